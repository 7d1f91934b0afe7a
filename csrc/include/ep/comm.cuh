// Device primitives shared by the kernels: system-scope flags, a wait with a timeout that
// reports instead of hanging, buffer addressing, and warp copies.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "ep/buffer.h"

namespace ep {

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool aborted(const DeviceView& v) {
  return *reinterpret_cast<volatile int*>(&v.state->abort) != 0;
}

// The same answer for every thread of the block (so that none is left at a __syncthreads).
__device__ __forceinline__ bool block_aborted(const DeviceView& v) {
  __shared__ int s_aborted;
  if (threadIdx.x == 0) s_aborted = aborted(v) ? 1 : 0;
  __syncthreads();
  return s_aborted != 0;
}

// The first waiter to time out on this rank sets the sticky abort flag and writes the report;
// later waits on this rank see the flag and give up at once.
__device__ __forceinline__ void report_timeout(const DeviceView& v, int phase, int peer, unsigned long long expected,
                                               unsigned long long seen, unsigned long long waited) {
  if (atomicCAS(&v.state->abort, 0, 1) == 0) {
    v.report->rank = v.rank;
    v.report->phase = phase;
    v.report->peer = peer;
    v.report->expected = expected;
    v.report->seen = seen;
    v.report->waited_ns = waited;
    __threadfence_system();
    v.report->flag = 1;
    __threadfence_system();
  }
}

// Spin until *flag >= expected. Returns false (after reporting) on timeout, or when another
// wait of this rank already timed out.
static __device__ __noinline__ bool wait_flag(const DeviceView& v, const unsigned long long* flag, unsigned long long expected,
                                       int phase, int peer) {
  unsigned long long start = global_timer_ns();
  for (unsigned iteration = 1;; ++iteration) {
    unsigned long long seen = ld_acquire_sys(flag);
    if (seen >= expected) return true;
    if ((iteration & 255) == 0) {
      if (aborted(v)) return false;
      unsigned long long waited = global_timer_ns() - start;
      if (waited > v.timeout_ns) {
        report_timeout(v, phase, peer, expected, seen, waited);
        return false;
      }
    }
  }
}

// Sequence number of the op in flight (advanced by the op's first kernel).
__device__ __forceinline__ unsigned long long current_seq(const DeviceView& v) {
  return *reinterpret_cast<volatile unsigned long long*>(&v.state->seq);
}

// ---- buffer addressing ----------------------------------------------------------------

__device__ __forceinline__ char* region(const DeviceView& v, int rank, int64_t offset) {
  return (rank == v.rank ? v.local : v.peers[rank]) + offset;
}
__device__ __forceinline__ unsigned long long* arrive_flags(const DeviceView& v, int owner) {
  return reinterpret_cast<unsigned long long*>(region(v, owner, v.layout.off_arrive));
}
__device__ __forceinline__ int32_t* counts_slot(const DeviceView& v, int owner, unsigned long long seq, int source) {
  const int width = v.layout.num_local_experts + 1;
  return reinterpret_cast<int32_t*>(region(v, owner, v.layout.off_counts)) +
         (static_cast<int64_t>(seq & 1) * v.layout.num_ranks + source) * width;
}
__device__ __forceinline__ unsigned long long* done_flag(const DeviceView& v, int owner, int64_t offset, int source,
                                                         int block) {
  return reinterpret_cast<unsigned long long*>(region(v, owner, offset)) +
         static_cast<int64_t>(source) * v.layout.max_blocks + block;
}
__device__ __forceinline__ int64_t packet_index(const DeviceView& v, int source, int slot) {
  return static_cast<int64_t>(source) * v.layout.max_tokens + slot;
}
__device__ __forceinline__ char* disp_payload(const DeviceView& v, int owner, int source, int slot) {
  return region(v, owner, v.layout.off_disp_data) + packet_index(v, source, slot) * v.layout.slot_bytes;
}
__device__ __forceinline__ int32_t* disp_k(const DeviceView& v, int owner, int source, int slot) {
  return reinterpret_cast<int32_t*>(region(v, owner, v.layout.off_disp_k)) +
         packet_index(v, source, slot) * v.layout.num_local_experts;
}
__device__ __forceinline__ float* disp_p(const DeviceView& v, int owner, int source, int slot) {
  return reinterpret_cast<float*>(region(v, owner, v.layout.off_disp_p)) +
         packet_index(v, source, slot) * v.layout.num_local_experts;
}
__device__ __forceinline__ __nv_bfloat16* comb_row(const DeviceView& v, int owner, int source, int slot) {
  return reinterpret_cast<__nv_bfloat16*>(region(v, owner, v.layout.off_comb_data)) +
         packet_index(v, source, slot) * v.layout.hidden;
}
__device__ __forceinline__ float* comb_p(const DeviceView& v, int owner, int source, int slot) {
  return reinterpret_cast<float*>(region(v, owner, v.layout.off_comb_p)) +
         packet_index(v, source, slot) * v.layout.num_local_experts;
}

// ---- completion signalling --------------------------------------------------------------

// Called by every thread of a block after its last store of this op's data: each of the first R
// threads publishes "block b of this rank is done for op seq" to one rank.
__device__ __forceinline__ void signal_block_done(const DeviceView& v, int64_t flags_offset, unsigned long long seq) {
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < v.layout.num_ranks) {
    __threadfence_system();
    st_release_sys(done_flag(v, threadIdx.x, flags_offset, v.rank, blockIdx.x), seq);
  }
}

