// The two data loops both backends run, with the backend-specific parts passed in:
//
//   stage_tokens_*   (dispatch, source side) warp w takes tokens w, w + warps, ...; `prepare(t, lane)`
//                    tells the token's destinations what they need (warp-cooperative) and returns
//                    how many there are; a token sent anywhere is copied once into this rank's stage
//                    (`staged_token(v, rank, t)`, found by argument-dependent lookup in the
//                    backend's namespace), where the receivers pull it.
//   pull_packets_*   (dispatch, receive side) warp w takes packets w, w + warps, ... of `total`;
//                    `prepare(q, lane)` finds the packet's output rows (warp-cooperative) and
//                    returns their count; `target(n)` is the n-th row's address; `payload(q)` the
//                    packet's staged source (a peer GPU's memory over NVLink, or this GPU's).
//
// Each comes with two copy engines: 16-byte register copies (any GPU), and bulk (TMA) copies
// through the warp's ring of shared-memory stages (sm_90+), rows split into chunks.
#pragma once

#include <cstdint>

#include "ep/copy.cuh"

namespace ep {

// Received packets are numbered source by source: the first packet index of each source (block-
// shared, R + 1 entries, prefix[R] = all packets). Every thread of the block calls this.
__device__ __forceinline__ void packet_prefix(int num_ranks, const int32_t* num_packets, int* prefix) {
  if (threadIdx.x == 0) {
    int total = 0;
    for (int r = 0; r < num_ranks; ++r) {
      prefix[r] = total;
      total += num_packets[r];
    }
    prefix[num_ranks] = total;
  }
  __syncthreads();
}

// The source of flat packet q.
__device__ __forceinline__ int source_of(int num_ranks, const int* prefix, int q) {
  int r = 0;
  while (r + 1 < num_ranks && prefix[r + 1] <= q) ++r;
  return r;
}

template <typename View, typename Prepare>
__device__ __forceinline__ void stage_tokens_register(const View& v, const void* hidden, int64_t row_bytes,
                                                      int num_tokens, Prepare prepare) {
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  for (int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; t < num_tokens; t += warps) {
    if (prepare(t, lane) == 0) continue;
    warp_copy16(staged_token(v, v.t.rank, t), static_cast<const char*>(hidden) + t * row_bytes, row_bytes, lane);
  }
}

template <typename View, typename Prepare>
__device__ __forceinline__ void stage_tokens_bulk(const View& v, const BulkRing& ring, const void* hidden,
                                                  int64_t row_bytes, int num_tokens, Prepare prepare) {
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  // Job j: a chunk of this warp's chunks.row(j)-th token.
  const RowChunks chunks(row_bytes, ring.shape);
  const int my_tokens = warp < num_tokens ? (num_tokens - warp + warps - 1) / warps : 0;
  int count = 0;
  auto token = [&](int j) { return warp + static_cast<int64_t>(chunks.row(j)) * warps; };
  auto source = [&](int j) {
    return BulkJob{static_cast<const char*>(hidden) + token(j) * row_bytes + chunks.offset(j), chunks.bytes(j)};
  };
  auto consume = [&](int j, const char* stage) {
    if (chunks.offset(j) == 0) count = prepare(static_cast<int>(token(j)), lane);
    if (lane == 0 && count > 0) bulk_store(staged_token(v, v.t.rank, token(j)) + chunks.offset(j), stage, chunks.bytes(j));
  };
  run_bulk_jobs(ring, my_tokens * chunks.parts, source, consume, lane);
}

template <typename Payload, typename Prepare, typename Target>
__device__ __forceinline__ void pull_packets_register(int total, int64_t row_bytes, Payload payload, Prepare prepare,
                                                      Target target) {
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  for (int q = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; q < total; q += warps) {
    const char* source = payload(q);
    const int count = prepare(q, lane);
    // Read the payload once, store it to each of its rows.
    warp_copy16_multi(target, count, source, row_bytes, lane);
    __syncwarp();
  }
}

template <typename Payload, typename Prepare, typename Target>
__device__ __forceinline__ void pull_packets_bulk(const BulkRing& ring, int total, int64_t row_bytes, Payload payload,
                                                  Prepare prepare, Target target) {
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  // Job j: a chunk of this warp's chunks.row(j)-th packet.
  const RowChunks chunks(row_bytes, ring.shape);
  const int my_packets = warp < total ? (total - warp + warps - 1) / warps : 0;
  int count = 0;
  auto packet = [&](int j) { return warp + chunks.row(j) * warps; };
  auto source = [&](int j) {  // lane 0 only
    return BulkJob{payload(packet(j)) + chunks.offset(j), chunks.bytes(j)};
  };
  auto consume = [&](int j, const char* stage) {
    if (chunks.offset(j) == 0) count = prepare(packet(j), lane);
    if (lane == 0) {
      for (int n = 0; n < count; ++n) bulk_store(target(n) + chunks.offset(j), stage, chunks.bytes(j));
    }
  };
  run_bulk_jobs(ring, my_packets * chunks.parts, source, consume, lane);
}

}  // namespace ep
