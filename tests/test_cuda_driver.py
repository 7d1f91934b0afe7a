"""The ctypes driver probe against a fake libcuda / libnvidia-ml: call order, cleanup, degradation.

The fakes receive exactly what ctypes would pass (``byref`` objects, string buffers, c_uint64)
and write results through them, so the probe's plumbing runs here without a GPU; the real
driver is exercised by ``python -m ep_plugin doctor`` on a GPU machine.
"""

import ctypes
import os
import types

import pytest

from ep_plugin.transport import cuda_driver
from ep_plugin.transport.cuda_driver import normalize_bus_id, probe_driver

ERROR_NAMES = {0: b"CUDA_SUCCESS", 1: b"CUDA_ERROR_INVALID_VALUE", 100: b"CUDA_ERROR_NO_DEVICE",
               801: b"CUDA_ERROR_NOT_SUPPORTED"}


class Entry:
    """A fake entry point that converts its arguments as ctypes would, so a wrong argtype fails here."""

    def __init__(self, fn):
        self.fn, self.__name__ = fn, fn.__name__
        self.argtypes = self.restype = None

    def __call__(self, *args):
        assert self.argtypes is not None and self.restype is ctypes.c_int, f"{self.__name__} called untyped"
        assert len(args) == len(self.argtypes), f"{self.__name__}: {len(args)} args for {self.argtypes}"
        for argtype, value in zip(self.argtypes, args, strict=True):
            argtype.from_param(value)  # raises TypeError where ctypes would refuse the call
        return self.fn(*args)


def library(functions):
    return types.SimpleNamespace(**{fn.__name__: Entry(fn) for fn in functions})


def fake_cuda(*, count=2, init_rc=0, export_rc=0, peer=True, with_export=True, attributes=None, without=()):
    """A namespace of plain functions named like libcuda's entry points; ``calls`` records the order.
    ``without``: entry points this (older) driver lacks."""
    calls = []
    state = {"fd": None, "allocated": 0}
    attributes = {16: 132, 75: 9, 76: 0, 102: 1, 110: 1, 116: 1, 124: 1, 128: 0, **(attributes or {})}

    def cuGetErrorName(code, text):
        text._obj.value = ERROR_NAMES.get(code, b"CUDA_ERROR_UNKNOWN")
        return 0

    def cuInit(flags):
        calls.append("cuInit")
        return init_rc

    def cuDriverGetVersion(version):
        version._obj.value = 13000
        return 0

    def cuDeviceGetCount(value):
        value._obj.value = count
        return 0

    def cuDeviceGet(device, ordinal):
        device._obj.value = ordinal
        return 0

    def cuDeviceGetName(buffer, length, device):
        buffer.value = b"NVIDIA H200"
        return 0

    def cuDeviceGetAttribute(value, attribute, device):
        if attribute not in attributes:
            return 1  # an attribute this driver does not know
        value._obj.value = attributes[attribute]
        return 0

    def cuDeviceGetPCIBusId(buffer, length, device):
        buffer.value = f"0000:{0x1B + device:02X}:00.0".encode()
        return 0

    def cuDeviceTotalMem_v2(total, device):
        total._obj.value = 141 << 30
        return 0

    def cuDeviceCanAccessPeer(can, device, peer_device):
        can._obj.value = int(peer)
        return 0

    def cuDevicePrimaryCtxRetain(context, device):
        calls.append("retain")
        context._obj.value = 0x1234
        return 0

    def cuDevicePrimaryCtxRelease_v2(device):
        calls.append("release")
        return 0

    def cuCtxPushCurrent_v2(context):
        calls.append("push")
        return 0

    def cuCtxPopCurrent_v2(context):
        calls.append("pop")
        return 0

    def cuMemAlloc_v2(pointer, size):
        calls.append(("alloc", size))
        pointer._obj.value = 0x7F0000200000 + 256  # not page-aligned: the probe must align inside
        state["allocated"] = size
        return 0

    def cuMemFree_v2(pointer):
        calls.append("free")
        return 0

    def cuMemGetHandleForAddressRange(handle, pointer, size, handle_type, flags):
        calls.append(("export", pointer, size, handle_type))
        if export_rc:
            return export_rc
        state["fd"] = os.open(os.devnull, os.O_RDONLY)
        handle._obj.value = state["fd"]
        return 0

    functions = [cuGetErrorName, cuInit, cuDriverGetVersion, cuDeviceGetCount, cuDeviceGet, cuDeviceGetName,
                 cuDeviceGetAttribute, cuDeviceGetPCIBusId, cuDeviceTotalMem_v2, cuDeviceCanAccessPeer,
                 cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRelease_v2, cuCtxPushCurrent_v2, cuCtxPopCurrent_v2,
                 cuMemAlloc_v2, cuMemFree_v2]
    if with_export:
        functions.append(cuMemGetHandleForAddressRange)
    return library([f for f in functions if f.__name__ not in without]), calls, state


