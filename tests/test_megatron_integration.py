"""ep_plugin.integrations.megatron.install(), against real megatron-core (the NeMo/Bridge helper:
test_nemo_bridge.py).

These run in the test process (no process group needed) plus two short subprocesses: one
with Megatron hidden from the import system (the ImportError a user without megatron-core
sees), one running a script through ``python -m ep_plugin.integrations.megatron.run``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap
import typing

import pytest
import torch

import ep_plugin
from ep_plugin.cli import backend_problem
from ep_plugin.testing import run_ranks

HAVE_MEGATRON = (importlib.util.find_spec("megatron") is not None
                 and importlib.util.find_spec("megatron.core") is not None)
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON,
                                    reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
pytestmark = pytest.mark.megatron

PLUGIN_NAMES = ("ep_reference", "ep_hybrid", "ep_elastic")


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=1, num_moe_experts=4,
                  moe_router_topk=2, moe_token_dispatcher_type="flex", use_cpu_initialization=True)
    values.update(overrides)
    return TransformerConfig(**values)


def _should_free_input_module():
    """Where this megatron-core keeps should_free_input (0.16: gpt.fine_grained_callables; 0.19: common.utils)."""
    import importlib

    for name in ("megatron.core.models.common.utils", "megatron.core.models.gpt.fine_grained_callables"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "should_free_input"):
            return module
    raise AssertionError("should_free_input not found in this megatron-core")


def _should_free_input(node: str, config) -> bool:
    import inspect

    function = _should_free_input_module().should_free_input
    if "num_local_experts" in inspect.signature(function).parameters:  # 0.19
        return function(node, True, config, num_local_experts=2)
    return function(node, True, config)


def _same(now: dict, before: dict) -> bool:
    """Every object is the one it was (equal is not enough: a rebuilt Literal of the same names equals the
    original, and an Optional[Literal[...]] must not come back as a plain Literal)."""
    return now.keys() == before.keys() and all(now[key] is before[key] for key in before)


def _snapshot():
    """Everything install() touches, by identity."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import fine_grained_callables
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher, MoETokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    field = TransformerConfig.__dataclass_fields__["moe_flex_dispatcher_backend"]
    return {
        "init": MoEFlexTokenDispatcher.__init__,
        "base_init": MoETokenDispatcher.__init__,
        "experts_forward": SequentialMLP.forward,
        "should_free_input": _should_free_input_module().should_free_input,
        "layer_callables": fine_grained_callables.build_transformer_layer_callables,
        "field_type": field.type,
        "annotation": TransformerConfig.__annotations__["moe_flex_dispatcher_backend"],
        "parse_known_args": argparse.ArgumentParser.parse_known_args,
        "config_post_init": TransformerConfig.__post_init__,
        "destroy_model_parallel": parallel_state.destroy_model_parallel,
    }


@needs_megatron
def test_install_twice_changes_nothing(ep_megatron):
    first = _snapshot()
    ep_megatron.install()
    second = _snapshot()
    assert first == second
    names = typing.get_args(second["field_type"])
    assert len(names) == len(set(names)), f"a name was added twice: {names}"
    for name in PLUGIN_NAMES + ("deepep", "hybridep"):
        assert names.count(name) == 1


@needs_megatron
def test_install_then_uninstall_restores_megatron(ep_megatron):
    ep_megatron.uninstall()
    original = _snapshot()
    assert not set(PLUGIN_NAMES) & set(typing.get_args(original["field_type"]))
    ep_megatron.install()
    installed = _snapshot()
    for key in original:
        assert installed[key] is not original[key], f"install() did not replace {key}"
    ep_megatron.uninstall()
    assert _same(_snapshot(), original)
    ep_megatron.install()


@needs_megatron
def test_uninstall_takes_back_the_widened_parser_choices(ep_megatron):
    parser = argparse.ArgumentParser()
    parser.add_argument("--moe-flex-dispatcher-backend", type=str, default="deepep", choices=["deepep", "hybridep"])
    assert parser.parse_args(["--moe-flex-dispatcher-backend", "ep_hybrid"]).moe_flex_dispatcher_backend == "ep_hybrid"
    ep_megatron.uninstall()
    try:
        with pytest.raises(SystemExit):  # Megatron's own choices again
            parser.parse_args(["--moe-flex-dispatcher-backend", "ep_hybrid"])
        parsed = parser.parse_args(["--moe-flex-dispatcher-backend", "hybridep"])
        assert parsed.moe_flex_dispatcher_backend == "hybridep"
    finally:
        ep_megatron.install()


@needs_megatron
def test_an_install_that_fails_half_way_leaves_megatron_as_it_was(ep_megatron, monkeypatch):
    """A step that raises (here the last one, made to fail) takes back the steps before it: no half-patched
    Megatron that uninstall() would not undo, and a later install() wraps the originals once."""
    ep_megatron.uninstall()
    original = _snapshot()

    def fails():
        raise RuntimeError("this step failed")

    monkeypatch.setattr(ep_megatron, "_wrap_config_post_init", fails)
    with pytest.raises(RuntimeError, match="this step failed"):
        ep_megatron.install()
    assert not ep_megatron.is_installed()
    assert _same(_snapshot(), original)
    monkeypatch.undo()
    ep_megatron.install()
    installed = _snapshot()
    assert all(installed[key] is not original[key] for key in original), "install() after the failed one"
    ep_megatron.uninstall()
    assert _same(_snapshot(), original)
    ep_megatron.install()


@needs_megatron
def test_an_annotation_without_megatrons_names_is_refused_at_install(ep_megatron, monkeypatch):
    """A megatron-core whose backend field is not a Literal of names (a future one, say): install() raises
    instead of wrapping a dispatcher that would refuse "deepep" and "hybridep" as unknown."""
    ep_megatron.uninstall()
    original = _snapshot()
    from megatron.core.transformer.transformer_config import TransformerConfig

    monkeypatch.setattr(TransformerConfig.__dataclass_fields__["moe_flex_dispatcher_backend"], "type", str)
    with pytest.raises(RuntimeError, match="is annotated <class 'str'>, not a Literal of names"):
        ep_megatron.install(replace_builtin=True)
    assert not ep_megatron.is_installed()
    assert ep_megatron.plugin_backend_for("hybridep") is None  # a failed install routes nothing to the plugin
    monkeypatch.undo()
    assert _same(_snapshot(), original)
    ep_megatron.install()


@needs_megatron
def test_uninstall_puts_back_the_annotation_megatron_had(ep_megatron, monkeypatch):
    """An Optional[Literal[...]] (how a config system may declare the field) comes back as itself; before,
    uninstall() wrote a plain Literal of Megatron's names in its place."""
    ep_megatron.uninstall()
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ep_plugin.integrations.megatron import compat

    field = TransformerConfig.__dataclass_fields__["moe_flex_dispatcher_backend"]
    optional = typing.Optional[field.type]
    monkeypatch.setattr(field, "type", optional)
    monkeypatch.setitem(TransformerConfig.__annotations__, "moe_flex_dispatcher_backend", optional)
    ep_megatron.install()
    assert set(PLUGIN_NAMES) <= set(compat.literal_names(field.type)) and type(None) in typing.get_args(field.type)
    ep_megatron.uninstall()
    assert field.type is optional and TransformerConfig.__annotations__["moe_flex_dispatcher_backend"] is optional
    monkeypatch.undo()
    ep_megatron.install()


@needs_megatron
def test_unknown_backend_name_lists_valid_names(ep_megatron):
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    config = _config(moe_flex_dispatcher_backend="ep_hybird")  # TransformerConfig itself accepts any string
    with pytest.raises(ValueError) as error:
        MoEFlexTokenDispatcher(2, [0, 1], config=config)
    message = str(error.value)
    assert "'ep_hybird'" in message
    for name in PLUGIN_NAMES + ("deepep", "hybridep"):
        assert name in message


@needs_megatron
@pytest.mark.skipif(backend_problem("hybrid", "cuda" if torch.cuda.is_available() else "cpu") is None,
                    reason="hybrid runs here")
def test_a_backend_that_cannot_run_here_fails_at_model_build(ep_megatron):
    """Not at the first forward, and as BackendUnavailableError naming the config value and why."""
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    config = _config(moe_flex_dispatcher_backend="ep_hybrid", bf16=True, params_dtype=torch.bfloat16)
    with pytest.raises(ep_plugin.BackendUnavailableError, match="moe_flex_dispatcher_backend='ep_hybrid'.*cuda"):
        MoEFlexTokenDispatcher(2, [0, 1], config=config)
    # Megatron's own name routed to the plugin: the message says so (else it reads as HybridEP's problem).
    ep_megatron.install(replace_builtin=True)
    try:
        config = _config(moe_flex_dispatcher_backend="hybridep", bf16=True, params_dtype=torch.bfloat16)
        with pytest.raises(ep_plugin.BackendUnavailableError,
                           match=r"'hybridep' \(routed to ep_plugin by install\(replace_builtin=True\)\): .*cuda"):
            MoEFlexTokenDispatcher(2, [0, 1], config=config)
    finally:
        ep_megatron.install(replace_builtin=False)


@needs_megatron
def test_activations_the_backend_does_not_move_are_named_at_model_build(ep_megatron, caplog):
    """The compiled backends move bf16. An fp16 model is refused when its dispatcher is built (before any
    process group is touched), naming the flags; an fp32 config is warned about once (a script may cast
    the model to bf16 itself); bf16 parameters or Megatron's bf16 autocast pass silently."""
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    from ep_plugin.integrations.megatron import manager
    from ep_plugin.logs import forget_warnings

    def build_outcome(name, **flags) -> tuple[str, list[str]]:
        """(the error building raised, the dtype warnings it logged)."""
        forget_warnings()
        caplog.clear()
        try:
            MoEFlexTokenDispatcher(2, [0, 1], config=_config(moe_flex_dispatcher_backend=name, **flags))
            error = ""
        except Exception as raised:  # noqa: BLE001 - without process groups (or a GPU) building fails later on
            error = f"{type(raised).__name__}: {raised}"
        return error, [r.getMessage() for r in caplog.records if "moves bfloat16 tokens" in r.getMessage()]

    caplog.set_level("WARNING", logger=manager.__name__)
    for name in ("ep_hybrid", "ep_elastic"):
        error, warnings = build_outcome(name, fp16=True, params_dtype=torch.float16)
        assert error.startswith(f"ValueError: moe_flex_dispatcher_backend='{name}': backend") and \
            "moves bfloat16 tokens, but this config's activations are float16" in error and "bf16=True" in error, error
        assert warnings == [], warnings
        error, warnings = build_outcome(name)  # fp32: a warning, and no dtype error
        assert "moves bfloat16 tokens" not in error, error
        assert len(warnings) == 1 and "activations are float32" in warnings[0], warnings
        for flags in ({"params_dtype": torch.bfloat16}, {"enable_autocast": True, "autocast_dtype": torch.bfloat16}):
            error, warnings = build_outcome(name, **flags)
            assert "moves bfloat16 tokens" not in error and warnings == [], (flags, error, warnings)


@needs_megatron
def test_variable_sequence_lengths_without_a_set_size_are_warned_about_at_model_build(ep_megatron, caplog,
                                                                                       monkeypatch):
    """The backend is sized from the first call's tokens per rank; with micro-batches of varying length a later,
    longer one would be refused mid-run. Said once when the model is built, unless EP_PLUGIN_MAX_TOKENS_PER_RANK
    is set."""
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    from ep_plugin.integrations.megatron import manager
    from ep_plugin.logs import forget_warnings

    def warnings_building(**flags) -> list[str]:
        forget_warnings()
        caplog.clear()
        for _ in range(2):  # two MoE layers: one warning
            try:
                MoEFlexTokenDispatcher(2, [0, 1], config=_config(moe_flex_dispatcher_backend="ep_reference", **flags))
            except Exception:  # noqa: BLE001 - without process groups building fails after the checks
                pass
        return [r.getMessage() for r in caplog.records if "variable_seq_lengths" in r.getMessage()]

    caplog.set_level("WARNING", logger=manager.__name__)
    monkeypatch.delenv("EP_PLUGIN_MAX_TOKENS_PER_RANK", raising=False)
    warned = warnings_building(variable_seq_lengths=True)
    assert len(warned) == 1 and "EP_PLUGIN_MAX_TOKENS_PER_RANK" in warned[0] and "sequence length x micro-batch" \
        in warned[0], warned
    assert warnings_building() == []
    monkeypatch.setenv("EP_PLUGIN_MAX_TOKENS_PER_RANK", "16384")
    assert warnings_building(variable_seq_lengths=True) == []


@needs_megatron
def test_moe_enable_deepep_next_to_a_plugin_name_is_refused(ep_megatron):
    """Megatron refuses it next to "hybridep"; next to a plugin name it would rename the backend "deepep"."""
    with pytest.raises(ValueError, match="Only one backend.*'ep_hybrid'"):
        _config(moe_flex_dispatcher_backend="ep_hybrid", moe_enable_deepep=True)
    assert _config(moe_flex_dispatcher_backend="ep_hybrid").moe_flex_dispatcher_backend == "ep_hybrid"


@needs_megatron
def test_plugin_name_without_the_flex_dispatcher_type_is_refused(ep_megatron):
    """Megatron picks the dispatcher by its type: with "alltoall" a plugin name would be ignored silently."""
    from ep_plugin.integrations.nemo import validate_ep_plugin_backend

    for dispatcher_type in ("alltoall", "allgather"):
        with pytest.raises(ValueError, match=f"requires moe_token_dispatcher_type='flex', got '{dispatcher_type}'.*"
                                             "Megatron-LM: --moe-token-dispatcher-type flex"):
            _config(moe_flex_dispatcher_backend="ep_reference", moe_token_dispatcher_type=dispatcher_type,
                    expert_model_parallel_size=2)
    # With TP = EP = 1 no dispatcher moves anything: Bridge's checkpoint loading and export switch a flex config
    # to "allgather" there, keeping the name (plugin installed or not, that must pass).
    loaded = _config(moe_flex_dispatcher_backend="ep_reference", moe_token_dispatcher_type="allgather")
    assert loaded.moe_token_dispatcher_type == "allgather"
    config = _config(moe_flex_dispatcher_backend="ep_reference", expert_model_parallel_size=2)
    config.moe_token_dispatcher_type = "alltoall"  # changed after construction, as recipes do
    with pytest.raises(ValueError, match="requires moe_token_dispatcher_type='flex', got 'alltoall'"):
        validate_ep_plugin_backend(config)
    # Without that call, the dispatcher Megatron builds refuses it, before any process group is asked for.
    from megatron.core.transformer.moe import token_dispatcher

    for dispatcher_class, dispatcher_type in ((token_dispatcher.MoEAlltoAllTokenDispatcher, "alltoall"),
                                              (token_dispatcher.MoEAllGatherTokenDispatcher, "allgather")):
        config.moe_token_dispatcher_type = dispatcher_type
        with pytest.raises(ValueError, match=f"requires moe_token_dispatcher_type='flex', got '{dispatcher_type}'"):
            dispatcher_class(2, [0, 1], config=config)
    assert _config(moe_flex_dispatcher_backend="deepep", moe_token_dispatcher_type="alltoall")  # Megatron's own
    # A dense model builds no dispatcher: a launch script that always passes the plugin's name must still run it.
    dense = _config(moe_flex_dispatcher_backend="ep_hybrid", num_moe_experts=None,
                    moe_token_dispatcher_type="allgather", num_attention_heads=2, tensor_model_parallel_size=2,
                    sequence_parallel=True)
    assert dense.num_moe_experts is None and dense.moe_flex_dispatcher_backend == "ep_hybrid"


@needs_megatron
def test_options_the_plugin_cannot_honour_fail_at_model_build(ep_megatron, monkeypatch):
    """Drop-and-pad (also 0.19's for decode), 0.19's fixed receive budget and Megatron's SM knob out of range
    raise ValueError when the dispatcher is built (before any process group is touched), naming the option and
    the config value; EP_PLUGIN_* variables do not (they may differ between ranks)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    from ep_plugin.backends.elastic import ElasticBackend
    from ep_plugin.backends.hybrid import HybridBackend
    from ep_plugin.config import Config
    from ep_plugin.integrations.megatron import compat
    from ep_plugin.integrations.megatron.manager import (
        check_megatron_options,
        resolve_backend_class,
        sync_free_problem,
    )

    def build(name, **overrides):
        MoEFlexTokenDispatcher(2, [0, 1], config=_config(moe_flex_dispatcher_backend=name, **overrides))

    with pytest.raises(ValueError, match="'ep_reference': ep_plugin backends are dropless; "
                                         "moe_pad_expert_input_to_capacity"):
        build("ep_reference", moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=1.0)
    ep_megatron.install(replace_builtin=True)  # an existing "hybridep" config now reaches the plugin
    with pytest.raises(ValueError, match=r"'hybridep' \(routed to ep_plugin by install\(replace_builtin=True\)\)"):
        build("hybridep", moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=1.0)
    config = _config(moe_flex_dispatcher_backend="ep_reference")
    config.moe_expert_rank_capacity_factor = 1.5  # a Megatron-Core 0.19 field (only hybridep/ncclep take it)
    with pytest.raises(ValueError, match="moe_expert_rank_capacity_factor=1.5"):
        MoEFlexTokenDispatcher(2, [0, 1], config=config)
    # 0.19's inference option that switches the built model to drop-and-pad for CUDA-graph decode
    # (test_megatron_dispatcher: a switch made after the build is refused at the next forward).
    config = _config(moe_flex_dispatcher_backend="ep_reference")
    config.moe_pad_experts_for_cuda_graph_inference = True
    with pytest.raises(ValueError, match="ep_plugin backends are dropless and would send each token to every expert"):
        MoEFlexTokenDispatcher(2, [0, 1], config=config)
    # Megatron's SM knob becomes the backend's num_sms: out of range, it is named here, not at the first step
    # as "EP_PLUGIN_* variables that do not parse".
    config = _config(moe_flex_dispatcher_backend="ep_reference")
    knob = compat.dispatcher_num_sms_field(config)
    setattr(config, knob, 2000)
    with pytest.raises(ValueError, match=f"'ep_reference': {knob}=2000 is the SMs per rank.*num_sms must be in"):
        MoEFlexTokenDispatcher(2, [0, 1], config=config)
    # Also where EP_PLUGIN_NUM_SMS takes its place: the variable may be set on some ranks only, and a refusal
    # here, on the ranks without it alone, would leave the others waiting in Megatron's next collective.
    monkeypatch.setenv("EP_PLUGIN_NUM_SMS", "8")
    with pytest.raises(ValueError, match=f"{knob}=2000 is the SMs per rank.*EP_PLUGIN_NUM_SMS takes its place too"):
        resolve_backend_class("reference", config)
    monkeypatch.delenv("EP_PLUGIN_NUM_SMS")
    # No EP_PLUGIN_* variable is refused here, on the ranks that have it alone (building a dispatcher is not a
    # collective): neither one that does not parse nor sync-free mode, whose outputs' unwritten rows past the
    # count Megatron's experts would compute with. The first dispatch's exchange refuses them on every rank
    # (test_megatron_dispatcher: test_a_setting_on_one_rank_only_..., test_sync_free_mode_on_one_rank_only_...).
    for variable, value in (("EP_PLUGIN_BLOCKING", "maybe"), ("EP_PLUGIN_TIMEOUT_S", "soon"),
                            ("EP_PLUGIN_BLOCKING", "0")):
        monkeypatch.setenv(variable, value)
        for backend_class in (HybridBackend, ElasticBackend):
            check_megatron_options(_config(moe_flex_dispatcher_backend=f"ep_{backend_class.name}"), backend_class)
        monkeypatch.delenv(variable)
    # What that exchange tells the peers of sync-free mode (the backend's, not the reference's, which has none).
    monkeypatch.setenv("EP_PLUGIN_BLOCKING", "0")
    sync_free = Config.from_env()
    for backend_class in (HybridBackend, ElasticBackend):
        config = _config(moe_flex_dispatcher_backend=f"ep_{backend_class.name}")
        assert f"'ep_{backend_class.name}' with EP_PLUGIN_BLOCKING=0" in sync_free_problem(config, backend_class,
                                                                                          sync_free)
        assert sync_free_problem(config, backend_class, Config()) is None
    assert sync_free_problem(config, ep_plugin.get_backend("reference"), sync_free) is None


@needs_megatron
def test_a_cuda_graph_over_the_dispatch_and_a_too_wide_top_k_fail_at_model_build(ep_megatron):
    """Megatron settings that used to pass the build and fail at the first forward (or in a capture, with advice
    the build refuses): a CUDA graph of the whole layer or iteration, which would capture the blocking dispatch;
    elastic with more than 32 experts per token (top-k times the expert tensor-parallel copies); a layer shape
    the kernels cannot take; and 0.19's fixed receive budget, where Megatron's own check would send the user to
    its HybridEP."""
    from megatron.core.transformer.enums import CudaGraphScope
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    from ep_plugin.integrations.megatron.manager import resolve_backend_class

    def build(config):
        MoEFlexTokenDispatcher(2, [0, 1], config=config)

    graph_settings = [("local", [], "an empty cuda_graph_(scope|modules)"),
                      ("transformer_engine", [], "the whole layer"),
                      ("local", [CudaGraphScope.full_iteration], "full_iteration"),
                      ("full_iteration", [], "cuda_graph_impl='full_iteration'"),  # 0.19's spelling
                      # A GPT layer's local graph over "attn" holds its whole forward, the dispatch included.
                      ("local", [CudaGraphScope.attn, CudaGraphScope.moe_router, CudaGraphScope.moe_preprocess],
                       "'attn' in cuda_graph_(scope|modules)")]
    for impl, scopes, words in graph_settings:
        config = _config(moe_flex_dispatcher_backend="ep_reference")
        config.cuda_graph_impl, config.cuda_graph_scope = impl, scopes  # set after __post_init__, as recipes do
        if hasattr(config, "cuda_graph_modules"):
            config.cuda_graph_modules = scopes
        with pytest.raises(ValueError, match=f"{words}.*captures the MoE layer's dispatch.*moe_router"):
            build(config)
    # Graphs that stop before the dispatch are Megatron's way with a dropless flex dispatcher: the build's checks
    # pass (the dispatcher itself would then need the model-parallel groups).
    config = _config(moe_flex_dispatcher_backend="ep_reference")
    config.cuda_graph_impl = "transformer_engine"
    config.cuda_graph_scope = [CudaGraphScope.attn, CudaGraphScope.moe_router, CudaGraphScope.moe_preprocess]
    if hasattr(config, "cuda_graph_modules"):
        config.cuda_graph_modules = config.cuda_graph_scope
    assert resolve_backend_class("reference", config) is ep_plugin.get_backend("reference")
    # A hybrid (Mamba) model's MoE layers under partial local graphs: 0.16's layer reads the dispatcher's dotted
    # attribute names with a plain getattr (an AttributeError at the first step, HybridEP's too); refused at the
    # build there, and run from the version that resolves them.
    config = _config(moe_flex_dispatcher_backend="ep_reference", is_hybrid_model=True)
    config.cuda_graph_impl = "local"
    config.cuda_graph_scope = [CudaGraphScope.moe_preprocess]  # alone makes 0.16's graphs partial too
    if hasattr(config, "cuda_graph_modules"):
        config.cuda_graph_modules = config.cuda_graph_scope
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    if hasattr(MoETransformerLayer, "_resolve_token_dispatcher_attr"):  # 0.19
        assert resolve_backend_class("reference", config) is ep_plugin.get_backend("reference")
    else:  # 0.16
        with pytest.raises(ValueError, match="'moe_router' or 'moe_preprocess' in cuda_graph_scope on a hybrid "
                                             r"model: megatron-core 0\.16.*plain getattr.*HybridEP's too"):
            build(config)

    config = _config(moe_flex_dispatcher_backend="ep_elastic", num_moe_experts=64, moe_router_topk=8)
    config.expert_tensor_parallel_size = 8
    with pytest.raises(ValueError, match="at most 32 experts per token.*up to 64 "
                                         r"\(moe_router_topk=8 x 8 expert tensor-parallel ranks"):
        build(config)
    config.expert_tensor_parallel_size = 4  # 32 ids: as wide as the kernels go
    unavailable = backend_problem("elastic", "cuda")  # none on a GPU machine with the extension built
    with pytest.raises(ep_plugin.BackendUnavailableError) if unavailable else contextlib.nullcontext():
        resolve_backend_class("elastic", config)  # past the option checks (then refused only if it cannot run)

    # Shapes the compiled kernels cannot take: refused here, not at the first step after the checkpoint loaded.
    # (Megatron's MoE layer hands the dispatcher its experts per rank: 1028 over 2 ranks here.)
    for backend, local, shape, words in (("ep_hybrid", 2, dict(hidden_size=4100), "hidden_size divisible by 8.*4100"),
                                         ("ep_elastic", 514, dict(num_moe_experts=1028, expert_model_parallel_size=2),
                                          r"at most 256 local experts, got 514 \(num_moe_experts=1028 over 2 "
                                          "expert-parallel ranks")):
        config = _config(moe_flex_dispatcher_backend=backend, **shape)
        with pytest.raises(ValueError, match=words):
            MoEFlexTokenDispatcher(local, list(range(local)), config=config)
    assert ep_plugin.get_backend("reference").shape_problem(4100, 514) is None  # reference takes any shape

    config = _config(moe_flex_dispatcher_backend="ep_reference")
    config.moe_expert_rank_capacity_factor = 1.5  # a 0.19 field; its checks run in __post_init__
    with pytest.raises(ValueError, match="moe_expert_rank_capacity_factor=1.5.*ep_plugin backends are dropless"
                                         "|ep_plugin backends are dropless.*moe_expert_rank_capacity_factor=1.5"):
        config.__post_init__()


def _dispatchers_on_their_own_groups(ctx) -> dict:
    """Rank function: elastic dispatchers built with a pg_collection whose sizes are not the config's."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    import ep_plugin.integrations.megatron as ep_megatron

    ep_megatron.install()
    world = torch.distributed.group.WORLD
    alone = [torch.distributed.new_group([rank]) for rank in range(ctx.world_size)][ctx.rank]

    def build(local_experts, groups, expert_tensor_parallel_size=1, **overrides):
        config = _config(moe_flex_dispatcher_backend="ep_elastic", **overrides)
        config.expert_tensor_parallel_size = expert_tensor_parallel_size  # after __post_init__, as a recipe may
        try:
            MoEFlexTokenDispatcher(local_experts, list(range(local_experts)), config=config,
                                   pg_collection=ProcessGroupCollection(**groups))
        except Exception as error:  # noqa: BLE001 - the outcome is what the test reads
            return f"{type(error).__name__}: {error}"
        return "built"

    return {
        # The config's expert TP size (1) would let 32 ids per token pass; the layer's groups hold 2 copies.
        "wider on the groups": build(64, dict(ep=alone, expt_tp=world, tp_ep=world), num_moe_experts=64,
                                     moe_router_topk=32),
        # The config says 8 copies (64 ids, refused); the layer's own groups hold 1.
        "narrower on the groups": build(64, dict(ep=alone, expt_tp=alone, tp_ep=alone), num_moe_experts=64,
                                        moe_router_topk=8, expert_tensor_parallel_size=8),
        # The config says 512 experts on one rank (refused); the layer's EP group splits them over 2.
        "split by the groups": build(256, dict(ep=world, expt_tp=alone, tp_ep=world), num_moe_experts=512),
    }


