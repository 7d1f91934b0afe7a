"""ep_plugin.integrations.nemo.apply_ep_plugin_backend against Megatron-Bridge's own helper.

Two groups of tests:

- megatron-core only (run in CI: Python 3.11, megatron-core 0.16.1): the helper's contract on a
  plain TransformerConfig, with the GPU generations simulated.
- the real megatron-bridge 0.6.x (Python 3.12 only; skipped elsewhere with the reason): a tiny
  GPT-MoE ``GPTModelProvider`` carrying the dispatcher lines of a Bridge MoE recipe goes through
  Bridge's ``apply_flex_dispatcher_backend(..., "hybridep")`` and, as a copy, through ours with
  each plugin name; every dataclass field must agree except the backend name. Then Bridge's
  ``finalize()`` (Megatron's config validation) and ``provide()`` (the model, whose MoE layers
  must drive the plugin's manager).

GPU generations are simulated by replacing ``torch.cuda.is_available`` and
``torch.cuda.get_device_properties`` for the test: both helpers read them at call time, so
Bridge's code and ours run unmodified. "this-machine" leaves torch alone (on the GPU machine:
the real H200).

Bridge's package __init__ (and its ConfigContainer and recipe modules) import TransformerEngine;
ep_plugin/testing/bridge.py imports the model-config modules without it. A Python 3.12
environment for these tests on a machine without a GPU:

    python3.12 -m venv .venv312
    .venv312/bin/pip install torch==2.11.0          # PyPI's build; it runs on CPU too
    .venv312/bin/pip install --no-deps megatron-core==0.19.2 megatron-bridge==0.6.2 omegaconf
    .venv312/bin/pip install pyyaml numpy packaging tqdm pytest
    EP_PLUGIN_NO_CUDA=1 .venv312/bin/pip install --no-deps --no-build-isolation -e .
    .venv312/bin/python -m pytest tests/test_nemo_bridge.py
"""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from ep_plugin.testing.bridge import MODEL_CONFIG_MODULES, bridge_missing_reason, import_bridge_module

HAVE_MEGATRON = (importlib.util.find_spec("megatron") is not None
                 and importlib.util.find_spec("megatron.core") is not None)
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON,
                                    reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
BRIDGE_MISSING = bridge_missing_reason() if HAVE_MEGATRON else "megatron-core is not installed"
needs_bridge = pytest.mark.skipif(BRIDGE_MISSING is not None,
                                  reason=f"needs the real Megatron-Bridge 0.6.x: {BRIDGE_MISSING}")
pytestmark = pytest.mark.megatron

PLUGIN_NAMES = ("ep_hybrid", "ep_elastic", "ep_reference")
CUDA_PLUGIN_NAMES = ("ep_hybrid", "ep_elastic")
# name -> (torch device name, compute capability) or None for "no CUDA device visible".
SIMULATED_GPUS = {
    "no-cuda": None,
    "V100-sm70": ("Tesla V100-SXM2-32GB", 7, 0),
    "A100-sm80": ("NVIDIA A100-SXM4-80GB", 8, 0),
    "H200-sm90": ("NVIDIA H200", 9, 0),
    "B200-sm100": ("NVIDIA B200", 10, 0),
    "RTX5090-sm120": ("NVIDIA GeForce RTX 5090", 12, 0),
}
THIS_MACHINE = "this-machine"
DEVICES = (THIS_MACHINE, *SIMULATED_GPUS)


def simulate_gpu(monkeypatch, device: str) -> None:
    """Make torch report ``device`` (a key of SIMULATED_GPUS) as GPU 0; THIS_MACHINE: change nothing."""
    if device == THIS_MACHINE:
        return
    spec = SIMULATED_GPUS[device]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: spec is not None)

    def get_device_properties(index=None):
        if spec is None:
            raise RuntimeError("no CUDA GPUs are available (simulated)")
        name, major, minor = spec
        return SimpleNamespace(name=name, major=major, minor=minor)

    monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)


# ---- megatron-core only -------------------------------------------------------------------------

def _transformer_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=1, num_moe_experts=4,
                  moe_router_topk=2, moe_token_dispatcher_type="alltoall", use_cpu_initialization=True)
    values.update(overrides)
    return TransformerConfig(**values)


@needs_megatron
@pytest.mark.parametrize("device", ["no-cuda", "H200-sm90"])
def test_sets_flex_fields(ep_megatron, monkeypatch, device):
    from ep_plugin.integrations.nemo import apply_ep_plugin_backend

    simulate_gpu(monkeypatch, device)
    for name in PLUGIN_NAMES:
        config = _transformer_config()
        config.moe_shared_expert_overlap = True  # set after construction: alltoall allows it
        assert apply_ep_plugin_backend(config, name) is True
        assert (config.moe_token_dispatcher_type, config.moe_flex_dispatcher_backend) == ("flex", name)
        assert config.moe_shared_expert_overlap is False


