"""Everything that differs between megatron-core versions (0.16.1 through 0.19.x) lives here.

The rest of the Megatron adapter asks this module for classes and facts and never tests a
version itself. What differs:

- where the name-based spots live: ``should_free_input`` moved from
  ``models.gpt.fine_grained_callables`` (0.16) to ``models.common.utils`` (0.19);
  ``skip_routed_expert_padding`` (the FP8 padding skip in the experts) exists from 0.19 on;
- the builtin backend names (0.16: deepep, hybridep; 0.19 adds ncclep) — read from the
  ``Literal`` type of ``TransformerConfig.moe_flex_dispatcher_backend``, never listed here;
- whether a dispatcher may be built without ``pg_collection`` (0.16 needs one; both versions
  offer ``moe_utils.get_default_pg_collection()``);
- 0.19 reads ``manager.over_budget`` (paged stash) and asserts TP x EP > 1 only for deepep and
  ncclep; 0.16 asserts it for every flex backend. The plugin path never asserts it, and its
  manager always carries ``over_budget``, so neither needs a version test;
- 0.16's MoE layer of hybrid models under partial local CUDA graphs reads the flex dispatcher's
  attributes by dotted names with a plain ``getattr`` (``partial_local_graph_problem``).
"""

from __future__ import annotations

import importlib
import typing
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

PIP_PACKAGE = "megatron-core"
MIN_VERSION = (0, 16, 1)
TESTED_UP_TO = (0, 19)  # newest minor version this adapter was written against


def require_megatron():
    """Import megatron.core or raise an ImportError that names the pip package to install."""
    try:
        import megatron.core  # noqa: F401
        from megatron.core import package_info
    except ImportError as error:
        raise ImportError(
            f"ep_plugin.integrations.megatron needs Megatron-Core: `pip install {PIP_PACKAGE}` "
            f"(>= {'.'.join(map(str, MIN_VERSION))}; 0.16.1 is the newest for Python 3.11). "
            f"Importing it failed with: {error}") from error
    version = megatron_version()
    if version < MIN_VERSION:
        raise ImportError(f"ep_plugin.integrations.megatron needs {PIP_PACKAGE} >= "
                          f"{'.'.join(map(str, MIN_VERSION))}, found {package_info.__version__}")
    if version[:2] > TESTED_UP_TO:
        warnings.warn(f"ep_plugin.integrations.megatron was written against megatron-core up to "
                      f"{'.'.join(map(str, TESTED_UP_TO))}.x; found {package_info.__version__}. The flex "
                      f"dispatcher's contract may have changed.", stacklevel=3)
    return megatron.core


def megatron_version() -> tuple[int, int, int]:
    from megatron.core import package_info

    return (int(package_info.MAJOR), int(package_info.MINOR), int(package_info.PATCH))


def flex_dispatcher_class():
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    return MoEFlexTokenDispatcher


def dispatcher_base_class():
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    return MoETokenDispatcher


def sequential_mlp_class():
    from megatron.core.transformer.moe.experts import SequentialMLP

    return SequentialMLP


def transformer_config_class():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig


BACKEND_FIELD = "moe_flex_dispatcher_backend"


def backend_field():
    """The dataclass Field of ``TransformerConfig.moe_flex_dispatcher_backend``."""
    return transformer_config_class().__dataclass_fields__[BACKEND_FIELD]


def literal_names(annotation: Any) -> tuple[str, ...]:
    """The strings of a ``Literal[...]`` (or ``Optional[Literal[...]]``) annotation."""
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(typing.get_args(annotation))
    names: tuple[str, ...] = ()
    for argument in typing.get_args(annotation):
        names += literal_names(argument)
    return names


def backend_annotations() -> tuple[Any, Any]:
    """The backend field's type and ``TransformerConfig``'s annotation of it (``set_backend_names`` changes
    both; ``restore_backend_annotations`` puts these back)."""
    return backend_field().type, transformer_config_class().__annotations__[BACKEND_FIELD]


def restore_backend_annotations(saved: tuple[Any, Any]) -> None:
    backend_field().type, transformer_config_class().__annotations__[BACKEND_FIELD] = saved


