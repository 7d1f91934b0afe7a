// The op prologue both backends share: handshake, and for a first dispatch the count exchange.
//
// Data flow: one block. Thread 0 advances the rank's op sequence number n (device-resident, so
// graph replays advance it too). For a dispatch, the block first writes this rank's count words
// for destination p into p's counts slot [n % 2][this rank] (another op may write one op word
// there instead: where its combine input lies, say); then the handshake publishes the op
// fingerprint and arrive = n into every rank p (release, system scope) and waits for every
// rank's arrival at n in the own buffer (acquire), comparing fingerprints. Having arrived, a rank
// has finished every earlier kernel on its stream, so its receive regions are free for op n and it
// no longer reads peers' staged tokens: the data kernels that follow write into peers (and into
// the own regions) without further checks. With counts, the block then derives this rank's
// receive layout: per local expert a segment padded to pad_multiple, and within it the rows of
// source 0, 1, ... in that order; the totals also go to the host mailbox (blocking mode reads them
// after an event wait), with every rank's input flags (pushed with the counts): the host refuses a
// dispatch that any rank flagged, on every rank alike. With W >= L + 4 the count words also carry
// each rank's receive budget and pad_multiple, and (when asked) the block derives peer_row_base:
// where this rank's tokens land in every peer's output, from the counts every rank wrote into
// that peer's buffer (visible here: each rank wrote them before publishing its arrival, which
// this rank has seen).
//
// Waits on: arrive[p] for every rank p (timeout or fingerprint mismatch -> report + abort).
#include <cuda_runtime.h>

#include "ep/check.cuh"
#include "ep/exchange.cuh"
#include "ep/transport.h"

namespace ep {
namespace {

constexpr int kExchangeThreads = 256;

__global__ void __launch_bounds__(kExchangeThreads) exchange_kernel(TransportView t, ExchangeArgs a) {
  exchange_block(t, a);
}

}  // namespace

void check_exchange_args(const SymmetricBuffer& buffer, const ExchangeArgs& args) {
  if (args.publish_op_word && (args.expert_counts != nullptr || buffer.view().sync.count_words < 1))
    throw std::invalid_argument("ep_plugin: exchange: an op word needs a handshake without counts and count words");
  if (args.expert_counts != nullptr) {
    const int L = args.num_local_experts;
    if (L < 1 || L > kMaxLocalExperts || L + 2 > buffer.view().sync.count_words)
      throw std::invalid_argument("ep_plugin: exchange: num_local_experts out of range for this buffer");
    if (args.pad_multiple < 1) throw std::invalid_argument("ep_plugin: exchange: pad_multiple must be >= 1");
    if (args.peer_row_base && buffer.view().sync.count_words < count_words_with_budget(L))
      throw std::invalid_argument("ep_plugin: exchange: peer_row_base needs count words for the budget");
    if (!args.rank_counts || !args.row_base || !args.expert_start || !args.tokens_per_expert ||
        !args.real_per_expert || !args.num_packets || !args.total_rows)
      throw std::invalid_argument("ep_plugin: exchange: a count output is missing");
  }
}

void launch_exchange(const SymmetricBuffer& buffer, const ExchangeArgs& args, uintptr_t stream) {
  check_exchange_args(buffer, args);
  const DeviceScope device_scope(buffer.device());
  const TransportView& view = buffer.view();  // (it throws once destroyed: not inside the launch's arguments)
  exchange_kernel<<<1, kExchangeThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(view, args);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep
