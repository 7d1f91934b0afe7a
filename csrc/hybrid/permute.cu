// Stage 3 of a dispatch: pull received packets into expert-sorted, padded output rows.
//
// Data flow: waits for disp_done[r][b] >= n from every block b of every source rank r (acquire);
// then warp w takes packets q = w, w + warps, ... of the packets received from all sources in
// rank order (packet q is (r, s): source r's s-th packet, whose payload is the token
// disp_token[r][s] staged in source r's buffer). A packet's row for local expert e is
// row_base[r][e] + k, with k the sender's index of the token within (r, e) (first dispatch: read
// from disp_k and recorded in packet_rows for combine), or comes straight from packet_rows
// (dispatch again). Rows at or past the budget are dropped and raise the overflow flag. Padding
// rows of each segment are zero-filled (hidden, scales and probs). Rows past the total (only in
// non-blocking mode, where the budget is an upper bound) are left as they are.
//
// Copy engines as in dispatch.cu: one bulk load of the payload (from the source's buffer: a peer
// GPU's over NVLink, or this GPU's), one bulk store per expert row (sm_90+), or 16-byte register
// copies.
#include <cuda_runtime.h>

#include "ep/check.cuh"
#include "ep/copy.cuh"
#include "ep/pipeline.cuh"
#include "hybrid/regions.cuh"

namespace ep {
namespace hybrid {
namespace {

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

__global__ void __launch_bounds__(kThreads) permute_kernel(TransportView t, Regions g, PermuteArgs a) {
  __shared__ int32_t s_targets[kThreads / 32][kMaxLocalExperts];  // output rows of the packet in hand
  __shared__ int s_prefix[kMaxRanks + 1];
  const View v{t, g};
  if (block_aborted(t)) return;
  const unsigned long long seq = current_seq(t);
  if (!wait_all_blocks(t, dispatch_done(v), seq, gridDim.x, kPhaseDispatchReceive)) return;
  const int R = v.g.num_ranks;
  int32_t* targets = s_targets[threadIdx.x / 32];
  if (blockIdx.x == 0 && threadIdx.x == 0 && a.total_rows[0] > a.budget) *a.overflow = 1;
  packet_prefix(R, a.num_packets, s_prefix);
  auto payload = [&](int q) {
    const int r = source_of(R, s_prefix, q);
    return packet_payload(v, r, q - s_prefix[r]);
  };
  auto prepare = [&](int q, int lane) {
    const int r = source_of(R, s_prefix, q);
    const int s = q - s_prefix[r];
    return prepare_packet(v, a, r, s, a.out_scales != nullptr ? packet_payload(v, r, s) : nullptr, targets, lane);
  };
  char* out = static_cast<char*>(a.out);
  auto target = [=](int n) { return out + targets[n] * a.row_bytes; };
  pull_packets_register(s_prefix[R], a.row_bytes, payload, prepare, target);
  zero_padding(v, a);
}

__global__ void __launch_bounds__(kBulkWarps * 32) permute_bulk_kernel(TransportView t, Regions g, PermuteArgs a,
                                                                       BulkShape shape) {
  extern __shared__ __align__(128) char s_stages[];
  __shared__ int32_t s_targets[kBulkWarps][kMaxLocalExperts];
  __shared__ uint64_t s_bars[kBulkWarps][kBulkMaxStages];
  __shared__ int s_prefix[kMaxRanks + 1];
  const View v{t, g};
  if (block_aborted(t)) return;
  const unsigned long long seq = current_seq(t);
  if (!wait_all_blocks(t, dispatch_done(v), seq, gridDim.x, kPhaseDispatchReceive)) return;
  const int R = v.g.num_ranks;
  const int warp_in_block = threadIdx.x / 32;
  int32_t* targets = s_targets[warp_in_block];
  if (blockIdx.x == 0 && threadIdx.x == 0 && a.total_rows[0] > a.budget) *a.overflow = 1;
  packet_prefix(R, a.num_packets, s_prefix);
  const BulkRing ring = make_bulk_ring(s_stages, s_bars[warp_in_block], shape, warp_in_block, threadIdx.x % 32);
  auto payload = [&](int q) {
    const int r = source_of(R, s_prefix, q);
    return packet_payload(v, r, q - s_prefix[r]);
  };
  auto prepare = [&](int q, int lane) {
    const int r = source_of(R, s_prefix, q);
    const int s = q - s_prefix[r];
    return prepare_packet(v, a, r, s, a.out_scales != nullptr ? packet_payload(v, r, s) : nullptr, targets, lane);
  };
  char* out = static_cast<char*>(a.out);
  auto target = [=](int n) { return out + targets[n] * a.row_bytes; };
  pull_packets_bulk(ring, s_prefix[R], a.row_bytes, payload, prepare, target);
  zero_padding(v, a);
}

}  // namespace

void launch_permute(const SymmetricBuffer& buffer, const Regions& regions, const PermuteArgs& args, int num_blocks, uintptr_t stream) {
  EP_CUDA_CHECK(cudaSetDevice(buffer.device()));
  const bool bulk = args.bulk_copy && buffer.bulk_capable();
  launch_copy_kernel(bulk, permute_bulk_kernel, permute_kernel, buffer.view(), regions, args, args.row_bytes, num_blocks,
                     reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace hybrid
}  // namespace ep
