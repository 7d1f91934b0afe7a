"""Autograd Functions: backward of dispatch is combine, backward of combine is dispatch.

Each Function keeps the Handle on its ctx, so the autograd graph owns the Handle (and through it
every tensor the backward kernels read) until the graph is freed — backward may run more than once
with retain_graph. The caller may drop its own references at any time.

Both backwards run the backend's ops outside autograd, so a second derivative through them (
``create_graph=True``, then differentiating the gradient again) would silently miss their terms.
``_differentiable_once`` makes it raise instead.

The backend declares what its dispatch returns (expert rows or compact rows, the shape of the
per-row probs) on the Handle; this layer assumes neither.
"""

from __future__ import annotations

from typing import Optional

import torch

from .backends.base import Backend
from .handle import EXPERT_ROWS, DispatchOutput, Handle


class _RaiseIfDifferentiated(torch.autograd.Function):
    """Passes ``result`` through; a derivative that flows back through it raises.

    Its inputs include the incoming gradients, so autograd reaches it exactly where a second
    derivative would flow through the backward it guards (torch's ``once_differentiable`` hangs
    its error on detached copies, which ``torch.autograd.grad(..., inputs=...)`` never visits).
    """

    @staticmethod
    def forward(ctx, op: str, result, *incoming_grads):
        ctx.op = op
        # A copy, not a view: a gradient that create_graph hands back may be written in place (g.mul_(0.5)),
        # which torch refuses on a view that a custom Function returned. Only under create_graph: a rare copy.
        return result.clone()

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(f"ep_plugin: the backward of {ctx.op} is not differentiable (double backward through "
                           "dispatch/combine is not supported)")


def _differentiable_once(op: str, incoming_grads: tuple, outputs: tuple) -> tuple:
    """The backward's ``outputs``, guarded when it runs with create_graph on gradients that need grad."""
    live = [g for g in incoming_grads if isinstance(g, torch.Tensor) and g.requires_grad]
    if not torch.is_grad_enabled() or not live:
        return outputs
    return tuple(_RaiseIfDifferentiated.apply(op, out, *live) if isinstance(out, torch.Tensor) else out
                 for out in outputs)


def _records(grad_enabled: bool, needs_input_grad: tuple) -> bool:
    """Whether autograd records the op (its backward will run), as ``Function.apply`` decides: grad mode
    on where the op was called and an input that requires grad. ``forward`` runs with grad mode off and
    ``ctx.needs_input_grad`` reads requires_grad also under torch.no_grad, so the mode comes from the caller."""
    return grad_enabled and any(needs_input_grad)


