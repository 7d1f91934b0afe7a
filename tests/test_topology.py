"""Topology: numbering, detection from placement, the forced size, and ranks that disagree."""

import pytest
import torch

import ep_plugin
from ep_plugin import Config, EPError
from ep_plugin.testing import run_ranks
from ep_plugin.topology import Topology, detect_topology, mappable_domain_size


def test_numbering_domains_and_rails():
    topology = Topology(8, 4, rank=6)
    assert (topology.num_domains, topology.domain_index, topology.local_index) == (2, 1, 2)
    assert topology.domain_ranks() == [4, 5, 6, 7] and topology.rail_ranks() == [2, 6]
    assert [Topology(8, 2, r).rail_ranks() for r in (0, 1)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert Topology.flat(8, 3).is_hierarchical is False and Topology(8, 1, 3).is_hierarchical
    with pytest.raises(ValueError, match="does not divide"):
        Topology(8, 3)


def _gpu(host: str, gpu: str, peers=()) -> dict:
    return {"host": host, "gpu": gpu, "peers": tuple(peers)}


def test_detected_domain_is_the_ranks_that_can_map_each_other():
    cpu = [{"host": "h", "gpu": None, "peers": ()}] * 4
    assert mappable_domain_size(cpu) == 1
    one_gpu = [_gpu("h", "g0")] * 8  # 8 ranks sharing one GPU: CUDA IPC between processes
    assert mappable_domain_size(one_gpu) == 8
    two_hosts = [_gpu("a", f"a{i}", [f"a{j}" for j in range(4) if j != i]) for i in range(4)] + \
        [_gpu("b", f"b{i}", [f"b{j}" for j in range(4) if j != i]) for i in range(4)]
    assert mappable_domain_size(two_hosts) == 4
    no_peer_access = [_gpu("h", "g0"), _gpu("h", "g0"), _gpu("h", "g1"), _gpu("h", "g1")]
    assert mappable_domain_size(no_peer_access) == 2  # 2 ranks per GPU, GPUs that cannot map each other
    # A rank that sees both GPUs next to one that sees only its own (CUDA_VISIBLE_DEVICES set per rank): the
    # second cannot open the first's memory, in either order (rank 0 first read 2, as it saw the peer).
    sees_both, sees_own = _gpu("h", "g0", ["g1"]), _gpu("h", "g1")
    assert mappable_domain_size([sees_both, sees_own]) == mappable_domain_size([sees_own, sees_both]) == 1


def test_ranks_that_each_see_one_gpu_are_found():
    """One GPU per process (Slurm's --gpus-per-task=1): domains of one rank, and detection names the ranks."""
    from ep_plugin.topology import isolated_gpus

    def isolated(host, gpu):
        return {**_gpu(host, gpu), "visible_gpus": 1}

    per_task = [isolated("a", f"a{i}") for i in range(4)] + [isolated("b", f"b{i}") for i in range(4)]
    assert mappable_domain_size(per_task) == 1
    assert isolated_gpus(per_task) == {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}
    whole_node = [{**_gpu("a", f"a{i}", [f"a{j}" for j in range(4) if j != i]), "visible_gpus": 4}
                  for i in range(4)]
    assert isolated_gpus(whole_node) == {}
    shared = [isolated("a", "a0")] * 4  # ranks sharing the one GPU they see can map each other
    assert isolated_gpus(shared) == {} and mappable_domain_size(shared) == 4
    assert isolated_gpus([{"host": "h", "gpu": None, "peers": (), "visible_gpus": 0}] * 2) == {}


def detection_and_disagreement(ctx) -> dict:
    config = Config.from_env()
    group = torch.distributed.group.WORLD
    seen = {"detected": detect_topology(group, "cpu", config=config).domain_size,
            "forced": detect_topology(group, "cpu", config=config.replace(scaleup_size=2)).describe()}
    build = dict(hidden_size=8, num_experts=8, device="cpu")
    seen["default backend"] = type(ep_plugin.get_backend("reference")(**build, config=config)).__name__
    seen["forced backend"] = type(ep_plugin.get_backend("reference")(
        **build, config=config.replace(scaleup_size=2))).__name__  # what EP_PLUGIN_SCALEUP_SIZE=2 does
    for name, size in (("disagree", 2 if ctx.rank else 4), ("not a divisor", 3)):
        try:
            detect_topology(group, "cpu", config=config, scaleup_size=size)
            seen[name] = "no error"
        except EPError as exc:
            seen[name] = str(exc)
    return seen


def test_detection_forced_size_and_disagreement_raise_on_every_rank():
    for rank, seen in enumerate(run_ranks(detection_and_disagreement, 4, timeout_s=120)):
        assert seen["detected"] == 1, seen  # CPU: nothing to map
        assert seen["forced"].startswith("2x2"), seen
        assert (seen["default backend"], seen["forced backend"]) == ("ReferenceBackend", "HierarchicalBackend"), seen
        assert "ranks disagree on the forced domain size" in seen["disagree"], (rank, seen)
        assert "rank 0: 4 (the topology= argument), rank 1: 2 (the topology= argument)" in seen["disagree"], seen
        assert "EP_PLUGIN_SCALEUP_SIZE" not in seen["disagree"], seen  # the sizes came from arguments, not the env
        assert "does not divide the 4 ranks" in seen["not a divisor"], (rank, seen)


def test_rail_engine_is_nccl_only_where_each_rail_has_its_own_gpus(monkeypatch):
    import torch.distributed as dist

    from ep_plugin.transport.scaleout import rail_engine

    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    cuda = torch.device("cuda", 0)
    # 2 GPUs, 4 ranks each, domains of 4 (one GPU's ranks): every rail has one rank per GPU.
    per_gpu = Topology(8, 4, 0, gpu_of_rank=tuple(f"g{r // 4}" for r in range(8)))
    assert rail_engine(per_gpu, cuda, "gloo") == "nccl"
    # The same ranks in domains of 2: rail 0 is ranks 0, 2, 4, 6, two of them on each GPU.
    assert rail_engine(Topology(8, 2, 0, gpu_of_rank=per_gpu.gpu_of_rank), cuda, "gloo") == "gloo"
    one_gpu = Topology(8, 4, 0, gpu_of_rank=("g0",) * 8)
    assert rail_engine(one_gpu, cuda, "gloo") == "gloo"
    assert rail_engine(per_gpu, torch.device("cpu"), "gloo") == "gloo"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert rail_engine(per_gpu, cuda, "gloo") == "gloo"
