"""MoEFlexTokenDispatcher on the plugin's ``ep_reference`` backend, against real megatron-core.

Each rank builds the dispatcher from a real TransformerConfig (moe_token_dispatcher_type="flex",
moe_flex_dispatcher_backend="ep_reference") and real SequentialMLP experts, then runs the
MoE layer's own sequence:

    dispatch_preprocess -> token_dispatch -> dispatch_postprocess -> experts
    -> combine_preprocess -> token_combine -> combine_postprocess -> backward

Every rank also computes the same layer densely, in float64, on the tokens of all ranks
(every rank draws the same global tensors from one seed), and the parent compares: the
output, and the gradients of the tokens, the router probs and the local expert weights.

A second group of checks follows upstream Megatron's token-dispatcher tests
(MoEModelTestContainer: dropless restore-identity and gradient checks), written here anew:
with identity experts that scale by the dispatched probs, combine must restore the input
(probs of a token sum to one) and backward must return the upstream gradient.

The same launches also run the layer with expert tensor parallelism (TP=2 with sequence
parallelism, EP = ranks/2): the routing map reaches the manager as [T, TP*E] and combine
sums the TP ranks' partial outputs.

With FP8 or FP4 configured, each local expert's rows must be padded to Megatron's own alignment
for the quantized expert GEMMs (what its HybridEP manager passes as ``pad_multiple``); padding
rows are zero and the layer still matches the dense one.

On a GPU the same layer case runs on the compiled backends (``ep_hybrid``, ``ep_elastic``: 2 ranks,
bf16 tokens and weights, top-1 and top-4) against the dense layer over the same rounded values.

One process launch per rank count (2 and 4) runs all cases; a 1-rank launch covers the
plugin path Megatron's own code refuses (TP x EP == 1), that builtin names still reach
Megatron's code, replace_builtin=True, and torch.compile traceability of setup_metadata.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                       or importlib.util.find_spec("megatron.core") is None,
                       reason="megatron-core is not installed (pip install megatron-core==0.16.1)"),
]

HIDDEN = 16
FFN = 24
NUM_EXPERTS = 8
TOKENS_PER_RANK = 12

# (name, TransformerConfig fields): FP8 as Megatron's delayed and MXFP8 recipes, FP4 as NVFP4.
QUANTIZATION_CASES = (
    ("fp8_delayed", {"fp8": "e4m3", "fp8_recipe": "delayed"}),
    ("fp8_mxfp8", {"fp8": "hybrid", "fp8_recipe": "mxfp8"}),
    ("fp4_nvfp4", {"fp4": "e2m1", "fp4_recipe": "nvfp4"}),
)

# (name, top-k, router probs dtype)
CASES = (
    ("top1_fp32", 1, "float32"),
    ("top4_fp32", 4, "float32"),
    ("top4_bf16_probs", 4, "bfloat16"),
    ("top4_fp64_probs", 4, "float64"),  # moe_router_dtype="fp64": the reference carries them as they are
)


# ---- rank side ----------------------------------------------------------------------------------

def _global_inputs(world_size: int, topk: int, seed: int):
    """Tokens, routing and upstream gradients of every rank, identical on every rank."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(world_size, TOKENS_PER_RANK, HIDDEN, generator=generator)
    logits = torch.randn(world_size, TOKENS_PER_RANK, NUM_EXPERTS, generator=generator)
    top_logits, top_index = logits.topk(topk, dim=-1)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, top_index, True)
    # Normalised over the chosen experts, as Megatron's softmax-after-topk router gives them.
    probs = torch.zeros_like(logits).scatter(-1, top_index, top_logits.softmax(-1))
    grad_out = torch.randn(world_size, TOKENS_PER_RANK, HIDDEN, generator=generator)
    fc1 = torch.randn(NUM_EXPERTS, FFN, HIDDEN, generator=generator) * 0.3
    fc2 = torch.randn(NUM_EXPERTS, HIDDEN, FFN, generator=generator) * 0.3
    return hidden, routing_map, probs, grad_out, fc1, fc2


def _make_config(topk: int, backend: str = "ep_reference", tensor_parallel: int = 1, quantization=None,
                 bf16: bool = False):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    quantization = quantization or {}
    fp8_fields = {name: value for name, value in quantization.items() if name.startswith("fp8")}
    # Megatron requires sequence parallelism for MoE with TP: each TP rank holds its own tokens.
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=2,
        num_moe_experts=NUM_EXPERTS, moe_router_topk=topk, moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend=backend, moe_router_dtype="fp32", add_bias_linear=False,
        moe_router_pre_softmax=topk == 1, use_cpu_initialization=True,
        tensor_model_parallel_size=tensor_parallel, sequence_parallel=tensor_parallel > 1,
        **({"bf16": True, "params_dtype": torch.bfloat16} if bf16 else {}),
        **{name: value for name, value in quantization.items() if name not in fp8_fields})
    # TransformerConfig refuses MoE with FP8 unless TransformerEngine (absent on CPU) is installed;
    # the dispatcher, its manager and SequentialMLP only read these fields, so set them afterwards.
    for name, value in fp8_fields.items():
        setattr(config, name, value)
    return config


def _megatron_pad_multiple(config) -> int:
    """Megatron's own row alignment for FP8/FP4 expert GEMMs (1 without them).

    Megatron's HybridEP manager pads each expert's rows to ``get_align_size_for_quantization(config)``
    when ``config.fp8 or config.fp4`` (``token_dispatcher._HybridEPManager.dispatch``): that is
    ``fp8_utils.get_fp8_align_size`` (16; 32 for MXFP8) or ``fp4_utils.get_fp4_align_size`` (128).
    """
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    return int(get_align_size_for_quantization(config)) if (config.fp8 or config.fp4) else 1


