#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace ep {

// Number of visible CUDA devices; 0 when there is no device or no driver (never throws).
int cuda_device_count();
// One line per device, or "no CUDA device (<reason>)".
std::string describe_devices();
// CUDART_VERSION the extension was built against.
int compiled_cuda_runtime_version();
// Whether a stream is being captured into a CUDA graph, and by which capture: (status, capture id), status a
// cudaStreamCaptureStatus (0 none, 1 active, 2 invalidated) or -1 when the query failed (error cleared).
// Ordering two streams with an event is legal only when neither is capturing or both are in one capture.
std::pair<int, unsigned long long> stream_capture_info(uintptr_t stream);

}  // namespace ep
