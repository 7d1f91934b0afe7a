// Stage 0 of a dispatch: the send-side layout, in one kernel launch.
//
// From this rank's routing (a [T, E] bool map, or [T, K] top-k ids with optional weights) it writes
// per token its index within each chosen expert (k_index [T, E]) and its packet slot at each
// destination rank (send_slot [T, R]), both exclusive prefix counts down a column; the column
// totals (expert_counts [E], rank_counts [R]); for top-k with weights dense_probs [T, E]; and for
// top-k the input flags of each rank column (an id out of range, an expert named twice).
//
// Data flow: grid (token chunk y, rank p). Block (y, p) owns rank p's L expert columns and its rank
// column (send_slot: the OR of those L) for the tokens of chunk y. A prefix count needs the totals
// of every earlier token, and the block recounts chunks 0..y-1 itself (pass A over [0, t0)) instead
// of waiting for the blocks that own them. (Why chunks: with one block per rank, each SM would
// write T*L*4 bytes of k_index, plus as much of dense_probs: ~1 MB and ~10 us at T=4096, R=8,
// E=256.) So blocks never wait on each other: the kernel cannot deadlock beside the spin-waiting
// kernels of ranks sharing the GPU, needs no zeroed scratch (one launch, replayable in a CUDA
// graph) and is correct in any scheduling order. The price is that the last chunk's block reads up
// to T*L bytes of the map (or T*K*8 of ids) from L2; chunks of >= 256 tokens and at most one block
// per SM bound that. Inside a block the 32 warps split the chunk into contiguous runs; pass A also
// counts each warp's run per column into shared memory, a scan across warps turns those counts into
// each warp's starting offsets, and pass B walks the run again in token order writing every output
// element exactly once (row-contiguous stores). The block of the last chunk writes the totals and
// its rank's input flags (it is the one block of that rank that reads every id).
//
// Lanes: "column lanes" (a step of `rows` tokens; lane = (row, vector of V columns)) count the map
// and write all outputs; "id lanes" (lane = (row, top-k slot)) count top-k ids. Pass B scatters a
// top-k step into a per-warp shared tile of column-lane shape first. A token naming an expert twice
// chose it once (flagged; the blocking mode then refuses the dispatch on every rank): pass A counts
// only the last such slot (a later slot of the same row is found with shuffles, or a bitmap when
// K > 32), and in pass B slots land in the tile in increasing k, so the prob of the last one wins.
// Loads in the counting loops are unrolled so that each lane has ~16 in flight.
//
// Waits on nothing, except in the fused prologue (launch_layout_exchange): there the last block of
// the grid to finish runs the count exchange (csrc/exchange.cu) and waits in its handshake, after
// every other block of the grid has exited. Cost: the kernel is bound by instruction issue, not by bytes (ncu, with
// __match_any_sync still in: 0.4 instructions per cycle per scheduler, 60% of stalls on the
// short scoreboard, 3% of DRAM bandwidth). Measured alone on
// an H200 (benchmarks/layout_time.py, R = 8, E = 256, top-8): 8.8 us at T=128 and 43 us at T=4096
// with 16 blocks (the bed's num_sms: 2 chunks x 8 ranks, the last recounting 2048 tokens), 26 us
// with 128 blocks. Before the shuffles replaced __match_any_sync: 15 and 70 us. Every block reads
// all K ids of its tokens for its one rank, so the work grows with R; a token-major kernel (one block
// per chunk for every rank) would read each id once. R=1 with large L is the slow corner (the
// recount is T*E bytes for one block).
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "ep/check.cuh"
#include "ep/exchange.cuh"
#include "ep/layout.h"

