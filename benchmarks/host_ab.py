"""Paired A/B of the eager host path: this tree against another (``scripts/gpu_ab.sh``'s base), one CPU.

On the lent GPU machine a CPU's speed drifts by up to ~2x over seconds (``cpu_speeds.py``), more
than a host-path change moves, so rounds of a few seconds each cannot tell two trees apart. Here
one worker process per tree, both pinned to the same CPU, take turns every ``--steps`` eager steps
(dispatch + combine, one-rank backends, 128 tokens, top-8 of 256) and each pair of turns gives one
ratio: the drift cancels within a pair. The hidden size is small (512) so that the GPU never holds
the host back; the host path does not depend on it. Prints, per backend, both trees' median host µs
per step and the median (and quartiles) of the paired ratios this / base.

  scripts/gpu_ab.sh run OUT 0 true                # on the device: builds this tree and /tmp/ab_base
  python3 benchmarks/host_ab.py [--base /tmp/ab_base] [--cpu 3] [--pairs 40] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("hybrid", "hybrid+in_place", "elastic+in_place")


def worker(port: int) -> None:
    """One tree's side: build the backends, then per stdin line "<variant> <steps>" print µs per step."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
    from kernel_times import eager_step

    import ep_plugin
    from ep_plugin.bench.workload import Shape
    from ep_plugin.config import Config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=0, world_size=1)
    shape = Shape(128, 512, 8, 256, "bf16", "balanced")
    steps = {}
    for variant in VARIANTS:
        name, _, option = variant.partition("+")
        in_place = option == "in_place"
        config = Config.from_env(num_sms=16, blocking=False, max_tokens_per_rank=128, num_permuted_tokens=128 * 8)
        cls = ep_plugin.get_backend(name)
        options = cls.in_place_options(num_ranks=1, max_tokens_per_rank=128, num_experts=256, topk=8,
                                       pad_multiple=config.pad_multiple) if in_place else {}
        backend = cls(hidden_size=512, num_experts=256, config=config, device=device, **options)
        steps[variant] = eager_step(backend, shape, 0, device, in_place=in_place)
        for _ in range(50):
            steps[variant]()
    torch.cuda.synchronize()
    print("ready", flush=True)
    for line in sys.stdin:
        variant, count = line.split()
        step = steps[variant]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(int(count)):
            step()
        print(f"{(time.perf_counter() - start) * 1e6 / int(count):.2f}", flush=True)
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="/tmp/ab_base", help="the other tree, built (gpu_ab.sh builds it there)")
    parser.add_argument("--cpu", default="3", help="the CPU both workers are pinned to")
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--steps", type=int, default=200, help="eager steps per turn")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # internal: run one side, gloo port
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args.worker)
    script = os.path.abspath(__file__)
    trees = {"this": os.getcwd(), "base": os.path.abspath(args.base)}
    workers = {}
    for port, (side, tree) in zip((29611, 29612), trees.items(), strict=True):
        workers[side] = subprocess.Popen(
            ["taskset", "-c", args.cpu, sys.executable, script, "--worker", str(port)], cwd=tree,
            env={**os.environ, "PYTHONPATH": tree}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for side, process in workers.items():
        line = process.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"the {side} worker did not start (printed {line!r})")
    for variant in VARIANTS:
        times = {"this": [], "base": []}
        for pair in range(args.pairs):
            for side in ("this", "base") if pair % 2 == 0 else ("base", "this"):  # neither always goes first
                workers[side].stdin.write(f"{variant} {args.steps}\n")
                workers[side].stdin.flush()
                times[side].append(float(workers[side].stdout.readline()))
        ratios = sorted(a / b for a, b in zip(times["this"], times["base"], strict=True))
        print(f"{variant:18s} host µs per step: this {statistics.median(times['this']):6.1f}, base "
              f"{statistics.median(times['base']):6.1f}; paired this/base median {statistics.median(ratios):.3f} "
              f"(quartiles {ratios[len(ratios) // 4]:.3f} - {ratios[3 * len(ratios) // 4]:.3f}, {args.pairs} pairs)",
              flush=True)
    for process in workers.values():
        process.stdin.close()
        process.wait()


if __name__ == "__main__":
    main()
