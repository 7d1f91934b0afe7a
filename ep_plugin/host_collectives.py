"""Host collectives on an existing engine (gloo, NCCL) that honour ``Config.timeout_s``.

A rank whose peer stopped calling must get an error that names the rank, the phase and the
peer, never wait forever; an engine failure (a peer exited, a collective out of step) must
come back as ``EPError`` carrying the engine's message, never as a raw engine exception.

How the wait is bounded (gloo's behaviour measured on torch 2.13; ``Work.wait(timeout)`` and
``Work.is_completed()`` are the same public API on 2.11):

- gloo: every op is issued with ``async_op=True`` and waited with ``Work.wait(timeout)``. On
  expiry gloo raises "Operation timed out!" but does not cancel the op: it stays queued in
  gloo's worker thread until the peer arrives (it then completes against that peer) or goes
  away. So a timeout leaves the group's collectives out of step among its ranks: the owner, and
  every other owner on that group (or twin) in this process, is marked failed, every later call
  raises at once, and the message says to end the job or build a new process group. The group's
  own timeout (30 min by default for gloo) is the engine's backstop; ``destroy_process_group``
  waits for the stranded op, which ends when the late peer calls or exits. On a gloo twin (below)
  each op carries its own backstop, the owner's timeout plus a margin, and the twin goes with its
  last owner, not with ``destroy_process_group``.
- NCCL: a collective whose result the host reads next is polled with ``Work.is_completed()``
  (never blocks, never throws) until the deadline. Payload collectives are left on the stream
  (no host sync added) unless the caller reads on the host next (``read_on_host``: the scale-out's
  blocking dispatch rows); a peer that dies in the middle of one left on the stream is then NCCL's
  watchdog's to report, at the group's own timeout. Set that timeout above
  ``EP_PLUGIN_TIMEOUT_S`` so that ep_plugin's report comes first.
- Either engine under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: torch's debug wrapper would block the issue itself
  until the peers come, so the collectives go on the engine under it (``unwrapped_backend``).

Host words of an NCCL group (``on_host=True``: the construction check, topology, buffer handles,
autosizing, the Megatron backend's tokens per rank and arena, the scale-out agreement and counts) travel on a
gloo twin of it, gloo over the same ranks that its owners share (``gloo_twin``;
``Config.gloo_host_words`` turns it off): a collective that a peer never joins then leaves nothing
spinning on a GPU. Over NCCL it would leave a kernel that waits for the peer, and the process's exit
(cudaFree, synchronize) would wait for that kernel, with the GIL held, until NCCL's watchdog ends the
process: the timeout's message, then a hang of minutes. Megatron's distributed optimizer keeps gloo
groups of its NCCL groups for host traffic too.

Which peer is late: neither engine says. On a timeout each rank posts where it gave up to
the store of the default process group, then reads the posts of its peers for a short grace
period. A peer that posted the same place waits too; one that posted another place gave up
there earlier; one that posted nothing within the grace period came late or never reached this op
(stopped calling ep_plugin, busy elsewhere, or dead), unless it posted, by its global rank, a wait of
its own in another group's collective about now (a domain peer stuck on its rail): the report says
where, and that rank's own report names whom it waits for. Ranks are named as their group knows them,
with their global rank where that differs. The store is reached through ``torch.distributed``'s private
``_get_default_store``; where that is missing the report lists every peer that could be late.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import pickle
import threading
import time
import weakref
from collections import Counter
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist

from .errors import EPError, EPTimeoutError
from .logs import warn_once

logger = logging.getLogger(__name__)

# Per process group object, how many owners of each label this process opened on it (``instance``). By the
# object, not its name: torch names a restarted world's groups as it named the last one's, so a count by name
# would differ between ranks that belonged to other groups before the restart.
_sites: "weakref.WeakKeyDictionary[dist.ProcessGroup, Counter]" = weakref.WeakKeyDictionary()
_twins: dict[str, weakref.ref] = {}  # group name -> the GlooTwin its owners hold (gloo_twin)
# Process group -> why a making of its twin failed in this process. The makings are numbered by a count in
# the store that assumes every rank joins every making: after one that a rank never joined, the ranks would
# look for each other under different numbers at every later making (use_gloo_twin refuses those instead).
_failed_twin_makings: "weakref.WeakKeyDictionary[dist.ProcessGroup, str]" = weakref.WeakKeyDictionary()
# Engines whose collectives fell out of step in this process (a wait that gave up, an engine error): the
# process group or the gloo twin the words went over -> what failed. Every owner on that engine consults
# it: another owner's next collective there would meet the op left behind, and gloo aborts the process
# when their sizes differ (SIGABRT, "Received data size doesn't match expected size").
_out_of_step: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
# Store keys where a rank that timed out says where it waits, by its global rank (see _report_peers).
_WAITS_BY_GLOBAL_RANK = "ep_plugin/timeouts/by_global_rank/"
# How long the report's store calls may take beyond their grace periods: a healthy store answers in
# milliseconds, so past this its host is taken for stopped or cut off (see _report_peers).
_STORE_ANSWER_S = 5.0


# Every host call's first exchange on a group has one size: FRAME_WORDS int64 per pair of ranks (the rows
# or bytes to follow, what the call is, the owner's number, one more word), whatever the call: reference's
# opening exchange of an op, the size exchange of a setup gather, a setup barrier. gloo aborts the process
# (SIGABRT, "Received data size doesn't match expected size") when two ranks meet in collectives of
# different sizes, and a call one rank issues and its peers do not (an op on one rank while another builds
# a backend) meets the peers' next call. With one size they meet, read each other's second word and raise
# EPError naming both calls.
FRAME_WORDS = 4
SETUP_EXCHANGE = 6  # the second word of a setup call (agreement.OP_SETUP's fingerprint; an op's is its own)

_OUT_OF_STEP = ("The process group's collectives are now out of step among its ranks (an engine cannot take back a "
                "collective that one rank gave up on or that failed): end the job, or build a new process group and "
                "a new backend on it.")


# What a plain engine name moves, as torch makes a group of it (dist.Backend.backend_capability): an engine
# named otherwise is taken to move both, as torch takes it.
_ENGINE_DEVICES = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "xccl": ("xpu",), "ucc": ("cpu", "cuda"),
                   "mpi": ("cpu", "cuda")}


def engine_for(engine: str, device_type: str) -> Optional[str]:
    """Which engine moves ``device_type`` tensors in a group whose ``dist.get_backend`` is ``engine``, or None
    where none does. ``engine`` is a plain name ("gloo", "nccl") or torch's per-device form: "cuda:nccl" (from
    ``init_process_group("cuda:nccl")``), "cpu:gloo", "cpu:gloo,cuda:nccl" (the default where CUDA is there).
    Every question about a group's engine goes through here (``moves_host_memory``, ``nccl_moves_cuda``)."""
    engine = str(engine).lower()
    if ":" not in engine:
        return engine if device_type in _ENGINE_DEVICES.get(engine, ("cpu", "cuda")) else None
    pairs = dict(pair.strip().split(":", 1) for pair in engine.split(",") if ":" in pair)
    return pairs.get(device_type)


