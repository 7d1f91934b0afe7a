// Transport: the per-rank symmetric buffer (cudaMalloc), its CUDA IPC handle, the peer pointer
// table on the device, the rank-private device state and the mapped host report. No kernels and
// no backend here: a backend says how many bytes its regions take and how many count words it
// exchanges; everything is set up once per backend and torn down by destroy().
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "ep/check.cuh"
#include "ep/copy.cuh"
#include "ep/region_builder.h"
#include "ep/transport.h"

namespace ep {
namespace {

constexpr int64_t kPageBytes = 2LL << 20;  // the GPU's large page

SyncLayout make_sync_layout(int num_ranks, int count_words) {
  SyncLayout s{};
  s.num_ranks = num_ranks;
  s.count_words = count_words;
  const int64_t R = num_ranks;
  RegionBuilder regions;
  s.off_arrive = regions.take(R * 8);
  s.off_fingerprint = regions.take(2 * R * 8);
  s.off_counts = regions.take(2 * R * static_cast<int64_t>(count_words) * 4);
  s.bytes = regions.size();
  return s;
}

// A stream of the buffer's own for its setup copies, waited for alone: a device-wide synchronize, or the
// legacy default stream, would also wait (with no timeout) for every other kernel of the process, a
// collective stuck on a dead peer, say; and a plain cudaMemcpy from pageable memory may return before
// its copy reached the device, where a kernel on a non-blocking stream would not wait for it.
struct PrivateStream {
  cudaStream_t stream = nullptr;
  PrivateStream() { EP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)); }
  ~PrivateStream() {
    if (cudaStreamDestroy(stream) != cudaSuccess) (void)cudaGetLastError();  // not left for the next launch
  }
  PrivateStream(const PrivateStream&) = delete;
  PrivateStream& operator=(const PrivateStream&) = delete;
  void wait() const { EP_CUDA_CHECK(cudaStreamSynchronize(stream)); }
};

}  // namespace

SymmetricBuffer::SymmetricBuffer(int device, int rank, int num_ranks, int64_t region_bytes, int count_words,
                                 double timeout_s)
    : device_(device) {
  if (num_ranks < 1 || num_ranks > kMaxRanks)
    throw std::invalid_argument("ep_plugin: num_ranks must be in [1, " + std::to_string(kMaxRanks) + "]");
  if (rank < 0 || rank >= num_ranks) throw std::invalid_argument("ep_plugin: rank out of range");
  if (region_bytes < 0 || count_words < 0) throw std::invalid_argument("ep_plugin: negative buffer size");
  const DeviceScope device_scope(device);
  int major = 0, smem_per_block = 0;
  EP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  EP_CUDA_CHECK(cudaDeviceGetAttribute(&smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  bulk_capable_ = major >= 9 && smem_per_block >= kBulkSmemBudget + kBulkStaticSmemReserve;
  view_.sync = make_sync_layout(num_ranks, count_words);
  view_.rank = rank;
  view_.num_ranks = num_ranks;
  // Round up to whole 2 MiB pages, as torch's caching allocator does. Measured on one H200 with
  // 8 ranks: stores into peers' buffers ran at 1.7 TB/s instead of 2.9 when the size was not a
  // multiple (likely the tail is mapped with small pages in the peers; benchmarks/NOTES.md,
  // eighth pass).
  total_bytes_ = align_up(view_.sync.bytes + align_up(region_bytes, 256), kPageBytes);
  try {
    EP_CUDA_CHECK(cudaMalloc(&local_, total_bytes_));
    EP_CUDA_CHECK(cudaMalloc(&peer_table_, sizeof(char*) * num_ranks));
    EP_CUDA_CHECK(cudaMalloc(&state_, sizeof(RankState)));
    // Flags start at 0 (no op has sequence 0). Backend regions are zeroed too: their flags need
    // it, and data regions do not mind.
    {
      const PrivateStream zeroing;
      EP_CUDA_CHECK(cudaMemsetAsync(local_, 0, total_bytes_, zeroing.stream));
      EP_CUDA_CHECK(cudaMemsetAsync(state_, 0, sizeof(RankState), zeroing.stream));
      zeroing.wait();
    }
    EP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&report_), sizeof(DeviceReport),
                                cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(const_cast<DeviceReport*>(report_), 0, sizeof(DeviceReport));
    DeviceReport* report_device = nullptr;
    EP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&report_device), report_, 0));
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

SymmetricBuffer::~SymmetricBuffer() {
  try {
    destroy();
  } catch (...) {
    // Never throw from a destructor; destroy() reports errors when called explicitly.
  }
}

void SymmetricBuffer::set_timeout(double timeout_s) {
  view_.timeout_ns = static_cast<unsigned long long>(timeout_s * 1e9);
}