@needs_megatron
def test_the_build_checks_read_the_layers_own_process_groups(ep_megatron):
    """A layer built with its own pg_collection (NeMo, custom parallelism) runs with those groups' sizes, not
    the config's expert_model_parallel_size / expert_tensor_parallel_size: the build's top-k and shape checks
    read the layer's (a valid layer was refused, and a too-wide top-k passed to its first step)."""
    # Past the checks, a machine without a GPU or the extension refuses elastic itself.
    unavailable = backend_problem("elastic", "cuda" if torch.cuda.is_available() else "cpu")
    past_the_checks = f"BackendUnavailableError: moe_flex_dispatcher_backend='ep_elastic': {unavailable}" \
        if unavailable else "built"
    for outcome in run_ranks(_dispatchers_on_their_own_groups, 2, timeout_s=120):
        assert outcome["wider on the groups"].startswith("ValueError"), outcome
        assert "up to 64 (moe_router_topk=32 x 2 expert tensor-parallel ranks" in outcome["wider on the groups"]
        assert outcome["narrower on the groups"] == past_the_checks, outcome
        assert outcome["split by the groups"] == past_the_checks, outcome


@needs_megatron
@pytest.mark.gpu(extension=False)
def test_a_capture_that_reaches_the_dispatch_says_what_to_graph(ep_megatron):
    """A capture the build could not foresee (an inference graph, say) reaches the manager's dispatch: it is
    refused with Megatron's scopes to graph instead, not the backend's advice (EP_PLUGIN_BLOCKING=0), which
    the build refuses. Nothing is enqueued: no process group is needed to get there."""
    from ep_plugin.integrations.megatron.manager import EPPluginManager

    config = _config(moe_flex_dispatcher_backend="ep_reference")
    manager = EPPluginManager("reference", group=None, num_local_experts=4, num_experts=4, config=config)
    routing_map = torch.zeros(8, 4, dtype=torch.bool, device="cuda")
    routing_map[:, :2] = True
    manager.setup_metadata(routing_map, routing_map.float() / 2)
    hidden = torch.ones(8, 16, device="cuda")
    with pytest.raises(RuntimeError, match="Megatron is capturing this MoE layer's dispatch.*'moe_router'"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            manager.dispatch(hidden)
    assert manager.backend is None  # refused before a backend was made


def _teardown_with_a_failing_destroy(ctx) -> dict:
    import logging

    from megatron.core import parallel_state

    import ep_plugin.integrations.megatron as ep_megatron
    from ep_plugin.integrations.megatron import manager

    ep_megatron.install()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ctx.world_size)
    backend = manager.shared_backend("reference", parallel_state.get_expert_model_parallel_group(), 16, 4,
                                     torch.device("cpu"), experts_per_token=2, pad_multiple=None)

    def destroy_fails():  # as when a peer is gone and the destroy's last barrier times out
        raise RuntimeError("the destroy's barrier timed out (planted)")

    backend.destroy = destroy_fails
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("ep_plugin.integrations.megatron").addHandler(handler)
    try:
        parallel_state.destroy_model_parallel()
        raised = None
    except Exception as error:  # noqa: BLE001 - what the test looks at
        raised = f"{type(error).__name__}: {error}"
    return {"raised": raised, "cache empty": not manager._backends,
            "megatron torn down": not parallel_state.model_parallel_is_initialized(), "warnings": warnings}


