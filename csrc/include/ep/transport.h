// The transport both compiled backends stand on: one symmetric buffer per rank, shared over
// CUDA IPC within an NVLink domain, and the generic sync state every op uses.
//
// A buffer is [sync header | backend regions]. The header is the transport's: the arrival flags
// of the handshake, the op fingerprints published with them and the count-exchange slots. The
// regions after it belong to one backend, which lays them out itself (csrc/<backend>/) and
// addresses them relative to `TransportView::sync.bytes`. The transport knows no backend.
//
// Beside the buffer each rank owns device-resident state (the op sequence number, advanced on the
// device so CUDA-graph replays move forward by themselves, and a sticky abort flag) and a report in
// mapped pinned host memory: what a failed device wait saw (timeout, or ranks that disagree), and
// a mailbox of values that kernels publish for the host (blocking mode's exact sizes).
//
// Handles: today cudaMalloc + cudaIpcMemHandle (one host, several GPUs or several processes per
// GPU). `handle_kind()` names the kind so that a fabric handle (cuMem with
// CU_MEM_HANDLE_TYPE_FABRIC, multi-node NVLink) can be added without changing the backends.
#pragma once

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ep/limits.h"

namespace ep {

// Offsets of the sync header (identical on every rank).
//   arrive       u64 [R]               arrive[r] = sequence number of the op rank r entered
//   fingerprint  u64 [2][R]            per op parity: the op fingerprint rank r entered it with
//   counts       i32 [2][R][W]         per op parity, from source r: W count words (count exchange)
struct SyncLayout {
  int num_ranks;
  int count_words;  // W, declared by the backend (0: no count exchange)
  int64_t off_arrive;
  int64_t off_fingerprint;
  int64_t off_counts;
  int64_t bytes;  // header size (a multiple of 256): backend regions start here
};

// Rank-private device state.
struct RankState {
  unsigned long long seq;  // op sequence number, advanced by each op's first kernel
  int abort;               // sticky: a wait of this rank failed; kernels leave peers untouched
  // Blocks of the fused layout + exchange launch that have finished their layout part; the last
  // one runs the exchange and puts it back to 0 (so every launch and graph replay starts at 0).
  unsigned int layout_blocks_done;
};

// A receive budget that drops nothing (blocking mode: the output has exactly the received rows).
constexpr int64_t kUnboundedRows = 0x7fffffff;

// kReportPeerExited: a wait gave up because the host found the awaited rank's process gone.
enum ReportKind : int { kReportNone = 0, kReportTimeout = 1, kReportMismatch = 2, kReportPeerExited = 3 };

// Mailbox words of the last count exchange: [0] total expert rows (segments padded), [1] total
// packets received, [2] the OR of every rank's input flags (kInputId* of layout.h), [3] a bit per
// rank that sent any, [4 + e] padded rows of local expert e.
constexpr int kMailboxTotalRows = 0;
constexpr int kMailboxTotalPackets = 1;
constexpr int kMailboxInputFlags = 2;
constexpr int kMailboxFlaggedRanks = 3;
constexpr int kMailboxExpertRows = 4;
constexpr int kMailboxWords = 4 + kMaxLocalExperts;

// Mapped pinned host memory owned by the buffer. The first failure on this rank fills the report
// fields, then sets `kind` (last). Timeout and peer exited: expected/seen are the flag values.
// Mismatch: expected is this rank's op fingerprint, seen the peer's.
// `exited` goes the other way: the host sets exited[r] when rank r's process is gone
// (ep_plugin/transport/liveness.py), and a device wait for rank r gives up instead of timing out.
struct DeviceReport {
  volatile int kind;
  int rank;
  int phase;
  int peer;
  unsigned long long expected;
  unsigned long long seen;
  unsigned long long waited_ns;
  volatile long long mailbox[kMailboxWords];
  volatile int exited[kMaxRanks];
};

// What every kernel receives, by value.
struct TransportView {
  int rank;
  int num_ranks;
  char* local;          // this rank's buffer
  char* const* peers;   // device array [R]: every rank's buffer (own one included)
  SyncLayout sync;
  RankState* state;
  DeviceReport* report;  // device alias of the mapped host report
  unsigned long long timeout_ns;
};

// One rank's symmetric buffer, the opened peer buffers and the sync state. Built once per
// backend (a collective in Python: handles are exchanged over the process group); never resized.
class SymmetricBuffer {
 public:
  // region_bytes: what the backend lays out after the header; count_words: W of the header.
  SymmetricBuffer(int device, int rank, int num_ranks, int64_t region_bytes, int count_words, double timeout_s);
  ~SymmetricBuffer();
  SymmetricBuffer(const SymmetricBuffer&) = delete;
  SymmetricBuffer& operator=(const SymmetricBuffer&) = delete;

