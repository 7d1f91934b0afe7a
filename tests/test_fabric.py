"""The fabric model on fake sysfs trees: NIC affinity, per-GPU bandwidth, EFA, modules, MPS."""

import os

import pytest
from fake_fabric import (
    add_gpu_pci,
    add_rdma,
    add_soft_rdma,
    add_uverbs,
    dgx_chains,
    dgx_cx7,
    driver,
    gpu,
    make_fabric,
    p5en_efa,
    write,
)

from ep_plugin import doctor
from ep_plugin.transport.cuda_driver import DriverReport, normalize_bus_id
from ep_plugin.transport.fabric import (
    DEFAULT_SCALEOUT_GBYTES_PER_S,
    cap_queue_pairs,
    gpu_link_bandwidths,
    parse_port_state,
    parse_rate,
    pci_path_of,
    probe_fabric,
)


def test_cx7_each_gpu_counts_only_the_nic_behind_its_switch(tmp_path):
    fabric = make_fabric(tmp_path, dgx_cx7(tmp_path))
    assert [g.nearest_nics for g in fabric.gpus] == [(f"mlx5_{i}",) for i in range(8)]
    assert {g.nic_affinity for g in fabric.gpus} == {"PCIe switch"}
    # 400 Gb/s per GPU, not the node's 3.2 Tb/s.
    assert [g.scaleout_gbytes_per_s for g in fabric.gpus] == [50.0] * 8
    assert all(g.scaleout_measured for g in fabric.gpus)
    assert [g.numa_node for g in fabric.gpus] == [0] * 4 + [1] * 4
    nic = fabric.rdma_devices[0]
    assert (nic.vendor, nic.hca_type, nic.model, nic.numa_node) == ("Mellanox", "MT4129", "ConnectX-7", 0)
    assert nic.ports[0].active and nic.ports[0].rate_gbit_per_s == 400.0 and nic.ports[0].link_layer == "InfiniBand"
    assert fabric.gpus[0].pci_path[0] == "pci0000:15" and fabric.gpus[0].pci_path[-1] == "0000:18:00.0"
    assert not fabric.efa and fabric.queue_pair_cap is None and cap_queue_pairs(129, fabric) == 129
    assert len(fabric.uverbs) == 8 and fabric.peermem == ["/sys/module/nvidia_peermem/version"]
    assert fabric.warnings == []
    # NVLink: 18 active links x 25 GB/s on sm_90.
    assert gpu_link_bandwidths(3, fabric) == (450.0, 50.0)
    assert gpu_link_bandwidths(42, fabric) == (None, None)


def test_p5en_efa_two_nics_per_gpu_and_queue_pair_cap(tmp_path):
    fabric = make_fabric(tmp_path, p5en_efa(tmp_path), {"FI_PROVIDER": "efa"})
    assert len(fabric.rdma_devices) == 16
    assert all(nic.name.startswith("rdmap") and nic.name.endswith("s0") for nic in fabric.rdma_devices)
    assert {(nic.vendor, nic.model, nic.hca_type) for nic in fabric.rdma_devices} == {("Amazon", "EFA", None)}
    assert {port.link_layer for nic in fabric.rdma_devices for port in nic.ports} == {"Unknown"}
    assert fabric.efa and "FI_PROVIDER=efa" in fabric.efa_reason and "16 EFA device(s): rdmap193s0" in fabric.efa_reason
    assert fabric.queue_pair_cap == 2
    assert cap_queue_pairs(129, fabric) == 2 and cap_queue_pairs(1, fabric) == 1 and cap_queue_pairs(0, fabric) == 1
    assert [len(g.nearest_nics) for g in fabric.gpus] == [2] * 8
    assert [g.scaleout_gbytes_per_s for g in fabric.gpus] == [50.0] * 8  # 2 x 200 Gb/s
    assert fabric.nccl.plugin_libraries == ["/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so"]
    assert fabric.nccl.env == {"FI_PROVIDER": "efa"}


