// Host side of the hybrid backend: its region layout on the shared transport, and one launcher
// per stage. Pointers are device addresses, streams cudaStream_t handles (both as integers from
// Python); every argument struct is filled by name from Python (see bindings.cpp).
#pragma once

#include <cstdint>

#include "ep/transport.h"

namespace ep {
namespace hybrid {

// The hybrid regions, after the transport's sync header (offsets relative to it, equal on every
// rank). Dispatch payloads are pulled: the owner stages its tokens in disp_stage and every
// receiver reads them from there; the small per-packet parts (token, k indices, probs) and all
// combine data are pushed by the sender.
//
//   disp_done   u64 [R][max_blocks]     dispatch data from (r, block b) complete for op n
//   comb_done   u64 [R][max_blocks]     combine data from (r, block b) complete for op n
//   disp_stage  [max_tokens][slot]      the owner's tokens of the op in flight: payload (+fp8 scales)
//   disp_token  i32 [R][max_tokens]     from source r: the token (its disp_stage row) of send slot s
//   disp_k      i32 [R][max_tokens][L]  row of the packet within (r, local expert), -1 = not routed
//   disp_p      f32 [R][max_tokens][L]  prob of (token, local expert)
//   comb_data   bf16 [R][max_tokens][H] from expert rank r: the sum of its rows for send slot s
//   comb_p      f32 [R][max_tokens][L]  from expert rank r: per-row scalars (backward of probs)
//   comb_input  [combine_input_bytes]   the combine-input arena: torch allocates expert outputs here
//
// comb_input exists only in a buffer built with combine_input_bytes > 0. A rank whose combine input
// (its expert output rows, in the dispatch output's row order) lies anywhere in it tells the peers
// where with its arrival at the combine (the op word: the byte offset / 16), and the sources read
// the rows where they are, summing a token's rows in one pass (no expert-side partial sums, no
// comb_data). A rank whose input lies elsewhere says kCombinePushed and pushes partial sums instead.
struct Regions {
  int num_ranks;
  int max_tokens;
  int num_local_experts;
  int max_blocks;
  int hidden;          // elements per row
  int64_t slot_bytes;  // bytes per staged token (2 * hidden: bf16, or fp8 + scales)
  int64_t off_disp_done, off_comb_done;
  int64_t off_disp_stage, off_disp_token, off_disp_k, off_disp_p, off_comb_data, off_comb_p;
  int64_t combine_input_bytes;  // bytes of comb_input (0: no in-place combine)
  int64_t off_comb_input;
  int64_t total_bytes;
  // Count words per (source, op) in the transport's exchange: L expert counts, the packet count,
  // the source's input flags, its receive budget and pad_multiple (for in-place combines).
  int count_words() const { return count_words_with_budget(num_local_experts); }
};
// Throws std::invalid_argument on sizes the kernels do not support.
Regions make_regions(int num_ranks, int max_tokens, int hidden, int num_local_experts, int max_blocks,
                     int64_t combine_input_bytes);

// Phases named in timeout reports (the Python backend has their names).
enum Phase : int {
  kPhaseDispatchNotify = 1,
  kPhaseCombineHandshake = 2,
  kPhaseDispatchAgainHandshake = 3,
  kPhaseDispatchReceive = 4,
  kPhaseCombineReceive = 5,
  kPhaseBarrier = 6,
};

// Stage 2 (after the transport's exchange): stage each token once for its destinations to pull,
// and push each destination the token index, and for a first dispatch its per-local-expert k index
// and prob; then signal per block.
struct SendArgs {
  const void* hidden = nullptr;         // [T, row_bytes]
  int64_t row_bytes = 0;                // bf16: 2H; fp8: H
  const float* scales = nullptr;        // fp8 only: [T, H/128]
  int64_t scale_bytes = 0;              // fp8 only: H/128 * 4
  const int32_t* send_slot = nullptr;   // [T, R]: packet slot at each destination, -1 = not sent
  const int32_t* k_index = nullptr;     // [T, E]: index of the token within (this rank, expert), -1; null = payload only
  const float* probs = nullptr;         // [T, E] or null
  int num_tokens = 0;
  bool bulk_copy = true;                // bulk (TMA) copies where the GPU has them; else register copies
  int32_t* overflow = nullptr;          // [1] or null: zeroed here for the permute that follows (no fill launch)
};
void launch_dispatch_send(const SymmetricBuffer& buffer, const Regions& regions, const SendArgs& args,
                          int num_blocks, uintptr_t stream);

// Stage 3: wait for every source, expand packets into expert-sorted padded rows.
struct PermuteArgs {
  void* out = nullptr;                        // [budget, row_bytes]
  int64_t row_bytes = 0;
  float* out_scales = nullptr;                // fp8 only: [budget, H/128]
  int64_t scale_bytes = 0;
  float* out_probs = nullptr;                 // [budget] or null
  int64_t budget = 0;
  const int32_t* row_base = nullptr;          // [R, L]
  const int32_t* expert_start = nullptr;      // [L]
  const int64_t* tokens_per_expert = nullptr; // [L]
  const int64_t* real_per_expert = nullptr;   // [L]
  const int32_t* num_packets = nullptr;       // [R]
  const int64_t* total_rows = nullptr;        // [1]
  int32_t* packet_rows = nullptr;             // [R * max_tokens, L]: written (first dispatch) or read (again)
  bool use_cached_rows = false;               // dispatch again: read packet_rows instead of writing them
  int32_t* overflow = nullptr;                // [1]: set when a row falls past the budget
  bool bulk_copy = true;
};
void launch_permute(const SymmetricBuffer& buffer, const Regions& regions, const PermuteArgs& args, int num_blocks,
                    uintptr_t stream);
// Stages 2 and 3 in one launch (the fused dispatch: a first dispatch whose budget is known before the
// counts, i.e. non-blocking): each block sends its share, then permutes its share. Rows of one size
// in both argument sets.
void launch_dispatch_fused(const SymmetricBuffer& buffer, const Regions& regions, const SendArgs& send,
                           const PermuteArgs& permute, int num_blocks, uintptr_t stream);

// Stage 4 (expert side): sum each packet's rows (fp32), push one bf16 row per packet back to its
// source, with per-row scalars unsummed when asked. rows == null (in place): only the scalars travel.
struct CombineSendArgs {
  const void* rows = nullptr;           // [budget, H] bf16, or null
  const float* row_probs = nullptr;     // [budget] or null
  const int32_t* packet_rows = nullptr; // [R * max_tokens, L]
  const int32_t* num_packets = nullptr; // [R]
  int64_t budget = 0;
};
void launch_combine_send(const SymmetricBuffer& buffer, const Regions& regions, const CombineSendArgs& args,
                         int num_blocks, uintptr_t stream);

// The combine's op word of a rank whose combine input is not in its arena: it pushed partial sums.
constexpr int32_t kCombinePushed = -1;

// Stage 5 (source side): wait for every expert rank, sum the returned rows per token (fp32).
// In place (peer_rows given; every rank published its op word): of a rank p whose input is in its
// arena, read each of the token's expert rows where it is, at byte 16 x word + (peer_rows[p][j] +
// k_index) x 2H of p's comb_input (rows at or past p's budget, peer_rows[p][L], were dropped and
// count as zero); of a rank that pushed (kCombinePushed), its partial sum; add them all in fp32
// (rank order, then local-expert order), rounding once. Waits only for the ranks that ran
// combine_send (those that pushed, or all when scalars travel).
struct CombineRecvArgs {
  void* out = nullptr;                  // [T, H] bf16
  float* out_probs = nullptr;           // [T, E] (zero-filled by the caller) or null
  const int32_t* send_slot = nullptr;   // [T, R]
  const int32_t* k_index = nullptr;     // [T, E]
  int num_tokens = 0;
  const int32_t* peer_rows = nullptr;   // [R, L + 1] (the exchange's peer_row_base) or null: pushed rows
  bool wait_for_send = true;            // without peer_rows: combine_send ran (it signals comb_done)
};
void launch_combine_recv(const SymmetricBuffer& buffer, const Regions& regions, const CombineRecvArgs& args,
                         int num_blocks, uintptr_t stream);

}  // namespace hybrid
}  // namespace ep
