"""Megatron's SequentialMLP experts write their output into the hybrid backend's combine-input arena
(EP_PLUGIN_COMBINE_INPUT_ROWS > 0, or unset with every rank on one GPU: then only outputs of at least
DEFAULT_MIN_OUTPUT_BYTES, lowered to 0 here except in one run), and the flex dispatcher's combine reads it
in place.

Each rank runs the MoE layer's own sequence (the flex dispatcher on ``ep_hybrid`` and real
SequentialMLP experts, bf16, on the GPU; ranks share it where there are fewer GPUs) twice on the same
inputs and weights: with an arena and without. With the arena the forward combine must be in place
(the backend counts it) and without it pushed; the forward outputs may differ only by the two-stage
combine's rounding of each rank's partial sum, and every gradient must be bitwise the same (the
backward never reads the arena: the experts saw the same inputs, and the combine of gradients is
pushed in both runs). Both experts shapes are covered: several local experts (the output is their
concatenation) and one (the output is its fc2's, left out of the arena under an FP8/FP4 recipe).
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.megatron,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                       or importlib.util.find_spec("megatron.core") is None,
                       reason="megatron-core is not installed"),
]

HIDDEN = 256
FFN = 128
TOKENS = 64
ROOM = 4096  # combine input rows the arena holds: more than any rank receives here


def _run_layer(ctx, num_experts: int, topk: int, seed: int, fp8: bool = False, grouped_gemm: bool = False) -> dict:
    """The layer once, on the backend the environment configures; returns output, gradients, counts.
    ``fp8``: the config names an FP8 recipe (the experts here are plain bf16 linears, which ignore it, but
    SequentialMLP pads its rows for it and the arena's hook takes its choice from it)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig
    from test_megatron_dispatcher import _moe_forward

    from ep_plugin.integrations.megatron.manager import combine_counts

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=2, num_moe_experts=num_experts,
        moe_router_topk=topk, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ep_hybrid",
        moe_router_dtype="fp32", add_bias_linear=False, use_cpu_initialization=True, bf16=True,
        params_dtype=torch.bfloat16)
    if fp8:
        config.fp8 = "e4m3"  # after construction: its checks would want Transformer Engine
    # Megatron would build grouped-GEMM experts, whose output never goes to the arena (TEGroupedMLP needs
    # Transformer Engine, absent here: the experts stay SequentialMLP, and the backend must have no default arena).
    config.moe_grouped_gemm = grouped_gemm
    pg_collection = get_default_pg_collection()
    num_local = num_experts // parallel_state.get_expert_model_parallel_world_size()
    local_indices = [ctx.rank * num_local + i for i in range(num_local)]
    dispatcher = MoEFlexTokenDispatcher(num_local, local_indices, config=config, pg_collection=pg_collection)
    experts = SequentialMLP(num_local, config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear),
                            pg_collection=pg_collection)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for expert in experts.local_experts:
            expert.linear_fc1.weight.copy_(torch.randn(FFN, HIDDEN, generator=generator) * 0.1)
            expert.linear_fc2.weight.copy_(torch.randn(HIDDEN, FFN, generator=generator) * 0.1)
    experts.cuda()
    generator.manual_seed(seed * 100 + ctx.rank)  # this rank's tokens
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator).to(torch.bfloat16).cuda().requires_grad_()
    logits = torch.randn(TOKENS, num_experts, generator=generator)
    top_logits, top_index = logits.topk(topk, dim=-1)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, top_index, True).cuda()
    probs = torch.zeros_like(logits).scatter(-1, top_index, top_logits.softmax(-1)).cuda().requires_grad_()
    grad_out = torch.randn(TOKENS, HIDDEN, generator=generator).to(torch.bfloat16).cuda()

    out, *_ = _moe_forward(dispatcher, experts, hidden, routing_map, probs)
    backend = dispatcher._comm_manager.backend
    forward_counts = combine_counts()  # over the shared backends, made anew for this run
    (out.float() * grad_out.float()).sum().backward()
    return {
        "out": out.detach().float().cpu(),
        "grads": [hidden.grad.cpu(), probs.grad.cpu()] + [p.grad.cpu() for p in experts.parameters()],
        "forward_counts": forward_counts,
        "arena": backend.arena is not None,
    }