  // "cuda_ipc" today (64 bytes of cudaIpcMemHandle_t per rank).
  std::string handle_kind() const { return "cuda_ipc"; }
  // This rank's handle, to all_gather over the process group.
  std::string export_handle() const;
  // Open every peer's handle (handles[rank] is ignored: the own buffer is used directly) and
  // upload the peer pointer table. Called once, after the exchange.
  void open_peers(const std::vector<std::string>& handles);
  // Release everything (idempotent; closes the peers' buffers first if close_peers did not; the destructor's
  // path). Peers must not touch this buffer afterwards.
  void destroy();
  // The binding's closing and destroying, each in two halves: the device-wide wait (a cudaError_t, not raised,
  // so that the release still runs), made without the GIL, then the release, with it (no other thread reads
  // the report or the peer table while they go).
  int wait_for_device() const;
  // Close the peers' buffers opened here (idempotent): before any peer frees its buffer, as CUDA IPC asks of
  // an importer (destroy's barrier in Python orders the two). No wait first where no kernel ever ran on the
  // mappings (a refused build): waited = 0.
  void close_peers_after_wait(int waited);
  void destroy_after_wait(int waited);
  bool destroyed() const { return destroyed_; }
  // Marks the buffer destroyed and frees nothing, now or in the destructor: the memory stays allocated and
  // mapped for the life of the process (a peer or a kernel may still use it, or a pool still holds part).
  void abandon() { destroyed_ = true; }

  // (kind, rank, phase, peer, expected, seen, waited_ns); kind 0 = nothing failed. Reads mapped
  // host memory only: no CUDA call, no sync.
  std::vector<long long> report() const;
  // Whether report() holds a failure: what every op checks first (a bool instead of a list).
  bool failed() const { return report_ != nullptr && report_->kind != kReportNone; }
  // Mailbox words [first, first + count) (read after an event wait on the kernel that wrote them).
  std::vector<long long> mailbox(int first, int count) const;
  void set_timeout(double timeout_s);
  // Tell this rank's device waits that rank r's process is gone (host write to the mapped report;
  // a no-op once destroyed). Called from the liveness watch's thread.
  void mark_peer_exited(int r);

  // What every launcher hands its kernels: refused once destroyed or abandoned (Python checks first too).
  const TransportView& view() const {
    if (destroyed_) throw std::runtime_error("ep_plugin: launch on a destroyed buffer");
    return view_;
  }
  int device() const { return device_; }
  // Whether the GPU has bulk (TMA) copies (sm_90+; the build then holds sm_90 code for them).
  bool bulk_capable() const { return bulk_capable_; }
  int64_t total_bytes() const { return total_bytes_; }
  int64_t header_bytes() const { return view_.sync.bytes; }
  // Device address of this rank's backend regions (byte 0 after the header); 0 once destroyed.
  uintptr_t region_address() const {
    return local_ ? reinterpret_cast<uintptr_t>(local_) + static_cast<uintptr_t>(view_.sync.bytes) : 0;
  }
  // The same for rank r's buffer as this process opened it (for measurement tools that write where
  // the kernels do); 0 before open_peers or once destroyed.
  uintptr_t peer_region_address(int r) const;

