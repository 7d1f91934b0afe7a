"""Write rates of N rank processes sharing one GPU under MPS, all at once: into their own memory vs
into their peers' (opened with CUDA IPC). The test bed's push pattern without the backend around it.

Every rank reads S bytes of its own and writes them N times, on a grid of --blocks blocks (one
rank's SM budget), a 16-byte load then N 16-byte stores per element, like the elastic in-place push
(one load per token, one store per destination):
- "own":   the N copies land in N slots of the rank's own buffer;
- "peers": copy d lands in slot `rank` of rank (rank + d) % N's buffer (d = 0 is the rank itself).
Also "fill own" / "fill peers" (stores only). All ranks start together after a barrier; the table gives
the slowest rank's time and all ranks' bytes written per µs. "alone" rows time rank 0 by itself.
Numbers only, no assertion. It answers whether the push's fall from 4 to 8 ranks (NOTES, sixth pass)
comes with the number of processes writing, or with writing into other processes' memory.

Each block stamps its start and end on the GPU clock, so the table also gives the span from the first
rank's start to the last rank's end (TB/s over that span) and the ranks' start skew: whether MPS ran
them together. --burst N repeats a launch back to back (to watch clocks and power); --dest transport
writes into buffers allocated by our transport instead of torch's allocator (how the 2 MiB rounding
of SymmetricBuffer was found, NOTES eighth pass).

  python benchmarks/mps_rates.py [--ranks 2,4,8] [--mib 64] [--blocks 16] [--only-rows]
                                 [--burst 200] [--dest torch|transport] [--dest-mib M --dest-offset-mib O]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

KERNELS = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

constexpr int kMaxDest = 16;
struct Dests { int4* p[kMaxDest]; };

// Block start and end on the GPU-wide clock (%globaltimer, ns; the same for every process on the GPU),
// so that the ranks' windows can be laid side by side: how long all of them took together.
__device__ __forceinline__ long long now_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void stamp_start(long long* stamps) {
  if (threadIdx.x == 0) stamps[2 * blockIdx.x] = now_ns();
}
__device__ __forceinline__ void stamp_end(long long* stamps) {
  __syncthreads();
  if (threadIdx.x == 0) stamps[2 * blockIdx.x + 1] = now_ns();
}

// Element i of the source, stored into every destination (loads first, then stores; 2 in flight).
__global__ void push_kernel(Dests dests, int num_dests, const int4* in, long long n, bool load, long long* stamps) {
  stamp_start(stamps);
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += 2 * stride) {
    const long long j = i + stride;
    int4 a = make_int4(1, 2, 3, 4), b = a;
    if (load) { a = in[i]; if (j < n) b = in[j]; }
    for (int d = 0; d < num_dests; ++d) {
      dests.p[d][i] = a;
      if (j < n) dests.p[d][j] = b;
    }
  }
  stamp_end(stamps);
}

// The elastic in-place push's pattern: token t (a row of row_bytes) goes to the destinations whose
// slot[t][d] >= 0, at row (rank * tokens + slot) of destination d's buffer. by_block: the whole block
// copies one row at a time (each warp a slice); else each warp copies whole rows (as the kernel does),
// 4 words per lane loaded before the stores.
__global__ void rows_kernel(Dests dests, int num_dests, const int4* in, const int* slots, int tokens, int row_words,
                            int rank, bool by_block, long long* stamps) {
  stamp_start(stamps);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int first = by_block ? blockIdx.x : blockIdx.x * warps + warp;
  const int step = by_block ? gridDim.x : gridDim.x * warps;
  const int i0 = by_block ? threadIdx.x : lane, di = by_block ? blockDim.x : 32;
  for (int t = first; t < tokens; t += step) {
    const int4* src = in + (long long)t * row_words;
    for (int i = i0; i < row_words; i += 4 * di) {
      int4 w[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) if (i + u * di < row_words) w[u] = src[i + u * di];
      for (int d = 0; d < num_dests; ++d) {
        const int slot = slots[t * num_dests + d];
        if (slot < 0) continue;
        int4* dst = dests.p[d] + ((long long)rank * tokens + slot) * row_words;
#pragma unroll
        for (int u = 0; u < 4; ++u) if (i + u * di < row_words) dst[i + u * di] = w[u];
      }
    }
  }
  stamp_end(stamps);
}

void rows(std::vector<int64_t> dest_addresses, torch::Tensor in, torch::Tensor slots, int blocks, int rank,
          bool by_block, torch::Tensor stamps) {
  Dests dests{};
  for (size_t d = 0; d < dest_addresses.size(); ++d) dests.p[d] = reinterpret_cast<int4*>(dest_addresses[d]);
  const int tokens = in.size(0), row_words = in.size(1) * in.element_size() / 16;
  rows_kernel<<<blocks, 512, 0, at::cuda::getCurrentCUDAStream()>>>(dests, (int)dest_addresses.size(),
      reinterpret_cast<const int4*>(in.data_ptr()), slots.data_ptr<int>(), tokens, row_words, rank, by_block,
      reinterpret_cast<long long*>(stamps.data_ptr<int64_t>()));
}

// Where blocks run: each block records (%smid, start, end) of a ~spin_ns busy wait; `smem` bytes of
// dynamic shared memory per block (reserved at launch, unused) decide how many blocks one SM can hold.
__global__ void place_kernel(long long* out, long long spin_ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < (unsigned long long)spin_ns);
  if (threadIdx.x == 0) {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    out[3 * blockIdx.x] = smid; out[3 * blockIdx.x + 1] = start; out[3 * blockIdx.x + 2] = now;
  }
}

void place(torch::Tensor out, int blocks, int threads, int smem, long long spin_ns) {
  cudaFuncSetAttribute(place_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  auto* records = reinterpret_cast<long long*>(out.data_ptr<int64_t>());
  place_kernel<<<blocks, threads, smem, at::cuda::getCurrentCUDAStream()>>>(records, spin_ns);
}

void push(std::vector<int64_t> dest_addresses, torch::Tensor in, int blocks, bool load, torch::Tensor stamps) {
  Dests dests{};
  TORCH_CHECK(dest_addresses.size() <= kMaxDest);
  for (size_t d = 0; d < dest_addresses.size(); ++d) dests.p[d] = reinterpret_cast<int4*>(dest_addresses[d]);
  push_kernel<<<blocks, 1024, 0, at::cuda::getCurrentCUDAStream()>>>(
      dests, (int)dest_addresses.size(), reinterpret_cast<const int4*>(in.data_ptr()), in.numel() / 16, load,
      reinterpret_cast<long long*>(stamps.data_ptr<int64_t>()));
}
"""