def _make_layer(config, fc1, fc2):
    """The flex dispatcher and this rank's SequentialMLP experts (weights from the global draw).

    Returns (dispatcher, experts, global indices of the local experts, this rank's slice of
    the FFN dimension: expert tensor parallelism splits fc1's rows and fc2's columns).
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    pg_collection = get_default_pg_collection()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    num_local = NUM_EXPERTS // parallel_state.get_expert_model_parallel_world_size()
    local_indices = [ep_rank * num_local + i for i in range(num_local)]
    ffn_part = FFN // parallel_state.get_expert_tensor_parallel_world_size()
    ffn_start = parallel_state.get_expert_tensor_parallel_rank() * ffn_part
    ffn_slice = slice(ffn_start, ffn_start + ffn_part)
    dispatcher = MoEFlexTokenDispatcher(num_local, local_indices, config=config, pg_collection=pg_collection)
    experts = SequentialMLP(num_local, config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear),
                            pg_collection=pg_collection)
    with torch.no_grad():
        for local, expert in enumerate(experts.local_experts):
            expert.linear_fc1.weight.copy_(fc1[local_indices[local]][ffn_slice])
            expert.linear_fc2.weight.copy_(fc2[local_indices[local]][:, ffn_slice])
    return dispatcher, experts, local_indices, ffn_slice


def _moe_forward(dispatcher, experts, hidden, routing_map, probs):
    """The MoE layer's dispatcher/expert sequence (MoELayer.forward without router).

    Returns (output, tokens_per_expert, dispatched row probs, dispatched rows).
    """
    hidden_2d, token_probs = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    dispatched, dispatched_probs = dispatcher.token_dispatch(hidden_2d, token_probs)
    rows, tokens_per_expert, row_probs = dispatcher.dispatch_postprocess(dispatched, dispatched_probs)
    expert_out, _ = experts(rows, tokens_per_expert, row_probs)
    combined = dispatcher.combine_preprocess(expert_out)
    combined = dispatcher.token_combine(combined)
    return dispatcher.combine_postprocess(combined), tokens_per_expert, row_probs, rows


def _dense_moe(hidden, routing_map, probs, fc1, fc2, activation):
    """y[t] = sum over chosen e of probs[t, e] * fc2[e] @ act(fc1[e] @ x[t]), in float64."""
    import torch

    out = torch.zeros_like(hidden)
    for expert in range(NUM_EXPERTS):
        chosen = routing_map[:, expert]
        if bool(chosen.any()):
            expert_out = activation(hidden[chosen] @ fc1[expert].T) @ fc2[expert].T
            out = out.index_add(0, chosen.nonzero().squeeze(1), expert_out * probs[chosen, expert, None])
    return out


def _max_error(actual, expected) -> float:
    """Largest absolute difference, relative to the largest expected magnitude once that exceeds 1."""
    if actual.shape != expected.shape:
        return float("inf")
    if not actual.numel():
        return 0.0
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    scale = max(1.0, float(expected.abs().max()))
    return float((actual - expected).abs().max()) / scale


def _layer_case(ctx, topk: int, probs_dtype: str, seed: int, tensor_parallel: int = 1, quantization=None,
                backend: str = "ep_reference", device: str = "cpu") -> dict:
    """Our dispatcher + SequentialMLP vs the dense float64 layer; returns max errors. On ``device="cuda"``
    tokens and weights are bf16 (what the compiled backends move); the dense layer gets them rounded alike."""
    import torch

    rank, world = ctx.rank, ctx.world_size
    hidden_all, routing_all, probs_all, grad_all, fc1, fc2 = _global_inputs(world, topk, seed)
    on_gpu = device == "cuda"
    if on_gpu:  # the dense layer sees the values the bf16 layer holds
        hidden_all, fc1, fc2 = (t.to(torch.bfloat16).float() for t in (hidden_all, fc1, fc2))
    config = _make_config(topk, backend, tensor_parallel=tensor_parallel, quantization=quantization, bf16=on_gpu)
    dispatcher, experts, local_indices, ffn_slice = _make_layer(config, fc1, fc2)
    experts.to(device)

    hidden = hidden_all[rank].to(device, config.params_dtype, copy=True).requires_grad_()
    probs = probs_all[rank].to(device, getattr(torch, probs_dtype), copy=True).requires_grad_()
    routing_map = routing_all[rank].to(device)
    out, tokens_per_expert, row_probs, rows = _moe_forward(dispatcher, experts, hidden, routing_map, probs)
    (out.float() * grad_all[rank].to(device)).sum().backward()
    counts_device = tokens_per_expert.device.type  # the experts' counts are on the host, as DeepEP's
    tokens_per_expert, row_probs, rows = tokens_per_expert.cpu(), row_probs.detach().cpu(), rows.detach().cpu()

    # Dense float64 layer over the tokens of all ranks.
    dense_hidden = hidden_all.reshape(-1, HIDDEN).double().requires_grad_()
    dense_probs = probs_all.reshape(-1, NUM_EXPERTS).to(getattr(torch, probs_dtype)).double().requires_grad_()
    dense_fc1 = fc1.double().requires_grad_()
    dense_fc2 = fc2.double().requires_grad_()
    dense_out = _dense_moe(dense_hidden, routing_all.reshape(-1, NUM_EXPERTS), dense_probs, dense_fc1, dense_fc2,
                           config.activation_func)
    (dense_out * grad_all.reshape(-1, HIDDEN).double()).sum().backward()
    mine = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)

    routed_here = routing_all.reshape(-1, NUM_EXPERTS)[:, local_indices].sum(0)
    # Megatron's padding rule: each count up to the next multiple (moe_utils.pad_routing_map pads
    # (-count) % pad_multiple rows; the DeepEP manager's _pad_routing_map: ceil(count / m) * m).
    pad_multiple = _megatron_pad_multiple(config)
    padded_here = routed_here + (-routed_here) % pad_multiple
    segments = torch.split(torch.arange(int(tokens_per_expert.sum())), tokens_per_expert.tolist())
    padding = torch.cat([segment[int(real):] for segment, real in zip(segments, routed_here, strict=True)])
    return {
        "out": _max_error(out, dense_out[mine]),
        "grad_hidden": _max_error(hidden.grad, dense_hidden.grad[mine]),
        "grad_probs": _max_error(probs.grad, dense_probs.grad[mine]),
        "grad_fc1": max(_max_error(e.linear_fc1.weight.grad, dense_fc1.grad[i][ffn_slice])
                        for e, i in zip(experts.local_experts, local_indices, strict=True)),
        "grad_fc2": max(_max_error(e.linear_fc2.weight.grad, dense_fc2.grad[i][:, ffn_slice])
                        for e, i in zip(experts.local_experts, local_indices, strict=True)),
        "out_dtype": str(out.dtype), "out_shape": tuple(out.shape),
        "row_probs_dtype": str(row_probs.dtype),
        "tokens_per_expert": tokens_per_expert.tolist(), "expected_tokens_per_expert": padded_here.tolist(),
        "tokens_per_expert_device": counts_device,
        "real_tokens_per_expert": routed_here.tolist(), "pad_multiple": pad_multiple,
        "padding_rows_zero": bool((rows[padding] == 0).all()) and bool((row_probs[padding] == 0).all()),
        "manager": type(dispatcher._comm_manager).__name__,
        "backend": getattr(dispatcher._comm_manager, "backend_name", None),
        "probs_grad_dtype": str(probs.grad.dtype),
    }


def _restore_identity_case(ctx, topk: int, seed: int) -> dict:
    """Upstream-style dropless check: rows * probs, combined, restore the input; grads too."""
    import torch

    rank, world = ctx.rank, ctx.world_size
    hidden_all, routing_all, probs_all, _, _, _ = _global_inputs(world, topk, seed)
    dispatcher = _make_layer(_make_config(topk), torch.zeros(NUM_EXPERTS, FFN, HIDDEN),
                             torch.zeros(NUM_EXPERTS, HIDDEN, FFN))[0]
    # Megatron passes hidden states as [S, B, H]; the dispatcher must give that shape back.
    hidden = hidden_all[rank].reshape(TOKENS_PER_RANK // 2, 2, HIDDEN).clone().requires_grad_()
    probs = probs_all[rank].clone().requires_grad_()

    hidden_2d, token_probs = dispatcher.dispatch_preprocess(hidden, routing_all[rank], probs)
    dispatched, dispatched_probs = dispatcher.token_dispatch(hidden_2d, token_probs)
    rows, tokens_per_expert, row_probs = dispatcher.dispatch_postprocess(dispatched, dispatched_probs)
    scaled = rows * row_probs.unsqueeze(-1)
    restored = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(scaled)))
    torch.autograd.backward(restored, hidden.detach())

    # d restored / d probs[t, e] = <x_t, upstream_t> = |x_t|^2 where token t chose e.
    flat = hidden.detach().reshape(-1, HIDDEN)
    expected_probs_grad = (flat * flat).sum(-1, keepdim=True) * routing_all[rank]
    return {
        "restore": _max_error(restored, hidden.detach()),
        "shape_ok": tuple(restored.shape) == tuple(hidden.shape),
        "grad_hidden": _max_error(hidden.grad, hidden.detach()),
        "grad_probs": _max_error(probs.grad, expected_probs_grad),
        "rows_match_counts": int(tokens_per_expert.sum()) == rows.shape[0],
    }


def _init_megatron(ctx, tensor_parallel: int = 1) -> None:
    from megatron.core import parallel_state

    import ep_plugin.integrations.megatron as ep_megatron

    ep_megatron.install()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                             expert_model_parallel_size=ctx.world_size // tensor_parallel)


def _finish_megatron() -> None:
    from megatron.core import parallel_state

    from ep_plugin.integrations.megatron.manager import clear_backend_cache

    clear_backend_cache()
    parallel_state.destroy_model_parallel()


def _recompute_case(ctx, seed: int) -> dict:
    """The MoE layer recomputed in backward (Megatron's moe_layer_recompute: a forward without grad, then the
    same forward again inside backward, whose dispatch and combine are new ops on the same manager): output and
    gradients equal a plain step's, for torch's reentrant checkpoint (what Megatron's CheckpointFunction does;
    Megatron's own needs CUDA's RNG state) and its non-reentrant one. Returns each mode's largest error."""
    import torch.utils.checkpoint as checkpoint

    hidden_all, routing_all, probs_all, grad_all, fc1, fc2 = _global_inputs(ctx.world_size, 2, seed)
    dispatcher, experts, _, _ = _make_layer(_make_config(2), fc1, fc2)

    def step(mode: str) -> list:
        hidden = hidden_all[ctx.rank].clone().requires_grad_()
        probs = probs_all[ctx.rank].clone().requires_grad_()
        experts.zero_grad()

        def layer(h, p):
            return _moe_forward(dispatcher, experts, h, routing_all[ctx.rank], p)[0]

        out = layer(hidden, probs) if mode == "plain" else checkpoint.checkpoint(
            layer, hidden, probs, use_reentrant=mode == "reentrant")
        (out * grad_all[ctx.rank]).sum().backward()
        weight_grads = [param.grad.clone() for param in experts.parameters()]
        return [out.detach(), hidden.grad, probs.grad, *weight_grads]

    plain = step("plain")
    return {mode: max(_max_error(a, b) for a, b in zip(step(mode), plain, strict=True))
            for mode in ("reentrant", "non_reentrant")}