def set_backend_names(names: tuple[str, ...]) -> None:
    """Make ``TransformerConfig.moe_flex_dispatcher_backend`` a Literal of ``names``.

    Megatron-LM >= 0.17 generates the ``--moe-flex-dispatcher-backend`` choices from this
    type (``ArgumentGroupFactory`` reads ``Field.type``); typed config systems read the
    annotation. An ``Optional[Literal[...]]`` stays Optional.
    """
    literal = typing.Literal[names]  # type: ignore[valid-type]
    if type(None) in typing.get_args(backend_field().type):
        literal = typing.Optional[literal]
    backend_field().type = literal
    transformer_config_class().__annotations__[BACKEND_FIELD] = literal


def default_pg_collection():
    """Process groups of the global parallel state (what a dispatcher uses without pg_collection)."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    return get_default_pg_collection()


def expert_tp_size(pg_collection) -> int:
    """The expert tensor-parallel size of ``pg_collection``, as the dispatcher's base class reads it."""
    from megatron.core.utils import get_pg_size

    return get_pg_size(getattr(pg_collection, "expt_tp", None))


def activation_dtype(config):
    """The dtype of the hidden states Megatron hands the dispatcher, as far as the config tells: bf16 or
    fp16 under those mixed-precision flags (Float16Module casts the model), Megatron's own autocast
    dtype (``enable_autocast``, 0.16 on), else the parameters' dtype. A script may still cast the model
    itself (``model.bfloat16()``) with the config left at fp32."""
    import torch

    if getattr(config, "bf16", False):
        return torch.bfloat16
    if getattr(config, "fp16", False):
        return torch.float16
    if getattr(config, "enable_autocast", False) and getattr(config, "autocast_dtype", None) is not None:
        return config.autocast_dtype
    return getattr(config, "params_dtype", None) or torch.float32


def quantized(config) -> bool:
    """Whether the experts' GEMMs run in FP8 or FP4 (Transformer Engine's recipes)."""
    return bool(getattr(config, "fp8", None) or getattr(config, "fp4", None))


def quantization_pad_multiple(config) -> Optional[int]:
    """Row alignment FP8/FP4 expert GEMMs need (None without FP8/FP4), like HybridEP's pad_multiple."""
    if not quantized(config):
        return None
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    return int(get_align_size_for_quantization(config)) or None


# ---- name-based spots -------------------------------------------------------------------------

@dataclass(frozen=True)
class NameSpot:
    """A Megatron function that branches on ``config.moe_flex_dispatcher_backend == "hybridep"``.

    ``config_of(args, kwargs)`` finds the TransformerConfig in a call of that function.
    """

    module: str
    function: str
    config_of: Callable[[tuple, dict], Any]
    what: str


def dispatcher_num_sms(config) -> Optional[int]:
    """The SMs per rank Megatron's config gives its flex dispatcher: 0.19's ``moe_flex_dispatcher_num_sms``
    (None: not set; its __post_init__ routes the deprecated per-backend knobs there), or 0.16's
    ``moe_hybridep_num_sms`` (HybridEP's own knob, default 16), else None."""
    return getattr(config, dispatcher_num_sms_field(config), None)


def dispatcher_num_sms_field(config) -> str:
    """The name of the field ``dispatcher_num_sms`` reads, for messages."""
    return "moe_flex_dispatcher_num_sms" if hasattr(config, "moe_flex_dispatcher_num_sms") else "moe_hybridep_num_sms"


def graph_capturing_the_dispatch(config) -> Optional[str]:
    """The CUDA-graph setting under which Megatron captures an MoE layer's dispatch in training, as
    "field=value" for a message, or None. The scope field is 0.16's ``cuda_graph_scope``, 0.19's
    ``cuda_graph_modules``:

    - ``cuda_graph_impl="full_iteration"`` (0.19), or "full_iteration" in the scope (0.16): the whole step;
    - "local" or "transformer_engine" with an empty scope: the whole layer (0.19's "local" leaves the layer
      alone when ``inference_cuda_graph_scope`` is "block": its graphs are the inference block's);
    - "local" with "attn" in the scope on a GPT layer (a plain TransformerLayer, ``is_hybrid_model`` False):
      its local graph holds the layer's whole forward, the MoE part included.

    Else None: "transformer_engine" graphs stop at "moe_router" / "moe_preprocess"; "moe" needs
    drop-and-pad, refused apart."""
    impl = getattr(config, "cuda_graph_impl", "none")
    if impl == "full_iteration":  # 0.19
        return "cuda_graph_impl='full_iteration'"
    if impl not in ("local", "transformer_engine"):
        return None
    field, names = _graph_scopes(config)
    if "full_iteration" in names:
        return f"cuda_graph_impl={impl!r} with {field}=['full_iteration']"
    if not names:
        inference_scope = getattr(getattr(config, "inference_cuda_graph_scope", None), "name", None)
        if impl == "local" and inference_scope == "block":
            return None
        return f"cuda_graph_impl={impl!r} with an empty {field} (the whole layer)"
    if impl == "local" and "attn" in names and not getattr(config, "is_hybrid_model", False):
        return f"cuda_graph_impl='local' with 'attn' in {field} (a GPT layer's local graph holds its whole forward)"
    return None