def extension():
    from torch.utils.cpp_extension import load_inline

    declarations = ("void push(std::vector<int64_t> dest_addresses, torch::Tensor in, int blocks, bool load, "
                    "torch::Tensor stamps);\n"
                    "void rows(std::vector<int64_t> dest_addresses, torch::Tensor in, torch::Tensor slots, int blocks, "
                    "int rank, bool by_block, torch::Tensor stamps);\n"
                    "void place(torch::Tensor out, int blocks, int threads, int smem, long long spin_ns);")
    return load_inline("mps_rates_kernels", cpp_sources=declarations, cuda_sources=KERNELS,
                       functions=["push", "rows", "place"], extra_cuda_cflags=["-O3"])


def timed_together(ctx, launch, stamps: torch.Tensor, repeats: int, alone: bool, burst: int = 1) -> tuple:
    """Median µs of launch() with every rank starting together (alone: rank 0 by itself), and per repeat
    this rank's window on the GPU clock (first block start, last block end, ns) from the kernel's
    `stamps` [blocks, 2]. Leaving the host barrier is skewed by up to hundreds of µs, so a rank's own
    time can miss part of its peers' traffic; the windows tell how long all ranks took together.
    burst > 1: that many launches back to back per repeat (µs per launch; the window is the last one's),
    the way the backend's kernels run in a training loop rather than one at a time."""
    import torch.distributed as dist

    times, windows = [], []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        dist.barrier()
        if alone and ctx.rank != 0:
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(burst):
            launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / burst)
        windows.append((int(stamps[:, 0].min()), int(stamps[:, 1].max())))
    return (statistics.median(times) if times else 0.0), windows


def open_peer_buffers(ctx, mine: torch.Tensor) -> list:
    """Every rank's `mine`, opened over CUDA IPC (this rank's own as is), indexed by rank."""
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    shared = [None] * ctx.world_size
    dist.all_gather_object(shared, reduce_tensor(mine))
    return [mine if peer == ctx.rank else rebuild(*data) for peer, (rebuild, data) in enumerate(shared)]


