"""Loads the compiled extension ep_plugin._C, or says why it is not there."""

from __future__ import annotations

from types import ModuleType
from typing import Optional

from .errors import BackendUnavailableError

_module: Optional[ModuleType] = None
_import_error: Optional[BaseException] = None

try:
    from . import _C as _module  # type: ignore[attr-defined]
except ImportError as exc:  # built without nvcc
    _import_error = exc


def available() -> bool:
    """True when the extension is built and at least one CUDA device answers."""
    return _module is not None and _module.cuda_device_count() > 0


def describe() -> str:
    if _module is None:
        return f"ep_plugin._C not built ({_import_error}); reinstall with nvcc on PATH for the CUDA backends"
    return _module.describe_devices().strip()


def extension() -> ModuleType:
    """The extension module; raises BackendUnavailableError with the reason when missing."""
    if _module is None:
        raise BackendUnavailableError(
            f"ep_plugin._C is not built ({_import_error}); install with nvcc on PATH to get the CUDA backends")
    return _module