def moves_host_memory(engine: str) -> bool:
    """Whether a group of this engine moves CPU tensors: gloo, or a mixed "cpu:gloo,cuda:nccl" group
    (torch routes CPU tensors to its gloo part). NCCL alone ("nccl", "cuda:nccl") moves CUDA tensors only."""
    return engine_for(engine, "cpu") is not None


def nccl_moves_cuda(engine: str) -> bool:
    """Whether NCCL moves a group's CUDA tensors ("nccl", "cuda:nccl", "cpu:gloo,cuda:nccl"): a collective on them
    is ordered on the stream (waited by polling). A group with gloo in it may still stage them through the host
    (``moves_host_memory``), which works with ranks sharing a GPU."""
    return engine_for(engine, "cuda") == "nccl"


def word_device(engine: str, device: Union[torch.device, str, None]) -> torch.device:
    """Where a collective's small tensors that the host reads go: host memory, except on a group that moves
    CUDA tensors only (NCCL), where they go to the owner's GPU. Not the current GPU when the owner has its own:
    a job that passes ``device=`` without ``torch.cuda.set_device`` would otherwise run every rank's
    words on GPU 0, which NCCL refuses (two ranks on one GPU) or waits on."""
    if moves_host_memory(engine):
        return torch.device("cpu")
    if device is not None and torch.device(device).type == "cuda" and torch.device(device).index is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device())


def unwrapped_backend(group: dist.ProcessGroup, device_type: str) -> Optional[Any]:
    """The engine under torch's debug wrapper of ``group``'s backend for ``device_type``, or None where there
    is no wrapper (``dist.all_to_all_single`` then reaches the engine as it is).

    With ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch wraps each group's gloo or NCCL backend in a
    ``ProcessGroupWrapper``, which checks every collective against the peers' on a gloo helper before issuing
    it, blocking the caller there until the peers issue theirs or the group's own timeout (30 min by default)
    ends it: ``Work.wait(timeout)`` would never get the work, so ``EP_PLUGIN_TIMEOUT_S`` would bound nothing
    and a late peer would be reported as a gloo failure. ``HostCollectives`` issues on the wrapped engine
    instead (torch peels it the same way to split a group); our ops carry their own agreement (their opening
    words, the setup frames' digests). Where this torch's wrapper does not say what it wraps, a warning
    naming the variable, once."""
    get_backend = getattr(group, "_get_backend", None)
    try:
        backend = get_backend(torch.device(device_type)) if get_backend is not None else None
    except RuntimeError:  # no engine for that device: dist.all_to_all_single raises its own error
        return None
    if backend is None or "ProcessGroupWrapper" not in type(backend).__name__:
        if backend is None and dist.get_debug_level() == dist.DebugLevel.DETAIL:
            _warn_wrapped_waits()
        return None
    inner = backend
    while "ProcessGroupWrapper" in type(inner).__name__:
        inner = getattr(inner, "wrapped_pg", None)
        if inner is None:
            _warn_wrapped_waits()
            return None
    return inner


def _warn_wrapped_waits() -> None:
    warn_once(logger, "debug wrapper", "ep_plugin: TORCH_DISTRIBUTED_DEBUG=DETAIL wraps each process group's engine "
              "in a check that blocks every collective until its peers issue theirs or the group's own timeout "
              "ends it, and this torch does not say what the wrapper wraps: ep_plugin's host waits are bounded "
              "by the group's timeout, not EP_PLUGIN_TIMEOUT_S, and a late peer is reported as an engine failure. "
              "Unset TORCH_DISTRIBUTED_DEBUG (or set it to INFO) to keep ep_plugin's timeouts.")