def _rank_all_cases(ctx) -> dict:
    _init_megatron(ctx)
    try:
        results = {}
        for index, (name, topk, probs_dtype) in enumerate(CASES):
            results[name] = _layer_case(ctx, topk, probs_dtype, seed=100 + index)
        for topk in (1, 4):
            results[f"restore_top{topk}"] = _restore_identity_case(ctx, topk, seed=200 + topk)
        for index, (name, quantization) in enumerate(QUANTIZATION_CASES):
            results[name] = _layer_case(ctx, 2, "float32", seed=500 + index, quantization=quantization)
        results["recompute"] = _recompute_case(ctx, seed=600)
    finally:
        _finish_megatron()
    # Expert tensor parallelism: the dispatcher expands the routing map over TP ranks
    # ([T, TP*E] reaches the manager) and combine sums the TP partial outputs.
    _init_megatron(ctx, tensor_parallel=2)
    try:
        results["tp2_top2"] = _layer_case(ctx, 2, "float32", seed=400, tensor_parallel=2)
    finally:
        _finish_megatron()
    return results


def _construct_outcome(config) -> str:
    """What building a flex dispatcher for ``config`` gives: our manager's backend, or the error."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    try:
        dispatcher = MoEFlexTokenDispatcher(NUM_EXPERTS, list(range(NUM_EXPERTS)), config=config,
                                            pg_collection=get_default_pg_collection())
    except BaseException as error:  # noqa: BLE001 - the outcome is what the test compares
        return f"{type(error).__name__}: {error}"
    manager = dispatcher._comm_manager
    return f"{type(manager).__name__}:{getattr(manager, 'backend_name', '')}"


def _backend_num_sms(knob: int, env_num_sms) -> int:
    """num_sms of the backend our manager builds for a config whose flex-dispatcher SM knob is ``knob``
    (0.19: moe_flex_dispatcher_num_sms, 0.16: moe_hybridep_num_sms), with EP_PLUGIN_NUM_SMS=env_num_sms."""
    import os

    import torch

    from ep_plugin.integrations.megatron.manager import EPPluginManager

    config = _make_config(2)
    knob_field = ("moe_flex_dispatcher_num_sms" if hasattr(config, "moe_flex_dispatcher_num_sms")
                  else "moe_hybridep_num_sms")
    setattr(config, knob_field, knob)
    before = os.environ.pop("EP_PLUGIN_NUM_SMS", None)
    if env_num_sms is not None:
        os.environ["EP_PLUGIN_NUM_SMS"] = env_num_sms
    try:
        manager = EPPluginManager("reference", group=torch.distributed.group.WORLD, num_local_experts=NUM_EXPERTS,
                                  num_experts=NUM_EXPERTS, config=config)
        routing_map = torch.zeros(4, NUM_EXPERTS, dtype=torch.bool)
        routing_map[:, :2] = True
        manager.setup_metadata(routing_map, routing_map.float())
        manager.dispatch(torch.randn(4, HIDDEN))
        return manager.backend.config.num_sms
    finally:
        os.environ.pop("EP_PLUGIN_NUM_SMS", None)
        if before is not None:
            os.environ["EP_PLUGIN_NUM_SMS"] = before


def _rank_single(ctx) -> dict:
    """World of one: Megatron's own flex path asserts TP x EP > 1; the plugin path must not."""
    import torch

    import ep_plugin.integrations.megatron as ep_megatron

    _init_megatron(ctx)
    try:
        results = {"layer": _layer_case(ctx, 2, "float32", seed=300)}
        # setup_metadata must trace without a graph break (dispatch_preprocess runs under torch.compile).
        dispatcher = _top2_dispatcher()
        manager = dispatcher._comm_manager

        def preprocess(routing_map, probs):
            manager.setup_metadata(routing_map, probs)
            return manager.token_probs * 1

        routing_map = torch.zeros(4, 1, NUM_EXPERTS, dtype=torch.bool)
        routing_map[:, 0, :2] = True
        compiled = torch.compile(preprocess, fullgraph=True, backend="eager")
        traced = compiled(routing_map, routing_map.float())
        results["compiled_shape"] = tuple(traced.shape)
        results["compiled_routing_shape"] = tuple(manager.routing_map.shape)
        # A model kept across clear_backend_cache() takes the new cache's backend, not the destroyed one.
        from ep_plugin.integrations.megatron.manager import clear_backend_cache

        manager.setup_metadata(routing_map, routing_map.float())
        manager.dispatch(torch.randn(4, HIDDEN))
        before = manager.backend
        clear_backend_cache()
        manager.dispatch(torch.randn(4, HIDDEN))
        results["new_backend_after_clear"] = manager.backend is not None and manager.backend is not before
        results["builtin_deepep"] = _construct_outcome(_make_config(2, "deepep"))
        # replace_builtin=True: "hybridep" reaches our manager on the plugin's hybrid backend
        # (or our BackendUnavailableError where this install lacks it), never Megatron's HybridEP.
        ep_megatron.install(replace_builtin=True)
        try:
            results["replaced_hybridep"] = _construct_outcome(_make_config(2, "hybridep", bf16=True))  # hybrid: bf16
        finally:
            ep_megatron.install(replace_builtin=False)
        results["builtin_hybridep"] = _construct_outcome(_make_config(2, "hybridep"))
        # What Megatron itself does with its own names, the plugin uninstalled for the moment.
        ep_megatron.uninstall()
        try:
            results["megatron_deepep"] = _construct_outcome(_make_config(2, "deepep"))
            results["megatron_hybridep"] = _construct_outcome(_make_config(2, "hybridep"))
        finally:
            ep_megatron.install()
        # Megatron's SM knob reaches our backend; EP_PLUGIN_NUM_SMS, where set, decides instead.
        results["num_sms"] = (_backend_num_sms(7, None), _backend_num_sms(7, "5"))
        results["decode_padding"] = _decode_padding_case()
        # Megatron's teardown of the process groups destroys the shared backends first (they hold buffers
        # on those groups); a model built after an in-process restart gets new ones.
        from megatron.core import parallel_state

        from ep_plugin.integrations.megatron import manager as manager_module

        generation = manager_module._cache_generation
        manager.dispatch(torch.randn(4, HIDDEN))  # a backend in the cache again
        parallel_state.destroy_model_parallel()
        results["teardown_cleared_cache"] = (not manager_module._backends,
                                             manager_module._cache_generation == generation + 1)
        return results
    finally:
        _finish_megatron()


