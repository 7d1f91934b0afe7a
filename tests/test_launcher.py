"""The multi-rank launcher: placement logic, results, errors and hangs reported by rank."""

import atexit
import os
import signal
import sys
import threading
import time

import pytest
import torch.distributed as dist

from ep_plugin.errors import EPError, EPTimeoutError
from ep_plugin.testing import plan_launch, run_ranks


def test_placement_cpu_one_gpu_per_rank_and_shared_gpus():
    cpu = plan_launch(4, "cpu", num_gpus=0)
    assert (cpu.process_group_backend, cpu.use_mps, cpu.gpu_of_rank) == ("gloo", False, ())
    per_gpu = plan_launch(2, "cuda", num_gpus=2)
    assert (per_gpu.process_group_backend, per_gpu.use_mps, per_gpu.gpu_of_rank) == ("nccl", False, (0, 1))
    assert per_gpu.ranks_per_gpu == 1
    shared = plan_launch(8, "cuda", num_gpus=1)
    assert (shared.process_group_backend, shared.use_mps, shared.ranks_per_gpu) == ("gloo", True, 8)
    mixed = plan_launch(4, "cuda", num_gpus=2)
    assert mixed.gpu_of_rank == (0, 1, 0, 1) and mixed.ranks_per_gpu == 2 and mixed.use_mps
    block = plan_launch(8, "cuda", num_gpus=2, placement="block")  # one NVLink domain per GPU
    assert block.gpu_of_rank == (0, 0, 0, 0, 1, 1, 1, 1) and block.use_mps
    assert plan_launch(2, "cuda", num_gpus=2, placement="block").gpu_of_rank == (0, 1)
    with pytest.raises(ValueError, match="placement"):
        plan_launch(2, "cuda", num_gpus=2, placement="diagonal")
    with pytest.raises(ValueError, match="no CUDA device"):
        plan_launch(2, "cuda", num_gpus=0)
    with pytest.raises(ValueError, match="num_ranks"):
        plan_launch(0, "cpu", num_gpus=0)


def test_cpu_ranks_beyond_the_cores_are_refused_before_any_process_starts(monkeypatch):
    from ep_plugin.testing import launcher

    monkeypatch.setattr(launcher, "CPU_RANKS_PER_CORE", 1)  # so that the plant below would start few ranks
    too_many = launcher.max_cpu_ranks() + 1
    assert "1 per core" in launcher.cpu_ranks_problem(too_many, "cpu")
    assert launcher.cpu_ranks_problem(too_many - 1, "cpu") is None
    assert launcher.cpu_ranks_problem(10**6, "cuda") is None  # GPU runs are not capped
    with pytest.raises(ValueError, match=f"num_ranks={too_many}: at most {too_many - 1} CPU ranks here"):
        run_ranks(report_rank, too_many, 0, timeout_s=60)


def test_ranks_sharing_a_gpu_without_mps_are_refused_in_one_line(tmp_path, monkeypatch):
    """More ranks than GPUs need nvidia-cuda-mps-control (the demo asks before it starts any process)."""
    from ep_plugin.testing import launcher

    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without the MPS tools
    assert "nvidia-cuda-mps-control is not on PATH" in launcher.mps_problem(4, 1)
    assert "run at most 2 rank(s)" in launcher.mps_problem(3, 2)
    assert launcher.mps_problem(2, 2) is None and launcher.mps_problem(1, 1) is None  # one GPU each
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text("#!/bin/sh\n")
    control.chmod(0o755)
    assert launcher.mps_problem(4, 1) is None


def killed_while_peers_wait(ctx):
    import signal

    if ctx.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would: no report, no cleanup
    dist.all_reduce(__import__("torch").ones(1))  # the peers' link to rank 0 closes under them


def test_a_killed_rank_is_named_before_the_peer_whose_link_broke():
    """Before: 'rank 2 raised: ... Connection closed by peer', rank 0 never named."""
    with pytest.raises(EPError, match=r"rank\(s\) \[0\] exited with code\(s\) \[-9\]"):
        run_ranks(killed_while_peers_wait, 3, timeout_s=60)


