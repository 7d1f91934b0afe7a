"""What the CUDA driver (and NVML, when present) says about this machine's GPUs, read through ctypes.

No toolkit, no torch, no compiled extension: ``libcuda.so.1`` ships with the driver, so this works
wherever a CUDA program could run, and says why not where none could. ``probe_driver()`` never
raises: a missing library, a failing ``cuInit`` (no device, ``CUDA_VISIBLE_DEVICES=""``) or an
attribute an older driver does not know all end up as text in the report.

Attribute numbers are those of CUDA 13's ``cuda.h`` (``CUdevice_attribute``). Functions whose
``cuda.h`` name is a macro for a versioned symbol (``cuMemAlloc`` -> ``cuMemAlloc_v2``) are called
by the versioned name: the unversioned symbols in ``libcuda`` are the legacy 32-bit ABI.

The live DMA-BUF check allocates 4 MiB on the first GPU in its primary context, exports a
page-aligned 2 MiB range inside it with ``cuMemGetHandleForAddressRange(..., DMA_BUF_FD)``, closes
the file descriptor and frees everything again: the same export NCCL performs before it registers
GPU memory with ``ibv_reg_dmabuf_mr``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

# CUdevice_attribute (CUDA 13 cuda.h).
ATTR_MULTIPROCESSOR_COUNT = 16
ATTR_COMPUTE_CAPABILITY_MAJOR = 75
ATTR_COMPUTE_CAPABILITY_MINOR = 76
ATTR_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
ATTR_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110
ATTR_GPU_DIRECT_RDMA_SUPPORTED = 116
ATTR_DMA_BUF_SUPPORTED = 124
ATTR_HANDLE_TYPE_FABRIC_SUPPORTED = 128
ATTR_MPS_ENABLED = 133

CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
CUDA_SUCCESS = 0
CUDA_ERROR_NO_DEVICE = 100

# DMA-BUF export of device memory arrived with CUDA 11.7 (driver API version 11070).
DMA_BUF_MIN_DRIVER_VERSION = 11070

NVML_SUCCESS = 0
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_NVLINK_MAX_LINKS = 18
NVML_FEATURE_ENABLED = 1
NVML_DEVICE_MIG_ENABLE = 1

_EXPORT_ALLOC_BYTES = 4 << 20
_EXPORT_RANGE_BYTES = 2 << 20


@dataclass
class GpuInfo:
    """One GPU as the driver reports it. ``None`` means the driver did not answer that question."""

    index: int
    name: str
    pci_bus_id: str  # "0000:1b:00.0": lower case, the spelling of /sys/bus/pci/devices
    sm_count: int
    compute_capability: tuple[int, int]
    total_memory_bytes: int = 0
    gpudirect_rdma: Optional[bool] = None  # attribute 116
    dmabuf_supported: Optional[bool] = None  # attribute 124
    vmm: Optional[bool] = None  # attribute 102
    gpudirect_rdma_with_vmm: Optional[bool] = None  # attribute 110
    fabric_handles: Optional[bool] = None  # attribute 128
    mps_enabled: Optional[bool] = None  # attribute 133
    dmabuf_export: str = "not tried"  # "ok", "not tried" or "failed: <why>"
    nvlink_active_links: Optional[int] = None  # from NVML; None = unknown
    mig_enabled: Optional[bool] = None  # from NVML (its current MIG mode); None = unknown


@dataclass
class DriverReport:
    """Everything the driver probe learned; ``error`` says why it learned nothing (or less)."""

    loaded: bool
    error: Optional[str] = None
    driver_version: Optional[int] = None  # cuDriverGetVersion: 13000 means CUDA 13.0
    gpus: list[GpuInfo] = field(default_factory=list)
    peer_access: list[list[bool]] = field(default_factory=list)  # [i][j]: i can map j's memory
    nvml_error: Optional[str] = None

    @property
    def driver_version_text(self) -> str:
        if self.driver_version is None:
            return "unknown"
        return f"{self.driver_version // 1000}.{(self.driver_version % 1000) // 10}"


class CudaCallError(RuntimeError):
    """A driver call returned an error; the message names the call and the CUDA error."""


def normalize_bus_id(text: str) -> str:
    """``"00000000:1B:00.0"`` or ``"0000:1b:00.0"`` -> ``"0000:1b:00.0"`` (sysfs spelling)."""
    match = re.fullmatch(r"\s*([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])\s*", text)
    if not match:
        return text.strip().lower()
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{function}"


class _Driver:
    """Typed handles on the few libcuda entry points the probe uses."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        c_int, c_uint, c_size_t = ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
        p_int = ctypes.POINTER(c_int)
        cu_device_ptr = ctypes.c_uint64
        self._bind("cuGetErrorName", [c_int, ctypes.POINTER(ctypes.c_char_p)])
        self._bind("cuInit", [c_uint])
        self._bind("cuDriverGetVersion", [p_int])
        self._bind("cuDeviceGetCount", [p_int])
        self._bind("cuDeviceGet", [p_int, c_int])
        self._bind("cuDeviceGetName", [ctypes.c_char_p, c_int, c_int])
        self._bind("cuDeviceGetAttribute", [p_int, c_int, c_int])
        self._bind("cuDeviceGetPCIBusId", [ctypes.c_char_p, c_int, c_int])
        self._bind("cuDeviceTotalMem_v2", [ctypes.POINTER(c_size_t), c_int])
        self._bind("cuDeviceCanAccessPeer", [p_int, c_int, c_int])
        # The DMA-BUF export's alone (cuDevicePrimaryCtxRelease_v2 from CUDA 11.0 drivers on,
        # cuMemGetHandleForAddressRange from 11.7): optional, so that an older driver still gets the GPUs listed.
        self._bind("cuDevicePrimaryCtxRetain", [ctypes.POINTER(ctypes.c_void_p), c_int], optional=True)
        self._bind("cuDevicePrimaryCtxRelease_v2", [c_int], optional=True)
        self._bind("cuCtxPushCurrent_v2", [ctypes.c_void_p], optional=True)
        self._bind("cuCtxPopCurrent_v2", [ctypes.POINTER(ctypes.c_void_p)], optional=True)
        self._bind("cuMemAlloc_v2", [ctypes.POINTER(cu_device_ptr), c_size_t], optional=True)
        self._bind("cuMemFree_v2", [cu_device_ptr], optional=True)
        self._bind("cuMemGetHandleForAddressRange", [ctypes.c_void_p, cu_device_ptr, c_size_t, c_int,
                                                      ctypes.c_ulonglong], optional=True)

    def _bind(self, name: str, argtypes: list, optional: bool = False) -> None:
        try:
            fn = getattr(self.lib, name)
        except AttributeError:
            if optional:
                setattr(self, name, None)
                return
            raise
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        setattr(self, name, fn)

    def error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        if self.cuGetErrorName(code, ctypes.byref(text)) == CUDA_SUCCESS and text.value:
            return text.value.decode(errors="replace")
        return f"CUresult {code}"

    def check(self, code: int, call: str) -> None:
        if code != CUDA_SUCCESS:
            raise CudaCallError(f"{call} failed: {self.error_name(code)} ({code})")

    def attribute(self, attribute: int, device: int) -> Optional[int]:
        """The attribute's value, or None when this driver does not know the attribute."""
        value = ctypes.c_int()
        if self.cuDeviceGetAttribute(ctypes.byref(value), attribute, device) != CUDA_SUCCESS:
            return None
        return value.value

    def flag(self, attribute: int, device: int) -> Optional[bool]:
        value = self.attribute(attribute, device)
        return None if value is None else bool(value)


