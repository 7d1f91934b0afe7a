"""What a gloo twin costs a backend build: the time to make one and run its first gather.

Over an NCCL group the setup's host words travel on a gloo twin of it (``ep_plugin.host_collectives``),
made by the group's ranks when a backend is built (about two per build: topology's, then the backend's,
which the construction check and the buffer share). This makes twins of the world on CPU ranks (the
same code; the twin is gloo whatever the group) and prints, per rank count, the slowest rank's time
for each of a few rounds. Numbers only.

  python benchmarks/gloo_twin_cost.py [--ranks 2,8,16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

from ep_plugin.host_collectives import HostCollectives
from ep_plugin.testing import run_ranks


def make_twins(ctx, rounds: int) -> list[float]:
    import torch.distributed as dist

    seconds = []
    for round_number in range(rounds):
        dist.barrier()
        start = time.monotonic()
        words = HostCollectives(None, owner="twin cost", timeout_s=60.0, label=f"twin cost {round_number}")
        words.use_gloo_twin()
        words.all_gather_object(ctx.rank, where="the first gather")
        seconds.append(time.monotonic() - start)
        words.release()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,8,16", help="comma-separated rank counts")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{'ranks':>5}  twin made + first gather, slowest rank, ms (one column per round)")
    for ranks in (int(text) for text in args.ranks.split(",")):
        per_rank = run_ranks(make_twins, ranks, args.rounds, timeout_s=300)
        slowest = [max(seconds[i] for seconds in per_rank) * 1e3 for i in range(args.rounds)]
        print(f"{ranks:>5}  " + "  ".join(f"{ms:7.1f}" for ms in slowest), flush=True)


if __name__ == "__main__":
    main()
