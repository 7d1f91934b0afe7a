"""Reference backend on 2 and 4 gloo ranks against the single-process dense oracle.

Each launch runs many scenarios inside the rank processes (launches are the slow part on
a 2-core machine); a failing scenario raises with its name and the rank's traceback.
"""

import itertools

import pytest
import torch

import ep_plugin
from ep_plugin.testing import run_ranks
from ep_plugin.testing.dense import dense_moe, expected_dispatch, make_problem, run_local_experts

HIDDEN = 16


def _tokens_per_rank(num_ranks: int, case: int) -> list[int]:
    """Uneven token counts with a T=0 rank (rank 1) in half of the cases."""
    counts = [7 + 3 * r for r in range(num_ranks)]
    if case % 2:
        counts[1] = 0
    return counts


def _expert_weights(num_experts: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(num_experts, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(123)).to(dtype) / 4


def check_dispatch_combine_scenarios(ctx, num_experts: int) -> int:
    backend = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=num_experts, device="cpu")
    weights = _expert_weights(num_experts)
    first_expert = ctx.rank * backend.num_local_experts
    checked = 0
    for case, (topk, pad_multiple, skewed, form) in enumerate(
            itertools.product((1, 2, 8), (1, 16, 128), (False, True), ("routing_map", "topk"))):
        name = f"topk={topk} pad={pad_multiple} skewed={skewed} form={form}"
        problem = make_problem(case, _tokens_per_rank(ctx.world_size, case), HIDDEN, num_experts, topk,
                               skewed=skewed, integer_valued=True, drop_some=(case % 3 == 0))
        rank = ctx.rank
        if form == "routing_map":
            routing = dict(routing_map=problem.routing_map[rank], probs=problem.probs[rank])
        else:
            routing = dict(topk_idx=problem.topk_idx[rank], topk_weights=problem.topk_weights[rank])
        out = ep_plugin.dispatch(backend, problem.hidden[rank], pad_multiple=pad_multiple, **routing)

        rows, row_probs, tokens_per_expert = expected_dispatch(problem, rank, pad_multiple)
        assert torch.equal(out.tokens_per_expert, tokens_per_expert), f"{name}: tokens_per_expert"
        assert torch.equal(out.hidden, rows), f"{name}: dispatched rows"
        assert torch.equal(out.probs, row_probs), f"{name}: dispatched probs"

        # Identity experts: each token comes back times the number of experts it chose (exact on integers).
        restored = ep_plugin.combine(out.hidden, out.handle)
        chosen = problem.routing_map[rank].sum(dim=1, keepdim=True).to(restored.dtype)
        assert torch.equal(restored, problem.hidden[rank] * chosen), f"{name}: combine(dispatch(x))"

        # A real MoE step: per-expert linear layers, weighted by the router probs.
        def expert_fn(expert, x):
            return x @ weights[expert]

        expert_out = run_local_experts(out.hidden, out.probs, out.tokens_per_expert, first_expert, expert_fn)
        moe_out = ep_plugin.combine(expert_out, out.handle)
        dense = dense_moe(problem, expert_fn)[rank]
        torch.testing.assert_close(moe_out, dense, rtol=1e-5, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
        checked += 1
    return checked


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_dispatch_and_combine_match_dense_oracle(num_ranks):
    num_experts = 16  # top-8 needs at least 8 experts; 16 splits over 2 and 4 ranks
    checked = run_ranks(check_dispatch_combine_scenarios, num_ranks, num_experts, timeout_s=240)
    assert checked == [36] * num_ranks


def check_bf16_and_empty_world(ctx) -> None:
    """bf16 payloads; a step where no rank has any token."""
    backend = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=8, device="cpu")
    problem = make_problem(7, [5] * ctx.world_size, HIDDEN, 8, 2, dtype=torch.bfloat16, integer_valued=True)
    out = ep_plugin.dispatch(backend, problem.hidden[ctx.rank], routing_map=problem.routing_map[ctx.rank],
                             probs=problem.probs[ctx.rank])
    rows, _, _ = expected_dispatch(problem, ctx.rank, 1)
    assert out.hidden.dtype == torch.bfloat16 and torch.equal(out.hidden, rows)
    assert torch.equal(ep_plugin.combine(out.hidden, out.handle), problem.hidden[ctx.rank] * 2)

    empty = make_problem(8, [0] * ctx.world_size, HIDDEN, 8, 2)
    out = ep_plugin.dispatch(backend, empty.hidden[ctx.rank], routing_map=empty.routing_map[ctx.rank],
                             probs=empty.probs[ctx.rank], pad_multiple=16)
    assert out.hidden.shape == (0, HIDDEN) and out.tokens_per_expert.tolist() == [0] * backend.num_local_experts
    assert ep_plugin.combine(out.hidden, out.handle).shape == (0, HIDDEN)


def test_bf16_and_no_tokens_anywhere():
    run_ranks(check_bf16_and_empty_world, 2, timeout_s=120)
