// pybind11 module ep_plugin._C: binds only; no torch. Tensors arrive as data pointers
// (int) and streams as cudaStream_t handles (int), so torch upgrades need no rebuild.
#include <pybind11/pybind11.h>

#include "ep/device_info.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "ep_plugin compiled CUDA kernels (no libtorch linkage)";
  m.def("cuda_device_count", &ep::cuda_device_count, "visible CUDA devices; 0 without device or driver");
  m.def("describe_devices", &ep::describe_devices, "one line per device, or 'no CUDA device (...)'");
  m.def("cuda_runtime_version", &ep::compiled_cuda_runtime_version, "CUDART_VERSION at build time");
}