def _decode_padding_case() -> dict:
    """A real MoELayer on ep_reference, switched to drop-and-pad by Megatron's inference helper (what
    moe_pad_experts_for_cuda_graph_inference does for decode) and back: the step in between raises.

    The step is the layer's router (its routing function, which applies the capacity: Megatron's gating
    matmul itself runs on CUDA only), dispatcher and experts."""
    import torch
    from megatron.core.inference.utils import set_decode_expert_padding
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    topk = 2
    experts = ModuleSpec(module=SequentialMLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                          linear_fc2=RowParallelLinear))
    layer = MoELayer(_make_config(topk), MoESubmodules(experts=experts))
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(TOKENS_PER_RANK, HIDDEN, generator=generator)
    logits = torch.randn(TOKENS_PER_RANK, NUM_EXPERTS, generator=generator)

    def step():
        probs, routing_map = layer.router.routing(logits)
        return _moe_forward(layer.token_dispatcher, layer.experts, hidden, routing_map, probs)[0]

    with torch.no_grad():
        before = step()
        set_decode_expert_padding(layer, True, capacity_factor=NUM_EXPERTS / topk)
        try:
            step()
            padded = "ran"
        except ValueError as error:
            padded = str(error)
        set_decode_expert_padding(layer, False)
        after = step()  # the layer and its backend stay usable
    return {"padded": padded, "same_after": torch.equal(before, after)}


def _rank_compiled(ctx, backend: str) -> dict:
    """The layer on a compiled backend, bf16 on the GPU (ranks share it where there are fewer GPUs)."""
    import torch

    torch.cuda.set_device(ctx.device)
    _init_megatron(ctx)
    try:
        return {f"top{topk}": _layer_case(ctx, topk, "float32", seed=600 + topk, backend=backend, device="cuda")
                for topk in (1, 4)}
    finally:
        _finish_megatron()


# ---- parent side ---------------------------------------------------------------------------------

def _check_layer(name: str, result: dict, tolerance: float, probs_grad_tolerance=None,
                 row_probs_dtype: str = "torch.float32") -> None:
    """``probs_grad_tolerance`` (default ``tolerance``) bounds grad_probs alone: every other key keeps ``tolerance``.
    ``row_probs_dtype``: what the experts get (fp32 but where the backend carries the router's fp64)."""
    for key in ("out", "grad_hidden", "grad_probs", "grad_fc1", "grad_fc2"):
        bound = probs_grad_tolerance if key == "grad_probs" and probs_grad_tolerance is not None else tolerance
        assert result[key] < bound, f"{name}: {key} differs from the dense layer by {result[key]:.3g}"
    assert result["tokens_per_expert"] == result["expected_tokens_per_expert"], (
        f"{name}: tokens_per_expert {result['tokens_per_expert']}, expected {result['expected_tokens_per_expert']}")
    assert result["out_dtype"] == "torch.float32" and result["out_shape"] == (TOKENS_PER_RANK, HIDDEN), name
    assert result["row_probs_dtype"] == row_probs_dtype, f"{name}: the experts' probs are {result['row_probs_dtype']}"
    assert result["manager"] == "EPPluginManager", name


@functools.lru_cache(maxsize=None)
def _all_cases_on(num_ranks: int) -> list:
    """One launch per rank count runs every case; the tests below share its results."""
    from ep_plugin.testing.launcher import run_ranks

    # torch.compile (Megatron's jit_fuser around dispatch_preprocess) stays on at 2 ranks; the
    # 4-rank launch skips compiling, which costs several seconds per process on a small CPU.
    env = {"TORCHDYNAMO_DISABLE": "1"} if num_ranks == 4 else {}
    return run_ranks(_rank_all_cases, num_ranks, timeout_s=600, env=env)


# The gradient returned to bf16 router probs is rounded to bf16: at most half an ulp, 2**-8 of its value (the
# measured error is about 2.6e-3 of the largest one). Nothing else in the layer is bf16.
BF16_PROBS_GRAD_TOLERANCE = 2**-8 + 1e-5


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_flex_dispatcher_matches_dense_layer(num_ranks):
    """Megatron's MoE layer on the plugin equals the dense layer: output and every gradient.

    With bf16 router probs the dense layer uses the same bf16-rounded probs, so output, token and weight
    gradients must match as tightly as with fp32 probs: a manager that changed the probs while casting
    them to fp32 (a scale, a wrong rounding) would show there, which a bf16-wide tolerance hid. Only the
    probs' own gradient, rounded to bf16 on its way back, gets a bf16 rounding's room."""
    results = _all_cases_on(num_ranks)
    for rank, per_rank in enumerate(results):
        for name, _topk, probs_dtype in CASES:
            result = per_rank[name]
            probs_grad_tolerance = BF16_PROBS_GRAD_TOLERANCE if probs_dtype == "bfloat16" else None
            _check_layer(f"rank {rank}/{num_ranks} {name}", result, 1e-5, probs_grad_tolerance,
                         "torch.float64" if probs_dtype == "float64" else "torch.float32")
            assert result["probs_grad_dtype"] == f"torch.{probs_dtype}"
        _check_layer(f"rank {rank}/{num_ranks} TP=2 x EP={num_ranks // 2}", per_rank["tp2_top2"], 1e-5)
        for topk in (1, 4):
            result = per_rank[f"restore_top{topk}"]
            label = f"rank {rank}/{num_ranks} restore top-{topk}"
            assert result["shape_ok"], label
            assert result["rows_match_counts"], label
            for key in ("restore", "grad_hidden", "grad_probs"):
                assert result[key] < 1e-5, f"{label}: {key} off by {result[key]:.3g}"


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_a_recomputed_moe_layer_matches_the_plain_one(num_ranks):
    for rank, per_rank in enumerate(_all_cases_on(num_ranks)):
        for mode, error in per_rank["recompute"].items():
            assert error < 1e-6, f"rank {rank}/{num_ranks} {mode} recompute off by {error:.3g}"


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_fp8_fp4_rows_padded_to_megatrons_alignment(num_ranks):
    results = _all_cases_on(num_ranks)
    for name, _quantization in QUANTIZATION_CASES:
        per_rank = [per_rank[name] for per_rank in results]
        pad_multiple = per_rank[0]["pad_multiple"]
        assert pad_multiple > 1, f"{name}: Megatron asks no padding here; the case tests nothing"
        # Some expert must receive a count that is not already a multiple, or padding is invisible.
        assert any(count % pad_multiple for result in per_rank for count in result["real_tokens_per_expert"]), name
        for rank, result in enumerate(per_rank):
            label = f"rank {rank}/{num_ranks} {name} (pad to {pad_multiple})"
            # tokens_per_expert == each routed count padded by Megatron's rule; output and gradients
            # still equal the dense layer's.
            _check_layer(label, result, 1e-5)
            assert result["padding_rows_zero"], f"{label}: padding rows or their probs are not zero"