class GlooTwin:
    """gloo over the ranks of one process group (``gloo_twin``). Its owners (``HostCollectives``) hold it;
    it goes, with its sockets and its hold on the default store, when the last of them lets go
    (``release`` at a backend's ``destroy``, or the owner itself going): a twin that outlived
    ``destroy_process_group`` would keep the store's port taken from a new world in the same process."""

    def __init__(self, parent: dist.ProcessGroup, gloo) -> None:
        self.parent = parent
        self.gloo = gloo  # dist.ProcessGroupGloo


def gloo_twin(group: dist.ProcessGroup, *, timeout_s: float) -> GlooTwin:
    """gloo over ``group``'s ranks (its rank r is ``group``'s rank r), made by every rank of ``group`` (a
    collective of those ranks only) and shared by the owners that hold it. It is torch's
    ``ProcessGroupGloo`` itself, not a group registered with ``torch.distributed``: registering one
    (``new_group``) names it by a count of the groups each process belongs to, which the ranks of ``group``
    need not agree on (a process in more groups than its peers would look for the others under another
    name, and all would wait out the timeout). The ranks meet in the default store under ``group``'s name
    and ranks, and the number of twins of it made before (counted in the store, so a process that joined
    later agrees with the others).

    Making it waits up to ``timeout_s`` plus a margin for the peers, then raises ``TwinMakingFailed`` (carrying
    the store's ``DistStoreError`` or gloo's "Connect timeout", by where it waited). A rank whose making failed
    marks that making abandoned in the store: a peer that comes later raises ``TwinAbandoned`` at once instead
    of meeting stale addresses. One that failed before the timeout (gloo could not connect) also posts why: its
    peers, which wait for it until their timeout, quote it instead of taking it for a late peer."""
    name = group.group_name
    held = _twins.get(name)
    twin = held() if held is not None else None
    if twin is not None and registered(twin.parent):
        return twin
    store = dist.distributed_c10d._get_default_store()
    size = dist.get_world_size(group)
    ranks = [dist.get_global_rank(group, rank) for rank in range(size)]
    where = f"ep_plugin/gloo_twin/{name}/{hashlib.sha1(str(ranks).encode()).hexdigest()[:16]}"
    generation = (store.add(f"{where}/arrivals", 1) - 1) // size  # the same on every rank of this making
    prefix = f"{where}/{generation}/"
    rank = dist.get_rank(group)
    if store.check([prefix + "abandoned"]):  # its other ranks gave up on it before this one came
        failures = _twin_failures(store, prefix, size, rank)
        why = "; ".join(f"rank {q} could not connect: {text}" for q, text in sorted(failures.items()))
        raise TwinAbandoned(f"the other ranks gave up making this gloo group "
                            f"({why or store.get(prefix + 'abandoned').decode()}) before this rank came")
    start = time.monotonic()
    try:
        gloo = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size,
                                     timedelta(seconds=timeout_s + twin_margin_s(timeout_s)))
    except RuntimeError as exc:
        with contextlib.suppress(Exception):
            if time.monotonic() - start < timeout_s:  # it came and failed: the peers waiting for it say why
                store.set(f"{prefix}failed/{rank}", _first_line(exc))
            store.set(prefix + "abandoned", f"rank {rank} could not connect or timed out")  # for latecomers
        raise TwinMakingFailed(str(exc), _twin_failures(store, prefix, size, rank)) from exc
    twin = GlooTwin(group, gloo)
    _twins[name] = weakref.ref(twin)
    return twin


def _twin_failures(store, prefix: str, size: int, rank: int) -> dict[int, str]:
    """The ranks other than ``rank`` that came to this making of a twin and failed before their timeout (gloo
    could not connect there), each with its error, as they posted it (``gloo_twin``)."""
    failures = {}
    with contextlib.suppress(Exception):  # what the store cannot say is left unsaid
        for q in range(size):
            if q != rank and store.check([f"{prefix}failed/{q}"]):
                failures[q] = store.get(f"{prefix}failed/{q}").decode()
    return failures


class TwinAbandoned(RuntimeError):
    """A rank came to make a gloo twin that its peers had given up on (``gloo_twin``)."""


class TwinMakingFailed(RuntimeError):
    """Making a gloo twin failed on this rank (``gloo_twin``): the message is the store's or gloo's error;
    ``peer_failures`` (the group's rank -> its error) the peers that came and failed before their timeout."""

    def __init__(self, message: str, peer_failures: dict[int, str]) -> None:
        super().__init__(message)
        self.peer_failures = peer_failures


def twin_margin_s(timeout_s: float) -> float:
    """How much longer than ``timeout_s`` gloo itself waits on a twin: ``HostCollectives``' own wait must
    expire first (it names the late peer; gloo's timeout would end the op with an error that names none)."""
    return 2 * _grace_s(timeout_s) + 1.0