def rows_main(ctx, args):
    """The push's pattern: 4096 rows of 14336 bytes, each to the ranks holding its top-8 of 256 experts."""
    import torch.distributed as dist

    ext = extension()
    n, tokens, row_bytes = ctx.world_size, args.tokens, args.row_bytes
    gen = torch.Generator(device="cpu").manual_seed(ctx.rank)
    experts = torch.rand(tokens, 256, generator=gen).topk(8, dim=1).indices
    chosen = torch.zeros(tokens, n, dtype=torch.bool)
    chosen.scatter_(1, experts * n // 256, True)
    slots = torch.where(chosen, chosen.int().cumsum(0) - 1, -1).int().to(ctx.device)
    source = torch.ones(tokens, row_bytes, dtype=torch.uint8, device=ctx.device)
    if args.random:  # the bytes of random bf16 activations, as the benchmark sends
        source.random_(0, 256)
    # Every rank's destination: [source][slot] rows at --dest-offset-mib into a buffer of --dest-mib
    # (at least what the rows need), allocated by torch or by the backends' transport.
    offset = args.dest_offset_mib << 20
    size = max(args.dest_mib << 20, offset + n * tokens * row_bytes)
    symmetric = None
    if args.dest == "transport":
        from ep_plugin.transport.symmetric import SymmetricBuffer

        symmetric = SymmetricBuffer(dist.group.WORLD, device=torch.device(ctx.device), region_bytes=size,
                                    count_words=0, timeout_s=60.0, backend="mps_rates")
        bases = [symmetric.raw.peer_region_address(peer) + offset for peer in range(n)]
    else:
        mine = torch.zeros(size, dtype=torch.uint8, device=ctx.device)
        bases = [buffer.data_ptr() + offset for buffer in open_peer_buffers(ctx, mine)]
    written = int(chosen.sum()) * row_bytes
    stamps = torch.zeros(args.blocks, 2, dtype=torch.int64, device=ctx.device)
    results = {}
    for by_block in (False, True):
        for name, dests, rank in (("own", [bases[ctx.rank] + d * tokens * row_bytes for d in range(n)], 0),
                                  ("peers", bases, ctx.rank)):
            for alone in (False, True):
                launch = functools.partial(ext.rows, dests, source, slots, args.blocks, rank, by_block, stamps)
                key = (f"rows {'block' if by_block else 'warp'} {name}", alone)
                results[key] = (*timed_together(ctx, launch, stamps, args.repeats, alone, args.burst), written)
    dist.barrier()
    torch.cuda.synchronize()
    dist.barrier()  # no peer writes into this rank's destination after this
    if symmetric is not None:
        symmetric.destroy()
    return results


def place_main(ctx, args):
    """Every rank at once: --blocks blocks of 512 threads with 192 KiB of shared memory each (one per
    SM, like the bulk kernels), each spinning 200 us. Returns the SM count the process sees, its MPS
    thread percentage and per block (smid, start ns, end ns)."""
    import os

    import torch.distributed as dist

    ext = extension()
    out = torch.zeros(args.blocks, 3, dtype=torch.int64, device=ctx.device)
    ext.place(out, args.blocks, 512, 0, 1000)  # warm-up
    dist.barrier()
    torch.cuda.synchronize()
    dist.barrier()
    ext.place(out, args.blocks, 512, 192 * 1024, 200_000)
    torch.cuda.synchronize()
    return (torch.cuda.get_device_properties(ctx.device).multi_processor_count,
            os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), out.cpu().tolist())


def report_placement(n: int, per_rank) -> None:
    """How many SM ids the ranks' blocks used, and how long the whole set took (200 us if all ran at once)."""
    t0 = min(b[1] for _, _, blocks in per_rank for b in blocks)
    t1 = max(b[2] for _, _, blocks in per_rank for b in blocks)
    ids = sorted({b[0] for _, _, blocks in per_rank for b in blocks})
    print(f"{n} ranks: SM count seen {sorted({r[0] for r in per_rank})}, MPS thread percentage "
          f"{sorted({str(r[1]) for r in per_rank})}; {len(ids)} distinct SM ids (max {ids[-1]}); all blocks done in "
          f"{(t1 - t0) / 1e3:.0f} us (each spins 200)")
    for rank, (_, _, blocks) in enumerate(per_rank):
        cells = " ".join(f"{b[0]}@{(b[1] - t0) / 1e3:.0f}" for b in blocks)
        print(f"  rank {rank}: smid@start_us {cells}")