def test_single_rank_plugin_path_and_traceable_metadata():
    """A world of one: the plugin path runs where Megatron's flex path refuses, setup_metadata traces under
    torch.compile, and Megatron's own names ("deepep", "hybridep") still get exactly Megatron's behaviour
    unless replace_builtin=True routes "hybridep" to the plugin."""
    from ep_plugin.testing.launcher import run_ranks

    (result,) = run_ranks(_rank_single, 1, timeout_s=300)
    _check_layer("single rank", result["layer"], 1e-5)
    assert result["compiled_shape"] == (4, NUM_EXPERTS)
    assert result["compiled_routing_shape"] == (4, NUM_EXPERTS)
    assert result["num_sms"] == (7, 5), result["num_sms"]
    assert result["new_backend_after_clear"]
    assert result["teardown_cleared_cache"] == (True, True), result["teardown_cleared_cache"]
    # Megatron's decode padding (switched on after the build-time check) is refused at the forward, not run
    # as a dropless dispatch of every token to every expert; switched off again, the layer runs as before.
    padding = result["decode_padding"]
    assert "drop-and-pad was switched on after the model was built" in padding["padded"], padding
    assert "moe_pad_experts_for_cuda_graph_inference" in padding["padded"], padding
    assert padding["same_after"], padding
    # Builtin names still reach Megatron's own code (0.16 refuses a world of one): installed, each gives what
    # Megatron gives uninstalled, so a wrap that refused or rerouted "hybridep" shows here.
    assert result["builtin_deepep"].startswith("AssertionError") and "TPxEP > 1" in result["builtin_deepep"]
    assert result["builtin_deepep"] == result["megatron_deepep"], (result["builtin_deepep"], result["megatron_deepep"])
    assert not result["megatron_hybridep"].startswith("EPPluginManager"), result["megatron_hybridep"]
    assert result["builtin_hybridep"] == result["megatron_hybridep"], (
        result["builtin_hybridep"], result["megatron_hybridep"])
    replaced = result["replaced_hybridep"]
    assert replaced == "EPPluginManager:hybrid" or (
        replaced.startswith("BackendUnavailableError") and "'hybrid'" in replaced), replaced


def _restore_error(dispatcher, num_tokens: int, generator, device: str = "cpu") -> float:
    """One top-2 call through the dispatcher: rows scaled by their probs and combined give the input back
    (probs of a token sum to one: exact in bf16 too, on ``device="cuda"``); returns the largest error."""
    import torch

    hidden = torch.randn(num_tokens, HIDDEN, generator=generator)
    if device != "cpu":
        hidden = hidden.to(device, torch.bfloat16)
    top = torch.rand(num_tokens, NUM_EXPERTS, generator=generator).topk(2, dim=-1).indices
    routing_map = torch.zeros(num_tokens, NUM_EXPERTS, dtype=torch.bool).scatter(-1, top, True).to(device)
    probs = routing_map.float() / 2
    hidden_2d, token_probs = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    rows, row_probs = dispatcher.token_dispatch(hidden_2d, token_probs)
    rows, _, row_probs = dispatcher.dispatch_postprocess(rows, row_probs)
    scaled = (rows * row_probs.unsqueeze(-1)).to(rows.dtype)  # the probs are fp32
    combined = dispatcher.token_combine(dispatcher.combine_preprocess(scaled))
    return _max_error(dispatcher.combine_postprocess(combined), hidden)


def _tokens_past_the_default(ctx, backend: str = "ep_reference") -> dict:
    """Megatron's tokens per rank (sequence x micro-batch) are not in its config: the first call sizes the backend,
    and a longer call grows it. A compiled ``backend`` runs on the GPU, in bf16."""
    import os

    import torch

    from ep_plugin.config import Config
    from ep_plugin.integrations.megatron import manager as manager_module
    from ep_plugin.integrations.megatron.manager import clear_backend_cache

    on_gpu = backend != "ep_reference"
    device = ctx.device if on_gpu else "cpu"
    if on_gpu:
        torch.cuda.set_device(device)
    _init_megatron(ctx)
    try:
        dispatcher, next_layer = (_make_layer(_make_config(2, backend, bf16=on_gpu),
                                              torch.zeros(NUM_EXPERTS, FFN, HIDDEN),
                                              torch.zeros(NUM_EXPERTS, HIDDEN, FFN))[0] for _ in range(2))
        generator = torch.Generator().manual_seed(ctx.rank)

        def restore_error(num_tokens: int, layer=dispatcher) -> float:
            return _restore_error(layer, num_tokens, generator, device)

        default = Config().max_tokens_per_rank
        outcome = {"default": default}
        # The call that builds the backend: rank 0 is past the default, rank 1 is not; both get rank 0's room.
        outcome["first"] = restore_error(default + 64 if ctx.rank == 0 else 8)
        outcome["room"] = dispatcher._comm_manager.backend.config.max_tokens_per_rank
        outcome["then"] = restore_error(default + 64)  # rank 1 too, on the same backend
        restore_error(8, next_layer)  # another MoE layer shares it
        manager = dispatcher._comm_manager
        first = manager.backend

        def forward_kept(num_tokens: int):
            hidden = torch.randn(num_tokens, HIDDEN, generator=generator)
            hidden = hidden.to(device, torch.bfloat16 if on_gpu else torch.float32).requires_grad_()
            top = torch.rand(num_tokens, NUM_EXPERTS, generator=generator).topk(2, dim=-1).indices
            routing_map = torch.zeros(num_tokens, NUM_EXPERTS, dtype=torch.bool).scatter(-1, top, True).to(device)
            hidden_2d, token_probs = dispatcher.dispatch_preprocess(hidden, routing_map, routing_map.float() / 2)
            rows, _ = dispatcher.token_dispatch(hidden_2d, token_probs)
            return hidden, dispatcher.token_combine(rows)  # each token's two copies summed: 2 x hidden

        # A training micro-batch, its backward done: the manager still holds its handle (with the probs), but
        # no op of it is left.
        _, combined = forward_kept(8)
        combined.sum().backward()
        # Past it on rank 0 only (a longer sequence at evaluation): every rank refuses together, then builds a
        # larger backend together (half again as large at least), and the call runs. No op is left to run on the
        # first: it is destroyed.
        outcome["past"] = restore_error(default + 65 if ctx.rank == 0 else 8)
        grown = manager.backend
        room = grown.config.max_tokens_per_rank
        outcome["grown"] = (grown is not first, room, first.destroyed)
        # The next layer takes the grown backend (its own was destroyed), with no second build.
        outcome["next_layer"] = (restore_error(default + 65 if ctx.rank == 0 else 8, next_layer),
                                 next_layer._comm_manager.backend is grown)

        # Micro-batches whose backward is still to come hold handles of the grown backend; a longer call then
        # grows it again but keeps it, and their backward runs on it.
        hidden, pending = forward_kept(default + 1 if ctx.rank == 0 else 8)
        outcome["again"] = restore_error(room + 1 if ctx.rank == 1 else 8)
        outcome["kept"] = (manager.backend.config.max_tokens_per_rank, grown.destroyed,
                           [backend is grown for backend in manager_module._retired])
        pending.sum().backward()  # on the kept backend, every rank: each token's gradient is 2
        outcome["kept_backward"] = float((hidden.grad.float() - 2).abs().max())
        # One rank's handle is enough to keep a backend for every rank (rank 1's graph here, never run).
        second = manager.backend
        held = forward_kept(8)
        if ctx.rank == 0:  # rank 0 drops its graph (the manager keeps the last dispatch's probs, and so its graph)
            held = manager.dispatched_probs = None
        restore_error(second.config.max_tokens_per_rank + 1 if ctx.rank == 0 else 8)
        # The first kept one, its backward done, is freed by this later build; the second is kept for rank 1.
        outcome["kept_for_a_peer"] = (second.destroyed, manager_module._retired == [second], grown.destroyed)
        del held
        outcome["after"] = restore_error(default + 64)  # the backend goes on
        # A grow whose build is refused (a variable that does not parse on rank 1): the old backend is kept for
        # clear_backend_cache(), and the next call builds anew.
        before = manager.backend
        os.environ["EP_PLUGIN_TIMEOUT_S"] = "soon" if ctx.rank == 1 else "30"
        try:
            restore_error(before.config.max_tokens_per_rank + 1 if ctx.rank == 0 else 8)
            outcome["refused_grow"] = "ran"
        except ValueError as error:
            outcome["refused_grow"] = f"{type(error).__name__}: {error}"
        del os.environ["EP_PLUGIN_TIMEOUT_S"]
        outcome["kept_after_refused_grow"] = (before in manager_module._retired, before.destroyed)
        outcome["after_refused_grow"] = restore_error(8)
        # EP_PLUGIN_MAX_TOKENS_PER_RANK decides wherever it is set, the first call's size notwithstanding.
        clear_backend_cache()
        os.environ["EP_PLUGIN_MAX_TOKENS_PER_RANK"] = "100"
        try:  # rank 0 past it, rank 1 not: refused on both (none waits for the other), nothing built
            restore_error(default + 64 if ctx.rank == 0 else 8)
            outcome["set"] = "ran"
        except ValueError as error:
            outcome["set"] = f"{type(error).__name__}: {error}"
        outcome["set_then"] = restore_error(50)  # within it: built for 100, and runs
        outcome["room_set"] = dispatcher._comm_manager.backend.config.max_tokens_per_rank
        outcome["kept_destroyed_by_clear"] = (grown.destroyed and second.destroyed and before.destroyed
                                              and not manager_module._retired)
        try:  # past the size the user set: refused on every rank, no second build
            restore_error(150 if ctx.rank == 1 else 8)
            outcome["set_past"] = "ran"
        except ValueError as error:
            outcome["set_past"] = f"{type(error).__name__}: {error}"
        outcome["set_past_room"] = dispatcher._comm_manager.backend.config.max_tokens_per_rank
        return outcome
    finally:
        _finish_megatron()


