// _C.elastic: the elastic backend's region layout, argument structs and stage launchers.
#include <pybind11/pybind11.h>

#include "bind_args.h"
#include "elastic/elastic.h"

namespace py = pybind11;

namespace ep {
namespace elastic {

void bind(py::module_& parent) {
  using bind::ArgStruct;
  py::module_ m = parent.def_submodule("elastic", "elastic backend: regions and stage launchers");
  m.attr("MAX_TOPK") = kMaxTopk;

  py::class_<Regions>(m, "Regions", "the elastic region layout on the transport (see csrc/elastic/elastic.h)")
      .def(py::init(&make_regions), py::arg("num_ranks"), py::arg("max_tokens"), py::arg("hidden"),
           py::arg("num_local_experts"), py::arg("max_blocks"), py::arg("max_topk"),
           py::arg("in_place_dispatch") = false)
      .def_readonly("total_bytes", &Regions::total_bytes)
      .def_readonly("max_tokens", &Regions::max_tokens)
      .def_readonly("max_topk", &Regions::max_topk)
      .def_readonly("off_comb_data", &Regions::off_comb_data)
      .def_readonly("off_recv_rows", &Regions::off_recv_rows)
      .def_readonly("off_recv_scales", &Regions::off_recv_scales)
      .def_readonly("in_place_dispatch", &Regions::in_place_dispatch)
      .def_property_readonly("count_words", &Regions::count_words);

  ArgStruct<SendArgs>(m, "SendArgs", "stage 2: stage tokens, push their per-destination metadata")
      .ptr("hidden", &SendArgs::hidden)
      .val("row_bytes", &SendArgs::row_bytes)
      .ptr("scales", &SendArgs::scales)
      .val("scale_bytes", &SendArgs::scale_bytes)
      .ptr("send_slot", &SendArgs::send_slot)
      .ptr("topk_idx", &SendArgs::topk_idx)
      .ptr("topk_weights", &SendArgs::topk_weights)
      .ptr("k_index", &SendArgs::k_index)
      .ptr("dest_base", &SendArgs::dest_base)
      .val("push_payload", &SendArgs::push_payload)
      .val("topk", &SendArgs::topk)
      .val("num_tokens", &SendArgs::num_tokens)
      .val("bulk_copy", &SendArgs::bulk_copy);
  m.def("dispatch_send", &launch_dispatch_send, py::arg("buffer"), py::arg("regions"), py::arg("args"),
        py::arg("num_blocks"), py::arg("stream"));

  ArgStruct<ReceiveArgs>(m, "ReceiveArgs", "stage 3: pull packets into compact or expanded rows")
      .ptr("out", &ReceiveArgs::out)
      .val("row_bytes", &ReceiveArgs::row_bytes)
      .ptr("out_scales", &ReceiveArgs::out_scales)
      .val("scale_bytes", &ReceiveArgs::scale_bytes)
      .val("capacity", &ReceiveArgs::capacity)
      .ptr("num_packets", &ReceiveArgs::num_packets)
      .val("topk", &ReceiveArgs::topk)
      .val("expand", &ReceiveArgs::expand)
      .val("cached", &ReceiveArgs::cached)
      .ptr("out_topk_idx", &ReceiveArgs::out_topk_idx)
      .ptr("out_topk_weights", &ReceiveArgs::out_topk_weights)
      .ptr("out_row_weights", &ReceiveArgs::out_row_weights)
      .ptr("row_base", &ReceiveArgs::row_base)
      .ptr("expert_start", &ReceiveArgs::expert_start)
      .ptr("tokens_per_expert", &ReceiveArgs::tokens_per_expert)
      .ptr("real_per_expert", &ReceiveArgs::real_per_expert)
      .ptr("packet_rows", &ReceiveArgs::packet_rows)
      .val("payload_pushed", &ReceiveArgs::payload_pushed)
      .val("zero_padding", &ReceiveArgs::zero_padding)
      .val("bulk_copy", &ReceiveArgs::bulk_copy);
  m.def("dispatch_receive", &launch_dispatch_receive, py::arg("buffer"), py::arg("regions"), py::arg("args"),
        py::arg("num_blocks"), py::arg("stream"));

  ArgStruct<CombineSendArgs>(m, "CombineSendArgs", "stage 4: send each packet's row (or row sum) back")
      .ptr("rows", &CombineSendArgs::rows)
      .ptr("slot_values", &CombineSendArgs::slot_values)
      .ptr("num_packets", &CombineSendArgs::num_packets)
      .ptr("packet_rows", &CombineSendArgs::packet_rows)
      .val("topk", &CombineSendArgs::topk);
  m.def("combine_send", &launch_combine_send, py::arg("buffer"), py::arg("regions"), py::arg("args"),
        py::arg("num_blocks"), py::arg("stream"));

  ArgStruct<CombineRecvArgs>(m, "CombineRecvArgs", "stage 5: sum each token's rows, route slot values back")
      .ptr("out", &CombineRecvArgs::out)
      .ptr("bias", &CombineRecvArgs::bias)
      .ptr("out_topk_values", &CombineRecvArgs::out_topk_values)
      .ptr("send_slot", &CombineRecvArgs::send_slot)
      .ptr("topk_idx", &CombineRecvArgs::topk_idx)
      .val("topk", &CombineRecvArgs::topk)
      .val("num_tokens", &CombineRecvArgs::num_tokens)
      .ptr("dest_base", &CombineRecvArgs::dest_base)
      .val("wait_for_send", &CombineRecvArgs::wait_for_send);
  m.def("combine_recv", &launch_combine_recv, py::arg("buffer"), py::arg("regions"), py::arg("args"),
        py::arg("num_blocks"), py::arg("stream"));
}

}  // namespace elastic
}  // namespace ep
