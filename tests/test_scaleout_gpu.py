"""Scale-out on the GPU: ``hybrid`` and ``elastic`` across forced NVLink domains, 8 ranks.

With 8 ranks on one GPU (the test bed) every rank can map every other's memory; ``topology=``
splits them into 1x8, 2x4, 4x2 and 8x1 domains (domains x ranks per domain). The rails are gloo
(the ranks share one GPU, which NCCL refuses); with one rank per GPU they would be NCCL. The
oracles, in the same processes:

- ``reference`` on the whole group (flat): bf16 rows, probs, ``tokens_per_expert``, combine
  (within the documented bf16 rounding of partial sums; exact for top-1), probs routed back,
  dispatch_again, bitwise where the flat backend is bitwise;
- the same backend flat (one domain): FP8 rows and scales, elastic's compact rows, top-k ids and
  weights, and gradients through ``ep_plugin.dispatch`` / ``ep_plugin.combine``;
- the blocking result for sync-free mode (the valid prefix, bitwise).

With two GPUs, ``placement="block"`` puts ranks 0-3 on GPU 0 and 4-7 on GPU 1: at 2x4 every rail has
one rank per GPU and runs on NCCL (also over NCCL's socket path: ``NCCL_P2P_DISABLE=1
NCCL_SHM_DISABLE=1``); 4x2 and 8x1 rails still share GPUs and stay on gloo.

Run on the GPU machine (8 ranks share the GPU under the launcher's private MPS daemon):
    ./dev test tests/test_scaleout_gpu.py --require-gpu -x -q
or ``scripts/gpu_validate.sh scaleout OUT``.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_hybrid import assert_combine_close, make_inputs, routing_kwargs
from test_scaleout import check_late_rank_barriers, late_rank_barriers

import ep_plugin
from ep_plugin.backends.hierarchical import HierarchicalBackend
from ep_plugin.config import Config
from ep_plugin.testing import run_ranks
from ep_plugin.topology import Topology

pytestmark = pytest.mark.gpu

NUM_RANKS = 8
NUM_EXPERTS = 32
MAX_TOKENS = 64
HIDDEN = 2048  # FP8 needs a multiple of 128
LAYOUTS = (8, 4, 2, 1)  # ranks per domain
LAUNCH_TIMEOUT_S = 540


def _config(**changes) -> Config:
    return Config.from_env(**{"max_tokens_per_rank": MAX_TOKENS, "timeout_s": 30.0, "num_sms": 8, **changes})


def _build(name: str, ctx, config: Config, size: int = 0):
    # hybrid is asked for an arena (Megatron's default on one GPU asks too): across domains the domain
    # backend's combine input is the reorder's output, so the arena would be memory nothing uses.
    extra = {"elastic": {"max_topk": 8}, "hybrid": {"combine_input_rows": 64}}.get(name, {})
    topology = Topology(NUM_RANKS, size, ctx.rank) if size else None
    backend = ep_plugin.get_backend(name)(hidden_size=HIDDEN, num_experts=NUM_EXPERTS, device=ctx.device,
                                          config=config, topology=topology, **extra)
    if size:
        assert isinstance(backend, HierarchicalBackend) == (size < NUM_RANKS), (size, type(backend))
    if name == "hybrid":
        spans_domains = isinstance(backend, HierarchicalBackend)
        arena = (backend.domain if spans_domains else backend).arena
        assert (arena is None) == spans_domains, (size, "an arena in the domain" if spans_domains else "no arena")
    return backend


def _layout_name(backend, size: int) -> str:
    """"2x4 rail=gloo": the domains, and the rail engine across them."""
    engine = f" rail={backend.scaleout.engine}" if isinstance(backend, HierarchicalBackend) else ""
    return f"{NUM_RANKS // size}x{size}{engine}"


def _tokens(rank: int, case: int) -> int:
    """Unequal counts (rank r sends 50 - 3r); rank 1 sends none in odd cases."""
    return 0 if case % 2 and rank == 1 else 50 - 3 * rank


def _quantize(x: torch.Tensor):
    blocks = x.float().view(x.shape[0], HIDDEN // 128, 128)
    scales = (blocks.abs().amax(dim=2) / 448.0).clamp_min(1e-8)
    data = (blocks / scales.unsqueeze(2)).to(torch.float8_e4m3fn).view(x.shape[0], HIDDEN)
    return data, scales.contiguous()


def _valid(out) -> int:
    return out.hidden[0].shape[0] if out.num_valid_rows is None else int(out.num_valid_rows.item())


def _step_grads(backend, inputs, form: str, **options):
    """Autograd through dispatch -> per-row scale -> combine -> loss: (output, grad of hidden, grad of weights)."""
    x, idx, w, routing_map, probs = inputs
    hidden = x.clone().requires_grad_()
    routing = routing_kwargs(form, inputs)
    key = "probs" if form == "routing_map" else "topk_weights"
    routing[key] = routing[key].clone().requires_grad_()
    out = ep_plugin.dispatch(backend, hidden, **routing, **options)
    weights = out.probs if out.probs.dim() == 1 else out.probs.sum(1)
    y = ep_plugin.combine((out.hidden.float() * (1 + weights.unsqueeze(1))).to(torch.bfloat16), out.handle)
    (y.float() * torch.linspace(-1, 1, HIDDEN, device=y.device)).sum().backward()
    return y.detach(), hidden.grad, routing[key].grad


def _check_sync_free_drops_bad_ids(ctx, sync_free, x, idx, w) -> None:
    """Sync-free mode reads no ids on the host: rank 0's out-of-range id goes nowhere, and check_errors
    (after its sync) raises it there, once; the other ranks have nothing to report."""
    bad_idx = idx.clone()
    if ctx.rank == 0:
        bad_idx[0, 0] = NUM_EXPERTS + 3
    sync_free.dispatch(x, topk_idx=bad_idx, topk_weights=w)
    if ctx.rank == 0:
        with pytest.raises(ValueError, match=rf"outside -1 or \[0, {NUM_EXPERTS}\)"):
            sync_free.check_errors()
    sync_free.check_errors()  # reported once, and nothing on the other ranks


def hybrid_suite(ctx) -> list[str]:
    checked = []
    config = _config()
    reference = _build("reference", ctx, config)
    flat = _build("hybrid", ctx, config)
    for size in LAYOUTS:
        layered = _build("hybrid", ctx, config, size)
        layout = _layout_name(layered, size)
        sync_free = _build("hybrid", ctx, config.replace(blocking=False), size)
        for case, (topk, pad, skewed, form) in enumerate([(8, 1, False, "routing_map"), (2, 16, True, "topk"),
                                                          (1, 128, False, "topk"), (4, 1, True, "routing_map")]):
            name = f"hybrid {layout} topk={topk} pad={pad} skewed={skewed} form={form}"
            inputs = make_inputs(case, ctx.rank, NUM_RANKS, _tokens(ctx.rank, case), HIDDEN, NUM_EXPERTS, topk,
                                 skewed=skewed, drop_some=case % 2 == 0)
            kwargs = routing_kwargs(form, inputs)
            ref = reference.dispatch(inputs[0], pad_multiple=pad, **kwargs)
            out = layered.dispatch(inputs[0], pad_multiple=pad, **kwargs)
            assert torch.equal(out.tokens_per_expert, ref.tokens_per_expert), f"{name}: tokens_per_expert"
            assert out.hidden.shape == ref.hidden.shape, f"{name}: rows {out.hidden.shape} vs {ref.hidden.shape}"
            assert torch.equal(out.hidden, ref.hidden), f"{name}: dispatched rows"
            assert torch.equal(out.probs, ref.probs), f"{name}: dispatched probs"
            rows = (ref.hidden.float() * 0.5 + 1).to(torch.bfloat16)
            ref_back = reference.combine(rows, ref.handle, row_probs=ref.probs * 3 + 1)
            back = layered.combine(rows, out.handle, row_probs=ref.probs * 3 + 1)
            assert_combine_close(back.hidden, ref_back.hidden, name)
            if topk == 1:
                assert torch.equal(back.hidden, ref_back.hidden), f"{name}: top-1 combine must be exact"
            assert torch.equal(back.probs, ref_back.probs), f"{name}: probs routed back"
            fresh = torch.randn(inputs[0].shape, device=inputs[0].device).to(torch.bfloat16)
            again = layered.dispatch_again(fresh, out.handle)
            assert torch.equal(again, reference.dispatch_again(fresh, ref.handle)), f"{name}: dispatch_again"
            # Sync-free: the valid prefix equals the blocking rows.
            free = sync_free.dispatch(inputs[0], pad_multiple=pad, **kwargs)
            assert free.hidden.shape[0] >= ref.hidden.shape[0], f"{name}: sync-free capacity"
            valid = int(free.num_valid_rows.item())
            assert valid == ref.hidden.shape[0], f"{name}: sync-free valid rows {valid} vs {ref.hidden.shape[0]}"
            assert int(free.handle.layout.overflow) == 0, f"{name}: overflow flag on a flat backend's place"
            assert torch.equal(free.hidden[:valid], ref.hidden), f"{name}: sync-free rows"
            assert torch.equal(free.probs[:valid], ref.probs), f"{name}: sync-free probs"
            assert torch.equal(free.tokens_per_expert, ref.tokens_per_expert), f"{name}: sync-free counts"
            free_rows = torch.zeros_like(free.hidden)
            free_rows[:valid] = rows
            free_back = sync_free.combine(free_rows, free.handle)
            assert_combine_close(free_back.hidden, layered.combine(rows, out.handle).hidden, f"{name}: sync-free")
            # FP8 (hybrid's own flat result is the oracle: reference takes no FP8).
            data, scales = _quantize(inputs[0])
            want_rows, want_scales = flat.dispatch((data, scales), pad_multiple=pad, **kwargs).hidden
            got_rows, got_scales = layered.dispatch((data, scales), pad_multiple=pad, **kwargs).hidden
            assert torch.equal(got_rows.view(torch.uint8), want_rows.view(torch.uint8)), f"{name}: fp8 rows"
            assert torch.equal(got_scales, want_scales), f"{name}: fp8 scales"
            # Gradients against the flat backend.
            if case < 2:
                want = _step_grads(flat, inputs, form, pad_multiple=pad)
                got = _step_grads(layered, inputs, form, pad_multiple=pad)
                for label, a, b in zip(("output", "grad hidden", "grad weights"), got, want, strict=True):
                    assert_combine_close(a, b, f"{name} {label}")
            checked.append(name)
        # One rank's out-of-range expert id: ValueError on every rank (flat: the count exchange carries the
        # flag; across domains: the agreement words), and the backend goes on.
        bad_idx = inputs[1].clone()
        if ctx.rank == 0:
            bad_idx[0, 0] = NUM_EXPERTS + 3
        with pytest.raises(ValueError, match="expert id" if ctx.rank == 0 else
                           r"rank\(s\) \[0\] of the group|refused its input"):
            layered.dispatch(inputs[0], topk_idx=bad_idx, topk_weights=inputs[2])
        layered.barrier()
        _check_sync_free_drops_bad_ids(ctx, sync_free, inputs[0], inputs[1], inputs[2])
        torch.cuda.synchronize()
        for backend in (layered, sync_free):
            backend.destroy()
    return checked


def elastic_suite(ctx) -> list[str]:
    checked = []
    config = _config()
    reference = _build("reference", ctx, config)
    flat = _build("elastic", ctx, config)
    for size in LAYOUTS:
        layered = _build("elastic", ctx, config, size)
        layout = _layout_name(layered, size)
        sync_free = _build("elastic", ctx, config.replace(blocking=False), size)
        for case, (topk, align, skewed, expand) in enumerate([(8, 1, False, False), (2, 128, True, True),
                                                              (1, 1, False, False), (4, 16, True, True)]):
            # Across domains k is at most one domain's experts (4 at 8x1): the hierarchical backend refuses more.
            topk = min(topk, getattr(layered, "experts_per_domain", NUM_EXPERTS))
            name = f"elastic {layout} topk={topk} align={align} skewed={skewed} expand={expand}"
            inputs = make_inputs(case, ctx.rank, NUM_RANKS, _tokens(ctx.rank, case), HIDDEN, NUM_EXPERTS, topk,
                                 skewed=skewed, drop_some=case % 2 == 0)
            x, idx, w, _, _ = inputs
            options = {"pad_multiple": align, "expand": expand, "zero_padding": True}
            want = flat.dispatch(x, topk_idx=idx, topk_weights=w, **options)
            out = layered.dispatch(x, topk_idx=idx, topk_weights=w, **options)
            assert out.hidden.shape == want.hidden.shape, f"{name}: rows {out.hidden.shape} vs {want.hidden.shape}"
            for field in ("hidden", "probs", "topk_idx", "tokens_per_expert"):
                a, b = getattr(out, field), getattr(want, field)
                assert (a is None and b is None) or torch.equal(a, b), f"{name}: {field}"
            assert out.tokens_per_expert_list == want.tokens_per_expert_list, f"{name}: host tokens_per_expert"
            if expand:  # expanded rows are the reference order
                ref = reference.dispatch(x, topk_idx=idx, topk_weights=w, pad_multiple=align)
                assert torch.equal(out.hidden, ref.hidden), f"{name}: expanded rows vs reference"
            rows = (out.hidden.float() * 0.5 + 1).to(torch.bfloat16)
            bias = torch.ones(x.shape[0], HIDDEN, dtype=torch.bfloat16, device=x.device)
            back = layered.combine(rows, out.handle, row_probs=out.probs * 3 + 1, bias=bias)
            want_back = flat.combine(rows, want.handle, row_probs=want.probs * 3 + 1, bias=bias)
            assert_combine_close(back.hidden, want_back.hidden, name)
            assert torch.equal(back.probs, want_back.probs), f"{name}: weights routed back"
            fresh = torch.randn(x.shape, device=x.device).to(torch.bfloat16)
            assert torch.equal(layered.dispatch(fresh, handle=out.handle).hidden,
                               flat.dispatch(fresh, handle=want.handle).hidden), f"{name}: cached dispatch"
            # The form options a flat cached dispatch takes (matching its handle) work across domains too; one
            # that contradicts the handle is refused there before the rails move anything.
            assert torch.equal(layered.dispatch(fresh, handle=out.handle, expand=expand, zero_padding=True).hidden,
                               flat.dispatch(fresh, handle=want.handle, expand=expand, zero_padding=True).hidden), \
                f"{name}: cached dispatch with its form's options"
            if not expand and hasattr(layered, "domain"):
                with pytest.raises(ValueError, match="a cached dispatch delivers its handle's form"):
                    layered.dispatch(fresh, handle=out.handle, expand=True)
            free = sync_free.dispatch(x, topk_idx=idx, topk_weights=w, **options)
            valid = _valid(free)
            assert valid == want.hidden.shape[0], f"{name}: sync-free valid rows {valid} vs {want.hidden.shape[0]}"
            assert torch.equal(free.hidden[:valid], want.hidden), f"{name}: sync-free rows"
            assert torch.equal(free.probs[:valid], want.probs), f"{name}: sync-free weights"
            if not expand:
                assert torch.equal(free.topk_idx[:valid], want.topk_idx), f"{name}: sync-free top-k ids"
            data, scales = _quantize(x)
            want_rows, want_scales = flat.dispatch((data, scales), topk_idx=idx, topk_weights=w, **options).hidden
            got_rows, got_scales = layered.dispatch((data, scales), topk_idx=idx, topk_weights=w, **options).hidden
            assert torch.equal(got_rows.view(torch.uint8), want_rows.view(torch.uint8)), f"{name}: fp8 rows"
            assert torch.equal(got_scales, want_scales), f"{name}: fp8 scales"
            if case < 2:
                want_grads = _step_grads(flat, inputs, "topk", pad_multiple=align, expand=expand)
                got_grads = _step_grads(layered, inputs, "topk", pad_multiple=align, expand=expand)
                for label, a, b in zip(("output", "grad hidden", "grad weights"), got_grads, want_grads, strict=True):
                    assert_combine_close(a, b, f"{name} {label}")
            checked.append(name)
        # An option value the domain backend refuses is refused before the rail exchange: the op never
        # begins (its number is not taken) and the backend goes on.
        begun = getattr(layered, "_num_dispatches", None)
        with pytest.raises(TypeError, match="must be bools"):
            layered.dispatch(x, topk_idx=idx, topk_weights=w, in_place=1)
        assert getattr(layered, "_num_dispatches", None) == begun, f"elastic {layout}: the op began"
        layered.barrier()
        _check_sync_free_drops_bad_ids(ctx, sync_free, x, idx, w)
        torch.cuda.synchronize()
        for backend in (layered, sync_free):
            backend.destroy()
    return checked


@pytest.mark.parametrize("suite", [hybrid_suite, elastic_suite], ids=["hybrid", "elastic"])
def test_scaleout_matches_flat_at_every_layout(suite):
    results = run_ranks(suite, NUM_RANKS, device="cuda", timeout_s=LAUNCH_TIMEOUT_S)
    assert all(len(checked) == 4 * len(LAYOUTS) for checked in results), results


@pytest.mark.parametrize("name", ["hybrid", "elastic"])
def test_barrier_waits_for_a_late_rank_on_the_gpu(name):
    """The CPU test's late rank at 2x4 and 4x2, with the compiled backend's device barrier in each domain."""
    per_rank = run_ranks(late_rank_barriers, NUM_RANKS, 0, name, _config(), device="cuda", timeout_s=300)
    check_late_rank_barriers(per_rank, 0)


@pytest.mark.parametrize("nccl_env", [{}, {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}],
                         ids=["nccl-rails", "nccl-socket-rails"])
def test_scaleout_with_nccl_rails_on_two_gpus(nccl_env):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: a NCCL rail needs its ranks on different GPUs")
    for suite in (hybrid_suite, elastic_suite):
        results = run_ranks(suite, NUM_RANKS, device="cuda", timeout_s=LAUNCH_TIMEOUT_S, env=nccl_env,
                            placement="block")
        names = results[0]
        assert len(names) == 4 * len(LAYOUTS), names
        assert all("rail=nccl" in name for name in names if " 2x4 " in name), names


def a_rail_peer_stopping_after_the_counts(ctx) -> dict:
    """2x4 on two GPUs (NCCL rails): global rank 4, rail 0's rank in domain 1, stops after blocking dispatch's
    count exchange, before its rail rows, for longer than the timeout; its rail peer (rank 0) reports it."""
    config = _config(timeout_s=5.0)
    backend = _build("hybrid", ctx, config, 4)
    x, idx, w, _, _ = make_inputs(0, ctx.rank, NUM_RANKS, 32, HIDDEN, NUM_EXPERTS, 4, skewed=False, drop_some=False)
    backend.dispatch(x, topk_idx=idx, topk_weights=w)  # in step once: the late rank is late in the second
    if ctx.rank == 4:
        exchange = backend.scaleout.exchange_rows

        def late_rows(*args, **kwargs):
            time.sleep(config.timeout_s + 10)
            return exchange(*args, **kwargs)

        backend.scaleout.exchange_rows = late_rows
    start = time.monotonic()
    try:
        backend.dispatch(x, topk_idx=idx, topk_weights=w)
        outcome = "dispatched"
    except ep_plugin.EPError as error:
        outcome = f"{type(error).__name__}: {error}"
    return {"engine": backend.scaleout.engine, "outcome": outcome, "seconds": time.monotonic() - start}


def test_a_rail_peer_that_stops_after_the_counts_is_named_on_two_gpus():
    """Over an NCCL rail blocking dispatch's rows are waited for on the host with the timeout: the rail peer of a
    rank that stopped after the count exchange raises EPTimeoutError naming the rail rows and that rank within the
    timeout (the rows were stream-ordered: it waited in an untimed CUDA sync until the late rank came, and then
    reported a domain peer instead)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: a NCCL rail needs its ranks on different GPUs")
    results = run_ranks(a_rail_peer_stopping_after_the_counts, NUM_RANKS, device="cuda", timeout_s=120,
                        placement="block")
    assert {result["engine"] for result in results} == {"nccl"}, results
    rank0 = results[0]
    assert rank0["outcome"].startswith("EPTimeoutError") and "rail/tokens" in rank0["outcome"], rank0
    assert "rank 4" in rank0["outcome"] and rank0["seconds"] < 5.0 + 8, rank0
    assert all(result["outcome"] != "dispatched" for result in results), results


