// Device primitives of the transport: system-scope flags, waits with a timeout that report
// instead of hanging, the op handshake with its fingerprint check, per-block completion flags,
// and addressing of the symmetric buffers. Backend kernels compose these; none knows a backend.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ep/transport.h"

namespace ep {

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool aborted(const TransportView& t) {
  return *reinterpret_cast<volatile int*>(&t.state->abort) != 0;
}

// The same answer for every thread of the block (so that none is left at a __syncthreads).
__device__ __forceinline__ bool block_aborted(const TransportView& t) {
  __shared__ int s_aborted;
  if (threadIdx.x == 0) s_aborted = aborted(t) ? 1 : 0;
  __syncthreads();
  return s_aborted != 0;
}

// The first failure on this rank sets the sticky abort flag and writes the report; later waits
// of this rank see the flag and give up at once.
__device__ __forceinline__ void report_failure(const TransportView& t, int kind, int phase, int peer,
                                               unsigned long long expected, unsigned long long seen,
                                               unsigned long long waited) {
  if (atomicCAS(&t.state->abort, 0, 1) == 0) {
    t.report->rank = t.rank;
    t.report->phase = phase;
    t.report->peer = peer;
    t.report->expected = expected;
    t.report->seen = seen;
    t.report->waited_ns = waited;
    __threadfence_system();
    t.report->kind = kind;
    __threadfence_system();
  }
}

// Spin until *flag >= expected. Returns false (after reporting) on timeout, when the host found
// the process of `peer` gone, or when another wait of this rank already failed.
static __device__ __noinline__ bool wait_flag(const TransportView& t, const unsigned long long* flag,
                                              unsigned long long expected, int phase, int peer) {
  const unsigned long long start = global_timer_ns();
  for (unsigned iteration = 1;; ++iteration) {
    const unsigned long long seen = ld_acquire_sys(flag);
    if (seen >= expected) return true;
    if ((iteration & 255) == 0) {
      if (aborted(t)) return false;
      const unsigned long long waited = global_timer_ns() - start;
      // A read of mapped host memory (~1 us over PCIe), once per 256 polls of the flag.
      if (peer >= 0 && peer < kMaxRanks && t.report->exited[peer]) {
        report_failure(t, kReportPeerExited, phase, peer, expected, seen, waited);
        return false;
      }
      if (waited > t.timeout_ns) {
        report_failure(t, kReportTimeout, phase, peer, expected, seen, waited);
        return false;
      }
    }
  }
}

// Sequence number of the op in flight (advanced by the op's first kernel).
__device__ __forceinline__ unsigned long long current_seq(const TransportView& t) {
  return *reinterpret_cast<volatile unsigned long long*>(&t.state->seq);
}

// ---- addressing -----------------------------------------------------------------------------

__device__ __forceinline__ char* buffer_of(const TransportView& t, int rank) {
  return rank == t.rank ? t.local : t.peers[rank];
}
// Byte `offset` of the backend regions in `rank`'s buffer.
__device__ __forceinline__ char* backend_region(const TransportView& t, int rank, int64_t offset) {
  return buffer_of(t, rank) + t.sync.bytes + offset;
}
__device__ __forceinline__ unsigned long long* arrive_flags(const TransportView& t, int owner) {
  return reinterpret_cast<unsigned long long*>(buffer_of(t, owner) + t.sync.off_arrive);
}
__device__ __forceinline__ unsigned long long* fingerprint_slot(const TransportView& t, int owner,
                                                                unsigned long long seq, int source) {
  return reinterpret_cast<unsigned long long*>(buffer_of(t, owner) + t.sync.off_fingerprint) +
         static_cast<int64_t>(seq & 1) * t.num_ranks + source;
}
__device__ __forceinline__ int32_t* counts_slot(const TransportView& t, int owner, unsigned long long seq,
                                                int source) {
  return reinterpret_cast<int32_t*>(buffer_of(t, owner) + t.sync.off_counts) +
         (static_cast<int64_t>(seq & 1) * t.num_ranks + source) * t.sync.count_words;
}

// The word rank `peer` published with its arrival at op seq (ExchangeArgs::op_word), in this rank's
// buffer; valid once this rank's handshake of op seq has seen that arrival (a later kernel of the op).
__device__ __forceinline__ int32_t op_word(const TransportView& t, unsigned long long seq, int peer) {
  return *reinterpret_cast<volatile int32_t*>(counts_slot(t, t.rank, seq, peer));
}

// ---- the op handshake -------------------------------------------------------------------------

// Block-cooperative, every thread of one block: publish (fingerprint, arrival of op seq) to every
// rank, wait until every rank arrived at op seq, and compare their fingerprints with ours. Count
// words written into peers before this call are visible to them once they see our arrival.
// Returns false on timeout, mismatch or abort (reported; the caller must write nothing more).
//
// Why parity slots suffice: a rank can run ahead to op seq + 1 only after every rank arrived at
// seq, and to seq + 2 only after every rank finished seq's handshake, i.e. read slot seq & 1.
__device__ __forceinline__ bool handshake(const TransportView& t, unsigned long long seq,
                                          unsigned long long fingerprint, int phase) {
  __shared__ int s_failed;
  if (threadIdx.x == 0) s_failed = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < t.num_ranks; p += blockDim.x) {
    *fingerprint_slot(t, p, seq, t.rank) = fingerprint;
    __threadfence_system();
    st_release_sys(arrive_flags(t, p) + t.rank, seq);
  }
  for (int p = threadIdx.x; p < t.num_ranks; p += blockDim.x) {
    if (!wait_flag(t, arrive_flags(t, t.rank) + p, seq, phase, p)) {
      s_failed = 1;
      continue;
    }
    const unsigned long long theirs =
        *reinterpret_cast<volatile unsigned long long*>(fingerprint_slot(t, t.rank, seq, p));
    if (theirs != fingerprint) {
      report_failure(t, kReportMismatch, phase, p, fingerprint, theirs, 0);
      s_failed = 1;
    }
  }
  __syncthreads();
  return s_failed == 0;
}