def _graph_scopes(config) -> tuple[str, list[str]]:
    """(The scope field's name: 0.16's ``cuda_graph_scope``, 0.19's ``cuda_graph_modules``; its scopes' names)."""
    field = "cuda_graph_modules" if hasattr(config, "cuda_graph_modules") else "cuda_graph_scope"
    scopes = getattr(config, field, None) or []
    if isinstance(scopes, str):  # before __post_init__ normalized it: "full" or "a,b"
        scopes = [] if scopes == "full" else scopes.split(",")
    return field, [getattr(scope, "name", scope) for scope in (scopes if isinstance(scopes, (list, tuple))
                                                               else [scopes])]


def partial_local_graph_problem(config) -> Optional[str]:
    """Why a hybrid (Mamba) model's MoE layers cannot run under partial local CUDA graphs on this Megatron-Core,
    or None. 0.16's ``MoETransformerLayer._forward_mlp_router`` copies the flex dispatcher's graph attributes,
    named ``"_comm_manager.token_probs"`` and the like, with a plain ``getattr``, which raises AttributeError at
    the first step whatever the flex backend (HybridEP's too); 0.19 resolves the dotted names
    (``_resolve_token_dispatcher_attr``)."""
    if getattr(config, "cuda_graph_impl", "none") != "local" or not getattr(config, "is_hybrid_model", False):
        return None
    field, names = _graph_scopes(config)
    if "moe_router" not in names and "moe_preprocess" not in names:  # (either makes the layer's graphs partial)
        return None
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    if hasattr(MoETransformerLayer, "_resolve_token_dispatcher_attr"):
        return None
    version = ".".join(map(str, megatron_version()))
    return (f"cuda_graph_impl='local' with 'moe_router' or 'moe_preprocess' in {field} on a hybrid model: "
            f"megatron-core {version}'s "
            "MoETransformerLayer reads the flex dispatcher's attributes '_comm_manager.token_probs' and "
            "'_comm_manager.routing_map' with a plain getattr, which raises AttributeError at the first step for "
            "every flex backend, HybridEP's too (later megatron-core versions resolve the dotted names). Use "
            "cuda_graph_impl='transformer_engine' with the same scopes, or leave 'moe_router' and "
            "'moe_preprocess' out")


def _argument(index: int, name: str) -> Callable[[tuple, dict], Any]:
    def config_of(args: tuple, kwargs: dict) -> Any:
        return kwargs[name] if name in kwargs else args[index]

    return config_of


def _layer_config(args: tuple, kwargs: dict) -> Any:
    layer = kwargs["layer"] if "layer" in kwargs else args[0]
    return layer.config


NAME_SPOTS = (
    NameSpot("megatron.core.models.gpt.fine_grained_callables", "should_free_input", _argument(2, "config"),
             "input freeing of the 1F1B schedule nodes (0.16)"),
    NameSpot("megatron.core.models.common.utils", "should_free_input", _argument(2, "config"),
             "input freeing of the 1F1B schedule nodes (0.19)"),
    NameSpot("megatron.core.models.gpt.fine_grained_callables", "build_transformer_layer_callables",
             _layer_config, "fine-grained 1F1B callables (probs handed to the dispatcher's manager)"),
    NameSpot("megatron.core.transformer.moe.moe_utils", "skip_routed_expert_padding", _argument(0, "config"),
             "FP8/FP4 padding skip in the experts (0.19)"),
)


def find_function(spot: NameSpot) -> Optional[Callable]:
    """The spot's function in this megatron-core version, or None where it does not exist."""
    try:
        module = importlib.import_module(spot.module)
    except ImportError:
        return None
    return getattr(module, spot.function, None)
