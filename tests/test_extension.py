"""The compiled extension imports without a GPU and says so instead of crashing."""

import subprocess
import sys

import pytest
import torch

from ep_plugin import _cuda
from ep_plugin.backends import compiled


def test_import_without_driver_reports_no_device(extension):
    # A fresh interpreter: importing _C alone must not crash, whatever the machine has.
    code = "import ep_plugin._C as c; print(c.cuda_device_count()); print(c.describe_devices())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    count_line, description = result.stdout.split("\n", 1)
    if int(count_line) == 0:
        assert description.startswith("no CUDA device")
        if not _driver_loads():  # the runtime's "driver version is insufficient" sent users to upgrade a missing one
            assert description.strip() == "no CUDA device (no CUDA driver loaded)", description
    else:
        assert "cuda:0" in description
    assert _cuda._module.cuda_runtime_version() >= 12000


def _driver_loads() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_missing_extension_explains_itself(monkeypatch):
    monkeypatch.setattr(_cuda, "_module", None)
    monkeypatch.setattr(_cuda, "_import_error", ImportError("no module named ep_plugin._C"))
    assert not _cuda.available()
    assert "nvcc" in _cuda.describe()
    with pytest.raises(Exception, match="nvcc"):
        _cuda.extension()


def test_region_layouts_and_argument_structs_need_no_gpu(extension):
    """The backends' region layouts (host code) and the keyword-filled argument structs: shapes the
    kernels cannot take are refused by name, regions are 256-byte aligned and do not overlap."""
    C = extension
    shape = dict(num_ranks=8, max_tokens=4096, hidden=7168, num_local_experts=32, max_blocks=16)
    layouts = {"hybrid": C.hybrid.Regions(**shape), "elastic": C.elastic.Regions(**shape, max_topk=8)}
    for name, regions in layouts.items():
        # Every rank's data alone (the combine rows, R x T x H bf16) bounds the total from below.
        assert regions.total_bytes >= 8 * 4096 * 7168 * 2 and regions.total_bytes % 256 == 0, name
    # Count words per source: per expert, the packet count, the input flags (hybrid: also the
    # receive budget and pad_multiple, from which peers derive where their rows land).
    assert layouts["elastic"].count_words == 32 + 2 and layouts["hybrid"].count_words == 32 + 4
    # The Python mirror that checks a Megatron layer's shape at model build, where _C is not asked.
    assert C.MAX_LOCAL_EXPERTS == compiled.MAX_LOCAL_EXPERTS
    for field, bad in (("num_ranks", 33), ("hidden", 12), ("num_local_experts", 257), ("max_blocks", 0)):
        with pytest.raises(ValueError, match=field if field != "max_blocks" else "max_blocks"):
            C.hybrid.Regions(**{**shape, field: bad})
    with pytest.raises(ValueError, match="max_topk"):
        C.elastic.Regions(**shape, max_topk=33)
    # In-place dispatch adds its receive rows (R x T x 2H) and fp8 scales (R x T x H/128 x 4), past the rest.
    plain, in_place = layouts["elastic"], C.elastic.Regions(**shape, max_topk=8, in_place_dispatch=True)
    assert not plain.in_place_dispatch and in_place.in_place_dispatch
    rows, scales = 8 * 4096 * 7168 * 2, 8 * 4096 * (7168 // 128) * 4
    assert in_place.total_bytes - plain.total_bytes == rows + scales
    assert in_place.off_recv_scales - in_place.off_recv_rows == rows
    assert in_place.off_recv_rows >= in_place.off_comb_data + 8 * 4096 * 7168 * 2
    # The combine-input arena comes last; none by default. Its size travels in 16-byte words (int32).
    plain, room = layouts["hybrid"], C.hybrid.Regions(**shape, combine_input_bytes=14 << 20)
    assert plain.combine_input_bytes == 0 and room.combine_input_bytes == 14 << 20
    assert room.total_bytes - plain.total_bytes == 14 << 20 and room.off_comb_input == plain.total_bytes
    for bad in (-256, 1000, 32 << 30):
        with pytest.raises(ValueError, match="combine_input_bytes"):
            C.hybrid.Regions(**shape, combine_input_bytes=bad)
    with pytest.raises(TypeError, match="no field 'hiden'"):
        C.elastic.SendArgs(hiden=0)
    args = C.elastic.ReceiveArgs(capacity=5, expand=True, out=None)
    assert (args.capacity, args.expand, args.out) == (5, True, 0)


def test_pointer_fields_take_tensors_ints_and_none(extension):
    """Pointer fields of the argument structs read a tensor's address (subclasses and any class with
    a data_ptr() method too: the extension looks data_ptr up once per class), take ints and None,
    and refuse anything else by field and type name."""
    C = extension
    counts = torch.zeros(8, dtype=torch.int32)
    weights = torch.nn.Parameter(torch.zeros(4))

    class Pointer:
        def __init__(self, address):
            self.address = address

        def data_ptr(self):
            return self.address

    for _ in range(2):  # the second round takes the remembered data_ptr of each class
        args = C.ExchangeArgs(expert_counts=counts, rank_counts=counts[2:], row_base=weights,
                              expert_start=Pointer(4096), num_packets=12345, total_rows=None)
        assert args.expert_counts == counts.data_ptr()
        assert args.rank_counts == counts.data_ptr() + 8  # a view's own address, not its storage's
        assert args.row_base == weights.data_ptr()
        assert (args.expert_start, args.num_packets, args.total_rows) == (4096, 12345, 0)
        args.expert_start = counts
        assert args.expert_start == counts.data_ptr()
    with pytest.raises(TypeError, match="field 'expert_counts' takes None, an int address or a tensor, got str"):
        C.ExchangeArgs(expert_counts="0x1000")
    with pytest.raises(TypeError, match="ExchangeArgs has no field 'expert_count' "):
        C.ExchangeArgs(expert_count=counts)
    # A value field names itself too (pybind's own cast error is a RuntimeError naming no field).
    with pytest.raises(TypeError, match=r"field 'num_local_experts' takes a C\+\+ int, got str"):
        C.ExchangeArgs(num_local_experts="12")
    with pytest.raises(TypeError, match=r"'num_local_experts' takes a C\+\+ int, got 1099511627776 \(out of range\)"):
        C.ExchangeArgs(num_local_experts=2**40)
    args = C.ExchangeArgs(num_local_experts=3)
    with pytest.raises(TypeError, match=r"field 'num_local_experts' takes a C\+\+ int, got float"):
        args.num_local_experts = 2.5  # assigned, as the ops set their per-call fields
    assert args.num_local_experts == 3