// ---- per-block completion flags -----------------------------------------------------------------
//
// A backend region of u64 [R][max_blocks]: flags[source][block] = the last op for which block
// `block` of rank `source` finished writing into the owner (or finished with what the owner reads
// from it).

struct DoneFlags {
  int64_t offset;  // within the backend regions
  int max_blocks;
};

__device__ __forceinline__ unsigned long long* done_flag(const TransportView& t, const DoneFlags& f, int owner,
                                                         int source, int block) {
  return reinterpret_cast<unsigned long long*>(backend_region(t, owner, f.offset)) +
         static_cast<int64_t>(source) * f.max_blocks + block;
}

// Called by every thread of a block after its last store of this op's data: each of the first R
// threads publishes "block b of this rank is done for op seq" to one rank.
__device__ __forceinline__ void signal_block_done(const TransportView& t, const DoneFlags& f,
                                                  unsigned long long seq) {
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < t.num_ranks) {
    __threadfence_system();
    st_release_sys(done_flag(t, f, threadIdx.x, t.rank, blockIdx.x), seq);
  }
}

// Wait until every block (of `num_blocks`) of every rank in `sources` (a bit per rank; default all)
// signalled op seq. Returns false on timeout/abort (then the caller must write nothing).
__device__ __forceinline__ bool wait_all_blocks(const TransportView& t, const DoneFlags& f, unsigned long long seq,
                                                int num_blocks, int phase, unsigned sources = 0xffffffffu) {
  __shared__ int s_failed;
  if (threadIdx.x == 0) s_failed = 0;
  __syncthreads();
  const int total = t.num_ranks * num_blocks;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int source = i / num_blocks;
    if (!(sources >> source & 1u)) continue;
    if (!wait_flag(t, done_flag(t, f, t.rank, source, i % num_blocks), seq, phase, source)) s_failed = 1;
  }
  __syncthreads();
  return s_failed == 0;
}

}  // namespace ep