@pytest.mark.parametrize("backend, scaleup_size", [
    ("ep_reference", ""), ("ep_reference", "1"),  # "1": two NVLink domains of one rank (the backend across them)
    pytest.param("ep_hybrid", "", marks=pytest.mark.gpu), pytest.param("ep_elastic", "", marks=pytest.mark.gpu)])
def test_the_first_call_sizes_the_backend_for_megatrons_tokens_per_rank(backend, scaleup_size):
    """Recipes at sequence 4096 x micro-batch 4 have 16384 tokens per rank, past the default 8192: the backend
    is sized from the first call (the largest over the group), as HybridEP's buffer is, instead of refusing
    the first forward. A later call past that size on one rank (evaluation at a longer sequence) is refused on
    every rank (the reference backend's exchange carries the refusal), and every rank builds a larger backend
    and runs it; the old one is destroyed, or kept while a micro-batch's backward is still to run on it (that
    backward then runs). EP_PLUGIN_MAX_TOKENS_PER_RANK, where set, decides: a call past it is refused on every
    rank, the first or a later one."""
    from ep_plugin.testing.launcher import run_ranks

    # An EP_PLUGIN_MAX_TOKENS_PER_RANK of the caller's would decide instead (empty counts as unset).
    results = run_ranks(_tokens_past_the_default, 2, backend, timeout_s=300,
                        device="cpu" if backend == "ep_reference" else "cuda",
                        env={"TORCHDYNAMO_DISABLE": "1", "EP_PLUGIN_MAX_TOKENS_PER_RANK": "",
                             "EP_PLUGIN_SCALEUP_SIZE": scaleup_size})
    for rank, outcome in enumerate(results):
        default = outcome["default"]
        assert outcome["room"] == default + 64, (rank, outcome["room"])
        assert outcome["first"] < 1e-5 and outcome["then"] < 1e-5, (rank, outcome)
        # Before: "past" raised ValueError on every rank, and the job ended.
        grown_room = (default + 64) * 3 // 2  # half again the first's room, past the call's own default + 65
        assert outcome["past"] < 1e-5 and outcome["grown"] == (True, grown_room, True), (rank, outcome)
        assert outcome["next_layer"][0] < 1e-5 and outcome["next_layer"][1], (rank, outcome)
        assert outcome["again"] < 1e-5 and outcome["kept"] == (grown_room * 3 // 2, False, [True]), (rank, outcome)
        assert outcome["kept_backward"] < 1e-5, (rank, outcome)
        assert outcome["kept_for_a_peer"] == (False, True, True), (rank, outcome)
        assert outcome["after"] < 1e-5 and outcome["kept_destroyed_by_clear"], (rank, outcome)
        assert "EP_PLUGIN_TIMEOUT_S='soon'" in outcome["refused_grow"], (rank, outcome)
        assert outcome["kept_after_refused_grow"] == (True, False) and outcome["after_refused_grow"] < 1e-5, outcome
        assert f"EP_PLUGIN_MAX_TOKENS_PER_RANK=100 (rank 0: {default + 64})" in outcome["set"], (rank, outcome)
        assert outcome["room_set"] == 100 and outcome["set_then"] < 1e-5, (rank, outcome)
        assert outcome["set_past"].startswith("TooManyTokensError: ") and outcome["set_past_room"] == 100, outcome
        assert "EP_PLUGIN_MAX_TOKENS_PER_RANK" in outcome["set_past"], outcome


def _top2_dispatcher():
    """A top-2 flex dispatcher on ep_reference with zero expert weights (the tests drive its manager)."""
    import torch

    return _make_layer(_make_config(2), torch.zeros(NUM_EXPERTS, FFN, HIDDEN), torch.zeros(NUM_EXPERTS, HIDDEN, FFN))[0]


def _micro_batch_with_backward_to_come(dispatcher, generator):
    """A forward through the dispatcher (8 tokens, experts 0 and 1) whose backward has not run: its handle holds
    the backend it ran on. Returns the combined output (the graph)."""
    import torch

    hidden = torch.randn(8, HIDDEN, generator=generator, requires_grad=True)
    routing_map = torch.zeros(8, NUM_EXPERTS, dtype=torch.bool)
    routing_map[:, :2] = True
    hidden_2d, token_probs = dispatcher.dispatch_preprocess(hidden, routing_map, routing_map.float() / 2)
    return dispatcher.token_combine(dispatcher.token_dispatch(hidden_2d, token_probs)[0])


def _a_grow_whose_destroy_fails(ctx) -> dict:
    """A grow that frees two backends (one kept earlier for a backward, now done; the one grown past) while the
    first one's destroy raises (planted on every rank): the error reaches the call, and the second is kept for a
    later build, which frees it."""
    import torch

    from ep_plugin.config import Config
    from ep_plugin.integrations.megatron import manager as manager_module

    _init_megatron(ctx)
    try:
        dispatcher = _top2_dispatcher()
        manager = dispatcher._comm_manager
        generator = torch.Generator().manual_seed(ctx.rank)
        default = Config().max_tokens_per_rank
        _restore_error(dispatcher, 8, generator)
        first = manager.backend
        # A micro-batch with its backward to come holds the first backend through a grow: it is kept.
        pending = _micro_batch_with_backward_to_come(dispatcher, generator)
        _restore_error(dispatcher, default + 1 if ctx.rank == 0 else 8, generator)
        second = manager.backend
        outcome = {"first_kept": manager_module._retired == [first] and not first.destroyed}
        pending.sum().backward()  # its backward done: the next build may free the first

        def planted_failure():
            raise RuntimeError("planted: destroy failed")

        first.destroy = planted_failure
        try:
            _restore_error(dispatcher, second.config.max_tokens_per_rank + 1 if ctx.rank == 1 else 8, generator)
            outcome["failed_grow"] = "ran"
        except RuntimeError as error:
            outcome["failed_grow"] = str(error)
        # The first is dropped (its destroy ran, and failed); the second, not yet destroyed, is kept.
        outcome["after_failure"] = (first in manager_module._retired, second in manager_module._retired,
                                    second.destroyed)
        # The next call builds anew (nothing is cached) and frees the second on the way.
        outcome["next"] = _restore_error(dispatcher, 8, generator)
        outcome["second_freed"] = (second.destroyed, manager_module._retired == [],
                                   manager.backend is not second)
        return outcome
    finally:
        _finish_megatron()


def test_a_grow_whose_destroy_fails_keeps_the_backends_it_did_not_reach():
    """A destroy that raises while a grow frees backends (a timeout, say) reaches the caller on every rank; the
    backends after it in the list stay on the books (``_retired``) for a later build or clear_backend_cache(),
    instead of being dropped with their buffers unreleased, and the layer goes on."""
    from ep_plugin.testing.launcher import run_ranks

    results = run_ranks(_a_grow_whose_destroy_fails, 2, timeout_s=300,
                        env={"TORCHDYNAMO_DISABLE": "1", "EP_PLUGIN_MAX_TOKENS_PER_RANK": ""})
    for rank, outcome in enumerate(results):
        assert outcome["first_kept"], (rank, outcome)
        assert outcome["failed_grow"] == "planted: destroy failed", (rank, outcome)
        assert outcome["after_failure"] == (False, True, False), (rank, outcome)
        assert outcome["next"] < 1e-5 and outcome["second_freed"] == (True, True, True), (rank, outcome)


def _a_kept_backend_freed_by_a_later_check(ctx) -> dict:
    """A grow keeps the old backend for a micro-batch whose backward is to come (rank 1's graph, never run: a
    handle held is enough); no build follows. The ranks' check every RETIRED_CHECK_INTERVAL-th dispatch keeps
    it while rank 1 holds the graph, and frees it at the first check after rank 1 let go."""
    import torch

    from ep_plugin.config import Config
    from ep_plugin.integrations.megatron import manager as manager_module

    _init_megatron(ctx)
    try:
        dispatcher = _top2_dispatcher()
        manager = dispatcher._comm_manager
        generator = torch.Generator().manual_seed(ctx.rank)
        interval = manager_module.RETIRED_CHECK_INTERVAL

        def step() -> float:
            return _restore_error(dispatcher, 8, generator)

        step()
        first = manager.backend
        held = _micro_batch_with_backward_to_come(dispatcher, generator)
        if ctx.rank == 0:  # rank 0 lets go of its graph
            held = None
        _restore_error(dispatcher, Config().max_tokens_per_rank + 1 if ctx.rank == 0 else 8, generator)  # grows
        outcome = {"kept": manager_module._retired == [first] and not first.destroyed}
        errors = [step() for _ in range(interval)]  # the last one's check: rank 1 still holds its graph
        outcome["while_held"] = (first.destroyed, manager_module._retired == [first])
        del held
        errors += [step() for _ in range(interval - 1)]
        outcome["one_before"] = first.destroyed
        errors.append(step())  # the next check: nobody holds it
        outcome["freed"] = (first.destroyed, manager_module._retired == [])
        outcome["errors"] = max(errors)
        return outcome
    finally:
        _finish_megatron()


def _a_dropped_forward_holds_no_backend(ctx) -> dict:
    """A forward with grad on whose output is dropped without a backward (evaluation without torch.no_grad): its
    handle no longer counts as a backward to come, so a grow frees the backend at once."""
    import gc

    import torch

    from ep_plugin.integrations.megatron import manager as manager_module

    _init_megatron(ctx)
    try:
        dispatcher = _top2_dispatcher()
        generator = torch.Generator().manual_seed(ctx.rank)
        output = _micro_batch_with_backward_to_come(dispatcher, generator)
        backend = dispatcher._comm_manager.backend
        outcome = {"while_held": manager_module._backward_to_come(backend)}
        del output
        gc.collect()
        outcome["dropped"] = manager_module._backward_to_come(backend)
        return outcome
    finally:
        _finish_megatron()


def test_a_forward_whose_output_is_dropped_holds_no_backward():
    """Before, the manager kept the last dispatch's probs past the combine, and with them the dispatch's graph:
    the handle stayed pending, so a grow kept the old backend until the next check after the next dispatch."""
    from ep_plugin.testing.launcher import run_ranks

    for rank, outcome in enumerate(run_ranks(_a_dropped_forward_holds_no_backend, 2, timeout_s=300,
                                             env={"TORCHDYNAMO_DISABLE": "1"})):
        assert outcome == {"while_held": True, "dropped": False}, (rank, outcome)


def test_a_backend_kept_by_a_grow_is_freed_once_no_rank_holds_its_backward():
    """Before, a backend kept for a pending backward was freed only by a later build or the job's end: under
    pipeline parallelism (a micro-batch's backward nearly always to come) one grow kept the old buffer for
    good."""
    from ep_plugin.testing.launcher import run_ranks

    results = run_ranks(_a_kept_backend_freed_by_a_later_check, 2, timeout_s=300,
                        env={"TORCHDYNAMO_DISABLE": "1", "EP_PLUGIN_MAX_TOKENS_PER_RANK": ""})
    for rank, outcome in enumerate(results):
        assert outcome["kept"] and outcome["while_held"] == (False, True), (rank, outcome)
        assert outcome["one_before"] is False and outcome["freed"] == (True, True), (rank, outcome)
        assert outcome["errors"] < 1e-5, (rank, outcome)


def _a_first_call_past_the_set_size(ctx) -> dict:
    """EP_PLUGIN_MAX_TOKENS_PER_RANK=16 on every rank, and rank 1's first call has 40 tokens; then a call that fits."""
    import torch

    from ep_plugin.errors import TooManyTokensError

    _init_megatron(ctx)
    try:
        dispatcher = _top2_dispatcher()
        generator = torch.Generator().manual_seed(ctx.rank)
        try:
            _restore_error(dispatcher, 40 if ctx.rank == 1 else 8, generator)
            outcome = {"first": "ran"}
        except TooManyTokensError as error:
            outcome = {"first": f"TooManyTokensError: {error}"}
        outcome["fits"] = _restore_error(dispatcher, 16 if ctx.rank == 1 else 8, generator)
        return outcome
    finally:
        _finish_megatron()


def test_a_first_call_past_a_set_size_is_refused_on_every_rank_as_too_many_tokens():
    """The size the user set stands, from the first call on: every rank raises TooManyTokensError (as a later call
    past it does; before, the first call's refusal was a plain ValueError) naming the rank over it, and a call that
    fits runs after it."""
    from ep_plugin.testing.launcher import run_ranks

    for rank, outcome in enumerate(run_ranks(_a_first_call_past_the_set_size, 2, timeout_s=300,
                                             env={"TORCHDYNAMO_DISABLE": "1", "EP_PLUGIN_MAX_TOKENS_PER_RANK": "16"})):
        assert outcome["first"].startswith("TooManyTokensError: ep_plugin megatron: the first MoE call has more "
                                           "tokens per rank than EP_PLUGIN_MAX_TOKENS_PER_RANK=16"), (rank, outcome)
        assert "rank 1: 40" in outcome["first"], (rank, outcome)
        assert outcome["fits"] < 1e-5, (rank, outcome)


def _a_setting_on_rank_1_only(ctx, variable: str, value: str, backend: str = "ep_reference") -> dict:
    """The first call with ``variable`` set on rank 1 only, then (unset again) the same call. A compiled
    ``backend`` runs on the GPU, in bf16."""
    import os

    import torch

    device = "cpu" if backend == "ep_reference" else "cuda"
    if device == "cuda":
        torch.cuda.set_device(ctx.device)
    _init_megatron(ctx)
    try:
        if device == "cpu":
            dispatcher = _top2_dispatcher()
        else:
            dispatcher = _make_layer(_make_config(2, backend, bf16=True), torch.zeros(NUM_EXPERTS, FFN, HIDDEN),
                                     torch.zeros(NUM_EXPERTS, HIDDEN, FFN))[0]
        generator = torch.Generator().manual_seed(ctx.rank)
        if ctx.rank == 1:
            os.environ[variable] = value
        try:  # rank 1 past its own limit where the variable is the token limit
            _restore_error(dispatcher, 200 if ctx.rank == 1 else 8, generator, device)
            outcome = {"first": "ran"}
        except ValueError as error:
            outcome = {"first": f"{type(error).__name__}: {error}"}
        os.environ.pop(variable, None)
        outcome["again"] = _restore_error(dispatcher, 200 if ctx.rank == 1 else 8, generator, device)
        return outcome
    finally:
        _finish_megatron()


@pytest.mark.parametrize("variable, value, named", [
    ("EP_PLUGIN_MAX_TOKENS_PER_RANK", "100", "EP_PLUGIN_MAX_TOKENS_PER_RANK (whether, and to what, it is set): "
                                             "rank 0: unset, rank 1: 100"),
    ("EP_PLUGIN_COMBINE_INPUT_ROWS", "64", "EP_PLUGIN_COMBINE_INPUT_ROWS (whether, and to what, it is set): "
                                           "rank 0: unset, rank 1: 64"),
    ("EP_PLUGIN_TIMEOUT_S", "soon", "rank 1: ep_plugin config: cannot parse EP_PLUGIN_TIMEOUT_S='soon'"),
])
def test_a_setting_on_one_rank_only_is_refused_on_every_rank_at_the_build(variable, value, named):
    """An env file of one node: a variable that decides the build's first steps (the token limit, the arena's
    size), or one that does not parse, set on one rank only. That rank refused alone, or took another path
    than its peers, which then waited out the timeout or met it in another setup step, and no message named
    the variable. Now every rank raises ValueError naming it and each rank's value, at once, nothing is
    built, and the same call runs once the variable is gone."""
    from ep_plugin.testing.launcher import run_ranks

    results = run_ranks(_a_setting_on_rank_1_only, 2, variable, value, timeout_s=300,
                        env={"TORCHDYNAMO_DISABLE": "1", "EP_PLUGIN_TIMEOUT_S": "20", variable: ""})
    for rank, outcome in enumerate(results):
        assert outcome["first"].startswith("ValueError: ep_plugin megatron: no rank builds the backend"), \
            (rank, outcome)
        assert named in outcome["first"], (rank, outcome)
        assert outcome["again"] < 1e-5, (rank, outcome)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["ep_hybrid", "ep_elastic"])
