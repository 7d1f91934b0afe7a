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


def built_archs() -> tuple[str, ...]:
    """The SM architectures the extension's kernels were compiled for (EP_PLUGIN_CUDA_ARCHS at build, e.g.
    ("90", "100")); () when it is not built or does not say."""
    if _module is None:
        return ()
    return tuple(arch for arch in getattr(_module, "BUILT_ARCHS", "").split(";") if arch)


def arch_mismatch(capability: tuple[int, int], archs: Optional[tuple[str, ...]] = None
                  ) -> Optional[tuple[str, str]]:
    """(what is wrong, the fix) when the extension's kernels cannot run on a GPU of compute ``capability``
    (major, minor); None when they can.

    Kernels compiled for sm_XY run on GPUs of major X and minor >= Y; an architecture-specific build
    (sm_90a) on that exact GPU only. No PTX is embedded, so nothing else runs. ``archs``: default
    ``built_archs()``; unknown (()) is no mismatch here (a missing extension is reported on its own)."""
    archs = built_archs() if archs is None else archs
    if not archs:
        return None
    major, minor = capability
    for arch in archs:
        digits = arch.rstrip("abcdefghijklmnopqrstuvwxyz")
        exact = digits != arch
        if len(digits) >= 2 and digits.isdigit() and int(digits[:-1]) == major and (
                int(digits[-1]) == minor if exact else int(digits[-1]) <= minor):
            return None
    wanted = ";".join(dict.fromkeys((*archs, f"{major}{minor}")))
    return (f"ep_plugin._C was built for {', '.join('sm_' + arch for arch in archs)}, whose kernels cannot run on "
            f"an sm_{major}{minor} GPU", f'reinstall ep_plugin with EP_PLUGIN_CUDA_ARCHS="{wanted}"')


def arch_problem(capability: tuple[int, int], archs: Optional[tuple[str, ...]] = None) -> Optional[str]:
    """``arch_mismatch`` in one line, or None."""
    mismatch = arch_mismatch(capability, archs)
    return None if mismatch is None else f"{mismatch[0]}: {mismatch[1]}"


def runtime_version() -> Optional[int]:
    """The CUDA runtime the extension was built with (CUDART_VERSION: 13000 is 13.0), or None when not built.
    A driver older than its major version runs none of its kernels (no CUDA device, as ``available`` says)."""
    return None if _module is None else int(_module.cuda_runtime_version())


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
