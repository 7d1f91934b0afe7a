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


def host_waits_refused_in_a_capture(ctx) -> list:
    """The reference (flat, and across two one-rank domains) waits on the host in its barrier and in a cached
    dispatch across domains; inside a CUDA graph capture each is refused before anything runs (not CUDA's own
    capture error from inside the op), and the backend stays usable."""
    from ep_plugin.topology import Topology

    device = torch.device(ctx.device)
    build = dict(hidden_size=32, num_experts=4, device=device)
    hidden, idx = torch.ones(3, 32, device=device), torch.tensor([[0, 1], [2, 3], [1, 2]], device=device)
    refused = []
    for name, backend in (("flat", ep_plugin.get_backend("reference")(**build)),
                          ("2x1", ep_plugin.get_backend("reference")(**build, topology=Topology(2, 1, ctx.rank)))):
        out = backend.dispatch(hidden, topk_idx=idx)
        calls = [("barrier", backend.barrier)]
        if name == "2x1":
            calls.append(("cached dispatch", lambda: backend.dispatch(hidden, handle=out.handle)))  # noqa: B023
        for op, call in calls:
            with pytest.raises(RuntimeError, match=f"{op} inside a CUDA graph capture"):
                with torch.cuda.graph(torch.cuda.CUDAGraph()):
                    call()
            refused.append((name, op))
        backend.barrier()  # still usable, and in step with the peer
        assert torch.equal(backend.combine(out.hidden, out.handle).hidden, hidden * 2)
        backend.destroy()
    return refused


def test_host_waits_are_refused_inside_a_capture():
    results = run_ranks(host_waits_refused_in_a_capture, 2, device="cuda", timeout_s=180)
    assert results[0] == [("flat", "barrier"), ("2x1", "barrier"), ("2x1", "cached dispatch")], results
