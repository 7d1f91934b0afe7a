"""The communication manager that ``MoEFlexTokenDispatcher`` drives when a plugin name is chosen.

Megatron's flex dispatcher calls, per MoE layer and step (docs/design.md, §7 Megatron-Core):

    setup_metadata(routing_map, probs)      inside torch.compile: reshapes only, sets token_probs
    dispatch(hidden, async_finish, allocate_on_comm_stream) -> rows; sets dispatched_probs
    get_permuted_hidden_states_by_experts(rows) -> (rows, dispatched_probs)
    get_number_of_tokens_per_expert()       -> [num_local_experts] int64 (padded segment lengths)
    get_restored_hidden_states_by_experts(rows) -> rows
    combine(rows, async_finish, allocate_on_comm_stream) -> [T, H], unweighted sum

The dispatch output is already grouped by local expert (the backend permutes), so the two
"by experts" steps are identities, as with Megatron's HybridEP manager. Probs travel with
the tokens and are applied inside the experts; combine only sums.

The backend instance (a communication buffer on GPU backends) is created on the first
``dispatch``, outside the compiled region, and shared by every layer with the same group,
hidden size and expert count. It holds the tokens per rank of that first call; a later call with more
(evaluation at a longer sequence, variable-length batches) is refused on every rank together
(``TooManyTokensError``), and every rank then builds a larger one and dispatches again (``grow``), as
Megatron's HybridEP reallocates its buffer.
"""

from __future__ import annotations

import collections
import logging
import weakref
from typing import Optional, Sequence

import torch

import ep_plugin
from ep_plugin.backends.base import Backend
from ep_plugin.config import Config, env_is_set, env_var_name
from ep_plugin.errors import TooManyTokensError
from ep_plugin.host_collectives import HostCollectives
from ep_plugin.logs import warn_once

from . import arena, compat

logger = logging.getLogger(__name__)

# (backend name, process group, hidden size, experts, device) -> Backend instance.
_backends: dict[tuple, Backend] = {}
# How many times a backend left the cache (clear_backend_cache, grow): a manager's backend from before may be
# destroyed, and the manager takes the cache's.
_cache_generation = 0
# The handles of the managers' dispatches, by backend (id): while one lives with its backward to come (a
# micro-batch in flight), ops will still run on its backend, so a backend grown past is destroyed only where no
# rank holds such a handle.
_handles: dict[int, weakref.WeakSet] = {}
# Backends grown past while some rank still held a handle of theirs with its backward to come: destroyed at a
# later build on their group, or at a later check (``release_drained``), where no rank holds one any more, or by
# clear_backend_cache().
_retired: list[Backend] = []
# Dispatches on a group between two checks of its kept backends (``release_drained``): a check is one exchange
# of host words, so not every dispatch. Every rank of an EP group dispatches at every MoE layer, so every rank
# counts the same.
RETIRED_CHECK_INTERVAL = 32
_dispatches_since_check: "weakref.WeakKeyDictionary[torch.distributed.ProcessGroup, int]" = weakref.WeakKeyDictionary()


def resolve_backend_class(backend_name: str, config, *, local_experts: Optional[int] = None,
                          tp_copies: Optional[int] = None):
    """The ep_plugin backend class for a layer's TransformerConfig ``config``. Raises ValueError for
    Megatron options the plugin does not do (``check_megatron_options``, with the layer's ``local_experts``
    and ``tp_copies`` where known), then BackendUnavailableError saying why this install lacks the backend
    or why it cannot run on this process's device (a CUDA backend without a GPU or its extension)."""
    from ep_plugin.cli import backend_problem

    selected = selected_by(config)
    try:
        backend_class = ep_plugin.get_backend(backend_name)
    except (ImportError, ValueError) as error:
        raise ep_plugin.BackendUnavailableError(
            f"{selected} selects ep_plugin backend {backend_name!r}, which this installation cannot provide "
            f"({error}); available backends: {', '.join(ep_plugin.list_backends())}") from error
    check_megatron_options(config, backend_class, local_experts=local_experts, tp_copies=tp_copies)
    problem = backend_problem(backend_name, "cuda" if torch.cuda.is_available() else "cpu")
    if problem:
        raise ep_plugin.BackendUnavailableError(f"{selected}: {problem}")
    return backend_class


def selected_by(config) -> str:
    """How the config chose the plugin, for messages: its backend name, and whether install(replace_builtin=True)
    routed Megatron's own "hybridep" here (so a message about ep_plugin's backend is not read as HybridEP's)."""
    name = config.moe_flex_dispatcher_backend
    return (f"moe_flex_dispatcher_backend={name!r}" +
            (" (routed to ep_plugin by install(replace_builtin=True))" if name == "hybridep" else ""))


# Megatron's inference switches a built model to drop-and-pad for CUDA-graph decode (set_decode_expert_padding,
# under moe_pad_experts_for_cuda_graph_inference): the router then pads every expert to a capacity of all
# the tokens, which a dropless dispatcher would send to every expert, each step.
DECODE_PADDING_PROBLEM = (
    "Megatron's drop-and-pad for CUDA-graph decode (moe_pad_experts_for_cuda_graph_inference, which calls "
    "megatron.core.inference.utils.set_decode_expert_padding) pads every expert's input to all the tokens; ep_plugin "
    "backends are dropless and would send each token to every expert. Leave moe_pad_experts_for_cuda_graph_inference "
    "False")


