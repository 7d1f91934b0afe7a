"""``elastic`` against oracles on 2, 4 and 8 ranks (one GPU per rank where there are enough GPUs, else ranks
sharing GPUs under MPS, NVLink and same-GPU peers mixed).

Every rank can rebuild every rank's inputs from the seed, so the oracles need no communication:
- compact form: the expected rows, local top-k ids and weights of this rank, built with torch from all
  sources' inputs (rows ordered by source rank, then source token), bitwise;
- expanded form: the ``reference`` backend's dispatch with ``pad_multiple`` = the alignment, bitwise;
- combine: compact rows summed at the source in fp32 in rank order (bitwise); expanded rows against
  ``reference``'s combine within the documented bf16 rounding of per-rank partial sums;
- weights routed back, cached == uncached dispatch, gradients through ``ep_plugin.dispatch/combine``.
Token counts differ per rank (rank r sends T - r, one rank sends none in some cases), some top-k
slots are -1, skewed routing leaves the last rank empty; alignment 1 and 128; FP8.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_hybrid import assert_combine_close, make_inputs

import ep_plugin
from ep_plugin.config import Config
from ep_plugin.testing import run_ranks

pytestmark = pytest.mark.gpu

NUM_EXPERTS = 32
MAX_TOKENS = 128
LAUNCH_TIMEOUT_S = 420


def make_backends(ctx, hidden: int, **config):
    config = Config.from_env(**{"max_tokens_per_rank": MAX_TOKENS, "timeout_s": 20.0, "num_sms": 8, **config})
    reference = ep_plugin.get_backend("reference")(hidden_size=hidden, num_experts=NUM_EXPERTS, device=ctx.device,
                                                   config=config)
    elastic = ep_plugin.get_backend("elastic")(hidden_size=hidden, num_experts=NUM_EXPERTS, device=ctx.device,
                                               config=config, max_topk=8)
    return reference, elastic


def tokens_of(rank: int, case: int) -> int:
    """Rank r sends T - r tokens; in odd cases rank 1 sends none."""
    if case % 2 and rank == 1:
        return 0
    return 60 - rank + case % 4


def all_inputs(seed: int, world: int, case: int, hidden: int, topk: int, **kw):
    """Every rank's (hidden, topk_idx, topk_weights, routing_map, probs), identical on every rank."""
    return [make_inputs(seed, r, world, tokens_of(r, case), hidden, NUM_EXPERTS, topk, **kw) for r in range(world)]


def kept_slots(topk_idx: torch.Tensor) -> torch.Tensor:
    """[T, k] bool: ids in range, each expert counted at its last slot only."""
    valid = (topk_idx >= 0) & (topk_idx < NUM_EXPERTS)
    k = topk_idx.shape[1]
    same = topk_idx.unsqueeze(2) == topk_idx.unsqueeze(1)  # [T, j, j']
    later = torch.ones(k, k, dtype=torch.bool, device=topk_idx.device).triu(1)  # j' > j
    return valid & ~(same & later).any(2)


def with_repeated_expert(inputs):
    """The same inputs with token 0's second slot naming the expert of its first (when it has one)."""
    x, idx, w, routing_map, probs = inputs
    if x.shape[0] and idx[0, 0] >= 0:
        idx = idx.clone()
        idx[0, 1] = idx[0, 0]
    return x, idx, w, routing_map, probs


def compact_oracle(me: int, world: int, inputs, pad: int):
    """This rank's compact receive: (rows, local ids, weights, tokens_per_expert padded)."""
    local = NUM_EXPERTS // world
    rows, ids, weights = [], [], []
    counts = torch.zeros(local, dtype=torch.int64, device="cuda")
    for x, idx, w, _, _ in inputs:
        here = kept_slots(idx) & (idx.div(local, rounding_mode="floor") == me)
        chosen = here.any(1)
        rows.append(x[chosen])
        ids.append(torch.where(here, idx - me * local, torch.full_like(idx, -1))[chosen])
        weights.append(torch.where(here, w, torch.zeros_like(w))[chosen])
        counts += torch.bincount((idx - me * local)[here], minlength=local)
    padded = (counts + pad - 1) // pad * pad
    return torch.cat(rows), torch.cat(ids), torch.cat(weights), padded


def expert_side_rows(rows: torch.Tensor, rank: int) -> torch.Tensor:
    """What an expert rank returns for its compact rows (depends on the rank, so a row that comes back
    from the wrong rank or lands on the wrong token shows)."""
    return (rows.float() * (0.5 + 0.25 * rank)).to(torch.bfloat16)


def compact_combine_oracle(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, world: int, bias=None):
    """The source's combine of expert_side_rows: fp32 sum in rank order (+ bias last), and the values
    routed back (each expert rank returns its weights * 3 + rank + 1)."""
    local = NUM_EXPERTS // world
    kept = kept_slots(idx)
    owner = torch.where(kept, idx.div(local, rounding_mode="floor"), torch.full_like(idx, -1))
    total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for p in range(world):
        sent = (owner == p).any(1)
        total[sent] += expert_side_rows(x[sent], p).float()
    if bias is not None:
        total += bias.float()
    values = torch.where(kept, w * 3 + (owner + 1).float(), torch.zeros_like(w))
    return total.to(torch.bfloat16), values


# ---- the scenario sweep -----------------------------------------------------------------------

