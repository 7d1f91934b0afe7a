// Error checking for every CUDA runtime call: a failure becomes a C++ exception that
// names the operation and the CUDA error; pybind11 turns it into a Python RuntimeError.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace ep {

inline void check_cuda(cudaError_t status, const char* what, const char* file, int line) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("ep_plugin: ") + what + " failed: " + cudaGetErrorName(status) + " (" +
                             cudaGetErrorString(status) + ") at " + file + ":" + std::to_string(line));
  }
}

}  // namespace ep

#define EP_CUDA_CHECK(call) ::ep::check_cuda((call), #call, __FILE__, __LINE__)
