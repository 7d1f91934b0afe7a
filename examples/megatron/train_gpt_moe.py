"""Train a small Megatron-Core GPT with MoE layers on synthetic data, with the plugin's dispatcher.

    python examples/megatron/train_gpt_moe.py --ranks 4 --dispatcher ep_hybrid --steps 50 --out hybrid.json
    python examples/megatron/train_gpt_moe.py --ranks 1 --grad-accum 4 --dispatcher alltoall --steps 50 \\
        --out alltoall.json
    python examples/megatron/plot_loss.py hybrid.json alltoall.json --out loss.png

The model is a GPTModel built from Megatron's local layer spec (no TransformerEngine):
attention + MoE layers whose experts are SequentialMLP, the router in fp32. Expert
parallelism spans all ranks (EP = --ranks, TP = PP = 1); the ranks are also data-parallel
for the dense weights. Ranks are processes started by ep_plugin's launcher: one per GPU
over NCCL, or several sharing a GPU over gloo under a private MPS daemon.

``--dispatcher`` is "ep_hybrid", "ep_reference" (any plugin name: flex dispatcher on that
backend) or Megatron's own "alltoall". Megatron's alltoall dispatcher needs NCCL (gloo moves
no CUDA tensors in all_to_all), so on ranks sharing one GPU the comparison run uses one rank
with ``--grad-accum`` equal to the other run's rank count: it sees the same micro-batches,
starts from the same weights (every weight is drawn from a seed derived from its name, with
expert indices made global) and takes the same optimizer steps, so the loss curves agree
up to numerics.

Each step prints the loss (mean over all micro-batches of the step) and the tokens/s of the
whole job; ``--out`` writes them as JSON for plot_loss.py.

Synthetic data: each sequence is an arithmetic progression modulo the vocabulary with a
random start and a random stride in [1, 8]; the next token is predictable from the two
before it, so the loss falls quickly from ln(vocab).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import zlib

PLUGIN_PREFIX = "ep_"


def parse_args(argv=None) -> argparse.Namespace:
    import torch

    from ep_plugin.cli import OneLineParser

    parser = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dispatcher", default="ep_hybrid",
                        help="ep_hybrid | ep_reference | ep_elastic (flex dispatcher on ep_plugin) or alltoall")
    parser.add_argument("--ranks", type=int, default=4, help="processes; EP size = DP size = ranks")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="where the model and batches live; Megatron's layers call CUDA, so it needs a GPU "
                             "either way (./dev demo is the CPU path)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per rank per step")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1024, help="FFN size of each expert")
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer (divisible by --ranks)")
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--aux-loss-coeff", type=float, default=0.0,
                        help="load-balancing aux loss coefficient (0 = no load balancing loss)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="parameter/activation dtype")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=None, help="write losses and throughput to this JSON file")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():  # else a rank's traceback from Megatron's first CUDA call
        parser.error("needs a CUDA GPU (Megatron's layers call CUDA, even with --device cpu) and torch sees none "
                     "here; without a GPU, ./dev demo trains a small MoE through ep_plugin on CPU ranks")
    if args.experts % args.ranks:
        parser.error(f"--experts {args.experts} must be divisible by --ranks {args.ranks}")
    return args


# ---- data and initial weights, identical whatever the rank layout -------------------------------

def synthetic_batch(args, step: int, rank: int, micro: int):
    """Micro-batch ``micro`` of ``rank`` at ``step``: [b, s+1] tokens. Depends only on the global
    micro-batch index, so 4 ranks x 1 micro-batch and 1 rank x 4 micro-batches see the same data."""
    import torch

    index = (step * args.ranks + rank) * args.grad_accum + micro
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + index)
    start = torch.randint(0, args.vocab, (args.micro_batch, 1), generator=generator)
    stride = torch.randint(1, 9, (args.micro_batch, 1), generator=generator)
    positions = torch.arange(args.seq_len + 1).unsqueeze(0)
    return (start + stride * positions) % args.vocab


def global_parameter_name(name: str, ep_rank: int, num_local_experts: int) -> str:
    """``...local_experts.<local>...`` -> ``...local_experts.<global>...``."""
    def to_global(match):
        return f"local_experts.{ep_rank * num_local_experts + int(match.group(1))}."

    return re.sub(r"local_experts\.(\d+)\.", to_global, name)


def init_weights(model, args, ep_rank: int) -> None:
    """Draw every matrix from N(0, 0.02) with a seed taken from its global name; keep norms/biases."""
    import torch

    num_local_experts = args.experts // args.ranks
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2:
                continue
            canonical = global_parameter_name(name, ep_rank, num_local_experts)
            generator = torch.Generator().manual_seed(args.seed + zlib.crc32(canonical.encode()))
            value = torch.randn(param.shape, generator=generator) * 0.02
            param.copy_(value.to(param.dtype))


# ---- one rank ---------------------------------------------------------------------------------

def build_model(args, device):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    flex = args.dispatcher.startswith(PLUGIN_PREFIX)
    moe = dict(
        num_moe_experts=args.experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn,
        moe_router_dtype="fp32", moe_grouped_gemm=False, moe_permute_fusion=False,
        moe_router_load_balancing_type="aux_loss" if args.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=args.aux_loss_coeff,
        moe_token_dispatcher_type="flex" if flex else args.dispatcher,
    )
    if flex:
        moe["moe_flex_dispatcher_backend"] = args.dispatcher
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        expert_model_parallel_size=args.ranks, params_dtype=dtype, bf16=args.dtype == "bf16",
        pipeline_dtype=dtype, use_cpu_initialization=True, **moe)
    spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab,
                     max_sequence_length=args.seq_len, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=True)
    if args.dtype == "bf16":
        from megatron.core.transformer.module import Float16Module

        # Casts every parameter (norms included) to bf16 and the logits back to fp32.
        model = Float16Module(config, model)
    return model.to(device), config


def is_expert_parameter(name: str) -> bool:
    return ".experts." in name


def train_rank(ctx, args, build=None) -> dict:
    """One rank's training loop; ``build(args, device) -> (model, config)`` makes the model
    (default ``build_model``; examples/nemo/bridge_train.py passes a Megatron-Bridge provider's)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    import ep_plugin.integrations.megatron as ep_megatron

    ep_megatron.install()
    device = torch.device(ctx.device)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                             expert_model_parallel_size=args.ranks)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    model, _ = (build or build_model)(args, device)
    init_weights(model, args, parallel_state.get_expert_model_parallel_rank())

    # fp32 master weights; the model computes in --dtype.
    params = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    masters = [param.detach().float().clone().requires_grad_(False) for _, param in params]
    optimizer = torch.optim.AdamW(masters, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    # gloo reduces CUDA tensors only slowly or not at all: stage the gradient buffer on the host.
    stage_on_host = device.type == "cuda" and dist.get_backend() != "nccl"
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / args.grad_accum, device=device))

    seq = args.seq_len
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(args.micro_batch, -1)
    causal_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
    tokens_per_step = args.ranks * args.grad_accum * args.micro_batch * seq
    losses, tokens_per_s = [], []
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        step_loss = torch.zeros((), dtype=torch.float64, device=device)
        for micro in range(args.grad_accum):
            batch = synthetic_batch(args, step, ctx.rank, micro).to(device)
            logits = model(batch[:, :-1], position_ids, causal_mask)  # [b, s, V]
            loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
            (loss / args.grad_accum).backward()
            step_loss += loss.detach().double() / args.grad_accum

        # Dense grads: mean over the data-parallel ranks. Expert grads live on one rank but got
        # contributions from every rank's loss: scale by 1/ranks for the same mean objective.
        grads = [param.grad.float() if param.grad is not None else torch.zeros_like(master)
                 for (_, param), master in zip(params, masters, strict=True)]
        flat = torch.cat([g.reshape(-1) for g, (name, _) in zip(grads, params, strict=True)
                          if not is_expert_parameter(name)])
        flat = flat.cpu() if stage_on_host else flat
        dist.all_reduce(flat)
        flat = flat.to(device)
        offset = 0
        for grad, (name, _), master in zip(grads, params, masters, strict=True):
            if is_expert_parameter(name):
                master.grad = grad / args.ranks
            else:
                master.grad = flat[offset:offset + grad.numel()].view_as(grad) / args.ranks
                offset += grad.numel()
        optimizer.step()
        with torch.no_grad():
            for (_, param), master in zip(params, masters, strict=True):
                param.copy_(master.to(param.dtype))
                param.grad = None

        loss_sum = step_loss.detach().cpu() if stage_on_host else step_loss.detach()
        dist.all_reduce(loss_sum)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        losses.append(float(loss_sum) / args.ranks)
        tokens_per_s.append(tokens_per_step / elapsed)
        if ctx.rank == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}  tokens/s {tokens_per_s[-1]:,.0f}  "
                  f"({elapsed * 1e3:.1f} ms)", flush=True)

    from ep_plugin.integrations.megatron.manager import clear_backend_cache, combine_counts

    combines = combine_counts()  # ep_hybrid: whether the experts' output was combined in place
    clear_backend_cache()
    parallel_state.destroy_model_parallel()
    return {"losses": losses, "tokens_per_s": tokens_per_s, "combines": combines}


