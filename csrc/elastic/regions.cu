// The elastic region layout (see elastic.h): sizes from the backend's shape, offsets equal on
// every rank.
#include <stdexcept>
#include <string>

#include "elastic/elastic.h"
#include "ep/region_builder.h"

namespace ep {
namespace elastic {

Regions make_regions(int num_ranks, int max_tokens, int hidden, int num_local_experts, int max_blocks,
                     int max_topk, bool in_place_dispatch) {
  check_backend_shape("elastic", num_ranks, max_tokens, hidden, num_local_experts, max_blocks);
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
  RegionBuilder regions;
  g.off_disp_done = regions.take(R * max_blocks * 8);
  g.off_comb_done = regions.take(R * max_blocks * 8);
  g.off_stage = regions.take(T * g.slot_bytes);
  g.off_recv_token = regions.take(R * T * 4);
  g.off_recv_idx = regions.take(R * T * K * 4);
  g.off_recv_w = regions.take(R * T * K * 4);
  g.off_recv_k = regions.take(R * T * K * 4);
  g.off_comb_data = regions.take(R * T * 2LL * hidden);
  g.off_comb_w = regions.take(R * T * K * 4);
  g.in_place_dispatch = in_place_dispatch;
  g.off_recv_rows = regions.take(in_place_dispatch ? R * T * 2LL * hidden : 0);
  g.off_recv_scales = regions.take(in_place_dispatch ? R * T * (hidden / 128) * 4LL : 0);
  g.total_bytes = regions.size();
  return g;
}

}  // namespace elastic
}  // namespace ep
