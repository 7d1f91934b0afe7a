// Device addressing of the elastic regions (layout in elastic.h).
#pragma once

#include <cuda_bf16.h>

#include "elastic/elastic.h"
#include "ep/sync.cuh"

namespace ep {
namespace elastic {

// What the elastic kernels address: the transport's view and the elastic region layout.
struct View {
  const TransportView& t;
  const Regions& g;
};

__device__ __forceinline__ char* region(const View& v, int rank, int64_t offset) {
  return backend_region(v.t, rank, offset);
}
__device__ __forceinline__ DoneFlags dispatch_done(const View& v) { return {v.g.off_disp_done, v.g.max_blocks}; }
__device__ __forceinline__ DoneFlags combine_done(const View& v) { return {v.g.off_comb_done, v.g.max_blocks}; }
__device__ __forceinline__ int64_t packet_index(const View& v, int source, int slot) {
  return static_cast<int64_t>(source) * v.g.max_tokens + slot;
}
// Token t of rank `owner`, staged for the receivers to pull: payload, then fp8 scales.
__device__ __forceinline__ char* staged_token(const View& v, int owner, int64_t t) {
  return region(v, owner, v.g.off_stage) + t * v.g.slot_bytes;
}
__device__ __forceinline__ int32_t* recv_token(const View& v, int owner, int source, int slot) {
  return reinterpret_cast<int32_t*>(region(v, owner, v.g.off_recv_token)) + packet_index(v, source, slot);
}
// The payload of packet (source, slot) received by this rank: the source's staged token.
__device__ __forceinline__ const char* packet_payload(const View& v, int source, int slot) {
  return staged_token(v, source, *recv_token(v, v.t.rank, source, slot));
}
__device__ __forceinline__ int32_t* recv_idx(const View& v, int owner, int source, int slot) {
  return reinterpret_cast<int32_t*>(region(v, owner, v.g.off_recv_idx)) + packet_index(v, source, slot) * v.g.max_topk;
}
__device__ __forceinline__ float* recv_w(const View& v, int owner, int source, int slot) {
  return reinterpret_cast<float*>(region(v, owner, v.g.off_recv_w)) + packet_index(v, source, slot) * v.g.max_topk;
}
__device__ __forceinline__ int32_t* recv_k(const View& v, int owner, int source, int slot) {
  return reinterpret_cast<int32_t*>(region(v, owner, v.g.off_recv_k)) + packet_index(v, source, slot) * v.g.max_topk;
}
__device__ __forceinline__ __nv_bfloat16* comb_row(const View& v, int owner, int source, int slot) {
  return reinterpret_cast<__nv_bfloat16*>(region(v, owner, v.g.off_comb_data)) +
         packet_index(v, source, slot) * v.g.hidden;
}
// Row `row` of the owner's combine input in place (comb_data seen as [R * max_tokens][H] compact rows).
__device__ __forceinline__ const __nv_bfloat16* combine_input_row(const View& v, int owner, int64_t row) {
  return reinterpret_cast<const __nv_bfloat16*>(region(v, owner, v.g.off_comb_data)) + row * v.g.hidden;
}
__device__ __forceinline__ float* comb_w(const View& v, int owner, int source, int slot) {
  return reinterpret_cast<float*>(region(v, owner, v.g.off_comb_w)) + packet_index(v, source, slot) * v.g.max_topk;
}

// Where source `source`'s packets start among `owner`'s compact rows for op seq: the packets of
// sources before it, read from the counts they wrote into the owner's header before the handshake.
__device__ __forceinline__ int compact_base(const View& v, int owner, int source, unsigned long long seq) {
  int base = 0;
  for (int r = 0; r < source; ++r) base += counts_slot(v.t, owner, seq, r)[v.g.num_local_experts];
  return base;
}
}  // namespace elastic
}  // namespace ep