LAUNCHER_SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
from ep_plugin.testing import run_ranks
from test_launcher import write_pid_and_sleep
run_ranks(write_pid_and_sleep, 2, {folder!r}, timeout_s=120)
"""


def write_pid_and_sleep(ctx, folder):
    with open(os.path.join(folder, f"rank{ctx.rank}.pid"), "w") as file:
        file.write(str(os.getpid()))
    time.sleep(120)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in status)
    except FileNotFoundError:
        return False


def _start_launcher(folder, env=None, script=LAUNCHER_SCRIPT):
    """A launcher running two sleeping ranks in a subprocess, once both ranks wrote their pids:
    (the Popen, the ranks' pids)."""
    import subprocess

    script = script.format(tests=os.path.dirname(__file__), folder=str(folder))
    launcher = subprocess.Popen([sys.executable, "-c", script], env=env)
    pid_files = [folder / f"rank{r}.pid" for r in range(2)]
    deadline = time.monotonic() + 60
    while not all(f.exists() and f.read_text() for f in pid_files):
        assert time.monotonic() < deadline and launcher.poll() is None, "the ranks did not start"
        time.sleep(0.1)
    return launcher, [int(f.read_text()) for f in pid_files]


def _kill_survivors(ranks, wait_s: float = 0.0) -> list:
    """The rank pids still running (after up to ``wait_s``), killed so that nothing is left behind."""
    deadline = time.monotonic() + wait_s
    while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in ranks if _running(pid)]
    for pid in alive:
        os.kill(pid, __import__("signal").SIGKILL)
    return alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_ranks_go_with_a_launcher_that_was_killed(tmp_path):
    """A launcher killed by SIGKILL (a CI timeout) cannot stop its ranks: they must not outlive it."""
    import signal

    folder, tmp = tmp_path / "pids", tmp_path / "tmp"  # the killed launcher's rendezvous folder stays: in tmp_path
    folder.mkdir()
    tmp.mkdir()
    launcher, ranks = _start_launcher(folder, env={**os.environ, "TMPDIR": str(tmp)})
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=30)
    alive = _kill_survivors(ranks, wait_s=20)
    assert not alive, f"rank processes {alive} outlived their killed launcher"
    # Its rendezvous folder stayed (nothing removed them: /tmp filled with them); the next launch sweeps it.
    left = [name for name in os.listdir(tmp) if name.startswith(f"ep_plugin_rdzv_{launcher.pid}_")]
    assert left, os.listdir(tmp)
    import tempfile

    saved, tempfile.tempdir = tempfile.tempdir, str(tmp)
    try:
        assert run_ranks(report_rank, 2, 0, timeout_s=60)[0][1] == 1
    finally:
        tempfile.tempdir = saved
    assert not [name for name in os.listdir(tmp) if name.startswith("ep_plugin_rdzv_")], os.listdir(tmp)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_launcher_stopped_by_sigterm_cleans_up(tmp_path):
    """SIGTERM (a CI timeout, ``timeout``) ended the launcher at once: its cleanup never ran, so the private
    MPS daemon (ranks sharing a GPU) and the rendezvous folder stayed behind. Now it unwinds: the folder
    (in the launcher's TMPDIR here) goes, the ranks go, and then SIGTERM ends the process as it would have
    (a SystemExit alone let pytest go on to the next test, past the caller's timeout)."""
    import signal

    folder, tmp = tmp_path / "pids", tmp_path / "tmp"
    folder.mkdir()
    tmp.mkdir()
    launcher, ranks = _start_launcher(folder, env={**os.environ, "TMPDIR": str(tmp)})
    assert any(name.startswith("ep_plugin_rdzv_") for name in os.listdir(tmp))
    launcher.send_signal(signal.SIGTERM)
    code = launcher.wait(timeout=60)
    alive = _kill_survivors(ranks)
    assert code == -signal.SIGTERM and not alive, (code, alive)
    assert not [name for name in os.listdir(tmp) if name.startswith("ep_plugin_rdzv_")], os.listdir(tmp)


def crash_in_teardown_after_a_large_result(ctx, size):
    """Rank 1's process group teardown crashes (a CUDA or NCCL destroy can) while its result may still be on
    its way out."""
    import torch.distributed as d

    if ctx.rank == 1:
        def destroy(*args, **kwargs):
            time.sleep(0.05)
            os.kill(os.getpid(), __import__("signal").SIGSEGV)

        d.destroy_process_group = destroy
    return b"x" * size


