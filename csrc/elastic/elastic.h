// Host side of the elastic backend (DeepEP V2 semantics): its region layout on the shared
// transport, and one launcher per stage. Pointers are device addresses, streams cudaStream_t
// handles (both as integers from Python); every argument struct is filled by name from Python.
//
// A dispatch delivers one packet per (token, destination rank). Compact form: the packet is one
// output row, rows ordered by source rank then source token. Expanded form: the packet becomes one
// row per (token, local expert) in expert-grouped segments (each padded to the alignment), in
// (local expert, source rank, source token) order. Payloads are pulled: the source stages each
// token once, receivers read it from there; the per-destination metadata (token index, top-k ids
// as local ids, weights, expanded row offsets) and all combine data are pushed.
#pragma once

#include <cstdint>

#include "ep/transport.h"

namespace ep {
namespace elastic {

constexpr int kMaxTopk = 32;  // one warp lane per top-k slot

// The elastic regions, after the transport's sync header (offsets relative to it, equal on every
// rank). K = max_topk.
//
//   disp_done   u64 [R][max_blocks]     dispatch data from (r, block b) complete for op n
//   comb_done   u64 [R][max_blocks]     combine data from (r, block b) complete for op n
//   stage       [max_tokens][slot]      the owner's tokens of the op in flight: payload (+fp8 scales)
//   recv_token  i32 [R][max_tokens]     from source r: the token (its stage row) of send slot s
//   recv_idx    i32 [R][max_tokens][K]  from source r: the token's top-k ids as local ids, -1 = elsewhere
//   recv_w      f32 [R][max_tokens][K]  from source r: the token's top-k weights (0 = elsewhere)
//   recv_k      i32 [R][max_tokens][K]  from source r: index of the token within (r, local expert)
//   comb_data   bf16 [R][max_tokens][H] from expert rank r: its rows of send slot s, summed
//   comb_w      f32 [R][max_tokens][K]  from expert rank r: per-slot values routed back (weights' grads)
//   recv_rows   [R * max_tokens][2H]    in-place dispatch only: compact rows pushed by the sources
//   recv_scales f32 [R * max_tokens][H/128]  in-place dispatch only: their fp8 scales
//
// recv_rows is the output of a dispatch with in_place (compact form): each source writes its packets
// straight to their rows there, so the payload crosses once and the receive only places metadata.
// comb_data doubles as the combine input handed to the caller (``combine_input``): compact rows
// [R * max_tokens][H] in the dispatch output's row order, which sources then read in place. Nothing
// else writes comb_data in that mode, and the copying mode never reads it as input.
struct Regions {
  int num_ranks;
  int max_tokens;
  int num_local_experts;
  int max_blocks;
  int hidden;          // elements per row
  int max_topk;        // K
  int64_t slot_bytes;  // bytes per staged token (2 * hidden: bf16, or fp8 + scales)
  int64_t off_disp_done, off_comb_done, off_stage, off_recv_token, off_recv_idx, off_recv_w, off_recv_k;
  int64_t off_comb_data, off_comb_w;
  bool in_place_dispatch;  // recv_rows and recv_scales exist (0 bytes otherwise)
  int64_t off_recv_rows, off_recv_scales;
  int64_t total_bytes;
  // Count words per (source, op) in the transport's exchange: L expert counts, the packet count and
  // the source's input flags.
  int count_words() const { return num_local_experts + 2; }
};
// Throws std::invalid_argument on sizes the kernels do not support.
Regions make_regions(int num_ranks, int max_tokens, int hidden, int num_local_experts, int max_blocks, int max_topk,
                     bool in_place_dispatch);

// Phases named in timeout reports (the Python backend has their names).
enum Phase : int {
  kPhaseDispatchExchange = 1,
  kPhaseCombineHandshake = 2,
  kPhaseCachedDispatchHandshake = 3,
  kPhaseDispatchReceive = 4,
  kPhaseCombineReceive = 5,
  kPhaseBarrier = 6,
};

// Stage 2 (after the transport's exchange): stage each token once (or, in place, write it straight
// into each destination's recv_rows); push each destination the token's index, and on a first
// dispatch its top-k ids (as that rank's local ids), weights and (expanded form) per-expert row
// offsets; then signal per block.
struct SendArgs {
  const void* hidden = nullptr;         // [T, row_bytes]
  int64_t row_bytes = 0;                // bf16: 2H; fp8: H
  const float* scales = nullptr;        // fp8 only: [T, H/128]
  int64_t scale_bytes = 0;              // fp8 only: H/128 * 4
  const int32_t* send_slot = nullptr;   // [T, R]: packet slot at each destination, -1 = not sent
  const int64_t* topk_idx = nullptr;    // [T, k] (-1 = none); null: cached dispatch (payload only)
  const float* topk_weights = nullptr;  // [T, k] or null
  const int32_t* k_index = nullptr;     // [T, E] index of the token within (this rank, expert); null: compact
  int32_t* dest_base = nullptr;         // out [R] (first dispatch, compact): this rank's first compact row at each rank
  bool push_payload = false;            // in place: write each packet into its destination's recv_rows (first
                                        // dispatch, compact, regions with in_place_dispatch); else stage it
  int topk = 0;                         // k <= max_topk
  int num_tokens = 0;
  bool bulk_copy = true;                // bulk (TMA) copies where the GPU has them; else register copies
};
void launch_dispatch_send(const SymmetricBuffer& buffer, const Regions& regions, const SendArgs& args,
                          int num_blocks, uintptr_t stream);

// Stage 3: wait for every source, pull each packet into its row (compact) or rows (expanded).
struct ReceiveArgs {
  void* out = nullptr;                        // [capacity, row_bytes]
  int64_t row_bytes = 0;
  float* out_scales = nullptr;                // fp8 only: [capacity, H/128]
  int64_t scale_bytes = 0;
  int64_t capacity = 0;                       // rows of out (rows at or past it are dropped; sized so none is)
  const int32_t* num_packets = nullptr;       // [R]
  int topk = 0;                               // k of the dispatch
  bool expand = false;
  bool cached = false;                        // cached dispatch: rows from packet_rows, no metadata
  // Compact form: one row per packet.
  int64_t* out_topk_idx = nullptr;            // [capacity, k] local ids, -1 = elsewhere (first dispatch)
  float* out_topk_weights = nullptr;          // [capacity, k] or null
  // Expanded form.
  float* out_row_weights = nullptr;           // [capacity] or null: the weight of each (token, expert) row
  const int32_t* row_base = nullptr;          // [R, L]
  const int32_t* expert_start = nullptr;      // [L]
  const int64_t* tokens_per_expert = nullptr; // [L] padded
  const int64_t* real_per_expert = nullptr;   // [L]
  int32_t* packet_rows = nullptr;             // [R * max_tokens, k]: row of each (packet, slot), -1; written or read
  bool payload_pushed = false;                // the sources wrote the payload (in place): place metadata only
  bool zero_padding = false;                  // zero the padding rows of each segment
  bool bulk_copy = true;
};
void launch_dispatch_receive(const SymmetricBuffer& buffer, const Regions& regions, const ReceiveArgs& args,
                             int num_blocks, uintptr_t stream);

// Stage 4 (expert side, after a handshake): for each received packet, its row (compact) or the
// fp32 sum of its rows (expanded), rounded once to bf16, pushed back to the source; per-slot
// values (the weights' gradients) pushed unsummed when given. With rows == null only the values
// travel (the rows are read in place from comb_data by the sources).
struct CombineSendArgs {
  const void* rows = nullptr;                 // [capacity, H] bf16, or null (values only)
  const float* slot_values = nullptr;         // compact: [capacity, k]; expanded: [capacity]; or null
  const int32_t* num_packets = nullptr;       // [R]
  const int32_t* packet_rows = nullptr;       // expanded: [R * max_tokens, k]; null = compact
  int topk = 0;
};
void launch_combine_send(const SymmetricBuffer& buffer, const Regions& regions, const CombineSendArgs& args,
                         int num_blocks, uintptr_t stream);

// Stage 5 (source side): wait for every expert rank, sum each token's returned rows (fp32, rank
// order, plus an optional bias), route the per-slot values back to [T, k]. In place: the rows are
// read from each expert rank's comb_data at dest_base[p] + slot (compact form), and the wait for
// combine_send is skipped when no values travel (the handshake before it is the only sync).
struct CombineRecvArgs {
  void* out = nullptr;                        // [T, H] bf16
  const void* bias = nullptr;                 // [T, H] bf16 or null
  float* out_topk_values = nullptr;           // [T, k] or null
  const int32_t* send_slot = nullptr;         // [T, R]
  const int64_t* topk_idx = nullptr;          // [T, k] (read with out_topk_values)
  int topk = 0;
  int num_tokens = 0;
  const int32_t* dest_base = nullptr;         // [R]: in place (rows in the expert ranks' comb_data); null: pushed
  bool wait_for_send = true;                  // combine_send ran (it signals comb_done)
};
void launch_combine_recv(const SymmetricBuffer& buffer, const Regions& regions, const CombineRecvArgs& args,
                         int num_blocks, uintptr_t stream);

}  // namespace elastic
}  // namespace ep