@needs_megatron
def test_a_teardown_whose_backend_destroy_fails_warns_and_goes_on(ep_megatron):
    """destroy_model_parallel runs on failure paths too (Bridge's cleanup after a failed pretrain, an in-process
    restart, peers possibly gone): a shared backend whose destroy raised made it raise, skipping the rest of
    the caller's teardown. It warns now, and Megatron's own teardown still runs."""
    outcome = run_ranks(_teardown_with_a_failing_destroy, 2, timeout_s=120)[0]
    assert outcome["raised"] is None and outcome["cache empty"] and outcome["megatron torn down"], outcome
    assert any("planted" in warning and "teardown goes on" in warning for warning in outcome["warnings"]), outcome


def _uninstall_with_a_shared_backend_alive(ctx) -> dict:
    import logging

    from megatron.core import parallel_state

    import ep_plugin.integrations.megatron as ep_megatron
    from ep_plugin.integrations.megatron import manager

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("ep_plugin.integrations.megatron").addHandler(handler)
    ep_megatron.install()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ctx.world_size)
    manager.shared_backend("reference", parallel_state.get_expert_model_parallel_group(), 16, 4,
                           torch.device("cpu"), experts_per_token=2, pad_multiple=None)
    ep_megatron.uninstall()
    with_backend = list(warnings)
    ep_megatron.clear_backend_cache()  # what the warning asks for
    ep_megatron.install()
    ep_megatron.uninstall()
    parallel_state.destroy_model_parallel()
    return {"with a backend": with_backend, "after clearing": warnings[len(with_backend):]}


@needs_megatron
def test_uninstall_with_a_shared_backend_alive_says_to_clear_the_cache(ep_megatron):
    """uninstall() restores Megatron's destroy_model_parallel, which then no longer destroys the shared backends
    (their buffers stay mapped past the process groups): it said nothing. A warning names the call to make."""
    outcome = run_ranks(_uninstall_with_a_shared_backend_alive, 2, timeout_s=120)[0]
    assert any("leaves 1 shared backend(s) alive" in w and "clear_backend_cache()" in w
               for w in outcome["with a backend"]), outcome
    assert not any("shared backend" in w for w in outcome["after clearing"]), outcome


@needs_megatron
def test_elastic_gets_megatrons_routing_map_as_top_k_ids(ep_megatron):
    """ep_elastic takes top-k ids, not Megatron's routing map: the manager's conversion keeps exactly each
    token's chosen experts (TP copies of the expert set included) with their probs, -1 and 0 elsewhere."""
    from ep_plugin.integrations.megatron.manager import EPPluginManager

    tp, experts, topk, tokens = 2, 8, 2, 64
    config = _config(num_moe_experts=experts, moe_router_topk=topk, moe_flex_dispatcher_backend="ep_reference")
    manager = EPPluginManager("reference", group=None, num_local_experts=experts, num_experts=tp * experts,
                              config=config)
    generator = torch.Generator().manual_seed(5)
    scores = torch.rand(tokens, tp * experts, generator=generator)
    routing_map = torch.zeros(tokens, tp * experts, dtype=torch.bool)
    for token in range(tokens):  # 0 to topk experts in each TP copy: a token may be routed nowhere
        for copy in range(tp):
            chosen = torch.randperm(experts, generator=generator)[:token % (topk + 1)] + copy * experts
            routing_map[token, chosen] = True
    probs = torch.where(routing_map, scores, torch.zeros_like(scores))
    manager.setup_metadata(routing_map.view(tokens, tp, experts), probs.view(tokens, tp, experts))
    routing, options = manager._routing_for(ep_plugin.get_backend("elastic"), probs)

    assert options == {"expand": True, "zero_padding": True}
    ids, weights = routing["topk_idx"], routing["topk_weights"]
    assert ids.shape == weights.shape == (tokens, tp * topk)
    for token in range(tokens):
        kept = ids[token][ids[token] >= 0]
        assert sorted(kept.tolist()) == routing_map[token].nonzero().flatten().tolist(), token
        assert torch.equal(weights[token][ids[token] >= 0], probs[token, kept]), token
        assert not weights[token][ids[token] < 0].any(), token


@needs_megatron
def test_config_and_argument_parser_accept_plugin_names(ep_megatron):
    for name in PLUGIN_NAMES:
        config = _config(moe_flex_dispatcher_backend=name)
        assert config.moe_flex_dispatcher_backend == name
    # Megatron-LM <= 0.16 writes the choices by hand; the installed parser hook widens them.
    parser = argparse.ArgumentParser()
    parser.add_argument("--moe-flex-dispatcher-backend", type=str, default="deepep", choices=["deepep", "hybridep"])
    assert parser.parse_args(["--moe-flex-dispatcher-backend", "ep_hybrid"]).moe_flex_dispatcher_backend == "ep_hybrid"
    assert parser.parse_args(["--moe-flex-dispatcher-backend", "hybridep"]).moe_flex_dispatcher_backend == "hybridep"
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-flex-dispatcher-backend", "ep_nope"])
    # Megatron-LM >= 0.17 derives the choices from the dataclass field's Literal type.
    from megatron.core.transformer.transformer_config import TransformerConfig

    field_type = TransformerConfig.__dataclass_fields__["moe_flex_dispatcher_backend"].type
    assert typing.get_origin(field_type) is typing.Literal
    assert set(PLUGIN_NAMES) | {"deepep", "hybridep"} <= set(typing.get_args(field_type))


