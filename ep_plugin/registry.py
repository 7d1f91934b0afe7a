"""Backend registry: name -> backend class (a factory ``cls(group, hidden_size=..., num_experts=..., ...)``).

Built-in backends are imported lazily so that importing ep_plugin never needs CUDA.
Third-party packages add backends through the entry-point group ``ep_plugin.backends``::

    [project.entry-points."ep_plugin.backends"]
    my_backend = "my_pkg.module:MyBackend"
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Callable, Union

ENTRY_POINT_GROUP = "ep_plugin.backends"

# Either the class itself, or "module:attr" imported on first use.
_Factory = Union[Callable, str]

_BUILTIN: dict[str, str] = {
    "reference": "ep_plugin.backends.reference:ReferenceBackend",
    "hybrid": "ep_plugin.backends.hybrid:HybridBackend",
    "elastic": "ep_plugin.backends.elastic:ElasticBackend",
}
_registry: dict[str, _Factory] = dict(_BUILTIN)
_entry_points_loaded = False


def register_backend(name: str, factory: _Factory, *, overwrite: bool = False) -> None:
    """Register ``factory`` (a Backend subclass or a ``"module:attr"`` string) under ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend name must be a non-empty string, got {name!r}")
    _load_entry_points()
    if name in _registry and not overwrite and _registry[name] is not factory:
        raise ValueError(f"backend {name!r} is already registered; pass overwrite=True to replace it")
    _registry[name] = factory


def get_backend(name: str) -> Callable:
    """Return the backend class registered as ``name``; unknown names list the known ones."""
    _load_entry_points()
    if name not in _registry:
        raise ValueError(f"unknown ep_plugin backend {name!r}; known backends: {', '.join(list_backends())}")
    factory = _registry[name]
    if isinstance(factory, str):
        module_name, _, attr = factory.partition(":")
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):  # an ImportError, as ``from module import attr`` says it: what callers catch
            raise ImportError(f"cannot import name {attr!r} from {module_name!r} (backend {name!r})")
        factory = getattr(module, attr)
        _registry[name] = factory
    return factory


def list_backends() -> list[str]:
    """Names of every registered backend (built-in, registered, and from entry points), sorted."""
    _load_entry_points()
    return sorted(_registry)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        _registry.setdefault(entry_point.name, entry_point.value)