LAUNCH_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from ep_plugin.testing import run_ranks
from test_launcher import {function}
try:
    run_ranks({function}, 2, {size}, timeout_s={timeout_s})
except Exception as error:
    print(type(error).__name__, str(error)[:300])
"""


def launch_in_a_subprocess(function: str, size: int, timeout_s: float):
    """run_ranks(function, 2, size) in a Python of its own, killed past 150 s (a launcher that hangs fails the test
    instead of the suite): its outcome's first line on stdout."""
    import subprocess

    script = LAUNCH_SCRIPT.format(tests=os.path.dirname(__file__), function=function, size=size, timeout_s=timeout_s)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=150)


def test_a_teardown_that_crashes_after_the_result_is_reported_not_waited_on():
    """The result was queued to a writer thread, and the teardown ran while it wrote: a crash there left half
    a message in the pipe, and the launcher's read of it waited for ever (the ranks hold the write end, so no
    end of file came). Now the result is out before the teardown begins: the crash is reported."""
    done = launch_in_a_subprocess("crash_in_teardown_after_a_large_result", 100_000_000, timeout_s=30)
    assert "TeardownError" in done.stdout and "rank 1: killed by SIGSEGV" in done.stdout, (done.stdout,
                                                                                          done.stderr[-2000:])


def killed_while_sending_its_result(ctx, size):
    """Rank 1 is killed (as the OOM killer would) while it writes its result to the launcher."""
    if ctx.rank == 1:
        def writing() -> bool:  # whether another thread of this process is in write() (x86-64: 1, arm64: 64)
            for task in os.listdir("/proc/self/task"):
                if int(task) != threading.get_native_id():
                    with open(f"/proc/self/task/{task}/syscall") as syscall:
                        if syscall.read().split()[0] in ("1", "64"):
                            return True
            return False

        def kill_once_writing():
            while not writing():
                time.sleep(0.0005)
            time.sleep(0.01)  # some of it in the pipe, far from all (200 MB)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill_once_writing, daemon=True).start()
    return b"x" * size


def test_a_rank_killed_while_sending_its_result_is_named():
    """Before: the ranks shared one queue, whose pipe every rank held open, so the launcher read the dead rank's
    half message for ever (no end of file; the rank also died holding the queue's lock), past its timeout."""
    done = launch_in_a_subprocess("killed_while_sending_its_result", 200_000_000, timeout_s=60)
    assert "rank(s) [1] exited with code(s) [-9] before reporting a result" in done.stdout, (done.stdout,
                                                                                             done.stderr[-2000:])


def killed_while_sending_with_a_child_holding_the_pipe(ctx, size):
    """As killed_while_sending_its_result, with a child process of rank 1 holding its end of the pipe."""
    import subprocess

    if ctx.rank == 1:
        subprocess.Popen(["sleep", "120"], close_fds=False)  # the launcher's cleanup kills its process group
    return killed_while_sending_its_result(ctx, size)


def test_a_rank_killed_while_sending_with_a_child_holding_its_pipe_is_named():
    """No end of file comes while the child lives: the rank, seen exited with half its report read, must be named
    after the grace period (it was once left to its reader as "arriving", and the launcher waited out its
    timeout to say the rank "did not finish")."""
    done = launch_in_a_subprocess("killed_while_sending_with_a_child_holding_the_pipe", 200_000_000, timeout_s=60)
    assert "rank(s) [1] exited with code(s) [-9] before reporting a result" in done.stdout, (done.stdout,
                                                                                             done.stderr[-2000:])


def returns_a_tensor(ctx):
    return __import__("torch").full((1000,), float(ctx.rank))


def test_a_tensor_result_comes_back_by_value():
    """The queue's pickler sent a CPU tensor as a file descriptor the rank's process serves, which is gone once
    the rank exits (a FileNotFoundError naming no rank, if the launcher read it a little late)."""
    for rank, tensor in enumerate(run_ranks(returns_a_tensor, 2, timeout_s=60)):
        assert not tensor.is_shared() and float(tensor.sum()) == 1000.0 * rank


def report_rank(ctx, offset):
    tensor = __import__("torch").tensor([ctx.rank + offset])
    dist.all_reduce(tensor)
    return ctx.rank, int(tensor), os.environ.get("EP_PLUGIN_TIMEOUT_S")


