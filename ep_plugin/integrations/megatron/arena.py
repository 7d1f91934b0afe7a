"""Megatron's experts allocate their output in the backend's combine-input arena, so that the
combine reads it where it is (one pass) instead of summing and pushing partials first.

Only where the backend has an arena (``hybrid`` built with ``combine_input_rows > 0``: by default when
every rank of the group is on one GPU, see ``default_combine_input_rows``, and then only for outputs of
at least ``DEFAULT_MIN_OUTPUT_BYTES``; EP_PLUGIN_COMBINE_INPUT_ROWS=N decides instead where set) and the
experts are ``SequentialMLP``. After each dispatch the manager
names its backend (``expect_expert_output``); the experts' forward, wrapped by ``install()``, takes it
and opens the arena (``combine_input_arena()``) just before its output is allocated, until it returns:
after the last local expert has run (their outputs are then concatenated into the output) or, with
one local expert, from its fc2 on (not under FP8/FP4: that fc2 allocates what outlives the combine). What
comes earlier (activations kept for backward) stays in torch's ordinary memory and cannot fill the arena.
An output that does not fit, or any other experts module, is combined the two-stage way, as before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Callable, Optional

import torch

from ep_plugin.backends.compiled import worst_case_rows
from ep_plugin.config import Config, env_is_set
from ep_plugin.host_collectives import HostCollectives
from ep_plugin.transport.arena import ARENA_OVERHEAD_BYTES, arena_bytes
from ep_plugin.transport.placement import ranks_per_gpu

from . import compat

logger = logging.getLogger(__name__)

# The share of one GPU's memory that the arenas of all the ranks on it may take by default.
DEFAULT_ARENA_SHARE = 1 / 8

# With the default arena, smaller expert outputs (bytes per rank) are combined the two-stage way: there
# the pool's host cost per MoE layer is more than the one-pass combine saves in Megatron's blocking,
# host-paced step. One H200, 8 ranks x 16 SMs, hidden 7168, top-8 of 256, 4 interleaved runs: step 336 µs
# two-stage against 379 in the arena at 1024 rows per rank (14.7 MB), 655 against 456 at 4096 rows
# (58.7 MB) (benchmarks/NOTES.md, twenty-third pass), about even at 2048 rows (29 MB, twenty-fourth pass).
# A size asked for with EP_PLUGIN_COMBINE_INPUT_ROWS takes every output that fits.
DEFAULT_MIN_OUTPUT_BYTES = 16 * 2**20

_pending = threading.local()  # .backend: the backend whose arena the next experts' output may use
_default_arenas: "weakref.WeakSet" = weakref.WeakSet()  # backends whose arena is Megatron's default


def note_default_arena(backend) -> None:
    """``backend``'s arena is Megatron's default (not asked for): small outputs stay out of it."""
    _default_arenas.add(backend)


def takes_output(num_rows: int, hidden_size: int, *, default_arena: bool) -> bool:
    """Whether an expert output of ``num_rows`` bf16 rows goes to the arena (see DEFAULT_MIN_OUTPUT_BYTES)."""
    return not default_arena or num_rows * 2 * hidden_size >= DEFAULT_MIN_OUTPUT_BYTES


def expect_expert_output(backend, num_rows: int) -> None:
    """After a dispatch of ``num_rows`` rows: the next experts' forward on this thread may put its output
    in ``backend``'s arena."""
    usable = getattr(backend, "arena", None) is not None and takes_output(
        num_rows, backend.hidden_size, default_arena=backend in _default_arenas)
    _pending.backend = backend if usable else None


def forget_expert_output() -> None:
    """At a combine: whatever the experts did, the next forward waits for the next dispatch."""
    _pending.backend = None


def run_experts(experts, forward: Callable, *args, **kwargs):
    """``forward(experts, *args, **kwargs)`` with its output allocated in the pending backend's arena."""
    backend = getattr(_pending, "backend", None)
    _pending.backend = None
    if backend is None:
        return forward(experts, *args, **kwargs)
    local = experts.local_experts
    if len(local) == 1 and compat.quantized(getattr(experts, "config", None)):
        # One expert's output is its fc2's, so the arena would be open during fc2, whose FP8/FP4 GEMM
        # allocates what outlives the combine (the quantized input kept for backward, Transformer
        # Engine's weight cache): arena memory, freed under them when the backend goes. Two-stage.
        return forward(experts, *args, **kwargs)
    arena = contextlib.ExitStack()

    def open_arena(*_) -> None:  # a hook: returning None leaves the module's output as it is
        arena.enter_context(backend.combine_input_arena())

    hook = (local[-1].register_forward_hook(open_arena) if len(local) > 1 else
            local[0].linear_fc2.register_forward_pre_hook(open_arena))
    try:
        with arena:
            return forward(experts, *args, **kwargs)
    finally:
        hook.remove()


# ---- how large an arena Megatron's backend gets when the user did not say ----------------------

def default_combine_input_rows(*, num_ranks: int, ranks_on_one_gpu: int, max_tokens_per_rank: int,
                               num_local_experts: int, experts_per_token: int, pad_multiple: int,
                               hidden_size: int, gpu_memory_bytes: int) -> int:
    """Rows of combine input the arena holds by default (0 = no arena: the two-stage combine).

    In place only where every rank of the group is on one GPU. There the in-place combine moves about
    half the bytes of the two-stage one (2.2x faster at the standard shape, 8 ranks on one H200). Across
    GPUs every expert row of a token crosses the link instead of one partial sum per expert rank (about
    1.5x the link bytes at top-8 of 256 experts over 8 ranks, 4x over 2), which has not been measured over
    NVLink: the two-stage combine stays there until it is.

    Size: twice a rank's balanced share of rows at ``max_tokens_per_rank`` (every source's tokens spread
    evenly over the ranks: max_tokens_per_rank x experts_per_token, plus each expert's padding), at most
    the worst case, with the arenas of all the ranks on the GPU within ``DEFAULT_ARENA_SHARE`` of its
    memory. 0 when not even the balanced share fits: most combines would miss the arena.
    """
    if ranks_on_one_gpu < num_ranks:
        return 0
    padding = num_local_experts * (pad_multiple - 1)
    balanced = max_tokens_per_rank * experts_per_token + padding
    worst = worst_case_rows(num_ranks, max_tokens_per_rank, num_local_experts, experts_per_token, pad_multiple)
    # An arena's rounding adds at most ARENA_OVERHEAD_BYTES to its rows (transport/arena.py).
    room_bytes = int(DEFAULT_ARENA_SHARE * gpu_memory_bytes) // ranks_on_one_gpu - ARENA_OVERHEAD_BYTES
    rows = min(2 * balanced, worst, max(0, room_bytes) // (2 * hidden_size))
    return rows if rows >= min(balanced, worst) else 0


def combine_input_options(backend_class, collectives: HostCollectives, device: torch.device, *, config: Config,
                          num_experts: int, experts_per_token: int, pad_multiple: Optional[int],
                          hidden_size: int) -> dict:
    """Constructor options that give Megatron's backend its default arena (a collective call on
    ``collectives``, the backend's group; ``config``: the backend's).

    Nothing for a backend without an arena or when EP_PLUGIN_COMBINE_INPUT_ROWS is set (the backend
    reads it). Otherwise the ranks find out whether they all share one GPU (a timed exchange) and
    ``default_combine_input_rows`` decides; every input is equal on every rank, so is the size."""
    if not getattr(backend_class, "has_combine_input_arena", False) or env_is_set("combine_input_rows"):
        return {}
    num_ranks = collectives.num_ranks
    rows = default_combine_input_rows(
        num_ranks=num_ranks, ranks_on_one_gpu=ranks_per_gpu(collectives, device),
        max_tokens_per_rank=config.max_tokens_per_rank, num_local_experts=num_experts // num_ranks,
        experts_per_token=experts_per_token, pad_multiple=pad_multiple or config.pad_multiple,  # None: the default
        hidden_size=hidden_size,
        gpu_memory_bytes=torch.cuda.get_device_properties(device).total_memory)
    logger.info("ep_plugin: combine input arena of %d rows (%.0f MiB per rank): %s; EP_PLUGIN_COMBINE_INPUT_ROWS "
                "overrides", rows, arena_bytes(rows * 2 * hidden_size) / 2**20,
                f"in place for expert outputs of >= {DEFAULT_MIN_OUTPUT_BYTES / 2**20:.0f} MiB" if rows else
                "two-stage combine (not every rank on one GPU, or no room)")
    return {"combine_input_rows": rows}