def _need_grad(*inputs) -> tuple:
    """``requires_grad`` of each tensor input, as ``ctx.needs_input_grad`` would read it (an fp8 tuple of
    tokens and scales, like None, needs none)."""
    return tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, probs, topk_weights, backend: Backend, routing_map, topk_idx, pad_multiple, options,
                grad_enabled: bool):
        # The backend validates the routing form; probs and topk_weights are inputs here only so
        # that autograd sees whichever one was given.
        backend.op_records_backward = _records(grad_enabled, ctx.needs_input_grad[:3])
        weights_index = 1 if routing_map is not None else 2  # probs or topk_weights (backward reads the same)
        backend.op_probs_need_grad = backend.op_records_backward and ctx.needs_input_grad[weights_index]
        try:
            result = backend.dispatch(hidden, routing_map=routing_map, probs=probs, topk_idx=topk_idx,
                                      topk_weights=topk_weights, pad_multiple=pad_multiple, **options)
            ctx.counted = backend.op_records_backward  # its backward runs combine with the handle
            result.handle.backward_ops_left += int(ctx.counted)
        finally:
            backend.op_records_backward = backend.op_probs_need_grad = False
        ctx.handle = result.handle
        ctx.weights_are_probs = routing_map is not None
        ctx.mark_non_differentiable(*(t for t in (result.tokens_per_expert, result.topk_idx, result.num_valid_rows)
                                      if t is not None))
        return (result.hidden, result.probs, result.tokens_per_expert, result.handle, result.topk_idx,
                result.num_valid_rows, result.tokens_per_expert_list, result.ready)

    @staticmethod
    def backward(ctx, grad_rows, grad_row_probs, *_grads_of_the_rest):
        # The Handle stays on ctx (not released here): backward may run again with retain_graph.
        handle: Handle = ctx.handle
        if grad_rows is None:
            grad_rows = torch.zeros(handle.num_rows, handle.hidden_size, dtype=handle.hidden_dtype,
                                    device=handle.backend.device)
        weights_index = 1 if ctx.weights_are_probs else 2
        want_probs = (handle.probs_shape is not None and ctx.needs_input_grad[weights_index]
                      and grad_row_probs is not None)
        with torch.no_grad():
            result = handle.backend.combine(grad_rows.contiguous(), handle,
                                            row_probs=grad_row_probs.contiguous() if want_probs else None)
        if ctx.counted:
            handle.backward_ops_left -= 1
            ctx.counted = False  # a second backward over a retained graph is not counted again
        grad_probs = result.probs if ctx.weights_are_probs else None
        grad_topk_weights = None if ctx.weights_are_probs else result.probs
        grads = _differentiable_once("dispatch", (grad_rows, grad_row_probs),
                                     (result.hidden, grad_probs, grad_topk_weights))
        return *grads, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, bias, handle: Handle, options, grad_enabled: bool):
        # ``bias`` (a backend's combine option, elastic's) is an input here so that autograd sees it.
        ctx.handle = handle
        backend = handle.backend
        # Only the rows' gradient is an op of the backend (dispatch_again): the bias's is the output's.
        backend.op_records_backward = _records(grad_enabled, ctx.needs_input_grad[:1])
        if bias is not None:
            options = {**options, "bias": bias}
        try:
            combined = backend.combine(rows, handle, **options).hidden
            ctx.counted = backend.op_records_backward  # its backward runs dispatch_again with the handle
            handle.backward_ops_left += int(ctx.counted)
            return combined
        finally:
            backend.op_records_backward = False

    @staticmethod
    def backward(ctx, grad_out):
        handle: Handle = ctx.handle
        grad_rows = None
        if ctx.needs_input_grad[0]:
            with torch.no_grad():
                grad_rows = handle.backend.dispatch_again(grad_out.contiguous(), handle)
        if ctx.counted:
            handle.backward_ops_left -= 1
            ctx.counted = False  # a second backward over a retained graph is not counted again
        (grad_rows,) = _differentiable_once("combine", (grad_out,), (grad_rows,))
        grad_bias = grad_out if ctx.needs_input_grad[1] else None  # out = sum of rows + bias
        return grad_rows, grad_bias, None, None, None


def _zero_padding_for_backward(backend: Backend, options: dict) -> dict:
    """``options`` with ``zero_padding=True`` for a recorded dispatch into expert rows on a backend that pads
    with whatever the memory held unless asked (elastic): a grouped GEMM over the padded segments takes the
    padding rows into its weight gradient, where a stale NaN times the zero gradient is NaN."""
    handle = options.get("handle")
    allowed = backend.capabilities.cached_dispatch_options if handle is not None else \
        backend.capabilities.dispatch_options
    expanded = options.get("expand") or getattr(handle, "output_form", None) == EXPERT_ROWS
    if expanded and "zero_padding" in allowed and not options.get("zero_padding"):
        return {**options, "zero_padding": True}
    return options


