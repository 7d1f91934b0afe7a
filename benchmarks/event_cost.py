"""What a CUDA timing event costs the GPU between kernels: one process alone, and ranks sharing a GPU.

The bench marks dispatch and combine with three timing events per iteration. On the one-H200 bed
(8 ranks under MPS) those events added 18-70 µs to a ~300 µs decode step (benchmarks/NOTES.md,
fifteenth pass). This script looks at the events alone, with no ep_plugin op in the loop. Every
rank runs steps of --kernels device copies of --bytes each on its own stream, with no waits across
ranks, and records 0, 1 or 3 events per step, spread between the copies, with timing on or off.
It prints µs per step: GPU time from two events around the loop, and host time, median over the
ranks. When the host time is below the GPU time, the GPU paces the loop, and the difference from
the 0-event row is what the events cost the GPU.

  python benchmarks/event_cost.py [--ranks 1,8] [--kernels 4] [--bytes 33554432] [--steps 300]
"""

from __future__ import annotations

import argparse
import statistics

import torch

WARMUP = 30
SETTINGS = ((0, True), (1, True), (3, True), (3, False))  # (events per step, enable_timing)


def timed_loop(src: torch.Tensor, dst: torch.Tensor, kernels: int, steps: int, marks: int,
               timing: bool) -> tuple[float, float]:
    """(GPU µs per step, host µs per step) of ``steps`` steps, each ``kernels`` copies with ``marks`` events
    recorded between them (created up front, as the bench does)."""
    from kernel_times import time_steps  # this folder

    events = iter([torch.cuda.Event(enable_timing=timing) for _ in range(steps * marks)])
    before = [0] * kernels  # how many events go before each copy of a step: spread evenly, the first at 0
    for index in range(marks):
        before[index * kernels // marks] += 1
    for _ in range(WARMUP):
        for _ in range(kernels):
            dst.copy_(src)

    def step():
        for copy in range(kernels):
            for _ in range(before[copy]):
                next(events).record()
            dst.copy_(src)

    return time_steps(step, steps)


def rank_main(ctx, args) -> list[tuple]:
    torch.cuda.set_device(torch.device(ctx.device))
    src = torch.empty(args.bytes, dtype=torch.uint8, device=ctx.device).random_()
    dst = torch.empty_like(src)
    return [(marks, timing, *timed_loop(src, dst, args.kernels, args.steps, marks, timing))
            for marks, timing in SETTINGS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="1,8", help="comma list of rank counts, all on GPU 0 (MPS when > 1)")
    parser.add_argument("--kernels", type=int, default=4, help="device copies per step")
    parser.add_argument("--bytes", type=int, default=32 << 20, help="bytes per copy")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    try:
        ranks = [int(r) for r in args.ranks.split(",") if r]
    except ValueError:
        parser.error(f"--ranks takes a comma list of rank counts, got {args.ranks!r}")
    if not ranks or min(ranks) < 1 or args.kernels < 1 or args.bytes < 1 or args.steps < 1:
        parser.error("--ranks, --kernels, --bytes and --steps must be positive")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    from ep_plugin.testing import run_ranks

    print(f"{'ranks':>5s} {'events':>6s} {'timing':>6s} {'GPU µs/step':>11s} {'host µs/step':>12s} "
          f"{'GPU µs per event':>16s}")
    for num_ranks in ranks:
        # Every rank on GPU 0, as on the one-H200 bed (CUDA_VISIBLE_DEVICES=0 for a machine with more).
        per_rank = run_ranks(rank_main, num_ranks, args, device="cuda", timeout_s=600)
        rows = {}
        for index, (marks, timing) in enumerate(SETTINGS):
            gpu = statistics.median(result[index][2] for result in per_rank)
            host = statistics.median(result[index][3] for result in per_rank)
            rows[marks, timing] = gpu
            extra = (gpu - rows[0, True]) / marks if marks else 0.0
            print(f"{num_ranks:5d} {marks:6d} {'on' if timing else 'off':>6s} {gpu:11.1f} {host:12.1f} {extra:16.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
