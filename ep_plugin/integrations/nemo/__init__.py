"""NeMo / Megatron-Bridge adapter: the plugin's counterpart of Bridge's flex-dispatcher helper.

Megatron-Bridge's ``apply_flex_dispatcher_backend(model_config, backend)`` (0.6.x) switches a
model provider's config to the flex dispatcher for "deepep"/"hybridep"/"ncclep":

- a non-MoE model (``num_moe_experts`` unset or 0): warns and changes nothing;
- no CUDA device visible (a config written on a host without a GPU): sets the flex fields
  anyway, and leaves the GPU check to ``validate_flex_dispatcher_backend`` on the training node;
- a GPU the backend does not support (for "hybridep": compute capability major not 8, 9 or 10):
  warns and falls back to ``moe_token_dispatcher_type="alltoall"``,
  ``moe_flex_dispatcher_backend=None``;
- otherwise: ``moe_token_dispatcher_type="flex"``, ``moe_flex_dispatcher_backend=<backend>``,
  ``moe_shared_expert_overlap=False`` (as Bridge sets it; megatron-core 0.16's flex dispatcher has no
  shared-expert overlap, 0.19's has).

``apply_ep_plugin_backend`` does the same for "ep_reference", "ep_hybrid", "ep_elastic", after
``ep_plugin.integrations.megatron.install()``; the CUDA backends support the GPUs "hybridep"
supports, and "ep_reference" needs no GPU (gloo or NCCL, CPU or GPU), so it never falls back.
Unlike Bridge, an unknown name raises (listing the valid ones) instead of warning: a typo in
a plugin name should not silently train with another dispatcher; ``None`` (no backend, which both
signatures allow) warns and changes nothing, as Bridge's does. tests/test_nemo_bridge.py
checks all of this field by field against the real Bridge.

    from ep_plugin.integrations.nemo import apply_ep_plugin_backend
    cfg = some_moe_recipe_config()                     # a Bridge ConfigContainer
    apply_ep_plugin_backend(cfg.model, "ep_hybrid")    # instead of apply_flex_dispatcher_backend
"""

from __future__ import annotations

import logging
import os

from ..megatron import (
    BUILTIN_ALIAS,
    PLUGIN_BACKENDS,
    check_dispatcher_type,
    install,
    plugin_backend_for,
    unknown_backend_error,
    valid_backend_names,
)

logger = logging.getLogger(__name__)

# Compute-capability majors the CUDA backends support: Ampere, Hopper, Blackwell (Bridge's
# list for "hybridep").
SUPPORTED_CC_MAJORS = (8, 9, 10)
# Plugin names that run without a GPU.
CPU_CAPABLE = ("ep_reference",)
# What Bridge falls back to when the requested flex backend cannot run on this GPU.
FALLBACK_DISPATCHER = "alltoall"


def _is_rank_zero() -> bool:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except Exception:  # noqa: BLE001 - logging only
        pass
    return os.environ.get("RANK", "0") == "0"


def _warn(message: str) -> None:
    if _is_rank_zero():
        logger.warning(message)


def gpu_problem(name: str) -> str | None:
    """Why backend ``name`` cannot run on this machine's GPU 0, or None when it can."""
    if name in CPU_CAPABLE:
        return None
    import torch

    if not torch.cuda.is_available():
        return f"{name} needs a CUDA GPU and none is visible"
    properties = torch.cuda.get_device_properties(0)
    if properties.major not in SUPPORTED_CC_MAJORS:
        return (f"{name} supports Ampere, Hopper and Blackwell GPUs (compute capability major "
                f"{SUPPORTED_CC_MAJORS}); GPU 0 is {properties.name} (sm_{properties.major}{properties.minor})")
    return None


def kernel_problem(name: str) -> str | None:
    """Why the compiled kernels of backend ``name`` cannot run here (the extension not built, or built for
    another GPU: the default build is sm_90's), or None: the CLI's own check (``cli.backend_problem``). Not a
    reason to fall back (``apply_ep_plugin_backend``): the install is to be mended, not trained around."""
    from ep_plugin.cli import backend_problem

    return backend_problem(PLUGIN_BACKENDS[name], "cuda") if name not in CPU_CAPABLE else None