def test_sync_free_mode_on_one_rank_only_is_refused_on_every_rank(backend):
    """EP_PLUGIN_BLOCKING=0 (its outputs' rows past the count unwritten, which Megatron's experts would compute
    with) from one node's env file: refused at model build on the ranks that had it alone, the others went on
    into Megatron's next collective and waited there. Now the first dispatch's exchange refuses it on every
    rank, naming it, and the call runs once it is unset."""
    from ep_plugin.testing.launcher import run_ranks

    results = run_ranks(_a_setting_on_rank_1_only, 2, "EP_PLUGIN_BLOCKING", "0", backend, device="cuda",
                        timeout_s=300, env={"TORCHDYNAMO_DISABLE": "1", "EP_PLUGIN_TIMEOUT_S": "20",
                                            "EP_PLUGIN_BLOCKING": ""})
    for rank, outcome in enumerate(results):
        assert outcome["first"].startswith("ValueError: ep_plugin megatron: no rank builds the backend"), \
            (rank, outcome)
        assert f"rank 1: moe_flex_dispatcher_backend='{backend}' with EP_PLUGIN_BLOCKING=0" in outcome["first"], \
            (rank, outcome)
        assert outcome["again"] < BF16_TOLERANCE, (rank, outcome)


def test_the_exchange_that_reports_an_unparsable_variable_keeps_the_ones_that_parse(monkeypatch):
    """The rank whose EP_PLUGIN_* variable does not parse still runs the build's first exchange, to tell its
    peers: with the job's timeout and host-word engine (EP_PLUGIN_GLOO_HOST_WORDS=0 keeps the words on NCCL),
    as the peers run it, not the defaults (a gloo twin the peers never make), and with Megatron's SM knob, so
    that a refresh finds the backend the peers cached (before: another cache key, a build on this rank alone)."""
    from ep_plugin.integrations.megatron import compat
    from ep_plugin.integrations.megatron.manager import _config_of_what_parses

    megatron_config = _make_config(2)
    setattr(megatron_config, compat.dispatcher_num_sms_field(megatron_config), 12)  # 0.16: default 16; 0.19: unset
    monkeypatch.setenv("EP_PLUGIN_NUM_SMS", "many")
    monkeypatch.setenv("EP_PLUGIN_TIMEOUT_S", "600")
    monkeypatch.setenv("EP_PLUGIN_GLOO_HOST_WORDS", "0")
    config = _config_of_what_parses(megatron_config)
    assert (config.timeout_s, config.gloo_host_words, config.num_sms) == (600.0, False, 12), config
    monkeypatch.setenv("EP_PLUGIN_NUM_SMS", "7")  # where it parses, it decides, as in backend_config
    assert _config_of_what_parses(megatron_config).num_sms == 7


