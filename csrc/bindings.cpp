// pybind11 module ep_plugin._C: binds only; no torch. Tensors arrive as data pointers (ints, or
// objects with data_ptr()) inside argument structs filled by name, streams as cudaStream_t
// handles (int), so torch upgrades need no rebuild.
//
//   _C                  device queries, the transport (SymmetricBuffer, exchange) and the
//                       send-side routing layout, which both backends share
//   _C.hybrid           the hybrid backend's regions and stages (csrc/hybrid/)
//   _C.elastic          the elastic backend's regions and stages (csrc/elastic/)
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>

#include "bind_args.h"
#include "ep/arena.h"
#include "ep/device_info.h"
#include "ep/layout.h"
#include "ep/transport.h"

namespace py = pybind11;

// EP_PLUGIN_CUDA_ARCHS at build time, e.g. "90;100" (setup.py defines it).
#ifndef EP_PLUGIN_BUILT_ARCHS
#define EP_PLUGIN_BUILT_ARCHS ""
#endif

namespace ep {
namespace hybrid {
void bind(py::module_& parent);
}
namespace elastic {
void bind(py::module_& parent);
}
}  // namespace ep

// A buffer's device-wide wait (its error, not raised) with the GIL released meanwhile.
static int wait_without_gil(const ep::SymmetricBuffer& buffer) {
  py::gil_scoped_release no_gil;
  return buffer.wait_for_device();
}

