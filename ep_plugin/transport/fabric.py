"""A model of this machine's fabric: GPUs and their links, RDMA NICs, GPUDirect RDMA, NCCL, MPS.

Built from sysfs, ``/dev``, ``/proc``, the environment and the CUDA driver (``cuda_driver``),
never from tools that may be missing (``ibstat``, ``nvidia-smi``). Every source is injectable
(``probe_fabric(root=..., environ=..., driver=..., memlock=..., nccl_version=..., host_address=...,
addresses=..., torch_cuda=...)``) so tests run
on fake trees; nothing here raises on a missing file or driver: it says what it could not read.

NIC-to-GPU affinity (the rule behind per-GPU scale-out bandwidth):

1. Only NICs with at least one ACTIVE port count (a NIC whose ports are all down carries nothing),
   and only hardware ones: software RDMA (soft-RoCE ``rxe``, soft-iWARP ``siw``) moves data through
   the CPU's network stack, so it cannot reach GPU memory (no GPUDirect RDMA). It is listed, marked
   ``software``, and never nearest to a GPU.
2. A GPU's nearest NICs are those sharing the longest PCI path prefix with it: behind the same
   PCIe switch beats the same PCI root complex. If none shares even the root complex, the NICs on
   the GPU's NUMA node; if every NIC's node is known and none is the GPU's, all of them ("another CPU":
   NCCL's SYS path, across the link between CPUs); if the GPU's NUMA node is unknown, none. Intel VMD nests a PCI domain
   (``pci10000:00``) under its controller: paths keep both host bridges, and NICs that share no more
   than a host bridge with the GPU are "PCI root", however deep that bridge sits.
3. A NIC that is nearest to several GPUs is shared evenly among them, counting every NVIDIA GPU
   in sysfs, also those CUDA_VISIBLE_DEVICES hides (a flat VM topology puts every device on one
   root: each GPU then gets its fair share, not the node's total).
4. Per-GPU scale-out bandwidth = sum over its nearest NICs of (rates of their ACTIVE ports /
   the number of GPUs sharing that NIC). Rates come from ``ports/<p>/rate`` ("400 Gb/sec (4X
   NDR)"); Gb/s / 8 = GB/s. When nothing is known the value is ``DEFAULT_SCALEOUT_GBYTES_PER_S``
   and the model carries a warning; it is never 0.

NVLink bandwidth per GPU = active NVLinks (NVML) x the per-link rate of its architecture
(``NVLINK_GBYTES_PER_LINK``); unknown -> ``DEFAULT_NVLINK_GBYTES_PER_S`` with a warning.

EFA (AWS): detected from ``FI_PROVIDER=efa``, Amazon (0x1d0f) RDMA devices or ``rdmap*`` names.
Its ports report link_layer "Unknown". ``Fabric.queue_pair_cap`` is ``EFA_QUEUE_PAIR_CAP`` there
(None elsewhere): a backend that opens queue pairs per peer caps its count with ``cap_queue_pairs``.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import logging
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

from .cuda_driver import DriverReport, GpuInfo, probe_driver
from .sizing import DEFAULT_NVLINK_GBYTES_PER_S, DEFAULT_SCALEOUT_GBYTES_PER_S, mps_thread_percentage

logger = logging.getLogger("ep_plugin")

VENDORS = {"0x15b3": "Mellanox", "0x1d0f": "Amazon"}
# hca_type (the PCI device id in decimal, as mlx5 prints it) -> product.
MELLANOX_MODELS = {
    "MT4115": "ConnectX-4", "MT4117": "ConnectX-4 Lx", "MT4119": "ConnectX-5", "MT4121": "ConnectX-5 Ex",
    "MT4123": "ConnectX-6", "MT4125": "ConnectX-6 Dx", "MT4127": "ConnectX-6 Lx", "MT4129": "ConnectX-7",
    "MT4131": "ConnectX-8", "MT41686": "BlueField-2", "MT41692": "BlueField-3",
}
# GB/s per NVLink and direction, by compute capability (A100: NVLink 3, H100/H200: 4, B200: 5).
NVLINK_GBYTES_PER_LINK = {(8, 0): 25.0, (9, 0): 25.0, (10, 0): 50.0, (10, 3): 50.0}
# aws-ofi-nccl's ring overflowed at DeepEP's automatic 129 queue pairs; 2 per peer suffice on EFA.
EFA_QUEUE_PAIR_CAP = 2
# Kernel modules through which an RDMA NIC can register cudaMalloc memory (GPUDirect RDMA).
PEERMEM_PATHS = (
    "/sys/module/nvidia_peermem/version",
    "/sys/kernel/mm/memory_peers/nvidia-peermem/version",
    "/sys/kernel/mm/memory_peers/nv_mem/version",
    "/sys/kernel/mm/memory_peers/nv_mem_nc/version",
)
MPS_DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
# How long the doctor waits for this host's name to resolve (host_name_address).
HOST_NAME_TIMEOUT_S = 5.0
NCCL_ENV_KEYS = (
    "NCCL_NET_PLUGIN", "NCCL_NET", "NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_DMABUF_ENABLE", "NCCL_NET_GDR_LEVEL",
    "NCCL_NET_GDR_READ", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_CUMEM_ENABLE",
    "NCCL_DEBUG", "FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "OFI_NCCL_DISABLE_DMABUF", "CUDA_VISIBLE_DEVICES",
    "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "EP_PLUGIN_SCALEUP_SIZE", "NCCL_CONF_FILE",
)
# Where NCCL net plugins (aws-ofi-nccl: libnccl-net-ofi.so / libnccl-net.so) are usually installed.
NCCL_PLUGIN_DIRS = ("/opt/amazon/ofi-nccl/lib", "/opt/amazon/ofi-nccl/lib64", "/opt/aws-ofi-nccl/lib",
                    "/usr/local/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64")

# A PCI domain has 4 hex digits, or 5 behind Intel VMD (pci10000:00, 10000:01:00.0).
_BDF = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_HOST_BRIDGE = re.compile(r"^pci[0-9a-f]{4,}:[0-9a-f]{2}$")
# sysfs does not name an RDMA device's driver: software RDMA is known by its name prefix (rdma-core's own
# fallback to find its rxe / siw providers), a renamed rxe by its ``parent`` file (the netdev under it).
SOFTWARE_RDMA = {"rxe": "soft-RoCE", "siw": "soft-iWARP"}


@dataclass(frozen=True)
class RdmaPort:
    number: int
    state: str  # "ACTIVE", "DOWN", "INIT", ... (sysfs prints "4: ACTIVE")
    rate_gbit_per_s: Optional[float]  # None: unreadable or 0
    rate_text: str
    link_layer: str  # "InfiniBand", "Ethernet" (RoCE), "Unknown" (EFA)

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


@dataclass(frozen=True)
class RdmaDevice:
    name: str
    vendor_id: Optional[str]
    vendor: str
    hca_type: Optional[str]
    model: str
    numa_node: Optional[int]
    pci_path: tuple[str, ...]  # host bridge first, the NIC's own address last
    ports: tuple[RdmaPort, ...]
    efa: bool
    software: bool  # soft-RoCE / soft-iWARP: no GPUDirect RDMA, never counted
    # EFA: AWS's efa driver says in device/gdr whether it registers GPU memory itself, through its own NVIDIA
    # provider (1) or cannot (0: no NVIDIA driver symbols); None where there is no such file (the upstream
    # driver, which needs DMA-BUF) or the device is not EFA.
    efa_gdr: Optional[bool] = None

    @property
    def usable(self) -> bool:
        """A hardware NIC with at least one ACTIVE port."""
        return not self.software and any(port.active for port in self.ports)

    @property
    def active_gbit_per_s(self) -> float:
        """Sum of the known rates of ACTIVE ports."""
        return sum(port.rate_gbit_per_s or 0.0 for port in self.ports if port.active)

    @property
    def rate_known(self) -> bool:
        return any(port.active and port.rate_gbit_per_s for port in self.ports)


@dataclass
class GpuLinks:
    """One GPU: what the driver says plus where it sits and what it can reach."""

    info: GpuInfo
    numa_node: Optional[int]
    pci_path: tuple[str, ...]
    peers: tuple[int, ...]  # GPUs whose memory this one can map (CUDA peer access)
    nearest_nics: tuple[str, ...]
    nic_affinity: str  # "PCIe switch", "PCI root", "NUMA node", "another CPU" or "none"
    scaleout_gbytes_per_s: float  # never 0: the default when unknown
    scaleout_measured: bool
    nvlink_gbytes_per_s: float  # never 0: the default when unknown
    nvlink_measured: bool


@dataclass
class NcclInfo:
    version: Optional[str]
    version_error: Optional[str]
    net_plugin: Optional[str]  # NCCL_NET_PLUGIN
    plugin_libraries: list[str]  # libnccl-net*.so found on LD_LIBRARY_PATH and the usual places
    env: dict[str, str]  # the relevant variables the environment sets
    # What NCCL's config files set (see read_nccl_config), and the file each variable came from.
    config: dict[str, str] = field(default_factory=dict)
    config_source: dict[str, str] = field(default_factory=dict)

    def effective_environ(self, environ: Mapping[str, str]) -> dict[str, str]:
        """``environ`` with this machine's NCCL config files under it (``as_nccl_sees_it``)."""
        return as_nccl_sees_it(environ, self.config)

    @property
    def plugin_may_load(self) -> bool:
        """Whether NCCL may load a net plugin: NCCL_NET_PLUGIN names one, or (unset) a library was found.
        NCCL_NET_PLUGIN=none (any case) turns plugins off: NCCL then uses its built-in IB or sockets."""
        named = (self.net_plugin or "").strip()
        if named:
            return named.lower() != "none"
        return bool(self.plugin_libraries)