def registered(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still in torch's registry (``destroy_process_group`` takes it out)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def _digest(where: str) -> int:
    """A setup call's name as a non-negative int64, the same in every process (``hash`` is salted per
    process)."""
    return int.from_bytes(hashlib.blake2b(where.encode(), digest_size=8).digest(), "little") >> 1


def _read_post(value: bytes) -> tuple[int, str]:
    """A timeout post (``_read_posts``): (the call's number among its owner's collectives, where)."""
    number, _, where = value.decode().partition("|")
    return int(number), where


def _first_line(exc: BaseException) -> str:
    """An engine's error in one line (its first), or its type where it says nothing."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _ask_store(read: Callable[[], Any], limit_s: float) -> dict[str, Any]:
    """``read()`` (store calls) in a thread, waited for at most ``limit_s``: a store call has no bound of its own
    but the store's timeout (30 min by default), which a store host that stopped answering (frozen, cut off
    without a reset) would make every waiter sit out. Returns {"answer": what it returned}, {"error": its
    exception's name} (no store, or it went with a dead rank 0), or {} (no answer in time)."""
    outcome: dict[str, Any] = {}

    def ask() -> None:
        try:
            outcome["answer"] = read()
        except Exception as exc:  # noqa: BLE001 - the caller says what a missing answer means
            outcome["error"] = type(exc).__name__

    reader = threading.Thread(target=ask, name="ep_plugin store read", daemon=True)
    reader.start()
    reader.join(limit_s)
    return dict(outcome)


def _grace_s(timeout_s: float) -> float:
    """How long a rank that timed out waits for its peers' posts before it reports."""
    return min(2.0, max(0.2, 0.1 * timeout_s))


@contextlib.contextmanager
def between_exchanges(where: str, collectives: Iterable[HostCollectives]) -> Iterator[None]:
    """A stretch of an op after its agreed opening, where every rank runs the same collectives in one order. A
    rank that leaves it by an exception of its own (an allocation that failed, say) skipped some that its
    peers run: its next call would meet one of theirs (rows read as opening words, or gloo aborting on a
    size). So ``collectives`` refuse every later op on this rank, naming why (``mark_out_of_step``), and the
    peers time out in this op, naming this rank. Refusals that every rank raises alike (a disagreement, a
    refused input) belong outside such stretches: they leave the backend usable."""
    try:
        yield
    except BaseException as error:
        what = f"{where} was left midway on this rank by {type(error).__name__}: {_first_line(error)}"
        for owner in collectives:
            owner.mark_out_of_step(what)
        raise


class HostCollectives:
    """The collectives one owner (a backend, a construction check) runs on one process group.

    Args:
        group: the process group.
        owner: name used in messages ("ep_plugin reference").
        timeout_s: seconds one collective may wait for its peers.
        label: what the owner is; together with the group name and a per-process count it
            names this instance's posts in the store, so it must be opened in the same order on
            every rank (backends are built collectively, so they are).
        device: the owner's device; over NCCL the small words the host reads go there (see
            ``word_device``). None: the current GPU.
        on_host: the owner moves only small words the host reads (no payload, nothing a stream must
            order): on a group that moves no CPU tensors (NCCL), they go on its gloo twin (see the
            module docstring; the caller passes ``Config.gloo_host_words``). Making the twin is a
            collective of the group's ranks, timed like the others.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], *, owner: str, timeout_s: float, label: str,
                 device: Union[torch.device, str, None] = None, on_host: bool = False) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.owner = owner
        self.timeout_s = float(timeout_s)
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)
        self.engine = dist.get_backend(self.group)
        self.word_device = word_device(self.engine, device)
        group_name = getattr(self.group, "group_name", "group")
        opened = _sites.setdefault(self.group, Counter())
        opened[label] += 1
        # This owner's number among the owners of its kind opened on this group by this process,
        # from 1 (equal on every rank when ranks build their backends in the same order).
        self.instance = opened[label]
        self.site = f"{group_name}/{label}#{self.instance}"
        self.failed: Optional[str] = None  # set once a wait timed out or the engine failed
        # This owner's collectives so far: ranks in step are in the same one, so a peer's timeout post names the
        # call it gave up in, not only its name (a barrier's, say, is the same on every call).
        self._exchanges = 0
        self._device = device
        self._twin: Optional[GlooTwin] = None  # where the words go over the group's gloo twin (use_gloo_twin)
        self._unwrapped: dict[str, Optional[Any]] = {}  # device type -> the engine under torch's debug wrapper
        self._released = False
        if on_host and not moves_host_memory(self.engine):
            self.use_gloo_twin()

    def use_gloo_twin(self) -> None:
        """From now on, run on the gloo twin of the group (``gloo_twin``; a collective of its ranks), or stay
        on the group with a warning where this torch has no gloo. Raises EPTimeoutError naming the late peers
        when one does not arrive within the timeout, EPError when gloo cannot connect otherwise."""
        if not dist.is_gloo_available():
            warn_once(logger, ("no gloo twin", self.engine), "ep_plugin: this torch has no gloo, so the host words "
                      "of an %s group go over it: a peer that never arrives there leaves a kernel waiting on the "
                      "GPU, and the process's exit waits for it", self.engine)
            return
        start = time.monotonic()
        where = f"making a gloo group of the {self.engine} group's ranks for the host words"
        earlier = _failed_twin_makings.get(self.group)
        if earlier is not None:
            self.failed = f"an earlier making of the gloo twin failed ({earlier})"
            raise EPError(f"{self.owner}: {self.peer_name(self.rank)}: {where}: an earlier making of it failed in this "
                          f"process ({earlier}), and the ranks number their makings by a count that assumes "
                          f"every rank joined every one, so no later making can meet: end the job, or build a "
                          f"new process group (and the backends on it)")
        try:
            twin = gloo_twin(self.group, timeout_s=self.timeout_s)
        except TwinAbandoned as exc:
            _failed_twin_makings[self.group] = str(exc)
            self.failed = f"{where}: {exc}"
            raise EPError(f"{self.owner}: {self.peer_name(self.rank)}: {where}: {exc}. A rank built with "
                          f"EP_PLUGIN_GLOO_HOST_WORDS=0 never comes here (the knob must be equal on every rank), "
                          f"and a rank that came past timeout_s={self.timeout_s:g} finds the others gone: end the "
                          f"job, or build a new process group (and the backends on it)") from None
        except RuntimeError as exc:
            # A peer that never came: the store's wait or gloo's connect times out (DistStoreError or
            # "Connect timeout", by where it waited). Either way the posts say who is late.
            waited = time.monotonic() - start
            failures = getattr(exc, "peer_failures", {})
            if waited >= self.timeout_s and failures:  # not late: they came and failed, and said why
                said = "; ".join(f"{self.peer_name(q)}: {why}" for q, why in sorted(failures.items()))
                _failed_twin_makings[self.group] = f"it failed on {said}"
                self.failed = f"gloo failed in {where} on another rank"
                others = [q for q in range(self.num_ranks) if q != self.rank and q not in failures]
                report = self._report_peers(where, others) if others else ""
                raise EPError(f"{self.owner}: {self.peer_name(self.rank)}: {where}: waited {waited:.1f} s for peers "
                              f"that came and failed: {said}. {report + ' ' if report else ''}Where gloo cannot "
                              f"connect between these hosts, GLOO_SOCKET_IFNAME names the interface it should use; "
                              f"EP_PLUGIN_GLOO_HOST_WORDS=0 keeps the host words on the {self.engine} "
                              f"group.") from None
            if waited >= self.timeout_s:  # no collective ran on the group: this owner alone fails
                _failed_twin_makings[self.group] = f"timed out after {waited:.1f} s"
                report = self._timeout_error(where, waited, engine_out_of_step=False)
                raise EPTimeoutError(f"{report} A rank built with EP_PLUGIN_GLOO_HOST_WORDS=0 never comes here: the "
                                     "knob must be equal on every rank.") from None
            _failed_twin_makings[self.group] = f"gloo could not connect: {_first_line(exc)}"
            self.failed = f"gloo failed in {where}"
            raise EPError(f"{self.owner}: {self.peer_name(self.rank)}: {where}: gloo could not connect: "
                          f"{_first_line(exc)}. "
                          f"Where gloo cannot connect between these hosts, GLOO_SOCKET_IFNAME names the interface it "
                          f"should use; EP_PLUGIN_GLOO_HOST_WORDS=0 keeps the host words on the {self.engine} "
                          f"group.") from None
        self._twin, self.engine = twin, "gloo"
        self.word_device = word_device(self.engine, self._device)

    # ---- the collectives -------------------------------------------------------------

    def all_to_all(self, tensor: torch.Tensor, out_splits: list[int], in_splits: list[int], *, where: str,
                   read_on_host: bool = True, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``all_to_all_single`` along dim 0 with exact splits; returns the received tensor.

        Args:
            tensor: [sum(in_splits), ...] rows to send, on a device the engine moves.
            out_splits / in_splits: rows received from / sent to each rank.
            where: the op and phase, for messages ("dispatch #3 (payload)").
            read_on_host: the caller reads the result on the host next. Over NCCL only such
                collectives are waited here (with the timeout); others stay stream-ordered.
            out: contiguous [sum(out_splits), ...] tensor to receive into (default: a fresh one).
        """
        self.check_usable()
        if self._released:
            raise RuntimeError(f"{self.owner}: {where} after release() (the owner was destroyed)")
        if out is None:
            out = tensor.new_empty((sum(out_splits),) + tuple(tensor.shape[1:]))
        self._exchanges += 1
        try:
            if self._twin is not None:  # the twin is torch's gloo engine itself: its own call, its own timeout
                options = dist.AllToAllOptions()
                options.timeout = timedelta(seconds=self.timeout_s + twin_margin_s(self.timeout_s))
                work = self._twin.gloo.alltoall_base(out, tensor.contiguous(), out_splits, in_splits, options)
            elif (engine := self._engine_under_wrapper(tensor.device.type)) is not None:
                options = dist.AllToAllOptions()  # as dist.all_to_all_single(async_op=True): the group's timeout
                if hasattr(options, "asyncOp"):  # a torch before the flag returns async work anyway
                    options.asyncOp = True
                work = engine.alltoall_base(out, tensor.contiguous(), out_splits, in_splits, options)
            else:
                work = dist.all_to_all_single(out, tensor.contiguous(), out_splits, in_splits, group=self.group,
                                              async_op=True)
        except RuntimeError as exc:  # an engine that fails at issue time
            raise self._engine_error(where, exc) from None
        self._wait(work, where, nccl=tensor.is_cuda and nccl_moves_cuda(self.engine), read_on_host=read_on_host)
        return out

    def _engine_under_wrapper(self, device_type: str) -> Optional[Any]:
        """``unwrapped_backend`` of the group for tensors of ``device_type``, looked up once."""
        if device_type not in self._unwrapped:
            self._unwrapped[device_type] = unwrapped_backend(self.group, device_type)
        return self._unwrapped[device_type]

    def all_gather_object(self, obj: Any, *, where: str) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order: two timed all-to-alls on ``word_device`` (the
        sizes, framed as ``setup_frames`` says, then the bytes). ``where`` names the call, the same on every
        rank: a peer in another call raises EPError on every rank."""
        device = self.word_device
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        sizes = self.setup_frames(payload.numel(), where=where, phase="sizes")
        received = self.all_to_all(payload.repeat(self.num_ranks), sizes, [payload.numel()] * self.num_ranks,
                                   where=where).cpu()
        objects, start = [], 0
        for size in sizes:
            objects.append(pickle.loads(received[start:start + size].numpy().tobytes()))
            start += size
        return objects

    def barrier(self, *, where: str) -> None:
        """Return once every rank of the group reached this point: one timed all-to-all of a frame per peer
        (``setup_frames``; ``where`` names the call, the same on every rank)."""
        self.setup_frames(0, where=where)

    def setup_frames(self, count: int, *, where: str, phase: Optional[str] = None) -> list[int]:
        """The first exchange of a setup call (a gather, a barrier): FRAME_WORDS words to every peer, ``count``
        (what this rank sends next), SETUP_EXCHANGE, 0 and a digest of ``where``; returns each peer's count.

        Raises EPError on every rank that meets a peer in another call, before anything else moves: a peer
        running an op (reference's opening exchange of one frame) or in another setup call (a digest that
        differs; each rank's own message names its call). The group stays in step: every rank made one
        exchange of one size. ``phase``: what the exchange is within the call, for timeout messages."""
        digest = _digest(where)
        sent = torch.tensor([count, SETUP_EXCHANGE, 0, digest] * self.num_ranks, dtype=torch.int64,
                            device=self.word_device)
        frames = [FRAME_WORDS] * self.num_ranks
        label = where if phase is None else f"{where} ({phase})"
        rows = self.all_to_all(sent, frames, frames, where=label).view(self.num_ranks, FRAME_WORDS)
        rows = rows.tolist()
        in_ops = [q for q, row in enumerate(rows) if row[1] != SETUP_EXCHANGE]
        elsewhere = [q for q, row in enumerate(rows) if row[3] != digest]
        late = (in_ops or elsewhere) and self.came_late_error(where)
        if late:
            raise late
        if in_ops:
            from .agreement import OpFingerprint  # agreement imports this module

            q = in_ops[0]
            theirs = OpFingerprint.unpack(rows[q][1])
            raise EPError(f"{self.owner}: {self.peer_name(self.rank)} was in {where} (a setup step) while "
                          f"{self.peer_name(q)} ran a {theirs.op} op on a backend of this process group: the ranks "
                          f"issued different calls (an op on some ranks only, or a backend built on some ranks "
                          f"only). Peers in ops: {', '.join(self.peer_name(p) for p in in_ops)}.")
        if elsewhere:
            raise EPError(f"{self.owner}: {self.peer_name(self.rank)} was in {where} while "
                          f"{', '.join(self.peer_name(q) for q in elsewhere)} were in another setup step (each "
                          f"rank's own message names its step): the ranks build their backends in different "
                          f"orders, or with different arguments.")
        return [row[0] for row in rows]

    def came_late_error(self, where: str, others: Iterable["HostCollectives"] = (), *,
                        name_peer: Optional[Callable[["HostCollectives", int], str]] = None,
                        this_rank: Optional[str] = None) -> Optional[EPError]:
        """For a rank whose exchange in ``where`` met a peer in another call: EPError when a peer had given up
        waiting for this rank in a collective of this owner (or of ``others``, the owner's other collectives).
        That peer's abandoned collective is what this rank met, not a call of the peer's own: the ranks did not
        disagree, this rank came late. Marks the owners out of step (their next op refuses at once, as the
        peer's do). None when no peer gave up: the disagreement stands.
        ``name_peer(owner, q)`` names peer q of an owner's group, ``this_rank`` begins the message (an owner
        whose collectives run on subgroups names ranks as its own group knows them); by default the owner's."""
        name_peer = name_peer or (lambda owner, q: owner.peer_name(q))
        this_rank = this_rank or f"{self.owner}: {self.peer_name(self.rank)}"
        owners = list(dict.fromkeys((self, *others)))  # (one object may stand for two of the owner's roles)
        # Bounded as the timeout report's reads: a store host that stopped answering would hold this error for the
        # store's own timeout (30 min by default). No answer in time, or no store, reads as no posts.
        posts = _ask_store(lambda: [owner._posts_of_peers_that_gave_up() for owner in owners],
                           _STORE_ANSWER_S).get("answer") or [{}] * len(owners)
        gave_up: dict[str, str] = {}  # peer's name -> where it gave up
        for owner, owners_posts in zip(owners, posts, strict=True):
            for q, place in sorted(owners_posts.items()):
                gave_up.setdefault(name_peer(owner, q), place)
        if not gave_up:
            return None
        for owner in owners:
            owner.mark_out_of_step(f"came late to {where}")
        peers = "; ".join(f"{peer} timed out waiting for it, in {place}" for peer, place in gave_up.items())
        those = "that peer" if len(gave_up) == 1 else "those peers"
        return EPError(f"{this_rank} came late to {where} ({peers}): the exchange met "
                       f"what {those} left behind, not a call of its own. Raise EP_PLUGIN_TIMEOUT_S if this rank "
                       f"is only slow (a first step's compilation, a checkpoint save). {_OUT_OF_STEP}")

    def _posts_of_peers_that_gave_up(self) -> dict[int, str]:
        """peer -> where it timed out in one of this owner's collectives (its post, ``_read_posts``); a store call
        (``came_late_error`` bounds it)."""
        store = dist.distributed_c10d._get_default_store()
        key = f"ep_plugin/timeouts/{self.site}/"
        return {q: _read_post(store.get(key + str(q)))[1] for q in range(self.num_ranks)
                if q != self.rank and store.check([key + str(q)])}

    def release(self) -> None:
        """The owner is being destroyed: let go of the gloo twin (it goes with its last owner). No
        collective may follow."""
        self._twin, self._released = None, True

    def check_usable(self) -> None:
        if self.failed is not None:
            raise EPError(f"{self.owner}: {self.peer_name(self.rank)} cannot run more ops after an earlier failure "
                          f"({self.failed}). {_OUT_OF_STEP}")
        failed_there = _out_of_step.get(self._engine_object())
        if failed_there is not None:
            raise EPError(f"{self.owner}: {self.peer_name(self.rank)} cannot run more ops after an earlier failure on "
                          f"this process group ({failed_there}). {_OUT_OF_STEP}")

    def mark_out_of_step(self, what: str) -> None:
        """The owner's rank left an op between two of its collectives (an exception of its own, say): the
        peers run, or wait in, the ones it skipped, so its next collective would pair with one of theirs.
        From now on this owner, and every owner on the same engine in this process, refuses (``check_usable``);
        an earlier failure keeps its own text."""
        if self.failed is None:
            self._mark_failed(what)

    def _engine_object(self):
        """What the collectives run on: the gloo twin, or the process group itself."""
        return self._twin if self._twin is not None else self.group

    def _mark_failed(self, what: str) -> None:
        """This owner, and every owner on the same engine in this process, runs no more collectives."""
        self.failed = what
        _out_of_step.setdefault(self._engine_object(), f"{self.owner}: {what}")

    def peer_name(self, peer: int) -> str:
        """'rank 3', or 'rank 3 (global rank 7)' in a subgroup."""
        try:
            global_rank = dist.get_global_rank(self.group, peer)
        except (RuntimeError, ValueError):
            return f"rank {peer}"
        return f"rank {peer}" if global_rank == peer else f"rank {peer} (global rank {global_rank})"

    # ---- waits and reports -----------------------------------------------------------

    def _wait(self, work: dist.Work, where: str, *, nccl: bool, read_on_host: bool) -> None:
        if nccl and not read_on_host:
            try:
                work.wait()  # stream-ordered: the current stream waits for the op, the host does not
            except RuntimeError as exc:
                raise self._engine_error(where, exc) from None
            return
        start = time.monotonic()
        deadline = start + self.timeout_s
        if not nccl:  # gloo (CPU tensors, or CUDA tensors staged through the host)
            try:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
                return
            except RuntimeError as exc:
                if work.is_completed() and "timed out" in str(exc).lower():
                    # The process group's own timeout, shorter than ours, ended the wait: a late peer all the
                    # same, so report it as one (naming it), not as an engine failure.
                    raise self._timeout_error(where, time.monotonic() - start, engine_timeout=True) from None
                if work.is_completed():  # finished, with the engine's own error
                    raise self._engine_error(where, exc) from None
                # else gloo's "Operation timed out!": the op is still queued; report below
        else:
            pause = 20e-6
            while not work.is_completed():
                if time.monotonic() > deadline:
                    break
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
            else:
                try:
                    work.wait()
                    return
                except RuntimeError as exc:
                    raise self._engine_error(where, exc) from None
        raise self._timeout_error(where, time.monotonic() - start)

    def _engine_error(self, where: str, exc: BaseException) -> EPError:
        self._mark_failed(f"{self.engine} failed in {where}")
        message = _first_line(exc)
        # The engine names a peer by its address at most: the ranks that failed here post it, so the one that
        # did not is named (a peer that exited, most often).
        report = self._report_peers(where, [q for q in range(self.num_ranks) if q != self.rank], engine_error=True)
        return EPError(f"{self.owner}: {self.peer_name(self.rank)}: {where} failed in {self.engine}: {message}. "
                       f"{report + ' ' if report else ''}A peer probably exited or ran a different collective on this "
                       f"process group. {_OUT_OF_STEP}")

    def _timeout_error(self, where: str, waited_s: float, *, engine_out_of_step: bool = True,
                       engine_timeout: bool = False) -> EPTimeoutError:
        """``engine_out_of_step``: a collective was left behind on the engine (not so for the twin's making,
        which runs none on the group): every owner on it refuses from now on. ``engine_timeout``: the process
        group's own, shorter, timeout ended the wait."""
        if engine_out_of_step:
            self._mark_failed(f"timed out in {where}")
        else:
            self.failed = f"timed out in {where}"
        peers = [q for q in range(self.num_ranks) if q != self.rank]
        report = self._report_peers(where, peers)
        limit = (f"the process group's own timeout, shorter than timeout_s={self.timeout_s:g} (EP_PLUGIN_TIMEOUT_S), "
                 "ended the wait; give the group a timeout of at least that (init_process_group / new_group "
                 "timeout=)" if engine_timeout else f"timeout_s={self.timeout_s:g}, EP_PLUGIN_TIMEOUT_S")
        return EPTimeoutError(
            f"{self.owner}: {self.peer_name(self.rank)} timed out after {waited_s:.1f} s ({limit}) in {where} over "
            f"{self.engine}. {report} Raise EP_PLUGIN_TIMEOUT_S if the peers are only slow. {_OUT_OF_STEP}")

    def _waits_elsewhere(self, store, peers: list[int], grace: float) -> dict[int, str]:
        """Of ``peers`` (none of which posted a wait here), those that timed out in another group's collective
        about now (their post by global rank): peer -> where."""
        found = {}
        for q in peers:
            try:
                global_rank = dist.get_global_rank(self.group, q)
            except (RuntimeError, ValueError):
                global_rank = q
            name = f"{_WAITS_BY_GLOBAL_RANK}{global_rank}"
            if not store.check([name]):
                continue
            stamp, place = store.get(name).decode().split("|", 1)
            if time.time() - float(stamp) < self.timeout_s + 2 * grace + 10.0:  # this wait, not an old one
                found[q] = place
        return found

    def _read_posts(self, where: str, peers: list[int],
                    grace: float) -> tuple[dict[int, tuple[int, str]], dict[int, str]]:
        """Post where this rank gave up (the call's number among this owner's collectives, and its name), then
        read the peers' posts for up to ``grace`` seconds: (peer -> (number, where) it posted here, peer ->
        where it waits in another group)."""
        store = dist.distributed_c10d._get_default_store()
        key = f"ep_plugin/timeouts/{self.site}/"
        store.set(key + str(self.rank), f"{self._exchanges}|{where}")
        # Also by global rank, with the time: a rank that blames this one in another group (a domain peer
        # of a rank stuck on its rail) learns where this one waits, and for whom.
        store.set(f"{_WAITS_BY_GLOBAL_RANK}{dist.get_rank()}", f"{time.time():.3f}|{where} ({self.owner})")
        deadline = time.monotonic() + grace
        while True:
            posted = [q for q in peers if store.check([key + str(q)])]
            if len(posted) == len(peers) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        places = {q: _read_post(store.get(key + str(q))) for q in posted}
        return places, self._waits_elsewhere(store, [q for q in peers if q not in places], grace)

    def _report_peers(self, where: str, peers: list[int], *, engine_error: bool = False) -> str:
        """Which peers are late, from the posts of the ranks that timed out (see the module docstring);
        ``engine_error``: of the ranks whose engine failed here, which did not say so."""
        if not peers:
            return ""
        grace = _grace_s(self.timeout_s)
        # Bounded (_ask_store): a store host that stopped answering would hold the report that long after the
        # timeout it reports; the error comes when the store is not back in time.
        limit_s = 2 * grace + _STORE_ANSWER_S
        outcome = _ask_store(lambda: self._read_posts(where, peers, grace), limit_s)
        if "answer" not in outcome:
            names = ", ".join(self.peer_name(q) for q in peers)
            why = (f"the store could not be asked ({outcome['error']})" if "error" in outcome else
                   f"the store did not answer within {limit_s:.1f} s (its host stopped or cannot be reached)")
            return f"{self.engine} does not say which peer is missing, and {why}; any of {names} may be late."
        places, waits_elsewhere = outcome["answer"]
        late = [q for q in peers if q not in places and q not in waits_elsewhere]
        # Waiting here: the same call, not one of the same name that peer gave up in before (a barrier's).
        waiting = [q for q in peers if places.get(q) == (self._exchanges, where)]
        elsewhere = [q for q in peers if q in places and q not in waiting]
        parts = []
        if late and engine_error:
            parts.append(f"No report from {', '.join(self.peer_name(q) for q in late)} within {grace:.1f} s of this "
                         f"rank's failure in {where} (exited, or busy elsewhere).")
        elif late:
            parts.append(f"Late peer(s): {', '.join(self.peer_name(q) for q in late)} (no wait reported in {where} "
                         f"within {grace:.1f} s of this rank's timeout: they came late or never: stopped calling "
                         f"ep_plugin, busy elsewhere, or dead).")
        for q in elsewhere:
            parts.append(f"{self.peer_name(q)} gave up earlier, in {places[q][1]}"
                         f"{' (an earlier call of that name)' if places[q][1] == where else ''}.")
        for q, place in waits_elsewhere.items():
            parts.append(f"{self.peer_name(q)} did not come because it waits elsewhere itself, in {place}: its "
                         f"own error names whom it waits for.")
        if waiting:
            parts.append(f"{'Failed' if engine_error else 'Waiting'} here too: "
                         f"{', '.join(self.peer_name(q) for q in waiting)}.")
        return " ".join(parts)