def test_software_rdma_devices_are_listed_but_never_count(tmp_path):
    # Soft-RoCE / soft-iWARP move data through the CPU: no GPUDirect RDMA. rxe0 sits on an Ethernet function
    # behind GPU 0's PCIe switch, so by PCI path alone it would take half of GPU 0's scale-out.
    report = dgx_cx7(tmp_path)
    _, nic_chain = dgx_chains(0)
    add_soft_rdma(tmp_path, "rxe0", chain=nic_chain[:-1] + ["0000:19:00.1"])
    add_soft_rdma(tmp_path, "siw0", chain=["pci0000:00", "0000:00:1f.6"])
    add_soft_rdma(tmp_path, "roce_lab", netdev="eth1")  # a renamed rxe: its parent file says what it is
    write(tmp_path / "sys/class/infiniband/odd0/ports/1/state", "4: ACTIVE")  # no device link: on no bus
    fabric = make_fabric(tmp_path, report)
    soft = {nic.name: nic.model for nic in fabric.rdma_devices if nic.software}
    assert soft == {"rxe0": "soft-RoCE", "siw0": "soft-iWARP", "roce_lab": "soft-RoCE", "odd0": "no bus device"}
    assert sorted(nic.name for nic in fabric.usable_nics) == [f"mlx5_{i}" for i in range(8)]
    assert [g.nearest_nics for g in fabric.gpus] == [(f"mlx5_{i}",) for i in range(8)]
    assert [g.scaleout_gbytes_per_s for g in fabric.gpus] == [50.0] * 8


def test_efa_detected_from_device_names_without_fi_provider(tmp_path):
    fabric = make_fabric(tmp_path, p5en_efa(tmp_path), {})
    assert fabric.efa and "FI_PROVIDER" not in fabric.efa_reason and fabric.queue_pair_cap == 2


def test_unreadable_rate_gives_default_and_warnings_never_zero(tmp_path):
    fabric = make_fabric(tmp_path, p5en_efa(tmp_path, rate=""))
    assert all(g.scaleout_gbytes_per_s == DEFAULT_SCALEOUT_GBYTES_PER_S and not g.scaleout_measured
               for g in fabric.gpus)
    assert any("rate is unreadable" in w for w in fabric.warnings)
    assert any(w.startswith("GPU 0:") and "report no rate" in w for w in fabric.warnings)
    assert gpu_link_bandwidths(0, fabric) == (450.0, None)


def test_port_down_moves_the_gpu_to_the_next_nic_and_shares_it(tmp_path):
    fabric = make_fabric(tmp_path, dgx_cx7(tmp_path, down=(0,)))
    gpu0, gpu1 = fabric.gpus[:2]
    assert gpu0.nearest_nics == ("mlx5_1",) and gpu0.nic_affinity == "PCI root"
    assert gpu1.nearest_nics == ("mlx5_1",)
    # mlx5_1 now serves two GPUs: half each.
    assert (gpu0.scaleout_gbytes_per_s, gpu1.scaleout_gbytes_per_s) == (25.0, 25.0)
    assert [g.scaleout_gbytes_per_s for g in fabric.gpus[2:]] == [50.0] * 6
    assert any("mlx5_0" in w and "no ACTIVE port" in w for w in fabric.warnings)
    assert not fabric.rdma_devices[0].usable and fabric.rdma_devices[0].ports[0].state == "DOWN"


def test_every_port_down_gives_default_bandwidth_and_a_warning(tmp_path):
    fabric = make_fabric(tmp_path, dgx_cx7(tmp_path, down=tuple(range(8))))
    assert fabric.usable_nics == []
    assert all(g.nearest_nics == () and g.nic_affinity == "none" for g in fabric.gpus)
    assert all(g.scaleout_gbytes_per_s == DEFAULT_SCALEOUT_GBYTES_PER_S and not g.scaleout_measured
               for g in fabric.gpus)
    assert any("no RDMA NIC with an ACTIVE port" in w for w in fabric.warnings)


def test_no_nics_default_bandwidth(tmp_path):
    gpu_chain, _ = dgx_chains(0)
    add_gpu_pci(tmp_path, gpu_chain, 0)
    fabric = make_fabric(tmp_path, driver([gpu(0, gpu_chain[-1])]))
    assert fabric.rdma_devices == [] and fabric.uverbs == []
    only = fabric.gpus[0]
    assert (only.nearest_nics, only.nic_affinity, only.scaleout_measured) == ((), "none", False)
    assert only.scaleout_gbytes_per_s == DEFAULT_SCALEOUT_GBYTES_PER_S > 0
    assert fabric.warnings == [f"no RDMA NIC with an ACTIVE port: scale-out bandwidth taken as the default "
                               f"{DEFAULT_SCALEOUT_GBYTES_PER_S:g} GB/s per GPU"]


def test_flat_vm_topology_shares_one_nic_evenly(tmp_path):
    add_gpu_pci(tmp_path, ["pci0000:00", "0000:00:05.0"])
    add_gpu_pci(tmp_path, ["pci0000:00", "0000:00:06.0"])
    add_rdma(tmp_path, "mlx5_0", ["pci0000:00", "0000:00:07.0"])
    fabric = make_fabric(tmp_path, driver([gpu(0, "0000:00:05.0"), gpu(1, "0000:00:06.0")]))
    assert [(g.nearest_nics, g.nic_affinity, g.scaleout_gbytes_per_s) for g in fabric.gpus] == \
        [(("mlx5_0",), "PCI root", 25.0)] * 2