@needs_megatron
def test_generated_megatron_lm_parser_accepts_plugin_names(ep_megatron):
    """Megatron-LM >= 0.17 builds its CLI from TransformerConfig (megatron.training, Python >= 3.12)."""
    try:
        from megatron.training.argument_utils import ArgumentGroupFactory
    except ImportError as error:
        pytest.skip(f"megatron.training.argument_utils is not importable here: {error}")
    from megatron.core.transformer.transformer_config import TransformerConfig

    # Megatron-LM excludes fields argparse cannot express (Callable, ...); keep only ours.
    others = [f.name for f in dataclasses.fields(TransformerConfig) if f.name != "moe_flex_dispatcher_backend"]
    parser = argparse.ArgumentParser()
    ArgumentGroupFactory(TransformerConfig, exclude=others).build_group(parser, "transformer")
    for name in PLUGIN_NAMES + ("hybridep",):
        assert parser.parse_args(["--moe-flex-dispatcher-backend", name]).moe_flex_dispatcher_backend == name


@needs_megatron
def test_name_based_spots_treat_plugin_names_like_hybridep(ep_megatron):
    def free_input(backend):
        config = _config(moe_flex_dispatcher_backend=backend)
        return {node: _should_free_input(node, config) for node in ("mlp", "moe_dispatch")}

    hybridep = free_input("hybridep")
    deepep = free_input("deepep")
    assert hybridep != deepep  # the spot really depends on the name
    for name in PLUGIN_NAMES:
        assert free_input(name) == hybridep, name
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "skip_routed_expert_padding"):  # the FP8 padding skip, 0.19 on
        assert not moe_utils.skip_routed_expert_padding(_config(moe_flex_dispatcher_backend="deepep"))
        for name in PLUGIN_NAMES:
            assert moe_utils.skip_routed_expert_padding(_config(moe_flex_dispatcher_backend=name)), name
    config = _config(moe_flex_dispatcher_backend="ep_hybrid")
    _should_free_input("mlp", config)
    assert config.moe_flex_dispatcher_backend == "ep_hybrid"  # the alias is only shown during the call


def _layer_for_callables(config):
    """A transformer layer as ``build_transformer_layer_callables`` reads it: the config, an MoE mlp (a real
    MoELayer subclass: Megatron's own __init__ needs process groups) whose dispatch and experts only hand
    the probs on, and a record of the backend name Megatron's function holds while it builds the callables
    (its call of ``layer.init_backward_dw_wrapper``)."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.moe_layer import MoELayer

    class MoELayerShape(MoELayer):
        def __init__(self):
            torch.nn.Module.__init__(self)
            # 0.19's expert callable also asks a HybridEP manager for its counts.
            manager = SimpleNamespace(token_probs=None, dispatched_probs=None,
                                      get_number_of_tokens_per_expert=lambda: torch.ones(1, dtype=torch.int64))
            self.token_dispatcher = SimpleNamespace(_comm_manager=manager)

        def dispatch(self, hidden_states, probs):
            return hidden_states, probs

        def routed_experts_compute(self, hidden_states, probs):
            return hidden_states * probs.unsqueeze(-1), None

    def _forward_mlp(hidden_states):  # 0.19 copies its signature onto the dense layers' callable
        raise AssertionError("a dense layer's callable ran for an MoE layer")

    layer = SimpleNamespace(config=config, mlp=MoELayerShape(), recompute_pre_mlp_layernorm=False,
                            backward_dw_wrapper=None, names_seen=[], _forward_mlp=_forward_mlp)
    layer.init_backward_dw_wrapper = lambda: layer.names_seen.append(config.moe_flex_dispatcher_backend)
    return layer


def _probs_swapped_in(build, layer) -> tuple[bool, bool]:
    """Whether the dispatch and expert callables ``build(layer)`` gives hand the schedule's detached probs to
    the dispatcher's manager (Megatron does that for "deepep" and "hybridep", whose managers keep the probs)."""
    from types import SimpleNamespace

    forward_funcs, _ = build(layer)
    dispatch, experts = forward_funcs[1], forward_funcs[2]
    node = SimpleNamespace(layer_state=SimpleNamespace(), detach=lambda tensor: tensor.detach())
    tokens, probs = torch.randn(4, 16), torch.rand(4)
    dispatched = dispatch(node, tokens, probs)
    detached_probs = node.layer_state.dispatched_probs
    experts(node, dispatched)
    manager = layer.mlp.token_dispatcher._comm_manager
    return manager.token_probs is probs, manager.dispatched_probs is detached_probs


@needs_megatron
def test_fine_grained_callables_see_plugin_names_as_hybridep(ep_megatron):
    """The 1F1B overlap schedule (``overlap_moe_expert_parallel_comm``) builds each layer's callables with
    ``build_transformer_layer_callables``, which hands the manager the detached probs only for "deepep" and
    "hybridep". A plugin name must reach it as "hybridep" (our manager keeps the probs for backward as
    HybridEP's does), else the manager keeps the attention node's probs and backward crosses the schedule's
    node boundary; the config must hold the user's name again afterwards."""
    from megatron.core.models.gpt import fine_grained_callables

    build = fine_grained_callables.build_transformer_layer_callables  # install() replaced it by name
    for name in PLUGIN_NAMES:
        config = _config(moe_flex_dispatcher_backend=name)
        layer = _layer_for_callables(config)
        assert _probs_swapped_in(build, layer) == (True, True), name
        assert layer.names_seen == ["hybridep"], (name, layer.names_seen)  # what Megatron's function compared
        assert config.moe_flex_dispatcher_backend == name  # the alias is only shown during the call
    # Megatron's function itself, given a plugin name, keeps the attention node's probs: the swap above comes
    # from the name shown, not from this layer.
    layer = _layer_for_callables(_config(moe_flex_dispatcher_backend="ep_hybrid"))
    assert _probs_swapped_in(build.__wrapped__, layer) == (False, False)
    assert layer.names_seen == ["ep_hybrid"]


