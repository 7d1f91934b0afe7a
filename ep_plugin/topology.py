"""Who is in my NVLink domain (scale-up) and on my rail (scale-out).

Ranks are numbered in contiguous blocks per domain::

    rank = domain_index * domain_size + local_index

The *domain* of a rank is the ``domain_size`` ranks that can map each other's GPU memory (the
compiled backends move data between them with CUDA IPC); its *rail* is the ranks with the same
``local_index`` in every domain (one per domain). Traffic between domains goes over the rails,
through an engine torch.distributed already has (``transport.scaleout``).

Detection (``detect_topology``, a collective) looks at placement: on CUDA, the longest runs of
consecutive ranks on one host whose GPUs are the same or peer-accessible; on CPU there is no memory
to map, so every rank is its own domain. ``Config.scaleup_size`` (``EP_PLUGIN_SCALEUP_SIZE``) forces
a domain size: on CUDA it must divide the detected size (domains can only be made smaller); on CPU
any divisor of the world is taken (the reference backend runs over any group), which is how the
hierarchical path is tested on one host. Every rank must arrive at the same topology: the facts are
gathered once, every rank computes the result from all of them, and a rank whose own forced size
differs makes every rank raise ``EPError`` (never a hang in a later collective).
"""

from __future__ import annotations

import logging
import math
import socket
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .config import Config
from .errors import EPError
from .host_collectives import HostCollectives
from .logs import warn_once

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """Domains and rails of a process group of ``world_size`` ranks, seen from ``rank``.

    world_size: ranks of the group; domain_size: ranks per NVLink domain (divides world_size).
    rank: this rank in the group. forced: the domain size was set by the user (config / argument),
    not detected; detected_domain_size: what placement allowed (0 when not looked at); gpu_of_rank: see below.
    """

    world_size: int
    domain_size: int
    rank: int = 0
    forced: bool = False
    detected_domain_size: int = 0
    # Every rank's physical GPU (``transport.placement.gpu_identity``; None on CPU), when detected: the
    # scale-out engine picks NCCL only for rails whose ranks have GPUs of their own.
    gpu_of_rank: tuple = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.domain_size < 1:
            raise ValueError(f"Topology needs world_size >= 1 and domain_size >= 1, got {self.world_size} and "
                             f"{self.domain_size}")
        if self.world_size % self.domain_size:
            raise ValueError(f"domain size {self.domain_size} does not divide the {self.world_size} ranks "
                             f"(EP_PLUGIN_SCALEUP_SIZE must divide the world size)")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside [0, {self.world_size})")

    @classmethod
    def flat(cls, world_size: int, rank: int = 0) -> "Topology":
        """One domain holding every rank (no scale-out)."""
        return cls(world_size, world_size, rank)

    @property
    def num_domains(self) -> int:
        return self.world_size // self.domain_size

    @property
    def domain_index(self) -> int:
        return self.rank // self.domain_size

    @property
    def local_index(self) -> int:
        return self.rank % self.domain_size

    @property
    def is_hierarchical(self) -> bool:
        """More than one domain: traffic between them goes over the rails."""
        return self.num_domains > 1

    def domain_ranks(self, domain_index: Optional[int] = None) -> list[int]:
        """Group ranks of one domain (default: this rank's), in local-index order."""
        d = self.domain_index if domain_index is None else domain_index
        return list(range(d * self.domain_size, (d + 1) * self.domain_size))

    def rail_ranks(self, local_index: Optional[int] = None) -> list[int]:
        """Group ranks of one rail (default: this rank's), in domain order."""
        local = self.local_index if local_index is None else local_index
        return [d * self.domain_size + local for d in range(self.num_domains)]

    def describe(self) -> str:
        return f"{self.num_domains}x{self.domain_size} (domains x ranks per domain)"


def _placement_facts(device: torch.device) -> dict:
    """What this rank knows about where it runs (compared across ranks by ``detect_topology``)."""
    facts: dict = {"host": socket.gethostname(), "gpu": None, "peers": (), "visible_gpus": 0}
    if device.type == "cuda":
        from .transport.placement import gpu_identity

        index = device.index if device.index is not None else torch.cuda.current_device()
        facts["gpu"] = gpu_identity(torch.device("cuda", index))
        # Peer access by other GPUs' identities, so that ranks with different visible devices compare.
        peers = []
        for other in range(torch.cuda.device_count()):
            if other != index and torch.cuda.can_device_access_peer(index, other):
                peers.append(gpu_identity(torch.device("cuda", other)))
        facts["peers"] = tuple(peers)
        facts["visible_gpus"] = torch.cuda.device_count()
    return facts


