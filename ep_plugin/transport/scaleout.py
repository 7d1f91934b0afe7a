"""Scale-out: the rails between NVLink domains, on an engine torch.distributed already has.

``ScaleOut`` owns, for one process group and one ``Topology``:

- one process group per domain and one per rail, made with ``dist.new_group`` by every rank of the
  group in the same order (domains 0..D-1, then rails 0..S-1) with local synchronization: no rank
  outside the group takes part, so the group may be a subgroup of the world (Megatron's EP group is).
  Groups are made once per (group, domain size, engine) and reused by later backends of that shape.
- the rail engine: NCCL where the ranks of each rail have GPUs of their own (one rank per GPU along
  the rail), gloo where some share a GPU (NCCL refuses two ranks on one GPU) or on CPU. The domain
  groups use the engine of the parent group.
- the rail's words (both modes' agreement words and blocking mode's row counts, which the host writes and
  reads): CPU tensors, on the rail group itself where its engine is gloo, else on a gloo twin of it
  (``HostCollectives``' ``on_host``; ``Config.gloo_host_words``). A peer that stops in a word exchange then
  leaves no NCCL collective queued behind the timeout, and backends of both modes meet there in rows of
  one size.
- the rail collectives, timed like every host wait (``HostCollectives``): a late or missing peer gives
  ``EPTimeoutError`` naming the level (``rail <l>``), the op and phase, and the peer (its rank on the
  rail and its global rank); an engine failure gives ``EPError`` with the engine's message.

What the engines can move (checked on torch 2.13, CPU): gloo's ``all_to_all_single`` takes CPU tensors
of the usual dtypes including uint8 / bool / bfloat16 / int64, and empty splits, but not
float8_e4m3fn ("Invalid scalar type"). So every rail payload travels as uint8 rows (``RowPacker``: the
fields of one token side by side as bytes), which also makes it one collective per op instead of one
per field, and bitwise by construction. CUDA tensors on a gloo rail are staged through host memory
here (gloo's CUDA support for all-to-all is not something we have checked on the device); staging
waits for the stream, so "sync-free" there means static shapes and no host read of a count, not no
synchronization. On NCCL rails the tensors stay on the GPU and the payload collectives are
stream-ordered, or waited for on the host with the timeout where the caller reads on the host next
(blocking dispatch: ``exchange_rows(read_on_host=True)``), so that a rail peer that stopped after the
count exchange is named, not left to an untimed CUDA sync and NCCL's watchdog.

Host memory on a gloo rail: the payload rows travel through two host buffers that ``ScaleOut`` keeps
between ops (send and receive; pinned where CUDA tensors are staged), grown to the largest exchange
and never shrunk. A fresh host tensor of a 100 MB payload costs its page faults on every op (about
40 ms on the 2-core CPU bed, more than the wire), and a pinned one copies to and from the GPU without
the driver's bounce buffer. When CUDA rows are staged, the rows a rank sends to its own domain stay
on the GPU (a device copy): only the other domains' rows cross the host.

Chunking (``Config.scaleout_chunk_tokens``): each rail collective moves at most that many rows per
peer; larger exchanges run as several rounds. This bounds one collective's message, not the host
buffers (they hold the whole payload); it does not yet overlap the rounds with forwarding into the domain.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

from ..errors import EPError
from ..host_collectives import HostCollectives, moves_host_memory, nccl_moves_cuda, registered, twin_margin_s
from ..topology import Topology

logger = logging.getLogger(__name__)

# (parent group name, domain size, rail engine) -> (domain groups, rail groups), by index.
_groups: dict[tuple, tuple[list, list]] = {}


def rail_engine(topology: Topology, device: torch.device, parent_engine: str) -> str:
    """"nccl" when this device is a GPU, NCCL is there and every rail's ranks use distinct GPUs; else "gloo"."""
    if device.type != "cuda" or not dist.is_nccl_available():
        return "gloo"
    gpus = topology.gpu_of_rank
    if not gpus or any(gpu is None for gpu in gpus):
        # NCCL alone ("nccl", "cuda:nccl"); a group with gloo in it keeps its rails on gloo (ranks may share a GPU)
        return "nccl" if nccl_moves_cuda(parent_engine) and not moves_host_memory(parent_engine) else "gloo"
    for local in range(topology.domain_size):
        rail = [gpus[rank] for rank in topology.rail_ranks(local)]
        if len(set(rail)) != len(rail):
            return "gloo"
    return "nccl"


