// The hybrid region layout (see hybrid.h): sizes from the backend's shape, offsets equal on
// every rank.
#include <stdexcept>
#include <string>

#include "ep/region_builder.h"
#include "hybrid/hybrid.h"

namespace ep {
namespace hybrid {

Regions make_regions(int num_ranks, int max_tokens, int hidden, int num_local_experts, int max_blocks,
                     int64_t combine_input_bytes) {
  check_backend_shape("hybrid", num_ranks, max_tokens, hidden, num_local_experts, max_blocks);
  // A combine input's offset travels as an int32 count of 16-byte words (the combine's op word).
  if (combine_input_bytes < 0 || combine_input_bytes % 256 || combine_input_bytes / 16 >= kUnboundedRows)
    throw std::invalid_argument("ep_plugin hybrid: combine_input_bytes must be a multiple of 256 in [0, 32 GiB)");
  Regions g{};
  g.num_ranks = num_ranks;
  g.max_tokens = max_tokens;
  g.num_local_experts = num_local_experts;
  g.max_blocks = max_blocks;
  g.hidden = hidden;
  g.slot_bytes = align_up(2LL * hidden, 16);  // bf16 row; an fp8 row + its scales is smaller
  const int64_t R = num_ranks, T = max_tokens, L = num_local_experts;
  RegionBuilder regions;
  g.off_disp_done = regions.take(R * max_blocks * 8);
  g.off_comb_done = regions.take(R * max_blocks * 8);
  g.off_disp_stage = regions.take(T * g.slot_bytes);
  g.off_disp_token = regions.take(R * T * 4);
  g.off_disp_k = regions.take(R * T * L * 4);
  g.off_disp_p = regions.take(R * T * L * 4);
  g.off_comb_data = regions.take(R * T * 2LL * hidden);
  g.off_comb_p = regions.take(R * T * L * 4);
  g.combine_input_bytes = combine_input_bytes;
  g.off_comb_input = regions.take(combine_input_bytes);
  g.total_bytes = regions.size();
  return g;
}

}  // namespace hybrid
}  // namespace ep
