// Stage 3 of an elastic dispatch: pull every received packet into its output row(s).
//
// Data flow: waits for disp_done[r][b] >= n from every block b of every source rank r (acquire);
// then warp w takes packets q = w, w + warps, ... of the packets received from all sources in rank
// order (packet q is (r, s): source r's s-th packet, whose payload is the token recv_token[r][s]
// staged in source r's buffer).
//   Compact form: packet q is output row q (rows ordered by source rank, then source token). A first
//   dispatch also writes the row's top-k ids (local ids, -1 = elsewhere) and weights.
//   Expanded form: for each top-k slot j naming a local expert e, the row is row_base[r][e] +
//   recv_k[j] (the token's index within (r, e)), recorded in packet_rows[q][j] for combine and for
//   cached dispatches, which read it back. With zero_padding, the padding rows of each expert's
//   segment are zeroed (payload, scales, row weights); otherwise they are left as they are.
// Rows at or past the capacity are dropped (the capacity is exact or the worst case, so none is).
// In place (payload_pushed), the sources already wrote each packet's payload (and fp8 scales) to
// its row in this rank's recv_rows: only the metadata is placed.
//
// Copy engines as in dispatch.cu: one bulk load of the payload (from the source's buffer: a peer
// GPU's over NVLink, or this GPU's), one bulk store per output row (sm_90+), or 16-byte register
// copies.
#include <cuda_runtime.h>

#include "elastic/regions.cuh"
#include "ep/check.cuh"
#include "ep/copy.cuh"
#include "ep/pipeline.cuh"
#include "ep/region_builder.h"

