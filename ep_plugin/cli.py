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
CONTAINER_LIMIT = "what the container's memory limit leaves"  # cgroup v2 memory.max less what the cgroup uses


def host_memory(cgroup: str = "/sys/fs/cgroup") -> Optional[HostMemory]:
    """MemAvailable of /proc/meminfo, or less where this process's cgroup (v2) limits it (a container's
    --memory: past it the OOM killer ends a rank, whatever the host has free); None where neither is read."""
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = HostMemory(int(line.split()[1]) * 1024, AVAILABLE)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(os.path.join(cgroup, "memory.max")) as limit, open(os.path.join(cgroup, "memory.current")) as used:
            text = limit.read().strip()
            if text != "max":
                headroom = max(0, int(text) - int(used.read().strip()))
                if available is None or headroom < available.bytes:
                    available = HostMemory(headroom, CONTAINER_LIMIT)
    except (OSError, ValueError):
        pass
    return available


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
