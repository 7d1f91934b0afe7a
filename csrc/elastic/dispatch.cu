// Stage 2 of an elastic dispatch: get each token to its destinations, and push each destination
// what it needs to place the token.
//
// Data flow: warp w takes tokens t = w, w + warps, ...; lane p (< R) holds the token's send slot at
// rank p (-1: no expert there). Two ways for the payload:
//   staged (default): a token sent anywhere is copied once into this rank's stage[t] (payload, then
//     fp8 scales), where every destination's receive kernel reads it;
//   pushed (in place, first compact dispatch): the token is read once and written straight into
//     each destination's recv_rows at its compact row, dest_base[p] + slot (fp8 scales into
//     recv_scales), so the receive kernel only places metadata.
// Destination p gets, pushed into its buffer at [this rank][slot]: the token index (recv_token)
// and, on a first dispatch, per top-k slot j (lane j): the expert as p's local id or -1 when it
// lives elsewhere (recv_idx), its weight (recv_w), and for the expanded form the token's index
// within (this rank, expert) (recv_k: its row offset inside the expert's rows from this rank). A
// slot naming an expert that a later slot of the same token names again, or an id outside [0, E),
// counts as -1 (the layout kernel counted such a token once per expert). dest_base[p] = the compact
// rows at p of the sources before this rank, summed from the packet counts those sources wrote
// into p's header before the exchange's handshake (complete once it passed). Nothing is waited
// on: the exchange kernel before this one established that every peer finished reading this
// rank's previous stage and that their regions are free. Each block ends by publishing
// disp_done[this rank][block] = n at every rank (release), which the receive kernel waits on. A
// rank with no tokens still publishes.
#include <cuda_runtime.h>

#include "elastic/regions.cuh"
#include "ep/check.cuh"
#include "ep/copy.cuh"
#include "ep/pipeline.cuh"
#include "ep/region_builder.h"

