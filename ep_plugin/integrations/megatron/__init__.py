"""Megatron-Core adapter: select ep_plugin backends with ``moe_flex_dispatcher_backend``.

    import ep_plugin.integrations.megatron as ep_megatron
    ep_megatron.install()
    config = TransformerConfig(..., moe_token_dispatcher_type="flex",
                               moe_flex_dispatcher_backend="ep_hybrid")

or, for an unmodified Megatron-LM script:

    python -m ep_plugin.integrations.megatron.run pretrain_gpt.py --moe-token-dispatcher-type flex \\
        --moe-flex-dispatcher-backend ep_hybrid ...

``install()`` (idempotent) does seven things:

1. wraps ``MoEFlexTokenDispatcher.__init__`` (the class attribute, so the name that
   moe_layer.py bound at import sees it): a plugin name builds an ``EPPluginManager``;
   builtin names run Megatron's own code; an unknown name raises a ValueError listing
   every valid name;
2. widens the ``Literal`` type of ``TransformerConfig.moe_flex_dispatcher_backend`` (which
   Megatron-LM >= 0.17 turns into the CLI ``choices``) and adds the names to the choices of
   an argparse ``--moe-flex-dispatcher-backend`` option written with a fixed list;
3. makes the name-based spots (FP8 padding skip, fine-grained 1F1B callables, input
   freeing) see a plugin name as "hybridep": our manager has HybridEP's shape (permuted
   output, probs needed in backward, identity post-processing, in-dispatch padding);
4. with ``replace_builtin=True``, routes "hybridep" itself to the plugin's hybrid backend;
5. wraps ``SequentialMLP.forward`` so that, on a backend with a combine-input arena, the experts'
   output is allocated there and combined in place (``arena.py``);
6. wraps ``TransformerConfig.__post_init__`` to refuse ``moe_enable_deepep=True`` next to a plugin
   name, as Megatron refuses it next to "hybridep" (it would overwrite the name with "deepep"), and a
   plugin name with another ``moe_token_dispatcher_type`` than "flex" (Megatron would silently run
   that dispatcher), as Megatron refuses it for "ncclep";
7. wraps ``parallel_state.destroy_model_parallel`` to destroy the shared backends first
   (``clear_backend_cache``): their buffers, IPC mappings and arena belong to the groups it destroys,
   and an in-process restart builds new ones.

Importing this package does not import Megatron; ``install()`` raises an ImportError naming
the pip package ``megatron-core`` when it is missing. Version differences live in ``compat``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import threading
from contextlib import contextmanager
from typing import Optional

from . import compat
from .manager import cached_backend_count, clear_backend_cache, rank_capacity_problem

logger = logging.getLogger(__name__)

# moe_flex_dispatcher_backend value -> ep_plugin registry name.
PLUGIN_BACKENDS: dict[str, str] = {
    "ep_reference": "reference",
    "ep_hybrid": "hybrid",
    "ep_elastic": "elastic",
}
# The builtin whose code paths our manager matches (see the name-based spots).
BUILTIN_ALIAS = "hybridep"
CLI_OPTION = "--moe-flex-dispatcher-backend"

_lock = threading.Lock()


class _State:
    installed = False
    replace_builtin = False
    builtin_names: tuple[str, ...] = ()  # Megatron's own names, read before we widen the type
    original_annotations = None  # the field's type and the class annotation, as they were (compat)
    original_init = None
    original_experts_forward = None
    original_config_post_init = None
    original_base_init = None  # every token dispatcher's base class (the dispatcher-type check)
    original_functions: dict = {}  # (module, function) -> original callable
    original_parse_known_args = None
    widened_choices: list = []  # (argparse action, its choices before): put back by uninstall()


_state = _State()


def install(replace_builtin: Optional[bool] = None) -> None:
    """Teach Megatron-Core the plugin's ``moe_flex_dispatcher_backend`` names. Idempotent.

    Args:
        replace_builtin: True also routes "hybridep" to the plugin's hybrid backend, so existing
            configs use the plugin without an edit; False stops that. None (the default) keeps the
            current setting (off at the first install), so a helper that only makes sure the plugin
            is installed (the NeMo helpers) does not switch off what the launcher switched on.
    Raises:
        ImportError: megatron-core is missing or older than 0.16.1 (the message names the package).
        RuntimeError: this megatron-core does not list its flex dispatcher backends as a ``Literal`` (the
            plugin could not tell Megatron's own names from unknown ones); Megatron is left as it was.
    """
    compat.require_megatron()
    with _lock:
        if _state.installed:
            if replace_builtin is not None:
                _state.replace_builtin = bool(replace_builtin)
            return
        annotation = compat.backend_field().type
        _state.builtin_names = compat.literal_names(annotation)
        if not _state.builtin_names:  # the wrapped __init__ would refuse Megatron's own names as unknown
            raise RuntimeError(f"ep_plugin cannot read Megatron's flex dispatcher backends from this megatron-core: "
                               f"TransformerConfig.{compat.BACKEND_FIELD} is annotated {annotation!r}, not a Literal "
                               "of names (supported: megatron-core 0.16.1 to 0.19.x); nothing was installed")
        try:  # all or nothing: a step that fails takes back the ones before it
            _state.original_annotations = compat.backend_annotations()
            compat.set_backend_names(_state.builtin_names + tuple(PLUGIN_BACKENDS))
            _wrap_dispatcher_init()
            _wrap_name_spots()
            _widen_argparse_choices()
            _wrap_experts_forward()
            _wrap_config_post_init()
            _wrap_dispatcher_base_init()
            _wrap_destroy_model_parallel()
        except BaseException:
            _restore_megatron()
            raise
        _state.installed = True
        if replace_builtin is not None:  # only once installed: a failed install routes nothing
            _state.replace_builtin = bool(replace_builtin)


def uninstall() -> None:
    """Undo ``install()`` (for tests and for users who need Megatron's original behaviour back).

    Shared backends already built stay alive for the layers that use them (destroying them is a collective,
    and those layers would fail); ``destroy_model_parallel`` no longer destroys them, so a warning says to
    call ``clear_backend_cache()`` on every rank first.
    """
    with _lock:
        if not _state.installed:
            return
        _restore_megatron()
        _state.installed = False
        _state.replace_builtin = False
        alive = cached_backend_count()
        if alive:  # Megatron's teardown is its own again: it no longer destroys them
            logger.warning("ep_plugin: uninstall() leaves %d shared backend(s) alive for the layers built while "
                           "installed; destroy_model_parallel no longer destroys them: call "
                           "ep_plugin.integrations.megatron.clear_backend_cache() on every rank before the "
                           "process groups go", alive)


def _restore_megatron() -> None:
    """Put back every original that install() recorded (each is recorded as its patch goes in, so this
    also undoes an install() that failed half-way), and the argparse choices it widened."""
    if _state.original_init is not None:
        compat.flex_dispatcher_class().__init__ = _state.original_init
    for (module_name, function_name), original in _state.original_functions.items():
        _rebind(getattr(sys.modules[module_name], function_name), original)
    if _state.original_parse_known_args is not None:
        argparse.ArgumentParser.parse_known_args = _state.original_parse_known_args
    for action, choices in _state.widened_choices:
        action.choices = choices
    if _state.original_experts_forward is not None:
        compat.sequential_mlp_class().forward = _state.original_experts_forward
    if _state.original_config_post_init is not None:
        compat.transformer_config_class().__post_init__ = _state.original_config_post_init
    if _state.original_base_init is not None:
        compat.dispatcher_base_class().__init__ = _state.original_base_init
    if _state.original_annotations is not None:  # the objects themselves (an Optional[Literal] stays one)
        compat.restore_backend_annotations(_state.original_annotations)
    _state.original_init = _state.original_parse_known_args = _state.original_annotations = None
    _state.original_experts_forward = _state.original_config_post_init = _state.original_base_init = None
    _state.original_functions, _state.widened_choices = {}, []


def is_installed() -> bool:
    return _state.installed


def valid_backend_names() -> tuple[str, ...]:
    """Every value ``moe_flex_dispatcher_backend`` accepts once installed (builtin ones first)."""
    builtin = _state.builtin_names or compat.literal_names(compat.backend_field().type)
    return tuple(dict.fromkeys(builtin + tuple(PLUGIN_BACKENDS)))


def unknown_backend_error(name) -> ValueError:
    """The error for a ``moe_flex_dispatcher_backend`` that no dispatcher takes, listing the valid names: raised
    by the dispatcher, and by NeMo's ``validate_ep_plugin_backend`` before it is built."""
    return ValueError(f"unknown moe_flex_dispatcher_backend {name!r}; valid names: {', '.join(valid_backend_names())}")


def plugin_backend_for(name: str) -> Optional[str]:
    """The ep_plugin backend a config value selects, or None when Megatron's own code handles it."""
    if name in PLUGIN_BACKENDS:
        return PLUGIN_BACKENDS[name]
    if name == BUILTIN_ALIAS and _state.replace_builtin:
        return PLUGIN_BACKENDS["ep_hybrid"]
    return None


# ---- 1. the dispatcher ------------------------------------------------------------------------

def _wrap_dispatcher_init() -> None:
    dispatcher_class = compat.flex_dispatcher_class()
    original = dispatcher_class.__init__
    _state.original_init = original

    @functools.wraps(original)
    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        name = config.moe_flex_dispatcher_backend
        backend_name = plugin_backend_for(name)
        if backend_name is None:
            if name not in _state.builtin_names:
                raise unknown_backend_error(name)
            return original(self, num_local_experts, local_expert_indices, config=config,
                            pg_collection=pg_collection)
        _init_plugin_dispatcher(self, backend_name, num_local_experts, local_expert_indices, config,
                                pg_collection)

    dispatcher_class.__init__ = __init__


def _init_plugin_dispatcher(dispatcher, backend_name, num_local_experts, local_expert_indices, config,
                            pg_collection) -> None:
    from .manager import EPPluginManager, resolve_backend_class

    # Before any group is made (a refusal needs no parallel state); the sizes the layer runs with: its own
    # experts per rank, and its own groups' expert tensor-parallel size where it brought groups.
    resolve_backend_class(backend_name, config, local_experts=num_local_experts,
                          tp_copies=None if pg_collection is None else compat.expert_tp_size(pg_collection))
    if pg_collection is None:
        pg_collection = compat.default_pg_collection()
    # The base class sets config, groups and sizes; unlike Megatron's DeepEP path there is no
    # TP x EP > 1 requirement: a plugin backend runs on one rank too.
    compat.dispatcher_base_class().__init__(dispatcher, config=config, pg_collection=pg_collection)
    dispatcher.num_local_experts = num_local_experts
    dispatcher.local_expert_indices = local_expert_indices
    dispatcher._comm_manager = EPPluginManager(
        backend_name, group=dispatcher.tp_ep_group, num_local_experts=num_local_experts,
        num_experts=dispatcher.tp_size * config.num_moe_experts, config=config)
    dispatcher.cudagraph_attrs = ["_comm_manager.token_probs", "_comm_manager.routing_map"]


# ---- 3. name-based spots ----------------------------------------------------------------------

@contextmanager
def _seen_as_builtin(config):
    """Temporarily present a plugin name as "hybridep" to Megatron code that compares names."""
    name = getattr(config, compat.BACKEND_FIELD, None)
    if name not in PLUGIN_BACKENDS:
        yield
        return
    setattr(config, compat.BACKEND_FIELD, BUILTIN_ALIAS)
    try:
        yield
    finally:
        setattr(config, compat.BACKEND_FIELD, name)


def _wrap_name_spots() -> None:
    for spot in compat.NAME_SPOTS:
        original = compat.find_function(spot)
        if original is None or hasattr(original, "__ep_plugin_original__"):
            continue  # absent in this version, or the same function re-exported by an earlier spot

        def wrapper(*args, _original=original, _spot=spot, **kwargs):
            with _seen_as_builtin(_spot.config_of(args, kwargs)):
                return _original(*args, **kwargs)

        functools.update_wrapper(wrapper, original)
        wrapper.__ep_plugin_original__ = original
        _state.original_functions[(spot.module, spot.function)] = original
        _rebind(original, wrapper)


def _rebind(old, new) -> None:
    """Replace ``old`` by ``new`` in every loaded megatron module (callers bound it by name)."""
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("megatron"):
            continue
        for attribute, value in list(vars(module).items()):
            if value is old:
                setattr(module, attribute, new)


# ---- 5. the experts' output in the combine-input arena ------------------------------------------

def _wrap_experts_forward() -> None:
    from . import arena

    experts_class = compat.sequential_mlp_class()
    original = experts_class.forward
    _state.original_experts_forward = original

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        return arena.run_experts(self, original, *args, **kwargs)

    experts_class.forward = forward


# ---- 6. config checks: moe_enable_deepep or another dispatcher type next to a plugin name ----------

def _wrap_config_post_init() -> None:
    config_class = compat.transformer_config_class()
    original = config_class.__post_init__
    _state.original_config_post_init = original

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        name = getattr(self, compat.BACKEND_FIELD, None)
        check_dispatcher_type(self)  # as Megatron refuses another type for "ncclep"
        if getattr(self, "moe_enable_deepep", False) and name in PLUGIN_BACKENDS:
            raise ValueError(f"Only one backend is supported for flex token dispatcher: moe_enable_deepep=True "
                             f"selects DeepEP and moe_flex_dispatcher_backend={name!r} selects ep_plugin's "
                             f"{PLUGIN_BACKENDS[name]} (drop moe_enable_deepep, which Megatron deprecates)")
        if name in PLUGIN_BACKENDS:
            # Before Megatron's check, which would send the user to its own backends ("hybridep", "ncclep").
            problem = rank_capacity_problem(self)
            if problem:
                raise ValueError(problem)
        return original(self, *args, **kwargs)

    config_class.__post_init__ = __post_init__


def _wrap_dispatcher_base_init() -> None:
    """The dispatcher-type check again when any token dispatcher is built: a field set after the config was
    made (a recipe's override, a config made before install()) never passed through __post_init__, and
    Megatron would build its alltoall or allgather dispatcher with the plugin's name ignored."""
    base_class = compat.dispatcher_base_class()
    original = base_class.__init__
    _state.original_base_init = original

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        check_dispatcher_type(kwargs["config"] if "config" in kwargs else args[0])
        return original(self, *args, **kwargs)

    base_class.__init__ = __init__


def check_dispatcher_type(config) -> None:
    """Raise ValueError when ``config`` names a plugin backend with another ``moe_token_dispatcher_type``
    than "flex": Megatron picks the dispatcher by its type and would silently run that one instead."""
    name = getattr(config, compat.BACKEND_FIELD, None)
    dispatcher_type = getattr(config, "moe_token_dispatcher_type", "flex")
    sizes = [getattr(config, field, None) or 1 for field in
             ("tensor_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size")]
    if sizes == [1, 1, 1]:
        # Nothing to move between ranks, so no dispatcher is ignored: Bridge's checkpoint loading and export
        # switch a flex config to "allgather" at TP = EP = 1 (which Megatron's flex refuses), keeping the name.
        return
    if not getattr(config, "num_moe_experts", None):  # a dense model builds no dispatcher (a shared launch script)
        return
    if name in PLUGIN_BACKENDS and dispatcher_type != "flex":
        raise ValueError(f"moe_flex_dispatcher_backend={name!r} requires moe_token_dispatcher_type='flex', got "
                         f"{dispatcher_type!r}: Megatron would run its own {dispatcher_type} dispatcher instead of "
                         f"ep_plugin's. Set moe_token_dispatcher_type='flex' (Megatron-LM: "
                         f"--moe-token-dispatcher-type flex; NeMo: apply_ep_plugin_backend sets both)")


# ---- 7. the shared backends go with the process groups ----------------------------------------

def _wrap_destroy_model_parallel() -> None:
    from megatron.core import parallel_state

    original = parallel_state.destroy_model_parallel

    @functools.wraps(original)
    def destroy_model_parallel(*args, **kwargs):
        try:
            clear_backend_cache()
        except Exception as error:  # noqa: BLE001 - a teardown must finish: warned, not raised
            # Callers tear down after a failure too (Bridge's cleanup, an in-process restart, where peers may
            # be gone): raising here would skip the rest of their teardown. The buffers stay mapped.
            logger.warning("ep_plugin: destroying the shared backends in destroy_model_parallel failed (%s: %s); "
                           "their buffers stay mapped, Megatron's teardown goes on", type(error).__name__, error)
        original(*args, **kwargs)

    _state.original_functions[(parallel_state.__name__, "destroy_model_parallel")] = original
    _rebind(original, destroy_model_parallel)  # callers that imported it by name too


# ---- 2. the Megatron-LM argument parser -------------------------------------------------------

def _widen_argparse_choices() -> None:
    """Add the plugin names to a ``--moe-flex-dispatcher-backend`` option's fixed choices.

    Megatron-LM <= 0.16 writes ``choices=['deepep', 'hybridep']`` by hand; the option is
    found by its flag when the parser parses, wherever it was defined.
    """
    original = argparse.ArgumentParser.parse_known_args
    _state.original_parse_known_args = original

    @functools.wraps(original)
    def parse_known_args(self, *args, **kwargs):
        for action in self._actions:
            if CLI_OPTION in action.option_strings and action.choices is not None:
                missing = [name for name in PLUGIN_BACKENDS if name not in action.choices]
                if missing:
                    _state.widened_choices.append((action, action.choices))
                    action.choices = list(action.choices) + missing
        return original(self, *args, **kwargs)

    argparse.ArgumentParser.parse_known_args = parse_known_args


__all__ = ["PLUGIN_BACKENDS", "check_dispatcher_type", "clear_backend_cache", "install", "is_installed",
           "plugin_backend_for", "uninstall", "unknown_backend_error", "valid_backend_names"]