@needs_megatron
def test_replace_builtin_routes_hybridep_to_plugin(ep_megatron, monkeypatch):
    assert ep_megatron.plugin_backend_for("hybridep") is None
    assert ep_megatron.plugin_backend_for("deepep") is None
    assert ep_megatron.plugin_backend_for("ep_reference") == "reference"
    ep_megatron.install(replace_builtin=True)
    assert ep_megatron.plugin_backend_for("hybridep") == "hybrid"
    assert ep_megatron.plugin_backend_for("deepep") is None
    # A plain install() (what the NeMo helpers call to make sure of it) keeps what the launcher chose.
    from ep_plugin.integrations.nemo import validate_ep_plugin_backend

    ep_megatron.install()
    validate_ep_plugin_backend(_config(moe_flex_dispatcher_backend="ep_reference"))
    assert ep_megatron.plugin_backend_for("hybridep") == "hybrid"
    # The validation checks what runs for "hybridep" then, the plugin's hybrid (it took the name for Megatron's
    # own and passed it unchecked: a machine without a GPU or the kernels failed only at model build).
    # (Without the extension, stood in for on a GPU.)
    from ep_plugin import _cuda

    monkeypatch.setattr(_cuda, "_module", None)
    with pytest.raises(ValueError, match="ep_hybrid needs a CUDA GPU|backend 'hybrid' needs the compiled extension"):
        validate_ep_plugin_backend(_config(moe_flex_dispatcher_backend="hybridep"))
    # Next to another dispatcher type no dispatcher reads the name (a recipe's fallback to alltoall): no check.
    validate_ep_plugin_backend(_config(moe_flex_dispatcher_backend="hybridep", moe_token_dispatcher_type="alltoall"))
    ep_megatron.install(replace_builtin=False)
    assert ep_megatron.plugin_backend_for("hybridep") is None


@needs_megatron
@pytest.mark.gpu
def test_validate_asks_for_kernels_that_run_on_this_gpu(monkeypatch):
    """The NeMo validation checked the GPU's compute capability only: without ep_plugin._C, or with one built
    for another GPU (the default build is sm_90's, an A100 is sm_80), it passed and the model build failed
    later. (The extension's absence and another build are stood in for on this GPU.)"""
    from ep_plugin import _cuda
    from ep_plugin.integrations.nemo import validate_ep_plugin_backend

    def validate(name: str) -> None:
        validate_ep_plugin_backend(_config(moe_flex_dispatcher_backend=name, moe_token_dispatcher_type="flex"))

    validate("ep_hybrid")
    validate("ep_reference")
    monkeypatch.setattr(_cuda, "built_archs", lambda: ("70",))
    with pytest.raises(ValueError, match="built for sm_70, whose kernels cannot run"):
        validate("ep_elastic")
    monkeypatch.setattr(_cuda, "_module", None)
    with pytest.raises(ValueError, match="backend 'hybrid' needs the compiled extension"):
        validate("ep_hybrid")
    validate("ep_reference")


# ---- Megatron-Core missing ------------------------------------------------------------------------

HIDE_MEGATRON = textwrap.dedent("""
    import sys

    class HideMegatron:
        def find_spec(self, name, path=None, target=None):
            if name == "megatron" or name.startswith("megatron."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, HideMegatron())
    import ep_plugin.integrations.megatron as adapter   # importing the adapter needs no Megatron
    try:
        adapter.install()
    except ImportError as error:
        print("IMPORT-ERROR:", error)
    else:
        print("NO-ERROR")
""")


def test_missing_megatron_core_raises_clear_import_error():
    result = subprocess.run([sys.executable, "-c", HIDE_MEGATRON], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "IMPORT-ERROR:" in result.stdout, result.stdout
    assert "pip install megatron-core" in result.stdout


# ---- the launcher -------------------------------------------------------------------------------

TRAINING_SCRIPT = textwrap.dedent("""
    # Stands in for an unmodified Megatron-LM script: a fixed-choice parser, then a config.
    import argparse
    import sys

    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--moe-flex-dispatcher-backend", choices=["deepep", "hybridep"], default="deepep")
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=2,
                               moe_token_dispatcher_type="flex", use_cpu_initialization=True,
                               moe_flex_dispatcher_backend=args.moe_flex_dispatcher_backend)
    print("RAN", __name__, config.moe_flex_dispatcher_backend, args.steps, sys.argv[1:])
    print("WRAPPED", hasattr(MoEFlexTokenDispatcher.__init__, "__wrapped__"))
    import megatron.core
    print("CORE", megatron.core.__file__)
""")


@needs_megatron
def test_run_launcher_installs_then_runs_unmodified_script(tmp_path):
    """The script runs as ``python script.py`` would, from another folder too: with the megatron package of
    a Megatron-LM checkout next to it (here the installed one, linked there), not the installed one."""
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "megatron").symlink_to(importlib.util.find_spec("megatron").submodule_search_locations[0])
    script = checkout / "pretrain_toy.py"
    script.write_text(TRAINING_SCRIPT)
    command = [sys.executable, "-m", "ep_plugin.integrations.megatron.run", str(script),
               "--moe-flex-dispatcher-backend", "ep_reference", "--steps", "3"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RAN __main__ ep_reference 3" in result.stdout, result.stdout
    assert "WRAPPED True" in result.stdout, result.stdout
    assert f"CORE {checkout / 'megatron'}" in result.stdout, result.stdout  # the checkout's, as the plugin's

    missing = subprocess.run([sys.executable, "-m", "ep_plugin.integrations.megatron.run", str(tmp_path / "no.py")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "training script not found" in missing.stderr
    short_help = subprocess.run([sys.executable, "-m", "ep_plugin.integrations.megatron.run", "-h"],
                                capture_output=True, text=True, timeout=120)
    assert short_help.returncode == 0 and short_help.stdout.startswith("usage:"), short_help


@needs_megatron
def test_run_launcher_passes_torch_launchs_local_rank_on_to_the_script(tmp_path):
    """``python -m torch.distributed.launch`` (without --use-env) puts --local-rank=N before the script: the
    launcher refused it as its own unknown option, on every rank; Megatron-LM's arguments take it."""
    script = tmp_path / "show_argv.py"
    script.write_text("import sys\nprint('ARGV', sys.argv[1:])\n")
    result = subprocess.run([sys.executable, "-m", "ep_plugin.integrations.megatron.run", "--local-rank=3",
                             str(script), "--steps", "2"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ARGV ['--local-rank=3', '--steps', '2']" in result.stdout, result.stdout
    unknown = subprocess.run([sys.executable, "-m", "ep_plugin.integrations.megatron.run", "--local-rnak=3",
                              str(script)], capture_output=True, text=True, timeout=120)
    assert unknown.returncode != 0 and "unknown option '--local-rnak=3'" in unknown.stderr, unknown