def make_groups(group: dist.ProcessGroup, topology: Topology, engine: str, *, timeout_s: float,
                owner: str, device: Optional[torch.device] = None, gloo_host_words: bool = True) -> tuple[list, list]:
    """Every domain's and every rail's process group (a collective: every rank, same order). Raises EPError
    on every rank, before any group is made, when the ranks could not meet in them (``_check_group_names``)."""
    parent_engine = dist.get_backend(group)
    for dead in [key for key, groups in _groups.items() if not _still_registered(groups)]:
        del _groups[dead]  # a destroyed world's groups: kept, they would pile up across in-process restarts
    key = _groups_key(group, topology, engine)
    if key not in _groups:
        _check_group_names(group, timeout_s=timeout_s, owner=owner, device=device, on_host=gloo_host_words)
        # Local synchronization: only the EP group's ranks make these groups. Megatron's EP group is a
        # subgroup of the world, whose other ranks are busy building their own EP groups' backends.
        # torch names such a group by its ranks and the number of groups this process belongs to, so the
        # members must belong to equally many (checked above; true of Megatron's ranks of one EP group,
        # which share a pipeline stage). Each rank then joins one domain group and one rail group, so
        # the members of every later group have made equally many too.
        timeout = groups_timeout(group, timeout_s)
        slow = (f"{owner}: rank {dist.get_rank(group)} has waited {timeout_s:g} s (EP_PLUGIN_TIMEOUT_S) in torch's "
                f"new_group, making the domain and rail groups: a rank of the group that stopped after the "
                f"group-name exchange (exited, or busy elsewhere) keeps every rank there until the groups' own "
                f"timeout ({timeout}), which is also their collectives' and so is not shortened")
        with _said_if_slow(timeout_s, slow):
            domains = [dist.new_group(_global_ranks(group, topology.domain_ranks(d)), backend=parent_engine,
                                      timeout=timeout, use_local_synchronization=True)
                       for d in range(topology.num_domains)]
            rails = [dist.new_group(_global_ranks(group, topology.rail_ranks(local)), backend=engine,
                                    timeout=timeout, use_local_synchronization=True)
                     for local in range(topology.domain_size)]
        _groups[key] = (domains, rails)
    return _groups[key]


