"""Gradients through dispatch -> per-expert linear -> combine on real gloo ranks.

- Against dense autograd in one process: hidden states, expert weights and router probs.
- Two backward passes over one graph (retain_graph=True), on ``reference`` (CPU) and ``hybrid``
  (GPU): both Functions' backward run twice on the Handle the graph owns.
- torch.autograd.gradcheck in float64 on 2 ranks. gradcheck perturbs one input element at
  a time, so every rank checks the same global function: inputs are all ranks' tensors
  (identical on every rank), each rank slices its own part (``_TakeLocal``, whose backward
  gathers every rank's gradient) and all ranks' outputs are gathered (``_GatherAll``, whose
  backward keeps the local slice). Every rank then makes the same calls in the same order.
"""

import dataclasses
import itertools
import weakref

import pytest
import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.backends.reference import ReferenceBackend
from ep_plugin.config import Config
from ep_plugin.handle import CombineOutput
from ep_plugin.testing import run_ranks
from ep_plugin.testing.dense import dense_moe, make_problem, run_local_experts
from ep_plugin.topology import Topology

HIDDEN = 6


def check_gradients_against_dense(ctx, form: str, topk: int) -> None:
    num_experts = 2 * ctx.world_size
    backend = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=num_experts, device="cpu")
    tokens = [5 + 2 * r for r in range(ctx.world_size)]
    tokens[-1] = 0  # a rank with no tokens still takes part in backward
    problem = make_problem(11, tokens, HIDDEN, num_experts, topk, dtype=torch.float64, probs_dtype=torch.float64)
    weights = torch.randn(num_experts, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grad_outputs = [torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64)
                    for r, t in enumerate(tokens)]
    rank, local = ctx.rank, backend.num_local_experts

    # Distributed: this rank's slice only.
    hidden = problem.hidden[rank].clone().requires_grad_()
    local_weights = weights[rank * local:(rank + 1) * local].clone().requires_grad_()
    if form == "routing_map":
        probs = problem.probs[rank].clone().requires_grad_()
        out = ep_plugin.dispatch(backend, hidden, routing_map=problem.routing_map[rank], probs=probs, pad_multiple=4)
    else:
        probs = problem.topk_weights[rank].clone().requires_grad_()
        out = ep_plugin.dispatch(backend, hidden, topk_idx=problem.topk_idx[rank], topk_weights=probs)
    expert_out = run_local_experts(out.hidden, out.probs, out.tokens_per_expert, rank * local,
                                   lambda e, x: x @ local_weights[e - rank * local])
    y = ep_plugin.combine(expert_out, out.handle)
    (y * grad_outputs[rank]).sum().backward()

    dense_out, dense_hidden, dense_weights, dense_probs = _dense_gradients(problem, weights, grad_outputs, form)

    torch.testing.assert_close(y, dense_out[rank].detach())
    torch.testing.assert_close(hidden.grad, _grad_or_zeros(dense_hidden[rank]))
    torch.testing.assert_close(local_weights.grad, dense_weights.grad[rank * local:(rank + 1) * local])
    torch.testing.assert_close(probs.grad, _grad_or_zeros(dense_probs[rank]))


def _dense_gradients(problem, weights: torch.Tensor, grad_outputs: list[torch.Tensor], form: str):
    """Every rank's tokens in one process in float64, loss summed over ranks.

    Returns (outputs, hidden leaves, weights leaf, probs leaves: [T, E] or [T, k] as ``form``), backward done.
    """
    num_experts = problem.num_experts
    dense_hidden = [h.detach().to(torch.float64, copy=True).requires_grad_() for h in problem.hidden]
    dense_weights = weights.detach().to(torch.float64, copy=True).requires_grad_()
    if form == "routing_map":
        dense_probs = [p.detach().to(torch.float64, copy=True).requires_grad_() for p in problem.probs]
        dense_probs_full = dense_probs
    else:  # scatter topk weights into [T, E] differentiably
        dense_probs = [w.detach().to(torch.float64, copy=True).requires_grad_() for w in problem.topk_weights]
        dense_probs_full = []
        for idx, w in zip(problem.topk_idx, dense_probs, strict=False):
            full = torch.zeros(idx.shape[0], num_experts, dtype=torch.float64)
            # scatter_add: a dropped slot (-1, weight 0) adds nothing to expert 0
            dense_probs_full.append(full.scatter_add(1, idx.clamp(min=0), w * (idx >= 0)))
    dense_out = dense_moe(problem, lambda e, x: x @ dense_weights[e], dense_hidden, dense_probs_full)
    sum((o * g.double()).sum() for o, g in zip(dense_out, grad_outputs, strict=False)).backward()
    return dense_out, dense_hidden, dense_weights, dense_probs


