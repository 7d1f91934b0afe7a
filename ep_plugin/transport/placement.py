"""Where ranks run: which of them share one physical GPU (a collective query)."""

from __future__ import annotations

import socket

import torch

from ..host_collectives import HostCollectives


def gpu_identity(device: torch.device) -> str:
    """A string equal on two ranks exactly when they use the same physical GPU."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return f"{socket.gethostname()}/{uuid if uuid is not None else props.pci_bus_id}"


def ranks_per_gpu(collectives: HostCollectives, device: torch.device) -> int:
    """The largest number of ranks of the collectives' group that share one GPU (a collective call,
    timed: a rank that does not arrive makes the others raise EPTimeoutError naming it)."""
    identities = collectives.all_gather_object(gpu_identity(device), where="placement (ranks sharing a GPU)")
    return max(identities.count(identity) for identity in identities)