@dataclass
class MpsInfo:
    pipe_directory: str
    control_pipe: bool  # <pipe dir>/control exists
    pid: Optional[int]  # from nvidia-cuda-mps-control.pid
    pid_alive: Optional[bool]  # /proc/<pid> exists (a daemon in another PID namespace is not seen there)
    active_thread_percentage: Optional[float]
    active_thread_percentage_text: Optional[str]  # as set, also when unparsable
    # The control socket accepted a connection (True), refused it (False: nobody listens, a stale pipe
    # directory), or could not be tried (None: not a socket, no permission).
    control_answers: Optional[bool] = None

    @property
    def daemon_running(self) -> bool:
        """The control socket answers; where it cannot be tried, the pid file names a live process. A
        container that shares the host's pipe directory sees the daemon answer but not its pid."""
        if not self.control_pipe:
            return False
        return self.control_answers if self.control_answers is not None else self.pid_alive is not False


@dataclass
class Fabric:
    """Everything ``doctor`` reports and the backends size from. ``warnings`` lists every default used."""

    root: str
    driver: DriverReport
    gpus: list[GpuLinks]
    pci_nvidia_gpus: list[str]  # NVIDIA display/3D controllers in sysfs, seen even without a driver
    nvidia_module_version: Optional[str]
    kernel_release: Optional[str]
    rdma_devices: list[RdmaDevice]
    uverbs: list[str]
    efa: bool
    efa_reason: str
    queue_pair_cap: Optional[int]
    memlock_soft_bytes: Optional[int]  # None = unlimited
    memlock_hard_bytes: Optional[int]
    peermem: list[str]  # which PEERMEM_PATHS exist
    nccl: NcclInfo
    mps: MpsInfo
    warnings: list[str] = field(default_factory=list)
    net_interfaces: list[str] = field(default_factory=list)  # /sys/class/net: what GLOO_SOCKET_IFNAME may name
    host_address: Optional[str] = None  # what this host's name resolves to (gloo's address without GLOO_SOCKET_IFNAME)
    # Each interface's IPv4/IPv6 addresses (None: not read here). gloo takes a GLOO_SOCKET_IFNAME interface's first
    # address, and refuses one without ("Unable to find address for: <name>").
    interface_addresses: Optional[dict[str, list[str]]] = None
    # The CUDA version this process's torch was built with (torch.version.cuda); None: a CPU build, or no torch.
    # The backends reach the GPU through torch, so a CPU torch runs no compiled backend.
    torch_cuda: Optional[str] = None

    @property
    def usable_nics(self) -> list[RdmaDevice]:
        return [nic for nic in self.rdma_devices if nic.usable]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Tree:
    """Reads absolute paths (``/sys/...``) below ``root``; every read may come back None."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def path(self, absolute: str) -> str:
        return os.path.join(self.root, absolute.lstrip("/"))

    def read(self, absolute: str) -> Optional[str]:
        try:
            with open(self.path(absolute), encoding="utf-8", errors="replace") as handle:
                return handle.read().strip()
        except OSError:
            return None

    def listdir(self, absolute: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(absolute)))
        except OSError:
            return []

    def exists(self, absolute: str) -> bool:
        return os.path.lexists(self.path(absolute))

    def inside(self, host_path: str) -> str:
        """The absolute path as seen from the machine, for a path under root."""
        relative = os.path.relpath(host_path, self.root)
        return "/" + relative if not relative.startswith("..") else host_path


def pci_path_of(real_path: str) -> tuple[str, ...]:
    """The PCI chain in a resolved sysfs device path: host bridge, bridges, the device itself."""
    parts = real_path.split(os.sep)
    for start, part in enumerate(parts):
        if _HOST_BRIDGE.match(part):
            return tuple(p for p in parts[start:] if _HOST_BRIDGE.match(p) or _BDF.match(p))
    return ()


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    shared = 0
    for x, y in zip(a, b, strict=False):  # paths differ in length
        if x != y:
            break
        shared += 1
    return shared


def parse_rate(text: Optional[str]) -> Optional[float]:
    """``"400 Gb/sec (4X NDR)"`` -> 400.0; unreadable or 0 -> None."""
    if not text:
        return None
    match = re.match(r"\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec", text)
    if not match:
        return None
    value = float(match.group(1))
    return value if value > 0 else None


def parse_port_state(text: Optional[str]) -> str:
    """``"4: ACTIVE"`` -> ``"ACTIVE"``; missing -> ``"UNKNOWN"``."""
    if not text:
        return "UNKNOWN"
    return text.split(":", 1)[-1].strip().upper() or "UNKNOWN"


def _numa(text: Optional[str]) -> Optional[int]:
    try:
        value = int(text) if text is not None else -1
    except ValueError:
        return None
    return value if value >= 0 else None


def _software_rdma(tree: _Tree, name: str) -> Optional[str]:
    """Which software RDMA device ``name`` is ("soft-RoCE", ...), or None for a hardware NIC."""
    base = f"/sys/class/infiniband/{name}"
    for prefix, kind in SOFTWARE_RDMA.items():
        if name.startswith(prefix):
            return kind
    if tree.exists(f"{base}/parent"):
        return SOFTWARE_RDMA["rxe"]
    if not tree.exists(f"{base}/device"):
        return "no bus device"  # recent rxe has none; a NIC always sits on a bus
    return None


def _read_rdma_devices(tree: _Tree, warnings: list[str]) -> list[RdmaDevice]:
    devices = []
    for name in tree.listdir("/sys/class/infiniband"):
        base = f"/sys/class/infiniband/{name}"
        device_link = tree.path(f"{base}/device")
        pci_path = pci_path_of(os.path.realpath(device_link)) if os.path.lexists(device_link) else ()
        software = _software_rdma(tree, name)
        # A software device's "device" is the Ethernet NIC under it (an ENA is Amazon's too): not its vendor.
        vendor_id = None if software else (tree.read(f"{base}/device/vendor") or "").lower() or None
        hca_type = tree.read(f"{base}/hca_type") or None
        efa = not software and (vendor_id == "0x1d0f" or bool(re.match(r"^(rdmap\d+s\d+|efa_?\d*)$", name)))
        ports = []
        for port in tree.listdir(f"{base}/ports"):
            if not port.isdigit():
                continue
            rate_text = tree.read(f"{base}/ports/{port}/rate") or ""
            entry = RdmaPort(number=int(port), state=parse_port_state(tree.read(f"{base}/ports/{port}/state")),
                             rate_gbit_per_s=parse_rate(rate_text), rate_text=rate_text,
                             link_layer=tree.read(f"{base}/ports/{port}/link_layer") or "unknown")
            if entry.active and entry.rate_gbit_per_s is None:
                warnings.append(f"{name} port {port} is ACTIVE but its rate is unreadable ({rate_text!r})")
            ports.append(entry)
        vendor = "software" if software else VENDORS.get(vendor_id or "", "Amazon" if efa else (vendor_id or "unknown"))
        model = software or ("EFA" if efa else MELLANOX_MODELS.get(hca_type or "", hca_type or "unknown"))
        devices.append(RdmaDevice(name=name, vendor_id=vendor_id, vendor=vendor, hca_type=hca_type, model=model,
                                  numa_node=_numa(tree.read(f"{base}/device/numa_node")), pci_path=pci_path,
                                  ports=tuple(sorted(ports, key=lambda p: p.number)), efa=efa,
                                  software=software is not None,
                                  efa_gdr={"1": True, "0": False}.get(tree.read(f"{base}/device/gdr") or "")
                                  if efa else None))
    return devices


def nccl_list_picks(text: str, name: str, port: Optional[int] = None) -> bool:
    """Whether NCCL's list of device names ``text`` (NCCL_IB_HCA, NCCL_SOCKET_IFNAME) picks device ``name``
    (at ``port``; None: any): a comma list of names, each a prefix of the device's name (``=`` before the list:
    the whole name), ``:port`` after one: that port only; ``^`` before the list: all but those. An empty list
    lists every device (so ``^`` alone excludes them all)."""
    exclude = text.startswith("^")
    text = text[1:] if exclude else text
    exact = text.startswith("=")
    text = text[1:] if exact else text
    entries = []
    for entry in text.split(","):
        wanted, _, wanted_port = entry.partition(":")
        if wanted:  # (a port of other digits than ASCII ones is none NCCL reads)
            entries.append((wanted, int(wanted_port) if wanted_port.isascii() and wanted_port.isdigit() else None))
    listed = not entries or any((name == wanted if exact else name.startswith(wanted))
                                and (wanted_port is None or port is None or wanted_port == port)
                                for wanted, wanted_port in entries)
    return listed != exclude


def ib_hca_selects(text: str, nic: RdmaDevice) -> bool:
    """Whether NCCL_IB_HCA (``text``) lets NCCL's IB transport use an ACTIVE port of ``nic``."""
    return any(nccl_list_picks(text, nic.name, port.number) for port in nic.ports if port.active)


