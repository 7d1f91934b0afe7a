// The per-rank communication buffer shared over CUDA IPC, and the view of it that kernels get.
//
// One cudaMalloc per rank holds every region peers write into or read from (all worst-case
// sized, so no flow control is needed: data lands in place). Offsets are the same on every rank,
// so a rank addresses a peer's region as peer_base[p] + offset. Dispatch payloads are pulled:
// the owner stages its tokens in disp_stage and every receiver reads them from there; the small
// per-packet parts (token, k indices, probs) and all combine data are pushed by the sender.
//
//   arrive      u64 [R]                 arrive[r] = sequence number of the op rank r entered
//   counts      i32 [2][R][L+1]         per op parity, from source r: L per-expert counts, packets
//   disp_done   u64 [R][max_blocks]     dispatch data from (r, block b) complete for op n
//   comb_done   u64 [R][max_blocks]     combine data from (r, block b) complete for op n
//   disp_stage  [max_tokens][slot]      the owner's tokens of the op in flight: payload (+fp8 scales)
//   disp_token  i32 [R][max_tokens]     from source r: the token (its disp_stage row) of send slot s
//   disp_k      i32 [R][max_tokens][L]  row of the packet within (r, local expert), -1 = not routed
//   disp_p      f32 [R][max_tokens][L]  prob of (token, local expert)
//   comb_data   bf16 [R][max_tokens][H] from expert rank r: the sum of its rows for send slot s
//   comb_p      f32 [R][max_tokens][L]  from expert rank r: per-row scalars (backward of probs)
#pragma once

#include <cstdint>

namespace ep {

constexpr int kMaxRanks = 32;        // a warp's lanes hold one destination rank each
constexpr int kMaxLocalExperts = 256;  // combine stages a packet's rows in shared memory
constexpr int kThreads = 512;          // threads per block of the data kernels

// Phases named in timeout reports (ep_plugin/backends/hybrid.py has the names).
enum Phase : int {
  kPhaseDispatchNotify = 1,
  kPhaseCombineHandshake = 2,
  kPhaseDispatchAgainHandshake = 3,
  kPhaseDispatchReceive = 4,
  kPhaseCombineReceive = 5,
};

struct BufferLayout {
  int num_ranks;
  int max_tokens;
  int num_local_experts;
  int max_blocks;
  int hidden;          // elements per row
  int64_t slot_bytes;  // bytes per staged token (2 * hidden: bf16, or fp8 + scales)
  int64_t off_arrive, off_counts, off_disp_done, off_comb_done;
  int64_t off_disp_stage, off_disp_token, off_disp_k, off_disp_p, off_comb_data, off_comb_p;
  int64_t total_bytes;
};

// Written by a device wait that timed out, read by the host (mapped pinned memory owned by
// the Buffer). `flag` is set last.
struct TimeoutReport {
  volatile int flag;
  int rank;
  int phase;
  int peer;
  unsigned long long expected;
  unsigned long long seen;
  unsigned long long waited_ns;
  // Not part of the report: blocking dispatch's exact output size, written by the notify kernel.
  volatile long long total_rows;
};

// Rank-private device state: the op sequence number every kernel reads (advanced on the device,
// so CUDA-graph replays move forward by themselves) and the sticky abort flag.
struct RankState {
  unsigned long long seq;
  int abort;
};

// What every kernel receives, by value.
struct DeviceView {
  BufferLayout layout;
  int rank;
  char* local;             // this rank's buffer
  char* const* peers;      // device array [R]: every rank's buffer (own one included)
  RankState* state;
  TimeoutReport* report;   // device alias of mapped host memory
  unsigned long long timeout_ns;
};

}  // namespace ep
