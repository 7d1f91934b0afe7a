"""The README's API example: send tokens to their experts' ranks, run the experts, sum them back.

Launch one process per rank with torchrun:

    torchrun --nproc-per-node 2 examples/api.py                      # CPU ranks over gloo
    torchrun --nproc-per-node 2 examples/api.py --backend hybrid     # one GPU per rank (NCCL)

With as many GPUs as ranks it uses them (NCCL); otherwise CPU ranks over gloo.
"""

import argparse
import os

import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.cli import OneLineParser, backend_problem


def main() -> None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="reference", help="reference (any device) or hybrid (GPU)")
    args = parser.parse_args()
    if "LOCAL_WORLD_SIZE" not in os.environ:  # started as `python examples/api.py`: no ranks to talk to
        parser.error("start it with torchrun, one process per rank: torchrun --nproc-per-node 2 examples/api.py")
    use_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    problem = backend_problem(args.backend, "cuda" if use_gpus else "cpu")
    if problem:  # e.g. hybrid with fewer GPUs than ranks: one line, before any rank builds anything
        parser.error(f"{problem}. This example runs one rank per GPU; ranks sharing a GPU: python -m ep_plugin "
                     "demo --backend hybrid")
    if use_gpus:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if use_gpus else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if use_gpus else torch.device("cpu")
    rank, num_ranks = dist.get_rank(), dist.get_world_size()

    num_tokens, hidden_size, num_experts, topk = 16, 64, 4 * num_ranks, 2
    backend = ep_plugin.get_backend(args.backend)(hidden_size=hidden_size, num_experts=num_experts, device=device)
    dtype = torch.float32 if args.backend == "reference" else torch.bfloat16

    # This rank's tokens and a router's choice: top-2 experts per token, with their probs.
    torch.manual_seed(rank)
    hidden = torch.randn(num_tokens, hidden_size, device=device, dtype=dtype, requires_grad=True)
    scores = torch.randn(num_tokens, num_experts, device=device).softmax(dim=-1)
    top = scores.topk(topk, dim=-1)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top.indices, True)
    probs = torch.zeros_like(scores).scatter(1, top.indices, top.values)

    out = ep_plugin.dispatch(backend, hidden, routing_map=routing_map, probs=probs)
    # out.hidden [R, H]: the rows this rank's experts must process, grouped by local expert;
    # out.tokens_per_expert [E / ranks]: the segment lengths; out.probs [R]: each row's prob.
    weights = torch.randn(backend.num_local_experts, hidden_size, hidden_size, device=device, dtype=dtype) / 8
    segments = out.hidden.split(out.tokens_per_expert.tolist())
    rows = torch.cat([segment @ weights[expert] for expert, segment in enumerate(segments)])
    rows = rows * out.probs.to(dtype).unsqueeze(1)
    y = ep_plugin.combine(rows, out.handle)  # [T, H]: each token's expert rows summed, in token order
    y.float().pow(2).mean().backward()  # gradients flow back through combine and dispatch to `hidden`

    print(f"rank {rank}/{num_ranks} ({device}, {args.backend}): {num_tokens} tokens out, {out.hidden.shape[0]} "
          f"expert rows in, tokens_per_expert {out.tokens_per_expert.tolist()}, |grad| "
          f"{hidden.grad.float().norm():.4f}", flush=True)
    backend.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