def nearest_nics(gpu_path: tuple[str, ...], gpu_numa: Optional[int],
                 nics: list[RdmaDevice]) -> tuple[tuple[str, ...], str]:
    """The usable NICs nearest a GPU and how they are near (see the module docstring's rule)."""
    usable = [nic for nic in nics if nic.usable]
    best = max((_common_prefix(gpu_path, nic.pci_path) for nic in usable), default=0)
    if best >= 1:
        names = tuple(nic.name for nic in usable if _common_prefix(gpu_path, nic.pci_path) == best)
        return names, ("PCI root" if _HOST_BRIDGE.match(gpu_path[best - 1]) else "PCIe switch")
    if gpu_numa is not None:
        names = tuple(nic.name for nic in usable if nic.numa_node == gpu_numa)
        if names:
            return names, "NUMA node"
        if usable and all(nic.numa_node is not None for nic in usable):  # each on another CPU's node
            return tuple(nic.name for nic in usable), "another CPU"
    return (), "none"


def _pci_place(tree: _Tree, bus_id: str) -> tuple[tuple[str, ...], Optional[int]]:
    """(PCI path, NUMA node) of a PCI device from sysfs; ((), None) where sysfs does not show it."""
    device_dir = tree.path(f"/sys/bus/pci/devices/{bus_id}")
    pci_path = pci_path_of(os.path.realpath(device_dir)) if os.path.lexists(device_dir) else ()
    return pci_path, _numa(tree.read(f"/sys/bus/pci/devices/{bus_id}/numa_node"))


