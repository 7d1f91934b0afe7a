// How kernels move rows: 16-byte register copies (any GPU) and bulk (TMA) copies through a
// per-warp ring of shared-memory stages (sm_90+), plus the host launcher that picks one.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "ep/check.cuh"
#include "ep/limits.h"
#include "ep/transport.h"

namespace ep {

// Words (16 bytes) each lane keeps in flight in warp_copy16_multi: loads are issued back to back
// before the stores, so a warp has 32 * kUnroll * 16 = 2 KiB moving instead of 512 bytes.
constexpr int kUnroll = 4;

// Copy `bytes` (a multiple of 16, 16-byte aligned) with the warp's lanes, 8 words per lane in flight
// (4 KiB per warp): for copies that are the warp's whole job.
__device__ __forceinline__ void warp_copy16(void* dst, const void* src, int64_t bytes, int lane) {
  constexpr int kDeep = 8;
  const int4* s = reinterpret_cast<const int4*>(src);
  int4* d = reinterpret_cast<int4*>(dst);
  const int64_t n = bytes / 16;
  int64_t i = lane;
  for (; i + 32 * (kDeep - 1) < n; i += 32 * kDeep) {
    int4 words[kDeep];
#pragma unroll
    for (int u = 0; u < kDeep; ++u) words[u] = s[i + 32 * u];
#pragma unroll
    for (int u = 0; u < kDeep; ++u) d[i + 32 * u] = words[u];
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

// ---- bulk (TMA) copies through shared memory, sm_90+ -------------------------------------
//
// One lane of a warp loads a chunk from global memory into a shared-memory stage with
// cp.async.bulk (completion counted in bytes on the stage's mbarrier), then issues one bulk
// store of the stage per destination (local or peer memory) and moves on: the copy engine
// keeps tens of KB in flight per SM where 16-byte register copies keep ~2 KB per warp.
// Sizes and addresses must be multiples of 16 bytes.

namespace ep {

constexpr int kBulkMaxStages = 8;      // stages per warp
constexpr int kBulkSmemBudget = 192 * 1024;
// What the bulk kernels' own shared memory takes next to the stages (ptxas: at most 20.3 KiB, sm_90), with
// room: a device whose blocks cannot hold both (sm_120's 99 KiB) copies with registers instead.
constexpr int kBulkStaticSmemReserve = 24 * 1024;

// Stage geometry, chosen on the host from the row size: more stages keep more bytes in flight.
struct BulkShape {
  int chunk_bytes;  // bytes per job: min(row bytes, max chunk)
  int stage_bytes;  // chunk_bytes rounded up to 128
  int num_stages;   // per warp, >= 3
  int lookahead;    // loads in flight ahead of the chunk being stored, < num_stages
};

// Warps per block of the bulk kernels, and the largest chunk of a row one bulk load moves. The
// permute spends a few dependent memory latencies per packet (its token, rows and probs), so more
// warps hide more of them: on the H200 bed (8 ranks x 16 SMs, 4096 tokens, H=7168) 16 x 4 KiB
// dispatched in 2452 us (fp8 2104) against 2567 (2255) for 8 x 8 KiB. The load depth (1 to 7
// chunks ahead) moved nothing by more than 2%. See benchmarks/NOTES.md.
constexpr int kBulkWarps = 16;
constexpr int kBulkChunkBytes = 4096;

inline BulkShape make_bulk_shape(int64_t row_bytes) {
  BulkShape s;
  s.chunk_bytes = static_cast<int>(row_bytes < kBulkChunkBytes ? row_bytes : kBulkChunkBytes);
  s.stage_bytes = (s.chunk_bytes + 127) / 128 * 128;
  const int stages = kBulkSmemBudget / (kBulkWarps * s.stage_bytes);
  s.num_stages = stages < 3 ? 3 : (stages > kBulkMaxStages ? kBulkMaxStages : stages);
  // Loads run as far ahead as the ring allows: a stage is reloaded once the stores of the job before
  // it have read it. Deep loads matter when the payload is a peer GPU's memory.
  s.lookahead = s.num_stages - 1;
  return s;
}
inline int bulk_smem_bytes(const BulkShape& s) { return kBulkWarps * s.num_stages * s.stage_bytes; }

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbarrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(bar)) : "memory");
  // Make the initialised barrier visible to the bulk-copy (async) proxy.
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}
// Spins on a bulk copy's completion. No timeout: the copy's source is ready (its flag was acquired before it
// was issued), and a load from a peer's memory (a pull over NVLink or IPC) completes or faults, a sticky
// error the host's timed wait reports; a link that stalled for ever would hang here unnamed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_address(bar)), "r"(parity)
        : "memory");
  }
}
__device__ __forceinline__ void bulk_load(void* stage, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_address(stage)),
               "l"(src), "r"(bytes), "r"(smem_address(bar))
               : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* stage, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_address(stage)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Wait until at most `pending` of this thread's newest store groups still read shared memory.
