"""Handle lifetime: the autograd graph owns the Handle until backward no longer needs it.

The caller drops every reference to the forward outputs and the Handle right after calling
backward; the Handle must still be alive inside backward (the graph holds it), must be freed
once the graph is gone (no leak), and freed memory reused by new allocations must not leak
into the gradients.
"""

import gc
import weakref

import torch

import ep_plugin
from ep_plugin.testing import run_ranks
from ep_plugin.testing.dense import dense_moe, make_problem, run_local_experts

HIDDEN, EXPERTS = 8, 8


def check_handle_lifetime(ctx) -> None:
    backend = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=EXPERTS, device="cpu")
    local, rank = backend.num_local_experts, ctx.rank
    weights = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(2))
    for step in range(5):
        problem = make_problem(step, [9] * ctx.world_size, HIDDEN, EXPERTS, 2)
        hidden = problem.hidden[rank].clone().requires_grad_()
        probs = problem.probs[rank].clone().requires_grad_()
        out = ep_plugin.dispatch(backend, hidden, routing_map=problem.routing_map[rank], probs=probs)
        expert_out = run_local_experts(out.hidden, out.probs, out.tokens_per_expert, rank * local,
                                       lambda e, x: x @ weights[e])
        loss = ep_plugin.combine(expert_out, out.handle).square().sum()
        handle_alive = weakref.ref(out.handle)
        layout_alive = weakref.ref(out.handle.layout.recv_row)
        del out, expert_out  # the caller keeps nothing but the loss
        gc.collect()
        assert handle_alive() is not None, "the autograd graph must own the Handle until backward"
        # Memory the caller let go of is reused with garbage before the backward reads what the graph kept.
        churn = [torch.full((9, HIDDEN), 1e30) for _ in range(16)]

        loss.backward()
        del loss  # graph gone: nothing may keep the Handle or its index tensors alive
        gc.collect()
        assert handle_alive() is None, "Handle leaked after backward"
        assert layout_alive() is None, "layout tensors leaked after backward"

        # The gradients, against dense autograd.
        dense_hidden = [h.clone().requires_grad_() for h in problem.hidden]
        dense_probs = [p.clone().requires_grad_() for p in problem.probs]
        outputs = dense_moe(problem, lambda e, x: x @ weights[e], dense_hidden, dense_probs)
        sum(o.square().sum() for o in outputs).backward()
        torch.testing.assert_close(hidden.grad, dense_hidden[rank].grad)
        torch.testing.assert_close(probs.grad, dense_probs[rank].grad)
        del churn


def test_handle_owned_by_graph_and_released_after_backward():
    run_ranks(check_handle_lifetime, 2, timeout_s=120)