def _gpu_links(tree: _Tree, driver: DriverReport, nics: list[RdmaDevice], warnings: list[str]) -> list[GpuLinks]:
    placed = []
    for gpu in driver.gpus:
        pci_path, numa = _pci_place(tree, gpu.pci_bus_id)
        names, affinity = nearest_nics(pci_path, numa, nics)
        placed.append((gpu, pci_path, numa, names, affinity))
    # A NIC is shared by every GPU of the node it is nearest to, also those CUDA_VISIBLE_DEVICES hides
    # (other ranks' GPUs): count them from sysfs, and the visible ones where sysfs does not show them.
    on_bus = set(_pci_nvidia_gpus(tree))
    sharing = Counter(name for bdf in on_bus for name in nearest_nics(*_pci_place(tree, bdf), nics)[0])
    sharing.update(name for gpu, *_, names, _ in placed if gpu.pci_bus_id not in on_bus for name in names)
    by_name = {nic.name: nic for nic in nics}
    links = []
    for gpu, pci_path, numa, names, affinity in placed:
        measured = sum(by_name[name].active_gbit_per_s / 8.0 / sharing[name] for name in names)
        scaleout_known = measured > 0
        if not scaleout_known and any(nic.usable for nic in nics):
            why = (f"its nearest NIC(s) {', '.join(names)} report no rate" if names
                   else "no ACTIVE NIC shares its PCI root or NUMA node")
            warnings.append(f"GPU {gpu.index}: {why}; scale-out bandwidth taken as the default "
                            f"{DEFAULT_SCALEOUT_GBYTES_PER_S:g} GB/s")
        if names:
            all_nearest, _ = nearest_nics(pci_path, numa, [_assume_up(nic) for nic in nics])
            down = [name for name in all_nearest if not by_name[name].usable]
            if down:
                warnings.append(f"GPU {gpu.index}: its nearest NIC(s) {', '.join(down)} have no ACTIVE port; "
                                f"counting {', '.join(names)} ({affinity}) instead")
        per_link = NVLINK_GBYTES_PER_LINK.get(tuple(gpu.compute_capability))
        nvlink_known = bool(gpu.nvlink_active_links) and per_link is not None
        nvlink = gpu.nvlink_active_links * per_link if nvlink_known else DEFAULT_NVLINK_GBYTES_PER_S
        peers = tuple(j for j, ok in enumerate(driver.peer_access[gpu.index]) if ok and j != gpu.index) \
            if gpu.index < len(driver.peer_access) else ()
        links.append(GpuLinks(info=gpu, numa_node=numa, pci_path=pci_path, peers=peers, nearest_nics=names,
                              nic_affinity=affinity,
                              scaleout_gbytes_per_s=measured if scaleout_known else DEFAULT_SCALEOUT_GBYTES_PER_S,
                              scaleout_measured=scaleout_known, nvlink_gbytes_per_s=nvlink,
                              nvlink_measured=nvlink_known))
    if driver.gpus and not any(nic.usable for nic in nics):
        warnings.append(f"no RDMA NIC with an ACTIVE port: scale-out bandwidth taken as the default "
                        f"{DEFAULT_SCALEOUT_GBYTES_PER_S:g} GB/s per GPU")
    return links


