"""Where ranks run: which of them share one physical GPU (a collective query)."""

from __future__ import annotations

import socket
from typing import Optional

import torch
import torch.distributed as dist


def gpu_identity(device: torch.device) -> str:
    """A string equal on two ranks exactly when they use the same physical GPU."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return f"{socket.gethostname()}/{uuid if uuid is not None else props.pci_bus_id}"


def ranks_per_gpu(group: dist.ProcessGroup, device: torch.device) -> int:
    """The largest number of ranks of ``group`` that share one GPU (a collective call)."""
    identities: list[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(identities, gpu_identity(device), group=group)
    return max(identities.count(identity) for identity in identities)
