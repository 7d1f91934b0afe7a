"""NeMo / Megatron-Bridge adapter: the plugin's counterpart of Bridge's flex-dispatcher helper.

Megatron-Bridge's ``apply_flex_dispatcher_backend(model_config, backend)`` switches a model
provider's config to the flex dispatcher for "deepep"/"hybridep": for a non-MoE model it
warns and changes nothing; on a GPU whose compute capability is not Ampere/Hopper/Blackwell
(major 8, 9, 10) it warns and changes nothing, so the config keeps its previous dispatcher;
otherwise it sets ``moe_token_dispatcher_type="flex"``, ``moe_flex_dispatcher_backend`` and
``moe_shared_expert_overlap=False`` (the flex dispatcher has no shared-expert overlap).

``apply_ep_plugin_backend`` does the same for "ep_reference", "ep_hybrid", "ep_elastic",
after ``ep_plugin.integrations.megatron.install()``. "ep_reference" needs no GPU (it runs on
gloo or NCCL, CPU or GPU); the CUDA backends need a GPU of those generations. Unlike Bridge,
an unknown name raises (listing the valid ones) instead of warning: a typo in a plugin name
should not silently train with another dispatcher.

    from ep_plugin.integrations.nemo import apply_ep_plugin_backend
    apply_ep_plugin_backend(recipe.model, "ep_hybrid")   # recipe: a Bridge ConfigContainer
"""

from __future__ import annotations

import logging
import os

from ..megatron import PLUGIN_BACKENDS, install

logger = logging.getLogger(__name__)

# Compute-capability majors the CUDA backends support: Ampere, Hopper, Blackwell (as in Bridge).
SUPPORTED_CC_MAJORS = (8, 9, 10)
# Plugin names that run without a GPU.
CPU_CAPABLE = ("ep_reference",)


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


def _check_name(name: str) -> None:
    if name not in PLUGIN_BACKENDS:
        raise ValueError(f"unknown ep_plugin dispatcher backend {name!r}; valid names: {', '.join(PLUGIN_BACKENDS)}")


def apply_ep_plugin_backend(model_config, moe_flex_dispatcher_backend: str | None = "ep_hybrid") -> bool:
    """Switch ``model_config`` to the flex dispatcher on an ep_plugin backend, as Bridge's helper does.

    Args:
        model_config: a Megatron TransformerConfig (or a Bridge model provider, which is one).
        moe_flex_dispatcher_backend: "ep_reference", "ep_hybrid" or "ep_elastic".
    Returns:
        True when the config was changed; False when it was left as it was (non-MoE model, or a
        GPU the backend does not support — a warning on rank 0 says which).
    Raises:
        ValueError: an unknown name (the message lists the valid ones).
        ImportError: megatron-core is not installed.
    """
    _check_name(moe_flex_dispatcher_backend)
    install()
    num_moe_experts = getattr(model_config, "num_moe_experts", None)
    if not num_moe_experts:
        _warn(f"{moe_flex_dispatcher_backend} applies to MoE models only and this config has no "
              "num_moe_experts; leaving the dispatcher unchanged.")
        return False
    problem = gpu_problem(moe_flex_dispatcher_backend)
    if problem is not None:
        _warn(f"{problem}; leaving the dispatcher unchanged ({model_config.moe_token_dispatcher_type}).")
        return False
    model_config.moe_token_dispatcher_type = "flex"
    model_config.moe_flex_dispatcher_backend = moe_flex_dispatcher_backend
    model_config.moe_shared_expert_overlap = False
    return True


def validate_ep_plugin_backend(model_config) -> None:
    """Raise if ``model_config`` selects an ep_plugin backend this machine cannot run.

    The counterpart of Bridge's ``validate_flex_dispatcher_backend``; call it after the
    config is final (e.g. after command-line overrides).
    """
    if getattr(model_config, "moe_token_dispatcher_type", None) != "flex":
        return
    name = model_config.moe_flex_dispatcher_backend
    if name not in PLUGIN_BACKENDS:
        return  # Megatron's own names: Bridge's validator covers them
    install()
    problem = gpu_problem(name)
    if problem is not None:
        raise ValueError(problem)


__all__ = ["apply_ep_plugin_backend", "gpu_problem", "validate_ep_plugin_backend"]
