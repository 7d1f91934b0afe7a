"""A private CUDA MPS daemon so that several rank processes can share one GPU concurrently.

Without MPS, processes on one GPU time-slice (a cross-process flag round trip ~2 ms);
with it they run at once. The daemon lives in a fresh 0700 directory named after the
process that owns it, and only the daemon this object started is stopped — also when the
body raises or is interrupted. A daemon whose owner was killed (SIGKILL: no cleanup ran)
is stopped by the next PrivateMPS of this user, which finds its folder with its owner gone.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import time

CONTROL = "nvidia-cuda-mps-control"
PREFIX = "ep_plugin_mps_"  # then the owner's pid and "_"


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def stop_orphaned_daemons(folder: str | None = None) -> list[str]:
    """Stop the private daemons in ``folder`` (default: the temp folder) whose owner process is gone, and
    remove their folders; returns the folders it removed. Only this user's folders are readable (0700)."""
    folder = folder or tempfile.gettempdir()
    removed = []
    for name in sorted(os.listdir(folder)):
        owner = name[len(PREFIX):].split("_", 1)[0]
        root = os.path.join(folder, name)
        if not name.startswith(PREFIX) or not owner.isdigit() or _owner_alive(int(owner)):
            continue
        _quit_and_remove(root)
        removed.append(root)
    return removed


def _folders(root: str) -> dict[str, str]:
    """The environment that points MPS clients and the control tool at the daemon of ``root``."""
    return {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log")}


def _quit_and_remove(root: str) -> None:
    """Tell the daemon of ``root`` to quit, give it up to 5 s to go (it removes its control pipe when it has
    exited), and remove the folder whatever it answered: a daemon that is not answering is past saving."""
    control = os.path.join(root, "pipe", "control")
    try:
        if os.path.exists(control):
            subprocess.run([CONTROL], input="quit\n", env={**os.environ, **_folders(root)}, capture_output=True,
                           text=True, timeout=30)
            for _ in range(50):
                if not os.path.exists(control):
                    break
                time.sleep(0.1)
        else:  # a daemon that forked but made no control pipe yet (its start timed out or was cut short)
            _terminate_by_pid_file(root)
    except (OSError, subprocess.SubprocessError):
        pass
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _terminate_by_pid_file(root: str) -> None:
    """SIGTERM the daemon whose pid the pipe folder of ``root`` names, if any: once the folder is gone, no later
    run could find it (``stop_orphaned_daemons`` looks for folders)."""
    try:
        with open(os.path.join(root, "pipe", "nvidia-cuda-mps-control.pid")) as file:
            pid = int(file.read().strip())
    except (OSError, ValueError):
        return
    if pid > 1:
        os.kill(pid, signal.SIGTERM)


class PrivateMPS:
    """Context manager: ``with PrivateMPS() as env: spawn children with env``."""

    def __init__(self) -> None:
        self.root: str | None = None
        self.env: dict[str, str] = {}

    def __enter__(self) -> dict[str, str]:
        if shutil.which(CONTROL) is None:
            raise RuntimeError(f"{CONTROL} not found: several ranks per GPU need CUDA MPS")
        stop_orphaned_daemons()
        self.root = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}_")
        atexit.register(self.stop)  # from here on: stop() quits a daemon that may have started and removes the folder
        try:
            os.chmod(self.root, 0o700)
            self.env = _folders(self.root)
            for path in self.env.values():
                os.makedirs(path, mode=0o700)
            result = subprocess.run([CONTROL, "-d"], env={**os.environ, **self.env}, capture_output=True, text=True,
                                    timeout=30)
        except BaseException:  # the program failed to run, timed out (its daemon may have forked), SIGTERM
            self.stop()
            raise
        if result.returncode != 0:
            self.stop()
            reason = result.stderr.strip() or result.stdout.strip()
            raise RuntimeError(f"could not start a private MPS daemon: {reason}")
        # -d returns once the daemon forked; a client that finds no control pipe yet runs without MPS, silently.
        control = os.path.join(self.env["CUDA_MPS_PIPE_DIRECTORY"], "control")
        deadline = time.monotonic() + 10.0
        while not os.path.exists(control) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not os.path.exists(control):  # the ranks would time-slice the GPU: slow, and timings that mislead
            self.stop()
            raise RuntimeError(f"the private MPS daemon made no control pipe in 10 s ({control}): several ranks per "
                               f"GPU need it")
        return self.env

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.root is None:
            return
        root, self.root = self.root, None
        atexit.unregister(self.stop)
        _quit_and_remove(root)