@contextlib.contextmanager
def _said_if_slow(seconds: float, message: str) -> Iterator[None]:
    """Log ``message`` (a warning) once the block has run ``seconds``: for a wait of torch's that cannot
    be given a shorter timeout of its own."""
    timer = threading.Timer(seconds, logger.warning, args=(message,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def groups_timeout(group: dist.ProcessGroup, timeout_s: float) -> timedelta:
    """The engine timeout of the domain and rail groups: the EP group's own (Megatron's
    --distributed-timeout-minutes; torch's default, 10 min for NCCL, would end a long rail payload wait
    first), and never shorter than ``timeout_s`` plus a margin (ep_plugin's own wait must name the late peer
    before the engine gives up)."""
    floor = timedelta(seconds=timeout_s + twin_margin_s(timeout_s))
    nccl = not moves_host_memory(dist.get_backend(group))
    try:  # no public getter: each engine's options carry the timeout the group was made with
        parent = group._get_backend(torch.device("cuda" if nccl else "cpu")).options._timeout
    except (AttributeError, RuntimeError, ValueError):  # torch's default for the engine, as new_group would use
        parent = default_pg_nccl_timeout if nccl else default_pg_timeout
    return max(floor, parent)


def _check_group_names(group: dist.ProcessGroup, *, timeout_s: float, owner: str, device: Optional[torch.device],
                       on_host: bool) -> None:
    """EPError on every rank when the ranks of ``group`` belong to different numbers of process groups.

    torch names a group made with local synchronization by a hash of its ranks and of that number
    (``_hash_ranks_to_str``), and its members meet in the store under that name: members whose numbers
    differ never meet, and each waits out the process group's timeout (30 min by default) in silence."""
    registry = getattr(dist.distributed_c10d._world, "pg_names", None)
    if registry is None:  # a torch that names groups otherwise: nothing to check
        return
    words = HostCollectives(group, owner=owner, timeout_s=timeout_s, label="group names", device=device,
                            on_host=on_host)
    counts = words.all_gather_object(len(registry), where="making the domain and rail groups (group names)")
    if len(set(counts)) > 1:
        per_rank = ", ".join(f"{words.peer_name(rank)}: {count}" for rank, count in enumerate(counts))
        raise EPError(f"{owner}: the ranks of the expert-parallel group belong to different numbers of process groups "
                      f"({per_rank}). torch names the domain and rail groups, which only these ranks make, after "
                      f"that number, so the ranks would never meet in them. Make the same process groups on every "
                      f"rank of the group (new_group with use_local_synchronization=True makes one on its members "
                      f"only), or build this backend before the groups that differ.")


def _still_registered(groups: tuple[list, list]) -> bool:
    """Whether no ``destroy_process_group`` took these groups. A process that then starts a new world
    (an in-process restart) gets groups with the old names, so the key alone would hand out dead ones.
    A rank outside a group holds a placeholder there, not a ProcessGroup: nothing to check."""
    return all(registered(member) for member in (*groups[0], *groups[1]) if isinstance(member, dist.ProcessGroup))


def _groups_key(group: dist.ProcessGroup, topology: Topology, engine: str) -> tuple:
    return getattr(group, "group_name", str(id(group))), topology.domain_size, engine


def _global_ranks(group: dist.ProcessGroup, ranks: Sequence[int]) -> list[int]:
    return [dist.get_global_rank(group, r) for r in ranks]


@dataclass
class RailSplits:
    """Rows this rank sends to / receives from each rail peer (indexed by domain), and the largest split
    of any pair on the rail (equal on every rail rank: chunked exchanges run that many rounds)."""

    send: list[int]
    recv: list[int]
    largest: int

    def reversed(self) -> "RailSplits":
        return RailSplits(self.recv, self.send, self.largest)


class ScaleOut:
    """The rail and domain groups of this rank, and the timed rail collectives.

    Args:
        group: the expert-parallel group the topology describes.
        topology: its domains and rails.
        device: this rank's device (CUDA tensors are staged through the host on a gloo rail).
        timeout_s: how long one rail collective may wait for its peers.
        chunk_rows: rows per peer per rail collective (0 = all at once).
        owner: name for messages ("ep_plugin reference").
        gloo_host_words: ``exchange_words`` and ``exchange_counts`` move CPU tensors (no wait for the GPU):
            on the rail group where it moves them, else on its gloo twin (``HostCollectives``' ``on_host``);
            False keeps them on an NCCL rail group (GPU words the host reads after the GPU).
    """

    def __init__(self, group: dist.ProcessGroup, topology: Topology, device: torch.device, *, timeout_s: float,
                 chunk_rows: int = 0, owner: str, gloo_host_words: bool = True) -> None:
        self.topology = topology
        self.device = device
        self.chunk_rows = int(chunk_rows)
        self.engine = rail_engine(topology, device, dist.get_backend(group))
        domains, rails = make_groups(group, topology, self.engine, timeout_s=timeout_s, owner=owner, device=device,
                                     gloo_host_words=gloo_host_words)
        self.domain_group = domains[topology.domain_index]
        self.rail_group = rails[topology.local_index]
        rail_global = [dist.get_global_rank(group, r) for r in topology.rail_ranks()]
        self.level = f"rail {topology.local_index} (global ranks {rail_global})"
        self.rail = HostCollectives(self.rail_group, owner=f"{owner} scale-out, {self.level}", timeout_s=timeout_s,
                                    label="rail", device=device)
        self.stage_on_host = device.type == "cuda" and not nccl_moves_cuda(self.engine)
        self.exchange_device = device if device.type == "cuda" and not self.stage_on_host else torch.device("cpu")
        self._host_buffers: dict[str, torch.Tensor] = {}  # "send" / "receive": kept host rows (module docstring)
        self.pin_host_buffers = self.stage_on_host
        # The words: on the rail group where it moves CPU tensors, else on its gloo twin (the module docstring).
        self.rail_words = self.rail
        if not moves_host_memory(self.engine) and gloo_host_words:
            self.rail_words = HostCollectives(self.rail_group, timeout_s=timeout_s, on_host=True,
                                              owner=f"{owner} scale-out, {self.level}", label="rail words",
                                              device=device)
        self.words_device = self.rail_words.word_device  # the CPU, unless they stay on an NCCL rail
        if self.engine == "nccl":
            # NCCL connects a group at its first collective, on the host and with no timeout: here, at the build,
            # among peers that just met, not in the first dispatch's rows (whose timed wait starts after it).
            D = topology.num_domains
            slow = (f"{owner}: rank {dist.get_rank(group)} has waited {timeout_s:g} s (EP_PLUGIN_TIMEOUT_S) in NCCL's "
                    f"connection of {self.level}: a rail peer that stopped after making the groups keeps it there "
                    "(NCCL's own connect has no timeout)")
            with _said_if_slow(timeout_s, slow):
                self.rail.all_to_all(torch.zeros(D, dtype=torch.int64, device=self.exchange_device), [1] * D,
                                     [1] * D, where="connecting the rail's NCCL group", read_on_host=True)

    @property
    def num_domains(self) -> int:
        return self.topology.num_domains

    def check_usable(self) -> None:
        self.rail.check_usable()
        self.rail_words.check_usable()

    def exchange_words(self, words: torch.Tensor, *, where: str) -> list[list[int]]:
        """Send each rail peer the same few int64 words; return every peer's words (host lists, by domain).

        A host read: sync-free mode's agreement uses it (CPU tensors on a group that moves them, unless
        ``gloo_host_words`` is off on an NCCL rail: no wait for the GPU).
        """
        D = self.num_domains
        sent = words.reshape(1, -1).to(torch.int64).repeat(D, 1).to(self.words_device)
        width = sent.shape[1]
        received = self.rail_words.all_to_all(sent.reshape(-1), [width] * D, [width] * D, where=where,
                                              read_on_host=True)
        return received.view(D, width).tolist()

    def exchange_counts(self, send_counts: list[int], extra: Sequence[int], *,
                        where: str) -> tuple[RailSplits, list[tuple]]:
        """Blocking mode: the rail's row counts, and each peer's ``extra`` words (for agreement).

        Every rank sends every peer its whole row of counts, so every rank knows the largest split on
        the rail (the number of chunked rounds must be equal on all of them).
        Returns: (RailSplits, each peer's extra words).
        """
        D = self.num_domains
        sent = torch.tensor([[count, *extra, *send_counts] for count in send_counts], dtype=torch.int64,
                            device=self.words_device)
        width = sent.shape[1]
        received = self.rail_words.all_to_all(sent.reshape(-1), [width] * D, [width] * D, where=where,
                                              read_on_host=True)
        rows = received.view(D, width).tolist()
        largest = max((max(row[width - D:], default=0) for row in rows), default=0)
        splits = RailSplits(list(send_counts), [row[0] for row in rows], largest)
        return splits, [tuple(row[1:width - D]) for row in rows]

    def send_rows(self, num_rows: int, row_bytes: int) -> torch.Tensor:
        """[num_rows, row_bytes] uint8 to pack a payload into before ``exchange_rows`` (contents undefined).

        On a CPU rail this is the kept send buffer (the next op's payload overwrites it; ``exchange_rows``
        has finished reading it when it returns); elsewhere a fresh tensor on this rank's device.
        """
        if self.device.type == "cpu" and not self.stage_on_host:
            return self._host_rows("send", num_rows, row_bytes)
        return torch.empty(num_rows, row_bytes, dtype=torch.uint8, device=self.device)

    def exchange_rows(self, rows: torch.Tensor, splits: RailSplits, *, where: str,
                      read_on_host: bool = False) -> torch.Tensor:
        """``all_to_all_single`` of ``rows`` [sum(splits.send), B] along the rail; returns [sum(splits.recv), B].

        Rows for peer d are the d-th block of ``rows``; received blocks come in domain order. Runs in
        ceil(splits.largest / chunk_rows) rounds when chunking is on (equal on every rail rank). Stays on
        the stream over NCCL, unless ``read_on_host``: the caller reads on the host next, so the host waits
        for the rows here, with the timeout. On a CPU rail the result is a view of the kept receive buffer,
        which the next exchange overwrites: read it (``RowPacker.unpack`` copies by default) before then.
        """
        if self.stage_on_host:
            return self._exchange_staged(rows, splits, where)
        received = None
        if rows.device.type == "cpu":
            received = self._host_rows("receive", sum(splits.recv), rows.shape[1])
        return self._all_to_all_rows(rows, splits, received, where, read_on_host)

    def _exchange_staged(self, rows: torch.Tensor, splits: RailSplits, where: str) -> torch.Tensor:
        """CUDA rows over a gloo rail: the own domain's block is a device copy, the others cross the host
        once each way through the kept pinned buffers (synchronous copies: a buffer is free when this returns)."""
        own = self.topology.domain_index
        width = rows.shape[1]
        out = rows.new_empty((sum(splits.recv), width))
        send_own, recv_own = _starts(splits.send)[own], _starts(splits.recv)[own]
        out[recv_own:recv_own + splits.recv[own]] = rows[send_own:send_own + splits.send[own]]
        remote = RailSplits([0 if d == own else n for d, n in enumerate(splits.send)],
                            [0 if d == own else n for d, n in enumerate(splits.recv)], splits.largest)
        host_rows = self._host_rows("send", sum(remote.send), width)
        for first, count, at in _around(send_own, splits.send[own], rows.shape[0]):
            host_rows[at:at + count].copy_(rows[first:first + count])
        received = self._all_to_all_rows(host_rows, remote, self._host_rows("receive", sum(remote.recv), width),
                                         where, read_on_host=True)
        for first, count, at in _around(recv_own, splits.recv[own], out.shape[0]):
            out[first:first + count].copy_(received[at:at + count])
        return out

    def _all_to_all_rows(self, rows: torch.Tensor, splits: RailSplits, out: Optional[torch.Tensor],
                         where: str, read_on_host: bool) -> torch.Tensor:
        """The rail collective(s) of ``exchange_rows`` on tensors the engine moves, into ``out`` (or fresh)."""
        chunk = self.chunk_rows
        most = splits.largest
        if chunk <= 0 or most <= chunk:
            return self.rail.all_to_all(rows, splits.recv, splits.send, where=where, read_on_host=read_on_host,
                                        out=out)
        if out is None:
            out = rows.new_empty((sum(splits.recv),) + tuple(rows.shape[1:]))
        send_starts = _starts(splits.send)
        recv_starts = _starts(splits.recv)
        rounds = range(0, most, chunk)
        for round_index, first in enumerate(rounds):
            send_now = [max(0, min(chunk, n - first)) for n in splits.send]
            recv_now = [max(0, min(chunk, n - first)) for n in splits.recv]
            pieces = [rows[s + first:s + first + n] for s, n in zip(send_starts, send_now, strict=True)]
            received = self.rail.all_to_all(torch.cat(pieces), recv_now, send_now,
                                            where=f"{where} (chunk {round_index + 1})",
                                            # rounds on one group end in order: the host waits for the last
                                            read_on_host=read_on_host and round_index == len(rounds) - 1)
            offset = 0
            for s, n in zip(recv_starts, recv_now, strict=True):
                out[s + first:s + first + n] = received[offset:offset + n]
                offset += n
        return out

    def _host_rows(self, role: str, num_rows: int, row_bytes: int) -> torch.Tensor:
        """[num_rows, row_bytes] uint8 of the kept host buffer ``role``, grown when too small (by a quarter at
        least, so that counts that creep up from op to op do not reallocate every time)."""
        size = num_rows * row_bytes
        kept = self._host_buffers.get(role)
        if kept is None or kept.numel() < size:
            grown = max(size, 0 if kept is None else kept.numel() * 5 // 4)
            # Kept for later ops: made under torch.inference_mode() it would be an inference tensor, which no
            # op outside that mode may write into.
            with torch.inference_mode(False):
                kept = torch.empty(grown, dtype=torch.uint8, pin_memory=self.pin_host_buffers)
            self._host_buffers[role] = kept
        return kept[:size].view(num_rows, row_bytes)

    def release_host_buffers(self) -> None:
        """Give the kept host buffers back (a later exchange allocates them again)."""
        self._host_buffers.clear()

    def release(self) -> None:
        """The owner is destroyed: the host buffers and the rail words' gloo twin go (no collective follows)."""
        self.release_host_buffers()
        self.rail.release()
        self.rail_words.release()

    def barrier(self, *, where: str) -> None:
        """Every rank of this rail reached this point (a timed host wait): a row of the agreement's size, zeros."""
        self.exchange_counts([0] * self.num_domains, (0, 0, 0, 0), where=where)


def _around(start: int, count: int, total: int) -> list[tuple[int, int, int]]:
    """The rows of [0, total) outside the block [start, start + count): (first row, rows, where they start
    once the block is taken out), for the non-empty runs before and after it."""
    runs = [(0, start, 0), (start + count, total - start - count, start)]
    return [run for run in runs if run[1] > 0]


def _starts(counts: list[int]) -> list[int]:
    starts, total = [], 0
    for count in counts:
        starts.append(total)
        total += count
    return starts


class RowPacker:
    """Lay several per-row tensors side by side as uint8 bytes (one rail collective per op), and back.

    Args: fields: (name, dtype, per-row shape) in wire order; a None dtype/shape entry is left out.
    """

    def __init__(self, fields: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        self.fields = [(name, dtype, tuple(shape)) for name, dtype, shape in fields]
        self.offsets: dict[str, tuple[int, int]] = {}
        total = 0
        for name, dtype, shape in self.fields:
            width = _numel(shape) * _itemsize(dtype)
            self.offsets[name] = (total, width)
            total += width
        self.row_bytes = total

    def pack(self, num_rows: int, values: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        """[num_rows, row_bytes] uint8 from each field's [num_rows, *shape] tensor (missing fields: zeros)."""
        return self.pack_into(torch.empty(num_rows, self.row_bytes, dtype=torch.uint8, device=device), values)

    def pack_into(self, out: torch.Tensor, values: dict[str, torch.Tensor], *, take: Optional[torch.Tensor] = None,
                  at: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Write each field's rows into its bytes of ``out`` [N, row_bytes] (missing fields: zeros); returns ``out``.

        Args:
            values: each field's [M, *shape] tensor; row i goes to row i of ``out`` (M = N), unless
            take: [N] int64: row i of ``out`` gets row take[i] of each value (a gather), or
            at: [M] int64: row i of each value goes to row at[i] of ``out`` (a scatter; other rows untouched).
        Gathers and scatters write into ``out``'s columns directly: no temporary copy of a field.
        """
        for name, _, shape in self.fields:
            columns = self.columns(out, name)
            value = values.get(name)
            if value is None:
                columns.zero_()
                continue
            value = _as_bytes(value.reshape(value.shape[0], _numel(shape)), columns.shape[1])
            if take is not None:
                torch.index_select(value, 0, take, out=columns)
            elif at is not None:
                columns.index_copy_(0, at, value)
            else:
                columns.copy_(value)
        return out

    def columns(self, rows: torch.Tensor, name: str) -> torch.Tensor:
        """The [N, width] uint8 bytes of field ``name`` in packed ``rows`` (a view)."""
        start, width = self.offsets[name]
        return rows[:, start:start + width]

    def unpack(self, rows: torch.Tensor, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """Each field as [N, *shape] in its dtype: fresh, contiguous tensors, or with ``copy=False`` views of
        ``rows`` where the byte offsets allow (strided rows: for a caller that reads them before ``rows`` change)."""
        fields = {}
        for name, dtype, shape in self.fields:
            raw = self.columns(rows, name)
            itemsize = _itemsize(dtype)
            if copy or raw.stride(0) % itemsize or raw.storage_offset() % itemsize:
                # A fresh [N, width] copy, also where view(dtype) refuses the row stride or offset (a slice of one
                # row, or none, counts as contiguous but keeps the row stride too).
                raw = torch.empty(rows.shape[0], raw.shape[1], dtype=torch.uint8, device=rows.device).copy_(raw)
            fields[name] = raw.view(dtype).reshape((rows.shape[0],) + shape)
        return fields


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _as_bytes(value: torch.Tensor, width: int) -> torch.Tensor:
    """[N, k] of any dtype -> [N, width] uint8 (bool as one byte per value)."""
    if value.numel() == 0:  # counts as contiguous whatever its strides (a 0-token rank's gradient of a
        # sum is an expanded tensor, stride 0), and view() refuses such strides
        return torch.empty(value.shape[0], width, dtype=torch.uint8, device=value.device)
    if value.dtype == torch.bool:
        value = value.to(torch.uint8)
    return value.contiguous().view(torch.uint8).reshape(value.shape[0], width)


def flat_order_index(counts: torch.Tensor, pad_multiple: int, num_rows: int) -> torch.Tensor:
    """Where each row of a domain-level dispatch output goes in the one-domain (flat) order.

    A rank's domain-level output holds, within each segment g (a local expert, or the one segment of a
    compact output), the rows forwarded by each domain peer s in turn (s-major), and within those the
    rows of each source domain d in turn; the flat order is source rank d * S + s ascending: d-major.
    Both keep source-token order inside a (s, d) block, and segments start at the same rows (equal
    counts, equal padding), so the reorder is a block transpose inside each segment.

    Args:
        counts: [S, D, G] int64, rows of (forwarding peer s, source domain d) in segment g.
        pad_multiple: each segment padded to a multiple of this (its padding rows stay in place).
        num_rows: rows of the output (at least the padded total; sync-free: the capacity).
    Returns: dest [num_rows] int64: ``flat[dest[i]] = domain_level[i]``; rows outside every block (padding,
        past the valid rows) map to themselves. Device ops only (no host read).
    """
    S, D, G = counts.shape
    device = counts.device
    n = counts.permute(2, 0, 1).reshape(G, S * D)  # domain-level order in a segment: (s, d)
    real = n.sum(1)
    padded = (real + pad_multiple - 1) // pad_multiple * pad_multiple
    segment_start = torch.cumsum(padded, 0) - padded
    flat_n = counts.permute(2, 1, 0).reshape(G, D * S)  # flat order in a segment: (d, s)
    flat_offset = (torch.cumsum(flat_n, 1) - flat_n).view(G, D, S).transpose(1, 2).reshape(G, S * D)
    sizes = torch.cat([n, (padded - real).unsqueeze(1)], 1).reshape(-1)  # (segment, block); block S*D = padding
    ends = torch.cumsum(sizes, 0)
    starts = ends - sizes
    row = torch.arange(num_rows, device=device, dtype=torch.int64)
    block = torch.searchsorted(ends, row, right=True)
    inside = block < sizes.numel()
    block = block.clamp(max=max(sizes.numel() - 1, 0))
    segment = block // (S * D + 1)
    within = block % (S * D + 1)
    is_padding = within == S * D
    within = within.clamp(max=S * D - 1)
    dest = segment_start[segment] + flat_offset[segment, within] + (row - starts[block])
    moved = inside & ~is_padding & (dest < num_rows)  # past the budget (hybrid overflow): left in place
    return torch.where(moved, dest, row)
