"""``hybrid`` combine in place: the expert output written into ``combine_input(handle)`` (the backend's
buffer) and read by the sources where it is, on 2 and 8 ranks (ranks share the GPU under MPS where
there are fewer GPUs).

The oracle is exact: each expert scales its rows by a factor of its own, so a source knows every
row it should read (bf16(x_t * c_e) for each chosen expert e) and the sum the kernel must produce:
all of a token's rows added in fp32 in expert order (rank order, then local-expert order), rounded
once. A wrong row, a missing or extra one, another order or an intermediate rounding changes bits.
The two-stage combine of the same rows has an exact oracle too: each rank's partial rounded to bf16,
the partials added in fp32 in rank order and rounded once more.
All tests need a GPU and the compiled extension; without them they skip (fail under --require-gpu).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from test_hybrid import assert_combine_close, make_inputs, routing_kwargs, tokens_of

import ep_plugin
from ep_plugin.backends.hybrid import HybridBackend
from ep_plugin.config import Config
from ep_plugin.testing import run_ranks

pytestmark = pytest.mark.gpu

MAX_TOKENS = 128
HIDDEN = 1024
LAUNCH_TIMEOUT_S = 420


def expert_scales(num_experts: int, device) -> torch.Tensor:
    """c_e = 1 + e / 16: a factor per expert, exact in fp32."""
    return 1 + torch.arange(num_experts, device=device, dtype=torch.float32) / 16


def expert_of_rows(tokens_per_expert: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The local expert of each of ``num_rows`` expert-grouped rows (no host sync: graph-safe;
    rows past the segments get the last expert)."""
    ends = torch.cumsum(tokens_per_expert, 0)
    rows = torch.arange(num_rows, device=tokens_per_expert.device)
    return torch.searchsorted(ends, rows, right=True).clamp_(max=tokens_per_expert.numel() - 1)


def expert_product(out, rank: int, scales: torch.Tensor) -> torch.Tensor:
    """row * c_e in fp32 for each row of local expert e (what expert_output rounds)."""
    local = out.tokens_per_expert.numel()
    experts = rank * local + expert_of_rows(out.tokens_per_expert, out.hidden.shape[0])
    return out.hidden.float() * scales[experts].unsqueeze(1)


def expert_output(out, rank: int, scales: torch.Tensor) -> torch.Tensor:
    """What expert e of this rank returns for its rows: bf16(row * c_e)."""
    return expert_product(out, rank, scales).to(torch.bfloat16)


def chosen_experts(form: str, inputs, num_experts: int) -> torch.Tensor:
    """[T, E] bool: the experts each token is dispatched to."""
    _, topk_idx, _, routing_map, _ = inputs
    if form == "routing_map":
        return routing_map
    chosen = torch.zeros(topk_idx.shape[0], num_experts + 1, dtype=torch.bool, device=topk_idx.device)
    return chosen.scatter_(1, torch.where(topk_idx < 0, num_experts, topk_idx), True)[:, :num_experts]


def add_expert_rows(total: torch.Tensor, x: torch.Tensor, chosen: torch.Tensor, scales: torch.Tensor,
                    experts) -> torch.Tensor:
    """total += bf16(x * c_e) of every chosen expert e of ``experts``, one after the other, in fp32."""
    for e in experts:
        row = (x.float() * scales[e]).to(torch.bfloat16).float()
        total += torch.where(chosen[:, e:e + 1], row, 0.0)
    return total


