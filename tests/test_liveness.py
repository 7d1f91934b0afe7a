"""The peers' liveness watch (``ep_plugin.transport.liveness``) on real processes: what counts as running
(a zombie and a reused pid do not), which peers can be watched, and the watching thread, which must mark
a buffer's peer once its process is gone and never touch a buffer after ``unwatch`` returned. The
device side (a wait that stops at the mark) is tested on the GPU: test_faults_gpu.py ``exited_rank``."""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ep_plugin.transport import liveness
from ep_plugin.transport.liveness import PeerWatch, ProcessIdentity, is_running, own_identity

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def child_identity(child: subprocess.Popen) -> ProcessIdentity:
    """The identity the child would have sent (same host and namespace as this process)."""
    with open(f"/proc/{child.pid}/stat") as f:
        text = f.read()
    start_ticks = int(text[text.rindex(")") + 2:].split()[19])
    return dataclasses.replace(own_identity(), pid=child.pid, start_ticks=start_ticks)


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


class RecordingBuffer:
    """Stands in for a SymmetricBuffer: records the ranks marked, and from which thread."""

    def __init__(self) -> None:
        self.marked: list[int] = []
        self.threads: set[str] = set()

    def mark_peer_exited(self, rank: int) -> None:
        self.marked.append(rank)
        self.threads.add(threading.current_thread().name)


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_a_process_runs_until_it_exits_and_a_zombie_or_a_reused_pid_is_not_it():
    here = own_identity()
    assert here.boot_id and here.start_ticks > 0 and is_running(here)
    child = sleeper()
    try:
        identity = child_identity(child)
        assert is_running(identity)
        assert not is_running(dataclasses.replace(identity, start_ticks=identity.start_ticks + 1))  # pid reused
        child.kill()
        assert wait_until(lambda: not is_running(identity))  # a zombie: not reaped yet (no wait() so far)
        with open(f"/proc/{child.pid}/stat") as f:
            assert ") Z " in f.read()
    finally:
        child.kill()
        child.wait()
    assert not is_running(identity)  # reaped: no /proc entry


@pytest.mark.parametrize("hidepid", [2, 1])
def test_a_process_that_proc_hides_counts_as_running_until_its_pid_is_gone(monkeypatch, hidepid):
    """/proc mounted with hidepid hides other users' processes: hidepid=2 leaves no /proc/<pid> entry
    (open raises FileNotFoundError), hidepid=1 lists it but refuses it (PermissionError, EPERM). A peer
    run by another user must not read as exited while it runs (its peers' waits would stop with a false
    'has exited'); once its pid is gone it is."""
    child = sleeper()
    try:
        identity = child_identity(child)

        def hidden(pid):
            path = f"/proc/{pid}/stat"
            raise FileNotFoundError(2, "No such file or directory", path) if hidepid == 2 else \
                PermissionError(1, "Operation not permitted", path)
        monkeypatch.setattr(liveness, "_stat_fields", hidden)
        assert is_running(identity)
        child.kill()
        child.wait()
        assert not is_running(identity)
    finally:
        child.kill()
        child.wait()


def test_a_zombie_that_proc_hides_is_marked_by_its_pidfd(monkeypatch):
    """A peer run by another user under a /proc mounted with hidepid=1 exits and stays a zombie (its launcher
    has not reaped it): its pidfd is readable, but /proc refuses its stat and kill(pid, 0) still finds it.
    Before: the thread asked is_running, which said running, so it never marked the peer and woke again at
    once on the readable pidfd, spinning a core until the zombie was reaped."""
    child = sleeper()
    real = liveness._stat_fields  # noqa: SLF001
    looks = []

    def hidden(pid):
        if pid != child.pid:
            return real(pid)
        looks.append(pid)
        raise PermissionError(1, "Operation not permitted", f"/proc/{pid}/stat")

    monkeypatch.setattr(liveness, "_stat_fields", hidden)
    watch, buffer = PeerWatch(), RecordingBuffer()
    try:
        identity = child_identity(child)
        watch.watch(buffer, {1: identity}, interval_s=0.05)
        if not watch._pidfds:  # noqa: SLF001
            pytest.skip("no pidfd here (Linux < 5.3 or Python < 3.9)")
        child.kill()
        assert wait_until(lambda: buffer.marked == [1]), (buffer.marked, len(looks))
        assert is_running(identity), "the zombie must still read as running, or this tests nothing"
        looks.clear()
        time.sleep(0.3)
        assert looks == [] and watch._pidfds == {}, len(looks)  # noqa: SLF001 - out of the poll set: no spin
    finally:
        watch.unwatch(buffer)
        child.kill()
        child.wait()


