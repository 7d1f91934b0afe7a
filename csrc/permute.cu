// Stage 3 of a dispatch: expand received packets into expert-sorted, padded output rows.
//
// Data flow: waits for disp_done[r][b] >= n from every block b of every source rank r (acquire);
// then warp w takes packets (r, s), s = w, w + warps, ... < num_packets[r]. A packet's row for
// local expert e is row_base[r][e] + k, with k the sender's index of the token within (r, e)
// (first dispatch: read from disp_k and recorded in packet_rows for combine), or comes straight
// from packet_rows (dispatch again). Rows at or past the budget are dropped and raise the
// overflow flag. Padding rows of each segment, and rows between the total and the budget, are
// zero-filled (hidden, scales and probs), so every row below the budget is written.
#include <cuda_runtime.h>

#include "ep/check.cuh"
#include "ep/comm.cuh"
#include "ep/hybrid.h"

namespace ep {
namespace {

__device__ __forceinline__ void zero_row(const PermuteArgs& a, int64_t row, int lane) {
  warp_zero16(static_cast<char*>(a.out) + row * a.row_bytes, a.row_bytes, lane);
  if (a.out_scales != nullptr) warp_zero4(reinterpret_cast<char*>(a.out_scales) + row * a.scale_bytes, a.scale_bytes, lane);
  if (a.out_probs != nullptr && lane == 0) a.out_probs[row] = 0.0f;
}

__global__ void __launch_bounds__(kThreads) permute_kernel(DeviceView v, PermuteArgs a) {
  __shared__ int32_t s_targets[kThreads / 32][kMaxLocalExperts];  // output rows of the packet in hand
  if (block_aborted(v)) return;
  const unsigned long long seq = current_seq(v);
  if (!wait_all_blocks(v, v.layout.off_disp_done, seq, gridDim.x, kPhaseDispatchReceive)) return;
  const int R = v.layout.num_ranks;
  const int L = v.layout.num_local_experts;
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  int32_t* targets = s_targets[threadIdx.x / 32];
  if (warp == 0 && lane == 0 && a.total_rows[0] > a.budget) *a.overflow = 1;

  for (int r = 0; r < R; ++r) {
    const int packets = a.num_packets[r];
    for (int s = warp; s < packets; s += warps) {
      const char* packet = disp_payload(v, v.rank, r, s);
      int32_t* cached = a.packet_rows + packet_index(v, r, s) * L;
      int count = 0;
      for (int j0 = 0; j0 < L; j0 += 32) {
        const int j = j0 + lane;
        int row = -1;
        if (j < L) {
          if (a.use_cached_rows) {
            row = cached[j];
          } else {
            const int k = disp_k(v, v.rank, r, s)[j];
            row = k >= 0 ? a.row_base[r * L + j] + k : -1;
            cached[j] = row;
          }
          if (row >= 0 && a.out_probs != nullptr && row < a.budget) a.out_probs[row] = disp_p(v, v.rank, r, s)[j];
          if (row >= a.budget) *a.overflow = 1;
        }
        const bool valid = row >= 0 && row < a.budget;
        const unsigned ballot = __ballot_sync(0xffffffffu, valid);
        if (valid) targets[count + __popc(ballot & ((1u << lane) - 1))] = row;
        count += __popc(ballot);
      }
      __syncwarp();
      // Read the packet once, store it to each of its rows.
      char* out = static_cast<char*>(a.out);
      const int64_t row_bytes = a.row_bytes;
      warp_copy16_multi([=](int k) { return out + targets[k] * row_bytes; }, count, packet, row_bytes, lane);
      if (a.out_scales != nullptr) {
        for (int n = 0; n < count; ++n) {
          warp_copy4(reinterpret_cast<char*>(a.out_scales) + static_cast<int64_t>(targets[n]) * a.scale_bytes,
                     packet + a.row_bytes, a.scale_bytes, lane);
        }
      }
      __syncwarp();
    }
  }

  // Zero the padding of each segment, then everything past the last segment up to the budget.
  for (int e = 0; e < L; ++e) {
    const int64_t first = a.expert_start[e] + a.real_per_expert[e];
    const int64_t end = min(static_cast<int64_t>(a.expert_start[e] + a.tokens_per_expert[e]), a.budget);
    for (int64_t row = first + warp; row < end; row += warps) zero_row(a, row, lane);
  }
  for (int64_t row = a.total_rows[0] + warp; row < a.budget; row += warps) zero_row(a, row, lane);
}

}  // namespace

void launch_permute(const Buffer& buffer, const PermuteArgs& args, int num_blocks, uintptr_t stream) {
  EP_CUDA_CHECK(cudaSetDevice(buffer.device()));
  permute_kernel<<<num_blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(buffer.view(), args);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep
