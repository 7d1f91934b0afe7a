"""NVLink-domain transport: one CUDA IPC communication buffer per rank.

Each rank cudaMallocs one buffer (sized for the worst case: ``max_tokens`` packets from every
source, see ``csrc/include/ep/buffer.h`` for its regions), exchanges its IPC handle once over the
process group (as bytes, so gloo groups work), opens every peer's buffer and uploads the table of
peer pointers to the device. Works with one rank per GPU and with several ranks (processes) on
one GPU. Kernels then exchange counts and data through these buffers with no host collective.

The buffer also owns the device-resident op sequence number, the sticky abort flag and the
mapped pinned report that a timed-out device wait fills in; ``raise_if_timed_out`` turns that
report into ``EPTimeoutError`` (a host read of mapped memory: no CUDA call, no sync).
"""

from __future__ import annotations

import socket
from typing import Optional

import torch
import torch.distributed as dist

from .. import _cuda
from ..errors import EPError, EPTimeoutError


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


class IpcBuffer:
    """One rank's communication buffer with every peer's buffer opened (a collective constructor)."""

    def __init__(self, group: dist.ProcessGroup, *, device: torch.device, max_tokens: int, hidden_size: int,
                 num_local_experts: int, max_blocks: int, timeout_s: float,
                 phase_names: Optional[dict[int, str]] = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.device = device
        self.phase_names = phase_names or {}
        C = _cuda.extension()
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._buffer = C.Buffer(index, self.rank, self.num_ranks, max_tokens, hidden_size, num_local_experts,
                                max_blocks, float(timeout_s))
        handles: list[Optional[bytes]] = [None] * self.num_ranks
        dist.all_gather_object(handles, self._buffer.ipc_handle(), group=group)
        self._buffer.open_peers(handles)
        # No rank may write into a peer before that peer opened everything (and zeroed its flags).
        dist.barrier(group=group)
        self._destroyed = False

    @property
    def raw(self):
        """The ``ep_plugin._C.Buffer`` that the launchers take."""
        if self._destroyed:
            raise EPError("this communication buffer was destroyed")
        return self._buffer

    @property
    def total_bytes(self) -> int:
        return self._buffer.total_bytes

    def host_total_rows(self) -> int:
        """Exact dispatch output size, written by the notify kernel (read after an event wait)."""
        return int(self._buffer.host_total_rows())

    def timeout_message(self) -> Optional[str]:
        report = self._buffer.timeout_report()
        if report[0] == 0:
            return None
        _, rank, phase, peer, expected, seen, waited_ns = report
        phase_name = self.phase_names.get(phase, f"phase {phase}")
        return (f"ep_plugin hybrid: rank {rank} timed out in {phase_name} waiting for peer rank {peer} "
                f"(flag expected >= {expected}, saw {seen}, waited {waited_ns / 1e9:.2f} s); "
                f"the communication buffer is unusable now")

    def raise_if_timed_out(self) -> None:
        message = self.timeout_message()
        if message is not None:
            raise EPTimeoutError(message)

    def wait_event(self, event: torch.cuda.Event, timeout_s: float, what: str) -> None:
        """Host spin-wait on ``event`` with a timeout; raises the device report if there is one."""
        import time

        deadline = time.monotonic() + timeout_s
        spins = 0
        while not event.query():
            spins += 1
            if spins > 1000:
                time.sleep(5e-5)
            if time.monotonic() > deadline:
                self.raise_if_timed_out()
                raise EPTimeoutError(f"ep_plugin hybrid: rank {self.rank}: host wait for {what} ran past "
                                     f"{timeout_s:.1f} s and the device reported nothing")
        self.raise_if_timed_out()

    def destroy(self) -> None:
        """Collective: wait until no peer can still write here, then free everything."""
        if self._destroyed:
            return
        torch.cuda.synchronize(self.device)  # our writes into peers are complete ...
        dist.barrier(group=self.group)  # ... and so are everyone's into ours
        self._buffer.destroy()
        self._destroyed = True
