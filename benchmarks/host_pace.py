"""What paces eager decode when ranks share a GPU: each rank's host time per step, four or five ways.

Eager decode (128 tokens) is bound by the host: the kernels of a step wait for every rank, so the
GPU runs at the pace of the slowest rank's host. This times every rank's eager steps (dispatch +
combine, no sync inside the loop) with a host clock stamp before each step, in these settings:

  coupled      the N-rank backend, what ``python -m ep_plugin.bench --preset decode`` times
  coupled+nogc the same with Python's garbage collector off during the loop
  coupled+N timing events per step   (with --marks N[,M...]) the same with N CUDA timing events
               recorded before every step, the way the bench marks each op: whether they slow the step
  independent  every rank a one-rank backend of its own, all at once: host contention alone, no
               rank waits for another
  alone        rank 0's one-rank backend while the other ranks sleep in a barrier

and prints, per setting, every rank's median / p90 / max host µs per step, the median over steps of
the slowest rank's step (what the GPU follows), and the GPU µs per step. When ranks differ by
much in ``independent`` and ``alone`` too, the difference is the machine's CPUs, not our code.

  python benchmarks/host_pace.py [--ranks 8] [--backends hybrid+in_place,hybrid+arena,elastic+in_place] [--steps 300]
      [--pin 0,2,4,...]   (pin rank r to CPU pin[r % len(pin)])   [--marks 1,3]   [--profile]

``--profile``: after the ``alone`` setting, rank 0 also runs its one-rank steps under cProfile and prints
the functions with the most host time of their own (where a slow step's host time goes).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist

WARMUP = 30


def timed_steps(step, steps: int, run: bool = True, nogc: bool = False, marks: int = 0):
    """(host stamps before each step and after the last, GPU µs per step); all ranks start together.
    ``run=False``: warm up and meet the others at the barrier, but time nothing. ``marks``: record that
    many timing events before every step, as the bench does (three per iteration) to time each op."""
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    if not run:
        return None, 0.0
    stamps = []
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps * marks)]  # made up front, as the bench
    if nogc:
        gc.disable()
    try:
        begin.record()
        for index in range(steps):
            stamps.append(time.perf_counter())
            if marks:
                for event in events[index * marks:(index + 1) * marks]:
                    event.record()
            step()
        stamps.append(time.perf_counter())
        end.record()
    finally:
        if nogc:
            gc.enable()
    end.synchronize()
    return stamps, begin.elapsed_time(end) * 1e3 / steps


def report(ctx, label: str, stamps, gpu_us: float) -> None:
    """Rank 0 prints every timed rank's host pace (perf_counter is one clock for all processes)."""
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, (stamps, gpu_us))
    if ctx.rank != 0:
        return
    lines, per_rank = [f"== {label}"], []
    for rank, (rank_stamps, gpu) in enumerate(everyone):
        if rank_stamps is None:
            continue
        steps = [(b - a) * 1e6 for a, b in zip(rank_stamps[:-1], rank_stamps[1:], strict=True)]
        per_rank.append(steps)
        ordered = sorted(steps)
        lines.append(f"  rank {rank}: host µs per step median {ordered[len(ordered) // 2]:6.1f}, p90 "
                     f"{ordered[int(len(ordered) * 0.9)]:6.1f}, max {ordered[-1]:8.1f}; GPU {gpu:6.1f} µs per step")
    if len(per_rank) > 1:
        slowest = sorted(max(step) for step in zip(*per_rank, strict=True))
        lines.append(f"  slowest rank's step, median over steps: {slowest[len(slowest) // 2]:.1f} µs")
    print("\n".join(lines), flush=True)