namespace ep {
namespace elastic {
namespace {

// Per warp: the token's send slot at each rank, and (pushed) its target rows.
struct WarpScratch {
  int slots[kMaxRanks];
  char* targets[kMaxRanks];
};

// Block-wide, at kernel start: dest_base for every destination into shared memory (and, from block
// 0, into args.dest_base). Only a first compact dispatch needs it.
__device__ __forceinline__ void load_dest_base(const View& v, const SendArgs& a, int* s_dest_base,
                                               unsigned long long seq) {
  if (a.dest_base != nullptr || a.push_payload) {
    const int p = threadIdx.x;
    if (p < v.g.num_ranks) {
      s_dest_base[p] = compact_base(v, p, v.t.rank, seq);
      if (blockIdx.x == 0 && a.dest_base != nullptr) a.dest_base[p] = s_dest_base[p];
    }
  }
  __syncthreads();
}

// Warp-cooperative: tell each destination of token t where to find it (and on a first dispatch
// its top-k metadata), stage or push its fp8 scales, record the pushed target rows, and return the
// number of destinations.
__device__ __forceinline__ int prepare_token(const View& v, const SendArgs& a, int t, WarpScratch& w,
                                             const int* dest_base, int lane) {
  const int R = v.g.num_ranks;
  const int L = v.g.num_local_experts;
  const int me = v.t.rank;
  const int my_slot = lane < R ? a.send_slot[static_cast<int64_t>(t) * R + lane] : -1;
  const unsigned destinations = __ballot_sync(0xffffffffu, my_slot >= 0);
  if (my_slot >= 0) *recv_token(v, lane, me, my_slot) = t;
  if (lane < R) w.slots[lane] = my_slot;
  if (a.push_payload && my_slot >= 0) {  // the n-th destination's row, n = rank among the set bits
    const int64_t row = dest_base[lane] + my_slot;
    w.targets[__popc(destinations & ((1u << lane) - 1))] = region(v, lane, v.g.off_recv_rows) + row * a.row_bytes;
  }
  __syncwarp();
  if (destinations == 0) return 0;
  if (a.scales != nullptr) {
    const char* scales = reinterpret_cast<const char*>(a.scales) + t * a.scale_bytes;
    if (!a.push_payload) {
      warp_copy4(staged_token(v, me, t) + a.row_bytes, scales, a.scale_bytes, lane);
    } else {
      for (unsigned mask = destinations; mask; mask &= mask - 1) {
        const int p = __ffs(mask) - 1;
        const int64_t row = dest_base[p] + w.slots[p];
        warp_copy4(region(v, p, v.g.off_recv_scales) + row * a.scale_bytes, scales, a.scale_bytes, lane);
      }
    }
  }
  if (a.topk_idx != nullptr) {
    const int E = R * L;
    const int64_t base = static_cast<int64_t>(t) * a.topk;
    const long long id = lane < a.topk ? a.topk_idx[base + lane] : -1;
    bool valid = id >= 0 && id < E;
    // Invalid lanes get keys no valid expert has, so that only real duplicates match.
    const unsigned same = __match_any_sync(0xffffffffu, valid ? static_cast<int>(id) : -1 - lane);
    if (valid && (same >> lane) > 1u) valid = false;  // a later slot names the same expert
    const int expert = static_cast<int>(id);
    const int owner = valid ? expert / L : -1;
    const float weight = (a.topk_weights != nullptr && lane < a.topk) ? a.topk_weights[base + lane] : 0.0f;
    const int32_t k = (valid && a.k_index != nullptr) ? a.k_index[static_cast<int64_t>(t) * E + expert] : 0;
    for (unsigned mask = destinations; mask; mask &= mask - 1) {
      const int p = __ffs(mask) - 1;
      const int slot = w.slots[p];
      if (lane < a.topk) {
        const bool here = owner == p;
        recv_idx(v, p, me, slot)[lane] = here ? expert - p * L : -1;
        if (a.topk_weights != nullptr) recv_w(v, p, me, slot)[lane] = here ? weight : 0.0f;
        if (a.k_index != nullptr) recv_k(v, p, me, slot)[lane] = here ? k : 0;
      }
    }
  }
  return __popc(destinations);
}

__global__ void __launch_bounds__(kThreads) dispatch_send_kernel(TransportView t, Regions g, SendArgs a) {
  __shared__ WarpScratch s_scratch[kThreads / 32];
  __shared__ int s_dest_base[kMaxRanks];
  const View v{t, g};
  if (block_aborted(t)) return;  // a wait of this op already failed: leave peers untouched
  const unsigned long long seq = current_seq(t);
  load_dest_base(v, a, s_dest_base, seq);
  WarpScratch& w = s_scratch[threadIdx.x / 32];
  auto prepare = [&](int token, int lane) { return prepare_token(v, a, token, w, s_dest_base, lane); };
  if (a.push_payload) {
    auto payload = [&](int token) { return static_cast<const char*>(a.hidden) + token * a.row_bytes; };
    pull_packets_register(a.num_tokens, a.row_bytes, payload, prepare, [&](int n) { return w.targets[n]; });
  } else {
    stage_tokens_register(v, a.hidden, a.row_bytes, a.num_tokens, prepare);
  }
  signal_block_done(t, dispatch_done(v), seq);
}

__global__ void __launch_bounds__(kBulkWarps * 32) dispatch_send_bulk_kernel(TransportView t, Regions g, SendArgs a,
                                                                             BulkShape shape) {
  extern __shared__ __align__(128) char s_stages[];
  __shared__ WarpScratch s_scratch[kBulkWarps];
  __shared__ uint64_t s_bars[kBulkWarps][kBulkMaxStages];
  __shared__ int s_dest_base[kMaxRanks];
  const View v{t, g};
  if (block_aborted(t)) return;
  const unsigned long long seq = current_seq(t);
  load_dest_base(v, a, s_dest_base, seq);
  const int warp_in_block = threadIdx.x / 32;
  const BulkRing ring = make_bulk_ring(s_stages, s_bars[warp_in_block], shape, warp_in_block, threadIdx.x % 32);
  WarpScratch& w = s_scratch[warp_in_block];
  auto prepare = [&](int token, int lane) { return prepare_token(v, a, token, w, s_dest_base, lane); };
  if (a.push_payload) {
    // The same loop as a receiver's pull: one load of the token, one bulk store per destination row.
    auto payload = [&](int token) { return static_cast<const char*>(a.hidden) + token * a.row_bytes; };
    pull_packets_bulk(ring, a.num_tokens, a.row_bytes, payload, prepare, [&](int n) { return w.targets[n]; });
  } else {
    stage_tokens_bulk(v, ring, a.hidden, a.row_bytes, a.num_tokens, prepare);
  }
  signal_block_done(t, dispatch_done(v), seq);
}

}  // namespace

void launch_dispatch_send(const SymmetricBuffer& buffer, const Regions& regions, const SendArgs& args,
                          int num_blocks, uintptr_t stream) {
  if (args.topk_idx != nullptr && (args.topk < 1 || args.topk > regions.max_topk))
    throw std::invalid_argument("ep_plugin elastic: topk out of range for this buffer");
  // (A rank with no tokens passes null tensors: a first dispatch is told by its topk.)
  if (args.push_payload && (!regions.in_place_dispatch || args.topk < 1 || args.k_index != nullptr))
    throw std::invalid_argument("ep_plugin elastic: an in-place dispatch needs a buffer built for it and a first, "
                                "compact dispatch");
  // A pushed payload's scales land in recv_scales, whose rows hold one float per 128 elements (the rows
  // themselves in recv_rows, whose rows hold hidden bytes of fp8 or 2 x hidden of bf16).
  if (args.push_payload && args.scale_bytes > static_cast<int64_t>(regions.hidden / 128) * 4)
    refuse_launch("elastic", "pushed scales of " + std::to_string(args.scale_bytes) + " bytes per row are more than "
                  "this buffer's " + std::to_string(regions.hidden / 128 * 4) + " (one float per 128 elements)");
  check_launch_fits("elastic", regions, num_blocks, args.num_tokens);
  check_rows_fit("elastic", regions, args.row_bytes, args.scale_bytes);
  const DeviceScope device_scope(buffer.device());
  const bool bulk = args.bulk_copy && buffer.bulk_capable();
  launch_copy_kernel(bulk, dispatch_send_bulk_kernel, dispatch_send_kernel, buffer.view(), regions, args,
                     args.row_bytes, num_blocks, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace elastic
}  // namespace ep
