// The op prologue both backends share: handshake, and for a first dispatch the count exchange.
//
// Data flow: one block. Thread 0 advances the rank's op sequence number n (device-resident, so
// graph replays advance it too). For a dispatch, the block first writes this rank's count words
// for destination p into p's counts slot [n % 2][this rank]; then the handshake publishes the op
// fingerprint and arrive = n into every rank p (release, system scope) and waits for every
// rank's arrival at n in the own buffer (acquire), comparing fingerprints. Having arrived, a rank
// has finished every earlier kernel on its stream, so its receive regions are free for op n and it
// no longer reads peers' staged tokens: the data kernels that follow write into peers (and into
// the own regions) without further checks. With counts, the block then derives this rank's
// receive layout: per local expert a segment padded to pad_multiple, and within it the rows of
// source 0, 1, ... in that order; the totals also go to the host mailbox (blocking mode reads them
// after an event wait), with every rank's input flags (pushed with the counts): the host refuses a
// dispatch that any rank flagged, on every rank alike. With W >= L + 4 the count words also carry
// each rank's receive budget and pad_multiple, and (when asked) the block derives peer_row_base:
// where this rank's tokens land in every peer's output, from the counts every rank wrote into
// that peer's buffer (visible here: each rank wrote them before publishing its arrival, which
// this rank has seen).
//
// Waits on: arrive[p] for every rank p (timeout or fingerprint mismatch -> report + abort).
#include <cuda_runtime.h>

#include "ep/check.cuh"
#include "ep/sync.cuh"
#include "ep/transport.h"