def _check_name(name: str) -> None:
    if name not in PLUGIN_BACKENDS:
        raise ValueError(f"unknown ep_plugin dispatcher backend {name!r}; valid names: {', '.join(PLUGIN_BACKENDS)}")


def apply_ep_plugin_backend(model_config, moe_flex_dispatcher_backend: str | None = "ep_hybrid") -> bool:
    """Switch ``model_config`` to the flex dispatcher on an ep_plugin backend, as Bridge's helper does.

    Args:
        model_config: a Megatron TransformerConfig (or a Bridge model provider, which is one).
        moe_flex_dispatcher_backend: "ep_reference", "ep_hybrid" or "ep_elastic"; None (no backend)
            warns and changes nothing, as Bridge's helper does.
    Returns:
        True when the config now selects the backend (also without a visible GPU, as Bridge
        does: ``validate_ep_plugin_backend`` checks the GPU where the job runs). False for None and
        a non-MoE model (config unchanged) and for a GPU the backend does not support (config
        falls back to alltoall, as Bridge's does); a warning on rank 0 says which.
    Raises:
        ValueError: an unknown name (the message lists the valid ones).
        ImportError: megatron-core is not installed.
    """
    if moe_flex_dispatcher_backend is None:
        _warn("no ep_plugin dispatcher backend given (None); leaving the dispatcher unchanged.")
        return False
    _check_name(moe_flex_dispatcher_backend)
    install()
    num_moe_experts = getattr(model_config, "num_moe_experts", None)
    if not num_moe_experts:
        _warn(f"{moe_flex_dispatcher_backend} applies to MoE models only and this config has no "
              "num_moe_experts; leaving the dispatcher unchanged.")
        return False
    import torch

    problem = gpu_problem(moe_flex_dispatcher_backend) if torch.cuda.is_available() else None
    if problem is not None:
        _warn(f"{problem}; falling back to {FALLBACK_DISPATCHER}.")
        model_config.moe_token_dispatcher_type = FALLBACK_DISPATCHER
        model_config.moe_flex_dispatcher_backend = None
        return False
    model_config.moe_token_dispatcher_type = "flex"
    model_config.moe_flex_dispatcher_backend = moe_flex_dispatcher_backend
    model_config.moe_shared_expert_overlap = False
    return True


def validate_ep_plugin_backend(model_config) -> None:
    """Raise if ``model_config`` selects an ep_plugin backend this machine cannot run (its GPU, as Bridge's
    check; also the compiled kernels: ``kernel_problem``), names one
    without ``moe_token_dispatcher_type="flex"`` (Megatron would run the other dispatcher), or names
    no backend at all (a typo such as "ep_hybird"; None with "flex"): the ValueError, listing the valid
    names, that the dispatcher would raise when the model is built.

    The counterpart of Bridge's ``validate_flex_dispatcher_backend`` (which passes the plugin's
    names through unchecked); call it where the job runs, after the config is final (e.g. after
    command-line overrides). A "hybridep" config that ``install(replace_builtin=True)`` routes to the plugin
    is checked as ``ep_hybrid``, which runs for it.
    """
    name = getattr(model_config, "moe_flex_dispatcher_backend", None)
    if (name == BUILTIN_ALIAS and plugin_backend_for(name) is not None  # install(replace_builtin=True)
            and getattr(model_config, "moe_token_dispatcher_type", None) == "flex"):  # else no dispatcher reads it
        name = "ep_hybrid"  # what runs for it
    if name not in PLUGIN_BACKENDS:
        # None is Bridge's fallback next to "alltoall"; a name no dispatcher takes is a typo whatever the type.
        unused = name is None and getattr(model_config, "moe_token_dispatcher_type", None) != "flex"
        if not unused and name not in valid_backend_names():
            raise unknown_backend_error(name)
        return  # Megatron's own names: Bridge's validator covers them
    check_dispatcher_type(model_config)
    if (getattr(model_config, "moe_token_dispatcher_type", None) != "flex"
            or not getattr(model_config, "num_moe_experts", None)):
        return  # passed above only where no dispatcher reads the name (export at TP = EP = 1, a dense model)
    install()
    problem = gpu_problem(name) or kernel_problem(name)
    if problem is not None:
        raise ValueError(problem)


__all__ = ["apply_ep_plugin_backend", "gpu_problem", "kernel_problem", "validate_ep_plugin_backend"]
