// Host side of the send-side layout kernel (csrc/layout.cu): the first stage of a dispatch, run
// before the count exchange. It needs no communication buffer: only this rank's routing.
// Pointers are device addresses (torch data_ptr() ints), the stream a cudaStream_t int.
#pragma once

#include <cstdint>

#include "ep/limits.h"  // kMaxRanks, kMaxLocalExperts
#include "ep/transport.h"  // SymmetricBuffer, ExchangeArgs (the fused prologue)

namespace ep {

// Routing in one of two forms (E = num_ranks * num_local_experts; expert e lives on rank e / L):
//   topk == 0: routing_map [T, E] bool (nonzero = chosen); topk_idx and probs unused.
//   topk >= 1: topk_idx [T, topk] int64 (-1 = none; any other id outside [0, E) is dropped and
//              flagged in input_flags) + optional probs [T, topk] fp32, scattered into dense_probs.
// A token that names an expert twice in its top-k chose it once (flagged); its dense prob is the
// one of the last (highest k) duplicate.
// Every output element is written (no zero-fill needed); T may be 0.
// Input flags of the top-k form (bits of input_flags[p]); the count exchange sends them to every rank.
constexpr int kInputIdOutOfRange = 1;  // some id was < -1 or >= E (every p's flags carry it)
constexpr int kInputIdRepeated = 2;    // some token named one of rank p's experts twice
// Set by the host (ExchangeArgs::host_input_flags), not the layout: the rank refused its own input for
// more tokens than its buffer holds, and runs the op with none, so that every rank refuses it together.
constexpr int kInputTooManyTokens = 4;

struct LayoutArgs {
  const uint8_t* routing_map;  // [T, E] or null (top-k form)
  const int64_t* topk_idx;     // [T, K] or null (routing-map form)
  const float* probs;          // [T, K] or null; read only when dense_probs is set
  int num_tokens;              // T >= 0
  int num_ranks;               // R in [1, kMaxRanks]
  int num_local_experts;       // L in [1, kMaxLocalExperts]
  int topk;                    // K (0 = routing-map form)
  int32_t* k_index;            // out [T, E]: tokens t' < t that chose e, when t chose e; else -1
  int32_t* expert_counts;      // out [E]: tokens that chose each expert
  int32_t* send_slot;          // out [T, R]: tokens t' < t sent to p, when t goes to p; else -1
  int32_t* rank_counts;        // out [R]: tokens sent to each rank
  float* dense_probs;          // out [T, E] or null: top-k probs at their expert's column, else 0
  int32_t* input_flags;        // out [R] or null (top-k form): kInputId* bits per destination rank
  int32_t* flags_since_checked;  // in/out [1] or null: every launch ORs its input flags into it, so that
                                 // the host sees those of every dispatch since it last cleared the word
  int max_blocks;              // grid cap: the rank's SM budget (num_sms), so that ranks sharing a
                               // GPU keep the SMs their spin-waiting kernels count on
};

// One kernel launch on `stream` (no host sync, no allocation: capturable in a CUDA graph).
// Throws std::invalid_argument on inconsistent arguments (before launching anything).
void launch_layout(const LayoutArgs& args, int device, uintptr_t stream);

// The layout and the count exchange of a first dispatch in one launch (one launch boundary and one
// host launch less than launch_layout + launch_exchange): the layout grid as above, and the last
// of its blocks to finish (a counter in the rank's state) runs the exchange with `exchange`, whose
// count inputs must be this launch's outputs (expert_counts, rank_counts, input_flags). The device
// is the buffer's. Checks both argument sets first (std::invalid_argument).
void launch_layout_exchange(const SymmetricBuffer& buffer, const LayoutArgs& args, const ExchangeArgs& exchange,
                            uintptr_t stream);

}  // namespace ep