def fake_nvml(active_links=4, link_codes=None, mig_mode=None):
    """NVML with ``active_links`` enabled links at indices 0.., or with ``link_codes[i]`` answering link i
    (0: enabled; "disabled": a disabled link; otherwise the error code returned). ``mig_mode``: each GPU's
    (by its handle's order) current MIG mode (0, 1) or the error code; None: an NVML without the entry point."""
    def nvmlInit_v2():
        return 0

    def nvmlShutdown():
        return 0

    def nvmlDeviceGetHandleByPciBusId_v2(bus_id, handle):
        handle._obj.value = 1
        return 0

    def nvmlDeviceGetNvLinkState(handle, link, active):
        codes = link_codes if link_codes is not None else [0] * active_links
        code = codes[link] if link < len(codes) else cuda_driver.NVML_ERROR_INVALID_ARGUMENT
        if code == "disabled":
            active._obj.value = 0
            return 0
        if code == 0:
            active._obj.value = cuda_driver.NVML_FEATURE_ENABLED
        return code

    handles = []

    def nvmlDeviceGetMigMode(handle, current, pending):
        answer = mig_mode[len(handles)]
        handles.append(handle)
        if answer in (0, 1):
            current._obj.value = answer
            return 0
        return answer

    functions = [nvmlInit_v2, nvmlShutdown, nvmlDeviceGetHandleByPciBusId_v2, nvmlDeviceGetNvLinkState]
    return library(functions + ([nvmlDeviceGetMigMode] if mig_mode is not None else []))


def test_mig_mode_is_read_per_gpu_and_unknown_without_an_answer():
    """A GPU in MIG mode cannot map its peers' memory (doctor says so); NOT_SUPPORTED is a GPU without MIG."""
    lib, _, _ = fake_cuda(count=2)
    report = probe_driver(library=lib, nvml_library=fake_nvml(mig_mode=[1, cuda_driver.NVML_ERROR_NOT_SUPPORTED]))
    assert [g.mig_enabled for g in report.gpus] == [True, False] and report.nvml_error is None
    report = probe_driver(library=fake_cuda(count=2)[0], nvml_library=fake_nvml(mig_mode=[0, 999]))
    assert [g.mig_enabled for g in report.gpus] == [False, None]
    report = probe_driver(library=fake_cuda(count=1)[0], nvml_library=fake_nvml())
    assert report.gpus[0].mig_enabled is None and report.gpus[0].nvlink_active_links == 4


def test_probe_reads_gpus_peers_attributes_and_links():
    lib, calls, state = fake_cuda()
    report = probe_driver(library=lib, nvml_library=fake_nvml(active_links=4))
    assert report.loaded and report.error is None and report.driver_version_text == "13.0"
    assert [g.pci_bus_id for g in report.gpus] == ["0000:1b:00.0", "0000:1c:00.0"]
    first = report.gpus[0]
    assert (first.name, first.sm_count, first.compute_capability, first.total_memory_bytes) == \
        ("NVIDIA H200", 132, (9, 0), 141 << 30)
    assert (first.gpudirect_rdma, first.dmabuf_supported, first.vmm, first.fabric_handles) == (True, True, True, False)
    assert first.mps_enabled is None  # attribute 133 unknown to this (fake) driver: not a crash
    assert report.peer_access == [[True, True], [True, True]]
    assert [g.nvlink_active_links for g in report.gpus] == [4, 4] and report.nvml_error is None
    assert first.dmabuf_export == "ok" and report.gpus[1].dmabuf_export == "not tried"


def test_dmabuf_export_is_page_aligned_and_cleans_up_in_order():
    lib, calls, state = fake_cuda(count=1)
    probe_driver(library=lib, nvml=False)
    export = next(call for call in calls if isinstance(call, tuple) and call[0] == "export")
    _, pointer, size, handle_type = export
    assert pointer % 4096 == 0 and size == 2 << 20 and handle_type == cuda_driver.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    allocation = next(call for call in calls if isinstance(call, tuple) and call[0] == "alloc")[1]
    assert pointer + size <= 0x7F0000200000 + 256 + allocation  # the range lies inside the allocation
    assert [c for c in calls if isinstance(c, str)][-5:] == ["retain", "push", "free", "pop", "release"]
    with pytest.raises(OSError):  # the DMA-BUF fd was closed
        os.fstat(state["fd"])