def one_pass_sum(x: torch.Tensor, chosen: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The in-place combine's result: bf16 of the fp32 sum, in expert order, of bf16(x * c_e)."""
    total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return add_expert_rows(total, x, chosen, scales, range(chosen.shape[1])).to(torch.bfloat16)


def combine_sum(x: torch.Tensor, chosen: torch.Tensor, scales: torch.Tensor, num_ranks: int, pushed) -> torch.Tensor:
    """A combine in which the ranks in ``pushed`` sent partial sums (bf16 of the fp32 sum of their rows,
    local-expert order) and the others' rows were read where they lie: in rank order, a pushed rank's
    partial or the other rank's rows one by one, all added in fp32 and rounded once."""
    local = chosen.shape[1] // num_ranks
    total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for p in range(num_ranks):
        lo, hi = p * local, (p + 1) * local  # rank p's experts
        if p in pushed:
            total += one_pass_sum(x, chosen[:, lo:hi], scales[lo:hi]).float()
        else:
            add_expert_rows(total, x, chosen, scales, range(lo, hi))
    return total.to(torch.bfloat16)


def two_stage_sum(x: torch.Tensor, chosen: torch.Tensor, scales: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """The two-stage combine's result: each rank's partial rounded to bf16, the partials added in fp32
    in rank order, rounded once more."""
    return combine_sum(x, chosen, scales, num_ranks, pushed=range(num_ranks))


def make_backends(ctx, num_experts: int, combine_input_rows: int, **config):
    config = Config.from_env(**{"max_tokens_per_rank": MAX_TOKENS, "timeout_s": 20.0, "num_sms": 8, **config})
    reference = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=num_experts, device=ctx.device,
                                                   config=config)
    hybrid = HybridBackend(hidden_size=HIDDEN, num_experts=num_experts, device=ctx.device, config=config,
                           combine_input_rows=combine_input_rows)
    return reference, hybrid


def check_peer_rows(ctx, out, pad: int, budget: int) -> None:
    """peer_rows[p] (derived by this rank in the exchange) is p's own row_base[this rank], and p's budget."""
    layout = out.handle.layout
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, layout.scratch.tensor("row_base").cpu())
    peer_rows = layout.scratch.tensor("peer_rows").cpu()
    for p, row_base in enumerate(everyone):
        assert torch.equal(peer_rows[p, :-1], row_base[ctx.rank]), (pad, p, peer_rows[p], row_base[ctx.rank])
        assert int(peer_rows[p, -1]) == budget, (p, int(peer_rows[p, -1]), budget)


def blocking_sweep(ctx) -> int:
    """Blocking mode: every routing form, top-k, padding and skew; with and without scalars routed
    back; top-k 40 of 64 experts lists more rows per token than a warp keeps (the unlisted path)."""
    checked = 0
    for num_experts in (32, 64):
        local = num_experts // ctx.world_size
        room = HybridBackend.worst_case_rows(ctx.world_size, MAX_TOKENS, local, 40, 16)
        reference, hybrid = make_backends(ctx, num_experts, room)
        scales = expert_scales(num_experts, ctx.device)
        topks = (1, 3, 8) if num_experts == 32 else (40,)
        for case, (topk, pad, skewed, form) in enumerate(
                itertools.product(topks, (1, 16), (False, True), ("routing_map", "topk"))):
            name = f"E={num_experts} R={ctx.world_size} topk={topk} pad={pad} skewed={skewed} form={form}"
            inputs = make_inputs(700 + case, ctx.rank, ctx.world_size, tokens_of(ctx.rank, case), HIDDEN,
                                 num_experts, topk, skewed=skewed, drop_some=case % 3 == 0)
            kwargs = routing_kwargs(form, inputs)
            out = hybrid.dispatch(inputs[0], pad_multiple=pad, **kwargs)
            ref = reference.dispatch(inputs[0], pad_multiple=pad, **kwargs)
            check_peer_rows(ctx, out, pad, hybrid._C.UNBOUNDED_ROWS)
            rows = hybrid.combine_input(out.handle)
            assert rows.shape == out.hidden.shape and rows.dtype == torch.bfloat16, name
            rows.copy_(expert_output(out, ctx.rank, scales))
            row_probs = out.probs * 3 + 1 if case % 2 else None
            back = hybrid.combine(rows, out.handle, row_probs=row_probs)
            expected = one_pass_sum(inputs[0], chosen_experts(form, inputs, num_experts), scales)
            assert torch.equal(back.hidden, expected), f"{name}: in-place combine"
            if row_probs is not None:
                ref_back = reference.combine(expert_output(ref, ctx.rank, scales), ref.handle,
                                             row_probs=ref.probs * 3 + 1)
                assert torch.equal(back.probs, ref_back.probs), f"{name}: scalars routed back"
            # The same handle again through the two-stage combine (a tensor of the caller's own):
            # exact too, with every rank's partial rounded to bf16 before the source adds them.
            staged = hybrid.combine(rows.clone(), out.handle, row_probs=row_probs)
            staged_expected = two_stage_sum(inputs[0], chosen_experts(form, inputs, num_experts), scales,
                                            ctx.world_size)
            assert torch.equal(staged.hidden, staged_expected), f"{name}: two-stage combine"
            if row_probs is not None:
                assert torch.equal(staged.probs, back.probs), f"{name}: two-stage scalars routed back"
            checked += 1
        torch.cuda.synchronize()
        hybrid.destroy()
    return checked


