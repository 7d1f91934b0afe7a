// Transport: the per-rank communication buffer (cudaMalloc), its CUDA IPC handle, the peer
// pointer table on the device, the rank-private device state and the mapped host report.
// No kernels here; everything is set up once per backend and torn down by destroy().
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>

#include "ep/check.cuh"
#include "ep/hybrid.h"

namespace ep {
namespace {

int64_t align_up(int64_t value, int64_t alignment) { return (value + alignment - 1) / alignment * alignment; }

BufferLayout make_layout(int num_ranks, int max_tokens, int hidden, int num_local_experts, int max_blocks) {
  BufferLayout l{};
  l.num_ranks = num_ranks;
  l.max_tokens = max_tokens;
  l.num_local_experts = num_local_experts;
  l.max_blocks = max_blocks;
  l.hidden = hidden;
  l.slot_bytes = align_up(2LL * hidden, 16);  // bf16 row; an fp8 row + its scales is smaller
  const int64_t R = num_ranks, T = max_tokens, L = num_local_experts;
  int64_t offset = 0;
  auto take = [&offset](int64_t bytes) {
    const int64_t at = offset;
    offset = align_up(offset + bytes, 256);
    return at;
  };
  l.off_arrive = take(R * 8);
  l.off_counts = take(2 * R * (L + 1) * 4);
  l.off_disp_done = take(R * max_blocks * 8);
  l.off_comb_done = take(R * max_blocks * 8);
  l.off_disp_stage = take(T * l.slot_bytes);
  l.off_disp_token = take(R * T * 4);
  l.off_disp_k = take(R * T * L * 4);
  l.off_disp_p = take(R * T * L * 4);
  l.off_comb_data = take(R * T * 2LL * hidden);
  l.off_comb_p = take(R * T * L * 4);
  l.total_bytes = offset;
  return l;
}

}  // namespace

Buffer::Buffer(int device, int rank, int num_ranks, int max_tokens, int hidden, int num_local_experts,
               int max_blocks, double timeout_s)
    : device_(device) {
  if (num_ranks < 1 || num_ranks > kMaxRanks) throw std::invalid_argument("ep_plugin: num_ranks must be in [1, 32]");
  if (rank < 0 || rank >= num_ranks) throw std::invalid_argument("ep_plugin: rank out of range");
  if (num_local_experts < 1 || num_local_experts > kMaxLocalExperts)
    throw std::invalid_argument("ep_plugin: num_local_experts must be in [1, 256]");
  if (hidden < 8 || hidden % 8) throw std::invalid_argument("ep_plugin: hidden must be a positive multiple of 8");
  if (max_tokens < 1 || max_blocks < 1) throw std::invalid_argument("ep_plugin: max_tokens and max_blocks >= 1");
  EP_CUDA_CHECK(cudaSetDevice(device));
  int major = 0;
  EP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  bulk_capable_ = major >= 9;
  view_.layout = make_layout(num_ranks, max_tokens, hidden, num_local_experts, max_blocks);
  view_.rank = rank;
  try {
    EP_CUDA_CHECK(cudaMalloc(&local_, view_.layout.total_bytes));
    // Flags start at 0 (no op has sequence 0); data regions need no initialisation.
    EP_CUDA_CHECK(cudaMemset(local_, 0, view_.layout.off_disp_stage));
    EP_CUDA_CHECK(cudaMalloc(&peer_table_, sizeof(char*) * num_ranks));
    EP_CUDA_CHECK(cudaMalloc(&state_, sizeof(RankState)));
    EP_CUDA_CHECK(cudaMemset(state_, 0, sizeof(RankState)));
    EP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&report_), sizeof(TimeoutReport),
                                cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(const_cast<TimeoutReport*>(report_), 0, sizeof(TimeoutReport));
    TimeoutReport* report_device = nullptr;
    EP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&report_device), report_, 0));
    EP_CUDA_CHECK(cudaDeviceSynchronize());
    view_.local = local_;
    view_.peers = peer_table_;
    view_.state = state_;
    view_.report = report_device;
    set_timeout(timeout_s);
  } catch (...) {
    destroy();
    throw;
  }
}

Buffer::~Buffer() {
  try {
    destroy();
  } catch (...) {
    // Never throw from a destructor; destroy() reports errors when called explicitly.
  }
}

void Buffer::set_timeout(double timeout_s) {
  view_.timeout_ns = static_cast<unsigned long long>(timeout_s * 1e9);
}

std::string Buffer::ipc_handle() const {
  if (destroyed_) throw std::runtime_error("ep_plugin: buffer already destroyed");
  EP_CUDA_CHECK(cudaSetDevice(device_));
  cudaIpcMemHandle_t handle;
  EP_CUDA_CHECK(cudaIpcGetMemHandle(&handle, local_));
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void Buffer::open_peers(const std::vector<std::string>& handles) {
  const int R = view_.layout.num_ranks;
  if (static_cast<int>(handles.size()) != R) throw std::invalid_argument("ep_plugin: open_peers needs one handle per rank");
  if (!opened_.empty()) throw std::runtime_error("ep_plugin: peers already opened");
  EP_CUDA_CHECK(cudaSetDevice(device_));
  std::vector<char*> table(R, nullptr);
  for (int r = 0; r < R; ++r) {
    if (r == view_.rank) {
      table[r] = local_;
      continue;
    }
    if (handles[r].size() != sizeof(cudaIpcMemHandle_t)) throw std::invalid_argument("ep_plugin: bad IPC handle size");
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, handles[r].data(), sizeof(handle));
    void* pointer = nullptr;
    EP_CUDA_CHECK(cudaIpcOpenMemHandle(&pointer, handle, cudaIpcMemLazyEnablePeerAccess));
    table[r] = static_cast<char*>(pointer);
    opened_.push_back(table[r]);
  }
  EP_CUDA_CHECK(cudaMemcpy(peer_table_, table.data(), sizeof(char*) * R, cudaMemcpyHostToDevice));
}

void Buffer::destroy() {
  if (destroyed_) return;
  destroyed_ = true;
  cudaSetDevice(device_);
  // Errors are collected so every resource is released; the first one is raised.
  cudaError_t first = cudaSuccess;
  auto keep = [&first](cudaError_t status) {
    if (first == cudaSuccess && status != cudaSuccess) first = status;
  };
  keep(cudaDeviceSynchronize());
  for (char* pointer : opened_) keep(cudaIpcCloseMemHandle(pointer));
  opened_.clear();
  if (local_) keep(cudaFree(local_));
  if (peer_table_) keep(cudaFree(peer_table_));
  if (state_) keep(cudaFree(state_));
  if (report_) keep(cudaFreeHost(const_cast<TimeoutReport*>(report_)));
  local_ = nullptr;
  peer_table_ = nullptr;
  state_ = nullptr;
  report_ = nullptr;
  EP_CUDA_CHECK(first);
}

std::vector<long long> Buffer::timeout_report() const {
  if (report_ == nullptr || report_->flag == 0) return {0};
  return {1, report_->rank, report_->phase, report_->peer, static_cast<long long>(report_->expected),
          static_cast<long long>(report_->seen), static_cast<long long>(report_->waited_ns)};
}

}  // namespace ep
