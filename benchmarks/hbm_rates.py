"""Memory rates of one device: write only, read only, and copy (read + write).

benchmarks/NOTES.md models a stage's floor on the shared-GPU bed as reads / read rate + writes /
write rate; this prints the two rates (and the copy's, which the bench's ceiling uses).

  python benchmarks/hbm_rates.py [--gib 4] [--device cuda]
"""

from __future__ import annotations

import argparse
import time

import torch


def time_us(fn, device: torch.device, repeats: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) * 1e3 / repeats
    start_s = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start_s) * 1e6 / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0, help="bytes per buffer (default 4 GiB, far above L2)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    n = int(args.gib * 2**30) // 8 * 8
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty(n, dtype=torch.uint8, device=device)
    words = x.view(torch.int64)
    cases = [("write only (fill)", lambda: x.fill_(1), 0, n),
             ("read only (sum)", lambda: words.sum(), n, 0),
             ("copy", lambda: y.copy_(x), n, n)]
    print(f"{'case':20s} {'us':>10s} {'read GB/s':>10s} {'write GB/s':>11s} {'total GB/s':>11s}")
    for name, fn, read, written in cases:
        us = time_us(fn, device, args.repeats)
        rates = (read / us / 1e3, written / us / 1e3, (read + written) / us / 1e3)
        print(f"{name:20s} {us:10.1f} {rates[0]:10.1f} {rates[1]:11.1f} {rates[2]:11.1f}")


if __name__ == "__main__":
    main()
