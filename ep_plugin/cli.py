"""What the command lines share: one-line errors, and what can run on this machine.

``python -m ep_plugin demo``, ``python -m ep_plugin.bench`` and ``python -m ep_plugin info``
default to the devices and backends that are here, and refuse what is not with one line
(``prog: error: ...``, exit status 2) before any process starts.
"""

from __future__ import annotations

import argparse
import os
from typing import NamedTuple, Optional

import torch


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (no usage block), exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


# The largest count or size an option takes: past an int32 the sizing arithmetic overflows a float (a traceback).
MAX_COUNT = 2**31 - 1


def positive_int(text: str, maximum: int = MAX_COUNT) -> int:
    """argparse type: a whole number in [1, maximum] (a count or a size); anything else is a one-line error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    if value > maximum:
        raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
    return value


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def describe_gpus() -> str:
    """'no GPU (...)' or 'N GPU(s): cuda:0 NAME sm_XY, ...', for people."""
    count = gpu_count()
    if count == 0:
        return "no GPU (torch sees no CUDA device): CPU only, where the reference backend runs"
    names = []
    for index in range(count):
        properties = torch.cuda.get_device_properties(index)
        names.append(f"cuda:{index} {properties.name} sm_{properties.major}{properties.minor}")
    return f"{count} GPU(s): " + ", ".join(names)


def default_device() -> str:
    return "cuda" if gpu_count() else "cpu"


class HostMemory(NamedTuple):
    """What this process can still allocate on the host, and which limit gives that figure."""

    bytes: int
    limit: str  # AVAILABLE or CONTAINER_LIMIT, to name it in a message


AVAILABLE = "the host's available memory"  # /proc/meminfo's MemAvailable
CONTAINER_LIMIT = "what the memory limit of its cgroup (a container's, a job's) leaves"  # the limit less the use


def host_memory(cgroup: str = "/sys/fs/cgroup", own_cgroup: str = "/proc/self/cgroup") -> Optional[HostMemory]:
    """MemAvailable of /proc/meminfo, or less where a cgroup this process is in limits it (a container's
    --memory, a Slurm job's: past it the OOM killer ends a rank, whatever the host has free); None where
    neither is read. ``cgroup`` is where the cgroup tree is mounted, ``own_cgroup`` names this process's."""
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = HostMemory(int(line.split()[1]) * 1024, AVAILABLE)
    except (OSError, ValueError, IndexError):
        pass
    headroom = _cgroup_headroom(cgroup, own_cgroup)
    if headroom is not None and (available is None or headroom < available.bytes):
        available = HostMemory(headroom, CONTAINER_LIMIT)
    return available


# Per cgroup version: the limit's file, the usage's, and memory.stat's inactive page cache (dropped before a kill).
_CGROUP_V2 = ("memory.max", "memory.current", "inactive_file")
_CGROUP_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
_NO_V1_LIMIT = 2**62  # v1 writes "no limit" as the largest page-aligned int64


def _cgroup_headroom(root: str, own_cgroup: str) -> Optional[int]:
    """The least room left under a memory limit of this process's cgroup or of one above it (a limit binds
    every cgroup below: a Slurm job's above its steps'), v2 (``root``) or v1's memory controller
    (``root``/memory), or None where none is set or read. What a cgroup uses is its usage less its inactive
    page cache, which the kernel drops before it kills."""
    places = []  # (mount, path, files)
    try:
        with open(own_cgroup) as lines:
            for line in lines:
                number, controllers, path = (line.rstrip("\n").split(":", 2) + ["", ""])[:3]
                if number == "0" and controllers == "":
                    places.append((root, path, _CGROUP_V2))
                elif "memory" in controllers.split(","):
                    places.append((os.path.join(root, "memory"), path, _CGROUP_V1))
    except OSError:
        pass
    if not places:  # this process's cgroup not known: the root of a v2 tree (a container's own)
        places.append((root, "", _CGROUP_V2))
    least = None
    for mount, path, files in places:
        parts = [part for part in path.split("/") if part and part != ".."]
        for depth in range(len(parts), -1, -1):  # this process's cgroup, then each one above it
            room = _room_under_limit(os.path.join(mount, *parts[:depth]), files)
            if room is not None and (least is None or room < least):
                least = room
    return least


def _room_under_limit(directory: str, files: tuple[str, str, str]) -> Optional[int]:
    """The limit less what the cgroup at ``directory`` uses, or None (no limit, or not readable)."""
    limit_file, usage_file, inactive_key = files
    try:
        with open(os.path.join(directory, limit_file)) as limit:
            text = limit.read().strip()
        if text == "max" or int(text) >= _NO_V1_LIMIT:
            return None
        with open(os.path.join(directory, usage_file)) as usage:
            used = int(usage.read().strip())
    except (OSError, ValueError):
        return None
    try:
        with open(os.path.join(directory, "memory.stat")) as stat:
            for line in stat:
                if line.startswith(inactive_key + " "):
                    used -= int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return max(0, int(text) - max(0, used))


def device_problem(device: str) -> Optional[str]:
    """Why ``device`` ("cpu" or "cuda") cannot be used here, or None."""
    if device == "cuda" and not gpu_count():
        return "--device cuda: there is no GPU here (torch sees no CUDA device); use --device cpu"
    return None


def config_problem() -> Optional[str]:
    """Why the ``EP_PLUGIN_*`` variables do not make a Config (a value that does not parse or is out of
    range), or None: asked before any rank starts, so the answer is one line, not a rank's traceback."""
    from .config import Config

    try:
        Config.from_env()
    except (TypeError, ValueError) as error:
        return str(error)
    return None


def backend_problem(name: str, device: str) -> Optional[str]:
    """Why backend ``name`` cannot run on ``device`` here, or None."""
    from . import _cuda
    from .registry import get_backend

    try:
        backend_cls = get_backend(name)
    except ValueError as exc:  # an unknown name: the message lists the known ones
        return str(exc)
    except ImportError as exc:  # registered (an entry point) but its module does not import: one line, no traceback
        return f"backend {name!r} is registered but cannot be imported ({type(exc).__name__}: {exc})"
    devices = backend_cls.capabilities.devices
    if device not in devices:
        no_gpu = " (and there is no GPU here)" if "cuda" in devices and not gpu_count() else ""
        return f"backend {name!r} runs on {' and '.join(devices)} only, not on {device}{no_gpu}"
    if device == "cuda" and "cpu" not in devices:
        if not _cuda.available():
            return f"backend {name!r} needs the compiled extension: {_cuda.describe()}"
        import torch

        problem = _cuda.arch_problem(torch.cuda.get_device_capability(torch.cuda.current_device()))
        if problem:
            return f"backend {name!r}: {problem}"
    return None


def available_backends(device: str) -> list[str]:
    """The registered backends that can run on ``device`` here, sorted."""
    from .registry import list_backends

    usable = []
    for name in list_backends():
        try:
            if backend_problem(name, device) is None:
                usable.append(name)
        except Exception:  # noqa: BLE001 - a third-party backend that fails to import is not usable
            continue
    return usable
