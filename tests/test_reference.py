"""Reference backend on 2 and 4 gloo ranks against the single-process dense oracle.

Each launch runs many scenarios inside the rank processes (launches are the slow part on
a 2-core machine); a failing scenario raises with its name and the rank's traceback.
"""

import itertools

import pytest
import torch

import ep_plugin
from ep_plugin.testing import run_ranks
from ep_plugin.testing.dense import dense_moe, expected_dispatch, make_problem, run_local_experts

HIDDEN = 16


def _tokens_per_rank(num_ranks: int, case: int) -> list[int]:
    """Uneven token counts with a T=0 rank (rank 1) in half of the cases."""
    counts = [7 + 3 * r for r in range(num_ranks)]
    if case % 2:
        counts[1] = 0
    return counts


def _expert_weights(num_experts: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(num_experts, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(123)).to(dtype) / 4


def check_dispatch_combine_scenarios(ctx, num_experts: int) -> int:
    backend = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=num_experts, device="cpu")
    weights = _expert_weights(num_experts)
    first_expert = ctx.rank * backend.num_local_experts
    checked = 0
    for case, (topk, pad_multiple, skewed, form) in enumerate(
            itertools.product((1, 2, 8), (1, 16, 128), (False, True), ("routing_map", "topk"))):
        name = f"topk={topk} pad={pad_multiple} skewed={skewed} form={form}"
        problem = make_problem(case, _tokens_per_rank(ctx.world_size, case), HIDDEN, num_experts, topk,
                               skewed=skewed, integer_valued=True, drop_some=(case % 3 == 0))
        rank = ctx.rank
        if form == "routing_map":
            routing = dict(routing_map=problem.routing_map[rank], probs=problem.probs[rank])
        else:
            routing = dict(topk_idx=problem.topk_idx[rank], topk_weights=problem.topk_weights[rank])
        out = ep_plugin.dispatch(backend, problem.hidden[rank], pad_multiple=pad_multiple, **routing)

        rows, row_probs, tokens_per_expert = expected_dispatch(problem, rank, pad_multiple)
        assert torch.equal(out.tokens_per_expert, tokens_per_expert), f"{name}: tokens_per_expert"
        assert out.tokens_per_expert_list == tokens_per_expert.tolist(), f"{name}: host tokens_per_expert"
        assert torch.equal(out.hidden, rows), f"{name}: dispatched rows"
        assert torch.equal(out.probs, row_probs), f"{name}: dispatched probs"

        # Identity experts: each token comes back times the number of experts it chose (exact on integers).
        restored = ep_plugin.combine(out.hidden, out.handle)
        chosen = problem.routing_map[rank].sum(dim=1, keepdim=True).to(restored.dtype)
        assert torch.equal(restored, problem.hidden[rank] * chosen), f"{name}: combine(dispatch(x))"

        # A real MoE step: per-expert linear layers, weighted by the router probs.
        def expert_fn(expert, x):
            return x @ weights[expert]

        expert_out = run_local_experts(out.hidden, out.probs, out.tokens_per_expert, first_expert, expert_fn)
        moe_out = ep_plugin.combine(expert_out, out.handle)
        dense = dense_moe(problem, expert_fn)[rank]
        torch.testing.assert_close(moe_out, dense, rtol=1e-5, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
        checked += 1
    return checked


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_dispatch_and_combine_match_dense_oracle(num_ranks):
    num_experts = 16  # top-8 needs at least 8 experts; 16 splits over 2 and 4 ranks
    checked = run_ranks(check_dispatch_combine_scenarios, num_ranks, num_experts, timeout_s=240)
    assert checked == [36] * num_ranks


def check_bf16_and_empty_world(ctx) -> None:
    """bf16 payloads; a step where no rank has any token."""
    backend = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=8, device="cpu")
    problem = make_problem(7, [5] * ctx.world_size, HIDDEN, 8, 2, dtype=torch.bfloat16, integer_valued=True)
    out = ep_plugin.dispatch(backend, problem.hidden[ctx.rank], routing_map=problem.routing_map[ctx.rank],
                             probs=problem.probs[ctx.rank])
    rows, _, _ = expected_dispatch(problem, ctx.rank, 1)
    assert out.hidden.dtype == torch.bfloat16 and torch.equal(out.hidden, rows)
    assert out.use_on() is out  # CPU outputs: nothing to hand over (it asserted CUDA on a CPU build of torch)
    assert torch.equal(ep_plugin.combine(out.hidden, out.handle), problem.hidden[ctx.rank] * 2)

    empty = make_problem(8, [0] * ctx.world_size, HIDDEN, 8, 2)
    out = ep_plugin.dispatch(backend, empty.hidden[ctx.rank], routing_map=empty.routing_map[ctx.rank],
                             probs=empty.probs[ctx.rank], pad_multiple=16)
    assert out.hidden.shape == (0, HIDDEN) and out.tokens_per_expert.tolist() == [0] * backend.num_local_experts
    assert ep_plugin.combine(out.hidden, out.handle).shape == (0, HIDDEN)