def rank_main(ctx, args):
    """Streaming copies and fills: S bytes read, written N times (own slots, or one slot per peer)."""
    import torch.distributed as dist

    ext = extension()
    n, size = ctx.world_size, args.mib << 20
    source = torch.ones(size, dtype=torch.uint8, device=ctx.device)
    if args.random:
        source.random_(0, 256)
    mine = torch.zeros(n * size, dtype=torch.uint8, device=ctx.device)  # slot s at s * size
    buffers = open_peer_buffers(ctx, mine)
    own = [mine.data_ptr() + s * size for s in range(n)]
    peers = [buffers[(ctx.rank + d) % n].data_ptr() + ctx.rank * size for d in range(n)]
    stamps = torch.zeros(args.blocks, 2, dtype=torch.int64, device=ctx.device)
    results = {}
    for name, dests, load in (("copy own", own, True), ("copy peers", peers, True), ("fill own", own, False),
                              ("fill peers", peers, False)):
        for alone in (False, True):
            launch = functools.partial(ext.push, dests, source, args.blocks, load, stamps)
            results[(name, alone)] = (*timed_together(ctx, launch, stamps, args.repeats, alone), n * size)
    dist.barrier()
    torch.cuda.synchronize()
    dist.barrier()  # no peer writes into `mine` after this
    return results


def span_and_skew(windows_per_rank: list) -> tuple:
    """Median over repeats of (last end - first start) across ranks, and of the spread of their starts, µs."""
    spans, skews = [], []
    for windows in zip(*windows_per_rank, strict=True):
        starts = [w[0] for w in windows]
        spans.append((max(w[1] for w in windows) - min(starts)) / 1e3)
        skews.append((max(starts) - min(starts)) / 1e3)
    return statistics.median(spans), statistics.median(skews)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--mib", type=int, default=64, help="bytes each rank reads (written once per rank)")
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=4096, help="rows per rank (the push pattern)")
    parser.add_argument("--row-bytes", type=int, default=14336)
    parser.add_argument("--only-rows", action="store_true", help="skip the streaming copies")
    parser.add_argument("--placement", action="store_true", help="only: where each rank's blocks run (SM ids)")
    parser.add_argument("--random", action="store_true", help="random source bytes (default: all ones)")
    parser.add_argument("--dest", choices=("torch", "transport"), default="torch",
                        help="push pattern: destination buffers from torch (cudaMalloc + IPC) or ep_plugin's transport")
    parser.add_argument("--dest-mib", type=int, default=0, help="push pattern: destination buffer size (0: the rows')")
    parser.add_argument("--dest-offset-mib", type=int, default=0, help="push pattern: where the rows start in it")
    parser.add_argument("--burst", type=int, default=1, help="push pattern: launches back to back per repeat")
    args = parser.parse_args()
    from ep_plugin.testing import run_ranks

    extension()  # compile once here; the ranks load the cached build
    print(f"{'ranks':>5} {'op':>16} {'who':>5} {'slowest us':>10} {'GB/s per rank':>13} {'all ranks TB/s':>14} "
          f"{'GB/s per SM':>11} {'span us':>8} {'TB/s over span':>14} {'start skew us':>13}")
    for n in (int(v) for v in args.ranks.split(",")):
        if args.placement:
            report_placement(n, run_ranks(place_main, n, args, device="cuda", timeout_s=300))
            continue
        for rank_fn in ((rows_main,) if args.only_rows else (rank_main, rows_main)):
            per_rank = run_ranks(rank_fn, n, args, device="cuda", timeout_s=300)
            for (name, alone), (us0, _, written) in per_rank[0].items():
                # All together: the slowest rank's time, every rank's bytes (rank 0's as the typical).
                us = us0 if alone else max(r[(name, alone)][0] for r in per_rank)
                writers = 1 if alone else n
                rate = written / us / 1e3
                span, skew = span_and_skew([r[(name, alone)][1] for r in ([per_rank[0]] if alone else per_rank)])
                print(f"{n:>5} {name:>16} {'alone' if alone else 'all':>5} {us:>10.1f} {rate:>13.1f} "
                      f"{rate * writers / 1e3:>14.2f} {rate / args.blocks:>11.2f} {span:>8.1f} "
                      f"{written * writers / span / 1e6:>14.2f} {skew:>13.1f}", flush=True)


if __name__ == "__main__":
    main()