def test_only_peers_on_this_host_and_pid_namespace_are_watchable():
    here = own_identity()
    assert here.watchable_from(here)
    assert not dataclasses.replace(here, boot_id="another-host").watchable_from(here)
    assert not dataclasses.replace(here, pid_namespace=here.pid_namespace + 1).watchable_from(here)
    assert not dataclasses.replace(here, boot_id="").watchable_from(dataclasses.replace(here, boot_id=""))


def test_the_watch_marks_the_peer_whose_process_exited_and_only_that_one():
    watch, buffer = PeerWatch(), RecordingBuffer()
    child = sleeper()
    try:
        watch.watch(buffer, {1: own_identity(), 3: child_identity(child)}, interval_s=0.05)
        time.sleep(0.3)
        assert buffer.marked == []  # both run
        child.kill()
        assert wait_until(lambda: buffer.marked == [3]), buffer.marked
        time.sleep(0.2)
        assert buffer.marked == [3]  # marked once
        assert set(watch.exited(buffer)) == {3} and buffer.threads == {"ep_plugin peer watch"}
    finally:
        watch.unwatch(buffer)
        child.kill()
        child.wait()


def test_with_pidfds_the_thread_sleeps_until_an_exit(monkeypatch):
    """No look at /proc while the peers run (the kernel wakes the thread), then one for the exit."""
    looks = []
    monkeypatch.setattr(liveness, "is_running", lambda identity: looks.append(identity.pid) or is_running(identity))
    watch, buffer = PeerWatch(), RecordingBuffer()
    child = sleeper()
    try:
        watch.watch(buffer, {1: child_identity(child)}, interval_s=0.02)
        time.sleep(0.3)
        assert looks == [child.pid]  # the check after opening its pidfd, none since
        child.kill()
        assert wait_until(lambda: buffer.marked == [1]), buffer.marked
    finally:
        watch.unwatch(buffer)
        child.kill()
        child.wait()


def test_without_pidfds_the_thread_looks_every_interval(monkeypatch):
    def no_pidfd(pid):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(liveness.os, "pidfd_open", no_pidfd)
    watch, buffer = PeerWatch(), RecordingBuffer()
    child = sleeper()
    try:
        watch.watch(buffer, {1: own_identity(), 2: child_identity(child)}, interval_s=0.05)
        time.sleep(0.2)
        assert buffer.marked == [] and watch._pidfds == {}  # noqa: SLF001
        child.kill()
        assert wait_until(lambda: buffer.marked == [2]), buffer.marked
        watch.unwatch(buffer)
        other = RecordingBuffer()  # a buffer whose only looked-at peer is gone: no timed wake-ups after it
        watch.watch(other, {4: child_identity(child)}, interval_s=0.05)
        assert wait_until(lambda: other.marked == [4] and watch._looked_at == {}), watch._looked_at  # noqa: SLF001
    finally:
        watch.unwatch(buffer)
        child.kill()
        child.wait()


def test_a_peer_gone_before_the_watch_began_is_marked():
    watch, buffer = PeerWatch(), RecordingBuffer()
    child = sleeper()
    identity = child_identity(child)
    child.kill()
    child.wait()
    try:
        watch.watch(buffer, {5: identity}, interval_s=0.05)
        assert wait_until(lambda: buffer.marked == [5]), buffer.marked
    finally:
        watch.unwatch(buffer)


def test_no_mark_after_unwatch_and_a_collected_buffer_is_forgotten():
    watch, buffer = PeerWatch(), RecordingBuffer()
    child = sleeper()
    try:
        watch.watch(buffer, {2: child_identity(child)}, interval_s=0.02)
        time.sleep(0.1)
        watch.unwatch(buffer)
        child.kill()
        time.sleep(0.3)
        assert buffer.marked == []
    finally:
        child.kill()
        child.wait()
    other = RecordingBuffer()
    watch.watch(other, {1: own_identity()}, interval_s=0.02)
    del other
    gc.collect()
    assert watch._buffers == {} and watch._pidfds == {}  # noqa: SLF001 - the registry is what this checks


