// Stage 3 of a dispatch: pull received packets into expert-sorted, padded output rows.
//
// Data flow: waits for disp_done[r][b] >= n from every block b of every source rank r (acquire);
// then warp w takes packets q = w, w + warps, ... of the packets received from all sources in
// rank order (packet q is (r, s): source r's s-th packet, whose payload is the token
// disp_token[r][s] staged in source r's buffer). A packet's row for local expert e is
// row_base[r][e] + k, with k the sender's index of the token within (r, e) (first dispatch: read
// from disp_k and recorded in packet_rows for combine), or comes straight from packet_rows
// (dispatch again). Rows at or past the budget are dropped and raise the overflow flag. Padding
// rows of each segment are zero-filled (hidden, scales and probs). Rows past the total (only in
// non-blocking mode, where the budget is an upper bound) are left as they are.
//
// Copy engines as in dispatch.cu: one bulk load of the payload (from the source's buffer: a peer
// GPU's over NVLink, or this GPU's), one bulk store per expert row (sm_90+), or 16-byte register
// copies.
#include <cuda_runtime.h>

#include <stdexcept>

#include "ep/check.cuh"
#include "ep/region_builder.h"
#include "hybrid/dispatch_stages.cuh"

namespace ep {
namespace hybrid {
namespace {

__global__ void __launch_bounds__(kThreads) permute_kernel(TransportView t, Regions g, PermuteArgs a) {
  __shared__ int32_t s_targets[kThreads / 32][kMaxLocalExperts];  // output rows of the packet in hand
  __shared__ int s_prefix[kMaxRanks + 1];
  const View v{t, g};
  if (block_aborted(t)) return;
  permute_block(v, a, current_seq(t), s_targets[threadIdx.x / 32], s_prefix);
}

__global__ void __launch_bounds__(kBulkWarps * 32) permute_bulk_kernel(TransportView t, Regions g, PermuteArgs a,
                                                                       BulkShape shape) {
  extern __shared__ __align__(128) char s_stages[];
  __shared__ int32_t s_targets[kBulkWarps][kMaxLocalExperts];
  __shared__ uint64_t s_bars[kBulkWarps][kBulkMaxStages];
  __shared__ int s_prefix[kMaxRanks + 1];
  const View v{t, g};
  if (block_aborted(t)) return;
  const int warp_in_block = threadIdx.x / 32;
  const BulkRing ring = make_bulk_ring(s_stages, s_bars[warp_in_block], shape, warp_in_block, threadIdx.x % 32);
  permute_block(v, ring, a, current_seq(t), s_targets[warp_in_block], s_prefix);
}

// The fused dispatch: the send's part, then the permute's, in one launch. Every block of every
// rank is resident (the co-residency rule), so a block waiting for the sends of others (its own
// rank's blocks included) cannot wait for one that is not scheduled. The permute part runs its
// bulk ring with barriers of its own: the send's have completed phases the permute must not see.
__global__ void __launch_bounds__(kThreads) dispatch_fused_kernel(TransportView t, Regions g, SendArgs s,
                                                                  PermuteArgs p) {
  __shared__ int s_slots[kThreads / 32][kMaxRanks];
  __shared__ int32_t s_targets[kThreads / 32][kMaxLocalExperts];
  __shared__ int s_prefix[kMaxRanks + 1];
  const View v{t, g};
  clear_overflow(s);
  if (block_aborted(t)) return;
  const unsigned long long seq = current_seq(t);
  send_block(v, s, seq, s_slots[threadIdx.x / 32]);
  permute_block(v, p, seq, s_targets[threadIdx.x / 32], s_prefix);
}

__global__ void __launch_bounds__(kBulkWarps * 32) dispatch_fused_bulk_kernel(TransportView t, Regions g, SendArgs s,
                                                                              PermuteArgs p, BulkShape shape) {
  extern __shared__ __align__(128) char s_stages[];
  __shared__ int s_slots[kBulkWarps][kMaxRanks];
  __shared__ int32_t s_targets[kBulkWarps][kMaxLocalExperts];
  __shared__ uint64_t s_send_bars[kBulkWarps][kBulkMaxStages];
  __shared__ uint64_t s_pull_bars[kBulkWarps][kBulkMaxStages];
  __shared__ int s_prefix[kMaxRanks + 1];
  const View v{t, g};
  clear_overflow(s);
  if (block_aborted(t)) return;
  const unsigned long long seq = current_seq(t);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  send_block(v, make_bulk_ring(s_stages, s_send_bars[warp], shape, warp, lane), s, seq, s_slots[warp]);
  // The send's ring ended with every store landed, so its stages are free for the permute's.
  permute_block(v, make_bulk_ring(s_stages, s_pull_bars[warp], shape, warp, lane), p, seq, s_targets[warp], s_prefix);
}

// What every permute reads or writes, whatever its rows: a null one would be a fault on the device.
void check_permute_args(const PermuteArgs& a) {
  if (!a.num_packets || !a.total_rows || !a.overflow || !a.packet_rows || !a.expert_start || !a.tokens_per_expert ||
      !a.real_per_expert)
    throw std::invalid_argument("ep_plugin hybrid: the permute needs num_packets, total_rows, overflow, packet_rows, "
                                "expert_start, tokens_per_expert and real_per_expert");
  if (!a.use_cached_rows && !a.row_base)
    throw std::invalid_argument("ep_plugin hybrid: a first dispatch's permute needs row_base");
  // (An empty output has a null address: nothing is written to it, so it is not missing.)
  if (a.budget > 0 && !a.out) throw std::invalid_argument("ep_plugin hybrid: the permute needs out");
}

}  // namespace

void launch_permute(const SymmetricBuffer& buffer, const Regions& regions, const PermuteArgs& args, int num_blocks, uintptr_t stream) {
  check_permute_args(args);
  check_launch_fits("hybrid", regions, num_blocks);
  check_rows_fit("hybrid", regions, args.row_bytes, args.scale_bytes);
  const DeviceScope device_scope(buffer.device());
  const bool bulk = args.bulk_copy && buffer.bulk_capable();
  launch_copy_kernel(bulk, permute_bulk_kernel, permute_kernel, buffer.view(), regions, args, args.row_bytes, num_blocks,
                     reinterpret_cast<cudaStream_t>(stream));
}

void launch_dispatch_fused(const SymmetricBuffer& buffer, const Regions& regions, const SendArgs& send,
                           const PermuteArgs& permute, int num_blocks, uintptr_t stream) {
  if (send.row_bytes != permute.row_bytes || send.scale_bytes != permute.scale_bytes)
    throw std::invalid_argument("ep_plugin hybrid: the fused dispatch's send and permute move rows of one size");
  if (permute.use_cached_rows)
    throw std::invalid_argument("ep_plugin hybrid: the fused dispatch is a first dispatch (use_cached_rows)");
  check_permute_args(permute);
  check_launch_fits("hybrid", regions, num_blocks, send.num_tokens);
  check_rows_fit("hybrid", regions, send.row_bytes, send.scale_bytes);
  const DeviceScope device_scope(buffer.device());
  const bool bulk = send.bulk_copy && permute.bulk_copy && buffer.bulk_capable();
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  const TransportView& view = buffer.view();  // (it throws once destroyed: not inside the launch's arguments)
  if (bulk) {
    const BulkShape shape = make_bulk_shape(send.row_bytes);
    const int smem = bulk_smem_bytes(shape);
    allow_dynamic_smem(reinterpret_cast<const void*>(dispatch_fused_bulk_kernel), smem);
    dispatch_fused_bulk_kernel<<<num_blocks, kBulkWarps * 32, smem, s>>>(view, regions, send, permute, shape);
  } else {
    dispatch_fused_kernel<<<num_blocks, kThreads, 0, s>>>(view, regions, send, permute);
  }
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace hybrid
}  // namespace ep