def _grad_or_zeros(leaf: torch.Tensor) -> torch.Tensor:
    # A rank with no tokens has empty gradients; the dense graph never touched its leaves.
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


@pytest.mark.parametrize("num_ranks,form,topk", [(2, "routing_map", 2), (2, "topk", 1), (4, "topk", 3),
                                                 (4, "routing_map", 4)])
def test_gradients_equal_dense_reference(num_ranks, form, topk):
    run_ranks(check_gradients_against_dense, num_ranks, form, topk, timeout_s=120)


def check_backward_twice_with_retain_graph(ctx, backend_name: str) -> None:
    """Two backward passes over one graph (retain_graph=True): equal gradients, both the dense ones.

    Each pass runs combine's backward (``dispatch_again``) and dispatch's backward (``combine``) on
    the Handle that only the graph holds: one that a backward released, or a layout it freed or
    recycled, breaks the second pass. ``reference`` in float64 (CPU); ``hybrid`` with bf16 payloads
    (GPU), against the float64 dense gradients within bf16 rounding.
    """
    backend = ep_plugin.get_backend(backend_name)(
        hidden_size=16, num_experts=2 * ctx.world_size, device=torch.device(ctx.device),
        config=Config.from_env(max_tokens_per_rank=64, timeout_s=60.0))
    for case, form in enumerate(("routing_map", "topk")):
        _backward_twice(ctx, backend, form, seed=40 + case, topk=2 + case)
    backend.destroy()


def _backward_twice(ctx, backend, form: str, seed: int, topk: int) -> None:
    device, exact = backend.device, backend.name == "reference"
    dtype, weight_dtype = (torch.float64, torch.float64) if exact else (torch.bfloat16, torch.float32)
    hidden_size, num_experts = backend.hidden_size, backend.num_experts
    rank, local = ctx.rank, backend.num_local_experts
    tokens = [6 + 3 * r for r in range(ctx.world_size)]
    problem = make_problem(seed, tokens, hidden_size, num_experts, topk, dtype=dtype, probs_dtype=weight_dtype,
                           drop_some=True)
    weights = torch.randn(num_experts, hidden_size, hidden_size, generator=torch.Generator().manual_seed(seed),
                          dtype=torch.float64)
    grad_outputs = [torch.randn(t, hidden_size, generator=torch.Generator().manual_seed(seed + 1 + r)).to(dtype)
                    for r, t in enumerate(tokens)]

    hidden = problem.hidden[rank].to(device, copy=True).requires_grad_()
    local_weights = weights[rank * local:(rank + 1) * local].to(device, weight_dtype).requires_grad_()
    if form == "routing_map":
        probs = problem.probs[rank].to(device, copy=True).requires_grad_()
        out = ep_plugin.dispatch(backend, hidden, routing_map=problem.routing_map[rank].to(device), probs=probs,
                                 pad_multiple=4)
    else:
        probs = problem.topk_weights[rank].to(device, copy=True).requires_grad_()
        out = ep_plugin.dispatch(backend, hidden, topk_idx=problem.topk_idx[rank].to(device), topk_weights=probs)
    expert_out = run_local_experts(out.hidden, out.probs, out.tokens_per_expert, rank * local,
                                   lambda e, x: (x.to(weight_dtype) @ local_weights[e - rank * local]).to(dtype))
    y = ep_plugin.combine(expert_out, out.handle)
    loss = (y.double() * grad_outputs[rank].to(device).double()).sum()
    handle = weakref.ref(out.handle)
    del out, expert_out, y  # from here only the graph holds the Handle
    # Ops of the backward are still to run with it (a caller that would replace the backend waits for them).
    assert handle().backward_pending, f"{backend.name} {form}: a recorded dispatch's handle is not pending"

    leaves = {"hidden": hidden, "probs": probs, "weights": local_weights}
    passes = []
    for _ in range(2):
        loss.backward(retain_graph=True)
        assert not handle().backward_pending, f"{backend.name} {form}: the handle is pending after the backward"
        passes.append({name: leaf.grad.cpu().double() for name, leaf in leaves.items()})
        for leaf in leaves.values():
            leaf.grad = None
    del loss

    _, dense_hidden, dense_weights, dense_probs = _dense_gradients(problem, weights, grad_outputs, form)
    expected = {"hidden": dense_hidden[rank].grad, "probs": dense_probs[rank].grad,
                "weights": dense_weights.grad[rank * local:(rank + 1) * local]}
    for name in leaves:
        label = f"{backend.name} {form}: {name} gradient"
        first, second = passes[0][name], passes[1][name]
        assert torch.equal(first, second), f"{label}: the second backward gave other values than the first"
        if exact:
            torch.testing.assert_close(first, expected[name], msg=lambda m, label=label: f"{label}: {m}")
        else:  # bf16 payloads: a few roundings of 2**-8 relative each
            scale = max(1.0, float(expected[name].abs().max()))
            torch.testing.assert_close(first, expected[name], rtol=3e-2, atol=3e-2 * scale,
                                       msg=lambda m, label=label: f"{label}: {m}")


