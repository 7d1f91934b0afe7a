"""Megatron's experts allocate their output in the backend's combine-input arena, so that the
combine reads it where it is (one pass) instead of summing and pushing partials first.

Only where the backend has an arena (``hybrid`` built with ``combine_input_rows > 0``, e.g.
EP_PLUGIN_COMBINE_INPUT_ROWS=N) and the experts are ``SequentialMLP``. After each dispatch the manager
names its backend (``expect_expert_output``); the experts' forward, wrapped by ``install()``, takes it
and opens the arena (``combine_input_arena()``) just before its output is allocated, until it returns:
after the last local expert has run (their outputs are then concatenated into the output) or, with
one local expert, from its fc2 on. What comes earlier (activations kept for backward) stays in torch's
ordinary memory and cannot fill the arena. An output that does not fit, or any other experts module,
is combined the two-stage way, as before.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

_pending = threading.local()  # .backend: the backend whose arena the next experts' output may use


def expect_expert_output(backend) -> None:
    """After a dispatch: the next experts' forward on this thread may put its output in ``backend``'s arena."""
    _pending.backend = backend if getattr(backend, "arena", None) is not None else None


def forget_expert_output() -> None:
    """At a combine: whatever the experts did, the next forward waits for the next dispatch."""
    _pending.backend = None


def run_experts(experts, forward: Callable, *args, **kwargs):
    """``forward(experts, *args, **kwargs)`` with its output allocated in the pending backend's arena."""
    backend = getattr(_pending, "backend", None)
    _pending.backend = None
    if backend is None:
        return forward(experts, *args, **kwargs)
    arena = contextlib.ExitStack()

    def open_arena(*_) -> None:  # a hook: returning None leaves the module's output as it is
        arena.enter_context(backend.combine_input_arena())

    local = experts.local_experts
    hook = (local[-1].register_forward_hook(open_arena) if len(local) > 1 else
            local[0].linear_fc2.register_forward_pre_hook(open_arena))
    try:
        with arena:
            return forward(experts, *args, **kwargs)
    finally:
        hook.remove()
