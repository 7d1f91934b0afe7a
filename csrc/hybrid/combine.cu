// Combine: stage 4 on the expert side, stage 5 on the source side.
//
// combine_send: (after the handshake kernel) warp w takes received packets (r, s); the packet's
// rows (packet_rows, recorded by permute; rows past the budget were dropped and count as zero)
// are summed in fp32 in local-expert order, rounded once to bf16, and pushed to rank r's
// comb_data[this rank][s]; with row_probs, each row's scalar goes unsummed to comb_p[this rank][s].
// Each block then publishes comb_done[this rank][block] = n at every rank.
//
// combine_recv: waits for comb_done[p][b] >= n from every block of every rank p (acquire), then
// warp w takes tokens t and sums, in fp32 and rank order, the rows returned for the token by each
// rank it was sent to (send_slot), writing bf16 [T, H]; scalars land in the dense [T, E] output.
//
// In place (a buffer with a combine-input arena; each rank's op word says where its input lies in
// its arena, or that it pushed): a rank whose input is in its arena runs combine_send only when
// scalars travel (rows == null), and combine_recv reads every expert row of the token where it is:
// row peer_rows[p][j] + k_index[t][p L + j] of the input in rank p's arena; of a rank that pushed,
// it reads the partial sum instead. Ranks in rank order, local experts j in order, all summed in
// fp32 and rounded once. It waits for the ranks that ran combine_send only: for the others the
// handshake before it suffices (every rank has arrived at this op, so the rows its earlier kernels
// wrote are complete).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ep/check.cuh"
#include "ep/copy.cuh"
#include "ep/reduce.cuh"
#include "ep/region_builder.h"
#include "hybrid/regions.cuh"

namespace ep {
namespace hybrid {
namespace {

constexpr int kWarps = kThreads / 32;

__global__ void __launch_bounds__(kThreads) combine_send_kernel(TransportView t, Regions g, CombineSendArgs a) {
  __shared__ int32_t s_rows[kWarps][kMaxLocalExperts];
  const View v{t, g};
  if (block_aborted(t)) return;
  const unsigned long long seq = current_seq(t);
  const int R = v.g.num_ranks;
  const int L = v.g.num_local_experts;
  const int H = v.g.hidden;
  const int lane = threadIdx.x % 32;
  const int warp_in_block = threadIdx.x / 32;
  const int warp = blockIdx.x * kWarps + warp_in_block;
  const int warps = gridDim.x * kWarps;
  int32_t* rows = s_rows[warp_in_block];

  for (int r = 0; r < R; ++r) {
    const int packets = a.num_packets[r];
    for (int s = warp; s < packets; s += warps) {
      const int32_t* packet_rows = a.packet_rows + packet_index(v, r, s) * L;
      // Compact the packet's valid rows, in local-expert order, into shared memory.
      int count = 0;
      for (int j0 = 0; j0 < L; j0 += 32) {
        const int j = j0 + lane;
        int row = j < L ? packet_rows[j] : -1;
        const bool valid = row >= 0 && row < a.budget;
        if (j < L && a.row_probs != nullptr) comb_p(v, r, v.t.rank, s)[j] = valid ? a.row_probs[row] : 0.0f;
        const unsigned ballot = __ballot_sync(0xffffffffu, valid);
        if (valid) rows[count + __popc(ballot & ((1u << lane) - 1))] = row;
        count += __popc(ballot);
      }
      __syncwarp();
      const int4* input = static_cast<const int4*>(a.rows);
      if (input != nullptr) {
        sum_rows(reinterpret_cast<int4*>(comb_row(v, r, v.t.rank, s)), H / 8, count,
                 [=](int n) { return input + static_cast<int64_t>(rows[n]) * (H / 8); }, lane);
      }
      __syncwarp();
    }
  }
  signal_block_done(t, combine_done(v), seq);
}

// In place: the rows of a token that a warp lists in shared memory before summing them (more go
// through sum_rows_by_group, which lists none).
constexpr int kListedRows = 32;

// Warp-cooperative, in place, for a rank p the token was sent to: the address of p's row for the
// token's local experts j0 + lane (null where the token does not go to that expert, or its row fell
// past p's budget); `input_at[p]` is where p's input starts (in p's arena), or null when p pushed
// its partial sum of the token's rows (at slot `slots[p]`), which lane 0 of the first group then
// returns instead.
__device__ __forceinline__ const int4* expert_row_at(const View& v, const CombineRecvArgs& a, const char* const* input_at,
                                                     const int* slots, int token, int p, int j0, int lane) {
  const char* input = input_at[p];
  if (input == nullptr) {
    return j0 == 0 && lane == 0 ? reinterpret_cast<const int4*>(comb_row(v, v.t.rank, p, slots[p])) : nullptr;
  }
  const int L = v.g.num_local_experts;
  const int j = j0 + lane;
  if (j >= L) return nullptr;
  const int32_t* base = a.peer_rows + p * (L + 1);
  const int k = a.k_index[static_cast<int64_t>(token) * v.g.num_ranks * L + p * L + j];
  const int row = k >= 0 ? base[j] + k : -1;
  if (row < 0 || row >= base[L]) return nullptr;
  return reinterpret_cast<const int4*>(input + static_cast<int64_t>(row) * 2 * v.g.hidden);
}

// Warp-cooperative, in place: lists the token's rows (ranks in `sources` order, then local-expert
// order) in `list`, at most kListedRows of them; returns how many there are (also past the limit).
__device__ __forceinline__ int list_token_rows(const View& v, const CombineRecvArgs& a, const char* const* input_at,
                                               const int* slots, int token, unsigned sources, const int4** list,
                                               int lane) {
  int count = 0;
  for (unsigned mask = sources; mask; mask &= mask - 1) {
    const int p = __ffs(mask) - 1;
    for (int j0 = 0; j0 < v.g.num_local_experts; j0 += 32) {
      const int4* row = expert_row_at(v, a, input_at, slots, token, p, j0, lane);
      const unsigned ballot = __ballot_sync(0xffffffffu, row != nullptr);
      const int at = count + __popc(ballot & ((1u << lane) - 1));
      if (row != nullptr && at < kListedRows) list[at] = row;
      count += __popc(ballot);
    }
  }
  return count;
}

// Warp-cooperative, in place, for a token with more than kListedRows rows: the same sums in the
// same order, with no list: the hidden words in warp-uniform steps, and in each step the rows of
// one group of 32 local experts at a time, their addresses shuffled from the lanes that found them.
__device__ void sum_rows_by_group(const View& v, const CombineRecvArgs& a, const char* const* input_at,
                                  const int* slots, int token, unsigned sources, int4* out, int lane) {
  const int words = v.g.hidden / 8;
  for (int step = 0; step < words; step += 32 * kSumUnroll) {
    float acc[kSumUnroll][8] = {};
    for (unsigned mask = sources; mask; mask &= mask - 1) {
      const int p = __ffs(mask) - 1;
      for (int j0 = 0; j0 < v.g.num_local_experts; j0 += 32) {
        const int4* mine = expert_row_at(v, a, input_at, slots, token, p, j0, lane);
        const unsigned ballot = __ballot_sync(0xffffffffu, mine != nullptr);
        const auto address = reinterpret_cast<unsigned long long>(mine);
        add_rows(acc, step + lane, words, __popc(ballot), [=](int n) {  // n is warp-uniform here
          return reinterpret_cast<const int4*>(__shfl_sync(0xffffffffu, address, __fns(ballot, 0, n + 1)));
        });
      }
    }
    store_sums(out, acc, step + lane, words);
  }
}

// One instance per form (kInPlace: a.peer_rows given), so that each gets registers for its own loop.
template <bool kInPlace>
__global__ void __launch_bounds__(kThreads) combine_recv_kernel(TransportView t, Regions g, CombineRecvArgs a) {
  __shared__ int s_slots[kWarps][kMaxRanks];
  __shared__ int s_ranks[kWarps][kMaxRanks];
  __shared__ const int4* s_listed[kWarps][kListedRows];
  __shared__ const char* s_input_at[kMaxRanks];  // in place: where rank p's input starts; null = p pushed
  const View v{t, g};
  if (block_aborted(t)) return;
  const unsigned long long seq = current_seq(t);
  constexpr bool in_place = kInPlace;
  unsigned senders = a.wait_for_send ? 0xffffffffu : 0u;  // ranks whose combine_send this waits for
  if constexpr (in_place) {
    for (int p = threadIdx.x; p < v.g.num_ranks; p += blockDim.x) {
      const int32_t word = op_word(t, seq, p);
      s_input_at[p] = word == kCombinePushed ? nullptr : region(v, p, v.g.off_comb_input) + static_cast<int64_t>(word) * 16;
    }
    __syncthreads();
    senders = 0;
    for (int p = 0; p < v.g.num_ranks; ++p) {
      if (s_input_at[p] == nullptr || a.out_probs != nullptr) senders |= 1u << p;
    }
  }
  if (senders && !wait_all_blocks(t, combine_done(v), seq, gridDim.x, kPhaseCombineReceive, senders)) return;
  const int R = v.g.num_ranks;
  const int L = v.g.num_local_experts;
  const int E = R * L;
  const int H = v.g.hidden;
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * kWarps;
  int* slots = s_slots[threadIdx.x / 32];
  int* ranks = s_ranks[threadIdx.x / 32];
  const int4** listed = s_listed[threadIdx.x / 32];
  for (int t = blockIdx.x * kWarps + threadIdx.x / 32; t < a.num_tokens; t += warps) {
    const int my_slot = lane < R ? a.send_slot[static_cast<int64_t>(t) * R + lane] : -1;
    const unsigned sources = __ballot_sync(0xffffffffu, my_slot >= 0);
    int4* out_row = static_cast<int4*>(a.out) + static_cast<int64_t>(t) * (H / 8);
    // Every lane needs every rank's slot: stage them in shared memory (lanes may leave the hidden
    // loop at different times, so no shuffles inside it).
    if (lane < R) slots[lane] = my_slot;
    __syncwarp();
    if constexpr (in_place) {
      const int count = list_token_rows(v, a, s_input_at, slots, t, sources, listed, lane);
      __syncwarp();
      if (count <= kListedRows) {
        sum_rows(out_row, H / 8, count, [=](int n) { return listed[n]; }, lane);
      } else {
        sum_rows_by_group(v, a, s_input_at, slots, t, sources, out_row, lane);
      }
    } else {
      // Rank order of the sum: the n-th set bit of `sources`.
      if (lane == 0) {
        int n = 0;
        for (unsigned mask = sources; mask; mask &= mask - 1) ranks[n++] = __ffs(mask) - 1;
      }
      __syncwarp();
      sum_rows(out_row, H / 8, __popc(sources),
               [=](int n) { return reinterpret_cast<const int4*>(comb_row(v, v.t.rank, ranks[n], slots[ranks[n]])); },
               lane);
    }
    if (a.out_probs != nullptr) {
      for (unsigned mask = sources; mask; mask &= mask - 1) {
        const int p = __ffs(mask) - 1;
        const int slot = __shfl_sync(0xffffffffu, my_slot, p);
        const int64_t base = static_cast<int64_t>(t) * E + p * L;
        for (int j = lane; j < L; j += 32) {
          if (a.k_index[base + j] >= 0) a.out_probs[base + j] = comb_p(v, v.t.rank, p, slot)[j];
        }
      }
    }
    __syncwarp();
  }
}

}  // namespace

void launch_combine_send(const SymmetricBuffer& buffer, const Regions& regions, const CombineSendArgs& args, int num_blocks, uintptr_t stream) {
  check_launch_fits("hybrid", regions, num_blocks);
  const DeviceScope device_scope(buffer.device());
  const TransportView& view = buffer.view();  // (it throws once destroyed: not inside the launch's arguments)
  combine_send_kernel<<<num_blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(view, regions, args);
  EP_CUDA_CHECK(cudaGetLastError());
}

void launch_combine_recv(const SymmetricBuffer& buffer, const Regions& regions, const CombineRecvArgs& args, int num_blocks, uintptr_t stream) {
  if (args.peer_rows != nullptr && regions.combine_input_bytes == 0)
    throw std::invalid_argument("ep_plugin hybrid: an in-place combine needs a buffer with combine_input_bytes > 0");
  if (args.peer_rows == nullptr && args.out_probs != nullptr && !args.wait_for_send)
    throw std::invalid_argument("ep_plugin hybrid: scalars routed back need combine_send (wait_for_send)");
  check_launch_fits("hybrid", regions, num_blocks, args.num_tokens);
  const DeviceScope device_scope(buffer.device());
  const TransportView& view = buffer.view();  // (it throws once destroyed: not inside the launch's arguments)
  const auto kernel = args.peer_rows != nullptr ? combine_recv_kernel<true> : combine_recv_kernel<false>;
  kernel<<<num_blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(view, regions, args);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace hybrid
}  // namespace ep