namespace ep {
namespace {

constexpr int kExchangeThreads = 256;

// Block-cooperative, after the handshake: out[p][j] = the row at rank p of this rank's first token
// of p's local expert j, by p's own rule (segments in expert order, each padded to p's
// pad_multiple; within one, sources in rank order), and out[p][L] = p's receive budget. Warp w
// takes ranks p = w, w + warps, ...; its lanes take experts and scan the padded lengths.
__device__ void peer_row_bases(const TransportView& t, unsigned long long seq, int L, int32_t* out) {
  const int R = t.num_ranks;
  const int lane = threadIdx.x % 32;
  for (int p = threadIdx.x / 32; p < R; p += blockDim.x / 32) {
    const int32_t* from_p = counts_slot(t, t.rank, seq, p);  // p's own budget and pad_multiple
    const int pad = from_p[L + 3];
    int32_t* row = out + static_cast<int64_t>(p) * (L + 1);
    int segment_start = 0;  // rows of p's experts before this group of 32
    for (int j0 = 0; j0 < L; j0 += 32) {
      const int j = j0 + lane;
      int total = 0, before_me = 0;
      if (j < L) {
#pragma unroll 4
        for (int r = 0; r < R; ++r) {
          const int count = counts_slot(t, p, seq, r)[j];  // rank r's tokens for (p, j), in p's buffer
          total += count;
          if (r < t.rank) before_me += count;
        }
      }
      const int padded = (total + pad - 1) / pad * pad;
      int inclusive = padded;  // prefix sum of the padded lengths over the lanes
#pragma unroll
      for (int offset = 1; offset < 32; offset *= 2) {
        const int from_below = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += from_below;
      }
      if (j < L) row[j] = segment_start + inclusive - padded + before_me;
      segment_start += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    if (lane == 0) row[L] = from_p[L + 2];
  }
}

__global__ void __launch_bounds__(kExchangeThreads) exchange_kernel(TransportView t, ExchangeArgs a) {
  __shared__ unsigned long long s_seq;
  __shared__ int s_failed;
  const int R = t.num_ranks;
  const int L = a.num_local_experts;
  if (threadIdx.x == 0) {
    s_failed = aborted(t) ? 1 : 0;
    s_seq = current_seq(t) + 1;
    t.state->seq = s_seq;
  }
  __syncthreads();
  if (s_failed) return;
  const unsigned long long seq = s_seq;

  // Words per destination: L expert counts, packets, flags (+ budget and pad_multiple, if room).
  const int words = t.sync.count_words >= count_words_with_budget(L) ? count_words_with_budget(L) : L + 2;
  if (a.expert_counts != nullptr) {
    int flags = 0;
    if (a.input_flags != nullptr) {
      for (int p = 0; p < R; ++p) flags |= a.input_flags[p];
    }
    const int budget = static_cast<int>(a.receive_budget < kUnboundedRows ? a.receive_budget : kUnboundedRows);
    for (int i = threadIdx.x; i < R * words; i += blockDim.x) {
      const int p = i / words, j = i % words;
      const int word = j < L ? a.expert_counts[p * L + j]
                       : j == L ? a.rank_counts[p]
                       : j == L + 1 ? flags
                       : j == L + 2 ? budget
                                    : a.pad_multiple;
      counts_slot(t, p, seq, t.rank)[j] = word;
    }
  }
  __syncthreads();
  if (!handshake(t, seq, a.fingerprint, a.phase) || a.expert_counts == nullptr) return;
  if (a.peer_row_base != nullptr) peer_row_bases(t, seq, L, a.peer_row_base);

  // Receive layout: segment of local expert e = [expert_start[e], + tokens_per_expert[e]); within
  // it, sources in rank order, each source's tokens in token order (the sender's k index).
  __shared__ long long s_padded[kMaxLocalExperts];
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    long long real = 0;
    for (int r = 0; r < R; ++r) real += counts_slot(t, t.rank, seq, r)[e];
    const long long padded = (real + a.pad_multiple - 1) / a.pad_multiple * a.pad_multiple;
    a.real_per_expert[e] = real;
    a.tokens_per_expert[e] = padded;
    t.report->mailbox[kMailboxExpertRows + e] = padded;
    s_padded[e] = padded;
  }
  for (int r = threadIdx.x; r < R; r += blockDim.x) a.num_packets[r] = counts_slot(t, t.rank, seq, r)[L];
  __syncthreads();
  if (threadIdx.x == 0) {  // L <= 256 and R <= 32: serial scans are cheap next to the handshake
    long long start = 0;
    for (int e = 0; e < L; ++e) {
      const long long length = s_padded[e];
      s_padded[e] = start;
      start += length;
    }
    long long packets = 0;
    for (int r = 0; r < R; ++r) packets += counts_slot(t, t.rank, seq, r)[L];
    long long flags = 0, flagged_ranks = 0;
    for (int r = 0; r < R; ++r) {
      const int from_r = counts_slot(t, t.rank, seq, r)[L + 1];
      flags |= from_r;
      if (from_r != 0) flagged_ranks |= 1ll << r;
    }
    a.total_rows[0] = start;
    if (a.total_packets != nullptr) a.total_packets[0] = packets;
    t.report->mailbox[kMailboxTotalRows] = start;
    t.report->mailbox[kMailboxTotalPackets] = packets;
    t.report->mailbox[kMailboxInputFlags] = flags;
    t.report->mailbox[kMailboxFlaggedRanks] = flagged_ranks;
    __threadfence_system();
  }
  __syncthreads();
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    long long base = s_padded[e];
    a.expert_start[e] = static_cast<int32_t>(base);
    for (int r = 0; r < R; ++r) {
      a.row_base[r * L + e] = static_cast<int32_t>(base);
      base += counts_slot(t, t.rank, seq, r)[e];
    }
  }
}

}  // namespace

void launch_exchange(const SymmetricBuffer& buffer, const ExchangeArgs& args, uintptr_t stream) {
  if (args.expert_counts != nullptr) {
    const int L = args.num_local_experts;
    if (L < 1 || L > kMaxLocalExperts || L + 2 > buffer.view().sync.count_words)
      throw std::invalid_argument("ep_plugin: exchange: num_local_experts out of range for this buffer");
    if (args.pad_multiple < 1) throw std::invalid_argument("ep_plugin: exchange: pad_multiple must be >= 1");
    if (args.peer_row_base && buffer.view().sync.count_words < count_words_with_budget(L))
      throw std::invalid_argument("ep_plugin: exchange: peer_row_base needs count words for the budget");
    if (!args.rank_counts || !args.row_base || !args.expert_start || !args.tokens_per_expert ||
        !args.real_per_expert || !args.num_packets || !args.total_rows)
      throw std::invalid_argument("ep_plugin: exchange: a count output is missing");
  }
  EP_CUDA_CHECK(cudaSetDevice(buffer.device()));
  exchange_kernel<<<1, kExchangeThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(buffer.view(), args);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep
