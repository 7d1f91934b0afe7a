"""doctor's verdicts on fake machines, its exit codes and JSON, and a run on this machine."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from fake_fabric import (
    add_gpu_pci,
    add_peermem,
    add_rdma,
    add_soft_rdma,
    add_uverbs,
    dgx_chains,
    dgx_cx7,
    driver,
    every_interface_addressed,
    gpu,
    make_fabric,
    p5en_efa,
    write,
)

from ep_plugin import _cuda, doctor
from ep_plugin.config import Config
from ep_plugin.doctor import DEGRADED, NOT_NEEDED, OK, UNAVAILABLE, Options, assess, exit_code
from ep_plugin.transport import nccl_probe
from ep_plugin.transport.cuda_driver import DriverReport
from ep_plugin.transport.fabric import nccl_config_files
from ep_plugin.transport.nccl_probe import NcclProbeResult

BUILT = (True, "ep_plugin._C is built")
REGISTERED = ["hybrid", "reference"]


def verdicts(fabric, environ=None, probe=None, extension=BUILT, registered=REGISTERED, runtime_version=13000,
             **options):
    found = assess(fabric, Options(**options), environ=environ or {}, extension=extension, registered=registered,
                   probe=probe, runtime_version=runtime_version)
    return {v.path: v for v in found}, exit_code(found)


def scaleout(tmp_path, report, environ=None, **kwargs):
    fabric = make_fabric(tmp_path, report, environ, **kwargs)
    return verdicts(fabric, environ, scaleout="gdr")


def fixes(verdict):
    return " | ".join(p.fix for p in verdict.problems)


# ---- scale-out: peermem vs DMA-BUF vs neither ---------------------------------------------------

def test_cx7_with_peermem_and_dmabuf_prefers_dmabuf(tmp_path):
    found, code = scaleout(tmp_path, dgx_cx7(tmp_path))
    verdict = found["scaleout"]
    assert (verdict.mode, verdict.status, verdict.passed, code) == (nccl_probe.GDR_DMABUF, OK, True, 0)
    assert "nvidia-peermem is loaded too" in verdict.summary
    assert any("GPU 0: 50, GPU 1: 50" in note for note in verdict.notes)


def test_peermem_only(tmp_path):
    found, code = scaleout(tmp_path, dgx_cx7(tmp_path, dmabuf=False))
    verdict = found["scaleout"]
    assert (verdict.mode, verdict.status, code) == (nccl_probe.GDR_PEERMEM, OK, 0)
    assert any("DMA-BUF not used: CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is False" in n for n in verdict.notes)


def test_dmabuf_only(tmp_path):
    found, code = scaleout(tmp_path, dgx_cx7(tmp_path, peermem=False))
    assert (found["scaleout"].mode, code) == (nccl_probe.GDR_DMABUF, 0)
    assert "peermem" not in found["scaleout"].summary


def test_neither_stages_through_host_memory(tmp_path):
    report = dgx_cx7(tmp_path, peermem=False, dmabuf=False)
    found, code = scaleout(tmp_path, report)
    verdict = found["scaleout"]
    assert (verdict.mode, verdict.status, verdict.passed, code) == (nccl_probe.STAGED, DEGRADED, False, 1)
    assert "modprobe nvidia_peermem" in fixes(verdict)
    # Staging is acceptable to --scaleout (= rdma), not to --scaleout gdr.
    fabric = make_fabric(tmp_path, report)
    assert verdicts(fabric, scaleout="rdma")[1] == 0 and verdicts(fabric, scaleout="gdr")[1] == 1


def test_dmabuf_attribute_without_a_working_export(tmp_path):
    found, _ = scaleout(tmp_path, dgx_cx7(tmp_path, peermem=False, export="failed: CUDA_ERROR_NOT_SUPPORTED (801)"))
    assert found["scaleout"].mode == nccl_probe.STAGED
    assert "live export failed: CUDA_ERROR_NOT_SUPPORTED" in found["scaleout"].problems[0].text


def test_environment_can_turn_gdr_off(tmp_path):
    report = dgx_cx7(tmp_path)
    found, _ = scaleout(tmp_path, report, {"NCCL_DMABUF_ENABLE": "0"})
    assert found["scaleout"].mode == nccl_probe.GDR_PEERMEM
    found, _ = scaleout(tmp_path, report, {"NCCL_NET_GDR_LEVEL": "LOC"})
    assert found["scaleout"].mode == nccl_probe.STAGED and "unset NCCL_NET_GDR_LEVEL" in fixes(found["scaleout"])


def test_nccls_config_files_count_as_the_environment_under_it(tmp_path):
    """NCCL reads NCCL_CONF_FILE (else ~/.nccl.conf), then /etc/nccl.conf, at init; the environment wins, and
    the first file wins over the second. A cluster's /etc/nccl.conf forcing sockets was invisible before."""
    report = dgx_cx7(tmp_path)
    write(tmp_path / "etc" / "nccl.conf", "# site defaults\nNCCL_IB_DISABLE=1\nNCCL_DEBUG=WARN\n"
                                          "NCCL_SOCKET_IFNAME = eth0\nCUDA_VISIBLE_DEVICES=3")
    found, code = scaleout(tmp_path, report)
    assert (found["scaleout"].mode, code) == (nccl_probe.SOCKET, 1)
    assert "unset NCCL_IB_DISABLE and remove it from /etc/nccl.conf" in fixes(found["scaleout"])
    assert "/etc/nccl.conf" in found["scaleout"].summary
    found, code = scaleout(tmp_path, report, {"NCCL_IB_DISABLE": "0"})  # the environment beats the file
    assert (found["scaleout"].mode, code) == (nccl_probe.GDR_DMABUF, 0)
    found, _ = scaleout(tmp_path, report, {"NCCL_NET": "Socket"})  # set in both: the environment's is to blame
    assert fixes(found["scaleout"]) == "unset NCCL_NET" and "the environment" in found["scaleout"].summary
    write(tmp_path / "job.conf", "NCCL_IB_DISABLE=0")  # the user's file beats the site's
    found, code = scaleout(tmp_path, report, {"NCCL_CONF_FILE": "/job.conf"})
    assert (found["scaleout"].mode, code) == (nccl_probe.GDR_DMABUF, 0)
    assert nccl_config_files({}, home="/home/u") == ["/home/u/.nccl.conf", "/etc/nccl.conf"]
    assert nccl_config_files({"NCCL_CONF_FILE": "/job.conf"}, home="/home/u") == ["/job.conf", "/etc/nccl.conf"]
    # A relative name is opened from the working directory (it was read below the probed root instead).
    assert nccl_config_files({"NCCL_CONF_FILE": "job.conf"}, home="/home/u") == [os.path.join(os.getcwd(), "job.conf"),
                                                                                "/etc/nccl.conf"]
    fabric = make_fabric(tmp_path, report, {"NCCL_CONF_FILE": "/job.conf", "NCCL_NET": "IB"})
    # NCCL splits at the first '=' as written (the spaced name sets nothing it reads), and CUDA read its own
    # variables before NCCL applied the file.
    assert fabric.nccl.config == {"NCCL_IB_DISABLE": "0", "NCCL_DEBUG": "WARN"}
    assert fabric.nccl.config_source == {"NCCL_IB_DISABLE": "/job.conf", "NCCL_DEBUG": "/etc/nccl.conf"}
    assert any("NCCL ignores 'NCCL_SOCKET_IFNAME = eth0'" in warning for warning in fabric.warnings)
    text = doctor.render(fabric, assess(fabric, Options(), environ={}), None, Options())
    assert "NCCL config file /etc/nccl.conf (what the environment does not set): NCCL_DEBUG=WARN" in text
    assert "env: NCCL_CONF_FILE=/job.conf NCCL_NET=IB" in text  # the environment's own, not the files'


def test_environment_can_force_sockets(tmp_path):
    report = dgx_cx7(tmp_path)
    for environ in ({"NCCL_IB_DISABLE": "1"}, {"NCCL_NET": "Socket"}):
        found, code = scaleout(tmp_path, report, environ)
        assert (found["scaleout"].mode, code) == (nccl_probe.SOCKET, 1), environ
        assert f"unset {next(iter(environ))}" in fixes(found["scaleout"])
    found, code = scaleout(tmp_path, report, {"NCCL_IB_DISABLE": "0"})
    assert (found["scaleout"].mode, code) == (nccl_probe.GDR_DMABUF, 0)
    # NCCL_IB_DISABLE leaves a net plugin (aws-ofi-nccl on EFA) in charge.
    efa = {"FI_PROVIDER": "efa", "NCCL_IB_DISABLE": "1"}
    found, code = scaleout(tmp_path / "efa", p5en_efa(tmp_path / "efa"), efa)
    assert (found["scaleout"].mode, code) == (nccl_probe.GDR_DMABUF, 0)
    # NCCL_NET_PLUGIN=none loads no plugin (NCCL compares it case-blind): sockets, and EFA has no transport.
    found, code = scaleout(tmp_path, report, {"NCCL_IB_DISABLE": "1", "NCCL_NET_PLUGIN": "none"})
    assert (found["scaleout"].mode, code) == (nccl_probe.SOCKET, 1)
    efa_off = {"FI_PROVIDER": "efa", "NCCL_NET_PLUGIN": "None"}
    found, code = scaleout(tmp_path / "efa_off", p5en_efa(tmp_path / "efa_off"), efa_off)
    assert (found["scaleout"].mode, code) == (nccl_probe.SOCKET, 1)
    assert "aws-ofi-nccl" in fixes(found["scaleout"])


def test_nics_farther_than_nccls_gdr_level_mean_staging(tmp_path):
    """A flat VM: both GPUs share only the PCI root with the one NIC. NCCL's default NCCL_NET_GDR_LEVEL (PXB)
    then turns GPUDirect RDMA off, so the verdict is staged (it said dma-buf GDR, with a note below
    contradicting it); a level that covers the root complex gives GDR back."""
    add_gpu_pci(tmp_path, ["pci0000:00", "0000:00:05.0"])
    add_gpu_pci(tmp_path, ["pci0000:00", "0000:00:06.0"])
    add_rdma(tmp_path, "mlx5_0", ["pci0000:00", "0000:00:07.0"])
    add_uverbs(tmp_path, 1)
    report = driver([gpu(0, "0000:00:05.0"), gpu(1, "0000:00:06.0")])
    found, code = scaleout(tmp_path, report)
    assert (found["scaleout"].mode, code) == (nccl_probe.STAGED, 1)
    assert "NCCL_NET_GDR_LEVEL=PXB (the default)" in found["scaleout"].problems[0].text
    assert "NCCL_NET_GDR_LEVEL=PHB" in fixes(found["scaleout"])
    for level in ("PHB", "SYS", "3"):
        found, code = scaleout(tmp_path, report, {"NCCL_NET_GDR_LEVEL": level})
        assert (found["scaleout"].mode, code) == (nccl_probe.GDR_DMABUF, 0), level
    found, _ = scaleout(tmp_path, report, {"NCCL_NET_GDR_LEVEL": "PXB"})
    assert found["scaleout"].mode == nccl_probe.STAGED


