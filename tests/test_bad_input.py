"""Bad input raises a clear error before any communication, and the backend stays usable.

Only rank 0 makes each bad call; the other ranks go straight on to the next valid call.
Had a bad call entered any collective, the ranks' collectives would pair up wrongly and
the valid calls would return wrong data or hang (the launcher's timeout reports that).

Top-k ids out of range or naming an expert twice are the exception: every rank calls, the
opening exchange carries the bad rank's verdict, and every rank raises ValueError. So are a backend's
construction arguments (building is a collective): test_agreement's one-rank refusals.
"""

import pytest
import torch

import ep_plugin
from ep_plugin.config import Config
from ep_plugin.testing import run_ranks
from ep_plugin.testing.dense import expected_dispatch, make_problem

HIDDEN, EXPERTS, TOPK = 8, 4, 2


def _bad_calls(backend, problem, rank):
    """(expected error type, text the message must contain, call) for each kind of bad input."""
    x, rmap, probs = problem.hidden[rank], problem.routing_map[rank], problem.probs[rank]
    idx, weights = problem.topk_idx[rank], problem.topk_weights[rank]

    def dispatch(hidden, **kw):
        return lambda: ep_plugin.dispatch(backend, hidden, **kw)

    return [
        (TypeError, "hidden must have dtype", dispatch(x.to(torch.int32), routing_map=rmap, probs=probs)),
        (TypeError, "probs must have dtype", dispatch(x, routing_map=rmap, probs=probs.to(torch.bfloat16))),
        (TypeError, "routing_map must have dtype", dispatch(x, routing_map=rmap.int(), probs=probs)),
        (TypeError, "topk_idx must have dtype", dispatch(x, topk_idx=idx.int(), topk_weights=weights)),
        (TypeError, "topk_idx must be a torch.Tensor", dispatch(x, topk_idx=idx.tolist(), topk_weights=weights)),
        (ValueError, "hidden must be a 2-D tensor", dispatch(x.unsqueeze(0), routing_map=rmap, probs=probs)),
        (ValueError, "hidden_size=8", dispatch(torch.zeros(len(x), HIDDEN + 1), routing_map=rmap, probs=probs)),
        (ValueError, "routing_map must have shape", dispatch(x, routing_map=rmap[:, :2].contiguous(),
                                                             probs=probs)),
        (ValueError, "contiguous", dispatch(torch.zeros(HIDDEN, len(x)).t(), routing_map=rmap, probs=probs)),
        (TypeError, "hidden must be a dense tensor", dispatch(x.to_sparse_csr(), routing_map=rmap, probs=probs)),
        (TypeError, "routing_map must be a dense tensor", dispatch(x, routing_map=rmap.to_sparse(), probs=probs)),
        (ValueError, "must be on cpu", dispatch(x.to("meta"), routing_map=rmap, probs=probs)),
        (ValueError, "probs must be on cpu", dispatch(x, routing_map=rmap, probs=probs.to("meta"))),
        (ValueError, "exactly one routing form", dispatch(x)),
        (ValueError, "topk_weights goes with topk_idx", dispatch(x, routing_map=rmap, topk_weights=weights)),
        (ValueError, "pad_multiple", dispatch(x, routing_map=rmap, probs=probs, pad_multiple=0)),
        (ValueError, r"pad_multiple must be an int in \[1, 65536\]",
         dispatch(x, routing_map=rmap, probs=probs, pad_multiple=2**31)),
        (ValueError, r"pad_multiple must be an int .*, got True", dispatch(x, routing_map=rmap, probs=probs,
                                                                           pad_multiple=True)),
    ]