# bf16 tokens, weights and expert GEMMs against float64 over the same rounded values: a few bf16 ulps
# (2**-8 relative) of the largest value; a wrong row, weight or count is off by order one.
BF16_TOLERANCE = 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["ep_hybrid", "ep_elastic"])
def test_compiled_backends_match_dense_layer_on_the_gpu(backend):
    """Megatron's MoE layer on our compiled kernels: output and every gradient as the dense layer's."""
    from ep_plugin.integrations.megatron import PLUGIN_BACKENDS
    from ep_plugin.testing.launcher import run_ranks

    results = run_ranks(_rank_compiled, 2, backend, device="cuda", timeout_s=400)
    for rank, per_rank in enumerate(results):
        for name, result in per_rank.items():
            label = f"{backend} rank {rank}/2 {name}"
            assert result["backend"] == PLUGIN_BACKENDS[backend], (label, result["backend"])
            errors = {key: result[key] for key in ("out", "grad_hidden", "grad_probs", "grad_fc1", "grad_fc2")}
            print(label, {key: f"{error:.2e}" for key, error in errors.items()})  # shown with -s
            assert all(error < BF16_TOLERANCE for error in errors.values()), (label, errors)
            assert result["tokens_per_expert"] == result["expected_tokens_per_expert"], (label, result)
            # On the host, as DeepEP's dispatcher gives them: the legacy GroupedMLP refuses device counts,
            # and SequentialMLP's .tolist() of device counts would wait for the dispatch.
            assert result["tokens_per_expert_device"] == "cpu", (label, result["tokens_per_expert_device"])
            assert result["out_dtype"] == "torch.bfloat16" and result["out_shape"] == (TOKENS_PER_RANK, HIDDEN), label
            assert result["row_probs_dtype"] == "torch.float32", label