def test_nccl_variables_are_read_as_nccl_reads_them(tmp_path):
    """The doctor read NCCL's variables its own way and said "dma-buf GDR" where NCCL stages, falls back to
    sockets or fails: a level name in lower case (NCCL ignores it: its default, PXB), names it did not know
    (PXN, NVL), integers in other spellings (NCCL's strtoll: "0x1", "false" = 0), a network name with blanks
    (NCCL compares it as it is), and NCCL_IB_HCA naming no NIC here (NCCL's IB transport finds none)."""
    add_gpu_pci(tmp_path, ["pci0000:00", "0000:00:05.0"])
    add_gpu_pci(tmp_path, ["pci0000:00", "0000:00:06.0"])
    add_rdma(tmp_path, "mlx5_0", ["pci0000:00", "0000:00:07.0"])
    add_uverbs(tmp_path, 1)
    flat = driver([gpu(0, "0000:00:05.0"), gpu(1, "0000:00:06.0")])  # the NIC is PHB from each GPU
    for level, mode in (("phb", nccl_probe.STAGED), ("PXN", nccl_probe.STAGED), ("3", nccl_probe.GDR_DMABUF),
                        ("9", nccl_probe.GDR_DMABUF), ("PHB", nccl_probe.GDR_DMABUF)):
        found, _ = scaleout(tmp_path, flat, {"NCCL_NET_GDR_LEVEL": level})
        assert found["scaleout"].mode == mode, (level, found["scaleout"])
    found, _ = scaleout(tmp_path, flat, {"NCCL_NET_GDR_LEVEL": "phb"})
    assert "'phb' is no level NCCL reads" in found["scaleout"].problems[0].text, found["scaleout"].problems
    dgx = tmp_path / "dgx"
    report = dgx_cx7(dgx)
    for environ, mode in (({"NCCL_NET_GDR_LEVEL": "NVL"}, nccl_probe.STAGED),
                          ({"NCCL_NET_GDR_LEVEL": "loc"}, nccl_probe.GDR_DMABUF),
                          ({"NCCL_IB_DISABLE": "0x1"}, nccl_probe.SOCKET),
                          ({"NCCL_IB_DISABLE": "false"}, nccl_probe.GDR_DMABUF),
                          ({"NCCL_NET": "IB "}, nccl_probe.UNAVAILABLE),
                          ({"NCCL_NET": "ib"}, nccl_probe.GDR_DMABUF),
                          ({"NCCL_IB_HCA": "mlx5_9"}, nccl_probe.SOCKET),
                          ({"NCCL_IB_HCA": "^mlx5"}, nccl_probe.SOCKET),
                          ({"NCCL_IB_HCA": "=mlx5"}, nccl_probe.SOCKET),
                          ({"NCCL_IB_HCA": "mlx5:1"}, nccl_probe.GDR_DMABUF),
                          ({"NCCL_IB_HCA": "mlx5_0:2"}, nccl_probe.SOCKET),  # its only ACTIVE port is 1
                          ({"NCCL_IB_HCA": "^"}, nccl_probe.SOCKET),  # an empty list lists every device
                          ({"NCCL_IB_HCA": "="}, nccl_probe.GDR_DMABUF),
                          ({"NCCL_IB_HCA": "  "}, nccl_probe.SOCKET),  # a name of blanks names none
                          ({"NCCL_DMABUF_ENABLE": ""}, nccl_probe.GDR_DMABUF),  # empty: NCCL's default
                          ({"NCCL_IB_DISABLE": "9" * 30}, nccl_probe.GDR_DMABUF),  # past int64: the default
                          ({"NCCL_IB_DISABLE": "\xa01"}, nccl_probe.GDR_DMABUF),  # not C's blank: reads 0
                          ({"NCCL_IB_HCA": "^mlx5_0,mlx5_1"}, nccl_probe.GDR_DMABUF),
                          ({"NCCL_IB_HCA": "mlx5_0:\u00b2"}, nccl_probe.GDR_DMABUF),  # no ASCII port: any (it raised)
                          # NCCL_NET names IB: no fallback to sockets, its init fails (it said sockets)
                          ({"NCCL_NET": "IB", "NCCL_IB_HCA": "mlx5_9"}, nccl_probe.UNAVAILABLE)):
        found, _ = scaleout(dgx, report, environ)
        assert found["scaleout"].mode == mode, (environ, found["scaleout"])
    without_peermem = tmp_path / "nopeermem"
    report = dgx_cx7(without_peermem, peermem=False)
    for value, mode in (("false", nccl_probe.STAGED), ("0x0", nccl_probe.STAGED), ("1", nccl_probe.GDR_DMABUF)):
        found, _ = scaleout(without_peermem, report, {"NCCL_DMABUF_ENABLE": value})
        assert found["scaleout"].mode == mode, (value, found["scaleout"])


def test_a_nic_under_another_host_bridge_of_the_gpus_cpu_is_phb(tmp_path):
    """NCCL calls any path through the CPU PHB (SYS only crosses CPUs): a NIC on another PCI root of the GPU's
    NUMA node gets GPUDirect RDMA at NCCL_NET_GDR_LEVEL=PHB. It was taken for SYS: staged, and told to set SYS."""
    add_gpu_pci(tmp_path, ["pci0000:15", "0000:15:01.0", "0000:16:00.0"], numa=0)
    add_rdma(tmp_path, "mlx5_0", ["pci0000:37", "0000:37:01.0", "0000:38:00.0"], numa=0)
    add_uverbs(tmp_path, 1)
    report = driver([gpu(0, "0000:16:00.0")])
    found, code = scaleout(tmp_path, report, {"NCCL_NET_GDR_LEVEL": "PHB"})
    assert (found["scaleout"].mode, code) == (nccl_probe.GDR_DMABUF, 0), found["scaleout"]
    found, code = scaleout(tmp_path, report)  # NCCL's default, PXB, stops short of the host bridge
    assert (found["scaleout"].mode, code) == (nccl_probe.STAGED, 1) and "NCCL_NET_GDR_LEVEL=PHB" in fixes(
        found["scaleout"])


def test_a_topology_file_gives_nccl_the_distance_sysfs_does_not(tmp_path):
    """Cloud VMs show each device on a PCI root of its own and give NCCL the real paths in NCCL_TOPO_FILE: the
    distance sysfs shows is not NCCL's (doctor said "staged" and failed --scaleout gdr there). A path to no
    file: NCCL detects from sysfs, as without one."""
    add_gpu_pci(tmp_path, ["pci0000:15", "0000:15:01.0", "0000:16:00.0"], numa=0)
    add_rdma(tmp_path, "mlx5_0", ["pci0000:37", "0000:37:01.0", "0000:38:00.0"], numa=0)
    add_uverbs(tmp_path, 1)
    report = driver([gpu(0, "0000:16:00.0")])
    topology = tmp_path / "topo.xml"
    topology.write_text("<system version='1'></system>\n")
    found, code = scaleout(tmp_path, report, {"NCCL_TOPO_FILE": str(topology)})
    assert (found["scaleout"].mode, code) == (nccl_probe.GDR_DMABUF, 0), found["scaleout"]
    assert any(f"NCCL_TOPO_FILE={topology}" in note and "not judged" in note for note in found["scaleout"].notes)
    found, code = scaleout(tmp_path, report, {"NCCL_TOPO_FILE": str(tmp_path / "missing.xml")})
    assert (found["scaleout"].mode, code) == (nccl_probe.STAGED, 1), found["scaleout"]


def test_ib_hca_naming_some_nics_leaves_the_others_out_of_the_gpus_nics(tmp_path):
    """NCCL's IB transport uses only the NICs NCCL_IB_HCA names: GPU 1's own NIC left out, its traffic goes to
    mlx5_0, behind another GPU's switch, shared by all eight. The doctor counted mlx5_1 as GPU 1's (GPUDirect,
    50 GB/s) whatever the list said."""
    report = dgx_cx7(tmp_path)
    one = {"NCCL_IB_HCA": "=mlx5_0"}
    fabric = make_fabric(tmp_path, report, one)
    assert [g.nearest_nics for g in fabric.gpus] == [("mlx5_0",)] * 8
    assert fabric.gpus[1].nic_affinity != "PCIe switch" and fabric.gpus[0].nic_affinity == "PCIe switch"
    assert fabric.gpus[1].scaleout_gbytes_per_s == pytest.approx(400 / 8 / 8)
    assert any("leaves out mlx5_1" in warning for warning in fabric.warnings)
    found, _ = verdicts(fabric, one, scaleout="gdr")
    assert any("GPU 1 (" in note and "expect host staging" in note for note in found["scaleout"].notes)
    every = make_fabric(tmp_path, report, {"NCCL_IB_HCA": "mlx5"})  # names them all: as unset
    assert [g.nearest_nics for g in every.gpus] == [(f"mlx5_{i}",) for i in range(8)]
    assert every.gpus[1].scaleout_gbytes_per_s == pytest.approx(400 / 8)


def test_nccl_socket_interfaces_this_host_cannot_use_fail_nccl(tmp_path):
    """NCCL's bootstrap takes the interfaces NCCL_SOCKET_IFNAME picks (NCCL's list: prefixes, = exact, ^ all but):
    one this host lacks, or one without an address, and every NCCL communicator fails to form; loopback alone,
    and the other nodes cannot reach it. The variable was never read (every verdict passed)."""
    report = dgx_cx7(tmp_path)
    for name in ("lo", "eth0", "ib0", "ifb0"):
        (tmp_path / "sys/class/net" / name).mkdir(parents=True, exist_ok=True)

    def addresses(names):
        return {name: [] if name == "ifb0" else every_interface_addressed([name])[name] for name in names}

    for value, mode in (("ens99", nccl_probe.UNAVAILABLE), ("=eth", nccl_probe.UNAVAILABLE),
                        ("^eth,ib,lo", nccl_probe.UNAVAILABLE), ("ifb0", nccl_probe.UNAVAILABLE),
                        ("lo", nccl_probe.UNAVAILABLE), ("eth", nccl_probe.GDR_DMABUF),
                        ("^lo", nccl_probe.GDR_DMABUF), ("=ib0", nccl_probe.GDR_DMABUF),
                        ("lo,eth0", nccl_probe.GDR_DMABUF)):
        environ = {"NCCL_SOCKET_IFNAME": value}
        found, code = verdicts(make_fabric(tmp_path, report, environ, addresses=addresses), environ,
                               backend="hybrid", scaleout="gdr")
        assert (found["scaleout"].mode, code) == (mode, int(mode == nccl_probe.UNAVAILABLE)), (value, found)
    environ = {"NCCL_SOCKET_IFNAME": "ens99"}
    found, _ = verdicts(make_fabric(tmp_path, report, environ, addresses=addresses), environ, scaleout="gdr")
    assert "picks no interface of this host with an address (it has " in found["scaleout"].problems[0].text
    assert fixes(found["scaleout"]).startswith("unset NCCL_SOCKET_IFNAME")
    environ = {"NCCL_SOCKET_IFNAME": "lo"}
    found, _ = verdicts(make_fabric(tmp_path, report, environ, addresses=addresses), environ, scaleout="gdr")
    assert "whose addresses are loopback" in found["scaleout"].problems[0].text
    assert "(here: eth0, ib0;" in fixes(found["scaleout"])