def check_bad_inputs_leave_backend_usable(ctx, blocking: bool) -> int:
    config = Config.from_env(max_tokens_per_rank=64, blocking=blocking)
    backend = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=EXPERTS, config=config,
                                                 device="cpu")
    problem = make_problem(0, [6] * ctx.world_size, HIDDEN, EXPERTS, TOPK)
    rows, _, _ = expected_dispatch(problem, ctx.rank, 1)
    rejected = 0
    for error_type, text, call in _bad_calls(backend, problem, ctx.rank):
        if ctx.rank == 0:
            with pytest.raises(error_type, match=text):
                call()
            rejected += 1
        out = ep_plugin.dispatch(backend, problem.hidden[ctx.rank], routing_map=problem.routing_map[ctx.rank],
                                 probs=problem.probs[ctx.rank])
        assert torch.equal(out.hidden, rows), f"valid dispatch after bad call {text!r} returned wrong rows"
        restored = ep_plugin.combine(out.hidden, out.handle)
        assert torch.allclose(restored, problem.hidden[ctx.rank] * TOPK)
        if ctx.rank == 0:
            with pytest.raises(ValueError, match="rows has 3 rows"):
                ep_plugin.combine(out.hidden[:3], out.handle)
    return rejected


@pytest.mark.parametrize("blocking", [True, False])
def test_bad_input_rejected_before_communication(blocking):
    """blocking=False too: the reference has no sync-free mode, so it checks everything anyway. Top-k id
    values are the next test's (every rank calls there)."""
    rejected = run_ranks(check_bad_inputs_leave_backend_usable, 2, blocking, timeout_s=120)
    assert rejected[0] == 18 and rejected[1] == 0


def bad_ids_on_one_rank(ctx, blocking: bool) -> list[str]:
    """Rank 1 passes top-k ids out of range, then an expert twice, then more tokens than max_tokens_per_rank,
    then more tokens again while rank 2 passes an id out of range; every rank calls dispatch each time.
    Returns each refusal as (exception class name, message)."""
    config = Config.from_env(max_tokens_per_rank=64, blocking=blocking, timeout_s=20.0)
    backend = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=EXPERTS, config=config,
                                                 device="cpu")
    problem = make_problem(2, [6] * ctx.world_size, HIDDEN, EXPERTS, TOPK)
    x, idx, weights = problem.hidden[ctx.rank], problem.topk_idx[ctx.rank], problem.topk_weights[ctx.rank]
    rows, _, _ = expected_dispatch(problem, ctx.rank, 1)
    out_of_range, repeated = idx.clone(), idx.clone()
    out_of_range[0, 0] = EXPERTS
    repeated[0, 1] = repeated[0, 0]
    too_many = config.max_tokens_per_rank + 1  # valid ids, one token too many
    too_many_ids = torch.arange(TOPK).repeat(too_many, 1)
    too_many_call = (torch.zeros(too_many, HIDDEN), too_many_ids, torch.full((too_many, TOPK), 1 / TOPK))
    bad_calls = [{1: (x, out_of_range, weights)}, {1: (x, repeated, weights)}, {1: too_many_call},
                 {1: too_many_call, 2: (x, out_of_range, weights)}]  # two reasons at once: ValueError, not more room
    messages = []
    for bad in bad_calls:
        with pytest.raises(ValueError) as caught:
            bad_x, bad_idx, bad_weights = bad.get(ctx.rank, (x, idx, weights))
            ep_plugin.dispatch(backend, bad_x, topk_idx=bad_idx, topk_weights=bad_weights)
        messages.append((type(caught.value).__name__, str(caught.value)))
        out = ep_plugin.dispatch(backend, x, topk_idx=idx, topk_weights=weights)  # the backend goes on
        assert torch.equal(out.hidden, rows), "valid dispatch after refused ids returned wrong rows"
    return messages


@pytest.mark.parametrize("blocking", [True, False])
def test_bad_topk_ids_on_one_rank_raise_on_every_rank(blocking):
    """As the compiled backends do: not only the bad rank raises while the others time out."""
    every = run_ranks(bad_ids_on_one_rank, 4, blocking, timeout_s=120)
    # Only a refusal for token counts alone, on every rank, is TooManyTokensError (a caller may grow the
    # backend then: the Megatron integration does); the others stay plain ValueError, on every rank alike.
    for rank, refusals in enumerate(every):
        kinds = [kind for kind, _ in refusals]
        assert kinds == ["ValueError", "ValueError", "TooManyTokensError", "ValueError"], (rank, kinds)
    out_of_range, repeated, too_many, mixed = [message for _, message in every[1]]
    assert out_of_range.startswith("topk_idx holds expert id 4") and "(on rank 1)" in out_of_range, out_of_range
    assert repeated.startswith("topk_idx row 0 names the same expert twice"), repeated
    assert too_many.startswith("hidden has 65 tokens, over max_tokens_per_rank=64") and "(on rank 1)" in too_many
    assert mixed.startswith("hidden has 65 tokens") and "(on rank 1)" in mixed, mixed
    assert every[2][3][1].startswith("topk_idx holds expert id 4") and "(on rank 2)" in every[2][3][1], every[2]
    for rank in (0, 3):
        messages = [message for _, message in every[rank]]
        for message in messages[:2]:
            assert message.startswith("rank(s) [1] of the group passed topk_idx"), (rank, message)
        assert messages[2].startswith("rank(s) [1] of the group passed more tokens than max_tokens_per_rank=64")
        assert "[1]" in messages[3] and "[2]" in messages[3], (rank, messages[3])
    for rank, refusals in enumerate(every):
        for _, message in refusals:
            assert "the backend stays usable" in message, (rank, message)


