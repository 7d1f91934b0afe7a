"""Write and copy rates into another process's GPU memory opened with CUDA IPC, against own memory.

Every compiled backend writes and reads its peers' buffers through CUDA IPC mappings. This asks
whether such a mapping is slower per SM than the process's own memory (page size, TLB reach) on
the same GPU: one process allocates a buffer and shares it; the other times a 16-byte store loop
and a copy on a grid of 16 blocks (one rank's SM budget on the shared-GPU bed) and of one block
per SM, into its own allocation and into the opened one. Numbers only, no assertion.

  python benchmarks/ipc_rates.py [--mib 1024] [--blocks 16]
"""

from __future__ import annotations

import argparse

import torch
import torch.multiprocessing as mp

KERNELS = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void fill16_kernel(int4* out, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    out[i] = make_int4(1, 2, 3, 4);
}
__global__ void copy16_kernel(int4* out, const int4* in, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    out[i] = in[i];
}
void fill16(torch::Tensor out, int blocks) {
  fill16_kernel<<<blocks, 1024, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<int4*>(out.data_ptr()), out.numel() * out.element_size() / 16);
}
void copy16(torch::Tensor out, torch::Tensor in, int blocks) {
  copy16_kernel<<<blocks, 1024, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<int4*>(out.data_ptr()), reinterpret_cast<const int4*>(in.data_ptr()),
      out.numel() * out.element_size() / 16);
}
"""


def time_us(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def owner(size: int, queue, done) -> None:
    shared = torch.zeros(size, dtype=torch.uint8, device="cuda")
    queue.put(shared)
    done.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=16)
    args = parser.parse_args()
    from torch.utils.cpp_extension import load_inline

    declarations = ("void fill16(torch::Tensor out, int blocks);\n"
                    "void copy16(torch::Tensor out, torch::Tensor in, int blocks);")
    ext = load_inline("ipc_rates_kernels", cpp_sources=declarations, cuda_sources=KERNELS,
                      functions=["fill16", "copy16"], extra_cuda_cflags=["-O3"])
    size = args.mib << 20
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    process = ctx.Process(target=owner, args=(size, queue, done))
    process.start()
    opened = queue.get()
    own = torch.zeros(size, dtype=torch.uint8, device="cuda")
    source = torch.ones(size, dtype=torch.uint8, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{'blocks':>6} {'op':>5} {'target':>7} {'us':>9} {'GB/s':>8} {'GB/s/SM':>8}")
    for blocks in (args.blocks, sms):
        for op in ("fill", "copy"):
            for name, target in (("own", own), ("opened", opened)):
                if op == "fill":
                    us = time_us(lambda t=target, b=blocks: ext.fill16(t, b))
                else:
                    us = time_us(lambda t=target, b=blocks: ext.copy16(t, source, b))
                rate = size / us / 1e3
                print(f"{blocks:>6} {op:>5} {name:>7} {us:>9.1f} {rate:>8.1f} {rate / blocks:>8.2f}")
    done.set()
    process.join()


if __name__ == "__main__":
    main()
