// Combine: stage 4 on the expert side, stage 5 on the source side.
//
// combine_send: (after the handshake kernel) warp w takes received packets (r, s); the packet's
// rows (packet_rows, recorded by permute; rows past the budget were dropped and count as zero)
// are summed in fp32 in local-expert order, rounded once to bf16, and pushed to rank r's
// comb_data[this rank][s]; with row_probs, each row's scalar goes unsummed to comb_p[this rank][s].
// Each block then publishes comb_done[this rank][block] = n at every rank.
//
// combine_recv: waits for comb_done[p][b] >= n from every block of every rank p (acquire), then
// warp w takes tokens t and sums, in fp32 and rank order, the rows returned for the token by each
// rank it was sent to (send_slot), writing bf16 [T, H]; scalars land in the dense [T, E] output.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ep/check.cuh"
#include "ep/comm.cuh"
#include "ep/hybrid.h"

namespace ep {
namespace {

constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& word) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&word);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

__device__ __forceinline__ int4 pack_bf16x8(const float (&acc)[8]) {
  int4 word;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&word);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return word;
}

__global__ void __launch_bounds__(kThreads) combine_send_kernel(DeviceView v, CombineSendArgs a) {
  __shared__ int32_t s_rows[kWarps][kMaxLocalExperts];
  if (block_aborted(v)) return;
  const unsigned long long seq = current_seq(v);
  const int R = v.layout.num_ranks;
  const int L = v.layout.num_local_experts;
  const int H = v.layout.hidden;
  const int lane = threadIdx.x % 32;
  const int warp_in_block = threadIdx.x / 32;
  const int warp = blockIdx.x * kWarps + warp_in_block;
  const int warps = gridDim.x * kWarps;
  int32_t* rows = s_rows[warp_in_block];

  for (int r = 0; r < R; ++r) {
    const int packets = a.num_packets[r];
    for (int s = warp; s < packets; s += warps) {
      const int32_t* packet_rows = a.packet_rows + packet_index(v, r, s) * L;
      // Compact the packet's valid rows, in local-expert order, into shared memory.
      int count = 0;
      for (int j0 = 0; j0 < L; j0 += 32) {
        const int j = j0 + lane;
        int row = j < L ? packet_rows[j] : -1;
        const bool valid = row >= 0 && row < a.budget;
        if (j < L && a.row_probs != nullptr) comb_p(v, r, v.rank, s)[j] = valid ? a.row_probs[row] : 0.0f;
        const unsigned ballot = __ballot_sync(0xffffffffu, valid);
        if (valid) rows[count + __popc(ballot & ((1u << lane) - 1))] = row;
        count += __popc(ballot);
      }
      __syncwarp();
      const int4* input = static_cast<const int4*>(a.rows);
      int4* output = reinterpret_cast<int4*>(comb_row(v, r, v.rank, s));
      for (int i = lane; i < H / 8; i += 32) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int n = 0; n < count; ++n) add_bf16x8(acc, input[static_cast<int64_t>(rows[n]) * (H / 8) + i]);
        output[i] = pack_bf16x8(acc);
      }
      __syncwarp();
    }
  }
  signal_block_done(v, v.layout.off_comb_done, seq);
}

__global__ void __launch_bounds__(kThreads) combine_recv_kernel(DeviceView v, CombineRecvArgs a) {
  __shared__ int s_slots[kWarps][kMaxRanks];
  if (block_aborted(v)) return;
  const unsigned long long seq = current_seq(v);
  if (!wait_all_blocks(v, v.layout.off_comb_done, seq, gridDim.x, kPhaseCombineReceive)) return;
  const int R = v.layout.num_ranks;
  const int L = v.layout.num_local_experts;
  const int E = R * L;
  const int H = v.layout.hidden;
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * kWarps;
  int* slots = s_slots[threadIdx.x / 32];
  for (int t = blockIdx.x * kWarps + threadIdx.x / 32; t < a.num_tokens; t += warps) {
    const int my_slot = lane < R ? a.send_slot[static_cast<int64_t>(t) * R + lane] : -1;
    const unsigned sources = __ballot_sync(0xffffffffu, my_slot >= 0);
    // Every lane needs every rank's slot: stage them in shared memory (lanes may leave the
    // hidden loop at different times, so no shuffles inside it).
    if (lane < R) slots[lane] = my_slot;
    __syncwarp();
    int4* output = static_cast<int4*>(a.out) + static_cast<int64_t>(t) * (H / 8);
    for (int i = lane; i < H / 8; i += 32) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (unsigned mask = sources; mask; mask &= mask - 1) {
        const int p = __ffs(mask) - 1;
        add_bf16x8(acc, reinterpret_cast<const int4*>(comb_row(v, v.rank, p, slots[p]))[i]);
      }
      output[i] = pack_bf16x8(acc);
    }
    if (a.out_probs != nullptr) {
      for (unsigned mask = sources; mask; mask &= mask - 1) {
        const int p = __ffs(mask) - 1;
        const int slot = __shfl_sync(0xffffffffu, my_slot, p);
        const int64_t base = static_cast<int64_t>(t) * E + p * L;
        for (int j = lane; j < L; j += 32) {
          if (a.k_index[base + j] >= 0) a.out_probs[base + j] = comb_p(v, v.rank, p, slot)[j];
        }
      }
    }
    __syncwarp();
  }
}

}  // namespace

void launch_combine_send(const Buffer& buffer, const CombineSendArgs& args, int num_blocks, uintptr_t stream) {
  EP_CUDA_CHECK(cudaSetDevice(buffer.device()));
  combine_send_kernel<<<num_blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(buffer.view(), args);
  EP_CUDA_CHECK(cudaGetLastError());
}

void launch_combine_recv(const Buffer& buffer, const CombineRecvArgs& args, int num_blocks, uintptr_t stream) {
  EP_CUDA_CHECK(cudaSetDevice(buffer.device()));
  combine_recv_kernel<<<num_blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(buffer.view(), args);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep
