// Elastic combine: stage 4 on the expert side, stage 5 on the source side.
//
// combine_send: (after the handshake kernel) warp w takes received packets q = (r, s) in the
// order of the dispatch. Compact form: the packet's row is row q. Expanded form: its rows are
// packet_rows[q][j] for its valid slots j, summed in fp32 in slot order. The result is rounded once
// to bf16 and pushed to rank r's comb_data[this rank][s]. Per-slot values (the gradient of the
// dispatched weights) go unsummed to comb_w[this rank][s][j]: compact rows carry k of them, expanded
// rows one each. Each block then publishes comb_done[this rank][block] = n at every rank.
//
// With rows == null (in place), combine_send pushes only the per-slot values: the expert rank's
// rows are already in its comb_data, in the compact order, where the sources read them.
//
// combine_recv: waits for comb_done[p][b] >= n from every block of every rank p (acquire), then
// warp w takes tokens t and sums, in fp32 and rank order, the rows returned for the token by each
// rank it was sent to (send_slot), plus the bias row when given, writing bf16 [T, H]. Slot j of the
// token gets the value its expert's rank returned (0 for -1, out-of-range and repeated ids).
// In place, the row of (token, rank p) is p's comb_data row dest_base[p] + slot; without values
// to wait for, the handshake kernel before this one is the only sync: every rank has arrived at
// this op, so its rows (written by its earlier kernels) are complete.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "elastic/regions.cuh"
#include "ep/check.cuh"
#include "ep/copy.cuh"
#include "ep/pipeline.cuh"
#include "ep/reduce.cuh"
#include "ep/region_builder.h"

namespace ep {
namespace elastic {
namespace {

constexpr int kWarps = kThreads / 32;

__global__ void __launch_bounds__(kThreads) combine_send_kernel(TransportView t, Regions g, CombineSendArgs a) {
  __shared__ int32_t s_rows[kWarps][kMaxTopk];
  __shared__ int s_prefix[kMaxRanks + 1];
  const View v{t, g};
  if (block_aborted(t)) return;
  const unsigned long long seq = current_seq(t);
  const int R = v.g.num_ranks;
  const int H = v.g.hidden;
  const int me = v.t.rank;
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * kWarps;
  int32_t* rows = s_rows[threadIdx.x / 32];
  packet_prefix(R, a.num_packets, s_prefix);
  const int4* input = static_cast<const int4*>(a.rows);
  for (int q = blockIdx.x * kWarps + threadIdx.x / 32; q < s_prefix[R]; q += warps) {
    const int r = source_of(R, s_prefix, q);
    const int s = q - s_prefix[r];
    int count = 1;
    if (a.packet_rows == nullptr) {  // compact
      if (lane == 0) rows[0] = q;
      if (a.slot_values != nullptr && lane < a.topk) {
        comb_w(v, r, me, s)[lane] = a.slot_values[static_cast<int64_t>(q) * a.topk + lane];
      }
    } else {  // expanded: the packet's valid rows, in slot order
      const int row = lane < a.topk ? a.packet_rows[static_cast<int64_t>(q) * a.topk + lane] : -1;
      const bool valid = row >= 0;
      if (a.slot_values != nullptr && lane < a.topk) comb_w(v, r, me, s)[lane] = valid ? a.slot_values[row] : 0.0f;
      const unsigned ballot = __ballot_sync(0xffffffffu, valid);
      if (valid) rows[__popc(ballot & ((1u << lane) - 1))] = row;
      count = __popc(ballot);
    }
    __syncwarp();
    if (input != nullptr) {
      sum_rows(reinterpret_cast<int4*>(comb_row(v, r, me, s)), H / 8, count,
               [=](int n) { return input + static_cast<int64_t>(rows[n]) * (H / 8); }, lane);
    }
    __syncwarp();
  }
  signal_block_done(t, combine_done(v), seq);
}

__global__ void __launch_bounds__(kThreads) combine_recv_kernel(TransportView t, Regions g, CombineRecvArgs a) {
  __shared__ int s_slots[kWarps][kMaxRanks];
  __shared__ int s_ranks[kWarps][kMaxRanks];
  __shared__ int s_dest_base[kMaxRanks];
  const View v{t, g};
  if (block_aborted(t)) return;
  const unsigned long long seq = current_seq(t);
  if (a.wait_for_send && !wait_all_blocks(t, combine_done(v), seq, gridDim.x, kPhaseCombineReceive)) return;
  const bool in_place = a.dest_base != nullptr;
  if (in_place && static_cast<int>(threadIdx.x) < v.g.num_ranks) s_dest_base[threadIdx.x] = a.dest_base[threadIdx.x];
  __syncthreads();
  const int R = v.g.num_ranks;
  const int L = v.g.num_local_experts;
  const int H = v.g.hidden;
  const int me = v.t.rank;
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * kWarps;
  int* slots = s_slots[threadIdx.x / 32];
  int* ranks = s_ranks[threadIdx.x / 32];
  const int4* bias = static_cast<const int4*>(a.bias);
  for (int token = blockIdx.x * kWarps + threadIdx.x / 32; token < a.num_tokens; token += warps) {
    const int my_slot = lane < R ? a.send_slot[static_cast<int64_t>(token) * R + lane] : -1;
    const unsigned sources = __ballot_sync(0xffffffffu, my_slot >= 0);
    // Every lane needs every rank's slot: stage them in shared memory (lanes may leave the hidden
    // loop at different times, so no shuffles inside it).
    if (lane < R) slots[lane] = my_slot;
    __syncwarp();
    if (lane == 0) {  // rank order of the sum: the n-th set bit of `sources`
      int n = 0;
      for (unsigned mask = sources; mask; mask &= mask - 1) ranks[n++] = __ffs(mask) - 1;
    }
    __syncwarp();
    const int count = __popc(sources);
    // The bias, when given, is one more row of the sum (added last).
    sum_rows(static_cast<int4*>(a.out) + static_cast<int64_t>(token) * (H / 8), H / 8, count + (bias != nullptr ? 1 : 0),
             [=](int n) {
               if (n == count) return bias + static_cast<int64_t>(token) * (H / 8);
               const int p = ranks[n];
               return reinterpret_cast<const int4*>(in_place ? combine_input_row(v, p, s_dest_base[p] + slots[p])
                                                             : comb_row(v, me, p, slots[p]));
             },
             lane);
    if (a.out_topk_values != nullptr) {
      const int64_t at = static_cast<int64_t>(token) * a.topk + lane;
      const long long id = lane < a.topk ? a.topk_idx[at] : -1;
      bool valid = id >= 0 && id < static_cast<long long>(R) * L;
      const unsigned same = __match_any_sync(0xffffffffu, valid ? static_cast<int>(id) : -1 - lane);
      if (valid && (same >> lane) > 1u) valid = false;  // a later slot names the same expert
      if (lane < a.topk) {
        const int owner = valid ? static_cast<int>(id) / L : 0;
        const int slot = slots[owner];
        a.out_topk_values[at] = (valid && slot >= 0) ? comb_w(v, me, owner, slot)[lane] : 0.0f;
      }
    }
    __syncwarp();
  }
}

}  // namespace

void launch_combine_send(const SymmetricBuffer& buffer, const Regions& regions, const CombineSendArgs& args,
                         int num_blocks, uintptr_t stream) {
  if (args.topk < 1 || args.topk > regions.max_topk)
    throw std::invalid_argument("ep_plugin elastic: topk out of range for this buffer");
  check_launch_fits("elastic", regions, num_blocks);
  const DeviceScope device_scope(buffer.device());
  const TransportView& view = buffer.view();  // (it throws once destroyed: not inside the launch's arguments)
  combine_send_kernel<<<num_blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(view, regions,
                                                                                           args);
  EP_CUDA_CHECK(cudaGetLastError());
}

void launch_combine_recv(const SymmetricBuffer& buffer, const Regions& regions, const CombineRecvArgs& args,
                         int num_blocks, uintptr_t stream) {
  if (args.out_topk_values != nullptr && (args.topk < 1 || args.topk > regions.max_topk || !args.topk_idx))
    throw std::invalid_argument("ep_plugin elastic: routing values back needs topk_idx and a topk in range");
  check_launch_fits("elastic", regions, num_blocks, args.num_tokens);
  const DeviceScope device_scope(buffer.device());
  const TransportView& view = buffer.view();  // (it throws once destroyed: not inside the launch's arguments)
  combine_recv_kernel<<<num_blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(view, regions,
                                                                                           args);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace elastic
}  // namespace ep