def test_bf16_and_no_tokens_anywhere():
    run_ranks(check_bf16_and_empty_world, 2, timeout_s=120)


def check_bf16_combine_rounds_once_from_fp32(ctx) -> None:
    """Combine of bf16 rows must sum in fp32 and round once: the oracle of every backend's combine.

    Each expert scales each column by 1 or 256, so a token's expert rows mix small and large
    integers. Every term is exact in bf16 and every sum exact in fp32, but many sums are not
    representable in bf16, and a running bf16 sum depends on the order of its terms.
    """
    num_experts, topk = 16, 8
    device = torch.device(ctx.device)
    backend = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=num_experts, device=device)
    problem = make_problem(21, [12 + r for r in range(ctx.world_size)], HIDDEN, num_experts, topk,
                           dtype=torch.bfloat16, integer_valued=True)
    big = torch.rand(num_experts, HIDDEN, generator=torch.Generator().manual_seed(22)) < 0.3
    scale = torch.where(big, 256.0, 1.0).to(torch.bfloat16)
    rank, first_expert = ctx.rank, ctx.rank * backend.num_local_experts

    out = ep_plugin.dispatch(backend, problem.hidden[rank].to(device), routing_map=problem.routing_map[rank].to(device))
    segments = torch.split(out.hidden, out.tokens_per_expert.tolist())
    rows = torch.cat([segment * scale[first_expert + i].to(device) for i, segment in enumerate(segments)])
    combined = ep_plugin.combine(rows, out.handle).cpu()

    chosen = [routing_map.to(torch.float64) for routing_map in problem.routing_map]
    exact = dense_moe(problem, lambda e, x: x * scale[e].double(), [h.double() for h in problem.hidden], chosen)
    expected = exact[rank].to(torch.bfloat16)  # the fp64 sum is exact here, so it equals the fp32 sum
    # The check means something only if a running bf16 sum (here in expert order) gives other
    # values than rounding the exact sum once.
    running_bf16 = dense_moe(problem, lambda e, x: x * scale[e],
                             probs=[c.to(torch.bfloat16) for c in chosen])[rank]
    assert not torch.equal(running_bf16, expected), "test data do not separate bf16 from fp32 accumulation"
    assert combined.dtype == torch.bfloat16
    assert torch.equal(combined, expected), (
        f"combine differs from the fp32 sum rounded once in {int((combined != expected).sum())} elements")


def bf16_combine_with_its_sums_watched(ctx) -> list:
    """The check above, with the dtypes of the backend's own index_add_ calls recorded: torch's CPU index_add_
    of bf16 sums a whole call in fp32, so the values alone would pass with a bf16 accumulator."""
    import sys

    seen, original = [], torch.Tensor.index_add_

    def watched(self, dim, index, source, *args, **kwargs):
        if sys._getframe(1).f_code.co_filename.endswith("reference.py"):
            seen.append((str(self.dtype), str(source.dtype)))
        return original(self, dim, index, source, *args, **kwargs)

    torch.Tensor.index_add_ = watched
    try:
        check_bf16_combine_rounds_once_from_fp32(ctx)
    finally:
        torch.Tensor.index_add_ = original
    return seen


def test_bf16_combine_rounds_the_exact_sum_once_on_cpu():
    """The combined values on CPU, and the dtype the combine sums them in (the CUDA twin below tells that by the
    values alone)."""
    for seen in run_ranks(bf16_combine_with_its_sums_watched, 2, timeout_s=120):
        assert seen and set(seen) == {("torch.float32", "torch.float32")}, seen


@pytest.mark.gpu(extension=False)
def test_bf16_combine_accumulates_in_fp32_on_cuda():
    # On the GPU a bf16 index_add_ rounds at every (atomic) add; on the CPU torch's kernel hides that.
    run_ranks(check_bf16_combine_rounds_once_from_fp32, 2, device="cuda", timeout_s=180)