def check_foreign_handle(ctx) -> None:
    first = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=EXPERTS, device="cpu")
    second = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=EXPERTS, device="cpu")
    problem = make_problem(1, [4] * ctx.world_size, HIDDEN, EXPERTS, TOPK)
    out = ep_plugin.dispatch(first, problem.hidden[ctx.rank], routing_map=problem.routing_map[ctx.rank],
                             probs=problem.probs[ctx.rank])
    with pytest.raises(ValueError, match="another backend instance"):
        second.combine(out.hidden, out.handle)
    with pytest.raises(TypeError, match="Handle"):
        ep_plugin.combine(out.hidden, "not a handle")
    ep_plugin.combine(out.hidden, out.handle)


def test_handle_of_another_backend_is_rejected():
    run_ranks(check_foreign_handle, 2, timeout_s=60)


def topk_ids_changed_after_dispatch(ctx, changing_rank) -> dict:
    """``changing_rank`` (every rank: None) rewrites its top-k ids in place after the dispatch: before a combine
    that routes values back, and between a forward and its backward. The reference (and the backend across
    domains over it) routes them back by the layout its dispatch built; what comes back is what untouched ids
    give."""
    backend = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=EXPERTS, device="cpu")
    problem = make_problem(0, [6] * ctx.world_size, HIDDEN, EXPERTS, TOPK)
    x, weights = problem.hidden[ctx.rank], problem.topk_weights[ctx.rank]
    changes = changing_rank in (None, ctx.rank)

    def change(ids: torch.Tensor) -> None:
        if changes:
            ids[0] = ids[0].flip(0)  # a reused buffer, say: same experts, other slots

    idx = problem.topk_idx[ctx.rank].clone()
    out = backend.dispatch(x, topk_idx=idx, topk_weights=weights)
    want = backend.combine(out.hidden, out.handle, row_probs=out.probs * 3)
    change(idx)
    got = backend.combine(out.hidden, out.handle, row_probs=out.probs * 3)
    outcome = {"combine": torch.equal(got.hidden, want.hidden) and torch.equal(got.probs, want.probs)}

    def gradients(changed: bool) -> tuple:
        ids = problem.topk_idx[ctx.rank].clone()
        tokens, gates = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = ep_plugin.dispatch(backend, tokens, topk_idx=ids, topk_weights=gates)
        combined = ep_plugin.combine(out.hidden * out.probs[:, None], out.handle)
        if changed:
            change(ids)
        (combined * torch.arange(1.0, HIDDEN + 1)).sum().backward()
        return tokens.grad, gates.grad

    clean, changed = gradients(False), gradients(True)
    outcome["backward"] = all(torch.equal(a, b) for a, b in zip(clean, changed, strict=True))
    return outcome


@pytest.mark.parametrize("scaleup_size", ["", "1"])  # "1": across two domains of one rank
@pytest.mark.parametrize("changing_rank", [None, 1])
def test_topk_ids_changed_in_place_after_the_dispatch_route_nothing_wrongly(changing_rank, scaleup_size):
    """Before, the handle kept the ids on every backend and a combine with row_probs refused them when changed,
    on that rank alone: inside a backward (the gradient of topk_weights) its peers then waited out the timeout.
    The reference and the backend across domains route the values back by their layout, never by the ids."""
    for rank, outcome in enumerate(run_ranks(topk_ids_changed_after_dispatch, 2, changing_rank, timeout_s=60,
                                             env={"EP_PLUGIN_SCALEUP_SIZE": scaleup_size,
                                                  "EP_PLUGIN_TIMEOUT_S": "10"})):
        assert outcome == {"combine": True, "backward": True}, (rank, outcome)