def isolated_gpus(placements: list[dict]) -> dict[str, list[int]]:
    """Hosts whose ranks each see only their own GPU (CUDA_VISIBLE_DEVICES of one device per process, as
    with Slurm's --gpus-per-task=1) while several GPUs there have ranks: host -> those ranks.

    Peer access between their GPUs cannot be checked from such a process (the peer is not visible), so
    detection makes each rank an NVLink domain of its own, and every token between them goes through the
    scale-out path."""
    ranks: dict[str, list[int]] = {}
    for q, facts in enumerate(placements):
        if facts["gpu"] is not None and facts.get("visible_gpus") == 1:
            ranks.setdefault(facts["host"], []).append(q)
    return {host: qs for host, qs in ranks.items() if len({placements[q]["gpu"] for q in qs}) > 1}


def mappable_domain_size(placements: list[dict]) -> int:
    """The largest domain size such that every block of consecutive ranks can map each other's memory.

    Args: placements: every rank's ``_placement_facts`` (host, GPU identity or None on CPU, peers).
    Returns: the size of the longest runs of consecutive ranks on one host whose GPUs are the same or
    peer-accessible, reduced to the gcd of the runs when they differ (so that the domains tile the world);
    1 on CPU.
    """
    def can_map(a: dict, b: dict) -> bool:
        if a["gpu"] is None or b["gpu"] is None or a["host"] != b["host"]:
            return False
        # Both ways: each maps the other's memory, and a process sees only its own visible GPUs' peers.
        return a["gpu"] == b["gpu"] or (b["gpu"] in a["peers"] and a["gpu"] in b["peers"])

    runs, start = [], 0
    for q in range(1, len(placements) + 1):
        if q == len(placements) or not all(can_map(placements[p], placements[q]) for p in range(start, q)):
            runs.append(q - start)
            start = q
    return math.gcd(*runs)


