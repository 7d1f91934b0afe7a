"""Import Megatron-Bridge's model-config modules where its package ``__init__`` cannot run.

``import megatron.bridge`` runs ``megatron/bridge/__init__.py``, which imports every model
bridge (``megatron.bridge.models``, the diffusion models, ``AutoBridge``) and through them
``megatron.bridge.peft.lora_layers``, which imports TransformerEngine unconditionally (0.6.2).
So do ``megatron.bridge.training.config`` (``ConfigContainer``) and every recipe module.
TransformerEngine cannot be carried to a machine without it: ``transformer_engine_cu13`` is a
277 MB native wheel and ``transformer_engine_torch`` ships as source only, compiled against
torch with nvcc. A NeMo container has it; a CPU machine and the lent GPU machine do not.

The model-config path itself does not touch TransformerEngine: ``GPTModelProvider`` (with
Bridge's ``local_layer_spec``), ``ModelProviderMixin`` and ``apply_flex_dispatcher_backend``
import with torch, megatron-core, PyYAML and omegaconf alone. ``import_bridge_module`` imports
such a module: Bridge's own file, executed as it is, nothing replaced. Where TransformerEngine
is missing, the ``__init__`` of the packages in ``PACKAGES_NOT_RUN`` is not executed (the
package object is created empty, so its submodules still load from its folder); where it is
installed, this is a plain import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from contextlib import contextmanager
from types import ModuleType

# Package __init__ files that pull in every model bridge, hence TransformerEngine.
PACKAGES_NOT_RUN = ("megatron.bridge", "megatron.bridge.models")
# What the model-config path uses (the test and examples/nemo import these).
MODEL_CONFIG_MODULES = (
    "megatron.bridge.training.flex_dispatcher_backend",
    "megatron.bridge.models.gpt_provider",
)
MIN_PYTHON = (3, 12)  # megatron-bridge >= 0.6 (and megatron-core >= 0.17) require it


class _EmptyPackageFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the packages in PACKAGES_NOT_RUN at their real folder, without running __init__."""

    def find_spec(self, name, path=None, target=None):
        if name not in PACKAGES_NOT_RUN:
            return None
        real = importlib.machinery.PathFinder.find_spec(name, path)
        if real is None or not real.submodule_search_locations:
            return None
        spec = importlib.machinery.ModuleSpec(name, self, origin=real.origin, is_package=True)
        spec.submodule_search_locations = list(real.submodule_search_locations)
        return spec

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        pass  # the __init__ is what we skip


def transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


@contextmanager
def _package_inits_skipped():
    finder = _EmptyPackageFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def import_bridge_module(name: str) -> ModuleType:
    """Import Bridge module ``name`` (e.g. "megatron.bridge.models.gpt_provider").

    Args:
        name: a module under ``megatron.bridge`` that does not itself need TransformerEngine.
    Returns:
        the module.
    Raises:
        ImportError: Bridge or one of the module's own dependencies is missing.
    """
    if transformer_engine_installed() or name in sys.modules:
        return importlib.import_module(name)
    with _package_inits_skipped():
        return importlib.import_module(name)


def bridge_version() -> str | None:
    """The installed megatron-bridge version, or None."""
    from importlib import metadata

    try:
        return metadata.version("megatron-bridge")
    except metadata.PackageNotFoundError:
        return None


def bridge_missing_reason(modules: tuple[str, ...] = MODEL_CONFIG_MODULES) -> str | None:
    """Why ``modules`` cannot be imported here (None when they can); imports them to find out."""
    if sys.version_info[:2] < MIN_PYTHON:
        return (f"megatron-bridge needs Python >= {'.'.join(map(str, MIN_PYTHON))}; this is "
                f"{sys.version.split()[0]}")
    version = bridge_version()
    if version is None:
        return "megatron-bridge is not installed (pip install --no-deps megatron-bridge==0.6.2 omegaconf pyyaml)"
    try:
        for name in modules:
            import_bridge_module(name)
    except ImportError as error:
        return f"megatron-bridge {version} does not import here: {type(error).__name__}: {error}"
    return None


__all__ = ["MODEL_CONFIG_MODULES", "PACKAGES_NOT_RUN", "bridge_missing_reason", "bridge_version",
           "import_bridge_module", "transformer_engine_installed"]