def test_old_kernel_cannot_import_dmabuf(tmp_path):
    report = dgx_cx7(tmp_path, peermem=False)
    write(tmp_path / "proc/sys/kernel/osrelease", "5.4.0-150-generic")
    found, _ = scaleout(tmp_path, report)
    assert found["scaleout"].mode == nccl_probe.STAGED and "older than 5.12" in found["scaleout"].problems[0].text


def test_gpu_without_gpudirect_support(tmp_path):
    gpu_chain, nic_chain = dgx_chains(0)
    add_gpu_pci(tmp_path, gpu_chain)
    add_rdma(tmp_path, "mlx5_0", nic_chain)
    add_uverbs(tmp_path, 1)
    add_peermem(tmp_path)
    found, code = scaleout(tmp_path, driver([gpu(0, gpu_chain[-1], gdr=False)]))
    assert (found["scaleout"].mode, code) == (nccl_probe.STAGED, 1)


def test_memlock_limit_is_a_problem_with_a_fix(tmp_path):
    found, code = scaleout(tmp_path, dgx_cx7(tmp_path), memlock=(64 << 10, 64 << 10))
    verdict = found["scaleout"]
    assert verdict.mode == nccl_probe.GDR_DMABUF and verdict.status == DEGRADED and code == 0
    assert "ulimit -l unlimited" in fixes(verdict) and "0.0625 MiB" in verdict.problems[0].text
    assert "after raising the hard limit (0.0625 MiB)" in fixes(verdict)


def test_memlock_limit_counts_only_below_what_registration_needs(tmp_path):
    report = dgx_cx7(tmp_path)
    found, code = scaleout(tmp_path, report, memlock=(64 * doctor.GIB, 64 * doctor.GIB))  # large, finite: fine
    assert (found["scaleout"].status, found["scaleout"].problems, code) == (OK, [], 0)
    found, code = scaleout(tmp_path, report, memlock=(8 << 20, 1 << 40))  # a common default, too small
    verdict = found["scaleout"]
    assert (verdict.status, code) == (DEGRADED, 0)
    assert "limit (ulimit -l) is 8 MiB, under the 1 GiB" in verdict.problems[0].text
    assert verdict.problems[0].fix == "ulimit -l 1073741824 (the hard limit allows it)"  # KiB


# ---- scale-out: NICs ------------------------------------------------------------------------------

def test_no_nics_means_sockets(tmp_path):
    gpu_chain, _ = dgx_chains(0)
    add_gpu_pci(tmp_path, gpu_chain)
    fabric = make_fabric(tmp_path, driver([gpu(0, gpu_chain[-1])]))
    found, code = verdicts(fabric, scaleout="rdma")
    assert (found["scaleout"].mode, found["scaleout"].status, code) == (nccl_probe.SOCKET, DEGRADED, 1)
    assert verdicts(fabric, scaleout="socket")[1] == 0
    assert verdicts(fabric)[1] == 0  # nobody asked about scale-out
    assert any("GPU 0: 50 (default)" in note for note in found["scaleout"].notes)


def test_all_ports_down(tmp_path):
    found, code = scaleout(tmp_path, dgx_cx7(tmp_path, down=tuple(range(8))))
    verdict = found["scaleout"]
    assert (verdict.mode, code) == (nccl_probe.SOCKET, 1)
    assert "no RDMA port is ACTIVE (mlx5_0 DOWN" in verdict.problems[0].text and "ACTIVE" in verdict.problems[0].fix


def test_one_port_down_is_reported_but_gdr_still_works(tmp_path):
    found, code = scaleout(tmp_path, dgx_cx7(tmp_path, down=(0,)))
    verdict = found["scaleout"]
    assert (verdict.mode, verdict.status, code) == (nccl_probe.GDR_DMABUF, DEGRADED, 0)
    assert "mlx5_0" in verdict.problems[0].text
    assert any("GPU 0: 25, GPU 1: 25, GPU 2: 50" in note for note in verdict.notes)
    assert any("GPU 0 (PCI root)" in note for note in verdict.notes)  # GDR distance warning


def soft_rdma_only(root, *, uverbs=1):
    """One GPU and one rxe0, no hardware NIC."""
    gpu_chain, _ = dgx_chains(0)
    add_gpu_pci(root, gpu_chain)
    add_soft_rdma(root, "rxe0")
    add_uverbs(root, uverbs)
    return driver([gpu(0, gpu_chain[-1])])


def test_software_rdma_only_is_named_and_never_gpudirect(tmp_path):
    report = soft_rdma_only(tmp_path, uverbs=2)
    add_soft_rdma(tmp_path, "siw0", chain=["pci0000:00", "0000:00:1f.6"])
    add_peermem(tmp_path)
    found, code = scaleout(tmp_path, report)
    verdict = found["scaleout"]
    assert (verdict.mode, verdict.status, code) == (nccl_probe.STAGED, DEGRADED, 1)
    text = verdict.problems[0].text
    assert "rxe0: software RDMA (soft-RoCE), no GPUDirect" in text and "siw0: software RDMA (soft-iWARP)" in text
    assert "InfiniBand / RoCE / EFA" in verdict.problems[0].fix


def test_nccl_net_ib_runs_over_software_rdma(tmp_path):
    """NCCL's IB network runs over soft-RoCE too (staged): NCCL_NET=IB there is no failed init (it said so)."""
    found, code = verdicts(make_fabric(tmp_path, soft_rdma_only(tmp_path), {"NCCL_NET": "IB"}), {"NCCL_NET": "IB"},
                           scaleout="rdma")
    assert (found["scaleout"].mode, code) == (nccl_probe.STAGED, 0), found["scaleout"]
    named = {"NCCL_NET": "IB", "NCCL_IB_HCA": "mlx5"}  # ... unless NCCL_IB_HCA leaves it out
    found, code = verdicts(make_fabric(tmp_path, soft_rdma_only(tmp_path), named), named, scaleout="rdma")
    assert (found["scaleout"].mode, code) == (nccl_probe.UNAVAILABLE, 1), found["scaleout"]
    assert "NCCL_IB_HCA=mlx5 selects none of rxe0" in found["scaleout"].problems[0].text


def test_software_rdma_only_still_needs_memlock(tmp_path):
    # NCCL's IB transport over rxe registers its staging buffers: a low memlock limit fails its init too.
    fabric = make_fabric(tmp_path, soft_rdma_only(tmp_path), memlock=(8 << 20, 1 << 40))
    found, code = verdicts(fabric, scaleout="rdma")
    verdict = found["scaleout"]
    assert (verdict.mode, verdict.status, code) == (nccl_probe.STAGED, DEGRADED, 0)
    assert any("memlock limit (ulimit -l) is 8 MiB" in p.text for p in verdict.problems)
    assert "ulimit -l 1073741824 (the hard limit allows it)" in fixes(verdict)


def test_software_rdma_only_still_needs_uverbs(tmp_path):
    # Without the uverbs nodes NCCL cannot open rxe0 either and falls back to sockets.
    found, code = verdicts(make_fabric(tmp_path, soft_rdma_only(tmp_path, uverbs=0)), scaleout="rdma")
    verdict = found["scaleout"]
    assert (verdict.mode, code) == (nccl_probe.SOCKET, 1)
    assert "no /dev/infiniband/uverbs*" in verdict.problems[-1].text
    assert "--device=/dev/infiniband" in fixes(verdict)


def test_software_rdma_next_to_real_nics_is_named_not_counted(tmp_path):
    report = dgx_cx7(tmp_path)
    add_soft_rdma(tmp_path, "rxe0")
    found, code = scaleout(tmp_path, report)
    verdict = found["scaleout"]
    assert (verdict.mode, verdict.status, code) == (nccl_probe.GDR_DMABUF, OK, 0)
    assert any("rxe0: software RDMA (soft-RoCE), no GPUDirect" in note and "NCCL_IB_HCA=^rxe0" in note
               for note in verdict.notes)
    # Following that advice leaves no hardware NIC out: nothing to warn about.
    fabric = make_fabric(tmp_path, report, {"NCCL_IB_HCA": "^rxe0"})
    assert not any("leaves out" in warning for warning in fabric.warnings), fabric.warnings


def test_missing_uverbs_devices(tmp_path):
    found, code = scaleout(tmp_path, dgx_cx7(tmp_path, uverbs=False))
    assert (found["scaleout"].mode, code) == (nccl_probe.SOCKET, 1)
    assert "--device=/dev/infiniband" in fixes(found["scaleout"])


def test_efa_with_plugin_and_queue_pair_cap(tmp_path):
    found, code = scaleout(tmp_path, p5en_efa(tmp_path), {"FI_PROVIDER": "efa"})
    verdict = found["scaleout"]
    assert (verdict.mode, code) == (nccl_probe.GDR_DMABUF, 0)
    assert any("queue pairs capped at 2 per peer" in note for note in verdict.notes)
    assert any("GPU 7: 50" in note for note in verdict.notes)


@pytest.mark.parametrize("gdr, mode, fix", [("1", nccl_probe.GDR_UNSPECIFIED, None),
                                            ("0", nccl_probe.STAGED, "efa_nv_peermem"),
                                            (None, nccl_probe.STAGED, "efa driver of AWS's EFA installer")])
def test_efa_without_peermem_or_dmabuf_asks_the_efa_driver(tmp_path, gdr, mode, fix):
    """AWS's efa driver registers GPU memory through its own NVIDIA provider (the proprietary GPU modules have
    no DMA-BUF, nvidia-peermem is not needed) and says so in device/gdr. doctor said staged, and told the user
    to load nvidia_peermem."""
    report = p5en_efa(tmp_path, gdr=gdr)
    report.gpus = [dataclasses.replace(g, dmabuf_supported=False) for g in report.gpus]
    found, code = scaleout(tmp_path, report, {"FI_PROVIDER": "efa"})
    verdict = found["scaleout"]
    assert (verdict.mode, code) == (mode, 0 if fix is None else 1), verdict
    if fix is not None:
        assert fix in fixes(verdict) and "modprobe nvidia_peermem" not in fixes(verdict), fixes(verdict)


def test_fi_provider_efa_alone_does_not_make_an_infiniband_host_efa(tmp_path):
    """Only libfabric reads FI_PROVIDER, and NCCL loads it only for EFA devices: a stray export in a job script
    turned a ConnectX-7 host into "EFA without its NCCL plugin" (sockets, exit 1)."""
    fabric = make_fabric(tmp_path, dgx_cx7(tmp_path), {"FI_PROVIDER": "efa"})
    assert not fabric.efa and any("FI_PROVIDER=efa is set" in text for text in fabric.warnings), fabric.warnings
    found, code = verdicts(fabric, {"FI_PROVIDER": "efa"}, scaleout="rdma")
    assert (found["scaleout"].mode, code) == (nccl_probe.GDR_DMABUF, 0), found["scaleout"]


