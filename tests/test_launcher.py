"""The multi-rank launcher: placement logic, results, errors and hangs reported by rank."""

import os
import threading
import time

import pytest
import torch.distributed as dist

from ep_plugin.errors import EPError, EPTimeoutError
from ep_plugin.testing import plan_launch, run_ranks


def test_placement_cpu_one_gpu_per_rank_and_shared_gpus():
    cpu = plan_launch(4, "cpu", num_gpus=0)
    assert (cpu.process_group_backend, cpu.use_mps, cpu.gpu_of_rank) == ("gloo", False, ())
    per_gpu = plan_launch(2, "cuda", num_gpus=2)
    assert (per_gpu.process_group_backend, per_gpu.use_mps, per_gpu.gpu_of_rank) == ("nccl", False, (0, 1))
    assert per_gpu.ranks_per_gpu == 1
    shared = plan_launch(8, "cuda", num_gpus=1)
    assert (shared.process_group_backend, shared.use_mps, shared.ranks_per_gpu) == ("gloo", True, 8)
    mixed = plan_launch(4, "cuda", num_gpus=2)
    assert mixed.gpu_of_rank == (0, 1, 0, 1) and mixed.ranks_per_gpu == 2 and mixed.use_mps
    block = plan_launch(8, "cuda", num_gpus=2, placement="block")  # one NVLink domain per GPU
    assert block.gpu_of_rank == (0, 0, 0, 0, 1, 1, 1, 1) and block.use_mps
    assert plan_launch(2, "cuda", num_gpus=2, placement="block").gpu_of_rank == (0, 1)
    with pytest.raises(ValueError, match="placement"):
        plan_launch(2, "cuda", num_gpus=2, placement="diagonal")
    with pytest.raises(ValueError, match="no CUDA device"):
        plan_launch(2, "cuda", num_gpus=0)
    with pytest.raises(ValueError, match="num_ranks"):
        plan_launch(0, "cpu", num_gpus=0)


def test_cpu_ranks_beyond_the_cores_are_refused_before_any_process_starts(monkeypatch):
    from ep_plugin.testing import launcher

    monkeypatch.setattr(launcher, "CPU_RANKS_PER_CORE", 1)  # so that the plant below would start few ranks
    too_many = launcher.max_cpu_ranks() + 1
    assert "1 per core" in launcher.cpu_ranks_problem(too_many, "cpu")
    assert launcher.cpu_ranks_problem(too_many - 1, "cpu") is None
    assert launcher.cpu_ranks_problem(10**6, "cuda") is None  # GPU runs are not capped
    with pytest.raises(ValueError, match=f"num_ranks={too_many}: at most {too_many - 1} CPU ranks here"):
        run_ranks(report_rank, too_many, 0, timeout_s=60)


def report_rank(ctx, offset):
    tensor = __import__("torch").tensor([ctx.rank + offset])
    dist.all_reduce(tensor)
    return ctx.rank, int(tensor), os.environ.get("EP_PLUGIN_TIMEOUT_S")


def test_results_come_back_by_rank_with_env():
    results = run_ranks(report_rank, 3, 10, env={"EP_PLUGIN_TIMEOUT_S": "7"}, timeout_s=60)
    assert results == [(0, 33, "7"), (1, 33, "7"), (2, 33, "7")]


def fail_on_rank_one(ctx):
    if ctx.rank == 1:
        raise KeyError("boom on purpose")
    return ctx.rank


def test_exception_names_the_rank():
    with pytest.raises(EPError, match="rank 1 raised:(.|\n)*boom on purpose"):
        run_ranks(fail_on_rank_one, 2, timeout_s=60)


def hang_on_rank_zero(ctx):
    if ctx.rank == 0:
        time.sleep(600)
    return ctx.rank


def test_hang_is_reported_not_waited_for():
    start = time.monotonic()
    with pytest.raises(EPTimeoutError, match=r"rank\(s\) \[0\] did not finish"):
        run_ranks(hang_on_rank_zero, 2, timeout_s=8)
    assert time.monotonic() - start < 60


def unpicklable_result_on_rank_one(ctx):
    return threading.Lock() if ctx.rank == 1 else ctx.rank


def test_a_result_that_cannot_be_pickled_names_the_rank_at_once():
    """Before: the queue's feeder thread dropped the result without a word, the rank exited with code 0, and
    the launcher waited out its whole timeout to report the rank as one that "did not finish"."""
    start = time.monotonic()
    with pytest.raises(EPError, match=r"rank 1 raised:(.|\n)*pickle"):
        run_ranks(unpicklable_result_on_rank_one, 2, timeout_s=30)
    assert time.monotonic() - start < 20