namespace ep {
namespace {

constexpr int kLayoutThreads = 1024;
constexpr int kLayoutWarps = kLayoutThreads / 32;
constexpr int kMinTokensPerBlock = 256;               // smaller chunks only add recounting
constexpr int kTileEntries = 256;                     // per-warp top-k tile: (rows of a step) x L
constexpr int kCountStride = kMaxLocalExperts + 1;    // per-warp counts: (L + 1) | 1 entries
constexpr unsigned kFullMask = 0xffffffffu;
static_assert(kLayoutWarps == 32, "the scan across warps gives each warp one lane");
static_assert(kTileEntries >= kMaxLocalExperts && kTileEntries >= 32 * 4, "a step of column lanes must fit the tile");

// ---- small primitives ---------------------------------------------------------------------------

__device__ __forceinline__ int next_pow2(int x) { return 1 << (32 - __clz(x - 1)); }  // 1 <= x <= 32
__device__ __forceinline__ unsigned lanes_below(int lane) { return (1u << lane) - 1u; }
__device__ __forceinline__ bool byte_set(uint32_t word, int v) { return ((word >> (8 * v)) & 0xffu) != 0; }
__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }
__device__ __forceinline__ int round_up(int a, int b) { return ceil_div(a, b) * b; }

// V consecutive map bytes (V = 4: one aligned word).
template <int V>
__device__ __forceinline__ uint32_t load_map_bytes(const uint8_t* p) {
  if constexpr (V == 4) {
    return __ldg(reinterpret_cast<const unsigned int*>(p));
  } else {
    return __ldg(p);
  }
}

__device__ __forceinline__ int64_t load_id(const int64_t* p) {
  return __ldg(reinterpret_cast<const long long*>(p));
}

__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

// Whether a later lane of this lane's segment (`width` lanes, a power of two; `pos` = this lane's
// place in it) holds the same key. Keys of different segments never compare. Up to 16 lanes this
// takes width - 1 shuffles; __match_any_sync over 32 distinct keys cost the kernel 40% of its time
// (70 -> 43 us at 4096 tokens, R = 8, 16 blocks).
__device__ __forceinline__ bool later_lane_has_key(unsigned key, int width, int pos) {
  if (width > 16) return (__match_any_sync(kFullMask, key) >> (threadIdx.x & 31)) > 1u;
  bool found = false;
#pragma unroll
  for (int d = 1; d < 16; ++d) {
    if (d >= width) break;  // warp-uniform
    const unsigned other = __shfl_down_sync(kFullMask, key, d, width);
    found |= pos + d < width && other == key;
  }
  return found;
}

template <int V>
__device__ __forceinline__ void store_vec(int32_t* p, const int (&v)[V]) {
  if constexpr (V == 4) {
    *reinterpret_cast<int4*>(p) = make_int4(v[0], v[1], v[2], v[3]);
  } else {
    *p = v[0];
  }
}

template <int V>
__device__ __forceinline__ void store_vec(float* p, const float (&v)[V]) {
  if constexpr (V == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    *p = v[0];
  }
}

// ---- lane shapes --------------------------------------------------------------------------------

// Column lanes: a step covers `rows` consecutive tokens; lane = (row r, column vector qi). Vector
// q = g * lpr + qi of group g holds the rank's columns [q * V, q * V + V). Masks are over the warp.
template <int V, int G>
struct ColumnLanes {
  int vecs;              // column vectors per token: L / V
  int lpr;               // lanes per row: next power of two >= vecs, at most 32
  int rows;              // tokens per step: 32 / lpr
  int r, qi;             // this lane
  unsigned same_column;  // lanes holding this lane's column vector (one per row)
  unsigned same_row;     // lanes of this lane's row
  unsigned row_leaders;  // lane qi == 0 of every row
  unsigned rows_before;  // lanes of rows < r

  __device__ ColumnLanes(int L, int lane) {
    vecs = L / V;
    lpr = vecs >= 32 ? 32 : next_pow2(vecs);
    rows = 32 / lpr;
    r = lane / lpr;
    qi = lane % lpr;
    row_leaders = lpr == 32 ? 1u : kFullMask / ((1u << lpr) - 1u);  // bit 0 of every lpr-bit field
    same_column = row_leaders << qi;
    same_row = lpr == 32 ? kFullMask : ((1u << lpr) - 1u) << (r * lpr);
    rows_before = (1u << (r * lpr)) - 1u;  // r * lpr <= 32 - lpr
  }
  __device__ int vec(int g) const { return g * lpr + qi; }
};

// Id lanes: a step covers `rows` tokens; lane = (row r, top-k slot). K > 32: one token per step,
// its slots in rounds of 32.
struct IdLanes {
  int lpr, rows, r, slot;
  unsigned same_row;
  __device__ IdLanes(int K, int lane) {
    lpr = K >= 32 ? 32 : next_pow2(K);
    rows = 32 / lpr;
    r = lane / lpr;
    slot = lane % lpr;
    same_row = lpr == 32 ? kFullMask : ((1u << lpr) - 1u) << (r * lpr);
  }
};

// Running offsets of one warp for the lane's columns and for the rank column.
template <int V, int G>
struct Runs {
  int column[G][V];
  int rank;
};

// ---- pass A: counting -----------------------------------------------------------------------------

// Sum per-lane column counts over the rows of a step, then add them (and the rank column's count,
// held by row leaders) to totals[0..L] in shared memory.
template <int V, int G>
__device__ __forceinline__ void add_counts(const ColumnLanes<V, G>& lanes, int (&count)[G][V], int rank_count, int L,
                                           int* totals) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int v = 0; v < V; ++v) {
      int c = count[g][v];
      for (int offset = lanes.lpr; offset < 32; offset <<= 1) c += __shfl_xor_sync(kFullMask, c, offset);
      const int q = lanes.vec(g);
      if (lanes.r == 0 && q < lanes.vecs && c != 0) atomicAdd(&totals[q * V + v], c);
    }
  }
  rank_count = __reduce_add_sync(kFullMask, rank_count);
  if ((threadIdx.x & 31) == 0 && rank_count != 0) atomicAdd(&totals[L], rank_count);
}