def test_results_come_back_by_rank_with_env():
    results = run_ranks(report_rank, 3, 10, env={"EP_PLUGIN_TIMEOUT_S": "7"}, timeout_s=60)
    assert results == [(0, 33, "7"), (1, 33, "7"), (2, 33, "7")]


def torch_threads_and_env(ctx):
    import torch

    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def test_env_is_there_before_the_rank_imports_torch():
    """env was set inside the rank after the spawn had imported torch (unpickling the plan): os.environ showed
    OMP_NUM_THREADS=1 while torch ran on its default thread count. It must not leak into the launcher."""
    before = os.environ.get("OMP_NUM_THREADS")
    results = run_ranks(torch_threads_and_env, 2, env={"OMP_NUM_THREADS": "1"}, timeout_s=60)
    assert results == [(1, "1"), (1, "1")], results
    assert os.environ.get("OMP_NUM_THREADS") == before


def destroys_its_own_group(ctx):
    tensor = __import__("torch").ones(1)
    dist.all_reduce(tensor)
    dist.destroy_process_group()  # as torch's examples end
    return float(tensor)


def test_a_rank_that_destroys_its_own_process_group_is_fine():
    """The launcher's teardown destroyed the group again: AssertionError in every rank, TeardownError here."""
    assert run_ranks(destroys_its_own_group, 2, timeout_s=60) == [2.0, 2.0]


def starts_a_process(ctx):
    import multiprocessing

    worker = multiprocessing.get_context("spawn").Process(target=os.getpid)
    worker.start()
    worker.join(30)
    return worker.exitcode


def test_a_rank_may_start_processes_of_its_own():
    """Ranks were daemonic processes: a DataLoader's workers or a process pool raised 'daemonic processes are
    not allowed to have children'."""
    assert run_ranks(starts_a_process, 2, timeout_s=120) == [0, 0]


def start_a_sleeper_then_fail(ctx, folder):
    import subprocess

    sleeper = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(folder, f"sleeper{ctx.rank}"), "w") as handle:
        handle.write(str(sleeper.pid))
    dist.barrier()
    if ctx.rank == 1:
        raise RuntimeError("fails with a child running")
    time.sleep(300)


def test_what_a_failed_rank_started_goes_with_it(tmp_path):
    """Only the rank's own process was killed: a subprocess it started lived on and held the caller's pipe
    (``| tail`` waited for it after the launcher had returned)."""
    with pytest.raises(EPError, match="fails with a child running"):
        run_ranks(start_a_sleeper_then_fail, 2, str(tmp_path), timeout_s=60)
    sleepers = [int((tmp_path / f"sleeper{rank}").read_text()) for rank in range(2)]
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in sleepers) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in sleepers if _running(pid)]
    for pid in alive:  # never leave them behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"processes the ranks started outlived them: {alive}"


def returns_a_config_error(ctx):
    from ep_plugin.config import Config, ConfigValueError

    try:
        Config(timeout_s=-1)
    except ConfigValueError as error:
        return error


class _OnlyPicklesOneWay:
    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return _OnlyPicklesOneWay, ()  # unpickling calls __init__ without its argument


def returns_what_does_not_unpickle(ctx):
    return _OnlyPicklesOneWay(ctx.rank)


def test_results_that_do_not_unpickle_name_the_rank():
    """A result that pickles in the rank but does not unpickle here raised a bare TypeError naming no rank; the
    library's own ConfigValueError was one of them."""
    errors = run_ranks(returns_a_config_error, 2, timeout_s=60)
    assert all(type(e).__name__ == "ConfigValueError" and e.field == "timeout_s" for e in errors), errors
    with pytest.raises(EPError, match="rank [01]'s result pickled in the rank but does not unpickle here"):
        run_ranks(returns_what_does_not_unpickle, 2, timeout_s=60)


def test_arguments_every_rank_would_fail_on_are_refused_here():
    with pytest.raises(ValueError, match="env takes strings"):
        run_ranks(report_rank, 2, 0, env={"EP_PLUGIN_TIMEOUT_S": 5}, timeout_s=60)
    for timeout in (float("nan"), 0, -1, float("inf")):
        with pytest.raises(ValueError, match="timeout_s must be a finite number"):
            run_ranks(report_rank, 2, 0, timeout_s=timeout)
    code = ("import ep_plugin.testing as t\n"
            "def f(ctx): return ctx.rank\n"
            "try:\n    t.run_ranks(f, 2, timeout_s=60)\nexcept ValueError as e:\n    print('refused:', e)\n")
    import subprocess

    done = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=120)
    assert "refused:" in done.stdout and "interactive __main__" in done.stdout, (done.stdout, done.stderr)