def _named_by_ib_hca(nics: list[RdmaDevice], hca: str, warnings: list[str]) -> list[RdmaDevice]:
    """The NICs NCCL's IB transport may use under NCCL_IB_HCA (``hca``), whose ports are up or not: only those
    can be a GPU's NIC (affinity, GPUDirect distance, bandwidth). All of them where it is unset, names none
    (NCCL then falls back to sockets: the doctor says so) or the NICs are EFA (whose plugin does not read it)."""
    if not hca or any(nic.efa for nic in nics):
        return nics
    named = [nic for nic in nics if ib_hca_selects(hca, _assume_up(nic))]
    left = [nic.name for nic in nics if nic not in named and not nic.software]  # (software ones never count)
    if not named or not left:
        return nics
    warnings.append(f"NCCL_IB_HCA={hca} leaves out {', '.join(left)}: the GPUs' NICs are counted among "
                    f"{', '.join(nic.name for nic in named)} only")
    return named


def _assume_up(nic: RdmaDevice) -> RdmaDevice:
    """The NIC as if its ports were ACTIVE: to find which NIC *would* be nearest."""
    ports = nic.ports or (RdmaPort(1, "ACTIVE", None, "", "unknown"),)
    return dataclasses.replace(nic, ports=tuple(dataclasses.replace(port, state="ACTIVE") for port in ports))


