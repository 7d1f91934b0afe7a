"""Fake machines for the fabric and doctor tests: sysfs trees in a tmp dir plus a driver report.

A tree mimics the kernel's layout: PCI devices live under ``sys/devices/pciDDDD:BB/...`` with
``sys/bus/pci/devices/<bdf>`` symlinks to them; each RDMA device has ``sys/class/infiniband/<name>``
with ``hca_type``, ``ports/<n>/{state,rate,link_layer}`` and a ``device`` symlink to its PCI node.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ep_plugin.transport.cuda_driver import DriverReport, GpuInfo
from ep_plugin.transport.fabric import probe_fabric

CX7_RATE = "400 Gb/sec (4X NDR)"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def add_pci_device(root: Path, chain: list[str], *, vendor: str, device_class: str = "0x020700",
                   numa: int = -1) -> Path:
    """A PCI device at ``chain`` (host bridge first, its own BDF last); returns its sysfs dir."""
    device_dir = root.joinpath("sys", "devices", *chain)
    device_dir.mkdir(parents=True, exist_ok=True)
    write(device_dir / "vendor", vendor)
    write(device_dir / "class", device_class)
    write(device_dir / "numa_node", str(numa))
    link = root / "sys" / "bus" / "pci" / "devices" / chain[-1]
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        os.symlink(device_dir, link)
    return device_dir


def add_gpu_pci(root: Path, chain: list[str], numa: int = -1) -> None:
    add_pci_device(root, chain, vendor="0x10de", device_class="0x030200", numa=numa)


def add_rdma(root: Path, name: str, chain: list[str], *, vendor: str = "0x15b3", hca_type: Optional[str] = "MT4129",
             ports: tuple[tuple[str, str, str], ...] = (("4: ACTIVE", CX7_RATE, "InfiniBand"),),
             numa: int = -1, gdr: Optional[str] = None) -> None:
    """An RDMA device; ``ports`` are (state, rate, link_layer) texts, a None-like "" rate is omitted; ``gdr``:
    the text of an EFA device's device/gdr (AWS's efa driver), None for no such file."""
    device_dir = add_pci_device(root, chain, vendor=vendor, numa=numa)
    if gdr is not None:
        write(Path(device_dir) / "gdr", gdr)
    base = root / "sys" / "class" / "infiniband" / name
    base.mkdir(parents=True, exist_ok=True)
    os.symlink(device_dir, base / "device")
    if hca_type is not None:
        write(base / "hca_type", hca_type)
    for number, (state, rate, link_layer) in enumerate(ports, start=1):
        write(base / "ports" / str(number) / "state", state)
        if rate:
            write(base / "ports" / str(number) / "rate", rate)
        write(base / "ports" / str(number) / "link_layer", link_layer)


def add_soft_rdma(root: Path, name: str, *, netdev: str = "eth0", chain: Optional[list[str]] = None,
                  rate: str = "100 Gb/sec (4X EDR)") -> None:
    """A software RDMA device over ``netdev``, one ACTIVE Ethernet port: soft-iWARP when ``name`` starts with
    "siw", else soft-RoCE (rxe), which has a ``parent`` file naming the netdev. With ``chain`` its ``device``
    link goes to that PCI Ethernet NIC (siw, and rxe on older kernels); without, there is none (rxe today)."""
    base = root / "sys" / "class" / "infiniband" / name
    base.mkdir(parents=True, exist_ok=True)
    if chain is not None:
        os.symlink(add_pci_device(root, chain, vendor="0x8086", device_class="0x020000"), base / "device")
    if not name.startswith("siw"):
        write(base / "parent", netdev)
    write(base / "ports" / "1" / "state", "4: ACTIVE")
    write(base / "ports" / "1" / "rate", rate)
    write(base / "ports" / "1" / "link_layer", "Ethernet")


def add_uverbs(root: Path, count: int) -> None:
    for index in range(count):
        write(root / "dev" / "infiniband" / f"uverbs{index}", "")


def add_peermem(root: Path) -> None:
    write(root / "sys" / "module" / "nvidia_peermem" / "version", "580.65.06")


def gpu(index: int, bus_id: str, *, name: str = "NVIDIA H100 80GB HBM3", sms: int = 132, cc=(9, 0),
        gdr: Optional[bool] = True, dmabuf: Optional[bool] = True, export: str = "ok",
        nvlinks: Optional[int] = 18, mig: Optional[bool] = False) -> GpuInfo:
    return GpuInfo(index=index, name=name, pci_bus_id=bus_id, sm_count=sms, compute_capability=cc,
                   gpudirect_rdma=gdr, dmabuf_supported=dmabuf, dmabuf_export=export if index == 0 else "not tried",
                   nvlink_active_links=nvlinks, mps_enabled=False, mig_enabled=mig)


def driver(gpus: list[GpuInfo], *, peer: bool = True) -> DriverReport:
    count = len(gpus)
    return DriverReport(loaded=True, driver_version=13000, gpus=gpus,
                        peer_access=[[i == j or peer for j in range(count)] for i in range(count)])


def dgx_chains(pair: int) -> tuple[list[str], list[str]]:
    """GPU and NIC of pair 0..7: one PCIe switch per pair, two switches per host bridge."""
    host_bus = [0x15, 0x37, 0x9a, 0xb8][pair // 2]
    host = f"pci0000:{host_bus:02x}"
    root_port = f"0000:{host_bus:02x}:{1 + pair % 2:02x}.0"
    bus = host_bus + 1 + 4 * (pair % 2)
    upstream = f"0000:{bus:02x}:00.0"
    gpu_chain = [host, root_port, upstream, f"0000:{bus + 1:02x}:00.0", f"0000:{bus + 2:02x}:00.0"]
    nic_chain = [host, root_port, upstream, f"0000:{bus + 1:02x}:01.0", f"0000:{bus + 3:02x}:00.0"]
    return gpu_chain, nic_chain


def dgx_cx7(root: Path, *, down: tuple[int, ...] = (), peermem: bool = True, dmabuf: bool = True,
            export: str = "ok", uverbs: bool = True) -> DriverReport:
    """8 H100 + 8 ConnectX-7 400G (MT4129), NIC p behind GPU p's PCIe switch; NUMA 0 for pairs 0-3."""
    gpus = []
    for pair in range(8):
        gpu_chain, nic_chain = dgx_chains(pair)
        numa = 0 if pair < 4 else 1
        add_gpu_pci(root, gpu_chain, numa)
        state = "1: DOWN" if pair in down else "4: ACTIVE"
        add_rdma(root, f"mlx5_{pair}", nic_chain, ports=((state, CX7_RATE, "InfiniBand"),), numa=numa)
        gpus.append(gpu(pair, gpu_chain[-1], dmabuf=dmabuf, export=export))
    if uverbs:
        add_uverbs(root, 8)
    if peermem:
        add_peermem(root)
    return driver(gpus)


def p5en_efa(root: Path, *, rate: str = "200 Gb/sec (4X HDR)", plugin: bool = True,
             gdr: Optional[str] = None) -> DriverReport:
    """AWS p5en-like: 8 H200, 16 EFA devices ``rdmap<bus>s0`` (two behind each GPU's switch), no hca_type;
    ``gdr``: what their device/gdr files read (None: no such file, the upstream efa driver)."""
    gpus = []
    for pair in range(8):
        gpu_chain, nic_chain = dgx_chains(pair)
        numa = 0 if pair < 4 else 1
        add_gpu_pci(root, gpu_chain, numa)
        for extra in range(2):
            bus = 0xc1 + 2 * pair + extra
            downstream = nic_chain[-2][:-4] + f"{1 + extra:02x}.0"
            chain = nic_chain[:-2] + [downstream, f"0000:{bus:02x}:00.0"]
            add_rdma(root, f"rdmap{bus}s0", chain, vendor="0x1d0f", hca_type=None,
                     ports=(("4: ACTIVE", rate, "Unknown"),), numa=numa, gdr=gdr)
        gpus.append(gpu(pair, gpu_chain[-1], name="NVIDIA H200", sms=132))
    add_uverbs(root, 16)
    if plugin:
        write(root / "opt" / "amazon" / "ofi-nccl" / "lib" / "libnccl-net-ofi.so", "")
    return driver(gpus)


def every_interface_addressed(names: list[str]) -> dict[str, list[str]]:
    """The fake interfaces' addresses: loopback for lo, a routable one for the others."""
    return {name: ["127.0.0.1"] if name == "lo" else [f"10.1.2.{3 + i}"] for i, name in enumerate(names)}


def make_fabric(root: Path, report: DriverReport, environ: Optional[dict] = None, *, memlock=(-1, -1),
                nccl: tuple = ("2.27.3", None), host_address: Optional[str] = "10.1.2.3",
                addresses=every_interface_addressed, torch_cuda: Optional[str] = "13.0"):
    return probe_fabric(root=root, environ=environ or {}, driver=report, memlock=lambda: memlock,
                        nccl_version=lambda: nccl, host_address=lambda: host_address, addresses=addresses,
                        torch_cuda=lambda: torch_cuda)