def test_backward_twice_with_retain_graph():
    run_ranks(check_backward_twice_with_retain_graph, 2, "reference", timeout_s=120)


@pytest.mark.gpu
def test_backward_twice_with_retain_graph_hybrid():
    run_ranks(check_backward_twice_with_retain_graph, 2, "hybrid", device="cuda", timeout_s=300)


class _TakeLocal(torch.autograd.Function):
    """Forward: this rank's rows of a tensor every rank holds whole. Backward: all ranks' gradients."""

    @staticmethod
    def forward(ctx, full, splits):
        ctx.splits = splits
        rank = dist.get_rank()
        start = sum(splits[:rank])
        return full[start:start + splits[rank]].clone()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_uneven(grad, ctx.splits), None


class _GatherAll(torch.autograd.Function):
    """Forward: every rank's tensor, concatenated. Backward: the gradient is identical on every
    rank (gradcheck drives them alike), so each rank keeps its own slice without summing."""

    @staticmethod
    def forward(ctx, local, splits):
        ctx.splits = splits
        return _all_gather_uneven(local, splits)

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank()
        start = sum(ctx.splits[:rank])
        return grad[start:start + ctx.splits[rank]], None


def _all_gather_uneven(local: torch.Tensor, splits: list[int]) -> torch.Tensor:
    # gloo gathers equal sizes only: pad every rank's rows to the largest count.
    padded = local.new_zeros((max(splits),) + tuple(local.shape[1:]))
    padded[:local.shape[0]] = local
    pieces = [torch.empty_like(padded) for _ in splits]
    dist.all_gather(pieces, padded)
    return torch.cat([piece[:count] for piece, count in zip(pieces, splits, strict=False)])


def check_gradcheck(ctx) -> bool:
    num_experts, topk = 4, 2
    tokens = [3, 2]
    backend = ep_plugin.get_backend("reference")(hidden_size=2, num_experts=num_experts, device="cpu")
    problem = make_problem(3, tokens, 2, num_experts, topk, dtype=torch.float64, probs_dtype=torch.float64)
    local = backend.num_local_experts
    routing_map = problem.routing_map[ctx.rank]
    all_hidden = torch.cat(problem.hidden).requires_grad_()
    all_probs = torch.cat(problem.probs).requires_grad_()
    all_weights = torch.randn(num_experts, 2, 2, generator=torch.Generator().manual_seed(1),
                              dtype=torch.float64).requires_grad_()

    def moe(all_hidden, all_probs, all_weights):
        hidden = _TakeLocal.apply(all_hidden, tokens)
        probs = _TakeLocal.apply(all_probs, tokens)
        weights = _TakeLocal.apply(all_weights, [local] * ctx.world_size)
        out = ep_plugin.dispatch(backend, hidden, routing_map=routing_map, probs=probs, pad_multiple=2)
        expert_out = run_local_experts(out.hidden, out.probs, out.tokens_per_expert, 0, lambda e, x: x @ weights[e])
        return _GatherAll.apply(ep_plugin.combine(expert_out, out.handle), tokens)

    return torch.autograd.gradcheck(moe, (all_hidden, all_probs, all_weights), eps=1e-6, atol=1e-7)