def _pci_nvidia_gpus(tree: _Tree) -> list[str]:
    found = []
    for bdf in tree.listdir("/sys/bus/pci/devices"):
        vendor = (tree.read(f"/sys/bus/pci/devices/{bdf}/vendor") or "").lower()
        pci_class = (tree.read(f"/sys/bus/pci/devices/{bdf}/class") or "").lower()
        if vendor == "0x10de" and (pci_class.startswith("0x0300") or pci_class.startswith("0x0302")):
            found.append(bdf)
    return found


def host_name_address(timeout_s: float = HOST_NAME_TIMEOUT_S, warnings: Optional[list[str]] = None) -> Optional[str]:
    """The first address this host's name resolves to, as gloo picks its own when GLOO_SOCKET_IFNAME is
    unset (None when the name does not resolve). The lookup has no timeout of its own (a resolver that does not
    answer holds it for the resolver's): past ``timeout_s`` it is left to end in its thread, and None comes
    back with a line in ``warnings``."""
    import socket
    import threading

    found: list[Optional[str]] = []

    def look_up() -> None:
        try:
            found.append(socket.getaddrinfo(socket.gethostname(), None)[0][4][0])
        except (OSError, IndexError):
            found.append(None)

    lookup = threading.Thread(target=look_up, name="ep_plugin host name lookup", daemon=True)
    lookup.start()
    lookup.join(timeout_s)
    if not found:
        if warnings is not None:
            warnings.append(f"this host's name did not resolve within {timeout_s:g} s (a resolver that does not "
                            "answer: /etc/resolv.conf, DNS): gloo, which looks it up where GLOO_SOCKET_IFNAME is "
                            "unset, waits as long; its address was not checked")
        return None
    return found[0]


def interface_addresses(names: list[str]) -> Optional[dict[str, list[str]]]:
    """Each of ``names``'s IPv4 address (SIOCGIFADDR) and IPv6 addresses (/proc/net/if_inet6), as gloo finds them
    with getifaddrs; None where this host offers no way to ask (no fcntl, or no /proc/net: not Linux). The
    names come from ``/sys/class/net`` under ``probe_fabric``'s root; the addresses are this host's (a fake tree
    passes ``addresses=``)."""
    import socket
    import struct

    try:
        import fcntl
    except ImportError:  # not a POSIX host
        return None
    if not os.path.isdir("/proc/net"):
        return None

    found: dict[str, list[str]] = {name: [] for name in names}
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            for name in names:
                try:
                    request = struct.pack("256s", name.encode()[:15])
                    found[name].append(socket.inet_ntoa(fcntl.ioctl(probe.fileno(), 0x8915, request)[20:24]))
                except OSError:  # no IPv4 address (or no such interface)
                    pass
        with open("/proc/net/if_inet6") as table:  # address, index, prefix, scope, flags, name
            for line in table:
                fields = line.split()
                if len(fields) == 6 and fields[5] in found:
                    found[fields[5]].append(socket.inet_ntop(socket.AF_INET6, bytes.fromhex(fields[0])))
    except FileNotFoundError:  # no IPv6 on this host: the IPv4 addresses stand
        pass
    except OSError:
        return None
    return found


def _memlock() -> tuple[int, int]:
    import resource

    return resource.getrlimit(resource.RLIMIT_MEMLOCK)


def torch_cuda_version() -> Optional[str]:
    """The CUDA version torch was built with ("13.0"), or None for a CPU build (or no torch at all)."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - no usable torch is a fact to report, not a crash
        return None
    return torch.version.cuda


def torch_nccl_version() -> tuple[Optional[str], Optional[str]]:
    """NCCL's version as torch was built with it: (version, None) or (None, why not)."""
    try:
        import torch

        if torch.version.cuda is None:
            return None, f"torch {torch.__version__} is a CPU build (no NCCL)"
        version = torch.cuda.nccl.version()
    except Exception as exc:  # noqa: BLE001 - any failure is a fact to report, not a crash
        return None, f"{type(exc).__name__}: {exc}"
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version), None
    code = int(version)  # NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9
    if code >= 10000:
        return f"{code // 10000}.{(code // 100) % 100}.{code % 100}", None
    return f"{code // 1000}.{(code // 100) % 10}.{code % 100}", None


def as_nccl_sees_it(environ: Mapping[str, str], config: Mapping[str, str]) -> dict[str, str]:
    """``environ`` as NCCL sees it once initialized: its config files' settings (``config``) under it."""
    return {**config, **environ}


def nccl_config_files(environ: Mapping[str, str], home: Optional[str] = None) -> list[str]:
    """The files NCCL reads settings from when it initializes, the more binding first: ``NCCL_CONF_FILE``
    when set (NCCL's docs name it since 2.23; torch bundles a later NCCL), else ``~/.nccl.conf`` (the
    user's home in passwd, not $HOME), then ``/etc/nccl.conf``. The environment beats every file. A relative
    ``NCCL_CONF_FILE`` is NCCL's fopen's: from the working directory (doctor's, taken as the job's)."""
    user_file = environ.get("NCCL_CONF_FILE", "")
    if user_file:
        user_file = os.path.abspath(user_file)
    else:
        if home is None:
            import pwd

            try:
                home = pwd.getpwuid(os.getuid()).pw_dir
            except KeyError:  # a uid without a passwd entry (some containers): NCCL reads no user file either
                home = ""
        user_file = os.path.join(home, ".nccl.conf") if home else ""
    return [path for path in (user_file, "/etc/nccl.conf") if path]


