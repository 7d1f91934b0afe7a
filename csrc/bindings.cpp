// pybind11 module ep_plugin._C: binds only; no torch. Tensors arrive as data pointers
// (int) and streams as cudaStream_t handles (int), so torch upgrades need no rebuild.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>

#include "ep/device_info.h"
#include "ep/hybrid.h"
#include "ep/layout.h"

namespace py = pybind11;

namespace {

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ep_plugin compiled CUDA kernels (no libtorch linkage)";
  m.def("cuda_device_count", &ep::cuda_device_count, "visible CUDA devices; 0 without device or driver");
  m.def("describe_devices", &ep::describe_devices, "one line per device, or 'no CUDA device (...)'");
  m.def("cuda_runtime_version", &ep::compiled_cuda_runtime_version, "CUDART_VERSION at build time");

  py::class_<ep::Buffer>(m, "Buffer", "one rank's IPC communication buffer (see csrc/include/ep/buffer.h)")
      .def(py::init<int, int, int, int, int, int, int, double>(), py::arg("device"), py::arg("rank"),
           py::arg("num_ranks"), py::arg("max_tokens"), py::arg("hidden"), py::arg("num_local_experts"),
           py::arg("max_blocks"), py::arg("timeout_s"))
      .def("ipc_handle", [](const ep::Buffer& b) { return py::bytes(b.ipc_handle()); })
      .def("open_peers", &ep::Buffer::open_peers, py::arg("handles"))
      .def("destroy", &ep::Buffer::destroy)
      .def("timeout_report", &ep::Buffer::timeout_report)
      .def("host_total_rows", &ep::Buffer::host_total_rows)
      .def("set_timeout", &ep::Buffer::set_timeout)
      .def_property_readonly("total_bytes", &ep::Buffer::total_bytes);

  m.def(
      "layout",
      [](uintptr_t routing_map, uintptr_t topk_idx, uintptr_t probs, int num_tokens, int num_ranks,
         int num_local_experts, int topk, uintptr_t send_slot, uintptr_t k_index, uintptr_t expert_counts,
         uintptr_t rank_counts, uintptr_t dense_probs, uintptr_t bad_ids, int device, uintptr_t stream,
         int max_blocks) {
        ep::LayoutArgs a{ptr<const uint8_t>(routing_map),
                         ptr<const int64_t>(topk_idx),
                         ptr<const float>(probs),
                         num_tokens,
                         num_ranks,
                         num_local_experts,
                         topk,
                         ptr<int32_t>(k_index),
                         ptr<int32_t>(expert_counts),
                         ptr<int32_t>(send_slot),
                         ptr<int32_t>(rank_counts),
                         ptr<float>(dense_probs),
                         ptr<bool>(bad_ids),
                         max_blocks};
        ep::launch_layout(a, device, stream);
      },
      py::arg("routing_map"), py::arg("topk_idx"), py::arg("probs"), py::arg("num_tokens"), py::arg("num_ranks"),
      py::arg("num_local_experts"), py::arg("topk"), py::arg("send_slot"), py::arg("k_index"),
      py::arg("expert_counts"), py::arg("rank_counts"), py::arg("dense_probs"), py::arg("bad_ids"),
      py::arg("device"), py::arg("stream"), py::arg("max_blocks") = 0,
      "stage 0: send-side layout in one kernel (topk = 0: routing-map form; pointer 0 = absent)");

  m.def(
      "notify",
      [](const ep::Buffer& b, int phase, uintptr_t expert_counts, uintptr_t rank_counts, int pad_multiple,
         uintptr_t row_base, uintptr_t expert_start, uintptr_t tokens_per_expert, uintptr_t real_per_expert,
         uintptr_t num_packets, uintptr_t total_rows, uintptr_t stream) {
        ep::NotifyArgs a{phase,
                         ptr<const int32_t>(expert_counts),
                         ptr<const int32_t>(rank_counts),
                         pad_multiple,
                         ptr<int32_t>(row_base),
                         ptr<int32_t>(expert_start),
                         ptr<int64_t>(tokens_per_expert),
                         ptr<int64_t>(real_per_expert),
                         ptr<int32_t>(num_packets),
                         ptr<int64_t>(total_rows)};
        ep::launch_notify(b, a, stream);
      },
      "stage 1: handshake (+ count exchange when expert_counts != 0)");

  m.def(
      "dispatch_send",
      [](const ep::Buffer& b, uintptr_t hidden, int64_t row_bytes, uintptr_t scales, int64_t scale_bytes,
         uintptr_t send_slot, uintptr_t k_index, uintptr_t probs, int num_tokens, int bulk_copy, int num_blocks,
         uintptr_t stream) {
        ep::SendArgs a{ptr<const void>(hidden),       row_bytes, ptr<const float>(scales), scale_bytes,
                       ptr<const int32_t>(send_slot), ptr<const int32_t>(k_index), ptr<const float>(probs),
                       num_tokens,                    bulk_copy};
        ep::launch_dispatch_send(b, a, num_blocks, stream);
      },
      "stage 2: push tokens once per destination rank");

  m.def(
      "permute",
      [](const ep::Buffer& b, uintptr_t out, int64_t row_bytes, uintptr_t out_scales, int64_t scale_bytes,
         uintptr_t out_probs, int64_t budget, uintptr_t row_base, uintptr_t expert_start, uintptr_t tokens_per_expert,
         uintptr_t real_per_expert, uintptr_t num_packets, uintptr_t total_rows, uintptr_t packet_rows,
         int use_cached_rows, uintptr_t overflow, int bulk_copy, int num_blocks, uintptr_t stream) {
        ep::PermuteArgs a{ptr<void>(out),
                          row_bytes,
                          ptr<float>(out_scales),
                          scale_bytes,
                          ptr<float>(out_probs),
                          budget,
                          ptr<const int32_t>(row_base),
                          ptr<const int32_t>(expert_start),
                          ptr<const int64_t>(tokens_per_expert),
                          ptr<const int64_t>(real_per_expert),
                          ptr<const int32_t>(num_packets),
                          ptr<const int64_t>(total_rows),
                          ptr<int32_t>(packet_rows),
                          use_cached_rows,
                          ptr<int32_t>(overflow),
                          bulk_copy};
        ep::launch_permute(b, a, num_blocks, stream);
      },
      "stage 3: expand packets into expert-sorted padded rows");

  m.def(
      "combine_send",
      [](const ep::Buffer& b, uintptr_t rows, uintptr_t row_probs, uintptr_t packet_rows, uintptr_t num_packets,
         int64_t budget, int num_blocks, uintptr_t stream) {
        ep::CombineSendArgs a{ptr<const void>(rows), ptr<const float>(row_probs), ptr<const int32_t>(packet_rows),
                              ptr<const int32_t>(num_packets), budget};
        ep::launch_combine_send(b, a, num_blocks, stream);
      },
      "stage 4: reduce each packet's rows on the expert side and send them back");

  m.def(
      "combine_recv",
      [](const ep::Buffer& b, uintptr_t out, uintptr_t out_probs, uintptr_t send_slot, uintptr_t k_index,
         int num_tokens, int num_blocks, uintptr_t stream) {
        ep::CombineRecvArgs a{ptr<void>(out), ptr<float>(out_probs), ptr<const int32_t>(send_slot),
                              ptr<const int32_t>(k_index), num_tokens};
        ep::launch_combine_recv(b, a, num_blocks, stream);
      },
      "stage 5: sum the returned rows per token at the source");
}
