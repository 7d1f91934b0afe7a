"""Which scale-out path NCCL really takes, read from its own ``NCCL_DEBUG=INFO`` log.

``run_nccl_probe`` starts two ranks on two GPUs of this host with peer-to-peer and shared-memory
transports disabled, so their connection goes through NCCL's network transport exactly as a
cross-node one would; ``parse_nccl_log`` (a pure function) turns the log lines into facts and
``scaleout_mode_from_log`` into one of the scale-out modes:

- a channel line ending ``via NET/IB/0/GDRDMA`` means GPUDirect RDMA is in use; the HCA lines
  ("GPU Direct RDMA (DMABUF) enabled for HCA ..." or "... Enabled for HCA ...") say how;
- a network channel without ``/GDRDMA`` ("GPU Direct RDMA Disabled for HCA ...") means every
  transfer is staged through host memory: correct but slow;
- "Using network Socket" means no RDMA at all.

"DMA-BUF is available on GPU device N" alone says only that the GPU can export DMA-BUFs; NCCL
prints it at every init whether or not the network uses it.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Iterable, Optional

# Scale-out modes, best first; RANK orders them for "--scaleout gdr|rdma|socket".
GDR_DMABUF = "gpudirect-rdma (dma-buf)"
GDR_PEERMEM = "gpudirect-rdma (nvidia-peermem)"
GDR_UNSPECIFIED = "gpudirect-rdma"
STAGED = "rdma staged through host memory"
SOCKET = "tcp sockets through host memory"
UNAVAILABLE = "unavailable"
RANK = {GDR_DMABUF: 3, GDR_PEERMEM: 3, GDR_UNSPECIFIED: 3, STAGED: 2, SOCKET: 1, UNAVAILABLE: 0}
REQUIREMENTS = {"gdr": 3, "rdma": 2, "socket": 1}

# The HCA's name; the RDMA plugin's "(DMABUF) enabled" and "(nvidia-peermem) enabled" lines print no closing quote.
_HCA = r"for HCA \d+ '([^'\s]+)'?"


@dataclass
class NcclLogFacts:
    """What an NCCL INFO log says about the network path."""

    version: Optional[str] = None
    network: Optional[str] = None  # "IB", "Socket", "AWS Libfabric", ...
    gpu_dmabuf_available: bool = False
    gdr_dmabuf_hcas: list[str] = field(default_factory=list)
    gdr_enabled_hcas: list[str] = field(default_factory=list)  # "(nvidia-peermem) enabled"
    # NCCL's own "GPU Direct RDMA Enabled" (its topology): peermem or DMA-BUF, it does not say which.
    gdr_unspecified_hcas: list[str] = field(default_factory=list)
    gdr_disabled_hcas: list[str] = field(default_factory=list)
    net_channels: int = 0  # connections through the network transport
    gdr_channels: int = 0  # ... of which use GPUDirect RDMA
    warnings: list[str] = field(default_factory=list)  # "NCCL WARN" lines


def parse_nccl_log(lines: Iterable[str]) -> NcclLogFacts:
    """Facts from NCCL_DEBUG=INFO lines (any prefix before "NCCL INFO" is ignored)."""
    facts = NcclLogFacts()
    for line in lines:
        line = line.rstrip("\n")
        if match := re.search(r"NCCL version (\S+)", line):
            facts.version = facts.version or match.group(1)
        if match := re.search(r"Using network (.+?)\s*$", line):
            facts.network = match.group(1)
        if "DMA-BUF is available on GPU device" in line:
            facts.gpu_dmabuf_available = True
        if match := re.search(r"GPU Direct RDMA \(DMABUF\) enabled " + _HCA, line, re.IGNORECASE):
            _add(facts.gdr_dmabuf_hcas, match.group(1))
        elif match := re.search(r"GPU Direct RDMA \(nvidia-peermem\) enabled " + _HCA, line, re.IGNORECASE):
            _add(facts.gdr_enabled_hcas, match.group(1))
        elif match := re.search(r"GPU Direct RDMA Enabled " + _HCA, line):
            _add(facts.gdr_unspecified_hcas, match.group(1))
        elif match := re.search(r"GPU Direct RDMA Disabled " + _HCA, line):
            _add(facts.gdr_disabled_hcas, match.group(1))
        if re.search(r"\bvia NET/", line):
            facts.net_channels += 1
            if "/GDRDMA" in line:
                facts.gdr_channels += 1
        if "NCCL WARN" in line:
            facts.warnings.append(line.strip())
    return facts


def _add(names: list[str], name: str) -> None:
    if name not in names:
        names.append(name)


def scaleout_mode_from_log(facts: NcclLogFacts) -> tuple[Optional[str], str]:
    """(mode, why) from parsed facts; mode None when the log never used the network transport."""
    network = facts.network or "unknown network"
    if facts.network is not None and facts.network.lower().startswith("socket"):
        return SOCKET, "NCCL chose its socket transport (no usable RDMA device)"
    if facts.net_channels == 0:
        return None, "no connection went through NCCL's network transport"
    if facts.gdr_channels > 0:
        if facts.gdr_dmabuf_hcas:
            return GDR_DMABUF, f"{facts.gdr_channels} of {facts.net_channels} {network} connections use GPUDirect " \
                               f"RDMA; DMA-BUF enabled for {', '.join(facts.gdr_dmabuf_hcas)}"
        if facts.gdr_enabled_hcas:
            return GDR_PEERMEM, f"{facts.gdr_channels} of {facts.net_channels} {network} connections use " \
                                f"GPUDirect RDMA (peer memory) on {', '.join(facts.gdr_enabled_hcas)}"
        dmabuf = " (DMA-BUF is available on the GPU)" if facts.gpu_dmabuf_available else ""
        return GDR_UNSPECIFIED, f"{facts.gdr_channels} of {facts.net_channels} {network} connections use " \
                                f"GPUDirect RDMA (the log does not say through which module{dmabuf})"
    disabled = f" (GPU Direct RDMA Disabled for {', '.join(facts.gdr_disabled_hcas)})" \
        if facts.gdr_disabled_hcas else ""
    return STAGED, f"{facts.net_channels} {network} connections, none with GPUDirect RDMA{disabled}"


@dataclass
class NcclProbeResult:
    ran: bool
    reason: str  # why it did not run, or how it ended
    # False when the ranks' NCCL init or all-reduce failed: a job's NCCL across nodes fails the same way here.
    succeeded: bool = True
    facts: Optional[NcclLogFacts] = None
    mode: Optional[str] = None
    why: str = ""
    log_tail: list[str] = field(default_factory=list)
    log_lines: int = 0  # NCCL's lines in all: none where the ranks failed before NCCL started


def _probe_rank(ctx) -> float:
    """One all-reduce: NCCL creates its communicator and connects on the first collective."""
    import torch
    import torch.distributed as dist

    value = torch.ones(1, device=ctx.device)
    dist.all_reduce(value)
    torch.cuda.synchronize()
    return float(value.item())


def run_nccl_probe(num_gpus: int, *, timeout_s: float = 120.0) -> NcclProbeResult:
    """Two NCCL ranks on GPUs 0 and 1 with the network transport forced; the log decides the mode.

    NCCL refuses two ranks on one GPU, so with fewer than two GPUs the probe does not run (the
    result says so). ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`` push the pair onto the network
    transport: on a machine without RDMA NICs that is NCCL's socket transport.
    """
    if num_gpus < 2:
        return NcclProbeResult(ran=False, reason=f"needs 2 GPUs (NCCL refuses two ranks on one GPU); "
                                                 f"this machine has {num_gpus}")
    from ..testing.launcher import run_ranks

    with tempfile.TemporaryDirectory(prefix="ep_plugin_nccl_probe_") as directory:
        env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV",
               "NCCL_DEBUG_FILE": os.path.join(directory, "nccl.%h.%p.log"),
               "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
        reason, succeeded = "two ranks initialised NCCL and ran one all-reduce", True
        try:
            run_ranks(_probe_rank, 2, device="cuda", timeout_s=timeout_s, env=env)
        except Exception as exc:  # noqa: BLE001 - a failed init is itself the finding
            reason = f"the NCCL run failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
            succeeded = False
        lines: list[str] = []
        for name in sorted(os.listdir(directory)):
            with open(os.path.join(directory, name), errors="replace") as handle:
                lines.extend(handle.readlines())
    facts = parse_nccl_log(lines)
    mode, why = scaleout_mode_from_log(facts)
    return NcclProbeResult(ran=True, reason=reason, succeeded=succeeded, facts=facts, mode=mode, why=why,
                           log_tail=[line.rstrip() for line in lines if "NET" in line or "WARN" in line][-20:],
                           log_lines=sum(1 for line in lines if "NCCL" in line))