def test_gradcheck_float64_two_ranks():
    assert run_ranks(check_gradcheck, 2, timeout_s=240) == [True, True]


def check_second_derivative_raises(ctx) -> None:
    """create_graph=True gives the right first-order gradient; differentiating it again through
    dispatch/combine raises (their backwards run outside autograd, so the second derivative would
    silently miss their terms: with ``inputs=`` torch's own once_differentiable error is skipped)."""
    backend = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=2 * ctx.world_size, device="cpu")
    problem = make_problem(21, [4, 3], HIDDEN, backend.num_experts, 2, dtype=torch.float64)
    hidden = problem.hidden[ctx.rank].clone().requires_grad_()
    chosen = problem.routing_map[ctx.rank].sum(dim=1, keepdim=True).double()

    # Through dispatch's backward: its incoming gradient 2 * rows needs grad.
    out = ep_plugin.dispatch(backend, hidden, routing_map=problem.routing_map[ctx.rank])
    y = ep_plugin.combine(out.hidden * out.hidden, out.handle) + hidden * hidden
    (grad_hidden,) = torch.autograd.grad(y.sum(), hidden, create_graph=True)
    torch.testing.assert_close(grad_hidden, 2 * hidden * (chosen + 1))
    with pytest.raises(RuntimeError, match="backward of dispatch is not differentiable"):
        torch.autograd.grad(grad_hidden.sum(), hidden)

    # Through combine's backward alone (rows are a leaf here): its incoming gradient 2 * y needs grad.
    rows = out.hidden.detach().clone().requires_grad_()
    y = ep_plugin.combine(rows, out.handle)
    (grad_rows,) = torch.autograd.grad((y * y).sum(), rows, create_graph=True)
    grad_rows.mul_(0.5)  # a gradient that create_graph hands back may be written in place, as a dense op's
    with pytest.raises(RuntimeError, match="backward of combine is not differentiable"):
        torch.autograd.grad(grad_rows.sum(), rows)


def test_second_derivative_through_dispatch_and_combine_raises():
    run_ranks(check_second_derivative_raises, 2, timeout_s=60)


def grad_on_rank_0_only(ctx) -> dict:
    """Autograd records an op on rank 0 only (its inputs need grad there, not elsewhere), so only rank 0
    would run that op's backward and the others would never meet it there. Every rank must get EPError
    naming ``grad`` at the forward, for dispatch and for combine, on the flat reference backend and on 2
    domains x 2 ranks (blocking and sync-free); then a step with grad everywhere must work."""
    torch.set_num_threads(1)
    config = Config.from_env(timeout_s=30.0)  # a hang reads as EPTimeoutError, not a stall
    build = dict(hidden_size=HIDDEN, num_experts=8, device="cpu")
    backends = {"flat": ep_plugin.get_backend("reference")(**build, config=config),
                **{f"2x2 {mode}": ep_plugin.get_backend("reference")(
                    **build, config=config.replace(blocking=mode == "blocking"), topology=Topology(4, 2, ctx.rank))
                   for mode in ("blocking", "sync-free")}}
    problem = make_problem(31, [5, 3, 0, 4], HIDDEN, 8, 2, dtype=torch.float64)
    routing = dict(topk_idx=problem.topk_idx[ctx.rank])
    times_routed = (problem.topk_idx[ctx.rank] >= 0).sum(1, keepdim=True).double()
    results = {}
    for name, backend in backends.items():
        hidden = problem.hidden[ctx.rank].clone().requires_grad_(ctx.rank == 0)
        for op in ("dispatch", "combine"):
            try:
                if op == "dispatch":
                    ep_plugin.dispatch(backend, hidden, **routing)
                else:
                    out = ep_plugin.dispatch(backend, hidden.detach(), **routing)
                    ep_plugin.combine(out.hidden.clone().requires_grad_(ctx.rank == 0), out.handle)
                results[name, op] = "no error"
            except ep_plugin.EPError as error:
                results[name, op] = f"{type(error).__name__}: {error}"
        hidden = problem.hidden[ctx.rank].clone().requires_grad_()
        out = ep_plugin.dispatch(backend, hidden, **routing)
        ep_plugin.combine(out.hidden, out.handle).sum().backward()
        results[name, "usable"] = torch.equal(hidden.grad, times_routed.expand_as(hidden))
    return results