namespace ep {
namespace elastic {
namespace {

// Warp-cooperative: the output rows of packet q = (r, s) into `targets` (shared memory), with the
// rows' metadata and fp8 scales written. Returns the count.
__device__ __forceinline__ int prepare_packet(const View& v, const ReceiveArgs& a, int q, int r, int s,
                                              int32_t* targets, int lane) {
  const int me = v.t.rank;
  int count = 0;
  if (!a.expand) {
    if (q < a.capacity) {
      if (lane == 0) targets[0] = q;
      count = 1;
      if (!a.cached && lane < a.topk) {
        const int64_t at = static_cast<int64_t>(q) * a.topk + lane;
        a.out_topk_idx[at] = recv_idx(v, me, r, s)[lane];
        if (a.out_topk_weights != nullptr) a.out_topk_weights[at] = recv_w(v, me, r, s)[lane];
      }
    }
  } else {
    int32_t* cached = a.packet_rows + static_cast<int64_t>(q) * a.topk;
    int row = -1;
    if (lane < a.topk) {
      if (a.cached) {
        row = cached[lane];
      } else {
        // Independent loads first, so that a packet costs one memory latency, not three.
        const int local = recv_idx(v, me, r, s)[lane];
        const int k = recv_k(v, me, r, s)[lane];
        const float weight = a.out_row_weights != nullptr ? recv_w(v, me, r, s)[lane] : 0.0f;
        row = local >= 0 ? a.row_base[r * v.g.num_local_experts + local] + k : -1;
        // A row past the output is dropped here; so it is for a cached dispatch and the combine (which read
        // these) too: they would read or write past the output.
        cached[lane] = row < a.capacity ? row : -1;
        if (row >= 0 && row < a.capacity && a.out_row_weights != nullptr) a.out_row_weights[row] = weight;
      }
    }
    const bool valid = row >= 0 && row < a.capacity;
    const unsigned ballot = __ballot_sync(0xffffffffu, valid);
    if (valid) targets[__popc(ballot & ((1u << lane) - 1))] = row;
    count = __popc(ballot);
  }
  __syncwarp();
  if (a.out_scales != nullptr) {
    const char* payload = packet_payload(v, r, s);
    for (int n = 0; n < count; ++n) {
      warp_copy4(reinterpret_cast<char*>(a.out_scales) + static_cast<int64_t>(targets[n]) * a.scale_bytes,
                 payload + a.row_bytes, a.scale_bytes, lane);
    }
  }
  return count;
}

// After the packets: zero the padding rows of each expert segment (all warps of the grid).
__device__ __forceinline__ void zero_padding(const View& v, const ReceiveArgs& a) {
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  for (int e = 0; e < v.g.num_local_experts; ++e) {
    const int64_t first = a.expert_start[e] + a.real_per_expert[e];
    const int64_t end = min(static_cast<int64_t>(a.expert_start[e] + a.tokens_per_expert[e]), a.capacity);
    for (int64_t row = first + warp; row < end; row += warps) {
      warp_zero16(static_cast<char*>(a.out) + row * a.row_bytes, a.row_bytes, lane);
      if (a.out_scales != nullptr) {
        warp_zero4(reinterpret_cast<char*>(a.out_scales) + row * a.scale_bytes, a.scale_bytes, lane);
      }
      if (a.out_row_weights != nullptr && lane == 0) a.out_row_weights[row] = 0.0f;
    }
  }
}

// The body both engines share; `pull` runs the packet loop with the engine's copies.
template <typename Pull>
__device__ __forceinline__ void receive(const View& v, const ReceiveArgs& a, int32_t* targets, int* prefix, Pull pull) {
  const int R = v.g.num_ranks;
  packet_prefix(R, a.num_packets, prefix);
  auto payload = [&](int q) {
    const int r = source_of(R, prefix, q);
    return packet_payload(v, r, q - prefix[r]);
  };
  auto prepare = [&](int q, int lane) {
    const int r = source_of(R, prefix, q);
    return prepare_packet(v, a, q, r, q - prefix[r], targets, lane);
  };
  char* out = static_cast<char*>(a.out);
  const int64_t row_bytes = a.row_bytes;
  auto target = [=](int n) { return out + targets[n] * row_bytes; };
  pull(prefix[R], payload, prepare, target);
  if (a.expand && a.zero_padding) zero_padding(v, a);
}

// In place: the compact rows' top-k ids and weights, nothing else (one warp per packet).
__device__ __forceinline__ void place_metadata(const View& v, const ReceiveArgs& a, int32_t* targets, int* prefix) {
  const int R = v.g.num_ranks;
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  packet_prefix(R, a.num_packets, prefix);
  for (int q = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; q < prefix[R]; q += warps) {
    const int r = source_of(R, prefix, q);
    prepare_packet(v, a, q, r, q - prefix[r], targets, lane);
  }
}

__global__ void __launch_bounds__(kThreads) receive_kernel(TransportView t, Regions g, ReceiveArgs a) {
  __shared__ int32_t s_targets[kThreads / 32][kMaxTopk];  // output rows of the packet in hand
  __shared__ int s_prefix[kMaxRanks + 1];
  const View v{t, g};
  if (block_aborted(t)) return;
  const unsigned long long seq = current_seq(t);
  if (!wait_all_blocks(t, dispatch_done(v), seq, gridDim.x, kPhaseDispatchReceive)) return;
  if (a.payload_pushed) {
    place_metadata(v, a, s_targets[threadIdx.x / 32], s_prefix);
    return;
  }
  receive(v, a, s_targets[threadIdx.x / 32], s_prefix, [&](int total, auto payload, auto prepare, auto target) {
    pull_packets_register(total, a.row_bytes, payload, prepare, target);
  });
}

__global__ void __launch_bounds__(kBulkWarps * 32) receive_bulk_kernel(TransportView t, Regions g, ReceiveArgs a,
                                                                       BulkShape shape) {
  extern __shared__ __align__(128) char s_stages[];
  __shared__ int32_t s_targets[kBulkWarps][kMaxTopk];
  __shared__ uint64_t s_bars[kBulkWarps][kBulkMaxStages];
  __shared__ int s_prefix[kMaxRanks + 1];
  const View v{t, g};
  if (block_aborted(t)) return;
  const unsigned long long seq = current_seq(t);
  if (!wait_all_blocks(t, dispatch_done(v), seq, gridDim.x, kPhaseDispatchReceive)) return;
  const int warp_in_block = threadIdx.x / 32;
  const BulkRing ring = make_bulk_ring(s_stages, s_bars[warp_in_block], shape, warp_in_block, threadIdx.x % 32);
  receive(v, a, s_targets[warp_in_block], s_prefix, [&](int total, auto payload, auto prepare, auto target) {
    pull_packets_bulk(ring, total, a.row_bytes, payload, prepare, target);
  });
}

}  // namespace

void launch_dispatch_receive(const SymmetricBuffer& buffer, const Regions& regions, const ReceiveArgs& args,
                             int num_blocks, uintptr_t stream) {
  if (args.topk < 1 || args.topk > regions.max_topk)
    throw std::invalid_argument("ep_plugin elastic: topk out of range for this buffer");
  // (An empty output has a null address: nothing is written to it, so it is not missing.)
  if (args.capacity > 0) {
    if (!args.out) throw std::invalid_argument("ep_plugin elastic: receive needs out");
    if (args.expand && !args.cached && !args.row_base)
      throw std::invalid_argument("ep_plugin elastic: the expanded form needs row_base");
    if (args.expand && !args.packet_rows)  // written by a first dispatch, read by a cached one
      throw std::invalid_argument("ep_plugin elastic: the expanded form needs packet_rows");
    if (!args.expand && !args.cached && !args.out_topk_idx)
      throw std::invalid_argument("ep_plugin elastic: the compact form needs out_topk_idx");
    if (args.expand && args.zero_padding && (!args.expert_start || !args.tokens_per_expert || !args.real_per_expert))
      throw std::invalid_argument("ep_plugin elastic: zero_padding needs the segment tensors");
  }
  if (args.payload_pushed && (args.expand || args.cached || args.out_scales))
    throw std::invalid_argument("ep_plugin elastic: a pushed payload is a first compact dispatch (scales pushed too)");
  check_launch_fits("elastic", regions, num_blocks);
  check_rows_fit("elastic", regions, args.row_bytes, args.scale_bytes);
  const DeviceScope device_scope(buffer.device());
  // Placing metadata copies no rows: the register kernel does it.
  const bool bulk = args.bulk_copy && buffer.bulk_capable() && !args.payload_pushed;
  launch_copy_kernel(bulk, receive_bulk_kernel, receive_kernel, buffer.view(), regions, args, args.row_bytes,
                     num_blocks, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace elastic
}  // namespace ep
