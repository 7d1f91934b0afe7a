// Stage 2 of a dispatch: stage each token for its destinations to pull, and tell them where.
//
// Data flow: warp w of the grid takes tokens t = w, w + warps, ...; lane p (< R) holds the token's
// send slot at rank p (-1: no expert there). A token sent anywhere is copied once into this
// rank's disp_stage[t] (payload, then fp8 scales), where every destination's permute kernel reads
// it. Each destination p gets, pushed into its buffer at [this rank][slot], the token index
// (disp_token) and, on a first dispatch, the token's per-local-expert k index (its position within
// (this rank, expert)) and prob (disp_k / disp_p). Nothing is waited on: the notify kernel before
// this one established that every peer finished reading this rank's previous stage and that
// their regions are free. Each block ends by publishing disp_done[this rank][block] = n at every
// rank (release), which the permute kernel waits on. A rank with no tokens still publishes.
//
// Why pull: a pushed packet is written at the receiver and read back by its permute; pulled, the
// payload is read once, straight into the expert rows: a third fewer bytes written per dispatch.
//
// Two copy engines stage the payload: bulk copies (sm_90+: one lane moves the row through a
// shared-memory stage, several rows in flight per warp), or 16-byte register copies (any GPU;
// EP_PLUGIN_BULK_COPY=0).
#include <cuda_runtime.h>

#include "ep/check.cuh"
#include "ep/copy.cuh"
#include "ep/pipeline.cuh"
#include "hybrid/regions.cuh"

namespace ep {
namespace hybrid {
namespace {

// Warp-cooperative: tell each destination of token t where to find it (token index, and on a
// first dispatch its k indices and probs), stage its fp8 scales, and return the number of
// destinations. `slots` is the warp's [R] scratch of send slots.
__device__ __forceinline__ int prepare_token(const View& v, const SendArgs& a, int t, int* slots, int lane) {
  const int R = v.g.num_ranks;
  const int L = v.g.num_local_experts;
  const int E = R * L;
  const int my_slot = lane < R ? a.send_slot[static_cast<int64_t>(t) * R + lane] : -1;
  const unsigned destinations = __ballot_sync(0xffffffffu, my_slot >= 0);
  if (my_slot >= 0) *disp_token(v, lane, v.t.rank, my_slot) = t;
  if (lane < R) slots[lane] = my_slot;
  __syncwarp();
  if (destinations == 0) return 0;
  if (a.scales != nullptr) {
    warp_copy4(staged_token(v, v.t.rank, t) + a.row_bytes, reinterpret_cast<const char*>(a.scales) + t * a.scale_bytes,
               a.scale_bytes, lane);
  }
  if (a.k_index != nullptr) {
    // The token's whole [E] row of k indices (and probs) at once, each column to its rank's packet:
    // the loads do not wait on the stores of another destination.
    const int64_t base = static_cast<int64_t>(t) * E;
#pragma unroll 4
    for (int j = lane; j < E; j += 32) {
      const int p = j / L;
      const int slot = slots[p];
      if (slot < 0) continue;
      const int32_t k = __ldg(a.k_index + base + j);
      const float prob = a.probs != nullptr ? __ldg(a.probs + base + j) : 0.0f;
      disp_k(v, p, v.t.rank, slot)[j - p * L] = k;
      disp_p(v, p, v.t.rank, slot)[j - p * L] = prob;
    }
  }
  return __popc(destinations);
}

// The permute's overflow flag starts at 0 (also when this op was aborted: the host may read it).
__device__ __forceinline__ void clear_overflow(const SendArgs& a) {
  if (a.overflow != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *a.overflow = 0;
}

__global__ void __launch_bounds__(kThreads) dispatch_send_kernel(TransportView t, Regions g, SendArgs a) {
  __shared__ int s_slots[kThreads / 32][kMaxRanks];
  const View v{t, g};
  clear_overflow(a);
  if (block_aborted(t)) return;  // a wait of this op already failed: leave peers untouched
  const unsigned long long seq = current_seq(t);
  int* slots = s_slots[threadIdx.x / 32];
  stage_tokens_register(v, a.hidden, a.row_bytes, a.num_tokens,
                        [&](int token, int lane) { return prepare_token(v, a, token, slots, lane); });
  signal_block_done(t, dispatch_done(v), seq);
}

__global__ void __launch_bounds__(kBulkWarps * 32) dispatch_send_bulk_kernel(TransportView t, Regions g, SendArgs a,
                                                                             BulkShape shape) {
  extern __shared__ __align__(128) char s_stages[];
  __shared__ int s_slots[kBulkWarps][kMaxRanks];
  __shared__ uint64_t s_bars[kBulkWarps][kBulkMaxStages];
  const View v{t, g};
  clear_overflow(a);
  if (block_aborted(t)) return;
  const unsigned long long seq = current_seq(t);
  const int warp_in_block = threadIdx.x / 32;
  const BulkRing ring = make_bulk_ring(s_stages, s_bars[warp_in_block], shape, warp_in_block, threadIdx.x % 32);
  int* slots = s_slots[warp_in_block];
  stage_tokens_bulk(v, ring, a.hidden, a.row_bytes, a.num_tokens,
                    [&](int token, int lane) { return prepare_token(v, a, token, slots, lane); });
  signal_block_done(t, dispatch_done(v), seq);
}

}  // namespace

void launch_dispatch_send(const SymmetricBuffer& buffer, const Regions& regions, const SendArgs& args, int num_blocks, uintptr_t stream) {
  EP_CUDA_CHECK(cudaSetDevice(buffer.device()));
  const bool bulk = args.bulk_copy && buffer.bulk_capable();
  launch_copy_kernel(bulk, dispatch_send_bulk_kernel, dispatch_send_kernel, buffer.view(), regions, args, args.row_bytes, num_blocks,
                     reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace hybrid
}  // namespace ep