def _silent_rank_then_check_usable(ctx) -> tuple:
    """Rank 0 never dispatches; rank 1's dispatch times out, after which check_usable() must raise at once."""
    import time

    backend = ep_plugin.get_backend("reference")(hidden_size=4, num_experts=4, device="cpu",
                                                 config=ep_plugin.Config.from_env(timeout_s=2.0))
    store = torch.distributed.distributed_c10d._get_default_store()
    if ctx.rank == 0:
        store.wait(["gave_up"])  # alive and silent until rank 1 gave up
        return ()
    with pytest.raises(ep_plugin.EPTimeoutError):
        backend.dispatch(torch.ones(2, 4), topk_idx=torch.tensor([[0, 1], [2, 3]]))
    start = time.monotonic()
    try:
        backend.check_usable()
        outcome = "no error"
    except ep_plugin.EPError as error:
        outcome = str(error)
    store.set("gave_up", "1")
    return outcome, time.monotonic() - start


def test_check_usable_refuses_after_a_timed_out_op():
    outcome, seconds = run_ranks(_silent_rank_then_check_usable, 2, timeout_s=120)[1]
    assert "cannot run more ops after an earlier failure" in outcome and seconds < 1.0, (outcome, seconds)


def fail_midway_then_retry(ctx, backend, stage: str, failure: str, key: str) -> dict:
    """Both ranks dispatch once in step; then rank 1's dispatch fails in ``stage`` (a method of the backend,
    run after the opening agreement) with MemoryError(``failure``), and rank 1 dispatches again. Each rank's
    outcome of that second dispatch (rank 1's: of its retry, with the seconds it took). ``key``: this case's
    name in the store, where rank 1 waits until rank 0 is done (a peer that exited would end rank 0's wait)."""
    import time

    store = torch.distributed.distributed_c10d._get_default_store()
    x, idx = torch.ones(2, 4), torch.tensor([[0, 2], [1, 3]])
    backend.dispatch(x, topk_idx=idx)

    def outcome_of_a_dispatch() -> str:
        try:
            backend.dispatch(x, topk_idx=idx)
            return "no error"
        except ep_plugin.EPError as error:
            return f"{type(error).__name__}: {error}"

    if ctx.rank == 0:
        outcome = outcome_of_a_dispatch()
        store.set(key, "1")
        return {"outcome": outcome}

    def fail(*_args, **_kwargs):
        raise MemoryError(failure)

    setattr(backend, stage, fail)  # what a rank-local failure between two exchanges looks like
    with pytest.raises(MemoryError):
        backend.dispatch(x, topk_idx=idx)
    delattr(backend, stage)
    start = time.monotonic()
    outcome = outcome_of_a_dispatch()
    seconds = time.monotonic() - start
    store.wait([key])
    return {"outcome": outcome, "seconds": seconds}


def _failure_between_two_collectives(ctx) -> dict:
    """Before, rank 1's retry's opening words met rank 0's rows exchange: rank 0 read them as rows, or gloo
    aborted rank 0 on the sizes. Now rank 1 refuses the retry, naming the op it left, and rank 0 times out in
    that op."""
    backend = ep_plugin.get_backend("reference")(hidden_size=4, num_experts=4, device="cpu",
                                                 config=ep_plugin.Config.from_env(timeout_s=3.0))
    return fail_midway_then_retry(ctx, backend, "_send_rows", "the rows' allocation failed", "flat")


def test_a_rank_that_failed_between_two_collectives_refuses_and_its_peer_times_out():
    rank0, rank1 = run_ranks(_failure_between_two_collectives, 2, timeout_s=120)
    assert rank1["outcome"].startswith("EPError: ") and rank1["seconds"] < 1.0, rank1
    assert "dispatch #2 was left midway on this rank by MemoryError: the rows' allocation failed" in \
        rank1["outcome"], rank1
    assert rank0["outcome"].startswith("EPTimeoutError: ") and "dispatch #2 (rows)" in rank0["outcome"], rank0


def _late_payload_then_next_op_over_a_twin(ctx):
    """The words on a gloo twin, as over NCCL (``use_gloo_twin``, forced here on a gloo group); rank 1 is late
    in dispatch #1 after the opening exchange, so rank 0's payload exchange (_comm) times out. Rank 0's next
    op must refuse at once: the twin's own check does not see a failure of the payload group."""
    import time

    from ep_plugin.host_collectives import HostCollectives

    timeout_s = 2.0
    backend = ep_plugin.get_backend("reference")(hidden_size=4, num_experts=4, device="cpu",
                                                 config=ep_plugin.Config.from_env(timeout_s=timeout_s))
    words = HostCollectives(backend.group, owner="ep_plugin reference", timeout_s=timeout_s, label="reference words")
    words.use_gloo_twin()  # what ReferenceBackend.__init__ makes when the group is NCCL
    words.site = backend._comm.site
    backend._words = words
    store = torch.distributed.distributed_c10d._get_default_store()
    hidden, idx = torch.ones(2, 4), torch.tensor([[0, 1], [2, 3]])
    if ctx.rank == 1:
        make_layout = backend._make_layout

        def late(*args, **kwargs):  # past the opening exchange, before the payload
            store.wait(["rank 0 is done"])
            return make_layout(*args, **kwargs)

        backend._make_layout = late
        with pytest.raises(ep_plugin.EPError):
            backend.dispatch(hidden, topk_idx=idx)
        return ()
    with pytest.raises(ep_plugin.EPTimeoutError):
        backend.dispatch(hidden, topk_idx=idx)
    start = time.monotonic()
    try:
        backend.barrier()
        outcome = "no error"
    except ep_plugin.EPError as error:
        outcome = f"{type(error).__name__}: {error}"
    store.set("rank 0 is done", "1")
    return outcome, time.monotonic() - start


