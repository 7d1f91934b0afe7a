"""Train a tiny GPT-MoE built by Megatron-Bridge's GPTModelProvider, on ep_plugin through Bridge's config path.

    python examples/nemo/bridge_train.py --ranks 4 --dispatcher ep_hybrid --steps 20 --out ep_hybrid.json
    python examples/nemo/bridge_train.py --ranks 1 --grad-accum 4 --dispatcher alltoall --steps 20 \\
        --out alltoall.json
    python examples/megatron/plot_loss.py ep_hybrid.json alltoall.json --out loss.png

The model config is a Bridge ``GPTModelProvider`` set up as a Bridge MoE recipe sets
``cfg.model`` (dispatcher "alltoall", shared-expert overlap off by default), then, for a
plugin name, the line a NeMo user adds (docs/megatron.md):

    apply_ep_plugin_backend(cfg.model, "ep_hybrid")

then Bridge's ``finalize()`` and ``provide()`` build the Megatron GPTModel. For "alltoall"
the helper is not called: Megatron's own alltoall dispatcher, the recipe's default. Bridge's
layer spec is its ``local_layer_spec`` (no TransformerEngine, which the GPU machine lacks),
and fusions that need Apex or TransformerEngine are off.

Everything else -- ranks (sharing one GPU over gloo under a private MPS daemon, as in
examples/megatron), synthetic data, initial weights by parameter name, AdamW steps, the
printed loss per step and the JSON -- is examples/megatron/train_gpt_moe.py's, with the same
options; see that file for why one alltoall rank with ``--grad-accum R`` sees the same data
as R plugin ranks.

Bridge's package __init__ imports TransformerEngine; ep_plugin.testing.bridge imports the
provider module without it (only where TransformerEngine is missing).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# Spawned ranks import this file and train_gpt_moe by module name (sys.path travels with spawn).
for folder in (HERE, os.path.join(HERE, "..", "megatron")):
    if folder not in sys.path:
        sys.path.insert(0, folder)

from train_gpt_moe import PLUGIN_PREFIX, parse_args, run, train_rank  # noqa: E402


def bridge_provider(args):
    """A finalized Bridge GPTModelProvider with ``args.dispatcher`` applied as a NeMo user would."""
    import torch

    from ep_plugin.integrations.nemo import apply_ep_plugin_backend, validate_ep_plugin_backend
    from ep_plugin.testing.bridge import import_bridge_module

    gpt_provider = import_bridge_module("megatron.bridge.models.gpt_provider")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    provider = gpt_provider.GPTModelProvider(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, ffn_hidden_size=args.ffn,
        vocab_size=args.vocab, seq_length=args.seq_len, position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=args.dtype == "bf16", use_cpu_initialization=True,
        transformer_layer_spec=gpt_provider.local_layer_spec,
        # Fusions whose kernels come from Apex / TransformerEngine: off (neither is on the GPU machine).
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, cross_entropy_loss_fusion=False,
        num_moe_experts=args.experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn,
        moe_router_dtype="fp32", moe_grouped_gemm=False, moe_permute_fusion=False,
        moe_router_load_balancing_type="aux_loss" if args.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=args.aux_loss_coeff)
    # The recipe's parallelism and dispatcher lines ...
    provider.expert_model_parallel_size = args.ranks
    provider.moe_token_dispatcher_type = "alltoall"
    # ... and the NeMo user's line.
    if args.dispatcher.startswith(PLUGIN_PREFIX):
        if not apply_ep_plugin_backend(provider, args.dispatcher):
            raise SystemExit(f"apply_ep_plugin_backend(provider, {args.dispatcher!r}) left the dispatcher at "
                             f"{provider.moe_token_dispatcher_type!r} (see the warning above)")
    elif args.dispatcher != "alltoall":
        raise SystemExit(f"--dispatcher {args.dispatcher!r}: a plugin name (ep_*) or alltoall")
    provider.finalize()
    validate_ep_plugin_backend(provider)
    return provider


def build_bridge_model(args, device):
    """The GPTModel that Bridge's provider builds (``train_rank``'s ``build``)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import Float16Module

    provider = bridge_provider(args)
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()  # as provide_distributed_model does
    model = provider.provide()
    if args.dtype == "bf16":
        model = Float16Module(provider, model)  # what Bridge's get_model wraps bf16 models in
    return model.to(device), provider


def bridge_rank(ctx, args) -> dict:
    return train_rank(ctx, args, build=build_bridge_model)


def main(argv=None) -> None:
    args = parse_args(argv)
    from bridge_train import bridge_rank as rank_function  # by module name, for the spawned ranks

    run(args, rank_function)


if __name__ == "__main__":
    main()
