"""How fast each CPU of this machine runs a fixed piece of Python, alone and beside one other busy CPU.

Eager decode with several ranks on one GPU is paced by the slowest rank's host (host_pace.py), so a
machine whose CPUs differ in speed, or slow each other down (SMT siblings a virtual machine does not
show), sets that pace whatever our code does. One worker process is pinned to each CPU; the
controller starts chosen workers at the same moment and reads their times. Prints each CPU's time
alone (best of three), the pair matrix (the row CPU's time with the column CPU busy, over its time
alone), and the times with the first eight CPUs and with all of them busy. Numbers only.

  python benchmarks/cpu_speeds.py
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import time


def busy_loop(n: int = 300_000) -> int:
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def worker(cpu: int, conn) -> None:
    os.sched_setaffinity(0, {cpu})
    busy_loop(50_000)
    while (start_at := conn.recv()) is not None:
        while time.perf_counter() < start_at:  # every worker of a run starts at the same moment
            pass
        start = time.perf_counter()
        busy_loop()
        conn.send(time.perf_counter() - start)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    context = mp.get_context("fork")
    pipes, workers = {}, []
    for cpu in cpus:
        mine, theirs = context.Pipe()
        process = context.Process(target=worker, args=(cpu, theirs), daemon=True)
        process.start()
        pipes[cpu] = mine
        workers.append(process)

    def run(group: list[int]) -> list[float]:
        start_at = time.perf_counter() + 0.01
        for cpu in group:
            pipes[cpu].send(start_at)
        return [pipes[cpu].recv() for cpu in group]

    alone = {cpu: min(run([cpu])[0] for _ in range(3)) for cpu in cpus}
    print("alone, ms:", " ".join(f"{cpu}:{alone[cpu] * 1e3:.0f}" for cpu in cpus))
    slowdown = {}
    for a, b in itertools.combinations(cpus, 2):
        time_a, time_b = run([a, b])
        slowdown[a, b], slowdown[b, a] = time_a / alone[a], time_b / alone[b]
    print("pairs: the row CPU's time with the column CPU busy / its time alone")
    print("    " + "".join(f"{cpu:5d}" for cpu in cpus))
    for a in cpus:
        print(f"{a:3d} " + "".join("    -" if a == b else f"{slowdown[a, b]:5.2f}" for b in cpus))
    print(f"CPUs {cpus[:8]} together, ms:", " ".join(f"{t * 1e3:.0f}" for t in run(cpus[:8])))
    print("all together, ms:", " ".join(f"{t * 1e3:.0f}" for t in run(cpus)))
    for cpu in cpus:
        pipes[cpu].send(None)
    for process in workers:
        process.join()


if __name__ == "__main__":
    main()