# What NCCL's config files can change: NCCL applies them when it initializes, after CUDA and the dynamic
# loader read their variables, so only its own and its net plugins' (libfabric, aws-ofi-nccl) count.
NCCL_CONFIG_PREFIXES = ("NCCL_", "FI_", "OFI_NCCL_")


def read_nccl_config(tree: _Tree, environ: Mapping[str, str], home: Optional[str] = None,
                     warnings: Optional[list[str]] = None) -> tuple[dict[str, str], dict[str, str]]:
    """(variable -> value, variable -> its file) for what NCCL's config files set and NCCL will use: a
    variable the environment does not set, named by the first file that names it (``nccl_config_files``'
    order). NCCL splits each line at its first ``=`` as it stands (no spaces trimmed, no comment syntax),
    so ``NCCL_IB_DISABLE = 1`` sets nothing NCCL reads: such lines go to ``warnings``. A cluster's
    /etc/nccl.conf with NCCL_IB_DISABLE=1 changes the scale-out path as the variable does."""
    settings: dict[str, str] = {}
    sources: dict[str, str] = {}
    for path in nccl_config_files(environ, home):
        for line in (tree.read(path) or "").splitlines():
            name, equals, value = line.partition("=")
            if not equals:
                continue
            if name != name.strip():  # a variable named with its spaces: nothing NCCL reads
                if name.strip().startswith(NCCL_CONFIG_PREFIXES) and warnings is not None:
                    warnings.append(f"{path}: NCCL ignores {line!r} (spaces around the name: write "
                                    f"{name.strip()}=...)")
                continue
            if name.startswith(NCCL_CONFIG_PREFIXES) and name not in environ and name not in settings:
                settings[name], sources[name] = value, path
    return settings, sources


def _nccl_info(tree: _Tree, environ: Mapping[str, str], version: Callable[[], tuple[Optional[str], Optional[str]]],
               config: tuple[dict[str, str], dict[str, str]] = ({}, {})) -> NcclInfo:
    """``environ``: as NCCL sees it (its config files' settings included); ``config``: what those set
    (``read_nccl_config``). ``env`` lists the environment's own variables, not the files'."""
    text, error = version()
    directories = [d for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d] + list(NCCL_PLUGIN_DIRS)
    libraries: list[str] = []
    for directory in directories:
        for found in sorted(glob.glob(os.path.join(tree.path(directory), "libnccl-net*.so*"))):
            shown = tree.inside(found)
            if shown not in libraries:
                libraries.append(shown)
    return NcclInfo(version=text, version_error=error, net_plugin=environ.get("NCCL_NET_PLUGIN"),
                    plugin_libraries=libraries,
                    env={key: environ[key] for key in NCCL_ENV_KEYS if key in environ and key not in config[1]},
                    config=dict(config[0]), config_source=dict(config[1]))


def _mps_info(tree: _Tree, environ: Mapping[str, str], warnings: list[str]) -> MpsInfo:
    pipe_directory = environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE_DIRECTORY
    pid_text = tree.read(os.path.join(pipe_directory, "nvidia-cuda-mps-control.pid"))
    pid = int(pid_text) if pid_text and pid_text.isdigit() else None
    percentage_text = environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if percentage_text is not None and not percentage_text.strip():
        percentage_text = None  # blank is unset, as for every variable here
    # The share as the SM sizing reads it: none for "nan", "inf" (and no JSON), 0 or less (the MPS verdict
    # reports the value).
    percentage = mps_thread_percentage(environ)
    if percentage_text is not None and percentage is None:
        try:
            float(percentage_text)
        except ValueError:
            warnings.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={percentage_text!r} is not a number")
    control = os.path.join(pipe_directory, "control")
    return MpsInfo(pipe_directory=pipe_directory, control_pipe=tree.exists(control),
                   pid=pid, pid_alive=None if pid is None else tree.exists(f"/proc/{pid}"),
                   active_thread_percentage=percentage, active_thread_percentage_text=percentage_text,
                   control_answers=_socket_answers(tree.path(control)))


def _socket_answers(path: str) -> Optional[bool]:
    """Whether a Unix socket accepts a connection (closed at once, no command sent); None where ``path`` is
    no socket or the connection cannot be tried (permissions, a path too long for a socket address)."""
    import socket
    import stat

    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(1.0)
            connection.connect(path)
        return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