// Routing map: the map bytes of kUnroll rows of column lanes starting at token s (0 past `end`), all
// loads issued before any is used.
template <int kUnroll, int V, int G>
__device__ __forceinline__ void load_map_step(const uint8_t* columns, int64_t E, const ColumnLanes<V, G>& lanes,
                                              int s, int end, uint32_t (&word)[kUnroll][G]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int t = s + u * lanes.rows + lanes.r;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int q = lanes.vec(g);
      word[u][g] = t < end && q < lanes.vecs ? load_map_bytes<V>(columns + t * E + q * V) : 0u;
    }
  }
}

// Routing map: count the columns of rank p (and its rank column) over tokens [begin, end).
template <int V, int G>
__device__ void count_map(const LayoutArgs& a, int p, const ColumnLanes<V, G>& lanes, int begin, int end,
                          int* totals) {
  constexpr int kUnroll = V == 1 && G > 1 ? 8 / G : 16 / G;  // loads in flight per lane (no spills)
  const int L = a.num_local_experts;
  const int64_t E = static_cast<int64_t>(a.num_ranks) * L;
  const uint8_t* columns = a.routing_map + static_cast<int64_t>(p) * L;
  int count[G][V] = {};
  int rank_count = 0;
  for (int s = begin; s < end; s += lanes.rows * kUnroll) {
    uint32_t word[kUnroll][G];
    load_map_step(columns, E, lanes, s, end, word);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      bool any = false;
#pragma unroll
      for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const bool chosen = byte_set(word[u][g], v);
          count[g][v] += chosen;
          any |= chosen;
        }
      }
      const bool row_any = (__ballot_sync(kFullMask, any) & lanes.same_row) != 0;
      rank_count += lanes.qi == 0 && row_any;
    }
  }
  add_counts(lanes, count, rank_count, L, totals);
}

