"""How many SMs the communication kernels of one rank should use (``num_sms=0``: autosize).

The rule (DeepEP V2's, with its failure modes removed):

1. A token's top-k experts land on ``g(n) = n (1 - C(E - E/n, k) / C(E, k))`` distinct ranks on
   average when E experts are spread over n ranks (``expected_destinations``). The same formula
   over domains gives the domains a token reaches.
2. Bytes per token on each link: NVLink carries a row to every hit rank but the one the token
   lands on in each domain, ``hidden_bytes * g(ranks) * (L - 1) / L`` for domains of L ranks; the
   scale-out carries one row per remote domain hit, ``hidden_bytes * g(D) * (D - 1) / D``.
3. The slowest link sets the token rate; at that rate the SMs must read each token once and
   write ``g(ranks)`` rows. SMs = ``1.25 * max(read / per-SM read rate, write / per-SM write
   rate)``, rounded up to an even number, at least 4.
4. Never more than the co-residency limit: every block of every rank sharing the GPU spin-waits
   on the others, so all must be resident at once: ``limit = SMs of the GPU // ranks sharing it``
   (and, under MPS, the rank's active-thread share of the SMs).

A bandwidth that is unknown (None, 0, negative, NaN) is replaced by a documented default and a
warning, never used as 0: DeepEP read 0 when ``ibstat`` was missing and divided by it.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

logger = logging.getLogger("ep_plugin")

# Defaults for a bandwidth nobody could measure, in GB/s (10^9 bytes) per GPU and direction.
DEFAULT_NVLINK_GBYTES_PER_S = 450.0  # 18 NVLink-4 links x 25 GB/s (H100 / H200)
DEFAULT_SCALEOUT_GBYTES_PER_S = 50.0  # one 400 Gb/s NIC per GPU
# Per-SM copy rates of DeepEP V2's rule, GB/s. Our kernels measured 13-20 GB/s per SM
# (benchmarks/NOTES.md) and pass their own rates (CompiledBackend.sm_*_gbytes_per_s).
SM_READ_GBYTES_PER_S = 200.0
SM_WRITE_GBYTES_PER_S = 50.0
HEADROOM = 1.25
MIN_SMS = 4
MAX_SMS_PER_RANK = 1024  # Config.num_sms' upper bound


@dataclass(frozen=True)
class SmSizing:
    """The autosized SM count and why; ``warnings`` name every default that stood in for a probe."""

    num_sms: int
    limit: int  # co-residency limit per rank
    demand: float  # SMs the links could keep busy, before rounding and clamping
    nvlink_gbytes_per_s: float
    scaleout_gbytes_per_s: float
    warnings: tuple[str, ...] = ()


def expected_destinations(num_groups: int, num_experts: int, topk: int) -> float:
    """Expected number of distinct groups (ranks or domains) a token's top-k experts fall in.

    ``g(n) = n * (1 - C(E - E/n, k) / C(E, k))`` with E experts split evenly over n groups; the
    ratio is the chance one group receives none of the k picks, computed as a product so that it
    needs no large binomials and no division by zero (every factor's denominator is E - i > 0).
    Degenerate inputs (n < 1, E < 1, k < 1) give 0 destinations for no experts or picks, and are
    clamped otherwise (n at least 1, k at most E).
    """
    groups = max(1, int(num_groups))
    experts = max(0, int(num_experts))
    picks = min(max(0, int(topk)), experts)
    if experts == 0 or picks == 0:
        return 0.0
    per_group = experts / groups
    miss = 1.0
    for i in range(picks):
        remaining = experts - per_group - i
        if remaining <= 0:
            miss = 0.0
            break
        miss *= remaining / (experts - i)
    return groups * (1.0 - miss)


def co_residency_limit(device_sms: int, ranks_sharing_gpu: int, mps_thread_percentage: Optional[float] = None) -> int:
    """Most blocks one rank may run when every rank's blocks on the GPU must be resident at once.

    ``device_sms // ranks_sharing_gpu`` (one spin-waiting block per SM), further capped under MPS
    by the rank's share of the SMs, ``floor(device_sms * percentage / 100)``. 0 means no block fits.
    """
    sharing = max(1, int(ranks_sharing_gpu))
    limit = max(0, int(device_sms)) // sharing
    if mps_thread_percentage is not None and math.isfinite(mps_thread_percentage) and mps_thread_percentage > 0:
        limit = min(limit, int(max(0, int(device_sms)) * min(mps_thread_percentage, 100.0) / 100.0))
    return min(limit, MAX_SMS_PER_RANK)


def _usable(bandwidth: Optional[float]) -> bool:
    return bandwidth is not None and isinstance(bandwidth, (int, float)) and math.isfinite(bandwidth) and bandwidth > 0


def autosize_sms(*, device_sms: int, ranks_sharing_gpu: int, num_ranks: int, num_experts: int, topk: int,
                 hidden_bytes: int, domain_size: Optional[int] = None,
                 nvlink_gbytes_per_s: Optional[float] = None, scaleout_gbytes_per_s: Optional[float] = None,
                 mps_thread_percentage: Optional[float] = None,
                 sm_read_gbytes_per_s: float = SM_READ_GBYTES_PER_S,
                 sm_write_gbytes_per_s: float = SM_WRITE_GBYTES_PER_S) -> SmSizing:
    """The SM count the rule above picks; a pure function (no probing, no logging).

    Args:
        device_sms: SMs of the GPU (or the ``max_sms_per_gpu`` override).
        ranks_sharing_gpu: ranks whose kernels share that GPU (values < 1 mean 1).
        num_ranks: ranks in the EP group (values < 1 mean 1).
        num_experts, topk: routing shape (E, k).
        hidden_bytes: bytes of one token row on the wire (hidden size x element size).
        domain_size: ranks per NVLink domain; None means all ranks share one domain.
        nvlink_gbytes_per_s, scaleout_gbytes_per_s: per-GPU link bandwidths in GB/s; unknown
            (None, <= 0, NaN) where a link carries traffic -> the default and a warning.
        mps_thread_percentage: the rank's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, if set.
        sm_read_gbytes_per_s, sm_write_gbytes_per_s: per-SM copy rates of the kernels.

    Returns:
        SmSizing with ``num_sms`` even (unless the limit is 1), at least ``min(4, limit)``, at most
        the co-residency limit.

    Raises:
        ValueError: when not even one block per rank fits (more ranks share the GPU than it has SMs).
    """
    limit = co_residency_limit(device_sms, ranks_sharing_gpu, mps_thread_percentage)
    if limit < 1:
        raise ValueError(f"SM autosize: {max(1, int(ranks_sharing_gpu))} ranks share a GPU that offers "
                         f"{device_sms} SMs (MPS active-thread percentage {mps_thread_percentage}); not one "
                         f"block per rank can be resident. Run fewer ranks per GPU.")
    warnings: list[str] = []
    ranks = max(1, int(num_ranks))
    local = ranks if domain_size is None else min(max(1, int(domain_size)), ranks)
    domains = math.ceil(ranks / local)
    row = max(0, int(hidden_bytes))
    rows_per_token = expected_destinations(ranks, num_experts, topk)
    nvlink_bytes = row * rows_per_token * (local - 1) / local
    scaleout_bytes = row * expected_destinations(domains, num_experts, topk) * (domains - 1) / domains

    nvlink = float(nvlink_gbytes_per_s) if _usable(nvlink_gbytes_per_s) else DEFAULT_NVLINK_GBYTES_PER_S
    scaleout = float(scaleout_gbytes_per_s) if _usable(scaleout_gbytes_per_s) else DEFAULT_SCALEOUT_GBYTES_PER_S
    if nvlink_bytes > 0 and not _usable(nvlink_gbytes_per_s):
        warnings.append(f"NVLink bandwidth unknown ({nvlink_gbytes_per_s!r}); sizing SMs with the default "
                        f"{DEFAULT_NVLINK_GBYTES_PER_S:g} GB/s")
    if scaleout_bytes > 0 and not _usable(scaleout_gbytes_per_s):
        warnings.append(f"scale-out bandwidth unknown ({scaleout_gbytes_per_s!r}); sizing SMs with the default "
                        f"{DEFAULT_SCALEOUT_GBYTES_PER_S:g} GB/s per GPU")

    # Tokens per second (in units of 1e9) the slowest loaded link allows; inf when no link is loaded.
    token_rate = math.inf
    if nvlink_bytes > 0:
        token_rate = min(token_rate, nvlink / nvlink_bytes)
    if scaleout_bytes > 0:
        token_rate = min(token_rate, scaleout / scaleout_bytes)
    read_rate = SM_READ_GBYTES_PER_S if not _usable(sm_read_gbytes_per_s) else float(sm_read_gbytes_per_s)
    write_rate = SM_WRITE_GBYTES_PER_S if not _usable(sm_write_gbytes_per_s) else float(sm_write_gbytes_per_s)
    if math.isinf(token_rate):
        demand = 0.0  # one rank, no experts or empty rows: nothing crosses a link
    else:
        demand = HEADROOM * max(token_rate * row / read_rate, token_rate * row * rows_per_token / write_rate)
    if math.isnan(demand):  # an overflow in the rates above: the links could use every SM
        demand = float(limit)
    wanted = math.ceil(min(demand, float(limit)))  # clamp before ceil: demand may be inf
    wanted = max(wanted, MIN_SMS)
    wanted += wanted % 2
    ceiling = limit - limit % 2 if limit >= 2 else limit
    num_sms = min(wanted, ceiling)
    if num_sms < MIN_SMS:
        warnings.append(f"only {limit} SMs per rank fit beside the other {max(1, int(ranks_sharing_gpu)) - 1} "
                        f"rank(s) on this GPU: using {num_sms}, below the minimum of {MIN_SMS}")
    return SmSizing(num_sms=num_sms, limit=limit, demand=demand, nvlink_gbytes_per_s=nvlink,
                    scaleout_gbytes_per_s=scaleout, warnings=tuple(warnings))


def mps_thread_percentage(environ: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` as a number, or None when unset or unparsable."""
    environ = os.environ if environ is None else environ
    text = environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def resolve_num_sms(config: Any, *, device_sms: int, ranks_sharing_gpu: int, num_ranks: int, num_experts: int,
                    topk: int, hidden_bytes: int, domain_size: Optional[int] = None,
                    nvlink_gbytes_per_s: Optional[float] = None, scaleout_gbytes_per_s: Optional[float] = None,
                    sm_read_gbytes_per_s: float = SM_READ_GBYTES_PER_S,
                    sm_write_gbytes_per_s: float = SM_WRITE_GBYTES_PER_S,
                    environ: Optional[Mapping[str, str]] = None) -> int:
    """SMs (thread blocks) per rank for the communication kernels: the one call every backend makes.

    Contract:
        - ``config.num_sms > 0``: returned unchanged. The backend still runs its own co-residency
          check on it (an explicit value is the user's, and a wrong one must be refused, not fixed).
        - ``config.num_sms == 0``: ``autosize_sms`` with ``device_sms`` replaced by
          ``config.max_sms_per_gpu`` when that is set, and the MPS active-thread percentage read
          from ``environ`` (default ``os.environ``). Every default that stood in for an unknown
          bandwidth, and a result below 4, is logged as a warning on the ``ep_plugin`` logger.
          The result fits the co-residency limit, so the backend's check passes.
        - Pure apart from that logging: no probing, no collectives, no CUDA calls; pass the
          bandwidths (``ep_plugin.transport.fabric.gpu_link_bandwidths`` reads them from this
          machine, or inject them where the topology is emulated, e.g. several domains on one host).

    Args:
        config: an ``ep_plugin.Config`` (``num_sms``, ``max_sms_per_gpu`` are read).
        device_sms: multiprocessor count of the rank's GPU.
        ranks_sharing_gpu: ranks of the group on that GPU (``transport.placement.ranks_per_gpu``).
        num_ranks: ranks in the EP group.
        num_experts, topk: routing shape.
        hidden_bytes: bytes of one token row as sent (hidden x element size; FP8 rows are smaller).
        domain_size: ranks per NVLink domain (None: one domain).
        nvlink_gbytes_per_s, scaleout_gbytes_per_s: per-GPU GB/s, None when unknown.
        sm_read_gbytes_per_s, sm_write_gbytes_per_s: the kernels' per-SM copy rates.
        environ: where CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is read.

    Returns:
        An int in [1, 1024].

    Raises:
        ValueError: autosizing was asked for and not one block per rank fits on the GPU.
    """
    if config.num_sms > 0:
        return int(config.num_sms)
    sizing = autosize_sms(
        device_sms=config.max_sms_per_gpu or device_sms, ranks_sharing_gpu=ranks_sharing_gpu, num_ranks=num_ranks,
        num_experts=num_experts, topk=topk, hidden_bytes=hidden_bytes, domain_size=domain_size,
        nvlink_gbytes_per_s=nvlink_gbytes_per_s, scaleout_gbytes_per_s=scaleout_gbytes_per_s,
        mps_thread_percentage=mps_thread_percentage(environ),
        sm_read_gbytes_per_s=sm_read_gbytes_per_s, sm_write_gbytes_per_s=sm_write_gbytes_per_s)
    for text in sizing.warnings:
        logger.warning("ep_plugin num_sms autosize: %s", text)
    logger.info("ep_plugin num_sms autosize: %d SMs per rank (demand %.1f, limit %d)", sizing.num_sms,
                sizing.demand, sizing.limit)
    return sizing.num_sms