 private:
  int device_;
  bool bulk_capable_ = false;
  std::atomic<bool> destroyed_{false};  // the binding waits without the GIL: another thread may read it then
  int64_t total_bytes_ = 0;
  char* local_ = nullptr;
  char** peer_table_ = nullptr;  // device
  std::vector<char*> opened_;    // host copies of opened peer pointers (to close)
  std::vector<char*> table_;     // host copy of the peer table (own buffer included)
  RankState* state_ = nullptr;
  DeviceReport* report_ = nullptr;  // host pointer of mapped pinned memory
  TransportView view_{};
};

// The op prologue that both backends share: advance the op sequence number, push this rank's
// count words to every peer (when given), publish arrival + fingerprint, wait for every rank and
// compare fingerprints. With counts, derive the receive layout of expert-grouped rows: for local
// expert e, rows of source r start at row_base[r][e]; each expert's segment is padded to
// pad_multiple. One block; nothing here is backend-specific.
//
// Count words from this rank to destination p: expert_counts[p * L + j] for j < L, then
// rank_counts[p] (packets), then this rank's input flags (the OR over input_flags[0..R) and
// host_input_flags), so
// W = L + 2. Every rank thus learns every rank's flags in the same op, and a blocking dispatch
// that any rank flagged is refused on all of them at the one host read of the counts.
// A backend that declared W >= L + 4 also gets word L + 2 = this rank's receive budget (rows of
// its expert-grouped output; rows at or past it are dropped) and word L + 3 = its pad_multiple:
// with them every rank can derive where its own tokens land in every peer's output
// (peer_row_base), which a combine that reads expert rows in the peers' buffers needs.
struct ExchangeArgs {
  int phase;                            // named in a timeout report
  unsigned long long fingerprint;       // this rank's op fingerprint (equal on every rank)
  const int32_t* expert_counts;         // [R * L] or null: handshake only
  const int32_t* rank_counts;           // [R]
  const int32_t* input_flags;           // [R] or null (none): the layout's flags for each rank
  int32_t host_input_flags = 0;         // kInput* bits the host adds to this rank's flags (kInputTooManyTokens)
  int num_local_experts;                // L
  int pad_multiple;                     // >= 1
  int32_t* row_base;                    // out [R, L]: first row of (source r, local expert e)
  int32_t* expert_start;                // out [L]: first row of each local expert's segment
  int64_t* tokens_per_expert;           // out [L]: padded segment lengths
  int64_t* real_per_expert;             // out [L]: before padding
  int32_t* num_packets;                 // out [R]: packets (tokens) received from each source
  int64_t* total_rows;                  // out [1]: sum of padded lengths (also to the mailbox)
  int64_t* total_packets;               // out [1] or null: sum of num_packets (also to the mailbox)
  int64_t receive_budget = kUnboundedRows;  // rows of this rank's expert-grouped output (W >= L + 4)
  // out [R, L + 1] or null (needs W >= L + 4): for each rank p, columns j < L = the row at p of this
  // rank's first token of p's local expert j (p's row_base[this rank][j]); column L = p's budget.
  int32_t* peer_row_base = nullptr;
  // A handshake without counts may tell every peer one word of this rank's for the op (into the
  // count slot the op does not otherwise use), read there after the handshake with op_word()
  // (ep/sync.cuh): what the peers' kernels of this op need to know of this rank, e.g. where its
  // combine input lies. Needs W >= 1.
  bool publish_op_word = false;
  int32_t op_word = 0;
};
// Count words per (source, op) that carry the budget and pad_multiple too (see ExchangeArgs).
constexpr int count_words_with_budget(int num_local_experts) { return num_local_experts + 4; }
void launch_exchange(const SymmetricBuffer& buffer, const ExchangeArgs& args, uintptr_t stream);
// The checks launch_exchange makes before launching (std::invalid_argument), for launchers that
// run the exchange inside another kernel (launch_layout_exchange, ep/layout.h).
void check_exchange_args(const SymmetricBuffer& buffer, const ExchangeArgs& args);

}  // namespace ep