@needs_megatron
@pytest.mark.parametrize("device", ["V100-sm70", "RTX5090-sm120"])
def test_unsupported_gpu_falls_back_to_alltoall(ep_megatron, monkeypatch, device):
    from ep_plugin.integrations.nemo import apply_ep_plugin_backend, validate_ep_plugin_backend

    simulate_gpu(monkeypatch, device)
    for name in CUDA_PLUGIN_NAMES:
        config = _transformer_config(moe_token_dispatcher_type="flex")
        assert apply_ep_plugin_backend(config, name) is False
        assert (config.moe_token_dispatcher_type, config.moe_flex_dispatcher_backend) == ("alltoall", None)
        config.moe_token_dispatcher_type, config.moe_flex_dispatcher_backend = "flex", name
        with pytest.raises(ValueError, match="supports Ampere, Hopper and Blackwell"):
            validate_ep_plugin_backend(config)
    config = _transformer_config()
    assert apply_ep_plugin_backend(config, "ep_reference") is True  # runs on any GPU
    validate_ep_plugin_backend(config)


@needs_megatron
def test_without_gpu_applies_and_validate_raises(ep_megatron, monkeypatch):
    from ep_plugin.integrations.nemo import apply_ep_plugin_backend, validate_ep_plugin_backend

    simulate_gpu(monkeypatch, "no-cuda")
    config = _transformer_config()
    assert apply_ep_plugin_backend(config, "ep_hybrid") is True  # a config written on a host without a GPU
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        validate_ep_plugin_backend(config)  # where the job runs
    # Where no dispatcher reads the name, no GPU is needed: Bridge's export at TP = EP = 1 switches flex to
    # "allgather" and keeps the name, and a dense model builds no dispatcher (both raised "needs a CUDA GPU").
    export = _transformer_config(moe_token_dispatcher_type="allgather", moe_flex_dispatcher_backend="ep_hybrid")
    validate_ep_plugin_backend(export)
    dense = _transformer_config(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ep_hybrid")
    dense.num_moe_experts = None
    validate_ep_plugin_backend(dense)


@needs_megatron
def test_non_moe_and_unknown_names(ep_megatron, caplog):
    from ep_plugin.integrations.nemo import apply_ep_plugin_backend

    dense = _transformer_config(num_moe_experts=None)
    assert apply_ep_plugin_backend(dense, "ep_reference") is False
    assert dense.moe_token_dispatcher_type == "alltoall"
    for typo in ("ep_hybird", "hybridep"):
        with pytest.raises(ValueError, match="ep_reference, ep_hybrid, ep_elastic"):
            apply_ep_plugin_backend(_transformer_config(), typo)
    # None, which the signature allows (Bridge's too), raised "unknown ... None"; Bridge's helper warns and skips.
    config = _transformer_config()
    assert apply_ep_plugin_backend(config, None) is False
    assert (config.moe_token_dispatcher_type, config.moe_flex_dispatcher_backend) == ("alltoall", "deepep")
    assert "leaving the dispatcher unchanged" in caplog.text


@needs_megatron
def test_validate_refuses_a_name_no_dispatcher_takes(ep_megatron):
    """validate_ep_plugin_backend returned on "ep_hybird" (not a plugin name, so "Megatron's"): the typo
    surfaced only when the model was built. It raises the dispatcher's own error now, where the job starts."""
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    from ep_plugin.integrations.nemo import validate_ep_plugin_backend

    for name, dispatcher_type in (("ep_hybird", "flex"), ("ep_hybird", "alltoall"), (None, "flex")):
        config = _transformer_config(moe_token_dispatcher_type=dispatcher_type)
        config.moe_flex_dispatcher_backend = name
        with pytest.raises(ValueError) as refused:
            validate_ep_plugin_backend(config)
        config.moe_token_dispatcher_type = "flex"
        with pytest.raises(ValueError) as dispatcher_refused:
            MoEFlexTokenDispatcher(2, [0, 1], config=config)
        assert str(refused.value) == str(dispatcher_refused.value), name
        assert "valid names: " in str(refused.value) and "ep_hybrid" in str(refused.value)
    for name, dispatcher_type in (("deepep", "flex"), (None, "alltoall")):  # Megatron's own; Bridge's fallback
        config = _transformer_config(moe_token_dispatcher_type=dispatcher_type)
        config.moe_flex_dispatcher_backend = name
        validate_ep_plugin_backend(config)


# ---- the real Megatron-Bridge -------------------------------------------------------------------

@pytest.fixture
def bridge(ep_megatron):
    """Bridge's flex-dispatcher module and GPT provider module (Bridge's own code)."""
    flex, gpt_provider = (import_bridge_module(name) for name in MODEL_CONFIG_MODULES)
    return SimpleNamespace(apply=flex.apply_flex_dispatcher_backend, validate=flex.validate_flex_dispatcher_backend,
                           gpt_provider=gpt_provider)


def recipe_model(bridge, **overrides):
    """A tiny GPT-MoE provider set up as Bridge's MoE recipes set cfg.model (recipes/qwen/h100/qwen3_moe.py):
    dispatcher alltoall with backend "deepep" pre-set, shared-expert overlap on."""
    gpt_provider = bridge.gpt_provider
    values = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=128,
                  seq_length=32, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128,
                  moe_shared_expert_intermediate_size=128, moe_grouped_gemm=False, add_bias_linear=False,
                  transformer_layer_spec=gpt_provider.local_layer_spec)
    values.update(overrides)
    model = gpt_provider.GPTModelProvider(**values)
    model.expert_model_parallel_size = 2
    model.moe_token_dispatcher_type = "alltoall"
    model.moe_flex_dispatcher_backend = "deepep"
    model.moe_shared_expert_overlap = True
    return model


