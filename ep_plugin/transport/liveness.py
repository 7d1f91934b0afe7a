"""Whether the peers' processes still run, so that a device wait for a rank that exited stops at once.

A rank whose process ends (an exception, out of memory, a kill) leaves its peers' kernels waiting for
flags it will never write: without help they report only when ``timeout_s`` runs out (100 s by
default), as a timeout. So each rank's symmetric buffer registers its peers' process identities here,
and one daemon thread per process watches them. When a peer's process is gone it marks that rank in
the buffer's mapped report (``mark_peer_exited``); the device waits for that rank poll the mark and
stop, and the host raises ``EPError`` saying which rank exited.

How the thread learns of an exit: from a pidfd per peer (Linux 5.3+), which the kernel makes readable
when the process exits; the thread sleeps in ``poll`` until then and costs nothing while the peers run.
Where a pidfd cannot be had, it looks at /proc every ``peer_watch_s`` seconds instead.

Only peers on this host in this PID namespace can be watched (same boot id and namespace: /proc then
shows their processes); the start time recorded with the pid guards against a reused pid. Other peers
keep the plain timeout. A zombie (exited, not yet reaped by its launcher) counts as gone: its pidfd is
readable, and /proc says 'Z' (a /proc that hides other users' processes does not say; without a pidfd such a
zombie then counts as running until it is reaped).
"""

from __future__ import annotations

import functools
import os
import select
import threading
import weakref
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ProcessIdentity:
    """Who a rank's process is: enough to find it in /proc and to tell it from a later one with its pid."""

    boot_id: str       # /proc/sys/kernel/random/boot_id: the host (and its boot)
    pid_namespace: int  # inode of /proc/self/ns/pid: pids mean the same only within one namespace
    pid: int
    start_ticks: int    # field 22 of /proc/<pid>/stat: when the process started, in clock ticks

    def watchable_from(self, here: "ProcessIdentity") -> bool:
        return bool(self.boot_id) and (self.boot_id, self.pid_namespace) == (here.boot_id, here.pid_namespace)


def own_identity() -> ProcessIdentity:
    """This process's identity (boot id "" where /proc does not say: then no peer is watched)."""
    pid = os.getpid()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        pid_namespace = os.stat("/proc/self/ns/pid").st_ino
        _, start_ticks = _stat_fields(pid)
    except (OSError, ValueError):
        return ProcessIdentity("", 0, pid, 0)
    return ProcessIdentity(boot_id, pid_namespace, pid, start_ticks)