// Top-k ids: count rank p's experts (and its rank column) over tokens [begin, end). A token naming
// an expert twice counts it once. Returns this lane's input flags: kInputIdOutOfRange for an id
// outside -1 and [0, E), kInputIdRepeated for a slot naming one of p's experts that a later slot of
// the same token names again. warm_probs: prefetch the probs of these slots into L1 for pass B.
__device__ int count_topk(const LayoutArgs& a, int p, const IdLanes& lanes, int begin, int end, int* totals,
                           unsigned* bits, bool warm_probs) {
  const int K = a.topk, L = a.num_local_experts, lane = threadIdx.x & 31;
  const int64_t E = static_cast<int64_t>(a.num_ranks) * L;
  const int64_t first = static_cast<int64_t>(p) * L;  // rank p's first expert
  bool bad = false, repeated = false;
  int rank_count = 0;
  if (K <= 32) {
    constexpr int kUnroll = 8;
    for (int s = begin; s < end; s += lanes.rows * kUnroll) {
      int64_t id[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int t = s + u * lanes.rows + lanes.r;
        const bool valid = t < end && lanes.slot < K;
        const int64_t at = static_cast<int64_t>(t) * K + lanes.slot;
        id[u] = valid ? load_id(a.topk_idx + at) : -1;
        if (warm_probs && valid) prefetch_l1(a.probs + at);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        bad |= id[u] < -1 || id[u] >= E;
        const int64_t c = id[u] - first;
        const bool hit = c >= 0 && c < L;
        // Only the last slot naming an expert counts; keys never match across rows or misses.
        const unsigned key = hit ? static_cast<unsigned>(lanes.r * kMaxLocalExperts + c) : 0x10000u + lane;
        const bool named_later = later_lane_has_key(key, lanes.lpr, lanes.slot);
        if (hit && !named_later) atomicAdd(&totals[c], 1);
        repeated |= hit && named_later;
        const bool row_any = (__ballot_sync(kFullMask, hit) & lanes.same_row) != 0;
        rank_count += lanes.slot == 0 && row_any;
      }
    }
  } else {  // K > 32 (rare): one token at a time, duplicates caught in a per-warp bitmap of L bits
    for (int t = begin; t < end; ++t) {
      bool any = false;
      for (int k0 = 0; k0 < K; k0 += 32) {
        const int k = k0 + lane;
        const int64_t at = static_cast<int64_t>(t) * K + k;
        const int64_t id = k < K ? load_id(a.topk_idx + at) : -1;
        if (warm_probs && k < K) prefetch_l1(a.probs + at);
        bad |= id < -1 || id >= E;
        const int64_t c = id - first;
        const bool hit = c >= 0 && c < L;
        if (hit) {
          const unsigned bit = 1u << (c & 31);
          if ((atomicOr(&bits[c >> 5], bit) & bit) == 0) {
            atomicAdd(&totals[c], 1);
          } else {
            repeated = true;
          }
        }
        any |= __any_sync(kFullMask, hit);
      }
      __syncwarp();
      if (lane < kTileEntries / 32) bits[lane] = 0u;
      __syncwarp();
      rank_count += lane == 0 && any;
    }
  }
  rank_count = __reduce_add_sync(kFullMask, rank_count);
  if (lane == 0 && rank_count != 0) atomicAdd(&totals[L], rank_count);
  return (bad ? kInputIdOutOfRange : 0) | (repeated ? kInputIdRepeated : 0);
}

// ---- pass B: writing ------------------------------------------------------------------------------

// One step of column lanes (this lane's token t): write k_index (and dense_probs) for the lane's
// columns and send_slot for the row, advancing the warp's runs. Every lane of the warp calls it.
template <int V, int G>
__device__ __forceinline__ void write_step(const LayoutArgs& a, int p, const ColumnLanes<V, G>& lanes,
                                           Runs<V, G>& runs, int t, bool valid, const bool (&chosen)[G][V],
                                           const float (&prob)[G][V]) {
  const int L = a.num_local_experts;
  const unsigned below = lanes_below(threadIdx.x & 31);
  int k[G][V];
  bool any = false;
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const unsigned column = __ballot_sync(kFullMask, chosen[g][v]) & lanes.same_column;
      k[g][v] = chosen[g][v] ? runs.column[g][v] + __popc(column & below) : -1;
      runs.column[g][v] += __popc(column);
      any |= chosen[g][v];
    }
  }
  const bool row_any = (__ballot_sync(kFullMask, any) & lanes.same_row) != 0;
  const unsigned sent = __ballot_sync(kFullMask, row_any) & lanes.row_leaders;
  const int slot = runs.rank + __popc(sent & lanes.rows_before);
  runs.rank += __popc(sent);
  if (!valid) return;
  const int64_t row = static_cast<int64_t>(t) * a.num_ranks * L + static_cast<int64_t>(p) * L;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int q = lanes.vec(g);
    if (q >= lanes.vecs) continue;
    store_vec<V>(a.k_index + row + q * V, k[g]);
    if (a.dense_probs != nullptr) {
      float value[V];
#pragma unroll
      for (int v = 0; v < V; ++v) value[v] = chosen[g][v] ? prob[g][v] : 0.0f;
      store_vec<V>(a.dense_probs + row + q * V, value);
    }
  }
  if (lanes.qi == 0) a.send_slot[static_cast<int64_t>(t) * a.num_ranks + p] = row_any ? slot : -1;
}