def dispatch(
    backend: Backend,
    hidden: torch.Tensor,
    *,
    routing_map: Optional[torch.Tensor] = None,
    probs: Optional[torch.Tensor] = None,
    topk_idx: Optional[torch.Tensor] = None,
    topk_weights: Optional[torch.Tensor] = None,
    pad_multiple: Optional[int] = None,
    **options,
) -> DispatchOutput:
    """Differentiable dispatch: send each token to the ranks that own its experts.

    Args:
        backend: a backend instance (``ep_plugin.get_backend(name)(group, hidden_size=, num_experts=)``).
        hidden: [T, H] this rank's tokens (T may be 0).
        routing_map: [T, E] bool with ``probs`` [T, E] float32 — Megatron's router output; or
        topk_idx: [T, k] int64 (-1 = none) with ``topk_weights`` [T, k] float32.
        pad_multiple: pad each local expert's rows to a multiple of this (zeros; ``elastic`` zeroes its
            expanded form's padding only with ``zero_padding=True``, which a dispatch autograd records
            always sets, and its compact form pads only ``tokens_per_expert``).
        options: the backend's own dispatch options (``backend.capabilities.dispatch_options``; for
            ``elastic``: ``expand``, ``zero_padding``, ``in_place``).
    Returns:
        DispatchOutput: hidden rows in the backend's output form (``handle.output_form``: rows sorted
        by local expert, or compact rows), their probs, tokens_per_expert [E/ranks] int64 (padded
        segment lengths), the handle for ``combine``, and the optional fields the backend fills.
        Gradients flow to ``hidden`` and to ``probs``/``topk_weights``.
    """
    grad_enabled = torch.is_grad_enabled()
    fp8 = isinstance(hidden, (tuple, list))
    # An fp8 pair's data may need grad (x.to(torch.float8_e4m3fn) is differentiable): that counts too.
    records = _records(grad_enabled, _need_grad(hidden[0] if fp8 and hidden else hidden, probs, topk_weights))
    if records and fp8:
        # Before any communication: the backward would fail on every rank after its combine had run (or, with
        # only the data needing grad, its gradient would be dropped without a word).
        raise TypeError("ep_plugin.dispatch: an FP8 dispatch ((data, scales) hidden) has no backward yet, and its "
                        "data or the probs / topk_weights need grad; dispatch them detached or under torch.no_grad")
    if not records:
        # Nothing to record (inference, torch.no_grad): the Function's bookkeeping (~5 µs) would buy nothing.
        return backend.dispatch(hidden, routing_map=routing_map, probs=probs, topk_idx=topk_idx,
                                topk_weights=topk_weights, pad_multiple=pad_multiple, **options)
    options = _zero_padding_for_backward(backend, options)
    outputs = _Dispatch.apply(hidden, probs, topk_weights, backend, routing_map, topk_idx, pad_multiple, options,
                              grad_enabled)
    return DispatchOutput(*outputs)


def combine(rows: torch.Tensor, handle: Handle, **options) -> torch.Tensor:
    """Differentiable combine: sum each token's rows back at its source rank.

    Args:
        rows: [R, H] in the layout of ``handle``'s dispatch (padding rows are ignored).
        handle: from ``dispatch``.
        options: the backend's own combine options (``backend.capabilities.combine_options``; for
            ``elastic``: ``bias`` [T, H], added to the sum, whose gradient is the output's).
    Returns: [T, H] in source token order, same dtype as ``rows`` (accumulated in fp32).
    """
    if not isinstance(handle, Handle):
        raise TypeError(f"combine needs the Handle returned by dispatch, got {type(handle).__name__}")
    # What backend.combine returns besides the rows would be lost here (None, as DeepEP-style code passes it, is no
    # row_probs at all).
    if options.pop("row_probs", None) is not None:
        raise TypeError("ep_plugin.combine returns the combined rows only; row_probs (the backward of dispatch's "
                        "probs, returned next to the rows) goes through backend.combine(rows, handle, row_probs=...)")
    bias = options.pop("bias", None)
    grad_enabled = torch.is_grad_enabled()
    if not _records(grad_enabled, _need_grad(rows, bias)):  # as in dispatch
        return handle.backend.combine(rows, handle, **options, **({} if bias is None else {"bias": bias})).hidden
    return _Combine.apply(rows, bias, handle, options, grad_enabled)
