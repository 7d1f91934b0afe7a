"""Routing input in Megatron's two forms, validated before any communication.

Form (a): ``routing_map [T, E] bool`` + ``probs [T, E]``  (Megatron's router output).
Form (b): ``topk_idx [T, k] int64`` (-1 = no expert) + ``topk_weights [T, k]``.

Either way, a token's (token, expert) pairs are ordered by expert id, which makes the
dispatch output of both forms identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

ROUTING_MAP = "routing_map"
TOPK = "topk"


@dataclass(frozen=True)
class Routing:
    """One rank's routing indices (probs travel separately so autograd can see them)."""

    form: str
    num_tokens: int
    num_experts: int
    routing_map: Optional[torch.Tensor] = None  # [T, E] bool
    topk_idx: Optional[torch.Tensor] = None  # [T, k] int64, -1 = none

    @property
    def probs_shape(self) -> tuple[int, int]:
        index = self.routing_map if self.form == ROUTING_MAP else self.topk_idx
        return tuple(index.shape)

    def pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token, expert, slot) of every selected pair, sorted by (token, expert).

        ``slot`` indexes the flattened probs tensor of this form. Reads the indices on the
        host (the reference backend syncs anyway).
        """
        if self.form == ROUTING_MAP:
            token, expert = self.routing_map.nonzero(as_tuple=True)  # row-major: sorted by (token, expert)
            return token, expert, token * self.num_experts + expert
        k = self.topk_idx.shape[1]
        # Sort each token's slots by expert id, pushing -1 ("none") to the end.
        key = torch.where(self.topk_idx < 0, torch.full_like(self.topk_idx, self.num_experts), self.topk_idx)
        sorted_key, column = key.sort(dim=1, stable=True)
        valid = sorted_key < self.num_experts
        token = torch.arange(self.num_tokens, device=key.device).unsqueeze(1).expand_as(key)[valid]
        expert = sorted_key[valid]
        slot = token * k + column[valid]
        return token, expert, slot


def make_routing(
    hidden: torch.Tensor,
    num_experts: int,
    *,
    routing_map: Optional[torch.Tensor] = None,
    probs: Optional[torch.Tensor] = None,
    topk_idx: Optional[torch.Tensor] = None,
    topk_weights: Optional[torch.Tensor] = None,
    probs_dtypes: tuple[torch.dtype, ...] = (torch.float32,),
    check_values: bool = True,
) -> tuple[Routing, Optional[torch.Tensor]]:
    """Validate one of the two routing forms against ``hidden``; return (Routing, probs-or-None).

    ``check_values`` reads expert ids on the host to range-check them before the op; backends that
    check them inside the op pass False (on the device, or on the host with the verdict carried in the
    op's first exchange, see ``Backend._refused_input``), and sync-free modes, which drop bad ids.
    """
    num_tokens = hidden.shape[0]
    if (routing_map is None) == (topk_idx is None):
        raise ValueError("dispatch needs exactly one routing form: routing_map (+ probs) or topk_idx (+ topk_weights)")
    if routing_map is not None:
        if topk_weights is not None:
            raise ValueError("topk_weights goes with topk_idx; with routing_map pass probs")
        check_tensor("routing_map", routing_map, dtypes=(torch.bool,), shape=(num_tokens, num_experts),
                     device=hidden.device)
        weights, form = probs, ROUTING_MAP
        routing = Routing(ROUTING_MAP, num_tokens, num_experts, routing_map=routing_map)
    else:
        if probs is not None:
            raise ValueError("probs goes with routing_map; with topk_idx pass topk_weights")
        check_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), ndim=2, device=hidden.device)
        k = topk_idx.shape[1]
        if topk_idx.shape[0] != num_tokens:
            raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows but hidden has {num_tokens} tokens")
        if not 1 <= k <= num_experts:
            raise ValueError(f"topk_idx has k={k} columns; expected 1 <= k <= num_experts={num_experts}")
        if check_values:
            check_topk_values(topk_idx, num_experts)
        weights, form = topk_weights, TOPK
        routing = Routing(TOPK, num_tokens, num_experts, topk_idx=topk_idx)
    if weights is not None:
        name = "probs" if form == ROUTING_MAP else "topk_weights"
        check_tensor(name, weights, dtypes=probs_dtypes, shape=routing.probs_shape, device=hidden.device)
    return routing, weights


def check_topk_values(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Expert ids must be -1 or in [0, E), and no expert twice in one token.

    One host read for both checks (each read waits for the stream: on a busy GPU shared by several
    ranks every extra one costs tens of microseconds); the details are looked up only on failure.
    """
    if topk_idx.numel() == 0:
        return
    out_of_range = (topk_idx < -1) | (topk_idx >= num_experts)
    same = topk_idx.unsqueeze(2) == topk_idx.unsqueeze(1)  # [T, j, j']
    later = torch.ones(same.shape[1:], dtype=torch.bool, device=topk_idx.device).triu(1)
    repeated = (same & later).any(2) & (topk_idx >= 0)
    bad_range, bad_repeat = torch.stack([out_of_range.any(), repeated.any()]).tolist()
    if bad_range:
        bad = int(topk_idx[out_of_range][0])
        raise ValueError(f"topk_idx holds expert id {bad}; expected -1 (none) or an id in [0, {num_experts})")
    if bad_repeat:
        token = int(repeated.any(dim=1).nonzero()[0])
        raise ValueError(f"topk_idx row {token} names the same expert twice: {topk_idx[token].tolist()}")


def dropped_ids_error(num_experts: int) -> ValueError:
    """What ``check_errors`` raises after a sync-free dispatch dropped out-of-range ids (no host read then)."""
    return ValueError(f"a non-blocking dispatch got topk_idx values outside -1 or [0, {num_experts}); those "
                      "pairs were dropped")


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    shape: Optional[tuple[int, ...]] = None,
    ndim: Optional[int] = None,
) -> None:
    """Raise TypeError/ValueError naming ``name``, the expected and the actual property."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:  # a sparse tensor has no strides (is_contiguous raises, or misleads)
        raise TypeError(f"{name} must be a dense tensor (call .to_dense()), got layout {tensor.layout}")
    if tensor.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {tensor.dtype}")
    expected_ndim = len(shape) if shape is not None else ndim
    if expected_ndim is not None and tensor.dim() != expected_ndim:
        raise ValueError(f"{name} must be a {expected_ndim}-D tensor, got {tensor.dim()}-D shape {tuple(tensor.shape)}")
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")
    if not same_device(tensor.device, device):
        raise ValueError(f"{name} must be on {device}, got a tensor on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()); got strides {tensor.stride()}")


def same_device(a: torch.device, b: torch.device) -> bool:
    if a == b:  # the common case, decided without building devices (a check on every op's hot path)
        return True
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cuda":
        current = torch.cuda.current_device()
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return True


def route_counts(routing_maps: list[torch.Tensor], num_ranks: int) -> tuple[list[list[int]], list[list[int]]]:
    """From every rank's [T, E] bool routing map (host tensors, indexed by rank): ``packets[s][d]``, the
    tokens of source s with at least one expert on rank d, and ``rows[s][d]``, its (token, expert) pairs
    on rank d. Experts are split evenly; rank r owns a contiguous block. (Byte models use these.)"""
    packets = [[0] * num_ranks for _ in routing_maps]
    rows = [[0] * num_ranks for _ in routing_maps]
    for source, routing_map in enumerate(routing_maps):
        per_rank = routing_map.view(routing_map.shape[0], num_ranks, -1)
        packets[source] = [int(v) for v in per_rank.any(dim=2).sum(dim=0)]
        rows[source] = [int(v) for v in per_rank.sum(dim=(0, 2))]
    return packets, rows