def test_nic_shared_with_gpus_hidden_by_cuda_visible_devices(tmp_path):
    # One rank per GPU with CUDA_VISIBLE_DEVICES=<its GPU>: the NIC is still shared by both GPUs.
    add_gpu_pci(tmp_path, ["pci0000:00", "0000:00:05.0"])
    add_gpu_pci(tmp_path, ["pci0000:00", "0000:00:06.0"])
    add_rdma(tmp_path, "mlx5_0", ["pci0000:00", "0000:00:07.0"])
    fabric = make_fabric(tmp_path, driver([gpu(0, "0000:00:06.0")]))
    assert fabric.gpus[0].scaleout_gbytes_per_s == 25.0


def vmd_pairs(root, down=()):
    """Two GPU + NIC pairs, each behind its own PCIe switch on its own root port of one Intel VMD domain
    (5 hex digits), which the kernel nests under the VMD controller, a device of domain 0000."""
    vmd = ["pci0000:17", "0000:17:05.5", "pci10000:00"]
    gpus = []
    for pair, root_port in enumerate(("10000:00:02.0", "10000:00:03.0")):
        bus = 1 + 4 * pair
        switch = vmd + [root_port, f"10000:{bus:02x}:00.0"]
        gpu_chain = switch + [f"10000:{bus + 1:02x}:00.0", f"10000:{bus + 2:02x}:00.0"]
        add_gpu_pci(root, gpu_chain)
        state = "1: DOWN" if pair in down else "4: ACTIVE"
        add_rdma(root, f"mlx5_{pair}", switch + [f"10000:{bus + 1:02x}:01.0", f"10000:{bus + 3:02x}:00.0"],
                 ports=((state, "400 Gb/sec (4X NDR)", "InfiniBand"),))
        gpus.append(gpu(pair, normalize_bus_id(f"{0x10000:08X}:{bus + 2:02X}:00.0")))  # NVML spells 8 digits
    return driver(gpus)


def test_vmd_domains_keep_their_pci_paths_switches_and_root_ports(tmp_path):
    fabric = make_fabric(tmp_path, vmd_pairs(tmp_path))
    assert [g.info.pci_bus_id for g in fabric.gpus] == ["10000:03:00.0", "10000:07:00.0"]
    assert fabric.gpus[0].pci_path == ("pci0000:17", "0000:17:05.5", "pci10000:00", "10000:00:02.0",
                                       "10000:01:00.0", "10000:02:00.0", "10000:03:00.0")
    assert fabric.rdma_devices[1].pci_path[-1] == "10000:08:00.0"
    assert [(g.nearest_nics, g.nic_affinity, g.scaleout_gbytes_per_s) for g in fabric.gpus] == \
        [(("mlx5_0",), "PCIe switch", 50.0), (("mlx5_1",), "PCIe switch", 50.0)]
    # Another root port of the same VMD domain shares only its host bridge (pci10000:00): not a switch.
    fabric = make_fabric(tmp_path / "down", vmd_pairs(tmp_path / "down", down=(0,)))
    assert (fabric.gpus[0].nearest_nics, fabric.gpus[0].nic_affinity) == (("mlx5_1",), "PCI root")


def test_numa_node_is_the_fallback_when_no_nic_shares_the_pci_root(tmp_path):
    add_gpu_pci(tmp_path, ["pci0000:15", "0000:15:01.0", "0000:16:00.0"], numa=1)
    add_rdma(tmp_path, "mlx5_0", ["pci0000:37", "0000:37:01.0", "0000:38:00.0"], numa=0)
    add_rdma(tmp_path, "mlx5_1", ["pci0000:9a", "0000:9a:01.0", "0000:9b:00.0"], numa=1)
    fabric = make_fabric(tmp_path, driver([gpu(0, "0000:16:00.0")]))
    assert (fabric.gpus[0].nearest_nics, fabric.gpus[0].nic_affinity) == (("mlx5_1",), "NUMA node")
    assert fabric.gpus[0].scaleout_gbytes_per_s == 50.0


def test_gpu_missing_from_sysfs_has_no_affinity_and_warns(tmp_path):
    add_rdma(tmp_path, "mlx5_0", ["pci0000:37", "0000:37:01.0", "0000:38:00.0"], numa=0)
    fabric = make_fabric(tmp_path, driver([gpu(0, "0000:99:00.0")]))
    assert fabric.gpus[0].nic_affinity == "none" and not fabric.gpus[0].scaleout_measured
    assert any("no ACTIVE NIC shares its PCI root or NUMA node" in w for w in fabric.warnings)