def compiled_topk_ids_changed(ctx, backend_name: str) -> dict:
    """Every rank changes its ids in place between a dispatch and a combine with row_probs on a compiled
    backend, whose combine gathers the values routed back by them: refused on every rank, before any launch."""
    from test_faults_gpu import make_backend, routed_tokens

    torch.cuda.set_device(ctx.device)
    backend = make_backend(ctx, backend_name)
    x, routing = routed_tokens(ctx, 811)
    idx = routing["topk_idx"].clone()
    out = backend.dispatch(x, topk_idx=idx, topk_weights=routing["topk_weights"])
    idx[0] = idx[0].flip(0)
    try:
        backend.combine(out.hidden, out.handle, row_probs=out.probs)
        refused = "ran"
    except ValueError as error:
        refused = str(error)
    # The backend goes on: rows alone need no ids, and fresh ids route back.
    back = backend.combine(out.hidden, out.handle).hidden
    again = backend.dispatch(x, topk_idx=idx, topk_weights=routing["topk_weights"])
    routed_back = backend.combine(again.hidden, again.handle, row_probs=again.probs).probs
    torch.cuda.synchronize()
    backend.destroy()
    return {"refused": refused, "rows": back.shape == x.shape, "routed_back": routed_back is not None}


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["hybrid", "elastic"])
def test_topk_ids_changed_in_place_before_a_compiled_combine_that_reads_them_are_refused(backend_name):
    """The compiled backends keep the caller's ids in their layout (DeepEP V2 copies them into its handle): a
    change in place since is refused, not misrouted."""
    for rank, outcome in enumerate(run_ranks(compiled_topk_ids_changed, 2, backend_name, device="cuda",
                                             timeout_s=120)):
        assert "topk_idx of this handle's dispatch was changed in place" in outcome["refused"], (rank, outcome)
        assert outcome["rows"] and outcome["routed_back"], (rank, outcome)


def deepeps_stream_options_on_a_compiled_backend(ctx, backend_name: str) -> list[str]:
    """DeepEP's stream options in a dispatch, a cached dispatch and a combine: each a TypeError (before any
    launch: the ranks stay in step, and the plain calls after them pair up)."""
    from test_faults_gpu import make_backend, routed_tokens

    torch.cuda.set_device(ctx.device)
    backend = make_backend(ctx, backend_name)
    x, routing = routed_tokens(ctx, 815)
    out = backend.dispatch(x, **routing)
    errors = []
    for call in (lambda: backend.dispatch(x, **routing, async_finish=True),
                 lambda: backend.dispatch(x, handle=out.handle, previous_event=None),
                 lambda: backend.combine(out.hidden, out.handle, async_with_compute_stream=True)):
        try:
            call()
            errors.append("no error")
        except TypeError as error:
            errors.append(str(error))
    backend.combine(out.hidden, out.handle)
    torch.cuda.synchronize()
    backend.destroy()
    return errors


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["hybrid", "elastic"])
def test_deepeps_stream_options_on_a_compiled_backend_say_what_to_do_instead(backend_name):
    """elastic's dispatch and combine named their keywords: DeepEP's stream options got Python's bare
    'unexpected keyword argument', not the words on streams that reference and hybrid give."""
    for rank, errors in enumerate(run_ranks(deepeps_stream_options_on_a_compiled_backend, 2, backend_name,
                                            device="cuda", timeout_s=120)):
        for op, error in zip(("dispatch", "cached dispatch", "combine"), errors, strict=True):
            assert f"no {op} option(s)" in error and "torch.cuda.stream(s)" in error, (rank, op, error)