// Routing map: write this warp's run [begin, end) (its map bytes are in L1 since pass A).
template <int V, int G>
__device__ void write_map(const LayoutArgs& a, int p, const ColumnLanes<V, G>& lanes, Runs<V, G>& runs, int begin,
                          int end) {
  constexpr int kUnroll = G >= 4 ? 1 : 4 / G;
  const int64_t E = static_cast<int64_t>(a.num_ranks) * a.num_local_experts;
  const uint8_t* columns = a.routing_map + static_cast<int64_t>(p) * a.num_local_experts;
  for (int s = begin; s < end; s += lanes.rows * kUnroll) {
    uint32_t word[kUnroll][G];
    load_map_step(columns, E, lanes, s, end, word);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = s + u * lanes.rows + lanes.r;
      bool chosen[G][V];
      float prob[G][V];
#pragma unroll
      for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
          chosen[g][v] = byte_set(word[u][g], v);
          prob[g][v] = 0.0f;
        }
      }
      write_step(a, p, lanes, runs, t, t < end, chosen, prob);
    }
  }
}

// Top-k: write this warp's run [begin, end). Each step's ids are scattered into the warp's tile
// (entry r * L + c: bit = chosen, prob of the last slot naming c), then read in column-lane shape.
template <int V, int G>
__device__ void write_topk(const LayoutArgs& a, int p, const ColumnLanes<V, G>& lanes, Runs<V, G>& runs, int begin,
                           int end, unsigned* bits, float* tile) {
  constexpr int kUnroll = 4;
  const int K = a.topk, L = a.num_local_experts, lane = threadIdx.x & 31;
  const int64_t first = static_cast<int64_t>(p) * L;
  const bool with_probs = a.dense_probs != nullptr;
  for (int s = begin; s < end; s += lanes.rows) {
    const int t = s + lanes.r;
    const bool valid = t < end;
    // Slots k = qi + i * lpr of the lane's row, in increasing k: a later round overwrites an
    // earlier one, and within a round the highest lane naming an entry writes its prob.
    for (int i0 = 0; i0 * lanes.lpr < K; i0 += kUnroll) {
      int64_t id[kUnroll];
      float prob[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int k = lanes.qi + (i0 + j) * lanes.lpr;
        const bool in = valid && k < K;
        const int64_t at = static_cast<int64_t>(t) * K + k;
        id[j] = in ? load_id(a.topk_idx + at) : -1;
        prob[j] = in && with_probs ? __ldg(a.probs + at) : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        if ((i0 + j) * lanes.lpr >= K) break;  // warp-uniform
        const int64_t c = id[j] - first;
        const bool hit = c >= 0 && c < L;
        const int entry = lanes.r * L + static_cast<int>(c);
        const unsigned key = hit ? static_cast<unsigned>(entry) : 0x10000u + lane;
        const bool named_later = later_lane_has_key(key, lanes.lpr, lanes.qi);
        if (hit) {
          atomicOr(&bits[entry >> 5], 1u << (entry & 31));
          if (with_probs && !named_later) tile[entry] = prob[j];
        }
        __syncwarp();
      }
    }
    bool chosen[G][V];
    float prob[G][V];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int q = lanes.vec(g);
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const int entry = lanes.r * L + q * V + v;
        chosen[g][v] = q < lanes.vecs && ((bits[entry >> 5] >> (entry & 31)) & 1u) != 0;
        prob[g][v] = chosen[g][v] && with_probs ? tile[entry] : 0.0f;
      }
    }
    write_step(a, p, lanes, runs, t, valid, chosen, prob);
    __syncwarp();
    if (lane < kTileEntries / 32) bits[lane] = 0u;
    __syncwarp();
  }
}

// ---- the kernel -------------------------------------------------------------------------------------

union CountsOrTiles {
  int counts[kLayoutWarps * kCountStride];    // pass A: per (warp, column) counts, then starting offsets
  float tiles[kLayoutWarps][kTileEntries];    // pass B, top-k: each warp's tile of probs
};

// The fused prologue (launch_layout_exchange): the last block of the launch to get here runs the
// count exchange. Every block's outputs are written and fenced before it counts itself done; the
// last one reads them past L1 (exchange_block) and puts the counter back to 0 for the next launch.
// Only that block waits (in the handshake), after every other block of the grid has finished.
__device__ __forceinline__ void exchange_if_last(const TransportView& t, const ExchangeArgs& x) {
  __shared__ int s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned blocks = gridDim.x * gridDim.y;
    s_last = atomicAdd(&t.state->layout_blocks_done, 1u) == blocks - 1 ? 1 : 0;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  if (threadIdx.x == 0) t.state->layout_blocks_done = 0;
  exchange_block(t, x);
}