def test_ranks_where_autograd_records_an_op_on_some_ranks_only_raise_at_the_forward():
    """Before: the ranks without grad went on; the others waited in the op's backward until the timeout
    (or met the next forward op as a mismatch)."""
    per_rank = run_ranks(grad_on_rank_0_only, 4, timeout_s=180)
    for rank, results in enumerate(per_rank):
        for (name, what), result in results.items():
            if what == "usable":
                assert result is True, (rank, name)
                continue
            assert result.startswith("EPError: "), (rank, name, what, result)
            # 2x2: a rank whose own rail saw equal fingerprints is told by its domain peer
            told = name != "flat" and "found that ranks disagree" in result
            assert "grad: True on rank" in result or "grad: False on rank" in result or told, \
                (rank, name, what, result)
    assert all("grad: " in per_rank[0][key] for key in per_rank[0] if key[1] != "usable"), per_rank[0]


def probs_grad_on_rank_0_only(ctx) -> dict:
    """Every rank's hidden needs grad, but the top-k weights only on rank 0: the dispatch's backward would
    route the weights' gradient back on rank 0 only, and the ranks met there in different ops (EPError
    naming a combine the user never called). Every rank must get EPError naming ``probs_grad`` at the
    forward (flat and 2 domains x 2 ranks); then a step with the weights' grad everywhere must work."""
    torch.set_num_threads(1)
    config = Config.from_env(timeout_s=30.0)
    build = dict(hidden_size=HIDDEN, num_experts=8, device="cpu")
    backends = {"flat": ep_plugin.get_backend("reference")(**build, config=config),
                "2x2": ep_plugin.get_backend("reference")(**build, config=config, topology=Topology(4, 2, ctx.rank))}
    problem = make_problem(37, [5, 3, 0, 4], HIDDEN, 8, 2, dtype=torch.float64)
    results = {}
    for name, backend in backends.items():
        for weights_need_grad, what in ((ctx.rank == 0, "mixed"), (True, "usable")):
            hidden = problem.hidden[ctx.rank].clone().requires_grad_()
            weights = problem.topk_weights[ctx.rank].clone().requires_grad_(weights_need_grad)
            try:
                out = ep_plugin.dispatch(backend, hidden, topk_idx=problem.topk_idx[ctx.rank], topk_weights=weights)
                ep_plugin.combine(out.hidden * out.probs.unsqueeze(1), out.handle).sum().backward()
                results[name, what] = weights.grad is not None and hidden.grad is not None
            except ep_plugin.EPError as error:
                results[name, what] = f"{type(error).__name__}: {error}"
    return results


def test_ranks_where_only_some_probs_need_grad_raise_at_the_forward():
    per_rank = run_ranks(probs_grad_on_rank_0_only, 4, timeout_s=180)
    for rank, results in enumerate(per_rank):
        for (name, what), result in results.items():
            if what == "usable":
                assert result is True, (rank, name, result)
                continue
            told = name != "flat" and "found that ranks disagree" in result  # through its domain peer
            assert result.startswith("EPError: ") and ("ranks disagree on dispatch" in result or told), \
                (rank, name, result)
            assert "probs_grad: " in result or told, (rank, name, result)


def grad_bit_follows_grad_mode(ctx) -> dict:
    """Autograd records an op only with grad mode on, whatever its inputs' requires_grad: under
    torch.no_grad nothing is recorded and no backward will run. Two cases on 2 ranks:

    - eval, every rank under torch.no_grad; rank 1 has no tokens and passes a dummy that requires grad
      (what a training loop gives an idle rank so that it takes part in backward): dispatch and combine
      must work;
    - rank 0 under torch.no_grad, rank 1 not, both with inputs that need grad (rank 0's hidden a view of
      a leaf, as a checkpointed forward sees it): rank 1 would run a backward rank 0 never enters, so
      both must get EPError naming grad at the forward.
    """
    torch.set_num_threads(1)
    backend = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=4, device="cpu",
                                                 config=Config.from_env(timeout_s=30.0))
    problem = make_problem(41, [5, 0], HIDDEN, 4, 2, dtype=torch.float64)
    routing = dict(topk_idx=problem.topk_idx[ctx.rank], topk_weights=problem.topk_weights[ctx.rank])
    results = {}

    with torch.no_grad():
        hidden = problem.hidden[ctx.rank].clone().requires_grad_(ctx.rank == 1)
        try:
            out = ep_plugin.dispatch(backend, hidden, **routing)
            y = ep_plugin.combine(out.hidden * out.probs.unsqueeze(1), out.handle)
            results["eval"] = torch.allclose(y, dense_moe(problem, lambda e, x: x)[ctx.rank])
        except ep_plugin.EPError as error:
            results["eval"] = f"EPError: {error}"

    leaf = problem.hidden[ctx.rank].clone().requires_grad_()
    try:
        with torch.set_grad_enabled(ctx.rank != 0):
            ep_plugin.dispatch(backend, leaf.view(-1, HIDDEN), **routing)
        results["mixed"] = "no error"
    except ep_plugin.EPError as error:
        results["mixed"] = f"EPError: {error}"
    return results


def test_grad_bit_is_off_under_no_grad_whatever_the_inputs_require():
    """Before: the bit was ``ctx.needs_input_grad``, which reads requires_grad also under torch.no_grad:
    an eval step with a grad-requiring dummy on an idle rank raised EPError, and a rank under no_grad
    with a view of a leaf was not told apart from a rank that records the op."""
    for rank, results in enumerate(run_ranks(grad_bit_follows_grad_mode, 2, timeout_s=120)):
        assert results["eval"] is True, (rank, results["eval"])
        assert results["mixed"].startswith("EPError: ") and "grad: " in results["mixed"], (rank, results["mixed"])


def grad_on_rank_0_only_in_a_cached_dispatch(ctx) -> list[str]:
    """A cached dispatch (``handle=``) through ``ep_plugin.dispatch`` on 4 flat ranks and on 2 domains x 2 ranks
    (blocking and sync-free), its input needing grad on rank 0 only: as a first dispatch, every rank gets EPError
    at the forward (elastic's and hybrid's cached dispatch carry the bit too)."""
    torch.set_num_threads(1)
    config = Config.from_env(timeout_s=30.0)
    problem = make_problem(43, [5, 3, 0, 4], HIDDEN, 8, 2, dtype=torch.float64)
    results = []
    for blocking, topology in itertools.product((True, False), (None, Topology(4, 2, ctx.rank))):
        backend = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=8, device="cpu",
                                                     config=config.replace(blocking=blocking), topology=topology)
        first = ep_plugin.dispatch(backend, problem.hidden[ctx.rank], topk_idx=problem.topk_idx[ctx.rank])
        again = problem.hidden[ctx.rank].clone().requires_grad_(ctx.rank == 0)
        try:
            ep_plugin.dispatch(backend, again, handle=first.handle)
            results.append("no error")
        except ep_plugin.EPError as error:
            results.append(f"EPError: {error}")
    return results


def test_a_cached_dispatch_carries_the_grad_bit():
    """Before: the hierarchical backend, and the flat reference once it took a cached dispatch, left grad out of
    a cached dispatch's fingerprint, so rank 0 went on to a backward (a combine) that the other ranks never run."""
    per_rank = run_ranks(grad_on_rank_0_only_in_a_cached_dispatch, 4, timeout_s=180)
    for rank, results in enumerate(per_rank):
        assert len(results) == 4, (rank, results)
        for result in results:
            assert result.startswith("EPError: ") and ("grad: " in result or "found that ranks disagree" in result), \
                (rank, result)


class _ReferenceWithBias(ReferenceBackend):
    """``reference`` plus elastic's combine option ``bias`` [T, H] (added to the sum), so that the autograd
    layer's handling of a tensor option runs on CPU ranks; test_elastic checks elastic's own on the GPU."""

    capabilities = dataclasses.replace(ReferenceBackend.capabilities, combine_options=("bias",))
    backward_ops = 0  # dispatch_again calls (combine's backward)

    def dispatch_again(self, hidden, handle):
        self.backward_ops += 1
        return super().dispatch_again(hidden, handle)

    def combine(self, rows, handle, *, row_probs=None, bias=None):
        out = super().combine(rows, handle, row_probs=row_probs)
        return out if bias is None else CombineOutput(out.hidden + bias, out.probs)


def combine_bias_gradients(ctx) -> dict:
    backend = _ReferenceWithBias(hidden_size=HIDDEN, num_experts=2 * ctx.world_size, device=torch.device("cpu"),
                                 config=Config.from_env(timeout_s=60.0))
    generator = torch.Generator().manual_seed(70 + ctx.rank)
    tokens = 5 + ctx.rank
    hidden = torch.randn(tokens, HIDDEN, generator=generator, dtype=torch.float64)
    topk_idx = torch.randint(0, backend.num_experts, (tokens, 1), generator=generator)
    upstream = torch.randn(tokens, HIDDEN, generator=generator, dtype=torch.float64)

    def step(rows_need_grad: bool, with_bias: bool):
        x = hidden.clone().requires_grad_(rows_need_grad)
        bias = torch.randn(tokens, HIDDEN, generator=generator, dtype=torch.float64).requires_grad_()
        out = ep_plugin.dispatch(backend, x, topk_idx=topk_idx)
        y = ep_plugin.combine(out.hidden * 2, out.handle, **({"bias": bias} if with_bias else {}))
        (y * upstream).sum().backward()
        return x.grad, bias.grad if with_bias else None

    plain_x_grad, _ = step(True, with_bias=False)
    x_grad, bias_grad = step(True, with_bias=True)
    ops_before = backend.backward_ops
    _, bias_grad_alone = step(False, with_bias=True)  # only the bias needs a gradient: no backward op runs
    backward_ops_for_bias_alone = backend.backward_ops - ops_before
    try:
        ep_plugin.combine(hidden, backend.dispatch(hidden, topk_idx=topk_idx).handle, row_probs=hidden[:, :1])
        row_probs = "accepted"
    except TypeError as error:
        row_probs = str(error)
    out = backend.dispatch(hidden, topk_idx=topk_idx)  # row_probs=None, as DeepEP-style code passes it: no refusal
    none_passed = torch.equal(ep_plugin.combine(out.hidden, out.handle, row_probs=None),
                              backend.combine(out.hidden, out.handle).hidden)
    backend.barrier()  # every rank made the same ops: a backward that ran an op on one rank only would hang here
    backend.destroy()
    return {"x_grad_unchanged": torch.equal(x_grad, plain_x_grad),
            "bias_grad_is_upstream": bias_grad is not None and torch.equal(bias_grad, upstream),
            "bias_grad_alone_is_upstream": bias_grad_alone is not None and torch.equal(bias_grad_alone, upstream),
            "backward_ops": (ops_before, backward_ops_for_bias_alone),
            "row_probs": row_probs, "row_probs_none_passed": none_passed}


def test_a_bias_given_to_combine_gets_its_gradient():
    """A tensor combine option (elastic's ``bias``) reaches autograd: its gradient is the output's, the rows'
    gradient is as without it, and a bias alone needing one runs no backward op. ``row_probs``, whose
    result ``ep_plugin.combine`` would drop, is refused; ``row_probs=None`` is not (it was)."""
    for result in run_ranks(combine_bias_gradients, 2, timeout_s=120):
        assert result["x_grad_unchanged"], result
        assert result["bias_grad_is_upstream"], result
        assert result["bias_grad_alone_is_upstream"], result
        assert result["backward_ops"] == (2, 0), result  # one for each step whose rows need a gradient
        assert "row_probs" in result["row_probs"] and "backend.combine" in result["row_probs"], result
        assert result["row_probs_none_passed"], result