def test_nothing_to_watch_starts_no_thread():
    watch = PeerWatch()
    watch.watch(RecordingBuffer(), {}, interval_s=0.5)
    watch.watch(RecordingBuffer(), {1: own_identity()}, interval_s=0)  # peer_watch_s = 0: off
    assert watch._thread is None  # noqa: SLF001


def test_a_very_long_interval_keeps_the_thread_watching(monkeypatch):
    """peer_watch_s may be any finite number, but poll takes at most 2**31 - 1 ms: a longer wait killed
    the thread (OverflowError), and every restart of it, so no buffer's peers were watched any more."""
    pidfds_fail = [True]
    real_pidfd_open = liveness.os.pidfd_open

    def pidfd_open(pid):
        if pidfds_fail[0]:
            raise OSError(38, "Function not implemented")
        return real_pidfd_open(pid)

    monkeypatch.setattr(liveness.os, "pidfd_open", pidfd_open)
    watch, looked_at, polled = PeerWatch(), RecordingBuffer(), RecordingBuffer()
    first, second = sleeper(), sleeper()
    try:
        watch.watch(looked_at, {1: child_identity(first)}, interval_s=1e7)  # a look every 116 days
        pidfds_fail[0] = False
        watch.watch(polled, {2: child_identity(second)}, interval_s=1e7)
        second.kill()
        assert wait_until(lambda: polled.marked == [2]), polled.marked
        assert watch._thread.is_alive()  # noqa: SLF001
    finally:
        watch.unwatch(looked_at)
        watch.unwatch(polled)
        for child in (first, second):
            child.kill()
            child.wait()


class SlowBuffer(RecordingBuffer):
    """Its mark takes a second, during which the watch thread holds the watch's lock."""

    def mark_peer_exited(self, rank: int) -> None:
        super().mark_peer_exited(rank)
        time.sleep(1.0)


def test_a_forked_child_starts_afresh_even_when_the_thread_held_the_lock():
    """A process forked while the thread marks (a DataLoader worker, say): the child's own buffer is
    watched (its first watch blocked forever on the lock the parent's thread held at the fork) and its
    copies of the parent's buffers are not marked (they are the parent's)."""
    watch, inherited = PeerWatch(), SlowBuffer()
    first, second = sleeper(), sleeper()
    try:
        watch.watch(inherited, {1: child_identity(first), 2: child_identity(second)}, interval_s=0.05)
        first.kill()
        assert wait_until(lambda: inherited.marked == [1])  # the thread is in the slow mark now
        pid = os.fork()
        if pid == 0:  # the child answers with its exit status and never returns into pytest
            status = 1
            try:
                signal.alarm(10)  # a deadlocked child ends here
                own, third = RecordingBuffer(), sleeper()
                watch.watch(own, {4: child_identity(third)}, interval_s=0.05)
                third.kill()
                os.kill(second.pid, signal.SIGKILL)  # (Popen.kill does nothing in the child)
                watched = wait_until(lambda: own.marked == [4])
                time.sleep(0.3)
                status = 0 if watched and inherited.marked == [1] else 2
            finally:
                os._exit(status)
        _, wait_status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(wait_status) == 0
        assert wait_until(lambda: inherited.marked == [1, 2])  # the parent's thread goes on
    finally:
        watch.unwatch(inherited)
        for child in (first, second):
            child.kill()
            child.wait()


class FailingBuffer(RecordingBuffer):
    def mark_peer_exited(self, rank: int) -> None:
        raise RuntimeError("this buffer's mark fails")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_that_died_is_restarted_by_the_next_watch_without_a_new_pipe():
    """An exception in the thread ends it (the traceback goes to stderr); the next watch starts it again,
    with the same wake pipe (a new pipe each time left the old one's two fds open)."""
    watch, failing, later = PeerWatch(), FailingBuffer(), RecordingBuffer()
    first, second = sleeper(), sleeper()
    try:
        watch.watch(failing, {1: child_identity(first)}, interval_s=0.05)
        fds_with_the_thread = open_fds()
        first.kill()
        assert wait_until(lambda: not watch._thread.is_alive())  # noqa: SLF001
        watch.watch(later, {2: child_identity(second)}, interval_s=0.05)
        second.kill()
        assert wait_until(lambda: later.marked == [2]), later.marked
        assert open_fds() == fds_with_the_thread - 1  # both pidfds closed (one pidfd fewer), no new pipe
    finally:
        watch.unwatch(failing)
        watch.unwatch(later)
        for child in (first, second):
            child.kill()
            child.wait()