def test_expert_alignment_is_deepeps_name_for_pad_multiple():
    from ep_plugin.backends.base import merge_alignment

    assert merge_alignment(None, None) is None
    assert merge_alignment(16, None) == 16 and merge_alignment(None, 128) == 128 and merge_alignment(8, 8) == 8
    with pytest.raises(ValueError, match="disagree"):
        merge_alignment(16, 128)
    # Refused under its own name (it was checked as pad_multiple, which the caller never passed).
    for bad in (0, True, 1.5, 1 << 17):
        with pytest.raises(ValueError, match=r"expert_alignment must be an int in \[1, 65536\], got"):
            merge_alignment(None, bad)


def test_a_compiled_backend_refuses_sizes_past_its_32_bit_row_indices():
    """2 ranks x 2^22 tokens x all 256 local experts (hybrid takes routing maps: a token may reach each) is past
    2^31 rows on one rank: an expert's segment start would wrap negative in the kernels and its padding be
    written far outside the output. CompiledBackend.__init__ refuses it first thing, naming the knob (on the GPU:
    test below); elastic, whose tokens reach at most 32 experts, is refused only from 2^25."""
    from ep_plugin.backends.compiled import INT32_MAX, row_index_problem
    from ep_plugin.config import MAX_PAD_MULTIPLE

    problem = row_index_problem("hybrid", 2, 1 << 22, 256, 256)
    assert "2164260608 rows" in problem and "EP_PLUGIN_MAX_TOKENS_PER_RANK" in problem, problem
    largest = (INT32_MAX - 256 * (MAX_PAD_MULTIPLE - 1)) // (2 * 256)  # the most tokens that still fit
    assert row_index_problem("hybrid", 2, largest, 256, 256) is None
    assert row_index_problem("hybrid", 2, largest + 1, 256, 256) is not None
    assert row_index_problem("elastic", 2, 1 << 22, 256, 32) is None
    assert "2164260608 rows (32 of its experts" in row_index_problem("elastic", 2, 1 << 25, 256, 32)
    # Realistic sizes stay far under: 32 ranks x 8192 tokens x 256 local experts is 84 million rows.
    assert row_index_problem("hybrid", 32, 8192, 256, 256) is None


def build_past_32_bit_rows(ctx) -> str:
    try:
        ep_plugin.get_backend("hybrid")(hidden_size=16, num_experts=512, config=Config(max_tokens_per_rank=1 << 22))
    except ValueError as error:
        return str(error)
    return "built"


@pytest.mark.gpu
def test_a_hybrid_backend_past_32_bit_rows_is_refused_when_built_on_the_gpu():
    for outcome in run_ranks(build_past_32_bit_rows, 2, device="cuda", timeout_s=180):
        assert "32-bit row indices" in outcome, outcome


