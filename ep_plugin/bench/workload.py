"""Inputs and byte counts for one benchmark shape (the same on every backend)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_BLOCK = 128  # one fp32 scale per this many fp8 elements


@dataclass(frozen=True)
class Shape:
    tokens: int
    hidden: int
    topk: int
    experts: int
    payload: str  # "bf16" or "fp8"
    routing: str  # "balanced" or "skewed"

    def row_bytes(self) -> int:
        if self.payload == "fp8":
            return self.hidden + self.hidden // FP8_BLOCK * 4
        return 2 * self.hidden


def make_topk(shape: Shape, rank: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx [T, k] int64, topk_weights [T, k] fp32, summing to 1); skewed routing favours low expert ids
    (exp decay)."""
    generator = torch.Generator().manual_seed(seed * 1009 + rank)
    logits = torch.randn(shape.tokens, shape.experts, generator=generator)
    if shape.routing == "skewed":
        logits = logits + torch.linspace(0, -6, shape.experts)  # expert 0 ~e^6 more likely than the last
    scores = torch.softmax(logits, dim=1)
    weights, experts = scores.topk(shape.topk, dim=1)
    return experts.to(device), (weights / weights.sum(1, keepdim=True)).to(device)


def make_routing(shape: Shape, rank: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same routing as ``make_topk`` as (routing_map [T, E] bool, probs [T, E] fp32)."""
    experts, weights = make_topk(shape, rank, seed, torch.device("cpu"))
    routing_map = torch.zeros(shape.tokens, shape.experts, dtype=torch.bool).scatter_(1, experts, True)
    probs = torch.zeros(shape.tokens, shape.experts).scatter_(1, experts, weights)
    return routing_map.to(device), probs.to(device)


def make_hidden(shape: Shape, rank: int, device: torch.device, dtype: torch.dtype):
    """Random payload (never zeros: they can time faster than real data); fp8 as (data, scales)."""
    generator = torch.Generator().manual_seed(77 + rank)
    hidden = torch.randn(shape.tokens, shape.hidden, generator=generator).to(device=device, dtype=dtype)
    if shape.payload != "fp8":
        return hidden
    blocks = hidden.float().view(shape.tokens, shape.hidden // FP8_BLOCK, FP8_BLOCK)
    scales = blocks.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    data = (blocks / scales.unsqueeze(2)).view(shape.tokens, shape.hidden).to(torch.float8_e4m3fn)
    return data.contiguous(), scales.contiguous()


def traffic(routing_maps: list[torch.Tensor], num_ranks: int, shape: Shape) -> dict[str, list[int]]:
    """Per-rank byte counts from every rank's routing map (host tensors).

    recv_token_bytes: tokens a rank receives, once per (token, source) — DeepEP's algorithm bytes.
    out_bytes: the expanded, expert-sorted dispatch output a rank writes (one row per (token, expert));
        a backend with another output form reports its own (``Backend.wire_bytes``).
    remote_bytes_in: recv_token_bytes minus what a rank sends to itself (what crosses a link).
    """
    local = shape.experts // num_ranks
    recv_tokens, out_rows, self_tokens = [0] * num_ranks, [0] * num_ranks, [0] * num_ranks
    for source, routing_map in enumerate(routing_maps):
        per_rank = routing_map.view(routing_map.shape[0], num_ranks, local)
        rows = per_rank.sum(dim=2)
        tokens = (rows > 0).sum(dim=0)
        for dest in range(num_ranks):
            recv_tokens[dest] += int(tokens[dest])
            out_rows[dest] += int(rows[:, dest].sum())
        self_tokens[source] += int(tokens[source])
    row_bytes = shape.row_bytes()
    return {
        "recv_token_bytes": [t * row_bytes for t in recv_tokens],
        "out_bytes": [r * row_bytes for r in out_rows],
        "remote_bytes_in": [(t - s) * row_bytes for t, s in zip(recv_tokens, self_tokens, strict=True)],
    }
