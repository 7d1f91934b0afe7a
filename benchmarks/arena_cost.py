"""Host cost of putting a combine input in the hybrid backend's arena, per call (one rank, its own GPU).

    python3 benchmarks/arena_cost.py [--rows 4096] [--hidden 7168] [--calls 2000]

Prints µs per call (host_costs.per_call_us: the median of 5 batches) of: an ordinary torch.empty of
the rows; the same inside combine_input_arena() (what Megatron's experts pay per MoE layer for the
context around their output); and combine_input(handle) (a view of the arena's first rows). No kernel
runs while timing.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ep_plugin.backends.hybrid import HybridBackend  # noqa: E402
from ep_plugin.config import Config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("arena_cost.py needs a CUDA GPU")
    from host_costs import per_call_us  # this folder
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    config = Config.from_env(max_tokens_per_rank=args.rows)
    pooled, viewed = (HybridBackend(hidden_size=args.hidden, num_experts=8, device=device, config=config,
                                    combine_input_rows=args.rows) for _ in range(2))
    tokens = torch.randn(args.rows, args.hidden, device=device, dtype=torch.bfloat16)
    topk_idx = torch.randint(0, 8, (args.rows, 1), device=device)
    handle = viewed.dispatch(tokens, topk_idx=topk_idx).handle

    def plain():
        torch.empty(args.rows, args.hidden, device=device, dtype=torch.bfloat16)

    def in_arena():
        with pooled.combine_input_arena():
            torch.empty(args.rows, args.hidden, device=device, dtype=torch.bfloat16)

    in_arena()
    print(f"rows={args.rows} hidden={args.hidden}; arena pool: {pooled.arena.unusable_reason or 'usable'}")
    print(f"{'call':>40} {'us/call':>9}")
    for name, function in (("torch.empty", plain), ("torch.empty in combine_input_arena()", in_arena),
                           ("combine_input(handle)", lambda: viewed.combine_input(handle))):
        print(f"{name:>40} {per_call_us(function, args.calls):9.2f}")
    torch.cuda.synchronize()
    pooled.destroy()
    viewed.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
