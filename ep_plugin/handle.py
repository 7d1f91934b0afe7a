"""The Handle returned by dispatch: everything combine (and both backwards) need.

Ownership rule (DESIGN §3.1): a Handle owns every tensor that a kernel queued for this
dispatch/combine pair may still read or write — the backend's layout tensors, device
counters, and any ``keepalive`` objects — until the work is known complete. Python code
may drop its last reference to a Handle right after enqueueing backward: the autograd
graph holds the Handle until the graph is freed (after backward, or later with
retain_graph), and GPU backends tie the tensors to the streams they were used on
(record_stream, or an event held in ``keepalive``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

if TYPE_CHECKING:
    from .backends.base import Backend


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
    num_rows: int  # rows of the dispatch output (padded); the budget in non-blocking mode
    tokens_per_expert: torch.Tensor  # [num_local_experts] int64: padded segment lengths
    num_real_tokens_per_expert: torch.Tensor  # [num_local_experts] int64: before padding
    # Backend-specific named dataclass that owns the tensors its kernels read.
    layout: Any
    # Objects that queued work still uses (tensors, events); released with the Handle.
    keepalive: list = field(default_factory=list)


class DispatchOutput(NamedTuple):
    """What ``ep_plugin.dispatch`` returns.

    hidden: [num_rows, H], rows grouped by local expert, each segment zero-padded to pad_multiple.
    probs: [num_rows] float, the prob of each row's (token, expert) pair (0 on padding); None without probs.
    tokens_per_expert: [num_local_experts] int64, padded segment lengths (sum = num_rows).
    handle: pass to ``ep_plugin.combine``.
    """

    hidden: torch.Tensor
    probs: Optional[torch.Tensor]
    tokens_per_expert: torch.Tensor
    handle: Handle


class CombineOutput(NamedTuple):
    """What a backend's combine returns.

    hidden: [T, H] sum of each token's expert rows, in source token order.
    probs: per-(token, expert) values sent back unsummed, shaped like the dispatched probs
        ([T, E] or [T, k], zeros where a token chose nothing); None when not asked for.
    """

    hidden: torch.Tensor
    probs: Optional[torch.Tensor]
