#pragma once

#include <string>

namespace ep {

// Number of visible CUDA devices; 0 when there is no device or no driver (never throws).
int cuda_device_count();
// One line per device, or "no CUDA device (<reason>)".
std::string describe_devices();
// CUDART_VERSION the extension was built against.
int compiled_cuda_runtime_version();

}  // namespace ep