def fail_on_rank_one(ctx):
    if ctx.rank == 1:
        raise KeyError("boom on purpose")
    return ctx.rank


def test_exception_names_the_rank():
    with pytest.raises(EPError, match="rank 1 raised:(.|\n)*boom on purpose"):
        run_ranks(fail_on_rank_one, 2, timeout_s=60)


def hang_on_rank_zero(ctx):
    if ctx.rank == 0:
        time.sleep(600)
    return ctx.rank


def test_hang_is_reported_not_waited_for():
    start = time.monotonic()
    # 20 s: rank 1 must have started and reported by then, also on a loaded 2-core machine (at 8 s it once
    # had not, and the message named both ranks).
    with pytest.raises(EPTimeoutError, match=r"rank\(s\) \[0\] did not finish"):
        run_ranks(hang_on_rank_zero, 2, timeout_s=20)
    assert time.monotonic() - start < 60


def caught_timeout_then_return(ctx):
    """Rank 0 gives up on a barrier (1 s) and returns; rank 1 stays away past the launcher's timeout."""
    from ep_plugin.host_collectives import HostCollectives

    words = HostCollectives(None, owner="test", timeout_s=1.0, label="caught timeout")
    if ctx.rank == 1:
        time.sleep(600)
    try:
        words.barrier(where="the barrier")
    except EPTimeoutError:
        return "gave up"


def test_a_rank_that_returned_is_not_named_with_one_that_hangs():
    """Before: rank 0 destroyed its process group before reporting its result, and gloo's destroy waited for
    the barrier its timeout left behind (until rank 1 came): the launcher named both ranks as not finished."""
    with pytest.raises(EPTimeoutError, match=r"rank\(s\) \[1\] did not finish .*finished: \[0\]"):
        run_ranks(caught_timeout_then_return, 2, timeout_s=20)


def unpicklable_result_on_rank_one(ctx):
    return threading.Lock() if ctx.rank == 1 else ctx.rank


def test_a_result_that_cannot_be_pickled_names_the_rank_at_once():
    """Before: the queue's feeder thread dropped the result without a word, the rank exited with code 0, and
    the launcher waited out its whole timeout to report the rank as one that "did not finish"."""
    start = time.monotonic()
    with pytest.raises(EPError, match=r"rank 1 raised:(.|\n)*pickle"):
        run_ranks(unpicklable_result_on_rank_one, 2, timeout_s=30)
    assert time.monotonic() - start < 20


def exit_0_on_rank_one(ctx):
    dist.barrier()  # so that rank 0 has its gloo links before rank 1's end closes them
    if ctx.rank == 1:
        os._exit(0)  # ends the process before _rank_main can report anything
    return ctx.rank


def test_a_rank_that_exits_0_without_a_result_is_named_at_once():
    """Before: only a non-zero exit code was noticed, so the launcher waited out its whole timeout and reported
    the rank as one that "did not finish"."""
    start = time.monotonic()
    with pytest.raises(EPError, match=r"rank\(s\) \[1\] exited with code 0 without reporting a result"):
        run_ranks(exit_0_on_rank_one, 2, timeout_s=120)
    # Well before the timeout, with room for slow starts on a loaded machine (22 s seen with 15 s allowed).
    assert time.monotonic() - start < 60


def first_get_empty_once_exited(monkeypatch, ranks) -> None:
    """The launcher's first look at the reports finds none, once ``ranks`` have exited (their reports, sent before,
    wait unread): the window in which it sees them exited before it read what they sent."""
    from ep_plugin.testing import launcher

    def collect_after_an_empty_get(processes, reports, arriving, timeout_s):
        class FirstGetEmptyOnceExited:
            first = True

            def get(self, timeout):
                if self.first:
                    self.first = False
                    for rank in ranks:
                        processes[rank].join()
                    raise launcher.queue.Empty
                return reports.get(timeout=timeout)

        return real_collect(processes, FirstGetEmptyOnceExited(), arriving, timeout_s)

    real_collect = launcher._collect
    monkeypatch.setattr(launcher, "_collect", collect_after_an_empty_get)