__device__ __forceinline__ void bulk_wait_read(int pending) {
  switch (pending) {
    case 0: asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.bulk.wait_group.read 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.bulk.wait_group.read 3;" ::: "memory"); break;
    default: asm volatile("cp.async.bulk.wait_group.read 4;" ::: "memory"); break;
  }
}
// Every store of this thread has landed (call before publishing a completion flag).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Orders this thread's global-memory accesses through the generic proxy (ordinary loads and stores,
// the flags it acquired or will release) with those of the bulk copies (the async proxy), both ways:
// a peer's rows seen ready through a flag are what a bulk load then reads, and rows stored in bulk
// are what a peer reading them through a flag finds (whichever copy engine that peer uses).
__device__ __forceinline__ void fence_generic_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
#else  // the bulk kernels are never launched below sm_90 (the host checks the device)
__device__ __forceinline__ void mbarrier_init(uint64_t*) { __trap(); }
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t*, uint32_t) { __trap(); }
__device__ __forceinline__ void mbarrier_wait(uint64_t*, uint32_t) { __trap(); }
__device__ __forceinline__ void bulk_load(void*, const void*, uint32_t, uint64_t*) { __trap(); }
__device__ __forceinline__ void bulk_store(void*, const void*, uint32_t) { __trap(); }
__device__ __forceinline__ void bulk_commit() { __trap(); }
__device__ __forceinline__ void bulk_wait_read(int) { __trap(); }
__device__ __forceinline__ void bulk_wait_all() { __trap(); }
__device__ __forceinline__ void fence_generic_async_global() { __trap(); }
#endif

// One warp's ring of stages. Job j (a chunk of a row) goes through stage j % num_stages.
struct BulkRing {
  char* stages;
  uint64_t* bars;
  BulkShape shape;
};

// Lane 0 sets up the ring of warp `warp_in_block` in the block's dynamic shared memory.
__device__ __forceinline__ BulkRing make_bulk_ring(char* dynamic_smem, uint64_t* bars, const BulkShape& shape,
                                                   int warp_in_block, int lane) {
  BulkRing ring{dynamic_smem + static_cast<int64_t>(warp_in_block) * shape.num_stages * shape.stage_bytes, bars,
                shape};
  if (lane == 0) {
    for (int s = 0; s < shape.num_stages; ++s) mbarrier_init(bars + s);
  }
  __syncwarp();
  return ring;
}

struct BulkJob {
  const void* src;
  uint32_t bytes;
};

