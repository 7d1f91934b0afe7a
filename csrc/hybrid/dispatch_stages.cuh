// The device side of hybrid's dispatch stages, block by block: the send (dispatch.cu) and the
// permute (permute.cu) each run one of these per block in their own launch, and the fused
// dispatch (permute.cu: a non-blocking first dispatch, whose budget is known before the counts
// are) runs both in one launch, the send's part then the permute's. See the two files for the data
// flow of each stage.
#pragma once

#include <cuda_runtime.h>

#include "ep/copy.cuh"
#include "ep/pipeline.cuh"
#include "hybrid/regions.cuh"

namespace ep {
namespace hybrid {

// ---- the send ----------------------------------------------------------------------------------

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

// One block's share of the send of op seq: stage its tokens, push their per-destination parts, and
// publish the block's completion (register copies, or bulk copies through `ring`).
__device__ __forceinline__ void send_block(const View& v, const SendArgs& a, unsigned long long seq, int* slots) {
  stage_tokens_register(v, a.hidden, a.row_bytes, a.num_tokens,
                        [&](int token, int lane) { return prepare_token(v, a, token, slots, lane); });
  signal_block_done(v.t, dispatch_done(v), seq);
}

__device__ __forceinline__ void send_block(const View& v, const BulkRing& ring, const SendArgs& a,
                                           unsigned long long seq, int* slots) {
  stage_tokens_bulk(v, ring, a.hidden, a.row_bytes, a.num_tokens,
                    [&](int token, int lane) { return prepare_token(v, a, token, slots, lane); });
  signal_block_done(v.t, dispatch_done(v), seq);
}

// ---- the permute -------------------------------------------------------------------------------

__device__ __forceinline__ void zero_row(const PermuteArgs& a, int64_t row, int lane) {
  warp_zero16(static_cast<char*>(a.out) + row * a.row_bytes, a.row_bytes, lane);
  if (a.out_scales != nullptr) warp_zero4(reinterpret_cast<char*>(a.out_scales) + row * a.scale_bytes, a.scale_bytes, lane);
  if (a.out_probs != nullptr && lane == 0) a.out_probs[row] = 0.0f;
}

// Warp-cooperative: the output rows of packet (r, s), compacted in local-expert order into
// `targets` (shared memory); also writes the rows' probs and fp8 scales (read from `payload`).
// Returns the count.
__device__ __forceinline__ int prepare_packet(const View& v, const PermuteArgs& a, int r, int s,
                                              const char* payload, int32_t* targets, int lane) {
  const int L = v.g.num_local_experts;
  int32_t* cached = a.packet_rows + packet_index(v, r, s) * L;
  int count = 0;
  for (int j0 = 0; j0 < L; j0 += 32) {
    const int j = j0 + lane;
    int row = -1;
    if (j < L) {
      // Independent loads first, so that a packet costs one memory latency, not three.
      const float prob = a.out_probs != nullptr ? disp_p(v, v.t.rank, r, s)[j] : 0.0f;
      if (a.use_cached_rows) {
        row = cached[j];
      } else {
        const int k = disp_k(v, v.t.rank, r, s)[j];
        const int base = a.row_base[r * L + j];
        row = k >= 0 ? base + k : -1;
        cached[j] = row;
      }
      if (row >= 0 && a.out_probs != nullptr && row < a.budget) a.out_probs[row] = prob;
      if (row >= a.budget) *a.overflow = 1;
    }
    const bool valid = row >= 0 && row < a.budget;
    const unsigned ballot = __ballot_sync(0xffffffffu, valid);
    if (valid) targets[count + __popc(ballot & ((1u << lane) - 1))] = row;
    count += __popc(ballot);
  }
  __syncwarp();
  if (a.out_scales != nullptr) {
    for (int n = 0; n < count; ++n) {
      warp_copy4(reinterpret_cast<char*>(a.out_scales) + static_cast<int64_t>(targets[n]) * a.scale_bytes,
                 payload + a.row_bytes, a.scale_bytes, lane);
    }
  }
  return count;
}

// After the packets: zero the padding rows of each segment (all warps of the grid).
__device__ __forceinline__ void zero_padding(const View& v, const PermuteArgs& a) {
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  for (int e = 0; e < v.g.num_local_experts; ++e) {
    const int64_t first = a.expert_start[e] + a.real_per_expert[e];
    const int64_t end = min(static_cast<int64_t>(a.expert_start[e] + a.tokens_per_expert[e]), a.budget);
    for (int64_t row = first + warp; row < end; row += warps) zero_row(a, row, lane);
  }
}

// One block's share of the permute of op seq: wait for every source's send, then pull packets into
// their expert rows (with `pull`: the register or the bulk loop) and zero the padding. `targets` is
// the warp's [kMaxLocalExperts] of shared memory, `prefix` the block's [R + 1].
template <typename Pull>
__device__ __forceinline__ void permute_block_with(const View& v, const PermuteArgs& a, unsigned long long seq,
                                                   int32_t* targets, int* prefix, Pull pull) {
  if (!wait_all_blocks(v.t, dispatch_done(v), seq, gridDim.x, kPhaseDispatchReceive)) return;
  const int R = v.g.num_ranks;
  if (blockIdx.x == 0 && threadIdx.x == 0 && a.total_rows[0] > a.budget) *a.overflow = 1;
  packet_prefix(R, a.num_packets, prefix);
  auto payload = [&](int q) {
    const int r = source_of(R, prefix, q);
    return packet_payload(v, r, q - prefix[r]);
  };
  auto prepare = [&](int q, int lane) {
    const int r = source_of(R, prefix, q);
    const int s = q - prefix[r];
    return prepare_packet(v, a, r, s, a.out_scales != nullptr ? packet_payload(v, r, s) : nullptr, targets, lane);
  };
  char* out = static_cast<char*>(a.out);
  auto target = [=](int n) { return out + targets[n] * a.row_bytes; };
  pull(prefix[R], payload, prepare, target);
  zero_padding(v, a);
}

__device__ __forceinline__ void permute_block(const View& v, const PermuteArgs& a, unsigned long long seq,
                                              int32_t* targets, int* prefix) {
  permute_block_with(v, a, seq, targets, prefix, [&](int total, auto payload, auto prepare, auto target) {
    pull_packets_register(total, a.row_bytes, payload, prepare, target);
  });
}

__device__ __forceinline__ void permute_block(const View& v, const BulkRing& ring, const PermuteArgs& a,
                                              unsigned long long seq, int32_t* targets, int* prefix) {
  permute_block_with(v, a, seq, targets, prefix, [&](int total, auto payload, auto prepare, auto target) {
    pull_packets_bulk(ring, total, a.row_bytes, payload, prepare, target);
  });
}

}  // namespace hybrid
}  // namespace ep