def backward_ops_left_of_a_handle(ctx) -> list:
    """How many backward ops a handle still has, after each step of two layers: one whose tokens and probs
    need grad, and one whose dispatch records none while its experts' weights need grad (a frozen trunk and
    router, trainable experts): its combine's backward still runs on the handle."""
    backend = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=4, device="cpu")
    problem = make_problem(47, [5, 4], HIDDEN, 4, 2, dtype=torch.float64)
    weight = torch.ones(HIDDEN, dtype=torch.float64, requires_grad=True)
    seen = []
    for trunk_needs_grad in (True, False):
        hidden = problem.hidden[ctx.rank].clone().requires_grad_(trunk_needs_grad)
        probs = problem.topk_weights[ctx.rank].clone().requires_grad_(trunk_needs_grad)
        out = ep_plugin.dispatch(backend, hidden, topk_idx=problem.topk_idx[ctx.rank], topk_weights=probs)
        seen.append(out.handle.backward_ops_left)
        y = ep_plugin.combine(out.hidden * weight, out.handle)
        seen.append(out.handle.backward_ops_left)
        y.sum().backward()
        seen.append(out.handle.backward_ops_left)
    with torch.no_grad():  # an evaluation step records none
        out = ep_plugin.dispatch(backend, problem.hidden[ctx.rank], topk_idx=problem.topk_idx[ctx.rank])
        ep_plugin.combine(out.hidden * weight, out.handle)
        seen.append(out.handle.backward_ops_left)
    backend.destroy()
    return seen


def test_a_handle_counts_the_backward_ops_still_to_run_with_it():
    """What a caller that would replace the backend asks (the Megatron manager when it grows it): before, only
    the dispatch's own backward counted, so a combine-only backward ran on a destroyed backend."""
    for rank, seen in enumerate(run_ranks(backward_ops_left_of_a_handle, 2, timeout_s=120)):
        assert seen == [1, 2, 0, 0, 1, 0, 0], (rank, seen)


def fp8_dispatch_with_weights_that_need_grad(ctx) -> dict:
    backend = ep_plugin.get_backend("reference")(hidden_size=128, num_experts=4, device="cpu")
    data, scales = torch.zeros(3, 128).to(torch.float8_e4m3fn), torch.ones(3, 1)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2]])
    weights = torch.full((3, 2), 0.5, requires_grad=True)
    outcome = {}
    try:
        ep_plugin.dispatch(backend, (data, scales), topk_idx=idx, topk_weights=weights)
        outcome["recorded"] = "no error"
    except TypeError as error:
        outcome["recorded"] = str(error)
    # Its data needing grad (a differentiable cast from a tensor that does) counts too: its gradient was dropped.
    cast = torch.zeros(3, 128, requires_grad=True).to(torch.float8_e4m3fn)
    try:
        ep_plugin.dispatch(backend, (cast, scales), topk_idx=idx, topk_weights=weights.detach())
        outcome["data_recorded"] = "no error"
    except TypeError as error:
        outcome["data_recorded"] = str(error)
    outcome["cast_needs_grad"] = cast.requires_grad
    hidden = torch.ones(3, 128)  # the peers are still in step: a round trip goes on
    out = ep_plugin.dispatch(backend, hidden, topk_idx=idx, topk_weights=weights)
    outcome["after"] = torch.equal(ep_plugin.combine(out.hidden, out.handle), hidden * 2)
    return outcome


def test_an_fp8_dispatch_that_autograd_would_record_is_refused_before_it_runs():
    """FP8 dispatch has no backward: with weights that need grad, hybrid's and elastic's forward ran, and the
    backward would have run a combine on every rank and then failed in torch (a gradient for the (data, scales)
    input; read from the code, not run). Now refused first, on the rank that passed it (here every rank), before
    any backend check or communication; on CPU the reference stands in for the backend it never reaches. FP8 data
    that needs grad itself (a differentiable cast) is refused too: its gradient was dropped without a word."""
    for rank, outcome in enumerate(run_ranks(fp8_dispatch_with_weights_that_need_grad, 2, timeout_s=120)):
        assert "FP8 dispatch" in outcome["recorded"] and "no backward yet" in outcome["recorded"], (rank, outcome)
        assert outcome["cast_needs_grad"] and "no backward yet" in outcome["data_recorded"], (rank, outcome)
        assert outcome["after"] is True, (rank, outcome)