@pytest.mark.parametrize("text,rate", [
    ("400 Gb/sec (4X NDR)", 400.0), ("2.5 Gb/sec (1X SDR)", 2.5), ("100 Gb/sec (4X EDR)", 100.0),
    ("0 Gb/sec", None), ("", None), (None, None), ("fast", None),
])
def test_parse_rate(text, rate):
    assert parse_rate(text) == rate


def test_parse_port_state_and_pci_path():
    assert parse_port_state("4: ACTIVE") == "ACTIVE" and parse_port_state("1: DOWN") == "DOWN"
    assert parse_port_state(None) == "UNKNOWN"
    assert pci_path_of("/tmp/x/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/infiniband/mlx5_0") == \
        ("pci0000:15", "0000:15:01.0", "0000:16:00.0")
    assert pci_path_of("/sys/devices/virtual/net/lo") == ()


@pytest.mark.parametrize("path", ["/sys/module/nvidia_peermem/version", "/sys/kernel/mm/memory_peers/nv_mem/version"])
def test_peermem_module_paths(tmp_path, path):
    write(tmp_path / path.lstrip("/"), "1.0")
    fabric = make_fabric(tmp_path, DriverReport(loaded=False, error="none"))
    assert fabric.peermem == [path]


def test_memlock_unlimited_and_limited(tmp_path):
    report = DriverReport(loaded=False, error="none")
    assert make_fabric(tmp_path, report, memlock=(-1, -1)).memlock_soft_bytes is None
    limited = make_fabric(tmp_path, report, memlock=(65536, 1 << 20))
    assert (limited.memlock_soft_bytes, limited.memlock_hard_bytes) == (65536, 1 << 20)


def test_mps_daemon_state_from_the_pipe_directory(tmp_path):
    env = {"CUDA_MPS_PIPE_DIRECTORY": "/run/mps", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    report = DriverReport(loaded=False, error="none")
    assert not make_fabric(tmp_path, report, env).mps.daemon_running
    write(tmp_path / "run/mps/control", "")
    write(tmp_path / "run/mps/nvidia-cuda-mps-control.pid", "4242")
    (tmp_path / "proc" / "4242").mkdir(parents=True)
    mps = make_fabric(tmp_path, report, env).mps
    assert (mps.pipe_directory, mps.daemon_running, mps.pid, mps.active_thread_percentage) == \
        ("/run/mps", True, 4242, 25.0)
    (tmp_path / "proc" / "4242").rmdir()
    stale = make_fabric(tmp_path, report, env).mps
    assert stale.control_pipe and stale.pid_alive is False and not stale.daemon_running
    bad = make_fabric(tmp_path, report, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "half"})
    assert bad.mps.active_thread_percentage is None and any("not a number" in w for w in bad.warnings)
    # Blank is unset (it warned "not a number"); no share (-5) is none (it showed as "MPS active threads -5%").
    blank = make_fabric(tmp_path, report, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": " "})
    assert blank.mps.active_thread_percentage_text is None and not any("PERCENTAGE" in w for w in blank.warnings)
    negative = make_fabric(tmp_path, report, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "-5"})
    assert negative.mps.active_thread_percentage is None and negative.mps.active_thread_percentage_text == "-5"


def test_mps_daemon_that_answers_on_its_control_socket_runs_whatever_its_pid():
    """A container sharing the host's pipe directory sees the daemon's socket but not its pid (another PID
    namespace): it read as a stale directory, and doctor asked to start a daemon that was running."""
    import socket
    import tempfile
    from pathlib import Path

    report = DriverReport(loaded=False, error="none")
    env = {"CUDA_MPS_PIPE_DIRECTORY": "/mps"}
    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # a Unix socket's path has at most 107 bytes
        root = Path(short)
        write(root / "mps/nvidia-cuda-mps-control.pid", "4242")  # no /proc/4242 here
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(root / "mps/control"))
        listener.listen(1)
        with listener:
            mps = make_fabric(root, report, env).mps
            assert (mps.control_answers, mps.pid_alive, mps.daemon_running) == (True, False, True)
            notes = doctor.mps_verdict(make_fabric(root, report, env), doctor.Options()).notes
            assert any("pid 4242 is not visible here" in note for note in notes), notes
        (root / "proc" / "4242").mkdir(parents=True)  # a live pid, but nobody listens: stale all the same
        stale = make_fabric(root, report, env).mps
        assert (stale.control_answers, stale.pid_alive, stale.daemon_running) == (False, True, False)


