"""Whether the peers' processes still run, so that a device wait for a rank that exited stops at once.

A rank whose process ends (an exception, out of memory, a kill) leaves its peers' kernels waiting for
flags it will never write: without help they report only when ``timeout_s`` runs out (100 s by
default), as a timeout. So each rank's symmetric buffer registers its peers' process identities here,
and one daemon thread per process looks at them every ``peer_watch_s`` seconds. When a peer's process
is gone it marks that rank in the buffer's mapped report (``mark_peer_exited``); the device waits for
that rank poll the mark and stop, and the host raises ``EPError`` saying which rank exited.

Only peers on this host in this PID namespace can be watched (same boot id and namespace: /proc then
shows their processes); the start time recorded with the pid guards against a reused pid. Other peers
keep the plain timeout. A zombie (exited, not yet reaped by its launcher) counts as gone. The thread
reads one small /proc file per watched peer per round and sleeps in between.
"""

from __future__ import annotations

import os
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
    except (OSError, ValueError):
        return False
    return state not in ("Z", "X", "x") and start_ticks == identity.start_ticks


def _stat_fields(pid: int) -> tuple[str, int]:
    """(state, start time in ticks) from /proc/<pid>/stat. The command name may hold spaces and
    parentheses, so the fields are counted from the last ')'."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)


class PeerWatch:
    """The watching thread and what it watches: per buffer, rank -> identity of the peers not yet seen gone.

    ``watch(buffer, peers, interval_s)`` registers a buffer (anything with ``mark_peer_exited(rank)``,
    held weakly); ``unwatch(buffer)`` removes it, and once it returns the thread will not touch that
    buffer again (call it before the buffer's memory is freed). ``exited(buffer)`` is what was found.
    """

    def __init__(self) -> None:
        # Reentrant: a buffer's weakref callback (``_forget``) may run in the thread itself, which holds
        # the lock while it looks, when the last reference to a buffer goes there.
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._watched: dict[int, tuple[weakref.ref, dict[int, ProcessIdentity], float]] = {}
        self._exited: dict[int, dict[int, ProcessIdentity]] = {}
        self._thread: Optional[threading.Thread] = None

    def watch(self, buffer, peers: dict[int, ProcessIdentity], interval_s: float) -> None:
        if not peers or interval_s <= 0:
            return
        key = id(buffer)
        with self._lock:
            self._watched[key] = (weakref.ref(buffer, lambda _, key=key: self._forget(key)), dict(peers),
                                  float(interval_s))
            self._exited[key] = {}
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ep_plugin peer watch", daemon=True)
                self._thread.start()
            self._wake.notify()

    def unwatch(self, buffer) -> None:
        self._forget(id(buffer))

    def exited(self, buffer) -> dict[int, ProcessIdentity]:
        """Peers of ``buffer`` whose processes were found gone: rank -> identity."""
        with self._lock:
            return dict(self._exited.get(id(buffer), {}))

    def _forget(self, key: int) -> None:
        with self._lock:
            self._watched.pop(key, None)

    def _run(self) -> None:
        with self._lock:
            while True:
                if not self._watched:
                    self._wake.wait()  # until a buffer is watched again
                    continue
                self._wake.wait(timeout=min(interval for _, _, interval in self._watched.values()))
                # The marks happen under the lock, so unwatch() returning means no mark is under way.
                for key, (ref, peers, _) in list(self._watched.items()):
                    buffer = ref()
                    if buffer is None:
                        continue
                    for rank, identity in list(peers.items()):
                        if not is_running(identity):
                            del peers[rank]
                            self._exited.setdefault(key, {})[rank] = identity
                            buffer.mark_peer_exited(rank)


WATCH = PeerWatch()  # one thread per process, whatever the number of buffers