def fields_of(config) -> dict:
    """Every dataclass field, by value (repr: callables and partials compare by what they are)."""
    return {field.name: repr(getattr(config, field.name)) for field in dataclasses.fields(config)}


def differing(actual: dict, expected: dict) -> dict:
    return {name: (actual[name], expected[name]) for name in expected if actual[name] != expected[name]}


def expected_from_bridge(bridge_model, name: str) -> dict:
    """Bridge's result with our name where Bridge put "hybridep"; "ep_reference" runs on any GPU,
    so where Bridge fell back to alltoall (an unsupported GPU) it is applied all the same."""
    expected = fields_of(bridge_model)
    if bridge_model.moe_token_dispatcher_type == "flex" or name == "ep_reference":
        expected.update(moe_token_dispatcher_type=repr("flex"), moe_flex_dispatcher_backend=repr(name),
                        moe_shared_expert_overlap=repr(False))
    return expected


@needs_bridge
def test_two_identical_recipe_models_compare_equal(bridge):
    assert fields_of(recipe_model(bridge)) == fields_of(recipe_model(bridge))


@needs_bridge
@pytest.mark.parametrize("recipe_applied", [None, "deepep", "hybridep"],
                         ids=["fresh", "after-recipe-deepep", "after-recipe-hybridep"])
@pytest.mark.parametrize("name", PLUGIN_NAMES)
@pytest.mark.parametrize("device", DEVICES)
def test_matches_bridge_field_by_field(bridge, monkeypatch, device, name, recipe_applied):
    """Ours with ``name`` == Bridge's with "hybridep", on the same recipe model, before and after finalize().

    ``recipe_applied``: the recipe already ran Bridge's helper with its own backend (as Bridge's MoE
    recipes do at their end) before the user's line.
    """
    from ep_plugin.integrations.nemo import apply_ep_plugin_backend

    simulate_gpu(monkeypatch, device)
    ours, theirs = recipe_model(bridge), recipe_model(bridge)
    if recipe_applied is not None:
        bridge.apply(ours, recipe_applied)
        bridge.apply(theirs, recipe_applied)
    assert bridge.apply(theirs, "hybridep") is None
    applied = apply_ep_plugin_backend(ours, name)

    expected = expected_from_bridge(theirs, name)
    assert differing(fields_of(ours), expected) == {}
    assert applied is (ours.moe_token_dispatcher_type == "flex")

    # Bridge finalizes the provider (Megatron's TransformerConfig checks) before building the model.
    theirs.finalize()
    ours.finalize()
    assert differing(fields_of(ours), expected_from_bridge(theirs, name)) == {}


@needs_bridge
@pytest.mark.parametrize("num_moe_experts", [None, 0])
@pytest.mark.parametrize("device", DEVICES)
def test_non_moe_model_left_unchanged_by_both(bridge, monkeypatch, device, num_moe_experts):
    from ep_plugin.integrations.nemo import apply_ep_plugin_backend

    simulate_gpu(monkeypatch, device)
    untouched = fields_of(recipe_model(bridge, num_moe_experts=num_moe_experts))
    theirs = recipe_model(bridge, num_moe_experts=num_moe_experts)
    bridge.apply(theirs, "hybridep")
    assert differing(fields_of(theirs), untouched) == {}
    for name in PLUGIN_NAMES:
        ours = recipe_model(bridge, num_moe_experts=num_moe_experts)
        assert apply_ep_plugin_backend(ours, name) is False
        assert differing(fields_of(ours), untouched) == {}