def test_efa_without_plugin(tmp_path):
    found, code = scaleout(tmp_path, p5en_efa(tmp_path, plugin=False), {"FI_PROVIDER": "efa"})
    assert (found["scaleout"].mode, code) == (nccl_probe.SOCKET, 1)
    assert "aws-ofi-nccl" in fixes(found["scaleout"])


def test_nccl_probe_log_overrides_the_static_guess(tmp_path):
    fabric = make_fabric(tmp_path, dgx_cx7(tmp_path))
    probe = NcclProbeResult(ran=True, reason="ran", facts=nccl_probe.NcclLogFacts(net_channels=2),
                            mode=nccl_probe.STAGED, why="2 IB connections, none with GPUDirect RDMA")
    found, code = verdicts(fabric, probe=probe, scaleout="gdr")
    verdict = found["scaleout"]
    assert (verdict.mode, code) == (nccl_probe.STAGED, 1) and "(NCCL probe)" in verdict.summary
    assert any("the NCCL log decides" in note for note in verdict.notes)
    skipped = NcclProbeResult(ran=False, reason="needs 2 GPUs")
    found, _ = verdicts(fabric, probe=skipped)
    assert found["scaleout"].mode == nccl_probe.GDR_DMABUF
    assert any("NCCL probe skipped: needs 2 GPUs" in note for note in found["scaleout"].notes)
    # Without a GPU too: the skip was in --json only.
    found, _ = verdicts(make_fabric(tmp_path, DriverReport(loaded=False, error="no CUDA driver")), probe=skipped)
    assert any("NCCL probe skipped: needs 2 GPUs" in note for note in found["scaleout"].notes), found["scaleout"]


def test_a_failed_nccl_probe_fails_the_scaleout_verdict(tmp_path):
    """The probe's NCCL init failed (ibv_reg_mr out of memory, say): doctor took the log lines before the failure
    as the path, or fell back to the static guess, and said ok."""
    fabric = make_fabric(tmp_path, dgx_cx7(tmp_path))
    facts = nccl_probe.parse_nccl_log([
        "h:1:1 NCCL INFO NCCL version 2.27.3+cuda12.9", "h:1:1 NCCL INFO Using network IB",
        "h:1:1 NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/0/GDRDMA",
        "h:1:1 NCCL WARN NET/IB : ibv_reg_mr failed: Cannot allocate memory"])
    mode, why = nccl_probe.scaleout_mode_from_log(facts)
    assert mode == nccl_probe.GDR_UNSPECIFIED or nccl_probe.RANK[mode] == 3
    # NCCL's bootstrap failing (a mistyped NCCL_SOCKET_IFNAME) logs its warning before any version line.
    bootstrap = nccl_probe.parse_nccl_log(["h:1:1 NCCL INFO NCCL_SOCKET_IFNAME set by environment to eht0",
                                           "h:1:1 NCCL WARN Bootstrap : no socket interface found"])
    for probe in (NcclProbeResult(ran=True, reason="the NCCL run failed: unhandled system error", succeeded=False,
                                  facts=facts, mode=mode, why=why, log_lines=4),
                  NcclProbeResult(ran=True, reason="the NCCL run failed: remote process exited", succeeded=False,
                                  facts=nccl_probe.parse_nccl_log(["h:1:1 NCCL INFO NCCL version 2.27.3+cuda12.9"]),
                                  mode=None, why="no network connection", log_lines=1),
                  NcclProbeResult(ran=True, reason="the NCCL run failed: unhandled system error", succeeded=False,
                                  facts=bootstrap, mode=None, why="no network connection", log_lines=2)):
        for scaleout in ("gdr", "socket", None):
            found, code = verdicts(fabric, probe=probe, scaleout=scaleout)
            verdict = found["scaleout"]
            assert (verdict.status, verdict.passed) == (UNAVAILABLE, False), (probe.reason, verdict)
            assert code == (0 if scaleout is None else 1)
            assert "the NCCL probe failed" in verdict.problems[-1].text
            assert verdict.mode == nccl_probe.UNAVAILABLE
            # NCCL's last warning reaches the user where the log had one (the first and third probes')
            warned = probe.facts.warnings[-1] if probe.facts.warnings else None
            assert (warned is not None and warned in verdict.problems[-1].text) == bool(warned), verdict
            assert "before NCCL started" not in verdict.summary, verdict.summary
            # "its log had said" quotes the log's path, never the static guess (the second log names none)
            assert ("its log had said" in verdict.summary) == (probe.mode is not None), verdict.summary
    # Ranks that failed before NCCL started (torch sees no GPU, say) leave no NCCL log: the static guess was
    # quoted as the log's, and the fix sent the user after NCCL's warnings and memlock.
    early = NcclProbeResult(ran=True, reason="the NCCL run failed: device='cuda' but no CUDA device is visible",
                            succeeded=False, facts=nccl_probe.parse_nccl_log([]), why="no network connection")
    found, code = verdicts(fabric, probe=early, scaleout="gdr")
    verdict = found["scaleout"]
    assert (verdict.status, verdict.passed, code) == (UNAVAILABLE, False, 1), verdict
    assert verdict.summary == "unavailable: the NCCL probe failed before NCCL started", verdict.summary
    assert "no CUDA device is visible" in verdict.problems[-1].text and "memlock" not in fixes(verdict), verdict
    ran = NcclProbeResult(ran=True, reason="ran", facts=facts, mode=mode, why=why)  # succeeded by default
    found, code = verdicts(fabric, probe=ran, scaleout="gdr")
    assert (found["scaleout"].status, code) == (OK, 0)


def test_nccl_net_naming_a_network_that_cannot_start_is_unavailable(tmp_path):
    """NCCL_NET picks one network by name and NCCL fails ("network IB not found") when it is skipped: it does
    not fall back to sockets, which doctor said (exit 0 for --scaleout socket)."""
    one = driver([gpu(0, "0000:00:05.0")])
    for environ in ({"NCCL_NET": "IB"}, {"NCCL_NET": "ib"}, {"NCCL_NET": "AWS Libfabric"}):
        found, code = verdicts(make_fabric(tmp_path / "one", one, environ), environ, scaleout="socket")
        assert (found["scaleout"].mode, code) == (nccl_probe.UNAVAILABLE, 1), (environ, found["scaleout"])
        assert "unset NCCL_NET" in fixes(found["scaleout"])
    report = dgx_cx7(tmp_path)
    environ = {"NCCL_NET": "IB", "NCCL_IB_DISABLE": "1"}
    found, code = scaleout(tmp_path, report, environ)
    assert (found["scaleout"].mode, code) == (nccl_probe.UNAVAILABLE, 1)
    assert "NCCL_IB_DISABLE=1 turns it off" in found["scaleout"].problems[0].text
    found, code = scaleout(tmp_path, report, {"NCCL_NET": "IB"})  # usable NICs: IB starts
    assert (found["scaleout"].mode, code) == (nccl_probe.GDR_DMABUF, 0)
    found, code = scaleout(tmp_path, report, {"NCCL_NET": "Socket"})
    assert found["scaleout"].mode == nccl_probe.SOCKET


def test_more_than_one_node_asks_for_some_scaleout_path(tmp_path):
    """--nodes 2 crosses nodes: a machine with no scale-out path at all (no NCCL) exited 0."""
    fabric = make_fabric(tmp_path, dgx_cx7(tmp_path), nccl=(None, "torch 2.13.0+cpu is a CPU build (no NCCL)"))
    found, code = verdicts(fabric, backend="hybrid", nodes=2)
    assert (found["scaleout"].asked, found["scaleout"].passed, code) == (True, False, 1)
    assert verdicts(fabric, backend="hybrid")[1] == 0  # one node: scale-out is shown, not asked
    one = make_fabric(tmp_path / "one", driver([gpu(0, "0000:00:05.0")]))
    found, code = verdicts(one, backend="hybrid", nodes=2)
    assert (found["scaleout"].mode, code) == (nccl_probe.SOCKET, 0)  # sockets are a path


def test_no_nccl_in_torch(tmp_path):
    fabric = make_fabric(tmp_path, dgx_cx7(tmp_path), nccl=(None, "torch 2.13.0+cpu is a CPU build (no NCCL)"))
    found, code = verdicts(fabric, scaleout="socket")
    assert (found["scaleout"].mode, found["scaleout"].status, code) == (nccl_probe.UNAVAILABLE, UNAVAILABLE, 1)


# ---- NVLink domain ---------------------------------------------------------------------------------

def test_nvlink_domain_of_eight_peer_gpus(tmp_path):
    found, code = verdicts(make_fabric(tmp_path, dgx_cx7(tmp_path)), backend="hybrid")
    verdict = found["nvlink"]
    assert (verdict.status, verdict.asked, code) == (OK, True, 0)
    assert "8 GPUs, all peer-accessible over NVLink (18+ active links, ~450 GB/s per GPU)" == verdict.summary


