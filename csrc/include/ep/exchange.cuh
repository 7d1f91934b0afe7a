// The op prologue's device side, block-cooperative: handshake, and with counts the count exchange
// and the receive layout. One block runs it: the exchange kernel (csrc/exchange.cu, its own launch)
// or the last block of the layout kernel to finish (csrc/layout.cu, the fused prologue of a first
// dispatch). Any block size that is a multiple of 32; every thread of the block must call it.
// See csrc/exchange.cu for the data flow.
#pragma once

#include <cuda_runtime.h>

#include "ep/sync.cuh"
#include "ep/transport.h"

namespace ep {

// Block-cooperative, after the handshake: out[p][j] = the row at rank p of this rank's first token
// of p's local expert j, by p's own rule (segments in expert order, each padded to p's
// pad_multiple; within one, sources in rank order), and out[p][L] = p's receive budget. Warp w
// takes ranks p = w, w + warps, ...; its lanes take experts and scan the padded lengths.
__device__ __forceinline__ void peer_row_bases(const TransportView& t, unsigned long long seq, int L, int32_t* out) {
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

// The whole prologue (see csrc/exchange.cu). The layout's outputs (counts, flags) are read past L1:
// in the fused prologue other blocks of the same launch wrote them.
__device__ __forceinline__ void exchange_block(const TransportView& t, const ExchangeArgs& a) {
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
    int flags = a.host_input_flags;
    if (a.input_flags != nullptr) {
      for (int p = 0; p < R; ++p) flags |= __ldcg(a.input_flags + p);
    }
    const int budget = static_cast<int>(a.receive_budget < kUnboundedRows ? a.receive_budget : kUnboundedRows);
    for (int i = threadIdx.x; i < R * words; i += blockDim.x) {
      const int p = i / words, j = i % words;
      const int word = j < L ? __ldcg(a.expert_counts + p * L + j)
                       : j == L ? __ldcg(a.rank_counts + p)
                       : j == L + 1 ? flags
                       : j == L + 2 ? budget
                                    : a.pad_multiple;
      counts_slot(t, p, seq, t.rank)[j] = word;
    }
  } else if (a.publish_op_word) {
    for (int p = threadIdx.x; p < R; p += blockDim.x) counts_slot(t, p, seq, t.rank)[0] = a.op_word;
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

}  // namespace ep