def rank_capacity_problem(config) -> Optional[str]:
    """Why 0.19's fixed receive budget (``moe_expert_rank_capacity_factor``) cannot go with a plugin backend,
    or None when it is unset. Also asked before Megatron's own check, whose message names only its backends."""
    capacity = getattr(config, "moe_expert_rank_capacity_factor", None)  # Megatron-Core >= 0.19
    if capacity is None:
        return None
    return (f"{selected_by(config)}: ep_plugin backends are dropless and size their outputs exactly; "
            f"moe_expert_rank_capacity_factor={capacity} (a fixed receive budget that drops tokens, which "
            "moe_paged_stash builds on) is not supported: leave both unset")


CAPTURE_PROBLEM = ("ep_plugin's dispatch in Megatron reads the exact row counts on the host (blocking mode), which a "
                   "capture cannot. Capture the parts before it instead: cuda_graph_impl='transformer_engine' with "
                   "cuda_graph_modules (0.16: cuda_graph_scope) = ['attn', 'moe_router', 'moe_preprocess'] "
                   "(Megatron-LM: --cuda-graph-impl transformer_engine --cuda-graph-scope attn moe_router "
                   "moe_preprocess)")


def check_megatron_options(config, backend_class, *, local_experts: Optional[int] = None,
                           tp_copies: Optional[int] = None) -> None:
    """Raise ValueError, at model build, for what a plugin backend would otherwise get wrong silently.

    ``local_experts`` and ``tp_copies`` are the layer's experts per rank and expert tensor-parallel size, from
    the process groups it runs on (a layer built with its own ``pg_collection`` may differ from the config's
    ``expert_model_parallel_size`` / ``expert_tensor_parallel_size``); None reads them from the config.

    - Drop-and-pad (``moe_pad_expert_input_to_capacity``, and 0.19's
      ``moe_pad_experts_for_cuda_graph_inference``, which switches it on for decode) and 0.19's fixed
      receive budget (``moe_expert_rank_capacity_factor``): the plugin is dropless, its outputs sized exactly.
    - fp16 activations (``fp16=True``) on a backend that does not move them (the compiled backends take
      bf16). An fp32 config is only warned about: a script may cast the model to bf16 itself, and
      otherwise the first dispatch refuses the fp32 tokens.
    - A CUDA graph that captures the dispatch (the whole layer, a whole iteration): blocking mode reads the
      exact counts on the host, which a capture cannot, and non-blocking mode is refused at the first
      dispatch (``sync_free_problem``). And 0.16's
      partial local graphs of a hybrid model's MoE layer, which fail at the first step for every flex
      backend (``compat.partial_local_graph_problem``).
    - Top-k wider than the backend takes (elastic: 32 ids per token; Megatron hands it
      ``moe_router_topk`` per tensor-parallel copy of the experts), and a layer shape its kernels cannot take
      (``Backend.shape_problem``: the compiled backends' hidden size, or latent size, a multiple of 8 and at
      most 256 experts per rank), which would otherwise be refused at the first step.
    - Megatron's SM knob for its flex dispatcher (``compat.dispatcher_num_sms``, our ``num_sms`` unless
      EP_PLUGIN_NUM_SMS is set) out of range, whether or not the variable is set on this rank.

    Only the Megatron config decides here, the same on every rank: building a dispatcher is not a collective,
    so a refusal that an EP_PLUGIN_* variable decides would stop the ranks that have it alone, and the others
    would wait for them in Megatron's next collective. Those variables are checked in the first dispatch's
    exchange, on every rank together (``agree_before_build``; EP_PLUGIN_BLOCKING=0: ``sync_free_problem``).

    Warned about: ``variable_seq_lengths`` without EP_PLUGIN_MAX_TOKENS_PER_RANK (the backend is sized from
    the first call, ``tokens_per_rank``, and built again for each longer one).
    """
    selected = selected_by(config)
    captured = compat.graph_capturing_the_dispatch(config)
    if captured:
        raise ValueError(f"{selected}: {captured} captures the MoE layer's dispatch in a CUDA graph; "
                         f"{CAPTURE_PROBLEM}")
    partial = compat.partial_local_graph_problem(config)
    if partial:  # Megatron's own bug, at model build rather than as an AttributeError at the first step
        raise ValueError(f"{selected}: {partial}")
    if tp_copies is None:
        tp_copies = getattr(config, "expert_tensor_parallel_size", None) or 1  # the flex dispatcher's TP copies
    too_wide = backend_class.topk_problem(config.moe_router_topk * tp_copies)
    if too_wide:
        raise ValueError(f"{selected}: {too_wide}: this layer routes each token to up to "
                         f"{config.moe_router_topk * tp_copies} (moe_router_topk={config.moe_router_topk} x "
                         f"{tp_copies} expert tensor-parallel ranks: the flex dispatcher gives each tensor-parallel "
                         "rank its own copy of the experts); lower one of them, or choose 'ep_hybrid', which takes "
                         "Megatron's routing map as it is")
    if local_experts is None:
        local_experts = config.num_moe_experts // config.expert_model_parallel_size
    # The tokens the dispatcher moves: 0.19's latent MoE projects them down to moe_latent_size first.
    moved_size = getattr(config, "moe_latent_size", None) or config.hidden_size
    shape = backend_class.shape_problem(moved_size, local_experts)
    if shape:
        raise ValueError(f"{selected}: {shape} (num_moe_experts={config.num_moe_experts} over "
                         f"{config.num_moe_experts // local_experts} expert-parallel ranks)")
    if config.moe_pad_expert_input_to_capacity:
        raise ValueError(f"{selected}: ep_plugin backends are dropless; moe_pad_expert_input_to_capacity=True is not "
                         "supported")
    if getattr(config, "moe_pad_experts_for_cuda_graph_inference", False):  # a TransformerConfig field from 0.19
        raise ValueError(f"{selected}: {DECODE_PADDING_PROBLEM}")
    capacity_problem = rank_capacity_problem(config)
    if capacity_problem:
        raise ValueError(capacity_problem)
    num_sms = compat.dispatcher_num_sms(config)
    if num_sms is not None:  # Megatron's SM knob becomes the backend's num_sms where EP_PLUGIN_NUM_SMS is unset
        try:
            Config(num_sms=num_sms)
        except ValueError as error:  # at model build, naming the knob (the first step would blame EP_PLUGIN_*)
            raise ValueError(f"{selected}: {compat.dispatcher_num_sms_field(config)}={num_sms} is the SMs per rank "
                             f"of ep_plugin's kernels: {error} (refused where EP_PLUGIN_NUM_SMS takes its place "
                             f"too: this check is made on every rank alike)") from None
    dtype = compat.activation_dtype(config)
    moved = backend_class.capabilities.hidden_dtypes
    if dtype not in moved:
        names = ", ".join(str(d).replace("torch.", "") for d in moved)
        problem = (f"{selected}: backend {backend_class.name!r} moves {names} tokens, but this config's "
                   f"activations are {str(dtype).replace('torch.', '')} (bf16={config.bf16}, fp16={config.fp16}, "
                   f"params_dtype={config.params_dtype}); train in bf16 (bf16=True, Megatron-LM's --bf16, a bf16 "
                   "mixed-precision recipe), or choose 'ep_reference'")
        if config.fp16:
            raise ValueError(problem)
        warn_once(logger, ("activation dtype", problem),  # once, not once per MoE layer
                  "%s. (A model cast to bf16 by the script itself runs; otherwise its first dispatch refuses the "
                  "tokens.)", problem)
    if getattr(config, "variable_seq_lengths", False) and not env_is_set("max_tokens_per_rank"):
        warn_once(logger, "variable_seq_lengths",
                  "%s with variable_seq_lengths=True: the backend is sized from the first MoE call's tokens per "
                  "rank, and each later micro-batch with more builds it again on every rank (a collective build, "
                  "and the old buffer stays while a backward is still to run on it). Set "
                  "EP_PLUGIN_MAX_TOKENS_PER_RANK, equal on every rank, to the most any "
                  "micro-batch can have: sequence length x micro-batch size, over TP with sequence parallelism "
                  "and over CP", selected)


def sync_free_problem(megatron_config, backend_class, config: Config) -> Optional[str]:
    """Why ``config`` (this rank's EP_PLUGIN_* variables) cannot run Megatron's experts on ``backend_class``, or
    None: non-blocking mode (EP_PLUGIN_BLOCKING=0) sizes its outputs to a budget with rows past the count left
    unwritten, while Megatron's experts use every row (SequentialMLP splits them by ``tokens_per_expert``, a
    single expert computes them all and its weight gradients with them). Told to every rank in the first
    dispatch's exchange (``agree_before_build``): a variable may be set on some ranks only."""
    if not backend_class.capabilities.non_blocking or config.blocking:
        return None
    return (f"{selected_by(megatron_config)} with EP_PLUGIN_BLOCKING=0: non-blocking outputs are sized to a budget "
            "and their rows past the count are not written, while Megatron's experts compute every row they get; "
            "unset EP_PLUGIN_BLOCKING (blocking mode sizes the output exactly)")


def backend_config(megatron_config) -> Config:
    """The backend's Config: the EP_PLUGIN_* variables, and Megatron's SM knob for its flex dispatcher
    (``compat.dispatcher_num_sms``) where EP_PLUGIN_NUM_SMS is not set."""
    num_sms = compat.dispatcher_num_sms(megatron_config)
    if num_sms is None or env_is_set("num_sms"):
        return Config.from_env()
    return Config.from_env(num_sms=num_sms)


def _config_of_what_parses(megatron_config) -> Config:
    """The EP_PLUGIN_* variables that parse (``Config.of_what_parses``), for the exchange that tells every rank
    of one that does not; Megatron's SM knob as ``backend_config`` takes it, so that the cache is looked up
    under the peers' key."""
    num_sms = compat.dispatcher_num_sms(megatron_config)
    megatrons = {} if num_sms is None else {env_var_name("num_sms"): str(num_sms)}
    return Config.of_what_parses(underneath=megatrons)


def shared_backend(backend_name: str, group, hidden_size: int, num_experts: int, device: torch.device, *,
                   experts_per_token: int, pad_multiple: Optional[int], config: Optional[Config] = None,
                   experts_take_arena: bool = True, num_tokens: Optional[int] = None,
                   config_problem: Optional[str] = None, grow_past: Optional[Backend] = None) -> Backend:
    """One backend instance per (name, group, hidden size, experts, device, top-k, padding, SMs), shared by
    all layers (a collective call when it builds one). Its buffers hold the tokens per rank of the call that
    builds it (``num_tokens``, the largest over the group; ``tokens_per_rank``). A backend with a
    combine-input arena gets Megatron's default size (``arena.combine_input_options``) where the experts can
    put their output there (``experts_take_arena``: SequentialMLP; grouped-GEMM experts cannot, and an arena
    would be memory nothing uses). ``config``: the backend's (default: the EP_PLUGIN_* variables);
    ``config_problem``: why this rank's EP_PLUGIN_* variables cannot be used (they do not parse, ``config`` is
    then what parses; or ``sync_free_problem``),
    which the first exchange tells every rank (``agree_before_build``).

    ``grow_past``: the cached backend that every rank's dispatch just refused for its token count
    (TooManyTokensError, raised on every rank alike): it leaves the cache, and every rank builds one for this
    call's tokens (``num_tokens``), and at least half as many again as before (``tokens_per_rank``), so that
    slowly rising lengths do not rebuild at every new longest one. It is destroyed first where no rank holds
    a handle of it with its backward to come; otherwise it is kept for that backward (``_release``)."""
    global _cache_generation
    config = config if config is not None else Config.from_env()
    group = group if group is not None else torch.distributed.group.WORLD  # as the backend keeps it
    key = (backend_name, group, hidden_size, num_experts, str(device), experts_per_token, pad_multiple,
           config.num_sms, experts_take_arena)
    if grow_past is not None and _backends.get(key) is grow_past:
        del _backends[key]
        _cache_generation += 1  # the other layers' managers take the new one
    else:
        grow_past = None
    if key not in _backends:
        backend_class = ep_plugin.get_backend(backend_name)
        # The words the ranks exchange before the build; the backend's own collectives share its gloo twin.
        words = _manager_words(group, config, device, "megatron sizing and arena")
        default_tokens = config.max_tokens_per_rank
        # The backends this build may free: this one's, and those kept before on the same group.
        releasing = [backend for backend in _retired if backend.group is group] + [grow_past] * (grow_past is not None)
        try:
            counts, held = agree_before_build(words, config, num_tokens, experts_take_arena=experts_take_arena,
                                              config_problem=config_problem,
                                              holds_handles=[_backward_to_come(backend) for backend in releasing])
        except BaseException:  # kept for clear_backend_cache(), which the job's end calls
            if grow_past is not None:
                _retired.append(grow_past)
            raise
        _release(releasing, held)
        grown_from = grow_past.config.max_tokens_per_rank if grow_past is not None else 0
        config = tokens_per_rank(config, words, counts, at_least=grown_from + grown_from // 2)
        options = {} if not experts_take_arena else arena.combine_input_options(
            backend_class, words, device, config=config, num_experts=num_experts,
            experts_per_token=experts_per_token, pad_multiple=pad_multiple, hidden_size=hidden_size)
        _backends[key] = backend_class(group, hidden_size=hidden_size, num_experts=num_experts, device=device,
                                       config=config, **options)
        if config.max_tokens_per_rank != default_tokens:  # memory the user did not ask for by name
            buffer_bytes = getattr(getattr(_backends[key], "regions", None), "total_bytes", None)
            # (keyed by the group's name: a key holding the group would keep it alive past destroy_model_parallel)
            sized = ("sized", backend_name, _group_name(group), config.max_tokens_per_rank)
            warn_once(logger, sized, "ep_plugin: the %s backend was built for "
                      "%d tokens per rank, %s (past the default %d)%s; a later call with more builds it again, "
                      "larger. EP_PLUGIN_MAX_TOKENS_PER_RANK, equal on every rank, sizes it once",
                      backend_name, config.max_tokens_per_rank,
                      "for a call the last size could not hold (and half again that size at least)"
                      if grow_past is not None else "the largest of its first call",
                      default_tokens, f": {buffer_bytes / 2**30:.1f} GiB of buffer per rank" if buffer_bytes else "")
        if options.get("combine_input_rows"):
            arena.note_default_arena(_backends[key])
    return _backends[key]


# The settings that decide which exchanges a rank runs before the backend's own agreement check
# (``check_construction``): ranks that differ in one would part ways before any check could name it.
SHARED_BEFORE_BUILD = {
    env_var_name("max_tokens_per_rank"): "whether, and to what, it is set",
    env_var_name("combine_input_rows"): "whether, and to what, it is set",
    "moe_grouped_gemm": "the experts' kind: only SequentialMLP's output goes to the combine-input arena",
}


def agree_before_build(words: HostCollectives, config: Config, num_tokens: Optional[int], *,
                       experts_take_arena: bool, config_problem: Optional[str] = None,
                       holds_handles: Sequence[bool] = ()) -> tuple[list[Optional[int]], list[bool]]:
    """(The tokens per rank of every rank's call that builds the backend, whether any rank ``holds_handles`` of
    each backend the build may free), from the one timed exchange every rank runs before a shared backend is
    built.
    ValueError on every rank alike, naming the ranks and their values, where a rank's EP_PLUGIN_* variables
    cannot be used (``config_problem``) or the ranks differ in ``SHARED_BEFORE_BUILD``: a rank that refused
    alone would leave its peers waiting for it in the next exchange."""
    mine = {"tokens": num_tokens, "problem": config_problem, "moe_grouped_gemm": not experts_take_arena,
            "holds_handles": list(holds_handles)}
    for knob in ("max_tokens_per_rank", "combine_input_rows"):
        mine[env_var_name(knob)] = getattr(config, knob) if env_is_set(knob) else None
    gathered = words.all_gather_object(mine, where="sizing (tokens per rank)")
    unparsed = [f"{words.peer_name(rank)}: {facts['problem']}" for rank, facts in enumerate(gathered)
                if facts["problem"]]
    if unparsed:
        raise ValueError("ep_plugin megatron: no rank builds the backend, as the EP_PLUGIN_* variables of some "
                         "ranks do not parse or cannot run Megatron's experts: " + "; ".join(unparsed))
    differing = []
    for name, meaning in SHARED_BEFORE_BUILD.items():
        values = [facts[name] for facts in gathered]
        if any(value != values[0] for value in values):
            per_rank = ", ".join(f"{words.peer_name(rank)}: {'unset' if value is None else value}"
                                 for rank, value in enumerate(values))
            differing.append(f"{name} ({meaning}): {per_rank}")
    if differing:
        raise ValueError("ep_plugin megatron: no rank builds the backend, as the ranks differ in settings they "
                         "must share: " + "; ".join(differing))
    held = _held_by_any_rank([facts["holds_handles"] for facts in gathered], len(holds_handles))
    return [facts["tokens"] for facts in gathered], held


def _manager_words(group, config: Config, device, label: str) -> HostCollectives:
    """The host words the manager's ranks exchange on ``group`` (the backends' own collectives share its gloo
    twin), with the job's timeout and host-word engine."""
    return HostCollectives(group, owner="ep_plugin megatron", timeout_s=config.timeout_s, label=label, device=device,
                           on_host=config.gloo_host_words)


def _held_by_any_rank(per_rank: list[list[bool]], count: int) -> list[bool]:
    """Per backend of ``count``, whether any rank holds a handle of it with its backward to come (each rank's
    ``_backward_to_come`` list); all of them where ranks listed different backends (then none is freed)."""
    if any(len(held) != count for held in per_rank):
        return [True] * count
    return [any(per_backend) for per_backend in zip(*per_rank, strict=True)]


def _group_name(group) -> str:
    return getattr(group, "group_name", None) or str(id(group))


def _backward_to_come(backend: Backend) -> bool:
    """Whether this rank holds a handle of ``backend`` whose backward is still to run (``Handle.backward_pending``)."""
    return any(handle.backward_pending for handle in _handles.get(id(backend), ()))


def _release(backends: list[Backend], held: list[bool]) -> None:
    """Backends left behind by a grow (``shared_backend``), on every rank alike (``held`` is the group's): each
    is destroyed (a collective, before a larger one takes its memory) where no rank holds a handle of it with
    its backward to come, and kept otherwise, for those ops, until a later build or check (``release_drained``)
    or ``clear_backend_cache()``."""
    first_error = None
    for backend, in_use in zip(backends, held, strict=True):
        if backend in _retired:
            _retired.remove(backend)
        if in_use or first_error is not None:  # after a failed destroy: kept for clear_backend_cache()
            _retired.append(backend)
            if in_use:
                _warn_kept(backend)
            continue
        _handles.pop(id(backend), None)
        try:
            backend.destroy()
        except Exception as error:  # noqa: BLE001 - raised once the others are kept, not dropped
            first_error = error
    if first_error is not None:
        raise first_error


def release_drained(group) -> None:
    """Every ``RETIRED_CHECK_INTERVAL``-th dispatch on ``group`` while it has kept backends (``_retired``): the
    ranks tell each other whether they still hold a handle of each with its backward to come, and those that
    no rank holds are destroyed (``_release``). Without it a job that never builds again (one grow under
    pipeline parallelism, where a micro-batch's backward is nearly always to come) kept the old buffer to
    its end. On every rank alike: ``_retired`` is agreed, and every rank counts the same dispatches."""
    kept = [backend for backend in _retired if backend.group is group]
    if not kept:
        return
    count = _dispatches_since_check.get(group, 0) + 1
    _dispatches_since_check[group] = 0 if count >= RETIRED_CHECK_INTERVAL else count
    if count < RETIRED_CHECK_INTERVAL:
        return
    config = kept[-1].config
    words = _manager_words(group, config, kept[-1].device, "megatron kept backends")
    gathered = words.all_gather_object([_backward_to_come(backend) for backend in kept], where="kept backends")
    _release(kept, _held_by_any_rank(gathered, len(kept)))


def _warn_kept(backend: Backend) -> None:
    buffer_bytes = getattr(getattr(backend, "regions", None), "total_bytes", None)
    warn_once(logger, ("retired", id(backend)), "ep_plugin: the %s backend for %d tokens per rank was grown past "
              "while a micro-batch's backward was still to run on it: it stays%s until the ranks find it unused "
              "(they check every %d dispatches), or clear_backend_cache(). EP_PLUGIN_MAX_TOKENS_PER_RANK, equal on "
              "every rank, sizes the backend once", backend.name, backend.config.max_tokens_per_rank,
              f" ({buffer_bytes / 2**30:.1f} GiB of buffer per rank)" if buffer_bytes else "", RETIRED_CHECK_INTERVAL)


def tokens_per_rank(config: Config, words: HostCollectives, counts: list[Optional[int]], *,
                    at_least: int = 0) -> Config:
    """``config`` with room for the largest of the group's ranks' tokens (``counts``, from
    ``agree_before_build``; None where a rank's caller did not say), and for ``at_least`` where the largest is
    past the size (a backend grown past, half again its size).

    Megatron's tokens per rank (sequence length x micro-batch, over TP with sequence parallelism and over
    CP) are not in its TransformerConfig, and recipes commonly pass 8192 (the default) or more: the
    call that builds the backend shows them, as HybridEP sizes its buffer from its first call. Never below
    the default; a later call with more tokens (another sequence length at evaluation, variable-length
    batches) is refused on every rank (the op's first exchange carries the refusal), and the backend is built
    again for it (``EPPluginManager.dispatch``). Where EP_PLUGIN_MAX_TOKENS_PER_RANK is set it decides (on
    every rank alike: ``agree_before_build``), a first call past it is refused on every rank, and a later
    one too, with no second build."""
    known = [count for count in counts if count is not None]
    largest = max(known, default=0)
    if largest <= config.max_tokens_per_rank:
        return config
    if env_is_set("max_tokens_per_rank"):  # every rank refuses, rather than one while its peers wait
        over = ", ".join(f"{words.peer_name(rank)}: {count}" for rank, count in enumerate(counts)
                         if count is not None and count > config.max_tokens_per_rank)
        raise TooManyTokensError(f"ep_plugin megatron: the first MoE call has more tokens per rank than "
                                 f"EP_PLUGIN_MAX_TOKENS_PER_RANK={config.max_tokens_per_rank} ({over}); raise it to "
                                 f"the most tokens per rank of any step, or unset it to size from the first call")
    return config.replace(max_tokens_per_rank=max(largest, at_least))


def _tokens_of(hidden_states: torch.Tensor) -> int:
    """Tokens of this rank's call (Megatron's dispatch_preprocess hands the manager [S x B, H])."""
    return hidden_states.numel() // hidden_states.shape[-1]


def combine_counts() -> dict[str, int]:
    """This rank's combines over the shared backends so far, by how its input travelled ("in_place": read
    in the arena by the peers, "pushed": partial sums sent); empty for backends that do not count."""
    total: collections.Counter = collections.Counter()
    for backend in _backends.values():
        total.update(getattr(backend, "combine_counts", {}))
    return dict(total)


def cached_backend_count() -> int:
    """How many shared backends are alive (built and not destroyed), those a grow left behind included."""
    return len(_backends) + len(_retired)


def clear_backend_cache() -> None:
    """Destroy the shared backends (call before destroying the process groups they use). The cache is
    emptied even when a destroy raises (a timeout, say): the first error is raised after the others ran."""
    global _cache_generation
    backends = list(_backends.values()) + _retired
    _backends.clear()
    _retired.clear()
    _handles.clear()
    _cache_generation += 1
    first_error = None
    for backend in backends:
        try:
            backend.destroy()
        except Exception as error:  # noqa: BLE001 - the others are still destroyed; the first is raised
            first_error = first_error or error
    if first_error is not None:
        raise first_error


class EPPluginManager:
    """Drives one ep_plugin backend for one MoE layer (Megatron's ``_DispatchManager`` duck type).

    Args:
        backend_name: ep_plugin registry name ("reference", "hybrid", "elastic").
        group: the TP x EP process group (``dispatcher.tp_ep_group``).
        num_local_experts: experts on this rank.
        num_experts: experts over the group, TP x ``num_moe_experts`` (the dispatcher expands the
            routing map over TP ranks, so each TP rank counts as its own destination).
        config: the layer's TransformerConfig.
    """

    def __init__(self, backend_name: str, group, num_local_experts: int, num_experts: int, config) -> None:
        self.backend_name = backend_name
        self.group = group
        self.num_local_experts = num_local_experts
        self.num_experts = num_experts
        self.config = config
        # Resolve the class now so an unknown or unavailable backend fails at model build time.
        self.backend_class = resolve_backend_class(backend_name, config, local_experts=num_local_experts,
                                                   tp_copies=num_experts // config.num_moe_experts)
        self.pad_multiple = compat.quantization_pad_multiple(config)

        # Per-step state, the same attribute names Megatron's managers use (the fine-grained 1F1B
        # callables overwrite token_probs and dispatched_probs with detached copies).
        self.routing_map: Optional[torch.Tensor] = None  # [T, num_experts] bool
        self.token_probs: Optional[torch.Tensor] = None  # [T, num_experts]
        self.dispatched_probs: Optional[torch.Tensor] = None  # [R] float32
        self.tokens_per_expert: Optional[torch.Tensor] = None  # [num_local_experts] int64
        self.handle: Optional[ep_plugin.Handle] = None
        self.backend: Optional[Backend] = None
        self._backend_generation = -1  # the cache generation self.backend came from (see _backend_for)
        # Read (and reset) by 0.19's paged stash through dispatcher.check_over_budget(). Plugin
        # backends size the output exactly in blocking mode and never drop a token, so it stays False.
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.over_budget = torch.zeros(1, dtype=torch.bool, device=device)

    def setup_metadata(self, routing_map: torch.Tensor, probs: torch.Tensor) -> None:
        """Keep this rank's routing for ``dispatch``. Runs under torch.compile: reshapes only.

        Args:
            routing_map: [T, world, num_local_experts] (or [T, num_experts]) bool.
            probs: same shape, the router's probs (any float dtype; fp32 is sent).
        """
        num_tokens = routing_map.shape[0]
        self.routing_map = routing_map.reshape(num_tokens, self.num_experts)
        self.token_probs = probs.reshape(num_tokens, self.num_experts)

    def dispatch(self, hidden_states: torch.Tensor, async_finish: bool = True,
                 allocate_on_comm_stream: bool = True) -> torch.Tensor:
        """Send tokens to their experts' ranks. Returns rows [R, H] grouped by local expert.

        ``async_finish``/``allocate_on_comm_stream`` are accepted for the contract; the call is
        ordered on the current stream, so the result is ready for the next kernel.
        """
        if self.routing_map is None:
            raise RuntimeError("EPPluginManager.dispatch called before setup_metadata")
        if self.config.moe_pad_expert_input_to_capacity:  # switched on after the build-time check
            raise ValueError(f"{selected_by(self.config)}: drop-and-pad was switched on after the model was built. "
                             f"{DECODE_PADDING_PROBLEM}")
        if hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():  # inference graphs, say
            # Before the backend's own refusal, whose advice (EP_PLUGIN_BLOCKING=0) the first dispatch refuses.
            raise RuntimeError(f"{selected_by(self.config)}: Megatron is capturing this MoE layer's dispatch in a "
                               f"CUDA graph; {CAPTURE_PROBLEM}")
        release_drained(self.group if self.group is not None else torch.distributed.group.WORLD)
        backend = self._backend_for(hidden_states)
        probs = self.token_probs
        if probs.dtype not in backend.capabilities.probs_dtypes:
            # fp32, as HybridEP carries them; a backend that carries the router's dtype (the reference, fp64
            # under moe_router_dtype="fp64") keeps it, as Megatron's alltoall dispatcher does.
            probs = probs.float()
        num_tokens = _tokens_of(hidden_states)
        room = backend.config.max_tokens_per_rank
        # The backend's own refusal would not say where its size came from; one that refuses in its exchange
        # (every backend in blocking mode, which Megatron's needs) makes every rank raise, where this one rank
        # would leave its peers waiting.
        if num_tokens > room and not backend.refuses_input_in_exchange:
            raise ValueError(f"{selected_by(self.config)}: this MoE layer's call has {num_tokens} tokens on this rank, "
                             f"over the {room} its shared backend was built for (the largest of the first call, or "
                             f"EP_PLUGIN_MAX_TOKENS_PER_RANK). Set EP_PLUGIN_MAX_TOKENS_PER_RANK to the most tokens "
                             f"per rank of any step (training and evaluation), equal on every rank")
        try:
            out = self._dispatch_on(backend, hidden_states, probs)
        except TooManyTokensError:
            # Every rank refused this dispatch together, before any row was delivered (a longer sequence at
            # evaluation, say): every rank builds a larger backend, together, and dispatches again. A size the
            # user set stands.
            if env_is_set("max_tokens_per_rank"):
                raise
            backend = self._backend_for(hidden_states, grow=True)
            out = self._dispatch_on(backend, hidden_states, probs)
        handles = _handles.get(id(backend))
        if handles is None:  # (not setdefault: that would make a WeakSet on every dispatch)
            handles = _handles[id(backend)] = weakref.WeakSet()
        handles.add(out.handle)
        self.handle = out.handle
        self.dispatched_probs = out.probs
        # On the host, as DeepEP's dispatcher hands them to the experts: SequentialMLP and TEGroupedMLP call
        # .tolist() on them (a device tensor would make the host wait for the dispatch there), and the
        # legacy GroupedMLP's grouped GEMM refuses a device tensor. Blocking mode read them with the count.
        counts = out.tokens_per_expert_list
        self.tokens_per_expert = (torch.tensor(counts, dtype=torch.int64) if counts is not None
                                  else out.tokens_per_expert.cpu())
        # The experts may put their output where combine reads it.
        arena.expect_expert_output(backend, out.handle.num_rows)
        return out.hidden

    def _dispatch_on(self, backend: Backend, hidden_states: torch.Tensor, probs: torch.Tensor):
        routing, options = self._routing_for(backend, probs)
        return ep_plugin.dispatch(backend, hidden_states.contiguous(), pad_multiple=self.pad_multiple, **routing,
                                  **options)

    def get_permuted_hidden_states_by_experts(self, hidden_states: torch.Tensor):
        """Rows are already grouped by local expert: returns (rows, their probs [R])."""
        return hidden_states, self.dispatched_probs

    def get_number_of_tokens_per_expert(self) -> torch.Tensor:
        """[num_local_experts] int64 rows per local expert (segments padded to pad_multiple), on the CPU."""
        return self.tokens_per_expert

    def get_restored_hidden_states_by_experts(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Expert outputs stay in the dispatch layout; combine reverses it."""
        return hidden_states

    def combine(self, hidden_states: torch.Tensor, async_finish: bool = True,
                allocate_on_comm_stream: bool = True) -> torch.Tensor:
        """Return [T, H]: each token's expert rows summed at its source rank (unweighted)."""
        if self.handle is None:
            raise RuntimeError("EPPluginManager.combine called without a preceding dispatch")
        handle, self.handle = self.handle, None  # autograd keeps the Handle for backward
        # Megatron read the probs after the dispatch; kept past the combine they would keep the dispatch's graph,
        # and its handle counted as pending, after a forward whose output was dropped (evaluation with grad on).
        self.dispatched_probs = None
        arena.forget_expert_output()
        return ep_plugin.combine(hidden_states.contiguous(), handle)

    def _routing_for(self, backend: Backend, probs: torch.Tensor) -> tuple[dict, dict]:
        """The routing arguments and options this backend takes, from Megatron's routing map and probs.

        A backend without the routing-map form (``elastic``) gets top-k ids: each row's chosen experts
        (at most ``moe_router_topk`` per TP copy of the expert set; fewer become -1), with their probs.
        A backend that can deliver either compact or expert-grouped rows is asked for expert-grouped
        rows with zeroed padding, which is what Megatron's experts consume.
        """
        capabilities = backend.capabilities
        if "routing_map" in capabilities.routing_forms:
            routing = dict(routing_map=self.routing_map.contiguous(), probs=probs.contiguous())
        else:
            chosen, topk_idx = self.routing_map.to(torch.float32).topk(self._experts_per_token(), dim=1)
            chosen = chosen > 0
            topk_idx = torch.where(chosen, topk_idx, torch.full_like(topk_idx, -1))
            weights = probs.gather(1, topk_idx.clamp_min(0)) * chosen
            routing = dict(topk_idx=topk_idx.contiguous(), topk_weights=weights.contiguous())
        options = {}
        if "expand" in capabilities.dispatch_options:
            options = dict(expand=True, zero_padding=True)
        return routing, options

    def _experts_per_token(self) -> int:
        """Routing map entries a token has at most: ``moe_router_topk`` per TP copy of the expert set."""
        tp = max(1, self.num_experts // self.config.num_moe_experts)
        return min(self.num_experts, self.config.moe_router_topk * tp)

    def _backend_for(self, hidden_states: torch.Tensor, *, grow: bool = False) -> Backend:
        """The shared backend for this call; ``grow``: every rank's dispatch on ``self.backend`` was just refused
        for its token count (TooManyTokensError), and every rank builds a larger one (``shared_backend``)."""
        hidden_size = hidden_states.shape[-1]
        backend = self.backend
        # A model kept across clear_backend_cache() (a rebuild of the process groups, say) must not use the
        # destroyed backend: it takes the new cache's. So does one whose backend another layer grew past.
        if (grow or backend is None or self._backend_generation != _cache_generation
                or backend.hidden_size != hidden_size or backend.device != hidden_states.device):
            device = hidden_states.device
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            try:
                config, problem = backend_config(self.config), None
            except ValueError as error:  # refused on every rank, in the build's first exchange
                config, problem = _config_of_what_parses(self.config), str(error)
            problem = problem or sync_free_problem(self.config, self.backend_class, config)
            backend = shared_backend(self.backend_name, self.group, hidden_size, self.num_experts, device,
                                     experts_per_token=self._experts_per_token(), pad_multiple=self.pad_multiple,
                                     config=config, config_problem=problem,
                                     # Only SequentialMLP's output goes to the arena (arena.run_experts).
                                     experts_take_arena=not getattr(self.config, "moe_grouped_gemm", False),
                                     num_tokens=_tokens_of(hidden_states), grow_past=backend if grow else None)
            self.backend, self._backend_generation = backend, _cache_generation
        return backend