def test_an_op_after_a_timeout_refuses_at_once_when_the_words_travel_on_a_twin():
    """Over NCCL the reference's opening words go on the group's gloo twin. After a payload exchange timed out,
    the next op ran its opening exchange on the twin, waited out another timeout and blamed the peer."""
    outcome, seconds = run_ranks(_late_payload_then_next_op_over_a_twin, 2, timeout_s=120)[0]
    assert "cannot run more ops after an earlier failure" in outcome and seconds < 1.0, (outcome, seconds)


def _ops_after_destroy(ctx) -> dict:
    """Every op of a destroyed backend, flat and across 2 domains: which error each raised."""
    import functools

    from ep_plugin.topology import Topology

    build = dict(hidden_size=4, num_experts=4, device="cpu")
    backends = {"flat": ep_plugin.get_backend("reference")(**build),
                "2x2": ep_plugin.get_backend("reference")(**build, topology=Topology(4, 2, ctx.rank))}
    hidden, idx = torch.ones(2, 4), torch.tensor([[0, 1], [2, 3]])
    outcomes = {}
    for name, backend in backends.items():
        out = backend.dispatch(hidden, topk_idx=idx)
        backend.destroy()
        backend.destroy()  # a second destroy is harmless
        for op, call in (("dispatch", functools.partial(backend.dispatch, hidden, topk_idx=idx)),
                         ("combine", functools.partial(backend.combine, out.hidden, out.handle)),
                         ("dispatch_again", functools.partial(backend.dispatch_again, hidden, out.handle)),
                         ("barrier", backend.barrier)):
            try:
                call()
                outcomes[name, op] = "no error"
            except RuntimeError as error:
                outcomes[name, op] = f"{type(error).__name__}: {error}"
    return outcomes


def test_a_destroyed_backend_refuses_every_op():
    """destroy() promised an unusable backend, but the reference (whose destroy had nothing to release) went on
    working, so code that used a backend after destroying it passed on CPU and failed on the GPU."""
    for outcomes in run_ranks(_ops_after_destroy, 4, timeout_s=120):
        for (name, op), outcome in outcomes.items():
            assert outcome.startswith("RuntimeError: ") and f"{op} on a backend that was destroyed" in outcome, \
                (name, op, outcome)


def _deepeps_stream_options(ctx) -> list[str]:
    backend = ep_plugin.get_backend("reference")(hidden_size=4, num_experts=4, device="cpu")
    hidden, idx = torch.ones(2, 4), torch.tensor([[0, 1], [2, 3]])
    errors = []
    for call in (lambda: backend.dispatch(hidden, topk_idx=idx, async_finish=True),
                 lambda: backend.dispatch(hidden, topk_idx=idx, previous_event=None, allocate_on_comm_stream=True),
                 lambda: backend.dispatch(hidden, topk_idx=idx, expnad=True)):
        try:
            call()
            errors.append("no error")
        except TypeError as error:
            errors.append(str(error))
    out = backend.dispatch(hidden, topk_idx=idx)  # nothing ran: the ranks are in step
    backend.combine(out.hidden, out.handle)
    backend.destroy()
    return errors


def test_deepeps_stream_options_are_refused_with_what_to_do_instead():
    """DeepEP code passes async_finish / previous_event / allocate_on_comm_stream; they were refused as unknown
    options with no word on streams. A typo stays a plain unknown option."""
    for stream, both, typo in run_ranks(_deepeps_stream_options, 2, timeout_s=120):
        assert "no dispatch option(s) ['async_finish']" in stream and "torch.cuda.stream(s)" in stream, stream
        assert "out.use_on(stream)" in stream and "current stream" in both, both
        assert "['expnad']" in typo and "stream" not in typo, typo