def test_failed_export_is_reported_and_still_cleans_up():
    lib, calls, _ = fake_cuda(count=1, export_rc=801)
    report = probe_driver(library=lib, nvml=False)
    assert report.gpus[0].dmabuf_export == "failed: cuMemGetHandleForAddressRange(DMA_BUF_FD): " \
                                           "CUDA_ERROR_NOT_SUPPORTED (801)"
    assert [c for c in calls if isinstance(c, str)][-4:] == ["push", "free", "pop", "release"]


def test_old_driver_without_the_export_entry_point():
    lib, _, _ = fake_cuda(count=1, with_export=False)
    report = probe_driver(library=lib, nvml=False)
    assert report.loaded and report.gpus[0].dmabuf_export.startswith("failed: this driver has no")


def test_a_driver_before_cuda_11_still_lists_its_gpus():
    """An R418/R440 driver has no cuDevicePrimaryCtxRelease_v2 (CUDA 11.0) nor the export: the export's entry
    points were bound as required, so the whole report was lost ("lacks an entry point": no GPUs listed)."""
    lib, _, _ = fake_cuda(count=1, with_export=False, without=("cuDevicePrimaryCtxRelease_v2",))
    report = probe_driver(library=lib, nvml=False)
    assert report.loaded and report.error is None and len(report.gpus) == 1, report
    assert report.gpus[0].dmabuf_export == "failed: this driver has no cuDevicePrimaryCtxRelease_v2 (the export " \
                                           "needs a CUDA 11.7+ driver)"


def test_init_failure_is_text_not_an_exception(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    lib, _, _ = fake_cuda(init_rc=100)
    report = probe_driver(library=lib)
    assert report.loaded and report.gpus == []
    assert report.error == "cuInit failed: CUDA_ERROR_NO_DEVICE (100) (CUDA_VISIBLE_DEVICES='')"


def test_no_peer_access_and_no_nvlink():
    lib, _, _ = fake_cuda(peer=False)
    report = probe_driver(library=lib, nvml_library=fake_nvml(active_links=0), dmabuf_export=False)
    assert report.peer_access == [[True, False], [False, True]]
    assert [g.nvlink_active_links for g in report.gpus] == [0, 0]
    assert report.gpus[0].dmabuf_export == "not tried"


def test_links_are_counted_past_an_index_without_a_link():
    # NVML answers NOT_SUPPORTED / INVALID_ARGUMENT for an index with no link; the populated links need not
    # be the first indices, so counting must not stop at the first such answer.
    unsupported, invalid = cuda_driver.NVML_ERROR_NOT_SUPPORTED, cuda_driver.NVML_ERROR_INVALID_ARGUMENT
    lib, _, _ = fake_cuda()
    nvml = fake_nvml(link_codes=[unsupported, 0, 0, invalid, "disabled", 0])
    report = probe_driver(library=lib, nvml_library=nvml, dmabuf_export=False)
    assert [g.nvlink_active_links for g in report.gpus] == [3, 3] and report.nvml_error is None


def test_missing_library_is_reported(monkeypatch):
    def refuse(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(cuda_driver.ctypes, "CDLL", refuse)
    report = probe_driver()
    assert not report.loaded and report.error == "no CUDA driver (libcuda.so.1: cannot open shared object file)"


@pytest.mark.parametrize("text,expected", [("00000000:1B:00.0", "0000:1b:00.0"), ("0000:3b:00.0", "0000:3b:00.0"),
                                           ("0001:C1:00.1", "0001:c1:00.1"), ("garbage", "garbage")])
def test_normalize_bus_id(text, expected):
    assert normalize_bus_id(text) == expected


def test_argtypes_use_the_versioned_symbols():
    lib, _, _ = fake_cuda()
    driver = cuda_driver._Driver(lib)
    assert driver.cuMemAlloc_v2.argtypes == [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    assert driver.cuMemAlloc_v2.restype is ctypes.c_int
    assert not hasattr(lib, "cuMemAlloc")  # the legacy 32-bit symbol is never bound


def test_a_probe_bug_is_reported_not_raised():
    lib, _, _ = fake_cuda(count=1)
    lib.cuDeviceGetName.fn = lambda buffer, length, device: 1 / 0
    report = probe_driver(library=lib, nvml=False)
    assert report.loaded and report.error == "driver probe failed: ZeroDivisionError: division by zero"