def test_gpus_without_peer_access_split_the_domain(tmp_path):
    report = dgx_cx7(tmp_path)
    report.peer_access = [[i // 4 == j // 4 for j in range(8)] for i in range(8)]
    found, code = verdicts(make_fabric(tmp_path, report), backend="hybrid", ranks_per_gpu=2)
    verdict = found["nvlink"]
    assert (verdict.status, code) == (DEGRADED, 0)
    assert "domains of 8 rank(s)" in fixes(verdict) and "[[0, 1, 2, 3], [4, 5, 6, 7]]" in verdict.summary
    # Groups of 3 and 4 GPUs tile no domain size but 1; groups that interleave leave consecutive GPUs unmappable.
    # The advice is what detect_topology does (it once suggested sizes that made it raise).
    for count, peer, expected in ((7, lambda i, j: (i < 3) == (j < 3), "domains of 1 rank(s) on its own"),
                                  (8, lambda i, j: i % 2 == j % 2, "of 1 rank(s) on its own; list each group's")):
        split = driver(report.gpus[:count])
        split.peer_access = [[peer(i, j) for j in range(count)] for i in range(count)]
        found, _ = verdicts(make_fabric(tmp_path, split), backend="hybrid")
        assert expected in fixes(found["nvlink"]) and "EP_PLUGIN_SCALEUP_SIZE" not in fixes(found["nvlink"])


def test_gpus_that_reach_each_other_only_through_a_third_are_not_one_domain(tmp_path):
    """A DGX-1's hybrid cube mesh: GPUs 0-3 and 4-7 map each other, and each GPU i also maps i + 4. Grouped by
    connected components all 8 were one group, "all peer-accessible", while detection (every pair must map)
    makes domains of 4 and the job crosses them over NCCL."""
    report = dgx_cx7(tmp_path)
    report.peer_access = [[i // 4 == j // 4 or abs(i - j) == 4 for j in range(8)] for i in range(8)]
    found, _ = verdicts(make_fabric(tmp_path, report), backend="hybrid")
    verdict = found["nvlink"]
    assert "[[0, 1, 2, 3], [4, 5, 6, 7]]" in verdict.summary and "all peer-accessible" not in verdict.summary, verdict
    assert "domains of 4 rank(s)" in fixes(verdict), fixes(verdict)


def test_forced_domain_size_must_divide_the_detected_one(tmp_path):
    fabric = make_fabric(tmp_path, dgx_cx7(tmp_path))
    found, code = verdicts(fabric, {"EP_PLUGIN_SCALEUP_SIZE": "3"}, backend="hybrid")
    assert (found["nvlink"].status, code) == (UNAVAILABLE, 1)
    assert "unset EP_PLUGIN_SCALEUP_SIZE (0 = detect) or set a divisor of 8" in fixes(found["nvlink"])
    # reference builds on the same topology: its build on these GPUs raises too (it said "works" and exit 0)
    found, code = verdicts(fabric, {"EP_PLUGIN_SCALEUP_SIZE": "3"}, backend="reference")
    assert (found["backend"].status, code) == (UNAVAILABLE, 1), found["backend"]
    assert "set a divisor of 8" in fixes(found["backend"])
    found, code = verdicts(fabric, {"EP_PLUGIN_SCALEUP_SIZE": "4"}, backend="reference")
    assert (found["backend"].status, code) == (OK, 0), found["backend"]
    found, code = verdicts(fabric, {"EP_PLUGIN_SCALEUP_SIZE": "4"}, backend="hybrid")
    assert (found["nvlink"].status, code) == (OK, 0)


def test_pcie_peer_access_without_nvlink(tmp_path):
    report = driver([gpu(0, "0000:00:05.0", nvlinks=0), gpu(1, "0000:00:06.0", nvlinks=0)])
    found, _ = verdicts(make_fabric(tmp_path, report))
    assert found["nvlink"].status == DEGRADED and "PCIe" in found["nvlink"].summary


def test_a_gpu_in_mig_mode_cannot_run_the_kernels(tmp_path):
    """MIG devices have no CUDA IPC or peer access between them: doctor said the ranks share memory through CUDA
    IPC, and the job then failed opening the peers' buffers."""
    report = driver([gpu(0, "0000:00:05.0", mig=True), gpu(1, "0000:00:06.0", mig=None)])
    found, code = verdicts(make_fabric(tmp_path, report), backend="hybrid")
    assert (found["nvlink"].status, code) == (UNAVAILABLE, 1), found["nvlink"]
    assert found["nvlink"].problems[0].text.startswith("GPU(s) [0] in MIG mode"), found["nvlink"].problems
    assert "-mig 0" in fixes(found["nvlink"]) and "MIG mode" in found["nvlink"].summary
    found, code = verdicts(make_fabric(tmp_path, driver([gpu(0, "0000:00:05.0", mig=None)])), backend="hybrid")
    assert (found["nvlink"].status, code) == (OK, 0), found["nvlink"]  # unknown (an old NVML): no claim


def test_no_driver_says_no_gpu(tmp_path):
    fabric = make_fabric(tmp_path, DriverReport(loaded=False, error="no CUDA driver (libcuda.so.1 missing)"))
    found, code = verdicts(fabric, backend="hybrid")
    assert (found["nvlink"].status, code) == (UNAVAILABLE, 1)
    assert found["nvlink"].problems[0].text.startswith("no GPU: no NVIDIA GPU on the PCI bus")
    assert "'reference' backend" in found["nvlink"].problems[0].fix
    assert found["mps"].status == NOT_NEEDED
    assert verdicts(fabric, backend="reference")[1] == 0
    # CPU ranks on the reference backend cross nodes over gloo (TCP): a socket-level scale-out works.
    found, code = verdicts(fabric, backend="reference", scaleout="socket")
    assert (found["scaleout"].mode, code) == (nccl_probe.SOCKET, 0) and "gloo" in found["scaleout"].summary
    found, code = verdicts(fabric, backend="reference", scaleout="rdma")
    assert code == 1 and "--scaleout socket" in found["scaleout"].problems[0].fix  # no RDMA path for CPU ranks
    # No backend named: with no GPU here the job's ranks are CPU ranks, so it is reference's path (it used to
    # be NCCL's, which needs a GPU: a CPU setup that works failed).
    assert verdicts(fabric, scaleout="socket")[1] == 0


def test_reference_ranks_sharing_a_gpu_cross_nodes_over_gloo(tmp_path):
    """NCCL refuses two ranks on one GPU, so reference's ranks sharing GPUs run on a gloo group (staged through
    the host), TCP between nodes: doctor promised GPUDirect RDMA on a machine with RDMA NICs (exit 0)."""
    fabric = make_fabric(tmp_path, dgx_cx7(tmp_path))
    found, code = verdicts(fabric, backend="reference", scaleout="gdr")
    assert (nccl_probe.RANK[found["scaleout"].mode], code) == (3, 0), found["scaleout"]  # one rank per GPU: NCCL
    found, code = verdicts(fabric, backend="reference", scaleout="gdr", ranks_per_gpu=2)
    verdict = found["scaleout"]
    assert (verdict.mode, verdict.passed, code) == (nccl_probe.SOCKET, False, 1), verdict
    assert "2 ranks share each GPU" in verdict.summary and "gloo" in verdict.summary, verdict.summary
    assert "one rank per GPU" in fixes(verdict), fixes(verdict)
    found, code = verdicts(fabric, backend="reference", scaleout="socket", ranks_per_gpu=2)
    assert (found["scaleout"].mode, found["scaleout"].passed) == (nccl_probe.SOCKET, True), found["scaleout"]


def test_gpu_on_the_bus_without_driver(tmp_path):
    add_gpu_pci(tmp_path, ["pci0000:00", "0000:00:05.0"])
    found, _ = verdicts(make_fabric(tmp_path, DriverReport(loaded=False, error="no CUDA driver (x)")))
    assert "0000:00:05.0" in found["nvlink"].problems[0].text and "install" in found["nvlink"].problems[0].fix


def test_extension_missing_and_unregistered_backend(tmp_path):
    fabric = make_fabric(tmp_path, dgx_cx7(tmp_path))
    found, code = verdicts(fabric, backend="hybrid", extension=(False, "ep_plugin._C is not built (no nvcc)"))
    assert (found["nvlink"].status, code) == (UNAVAILABLE, 1) and "nvcc" in fixes(found["nvlink"])
    assert "pip install pybind11" in fixes(found["nvlink"]) and "EP_PLUGIN_CUDA_ARCHS" not in fixes(found["nvlink"])
    # A GPU the default build (sm_90) cannot run: the reinstall builds for it (the fix used to omit that).
    blackwell = make_fabric(tmp_path, driver([gpu(0, "0000:00:05.0", name="NVIDIA B200", cc=(10, 0))]))
    found, _ = verdicts(blackwell, backend="hybrid", extension=(False, "ep_plugin._C is not built (no nvcc)"))
    assert 'EP_PLUGIN_CUDA_ARCHS="100"' in fixes(found["nvlink"]), fixes(found["nvlink"])
    found, code = verdicts(fabric, backend="elastic")
    assert code == 1 and "'elastic' is not in this build" in found["nvlink"].problems[0].text
    found, code = verdicts(fabric, backend="magic")
    assert code == 1 and found["backend"].status == UNAVAILABLE


def test_a_driver_older_than_the_extensions_cuda_is_unavailable(tmp_path):
    """An R550 driver (CUDA 12.4) runs no kernel of an extension built with CUDA 13: the backends find no
    device. doctor said ok (it checked the import and the architecture only)."""
    report = dgx_cx7(tmp_path)
    report.driver_version = 12040
    fabric = make_fabric(tmp_path, report)
    found, code = verdicts(fabric, backend="hybrid", runtime_version=13000)
    assert (found["nvlink"].status, code) == (UNAVAILABLE, 1), found["nvlink"]
    assert "built with CUDA 13.0; this driver supports CUDA 12.4" in found["nvlink"].problems[0].text
    assert "R580" in fixes(found["nvlink"]) and "CUDA 12.x nvcc" in fixes(found["nvlink"])
    # Within one major version the driver runs a newer minor's kernels (minor-version compatibility).
    fabric = make_fabric(tmp_path, report, torch_cuda="12.8")  # a torch this driver runs (the next test)
    for runtime in (12080, 12040, 11080):
        found, code = verdicts(fabric, backend="hybrid", runtime_version=runtime)
        assert (found["nvlink"].status, code) == (OK, 0), (runtime, found["nvlink"])


def test_a_torch_that_cannot_use_the_gpus_fails_the_kernel_backends(tmp_path):
    """The extension sees the GPUs without torch, but the backends take their device from torch: a CPU torch,
    or one built for a CUDA major version the driver lacks, failed at the build while doctor said ok."""
    report = dgx_cx7(tmp_path)
    for torch_cuda, expected in ((None, "this torch has no CUDA"),
                                 ("13.0", "torch was built with CUDA 13.0; this driver supports CUDA 12.8")):
        report.driver_version = 13000 if torch_cuda is None else 12080
        found, code = verdicts(make_fabric(tmp_path, report, torch_cuda=torch_cuda), backend="hybrid",
                               runtime_version=12080)
        assert (found["nvlink"].status, code) == (UNAVAILABLE, 1), found["nvlink"]
        assert expected in found["nvlink"].problems[0].text
    report.driver_version = 13000
    for torch_cuda in ("13.0", "12.8"):  # a driver runs any torch of its major version or older
        found, code = verdicts(make_fabric(tmp_path, report, torch_cuda=torch_cuda), backend="hybrid")
        assert (found["nvlink"].status, code) == (OK, 0), found["nvlink"]
    # reference runs on CPU ranks with any torch, across nodes over gloo (no NCCL in a CPU torch).
    cpu_torch = make_fabric(tmp_path, report, nccl=(None, "torch 2.13.0+cpu is a CPU build (no NCCL)"), torch_cuda=None)
    for nodes in (1, 2):
        found, code = verdicts(cpu_torch, backend="reference", nodes=nodes)
        assert code == 0 and found["scaleout"].mode == nccl_probe.SOCKET, found["scaleout"]


def test_an_nvlink_domain_past_the_kernels_rank_limit_fails(tmp_path):
    """The kernels serve at most MAX_RANKS (32) ranks per domain; 8 GPUs x 8 ranks made one of 64, which the
    build refuses, and doctor said ok."""
    fabric = make_fabric(tmp_path, dgx_cx7(tmp_path))
    found, code = verdicts(fabric, backend="hybrid", ranks_per_gpu=8)
    assert (found["nvlink"].status, code) == (UNAVAILABLE, 1), found["nvlink"]
    assert "64 ranks" in found["nvlink"].problems[0].text and "EP_PLUGIN_SCALEUP_SIZE=32" in fixes(found["nvlink"])
    assert doctor.MAX_DOMAIN_RANKS == (_cuda._module.MAX_RANKS if _cuda._module is not None else 32)
    for environ, ranks_per_gpu in (({}, 4), ({"EP_PLUGIN_SCALEUP_SIZE": "16"}, 8)):  # 32 ranks, or forced 16s
        found, code = verdicts(make_fabric(tmp_path, fabric.driver, environ), environ, backend="hybrid",
                               ranks_per_gpu=ranks_per_gpu)
        assert code == 0, (environ, found["nvlink"])


def test_co_residency_refuses_too_many_sms(tmp_path):
    fabric = make_fabric(tmp_path, driver([gpu(0, "0000:00:05.0", nvlinks=0)]))
    found, code = verdicts(fabric, {"EP_PLUGIN_NUM_SMS": "40"}, backend="hybrid", ranks_per_gpu=4)
    verdict = found["nvlink"]
    assert (verdict.status, code) == (UNAVAILABLE, 1)
    assert "would deadlock" in verdict.problems[0].text and "EP_PLUGIN_NUM_SMS=33" in verdict.problems[0].fix
    found, code = verdicts(fabric, {"EP_PLUGIN_NUM_SMS": "0"}, backend="hybrid", ranks_per_gpu=4)
    assert code == 0 and any("autosized" in note and "fits" in note for note in found["nvlink"].notes)
    # MPS caps a rank at its share of the SMs: 10% of 132 -> 13 < 16.
    found, code = verdicts(make_fabric(tmp_path, fabric.driver, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10"}),
                           {}, backend="hybrid")
    assert code == 1 and "EP_PLUGIN_NUM_SMS=13" in fixes(found["nvlink"])
    # Across domains (forced pairs on the GPU's 4 ranks) the domain kernels run EP_PLUGIN_FORWARD_SMS blocks:
    # 4 x 40 is past 132 and the build is refused (the doctor checked num_sms only and said it fits).
    forward = {"EP_PLUGIN_SCALEUP_SIZE": "2", "EP_PLUGIN_FORWARD_SMS": "40"}
    found, code = verdicts(make_fabric(tmp_path, fabric.driver, forward), forward, backend="hybrid", ranks_per_gpu=4)
    assert (found["nvlink"].status, code) == (UNAVAILABLE, 1), found["nvlink"]
    assert "EP_PLUGIN_FORWARD_SMS=33" in fixes(found["nvlink"]) and "(EP_PLUGIN_FORWARD_SMS)" in found[
        "nvlink"].problems[0].text
    # GPUs in two peer groups split one node into domains as well: forward_sms counts there too (it was
    # ignored, so 2 x 100 "fit" and a good EP_PLUGIN_FORWARD_SMS=32 under EP_PLUGIN_NUM_SMS=100 failed).
    split = dgx_cx7(tmp_path / "split")
    split.peer_access = [[(i < 4) == (j < 4) for j in range(8)] for i in range(8)]
    for environ, expected in (({"EP_PLUGIN_FORWARD_SMS": "100"}, 1),
                              ({"EP_PLUGIN_NUM_SMS": "100", "EP_PLUGIN_FORWARD_SMS": "32"}, 0)):
        found, code = verdicts(make_fabric(tmp_path / "split", split, environ), environ, backend="hybrid",
                               ranks_per_gpu=2)
        assert code == expected, (environ, found["nvlink"])
    one_domain = {"EP_PLUGIN_FORWARD_SMS": "40"}  # one domain: forward_sms moves nothing
    found, code = verdicts(make_fabric(tmp_path, fabric.driver, one_domain), one_domain, backend="hybrid",
                           ranks_per_gpu=4)
    assert code == 0, found["nvlink"]


def test_max_sms_per_gpu_past_the_gpus_sms_is_a_problem(tmp_path):
    """EP_PLUGIN_MAX_SMS_PER_GPU above the GPU's SMs made doctor judge co-residency for SMs that are not there:
    2 x 132 "fit" on a 132-SM GPU."""
    fabric = make_fabric(tmp_path, driver([gpu(0, "0000:00:05.0", nvlinks=0)]))
    environ = {"EP_PLUGIN_MAX_SMS_PER_GPU": "264", "EP_PLUGIN_NUM_SMS": "132"}
    found, code = verdicts(fabric, environ, backend="hybrid", ranks_per_gpu=2)
    assert (found["nvlink"].status, code) == (UNAVAILABLE, 1), found["nvlink"]
    assert "EP_PLUGIN_MAX_SMS_PER_GPU=132 or less" in fixes(found["nvlink"])
    assert "EP_PLUGIN_NUM_SMS=66" in fixes(found["nvlink"])
    # The build checks the grid against the knob's 264 SMs, so it passes and deadlocks (it said "refused").
    texts = " ".join(problem.text for problem in found["nvlink"].problems)
    assert "a build is not refused" in texts and "a build is refused" not in texts, texts
    found, _ = verdicts(fabric, {"EP_PLUGIN_NUM_SMS": "132"}, backend="hybrid", ranks_per_gpu=2)
    assert "a build is refused" in " ".join(problem.text for problem in found["nvlink"].problems)
    environ = {"EP_PLUGIN_MAX_SMS_PER_GPU": "264"}  # autosized: a warning, not a failure
    found, code = verdicts(fabric, environ, backend="hybrid", ranks_per_gpu=2)
    assert (found["nvlink"].status, code) == (DEGRADED, 0), found["nvlink"]


def test_sm_autosize_line_honours_max_sms_per_gpu(tmp_path, capsys):
    fabric = make_fabric(tmp_path, driver([gpu(0, "0000:00:05.0", nvlinks=0)]))
    doctor.main(["--json", "--ranks-per-gpu", "4"], fabric=fabric, environ={"EP_PLUGIN_MAX_SMS_PER_GPU": "32"})
    sizing = json.loads(capsys.readouterr().out)["sm_autosize"]
    assert (sizing["limit"], sizing["num_sms"]) == (8, 8)  # what the backend picks: 32 SMs // 4 ranks


def test_sm_autosize_line_is_what_the_backend_picks(tmp_path, capsys):
    """The line showed autosize_sms at the default per-SM copy rates and the asked top-k; the backends size with
    their own measured rates for top-8 bf16 rows, so num_sms=0 picked another count than the doctor said."""
    from ep_plugin.backends.elastic import ElasticBackend
    from ep_plugin.backends.hybrid import HybridBackend
    from ep_plugin.transport.fabric import gpu_link_bandwidths
    from ep_plugin.transport.sizing import resolve_num_sms

    fabric = make_fabric(tmp_path, dgx_cx7(tmp_path))
    nvlink, scaleout = gpu_link_bandwidths(0, fabric)
    picked = {}
    for backend in (HybridBackend, ElasticBackend):  # the call _resolve_num_blocks makes, on 8 ranks of H=7168
        want = resolve_num_sms(Config(num_sms=0), device_sms=132, ranks_sharing_gpu=1, num_ranks=8, num_experts=256,
                               topk=backend.autosize_topk, hidden_bytes=2 * 7168, nvlink_gbytes_per_s=nvlink,
                               scaleout_gbytes_per_s=scaleout, sm_read_gbytes_per_s=backend.sm_read_gbytes_per_s,
                               sm_write_gbytes_per_s=backend.sm_write_gbytes_per_s, environ={})
        doctor.main(["--json", "--backend", backend.name], fabric=fabric, environ={})
        picked[backend.name] = json.loads(capsys.readouterr().out)["sm_autosize"]["num_sms"]
        assert picked[backend.name] == want, (backend.name, picked, want)
    assert picked["hybrid"] != picked["elastic"]  # the rates differ: a line for one backend would be wrong for one
    # Forced domains of 4: each domain's backend sizes for its 4 ranks and their 128 experts.
    forced = {"EP_PLUGIN_SCALEUP_SIZE": "4"}
    want = resolve_num_sms(Config(num_sms=0), device_sms=132, ranks_sharing_gpu=1, num_ranks=4, num_experts=128,
                           topk=HybridBackend.autosize_topk, hidden_bytes=2 * 7168, nvlink_gbytes_per_s=nvlink,
                           scaleout_gbytes_per_s=scaleout, sm_read_gbytes_per_s=HybridBackend.sm_read_gbytes_per_s,
                           sm_write_gbytes_per_s=HybridBackend.sm_write_gbytes_per_s, environ={})
    doctor.main(["--json"], fabric=fabric, environ=forced)
    assert json.loads(capsys.readouterr().out)["sm_autosize"]["num_sms"] == want
    doctor.main([], fabric=fabric, environ=forced)
    assert "of hybrid for the 4 ranks of an NVLink domain, 128 experts" in capsys.readouterr().out
    # Two groups of 4 GPUs that map only each other: the domain found is 4, forced or not.
    split = fabric.driver
    split.peer_access = [[(i < 4) == (j < 4) for j in range(8)] for i in range(8)]
    doctor.main(["--json"], fabric=make_fabric(tmp_path, split), environ={})
    assert json.loads(capsys.readouterr().out)["sm_autosize"]["num_sms"] == want


def test_older_architecture_is_flagged(tmp_path):
    found, _ = verdicts(make_fabric(tmp_path, driver([gpu(0, "0000:00:05.0", cc=(8, 0), nvlinks=0)])))
    built = _cuda.built_archs()
    if not built:  # no extension here: the default build's targets
        assert "EP_PLUGIN_CUDA_ARCHS=80" in fixes(found["nvlink"])
    elif "80" not in built:  # the kernels installed here cannot run on it
        assert found["nvlink"].status == UNAVAILABLE
        assert f'EP_PLUGIN_CUDA_ARCHS="{";".join(built)};80"' in fixes(found["nvlink"])


def test_a_gpu_the_installed_kernels_were_not_built_for_is_unavailable(tmp_path, monkeypatch):
    """A Blackwell GPU (sm_100) with the default sm_90 build: the kernels cannot run there, so the NVLink
    path is unavailable (it said ok, and the first launch failed with CUDA's 'no kernel image')."""
    monkeypatch.setattr(_cuda, "built_archs", lambda: ("90",))
    found, code = verdicts(make_fabric(tmp_path, driver([gpu(0, "0000:00:05.0", cc=(10, 0), nvlinks=0)])),
                           backend="hybrid")
    assert found["nvlink"].status == UNAVAILABLE and code == 1
    assert 'EP_PLUGIN_CUDA_ARCHS="90;100"' in fixes(found["nvlink"])


@pytest.mark.parametrize("archs,capability,runs", [
    (("90",), (9, 0), True), (("90",), (10, 0), False), (("90",), (8, 0), False),
    (("80",), (8, 6), True), (("86",), (8, 0), False),  # same major, a minor at least the build's
    (("90a",), (9, 0), True), (("100a",), (10, 3), False),  # architecture-specific: that GPU only
    (("90", "100"), (10, 3), True), ((), (7, 0), True),  # unknown builds are not judged here
])
def test_which_gpus_a_build_runs_on(archs, capability, runs):
    assert (_cuda.arch_mismatch(capability, archs) is None) == runs


# ---- MPS ---------------------------------------------------------------------------------------------

def test_mps_verdicts(tmp_path):
    report = driver([gpu(0, "0000:00:05.0", nvlinks=0)])
    found, _ = verdicts(make_fabric(tmp_path, report))
    assert found["mps"].status == NOT_NEEDED
    found, code = verdicts(make_fabric(tmp_path, report), ranks_per_gpu=4)
    assert (found["mps"].status, code) == (DEGRADED, 0) and "nvidia-cuda-mps-control -d" in fixes(found["mps"])
    write(tmp_path / "tmp/nvidia-mps/control", "")
    found, _ = verdicts(make_fabric(tmp_path, report), ranks_per_gpu=4)
    assert found["mps"].status == OK and "control daemon running" in found["mps"].summary
    greedy = make_fabric(tmp_path, report, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"})
    found, _ = verdicts(greedy, ranks_per_gpu=4)
    assert found["mps"].status == DEGRADED and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in fixes(found["mps"])
    for text in ("0", "-5", "150", "nan", "ten"):  # only "ten" was flagged; the numbers passed as they were
        odd = make_fabric(tmp_path, report, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": text})
        found, _ = verdicts(odd, ranks_per_gpu=1)
        problems = " ".join(problem.text for problem in found["mps"].problems)
        assert found["mps"].status == DEGRADED and f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={text!r}" in problems, text


# ---- gloo ---------------------------------------------------------------------------------------------

def test_a_gloo_interface_this_host_lacks_fails_a_backend_job(tmp_path):
    """The host words of an NCCL group travel on gloo: a GLOO_SOCKET_IFNAME naming no interface here
    makes building a backend fail, which the doctor says before the job starts."""
    report = driver([gpu(0, "0000:00:05.0")])
    for name in ("eth0", "ib0"):
        (tmp_path / "sys/class/net" / name).mkdir(parents=True)
    found, code = verdicts(make_fabric(tmp_path, report), backend="hybrid")
    assert (found["gloo"].status, code) == (OK, 0) and "unset" in found["gloo"].summary
    typo = {"GLOO_SOCKET_IFNAME": "eth0,eth9"}
    found, code = verdicts(make_fabric(tmp_path, report, typo), typo, backend="hybrid")
    assert (found["gloo"].status, code) == (UNAVAILABLE, 1), found["gloo"]
    assert "names eth9" in found["gloo"].problems[0].text and "(eth0, ib0)" in fixes(found["gloo"])
    assert "EP_PLUGIN_GLOO_HOST_WORDS=0" in fixes(found["gloo"])
    _, code = verdicts(make_fabric(tmp_path, report, typo), typo)  # no backend named: shown, not asked
    assert code == 0
    # Our words stay on NCCL, but Megatron makes gloo groups of its own by default (create_gloo_process_groups):
    # still asked (the fix said the knob was enough and doctor passed; the Megatron job failed).
    off = {**typo, "EP_PLUGIN_GLOO_HOST_WORDS": "0"}
    found, code = verdicts(make_fabric(tmp_path, report, off), off, backend="hybrid")
    assert (found["gloo"].status, code) == (UNAVAILABLE, 1), found["gloo"]
    assert "EP_PLUGIN_GLOO_HOST_WORDS=0" not in fixes(found["gloo"])
    assert any("create_gloo_process_groups" in note for note in found["gloo"].notes)
    found, _ = verdicts(make_fabric(tmp_path, report, typo), typo, backend="hybrid")
    assert "create_gloo_process_groups=False" in fixes(found["gloo"])
    present = {"GLOO_SOCKET_IFNAME": "ib0"}
    found, code = verdicts(make_fabric(tmp_path, report, present), present, backend="hybrid")
    assert (found["gloo"].status, code) == (OK, 0) and "present here" in found["gloo"].summary
    # Names as torch reads them: as written, blanks and empty names included (they passed, stripped; every gloo
    # group then failed with "Unable to find address for: ib0 " or "interface or hostname can't be empty").
    for odd, shown in (("ib0 ", "'ib0 '"), (",ib0", "''"), ("eth0,,ib0", "''"), (" eth0", "' eth0'")):
        found, code = verdicts(make_fabric(tmp_path, report, {"GLOO_SOCKET_IFNAME": odd}),
                               {"GLOO_SOCKET_IFNAME": odd}, backend="hybrid")
        assert (found["gloo"].status, code) == (UNAVAILABLE, 1), (odd, found["gloo"])
        assert f"the name(s) {shown}" in found["gloo"].problems[0].text, found["gloo"].problems[0].text
        assert fixes(found["gloo"]).startswith(f"GLOO_SOCKET_IFNAME={odd.strip(' ,').replace(',,', ',')}")
    for fine in ("ib0,", "eth0,ib0,", " ", "x"):  # a trailing comma ends the list; one character is ignored
        found, code = verdicts(make_fabric(tmp_path, report, {"GLOO_SOCKET_IFNAME": fine}),
                               {"GLOO_SOCKET_IFNAME": fine}, backend="hybrid")
        assert (found["gloo"].status, code) == (OK, 0), (fine, found["gloo"])
    # reference's process group is gloo itself (CPU ranks, or staging): asked whatever the knob says (it
    # passed with the knob off, and the job failed with "Unable to find address for: eth9").
    _, code = verdicts(make_fabric(tmp_path, report, off), off, backend="reference")
    assert code == 1


def test_a_knob_every_backend_refuses_fails_any_backend_job(tmp_path):
    """Config.from_env runs in every backend's build: a refused EP_PLUGIN_* value fails reference's too. It was
    reported inside the NVLink verdict only (not asked for reference, and skipped where there is no GPU)."""
    for fabric in (make_fabric(tmp_path, driver([gpu(0, "0000:00:05.0")])),
                   make_fabric(tmp_path, DriverReport(loaded=False, error="no CUDA driver"))):
        bad = {"EP_PLUGIN_BLOCKING": "maybe"}
        found, code = verdicts(fabric, bad, backend="reference")
        assert (found["config"].status, code) == (UNAVAILABLE, 1), found["config"]
        assert "EP_PLUGIN_BLOCKING" in found["config"].problems[0].text
        assert verdicts(fabric, bad)[1] == 0  # no backend named: shown, not asked
        found, code = verdicts(fabric, {"EP_PLUGIN_NUM_SMS": "8"}, backend="reference")
        assert (found["config"].status, code) == (OK, 0) and "EP_PLUGIN_NUM_SMS" in found["config"].summary
        # A misspelt knob leaves the one it meant at its default: a warning naming it, not "[ok] set here".
        found, code = verdicts(fabric, {"EP_PLUGIN_NUM_SM": "8"}, backend="reference")
        assert (found["config"].status, code) == (DEGRADED, 0), found["config"]
        assert "did you mean EP_PLUGIN_NUM_SMS?" in found["config"].problems[0].text
        assert "EP_PLUGIN_NUM_SM" not in found["config"].summary
        # Next to a refused value too: doctor keeps from_env's warning quiet, so this is its only mention.
        found, code = verdicts(fabric, dict(bad, EP_PLUGIN_NUM_SM="8"), backend="reference")
        assert (found["config"].status, code) == (UNAVAILABLE, 1), found["config"]
        assert "did you mean EP_PLUGIN_NUM_SMS?" in found["config"].problems[1].text, found["config"]
        # The build's and the test bed's variables are no knobs a run reads: a note, not "knobs set here".
        built = {"EP_PLUGIN_CUDA_ARCHS": "90", "EP_PLUGIN_REQUIRE_GPU": "1", "EP_PLUGIN_TIMEOUT_S": "30"}
        found, code = verdicts(fabric, built, backend="reference")
        assert (found["config"].status, code) == (OK, 0), found["config"]
        assert found["config"].summary == "set here: EP_PLUGIN_TIMEOUT_S", found["config"].summary
        assert any("EP_PLUGIN_CUDA_ARCHS, EP_PLUGIN_REQUIRE_GPU" in note for note in found["config"].notes)


def test_a_third_party_backend_is_not_shown_as_checked(tmp_path):
    fabric = make_fabric(tmp_path, dgx_cx7(tmp_path))
    found, code = verdicts(fabric, registered=REGISTERED + ["vendor_ep"], backend="vendor_ep")
    assert (found["backend"].status, code) == (doctor.UNCHECKED, 0)
    text = doctor.render(fabric, list(found.values()), None, Options(backend="vendor_ep"))
    assert "[?   ] backend 'vendor_ep' (asked)" in text, text


def test_an_asked_verdict_that_fails_is_shown_as_fail(tmp_path):
    """The exit code reads asked verdicts that did not pass; a degraded one (RDMA staged through the host
    where GPUDirect was asked for) was shown as [warn] next to exit code 1."""
    report = driver([gpu(0, "0000:00:05.0", gdr=False, dmabuf=False)])
    fabric = make_fabric(tmp_path, report)
    found, code = verdicts(fabric, backend="hybrid", scaleout="gdr")
    assert code == 1 and found["scaleout"].status != UNAVAILABLE and not found["scaleout"].passed
    text = doctor.render(fabric, list(found.values()), None, Options(backend="hybrid", scaleout="gdr"))
    assert "[FAIL] scale-out" in text and "[warn] scale-out" not in text, text


def test_a_host_name_on_loopback_fails_gloo_across_nodes(tmp_path):
    """Without GLOO_SOCKET_IFNAME gloo listens where the host name resolves; /etc/hosts often maps it to
    127.0.1.1, which the other nodes cannot reach (every gloo group across nodes then fails to connect)."""
    report = driver([gpu(0, "0000:00:05.0")])
    for name in ("lo", "eth0"):
        (tmp_path / "sys/class/net" / name).mkdir(parents=True, exist_ok=True)
    loopback = make_fabric(tmp_path, report, host_address="127.0.1.1")
    found, code = verdicts(loopback, backend="hybrid")  # one node: loopback is fine
    assert (found["gloo"].status, code) == (OK, 0) and "127.0.1.1" in found["gloo"].summary
    found, code = verdicts(loopback, backend="hybrid", nodes=2)
    assert (found["gloo"].status, code) == (UNAVAILABLE, 1), found["gloo"]
    assert "resolves to 127.0.1.1" in found["gloo"].problems[0].text and "(here: eth0)" in fixes(found["gloo"])
    found, code = verdicts(loopback, nodes=2)  # --nodes alone asks for it too (it said FAIL and exited 0)
    assert (found["gloo"].status, code) == (UNAVAILABLE, 1), found["gloo"]
    found, code = verdicts(make_fabric(tmp_path, report, host_address=None), scaleout="socket")
    assert found["gloo"].status == UNAVAILABLE and code == 1, found["gloo"]
    found, code = verdicts(make_fabric(tmp_path, report), backend="hybrid", nodes=2)  # a routable address
    assert (found["gloo"].status, code) == (OK, 0) and "10.1.2.3" in found["gloo"].summary
    named = {"GLOO_SOCKET_IFNAME": "eth0"}
    found, code = verdicts(make_fabric(tmp_path, report, named, host_address="127.0.1.1"), named, backend="hybrid",
                           nodes=2)
    assert (found["gloo"].status, code) == (OK, 0), found["gloo"]


def test_a_gloo_interface_without_a_routable_address_fails_a_backend_job(tmp_path):
    """gloo takes the named interface's address: one that has none (down, or a dummy) is refused when the group
    forms ("Unable to find address for: ifb0"), and a loopback one cannot be reached from other nodes. The doctor
    said "present here" to both."""
    report = driver([gpu(0, "0000:00:05.0")])
    for name in ("lo", "eth0", "ifb0"):
        (tmp_path / "sys/class/net" / name).mkdir(parents=True, exist_ok=True)

    def addresses(names):
        return {name: [] if name == "ifb0" else every_interface_addressed([name])[name] for name in names}

    bare = {"GLOO_SOCKET_IFNAME": "ifb0"}
    found, code = verdicts(make_fabric(tmp_path, report, bare, addresses=addresses), bare, backend="hybrid")
    assert (found["gloo"].status, code) == (UNAVAILABLE, 1), found["gloo"]
    assert "ifb0, which has no address" in found["gloo"].problems[0].text and "(eth0)" in fixes(found["gloo"])
    loop = {"GLOO_SOCKET_IFNAME": "lo"}
    found, code = verdicts(make_fabric(tmp_path, report, loop, addresses=addresses), loop, backend="hybrid")
    assert (found["gloo"].status, code) == (OK, 0) and "lo: 127.0.0.1" in found["gloo"].summary  # one node
    found, code = verdicts(make_fabric(tmp_path, report, loop, addresses=addresses), loop, backend="hybrid", nodes=2)
    assert (found["gloo"].status, code) == (UNAVAILABLE, 1), found["gloo"]
    assert "only address is loopback" in found["gloo"].problems[0].text
    unread = make_fabric(tmp_path, report, bare, addresses=lambda names: None)  # not asked here: a note, passes
    found, code = verdicts(unread, bare, backend="hybrid")
    assert (found["gloo"].status, code) == (OK, 0) and "could not be read" in " ".join(found["gloo"].notes)


def test_megatron_core_is_checked_against_the_versions_the_integration_takes(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from ep_plugin.integrations.megatron import compat

    fabric = make_fabric(tmp_path, driver([gpu(0, "0000:00:05.0")]))
    found, _ = verdicts(fabric)
    installed = ".".join(map(str, compat.megatron_version()))  # the real megatron-core of this environment
    assert (found["megatron"].status, found["megatron"].summary) == (OK, f"megatron-core {installed}")
    for version, status in (((0, 15, 2), UNAVAILABLE), ((0, 20, 0), DEGRADED), (compat.MIN_VERSION, OK)):
        info = SimpleNamespace(MAJOR=version[0], MINOR=version[1], PATCH=version[2],
                               __version__=".".join(map(str, version)))
        monkeypatch.setattr(doctor, "_megatron_package_info", lambda info=info: info)
        found, code = verdicts(fabric, backend="hybrid")
        assert (found["megatron"].status, code) == (status, 0), found["megatron"]  # shown, never asked
    monkeypatch.setattr(doctor, "_megatron_package_info", lambda: None)
    assert verdicts(fabric)[0]["megatron"].status == NOT_NEEDED


def test_reference_needs_torch_distributed(tmp_path, monkeypatch):
    import torch.distributed as dist

    fabric = make_fabric(tmp_path, DriverReport(loaded=False, error="no CUDA driver"))
    assert verdicts(fabric, backend="reference")[1] == 0
    monkeypatch.setattr(dist, "is_available", lambda: False)
    found, code = verdicts(fabric, backend="reference")
    assert (found["backend"].status, code) == (UNAVAILABLE, 1) and "USE_DISTRIBUTED=0" in found[
        "backend"].problems[0].text


# ---- command line ------------------------------------------------------------------------------------

def test_json_output_parses_and_carries_the_exit_code(tmp_path, capsys):
    fabric = make_fabric(tmp_path, dgx_cx7(tmp_path, peermem=False, dmabuf=False))
    code = doctor.main(["--json", "--scaleout", "gdr"], fabric=fabric, environ={})
    payload = json.loads(capsys.readouterr().out)
    assert code == 1 and payload["exit_code"] == 1
    modes = {v["path"]: v["mode"] for v in payload["verdicts"]}
    assert modes["scaleout"] == nccl_probe.STAGED
    assert payload["fabric"]["gpus"][0]["scaleout_gbytes_per_s"] == 50.0
    assert payload["fabric"]["rdma_devices"][0]["hca_type"] == "MT4129"
    assert payload["sm_autosize"]["num_sms"] >= 4


def test_json_output_is_strict_json_with_a_non_number_mps_percentage(tmp_path, capsys):
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=nan printed a bare NaN, which strict JSON parsers refuse."""
    for value in ("nan", "inf"):
        environ = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": value}
        fabric = make_fabric(tmp_path, driver([gpu(0, "0000:00:05.0")]), environ)
        doctor.main(["--json", "--ranks-per-gpu", "2"], fabric=fabric, environ=environ)

        def refuse(constant):
            raise ValueError(f"not JSON: {constant}")

        payload = json.loads(capsys.readouterr().out, parse_constant=refuse)
        mps = next(v for v in payload["verdicts"] if v["path"] == "mps")
        assert "is not a number" in mps["problems"][0]["text"], mps


def test_text_output_has_tables_verdicts_and_fixes(tmp_path, capsys):
    fabric = make_fabric(tmp_path, dgx_cx7(tmp_path, down=(3,), peermem=False, dmabuf=False))
    assert doctor.main(["--ranks-per-gpu", "2"], fabric=fabric, environ={}) == 0
    text = capsys.readouterr().out
    for expected in ("Machine", "GPUs", "RDMA devices (/sys/class/infiniband)", "ConnectX-7", "400 Gb/sec (4X NDR)",
                     "SM autosize (EP_PLUGIN_NUM_SMS=0) of hybrid for the 16 ranks of an NVLink domain", "Verdicts",
                     "[warn] scale-out",
                     "fix:     modprobe nvidia_peermem", "Warnings", "mlx5_3 have no ACTIVE port"):
        assert expected in text, expected
    nic_row = next(line for line in text.splitlines() if line.strip().startswith("mlx5_3"))
    assert nic_row.split()[4] == "DOWN"


def test_cli_on_this_machine(capsys):
    code = doctor.main(["--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["exit_code"] == 0
    nvlink = next(v for v in payload["verdicts"] if v["path"] == "nvlink")
    if payload["fabric"]["gpus"]:
        assert nvlink["summary"]
    else:  # the CPU build machine: said plainly
        assert nvlink["status"] == UNAVAILABLE and nvlink["problems"][0]["text"].startswith("no GPU")
        assert doctor.main(["--backend", "hybrid"]) == 1 and doctor.main(["--backend", "reference"]) == 0
        assert "no GPU" in capsys.readouterr().out


def test_module_and_console_script_entry_points():
    result = subprocess.run([sys.executable, "-m", "ep_plugin", "doctor"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Verdicts" in result.stdout and "NVLink domain" in result.stdout
    script = os.path.join(os.path.dirname(sys.executable), "ep-plugin")
    if not os.path.exists(script):
        pytest.skip("ep-plugin console script not installed next to this python")
    result = subprocess.run([script, "doctor", "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and json.loads(result.stdout)["verdicts"]


@pytest.mark.parametrize("entry", ["module", "console script"])
def test_a_reader_that_leaves_early_gets_no_traceback(entry):
    """``ep-plugin info | head -1``: the pipe closes under the writer; both entry points exit 0, quietly."""
    command = [sys.executable, "-m", "ep_plugin", "info"]
    if entry == "console script":
        command = [os.path.join(os.path.dirname(sys.executable), "ep-plugin"), "info"]
        if not os.path.exists(command[0]):
            pytest.skip("ep-plugin console script not installed next to this python")
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        process.stdout.close()  # the reader leaves before the first line
        stderr = process.stderr.read().decode()
        assert process.wait(timeout=120) == 0, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_info_prints_the_fabric_line(capsys):
    from ep_plugin.__main__ import main

    assert main(["info"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("fabric: "))
    assert "scale-out:" in line and "python -m ep_plugin doctor" in line


def test_summary_line(tmp_path):
    line = doctor.summary_line(make_fabric(tmp_path, p5en_efa(tmp_path)), {})
    assert line.startswith("8 x NVIDIA H200 (132 SMs, sm_90)") and "16 ACTIVE RDMA NIC(s) (EFA)" in line
    assert nccl_probe.GDR_DMABUF in line
    # No GPU: CPU ranks cross nodes over gloo, as doctor's verdict says (info said "unavailable").
    line = doctor.summary_line(make_fabric(tmp_path / "cpu", DriverReport(loaded=False, error="no driver")), {})
    assert f"scale-out: {nccl_probe.SOCKET}" in line, line


def test_partial_driver_report_is_a_problem_not_a_crash(tmp_path):
    report = driver([gpu(0, "0000:00:05.0", nvlinks=None, sms=0)])
    report.error, report.nvml_error = "cuDeviceGetPCIBusId(1) failed: CUDA_ERROR_UNKNOWN (999)", "NVML not found"
    found, code = verdicts(make_fabric(tmp_path, report), backend="hybrid")
    verdict = found["nvlink"]
    assert (verdict.status, code) == (DEGRADED, 0) and "stopped early" in verdict.problems[0].text
    assert "NVLink state unknown: NVML not found" in verdict.notes
    assert any("SM count" in note for note in verdict.notes)


@pytest.mark.parametrize("argv, words", [(["--hidden", "-5"], "--hidden: must be >= 1, got -5"),
                                          (["--nodes", "0"], "--nodes: must be >= 1, got 0"),
                                          (["--ranks-per-gpu", "two"], "--ranks-per-gpu: 'two' is not a whole number"),
                                          # a traceback (OverflowError in the sizing), and a quadratic placement
                                          # search that ran for minutes
                                          (["--hidden", "9" * 400], "--hidden: must be at most 2147483647"),
                                          (["--experts", "9" * 400], "--experts: must be at most 2147483647"),
                                          (["--ranks-per-gpu", "100000"], "--ranks-per-gpu: must be at most 32")])
def test_bad_sizes_are_one_line_errors(argv, words, capsys):
    """They were clamped to 1 (or used as they were) without a word; a typo now stops with one line."""
    with pytest.raises(SystemExit) as stopped:
        doctor.main(argv, environ={})  # the parser stops it before any probe
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("release,at_least_5_12", [("6.18.44-fc-v1252", True), ("5.12.0", True), ("5.11.22", False),
                                                   ("5.1-rc3", False), ("5.4.0-150-generic", False), ("", None)])
def test_kernel_release_against_dmabuf_import_minimum(release, at_least_5_12):
    """DMA-BUF import needs Linux 5.12; the minor is its leading digits (5.1-rc3 once read as 5.13)."""
    assert doctor._kernel_at_least(release, 5, 12) is at_least_5_12