def _load(names: tuple[str, ...]) -> tuple[Optional[ctypes.CDLL], str]:
    """The first library that loads, or None and the first loader error."""
    reasons = []
    for name in names:
        try:
            return ctypes.CDLL(name), ""
        except OSError as exc:
            reasons.append(str(exc))
    return None, reasons[0] if reasons else "nothing to load"


def probe_driver(*, dmabuf_export: bool = True, nvml: bool = True, library: Any = None,
                 nvml_library: Any = None) -> DriverReport:
    """Ask the CUDA driver about every visible GPU; never raises.

    Args:
        dmabuf_export: also try the live DMA-BUF export on GPU 0 (creates its primary context for
            a moment; ``python -m ep_plugin info`` skips it to stay quick).
        nvml: count active NVLinks per GPU through ``libnvidia-ml.so.1`` when it loads.
        library, nvml_library: already-loaded libraries to use instead of loading libcuda.so.1 /
            libnvidia-ml.so.1 (tests pass fakes with the same entry points).

    Returns:
        A DriverReport; ``loaded=False`` with ``error`` set when there is no usable driver.
    """
    lib, why = (library, "") if library is not None else _load(("libcuda.so.1", "libcuda.so"))
    if lib is None:
        return DriverReport(loaded=False, error=f"no CUDA driver ({why})")
    try:
        driver = _Driver(lib)
    except AttributeError as exc:
        return DriverReport(loaded=False, error=f"libcuda.so.1 lacks an entry point the probe needs: {exc}")
    report = DriverReport(loaded=True)
    version = ctypes.c_int()
    if driver.cuDriverGetVersion(ctypes.byref(version)) == CUDA_SUCCESS:
        report.driver_version = version.value
    code = driver.cuInit(0)
    if code != CUDA_SUCCESS:
        hint = ""
        if code == CUDA_ERROR_NO_DEVICE and "CUDA_VISIBLE_DEVICES" in os.environ:
            hint = f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})"
        report.error = f"cuInit failed: {driver.error_name(code)} ({code}){hint}"
        return report
    try:
        _probe_devices(driver, report)
        if dmabuf_export and report.gpus:
            report.gpus[0].dmabuf_export = _try_dmabuf_export(driver, 0, report.driver_version)
    except CudaCallError as exc:
        report.error = str(exc)
    except Exception as exc:  # noqa: BLE001 - a probe bug must not take doctor down with it
        report.error = f"driver probe failed: {type(exc).__name__}: {exc}"
    if nvml and report.gpus:
        try:
            report.nvml_error = _count_nvlinks(report.gpus, nvml_library)
        except Exception as exc:  # noqa: BLE001 - an NVML too old for these calls, or a probe bug
            report.nvml_error = f"NVML unusable: {type(exc).__name__}: {exc}"
    return report


