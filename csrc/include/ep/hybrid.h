// Host side of the hybrid kernels: the Buffer (transport) and the launchers, one per stage.
// Pointers are device addresses (torch data_ptr() ints), streams are cudaStream_t ints.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ep/buffer.h"

namespace ep {

// One rank's communication buffer, its IPC handle, the opened peer buffers and the
// device-resident state. Built once per backend; never reallocated.
class Buffer {
 public:
  Buffer(int device, int rank, int num_ranks, int max_tokens, int hidden, int num_local_experts, int max_blocks,
         double timeout_s);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // 64 bytes of cudaIpcMemHandle_t, to all_gather over the process group.
  std::string ipc_handle() const;
  // Open every peer's handle (handles[rank] is ignored: the own buffer is used directly) and
  // upload the peer pointer table. Called once, after the exchange.
  void open_peers(const std::vector<std::string>& handles);
  // Release everything (idempotent). Peers must not touch this buffer afterwards.
  void destroy();

  // The timeout report, if a device wait timed out: (rank, phase, peer, expected, seen, waited_ns);
  // flag 0 = none. Reads mapped host memory only: no CUDA call, no sync.
  std::vector<long long> timeout_report() const;
  long long host_total_rows() const { return report_->total_rows; }
  void set_timeout(double timeout_s);

  const DeviceView& view() const { return view_; }
  int device() const { return device_; }
  // Whether the GPU has bulk (TMA) copies (sm_90+; the build then holds sm_90 code for it).
  bool bulk_capable() const { return bulk_capable_; }
  int64_t total_bytes() const { return view_.layout.total_bytes; }

 private:
  int device_;
  bool bulk_capable_ = false;
  bool destroyed_ = false;
  char* local_ = nullptr;
  char** peer_table_ = nullptr;  // device
  std::vector<char*> opened_;    // host copies of opened peer pointers (to close)
  RankState* state_ = nullptr;
  TimeoutReport* report_ = nullptr;  // host pointer of mapped pinned memory
  DeviceView view_{};
};

// Stage 1 (every op): advance the op sequence number, tell every peer we arrived, wait for all.
// For a dispatch, also push this rank's per-(destination, local expert) counts and packet counts
// ahead of the arrival and derive the receive layout from the counts received.
struct NotifyArgs {
  int phase;
  const int32_t* expert_counts;  // [E] tokens this rank sends to each expert, or null (no counts)
  const int32_t* rank_counts;    // [R] packets this rank sends to each rank
  int pad_multiple;
  int32_t* row_base;          // out [R, L]: first output row of (source r, local expert)
  int32_t* expert_start;      // out [L]: first row of each local expert's segment
  int64_t* tokens_per_expert; // out [L]: padded segment lengths
  int64_t* real_per_expert;   // out [L]: before padding
  int32_t* num_packets;       // out [R]: packets received from each source
  int64_t* total_rows;        // out [1]: sum of padded lengths (also written to the host report)
};
void launch_notify(const Buffer& buffer, const NotifyArgs& args, uintptr_t stream);

// Stage 2: push each token once per destination rank (payload, and for a first dispatch its
// per-local-expert row index and prob); then signal per block.
struct SendArgs {
  const void* hidden;        // [T, row_bytes]
  int64_t row_bytes;         // bf16: 2H; fp8: H
  const float* scales;       // fp8 only: [T, H/128]
  int64_t scale_bytes;       // fp8 only: H/128 * 4
  const int32_t* send_slot;  // [T, R]: packet slot at each destination, -1 = not sent
  const int32_t* k_index;    // [T, E]: index of the token within (this rank, expert), -1; null = payload only
  const float* probs;        // [T, E] or null
  int num_tokens;
  int bulk_copy;             // 1: bulk (TMA) copies where the GPU has them; 0: register copies
};
void launch_dispatch_send(const Buffer& buffer, const SendArgs& args, int num_blocks, uintptr_t stream);

// Stage 3: wait for every source, expand packets into expert-sorted padded rows.
struct PermuteArgs {
  void* out;                  // [budget, row_bytes]
  int64_t row_bytes;
  float* out_scales;          // fp8 only: [budget, H/128]
  int64_t scale_bytes;
  float* out_probs;           // [budget] or null
  int64_t budget;
  const int32_t* row_base;    // [R, L]
  const int32_t* expert_start;        // [L]
  const int64_t* tokens_per_expert;   // [L]
  const int64_t* real_per_expert;     // [L]
  const int32_t* num_packets;         // [R]
  const int64_t* total_rows;          // [1]
  int32_t* packet_rows;       // [R * max_tokens, L]: written (first dispatch) or read (dispatch again)
  int use_cached_rows;
  int32_t* overflow;          // [1]: set when a row falls past the budget
  int bulk_copy;              // as in SendArgs
};
void launch_permute(const Buffer& buffer, const PermuteArgs& args, int num_blocks, uintptr_t stream);

// Stage 4 (expert side): sum each packet's rows (fp32), push one bf16 row per packet back to its
// source, with per-row scalars unsummed when asked.
struct CombineSendArgs {
  const void* rows;           // [budget, H] bf16
  const float* row_probs;     // [budget] or null
  const int32_t* packet_rows; // [R * max_tokens, L]
  const int32_t* num_packets; // [R]
  int64_t budget;
};
void launch_combine_send(const Buffer& buffer, const CombineSendArgs& args, int num_blocks, uintptr_t stream);

// Stage 5 (source side): wait for every expert rank, sum the returned rows per token (fp32).
struct CombineRecvArgs {
  void* out;                  // [T, H] bf16
  float* out_probs;           // [T, E] (zero-filled by the caller) or null
  const int32_t* send_slot;   // [T, R]
  const int32_t* k_index;     // [T, E]
  int num_tokens;
};
void launch_combine_recv(const Buffer& buffer, const CombineRecvArgs& args, int num_blocks, uintptr_t stream);

}  // namespace ep
