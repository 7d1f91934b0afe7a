// Stage 2 of a dispatch: stage each token for its destinations to pull, and tell them where.
//
// Data flow: warp w of the grid takes tokens t = w, w + warps, ...; lane p (< R) holds the token's
// send slot at rank p (-1: no expert there). A token sent anywhere is copied once into this
// rank's disp_stage[t] (payload, then fp8 scales), where every destination's permute kernel reads
// it. Each destination p gets, pushed into its buffer at [this rank][slot], the token index
// (disp_token) and, on a first dispatch, the token's per-local-expert k index (its position within
// (this rank, expert)) and prob (disp_k / disp_p). Nothing is waited on: the notify kernel before
// this one established that every peer finished reading this rank's previous stage and that
// their regions are free. Each block ends by publishing disp_done[this rank][block] = n at every
// rank (release), which the permute kernel waits on. A rank with no tokens still publishes.
//
// Why pull: a pushed packet is written at the receiver and read back by its permute; pulled, the
// payload is read once, straight into the expert rows: a third fewer bytes written per dispatch.
//
// Two copy engines stage the payload: bulk copies (sm_90+: one lane moves the row through a
// shared-memory stage, several rows in flight per warp), or 16-byte register copies (any GPU;
// EP_PLUGIN_BULK_COPY=0).
#include <cuda_runtime.h>

#include "ep/check.cuh"
#include "ep/region_builder.h"
#include "hybrid/dispatch_stages.cuh"

namespace ep {
namespace hybrid {
namespace {

__global__ void __launch_bounds__(kThreads) dispatch_send_kernel(TransportView t, Regions g, SendArgs a) {
  __shared__ int s_slots[kThreads / 32][kMaxRanks];
  const View v{t, g};
  clear_overflow(a);
  if (block_aborted(t)) return;  // a wait of this op already failed: leave peers untouched
  send_block(v, a, current_seq(t), s_slots[threadIdx.x / 32]);
}

__global__ void __launch_bounds__(kBulkWarps * 32) dispatch_send_bulk_kernel(TransportView t, Regions g, SendArgs a,
                                                                             BulkShape shape) {
  extern __shared__ __align__(128) char s_stages[];
  __shared__ int s_slots[kBulkWarps][kMaxRanks];
  __shared__ uint64_t s_bars[kBulkWarps][kBulkMaxStages];
  const View v{t, g};
  clear_overflow(a);
  if (block_aborted(t)) return;
  const int warp_in_block = threadIdx.x / 32;
  const BulkRing ring = make_bulk_ring(s_stages, s_bars[warp_in_block], shape, warp_in_block, threadIdx.x % 32);
  send_block(v, ring, a, current_seq(t), s_slots[warp_in_block]);
}

}  // namespace
void launch_dispatch_send(const SymmetricBuffer& buffer, const Regions& regions, const SendArgs& args, int num_blocks, uintptr_t stream) {
  check_launch_fits("hybrid", regions, num_blocks, args.num_tokens);
  check_rows_fit("hybrid", regions, args.row_bytes, args.scale_bytes);
  const DeviceScope device_scope(buffer.device());
  const bool bulk = args.bulk_copy && buffer.bulk_capable();
  launch_copy_kernel(bulk, dispatch_send_bulk_kernel, dispatch_send_kernel, buffer.view(), regions, args, args.row_bytes, num_blocks,
                     reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace hybrid
}  // namespace ep