def test_ranks_that_exited_0_before_their_results_were_read_are_not_reported(monkeypatch):
    """The race an exit-0 check must not lose: get() times out, then the ranks put their results and exit, and
    the launcher sees them dead with code 0 while their results still wait, unread, in their pipes."""
    first_get_empty_once_exited(monkeypatch, [0, 1])
    # report_rank's all_reduce keeps a rank from exiting while its peer is still setting up gloo
    assert run_ranks(report_rank, 2, 0, env={"EP_PLUGIN_TIMEOUT_S": "7"}, timeout_s=60) == [(0, 1, "7"), (1, 1, "7")]


def report_then_wait_on_rank_zero(ctx):
    from ep_plugin.testing.launcher import PEER_DEATH_GRACE_S

    if ctx.rank == 0:
        time.sleep(3 * PEER_DEATH_GRACE_S + 1)
    return ctx.rank


def test_a_rank_seen_exited_before_its_report_was_read_is_not_named_once_it_is(monkeypatch):
    """Rank 1 reports and exits while rank 0 works on: seen exited before its report was taken from the queue,
    it must not be named as gone without one a grace period later."""
    first_get_empty_once_exited(monkeypatch, [1])
    assert run_ranks(report_then_wait_on_rank_zero, 2, timeout_s=60) == [0, 1]


def test_a_report_that_takes_longer_than_the_grace_to_receive_is_not_named(monkeypatch):
    """A large result still being received when its rank has exited (the rank wrote it into the pipe, the
    launcher reads and unpickles it for longer than PEER_DEATH_GRACE_S): the rank was named as one that "exited
    with code 0 without reporting", and its result lost."""
    from ep_plugin.testing import launcher

    def slow_unpickle(message):
        time.sleep(3 * launcher.PEER_DEATH_GRACE_S + 1)  # meanwhile the ranks exit, and are seen exited
        return real_unpickle(message)

    real_unpickle = launcher._unpickle
    monkeypatch.setattr(launcher, "_unpickle", slow_unpickle)
    assert run_ranks(report_rank, 2, 0, env={"EP_PLUGIN_TIMEOUT_S": "7"}, timeout_s=60) == [(0, 1, "7"), (1, 1, "7")]


def test_a_report_the_launcher_cannot_receive_is_named_not_waited_for(monkeypatch):
    """An error receiving a report other than an end of file (out of memory for a large result) ended the reading
    thread without a word, and the launcher waited out its timeout for a rank that had finished."""
    import multiprocessing.connection

    def out_of_memory(self, *args):
        raise MemoryError("a large result")

    monkeypatch.setattr(multiprocessing.connection.Connection, "recv_bytes", out_of_memory)
    start = time.monotonic()
    with pytest.raises(EPError, match=r"could not receive its report \(MemoryError: a large result\)"):
        run_ranks(report_rank, 2, 0, timeout_s=120)
    assert time.monotonic() - start < 60


def exit_0_while_a_child_holds_the_pipe(ctx):
    import subprocess

    dist.barrier()
    if ctx.rank == 1:
        subprocess.Popen(["sleep", "120"], close_fds=False)  # inherits this rank's end of the launcher's pipe
        os._exit(0)
    return ctx.rank


def test_a_rank_that_exits_0_while_its_child_holds_the_pipe_is_named_at_once():
    """No end of file comes while the child lives: the rank, seen exited, is named after a grace period, not
    at the launcher's timeout."""
    start = time.monotonic()
    with pytest.raises(EPError, match=r"rank\(s\) \[1\] exited with code 0 without reporting a result"):
        run_ranks(exit_0_while_a_child_holds_the_pipe, 2, timeout_s=120)
    assert time.monotonic() - start < 60


def crash_at_exit_on_rank_one(ctx):
    """Rank 1 returns its result, then dies in an exit handler (as a teardown that frees memory a kernel
    still reads may)."""
    if ctx.rank == 1:
        atexit.register(os.kill, os.getpid(), signal.SIGSEGV)
    return ctx.rank


def test_a_rank_that_crashes_after_its_result_is_named():
    """Before: once every result was in, the launcher killed the ranks still exiting and reported success."""
    with pytest.raises(EPError, match=r"every rank returned, but exited with an error after returning its result "
                                      r"\(rank 1: killed by SIGSEGV\)"):
        run_ranks(crash_at_exit_on_rank_one, 2, timeout_s=60)