// Rows longer than a chunk go as several jobs: job j is chunk (j % parts) of the (j / parts)-th row.
struct RowChunks {
  int64_t row_bytes;
  int chunk_bytes;
  int parts;
  __device__ RowChunks(int64_t row, const BulkShape& shape)
      : row_bytes(row), chunk_bytes(shape.chunk_bytes), parts(static_cast<int>((row + chunk_bytes - 1) / chunk_bytes)) {}
  __device__ int row(int j) const { return j / parts; }
  __device__ int64_t offset(int j) const { return static_cast<int64_t>(j % parts) * chunk_bytes; }
  __device__ uint32_t bytes(int j) const {
    return static_cast<uint32_t>(min(static_cast<int64_t>(chunk_bytes), row_bytes - offset(j)));
  }
};

// Run `num_jobs` jobs through the warp's ring: source(j) -> BulkJob says what to load (called
// by lane 0, `lookahead` jobs ahead); consume(j, stage) is called by the whole warp once job j's
// chunk is in shared memory, and lane 0 issues its bulk stores there. A stage is reloaded only
// after the stores reading it are done. Ends with every store of the warp landed.
template <typename Source, typename Consume>
__device__ __forceinline__ void run_bulk_jobs(const BulkRing& ring, int num_jobs, Source source, Consume consume,
                                              int lane) {
  const int stages = ring.shape.num_stages;
  const int ahead = ring.shape.lookahead;
  auto load = [&](int j) {
    const int slot = j % stages;
    const BulkJob job = source(j);
    mbarrier_expect_bytes(ring.bars + slot, job.bytes);
    bulk_load(ring.stages + static_cast<int64_t>(slot) * ring.shape.stage_bytes, job.src, job.bytes,
              ring.bars + slot);
  };
  if (lane == 0) {
    fence_generic_async_global();  // after the caller's wait for the rows (a flag acquired in this block)
    for (int j = 0; j < ahead && j < num_jobs; ++j) load(j);
  }
  for (int i = 0; i < num_jobs; ++i) {
    const int slot = i % stages;
    if (lane == 0) mbarrier_wait(ring.bars + slot, (i / stages) & 1);
    __syncwarp();
    consume(i, ring.stages + static_cast<int64_t>(slot) * ring.shape.stage_bytes);
    if (lane == 0) {
      bulk_commit();
      if (i + ahead < num_jobs) {
        // Job i + ahead reuses the stage of job i + ahead - stages, whose store group is
        // (stages - ahead) groups older than the newest one.
        bulk_wait_read(stages - ahead);
        load(i + ahead);
      }
    }
    __syncwarp();
  }
  if (lane == 0) {
    bulk_wait_all();
    fence_generic_async_global();
    __threadfence_system();  // the landed stores come before the block's completion flag
  }
  __syncwarp();
}

// Host side: allow `bytes` of dynamic shared memory for `kernel` on the current device, asking the
// driver only the first time (cudaFuncSetAttribute on every launch is host time an eager op pays).
inline void allow_dynamic_smem(const void* kernel, int bytes) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, int> allowed;  // (device, kernel) -> bytes set
  int device = 0;
  EP_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  int& current = allowed[{device, kernel}];
  if (current >= bytes) return;
  EP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  current = bytes;
}

// Host side: launch the bulk kernel (with its shared-memory stages) when asked and the GPU has
// bulk copies, else the register-copy kernel. Rows of `row_bytes` set the stage geometry.
template <typename Regions, typename Args>
void launch_copy_kernel(bool bulk, void (*bulk_kernel)(TransportView, Regions, Args, BulkShape),
                        void (*register_kernel)(TransportView, Regions, Args), const TransportView& view,
                        const Regions& regions, const Args& args, int64_t row_bytes, int num_blocks,
                        cudaStream_t stream) {
  if (bulk) {
    const BulkShape shape = make_bulk_shape(row_bytes);
    const int smem = bulk_smem_bytes(shape);
    allow_dynamic_smem(reinterpret_cast<const void*>(bulk_kernel), smem);
    bulk_kernel<<<num_blocks, kBulkWarps * 32, smem, stream>>>(view, regions, args, shape);
  } else {
    register_kernel<<<num_blocks, kThreads, 0, stream>>>(view, regions, args);
  }
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep
