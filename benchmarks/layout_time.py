"""Device time of the send-side layout kernel (csrc/layout.cu) alone in one process, no peers.

On the shared-GPU bed the profiler gives the layout 70 us at 4096 tokens (NOTES, sixth pass), where
the kernel's comment estimates a few. This times the same launch by itself at the bed's grid cap
(16 blocks) and at larger caps, so the two can be told apart: the kernel's own cost, or what the
bed adds (SMs held by other ranks' kernels, memory traffic). Numbers only, no assertion.

  python benchmarks/layout_time.py [--ranks 8] [--experts 256] [--topk 8]
"""

from __future__ import annotations

import argparse
import functools
from types import SimpleNamespace

import torch

from ep_plugin import _cuda
from ep_plugin.backends.compiled import CompiledBackend
from ep_plugin.routing import TOPK, Routing


def stand_in(num_ranks: int, num_experts: int, num_blocks: int) -> SimpleNamespace:
    device = torch.device("cuda", torch.cuda.current_device())
    return SimpleNamespace(num_ranks=num_ranks, num_local_experts=num_experts // num_ranks, num_experts=num_experts,
                           device=device, config=SimpleNamespace(blocking=True), _C=_cuda.extension(),
                           num_blocks=num_blocks, _stream=lambda: torch.cuda.current_stream(device).cuda_stream)


def kernel_us(fn, repeats: int = 50) -> float:
    """Mean device time of the layout kernel per call (the profiler's, so host launch gaps do not count)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    total = sum(getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
                for e in profiler.key_averages() if "layout_kernel" in e.key)
    return total / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{'tokens':>6} {'max blocks':>10} {'probs':>5} {'kernel us':>9}")
    for tokens in (128, 4096):
        scores = torch.rand(tokens, args.experts, device="cuda")
        idx = scores.topk(args.topk, dim=1).indices.contiguous()
        probs = torch.rand(tokens, args.topk, device="cuda")
        routing = Routing(TOPK, tokens, args.experts, topk_idx=idx)
        for blocks in (16, 32, 64, sms):
            backend = stand_in(args.ranks, args.experts, blocks)
            for with_probs in (False, True):
                layout = functools.partial(CompiledBackend._layout_tensors, backend, routing,
                                           probs if with_probs else None)
                us = kernel_us(layout)
                print(f"{tokens:>6} {blocks:>10} {str(with_probs):>5} {us:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