def test_empty_machine_probes_without_error(tmp_path):
    fabric = make_fabric(tmp_path, DriverReport(loaded=False, error="no CUDA driver (libcuda.so.1 missing)"))
    assert (fabric.gpus, fabric.rdma_devices, fabric.pci_nvidia_gpus, fabric.warnings) == ([], [], [], [])
    assert fabric.mps.pipe_directory == "/tmp/nvidia-mps" and not fabric.mps.daemon_running
    assert fabric.to_dict()["driver"]["error"].startswith("no CUDA driver")


def test_gpu_on_the_bus_is_seen_without_a_driver(tmp_path):
    add_gpu_pci(tmp_path, ["pci0000:00", "0000:00:05.0"])
    add_rdma(tmp_path, "mlx5_0", ["pci0000:00", "0000:00:07.0"])  # a NIC is not a GPU
    fabric = make_fabric(tmp_path, DriverReport(loaded=False, error="none"))
    assert fabric.pci_nvidia_gpus == ["0000:00:05.0"]


@pytest.mark.parametrize("links,cc,expected", [(18, (9, 0), (450.0, True)), (12, (8, 0), (300.0, True)),
                                               (18, (10, 0), (900.0, True)), (0, (9, 0), (450.0, False)),
                                               (None, (9, 0), (450.0, False)), (4, (7, 5), (450.0, False))])
def test_nvlink_bandwidth_from_links_and_architecture(tmp_path, links, cc, expected):
    fabric = make_fabric(tmp_path, driver([gpu(0, "0000:00:05.0", nvlinks=links, cc=cc)]))
    assert (fabric.gpus[0].nvlink_gbytes_per_s, fabric.gpus[0].nvlink_measured) == expected


def test_default_probe_of_this_machine_does_not_raise():
    fabric = probe_fabric(dmabuf_export=False)
    assert isinstance(fabric.gpus, list)
    if not fabric.driver.loaded:
        assert fabric.gpus == [] and "CUDA driver" in fabric.driver.error
    assert fabric.kernel_release == os.uname().release


def test_uverbs_listing(tmp_path):
    add_uverbs(tmp_path, 12)
    write(tmp_path / "dev/infiniband/rdma_cm", "")
    fabric = make_fabric(tmp_path, DriverReport(loaded=False, error="none"))
    assert fabric.uverbs == [f"uverbs{i}" for i in range(12)]  # numeric order, verbs devices only


def test_a_nic_only_on_another_cpus_node_is_the_gpus_across_that_link(tmp_path):
    """A GPU whose NICs all sit on the other CPU's NUMA node (no PCI root, no node shared) had none nearest
    ("none"), so the doctor judged no distance and reported GPUDirect RDMA, which NCCL does not use across the
    link between CPUs (SYS, past its default level): it stages through host memory."""
    add_gpu_pci(tmp_path, ["pci0000:15", "0000:15:00.0"], numa=0)
    add_rdma(tmp_path, "mlx5_0", ["pci0000:b7", "0000:b7:00.0"], numa=1)
    fabric = make_fabric(tmp_path, driver([gpu(0, "0000:15:00.0")]))
    [only] = fabric.gpus
    assert (only.nearest_nics, only.nic_affinity, only.scaleout_measured) == (("mlx5_0",), "another CPU", True)
    problems = []
    assert doctor._too_far_for_gdr(fabric, "", problems) and "NCCL_NET_GDR_LEVEL=SYS" in problems[0].fix
    assert not doctor._too_far_for_gdr(fabric, "SYS", [])


def test_a_host_name_lookup_that_never_answers_is_given_up_with_a_warning(monkeypatch):
    """getaddrinfo has no timeout of its own: a resolver that does not answer held doctor for its own timeout
    (tens of seconds per name server), with no word. Now it is given up after the doctor's wait, and says why."""
    import socket
    import threading
    import time

    from ep_plugin.transport.fabric import host_name_address

    answered = threading.Event()

    def silent_resolver(*args, **kwargs):
        answered.wait(30)
        raise OSError("no answer")

    monkeypatch.setattr(socket, "getaddrinfo", silent_resolver)
    warnings = []
    start = time.monotonic()
    try:
        assert host_name_address(timeout_s=0.3, warnings=warnings) is None
        assert time.monotonic() - start < 5.0
    finally:
        answered.set()
    assert len(warnings) == 1 and "did not resolve within 0.3 s" in warnings[0], warnings
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: [(2, 1, 6, "", ("10.9.8.7", 0))])
    warnings = []
    assert host_name_address(timeout_s=0.3, warnings=warnings) == "10.9.8.7" and warnings == []
