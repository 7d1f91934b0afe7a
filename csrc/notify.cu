// Stage 1 of every op: the handshake, and for a dispatch the count exchange.
//
// Data flow: one block. Thread 0 advances the rank's op sequence number n (device-resident, so
// graph replays advance it too). For a dispatch, the block first writes this rank's counts for
// destination p into p's counts slot [n % 2][this rank]; then thread p publishes arrive = n into
// rank p's `arrive[this rank]` (release, system scope) and waits for `arrive[p] >= n` in the own
// buffer (acquire). Having arrived, a rank has finished every earlier kernel on its stream, so
// its receive regions are free for op n and it no longer reads peers' staged tokens: the data
// kernels that follow write into peers (and into the own stage) without further checks. With
// counts, the block then derives this rank's receive layout.
//
// Waits on: arrive[p] for every rank p (phase given by the caller; timeout -> report + abort).
#include <cuda_runtime.h>

#include "ep/check.cuh"
#include "ep/comm.cuh"
#include "ep/hybrid.h"

namespace ep {
namespace {

constexpr int kNotifyThreads = 256;

__global__ void __launch_bounds__(kNotifyThreads) notify_kernel(DeviceView v, NotifyArgs a) {
  __shared__ unsigned long long s_seq;
  __shared__ int s_failed;
  const int R = v.layout.num_ranks;
  const int L = v.layout.num_local_experts;
  if (threadIdx.x == 0) {
    s_failed = aborted(v) ? 1 : 0;
    s_seq = current_seq(v) + 1;
    v.state->seq = s_seq;
  }
  __syncthreads();
  if (s_failed) return;
  const unsigned long long seq = s_seq;

  if (a.expert_counts != nullptr) {
    for (int i = threadIdx.x; i < R * (L + 1); i += blockDim.x) {
      const int p = i / (L + 1), j = i % (L + 1);
      counts_slot(v, p, seq, v.rank)[j] = j < L ? a.expert_counts[p * L + j] : a.rank_counts[p];
    }
  }
  __syncthreads();
  for (int p = threadIdx.x; p < R; p += blockDim.x) {
    __threadfence_system();
    st_release_sys(arrive_flags(v, p) + v.rank, seq);
  }
  for (int p = threadIdx.x; p < R; p += blockDim.x) {
    if (!wait_flag(v, arrive_flags(v, v.rank) + p, seq, a.phase, p)) s_failed = 1;
  }
  __syncthreads();
  if (s_failed || a.expert_counts == nullptr) return;

  // Receive layout: segment of local expert e = [expert_start[e], + tokens_per_expert[e]); within
  // it, sources in rank order, each source's tokens in token order (the sender's k index).
  __shared__ long long s_padded[kMaxLocalExperts];
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    long long real = 0;
    for (int r = 0; r < R; ++r) real += counts_slot(v, v.rank, seq, r)[e];
    const long long padded = (real + a.pad_multiple - 1) / a.pad_multiple * a.pad_multiple;
    a.real_per_expert[e] = real;
    a.tokens_per_expert[e] = padded;
    s_padded[e] = padded;
  }
  for (int r = threadIdx.x; r < R; r += blockDim.x) a.num_packets[r] = counts_slot(v, v.rank, seq, r)[L];
  __syncthreads();
  if (threadIdx.x == 0) {  // L <= 256: a serial scan is cheap next to the handshake
    long long start = 0;
    for (int e = 0; e < L; ++e) {
      const long long length = s_padded[e];
      s_padded[e] = start;
      start += length;
    }
    a.total_rows[0] = start;
    v.report->total_rows = start;
    __threadfence_system();
  }
  __syncthreads();
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    long long base = s_padded[e];
    a.expert_start[e] = static_cast<int32_t>(base);
    for (int r = 0; r < R; ++r) {
      a.row_base[r * L + e] = static_cast<int32_t>(base);
      base += counts_slot(v, v.rank, seq, r)[e];
    }
  }
}

}  // namespace

void launch_notify(const Buffer& buffer, const NotifyArgs& args, uintptr_t stream) {
  EP_CUDA_CHECK(cudaSetDevice(buffer.device()));
  notify_kernel<<<1, kNotifyThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(buffer.view(), args);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep
