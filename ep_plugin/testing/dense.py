"""Single-process oracle: the same MoE step computed densely over every rank's tokens.

Every rank builds the whole problem from one seed (``make_problem``), runs its own slice
through a backend, and compares against ``expected_dispatch`` / ``dense_moe`` computed
locally — no communication is needed to know the right answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass
class Problem:
    """All ranks' inputs. Lists are indexed by rank."""

    num_ranks: int
    num_experts: int
    topk: int
    hidden: list[torch.Tensor]  # [T_r, H]
    routing_map: list[torch.Tensor]  # [T_r, E] bool
    probs: list[torch.Tensor]  # [T_r, E], zero where not routed
    topk_idx: list[torch.Tensor]  # [T_r, k] int64, -1 padding where a token routes to fewer experts
    topk_weights: list[torch.Tensor]  # [T_r, k]

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks


def make_problem(
    seed: int,
    tokens_per_rank: list[int],
    hidden_size: int,
    num_experts: int,
    topk: int,
    *,
    skewed: bool = False,
    dtype: torch.dtype = torch.float32,
    probs_dtype: torch.dtype = torch.float32,
    integer_valued: bool = False,
    drop_some: bool = False,
) -> Problem:
    """Random tokens and top-k routing for every rank.

    skewed: every token picks among the first max(topk, 2) experts only, so most ranks receive nothing.
    integer_valued: hidden holds small integers, so sums of rows are exact in any float dtype.
    drop_some: some tokens route to fewer than k experts (topk_idx holds -1; routing_map rows have fewer bits).
    """
    generator = torch.Generator().manual_seed(seed)
    problem = Problem(len(tokens_per_rank), num_experts, topk, [], [], [], [], [])
    for num_tokens in tokens_per_rank:
        if integer_valued:
            hidden = torch.randint(-8, 9, (num_tokens, hidden_size), generator=generator).to(dtype)
        else:
            hidden = torch.randn(num_tokens, hidden_size, generator=generator).to(dtype)
        logits = torch.randn(num_tokens, num_experts, generator=generator)
        if skewed:
            logits[:, max(topk, 2):] = -1e9
        scores = torch.softmax(logits, dim=1)
        topk_weights, topk_idx = scores.topk(topk, dim=1)
        if drop_some and topk > 1:
            drop = torch.rand(num_tokens, generator=generator) < 0.3
            topk_idx[drop, -1] = -1
            topk_weights[drop, -1] = 0.0
        topk_weights = topk_weights.to(probs_dtype)
        routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
        probs = torch.zeros(num_tokens, num_experts, dtype=probs_dtype)
        valid = topk_idx >= 0
        rows = torch.arange(num_tokens).unsqueeze(1).expand_as(topk_idx)
        routing_map[rows[valid], topk_idx[valid]] = True
        probs[rows[valid], topk_idx[valid]] = topk_weights[valid]
        problem.hidden.append(hidden)
        problem.routing_map.append(routing_map)
        problem.probs.append(probs)
        problem.topk_idx.append(topk_idx)
        problem.topk_weights.append(topk_weights)
    return problem


def expected_dispatch(problem: Problem, rank: int, pad_multiple: int):
    """(rows [R, H], row_probs [R], tokens_per_expert [L]) that ``rank`` must receive, per the row contract."""
    local = problem.num_local_experts
    hidden_size = problem.hidden[0].shape[1]
    rows, row_probs, counts = [], [], []
    for local_expert in range(local):
        expert = rank * local + local_expert
        segment, segment_probs = [], []
        for source in range(problem.num_ranks):
            chosen = problem.routing_map[source][:, expert].nonzero().flatten()
            segment.append(problem.hidden[source][chosen])
            segment_probs.append(problem.probs[source][chosen, expert])
        segment = torch.cat(segment) if segment else torch.zeros(0, hidden_size)
        segment_probs = torch.cat(segment_probs)
        padded = -(-len(segment) // pad_multiple) * pad_multiple
        pad = padded - len(segment)
        rows.append(torch.cat([segment, segment.new_zeros(pad, hidden_size)]))
        row_probs.append(torch.cat([segment_probs, segment_probs.new_zeros(pad)]))
        counts.append(padded)
    return torch.cat(rows), torch.cat(row_probs), torch.tensor(counts, dtype=torch.int64)


def dense_moe(
    problem: Problem,
    expert_fn: Callable[[int, torch.Tensor], torch.Tensor],
    hidden: Optional[list[torch.Tensor]] = None,
    probs: Optional[list[torch.Tensor]] = None,
) -> list[torch.Tensor]:
    """Each rank's MoE output: sum over the token's experts of expert_fn(e, x) * prob.

    ``hidden``/``probs`` default to the problem's; pass leaf tensors to get dense gradients.
    """
    hidden = problem.hidden if hidden is None else hidden
    probs = problem.probs if probs is None else probs
    outputs = []
    for source in range(problem.num_ranks):
        out = torch.zeros_like(hidden[source])
        for expert in range(problem.num_experts):
            chosen = problem.routing_map[source][:, expert].nonzero().flatten()
            if len(chosen):
                contribution = expert_fn(expert, hidden[source][chosen]) * probs[source][chosen, expert, None]
                out = out.index_add(0, chosen, contribution.to(out.dtype))
        outputs.append(out)
    return outputs


def run_local_experts(rows: torch.Tensor, row_probs: torch.Tensor, tokens_per_expert: torch.Tensor,
                      first_expert: int, expert_fn: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Apply each local expert to its segment of the dispatch output and weight by the row probs."""
    segments = torch.split(rows, tokens_per_expert.tolist())
    outputs = [expert_fn(first_expert + i, segment) for i, segment in enumerate(segments)]
    out = torch.cat(outputs) if outputs else rows
    return out * row_probs.unsqueeze(1).to(out.dtype)
