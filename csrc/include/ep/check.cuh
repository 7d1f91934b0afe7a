// Error checking for every CUDA runtime call: a failure becomes a C++ exception that
// names the operation and the CUDA error; pybind11 turns it into a Python RuntimeError.
#pragma once

#include <cuda_runtime.h>

#include <new>
#include <stdexcept>
#include <string>

namespace ep {

inline void check_cuda(cudaError_t status, const char* what, const char* file, int line) {
  if (status != cudaSuccess) {
    // The runtime also kept it as its last error: cleared here, or the next launch's cudaGetLastError()
    // would report it again, as its own failure, after a kernel that was enqueued fine.
    (void)cudaGetLastError();
    throw std::runtime_error(std::string("ep_plugin: ") + what + " failed: " + cudaGetErrorName(status) + " (" +
                             cudaGetErrorString(status) + ") at " + file + ":" + std::to_string(line));
  }
}

}  // namespace ep

#define EP_CUDA_CHECK(call) ::ep::check_cuda((call), #call, __FILE__, __LINE__)

namespace ep {

// Makes `device` current for the enclosing scope and gives the caller's device back on the way out: an
// entry point must not leave the current device changed (a process whose current device is another GPU
// would find its next allocation, and torch's next default stream, on ours).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    EP_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      EP_CUDA_CHECK(cudaSetDevice(device));
      changed_ = true;
    }
  }
  // For release paths, which go on after a CUDA error: failures here are ignored (the releases report theirs).
  DeviceScope(int device, std::nothrow_t) {
    const bool known = cudaGetDevice(&previous_) == cudaSuccess;
    if (!known || previous_ != device) changed_ = cudaSetDevice(device) == cudaSuccess && known;
    cudaGetLastError();
  }
  ~DeviceScope() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

}  // namespace ep