def sweep(ctx, hidden: int) -> int:
    reference, elastic = make_backends(ctx, hidden)
    me, world = ctx.rank, ctx.world_size
    checked = 0
    for case, (topk, align, skewed, expand) in enumerate(
            itertools.product((1, 6, 8), (1, 128), (False, True), (False, True))):
        name = f"H={hidden} R={world} topk={topk} align={align} skewed={skewed} expand={expand}"
        inputs = all_inputs(case, world, case, hidden, topk, skewed=skewed, drop_some=case % 3 == 0)
        x, idx, w, _, _ = inputs[me]
        zero_padding = expand and case % 4 == 1
        out = elastic.dispatch(x, topk_idx=idx, topk_weights=w, pad_multiple=align, expand=expand,
                               zero_padding=zero_padding)
        if not expand:
            rows, ids, weights, padded = compact_oracle(me, world, inputs, align)
            assert out.hidden.shape == rows.shape, f"{name}: rows {tuple(out.hidden.shape)} vs {tuple(rows.shape)}"
            assert torch.equal(out.hidden, rows), f"{name}: compact rows"
            assert torch.equal(out.topk_idx, ids), f"{name}: recv_topk_idx"
            assert torch.equal(out.probs, weights), f"{name}: recv_topk_weights"
            assert torch.equal(out.tokens_per_expert, padded), f"{name}: tokens_per_expert"
            assert out.tokens_per_expert_list == padded.tolist(), f"{name}: host tokens_per_expert"
            # Combine: each expert rank returns rank-dependent rows and values.
            back = elastic.combine(expert_side_rows(out.hidden, me), out.handle,
                                   row_probs=out.probs * 3 + (me + 1))
            want, want_values = compact_combine_oracle(x, idx, w, world)
            assert torch.equal(back.hidden, want), f"{name}: compact combine"
            assert torch.equal(back.probs, want_values), f"{name}: weights routed back"
        else:
            ref = reference.dispatch(x, topk_idx=idx, topk_weights=w, pad_multiple=align)
            assert out.hidden.shape == ref.hidden.shape, f"{name}: rows {out.hidden.shape} vs {ref.hidden.shape}"
            assert torch.equal(out.tokens_per_expert, ref.tokens_per_expert), f"{name}: tokens_per_expert"
            real = ref.handle.num_real_tokens_per_expert
            data_row = torch.zeros(ref.hidden.shape[0], dtype=torch.bool, device=x.device)
            start = 0
            for length, used in zip(ref.tokens_per_expert.tolist(), real.tolist(), strict=True):
                data_row[start:start + used] = True
                start += length
            if zero_padding:
                assert torch.equal(out.hidden, ref.hidden), f"{name}: expanded rows (zeroed padding)"
                assert torch.equal(out.probs, ref.probs), f"{name}: row weights"
            else:
                assert torch.equal(out.hidden[data_row], ref.hidden[data_row]), f"{name}: expanded rows"
                assert torch.equal(out.probs[data_row], ref.probs[data_row]), f"{name}: row weights"
            rows = (ref.hidden.float() * 0.5 + 1).to(torch.bfloat16)
            ref_back = reference.combine(rows, ref.handle, row_probs=ref.probs * 3 + 1)
            back = elastic.combine(rows, out.handle, row_probs=ref.probs * 3 + 1)
            assert_combine_close(back.hidden, ref_back.hidden, name)
            if topk == 1:  # one row per token: no partial sums, so exact
                assert torch.equal(back.hidden, ref_back.hidden), f"{name}: top-1 combine must be exact"
            assert torch.equal(back.probs, ref_back.probs), f"{name}: weights routed back"
        # Cached dispatch of new rows along the same layout == a fresh dispatch of them (padding rows,
        # when not zeroed, are left as they were: compare the data rows then).
        fresh = torch.randn(x.shape, device=x.device).to(torch.bfloat16)
        cached = elastic.dispatch(fresh, handle=out.handle)
        again = elastic.dispatch(fresh, topk_idx=idx, topk_weights=w, pad_multiple=align, expand=expand,
                                 zero_padding=zero_padding)
        rows_to_compare = data_row if expand and not zero_padding else slice(None)
        assert torch.equal(cached.hidden[rows_to_compare], again.hidden[rows_to_compare]), f"{name}: cached dispatch"
        if expand and not zero_padding:  # DeepEP V2 takes zero padding per call: a cached one zeroes it too
            zeroed = elastic.dispatch(fresh, handle=out.handle, zero_padding=True)
            ref_fresh = reference.dispatch(fresh, topk_idx=idx, topk_weights=w, pad_multiple=align)
            assert torch.equal(zeroed.hidden, ref_fresh.hidden), f"{name}: cached dispatch, padding zeroed this time"
        checked += 1
    torch.cuda.synchronize()
    elastic.destroy()
    return checked