def build_with_one_rank_limiting_its_gpu(ctx) -> str:
    """2 x 2 forced domains; rank 0 alone says its GPU holds one block too few for the 4 blocks of every rank on
    it (its domain's own check, over its two ranks, passes)."""
    sharing = -(-ctx.world_size // torch.cuda.device_count())  # ranks on one GPU (round-robin placement)
    config = _config(num_sms=4, max_sms_per_gpu=4 * sharing - 1 if ctx.rank == 0 else 0)
    try:
        ep_plugin.get_backend("hybrid")(hidden_size=HIDDEN, num_experts=NUM_EXPERTS, device=ctx.device,
                                        config=config, topology=Topology(ctx.world_size, 2, ctx.rank)).destroy()
    except (ValueError, ep_plugin.EPError) as error:
        return f"{type(error).__name__}: {error}"
    return "built"


def test_a_gpu_one_domain_cannot_share_refuses_the_build_in_every_domain():
    """Domains that share a GPU check co-residency with every rank on it, over their own domain: the domain
    with the limiting rank refused, the other built and waited for it at its first op until the timeout."""
    results = run_ranks(build_with_one_rank_limiting_its_gpu, 4, device="cuda", timeout_s=LAUNCH_TIMEOUT_S)
    for rank, outcome in enumerate(results):
        assert outcome.startswith("ValueError: ") and "resident" in outcome, (rank, outcome)
        if rank >= 2:
            assert "could not be built on rank(s) [0, 1]" in outcome, (rank, outcome)