def run(args, rank_function) -> None:
    """Run ``rank_function(ctx, args)`` on ``args.ranks`` ranks; print the summary, write ``args.out``."""
    from ep_plugin.testing.launcher import run_ranks

    results = run_ranks(rank_function, args.ranks, args, device=args.device, timeout_s=args.timeout_s)
    losses = results[0]["losses"]
    steady = results[0]["tokens_per_s"][min(5, len(losses) - 1):]  # skip warm-up steps
    median_tokens_per_s = sorted(steady)[len(steady) // 2]
    print(f"{args.dispatcher} on {args.ranks} rank(s): loss {losses[0]:.4f} -> {losses[-1]:.4f} "
          f"(ln vocab = {math.log(args.vocab):.3f}); median {median_tokens_per_s:,.0f} tokens/s after warm-up")
    if results[0]["combines"]:
        counts = sorted(results[0]["combines"].items())  # forward and backward (the gradients' are pushed)
        print("rank 0's combines: " + ", ".join(f"{n} {kind}" for kind, n in counts))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"args": vars(args), "losses": losses, "tokens_per_s": results[0]["tokens_per_s"],
                       "median_tokens_per_s": median_tokens_per_s}, handle, indent=1)


def main(argv=None) -> None:
    args = parse_args(argv)
    # Spawned ranks import this file by module name.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_gpt_moe import train_rank as rank_function

    run(args, rank_function)


if __name__ == "__main__":
    main()