def _rank_arena(ctx) -> dict:
    import os

    import torch
    from megatron.core import parallel_state

    import ep_plugin.integrations.megatron as ep_megatron
    from ep_plugin.integrations.megatron import arena as megatron_arena
    from ep_plugin.integrations.megatron.manager import clear_backend_cache

    torch.cuda.set_device(ctx.device)
    ep_megatron.install()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ctx.world_size)
    results = {}
    shipped_threshold = megatron_arena.DEFAULT_MIN_OUTPUT_BYTES
    try:
        for name, num_experts, topk in (("several local experts", 4 * ctx.world_size, 4),
                                        ("one local expert", ctx.world_size, 2)):
            runs = {}
            # None: unset, Megatron's default decides; "small": the same with its size threshold as it
            # ships (these outputs are far below it), else lowered to 0 so that the default's arena is used.
            for rows in (ROOM, 0, None, "small"):
                os.environ.pop("EP_PLUGIN_COMBINE_INPUT_ROWS", None)
                if isinstance(rows, int):
                    os.environ["EP_PLUGIN_COMBINE_INPUT_ROWS"] = str(rows)
                megatron_arena.DEFAULT_MIN_OUTPUT_BYTES = shipped_threshold if rows == "small" else 0
                clear_backend_cache()  # the next dispatch builds the backend from the environment
                runs[rows] = _run_layer(ctx, num_experts, topk, seed=7 + num_experts)
            megatron_arena.DEFAULT_MIN_OUTPUT_BYTES = 0  # the default's arena would take these outputs
            os.environ.pop("EP_PLUGIN_COMBINE_INPUT_ROWS", None)
            clear_backend_cache()
            grouped = _run_layer(ctx, num_experts, topk, seed=7 + num_experts, grouped_gemm=True)
            megatron_arena.DEFAULT_MIN_OUTPUT_BYTES = shipped_threshold
            os.environ["EP_PLUGIN_COMBINE_INPUT_ROWS"] = str(ROOM)
            clear_backend_cache()
            fp8 = _run_layer(ctx, num_experts, topk, seed=7 + num_experts, fp8=True)
            arena, plain, default, small = runs[ROOM], runs[0], runs[None], runs["small"]
            results[name] = {
                "arena_built": (arena["arena"], plain["arena"]),
                "forward_counts": (arena["forward_counts"], plain["forward_counts"]),
                "out_difference": float((arena["out"] - plain["out"]).abs().max()),
                "out_scale": float(plain["out"].abs().max()),
                "grads_equal": all(torch.equal(a, b) for a, b in zip(arena["grads"], plain["grads"], strict=True)),
                "default": (default["arena"], default["forward_counts"]),
                "default_small": (small["arena"], small["forward_counts"]),
                "default_out_equal": torch.equal(default["out"], (arena if default["arena"] else plain)["out"]),
                "one_gpu": ctx.plan.ranks_per_gpu == ctx.world_size,
                "fp8": (fp8["arena"], fp8["forward_counts"]),
                "grouped_gemm_default": (grouped["arena"], grouped["forward_counts"]),
            }
    finally:
        clear_backend_cache()
        parallel_state.destroy_model_parallel()
    return results


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_sequential_mlp_output_is_combined_in_place(num_ranks):
    from ep_plugin.testing.launcher import run_ranks

    results = run_ranks(_rank_arena, num_ranks, device="cuda", timeout_s=400)
    for rank, per_rank in enumerate(results):
        for name, result in per_rank.items():
            label = f"rank {rank}/{num_ranks}, {name}"
            assert result["arena_built"] == (True, False), label
            arena_counts, plain_counts = result["forward_counts"]
            assert arena_counts == {"in_place": 1}, f"{label}: the forward combine with an arena: {arena_counts}"
            assert plain_counts == {"pushed": 1}, f"{label}: the forward combine without: {plain_counts}"
            assert result["grads_equal"], f"{label}: a gradient differs between the runs"
            # One pass rounds once; the two-stage combine rounds each rank's partial first: within a
            # few bf16 ulps of the output's magnitude, never more.
            assert result["out_difference"] <= num_ranks * 2 ** -7 * result["out_scale"], (label, result)
            assert result["out_scale"] > 0, label
            # Unset, EP_PLUGIN_COMBINE_INPUT_ROWS is Megatron's default: in place where every rank is on one GPU.
            one_gpu = result["one_gpu"]
            expected = (True, {"in_place": 1}) if one_gpu else (False, {"pushed": 1})
            assert result["default"] == expected, f"{label}: the default (one GPU: {one_gpu}): {result['default']}"
            assert result["default_out_equal"], f"{label}: the default's output differs from the same way's run"
            # As shipped, the default arena leaves outputs this small (decode-sized) to the two-stage combine.
            expected = (one_gpu, {"pushed": 1})
            assert result["default_small"] == expected, f"{label}: the default, small output: {result['default_small']}"
            # Under an FP8 recipe one local expert's fc2 would run inside the arena (its GEMM's caches would
            # land there): that output is pushed; several experts' concatenation still lands in place.
            expected = (True, {"pushed": 1} if name == "one local expert" else {"in_place": 1})
            assert result["fp8"] == expected, f"{label}, FP8 recipe: {result['fp8']}"
            # Grouped-GEMM experts never write into the arena: the default gives such a model none.
            grouped = result["grouped_gemm_default"]
            assert grouped == (False, {"pushed": 1}), f"{label}, moe_grouped_gemm: {grouped}"