def detect_topology(group: Optional[dist.ProcessGroup], device: torch.device, *,
                    config: Optional[Config] = None, scaleup_size: Optional[int] = None,
                    purpose: str = "detecting the topology", refusal: Optional[str] = None) -> Topology:
    """Detect and validate this group's topology (a collective: call it on every rank, in the same order).

    Args:
        group: the expert-parallel process group (default: the world).
        device: this rank's device (CPU: every rank is its own domain unless forced).
        config: for ``scaleup_size`` and ``timeout_s`` (default ``Config.from_env()``).
        scaleup_size: overrides ``config.scaleup_size`` (0 = detect).
        purpose: what the caller is doing, for timeout messages ("building the reference backend").
        refusal: why this rank will not go on, in words (a backend's argument that is wrong here alone): it
            still joins the exchange, which tells its peers, so that every rank raises at once instead of the
            others waiting for it in their next collective until the timeout. The caller raises its own error
            after this returns (a flat placeholder topology, then).
    Returns: the Topology, equal on every rank (up to ``rank``).
    Raises: ValueError naming the rank and its refusal where another rank refused; this rank's own error where
        its device cannot be placed (a GPU this process cannot see);
        EPError on every rank when the ranks forced different sizes or a forced size does not fit;
        EPTimeoutError naming the late rank when one does not arrive within ``timeout_s``.
    """
    config = config if config is not None else Config.from_env()
    forced = config.scaleup_size if scaleup_size is None else scaleup_size
    group = group if group is not None else dist.group.WORLD
    comm = HostCollectives(group, owner="ep_plugin topology", timeout_s=config.timeout_s, label="topology",
                           device=device, on_host=config.gloo_host_words)
    # Where the size came from, for the messages: an argument (a backend's topology=) or the config.
    source = "the topology= argument" if scaleup_size is not None else "EP_PLUGIN_SCALEUP_SIZE / config.scaleup_size"
    unplaced = None
    try:
        placement = _placement_facts(torch.device(device))
    except Exception as error:  # noqa: BLE001 - a GPU this process cannot see, say: told to the peers, raised below
        unplaced, placement = error, _placement_facts(torch.device("cpu"))
    said = refusal or (None if unplaced is None else f"{type(unplaced).__name__}: {unplaced}")
    mine = {"scaleup_size": int(forced), "source": source, **placement, "refused": said}
    everyone = comm.all_gather_object(mine, where=f"{purpose} (topology)")
    world, rank = len(everyone), comm.rank
    if unplaced is not None and refusal is None:
        try:
            raise unplaced
        finally:  # the traceback holds this frame: holding the error too would keep both to a full collection
            unplaced = None
    if said is not None:  # the caller raises why
        return Topology.flat(world, rank)
    refused = [f"{comm.peer_name(q)}: {facts['refused']}" for q, facts in enumerate(everyone) if facts["refused"]]
    if refused:
        raise ValueError(f"ep_plugin: {purpose} was refused on another rank, so no rank goes on: {'; '.join(refused)}")

    forced_sizes = [facts["scaleup_size"] for facts in everyone]
    if any(size != forced_sizes[0] for size in forced_sizes):
        per_rank = ", ".join(f"rank {q}: {facts['scaleup_size']} ({facts['source']})"
                             for q, facts in enumerate(everyone))
        raise EPError(f"ep_plugin topology: ranks disagree on the forced domain size (0 = detect): {per_rank}. "
                      f"Force it alike on every rank.")
    detected = mappable_domain_size(everyone)
    for host, ranks in isolated_gpus(everyone).items():
        if rank == 0:  # once per host and process: every backend build runs this
            warn_once(logger, ("isolated GPUs", host),
                      "ep_plugin topology: ranks %s on %s each see only their own GPU, so peer access between them "
                      "cannot be checked: each is an NVLink domain of its own and their tokens go through the "
                      "scale-out path (NCCL). Give every process the node's GPUs (no per-task CUDA_VISIBLE_DEVICES) "
                      "and pick its own with torch.cuda.set_device(local_rank).", ranks, host)
    gpus = tuple(facts["gpu"] for facts in everyone)
    size = forced_sizes[0]
    if size == 0:
        return Topology(world, detected, rank, forced=False, detected_domain_size=detected, gpu_of_rank=gpus)
    if world % size:
        raise EPError(f"ep_plugin topology: domain size {size} ({source}) does not divide the {world} ranks")
    on_gpu = everyone[0]["gpu"] is not None
    if on_gpu and detected % size:
        raise EPError(f"ep_plugin topology: domain size {size} ({source}) does not divide the detected NVLink "
                      f"domain size {detected} (ranks that can map each other's memory); domains can only be made "
                      f"smaller")
    return Topology(world, size, rank, forced=True, detected_domain_size=detected, gpu_of_rank=gpus)


def resolve_topology(topology: Optional[Topology], group: Optional[dist.ProcessGroup], device: torch.device,
                     config: Config, *, purpose: str = "detecting the topology",
                     refusal: Optional[str] = None) -> Topology:
    """The topology a backend is built on: detected (``topology=None``), or the given one's domain size,
    validated like a forced size (a collective either way: every rank must pass the same). A ``topology``
    that is wrong here is raised after the exchange, which tells every rank; ``refusal`` as in
    ``detect_topology`` (the caller raises it)."""
    if topology is None:
        return detect_topology(group, device, config=config, purpose=purpose, refusal=refusal)
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    wrong = None
    if not isinstance(topology, Topology):
        wrong = TypeError(f"topology must be an ep_plugin.topology.Topology, got {type(topology).__name__}")
    elif topology.world_size != world:
        wrong = ValueError(f"topology is for {topology.world_size} ranks, the process group has {world}")
    said = refusal or (None if wrong is None else f"{type(wrong).__name__}: {wrong}")
    resolved = detect_topology(group, device, config=config, scaleup_size=None if said else topology.domain_size,
                               purpose=purpose, refusal=said)
    if wrong is not None and refusal is None:
        try:
            raise wrong
        finally:  # as in detect_topology: no cycle through this frame
            wrong = None
    return resolved