def hang_at_exit_on_rank_zero(ctx):
    if ctx.rank == 0:
        atexit.register(time.sleep, 600)
    return ctx.rank


def test_a_rank_whose_exit_hangs_is_named(monkeypatch):
    from ep_plugin.testing import launcher

    monkeypatch.setattr(launcher, "EXIT_TIMEOUT_S", 3.0)
    start = time.monotonic()
    with pytest.raises(EPError, match=r"rank\(s\) \[0\] did not exit within 3 s of returning their results"):
        run_ranks(hang_at_exit_on_rank_zero, 2, timeout_s=60)
    assert time.monotonic() - start < 30  # and the launcher's cleanup killed it


def test_a_private_mps_daemon_whose_owner_was_killed_is_stopped_by_the_next(tmp_path, monkeypatch):
    """A launcher killed by SIGKILL (a device call's last resort) runs no cleanup: its daemon stayed, for
    ever on a machine kept warm. The next PrivateMPS of this user stops daemons whose owner is gone (an
    ``nvidia-cuda-mps-control`` stand-in records what it was told), and leaves a live owner's alone."""
    import subprocess
    import tempfile

    from ep_plugin.testing import mps

    calls, tmp, bin_dir = tmp_path / "calls", tmp_path / "tmp", tmp_path / "bin"
    tmp.mkdir()
    bin_dir.mkdir()
    fake = bin_dir / mps.CONTROL
    fake.write_text(f"""#!/bin/sh
if [ "$1" = "-d" ]; then touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
echo "$(cat) $CUDA_MPS_PIPE_DIRECTORY" >> {calls}
rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    finished = subprocess.Popen(["true"])
    finished.wait()
    orphan, live = tmp / f"{mps.PREFIX}{finished.pid}_a", tmp / f"{mps.PREFIX}{os.getppid()}_b"
    for root in (orphan, live):
        (root / "pipe").mkdir(parents=True)
        (root / "pipe" / "control").touch()
    with mps.PrivateMPS() as env:
        assert env["CUDA_MPS_PIPE_DIRECTORY"].startswith(str(tmp / f"{mps.PREFIX}{os.getpid()}_"))
    assert not orphan.exists() and live.exists()
    told = calls.read_text().splitlines()
    assert told[0] == f"quit {orphan / 'pipe'}" and told[1].startswith("quit ") and len(told) == 2, told



def test_a_private_mps_daemon_that_fails_to_start_leaves_no_folder(tmp_path, monkeypatch):
    """Its folder was removed only when the control program ran and said no: one that could not run (a
    missing interpreter, say), timed out (its daemon may have forked) or was interrupted left the folder, with
    nothing registered to remove it. Now ``stop`` runs on every failure (a stand-in control program here)."""
    import tempfile

    from ep_plugin.testing import mps

    tmp, bin_dir = tmp_path / "tmp", tmp_path / "bin"
    tmp.mkdir()
    bin_dir.mkdir()
    fake = bin_dir / mps.CONTROL
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    for script, error in (("#!/no/such/interpreter\n", OSError),  # it cannot run
                          ("#!/bin/sh\necho 'no GPU here' >&2; exit 1\n", RuntimeError)):  # it runs and says no
        fake.write_text(script)
        fake.chmod(0o755)
        with pytest.raises(error):
            mps.PrivateMPS().__enter__()
        assert list(tmp.iterdir()) == [], (script, list(tmp.iterdir()))
    # A daemon that forked (its pid file written) but made no control pipe: it is stopped too, by its pid, before
    # its folder goes (no later run could find it then). A sleep stands in for it; -d gives up on it.
    pid_file = tmp_path / "daemon.pid"
    fake.write_text(f"""#!/bin/sh
sleep 300 > /dev/null 2>&1 &
echo $! > "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
echo $! > {pid_file}
exit 1
""")
    with pytest.raises(RuntimeError):
        mps.PrivateMPS().__enter__()
    pid = int(pid_file.read_text())
    for _ in range(50):  # gone, or a zombie whose parent has not reaped it yet
        try:
            with open(f"/proc/{pid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        raise AssertionError(f"the forked daemon (pid {pid}) still runs")

def test_a_second_sigterm_does_not_cut_the_launchers_cleanup_short():
    """``timeout`` sends SIGTERM to its command and then to the command's process group: a loaded process took
    the second while its launcher killed the ranks, and the SystemExit it raised there left a rank alive, which
    the process's exit then waited for (CI: pytest killed by timeout's SIGKILL, test below)."""
    from ep_plugin.testing.launcher import _sigterm_unwinds

    passed_on = []
    earlier = signal.signal(signal.SIGTERM, lambda signum, frame: passed_on.append(signum))
    cleaned = []
    try:
        with pytest.raises(SystemExit):
            with _sigterm_unwinds():
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)  # interrupted by the first
                finally:  # the launcher's cleanup
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.1)  # where the second's handler runs
                    cleaned.append(True)
    finally:
        signal.signal(signal.SIGTERM, earlier)
    assert cleaned == [True]
    assert passed_on == [signal.SIGTERM]  # handed on once, after the cleanup


# The second Ctrl-C, arriving while the launcher's cleanup waits for a rank it killed: the first wait raises
# KeyboardInterrupt (no rank dies before the cleanup here, so the first join is the cleanup's).
LAUNCHER_INTERRUPTED_AGAIN_SCRIPT = """
import signal
import sys
import multiprocessing.process as process
# A shell's background job (CI under nohup ... &) ignores SIGINT, and Python keeps an ignored SIGINT ignored:
# this launcher gets Ctrl-C's default.
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
join, interrupted = process.BaseProcess.join, []


