"""The reference backend and the launcher on a GPU: NCCL with one rank per GPU, gloo + MPS when ranks share."""

import os

import pytest
import torch

import ep_plugin
from ep_plugin.testing import run_ranks
from ep_plugin.testing.dense import expected_dispatch, make_problem

pytestmark = pytest.mark.gpu(extension=False)  # NCCL / gloo + MPS only: no kernel of ours


def check_reference_on_cuda(ctx):
    device = torch.device(ctx.device)
    backend = ep_plugin.get_backend("reference")(hidden_size=32, num_experts=16, device=device)
    problem = make_problem(4, [40 + r for r in range(ctx.world_size)], 32, 16, 4, dtype=torch.bfloat16,
                           integer_valued=True)
    out = ep_plugin.dispatch(backend, problem.hidden[ctx.rank].to(device),
                             routing_map=problem.routing_map[ctx.rank].to(device),
                             probs=problem.probs[ctx.rank].to(device), pad_multiple=16)
    rows, row_probs, counts = expected_dispatch(problem, ctx.rank, 16)
    assert out.hidden.is_cuda and torch.equal(out.hidden.cpu(), rows)
    assert torch.equal(out.probs.cpu(), row_probs) and torch.equal(out.tokens_per_expert.cpu(), counts)
    restored = ep_plugin.combine(out.hidden, out.handle)
    assert torch.equal(restored.cpu(), problem.hidden[ctx.rank] * 4)
    return ctx.plan.process_group_backend, os.environ.get("CUDA_MPS_PIPE_DIRECTORY")


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_reference_on_cuda_and_launcher_placement(num_ranks):
    results = run_ranks(check_reference_on_cuda, num_ranks, device="cuda", timeout_s=180)
    shared = num_ranks > torch.cuda.device_count()
    for pg_backend, mps_dir in results:
        assert pg_backend == ("gloo" if shared else "nccl")
        assert (mps_dir is not None) == shared
    if shared:  # the launcher stopped its private daemon and removed its directory
        assert not os.path.exists(os.path.dirname(results[0][1]))