def over_budget(ctx) -> int:
    """Non-blocking with a budget of 48 rows (most ranks receive more): rows a rank dropped are not
    read. The buffer past the budget holds NaN, so reading a dropped row would show; the result
    equals the two-stage combine's, which drops the same rows (up to its partial-sum rounding)."""
    num_experts = 32
    budget = 48
    reference, hybrid = make_backends(ctx, num_experts, 4 * budget, blocking=False, num_permuted_tokens=budget)
    scales = expert_scales(num_experts, ctx.device)
    inputs = make_inputs(800, ctx.rank, ctx.world_size, 60, HIDDEN, num_experts, 4, skewed=True, drop_some=False)
    out = hybrid.dispatch(inputs[0], pad_multiple=16, **routing_kwargs("topk", inputs))
    check_peer_rows(ctx, out, 16, budget)
    whole = hybrid.buffer.region_tensor(hybrid.regions.off_comb_input, (hybrid.regions.combine_input_bytes // 2,),
                                        torch.bfloat16)
    whole.fill_(float("nan"))  # the whole arena, wherever the combine input lands
    rows = hybrid.combine_input(out.handle)
    rows.copy_(expert_output(out, ctx.rank, scales))
    back = hybrid.combine(rows, out.handle)
    staged = hybrid.combine(rows.clone(), out.handle)
    assert not bool(back.hidden.isnan().any()), "a row past a rank's budget was read"
    assert_combine_close(back.hidden, staged.hidden, "over budget: in place vs two-stage")
    needed = int(reference.dispatch(inputs[0], pad_multiple=16, **routing_kwargs("topk", inputs))
                 .tokens_per_expert.sum())
    assert int(out.handle.layout.overflow) == int(needed > budget)
    torch.cuda.synchronize()
    hybrid.destroy()
    return 1


def graph_replays(ctx) -> int:
    """Non-blocking, worst-case budget: dispatch, the expert's write into combine_input and the
    in-place combine captured in one CUDA graph and replayed with new inputs."""
    num_experts = 32
    local = num_experts // ctx.world_size
    _, hybrid = make_backends(ctx, num_experts, HybridBackend.worst_case_rows(ctx.world_size, MAX_TOKENS, local, 2, 8),
                              blocking=False, num_permuted_tokens=0)
    scales = expert_scales(num_experts, ctx.device)
    static = [t.clone() for t in make_inputs(900, ctx.rank, ctx.world_size, 40 + ctx.rank, HIDDEN, num_experts, 2,
                                             skewed=False, drop_some=False)]

    def step():
        out = hybrid.dispatch(static[0], pad_multiple=8, **routing_kwargs("topk", static))
        rows = hybrid.combine_input(out.handle)
        rows.copy_(expert_output(out, ctx.rank, scales))
        return hybrid.combine(rows, out.handle)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_back = step()
    checked = 0
    for replay in range(6):
        fresh = make_inputs(950 + replay, ctx.rank, ctx.world_size, 40 + ctx.rank, HIDDEN, num_experts, 2,
                            skewed=replay % 2 == 1, drop_some=replay % 3 == 0)
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        expected = one_pass_sum(fresh[0], chosen_experts("topk", fresh, num_experts), scales)
        assert torch.equal(graph_back.hidden, expected), f"replay {replay}"
        checked += 1
    torch.cuda.synchronize()
    hybrid.destroy()
    return checked


def autograd_and_misuse(ctx) -> int:
    """ep_plugin.combine of the combine input: forward in place, gradients as through the reference.
    A combine_input_rows that is no int >= 0 is refused at construction; combine_input is refused
    (before any launch) without room or with too little, and the backend goes on; so is a combine of
    the buffer's combine input for a handle it was not handed out for (rows in another order)."""
    num_experts = 32
    inputs = make_inputs(1000, ctx.rank, ctx.world_size, tokens_of(ctx.rank, 0), HIDDEN, num_experts, 4,
                         skewed=False, drop_some=True)
    reference, hybrid = make_backends(ctx, num_experts, 2048)
    grads = []
    for backend in (reference, hybrid):
        x = inputs[0].clone().requires_grad_(True)
        out = ep_plugin.dispatch(backend, x, **routing_kwargs("topk", inputs, with_probs=False))
        y = out.hidden * 2
        if backend is hybrid:
            rows = hybrid.combine_input(out.handle)
            rows.copy_(y)  # the expert's write: autograd records the copy
            y = rows
        z = ep_plugin.combine(y, out.handle)
        z.float().square().sum().backward()
        grads.append((z.detach(), x.grad))
    (z_ref, gx_ref), (z, gx) = grads
    assert_combine_close(z, z_ref, "autograd: forward")
    assert_combine_close(gx, gx_ref, "autograd: hidden grad")
    # The recorded write stays with that tensor: a later combine input carries no history.
    again = hybrid.combine_input(out.handle)
    assert again.grad_fn is None and not again.requires_grad, "the combine input kept the last write's history"

    # The buffer holds one combine input: A's rows passed for B, or A's after B took the buffer, are refused.
    first = hybrid.dispatch(inputs[0], **routing_kwargs("topk", inputs))
    rows_first = hybrid.combine_input(first.handle)
    second = hybrid.dispatch(inputs[0] * 2, **routing_kwargs("topk", inputs))
    with pytest.raises(ValueError, match="holds it for another dispatch"):
        hybrid.combine(rows_first, second.handle)
    rows_second = hybrid.combine_input(second.handle)
    with pytest.raises(ValueError, match="holds it for another dispatch"):
        hybrid.combine(rows_first, first.handle)
    rows_second.copy_(second.hidden)
    back = hybrid.combine(rows_second, second.handle)  # still usable: its own handle combines as before
    ref = reference.dispatch(inputs[0] * 2, **routing_kwargs("topk", inputs))
    assert_combine_close(back.hidden, reference.combine(ref.hidden, ref.handle).hidden, "after the misuse")
    # Two batches in flight: right after the first's in-place combine a slower peer may still read the
    # buffer, so the second's combine input is refused (before any launch) until another op ran.
    first = hybrid.dispatch(inputs[0], **routing_kwargs("topk", inputs))
    second = hybrid.dispatch(inputs[0] * 2, **routing_kwargs("topk", inputs))
    rows_first = hybrid.combine_input(first.handle)
    rows_first.copy_(first.hidden)
    hybrid.combine(rows_first, first.handle)
    with pytest.raises(ValueError, match="may still be reading"):
        hybrid.combine_input(second.handle)
    hybrid.barrier()
    rows_second = hybrid.combine_input(second.handle)
    rows_second.copy_(second.hidden)
    back = hybrid.combine(rows_second, second.handle)
    assert_combine_close(back.hidden, reference.combine(ref.hidden, ref.handle).hidden, "two batches in flight")

    for bad, error in (("8", TypeError), (True, TypeError), (-1, ValueError)):  # refused before anything is built
        with pytest.raises(error, match="combine_input_rows"):
            HybridBackend(hidden_size=HIDDEN, num_experts=num_experts, device=ctx.device, combine_input_rows=bad)
    small, none = make_backends(ctx, num_experts, 8)[1], make_backends(ctx, num_experts, 0)[1]
    for backend, match in ((small, "has room for 8"), (none, "without room")):
        out = backend.dispatch(inputs[0], **routing_kwargs("topk", inputs))
        if out.hidden.shape[0] > 8 or backend is none:
            with pytest.raises(ValueError, match=match):
                backend.combine_input(out.handle)
        back = backend.combine(out.hidden, out.handle)  # still usable: the two-stage combine
        ref = reference.dispatch(inputs[0], **routing_kwargs("topk", inputs))
        assert_combine_close(back.hidden, reference.combine(ref.hidden, ref.handle).hidden, f"after refusal {match}")
        backend.destroy()
    hybrid.destroy()
    return 1


def arena(ctx) -> int:
    """Expert outputs computed by torch ops inside combine_input_arena() (at any offset of the arena),
    ranks that combine from the arena next to ranks that push partial sums (by choice, or because the
    arena was full), scalars routed back meanwhile: each result exactly the sum its ranks' forms give."""
    num_experts = 32
    room = HybridBackend.worst_case_rows(ctx.world_size, MAX_TOKENS, num_experts // ctx.world_size, 4, 16)
    _, hybrid = make_backends(ctx, num_experts, room)
    scales = expert_scales(num_experts, ctx.device)
    everyone = range(ctx.world_size)
    checked = 0
    # (case name, ranks that compute their output outside the arena, ranks whose arena is full)
    cases = (("all in the arena", (), ()), ("even ranks in the arena", everyone[1::2], ()),
             ("rank 0's arena full", (), (0,)), ("none in the arena", everyone, ()))
    for case, (name, outside, full) in enumerate(cases):
        for with_probs in (False, True):
            inputs = make_inputs(1100 + case, ctx.rank, ctx.world_size, tokens_of(ctx.rank, case), HIDDEN,
                                 num_experts, 4, skewed=case % 2 == 1, drop_some=case == 1)
            out = hybrid.dispatch(inputs[0], pad_multiple=16, **routing_kwargs("topk", inputs))
            hogs = []
            product = expert_product(out, ctx.rank, scales)
            if ctx.rank in outside:
                rows = expert_output(out, ctx.rank, scales)
            else:
                with hybrid.combine_input_arena() as usable:
                    assert usable, f"{name}: the arena routes nothing ({hybrid.arena.unusable_reason})"
                    if ctx.rank in full:  # the pool's two segments (2 MiB of small blocks, the rest) taken whole
                        hogs = [torch.empty(1 << 20, dtype=torch.uint8, device=ctx.device) for _ in range(2)]
                        hogs.append(torch.empty(hybrid.arena.nbytes - (2 << 20), dtype=torch.uint8,
                                                device=ctx.device))
                    hogs.append(torch.empty(1000, dtype=torch.uint8, device=ctx.device))  # the output lands past it
                    rows = product.to(torch.bfloat16)  # the fp32 product (twice the bytes) stays outside
            offset = hybrid.arena.offset_of(rows)
            # Skewed routing sends every token to rank 0's experts: the other ranks have no rows to place.
            in_arena = ctx.rank not in outside and ctx.rank not in full and rows.numel() > 0
            assert (offset is not None) == in_arena, f"{name}: rank {ctx.rank} output at arena offset {offset}"
            assert offset is None or offset > 0, f"{name}: the output should lie past the other block"
            assert hybrid.arena.lent_parts() == 2, hybrid.arena.lent_parts()
            counts = dict(hybrid.combine_counts)
            row_probs = out.probs * 3 + 1 if with_probs else None
            back = hybrid.combine(rows, out.handle, row_probs=row_probs)
            kind = "in_place" if in_arena else "pushed"
            assert hybrid.combine_counts[kind] == counts.get(kind, 0) + 1, f"{name}: counted as {kind}"
            expected = combine_sum(inputs[0], chosen_experts("topk", inputs, num_experts), scales, ctx.world_size,
                                   pushed=set(outside) | set(full))
            assert torch.equal(back.hidden, expected), f"{name}, probs={with_probs}: rank {ctx.rank}"
            if with_probs:
                staged = hybrid.combine(rows.clone(), out.handle, row_probs=row_probs)
                assert torch.equal(back.probs, staged.probs), f"{name}: scalars routed back"
            # Right after an in-place combine nothing goes to the arena until the next op (with probs,
            # the two-stage combine of the copy was that op).
            with hybrid.combine_input_arena() as usable:
                assert usable == (not in_arena or with_probs), f"{name}: arena open while peers may read"
            del hogs, rows, back, product  # the next case's hogs need the arena empty
            torch.cuda.synchronize()  # and their frees retired (they were recorded on the stream)
            checked += 1
    # A combine inside a routing context is refused (a block freed there could be handed out again while
    # the peers read it), and so is combine_input on a backend whose arena the context took; both
    # before any launch, and the backend goes on.
    inputs = make_inputs(1190, ctx.rank, ctx.world_size, 40, HIDDEN, num_experts, 4, skewed=False, drop_some=False)
    out = hybrid.dispatch(inputs[0], **routing_kwargs("topk", inputs))
    with pytest.raises(ValueError, match="serves combine_input_arena"):
        hybrid.combine_input(out.handle)
    product = expert_product(out, ctx.rank, scales)
    with hybrid.combine_input_arena() as usable:
        assert usable
        rows = product.to(torch.bfloat16)
        with pytest.raises(ValueError, match="inside combine_input_arena"):
            hybrid.combine(rows, out.handle)
    back = hybrid.combine(rows, out.handle)
    assert torch.equal(back.hidden, one_pass_sum(inputs[0], chosen_experts("topk", inputs, num_experts), scales))
    del rows, back
    hybrid.barrier()
    with hybrid.combine_input_arena() as usable:
        assert usable, "the arena stays closed after the next op"
        # Rank 0's pool took ordinary memory while its arena was full; empty now, it was made anew.
        assert hybrid.arena.fallback_segments() == 0, hybrid.arena.fallback_segments()
        probe = torch.empty(MAX_TOKENS, HIDDEN, dtype=torch.bfloat16, device=ctx.device)
    assert hybrid.arena.offset_of(probe) is not None, "after the arena ran full, outputs no longer land there"
    # torch gives a segment's blocks to one stream: once empty, the arena follows the current stream.
    del probe
    side = torch.cuda.Stream(ctx.device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), hybrid.combine_input_arena():
        on_side = torch.empty(MAX_TOKENS, HIDDEN, dtype=torch.bfloat16, device=ctx.device)
    assert hybrid.arena.offset_of(on_side) is not None, "an output on another stream missed the empty arena"
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    hybrid.destroy()
    return checked


def arena_tensor_outliving_its_backend(ctx) -> int:
    """A tensor of the arena alive at destroy(): the buffer was freed, the next backend's buffer came back at
    the same address, and when torch gave the old pool's segment back late, the new arena's part was marked
    free while the new pool held it (two pools lending the same bytes). Now the old buffer stays allocated
    (a warning says so): the new arena lies elsewhere, and the late free changes nothing of it."""
    num_experts = 32
    room = HybridBackend.worst_case_rows(ctx.world_size, MAX_TOKENS, num_experts // ctx.world_size, 4, 16)
    _, first = make_backends(ctx, num_experts, room)
    with first.combine_input_arena() as usable:
        assert usable, first.arena.unusable_reason
        kept = torch.ones(1000, dtype=torch.bfloat16, device=ctx.device)
    old_address = first.arena.address
    first.destroy()
    assert first.keep_buffer_memory
    _, second = make_backends(ctx, num_experts, room)
    with second.combine_input_arena() as usable:
        assert usable, second.arena.unusable_reason
        fresh = torch.full((1000,), 2.0, dtype=torch.bfloat16, device=ctx.device)
    assert second.arena.address != old_address and second.arena.lent_parts() == 2
    del kept
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the old pool gives its segment back now
    assert second.arena.lent_parts() == 2, second.arena.lent_parts()
    with second.combine_input_arena() as usable:  # a new block must not land on fresh's bytes
        other = torch.zeros(1000, dtype=torch.bfloat16, device=ctx.device)
    assert other.data_ptr() != fresh.data_ptr() and float(fresh.float().sum()) == 2000.0
    del fresh, other
    torch.cuda.synchronize()
    second.destroy()
    assert not second.keep_buffer_memory
    return 1


def combine_input_outliving_its_backend(ctx) -> int:
    """A combine_input view (rows of the backend's own buffer) alive at destroy(): the buffer was freed under it,
    and a write to it went to whatever the driver put there next. Now the buffer stays allocated (a warning
    says so); with no view alive, destroy() frees it."""
    num_experts = 32
    room = HybridBackend.worst_case_rows(ctx.world_size, MAX_TOKENS, num_experts // ctx.world_size, 2, 16)
    for keep_the_view in (True, False):
        _, hybrid = make_backends(ctx, num_experts, room)
        inputs = make_inputs(950, ctx.rank, ctx.world_size, 24, HIDDEN, num_experts, 2, skewed=False,
                             drop_some=False)
        out = hybrid.dispatch(inputs[0], **routing_kwargs("topk", inputs))
        rows = hybrid.combine_input(out.handle)
        rows.copy_(out.hidden)
        back = hybrid.combine(rows, out.handle).hidden
        del out, back
        if not keep_the_view:
            del rows
        torch.cuda.synchronize()
        hybrid.destroy()
        assert hybrid.buffer.kept_for_views == keep_the_view, keep_the_view
        if keep_the_view:
            rows.fill_(1.0)  # its memory is still this buffer's
            torch.cuda.synchronize()
            del rows
    return 1


def run_suite(ctx) -> dict:
    return {"blocking": blocking_sweep(ctx), "over_budget": over_budget(ctx), "graph": graph_replays(ctx),
            "autograd": autograd_and_misuse(ctx), "arena": arena(ctx),
            "arena outliving its backend": arena_tensor_outliving_its_backend(ctx),
            "combine input outliving its backend": combine_input_outliving_its_backend(ctx)}


@pytest.mark.parametrize("num_ranks", [2, 8])
def test_hybrid_combine_in_place_is_the_one_pass_sum(num_ranks):
    results = run_ranks(run_suite, num_ranks, device="cuda", timeout_s=LAUNCH_TIMEOUT_S)
    assert results[0] == {"blocking": 3 * 8 + 8, "over_budget": 1, "graph": 6, "autograd": 1, "arena": 8,
                          "arena outliving its backend": 1, "combine input outliving its backend": 1}, results[0]
    assert all(r == results[0] for r in results)


def first_used_in_inference_mode(ctx, name: str) -> dict:
    """Built and first used under torch.inference_mode() (a Megatron evaluation or generation pass that comes
    first builds the backend there), then used outside it: the buffer's row views (combine_input, elastic's
    in-place rows) are written by the expert, and a sync-free backend's error flags are reset by check_errors()."""
    torch.manual_seed(ctx.rank)
    num_experts, tokens = 8, 64
    config = Config.from_env().replace(max_tokens_per_rank=MAX_TOKENS)
    options = {"combine_input_rows": 4 * MAX_TOKENS} if name == "hybrid" else {"in_place_dispatch": True}
    x = torch.randn(tokens, HIDDEN, device=ctx.device).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(num_experts, device=ctx.device)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, device=ctx.device)

    def round_trip(backend) -> torch.Tensor:
        in_place = {"in_place": True} if name == "elastic" else {}
        out = backend.dispatch(x, topk_idx=idx, topk_weights=weights, **in_place)
        rows = backend.combine_input(out.handle)
        if not torch.is_inference_mode_enabled():  # rows of the kept buffer tensor: not inference tensors
            assert not rows.is_inference() and not out.hidden.is_inference(), name
        rows.copy_(out.hidden)  # the expert (identity) writes its output into the backend's buffer
        return backend.combine(rows, out.handle).hidden

    def make(**changes):
        return ep_plugin.get_backend(name)(hidden_size=HIDDEN, num_experts=num_experts, device=ctx.device,
                                           config=config.replace(**changes), **options)

    with torch.inference_mode():
        backend, sync_free = make(), make(blocking=False)
        round_trip(backend)
    got = round_trip(backend)
    # Each token comes back once per row it was sent as: per expert (hybrid), per destination rank (elastic).
    per_rank = num_experts // ctx.world_size
    copies = 2 if name == "hybrid" else torch.tensor([len(set((row // per_rank).tolist())) for row in idx])
    expected = x.float() * (copies if name == "hybrid" else copies.to(ctx.device)[:, None])
    bad = idx.clone()
    bad[0, 0] = num_experts + 3  # out of range: sync-free kernels drop it, check_errors() reports it
    sync_free.dispatch(x, topk_idx=bad, topk_weights=weights)
    try:
        sync_free.check_errors()
        reported = "nothing"
    except ValueError:
        reported = "ValueError"
    backend.destroy()
    sync_free.destroy()
    return {"round trip exact": torch.equal(got.float(), expected), "dropped ids": reported}


@pytest.mark.parametrize("name", ["hybrid", "elastic"])
def test_a_backend_first_used_in_inference_mode_works_outside_it(name):
    """The buffer's row tensor was kept from its first use: made under inference mode, it was an inference
    tensor, so its later views were too (elastic then skips the autograd version bump of in-place rows it
    writes over, whose check tests is_inference()); and check_errors()'s reset of a sync-free backend's error
    flags made there raised RuntimeError instead of reporting the dropped ids."""
    results = run_ranks(first_used_in_inference_mode, 2, name, device="cuda", timeout_s=LAUNCH_TIMEOUT_S)
    assert all(r == {"round trip exact": True, "dropped ids": "ValueError"} for r in results), results