PYBIND11_MODULE(_C, m) {
  using ep::bind::ArgStruct;
  m.doc() = "ep_plugin compiled CUDA kernels (no libtorch linkage)";
  m.def("cuda_device_count", &ep::cuda_device_count, "visible CUDA devices; 0 without device or driver");
  m.def("describe_devices", &ep::describe_devices, "one line per device, or 'no CUDA device (...)'");
  m.def("cuda_runtime_version", &ep::compiled_cuda_runtime_version, "CUDART_VERSION at build time");
  m.def("stream_capture_info", &ep::stream_capture_info, py::arg("stream"),
        "(status, capture id) of a stream: status 0 not capturing, 1 capturing, 2 capture invalidated, -1 unknown");

  m.attr("BUILT_ARCHS") = EP_PLUGIN_BUILT_ARCHS;
  m.attr("MAILBOX_TOTAL_ROWS") = ep::kMailboxTotalRows;
  m.attr("MAILBOX_TOTAL_PACKETS") = ep::kMailboxTotalPackets;
  m.attr("MAILBOX_INPUT_FLAGS") = ep::kMailboxInputFlags;
  m.attr("MAILBOX_FLAGGED_RANKS") = ep::kMailboxFlaggedRanks;
  m.attr("MAILBOX_EXPERT_ROWS") = ep::kMailboxExpertRows;
  m.attr("INPUT_ID_OUT_OF_RANGE") = ep::kInputIdOutOfRange;
  m.attr("INPUT_ID_REPEATED") = ep::kInputIdRepeated;
  m.attr("INPUT_TOO_MANY_TOKENS") = ep::kInputTooManyTokens;
  m.attr("REPORT_TIMEOUT") = static_cast<int>(ep::kReportTimeout);
  m.attr("REPORT_MISMATCH") = static_cast<int>(ep::kReportMismatch);
  m.attr("REPORT_PEER_EXITED") = static_cast<int>(ep::kReportPeerExited);
  m.attr("MAX_RANKS") = ep::kMaxRanks;
  m.attr("MAX_LOCAL_EXPERTS") = ep::kMaxLocalExperts;
  m.attr("UNBOUNDED_ROWS") = ep::kUnboundedRows;

  py::class_<ep::SymmetricBuffer>(m, "SymmetricBuffer",
                                  "one rank's symmetric buffer and sync state (see csrc/include/ep/transport.h)")
      .def(py::init<int, int, int, int64_t, int, double>(), py::arg("device"), py::arg("rank"), py::arg("num_ranks"),
           py::arg("region_bytes"), py::arg("count_words"), py::arg("timeout_s"))
      .def_property_readonly("handle_kind", &ep::SymmetricBuffer::handle_kind)
      .def("export_handle", [](const ep::SymmetricBuffer& b) { return py::bytes(b.export_handle()); })
      .def("open_peers", &ep::SymmetricBuffer::open_peers, py::arg("handles"))
      // Both begin with a device-wide wait: made without the GIL, so that the process's other threads (a
      // watchdog printing why a kernel is stuck, say) go on meanwhile; the release that follows holds it, so no
      // other thread reads the report or the peer table while they are freed.
      .def("close_peers", [](ep::SymmetricBuffer& buffer, bool synchronize) {
             if (!buffer.destroyed()) buffer.close_peers_after_wait(synchronize ? wait_without_gil(buffer) : 0);
           }, py::arg("synchronize") = true)
      .def("destroy", [](ep::SymmetricBuffer& buffer) {
             if (!buffer.destroyed()) buffer.destroy_after_wait(wait_without_gil(buffer));
           })
      .def("abandon", &ep::SymmetricBuffer::abandon)
      .def("report", &ep::SymmetricBuffer::report)
      .def("failed", &ep::SymmetricBuffer::failed)
      .def("mailbox", &ep::SymmetricBuffer::mailbox, py::arg("first"), py::arg("count"))
      .def("set_timeout", &ep::SymmetricBuffer::set_timeout, py::arg("timeout_s"))
      .def("mark_peer_exited", &ep::SymmetricBuffer::mark_peer_exited, py::arg("rank"))
      .def("peer_region_address", &ep::SymmetricBuffer::peer_region_address, py::arg("rank"))
      .def_property_readonly("total_bytes", &ep::SymmetricBuffer::total_bytes)
      .def_property_readonly("header_bytes", &ep::SymmetricBuffer::header_bytes)
      .def_property_readonly("region_address", &ep::SymmetricBuffer::region_address)
      .def_property_readonly("bulk_capable", &ep::SymmetricBuffer::bulk_capable);

  ArgStruct<ep::ExchangeArgs>(m, "ExchangeArgs", "handshake (+ count exchange when expert_counts is set)")
      .val("phase", &ep::ExchangeArgs::phase)
      .val("fingerprint", &ep::ExchangeArgs::fingerprint)
      .ptr("expert_counts", &ep::ExchangeArgs::expert_counts)
      .ptr("rank_counts", &ep::ExchangeArgs::rank_counts)
      .ptr("input_flags", &ep::ExchangeArgs::input_flags)
      .val("host_input_flags", &ep::ExchangeArgs::host_input_flags)
      .val("num_local_experts", &ep::ExchangeArgs::num_local_experts)
      .val("pad_multiple", &ep::ExchangeArgs::pad_multiple)
      .ptr("row_base", &ep::ExchangeArgs::row_base)
      .ptr("expert_start", &ep::ExchangeArgs::expert_start)
      .ptr("tokens_per_expert", &ep::ExchangeArgs::tokens_per_expert)
      .ptr("real_per_expert", &ep::ExchangeArgs::real_per_expert)
      .ptr("num_packets", &ep::ExchangeArgs::num_packets)
      .ptr("total_rows", &ep::ExchangeArgs::total_rows)
      .ptr("total_packets", &ep::ExchangeArgs::total_packets)
      .val("receive_budget", &ep::ExchangeArgs::receive_budget)
      .ptr("peer_row_base", &ep::ExchangeArgs::peer_row_base)
      .val("publish_op_word", &ep::ExchangeArgs::publish_op_word)
      .val("op_word", &ep::ExchangeArgs::op_word);
  m.def("exchange", &ep::launch_exchange, py::arg("buffer"), py::arg("args"), py::arg("stream"),
        "the op prologue: handshake with fingerprint check, and the count exchange when counts are given");

  ArgStruct<ep::LayoutArgs>(m, "LayoutArgs", "send-side routing layout (see csrc/include/ep/layout.h)")
      .ptr("routing_map", &ep::LayoutArgs::routing_map)
      .ptr("topk_idx", &ep::LayoutArgs::topk_idx)
      .ptr("probs", &ep::LayoutArgs::probs)
      .val("num_tokens", &ep::LayoutArgs::num_tokens)
      .val("num_ranks", &ep::LayoutArgs::num_ranks)
      .val("num_local_experts", &ep::LayoutArgs::num_local_experts)
      .val("topk", &ep::LayoutArgs::topk)
      .ptr("k_index", &ep::LayoutArgs::k_index)
      .ptr("expert_counts", &ep::LayoutArgs::expert_counts)
      .ptr("send_slot", &ep::LayoutArgs::send_slot)
      .ptr("rank_counts", &ep::LayoutArgs::rank_counts)
      .ptr("dense_probs", &ep::LayoutArgs::dense_probs)
      .ptr("input_flags", &ep::LayoutArgs::input_flags)
      .ptr("flags_since_checked", &ep::LayoutArgs::flags_since_checked)
      .val("max_blocks", &ep::LayoutArgs::max_blocks);
  m.def("layout", &ep::launch_layout, py::arg("args"), py::arg("device"), py::arg("stream"),
        "stage 0 of a dispatch: send slots, k indices and counts in one kernel (no host sync)");
  m.def("layout_exchange", &ep::launch_layout_exchange, py::arg("buffer"), py::arg("layout"), py::arg("exchange"),
        py::arg("stream"), "a first dispatch's layout and count exchange in one launch (the fused prologue)");

  // The combine-input arena (ep/arena.h): torch's pluggable allocator finds the two C functions by
  // these names in this library.
  m.attr("ARENA_ALLOC_SYMBOL") = "ep_arena_alloc";
  m.attr("ARENA_FREE_SYMBOL") = "ep_arena_free";
  m.def("arena_register", &ep::arena::register_arena, py::arg("id"), py::arg("device"), py::arg("parts"),
        "parts: [(address, bytes)] of a buffer that the arena's pool may take as segments");
  m.def("arena_unregister", &ep::arena::unregister_arena, py::arg("id"));
  m.def("arena_select", &ep::arena::select_arena, py::arg("id"),
        "the arena this thread's segment requests go to (0 = none); returns the one selected before");
  m.def("arena_lent_parts", &ep::arena::lent_parts, py::arg("id"));
  m.def("arena_fallback_segments", &ep::arena::fallback_segments, py::arg("id"));

  ep::hybrid::bind(m);
  ep::elastic::bind(m);
}