@needs_bridge
@pytest.mark.parametrize("device", DEVICES)
def test_validation_agrees_with_bridge(bridge, monkeypatch, device):
    """Where Bridge's validator rejects "hybridep", ours rejects the CUDA backends; Bridge's own
    validator (run by ConfigContainer.validate) lets the plugin names through wherever it can read
    the GPU."""
    from ep_plugin.integrations.nemo import validate_ep_plugin_backend

    simulate_gpu(monkeypatch, device)

    def raises(validate, config) -> bool:
        try:
            validate(config)
        except (ValueError, RuntimeError, AssertionError):
            return True
        return False

    def flex_model(name):
        model = recipe_model(bridge)
        model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend = "flex", name
        return model

    bridge_rejects = raises(bridge.validate, flex_model("hybridep"))
    for name in CUDA_PLUGIN_NAMES:
        assert raises(validate_ep_plugin_backend, flex_model(name)) == bridge_rejects, name
    assert not raises(validate_ep_plugin_backend, flex_model("ep_reference"))
    gpu_readable = device != "no-cuda" and (device != THIS_MACHINE or torch.cuda.is_available())
    for name in PLUGIN_NAMES:
        assert raises(bridge.validate, flex_model(name)) == (not gpu_readable), name


@needs_bridge
def test_unknown_name_leaves_recipe_model_unchanged(bridge, monkeypatch):
    """Bridge warns and leaves the config; ours raises (a typo must not train another dispatcher),
    and leaves the config too."""
    from ep_plugin.integrations.nemo import apply_ep_plugin_backend

    simulate_gpu(monkeypatch, "H200-sm90")
    untouched = fields_of(recipe_model(bridge))
    theirs, ours = recipe_model(bridge), recipe_model(bridge)
    bridge.apply(theirs, "ep_hybird")
    assert differing(fields_of(theirs), untouched) == {}
    with pytest.raises(ValueError, match="ep_hybrid"):
        apply_ep_plugin_backend(ours, "ep_hybird")
    assert differing(fields_of(ours), untouched) == {}
    bridge.apply(theirs, None)  # no backend: both warn and change nothing
    assert apply_ep_plugin_backend(ours, None) is False
    assert differing(fields_of(theirs), untouched) == {} and differing(fields_of(ours), untouched) == {}


def _provide_rank(ctx, name: str) -> list[str]:
    """One rank: the recipe model with ``name`` applied, finalized and built by Bridge's provide()."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    import ep_plugin.integrations.megatron as ep_megatron
    from ep_plugin.integrations.megatron.manager import clear_backend_cache
    from ep_plugin.integrations.nemo import apply_ep_plugin_backend

    ep_megatron.install()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ctx.world_size)
    gpt_provider = import_bridge_module("megatron.bridge.models.gpt_provider")
    # bf16, as Bridge's mixed-precision recipes set it: the compiled backends refuse an fp32 model at build.
    model_config = recipe_model(SimpleNamespace(gpt_provider=gpt_provider), use_cpu_initialization=True,
                                gradient_accumulation_fusion=False, bf16=True, params_dtype=torch.bfloat16)
    model_config.expert_model_parallel_size = ctx.world_size
    assert apply_ep_plugin_backend(model_config, name)
    model_config.finalize()
    model_config._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model = model_config.provide()
    managers = [f"{type(module.token_dispatcher).__name__}/{type(module.token_dispatcher._comm_manager).__name__}/"
                f"{module.token_dispatcher._comm_manager.backend_name}"
                for module in model.modules() if hasattr(module, "token_dispatcher")]
    clear_backend_cache()
    parallel_state.destroy_model_parallel()
    return managers


@needs_bridge
@pytest.mark.parametrize("name, device", [("ep_reference", "cpu"),
                                          pytest.param("ep_hybrid", "cuda", marks=pytest.mark.gpu),
                                          pytest.param("ep_elastic", "cuda", marks=pytest.mark.gpu)])
def test_provider_builds_model_on_plugin_dispatcher(name, device):
    """Bridge's provide() builds a GPTModel whose MoE layers drive the plugin's manager."""
    from ep_plugin.integrations.megatron import PLUGIN_BACKENDS
    from ep_plugin.testing import run_ranks

    results = run_ranks(_provide_rank, 2, name, device=device, timeout_s=240)
    expected = [f"MoEFlexTokenDispatcher/EPPluginManager/{PLUGIN_BACKENDS[name]}"] * 2  # one per MoE layer
    assert results == [expected, expected]