// Wait until every block of every rank signalled op seq on flags_offset. Returns false on
// timeout/abort (then the caller must write nothing).
__device__ __forceinline__ bool wait_all_blocks(const DeviceView& v, int64_t flags_offset, unsigned long long seq,
                                                int num_blocks, int phase) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const int total = v.layout.num_ranks * num_blocks;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int source = i / num_blocks;
    const int block = i % num_blocks;
    if (!wait_flag(v, done_flag(v, v.rank, flags_offset, source, block), seq, phase, source)) failed = 1;
  }
  __syncthreads();
  return failed == 0;
}

// ---- warp copies ------------------------------------------------------------------------

// Words (16 bytes) each lane keeps in flight: loads are issued back to back before the stores,
// so a warp has 32 * kUnroll * 16 = 2 KiB moving instead of 512 bytes.
constexpr int kUnroll = 4;

// Copy `bytes` (a multiple of 16, 16-byte aligned) with the warp's lanes.
__device__ __forceinline__ void warp_copy16(void* dst, const void* src, int64_t bytes, int lane) {
  const int4* s = reinterpret_cast<const int4*>(src);
  int4* d = reinterpret_cast<int4*>(dst);
  const int64_t n = bytes / 16;
  int64_t i = lane;
  for (; i + 32 * (kUnroll - 1) < n; i += 32 * kUnroll) {
    int4 words[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) words[u] = s[i + 32 * u];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[i + 32 * u] = words[u];
  }
  for (; i < n; i += 32) d[i] = s[i];
}

// Copy one row of `bytes` (multiple of 16) to `count` destinations, reading the source once;
// destination(k) gives the k-th destination address (count is warp-uniform).
template <typename Destination>
__device__ __forceinline__ void warp_copy16_multi(Destination destination, int count, const void* src, int64_t bytes,
                                                  int lane) {
  const int4* s = reinterpret_cast<const int4*>(src);
  const int64_t n = bytes / 16;
  for (int64_t i = lane; i < n; i += 32 * kUnroll) {
    int4 words[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i + 32 * u < n) words[u] = s[i + 32 * u];
    }
    for (int k = 0; k < count; ++k) {
      int4* d = reinterpret_cast<int4*>(destination(k));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i + 32 * u < n) d[i + 32 * u] = words[u];
      }
    }
  }
}

__device__ __forceinline__ void warp_zero16(void* dst, int64_t bytes, int lane) {
  int4* d = reinterpret_cast<int4*>(dst);
  const int4 zero = make_int4(0, 0, 0, 0);
  for (int64_t i = lane; i < bytes / 16; i += 32) d[i] = zero;
}
// Same for a multiple of 4 bytes (fp8 scales).
__device__ __forceinline__ void warp_copy4(void* dst, const void* src, int64_t bytes, int lane) {
  const int* s = reinterpret_cast<const int*>(src);
  int* d = reinterpret_cast<int*>(dst);
  for (int64_t i = lane; i < bytes / 4; i += 32) d[i] = s[i];
}
__device__ __forceinline__ void warp_zero4(void* dst, int64_t bytes, int lane) {
  int* d = reinterpret_cast<int*>(dst);
  for (int64_t i = lane; i < bytes / 4; i += 32) d[i] = 0;
}

}  // namespace ep