def profile_steps(label: str, step, steps: int, top: int = 18) -> None:
    """Run ``steps`` steps under cProfile (after a warm-up) and print the ``top`` functions by own time."""
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    print(f"== {label}: cProfile of {steps} steps, by own time (µs per step = tottime / steps)", flush=True)
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    for (path, line, function), (_, calls, own, total, _) in rows:
        print(f"  {own / steps * 1e6:8.1f} own {total / steps * 1e6:8.1f} total µs/step "
              f"{calls / steps:6.1f} calls/step  {function} ({os.path.basename(path)}:{line})", flush=True)


def report_arena(ctx, variant: str, backend) -> None:
    """Rank 0, "+arena": how often the arena's pool was made and what it overflowed into (a pool made
    again every step would cost the step its snapshot and its allocations)."""
    arena = getattr(backend, "arena", None)
    if ctx.rank == 0 and variant.endswith("+arena") and arena is not None:
        print(f"  rank 0 arena: pools made {arena.pools_made}, snapshots {arena.snapshots_taken}, fallback "
              f"segments {arena.fallback_segments()}, "
              f"combines {dict(backend.combine_counts)}", flush=True)


def rank_main(ctx, args) -> None:
    from kernel_times import decode_backend, eager_step  # this folder: what kernel_times.py times

    from ep_plugin.bench.workload import Shape

    if args.pin:
        cpus = [int(cpu) for cpu in args.pin.split(",")]
        os.sched_setaffinity(0, {cpus[ctx.rank % len(cpus)]})
    device = torch.device(ctx.device)
    torch.cuda.set_device(device)
    shape = Shape(args.tokens, 7168, 8, 256, "bf16", "balanced")
    own_groups = [dist.new_group([rank], backend="gloo") for rank in range(ctx.world_size)]  # a collective
    for variant in args.backends.split(","):
        in_place, arena = variant.endswith("+in_place"), variant.endswith("+arena")
        backend = decode_backend(variant, None, ctx.world_size, device, args.tokens)
        step = eager_step(backend, shape, ctx.rank, device, in_place=in_place, arena=arena)
        report(ctx, f"{variant} coupled ({ctx.world_size} ranks)", *timed_steps(step, args.steps))
        report(ctx, f"{variant} coupled+nogc", *timed_steps(step, args.steps, nogc=True))
        for marks in args.marks:
            report(ctx, f"{variant} coupled+{marks} timing events per step",
                   *timed_steps(step, args.steps, marks=marks))
        report_arena(ctx, variant, backend)
        backend.destroy()
        own = decode_backend(variant, own_groups[ctx.rank], 1, device, args.tokens)
        step = eager_step(own, shape, 0, device, in_place=in_place, arena=arena)
        report(ctx, f"{variant} independent ({ctx.world_size} one-rank backends at once)",
               *timed_steps(step, args.steps))
        report(ctx, f"{variant} alone (rank 0's one-rank backend)", *timed_steps(step, args.steps, run=ctx.rank == 0))
        if args.profile and ctx.rank == 0:
            profile_steps(f"{variant} alone", step, args.steps)
        report_arena(ctx, variant, own)
        own.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--backends", default="hybrid,hybrid+in_place,elastic+in_place")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--pin", default="", help="comma list of CPUs; rank r runs on pin[r %% len(pin)]")
    parser.add_argument("--marks", default="",
                        help="comma list: also the coupled case with each many timing events recorded before every "
                             "step (the bench records 3 per iteration): what they cost the step")
    parser.add_argument("--profile", action="store_true",
                        help="rank 0 also profiles its one-rank steps (cProfile, functions by own time)")
    args = parser.parse_args()
    try:
        args.marks = [int(marks) for marks in args.marks.split(",") if marks]
    except ValueError:
        parser.error(f"--marks takes a comma list of counts, got {args.marks!r}")
    if any(marks < 1 for marks in args.marks):
        parser.error(f"--marks counts must be >= 1, got {args.marks}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ep_plugin.testing import run_ranks

    run_ranks(rank_main, args.ranks, args, device="cuda", timeout_s=600)


if __name__ == "__main__":
    main()
