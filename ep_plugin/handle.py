"""The Handle returned by dispatch: everything combine (and both backwards) need.

Ownership rule: a Handle owns every tensor that a kernel queued for this dispatch/combine pair may
still read or write — the backend's layout tensors, device counters, and any ``keepalive`` objects
— until the work is known complete. Python code may drop its last reference to a Handle right
after enqueueing backward: the autograd graph holds the Handle until the graph is freed (after
backward, or later with retain_graph), and GPU backends tie the tensors to the streams they were
used on (record_stream, or an event held in ``keepalive``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from . import streams

if TYPE_CHECKING:
    from .backends.base import Backend

# Output forms of a dispatch (declared by the backend on the Handle).
EXPERT_ROWS = "expert_rows"  # one row per (token, local expert), grouped by expert, segments padded
COMPACT = "compact"  # one row per (token, destination rank), ordered by source rank then token


@dataclass(eq=False)
class Handle:
    """Layout of one dispatch, reused by its combine and by both backward passes."""

    backend: "Backend"
    # Shape facts of the source side.
    num_tokens: int  # T on this rank
    hidden_size: int
    hidden_dtype: torch.dtype
    probs_shape: Optional[tuple[int, ...]]  # [T, E] or [T, k]; None when no probs were dispatched
    # Shape facts of the expert side.
    num_experts: int
    num_local_experts: int
    pad_multiple: int
    num_rows: int  # rows of the dispatch output (padded); the capacity in non-blocking mode
    tokens_per_expert: torch.Tensor  # [num_local_experts] int64: padded segment lengths
    num_real_tokens_per_expert: torch.Tensor  # [num_local_experts] int64: before padding
    # Backend-specific named dataclass that owns the tensors its kernels read.
    layout: Any
    # Objects that queued work still uses (tensors, events); released with the Handle.
    keepalive: list = field(default_factory=list)
    # Which dispatch of its backend made this handle (from 1; 0 on backends whose ops do not carry it,
    # reference): ops that use it carry the number, so ranks that use their handles in different orders
    # are told apart.
    handle_id: int = 0
    # What the dispatch output looks like (EXPERT_ROWS or COMPACT), and the shape combine expects
    # for its per-row values (the gradient of the dispatched probs): [num_rows] by default.
    output_form: str = EXPERT_ROWS
    row_probs_shape: Optional[tuple[int, ...]] = None
    # A top-k dispatch's ids and their version then (``Tensor._version``), on a backend whose combine routes values
    # back by them (``Backend.combine_reads_topk_ids``): a change in place since (a reused buffer, say) is refused
    # there, not summed wrongly.
    topk_ids: Optional[tuple[torch.Tensor, int]] = None
    # The handed-out counts (views of one allocation: one stands for all) and their version at the dispatch, where
    # the handle's later kernels read them (``Backend.kernels_read_handed_out_counts``): a change since is refused.
    counts_version: Optional[tuple[torch.Tensor, int]] = None
    # Backward ops that autograd recorded with this handle (``ep_plugin.dispatch``'s and ``ep_plugin.combine``'s)
    # and that have not run yet: while any is left, its backend will still run ops with it (a caller that would
    # replace the backend waits for them). A second backward over a retained graph is not counted.
    backward_ops_left: int = 0

    @property
    def backward_pending(self) -> bool:
        return self.backward_ops_left > 0

    def expected_row_probs_shape(self) -> tuple[int, ...]:
        return self.row_probs_shape if self.row_probs_shape is not None else (self.num_rows,)


class DispatchOutput(NamedTuple):
    """What ``ep_plugin.dispatch`` returns.

    hidden: [num_rows, H]. Expert-row form: rows grouped by local expert, each segment padded to
        pad_multiple. Compact form: one row per (token, this rank), by source rank then token.
    probs: the dispatched probs / weights: [num_rows] per row (expert-row form) or [num_rows, k]
        (compact form, 0 where the expert is not on this rank); None without probs.
    tokens_per_expert: [num_local_experts] int64 on the device, padded segment lengths.
    handle: pass to ``ep_plugin.combine``.
    topk_idx: compact form only: [num_rows, k] int64 local expert ids, -1 where the token's expert
        is not on this rank.
    num_valid_rows: [1] int64 on the device: rows [0, min(num_valid_rows, num_rows)) are valid (the
        rest of a worst-case-sized output in non-blocking mode is unwritten). It counts the rows the
        senders had for this rank, so past a budget that was too small (``hybrid``'s
        ``num_permuted_tokens``; its overflow flag is then set) it exceeds the output's rows. None
        where every row is valid.
    tokens_per_expert_list: host copy of tokens_per_expert where the mode read it anyway (blocking).
    ready: CUDA event recorded after the last kernel that writes these outputs (None on CPU).
    """

    hidden: torch.Tensor
    probs: Optional[torch.Tensor]
    tokens_per_expert: torch.Tensor
    handle: Handle
    topk_idx: Optional[torch.Tensor] = None
    num_valid_rows: Optional[torch.Tensor] = None
    tokens_per_expert_list: Optional[list[int]] = None
    ready: Optional[torch.cuda.Event] = None

    def use_on(self, stream: Optional[torch.cuda.Stream] = None) -> "DispatchOutput":
        """Hand these outputs to ``stream`` (default: the current one): wait for the ready event, then
        ``record_stream`` every output storage there, so that the caching allocator keeps the memory
        until that stream's work is done, even if every other reference is dropped. Returns self
        (nothing to do for outputs on the CPU: a backend's CPU ops have finished when they return)."""
        hidden = self.hidden if isinstance(self.hidden, torch.Tensor) else None
        extra = list(self.hidden) if hidden is None else []  # FP8: (rows, scales)
        outputs = [hidden, *extra, self.probs, self.tokens_per_expert, self.topk_idx, self.num_valid_rows]
        if self.ready is None and not any(t is not None and t.is_cuda for t in outputs):
            return self
        stream = stream if stream is not None else torch.cuda.current_stream(self.handle.backend.device)
        streams.use_on(stream, self.ready, outputs)
        return self


class CombineOutput(NamedTuple):
    """What a backend's combine returns.

    hidden: [T, H] sum of each token's rows, in source token order.
    probs: per-(token, expert) values sent back unsummed, shaped like the dispatched probs
        ([T, E] or [T, k], zeros where a token chose nothing); None when not asked for.
    """

    hidden: torch.Tensor
    probs: Optional[torch.Tensor]