def probe_fabric(*, root: Union[str, os.PathLike] = "/", environ: Optional[Mapping[str, str]] = None,
                 driver: Union[DriverReport, Callable[[], DriverReport], None] = None,
                 memlock: Optional[Callable[[], tuple[int, int]]] = None,
                 nccl_version: Optional[Callable[[], tuple[Optional[str], Optional[str]]]] = None,
                 dmabuf_export: bool = True, host_address: Optional[Callable[[], Optional[str]]] = None,
                 addresses: Optional[Callable[[list[str]], Optional[dict[str, list[str]]]]] = None,
                 torch_cuda: Optional[Callable[[], Optional[str]]] = None) -> Fabric:
    """Build the fabric model; never raises for a missing file, library or driver.

    Args:
        root: where ``/sys``, ``/dev``, ``/proc`` and the MPS pipe directory are read from.
        environ: the environment (default ``os.environ``).
        driver: a DriverReport, or a callable returning one (default: ``probe_driver``).
        memlock: returns (soft, hard) RLIMIT_MEMLOCK in bytes, -1 = unlimited.
        nccl_version: returns (version, error) (default: torch's NCCL).
        dmabuf_export: passed to ``probe_driver`` when ``driver`` is not given.
        host_address: returns what this host's name resolves to (default: ``host_name_address``).
        addresses: returns the addresses of the interfaces it is given (default: ``interface_addresses``).
        torch_cuda: returns torch's CUDA version, None for a CPU build (default: ``torch_cuda_version``).
    """
    tree = _Tree(os.fspath(root))
    environ = os.environ if environ is None else environ
    warnings: list[str] = []
    config = read_nccl_config(tree, environ, warnings=warnings)
    environ = as_nccl_sees_it(environ, config[0])
    if driver is None:
        report = probe_driver(dmabuf_export=dmabuf_export)
    elif isinstance(driver, DriverReport):
        report = driver
    else:
        report = driver()
    nics = _read_rdma_devices(tree, warnings)
    gpus = _gpu_links(tree, report, _named_by_ib_hca(nics, environ.get("NCCL_IB_HCA", ""), warnings), warnings)
    efa_nics = [nic.name for nic in nics if nic.efa]
    reasons = []
    if environ.get("FI_PROVIDER", "").lower() == "efa":
        if efa_nics:
            reasons.append("FI_PROVIDER=efa")
        else:  # only libfabric reads it, and NCCL loads libfabric only through aws-ofi-nccl, for EFA devices
            warnings.append("FI_PROVIDER=efa is set, but this host has no EFA device: ignored (NCCL uses its own "
                            "transports here)")
    if efa_nics:
        shown = ", ".join(efa_nics[:3]) + (", ..." if len(efa_nics) > 3 else "")
        reasons.append(f"{len(efa_nics)} EFA device(s): {shown}")
    soft, hard = (memlock or _memlock)()
    interfaces = tree.listdir("/sys/class/net")
    fabric = Fabric(
        root=tree.root, driver=report, gpus=gpus, pci_nvidia_gpus=_pci_nvidia_gpus(tree),
        nvidia_module_version=tree.read("/sys/module/nvidia/version"),
        kernel_release=tree.read("/proc/sys/kernel/osrelease"),
        rdma_devices=nics,
        uverbs=sorted((name for name in tree.listdir("/dev/infiniband") if re.fullmatch(r"uverbs\d+", name)),
                      key=lambda name: int(name[len("uverbs"):])),
        efa=bool(reasons), efa_reason="; ".join(reasons), queue_pair_cap=EFA_QUEUE_PAIR_CAP if reasons else None,
        memlock_soft_bytes=None if soft < 0 else soft, memlock_hard_bytes=None if hard < 0 else hard,
        peermem=[path for path in PEERMEM_PATHS if tree.exists(path)],
        nccl=_nccl_info(tree, environ, nccl_version or torch_nccl_version, config),
        mps=_mps_info(tree, environ, warnings), warnings=warnings, net_interfaces=interfaces,
        host_address=host_address() if host_address else host_name_address(warnings=warnings),
        interface_addresses=(addresses or interface_addresses)(
            interfaces), torch_cuda=(torch_cuda or torch_cuda_version)())
    return fabric


def cap_queue_pairs(requested: int, fabric: Fabric) -> int:
    """Queue pairs per peer a backend should open: ``requested``, capped on EFA (at least 1)."""
    if fabric.queue_pair_cap is None:
        return max(1, requested)
    return max(1, min(requested, fabric.queue_pair_cap))


@functools.lru_cache(maxsize=1)
def local_fabric() -> Fabric:
    """This machine's fabric, probed once per process (without the live DMA-BUF export)."""
    return probe_fabric(dmabuf_export=False)


def gpu_link_bandwidths(device_index: int, fabric: Optional[Fabric] = None) -> tuple[Optional[float], Optional[float]]:
    """(NVLink, scale-out) GB/s of one GPU for ``resolve_num_sms``; None where only a default is known.

    ``device_index`` is the CUDA ordinal in this process (``CUDA_VISIBLE_DEVICES`` applies). The
    defaults are left to ``resolve_num_sms`` so that the warning is logged where the value is used.
    """
    fabric = fabric or local_fabric()
    for gpu in fabric.gpus:
        if gpu.info.index == device_index:
            return (gpu.nvlink_gbytes_per_s if gpu.nvlink_measured else None,
                    gpu.scaleout_gbytes_per_s if gpu.scaleout_measured else None)
    return None, None
