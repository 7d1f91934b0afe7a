"""Autograd Functions: backward of dispatch is combine, backward of combine is dispatch.

Each Function keeps the Handle on its ctx, so the autograd graph owns the Handle (and
through it every tensor the backward kernels read) until the graph is freed — backward may
run more than once with retain_graph. The caller may drop its own references at any time.
"""

from __future__ import annotations

from typing import Optional

import torch

from .backends.base import Backend
from .handle import DispatchOutput, Handle


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, probs, backend: Backend, routing_kwargs: dict, pad_multiple):
        weights = _probs_kwarg(routing_kwargs, probs)
        result = backend.dispatch(hidden, pad_multiple=pad_multiple, **routing_kwargs, **weights)
        ctx.handle = result.handle
        ctx.mark_non_differentiable(result.tokens_per_expert)
        return result.hidden, result.probs, result.tokens_per_expert, result.handle

    @staticmethod
    def backward(ctx, grad_rows, grad_row_probs, _grad_counts, _grad_handle):
        # The Handle stays on ctx (not released here): backward may run again with retain_graph.
        handle: Handle = ctx.handle
        if grad_rows is None:
            grad_rows = torch.zeros(handle.num_rows, handle.hidden_size, dtype=handle.hidden_dtype,
                                    device=handle.backend.device)
        want_probs = handle.probs_shape is not None and ctx.needs_input_grad[1]
        if want_probs and grad_row_probs is None:
            want_probs = False
        result = handle.backend.combine(grad_rows.contiguous(), handle,
                                        row_probs=grad_row_probs.contiguous() if want_probs else None)
        return result.hidden, result.probs, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, handle: Handle):
        ctx.handle = handle
        return handle.backend.combine(rows, handle).hidden

    @staticmethod
    def backward(ctx, grad_out):
        handle: Handle = ctx.handle
        return handle.backend.dispatch_again(grad_out.contiguous(), handle), None


def _probs_kwarg(routing_kwargs: dict, probs: Optional[torch.Tensor]) -> dict:
    return {"probs": probs} if "routing_map" in routing_kwargs else {"topk_weights": probs}


def dispatch(
    backend: Backend,
    hidden: torch.Tensor,
    *,
    routing_map: Optional[torch.Tensor] = None,
    probs: Optional[torch.Tensor] = None,
    topk_idx: Optional[torch.Tensor] = None,
    topk_weights: Optional[torch.Tensor] = None,
    pad_multiple: Optional[int] = None,
) -> DispatchOutput:
    """Differentiable dispatch: send each token to the ranks that own its experts.

    Args:
        backend: a backend instance (``ep_plugin.get_backend(name)(group, hidden_size=, num_experts=)``).
        hidden: [T, H] this rank's tokens (T may be 0).
        routing_map: [T, E] bool with ``probs`` [T, E] float32 — Megatron's router output; or
        topk_idx: [T, k] int64 (-1 = none) with ``topk_weights`` [T, k] float32.
        pad_multiple: pad each local expert's rows to a multiple of this (zeros).
    Returns:
        DispatchOutput(hidden [R, H] sorted by local expert, probs [R] of each row,
        tokens_per_expert [E/ranks] int64 padded segment lengths, handle for ``combine``).
        Gradients flow to ``hidden`` and to ``probs``/``topk_weights``.
    """
    if routing_map is not None:
        routing_kwargs, weights = {"routing_map": routing_map}, probs
        if topk_weights is not None:
            raise ValueError("topk_weights goes with topk_idx; with routing_map pass probs")
    else:
        routing_kwargs, weights = {"topk_idx": topk_idx}, topk_weights
        if probs is not None:
            raise ValueError("probs goes with routing_map; with topk_idx pass topk_weights")
    rows, row_probs, tokens_per_expert, handle = _Dispatch.apply(hidden, weights, backend, routing_kwargs, pad_multiple)
    return DispatchOutput(rows, row_probs, tokens_per_expert, handle)


def combine(rows: torch.Tensor, handle: Handle) -> torch.Tensor:
    """Differentiable combine: sum each token's expert rows back at its source rank.

    Args:
        rows: [R, H] in the layout of ``handle``'s dispatch (padding rows are ignored).
        handle: from ``dispatch``.
    Returns: [T, H] in source token order, same dtype as ``rows`` (accumulated in fp32).
    """
    if not isinstance(handle, Handle):
        raise TypeError(f"combine needs the Handle returned by dispatch, got {type(handle).__name__}")
    return _Combine.apply(rows, handle)