def join_interrupted_once(self, timeout=None):
    if not interrupted:
        interrupted.append(True)
        raise KeyboardInterrupt
    return join(self, timeout)


process.BaseProcess.join = join_interrupted_once
from ep_plugin.testing import run_ranks
from test_launcher import write_pid_and_sleep
run_ranks(write_pid_and_sleep, 2, {folder!r}, timeout_s=120)
"""


def test_a_second_ctrl_c_during_the_cleanup_leaves_no_rank_alive(tmp_path):
    """Ctrl-C twice: the second stopped the launcher's cleanup in its wait for the first rank, before the
    second was killed; that rank lived on, and the process's exit waited for it (multiprocessing joins its
    children at exit) until its sleep ended. Every rank is killed now before any wait."""
    import subprocess

    folder = tmp_path / "pids"
    folder.mkdir()
    launcher, ranks = _start_launcher(folder, script=LAUNCHER_INTERRUPTED_AGAIN_SCRIPT)
    launcher.send_signal(signal.SIGINT)
    try:
        code = launcher.wait(timeout=30)  # the ranks sleep 120 s: a rank left alive holds the exit past this
    except subprocess.TimeoutExpired:
        launcher.kill()  # (its ranks then go by the parent-death signal)
        launcher.wait()
        code = None
    alive = _kill_survivors(ranks)
    assert code is not None and not alive, f"the launcher exited: {code is not None}; ranks alive: {alive}"


SESSION_UNDER_SIGTERM = '''
import time
from ep_plugin.testing import run_ranks


def sleep_in_rank(ctx):
    time.sleep(120)


def test_a_fails():
    assert 1 == 2, "planted failure"


def test_b_runs_ranks_past_the_timeout():
    run_ranks(sleep_in_rank, 2, timeout_s=120)
'''


def test_a_pytest_session_stopped_by_sigterm_reports_what_failed(tmp_path):
    """The GPU stages run pytest under `timeout`: its SIGTERM ended pytest with no summary (or, once the launcher
    turned it into SystemExit, only the current test failed and the session ran on past the timeout). Now the
    launcher cleans its ranks up, and pytest stops as on Ctrl-C, printing what failed so far."""
    import shutil
    import subprocess

    shutil.copy(os.path.join(os.path.dirname(__file__), "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_session.py").write_text(SESSION_UNDER_SIGTERM)
    done = subprocess.run(["timeout", "-k", "30", "20", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tmp_path / "test_session.py")], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert "FAILED test_session.py::test_a_fails" in done.stdout and "KeyboardInterrupt" in done.stdout, done.stdout
    assert done.returncode == 124, done.returncode  # timeout's status: ended by its SIGTERM, not its SIGKILL
    assert not [name for name in os.listdir(tmp_path) if name.startswith("ep_plugin_rdzv_")]  # the launcher cleaned up