def _probe_devices(driver: _Driver, report: DriverReport) -> None:
    count = ctypes.c_int()
    driver.check(driver.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    devices = []
    for ordinal in range(count.value):
        device = ctypes.c_int()
        driver.check(driver.cuDeviceGet(ctypes.byref(device), ordinal), f"cuDeviceGet({ordinal})")
        devices.append(device.value)
        name = ctypes.create_string_buffer(256)
        driver.check(driver.cuDeviceGetName(name, len(name), device.value), f"cuDeviceGetName({ordinal})")
        bus_id = ctypes.create_string_buffer(64)
        driver.check(driver.cuDeviceGetPCIBusId(bus_id, len(bus_id), device.value), f"cuDeviceGetPCIBusId({ordinal})")
        total = ctypes.c_size_t()
        total_bytes = total.value if driver.cuDeviceTotalMem_v2(ctypes.byref(total), device.value) == 0 else 0
        report.gpus.append(GpuInfo(
            index=ordinal,
            name=name.value.decode(errors="replace"),
            pci_bus_id=normalize_bus_id(bus_id.value.decode(errors="replace")),
            sm_count=driver.attribute(ATTR_MULTIPROCESSOR_COUNT, device.value) or 0,
            compute_capability=(driver.attribute(ATTR_COMPUTE_CAPABILITY_MAJOR, device.value) or 0,
                                driver.attribute(ATTR_COMPUTE_CAPABILITY_MINOR, device.value) or 0),
            total_memory_bytes=total_bytes,
            gpudirect_rdma=driver.flag(ATTR_GPU_DIRECT_RDMA_SUPPORTED, device.value),
            dmabuf_supported=driver.flag(ATTR_DMA_BUF_SUPPORTED, device.value),
            vmm=driver.flag(ATTR_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device.value),
            gpudirect_rdma_with_vmm=driver.flag(ATTR_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, device.value),
            fabric_handles=driver.flag(ATTR_HANDLE_TYPE_FABRIC_SUPPORTED, device.value),
            mps_enabled=driver.flag(ATTR_MPS_ENABLED, device.value),
        ))
    report.peer_access = [[i == j for j in range(len(devices))] for i in range(len(devices))]
    for i, device_i in enumerate(devices):
        for j, device_j in enumerate(devices):
            if i != j:
                can = ctypes.c_int()
                driver.check(driver.cuDeviceCanAccessPeer(ctypes.byref(can), device_i, device_j),
                             f"cuDeviceCanAccessPeer({i}, {j})")
                report.peer_access[i][j] = bool(can.value)


_EXPORT_ENTRY_POINTS = ("cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2", "cuCtxPushCurrent_v2",
                        "cuCtxPopCurrent_v2", "cuMemAlloc_v2", "cuMemFree_v2", "cuMemGetHandleForAddressRange")


def _try_dmabuf_export(driver: _Driver, device: int, driver_version: Optional[int]) -> str:
    """Export a page-aligned range of a fresh cuMemAlloc as a DMA-BUF fd; "ok" or "failed: why"."""
    for name in _EXPORT_ENTRY_POINTS:
        if getattr(driver, name) is None:
            return f"failed: this driver has no {name} (the export needs a CUDA 11.7+ driver)"
    if driver_version is not None and driver_version < DMA_BUF_MIN_DRIVER_VERSION:
        return f"failed: driver API {driver_version} is older than 11.7"
    context = ctypes.c_void_p()
    pushed = False
    pointer = ctypes.c_uint64(0)
    fd = ctypes.c_int(-1)
    try:
        driver.check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
        driver.check(driver.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        pushed = True
        driver.check(driver.cuMemAlloc_v2(ctypes.byref(pointer), _EXPORT_ALLOC_BYTES), "cuMemAlloc")
        page = mmap.PAGESIZE
        start = (pointer.value + page - 1) // page * page  # inside the allocation: it has 2 MiB to spare
        code = driver.cuMemGetHandleForAddressRange(ctypes.byref(fd), start, _EXPORT_RANGE_BYTES,
                                                    CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
        if code != CUDA_SUCCESS:
            return f"failed: cuMemGetHandleForAddressRange(DMA_BUF_FD): {driver.error_name(code)} ({code})"
        if fd.value < 0:
            return "failed: cuMemGetHandleForAddressRange returned no file descriptor"
        return "ok"
    except CudaCallError as exc:
        return f"failed: {exc}"
    finally:
        if fd.value >= 0:
            os.close(fd.value)
        if pointer.value:
            driver.cuMemFree_v2(pointer)
        if pushed:
            driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        if context.value:
            driver.cuDevicePrimaryCtxRelease_v2(device)


def _count_nvlinks(gpus: list[GpuInfo], library: Any = None) -> Optional[str]:
    """Fill ``nvlink_active_links`` and ``mig_enabled`` from NVML; returns why it could not (None when it could).
    A GPU in MIG mode is found by its PCI bus id too: its MIG devices report their parent's."""
    lib, why = (library, "") if library is not None else _load(("libnvidia-ml.so.1",))
    if lib is None:
        return f"NVML not found ({why})"
    init = lib.nvmlInit_v2
    init.argtypes, init.restype = [], ctypes.c_int
    shutdown = lib.nvmlShutdown
    shutdown.argtypes, shutdown.restype = [], ctypes.c_int
    by_bus_id = lib.nvmlDeviceGetHandleByPciBusId_v2
    by_bus_id.argtypes, by_bus_id.restype = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int
    link_state = lib.nvmlDeviceGetNvLinkState
    link_state.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(ctypes.c_uint)]
    link_state.restype = ctypes.c_int
    mig_mode = getattr(lib, "nvmlDeviceGetMigMode", None)  # NVML 11+; older: unknown
    if mig_mode is not None:
        mig_mode.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint)]
        mig_mode.restype = ctypes.c_int
    code = init()
    if code != NVML_SUCCESS:
        return f"nvmlInit_v2 failed ({code})"
    problems = []
    try:
        for gpu in gpus:
            handle = ctypes.c_void_p()
            code = by_bus_id(gpu.pci_bus_id.encode(), ctypes.byref(handle))
            if code != NVML_SUCCESS:
                problems.append(f"GPU {gpu.index}: nvmlDeviceGetHandleByPciBusId_v2 failed ({code})")
                continue
            if mig_mode is not None:
                current, pending = ctypes.c_uint(0), ctypes.c_uint(0)
                code = mig_mode(handle, ctypes.byref(current), ctypes.byref(pending))
                if code == NVML_SUCCESS:
                    gpu.mig_enabled = current.value == NVML_DEVICE_MIG_ENABLE
                elif code == NVML_ERROR_NOT_SUPPORTED:  # a GPU without MIG
                    gpu.mig_enabled = False
            active = 0
            for link in range(NVML_NVLINK_MAX_LINKS):
                state = ctypes.c_uint(0)
                code = link_state(handle, link, ctypes.byref(state))
                if code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT):
                    # No NVLink at all, or no link at this index: the populated links need not be the first
                    # ones (nvidia-smi asks every index too), so go on to the next.
                    continue
                if code != NVML_SUCCESS:
                    active = None
                    problems.append(f"GPU {gpu.index}: nvmlDeviceGetNvLinkState({link}) failed ({code})")
                    break
                active += int(state.value == NVML_FEATURE_ENABLED)
            gpu.nvlink_active_links = active
    finally:
        shutdown()
    return "; ".join(problems) or None