def fp8_and_no_weights(ctx, hidden: int) -> int:
    """FP8 payload (dequantized == the oracle of the dequantized input) and dispatch without weights."""
    reference, elastic = make_backends(ctx, hidden)
    me, world = ctx.rank, ctx.world_size
    checked = 0
    for case, (topk, align, expand) in enumerate(itertools.product((1, 8), (1, 128), (False, True))):
        name = f"fp8 H={hidden} topk={topk} align={align} expand={expand}"
        inputs = all_inputs(100 + case, world, case, hidden, topk, skewed=case % 2 == 1, drop_some=False)

        def quantize(x):
            blocks = x.float().view(x.shape[0], hidden // 128, 128)
            scales = (blocks.abs().amax(dim=2) / 448.0).clamp_min(1e-8)
            data = (blocks / scales.unsqueeze(2)).to(torch.float8_e4m3fn).view(x.shape[0], hidden)
            dequantized = (data.float().view_as(blocks) * scales.unsqueeze(2)).view_as(x)
            return data, scales.contiguous(), dequantized

        quantized = [quantize(inp[0]) for inp in inputs]
        data, scales, _ = quantized[me]
        x, idx, w, _, _ = inputs[me]
        out = elastic.dispatch((data, scales), topk_idx=idx, topk_weights=w, pad_multiple=align, expand=expand,
                               zero_padding=True)
        rows, row_scales = out.hidden
        assert rows.dtype == torch.float8_e4m3fn and row_scales.shape == (rows.shape[0], hidden // 128), name
        got = (rows.float().view(rows.shape[0], hidden // 128, 128) * row_scales.unsqueeze(2)).view(rows.shape[0],
                                                                                                    hidden)
        if expand:
            ref = reference.dispatch(quantized[me][2], topk_idx=idx, topk_weights=w, pad_multiple=align)
            assert torch.equal(got, ref.hidden), f"{name}: dequantized expanded rows"
        else:
            dequantized_inputs = [(q[2],) + tuple(inp[1:]) for q, inp in zip(quantized, inputs, strict=True)]
            want, ids, _, _ = compact_oracle(me, world, dequantized_inputs, align)
            assert torch.equal(got, want.float()), f"{name}: dequantized compact rows"
            assert torch.equal(out.topk_idx, ids), f"{name}: recv_topk_idx"
        plain = elastic.dispatch(x, topk_idx=idx, pad_multiple=align, expand=expand)
        assert plain.probs is None, f"{name}: no weights in, no weights out"
        back = elastic.combine(plain.hidden, plain.handle)
        assert back.probs is None and back.hidden.shape == x.shape, name
        checked += 1
    torch.cuda.synchronize()
    elastic.destroy()
    return checked


def autograd_end_to_end(ctx) -> int:
    """dispatch -> experts weighted by the routed weights -> combine -> loss.backward(): gradients of the
    tokens and of the top-k weights against the reference's, in both forms."""
    hidden = 256
    reference, elastic = make_backends(ctx, hidden)
    me, world = ctx.rank, ctx.world_size
    local = NUM_EXPERTS // world
    expert_scale = torch.linspace(0.5, 1.5, local, device=ctx.device)
    checked = 0
    for case, expand in enumerate((False, True, False, True)):
        inputs = make_inputs(200 + case, me, world, tokens_of(me, case), hidden, NUM_EXPERTS, 3 + case,
                             skewed=case == 2, drop_some=case == 1)
        target = torch.randn(inputs[0].shape, device=ctx.device).to(torch.bfloat16)
        results = []
        for backend in (reference, elastic):
            x = inputs[0].clone().requires_grad_(True)
            weights = inputs[2].clone().requires_grad_(True)
            options = dict(expand=expand, zero_padding=True) if backend is elastic else {}
            out = ep_plugin.dispatch(backend, x, topk_idx=inputs[1], topk_weights=weights, pad_multiple=4, **options)
            if backend is elastic and not expand:  # compact rows: weigh by the row's local experts
                scale = torch.where(out.topk_idx >= 0, expert_scale[out.topk_idx.clamp_min(0)], 0.0)
                y = out.hidden * (out.probs * scale).sum(1, keepdim=True).to(torch.bfloat16)
            else:
                expert_of_row = torch.repeat_interleave(torch.arange(local, device=ctx.device), out.tokens_per_expert,
                                                        output_size=out.hidden.shape[0])
                y = out.hidden * (expert_scale[expert_of_row] * out.probs).unsqueeze(1).to(torch.bfloat16)
            # Elastic's combine option in the last case: a bias, whose gradient is the output's.
            bias = (torch.randn(x.shape, device=ctx.device).to(torch.bfloat16).requires_grad_()
                    if backend is elastic and case == 3 else None)
            z = ep_plugin.combine(y, out.handle, **({"bias": bias} if bias is not None else {}))
            (z.float() * target.float()).sum().backward()
            results.append((z.detach(), x.grad, weights.grad))
        (z_ref, gx_ref, gw_ref), (z, gx, gw) = results
        label = f"autograd expand={expand}"
        if bias is not None:
            assert torch.equal(bias.grad, target), f"{label}: bias grad"
            z_ref = (z_ref.float() + bias.detach().float()).to(torch.bfloat16)
        assert_combine_close(z, z_ref, f"{label}: forward")
        assert_combine_close(gx, gx_ref, f"{label}: hidden grad")
        assert torch.allclose(gw, gw_ref, rtol=2e-2, atol=2e-2), f"{label}: weights grad"
        checked += 1
    torch.cuda.synchronize()
    elastic.destroy()
    return checked


def capture(step):
    """Run ``step`` once eagerly on a side stream (torch asks for warm-up there), then capture it into
    a CUDA graph; returns (graph, what the captured step returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


def non_blocking_and_graph(ctx) -> int:
    """Sync-free mode: worst-case outputs, a device count of valid rows, rows past it unwritten; a
    captured CUDA graph of dispatch + combine replays with new inputs."""
    hidden = 512
    me, world = ctx.rank, ctx.world_size
    reference, elastic = make_backends(ctx, hidden, blocking=False)
    canary = 12345.0
    elastic._empty = lambda *shape, dtype: torch.full(shape, canary, dtype=dtype, device=ctx.device)
    checked = 0
    for case, expand in enumerate((False, True)):
        # One token of every rank names an expert twice (the blocking mode would refuse it): it counts once.
        inputs = [with_repeated_expert(inp) for inp in all_inputs(300 + case, world, case, hidden, 4, skewed=True,
                                                                      drop_some=True)]
        x, idx, w, _, _ = inputs[me]
        out = elastic.dispatch(x, topk_idx=idx, topk_weights=w, pad_multiple=16, expand=expand)
        capacity = world * MAX_TOKENS if not expand else -(-(world * MAX_TOKENS * 4 + 15 * (NUM_EXPERTS // world))
                                                           // 16) * 16
        assert out.hidden.shape[0] == capacity and out.tokens_per_expert_list is None, "worst-case capacity"
        valid = int(out.num_valid_rows)
        if not expand:
            rows, ids, weights, padded = compact_oracle(me, world, inputs, 16)
            assert valid == rows.shape[0], f"valid rows {valid} vs {rows.shape[0]}"
            assert torch.equal(out.hidden[:valid], rows) and torch.equal(out.topk_idx[:valid], ids)
            assert torch.equal(out.probs[:valid], weights) and torch.equal(out.tokens_per_expert, padded)
        else:  # the reference, given the repeated slot as -1, is what the kept slots mean
            kept_idx = torch.where(kept_slots(idx), idx, torch.full_like(idx, -1))
            ref = reference.dispatch(x, topk_idx=kept_idx, topk_weights=w, pad_multiple=16)
            assert valid == ref.hidden.shape[0], f"valid rows {valid} vs {ref.hidden.shape[0]}"
            assert torch.equal(out.tokens_per_expert, ref.tokens_per_expert)
            data = torch.zeros(valid, dtype=torch.bool, device=x.device)
            start = 0
            for length, used in zip(ref.tokens_per_expert.tolist(), ref.handle.num_real_tokens_per_expert.tolist(),
                                    strict=True):
                data[start:start + used] = True
                start += length
            assert torch.equal(out.hidden[:valid][data], ref.hidden[data]), "expanded rows"
            assert torch.equal(out.probs[:valid][data], ref.probs[data]), "expanded row weights"
        assert bool((out.hidden[valid:] == canary).all()), "rows past the valid count must stay unwritten"
        checked += 1
    elastic.check_errors()

    # CUDA graph: one dispatch + combine captured, replayed with fresh inputs.
    num_tokens = 40 + me
    static = [t.clone() for t in make_inputs(400, me, world, num_tokens, hidden, NUM_EXPERTS, 2, skewed=False,
                                             drop_some=False)]
    elastic._empty = lambda *shape, dtype: torch.empty(shape, dtype=dtype, device=ctx.device)

    def step():
        out = elastic.dispatch(static[0], topk_idx=static[1], topk_weights=static[2])
        back = elastic.combine(expert_side_rows(out.hidden, me), out.handle, row_probs=out.probs * 3 + (me + 1))
        return out, back

    graph, (graph_out, graph_back) = capture(step)
    for replay in range(6):
        fresh = [make_inputs(500 + replay, r, world, 40 + r, hidden, NUM_EXPERTS, 2, skewed=replay % 2 == 1,
                             drop_some=replay % 3 == 0) for r in range(world)]
        for dst, src in zip(static, fresh[me], strict=True):
            dst.copy_(src)
        graph.replay()
        rows, ids, weights, _ = compact_oracle(me, world, fresh, 1)
        valid = int(graph_out.num_valid_rows)
        assert valid == rows.shape[0] and torch.equal(graph_out.hidden[:valid], rows), f"replay {replay}: rows"
        assert torch.equal(graph_out.topk_idx[:valid], ids), f"replay {replay}: ids"
        want, want_values = compact_combine_oracle(*fresh[me][:3], world)
        assert torch.equal(graph_back.hidden, want), f"replay {replay}: combine"
        assert torch.equal(graph_back.probs, want_values), f"replay {replay}: values back"
        checked += 1
    torch.cuda.synchronize()
    elastic.destroy()
    return checked


def combine_in_place(ctx) -> int:
    """Combine with the rows written into ``combine_input(handle)``: bitwise the same as the copying
    combine's oracle (with and without values routed back and a bias), blocking and sync-free, and
    under CUDA-graph replay; the expanded form refuses it."""
    hidden = 1024
    me, world = ctx.rank, ctx.world_size
    checked = 0
    for blocking in (True, False):
        _, elastic = make_backends(ctx, hidden, blocking=blocking)
        for case in range(3):
            inputs = all_inputs(700 + case, world, case, hidden, 6, skewed=case == 2, drop_some=case == 1)
            x, idx, w, _, _ = inputs[me]
            out = elastic.dispatch(x, topk_idx=idx, topk_weights=w)
            rows = elastic.combine_input(out.handle)
            assert rows.shape == out.hidden.shape and rows.dtype == torch.bfloat16
            rows.copy_(expert_side_rows(out.hidden, me))
            bias = torch.randn(x.shape, device=x.device).to(torch.bfloat16) if case == 1 else None
            values = out.probs * 3 + (me + 1) if case != 2 else None
            back = elastic.combine(rows, out.handle, row_probs=values, bias=bias)
            want, want_values = compact_combine_oracle(x, idx, w, world, bias=bias)
            name = f"in place blocking={blocking} case={case}"
            assert torch.equal(back.hidden, want), f"{name}: combine"
            if values is not None:
                assert torch.equal(back.probs, want_values), f"{name}: values back"
            checked += 1
        expanded = elastic.dispatch(x, topk_idx=idx, topk_weights=w, expand=True)
        with pytest.raises(ValueError, match="compact"):
            elastic.combine_input(expanded.handle)
        elastic.combine(expanded.hidden, expanded.handle)  # still usable
        # Two batches in flight: right after the first's in-place combine a slower peer may still read the
        # buffer, so the second's combine input is refused (before any launch) until another op ran.
        first = elastic.dispatch(x, topk_idx=idx, topk_weights=w)
        second = elastic.dispatch(x, topk_idx=idx, topk_weights=w)
        rows = elastic.combine_input(first.handle)
        rows.copy_(expert_side_rows(first.hidden, me))
        elastic.combine(rows, first.handle)
        with pytest.raises(ValueError, match="may still be reading"):
            elastic.combine_input(second.handle)
        elastic.barrier()
        rows = elastic.combine_input(second.handle)
        rows.copy_(expert_side_rows(second.hidden, me))
        want, _ = compact_combine_oracle(x, idx, w, world)
        assert torch.equal(elastic.combine(rows, second.handle).hidden, want), f"blocking={blocking}: two in flight"
        # A copying combine in between: the peers' send wrote this rank's rows over the combine input, so
        # the view handed out before is refused (before, it was read in place and summed other rows).
        first = elastic.dispatch(x, topk_idx=idx, topk_weights=w)
        second = elastic.dispatch(x, topk_idx=idx, topk_weights=w)
        elastic.barrier()
        rows = elastic.combine_input(first.handle)
        rows.copy_(expert_side_rows(first.hidden, me))
        elastic.combine(expert_side_rows(second.hidden, me), second.handle)
        with pytest.raises(ValueError, match="holds it for another dispatch"):
            elastic.combine(rows, first.handle)
        assert torch.equal(elastic.combine(expert_side_rows(first.hidden, me), first.handle).hidden, want)
        if blocking:  # (exact row counts: sync-free outputs hold the worst case)
            # Rows in the combine input's memory that combine cannot read in place (a smaller dispatch's rows one row
            # into a larger one's combine input) are refused on every rank: the copying combine's sends write that
            # memory while it reads them (it summed wrong rows without a word). The backend stays usable.
            x0, idx0, w0, _, _ = all_inputs(700, world, 0, hidden, 6, skewed=False, drop_some=False)[me]
            half = x0.shape[0] // 2
            large = elastic.dispatch(x0, topk_idx=idx0, topk_weights=w0)
            small = elastic.dispatch(x0[:half], topk_idx=idx0[:half], topk_weights=w0[:half])
            elastic.barrier()
            inside = elastic.combine_input(large.handle)
            n = small.hidden.shape[0]
            assert inside.shape[0] > n, (inside.shape, n)  # every token reaches some rank: more rows than the half's
            inside[1:1 + n].copy_(expert_side_rows(small.hidden, me))
            with pytest.raises(ValueError, match="lie in this rank's combine-input memory"):
                elastic.combine(inside[1:1 + n], small.handle)
            want, _ = compact_combine_oracle(x0[:half], idx0[:half], w0[:half], world)
            assert torch.equal(elastic.combine(expert_side_rows(small.hidden, me), small.handle).hidden, want), \
                f"blocking={blocking}: usable after the refusal"
        torch.cuda.synchronize()
        elastic.destroy()

    # Graph replay: dispatch, the expert writing into the combine input, and the in-place combine.
    _, elastic = make_backends(ctx, hidden, blocking=False)
    static = [t.clone() for t in make_inputs(750, me, world, 40 + me, hidden, NUM_EXPERTS, 3, skewed=False,
                                             drop_some=False)]

    def step():
        out = elastic.dispatch(static[0], topk_idx=static[1], topk_weights=static[2])
        rows = elastic.combine_input(out.handle)
        rows.copy_(expert_side_rows(out.hidden, me))
        return elastic.combine(rows, out.handle)

    graph, graph_back = capture(step)
    for replay in range(3):
        fresh = [make_inputs(760 + replay, r, world, 40 + r, hidden, NUM_EXPERTS, 3, skewed=replay == 1,
                             drop_some=replay == 2) for r in range(world)]
        for dst, src in zip(static, fresh[me], strict=True):
            dst.copy_(src)
        graph.replay()
        want, _ = compact_combine_oracle(*fresh[me][:3], world)
        assert torch.equal(graph_back.hidden, want), f"in place, graph replay {replay}"
        checked += 1
    torch.cuda.synchronize()
    elastic.destroy()
    return checked


def dispatch_in_place(ctx) -> int:
    """dispatch(in_place=True): the sources write the rows into the backend's buffer. Rows bitwise the
    compact oracle (bf16 and FP8 with scales, blocking and sync-free), ids, weights and counts too;
    combine (copying and in place) and a cached dispatch along its handle as after a staged dispatch;
    the next in-place dispatch overwrites the rows (the documented lifetime); ranks that disagree on
    in_place get EPError; misuse is refused before any launch."""
    hidden = 1024
    me, world = ctx.rank, ctx.world_size
    checked = 0

    def build(**config):
        config = Config.from_env(**{"max_tokens_per_rank": MAX_TOKENS, "timeout_s": 20.0, "num_sms": 8, **config})
        return ep_plugin.get_backend("elastic")(hidden_size=hidden, num_experts=NUM_EXPERTS, device=ctx.device,
                                                config=config, max_topk=8, in_place_dispatch=True)

    def to_fp8(x):  # deterministic on every rank: data and per-128 scales
        scales = x.float()[:, ::128].abs().add(1.0).contiguous()
        return x.to(torch.float8_e4m3fn), scales

    for blocking in (True, False):
        elastic = build(blocking=blocking)
        for case in range(4):
            name = f"in-place dispatch blocking={blocking} case={case}"
            inputs = all_inputs(1000 + case, world, case, hidden, 6, skewed=case == 2, drop_some=case == 1)
            x, idx, w, _, _ = inputs[me]
            rows, ids, weights, padded = compact_oracle(me, world, inputs, 1)
            n = rows.shape[0]
            if case == 3:  # fp8: bytes and scales land where the bf16 rows would
                out = elastic.dispatch(to_fp8(x), topk_idx=idx, topk_weights=w, in_place=True)
                fp8_inputs = [(to_fp8(inp[0])[0].view(torch.uint8),) + tuple(inp[1:]) for inp in inputs]
                scale_inputs = [(to_fp8(inp[0])[1],) + tuple(inp[1:]) for inp in inputs]
                got, got_scales = out.hidden
                assert torch.equal(got[:n].view(torch.uint8), compact_oracle(me, world, fp8_inputs, 1)[0]), name
                assert torch.equal(got_scales[:n], compact_oracle(me, world, scale_inputs, 1)[0]), f"{name}: scales"
                checked += 1
                continue
            out = elastic.dispatch(x, topk_idx=idx, topk_weights=w, in_place=True)
            assert out.hidden.shape[0] == (n if blocking else world * MAX_TOKENS), name
            assert torch.equal(out.hidden[:n], rows), f"{name}: rows"
            assert torch.equal(out.topk_idx[:n], ids) and torch.equal(out.probs[:n], weights), f"{name}: metadata"
            assert torch.equal(out.tokens_per_expert, padded), f"{name}: tokens_per_expert"
            values = out.probs * 3 + (me + 1)
            if case == 0:
                back = elastic.combine(expert_side_rows(out.hidden, me), out.handle, row_probs=values)
            else:  # both buffers in place
                combine_rows = elastic.combine_input(out.handle)
                combine_rows.copy_(expert_side_rows(out.hidden, me))
                back = elastic.combine(combine_rows, out.handle, row_probs=values)
            want, want_values = compact_combine_oracle(x, idx, w, world)
            assert torch.equal(back.hidden, want) and torch.equal(back.probs, want_values), f"{name}: combine"
            # A cached dispatch along the handle: new tensors, the staged path's rows.
            twice = [((inp[0].float() * 2 + 1).to(torch.bfloat16),) + tuple(inp[1:]) for inp in inputs]
            cached = elastic.dispatch(twice[me][0], handle=out.handle)
            assert torch.equal(cached.hidden[:n], compact_oracle(me, world, twice, 1)[0]), f"{name}: cached"
            # The next in-place dispatch writes over the rows handed out before.
            earlier = out.hidden
            elastic.dispatch(twice[me][0], topk_idx=idx, topk_weights=w, in_place=True)
            assert torch.equal(earlier[:n], compact_oracle(me, world, twice, 1)[0]), f"{name}: overwritten"
            checked += 1
        if blocking:  # the rows are pushed before the count read tells of bad ids: refused anyway
            inputs = all_inputs(1000, world, 0, hidden, 6, skewed=False, drop_some=False)  # every rank has tokens
            x, idx, w, _, _ = inputs[me]
            refuse_bad_ids_on_every_rank(ctx, elastic, x, idx, w, in_place=True)
            good = elastic.dispatch(x, topk_idx=idx, topk_weights=w, in_place=True)
            rows, ids = compact_oracle(me, world, inputs, 1)[:2]
            assert torch.equal(good.hidden, rows) and torch.equal(good.topk_idx, ids), "in place after a refusal"
            checked += 1
        with pytest.raises(ValueError, match="compact"):
            elastic.dispatch(x, topk_idx=idx, topk_weights=w, in_place=True, expand=True)
        torch.cuda.synchronize()
        elastic.destroy()

    # Rows saved for a backward (an expert's input, for its weight gradient) and then written over by the
    # next in-place dispatch: autograd sees the write and the backward raises (it would use the new rows).
    elastic = build(blocking=True)
    x, idx, w, _, _ = all_inputs(1200, world, 0, hidden, 6, skewed=False, drop_some=False)[me]
    weight = torch.ones(hidden, 4, dtype=torch.bfloat16, device=ctx.device, requires_grad=True)
    out = elastic.dispatch(x, topk_idx=idx, topk_weights=w, in_place=True)
    loss = (out.hidden @ weight).float().sum()  # the matmul keeps out.hidden for weight's gradient
    elastic.dispatch(x * 2, topk_idx=idx, topk_weights=w, in_place=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    out = elastic.dispatch(x, topk_idx=idx, topk_weights=w, in_place=True)
    (out.hidden @ weight).float().sum().backward()  # saved and used before the next in-place dispatch: fine
    column_sums = out.hidden.float().sum(0)[:, None].expand(-1, 4)
    scale = float(column_sums.abs().max())
    torch.testing.assert_close(weight.grad.float(), column_sums, rtol=2**-6, atol=2**-6 * scale)
    torch.cuda.synchronize()
    elastic.destroy()
    checked += 1

    # Misuse on a backend without the regions; the backend stays usable.
    _, plain = make_backends(ctx, hidden)
    x, idx, w, _, _ = all_inputs(1100, world, 0, hidden, 4, skewed=False, drop_some=False)[me]
    with pytest.raises(ValueError, match="in_place_dispatch=True"):
        plain.dispatch(x, topk_idx=idx, topk_weights=w, in_place=True)
    again = plain.dispatch(x, topk_idx=idx, topk_weights=w)
    assert plain.combine(again.hidden, again.handle).hidden.shape == x.shape
    torch.cuda.synchronize()
    plain.destroy()

    # Rank 0 stages while the others dispatch in place: an error on every rank, naming the form.
    elastic = build()
    try:
        elastic.dispatch(x, topk_idx=idx, topk_weights=w, in_place=me != 0)
        elastic.check_errors()
        error = None
    except ep_plugin.EPError as caught:
        error = str(caught)
    assert error is not None and "topk+in_place" in error, error
    elastic.destroy()
    return checked + 1


def refuse_bad_ids_on_every_rank(ctx, backend, x, idx, w, **options) -> None:
    """Blocking mode checks top-k ids on the device, and the count exchange tells every rank: rank 0's
    id out of range, then the last rank's expert named twice, refuse the dispatch on every rank (the
    flagged rank's message names the id or the token, the others' the rank)."""
    last = ctx.world_size - 1
    out_of_range, repeated = idx.clone(), idx.clone()
    if ctx.rank == 0:
        out_of_range[0, 0] = NUM_EXPERTS + 3
    if ctx.rank == last:
        repeated[0, 1] = repeated[0, 0]
    for bad, flagged, own_text, text in ((out_of_range, 0, f"expert id {NUM_EXPERTS + 3}", "an expert id outside"),
                                         (repeated, last, "same expert twice", "the same expert twice")):
        expected = own_text if ctx.rank == flagged else rf"rank\(s\) \[{flagged}\] of the group .*{text}"
        with pytest.raises(ValueError, match=expected) as caught:
            backend.dispatch(x, topk_idx=bad, topk_weights=w, **options)
        assert "every rank of backend" in str(caught.value), str(caught.value)


def bad_input_then_good(ctx) -> int:
    """A rejected call on rank 0 launches nothing; the next good call completes on every rank."""
    reference, elastic = make_backends(ctx, 256)
    x, idx, w, routing_map, probs = make_inputs(600, ctx.rank, ctx.world_size, 30, 256, NUM_EXPERTS, 2, skewed=False,
                                                drop_some=False)
    if ctx.rank == 0:
        bad_calls = [
            (TypeError, lambda: elastic.dispatch(x.float(), topk_idx=idx, topk_weights=w)),
            (ValueError, lambda: elastic.dispatch(x, routing_map=routing_map, probs=probs)),
            (ValueError, lambda: elastic.dispatch(x, topk_idx=torch.cat([idx] * 5, 1), topk_weights=None)),
            (TypeError, lambda: elastic.dispatch(x, topk_idx=idx, expand="yes")),
            (TypeError, lambda: elastic.dispatch(x, topk_idx=idx, flavour=1)),
            (TypeError, lambda: elastic.dispatch(x, topk_idx=idx.tolist(), topk_weights=w)),  # not AttributeError
        ]
        for error_type, call in bad_calls:
            with pytest.raises(error_type):
                call()
    refuse_bad_ids_on_every_rank(ctx, elastic, x, idx, w)
    out = elastic.dispatch(x, topk_idx=idx, topk_weights=w)
    if ctx.rank == 0:
        with pytest.raises(ValueError):
            elastic.combine(out.hidden[:-1] if out.hidden.shape[0] else out.hidden.new_zeros(1, 256), out.handle)
        with pytest.raises(ValueError):
            elastic.combine(out.hidden, out.handle, bias=torch.zeros(3, 256, dtype=torch.bfloat16, device=x.device))
        with pytest.raises(ValueError):
            elastic.dispatch(x[:-1], handle=out.handle)
        # A cached dispatch takes its form from the handle: expand=True on a compact one is refused (it was
        # ignored, and a compact handle returned compact rows for expand=True).
        with pytest.raises(ValueError, match="delivers its handle's form"):
            elastic.dispatch(x, handle=out.handle, expand=True)
        with pytest.raises(TypeError, match="must be bools"):
            elastic.dispatch(x, handle=out.handle, zero_padding="yes")
    back = elastic.combine(out.hidden, out.handle)
    ref = reference.dispatch(x, topk_idx=idx, topk_weights=w)
    assert back.hidden.shape == x.shape and ref.hidden is not None
    torch.cuda.synchronize()
    elastic.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):  # the cached path checks it too
        elastic.dispatch(x, handle=out.handle)
    return 1


def allocation_failure_then_retry(ctx) -> int:
    """Sync-free mode: rank 0's first output allocation fails (out of memory). Every output is allocated
    before the first launch, so nothing was enqueued: the same call again pairs with the dispatch its peers
    are in, and the rows are the oracle's. (Before, the layout and send had run: the retry met the peers'
    next op.)"""
    _, elastic = make_backends(ctx, 512, blocking=False)
    inputs = all_inputs(900, ctx.world_size, 0, 512, 4, skewed=False, drop_some=True)
    x, idx, w, _, _ = inputs[ctx.rank]
    checked = 0
    for expand in (False, True):
        if ctx.rank == 0:
            def failing_once(*shape, dtype):
                del elastic._empty  # the next allocation (the retry's) is the backend's own again
                raise torch.cuda.OutOfMemoryError("planted: the first output allocation fails")

            elastic._empty = failing_once
            with pytest.raises(torch.cuda.OutOfMemoryError, match="planted"):
                elastic.dispatch(x, topk_idx=idx, topk_weights=w, expand=expand)
        out = elastic.dispatch(x, topk_idx=idx, topk_weights=w, expand=expand)
        if not expand:
            rows, ids, weights, _ = compact_oracle(ctx.rank, ctx.world_size, inputs, 1)
            valid = int(out.num_valid_rows)
            assert valid == rows.shape[0] and torch.equal(out.hidden[:valid], rows), "rows after the retry"
            assert torch.equal(out.topk_idx[:valid], ids) and torch.equal(out.probs[:valid], weights)
            want, _ = compact_combine_oracle(x, idx, w, ctx.world_size)
            back = elastic.combine(expert_side_rows(out.hidden, ctx.rank), out.handle).hidden
            assert torch.equal(back, want), "combine after the retry"
        else:
            elastic.combine(out.hidden, out.handle)
        elastic.check_errors()
        checked += 1
    torch.cuda.synchronize()
    elastic.destroy()
    return checked


def dropped_ids_reported_after_a_clean_dispatch(ctx) -> int:
    """Sync-free mode drops ids out of range and check_errors() reports them later: also when a clean
    dispatch came in between (it read the last dispatch's flags only), once."""
    _, elastic = make_backends(ctx, 256, blocking=False)
    x, idx, w, _, _ = make_inputs(950, ctx.rank, ctx.world_size, 30, 256, NUM_EXPERTS, 2, skewed=False,
                                  drop_some=False)
    bad = idx.clone()
    if ctx.rank == 0:
        bad[0, 0] = NUM_EXPERTS + 7
    for routing in (bad, idx):
        out = elastic.dispatch(x, topk_idx=routing, topk_weights=w)
        elastic.combine(out.hidden, out.handle)
    if ctx.rank == 0:
        with pytest.raises(ValueError, match="outside -1"):
            elastic.check_errors()
    elastic.check_errors()  # reported once; the others had nothing to report
    torch.cuda.synchronize()
    elastic.destroy()
    return 1


def padding_rows_get_zero_gradient(ctx) -> int:
    """The backward of combine hands the expanded form's padding rows a zero gradient, also when the dispatch
    left them unzeroed (zero_padding=False, DeepEP V2's default): a grouped GEMM runs over them, and its weight
    gradient would take in whatever the backward's output memory held. Here that memory starts as NaN."""
    hidden = 256
    _, elastic = make_backends(ctx, hidden)
    x, idx, w, _, _ = make_inputs(960, ctx.rank, ctx.world_size, tokens_of(ctx.rank, 0), hidden, NUM_EXPERTS, 4,
                                  skewed=False, drop_some=True)
    x.requires_grad_(True)
    out = ep_plugin.dispatch(elastic, x, topk_idx=idx, topk_weights=w, expand=True, pad_multiple=16)
    grads = []
    out.hidden.register_hook(grads.append)
    z = ep_plugin.combine(out.hidden * 2, out.handle)
    elastic._empty = lambda *shape, dtype: torch.full(shape, float("nan"), dtype=dtype, device=ctx.device)
    z.float().sum().backward()
    grad = grads[0]
    padded, real = out.tokens_per_expert.tolist(), out.handle.num_real_tokens_per_expert.tolist()
    is_padding = torch.cat([torch.arange(p, device=ctx.device) >= r for p, r in zip(padded, real, strict=True)])
    assert sum(padded) > sum(real), "no padding rows: the test checks nothing"
    rows = grad[: is_padding.numel()]
    assert torch.equal(rows[is_padding], torch.zeros_like(rows[is_padding])), "padding rows' gradient is not zero"
    assert torch.equal(rows[~is_padding], torch.full_like(rows[~is_padding], 2)), "token rows' gradient"
    torch.cuda.synchronize()
    elastic.destroy()
    return 1


def test_padding_rows_get_zero_gradient():
    assert run_ranks(padding_rows_get_zero_gradient, 2, device="cuda", timeout_s=LAUNCH_TIMEOUT_S) == [1, 1]


def padding_counts_and_destroy(ctx) -> dict:
    """Three ways a saved or handed-out tensor went wrong without an error:
    - an expanded dispatch that autograd records left its padding rows and weights as the memory held (here
      NaN): a grouped GEMM over the padded segments took NaN * 0 = NaN into its weight gradient;
    - the counts a dispatch hands out are what its cached dispatch and combine's backward read again: changed
      in place (cumsum_ for offsets), they zeroed other experts' rows there;
    - destroy() freed the rows of an in-place dispatch that a backward had saved, which then read freed
      memory instead of raising."""
    hidden = 256
    _, elastic = make_backends(ctx, hidden)
    x, idx, w, _, _ = make_inputs(961, ctx.rank, ctx.world_size, tokens_of(ctx.rank, 0), hidden, NUM_EXPERTS, 4,
                                  skewed=False, drop_some=True)
    found = {}
    real_empty = elastic._empty
    elastic._empty = lambda *shape, dtype: torch.full(shape, float("nan"), dtype=dtype, device=ctx.device)
    out = ep_plugin.dispatch(elastic, x.requires_grad_(True), topk_idx=idx, topk_weights=w.requires_grad_(True),
                             expand=True, pad_multiple=16)
    elastic._empty = real_empty
    padded, real = out.tokens_per_expert.tolist(), out.handle.num_real_tokens_per_expert.tolist()
    is_padding = torch.cat([torch.arange(p, device=ctx.device) >= r for p, r in zip(padded, real, strict=True)])
    assert sum(padded) > sum(real), "no padding rows: the test checks nothing"
    rows, probs = out.hidden[: is_padding.numel()], out.probs[: is_padding.numel()]
    found["padding zeroed"] = bool((rows[is_padding] == 0).all() and (probs[is_padding] == 0).all())

    # Counts changed in place: every rank changes its own, so every rank refuses (no peer waits).
    z = ep_plugin.combine(out.hidden * 2, out.handle)
    out.tokens_per_expert.cumsum_(0)
    for what, op in (("cached dispatch", lambda: elastic.dispatch(x.detach(), handle=out.handle)),
                     ("backward", lambda: z.float().sum().backward())):
        try:
            op()
            found[what] = "ran"
        except ValueError as error:
            found[what] = "refused" if "changed in place" in str(error) else str(error)
    again = elastic.dispatch(x.detach(), topk_idx=idx, topk_weights=w.detach(), expand=True, pad_multiple=16,
                             zero_padding=True)
    cached = elastic.dispatch(x.detach(), handle=again.handle, zero_padding=True)  # usable afterwards
    found["usable after"] = torch.equal(cached.hidden[:sum(again.tokens_per_expert_list)],
                                        again.hidden[:sum(again.tokens_per_expert_list)])
    elastic.destroy()

    # destroy() with in-place rows saved by a backward.
    config = Config.from_env(max_tokens_per_rank=MAX_TOKENS, timeout_s=20.0, num_sms=8)
    in_place = ep_plugin.get_backend("elastic")(hidden_size=hidden, num_experts=NUM_EXPERTS, device=ctx.device,
                                                config=config, max_topk=8, in_place_dispatch=True)
    placed = in_place.dispatch(x.detach(), topk_idx=idx, topk_weights=w.detach(), in_place=True)
    scale = torch.ones(hidden, dtype=torch.bfloat16, device=ctx.device, requires_grad=True)
    saved = (placed.hidden * scale).float().sum()  # saves the in-place rows for scale's gradient
    torch.cuda.synchronize()
    in_place.destroy()
    try:
        saved.backward()
        found["backward after destroy"] = "ran"
    except RuntimeError as error:
        found["backward after destroy"] = "raised" if "inplace operation" in str(error) else str(error)
    return found


def test_padding_counts_and_destroy_leave_no_silent_wrong_values():
    results = run_ranks(padding_counts_and_destroy, 2, device="cuda", timeout_s=LAUNCH_TIMEOUT_S)
    expected = {"padding zeroed": True, "cached dispatch": "refused", "backward": "refused", "usable after": True,
                "backward after destroy": "raised"}
    assert results == [expected, expected], results


def run_suite(ctx, hidden_sizes) -> dict:
    counts = {}
    for hidden in hidden_sizes:
        counts[f"sweep{hidden}"] = sweep(ctx, hidden)
    counts["fp8"] = fp8_and_no_weights(ctx, hidden_sizes[-1])
    counts["autograd"] = autograd_end_to_end(ctx)
    counts["non_blocking"] = non_blocking_and_graph(ctx)
    counts["bad_input"] = bad_input_then_good(ctx)
    counts["allocation_failure"] = allocation_failure_then_retry(ctx)
    counts["dropped_ids"] = dropped_ids_reported_after_a_clean_dispatch(ctx)
    counts["in_place"] = combine_in_place(ctx)
    counts["dispatch_in_place"] = dispatch_in_place(ctx)
    return counts


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_elastic_matches_oracles(num_ranks):
    results = run_ranks(run_suite, num_ranks, (2048, 7168), device="cuda", timeout_s=LAUNCH_TIMEOUT_S)
    assert results[0]["sweep2048"] == 24 and results[0]["sweep7168"] == 24, results[0]
    assert all(r == results[0] for r in results)


def test_elastic_register_copies_match_oracles():
    """The register copy engine (EP_PLUGIN_BULK_COPY=0, the path below sm_90) passes the same suite, with
    rows longer than one bulk chunk (H=12288: 24 KiB)."""
    results = run_ranks(run_suite, 2, (12288,), device="cuda", timeout_s=LAUNCH_TIMEOUT_S,
                        env={"EP_PLUGIN_BULK_COPY": "0"})
    assert results[0]["sweep12288"] == 24 and all(r == results[0] for r in results), results


# ---- the receive-lifetime contract ------------------------------------------------------------

# Cycles of the side stream's sleep kernel before its late read: about 2 s on an H200 (1.98 GHz), far
# longer than the main stream's work in between (milliseconds).
READER_DELAY_CYCLES = 4_000_000_000
FILLERS = 32  # same-size allocations the caller makes while the reader sleeps


def delayed_reader(ctx, use_helper: bool) -> dict:
    """A sync-free output's prefix is read late on a side stream while the caller drops its references,
    runs more dispatches and fills same-size allocations. Returns whether the reader saw the right rows,
    whether the output's memory was handed to another tensor (and overwritten) before the read, and
    whether the read was still pending when the caller's work had finished (the window was open).

    The read is enqueued behind a sleep kernel on the side stream before the references are dropped.
    Nothing in the window may call cudaMalloc: a device allocation waits for every stream (the
    sleeping reader's too), which would close the window (the read would run first and see the
    original rows). So the allocator is warmed first with everything the window allocates. With
    ``out.use_on(side)`` (wait on the ready event + record_stream) the allocator keeps the storage
    for the side stream; the negative control only waits on the event, so the lowest cached block of
    that size, the output's, goes to the next allocation and the late read sees its data. Rows are
    wide enough (12 MiB outputs) that the allocator gives each such tensor a block of its own, never
    a piece of a split one, so "the same block" is "the same address"."""
    hidden = 24576
    _, elastic = make_backends(ctx, hidden, blocking=False)
    me, world = ctx.rank, ctx.world_size
    inputs = all_inputs(900, world, 0, hidden, 4, skewed=False, drop_some=False)
    x, idx, w, _, _ = inputs[me]
    expected, _, _, _ = compact_oracle(me, world, inputs, 1)
    size = (world * MAX_TOKENS, hidden)

    def callers_work():  # what the caller does while the reader sleeps
        later = [elastic.dispatch(x + 1, topk_idx=idx, topk_weights=w).hidden for _ in range(3)]
        return later + [torch.full(size, -7.0, dtype=torch.bfloat16, device=ctx.device) for _ in range(FILLERS)]

    warm = callers_work() + [torch.empty(size, dtype=torch.bfloat16, device=ctx.device)]
    torch.cuda.synchronize()
    del warm  # all cached now, one block of that size more than the window takes
    out = elastic.dispatch(x, topk_idx=idx, topk_weights=w)  # the lowest cached block of its size
    address = out.hidden.data_ptr()
    side = torch.cuda.Stream()
    if use_helper:
        out.use_on(side)
    else:
        side.wait_event(out.ready)
    prefix = out.hidden[:expected.shape[0]]
    with torch.cuda.stream(side):
        seen = torch.empty_like(prefix)  # allocated before the sleep: this one may cudaMalloc
        torch.cuda._sleep(READER_DELAY_CYCLES)  # the reader comes late
        seen.copy_(prefix)
    del out, prefix  # the caller keeps no reference
    taken = callers_work()
    reusers = [t for t in taken if t.data_ptr() == address]
    done = torch.cuda.Event()
    done.record()
    done.synchronize()  # the caller's writes have landed ...
    reader_pending = not side.query()  # ... while the reader still sleeps
    # What the memory holds before the read (read on the main stream): did its new owner write it?
    overwritten = bool(reusers) and not torch.equal(reusers[0][:expected.shape[0]], expected)
    torch.cuda.synchronize()
    correct = torch.equal(seen, expected)
    del taken
    elastic.destroy()
    return {"correct": correct, "reused_before_read": bool(reusers), "overwritten_before_read": overwritten,
            "reader_pending": reader_pending}


def test_sync_free_output_survives_a_delayed_side_stream_reader():
    results = run_ranks(delayed_reader, 2, True, device="cuda", timeout_s=180)
    # The reader was still pending when the main stream's later work had finished: the window was open.
    outcome = [(r["correct"], r["reused_before_read"], r["reader_pending"]) for r in results]
    assert outcome == [(True, False, True)] * 2, results


def test_negative_control_without_record_stream_reads_other_rows():
    """The same test without record_stream: the allocator hands the output's storage to another tensor
    while the reader is pending, the new owner writes it, and the late read returns its rows instead of
    the dispatched ones: the corruption the test above guards against, so that test can fail."""
    results = run_ranks(delayed_reader, 2, False, device="cuda", timeout_s=180)
    assert all(r["reused_before_read"] and r["overwritten_before_read"] and r["reader_pending"] for r in results), \
        results
    assert not any(r["correct"] for r in results), results


# ---- autosizing (faults of both compiled backends: test_faults_gpu.py) ------------------------

def autosized(ctx) -> dict:
    """num_sms=0: every rank runs the same autosized grid, within the co-residency limit, and it works."""
    _, elastic = make_backends(ctx, 512, num_sms=0)
    x, idx, w, _, _ = make_inputs(950, ctx.rank, ctx.world_size, 30, 512, NUM_EXPERTS, 2, skewed=False,
                                  drop_some=False)
    out = elastic.dispatch(x, topk_idx=idx, topk_weights=w)
    back = elastic.combine(out.hidden, out.handle)
    sharing = -(-ctx.world_size // torch.cuda.device_count())
    limit = torch.cuda.get_device_properties(ctx.device).multi_processor_count // sharing
    result = {"blocks": elastic.num_blocks, "limit": limit, "shape": tuple(back.hidden.shape)}
    elastic.destroy()
    return result


def test_elastic_autosizes_sms_when_num_sms_is_zero():
    results = run_ranks(autosized, 4, device="cuda", timeout_s=120)
    blocks = {r["blocks"] for r in results}
    assert len(blocks) == 1, results  # one grid size on every rank
    (count,) = blocks
    assert 1 <= count <= results[0]["limit"] and (count % 2 == 0 or count < 4), results
    assert all(r["shape"] == (30, 512) for r in results), results