def launches_past_the_buffer(ctx, name: str) -> list[str]:
    """The extension's launchers refuse blocks or tokens past what the buffer was built for (the Python layer
    never asks; this guards the extension's own API), before anything runs; the backend stays usable."""
    backend = ep_plugin.get_backend(name)(hidden_size=16, num_experts=4, config=Config(max_tokens_per_rank=64))
    kernels = getattr(backend._C, name)
    raw, regions, stream = backend.buffer.raw, backend.regions, backend._stream()
    hidden = torch.randn(3, 16, device=ctx.device).to(torch.bfloat16)
    topk_idx = torch.tensor([[0, 1], [2, 3], [1, 2]], device=ctx.device)

    def round_trip() -> torch.Tensor:
        out = backend.dispatch(hidden, topk_idx=topk_idx)
        return backend.combine(out.hidden, out.handle).hidden

    before = round_trip()
    refused = []
    # (elastic checks the top-k first: one in range, so that the check under test is the one that speaks)
    past_blocks = [("combine_send", kernels.combine_send,
                    kernels.CombineSendArgs(**({"topk": 1} if name == "elastic" else {})))]
    past_tokens = [("dispatch_send", kernels.dispatch_send, kernels.SendArgs(num_tokens=65)),
                   ("combine_recv", kernels.combine_recv, kernels.CombineRecvArgs(num_tokens=65))]
    for op, launch, args in past_blocks:
        with pytest.raises(ValueError, match=f"ep_plugin {name}: num_blocks {backend.num_blocks + 1} outside"):
            launch(raw, regions, args, backend.num_blocks + 1, stream)
        refused.append(f"{op} blocks")
    for op, launch, args in past_tokens:
        with pytest.raises(ValueError, match=f"ep_plugin {name}: num_tokens 65 outside \\[0, max_tokens=64\\]"):
            launch(raw, regions, args, backend.num_blocks, stream)
        refused.append(f"{op} tokens")
    # Rows the copies cannot move, or larger than a staging slot (2 x 16 bf16 = 32 bytes here).
    for row_bytes, scale_bytes, words in ((8, 0, "row_bytes 8 is not a positive multiple of 16"),
                                          (32, 2, "scale_bytes 2 is not a multiple of 4"),
                                          (48, 0, "a row of 48 \\+ 0 bytes is larger than this buffer's slot of 32")):
        with pytest.raises(ValueError, match=f"ep_plugin {name}: {words}"):
            kernels.dispatch_send(raw, regions, kernels.SendArgs(num_tokens=1, row_bytes=row_bytes,
                                                                 scale_bytes=scale_bytes), backend.num_blocks, stream)
        refused.append(f"dispatch_send rows of {row_bytes} + {scale_bytes}")
    # Pointers the kernel writes or reads whatever the rows, left out (a fault on the device, before).
    somewhere = torch.zeros(64, dtype=torch.int32, device=ctx.device)
    if name == "hybrid":
        missing = [(kernels.permute, kernels.PermuteArgs(row_bytes=32), "the permute needs num_packets")]
    else:
        missing = [(kernels.dispatch_receive, kernels.ReceiveArgs(topk=1, capacity=1, row_bytes=32, expand=True,
                                                                 out=somewhere, row_base=somewhere),
                    "the expanded form needs packet_rows")]
    for launch, args, words in missing:
        with pytest.raises(ValueError, match=f"ep_plugin {name}: {words}"):
            launch(raw, regions, args, backend.num_blocks, stream)
        refused.append(words)
    if name == "elastic":  # pushed scales land in rows of one float per 128 elements (none at hidden 16)
        in_place = ep_plugin.get_backend(name)(hidden_size=16, num_experts=4, config=Config(max_tokens_per_rank=64),
                                               in_place_dispatch=True)
        args = kernels.SendArgs(push_payload=True, topk=1, num_tokens=1, row_bytes=16, scale_bytes=4)
        with pytest.raises(ValueError, match="pushed scales of 4 bytes per row are more than this buffer's 0"):
            kernels.dispatch_send(in_place.buffer.raw, in_place.regions, args, in_place.num_blocks, stream)
        in_place.destroy()
        refused.append("pushed scales")
    assert torch.equal(round_trip(), before), "the backend changed after the refused launches"
    backend.destroy()
    return refused


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hybrid", "elastic"])
def test_the_extensions_launchers_refuse_more_than_the_buffer_holds(name):
    for refused in run_ranks(launches_past_the_buffer, 2, name, device="cuda", timeout_s=180):
        assert refused == ["combine_send blocks", "dispatch_send tokens", "combine_recv tokens",
                           "dispatch_send rows of 8 + 0", "dispatch_send rows of 32 + 2",
                           "dispatch_send rows of 48 + 0",
                           *(["the permute needs num_packets"] if name == "hybrid" else
                             ["the expanded form needs packet_rows", "pushed scales"])], refused


def build_without_a_gpu(ctx) -> list[str]:
    outcomes = []
    for name in ("hybrid", "elastic"):
        for device in (None, "cuda"):
            try:
                ep_plugin.get_backend(name)(hidden_size=HIDDEN, num_experts=EXPERTS, device=device)
                outcomes.append("built")
            except Exception as error:  # noqa: BLE001 - the test compares what came
                outcomes.append(f"{type(error).__name__}: {error}")
    return outcomes


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a CUDA GPU gets")
def test_a_compiled_backend_without_a_gpu_is_unavailable_not_an_assertion():
    """design.md's error table: BackendUnavailableError where the backend cannot run. Without a GPU it was a
    ValueError about the device, or with device="cuda" torch's bare 'Torch not compiled with CUDA enabled'
    (the topology's CUDA call came before any check of ours)."""
    for outcome in run_ranks(build_without_a_gpu, 2, timeout_s=120)[0]:
        assert outcome.startswith("BackendUnavailableError") and "needs a CUDA GPU; torch sees none" in outcome, \
            outcome