def is_running(identity: ProcessIdentity) -> bool:
    """Whether that process still runs (not exited, not a zombie, not a new process with its pid)."""
    try:
        state, start_ticks = _stat_fields(identity.pid)
    except (FileNotFoundError, PermissionError):
        # Gone, or hidden: a /proc mounted with hidepid shows only this user's processes (hidepid=2
        # leaves no entry: ENOENT; hidepid=1 lists it but refuses it: EPERM). Ask the kernel (a
        # signal 0 checks the pid exists); a hidden peer then counts as running, unchecked for a
        # reused pid, rather than as exited while it runs.
        return _pid_exists(identity.pid)
    except (OSError, ValueError):
        return False
    return state not in ("Z", "X", "x") and start_ticks == identity.start_ticks


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only checks; PermissionError means another user's process, which exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _stat_fields(pid: int) -> tuple[str, int]:
    """(state, start time in ticks) from /proc/<pid>/stat. The command name may hold spaces and
    parentheses, so the fields are counted from the last ')'."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)


class PeerWatch:
    """The watching thread and what it watches.

    ``watch(buffer, peers, interval_s)`` registers a buffer (anything with ``mark_peer_exited(rank)``,
    held weakly) and its peers (rank -> identity); ``unwatch(buffer)`` removes it, and once it returns
    the thread will not touch that buffer again (call it before the buffer's memory is freed).
    ``exited(buffer)`` is what was found. ``interval_s`` paces the /proc looks at peers without a pidfd.
    """

    def __init__(self) -> None:
        self._start_afresh()
        # A forked child (a DataLoader worker, say) has no watch thread, and the lock may have been held
        # by it at the fork (the child then blocked forever on its first watch): the child starts afresh.
        os.register_at_fork(after_in_child=functools.partial(_start_afresh_in_child, weakref.ref(self)))

    def _start_afresh(self) -> None:
        # Reentrant: a buffer's weakref callback (``_forget``) may run in the thread itself, which holds
        # the lock while it marks, when the last reference to a buffer goes there.
        self._lock = threading.RLock()
        self._buffers: dict[int, weakref.ref] = {}
        self._looked_at: dict[int, tuple[dict[int, ProcessIdentity], float]] = {}  # peers without a pidfd
        self._pidfds: dict[int, tuple[int, int, ProcessIdentity]] = {}  # fd -> (buffer key, rank, identity)
        self._exited: dict[int, dict[int, ProcessIdentity]] = {}
        self._thread: Optional[threading.Thread] = None
        self._wake_read, self._wake_write = -1, -1

    def watch(self, buffer, peers: dict[int, ProcessIdentity], interval_s: float) -> None:
        if not peers or interval_s <= 0:
            return
        key = id(buffer)
        with self._lock:
            self._buffers[key] = weakref.ref(buffer, lambda _, key=key: self._forget(key))
            self._exited[key] = {}
            looked_at = {}
            for rank, identity in peers.items():
                fd = _pidfd(identity)
                if fd is not None and not is_running(identity):  # gone already, or its pid names another
                    os.close(fd)                                  # process now: a pidfd would never tell
                    fd = None
                if fd is None:
                    looked_at[rank] = identity
                else:
                    self._pidfds[fd] = (key, rank, identity)
            if looked_at:
                self._looked_at[key] = (looked_at, float(interval_s))
            if self._wake_read < 0:  # one pipe for good: a thread that died is restarted below with it
                self._wake_read, self._wake_write = os.pipe()
                os.set_blocking(self._wake_read, False)
                os.set_blocking(self._wake_write, False)  # a full pipe already wakes the thread
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ep_plugin peer watch", daemon=True)
                self._thread.start()
            self._wake()

    def unwatch(self, buffer) -> None:
        self._forget(id(buffer))

    def exited(self, buffer) -> dict[int, ProcessIdentity]:
        """Peers of ``buffer`` whose processes were found gone: rank -> identity."""
        with self._lock:
            return dict(self._exited.get(id(buffer), {}))

    def _forget(self, key: int) -> None:
        with self._lock:
            self._buffers.pop(key, None)
            self._looked_at.pop(key, None)
            self._exited.pop(key, None)
            for fd in [fd for fd, (owner, _, _) in self._pidfds.items() if owner == key]:
                del self._pidfds[fd]
                os.close(fd)
            self._wake()

    def _forget_parents_buffers(self) -> None:
        """In a forked child: the buffers and pidfds are the parent's (the child must not mark its copies
        of them), and so is the wake pipe (a write would wake the parent's thread)."""
        for fd in [*self._pidfds, self._wake_read, self._wake_write]:
            if fd >= 0:
                os.close(fd)
        self._start_afresh()

    def _wake(self) -> None:
        """Make the thread rebuild its poll set (the watched peers changed)."""
        if self._wake_write >= 0:
            try:
                os.write(self._wake_write, b"x")
            except BlockingIOError:
                pass

    def _run(self) -> None:
        while True:
            with self._lock:
                poller = select.poll()
                poller.register(self._wake_read, select.POLLIN)
                for fd in self._pidfds:
                    poller.register(fd, select.POLLIN)
                intervals = [interval for _, interval in self._looked_at.values()]
            timeout_ms = min(1000 * min(intervals), _LONGEST_POLL_MS) if intervals else None
            ready = poller.poll(timeout_ms)  # sleeps without the GIL
            with self._lock:
                try:
                    os.read(self._wake_read, 4096)
                except BlockingIOError:
                    pass
                # Marks happen under the lock, so unwatch() returning means no mark is under way; a fd is
                # resolved now (not from the poll set: it may have been closed and reused since, for another
                # peer's pidfd) and asked again. A readable pidfd is the kernel's word that its own process
                # exited, trusted as is: a zombie under a /proc mounted with hidepid reads as running
                # (kill(pid, 0) still finds it), and the thread spun on its readable pidfd without a mark.
                for fd, _ in ready:
                    entry = self._pidfds.get(fd)
                    if entry is not None and _pidfd_says_exited(fd):
                        del self._pidfds[fd]
                        os.close(fd)
                        self._mark(entry[0], entry[1], entry[2])
                for key, (peers, _) in list(self._looked_at.items()):
                    for rank, identity in list(peers.items()):
                        if not is_running(identity):
                            del peers[rank]
                            self._mark(key, rank, identity)
                    if not peers:  # nothing left to look at: no more timed wake-ups for this buffer
                        self._looked_at.pop(key, None)

    def _mark(self, key: int, rank: int, identity: ProcessIdentity) -> None:
        ref = self._buffers.get(key)
        buffer = ref() if ref is not None else None
        if buffer is not None:
            self._exited.setdefault(key, {})[rank] = identity
            buffer.mark_peer_exited(rank)


def _start_afresh_in_child(watch_ref: weakref.ref) -> None:
    watch = watch_ref()
    if watch is not None:
        watch._forget_parents_buffers()


def _pidfd(identity: ProcessIdentity) -> Optional[int]:
    """A pidfd of that process's pid (readable once it exits), or None where there is none to have."""
    try:
        return os.pidfd_open(identity.pid)
    except (AttributeError, OSError):  # no pidfd_open (old kernel or Python, not Linux), or no such pid
        return None


def _pidfd_says_exited(fd: int) -> bool:
    """Whether the process of that pidfd has exited (the kernel makes the fd readable then), without waiting."""
    checker = select.poll()
    checker.register(fd, select.POLLIN)
    return any(events & (select.POLLIN | select.POLLHUP) for _, events in checker.poll(0))


# poll takes a C int of milliseconds (24.8 days); a longer peer_watch_s raised OverflowError in the
# thread, which ended it and with it the watch of every buffer.
_LONGEST_POLL_MS = 2**31 - 1

WATCH = PeerWatch()  # one thread per process, whatever the number of buffers
