"""Symmetric buffers within one NVLink domain, and the sync state every op of a backend uses.

Each rank cudaMallocs one buffer: the transport's sync header (arrival flags, op fingerprints,
count-exchange slots) followed by regions that one backend lays out itself. The constructor
exchanges the buffer handles once over the process group (as bytes, so gloo groups work), opens
every peer's buffer and uploads the table of peer pointers to the device. Works with one rank per
GPU and with several ranks (processes) on one GPU. Kernels then exchange counts and data through
these buffers with no host collective.

The buffer also owns the device-resident op sequence number, the sticky abort flag and a report
in mapped pinned memory that a failed device wait fills in (a timeout, or ranks whose op
fingerprints differ); ``raise_if_failed`` turns it into ``EPTimeoutError`` / ``EPError`` (a host
read of mapped memory: no CUDA call, no sync). The report's mailbox carries the values blocking
mode reads on the host (exact output sizes), after an event wait with a timeout. The peers'
process identities travel with the handles, and ``liveness.WATCH`` marks a peer whose process is
gone in the report, so that a wait for it stops at once ("rank 3 exited") instead of timing out.
"""

from __future__ import annotations

import gc
import logging
import time
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .. import _cuda, streams
from ..agreement import mismatch_message
from ..errors import EPError, EPTimeoutError, add_note
from ..host_collectives import HostCollectives
from .liveness import WATCH, own_identity

logger = logging.getLogger(__name__)


class SymmetricBuffer:
    """One rank's buffer with every peer's buffer opened (a collective constructor).

    Args:
        group: the ranks of one NVLink domain.
        device: this rank's GPU.
        region_bytes: bytes of the backend's regions after the sync header.
        count_words: int32 words each rank sends every peer in a count exchange (0: none).
        timeout_s: how long any device wait may spin before it reports.
        backend: the backend's name, for messages.
        phase_names: phase number -> text, for timeout messages.
        peer_watch_s: > 0 watches the peers' processes (``liveness``; the seconds between /proc looks where
            there is no pidfd); 0 = no watch.
        on_host: the handle exchange and barriers of an NCCL group go over its gloo twin (``HostCollectives``).
    """

    def __init__(self, group: dist.ProcessGroup, *, device: torch.device, region_bytes: int, count_words: int,
                 timeout_s: float, backend: str, phase_names: Optional[dict[int, str]] = None,
                 peer_watch_s: float = 0.0, on_host: bool = True) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.device = device
        self.backend = backend
        self.phase_names = phase_names or {}
        self.timeout_s = float(timeout_s)
        self._C = _cuda.extension()
        index = device.index if device.index is not None else torch.cuda.current_device()
        # An allocation that fails here (out of memory on this rank alone, as a grow mid-training can meet), or a
        # CUDA IPC step, is told to the peers in the exchanges below: every rank raises at once, none waits for
        # this one until its timeout.
        handle, failure, remedy = None, None, None
        try:
            self._buffer = self._C.SymmetricBuffer(index, self.rank, self.num_ranks, int(region_bytes),
                                                   int(count_words), float(timeout_s))
        except RuntimeError as error:
            self._buffer, failure, remedy = None, error, "free memory on its GPU or lower max_tokens_per_rank"
        else:
            try:
                handle = self._buffer.export_handle()
            except RuntimeError as error:  # CUDA IPC refused here (a container, say): memory is not the problem
                failure, remedy = error, _ALLOW_IPC  # the buffer is freed with the refusal (_refuse_together)
        self._region_tensors: dict[tuple, torch.Tensor] = {}  # see region_tensor
        # The memory objects of every tensor region_tensor made: one alive after destroy() dropped its own
        # tensors means a tensor over this memory lives on (a combine_input view, in-place rows, views of them).
        self._region_memories: weakref.WeakSet = weakref.WeakSet()
        self.kept_for_views = False  # destroy() left the memory allocated: a tensor over it was still alive
        # Dropped without destroy() (garbage collected while the process runs, or left behind by an exchange
        # below that gave up): a peer may still map, read or write this memory, so it is kept, not freed
        # (``_kept_when_dropped``); at exit the process's end frees it. Only a refusal every rank makes together
        # (``_refuse_together``) or destroy's barrier frees it. Without peers (a group of one) the extension's
        # destructor frees it.
        self._dropped = weakref.finalize(self, _kept_when_dropped, self._buffer, backend, self.rank)
        self._dropped.atexit = False
        if self._buffer is None or self.num_ranks == 1:
            self._dropped.detach()
        here = own_identity()
        said = _in_words(failure, remedy)
        try:
            # Timed (a rank that failed alone, one that never builds this backend, say, is named instead of
            # waited for).
            self._collectives = HostCollectives(group, owner=f"ep_plugin {backend}", timeout_s=timeout_s,
                                                label="buffer", device=torch.device("cuda", index), on_host=on_host)
            gathered = self._collectives.all_gather_object((handle, here, said), where="opening the peers' buffers")
        except Exception as error:  # noqa: BLE001 - re-raised; this rank's own failure first, if it has one
            if failure is None:
                raise
            add_note(failure, f"ep_plugin {backend}: telling the peers about it failed too ({type(error).__name__}: "
                              f"{error}), so they may wait for this rank until their timeout")
            if self._buffer is not None:  # its handle was never exported: no peer maps it, it can go
                self._dropped.detach()
                kept = self._free_unused_buffer()
                if kept:
                    add_note(failure, kept)
            try:
                raise failure from None
            finally:  # as below: no cycle through this frame
                failure = None
        try:
            self._refuse_together([why for _, _, why in gathered], failure, remedy,
                                  "could not make or share its own buffer, so no rank opens the peers' buffers")
        finally:  # raised, the traceback holds this frame: holding the error too would make a cycle
            failure = None
        try:
            self._buffer.open_peers([handle for handle, _, _ in gathered])
        except RuntimeError as error:  # cudaIpcOpenMemHandle refused (a container without a shared IPC namespace)
            failure = error
        # No rank may write into a peer before that peer opened everything (its flags start zeroed): this gather
        # waits for every rank, and tells each whether the others could open theirs.
        opened = self._collectives.all_gather_object(_in_words(failure, _ALLOW_IPC),
                                                     where="opening the peers' buffers (every rank opened them)")
        try:
            if any(opened):  # refused below, the buffer freed: as in destroy, every importer closes first (a
                # close that failed too changes nothing there: the refusal says why no rank goes on)
                # No kernel ran on the mappings: no device-wide wait (on whatever else this GPU runs) first.
                self._close_peers_together("opening the peers' buffers (refused: the mappings closed)",
                                           synchronize=False)
            self._refuse_together(opened, failure, _ALLOW_IPC,
                                  "could not open its peers' buffers through CUDA IPC, so no rank uses them")
        finally:  # as above
            failure = None
        self._destroyed = False
        self.peer_processes = {rank: identity for rank, (_, identity, _) in enumerate(gathered) if rank != self.rank}
        WATCH.watch(self, {rank: identity for rank, identity in self.peer_processes.items()
                           if identity.watchable_from(here)}, peer_watch_s)

    def _refuse_together(self, outcomes: list, failure: Optional[Exception], remedy: str, what: str) -> None:
        """After an exchange of each rank's failure in words (None: it went well), raise on every rank where any
        rank failed, with its buffer freed: this rank's own ``failure`` (its ``remedy`` as a note), the others
        EPError naming the failed ranks and saying that ``what``. The caller lets go of ``failure`` in a
        ``finally``: the traceback holds its frame too."""
        failed = [f"{self._collectives.peer_name(rank)}: {why}" for rank, why in enumerate(outcomes) if why]
        if not failed:
            return
        self._dropped.detach()  # every rank refuses together: no peer maps this memory (or it closed first)
        kept = self._free_unused_buffer()
        self._collectives.release()
        if failure is not None:
            add_note(failure, f"ep_plugin {self.backend}: {remedy}; every rank of the group was told and raises too")
            if kept:
                add_note(failure, kept)
            try:
                raise failure
            finally:  # the traceback holds this frame: no cycle keeping it (and self) to a full collection
                failure = None
        raise EPError(f"ep_plugin {self.backend}: another rank {what} ({'; '.join(failed)}). Build again on every "
                      f"rank once that is mended." + (f" ({kept})" if kept else ""))

    def _free_unused_buffer(self) -> str:
        """Frees the buffer of a refused build (no kernel of ours ran on it). The extension's free begins with a
        device-wide wait, without a timeout and with the GIL held, and a kernel of another library may still run
        on this GPU (an NCCL collective waiting for a peer): that wait is made here first, timed. Returns '' once
        freed, or, past the timeout, why the memory stays allocated (a leak, as in destroy) instead of a hang."""
        buffer, self._buffer = self._buffer, None
        if buffer is None:
            return ""
        try:
            self.synchronize("freeing the refused buffer", raise_report=False)  # as destroy's wait
        except (EPTimeoutError, RuntimeError) as error:  # late, or a CUDA error of the device
            buffer.abandon()
            return f"its buffer stays allocated: {error}"
        try:
            buffer.destroy()  # the device-wide wait it begins with finds nothing left to wait for
        except RuntimeError as error:  # reported with the refusal, which stays the error raised
            return f"freeing its buffer failed: {error}"
        return ""

    def _close_peers_together(self, where: str, *, synchronize: bool = True) -> Optional[RuntimeError]:
        """CUDA IPC: every rank closes its mappings of the peers' buffers, then meets them, so that no exporter
        frees memory another rank still maps. A rank whose close failed meets them all the same: its error is
        returned, for the caller to raise. ``synchronize=False``: no device-wide wait before (nothing ran)."""
        closing_failed = None
        try:
            self._buffer.close_peers(synchronize=synchronize)
        except RuntimeError as error:
            closing_failed = error
        self._collectives.barrier(where=where)
        return closing_failed

    def mark_peer_exited(self, rank: int) -> None:
        """``liveness.WATCH`` found the process of ``rank`` gone: device waits for it stop."""
        self._buffer.mark_peer_exited(rank)

    @property
    def raw(self):
        """The ``ep_plugin._C.SymmetricBuffer`` that the launchers take."""
        if self._destroyed:
            raise EPError(f"ep_plugin {self.backend}: this communication buffer was destroyed")
        return self._buffer

    @property
    def total_bytes(self) -> int:
        return self._buffer.total_bytes

    def region_tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor over this rank's backend regions at byte ``offset`` (no copy). It keeps the
        extension's buffer object alive, but its memory is valid only until ``destroy()``. Tensors
        of one region alias one another (and share torch's version counter), but autograd sees no
        link between them: a write that autograd records (``rows.copy_(y)`` with ``y`` requiring
        grad) stays on that tensor and does not attach its history to every later one."""
        # torch.as_tensor over __cuda_array_interface__ costs ~10 µs, on every in-place op: keep one
        # tensor per (offset, row shape, dtype), as tall as the tallest asked for, and hand out a
        # row slice of it (a new tensor object over the same memory, ~1.5 µs).
        address = self.raw.region_address + offset  # (raw raises once the buffer is destroyed)
        rows, row_shape = shape[0], tuple(shape[1:])
        key = (offset, row_shape, dtype)
        whole = self._region_tensors.get(key)
        if whole is None or whole.shape[0] < rows:
            # The tensor keeps the extension's buffer object alive (not this wrapper, which holds the
            # tensor: that cycle would run through torch's storage, where the collector cannot see).
            memory = _DeviceMemory(address, (rows, *row_shape), _TYPESTRS[dtype], owner=self._buffer)
            self._region_memories.add(memory)
            # Kept across ops: made under torch.inference_mode() it would be an inference tensor, and so would
            # every later view of it (combine_input's, in-place dispatch rows), outside that mode too.
            with torch.inference_mode(False):
                whole = torch.as_tensor(memory, device=self.device)
                whole = whole.view(dtype) if dtype == torch.bfloat16 else whole
            self._region_tensors[key] = whole
        return whole[:rows].detach()  # detached: not an autograd view of the cached tensor

    def mailbox(self, first: int, count: int = 1) -> list[int]:
        """Values a kernel published for the host (read after an event wait on that kernel)."""
        return self._buffer.mailbox(first, count)

    def failure_message(self) -> Optional[tuple[type, str]]:
        """(exception type, message) of the first device failure on this rank, or None."""
        report = self._buffer.report()
        kind = report[0]
        if kind == 0:
            return None
        _, rank, phase, peer, expected, seen, waited_ns = report
        phase_name = self.phase_names.get(phase, f"phase {phase}")
        # The ranks as the group numbers them, with their global rank in a subgroup (Megatron's EP group): the
        # log to open is the global rank's.
        me, them = self._rank_name(rank), self._rank_name(peer)
        if kind == self._C.REPORT_MISMATCH:
            mismatch = mismatch_message(self.backend, rank, peer, expected, seen, self._rank_name)
            return EPError, f"{mismatch} (seen by {me} in {phase_name}; this backend is unusable now: build a new one)"
        if kind == self._C.REPORT_PEER_EXITED:
            identity = self.peer_processes.get(peer)
            pid = f" (pid {identity.pid})" if identity is not None else ""
            return EPError, (f"ep_plugin {self.backend}: {me} stopped waiting for peer {them} in "
                             f"{phase_name}: the process of {them}{pid} has exited (its own log says why); "
                             f"the communication buffer is unusable now")
        return EPTimeoutError, (f"ep_plugin {self.backend}: {me} timed out in {phase_name} waiting for peer "
                                f"{them} (flag expected >= {expected}, saw {seen}, waited {waited_ns / 1e9:.2f} "
                                f"s); the communication buffer is unusable now")

    def _rank_name(self, rank: int) -> str:
        """'rank 3', or 'rank 3 (global rank 11)' in a subgroup."""
        collectives = getattr(self, "_collectives", None)
        return collectives.peer_name(rank) if collectives is not None else f"rank {rank}"

    def raise_if_failed(self) -> None:
        if not self._buffer.failed():  # every op asks: one bool, not the report's list
            return
        failure = self.failure_message()
        if failure is not None:
            error_type, message = failure
            raise error_type(message)

    def wait_event(self, event: torch.cuda.Event, timeout_s: float, what: str) -> None:
        """Host spin-wait on ``event`` with a timeout; raises the device report if there is one."""
        deadline = time.monotonic() + timeout_s
        spins = 0
        while not event.query():
            spins += 1
            if spins > 1000:
                time.sleep(5e-5)
            if time.monotonic() > deadline:
                self.raise_if_failed()
                raise EPTimeoutError(f"ep_plugin {self.backend}: {self._rank_name(self.rank)}: host wait for {what} "
                                     f"ran past {timeout_s:.1f} s and the device reported nothing")
        self.raise_if_failed()

    def synchronize(self, what: str, *, raise_report: bool = True) -> None:
        """Wait, with the buffer's timeout, until the device ran everything queued so far (every stream);
        then raise the device report, if there is one and ``raise_report``."""
        # A margin past the kernels' own timeout (up to 5 s, as for the op waits): a kernel that began its wait
        # just after this one can still write its report, which names the peer, before the host gives up.
        streams.wait_for_device(self.device, self.timeout_s + min(5.0, self.timeout_s),
                                f"ep_plugin {self.backend}: {self._rank_name(self.rank)}: {what}: waiting for the "
                                "device",
                                before_timeout=self.raise_if_failed if raise_report else None)
        if raise_report:
            self.raise_if_failed()

    def destroy(self, *, keep_memory: bool = False) -> None:
        """Collective: wait until no peer can still write here, then free everything. Where that wait fails
        (a peer gone or late, this GPU still busy), it raises, and the buffer counts as destroyed all the
        same, with its memory left allocated and mapped: a peer or a kernel may still write there, and freed
        memory would be handed to other allocations (a leak, not a corruption). ``keep_memory``: the same
        after a wait that succeeded (a tensor of the combine-input arena outlives the backend)."""
        if self._destroyed:
            return
        self._dropped.detach()  # destroyed by name: what follows decides about the memory
        try:
            # Our writes into peers are complete (a failed backend is destroyed too: its report is not raised)
            self.synchronize("destroy", raise_report=False)
            self._collectives.barrier(where="destroy")  # ... and so are everyone's into ours
            # Also a rank that keeps its own memory closes its mappings (nothing it keeps maps a peer's); one whose
            # close failed raises after meeting its peers (its own memory stays, as above).
            closing_failed = self._close_peers_together("destroy (peers' buffers closed)")
            if closing_failed is not None:
                raise closing_failed
        except BaseException:
            # Not freed, not even by its destructor at exit (whose device-wide synchronize would wait on the
            # kernel that never finished, with the process on its way out).
            self._buffer.abandon()
            raise
        finally:
            self._destroyed = True
            self._collectives.release()
            WATCH.unwatch(self)  # before the report's memory goes
        self._region_tensors.clear()
        if self._region_memories:
            gc.collect()  # a view held only by a dropped autograd graph's cycle is gone now
        if self._region_memories:  # freed, the memory would be handed to other allocations under that tensor
            self.kept_for_views = True
            logger.warning("ep_plugin %s: rank %d: a tensor over the backend's buffer (a combine_input view, "
                           "in-place dispatch rows, or a view of them) outlived destroy(): the buffer "
                           "(%.2f GiB) stays allocated until the process ends", self.backend, self.rank,
                           self._buffer.total_bytes / 2**30)
        if keep_memory or self.kept_for_views:
            self._buffer.abandon()
        else:
            self._buffer.destroy()


def _kept_when_dropped(buffer, backend: str, rank: int) -> None:
    """A ``SymmetricBuffer`` garbage-collected without ``destroy()``: its memory is never freed (``abandon``), since
    only destroy's barrier knows that no peer still reads or writes there (a slower peer's op, or a peer
    pulling rows from it), and freed memory would fault in the peer's kernel or be handed to another
    allocation."""
    buffer.abandon()
    logger.warning("ep_plugin %s: a backend of rank %d was let go without destroy() (garbage-collected, or left "
                   "behind by a build that failed): its communication buffer (%.2f GiB) stays allocated until the "
                   "process ends, as a peer may still use it. Call destroy() on every rank before letting a "
                   "backend go (Megatron: clear_backend_cache())",
                   backend, rank, buffer.total_bytes / 2**30)


# What helps a rank that CUDA IPC failed (exporting its buffer's handle, or opening a peer's).
_ALLOW_IPC = ("allow CUDA IPC between the ranks' processes (containers: one IPC namespace, docker's --ipc=host), "
              "which every rank of an NVLink domain needs")


def _in_words(failure: Optional[Exception], remedy: Optional[str]) -> Optional[str]:
    """What a rank tells its peers in an exchange of outcomes: None when its step went well."""
    return None if failure is None else f"{type(failure).__name__}: {failure} ({remedy})"


# bf16 has no typestr: it travels as int16 and is reinterpreted on the torch side.
_TYPESTRS = {torch.bfloat16: "<i2", torch.float32: "<f4", torch.int32: "<i4", torch.int64: "<i8", torch.uint8: "|u1"}


class _DeviceMemory:
    """Device memory described by ``__cuda_array_interface__`` (how torch wraps it without a copy);
    torch keeps this object, and with it ``owner``, alive as long as the tensor."""

    def __init__(self, address: int, shape: tuple[int, ...], typestr: str, owner) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"data": (address, False), "shape": tuple(shape), "typestr": typestr,
                                         "version": 3, "strides": None, "stream": None}
