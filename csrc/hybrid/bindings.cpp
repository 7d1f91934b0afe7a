// _C.hybrid: the hybrid backend's region layout, argument structs and stage launchers.
#include <pybind11/pybind11.h>

#include "bind_args.h"
#include "hybrid/hybrid.h"

namespace py = pybind11;

namespace ep {
namespace hybrid {

void bind(py::module_& parent) {
  using bind::ArgStruct;
  py::module_ m = parent.def_submodule("hybrid", "hybrid backend: regions and stage launchers");

  py::class_<Regions>(m, "Regions", "the hybrid region layout on the transport (see csrc/hybrid/hybrid.h)")
      .def(py::init(&make_regions), py::arg("num_ranks"), py::arg("max_tokens"), py::arg("hidden"),
           py::arg("num_local_experts"), py::arg("max_blocks"), py::arg("combine_input_bytes") = 0)
      .def_readonly("total_bytes", &Regions::total_bytes)
      .def_readonly("combine_input_bytes", &Regions::combine_input_bytes)
      .def_readonly("off_comb_input", &Regions::off_comb_input)
      .def_readonly("max_tokens", &Regions::max_tokens)
      .def_property_readonly("count_words", &Regions::count_words);

  ArgStruct<SendArgs>(m, "SendArgs", "stage 2: stage tokens, push their per-destination parts")
      .ptr("hidden", &SendArgs::hidden)
      .val("row_bytes", &SendArgs::row_bytes)
      .ptr("scales", &SendArgs::scales)
      .val("scale_bytes", &SendArgs::scale_bytes)
      .ptr("send_slot", &SendArgs::send_slot)
      .ptr("k_index", &SendArgs::k_index)
      .ptr("probs", &SendArgs::probs)
      .val("num_tokens", &SendArgs::num_tokens)
      .val("bulk_copy", &SendArgs::bulk_copy)
      .ptr("overflow", &SendArgs::overflow);
  m.def("dispatch_send", &launch_dispatch_send, py::arg("buffer"), py::arg("regions"), py::arg("args"),
        py::arg("num_blocks"), py::arg("stream"));

  ArgStruct<PermuteArgs>(m, "PermuteArgs", "stage 3: pull packets into expert-sorted padded rows")
      .ptr("out", &PermuteArgs::out)
      .val("row_bytes", &PermuteArgs::row_bytes)
      .ptr("out_scales", &PermuteArgs::out_scales)
      .val("scale_bytes", &PermuteArgs::scale_bytes)
      .ptr("out_probs", &PermuteArgs::out_probs)
      .val("budget", &PermuteArgs::budget)
      .ptr("row_base", &PermuteArgs::row_base)
      .ptr("expert_start", &PermuteArgs::expert_start)
      .ptr("tokens_per_expert", &PermuteArgs::tokens_per_expert)
      .ptr("real_per_expert", &PermuteArgs::real_per_expert)
      .ptr("num_packets", &PermuteArgs::num_packets)
      .ptr("total_rows", &PermuteArgs::total_rows)
      .ptr("packet_rows", &PermuteArgs::packet_rows)
      .val("use_cached_rows", &PermuteArgs::use_cached_rows)
      .ptr("overflow", &PermuteArgs::overflow)
      .val("bulk_copy", &PermuteArgs::bulk_copy);
  m.def("permute", &launch_permute, py::arg("buffer"), py::arg("regions"), py::arg("args"), py::arg("num_blocks"),
        py::arg("stream"));

  m.def("dispatch_fused", &launch_dispatch_fused, py::arg("buffer"), py::arg("regions"), py::arg("send"),
        py::arg("permute"), py::arg("num_blocks"), py::arg("stream"),
        "stages 2 and 3 in one launch (non-blocking first dispatch)");
  ArgStruct<CombineSendArgs>(m, "CombineSendArgs", "stage 4: reduce each packet's rows, send them back")
      .ptr("rows", &CombineSendArgs::rows)
      .ptr("row_probs", &CombineSendArgs::row_probs)
      .ptr("packet_rows", &CombineSendArgs::packet_rows)
      .ptr("num_packets", &CombineSendArgs::num_packets)
      .val("budget", &CombineSendArgs::budget);
  m.def("combine_send", &launch_combine_send, py::arg("buffer"), py::arg("regions"), py::arg("args"),
        py::arg("num_blocks"), py::arg("stream"));

  m.attr("COMBINE_PUSHED") = kCombinePushed;
  ArgStruct<CombineRecvArgs>(m, "CombineRecvArgs", "stage 5: sum the returned rows per token")
      .ptr("out", &CombineRecvArgs::out)
      .ptr("out_probs", &CombineRecvArgs::out_probs)
      .ptr("send_slot", &CombineRecvArgs::send_slot)
      .ptr("k_index", &CombineRecvArgs::k_index)
      .val("num_tokens", &CombineRecvArgs::num_tokens)
      .ptr("peer_rows", &CombineRecvArgs::peer_rows)
      .val("wait_for_send", &CombineRecvArgs::wait_for_send);
  m.def("combine_recv", &launch_combine_recv, py::arg("buffer"), py::arg("regions"), py::arg("args"),
        py::arg("num_blocks"), py::arg("stream"));
}

}  // namespace hybrid
}  // namespace ep
