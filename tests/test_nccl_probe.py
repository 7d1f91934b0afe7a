"""NCCL log parsing (a pure function) decides the scale-out mode; the probe itself needs 2 GPUs."""

import pytest

from ep_plugin.transport import nccl_probe
from ep_plugin.transport.nccl_probe import parse_nccl_log, run_nccl_probe, scaleout_mode_from_log

PREFIX = "node1:5123:5170 [0] NCCL INFO "

IB_DMABUF = [
    "NCCL version 2.27.3+cuda12.9",
    "DMA-BUF is available on GPU device 0",
    "NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB ens3:10.0.0.2<0>",
    "Using network IB",
    # The RDMA plugin's lines print no closing quote; NCCL's own (its topology) cannot say which module.
    "NET/IB : GPU Direct RDMA (DMABUF) enabled for HCA 0 'mlx5_0",
    "NET/IB : GPU Direct RDMA (DMABUF) enabled for HCA 1 'mlx5_1",
    "NET/IB : GPU Direct RDMA Enabled for HCA 0 'mlx5_0'",
    "Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/0/GDRDMA",
    "Channel 01/0 : 0[0] -> 1[1] [send] via NET/IB/1/GDRDMA",
]
IB_PEERMEM = [
    "Using network IB",
    "NET/IB : GPU Direct RDMA (nvidia-peermem) enabled for HCA 0 'mlx5_0",
    "NET/IB : GPU Direct RDMA Enabled for HCA 0 'mlx5_0'",
    "Channel 00/0 : 1[1] -> 0[0] [receive] via NET/IB/0/GDRDMA",
]
# NCCL's own IB transport alone: "Enabled" is peermem or DMA-BUF (it was read as peermem).
IB_ENABLED = [
    "DMA-BUF is available on GPU device 0",
    "Using network IB",
    "NET/IB : GPU Direct RDMA Enabled for HCA 0 'mlx5_0'",
    "Channel 00/0 : 1[1] -> 0[0] [receive] via NET/IB/0/GDRDMA",
]
IB_STAGED = [
    "DMA-BUF is available on GPU device 0",  # says nothing about the network path
    "Using network IB",
    "NET/IB : GPU Direct RDMA Disabled for HCA 0 'mlx5_0' (no module)",
    "Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/0",
    "Channel 00/0 : 1[1] -> 0[0] [receive] via NET/IB/0",
]
SOCKETS = [
    "NET/IB : No device found.",
    "NET/Socket : Using [0]eth0:10.1.2.3<0>",
    "Using network Socket",
    "Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0",
]
P2P_ONLY = [
    "DMA-BUF is available on GPU device 0",
    "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read",
]
EFA_GDR = [
    "NET/OFI Selected Provider is efa (found 16 nics)",
    "Using network AWS Libfabric",
    "Channel 00/0 : 0[0] -> 8[0] [send] via NET/AWS Libfabric/0/GDRDMA",
]
# Two layers disagree (a plugin reports Disabled after the IB transport said DMA-BUF): the channel decides.
CONFLICTING = [
    "NET/IB : GPU Direct RDMA (DMABUF) enabled for HCA 0 'rocep1s0f0'",
    "NET/NCCL RDMA Plugin v10 : GPU Direct RDMA Disabled for HCA 0 'rocep1s0f0'",
    "Channel 00/0 : 1[0] -> 0[0] [receive] via NET/NCCL RDMA Plugin v10/0",
    "node1:5123:5170 [0] misc/ibvwrap.cc:288 NCCL WARN Call to ibv_reg_dmabuf_mr failed with error Operation "
    "not supported",
]


def lines(sample):
    """As NCCL writes them: host:pid:tid [dev] NCCL INFO ..., newline-terminated."""
    return [(line if line.startswith("node1:") else PREFIX + line) + "\n" for line in sample]


@pytest.mark.parametrize("sample,mode", [
    (IB_DMABUF, nccl_probe.GDR_DMABUF), (IB_PEERMEM, nccl_probe.GDR_PEERMEM), (IB_STAGED, nccl_probe.STAGED),
    (SOCKETS, nccl_probe.SOCKET), (P2P_ONLY, None), (EFA_GDR, nccl_probe.GDR_UNSPECIFIED),
    (CONFLICTING, nccl_probe.STAGED), (IB_ENABLED, nccl_probe.GDR_UNSPECIFIED),
])
def test_log_decides_the_mode(sample, mode):
    assert scaleout_mode_from_log(parse_nccl_log(lines(sample)))[0] == mode


def test_parsed_facts():
    facts = parse_nccl_log(lines(IB_DMABUF))
    assert (facts.version, facts.network, facts.gpu_dmabuf_available) == ("2.27.3+cuda12.9", "IB", True)
    assert facts.gdr_dmabuf_hcas == ["mlx5_0", "mlx5_1"] and facts.gdr_enabled_hcas == []
    assert facts.gdr_unspecified_hcas == ["mlx5_0"]
    assert parse_nccl_log(lines(IB_PEERMEM)).gdr_enabled_hcas == ["mlx5_0"]
    assert (facts.net_channels, facts.gdr_channels) == (2, 2)
    staged = parse_nccl_log(lines(IB_STAGED))
    assert staged.gdr_disabled_hcas == ["mlx5_0"] and (staged.net_channels, staged.gdr_channels) == (2, 0)
    mode, why = scaleout_mode_from_log(staged)
    assert "GPU Direct RDMA Disabled for mlx5_0" in why
    conflicting = parse_nccl_log(lines(CONFLICTING))
    assert conflicting.gdr_dmabuf_hcas == ["rocep1s0f0"] and conflicting.gdr_disabled_hcas == ["rocep1s0f0"]
    assert len(conflicting.warnings) == 1 and "ibv_reg_dmabuf_mr" in conflicting.warnings[0]
    assert parse_nccl_log(lines(EFA_GDR)).network == "AWS Libfabric"


def test_probe_needs_two_gpus():
    result = run_nccl_probe(1)
    assert not result.ran and "needs 2 GPUs" in result.reason and result.mode is None
