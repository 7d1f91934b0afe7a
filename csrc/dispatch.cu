// Stage 2 of a dispatch: push each token once per destination rank.
//
// Data flow: warp w of the grid takes tokens t = w, w + warps, ...; lane p (< R) holds the token's
// send slot at rank p (-1: no expert there). The payload, read once, (and fp8 scales) goes to
// peer p's disp_data[this rank][slot]; on a first dispatch the token's per-local-expert k index
// (its position within (this rank, expert)) and prob go to disp_k / disp_p beside it. Nothing is
// waited on: the notify kernel before this one established that every peer's regions are free.
// Each block ends by publishing disp_done[this rank][block] = n at every rank (release), which
// the permute kernel waits on. A rank with no tokens still publishes.
#include <cuda_runtime.h>

#include "ep/check.cuh"
#include "ep/comm.cuh"
#include "ep/hybrid.h"

namespace ep {
namespace {

__global__ void __launch_bounds__(kThreads) dispatch_send_kernel(DeviceView v, SendArgs a) {
  __shared__ char* s_packets[kThreads / 32][kMaxRanks];
  if (block_aborted(v)) return;  // a wait of this op already timed out: leave peers untouched
  const unsigned long long seq = current_seq(v);
  const int R = v.layout.num_ranks;
  const int L = v.layout.num_local_experts;
  const int E = R * L;
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  for (int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; t < a.num_tokens; t += warps) {
    const int my_slot = lane < R ? a.send_slot[static_cast<int64_t>(t) * R + lane] : -1;
    const unsigned destinations = __ballot_sync(0xffffffffu, my_slot >= 0);
    if (destinations == 0) continue;
    // Each lane of the warp loads the row once and stores it to every destination.
    char** packets = s_packets[threadIdx.x / 32];
    if (my_slot >= 0) packets[__popc(destinations & ((1u << lane) - 1))] = disp_payload(v, lane, v.rank, my_slot);
    __syncwarp();
    const int count = __popc(destinations);
    warp_copy16_multi([packets](int k) { return packets[k]; }, count, static_cast<const char*>(a.hidden) + t * a.row_bytes, a.row_bytes, lane);
    int n = 0;
    for (unsigned mask = destinations; mask; mask &= mask - 1, ++n) {
      const int p = __ffs(mask) - 1;
      const int slot = __shfl_sync(0xffffffffu, my_slot, p);
      if (a.scales != nullptr) {
        warp_copy4(packets[n] + a.row_bytes, reinterpret_cast<const char*>(a.scales) + t * a.scale_bytes,
                   a.scale_bytes, lane);
      }
      if (a.k_index != nullptr) {
        const int64_t base = static_cast<int64_t>(t) * E + p * L;
        int32_t* k_out = disp_k(v, p, v.rank, slot);
        float* p_out = disp_p(v, p, v.rank, slot);
        for (int j = lane; j < L; j += 32) {
          k_out[j] = a.k_index[base + j];
          p_out[j] = a.probs != nullptr ? a.probs[base + j] : 0.0f;
        }
      }
    }
    __syncwarp();
  }
  signal_block_done(v, v.layout.off_disp_done, seq);
}

}  // namespace

void launch_dispatch_send(const Buffer& buffer, const SendArgs& args, int num_blocks, uintptr_t stream) {
  EP_CUDA_CHECK(cudaSetDevice(buffer.device()));
  dispatch_send_kernel<<<num_blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(buffer.view(), args);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep
