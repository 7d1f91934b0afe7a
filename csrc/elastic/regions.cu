// The elastic region layout (see elastic.h): sizes from the backend's shape, offsets equal on
// every rank.
#include <stdexcept>
#include <string>

#include "elastic/elastic.h"
#include "ep/limits.h"

namespace ep {
namespace elastic {
namespace {

int64_t align_up(int64_t value, int64_t alignment) { return (value + alignment - 1) / alignment * alignment; }

}  // namespace

Regions make_regions(int num_ranks, int max_tokens, int hidden, int num_local_experts, int max_blocks,
                     int max_topk) {
  if (num_ranks < 1 || num_ranks > kMaxRanks)
    throw std::invalid_argument("ep_plugin elastic: num_ranks must be in [1, " + std::to_string(kMaxRanks) + "]");
  if (num_local_experts < 1 || num_local_experts > kMaxLocalExperts)
    throw std::invalid_argument("ep_plugin elastic: num_local_experts must be in [1, " +
                                std::to_string(kMaxLocalExperts) + "]");
  if (hidden < 8 || hidden % 8) throw std::invalid_argument("ep_plugin elastic: hidden must be a positive multiple of 8");
  if (max_tokens < 1 || max_blocks < 1) throw std::invalid_argument("ep_plugin elastic: max_tokens and max_blocks >= 1");
  if (max_topk < 1 || max_topk > kMaxTopk)
    throw std::invalid_argument("ep_plugin elastic: max_topk must be in [1, " + std::to_string(kMaxTopk) + "]");
  Regions g{};
  g.num_ranks = num_ranks;
  g.max_tokens = max_tokens;
  g.num_local_experts = num_local_experts;
  g.max_blocks = max_blocks;
  g.hidden = hidden;
  g.max_topk = max_topk;
  g.slot_bytes = align_up(2LL * hidden, 16);  // bf16 row; an fp8 row + its scales is smaller
  const int64_t R = num_ranks, T = max_tokens, K = max_topk;
  int64_t offset = 0;
  auto take = [&offset](int64_t bytes) {
    const int64_t at = offset;
    offset = align_up(offset + bytes, 256);
    return at;
  };
  g.off_disp_done = take(R * max_blocks * 8);
  g.off_comb_done = take(R * max_blocks * 8);
  g.off_stage = take(T * g.slot_bytes);
  g.off_recv_token = take(R * T * 4);
  g.off_recv_idx = take(R * T * K * 4);
  g.off_recv_w = take(R * T * K * 4);
  g.off_recv_k = take(R * T * K * 4);
  g.off_comb_data = take(R * T * 2LL * hidden);
  g.off_comb_w = take(R * T * K * 4);
  g.total_bytes = offset;
  return g;
}

}  // namespace elastic
}  // namespace ep
