// Device queries that must never crash on a machine without a GPU or driver:
// the CUDA runtime is linked statically and loads the driver lazily, so a missing
// driver shows up as an error code that we turn into "no CUDA device".
#include <cuda_runtime.h>

#include <string>

#include "ep/device_info.h"

namespace ep {

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return count;
}

std::string describe_devices() {
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    cudaGetLastError();
    int driver = 0;  // 0 where no driver is loaded at all
    if (status == cudaErrorInsufficientDriver && cudaDriverGetVersion(&driver) == cudaSuccess && driver == 0) {
      // The runtime's text ("driver version is insufficient") would send the user to upgrade a driver
      // that is not there.
      return "no CUDA device (no CUDA driver loaded)";
    }
    return std::string("no CUDA device (") + (status == cudaSuccess ? "zero devices" : cudaGetErrorString(status)) +
           ")";
  }
  std::string text;
  for (int device = 0; device < count; ++device) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) continue;
    text += "cuda:" + std::to_string(device) + " " + prop.name + " sm_" + std::to_string(prop.major) +
            std::to_string(prop.minor) + " " + std::to_string(prop.multiProcessorCount) + " SMs\n";
  }
  return text;
}

int compiled_cuda_runtime_version() { return CUDART_VERSION; }

std::pair<int, unsigned long long> stream_capture_info(uintptr_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  if (cudaStreamGetCaptureInfo(reinterpret_cast<cudaStream_t>(stream), &status, &id) != cudaSuccess) {
    cudaGetLastError();
    return {-1, 0};
  }
  return {static_cast<int>(status), status == cudaStreamCaptureStatusNone ? 0 : id};
}

}  // namespace ep