// Grid (chunks, R); G = column groups of column lanes (L / V > 32 only); kExchange: the fused
// prologue (t and x are unused otherwise).
template <bool kTopk, int V, int G, bool kExchange>
__global__ void __launch_bounds__(kLayoutThreads, 1) layout_kernel(const LayoutArgs a, const TransportView t,
                                                                   const ExchangeArgs x) {
  __shared__ int s_prefix[kMaxLocalExperts + 1];  // column totals over tokens [0, t0)
  __shared__ CountsOrTiles s;
  __shared__ unsigned s_bits[kLayoutWarps][kTileEntries / 32];  // top-k: per-warp chosen bits

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int T = a.num_tokens, L = a.num_local_experts, p = blockIdx.y;
  const bool last_chunk = blockIdx.x == gridDim.x - 1;
  const int stride = (L + 1) | 1;  // odd: the scan's column reads hit distinct banks
  const int chunk = ceil_div(T, gridDim.x);
  const int t0 = min(T, static_cast<int>(blockIdx.x) * chunk), t1 = min(T, t0 + chunk);

  for (int i = threadIdx.x; i <= L; i += kLayoutThreads) s_prefix[i] = 0;
  for (int i = threadIdx.x; i < kLayoutWarps * stride; i += kLayoutThreads) s.counts[i] = 0;
  if (lane < kTileEntries / 32) s_bits[warp][lane] = 0u;
  __syncthreads();

  const ColumnLanes<V, G> columns(L, lane);
  // This warp's run of the chunk (whole steps of column lanes) and its share of the recount.
  const int run = round_up(ceil_div(t1 - t0, kLayoutWarps), columns.rows);
  const int begin = min(t1, t0 + warp * run), end = min(t1, begin + run);
  const int share = round_up(ceil_div(t0, kLayoutWarps), 32);
  const int prefix_begin = min(t0, warp * share), prefix_end = min(t0, prefix_begin + share);
  int* const warp_counts = s.counts + warp * stride;

  int flags = 0;
  if constexpr (kTopk) {
    const IdLanes ids(a.topk, lane);
    flags = count_topk(a, p, ids, prefix_begin, prefix_end, s_prefix, s_bits[warp], false);
    flags |= count_topk(a, p, ids, begin, end, warp_counts, s_bits[warp], a.dense_probs != nullptr);
  } else {
    count_map(a, p, columns, prefix_begin, prefix_end, s_prefix);
    count_map(a, p, columns, begin, end, warp_counts);
  }
  __syncthreads();

  // Scan across warps, one column per warp at a time (lane = source warp): counts -> offsets.
  for (int c = warp; c <= L; c += kLayoutWarps) {
    const int n = s.counts[lane * stride + c];
    int inclusive = n;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int below = __shfl_up_sync(kFullMask, inclusive, offset);
      if (lane >= offset) inclusive += below;
    }
    const int base = s_prefix[c];
    s.counts[lane * stride + c] = base + inclusive - n;
    if (lane == 31 && last_chunk) {
      if (c < L) {
        a.expert_counts[p * L + c] = base + inclusive;
      } else {
        a.rank_counts[p] = base + inclusive;
      }
    }
  }
  __syncthreads();

  Runs<V, G> runs;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int q = columns.vec(g);
#pragma unroll
    for (int v = 0; v < V; ++v) runs.column[g][v] = q < columns.vecs ? warp_counts[q * V + v] : 0;
  }
  runs.rank = warp_counts[L];
  // Also the barrier before the top-k tiles reuse the offsets' shared memory.
  const int out_of_range = __syncthreads_or(flags & kInputIdOutOfRange);
  const int repeated = __syncthreads_or(flags & kInputIdRepeated);
  if (kTopk && a.input_flags != nullptr && last_chunk && threadIdx.x == 0) {
    const int bits = (out_of_range ? kInputIdOutOfRange : 0) | (repeated ? kInputIdRepeated : 0);
    a.input_flags[p] = bits;
    if (bits != 0 && a.flags_since_checked != nullptr) atomicOr(a.flags_since_checked, bits);
  }

  if constexpr (kTopk) {
    write_topk(a, p, columns, runs, begin, end, s_bits[warp], s.tiles[warp]);
  } else {
    write_map(a, p, columns, runs, begin, end);
  }
  if constexpr (kExchange) exchange_if_last(t, x);
}

// ---- host -------------------------------------------------------------------------------------------

void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("ep_plugin layout: ") + what);
}

int multiprocessors(int device) {
  static int cached[64] = {};  // SM count never changes; a racing first call writes the same value
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int count = 0;
  EP_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  if (device >= 0 && device < 64) cached[device] = count;
  return count;
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

void check_layout_args(const LayoutArgs& a) {
  const int T = a.num_tokens, R = a.num_ranks, L = a.num_local_experts, K = a.topk;
  require(T >= 0, "num_tokens must be >= 0");
  require(R >= 1 && R <= kMaxRanks, "num_ranks must be in [1, 32]");
  require(L >= 1 && L <= kMaxLocalExperts, "num_local_experts must be in [1, 256]");
  require(K >= 0, "topk must be >= 0 (0 = routing-map form)");
  require(a.expert_counts != nullptr && a.rank_counts != nullptr, "expert_counts and rank_counts are required");
  require(K > 0 || (a.dense_probs == nullptr && a.input_flags == nullptr),
          "dense_probs and input_flags belong to the top-k form");
  if (T > 0) {
    require(a.k_index != nullptr && a.send_slot != nullptr, "k_index and send_slot are required");
    require(K > 0 ? a.topk_idx != nullptr : a.routing_map != nullptr, "the routing input is missing");
    require(a.dense_probs == nullptr || a.probs != nullptr, "dense_probs needs probs");
  }
}

// The kernel instance and grid for `a` on `device`, launched with (t, x) for the fused prologue.
template <bool kExchange>
void launch_kernel(const LayoutArgs& a, int device, const TransportView& t, const ExchangeArgs& x, uintptr_t stream) {
  const int T = a.num_tokens, R = a.num_ranks, L = a.num_local_experts, K = a.topk;
  // Four columns per lane when every row segment is 16-byte aligned (bytes of the map: 4-byte).
  const bool vectorized = L % 4 == 0 && aligned(a.k_index, 16) && aligned(a.dense_probs, 16) &&
                          (K > 0 || aligned(a.routing_map, 4));
  const int vecs = vectorized ? L / 4 : L;
  int groups = 1;
  while (groups * 32 < vecs) groups *= 2;  // <= 2 (vectorized) or <= 8

  const DeviceScope device_scope(device);
  const int budget = a.max_blocks > 0 ? std::min(a.max_blocks, multiprocessors(device)) : multiprocessors(device);
  const int per_sm = std::max(1, budget / R);
  const int chunks = T == 0 ? 1 : std::min((T + kMinTokensPerBlock - 1) / kMinTokensPerBlock, per_sm);
  const dim3 grid(chunks, R);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  // Instances: (top-k or map) x (4 columns per lane or 1) x column groups.
  auto launch = [&](auto kernel) { kernel<<<grid, kLayoutThreads, 0, s>>>(a, t, x); };
  auto with_groups = [&](auto topk, auto v) {
    constexpr bool kTopk = decltype(topk)::value;
    constexpr int V = decltype(v)::value;
    if (groups == 1) {
      launch(layout_kernel<kTopk, V, 1, kExchange>);
    } else if (groups == 2) {
      launch(layout_kernel<kTopk, V, 2, kExchange>);
    } else if constexpr (V == 1) {
      if (groups == 4) {
        launch(layout_kernel<kTopk, V, 4, kExchange>);
      } else {
        launch(layout_kernel<kTopk, V, 8, kExchange>);
      }
    }
  };
  auto with_vectors = [&](auto topk) {
    if (vectorized) {
      with_groups(topk, std::integral_constant<int, 4>{});
    } else {
      with_groups(topk, std::integral_constant<int, 1>{});
    }
  };
  if (K > 0) {
    with_vectors(std::true_type{});
  } else {
    with_vectors(std::false_type{});
  }
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_layout(const LayoutArgs& a, int device, uintptr_t stream) {
  check_layout_args(a);
  launch_kernel<false>(a, device, TransportView{}, ExchangeArgs{}, stream);
}

void launch_layout_exchange(const SymmetricBuffer& buffer, const LayoutArgs& a, const ExchangeArgs& exchange,
                            uintptr_t stream) {
  check_layout_args(a);
  check_exchange_args(buffer, exchange);
  require(exchange.expert_counts == a.expert_counts && exchange.rank_counts == a.rank_counts &&
              exchange.input_flags == a.input_flags,
          "the fused exchange must send this layout's counts and flags");
  require(a.num_ranks == buffer.view().num_ranks, "num_ranks differs from the buffer's");
  launch_kernel<true>(a, buffer.device(), buffer.view(), exchange, stream);
}

}  // namespace ep