std::string SymmetricBuffer::export_handle() const {
  if (destroyed_) throw std::runtime_error("ep_plugin: buffer already destroyed");
  const DeviceScope device_scope(device_);
  cudaIpcMemHandle_t handle;
  EP_CUDA_CHECK(cudaIpcGetMemHandle(&handle, local_));
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void SymmetricBuffer::open_peers(const std::vector<std::string>& handles) {
  const int R = view_.num_ranks;
  if (static_cast<int>(handles.size()) != R) throw std::invalid_argument("ep_plugin: open_peers needs one handle per rank");
  if (!opened_.empty()) throw std::runtime_error("ep_plugin: peers already opened");
  const DeviceScope device_scope(device_);
  std::vector<char*> table(R, nullptr);
  for (int r = 0; r < R; ++r) {
    if (r == view_.rank) {
      table[r] = local_;
      continue;
    }
    if (handles[r].size() != sizeof(cudaIpcMemHandle_t))
      throw std::invalid_argument("ep_plugin: bad IPC handle size from rank " + std::to_string(r));
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, handles[r].data(), sizeof(handle));
    void* pointer = nullptr;
    EP_CUDA_CHECK(cudaIpcOpenMemHandle(&pointer, handle, cudaIpcMemLazyEnablePeerAccess));
    table[r] = static_cast<char*>(pointer);
    opened_.push_back(table[r]);
  }
  const PrivateStream copy;
  EP_CUDA_CHECK(cudaMemcpyAsync(peer_table_, table.data(), sizeof(char*) * R, cudaMemcpyHostToDevice, copy.stream));
  copy.wait();  // before any kernel reads the table (and while `table` lives)
  table_ = table;
}

uintptr_t SymmetricBuffer::peer_region_address(int r) const {
  if (destroyed_ || r < 0 || r >= static_cast<int>(table_.size())) return 0;
  return reinterpret_cast<uintptr_t>(table_[r]) + static_cast<uintptr_t>(view_.sync.bytes);
}

int SymmetricBuffer::wait_for_device() const {
  const DeviceScope device_scope(device_, std::nothrow);
  return static_cast<int>(cudaDeviceSynchronize());
}

void SymmetricBuffer::close_peers_after_wait(int waited) {
  if (destroyed_ || opened_.empty()) return;
  const DeviceScope device_scope(device_);
  // Errors are collected so every mapping is closed; the first one is raised.
  cudaError_t first = static_cast<cudaError_t>(waited);
  for (char* pointer : opened_) {
    const cudaError_t status = cudaIpcCloseMemHandle(pointer);
    if (first == cudaSuccess) first = status;
  }
  opened_.clear();
  table_.clear();
  EP_CUDA_CHECK(first);
}

void SymmetricBuffer::destroy() {
  if (destroyed_) return;
  destroy_after_wait(wait_for_device());
}

void SymmetricBuffer::destroy_after_wait(int waited) {
  if (destroyed_.exchange(true)) return;
  const DeviceScope device_scope(device_, std::nothrow);
  // Errors are collected so every resource is released; the first one is raised.
  cudaError_t first = cudaSuccess;
  auto keep = [&first](cudaError_t status) {
    if (first == cudaSuccess && status != cudaSuccess) first = status;
  };
  keep(static_cast<cudaError_t>(waited));
  for (char* pointer : opened_) keep(cudaIpcCloseMemHandle(pointer));
  opened_.clear();
  table_.clear();
  if (local_) keep(cudaFree(local_));
  if (peer_table_) keep(cudaFree(peer_table_));
  if (state_) keep(cudaFree(state_));
  if (report_) keep(cudaFreeHost(const_cast<DeviceReport*>(report_)));
  local_ = nullptr;
  peer_table_ = nullptr;
  state_ = nullptr;
  report_ = nullptr;
  view_.local = nullptr;  // the view a launcher takes holds no freed pointer either
  view_.peers = nullptr;
  view_.state = nullptr;
  view_.report = nullptr;
  EP_CUDA_CHECK(first);
}

std::vector<long long> SymmetricBuffer::report() const {
  if (report_ == nullptr || report_->kind == kReportNone) return {kReportNone};
  return {report_->kind, report_->rank, report_->phase, report_->peer, static_cast<long long>(report_->expected),
          static_cast<long long>(report_->seen), static_cast<long long>(report_->waited_ns)};
}

void SymmetricBuffer::mark_peer_exited(int r) {
  if (r < 0 || r >= view_.num_ranks) throw std::out_of_range("ep_plugin: mark_peer_exited: rank out of range");
  if (report_ == nullptr) return;
  report_->exited[r] = 1;
}

std::vector<long long> SymmetricBuffer::mailbox(int first, int count) const {
  if (first < 0 || count < 0 || first > kMailboxWords || count > kMailboxWords - first)  // no int overflow
    throw std::out_of_range("ep_plugin: mailbox range out of bounds");
  if (report_ == nullptr) throw std::runtime_error("ep_plugin: buffer already destroyed");
  std::vector<long long> words(count);
  for (int i = 0; i < count; ++i) words[i] = report_->mailbox[first + i];
  return words;
}

}  // namespace ep
