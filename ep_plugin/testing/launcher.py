"""Run a function on N ranks, each a separate process with a real torch.distributed group.

Placement (``plan_launch``):
- device "cpu": N CPU processes over gloo;
- device "cuda", N <= GPUs: one rank per GPU over NCCL;
- device "cuda", N > GPUs: ranks share GPUs round-robin over gloo, under a private MPS
  daemon that the launcher starts and stops itself; ``placement="block"`` puts consecutive ranks
  on one GPU instead (ranks 0..N/G-1 on GPU 0, ...): one NVLink domain per GPU, so that forced
  domains of N/G ranks have one rank per GPU on every rail (NCCL rails).

``fn(ctx, *args)`` must be a module-level function; its return value (picklable) comes
back in a list indexed by rank. An exception on any rank raises here with that rank's
traceback; a rank that exits without reporting a result is named at once; a rank that does
not finish within ``timeout_s`` is killed and reported.
CPU ranks are capped at ``max_cpu_ranks()`` (``CPU_RANKS_PER_CORE`` per core); GPU runs are not.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from ..errors import EPError, EPTimeoutError

# Each CPU rank is a process with its own torch (about 300 MB) and a gloo connection to every other
# rank; past a few per core they mostly wait for one. On 2 cores 10 demo steps took 19 s on 8 ranks,
# 53 s on 16 and 2 min on 32; 512 would take well over half an hour and about 170 GB (extrapolated).
CPU_RANKS_PER_CORE = 8
# How long a rank that returned its result may take to exit (its process group's, buffers' and CUDA
# context's teardown) before the launcher reports it as hanging.
EXIT_TIMEOUT_S = 60.0
# How long a failed rank's report waits for a peer that may have died with it to be seen dead.
PEER_DEATH_GRACE_S = 1.0


def max_cpu_ranks() -> int:
    """The most CPU ranks ``run_ranks`` starts here: ``CPU_RANKS_PER_CORE`` per core this process may use."""
    return CPU_RANKS_PER_CORE * _usable_cores()


def cpu_ranks_problem(num_ranks: int, device: str) -> Optional[str]:
    """Why ``num_ranks`` ranks on ``device`` ("cpu", "cuda") are too many for this machine, or None.

    Only CPU ranks are capped; the line does not name the option, so callers prefix it."""
    if device != "cpu" or num_ranks <= max_cpu_ranks():
        return None
    return (f"at most {max_cpu_ranks()} CPU ranks here ({CPU_RANKS_PER_CORE} per core, {_usable_cores()} "
            f"core(s)): each rank is a process with its own torch and a gloo link to every other rank, so more "
            f"of them mostly wait for a core")


def mps_problem(num_ranks: int, num_gpus: int) -> Optional[str]:
    """Why ``num_ranks`` CUDA ranks on ``num_gpus`` GPUs cannot start here, or None: more ranks than GPUs
    share them under a private MPS daemon, whose control program must be on PATH."""
    from .mps import CONTROL

    if num_gpus < 1 or num_ranks <= num_gpus or shutil.which(CONTROL) is not None:
        return None
    return (f"{num_ranks} ranks on {num_gpus} GPU(s) share them under CUDA MPS, and {CONTROL} is not on PATH "
            f"(a container or WSL without it): run at most {num_gpus} rank(s), install the CUDA MPS tools, "
            "or use the CPU")


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may run on (taskset, a container's cpuset)
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class LaunchPlan:
    num_ranks: int
    device_type: str  # "cpu" or "cuda"
    gpu_of_rank: tuple[int, ...]  # empty on CPU
    process_group_backend: str  # "gloo" or "nccl"
    use_mps: bool

    @property
    def ranks_per_gpu(self) -> int:
        if not self.gpu_of_rank:
            return 0
        return max(self.gpu_of_rank.count(gpu) for gpu in set(self.gpu_of_rank))


@dataclass(frozen=True)
class RankContext:
    """What a rank function gets: its rank, the world, and where it runs."""

    rank: int
    world_size: int
    device: str  # "cpu" or "cuda:<i>"
    plan: LaunchPlan


def plan_launch(num_ranks: int, device: str, num_gpus: int, placement: str = "round_robin") -> LaunchPlan:
    """Decide placement for ``num_ranks`` ranks on ``device`` ("cpu", "cuda") with ``num_gpus`` GPUs.

    placement: "round_robin" (rank r on GPU r % G) or "block" (rank r on GPU r * G // N).
    """
    if placement not in ("round_robin", "block"):
        raise ValueError(f"placement must be 'round_robin' or 'block', got {placement!r}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if device == "cpu":
        return LaunchPlan(num_ranks, "cpu", (), "gloo", False)
    if device != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if num_gpus < 1:
        raise ValueError("device='cuda' but no CUDA device is visible")
    if placement == "block":
        gpu_of_rank = tuple(rank * min(num_gpus, num_ranks) // num_ranks for rank in range(num_ranks))
    else:
        gpu_of_rank = tuple(rank % num_gpus for rank in range(num_ranks))
    if num_ranks <= num_gpus:
        return LaunchPlan(num_ranks, "cuda", gpu_of_rank, "nccl", False)
    # NCCL refuses two ranks on one GPU; gloo + MPS lets them run concurrently.
    return LaunchPlan(num_ranks, "cuda", gpu_of_rank, "gloo", True)


def run_ranks(
    fn: Callable[..., Any],
    num_ranks: int,
    *args: Any,
    device: str = "cpu",
    timeout_s: float = 300.0,
    env: Optional[dict[str, str]] = None,
    placement: str = "round_robin",
) -> list[Any]:
    """Run ``fn(RankContext, *args)`` on ``num_ranks`` processes and return each rank's result.

    ``placement`` ("round_robin" or "block") assigns ranks to GPUs when they outnumber them (``plan_launch``).
    """
    problem = cpu_ranks_problem(num_ranks, device)
    if problem:
        raise ValueError(f"num_ranks={num_ranks}: {problem}")
    _check_launch_arguments(fn, timeout_s, env)
    num_gpus = 0
    if device == "cuda":
        import torch

        num_gpus = torch.cuda.device_count()
    plan = plan_launch(num_ranks, device, num_gpus, placement)
    with _sigterm_unwinds():
        if plan.use_mps:
            from .mps import PrivateMPS

            with PrivateMPS() as mps_env:
                return _spawn(fn, args, plan, timeout_s, {**(env or {}), **mps_env})
        return _spawn(fn, args, plan, timeout_s, env or {})


def _check_launch_arguments(fn: Callable[..., Any], timeout_s: float, env: Optional[dict[str, str]]) -> None:
    """ValueError for what would otherwise fail inside every rank before it can report (its cause then only on
    the ranks' stderr, which a notebook never shows), or never time out."""
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    bad = {name: value for name, value in (env or {}).items()
           if not isinstance(name, str) or not isinstance(value, str)}
    if bad:
        raise ValueError(f"env takes strings, as os.environ does; got {bad!r}")
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)  # "<stdin>" for python -
    if getattr(fn, "__module__", None) == "__main__" and not (main_file and os.path.isfile(main_file)):
        raise ValueError(f"{getattr(fn, '__qualname__', fn)!r} is defined in an interactive __main__ (a REPL, a "
                         "notebook, python -): the ranks are new processes that import fn by its module, and this "
                         "one has no file; define it in a module (a .py file you import, or a script run as "
                         "python file.py)")


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (a CI job's timeout, ``timeout``, ``kill``) raises SystemExit in the launcher, so that its
    cleanup runs: the ranks are killed, the private MPS daemon quits, the rendezvous folder goes. By
    default SIGTERM ends the process at once and left the daemon and the folders behind. Then the signal is
    delivered again to the earlier handler (by default: the process ends, as SIGTERM asked): pytest took the
    SystemExit for one failed test and ran on to the next, past the caller's timeout. A second SIGTERM
    (``timeout`` signals its command, then the command's process group: a busy process takes them one at a
    time) does not interrupt that cleanup: it stopped the rank loop halfway, a rank lived on, and the process's
    exit waited for it. Main thread only (signal handlers can be set nowhere else)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []

    def unwind(signum, frame):
        received.append(signum)
        if len(received) == 1:
            raise SystemExit(128 + signum)

    earlier = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, earlier)
        if received:  # the cleanup above ran; now what SIGTERM would have done
            signal.raise_signal(signal.SIGTERM)


RENDEZVOUS_PREFIX = "ep_plugin_rdzv_"  # then the launcher's pid and "_"


def remove_orphaned_rendezvous(folder: Optional[str] = None) -> list[str]:
    """Remove the rendezvous folders in ``folder`` (default: the temp folder) whose launcher is gone (killed
    with SIGKILL, its cleanup never ran); returns them. Each launch sweeps so, as the MPS daemons' are."""
    from .mps import _owner_alive

    folder = folder or tempfile.gettempdir()
    removed = []
    for name in sorted(os.listdir(folder)):
        owner = name[len(RENDEZVOUS_PREFIX):].split("_", 1)[0]
        if not name.startswith(RENDEZVOUS_PREFIX) or not owner.isdigit() or _owner_alive(int(owner)):
            continue
        shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
        removed.append(os.path.join(folder, name))
    return removed


def _spawn(fn, args, plan: LaunchPlan, timeout_s: float, env: dict[str, str]) -> list[Any]:
    context = mp.get_context("spawn")
    # One pipe per rank, its write end in that rank alone: a rank killed halfway through sending its result
    # (out of memory, a signal) closes it, so the launcher reads an end of file, not half a message it would wait
    # on for ever (a shared queue's pipe stays open in every rank, and the dead one held its lock).
    pipes = [context.Pipe(duplex=False) for _ in range(plan.num_ranks)]  # (read end, write end)
    remove_orphaned_rendezvous()
    with tempfile.TemporaryDirectory(prefix=f"{RENDEZVOUS_PREFIX}{os.getpid()}_") as rendezvous_dir:
        init_method = "file://" + os.path.join(rendezvous_dir, "store")
        # Not daemonic: a rank may start processes of its own (a DataLoader's workers). The cleanup below, and
        # the parent-death signal when the launcher itself is killed, stop the ranks instead.
        processes = [
            context.Process(target=_rank_main, args=(fn, args, plan, rank, init_method, env, pipes[rank][1]),
                            daemon=False)
            for rank in range(plan.num_ranks)
        ]
        reports = None
        try:  # a rank that fails to start (fd or process limits) must not leave the started ones waiting
            with _environment(env):
                for process, (_, write_end) in zip(processes, pipes, strict=True):
                    process.start()
                    write_end.close()  # the rank has its own copy now
            reports, arriving = _read_reports([read_end for read_end, _ in pipes])  # its threads close the read ends
            outputs = _collect(processes, reports, arriving, timeout_s)
            _check_exits(processes, EXIT_TIMEOUT_S, outputs)
            return outputs
        finally:
            started = [process for process in processes if process.pid is not None]  # (a start that failed
            # is what propagates.) Every rank is killed before any is waited for: a second Ctrl-C during a wait
            # stopped the loop there, and the ranks not yet killed held the process's exit (multiprocessing
            # joins its children at exit).
            for process in started:
                if process.is_alive():
                    process.kill()
                _kill_group(process.pid)  # and what it started
            for process in started:
                process.join(timeout=10)
            for read_end, write_end in pipes:
                write_end.close()  # those of ranks that never started (closing twice is harmless)
                if reports is None:
                    read_end.close()


_environment_lock = threading.Lock()


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` in this process's environment while the ranks start, which they inherit at exec: set inside a
    rank it came after the spawn's bootstrap had imported torch (through the pickled plan), so what torch
    reads when it loads (OMP_NUM_THREADS, TORCH_* logging) was ignored there. Locked: launches from several
    threads would otherwise restore each other's values."""
    with _environment_lock:
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _kill_group(pid: int) -> None:
    """Kill what is left of a rank's process group (the rank leads one of its own, ``_rank_main``): processes it
    started (a subprocess, a worker) outlived it and kept a pipe of the caller's open (``| tail`` waited for
    them). Its number cannot name another group while any of these is alive; none left: ESRCH."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass


def _read_reports(read_ends) -> tuple[queue.Queue, set[int]]:
    """Each rank's report, as it arrives, in one queue: (rank, ok, payload) from a thread per rank (a large result
    takes a while to come through, and the launcher's checks and timeout go on meanwhile), or (rank, None, None)
    when its pipe closed without one (the rank died, or exited without reporting). Also the set of ranks whose
    whole report was read and is being unpickled (a large result takes a while): the thread puts those in the
    queue soon, so they are never named as gone without one. (A rank killed halfway through its send is not in
    it.) The threads end with their pipes, which the cleanup's kill closes."""
    reports: queue.Queue = queue.Queue()
    arriving: set[int] = set()

    def read(rank: int, read_end) -> None:
        try:
            message = read_end.recv_bytes()
            arriving.add(rank)
            ok, payload = _unpickle(message)
        except (EOFError, OSError):
            ok, payload = None, None
        except BaseException as error:  # noqa: BLE001 - (out of memory for a large result, say) reported, not lost
            ok, payload = False, f"the launcher could not receive its report ({type(error).__name__}: {error})"
        finally:
            read_end.close()
        reports.put((rank, ok, payload))

    for rank, read_end in enumerate(read_ends):
        threading.Thread(target=read, args=(rank, read_end), name=f"ep_plugin rank {rank} report",
                         daemon=True).start()
    return reports, arriving


def _unpickle(message: bytes) -> tuple[Any, Any]:
    return pickle.loads(message)  # what Connection.recv does after recv_bytes; its own function for a test


def _collect(processes, reports: queue.Queue, arriving: set[int], timeout_s: float) -> list[Any]:
    outputs: dict[int, Any] = {}
    num_ranks = len(processes)
    gone_since: dict[int, float] = {}  # rank -> when it was first seen exited without a report
    deadline = time.monotonic() + timeout_s
    while len(outputs) < num_ranks:
        try:
            rank, ok, payload = reports.get(timeout=0.2)
        except queue.Empty:
            # A rank that exited while its pipe stays open (a process it started holds it) and empty is named
            # once it was seen exited for a grace period (a report it sent just before may still be on its way).
            # One whose whole report was read is left to its reader: a large one may take longer to unpickle.
            now = time.monotonic()
            for rank, p in enumerate(processes):
                if rank not in outputs and not p.is_alive():
                    gone_since.setdefault(rank, now)
            gone = sorted(rank for rank, since in gone_since.items()
                          if rank not in outputs and rank not in arriving and now - since > PEER_DEATH_GRACE_S)
            if gone:
                raise EPError(_exited_without_report(processes, gone)) from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(num_ranks)) - set(outputs))
                raise EPTimeoutError(f"launcher: rank(s) {missing} did not finish within {timeout_s:.0f} s "
                                     f"(finished: {sorted(outputs)})") from None
            continue
        if ok is None:  # its pipe closed without a report
            processes[rank].join(timeout=PEER_DEATH_GRACE_S)
            if processes[rank].exitcode is None:
                raise EPError(f"rank {rank} closed the launcher's pipe without reporting a result, and runs on")
            raise EPError(_exited_without_report(processes, [rank]))
        if not ok:
            raise EPError(_failure_report(processes, outputs, rank, payload))
        try:
            outputs[rank] = pickle.loads(payload)
        except Exception as error:  # noqa: BLE001 - named, not raised as if the caller's code had failed
            raise EPError(f"rank {rank}'s result pickled in the rank but does not unpickle here "
                          f"({type(error).__name__}: {error}): return plain values (numbers, strings, lists, "
                          f"dicts, tensors)") from error
    return [outputs[rank] for rank in range(num_ranks)]


def _exited_without_report(processes, ranks: list[int]) -> str:
    """Names the ranks that exited without a report: those killed or failed first, then those that exited 0."""
    failed = [r for r in ranks if processes[r].exitcode != 0]
    if failed:
        return (f"rank(s) {failed} exited with code(s) {[processes[r].exitcode for r in failed]} before reporting "
                f"a result")
    return (f"rank(s) {ranks} exited with code 0 without reporting a result: something in the rank ended its "
            f"process before the rank function returned (os._exit(0), or a library that exits on its own)")


class TeardownError(EPError):
    """Every rank returned its result, but some rank then crashed or hung on its way out. ``results`` holds
    what the ranks returned (a caller may keep them: a benchmark's finished figures, say)."""

    def __init__(self, message: str, results: list[Any]) -> None:
        super().__init__(message)
        self.results = results

    def __reduce__(self):  # pickled as it was made (a rank may return or raise one)
        return type(self), (str(self), self.results)


def _check_exits(processes, timeout_s: float, results: list[Any]) -> None:
    """Every rank returned its result: each process must now exit, with code 0, within ``timeout_s``, else
    ``TeardownError``. What runs after the rank function (``_exit_after_own_teardown``: freeing what it
    left, the exit handlers libraries registered) can crash or hang, as the crashes users report of other EP
    libraries do; killing a rank still exiting, as the cleanup does, hid both."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    hanging = [rank for rank, p in enumerate(processes) if p.is_alive()]
    failed = {rank: p.exitcode for rank, p in enumerate(processes) if not p.is_alive() and p.exitcode != 0}
    problems = []
    if failed:
        named = ", ".join(f"rank {rank}: {_exit_name(code)}" for rank, code in failed.items())
        problems.append(f"exited with an error after returning its result ({named})")
    if hanging:
        problems.append(f"rank(s) {hanging} did not exit within {timeout_s:.0f} s of returning their results "
                        f"(the teardown hangs: a kernel still waiting, a process group that does not end)")
    if problems:
        raise TeardownError("launcher: every rank returned, but " + "; ".join(problems), results)


def _exit_name(code: int) -> str:
    """'code 3', or 'killed by SIGSEGV' for a negative code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"code {code}"


def _failure_report(processes, outputs: dict, rank: int, payload: str) -> str:
    """A rank's error, after the ranks that died without a word: the peers of a rank killed by a signal
    (out of memory, a segfault) raise connection errors that name nobody, and one of them often reports
    first. A rank that raises reports and then exits with code 0, so a nonzero code means it never reported.
    The peers get a moment to be seen dead: a connection error can reach the launcher before the killed
    process is reaped (on a loaded machine the report then named nobody)."""
    deadline = time.monotonic() + PEER_DEATH_GRACE_S
    for r, p in enumerate(processes):
        if r != rank and r not in outputs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    dead = [r for r, p in enumerate(processes)
            if r != rank and r not in outputs and not p.is_alive() and p.exitcode not in (None, 0)]
    if not dead:
        return f"rank {rank} raised:\n{payload}"
    codes = [processes[r].exitcode for r in dead]
    return (f"rank(s) {dead} exited with code(s) {codes} (negative: killed by that signal) without reporting; "
            f"then rank {rank} raised:\n{payload}")


def _die_with_the_launcher() -> None:
    """Linux: this rank gets SIGKILL when the launcher's process dies. A launcher that is killed (a CI job's
    timeout, Ctrl-C twice) cannot stop its ranks itself, and they would hold the GPU and their ports."""
    launcher = mp.parent_process()
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own cleanup only
        return
    if launcher is not None and os.getppid() != launcher.pid:  # it died before the line above
        os._exit(1)


def _destroy_quietly(dist) -> None:
    """Tear the process group down after the rank's error was reported; a failure here adds nothing."""
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the rank's own error is what the launcher reports
        pass


def _rank_main(fn, args, plan: LaunchPlan, rank: int, init_method: str, env: dict[str, str], report) -> None:
    """One rank: its process group, ``fn``, then one message on ``report`` (its pipe to the launcher): (True, the
    pickled result) or (False, the traceback). A pipe's send returns once the whole message is in the pipe, so
    a crash after it (the teardown's) cannot cut it short."""
    _die_with_the_launcher()
    os.setpgrp()  # a group of its own: the launcher's cleanup kills what the rank starts too (_kill_group)
    os.environ.update(env)  # before any CUDA call: MPS pipes, EP_PLUGIN_* knobs
    dist = None
    try:
        import torch
        import torch.distributed as dist

        device = "cpu"
        if plan.device_type == "cuda":
            torch.cuda.set_device(plan.gpu_of_rank[rank])
            device = f"cuda:{plan.gpu_of_rank[rank]}"
        dist.init_process_group(plan.process_group_backend, init_method=init_method, rank=rank,
                                world_size=plan.num_ranks)
        if plan.process_group_backend == "gloo":
            # gloo's init returns on a rank once its own links are up, while a peer may still be connecting;
            # a rank that then finished quickly (no collective in fn) and exited made that peer's init fail
            # ("connectFullMesh failed ... Connection closed by peer"). Nobody leaves before everyone is in.
            dist.barrier()
        try:
            output = fn(RankContext(rank, plan.num_ranks, device, plan), *args)
        except BaseException:
            # Reported before the teardown: destroying a process group whose peers are still inside a
            # collective can block (NCCL), and the launcher would then say "did not finish" instead.
            report.send((False, traceback.format_exc()))
            _destroy_quietly(dist)
            return
        # Pickled here, by value, with the standard pickler: multiprocessing's sends a CPU tensor as a file
        # descriptor this process serves, gone once it exits. Sent before the teardown, which may crash.
        report.send((True, pickle.dumps(output)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        report.send((False, traceback.format_exc()))
        if dist is not None:  # e.g. a result that does not pickle: the group still goes first
            _destroy_quietly(dist)
        return
    try:
        # After the result: gloo's destroy waits for an op a caught timeout left behind (until the late peer
        # calls or exits), which lost the result and named this rank as not finished. A hang or crash here
        # is the exit check's to report (TeardownError, with the results). The rank function may have destroyed
        # the group itself, as torch's examples end.
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the result is reported; the exit code tells the launcher
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    _exit_after_own_teardown()


def _exit_after_own_teardown() -> None:
    """The rank's result is reported: free what it left (its buffers, handles, whatever the garbage
    collector takes) and run the exit handlers libraries registered, while the interpreter is whole, then
    leave without the interpreter's own finalization. A crash or hang in the first two is the launcher's
    to report (``_check_exits``). The last is torch's: its C++ teardown at interpreter exit sometimes
    aborts on a loaded machine ("terminate called without an active exception", SIGABRT; once in six CI
    runs of the suite, in a CPU-only rank), which is not this library's to test."""
    import atexit
    import gc

    gc.collect()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
