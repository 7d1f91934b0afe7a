"""``hybrid`` backend against ``reference`` on 2, 4 and 8 ranks (one GPU per rank where there are enough
GPUs, else ranks sharing GPUs under MPS, NVLink and same-GPU peers mixed).

Each launch runs many scenarios inside the rank processes (starting ranks is the slow part); both
backends run in the same processes on the same inputs, and dispatch payloads, probs,
tokens_per_expert and row order must be bitwise equal. Combine may differ from the reference by the
documented bf16 rounding of per-rank partial sums (see ``ep_plugin/backends/hybrid.py``).
All tests need a GPU and the compiled extension; without them they skip (fail under --require-gpu).
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

import ep_plugin
from ep_plugin.config import Config
from ep_plugin.testing import run_ranks

pytestmark = pytest.mark.gpu

NUM_EXPERTS = 32
MAX_TOKENS = 128
LAUNCH_TIMEOUT_S = 420


# ---- problem generation (identical on every rank for a given seed) -------------------------

def make_inputs(seed: int, rank: int, world: int, num_tokens: int, hidden: int, num_experts: int, topk: int, *,
                skewed: bool, drop_some: bool):
    """(hidden [T, H] bf16, topk_idx [T, k], topk_weights [T, k], routing_map [T, E], probs [T, E]) on the GPU.

    skewed: experts of rank 0 preferred, and no token of any rank picks an expert of the last rank
    (that rank receives nothing).
    """
    generator = torch.Generator().manual_seed(seed * 1009 + rank)
    local = num_experts // world
    hidden_states = torch.randn(num_tokens, hidden, generator=generator).to(torch.bfloat16)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    if skewed:
        scores[:, :local] += 1.0
        scores[:, num_experts - local:] = -1.0
    values, topk_idx = scores.topk(topk, dim=1)
    topk_weights = torch.softmax(values, dim=1)
    if drop_some and num_tokens:
        drop = torch.rand(num_tokens, topk, generator=generator) < 0.2
        topk_idx = topk_idx.masked_fill(drop, -1)
        topk_weights = topk_weights.masked_fill(drop, 0.0)
    routing_map = torch.zeros(num_tokens, num_experts + 1, dtype=torch.bool)
    routing_map.scatter_(1, torch.where(topk_idx < 0, num_experts, topk_idx), True)
    routing_map = routing_map[:, :num_experts].contiguous()
    probs = torch.rand(num_tokens, num_experts, generator=generator)
    cuda = [t.cuda() for t in (hidden_states, topk_idx, topk_weights.float(), routing_map, probs)]
    return tuple(cuda)


def routing_kwargs(form: str, inputs, with_probs: bool = True) -> dict:
    _, topk_idx, topk_weights, routing_map, probs = inputs
    if form == "routing_map":
        return dict(routing_map=routing_map, probs=probs if with_probs else None)
    return dict(topk_idx=topk_idx, topk_weights=topk_weights if with_probs else None)


def make_backends(ctx, hidden: int, num_experts: int = NUM_EXPERTS, **config):
    config = Config.from_env(**{"max_tokens_per_rank": MAX_TOKENS, "timeout_s": 20.0, "num_sms": 8, **config})
    reference = ep_plugin.get_backend("reference")(hidden_size=hidden, num_experts=num_experts, device=ctx.device,
                                                   config=config)
    hybrid = ep_plugin.get_backend("hybrid")(hidden_size=hidden, num_experts=num_experts, device=ctx.device,
                                             config=config)
    return reference, hybrid


def tokens_of(rank: int, case: int) -> int:
    if case % 2 and rank == 1:
        return 0
    return 20 + 13 * rank + (case % 5)


def assert_combine_close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    # Partial sums are rounded to bf16 per expert rank: allow a few bf16 ulps of the magnitude.
    tolerance = 2 ** -6 * expected.float().abs().clamp_min(1.0)
    error = (actual.float() - expected.float()).abs()
    assert bool((error <= tolerance).all()), f"{name}: combine differs by {float(error.max())}"


# ---- scenario sweep ------------------------------------------------------------------------

def sweep(ctx, hidden: int) -> int:
    reference, hybrid = make_backends(ctx, hidden)
    checked = 0
    for case, (topk, pad, skewed, form) in enumerate(
            itertools.product((1, 2, 8), (1, 16, 128), (False, True), ("routing_map", "topk"))):
        name = f"H={hidden} R={ctx.world_size} topk={topk} pad={pad} skewed={skewed} form={form}"
        inputs = make_inputs(case, ctx.rank, ctx.world_size, tokens_of(ctx.rank, case), hidden, NUM_EXPERTS, topk,
                             skewed=skewed, drop_some=case % 3 == 0)
        kwargs = routing_kwargs(form, inputs)
        ref = reference.dispatch(inputs[0], pad_multiple=pad, **kwargs)
        out = hybrid.dispatch(inputs[0], pad_multiple=pad, **kwargs)
        assert torch.equal(out.tokens_per_expert, ref.tokens_per_expert), f"{name}: tokens_per_expert"
        # Blocking mode's host copy (what Megatron's experts get), read with the row count.
        assert out.tokens_per_expert_list == ref.tokens_per_expert.tolist(), f"{name}: host tokens_per_expert"
        assert out.hidden.shape == ref.hidden.shape, f"{name}: rows {out.hidden.shape} vs {ref.hidden.shape}"
        assert torch.equal(out.hidden, ref.hidden), f"{name}: dispatched rows"
        assert torch.equal(out.probs, ref.probs), f"{name}: dispatched probs"
        if skewed and ctx.rank == ctx.world_size - 1:
            assert out.hidden.shape[0] == 0, f"{name}: the last rank should receive nothing"

        # Combine of a per-row transform, with per-row scalars going back unsummed.
        rows = (ref.hidden.float() * 0.5 + 1).to(torch.bfloat16)
        row_probs = ref.probs * 3 + 1
        ref_back = reference.combine(rows, ref.handle, row_probs=row_probs)
        back = hybrid.combine(rows, out.handle, row_probs=row_probs)
        assert_combine_close(back.hidden, ref_back.hidden, name)
        if topk == 1:  # one row per token: no partial sums, so exact
            assert torch.equal(back.hidden, ref_back.hidden), f"{name}: top-1 combine must be exact"
        assert torch.equal(back.probs, ref_back.probs), f"{name}: combined probs"

        # Backward of combine: dispatch new [T, H] along the cached layout.
        grad = torch.randn(inputs[0].shape, device=ctx.device).to(torch.bfloat16)
        assert torch.equal(hybrid.dispatch_again(grad, out.handle), reference.dispatch_again(grad, ref.handle)), \
            f"{name}: dispatch_again"
        checked += 1
    torch.cuda.synchronize()
    hybrid.destroy()
    return checked


def fp8_and_no_probs(ctx, hidden: int) -> int:
    """FP8 payload (dequantized = reference of the dequantized input) and dispatch without probs."""
    reference, hybrid = make_backends(ctx, hidden)
    checked = 0
    for case, (topk, pad, form) in enumerate(itertools.product((1, 8), (1, 128), ("routing_map", "topk"))):
        name = f"fp8 H={hidden} topk={topk} pad={pad} form={form}"
        inputs = make_inputs(100 + case, ctx.rank, ctx.world_size, tokens_of(ctx.rank, case), hidden, NUM_EXPERTS,
                             topk, skewed=case % 2 == 1, drop_some=False)
        x = inputs[0].float()
        blocks = x.view(x.shape[0], hidden // 128, 128)
        scales = (blocks.abs().amax(dim=2) / 448.0).clamp_min(1e-8)
        data = (blocks / scales.unsqueeze(2)).to(torch.float8_e4m3fn).view(x.shape[0], hidden)
        dequantized = (data.float().view_as(blocks) * scales.unsqueeze(2)).view_as(x)
        ref_reference = ep_plugin.get_backend("reference")(hidden_size=hidden, num_experts=NUM_EXPERTS,
                                                           device=ctx.device, config=reference.config)
        ref = ref_reference.dispatch(dequantized, pad_multiple=pad, **routing_kwargs(form, inputs))
        out = hybrid.dispatch((data, scales.contiguous()), pad_multiple=pad, **routing_kwargs(form, inputs))
        rows, row_scales = out.hidden
        assert rows.dtype == torch.float8_e4m3fn and row_scales.shape == (rows.shape[0], hidden // 128), name
        got = rows.float().view(rows.shape[0], hidden // 128, 128) * row_scales.unsqueeze(2)
        got = got.view(rows.shape[0], hidden)
        assert torch.equal(got, ref.hidden), f"{name}: dequantized rows"
        assert torch.equal(out.probs, ref.probs), f"{name}: probs"
        assert torch.equal(out.tokens_per_expert, ref.tokens_per_expert), f"{name}: tokens_per_expert"
        # The same layout without probs, in bf16.
        plain = hybrid.dispatch(inputs[0], pad_multiple=pad, **routing_kwargs(form, inputs, with_probs=False))
        plain_ref = reference.dispatch(inputs[0], pad_multiple=pad, **routing_kwargs(form, inputs, with_probs=False))
        assert plain.probs is None and torch.equal(plain.hidden, plain_ref.hidden), f"{name}: no-probs dispatch"
        checked += 1
    torch.cuda.synchronize()
    hybrid.destroy()
    return checked


def autograd_end_to_end(ctx) -> int:
    """dispatch -> experts (weighted by probs) -> combine -> loss.backward(), against the reference."""
    hidden = 256
    reference, hybrid = make_backends(ctx, hidden)
    checked = 0
    for case, form in enumerate(("routing_map", "topk", "topk")):
        inputs = make_inputs(200 + case, ctx.rank, ctx.world_size, tokens_of(ctx.rank, case), hidden, NUM_EXPERTS,
                             2 + case, skewed=case == 2, drop_some=case == 1)
        expert_scale = torch.linspace(0.5, 1.5, NUM_EXPERTS // ctx.world_size, device=ctx.device)
        target = torch.randn(inputs[0].shape, device=ctx.device, generator=None).to(torch.bfloat16)
        grads = []
        for backend in (reference, hybrid):
            x = inputs[0].clone().requires_grad_(True)
            kwargs = routing_kwargs(form, inputs)
            weight_name = "probs" if form == "routing_map" else "topk_weights"
            weights = kwargs[weight_name].clone().requires_grad_(True)
            kwargs[weight_name] = weights
            out = ep_plugin.dispatch(backend, x, pad_multiple=4, **kwargs)
            expert_of_row = torch.repeat_interleave(torch.arange(len(out.tokens_per_expert), device=ctx.device),
                                                    out.tokens_per_expert, output_size=out.hidden.shape[0])
            y = out.hidden * (expert_scale[expert_of_row] * out.probs).unsqueeze(1).to(torch.bfloat16)
            z = ep_plugin.combine(y, out.handle)
            loss = (z.float() * target.float()).sum()
            loss.backward()
            grads.append((z.detach(), x.grad, weights.grad))
        (z_ref, gx_ref, gw_ref), (z, gx, gw) = grads
        assert_combine_close(z, z_ref, f"autograd {form}: forward")
        assert_combine_close(gx, gx_ref, f"autograd {form}: hidden grad")
        assert torch.allclose(gw, gw_ref, rtol=1e-2, atol=1e-2), f"autograd {form}: probs grad"
        checked += 1
    torch.cuda.synchronize()
    hybrid.destroy()
    return checked


def non_blocking_overflow_and_graph(ctx) -> int:
    """Budget overflow never writes past the budget (canaries); a captured graph replays 10x."""
    hidden = 512
    checked = 0
    # 1) overflow: a budget of 48 rows with ~100+ rows arriving at most ranks.
    reference, hybrid = make_backends(ctx, hidden, blocking=False, num_permuted_tokens=48)
    canary = 12345.0
    allocations = []

    def guarded_empty(*shape, dtype):
        rows = shape[0]
        spare = 64
        full = torch.full((rows + spare,) + tuple(shape[1:]), canary, dtype=dtype, device=ctx.device)
        allocations.append((full, rows))
        return full[:rows]

    hybrid._empty = guarded_empty
    inputs = make_inputs(300, ctx.rank, ctx.world_size, 60, hidden, NUM_EXPERTS, 4, skewed=True, drop_some=False)
    out = hybrid.dispatch(inputs[0], pad_multiple=16, **routing_kwargs("topk", inputs))
    ref = reference.dispatch(inputs[0], pad_multiple=16, **routing_kwargs("topk", inputs))
    torch.cuda.synchronize()
    for full, rows in allocations:
        assert bool((full[rows:] == canary).all()), "a row past the budget was written"
    needed = int(ref.tokens_per_expert.sum())
    assert int(out.handle.layout.overflow) == int(needed > 48), f"overflow flag {int(out.handle.layout.overflow)}"
    assert torch.equal(out.tokens_per_expert, ref.tokens_per_expert)
    valid = min(needed, 48)
    assert torch.equal(out.hidden[:valid], ref.hidden[:valid]), "rows below the budget"
    assert bool((out.hidden[valid:] == canary).all()), "rows past the total are left unwritten"
    checked += 1
    torch.cuda.synchronize()
    hybrid.destroy()

    # 2) CUDA graph of dispatch + combine with a worst-case budget, replayed with new inputs.
    reference, hybrid = make_backends(ctx, hidden, blocking=False, num_permuted_tokens=0)
    num_tokens = 40 + ctx.rank
    static = [t.clone() for t in make_inputs(400, ctx.rank, ctx.world_size, num_tokens, hidden, NUM_EXPERTS, 2,
                                             skewed=False, drop_some=False)]

    def step():
        out = hybrid.dispatch(static[0], pad_multiple=8, **routing_kwargs("topk", static))
        rows = (out.hidden.float() * 2).to(torch.bfloat16)
        back = hybrid.combine(rows, out.handle, row_probs=out.probs)
        return out, back

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the graph (module load, allocator pools)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, graph_back = step()
    for replay in range(10):
        fresh = make_inputs(500 + replay, ctx.rank, ctx.world_size, num_tokens, hidden, NUM_EXPERTS, 2,
                            skewed=replay % 2 == 1, drop_some=replay % 3 == 0)
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        ref = reference.dispatch(fresh[0], pad_multiple=8, **routing_kwargs("topk", fresh))
        total = int(ref.tokens_per_expert.sum())
        assert torch.equal(graph_out.tokens_per_expert, ref.tokens_per_expert), f"replay {replay}: counts"
        assert torch.equal(graph_out.hidden[:total], ref.hidden), f"replay {replay}: rows"
        assert torch.equal(graph_out.probs[:total], ref.probs), f"replay {replay}: probs"
        rows = (ref.hidden.float() * 2).to(torch.bfloat16)
        ref_back = reference.combine(rows, ref.handle, row_probs=ref.probs)
        assert_combine_close(graph_back.hidden, ref_back.hidden, f"replay {replay}: combine")
        assert torch.equal(graph_back.probs, ref_back.probs), f"replay {replay}: combined probs"
        checked += 1
    torch.cuda.synchronize()
    hybrid.destroy()
    return checked


def bad_input_then_good(ctx) -> int:
    """A rejected call on rank 0 launches nothing; the next good call completes on every rank."""
    reference, hybrid = make_backends(ctx, 256)
    inputs = make_inputs(600, ctx.rank, ctx.world_size, 30, 256, NUM_EXPERTS, 2, skewed=False, drop_some=False)
    if ctx.rank == 0:
        with pytest.raises((TypeError, ValueError)):
            hybrid.dispatch(inputs[0].float(), **routing_kwargs("topk", inputs))
    # Top-k ids are checked on the device: one rank's bad id refuses the dispatch on every rank.
    bad_idx = inputs[1].clone()
    if ctx.rank == 0:
        bad_idx[0, 0] = NUM_EXPERTS + 3
    with pytest.raises(ValueError, match="expert id" if ctx.rank == 0 else r"rank\(s\) \[0\] of the group"):
        hybrid.dispatch(inputs[0], topk_idx=bad_idx, topk_weights=inputs[2])
    out = hybrid.dispatch(inputs[0], **routing_kwargs("topk", inputs))
    ref = reference.dispatch(inputs[0], **routing_kwargs("topk", inputs))
    assert torch.equal(out.hidden, ref.hidden)
    torch.cuda.synchronize()
    hybrid.destroy()
    return 1


def mid_word(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in a contiguous view that starts mid-word (2 bytes past a 16-byte boundary)."""
    flat = torch.empty(tensor.numel() + 8, dtype=tensor.dtype, device=tensor.device)
    view = flat[1:1 + tensor.numel()].view(tensor.shape)
    view.copy_(tensor)
    assert view.data_ptr() % 16, "the view should start mid-word"
    return view


def mid_word_inputs_and_capture(ctx) -> int:
    """Inputs that start mid-word give the results of aligned ones (the kernels move 16-byte words: such
    an input is copied first, not read misaligned, which would kill the CUDA context). A blocking
    dispatch inside a CUDA graph capture is refused before anything is enqueued; the backend stays usable."""
    reference, hybrid = make_backends(ctx, 256)
    inputs = make_inputs(700, ctx.rank, ctx.world_size, 30, 256, NUM_EXPERTS, 4, skewed=False, drop_some=False)
    kwargs = routing_kwargs("topk", inputs)
    ref = reference.dispatch(inputs[0], **kwargs)
    out = hybrid.dispatch(mid_word(inputs[0]), **kwargs)
    assert torch.equal(out.hidden, ref.hidden), "mid-word dispatch input"
    rows = (ref.hidden.float() * 0.5 + 1).to(torch.bfloat16)
    back = hybrid.combine(mid_word(rows), out.handle, row_probs=mid_word(ref.probs * 3 + 1))
    ref_back = reference.combine(rows, ref.handle, row_probs=ref.probs * 3 + 1)
    assert_combine_close(back.hidden, ref_back.hidden, "mid-word combine input")
    assert torch.equal(back.probs, ref_back.probs), "mid-word combine row_probs"
    grad = torch.randn(inputs[0].shape, device=ctx.device).to(torch.bfloat16)
    assert torch.equal(hybrid.dispatch_again(mid_word(grad), out.handle), reference.dispatch_again(grad, ref.handle)), \
        "mid-word dispatch_again input"

    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture.*EP_PLUGIN_BLOCKING=0"):
        with torch.cuda.graph(graph):
            hybrid.dispatch(inputs[0], **kwargs)
    with pytest.raises(RuntimeError, match="barrier inside a CUDA graph capture.*waits on the host"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            hybrid.barrier()
    out = hybrid.dispatch(inputs[0], **kwargs)
    assert torch.equal(out.hidden, ref.hidden), "the dispatch after the refused capture"
    torch.cuda.synchronize()
    hybrid.destroy()
    return 1


def round_trip_matches(hybrid, reference, out, ref, name: str) -> None:
    """``out`` (blocking, or non-blocking with its valid rows first) against ``ref``, then their combines."""
    n = ref.hidden.shape[0]
    assert torch.equal(out.tokens_per_expert, ref.tokens_per_expert), f"{name}: tokens_per_expert"
    assert torch.equal(out.hidden[:n], ref.hidden), f"{name}: dispatched rows"
    rows = torch.zeros_like(out.hidden)
    rows[:n] = ref.hidden * 2
    assert_combine_close(hybrid.combine(rows, out.handle).hidden,
                         reference.combine(ref.hidden * 2, ref.handle).hidden, f"{name}: combine")


def scratch_reuse(ctx) -> int:
    """A loop of one shape: torch hands the dispatches' scratches the same few addresses again, and the
    argument structs built over them serve again (``Scratch.args``) with each op's own tensors; every
    round trip equals the reference, and a handle kept meanwhile is never written over."""
    checked = 0
    for blocking in (True, False):
        reference, hybrid = make_backends(ctx, 256, blocking=blocking)
        inputs = [make_inputs(300 + i, ctx.rank, ctx.world_size, 24, 256, NUM_EXPERTS, 2, skewed=i % 2 == 1,
                              drop_some=i == 2) for i in range(4)]
        kept, kept_ref = (backend.dispatch(inputs[0][0], **routing_kwargs("topk", inputs[0]))
                          for backend in (hybrid, reference))
        kept_counts = kept.tokens_per_expert.clone()
        for step, i in enumerate([1, 2, 3] * 2):
            out, ref = (backend.dispatch(inputs[i][0], **routing_kwargs("topk", inputs[i]))
                        for backend in (hybrid, reference))
            round_trip_matches(hybrid, reference, out, ref, f"scratch reuse blocking={blocking} step {step}")
            del out  # its scratch's address is free for the next dispatch
        assert torch.equal(kept.tokens_per_expert, kept_counts), "a held handle's counts were written over"
        round_trip_matches(hybrid, reference, kept, kept_ref, f"scratch reuse blocking={blocking}: the kept handle")
        torch.cuda.synchronize()
        hybrid.destroy()
        checked += 1
    return checked


def run_suite(ctx, hidden_sizes) -> dict:
    counts = {}
    for hidden in hidden_sizes:
        counts[f"sweep{hidden}"] = sweep(ctx, hidden)
    counts["fp8"] = fp8_and_no_probs(ctx, hidden_sizes[-1])
    counts["autograd"] = autograd_end_to_end(ctx)
    counts["non_blocking"] = non_blocking_overflow_and_graph(ctx)
    counts["bad_input"] = bad_input_then_good(ctx)
    counts["mid_word"] = mid_word_inputs_and_capture(ctx)
    counts["scratch_reuse"] = scratch_reuse(ctx)
    return counts


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_hybrid_matches_reference(num_ranks):
    results = run_ranks(run_suite, num_ranks, (2048, 7168), device="cuda", timeout_s=LAUNCH_TIMEOUT_S)
    assert results[0]["sweep2048"] == 36 and results[0]["sweep7168"] == 36
    assert results[0]["scratch_reuse"] == 2
    assert all(r == results[0] for r in results)


def test_hybrid_register_copies_and_long_rows_match_reference():
    """The register copy engine (EP_PLUGIN_BULK_COPY=0, the path below sm_90) passes the same suite, and
    rows longer than one bulk chunk (H=12288: 24 KiB) go through both engines."""
    for bulk in ("0", "1"):
        results = run_ranks(run_suite, 2, (12288,), device="cuda", timeout_s=LAUNCH_TIMEOUT_S,
                            env={"EP_PLUGIN_BULK_COPY": bulk})
        assert results[0]["sweep12288"] == 36, (bulk, results[0])
        assert all(r == results[0] for r in results)



def repeated_ids_probs_gradient(ctx) -> list:
    """Non-blocking mode drops a repeated expert's earlier slots (the last one counts): the weights' gradient
    must be that of the same dispatch with those slots -1 (zero there), not the routed-back value in both.
    Twice: finite rows, then token 0's row inf (its dropped slot's gradient is still 0, not inf x 0 = NaN)."""
    hidden, local = 256, NUM_EXPERTS // ctx.world_size
    _, hybrid = make_backends(ctx, hidden, blocking=False)
    remote, mine = ((ctx.rank + 1) % ctx.world_size) * local, ctx.rank * local + 1
    repeated = torch.tensor([[remote, remote], [mine, mine], [remote, mine], [mine + 1, -1]], device=ctx.device)
    dropped = repeated.clone()
    dropped[0, 0] = dropped[1, 0] = -1
    generator = torch.Generator().manual_seed(31 + ctx.rank)
    finite = torch.randn(4, hidden, generator=generator).to(torch.bfloat16).to(ctx.device)
    inf_row = finite.clone()
    inf_row[0] = float("inf")
    weights = torch.rand(4, 2, generator=generator).to(ctx.device)
    grads = []
    for x in (finite, inf_row):
        for topk_idx in (repeated, dropped):
            w = weights.clone().requires_grad_(True)
            out = ep_plugin.dispatch(hybrid, x, topk_idx=topk_idx, topk_weights=w)
            z = ep_plugin.combine(out.hidden * out.probs.unsqueeze(1).to(torch.bfloat16), out.handle)
            z.float().sum().backward()
            grads.append(w.grad.tolist())
    torch.cuda.synchronize()
    hybrid.check_errors()
    hybrid.destroy()
    return grads


def test_a_repeated_expert_gets_the_gradient_of_its_last_slot_only():
    """Before: the earlier slot of a repeated expert got the same non-zero gradient as the last one."""
    for rank, grads in enumerate(run_ranks(repeated_ids_probs_gradient, 2, device="cuda",
                                           timeout_s=LAUNCH_TIMEOUT_S)):
        repeated, dropped, repeated_inf, dropped_inf = grads
        assert repeated == dropped, (rank, repeated, dropped)
        assert repeated[0][0] == 0 and repeated[0][1] != 0 and repeated[1][1] != 0, (rank, repeated)
        # inf where token 0's last slot routes its row back; its dropped slot (and nothing else) stays finite
        assert repeated_inf == dropped_inf and repeated_inf[0] == [0, float("inf")], (rank, repeated_inf)


# ---- cached dispatch (handle=) ------------------------------------------------------------

def cached_dispatch(ctx) -> list[str]:
    """hybrid's cached dispatch (``dispatch(x2, handle=...)``; before, refused as an unknown option) gives the rows
    of a routed dispatch of ``x2``, in both modes (non-blocking: the valid-row count too); an FP8 pair is refused
    before any launch and the backend goes on. Both routing forms, and ``expert_alignment=``."""
    hidden = 256
    checked = []
    for blocking, form in itertools.product((True, False), ("topk", "routing_map")):
        _, hybrid = make_backends(ctx, hidden, blocking=blocking,
                                  **({} if blocking else {"num_permuted_tokens": 4 * MAX_TOKENS}))
        inputs = make_inputs(91, ctx.rank, ctx.world_size, 30 + 7 * ctx.rank, hidden, NUM_EXPERTS, 3, skewed=False,
                             drop_some=True)
        fresh = (inputs[0].float() * 3 + 1).to(torch.bfloat16)
        out = hybrid.dispatch(inputs[0], **routing_kwargs(form, inputs), expert_alignment=8)
        routed = hybrid.dispatch(fresh, **routing_kwargs(form, inputs, with_probs=False), pad_multiple=8)
        cached = hybrid.dispatch(fresh, handle=out.handle)
        name = f"blocking={blocking} {form}"
        if blocking:
            assert cached.num_valid_rows is None, name
            valid = routed.hidden.shape[0]
        else:  # rows past the valid count of a worst-case-sized output are unwritten
            valid = int(routed.num_valid_rows)
            assert int(cached.num_valid_rows) == valid, name
        assert torch.equal(cached.hidden[:valid], routed.hidden[:valid]), name
        assert cached.probs is None and torch.equal(cached.tokens_per_expert, routed.tokens_per_expert), name
        scales = torch.ones(fresh.shape[0], hidden // 128, device=ctx.device)
        with pytest.raises(TypeError, match="takes FP8 rows in a routed dispatch only"):
            hybrid.dispatch((fresh.to(torch.float8_e4m3fn), scales), handle=out.handle)
        again = hybrid.dispatch(fresh, handle=out.handle)  # still in step with the peers
        assert torch.equal(again.hidden[:valid], cached.hidden[:valid]), name
        torch.cuda.synchronize()
        hybrid.check_errors()
        hybrid.destroy()
        checked.append(name)
    return checked


def test_hybrid_cached_dispatch_gives_the_rows_of_a_routed_dispatch():
    for checked in run_ranks(cached_dispatch, 2, device="cuda", timeout_s=LAUNCH_TIMEOUT_S):
        assert len(checked) == 4, checked


# ---- lifetime regression ------------------------------------------------------------------

def lifetime(ctx, iterations: int) -> int:
    """Blocking mode; the handle dropped right after backward is enqueued; pinned memory churned and
    poisoned by another thread; the GPU kept busy so the host runs ahead."""
    hidden = 512
    reference, hybrid = make_backends(ctx, hidden)
    stop = threading.Event()

    def churn():
        blocks = []
        while not stop.is_set():
            block = torch.empty(1 << 16, dtype=torch.float32, pin_memory=True)
            block.fill_(3.0e38)  # poison: a kernel reading freed pinned memory would see this
            blocks.append(block)
            if len(blocks) > 16:
                old = blocks.pop(0)
                old.fill_(3.0e38)
                del old
            time.sleep(0)

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    busy = torch.randn(4096, 4096, device=ctx.device)
    checked = 0
    try:
        for iteration in range(iterations):
            inputs = make_inputs(700 + iteration % 7, ctx.rank, ctx.world_size, 50 + ctx.rank, hidden, NUM_EXPERTS,
                                 2, skewed=iteration % 2 == 1, drop_some=False)
            for _ in range(2):
                busy = busy @ busy / 64  # keep the GPU busy
            x = inputs[0].clone().requires_grad_(True)
            out = ep_plugin.dispatch(hybrid, x, **routing_kwargs("topk", inputs))
            z = ep_plugin.combine(out.hidden * 2, out.handle)
            z.float().sum().backward()
            del out, z  # drop the handle right after backward was enqueued
            if iteration % 25 == 0:
                x_ref = inputs[0].clone().requires_grad_(True)
                ref = ep_plugin.dispatch(reference, x_ref, **routing_kwargs("topk", inputs))
                ep_plugin.combine(ref.hidden * 2, ref.handle).float().sum().backward()
                assert_combine_close(x.grad, x_ref.grad, f"lifetime iteration {iteration}")
                checked += 1
        torch.cuda.synchronize()
        hybrid.check_errors()
    finally:
        stop.set()
        thread.join()
    hybrid.destroy()
    return checked


def test_hybrid_lifetime_regression():
    results = run_ranks(lifetime, 4, 200, device="cuda", timeout_s=LAUNCH_TIMEOUT_S)
    assert results == [8] * 4
