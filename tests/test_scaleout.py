"""Scale-out on CPU: backends across forced NVLink domains (gloo rails), 8 ranks.

Each launch runs every case inside the rank processes (launches are the slow part on a 2-core
machine). The oracle is the same backend flat on the same group, in the same process: the
hierarchical path must give the same rows in the same order, bitwise, and the same sums (exact here:
integer-valued payloads), the same probs, counts and gradients. ``reference`` covers the expert-row
form; ``CompactBackend`` (below, test-only) stands in for elastic's compact form. Also: the barrier
with a late rank (and a parallel-order control), a missing rank, ranks that disagree on an op (2 and 4
ranks: every rank raises EPError), and the reorder and byte packing alone.
"""

import dataclasses
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.backends.base import Backend, Capabilities
from ep_plugin.backends.hierarchical import HierarchicalBackend
from ep_plugin.backends.reference import ReferenceBackend
from ep_plugin.config import Config
from ep_plugin.errors import EPError
from ep_plugin.handle import COMPACT, CombineOutput, DispatchOutput, Handle
from ep_plugin.host_collectives import _grace_s
from ep_plugin.testing import run_ranks
from ep_plugin.testing.dense import make_problem, run_local_experts
from ep_plugin.topology import Topology
from ep_plugin.transport import scaleout

HIDDEN = 16
NUM_RANKS = 8
NUM_EXPERTS = 32  # 4 per rank
LAYOUTS = (8, 4, 2, 1)  # ranks per domain: 1x8, 2x4, 4x2, 8x1


def _reference(config=None, topology=None):
    return ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=NUM_EXPERTS, device="cpu",
                                              config=config, topology=topology)


def _tokens(case: int) -> list[int]:
    """Unequal counts (rank r sends 9 + 2r); one rank with none in odd cases."""
    counts = [9 + 2 * r for r in range(NUM_RANKS)]
    if case % 2:
        counts[5] = 0
    return counts


def _routing(problem, rank: int, form: str) -> dict:
    if form == "routing_map":
        return {"routing_map": problem.routing_map[rank], "probs": problem.probs[rank]}
    return {"topk_idx": problem.topk_idx[rank], "topk_weights": problem.topk_weights[rank]}


def _step(backend, problem, rank: int, form: str, pad_multiple: int):
    """Dispatch, an MoE step (integer expert scales), combine and backward; every tensor a test compares."""
    hidden = problem.hidden[rank].clone().requires_grad_()
    routing = _routing(problem, rank, form)
    weights_name = "probs" if form == "routing_map" else "topk_weights"
    weights = routing[weights_name].clone().requires_grad_()
    routing[weights_name] = weights
    out = ep_plugin.dispatch(backend, hidden, pad_multiple=pad_multiple, **routing)
    first_expert = rank * backend.num_local_experts
    rows = out.hidden
    identity = ep_plugin.combine(rows, out.handle)  # each token times its expert count: exact
    expert_out = run_local_experts(rows, out.probs, out.tokens_per_expert, first_expert,
                                   lambda e, x: x * float(e % 3 + 1))
    moe = ep_plugin.combine(expert_out, out.handle)
    (moe * torch.arange(HIDDEN, dtype=moe.dtype)).sum().backward()
    return {"rows": out.hidden.detach(), "probs": out.probs.detach(), "tokens_per_expert": out.tokens_per_expert,
            "identity": identity.detach(), "moe": moe.detach(), "grad_hidden": hidden.grad,
            "grad_weights": weights.grad}


def check_hierarchical_equals_flat(ctx) -> list[str]:
    torch.set_num_threads(1)  # 8 ranks on few cores
    flat = _reference()
    blocking = ep_plugin.Config.from_env()
    # (ranks per domain, mode): 1x8 is one domain, so the constructor returns the flat backend.
    variants = {"blocking": blocking, "sync-free": blocking.replace(blocking=False),
                "chunked": blocking.replace(scaleout_chunk_tokens=3, combine_input_rows=64), "staged": blocking,
                "staged sync-free": blocking.replace(blocking=False)}
    plan = [(size, "blocking") for size in LAYOUTS] + [(size, "sync-free") for size in (4, 2, 1)] + [(2, "chunked")] \
        + [(2, "staged"), (4, "staged sync-free")]
    backends = {(size, variant): _reference(variants[variant], Topology(NUM_RANKS, size, ctx.rank))
                for size, variant in plan}
    for (_, variant), backend in backends.items():
        if variant.startswith("staged"):  # CPU rows on the path of CUDA rows over a gloo rail (own block kept)
            backend.scaleout.stage_on_host = True
    rail_rows = _count_rail_rows(backends[(2, "chunked")])
    for (size, _), backend in backends.items():
        expected_class = HierarchicalBackend if size < NUM_RANKS else type(flat)
        assert type(backend) is expected_class, (size, type(backend))
        if expected_class is HierarchicalBackend:  # the domain's combine input is the reorder's: no arena there
            assert backend.domain.config.combine_input_rows == 0, (size, backend.domain.config)
    # (form, pad_multiple, skewed): unequal token counts in both, one rank without tokens in the second.
    cases = [("routing_map", 1, False), ("topk", 16, True), ("topk", 1, False), ("routing_map", 4, True)]
    checked = []
    for case, (form, pad_multiple, skewed) in enumerate(cases):
        problem = make_problem(40 + case, _tokens(case), HIDDEN, NUM_EXPERTS, 4, skewed=skewed, integer_valued=True,
                               drop_some=True)
        want = _step(flat, problem, ctx.rank, form, pad_multiple)
        for (size, variant), backend in backends.items():
            name = f"{NUM_RANKS // size}x{size} {variant} {form} pad={pad_multiple} skewed={skewed}"
            got = _step(backend, problem, ctx.rank, form, pad_multiple)
            for key, value in want.items():
                assert got[key].dtype == value.dtype and got[key].shape == value.shape, f"{name}: {key} shape"
                if key in ("moe", "grad_weights", "grad_hidden"):  # sums of products: order may differ
                    torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6,
                                               msg=lambda m, name=name, key=key: f"{name}: {key}: {m}")
                else:
                    assert torch.equal(got[key], value), f"{name}: {key} differs from the flat reference"
            checked.append(name)
    # The chunked variant moved its rows in rounds of at most 3 per peer, and needed more than one round.
    assert rail_rows and max(max(rows) for rows, _ in rail_rows) <= 3, rail_rows
    assert any("(chunk 2)" in where for _, where in rail_rows), rail_rows
    return checked


def _count_rail_rows(backend) -> list:
    """Records (rows sent to each rail peer, where) for each of ``backend``'s rail collectives of rows."""
    calls = []
    all_to_all = backend.scaleout.rail.all_to_all

    def counting(tensor, out_splits, in_splits, *, where, read_on_host, **kwargs):
        if not read_on_host:  # rows, not count words
            calls.append((list(in_splits), where))
        return all_to_all(tensor, out_splits, in_splits, where=where, read_on_host=read_on_host, **kwargs)

    backend.scaleout.rail.all_to_all = counting
    return calls


def test_hierarchical_reference_equals_flat_at_every_layout():
    results = run_ranks(check_hierarchical_equals_flat, NUM_RANKS, timeout_s=300)
    assert all(len(checked) == len(results[0]) > 0 for checked in results), results


def first_used_in_inference_mode(ctx) -> list[str]:
    """2 x 2 domains, built and first used under torch.inference_mode() (a Megatron evaluation or generation
    pass that comes first builds the backend there), then a training step outside it, against flat."""
    torch.set_num_threads(1)
    flat = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=16, device="cpu")
    problem = make_problem(7, [9, 0, 13, 11], HIDDEN, 16, 4, skewed=True, integer_valued=True, drop_some=True)
    checked = []
    for staged in (False, True):
        with torch.inference_mode():
            backend = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=16, device="cpu",
                                                         topology=Topology(4, 2, ctx.rank))
            backend.scaleout.stage_on_host = staged  # CPU rows on the path of CUDA rows over a gloo rail
            _step_without_grad(backend, problem, ctx.rank)
        want, got = _step(flat, problem, ctx.rank, "topk", 4), _step(backend, problem, ctx.rank, "topk", 4)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6)
        checked.append(f"staged={staged}")
        backend.destroy()
    return checked


def _step_without_grad(backend, problem, rank: int) -> None:
    out = ep_plugin.dispatch(backend, problem.hidden[rank], pad_multiple=4, **_routing(problem, rank, "topk"))
    ep_plugin.combine(out.hidden, out.handle)


def test_a_backend_first_used_in_inference_mode_trains_outside_it():
    """The rail's kept host buffers were made on the first op, inference tensors under inference mode: every
    later op outside it failed writing into them ("Inplace update to inference tensor"), and the backend was
    out of step for good."""
    results = run_ranks(first_used_in_inference_mode, 4, timeout_s=120)
    assert all(checked == ["staged=False", "staged=True"] for checked in results), results


def domains_in_an_ep_subgroup(ctx) -> bool:
    """World 4 as two EP groups of 2 (Megatron's EP group is a subgroup of the world); each builds the
    reference forced into 2 domains of 1 and dispatches as the flat one does."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both, as Megatron does
    group = groups[ctx.rank // 2]
    local_rank = dist.get_rank(group)
    flat = ep_plugin.get_backend("reference")(group, hidden_size=4, num_experts=4, device="cpu")
    split = ep_plugin.get_backend("reference")(group, hidden_size=4, num_experts=4, device="cpu",
                                               topology=Topology(2, 1, local_rank))
    x = torch.arange(12, dtype=torch.float32).view(3, 4) + 100 * ctx.rank
    idx = torch.tensor([[0, 3], [1, 2], [2, -1]])
    return isinstance(split, HierarchicalBackend) and torch.equal(flat.dispatch(x, topk_idx=idx).hidden,
                                                                  split.dispatch(x, topk_idx=idx).hidden)


def test_forced_domains_in_an_ep_subgroup_of_the_world():
    """The domain and rail groups are made by the EP group's ranks alone (torch's new_group would
    otherwise wait for every rank of the world, which here builds the other EP group: a hang)."""
    assert run_ranks(domains_in_an_ep_subgroup, 4, timeout_s=120) == [True] * 4


def group_timeouts(ctx) -> dict:
    """The domain and rail groups' engine timeouts, on EP groups made with a long and a short timeout."""
    def timeouts(group_timeout: timedelta, timeout_s: float) -> tuple:
        group = dist.new_group([0, 1], timeout=group_timeout)
        backend = ep_plugin.get_backend("reference")(group, hidden_size=4, num_experts=4, device="cpu",
                                                     config=Config.from_env(timeout_s=timeout_s),
                                                     topology=Topology(2, 1, ctx.rank))
        made = [backend.scaleout.domain_group, backend.scaleout.rail_group]
        found = tuple(g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in made)
        backend.destroy()
        return found

    return {"megatron's hour": timeouts(timedelta(hours=1), 5.0), "a long EP_PLUGIN_TIMEOUT_S": timeouts(
        timedelta(minutes=1), 5000.0)}


def test_domain_and_rail_groups_wait_as_long_as_the_ep_group_and_the_plugin_timeout():
    """torch's default (30 min gloo, 10 min NCCL) ignored the EP group's timeout (Megatron's
    --distributed-timeout-minutes) and a longer EP_PLUGIN_TIMEOUT_S: the engine gave up first."""
    for found in run_ranks(group_timeouts, 2, timeout_s=120):
        assert found["megatron's hour"] == (3600.0, 3600.0), found
        assert all(5000.0 < seconds < 5100.0 for seconds in found["a long EP_PLUGIN_TIMEOUT_S"]), found


def late_into_new_group(ctx) -> list:
    """Rank 1 passes the timed group-name exchange, then comes 3.5 s late into torch's new_group (as a rank
    stuck, or gone, there would): what rank 0 logs while it waits in new_group's own barrier."""
    import logging
    import time

    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("ep_plugin.transport.scaleout").addHandler(Collect())
    if ctx.rank == 1:
        new_group = dist.new_group

        def late_new_group(*args, **kwargs):
            time.sleep(3.5)
            dist.new_group = new_group
            return new_group(*args, **kwargs)

        dist.new_group = late_new_group
    backend = ep_plugin.get_backend("reference")(hidden_size=4, num_experts=4, device="cpu",
                                                 topology=Topology(2, 1, ctx.rank),
                                                 config=Config.from_env(timeout_s=2.0))
    backend.destroy()
    return messages


def test_a_rank_late_into_torchs_new_group_is_said_after_the_timeout():
    # new_group waits in a store barrier with the groups' own timeout (30 min by default), which is also their
    # collectives' and is not shortened: a rank that stopped there left its peers waiting without a word.
    messages = run_ranks(late_into_new_group, 2, timeout_s=120)[0]
    assert any("rank 0 has waited 2 s (EP_PLUGIN_TIMEOUT_S) in torch's new_group" in m for m in messages), messages


class _ReferenceWithGrid(ReferenceBackend):
    """``reference`` that, like the compiled backends, makes its domain agree on ``num_sms`` when built: a
    setting only the domain backend checks (over its own domain)."""

    def _construction_facts(self) -> dict:
        return {**super()._construction_facts(), "num_sms": self.config.num_sms}


def build_with_one_domain_refusing(ctx) -> tuple:
    """2 x 2 forced domains; rank 1 alone has another num_sms, so domain 0's build is refused."""
    config = Config.from_env(num_sms=8 if ctx.rank == 1 else 16, timeout_s=30.0)
    try:
        backend = _ReferenceWithGrid(hidden_size=4, num_experts=4, device="cpu", config=config,
                                     topology=Topology(4, 2, ctx.rank))
    except (ValueError, EPError) as error:
        # The group is still usable: a flat backend on it runs an op.
        flat = ep_plugin.get_backend("reference")(hidden_size=4, num_experts=4, device="cpu")
        flat.barrier()
        return type(error).__name__, str(error)
    backend.destroy()
    return "built", ""


def test_a_domain_that_refuses_its_build_makes_every_rank_raise():
    """Before: domain 1 built its backend and would have waited for domain 0 at its first op."""
    results = run_ranks(build_with_one_domain_refusing, 4, timeout_s=120)
    for rank, (kind, message) in enumerate(results):
        assert kind == "ValueError", (rank, kind, message)
        if rank < 2:  # the domain's own agreement check names the setting
            assert "num_sms (rank 0: 16, rank 1: 8)" in message, (rank, message)
        else:
            assert "could not be built on rank(s) [0, 1]" in message and "num_sms" in message, (rank, message)


class _ReferenceOutOfMemoryOnRank0(ReferenceBackend):
    """``reference`` whose build fails on rank 0 alone, before its domain's agreement check (a CUDA
    allocation that ran out of memory there, say)."""

    built: list = []  # this process's domain backends that did build

    def __init__(self, *args, **kwargs):
        if dist.get_rank() == 0:
            raise MemoryError("out of memory (injected on rank 0)")
        super().__init__(*args, **kwargs)
        _ReferenceOutOfMemoryOnRank0.built.append(self)


def build_with_one_rank_out_of_memory(ctx) -> tuple:
    """2 x 2 forced domains; rank 0's domain backend fails to build. Every rank stays until the others are
    done (leaving would close connections they wait on)."""
    start = time.monotonic()
    try:
        _ReferenceOutOfMemoryOnRank0(hidden_size=4, num_experts=4, device="cpu", config=Config.from_env(timeout_s=2.0),
                                     topology=Topology(4, 2, ctx.rank)).destroy()
        outcome = "built", ""
    except Exception as error:  # noqa: BLE001 - the test compares the type and text
        outcome = type(error).__name__, str(error)
    time.sleep(max(0.0, 12.0 - (time.monotonic() - start)))
    return (*outcome, [domain.destroyed for domain in _ReferenceOutOfMemoryOnRank0.built])


def test_a_rank_whose_domain_build_failed_alone_raises_its_own_error():
    """Before: its domain peer held it up past the group's wait, and every rank raised a timeout there; the
    MemoryError itself reached no one."""
    results = run_ranks(build_with_one_rank_out_of_memory, 4, timeout_s=120)
    assert results[0] == ("MemoryError", "out of memory (injected on rank 0)", []), results[0]
    # Domain 1 built its backend, then timed out waiting for domain 0: it destroyed what it built (before, a
    # compiled domain backend's buffer stayed allocated to the process's exit).
    assert results[2][2] == results[3][2] == [True], results
    # The trail leads there: rank 1 waited for rank 0 in its domain's check, ranks 2 and 3 for rank 1.
    kind, message, _ = results[1]
    assert kind == "EPTimeoutError" and "agreement check" in message, (kind, message)
    assert "rank 0 did not come because it waits elsewhere itself, in building the domain backends" in message, message
    for rank in (2, 3):
        kind, message, _ = results[rank]
        assert kind == "EPTimeoutError" and "in building the domain backends" in message, (rank, kind, message)
        assert "rank 1 did not come because it waits elsewhere itself, in building the reference backend " \
               "(agreement check)" in message, (rank, message)


def build_with_forward_sms_on_one_rank(ctx) -> str:
    config = Config.from_env(forward_sms=8 if ctx.rank == 1 else 0, timeout_s=30.0)
    try:
        _ReferenceWithGrid(hidden_size=4, num_experts=4, device="cpu", config=config,
                           topology=Topology(4, 2, ctx.rank)).destroy()
    except ValueError as error:
        return str(error)
    return "built"


def test_forward_sms_on_one_rank_is_named_as_forward_sms():
    """EP_PLUGIN_FORWARD_SMS becomes the domain backend's num_sms: a rank that set it alone was reported as
    disagreeing on num_sms, a knob the user never set."""
    for rank, message in enumerate(run_ranks(build_with_forward_sms_on_one_rank, 4, timeout_s=120)):
        assert "forward_sms (rank 0: 0, rank 1: 8, rank 2: 0, rank 3: 0)" in message, (rank, message)


def across_restarted_worlds(ctx, store_path: str) -> tuple[list, list]:
    """Forced domains, then ``destroy_process_group`` and a new world in the same process (an in-process
    restart), then forced domains again, twice: the second backend must make new domain and rail groups, not
    take the destroyed ones (whose names the new world's groups reuse); the third, on a subgroup (another
    name), leaves only its own groups cached, not the destroyed worlds' ones."""
    sums, cached = [], []
    for world in range(3):
        if world:
            dist.destroy_process_group()
            dist.init_process_group("gloo", init_method=f"file://{store_path}_{world}", rank=ctx.rank,
                                    world_size=ctx.world_size)
        group = dist.new_group([0, 1]) if world == 2 else None
        backend = ep_plugin.get_backend("reference")(group, hidden_size=4, num_experts=4, device="cpu",
                                                     topology=Topology(2, 1, ctx.rank))
        x = torch.full((3, 4), float(ctx.rank + 1 + 10 * world))
        out = backend.dispatch(x, topk_idx=torch.tensor([[0, 3], [1, 2], [2, -1]]))
        sums.append(backend.combine(out.hidden, out.handle).hidden.sum(1).tolist())
        cached.append(len(scaleout._groups))
        backend.destroy()
    return sums, cached


def test_forced_domains_after_the_world_was_destroyed_and_started_again(tmp_path):
    """Before: ValueError 'Group ... is not registered' from the cached groups of the first world; and the
    groups of every destroyed world stayed cached."""
    for rank, (sums, cached) in enumerate(run_ranks(across_restarted_worlds, 2, str(tmp_path / "world"),
                                                    timeout_s=120)):
        assert sums == [[4 * (rank + 1 + 10 * world) * k for k in (2, 2, 1)] for world in range(3)], sums
        assert cached == [1, 1, 1], cached


def refusal_and_disagreement_in_one_dispatch(ctx, variant: str) -> dict:
    """Rank 0 refuses its input (an id out of range, or too many tokens) while rank 1 disagrees on the op (an
    fp64 payload, or fp64 weights: another rail row width), flat and across domains; then a valid dispatch."""
    torch.set_num_threads(1)
    config = ep_plugin.Config.from_env().replace(max_tokens_per_rank=4)
    raised = {}
    for name, domain_size in (("flat", None), ("2x2", 2), ("4x1", 1)):
        backend = ep_plugin.get_backend("reference")(
            hidden_size=4, num_experts=8, device="cpu", config=config,
            topology=None if domain_size is None else Topology(4, domain_size, ctx.rank))
        tokens = 5 if ctx.rank == 0 and variant == "tokens" else 3
        x = torch.ones(tokens, 4, dtype=torch.float64 if ctx.rank == 1 and variant != "weights" else torch.float32)
        idx = torch.tensor([[0, 5], [1, 2], [7, -1], [3, 4], [6, 0]])[:tokens].clone()
        weights = torch.full((tokens, 2), 0.5, dtype=torch.float64 if ctx.rank == 1 and variant == "weights"
                             else torch.float32)
        if ctx.rank == 0 and variant != "tokens":
            idx[0, 0] = 99
        try:
            backend.dispatch(x, topk_idx=idx, topk_weights=weights)
            raised[name] = "nothing"
        except (ValueError, EPError) as error:
            raised[name] = type(error).__name__
        backend.dispatch(torch.ones(3, 4), topk_idx=idx[:3].clamp(0, 7))  # the backend stays usable
        backend.destroy()
    return raised


@pytest.mark.parametrize("variant", ["ids", "tokens", "weights"])
def test_ranks_that_disagree_while_another_refuses_raise_eperror_everywhere_as_flat(variant):
    """Across domains the ranks whose rail saw the refusal raised ValueError and the others EPError (a
    domain stage that raised its own rail's refusal before looking at the other rails' disagreement), and
    over one rail a row width difference was not compared once a rank refused."""
    results = run_ranks(refusal_and_disagreement_in_one_dispatch, 4, variant, timeout_s=120)
    assert all(raised == {"flat": "EPError", "2x2": "EPError", "4x1": "EPError"} for raised in results), results


def bad_topk_across_domains(ctx) -> list:
    """Rank 0 passes top-k ids that are no tensor, then every rank dispatches validly."""
    backend = ep_plugin.get_backend("reference")(hidden_size=4, num_experts=4, device="cpu",
                                                 topology=Topology(2, 1, ctx.rank))
    x, idx = torch.ones(2, 4), torch.tensor([[0, 1], [2, 3]])
    raised = []
    if ctx.rank == 0:
        for bad in ([[0, 1], [2, 3]], torch.tensor([0, 1])):
            try:
                backend.dispatch(x, topk_idx=bad)
            except (TypeError, ValueError) as error:
                raised.append(f"{type(error).__name__}: {error}")
    return raised + [tuple(backend.dispatch(x, topk_idx=idx).hidden.shape)]


def test_bad_topk_ids_across_domains_raise_as_flat():
    rank0, rank1 = run_ranks(bad_topk_across_domains, 2, timeout_s=120)
    assert rank0[0].startswith("TypeError: topk_idx must be a torch.Tensor"), rank0
    assert rank0[1].startswith("ValueError: topk_idx must be a 2-D tensor"), rank0
    assert rank0[2:] == rank1 == [rank1[0]] and len(rank1[0]) == 2  # the backend went on


def topk_wider_than_a_domain(ctx) -> dict:
    """Across two domains of one rank (2 experts each): a top-k of 3 on rank 0 only, then on every rank, then a
    valid dispatch."""
    config = ep_plugin.Config.from_env(timeout_s=20.0)
    backend = ep_plugin.get_backend("reference")(hidden_size=4, num_experts=4, device="cpu", config=config,
                                                 topology=Topology(2, 1, ctx.rank))
    x, idx = torch.ones(2, 4), torch.tensor([[0, 1, 2], [1, 2, 3]])
    raised = {}
    for case, k in (("rank 0 only", 3 if ctx.rank == 0 else 2), ("every rank", 3)):
        start = time.monotonic()
        try:
            backend.dispatch(x, topk_idx=idx[:, :k].contiguous())
            raised[case] = "nothing"
        except (ValueError, EPError) as error:
            raised[case] = f"{type(error).__name__}: {error}"
        raised[case + " seconds"] = time.monotonic() - start
    raised["after"] = tuple(backend.dispatch(x, topk_idx=idx[:, :2].contiguous()).hidden.shape)
    backend.destroy()
    return raised


def test_a_topk_wider_than_a_domain_is_refused_on_every_rank():
    """k must fit the experts of one domain. It was checked before the op's agreement: a rank that passed a
    wider k raised ValueError alone and its peers waited out the timeout (20 s here). Now the agreement carries
    it: where k differs, every rank raises the disagreement (as flat); where every rank passed it, every rank
    raises why; the backend goes on."""
    for rank, raised in enumerate(run_ranks(topk_wider_than_a_domain, 2, timeout_s=120)):
        assert raised["rank 0 only"].startswith("EPError") and "topk: " in raised["rank 0 only"], (rank, raised)
        assert raised["rank 0 only seconds"] < 10, (rank, raised)
        assert raised["every rank"].startswith("ValueError") and "more than the 2 experts of one NVLink domain" \
            in raised["every rank"], (rank, raised)
        assert raised["after"] == ((6, 4), (2, 4))[rank], (rank, raised)  # ids 0, 1 | 1, 2 from both ranks


def cached_dispatch_arguments_across_domains(ctx) -> list:
    """A cached dispatch across domains takes the form options its domain backend's cached dispatch takes
    (the reference's: none) and no routing arguments; both refused before the rails, every rank alike."""
    backend = ep_plugin.get_backend("reference")(hidden_size=4, num_experts=4, device="cpu",
                                                 topology=Topology(2, 1, ctx.rank))
    x, idx = torch.arange(8.0).view(2, 4) + ctx.rank, torch.tensor([[0, 1], [2, 3]])
    out = backend.dispatch(x, topk_idx=idx)
    raised = []
    for extra in (dict(topk_idx=idx), dict(expand=True)):
        try:
            backend.dispatch(x * 2, handle=out.handle, **extra)
        except (TypeError, ValueError) as error:
            raised.append(f"{type(error).__name__}: {error}")
    assert torch.equal(backend.dispatch(x * 2, handle=out.handle).hidden, out.hidden * 2)  # and it goes on
    return raised


def test_a_cached_dispatch_across_domains_refuses_what_its_domain_backend_would():
    for raised in run_ranks(cached_dispatch_arguments_across_domains, 2, timeout_s=120):
        assert raised == ["ValueError: a cached dispatch (handle=...) takes no routing arguments: the handle has them",
                          "TypeError: backend 'reference' has no cached dispatch option(s) ['expand']; it takes "
                          "none"], raised


def cached_dispatch_on_one_domain_and_across(ctx) -> dict:
    """The same code on one domain and across two: ``expert_alignment=`` is ``pad_multiple``, and a cached dispatch
    (plain and through ``ep_plugin.dispatch``, whose backward is a combine) gives the rows of a routed dispatch of
    the new tokens. Before, the flat reference refused both arguments (TypeError) that the layered one took."""
    problem = make_problem(61, [3, 0, 4, 2], HIDDEN, NUM_EXPERTS, 3, integer_valued=True)
    x, idx, w = problem.hidden[ctx.rank], problem.topk_idx[ctx.rank], problem.topk_weights[ctx.rank]
    fresh = x * 3 + 1
    upstream = torch.arange(HIDDEN, dtype=torch.float32)
    results = {}
    for name, topology in (("flat", None), ("2x2", Topology(4, 2, ctx.rank))):
        backend = _reference(topology=topology)
        out = backend.dispatch(x, topk_idx=idx, topk_weights=w, expert_alignment=4)
        padded = backend.dispatch(x, topk_idx=idx, topk_weights=w, pad_multiple=4)
        routed = backend.dispatch(fresh, topk_idx=idx, pad_multiple=4)
        cached = backend.dispatch(fresh, handle=out.handle)
        restated = backend.dispatch(fresh, handle=out.handle, expert_alignment=4)  # as DeepEP V2 code may pass it
        try:
            backend.dispatch(fresh, handle=out.handle, pad_multiple=8)
            changed = "taken"
        except ValueError as error:
            changed = str(error)
        leaf = fresh.clone().requires_grad_(True)
        through_autograd = ep_plugin.dispatch(backend, leaf, handle=out.handle)
        (through_autograd.hidden * upstream).sum().backward()
        want_grad = backend.combine(upstream.expand(out.hidden.shape[0], -1).contiguous(), out.handle).hidden
        results[name] = dict(
            alignment=torch.equal(out.hidden, padded.hidden) and torch.equal(out.probs, padded.probs),
            rows=torch.equal(cached.hidden, routed.hidden) and cached.probs is None,
            counts=torch.equal(cached.tokens_per_expert, routed.tokens_per_expert),
            restated=torch.equal(restated.hidden, routed.hidden),
            changed=changed.startswith("a cached dispatch pads as its handle's dispatch did (pad_multiple / "
                                       "expert_alignment 4); got 8"),
            autograd=torch.equal(through_autograd.hidden.detach(), routed.hidden),
            grad=torch.equal(leaf.grad, want_grad), hidden=cached.hidden)
        backend.destroy()
    return results


def test_a_cached_dispatch_and_expert_alignment_work_alike_on_one_domain_and_across_domains():
    for rank, results in enumerate(run_ranks(cached_dispatch_on_one_domain_and_across, 4, timeout_s=120)):
        rows = {name: checks.pop("hidden") for name, checks in results.items()}
        for name, checks in results.items():
            assert all(checks.values()), (rank, name, checks)
        assert torch.equal(rows["flat"], rows["2x2"]), rank  # the layered backend's rows are the flat one's


def combine_input_across_domains(ctx) -> dict:
    """Code written for hybrid's combine input, run on the reference flat and across domains: combine_input says
    why it cannot be, the arena context routes nothing, and a round trip through it is the two-stage one."""
    results = {}
    for name, topology in (("flat", None), ("2x1", Topology(2, 1, ctx.rank))):
        backend = ep_plugin.get_backend("reference")(hidden_size=4, num_experts=4, device="cpu", topology=topology)
        x, idx = torch.arange(8.0).view(2, 4) + ctx.rank, torch.tensor([[0, 1], [2, 3]])
        out = backend.dispatch(x, topk_idx=idx)
        try:
            backend.combine_input(out.handle)
            refused = None
        except ValueError as error:
            refused = str(error)
        with backend.combine_input_arena() as usable:
            rows = out.hidden * 1.0  # the expert's output, allocated inside the context
        back = backend.combine(rows, out.handle).hidden
        results[name] = {"refused": refused, "usable": usable, "round_trip": torch.equal(back, x * 2)}
    return results


def test_combine_input_on_a_backend_without_an_arena_is_refused_with_a_reason_and_the_arena_routes_nothing():
    # Before: a HierarchicalBackend, and the flat reference until the 25th session, had neither method
    # (AttributeError); the first also dropped combine_input_rows unsaid.
    for result in run_ranks(combine_input_across_domains, 2, timeout_s=120):
        assert result["2x1"]["refused"].startswith("combine_input: across NVLink domains (2 domains of 1 ranks)"), \
            result
        assert result["flat"]["refused"].startswith("combine_input: backend 'reference' has no combine-input arena"), \
            result
        for checks in result.values():
            assert "combine a tensor of your own" in checks["refused"], result
            assert (checks["usable"], checks["round_trip"]) == (False, True), result


def failure_between_two_exchanges_across_domains(ctx, blocking: bool) -> dict:
    """Rank 1's dispatch fails packing its rail rows, after the agreement: its retry must refuse, and rank 0
    time out in the rail exchange it waits in (not meet rank 1's retry there)."""
    from test_reference import fail_midway_then_retry

    backend = ep_plugin.get_backend("reference")(hidden_size=4, num_experts=4, device="cpu",
                                                 topology=Topology(2, 1, ctx.rank),
                                                 config=Config.from_env(timeout_s=3.0, blocking=blocking))
    return fail_midway_then_retry(ctx, backend, "_pack_for_rail", "the rail rows' allocation failed",
                                  f"across domains, blocking={blocking}")


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "sync_free_mode"])
def test_a_rank_that_failed_between_two_exchanges_across_domains_refuses_and_its_peer_times_out(blocking):
    rank0, rank1 = run_ranks(failure_between_two_exchanges_across_domains, 2, blocking, timeout_s=120)
    assert rank1["outcome"].startswith("EPError: ") and rank1["seconds"] < 1.0, rank1
    assert "dispatch #2 was left midway on this rank by MemoryError: the rail rows' allocation failed" in \
        rank1["outcome"], rank1
    assert rank0["outcome"].startswith("EPTimeoutError: ") and "dispatch #2: rail/tokens" in rank0["outcome"], rank0


def failure_before_the_domain_stage(ctx, blocking: bool) -> dict:
    """Rank 1's dispatch fails counting the rows its rail delivered, after the rail exchange and before the
    domain's (2 domains of 2: rank 1's domain peer, rank 0, waits for it there)."""
    from test_reference import fail_midway_then_retry

    backend = ep_plugin.get_backend("reference")(hidden_size=4, num_experts=4, device="cpu",
                                                 topology=Topology(4, 2, ctx.rank),
                                                 config=Config.from_env(timeout_s=3.0, blocking=blocking))
    if ctx.rank >= 2:  # domain 1 takes part in both dispatches, and stays until the others are done
        x, idx = torch.ones(2, 4), torch.tensor([[0, 2], [1, 3]])
        backend.dispatch(x, topk_idx=idx)
        try:
            backend.dispatch(x, topk_idx=idx)
        except ep_plugin.EPError:
            pass
        time.sleep(8.0)
        return {}
    return fail_midway_then_retry(ctx, backend, "_local_segment_counts", "the segment counts' allocation failed",
                                  f"segment counts, blocking={blocking}")


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "sync_free_mode"])
def test_a_rank_that_failed_before_the_domain_stage_refuses_and_its_domain_peer_times_out(blocking):
    # Before: nothing marked the collectives, so rank 1's retry went on into exchanges its peers had left.
    rank0, rank1 = run_ranks(failure_before_the_domain_stage, 4, blocking, timeout_s=120)[:2]
    assert rank1["outcome"].startswith("EPError: ") and rank1["seconds"] < 1.0, rank1
    assert "dispatch #2 was left midway on this rank by MemoryError: the segment counts' allocation failed" in \
        rank1["outcome"], rank1
    assert rank0["outcome"].startswith("EPTimeoutError: ") and "dispatch #2: domain/segment counts" in \
        rank0["outcome"], rank0


def bad_topk_values_on_one_rank(ctx, blocking: bool) -> list:
    """Rank 0's top-k ids name an expert out of range, then rank 3's an expert twice, then rank 0 has more
    tokens than max_tokens_per_rank, then so has rank 0 while rank 3 names an expert twice; every rank
    dispatches each time (2 domains of 2: rank 3 is neither rank 0's rail peer nor in its domain), then
    validly."""
    config = Config.from_env(blocking=blocking, timeout_s=20.0, max_tokens_per_rank=64)
    backend = _reference(config=config, topology=Topology(4, 2, ctx.rank))
    problem = make_problem(3, _tokens(0)[:4], HIDDEN, NUM_EXPERTS, 2)
    seen = []
    for bad in ({0: NUM_EXPERTS + 5}, {3: "twice"}, {0: "too many"}, {0: "too many", 3: "twice"}):
        hidden, idx, weights = problem.hidden[ctx.rank], problem.topk_idx[ctx.rank].clone(), \
            problem.topk_weights[ctx.rank]
        bad_value = bad.get(ctx.rank)
        if bad_value == "too many":
            hidden, idx, weights = hidden.repeat(65, 1)[:65], idx.repeat(65, 1)[:65], weights.repeat(65, 1)[:65]
        elif bad_value is not None:
            idx[0, 1] = idx[0, 0] if bad_value == "twice" else bad_value
        try:
            backend.dispatch(hidden, topk_idx=idx, topk_weights=weights)
            seen.append("no error")
        except Exception as error:  # noqa: BLE001 - the test compares the type and text
            seen.append(f"{type(error).__name__}: {error}")
    flat = _reference(config=config)
    routing = _routing(problem, ctx.rank, "topk")
    good = backend.dispatch(problem.hidden[ctx.rank], **routing)
    assert torch.equal(good.hidden, flat.dispatch(problem.hidden[ctx.rank], **routing).hidden)
    return seen


class SyncFreeReference(ReferenceBackend):
    """The reference claiming a sync-free mode, as the compiled backends have, so that the hierarchical
    backend takes its sync-free path on CPU (no host read of the ids: an id out of range is only flagged,
    for check_errors). The domain's own ops stay the reference's."""

    name = "sync_free_reference_test"
    capabilities = dataclasses.replace(ReferenceBackend.capabilities, non_blocking=True)


def refused_dispatch_then_check_errors(ctx) -> list[str]:
    """2 domains of 1, sync-free: rank 0 sends an id out of range while rank 1 sends more tokens than
    max_tokens_per_rank, so every rank refuses the dispatch; then a clean dispatch and check_errors; then
    rank 0's bad id in a dispatch the ranks accept, and check_errors again."""
    config = Config.from_env(blocking=False, timeout_s=20.0, max_tokens_per_rank=8)
    backend = SyncFreeReference(hidden_size=4, num_experts=4, device="cpu", config=config,
                                topology=Topology(2, 1, ctx.rank))
    x, idx, weights = torch.ones(2, 4), torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2)
    bad = idx.clone()
    bad[0, 1] = 99
    seen = []

    def outcome(action):
        try:
            action()
            seen.append("no error")
        except Exception as error:  # noqa: BLE001 - the test compares the type and text
            seen.append(f"{type(error).__name__}: {error}")

    if ctx.rank == 0:
        outcome(lambda: backend.dispatch(x, topk_idx=bad, topk_weights=weights))
    else:
        too_many = idx.repeat(5, 1)[:9]
        outcome(lambda: backend.dispatch(torch.ones(9, 4), topk_idx=too_many, topk_weights=torch.ones(9, 2)))
    backend.dispatch(x, topk_idx=idx, topk_weights=weights)
    outcome(backend.check_errors)
    backend.dispatch(x, topk_idx=bad if ctx.rank == 0 else idx, topk_weights=weights)
    outcome(backend.check_errors)
    return seen


def test_a_dispatch_every_rank_refused_leaves_check_errors_nothing_to_report():
    # Before: the refused dispatch's out-of-range flag was kept, and the check after the clean dispatch blamed it.
    for rank, (refused, after_clean, after_bad) in enumerate(run_ranks(refused_dispatch_then_check_errors, 2,
                                                                        timeout_s=120)):
        # rank 0 refuses because rank 1 did; rank 1 for its own token count. Sync-free mode reads no ids on the
        # host, so rank 0's bad id refuses nothing: the token count alone, on every rank (TooManyTokensError).
        words = "stays usable" if rank == 0 else "hidden has 9 tokens, over max_tokens_per_rank=8"
        assert refused.startswith("TooManyTokensError: ") and words in refused, (rank, refused)
        assert after_clean == "no error", (rank, after_clean)
        if rank == 0:  # the flag itself still works
            assert after_bad.startswith("ValueError: ") and "outside -1 or [0, 4)" in after_bad, after_bad
        else:
            assert after_bad == "no error", after_bad


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "sync_free_mode"])
def test_bad_topk_values_on_one_rank_raise_value_error_on_every_rank_across_domains(blocking):
    """As a flat compiled backend: not a timeout on the others (the agreement carries the refusal); a token
    count past max_tokens_per_rank on one rank too (a longer micro-batch under Megatron, say)."""
    results = run_ranks(bad_topk_values_on_one_rank, 4, blocking, timeout_s=120)
    assert results[0][0].startswith("ValueError: topk_idx holds expert id 37"), results[0]
    assert results[3][1].startswith("ValueError: topk_idx row 0 names the same expert twice"), results[3]
    assert results[0][2].startswith("TooManyTokensError: hidden has 65 tokens, over max_tokens_per_rank=64"), results[0]
    # Domain 1 heard of rank 0's refusal from its own rail peer, rank 2, named as the group knows it (it was
    # once named by its index in the domain, "rank 0", the rank that refused).
    assert "domain 1 (global ranks [2, 3]): in dispatch #1 the rail of rank 2 found" in results[3][0], results[3]
    # The token count alone is TooManyTokensError on every rank (a caller may grow the backend); with rank 3's
    # repeated expert in the same dispatch, every rank raises plain ValueError, though neither rank 0's rail
    # nor its domain holds rank 3.
    assert results[3][3].startswith("ValueError: topk_idx row 0 names the same expert twice"), results[3]
    for rank, seen in enumerate(results):
        for case, (bad_ranks, message) in enumerate(zip(((0,), (3,), (0,), (0, 3)), seen, strict=True)):
            kind = "TooManyTokensError: " if case == 2 else "ValueError: "
            assert message.startswith(kind), (rank, case, message)
            if case == 2 and rank != 0:  # the peers are told the reason too
                assert "passed more tokens than max_tokens_per_rank=64" in message, (rank, message)
            assert "refuse" in message and "stays usable" in message, (rank, case, message)
            if rank in bad_ranks:  # its own reason, worded as a flat backend's
                assert f"(on rank {rank}); every rank of backend" in message, (rank, case, message)


def disagree_across_the_rail(ctx, case: str) -> str:
    """2 ranks in 2 domains of 1 (their rail joins them): rank 0 and rank 1 disagree on the op; each
    must raise EPError (before the fix, gloo saw two sizes in one exchange and aborted the process)."""
    backend = ep_plugin.get_backend("reference")(hidden_size=4, num_experts=4, device="cpu",
                                                 topology=Topology(2, 1, ctx.rank))
    x, idx = torch.ones(2, 4), torch.tensor([[0, 1], [2, 3]])
    try:
        if case == "barrier_vs_dispatch":
            backend.barrier() if ctx.rank == 0 else backend.dispatch(x, topk_idx=idx)
        else:  # the probs routed back in two dtypes: rail rows of two widths
            out = backend.dispatch(x, topk_idx=idx, topk_weights=torch.ones(2, 2))
            probs_dtype = torch.float64 if ctx.rank else torch.float32
            backend.combine(out.hidden, out.handle, row_probs=out.probs.to(probs_dtype))
    except ep_plugin.EPError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("case, words", [("barrier_vs_dispatch", "'barrier' on rank"), ("probs_dtype", "row bytes")])
def test_ranks_that_disagree_across_the_rail_raise(case, words):
    messages = run_ranks(disagree_across_the_rail, 2, case, timeout_s=120)
    assert all("ranks disagree" in message and words in message for message in messages), messages


def a_domain_peer_in_another_call(ctx, case: str) -> str:
    """2 domains x 2: ranks 1 and 3 (rail 1) run the backend's op, ranks 0 and 2 (rail 0) another call on their
    domain group alone: a setup step (building a backend there) or an op (the domain backend's dispatch)."""
    torch.set_num_threads(1)
    backend = ep_plugin.get_backend("reference")(hidden_size=4, num_experts=8, device="cpu",
                                                 config=ep_plugin.Config.from_env(timeout_s=20.0),
                                                 topology=Topology(4, 2, ctx.rank))
    x, idx = torch.ones(2, 4), torch.tensor([[0, 5], [3, 7]])
    try:
        if ctx.rank % 2 == 0 and case == "setup":
            ep_plugin.get_backend("reference")(backend.scaleout.domain_group, hidden_size=4, num_experts=4,
                                               device="cpu", config=ep_plugin.Config.from_env(timeout_s=20.0))
        elif ctx.rank % 2 == 0:
            backend.domain.dispatch(x, topk_idx=idx % 4)
        else:
            backend.barrier() if case == "setup" else backend.dispatch(x, topk_idx=idx)
    except Exception as error:  # noqa: BLE001 - the test reads what came
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize("case", ["setup", "op"])
def test_a_domain_stage_that_meets_another_call_of_its_domain_raises_eperror(case):
    """The domain stage is a frame of the size every call's first exchange has on the group, so a domain backend's
    setup step or op there (on some ranks only) meets it and both sides raise EPError: blocking dispatch's words
    were larger (padded counts), and gloo aborted the processes; then the reference domain backend, reading the
    frame's row-bytes word as a probs dtype, raised an IndexError, and a setup frame read as a backend number 0."""
    outcomes = run_ranks(a_domain_peer_in_another_call, 4, case, timeout_s=120)
    for rank, outcome in enumerate(outcomes):
        assert outcome.startswith("EPError: "), (rank, outcome)
    if case == "setup":  # both sides say the other was in another call
        assert "were in a setup step on domain" in outcomes[1] and "building or destroying" in outcomes[1], outcomes
        assert "(a setup step) while" in outcomes[0] and "ran a barrier op" in outcomes[0], outcomes
    else:
        assert "another call's word" in outcomes[0] or "ranks disagree" in outcomes[0], outcomes


def two_backends_in_two_orders(ctx, kind: str, split: str, too_many: bool = False) -> list:
    """2 domains x 2: two backends on one group that differ in their experts (8 and 1200, so 2 and 300 per rank,
    whose segment counts differ in size; ``kind`` "experts_blocking" or "experts_sync_free") or their mode
    (``kind`` "modes": blocking and sync-free).
    Half the ranks (``split``: a domain, or a rail) use the first backend first, the others the second
    (``too_many``: rank 1 with more tokens than max_tokens_per_rank there). Then every rank uses the first
    (the same order again)."""
    torch.set_num_threads(1)
    config = ep_plugin.Config.from_env().replace(timeout_s=20.0, max_tokens_per_rank=8,
                                                 blocking=kind != "experts_sync_free")
    configs = (config, config.replace(blocking=False)) if kind == "modes" else (config, config)
    experts = (8, 8) if kind == "modes" else (8, 1200)
    first, second = (ep_plugin.get_backend("reference")(hidden_size=4, num_experts=e, device="cpu", config=c,
                                                        topology=Topology(4, 2, ctx.rank))
                     for e, c in zip(experts, configs, strict=True))
    x, idx = torch.full((2, 4), float(ctx.rank + 1)), torch.tensor([[0, 5], [3, 7]])
    first_group = ctx.rank < 2 if split == "domain" else ctx.rank % 2 == 0
    outcomes = []
    for backend in (first, second) if first_group else (second, first):
        try:
            if too_many and ctx.rank == 1:
                backend.dispatch(x.repeat(5, 1)[:9], topk_idx=idx.repeat(5, 1)[:9])
            else:
                backend.dispatch(x, topk_idx=idx)
            outcomes.append("no error")
        except Exception as error:  # noqa: BLE001 - the test compares what came
            outcomes.append(f"{type(error).__name__}: {error}")
    out = first.dispatch(x, topk_idx=idx)
    outcomes.append(float(first.combine(out.hidden, out.handle).hidden.sum()))
    return outcomes


@pytest.mark.parametrize("kind, split, too_many", [
    ("experts_blocking", "domain", False), ("experts_sync_free", "domain", False), ("experts_blocking", "rail", False),
    ("modes", "domain", False), ("modes", "rail", False),
    # Each rail agrees within itself, and rank 1's rail refuses its token count: that rail's ranks raised
    # TooManyTokensError alone (a Megatron manager would have grown its backend there, waiting for the others).
    ("experts_blocking", "rail", True), ("experts_sync_free", "rail", True)])
def test_ranks_that_use_two_backends_in_two_orders_all_raise(kind, split, too_many):
    """Before the backend's number was in the agreement words, split by domain the ranks decoded the other
    domain's rows with the other backend's experts (an IndexError on some ranks, rows without an error on
    the others); where the two backends' words differed in size (split by rail, or two modes) gloo aborted
    the processes. More than 256 local experts per rank were refused across domains (the domain stage's words
    were padded for 256); the domain stage is now one frame of one size, the counts after it."""
    per_rank = run_ranks(two_backends_in_two_orders, 4, kind, split, too_many, timeout_s=120)
    for rank, outcomes in enumerate(per_rank):
        for outcome in outcomes[:2]:
            assert outcome.startswith("EPError") and "Ranks must use their backends in the same order" in outcome, \
                (rank, outcome)
        assert outcomes[2] == 2 * 2 * 4 * (rank + 1), (rank, outcomes[2])  # usable after: each token's 2 experts


# ---- the compact form (elastic's) on CPU -----------------------------------------------------------

class CompactBackend(Backend):
    """A CPU stand-in for elastic's compact receive, so the hierarchical compact path is tested here too.

    Top-k only. Dispatch: one row per (token, destination rank), by source rank then token, with the
    token's top-k as this rank's local ids (-1 elsewhere) and its weights (0 elsewhere); combine sums the
    rows back at the source in fp32 and routes per-slot values back.
    """

    name = "compact_test"
    capabilities = Capabilities(devices=("cpu",), hidden_dtypes=(torch.float32,), probs_dtypes=(torch.float32,),
                                routing_forms=("topk",))

    def _exchange(self, tensor, out_splits, in_splits):
        out = tensor.new_empty((sum(out_splits),) + tuple(tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), out_splits, in_splits, group=self.group)
        return out

    def _dispatch(self, hidden, routing, probs, pad_multiple):
        idx, L, R = routing.topk_idx, self.num_local_experts, self.num_ranks
        owner = torch.where(idx >= 0, idx.div(L, rounding_mode="floor"), torch.full_like(idx, -1))
        pairs = [(r, t) for r in range(R) for t in range(idx.shape[0]) if bool((owner[t] == r).any())]
        dest = torch.tensor([r for r, _ in pairs], dtype=torch.int64)
        tokens = torch.tensor([t for _, t in pairs], dtype=torch.int64)
        send = torch.bincount(dest, minlength=R).tolist()
        recv = self._exchange(torch.tensor(send), [1] * R, [1] * R).tolist()
        mine = owner[tokens] == dest.unsqueeze(1)
        local_ids = torch.where(mine, idx[tokens] - dest.unsqueeze(1) * L, torch.full_like(idx[tokens], -1))
        rows = self._exchange(hidden[tokens], recv, send)
        ids = self._exchange(local_ids, recv, send)
        weights = self._exchange(torch.where(mine, probs[tokens], 0.0), recv, send) if probs is not None else None
        counts = torch.bincount(ids[ids >= 0], minlength=L)
        padded = (counts + pad_multiple - 1) // pad_multiple * pad_multiple
        layout = {"tokens": tokens, "dest": dest, "send": send, "recv": recv, "mine": mine}
        handle = Handle(backend=self, num_tokens=idx.shape[0], hidden_size=self.hidden_size, hidden_dtype=hidden.dtype,
                        probs_shape=routing.probs_shape if probs is not None else None, num_experts=self.num_experts,
                        num_local_experts=L, pad_multiple=pad_multiple, num_rows=rows.shape[0],
                        tokens_per_expert=padded, num_real_tokens_per_expert=counts, layout=layout,
                        output_form=COMPACT, row_probs_shape=(rows.shape[0], idx.shape[1]))
        return DispatchOutput(rows, weights, padded, handle, topk_idx=ids)

    def _dispatch_again(self, hidden, handle):
        layout = handle.layout
        return self._exchange(hidden[layout["tokens"]], layout["recv"], layout["send"])

    def _combine(self, rows, handle, row_probs):
        layout = handle.layout
        back = self._exchange(rows, layout["send"], layout["recv"])
        summed = torch.zeros(handle.num_tokens, self.hidden_size).index_add_(0, layout["tokens"], back)
        values = None
        if row_probs is not None:
            returned = self._exchange(row_probs, layout["send"], layout["recv"])
            values = torch.zeros(handle.probs_shape)
            for row, token in enumerate(layout["tokens"].tolist()):
                values[token] = torch.where(layout["mine"][row], returned[row], values[token])
        return CombineOutput(summed.to(rows.dtype), values)


class CompactWithExpand(CompactBackend):
    """CompactBackend taking elastic's ``expand`` flag, which changes its dispatch form (the rows here stay
    compact: what is tested is that ranks which differ in the flag disagree)."""

    name = "compact_expand_test"
    capabilities = dataclasses.replace(CompactBackend.capabilities, dispatch_options=("expand",))

    def dispatch_form(self, form, *, expand=False, **_):
        return f"{form}+expand" if expand else form

    def _dispatch(self, hidden, routing, probs, pad_multiple, expand=False):
        return super()._dispatch(hidden, routing, probs, pad_multiple)


class CompactWithZeroPadding(CompactBackend):
    """CompactBackend whose cached dispatch takes elastic's ``zero_padding`` flag, with elastic's check of its value
    (a bool); the compact form ignores it, as elastic's does."""

    name = "compact_zero_padding_test"
    capabilities = dataclasses.replace(CompactBackend.capabilities, cached_dispatch_options=("zero_padding",))

    def check_dispatch_flags(self, *, zero_padding=False):
        if not isinstance(zero_padding, bool):
            raise TypeError(f"zero_padding must be a bool, got {zero_padding!r}")

    @staticmethod
    def check_cached_form(handle, *, zero_padding=False):
        return None


def cached_dispatch_flag_of_the_wrong_type(ctx) -> dict:
    """2 domains x 2: a cached dispatch with ``zero_padding=1`` (not a bool) on rank 0 alone (which then calls again
    with a bool, pairing with its peers' op, as README says), then on every rank."""
    torch.set_num_threads(1)
    problem = make_problem(9, [3, 4, 2, 5], HIDDEN, 8, 2, integer_valued=True)
    hidden = problem.hidden[ctx.rank]
    config = ep_plugin.Config.from_env().replace(timeout_s=20.0)
    backend = CompactWithZeroPadding(hidden_size=HIDDEN, num_experts=8, device="cpu", config=config,
                                     topology=Topology(4, 2, ctx.rank))
    out = backend.dispatch(hidden, **_routing(problem, ctx.rank, "topk"))
    outcomes = {}
    for who, odd in (("rank 0", ctx.rank == 0), ("every rank", True)):
        try:
            backend.dispatch(hidden * 2, handle=out.handle, zero_padding=1 if odd else False)
            outcomes[who] = "no error"
        except Exception as error:  # noqa: BLE001 - the test compares what came
            outcomes[who] = f"{type(error).__name__}: {error}"
            if who == "rank 0":
                outcomes["again"] = torch.equal(backend.dispatch(hidden * 2, handle=out.handle).hidden, out.hidden * 2)
    outcomes["after"] = torch.equal(backend.dispatch(hidden * 2, handle=out.handle, zero_padding=True).hidden,
                                    out.hidden * 2)
    return outcomes


def test_a_cached_dispatch_across_domains_checks_its_flags_before_the_rails():
    """Before, a cached dispatch across domains checked the values of its domain backend's flags (elastic's
    zero_padding, expand) only inside the domain backend's dispatch, after the rail rows had moved: the backend was
    left out of step, and where one rank alone passed it, its domain peer timed out."""
    for rank, outcomes in enumerate(run_ranks(cached_dispatch_flag_of_the_wrong_type, 4, timeout_s=120)):
        wrong = "TypeError: zero_padding must be a bool, got 1"
        assert outcomes["rank 0"] == (wrong if rank == 0 else "no error"), (rank, outcomes)
        assert outcomes.get("again", True) is True, (rank, outcomes)
        assert outcomes["every rank"] == wrong and outcomes["after"] is True, (rank, outcomes)


def expand_on_some_ranks(ctx) -> dict:
    """2 domains x 2, blocking and sync-free: rank 0 alone, then domain 1 (ranks 2, 3), passes expand=True."""
    torch.set_num_threads(1)
    outcomes = {}
    problem = make_problem(5, [3, 4, 2, 5], HIDDEN, 8, 2, integer_valued=True)
    routing = _routing(problem, ctx.rank, "topk")
    hidden = problem.hidden[ctx.rank]
    for blocking in (True, False):
        config = ep_plugin.Config.from_env().replace(timeout_s=20.0, blocking=blocking, max_tokens_per_rank=8)
        backend = CompactWithExpand(hidden_size=HIDDEN, num_experts=8, device="cpu", config=config,
                                    topology=Topology(4, 2, ctx.rank))
        for who, odd in (("rank 0", ctx.rank == 0), ("domain 1", ctx.rank >= 2)):
            try:
                backend.dispatch(hidden, expand=odd, **routing)
                outcomes[(blocking, who)] = "no error"
            except Exception as error:  # noqa: BLE001 - the test compares what came
                outcomes[(blocking, who)] = f"{type(error).__name__}: {error}"
        out = backend.dispatch(hidden, **routing)  # still usable: the compact sum counts each rank once
        idx = problem.topk_idx[ctx.rank]
        ranks_reached = [len({e // 2 for e in row if e >= 0}) for row in idx.tolist()]
        outcomes[(blocking, "after")] = torch.equal(backend.combine(out.hidden, out.handle).hidden,
                                                    hidden * torch.tensor(ranks_reached, dtype=hidden.dtype)[:, None])
    return outcomes


def test_ranks_that_differ_in_a_form_option_across_domains_all_raise():
    """The rail fingerprint named the routing form alone: a rank that expanded (elastic) disagreed only in its
    domain's handshake, after the rail rows moved, and a whole domain that expanded disagreed nowhere."""
    for rank, outcomes in enumerate(run_ranks(expand_on_some_ranks, 4, timeout_s=120)):
        for key, outcome in outcomes.items():
            if key[1] == "after":
                assert outcome is True, (rank, key)
            else:
                assert outcome.startswith("EPError") and "disagree" in outcome, (rank, key, outcome)


def check_compact_form(ctx) -> list[str]:
    """The compact form across domains equals the flat compact backend: rows, ids, weights, counts, sums."""
    torch.set_num_threads(1)
    build = dict(hidden_size=HIDDEN, num_experts=NUM_EXPERTS, device="cpu")
    flat = CompactBackend(**build)
    checked = []
    for size, blocking in ((4, True), (2, False), (1, True)):
        config = ep_plugin.Config.from_env().replace(blocking=blocking)
        layered = CompactBackend(**build, config=config, topology=Topology(NUM_RANKS, size, ctx.rank))
        assert isinstance(layered, HierarchicalBackend)
        # A routing form the backend does not take is refused by name, flat or across domains.
        routing_map = torch.zeros(2, NUM_EXPERTS, dtype=torch.bool)
        for backend in (flat, layered):
            with pytest.raises(ValueError, match="takes topk_idx"):
                backend.dispatch(torch.zeros(2, HIDDEN), routing_map=routing_map)
        for case, skewed in enumerate((False, True)):
            name = f"compact {NUM_RANKS // size}x{size} blocking={blocking} skewed={skewed}"
            problem = make_problem(60 + case, _tokens(case), HIDDEN, NUM_EXPERTS, 4, skewed=skewed,
                                   integer_valued=True, drop_some=True)
            routing = _routing(problem, ctx.rank, "topk")
            want = flat.dispatch(problem.hidden[ctx.rank], **routing)
            got = layered.dispatch(problem.hidden[ctx.rank], **routing)
            assert got.handle.output_form == COMPACT, name
            for field in ("hidden", "probs", "topk_idx", "tokens_per_expert"):
                assert torch.equal(getattr(got, field), getattr(want, field)), f"{name}: {field}"
            rows = want.hidden * 3 + ctx.rank  # exact sums of small integers
            back, want_back = (backend.combine(rows, out.handle, row_probs=out.probs * 2 + 1)
                               for backend, out in ((layered, got), (flat, want)))
            assert torch.equal(back.hidden, want_back.hidden), f"{name}: combine"
            assert torch.equal(back.probs, want_back.probs), f"{name}: values routed back"
            checked.append(name)
    return checked


def disagreement_across_domains(ctx) -> tuple[str, str, bool]:
    """2x4: rank 0 dispatches float64 rows, the others float32; later rank 0 combines two handles in the
    opposite order. Its rail (ranks 0 and 4) sees it; every rank must raise EPError at once (the rail's
    ranks tell their domains; no domain peer waits for a timeout), and the backend stays usable."""
    backend = _reference(topology=Topology(NUM_RANKS, 4, ctx.rank))
    problem = make_problem(7, _tokens(0), HIDDEN, NUM_EXPERTS, 2, integer_valued=True)
    hidden = problem.hidden[ctx.rank]
    try:
        backend.dispatch(hidden.double() if ctx.rank == 0 else hidden, **_routing(problem, ctx.rank, "topk"))
        message = "no error"
    except ep_plugin.EPError as exc:
        message = str(exc)
    routing = _routing(problem, ctx.rank, "topk")
    first, second = backend.dispatch(hidden, **routing), backend.dispatch(hidden * 2, **routing)
    try:
        out = second if ctx.rank == 0 else first
        backend.combine(out.hidden, out.handle)
        combine_message = "no error"
    except ep_plugin.EPTimeoutError as exc:
        combine_message = f"timeout: {exc}"
    except ep_plugin.EPError as exc:
        combine_message = str(exc)
    usable = torch.equal(backend.combine(first.hidden, first.handle).hidden,
                         hidden * (problem.topk_idx[ctx.rank] >= 0).sum(1, keepdim=True).to(hidden.dtype))
    return message, combine_message, usable


def compact_and_disagreement(ctx) -> tuple:
    return check_compact_form(ctx), disagreement_across_domains(ctx)


def test_compact_form_across_domains_equals_flat_and_ranks_that_disagree_all_raise():
    results = run_ranks(compact_and_disagreement, NUM_RANKS, timeout_s=300)
    assert all(len(checked) == 6 for checked, _ in results), results
    for rank, (_, (message, combine_message, usable)) in enumerate(results):
        if rank in (0, 4):  # rail 0 saw the dtypes differ, then the handles
            assert "ranks disagree on dispatch" in message and "dtype" in message and "rail 0" in message, message
            # The ranks named are the EP group's (0 and 4), not their places on the rail (0 and 1).
            assert "torch.float64 on rank 0" in message and "torch.float32 on rank 4" in message, message
            assert "ranks disagree on combine" in combine_message and "handle_id" in combine_message, combine_message
        else:  # told by their domain: the flag of their peer on rail 0
            for told in (message, combine_message):
                assert "found that ranks disagree on the op" in told and "domain" in told, (rank, told)
        assert usable, f"rank {rank}: the backend is not usable after the disagreements"


# ---- ranks that disagree inside one domain: every rank of every domain raises -------------------

# (case, ranks that run the odd op, what the errors must name). Rank 0 alone: only its rail (ranks 0 and 2)
# sees it, and ranks 1 and 3 learn it from their domain peer. Ranks 0 and 2 (a whole rail): both rails agree
# and each domain sees two ops (blocking: a dispatch's domain frame meets a combine's).
DOMAIN_CASES = (("blocking: combine vs dispatch", (0,), ("op: ", "'combine' on rank")),
                ("blocking: barrier vs dispatch", (0,), ("op: ", "'barrier' on rank")),
                ("blocking: dispatch_again vs combine", (0,), ("op: ", "'dispatch_again' on rank")),
                ("blocking: combine vs dispatch, by rail", (0, 2), ("op: ", "'combine' on rank")),
                ("blocking: barrier vs combine", (0,), ("op: ", "'barrier' on rank")),
                ("blocking: row_probs on one rank", (0,), ("probs: ", "True on rank")),
                ("sync-free: probs on one rank", (0,), ("probs: ", "False on rank")),
                ("sync-free: dtype", (0,), ("dtype: ", "torch.float64 on rank")),
                ("sync-free: combine order", (0,), ("handle_id: ",)),
                ("sync-free: combine vs dispatch", (0,), ("op: ", "'combine' on rank")),
                ("sync-free: row_probs on one rank", (0,), ("probs: ", "True on rank")),
                ("sync-free: barrier vs dispatch", (0,), ("op: ", "'barrier' on rank")),
                ("sync-free: dtype, by rail", (0, 2), ("dtype: ", "torch.float64 on rank")),
                # Each rail agrees on its rows' width; the domain stage compares them (before: the domain backend's
                # own check, after the rail rows moved, and the backend was out of step).
                ("blocking: probs dtype, by rail", (0, 2), ("rail rows of ", "bytes on rank", "probs' dtypes")),
                ("sync-free: probs dtype, by rail", (0, 2), ("rail rows of ", "bytes on rank", "probs' dtypes")),
                ("blocking: row_probs dtype, by rail", (0, 2), ("rail rows of ", "bytes on rank", "probs' dtypes")),
                ("sync-free: row_probs dtype, by rail", (0, 2), ("rail rows of ", "bytes on rank", "probs' dtypes")))


def _odd_op(backend, what: str, odd: bool, hidden, routing) -> None:
    """The ranks of ``odd`` and the others run ``what`` (a DOMAIN_CASES case without its mode)."""
    what = what.removesuffix(", by rail")
    if what == "barrier vs dispatch":
        backend.barrier() if odd else backend.dispatch(hidden, **routing)
    elif what == "probs on one rank":
        backend.dispatch(hidden, **{**routing, "topk_weights": None} if odd else routing)
    elif what == "dtype":
        backend.dispatch(hidden.double() if odd else hidden, **routing)
    elif what == "probs dtype":
        weights = routing["topk_weights"]
        backend.dispatch(hidden, **{**routing, "topk_weights": weights.double() if odd else weights})
    else:
        first = backend.dispatch(hidden, **routing)
        if what == "combine vs dispatch":
            backend.combine(first.hidden, first.handle) if odd else backend.dispatch(hidden, **routing)
        elif what == "barrier vs combine":
            backend.barrier() if odd else backend.combine(first.hidden, first.handle)
        elif what == "row_probs on one rank":  # combine's rail rows of two widths, unless agreed first
            backend.combine(first.hidden, first.handle, row_probs=first.probs if odd else None)
        elif what == "row_probs dtype":
            backend.combine(first.hidden, first.handle, row_probs=first.probs.double() if odd else first.probs)
        elif what == "dispatch_again vs combine":
            backend.dispatch_again(hidden, first.handle) if odd else backend.combine(first.hidden, first.handle)
        else:  # combine order: the odd rank combines its second dispatch, the others their first
            second = backend.dispatch(hidden, **routing)
            out = second if odd else first
            backend.combine(out.hidden, out.handle)


def disagree_within_a_domain(ctx, cases: list[tuple[str, tuple]]) -> dict:
    """2 domains x 2 ranks, blocking and sync-free: each (case, odd ranks) once, then a matching dispatch +
    combine. Returns {case: (the error the case raised here, whether the matching ops gave the right sums)}."""
    torch.set_num_threads(1)
    config = ep_plugin.Config.from_env().replace(timeout_s=30.0)  # a hang reads as EPTimeoutError, not a stall
    backends = {mode: ep_plugin.get_backend("reference")(
        hidden_size=HIDDEN, num_experts=8, device="cpu", config=config.replace(blocking=mode == "blocking"),
        topology=Topology(4, 2, ctx.rank)) for mode in ("blocking", "sync-free")}
    problem = make_problem(11, [5, 3, 7, 4], HIDDEN, 8, 2, integer_valued=True, drop_some=True)
    hidden, routing = problem.hidden[ctx.rank], _routing(problem, ctx.rank, "topk")
    times_routed = (problem.topk_idx[ctx.rank] >= 0).sum(1, keepdim=True).to(hidden.dtype)
    results = {}
    for case, odd_ranks in cases:
        mode, what = case.split(": ")
        backend = backends[mode]
        try:
            _odd_op(backend, what, ctx.rank in odd_ranks, hidden, routing)
            message = "no error"
        except ep_plugin.EPError as exc:
            message = f"{type(exc).__name__}: {exc}"
        out = backend.dispatch(hidden, **routing)
        results[case] = message, torch.equal(backend.combine(out.hidden, out.handle).hidden, hidden * times_routed)
    return results


def test_ranks_that_disagree_within_a_domain_all_raise_and_the_backend_stays_usable():
    """Before: blocking mode met a domain peer's segment counts with a barrier (gloo aborted the process);
    sync-free mode had no agreement (rows of two widths in one exchange, or an error in one domain and a
    timeout in the other)."""
    per_rank = run_ranks(disagree_within_a_domain, 4, [case[:2] for case in DOMAIN_CASES], timeout_s=180)
    for case, odd_ranks, words in DOMAIN_CASES:
        for rank, results in enumerate(per_rank):
            message, usable = results[case]
            assert message.startswith("EPError: "), (case, rank, message)
            if odd_ranks == (0,) and rank in (1, 3):  # told by their domain peer on rank 0's rail
                assert "the rail of rank" in message and "found that ranks disagree" in message, (case, rank, message)
            else:  # rank 0's rail saw the two ops, or (by rail) each domain did
                assert "ranks disagree on" in message and all(w in message for w in words), (case, rank, message)
                assert (f"seen in domain {rank // 2}" in message) == (odd_ranks != (0,)), (case, rank, message)
            assert usable, f"{case}: rank {rank}: the matching dispatch + combine after it went wrong"

# ---- the barrier is global: rail barrier, then domain barrier -------------------------------------

LATE_S = 1.5


def _parallel_barrier(backend) -> None:
    """The bug the sequential order prevents: rail and domain barriers at once (negative control)."""
    import threading

    errors = []

    def domain_barrier():
        try:
            backend.domain.barrier()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=domain_barrier)
    thread.start()
    backend.scaleout.barrier(where="barrier: rail barrier")
    thread.join()
    if errors:
        raise errors[0]


def late_rank_barriers(ctx, late_rank: int, name: str = "reference", config=None) -> dict:
    """For 2x4 and 4x2: the barrier, then the parallel control, each with ``late_rank`` entering late.

    Returns {(layout, order): (entry time, exit time)} on this rank's host clock.
    """
    torch.set_num_threads(1)
    times = {}
    for size in (4, 2):
        backend = ep_plugin.get_backend(name)(hidden_size=HIDDEN, num_experts=NUM_EXPERTS, device=ctx.device,
                                              config=config, topology=Topology(NUM_RANKS, size, ctx.rank))
        for order in ("sequential", "parallel"):
            backend.barrier()  # everyone at the start line
            if ctx.rank == late_rank:
                time.sleep(LATE_S)
            entered = time.time()
            backend.barrier() if order == "sequential" else _parallel_barrier(backend)
            times[(f"{NUM_RANKS // size}x{size}", order)] = (entered, time.time())
        backend.barrier()
        backend.destroy()
    return times


def check_late_rank_barriers(per_rank: list[dict], late: int) -> None:
    """Every rank leaves the (sequential) barrier after the late rank entered; the parallel control does not."""
    for key in per_rank[0]:
        late_entry = per_rank[late][key][0]
        early_exits = [rank for rank, times in enumerate(per_rank) if times[key][1] < late_entry]
        if key[1] == "sequential":
            assert not early_exits, f"{key}: rank(s) {early_exits} left the barrier before rank {late} entered"
        else:  # the control: the same check catches the parallel order
            assert early_exits, f"{key}: the parallel barrier was not caught; the test cannot tell the orders apart"


def test_barrier_waits_for_a_late_rank_in_another_domain_and_rail():
    # Rank 0 is late. Rank 5 (2x4) and rank 3 (4x2) share neither its domain nor its rail.
    check_late_rank_barriers(run_ranks(late_rank_barriers, NUM_RANKS, 0, timeout_s=120), 0)


# ---- a missing rank at the scale-out level ------------------------------------------------------

TIMEOUT_S = 2.0
SLACK_S = 4.0  # process scheduling on a loaded 2-core machine


def missing_rank(ctx) -> dict:
    """At 8x1, then at 2x4 (new groups): rank 0 builds the backend and never dispatches; the others do, then
    ranks 1-3 try a barrier."""
    torch.set_num_threads(1)
    config = ep_plugin.Config.from_env().replace(timeout_s=TIMEOUT_S)
    store = torch.distributed.distributed_c10d._get_default_store()
    outcomes = {}
    for size in (1, 4):
        backend = _reference(config, Topology(NUM_RANKS, size, ctx.rank))
        if ctx.rank == 0:  # stay (alive, silent) until the others gave up: a closed connection is another error
            deadline = time.monotonic() + 4 * TIMEOUT_S + SLACK_S
            while time.monotonic() < deadline and not store.check([f"{size}/gave_up/{q}"
                                                                     for q in range(1, NUM_RANKS)]):
                time.sleep(0.05)
            continue
        problem = make_problem(3, _tokens(0), HIDDEN, NUM_EXPERTS, 4, integer_valued=True)
        start = time.monotonic()
        try:
            backend.dispatch(problem.hidden[ctx.rank], **_routing(problem, ctx.rank, "topk"))
            outcome = "no error", ""
        except Exception as exc:  # noqa: BLE001 - the test reports it
            outcome = type(exc).__name__, str(exc)
        outcomes[size] = (*outcome, time.monotonic() - start)
        if ctx.rank < 4:  # domain 0 at 2x4: a next op (a barrier, as a cleanup would call) its rail peers skip
            start = time.monotonic()
            try:
                backend.barrier()
                outcome = "no error", ""
            except Exception as exc:  # noqa: BLE001 - the test reports it
                outcome = type(exc).__name__, str(exc)
            outcomes[size, "next op"] = (*outcome, time.monotonic() - start)
        store.set(f"{size}/gave_up/{ctx.rank}", "1")
    return outcomes


def test_missing_rank_times_out_naming_the_rail_phase_and_peer():
    per_rank = run_ranks(missing_rank, NUM_RANKS, timeout_s=120)
    for size in (1, 4):
        rail_peers = list(range(size, NUM_RANKS, size))  # rank 0's rail
        for rank in range(1, NUM_RANKS):
            kind, message, seconds = per_rank[rank][size]
            where = f"{NUM_RANKS // size}x{size} rank {rank}"
            assert kind == "EPTimeoutError", (where, kind, message)
            assert seconds < TIMEOUT_S + _grace_s(TIMEOUT_S) + SLACK_S, (where, seconds)
            if rank in rail_peers:  # 8x1: every survivor
                assert "rail 0 (global ranks" in message and "dispatch #1: rail/counts" in message, (where, message)
                assert "Late peer(s): rank 0 (no wait reported" in message, (where, message)
                # It names itself as its peers know it (it said "rank 1 timed out" on rail [0, 4], where rank 1
                # reads as global rank 1, alive and waiting elsewhere).
                me = f"rank {rank}" if size == 1 else f"rank {rank // size} (global rank {rank})"
                assert f"{me} timed out" in message, (where, message)
            else:  # 2x4: rank 0's domain peers wait for it there; the rest for rank 4, which waits on the rail
                assert "domain" in message and "segment counts" in message, (where, message)
                if rank > 4:  # rank 4 was named late, though it waits on its rail for rank 0
                    assert "rank 0 (global rank 4) did not come because it waits elsewhere itself, in dispatch " \
                           "#1: rail/counts" in message and "Late peer(s)" not in message, (where, message)
            if rank >= 4:
                continue
            # Refused at once, whichever level timed out. A rank whose domain stage had timed out used to enter
            # the next op's rail exchange and blame its rail peer (which did not call it) after another timeout.
            kind, message, seconds = per_rank[rank][size, "next op"]
            assert kind == "EPError" and "cannot run more ops after an earlier failure" in message, (where, message)
            assert seconds < TIMEOUT_S / 2, (where, seconds)


# ---- pieces, without ranks ------------------------------------------------------------------------

def test_flat_order_index_is_the_block_transpose():
    """Domain-level rows (segment, forwarding peer s, source domain d, token) move to (segment, d, s, token);
    padding and rows past the valid ones stay; compact (one segment, no padding) too."""
    from ep_plugin.transport.scaleout import flat_order_index

    generator = torch.Generator().manual_seed(5)
    for S, D, G, pad in ((2, 3, 4, 4), (4, 2, 1, 1), (1, 4, 3, 2), (3, 1, 2, 1)):
        counts = torch.randint(0, 4, (S, D, G), generator=generator)
        inner, flat = [], []
        for g in range(G):
            real = int(counts[:, :, g].sum())
            padding = -(-real // pad) * pad - real
            inner += [(g, s, d, t) for s in range(S) for d in range(D) for t in range(int(counts[s, d, g]))]
            inner += [(g, "pad", i) for i in range(padding)]
            flat += [(g, s, d, t) for d in range(D) for s in range(S) for t in range(int(counts[s, d, g]))]
            flat += [(g, "pad", i) for i in range(padding)]
        capacity = len(inner) + 3  # sync-free: rows past the valid ones
        dest = flat_order_index(counts, pad, capacity).tolist()
        assert sorted(dest) == list(range(capacity)), "not a permutation"
        placed = [None] * capacity
        for i, label in enumerate(inner + ["past"] * 3):
            placed[dest[i]] = label
        assert placed == flat + ["past"] * 3, (S, D, G, pad)


def test_row_packer_round_trip_is_bitwise():
    from ep_plugin.transport.scaleout import RowPacker

    rows = torch.randn(5, 8).to(torch.float8_e4m3fn)
    one_row = RowPacker([("ids", torch.int64, (2,)), ("flag", torch.bool, (3,))])  # 19-byte rows, one row
    ids = torch.tensor([[3, -1]])
    assert torch.equal(one_row.unpack(one_row.pack(1, {"ids": ids}, torch.device("cpu")))["ids"], ids)
    values = {"hidden": rows.view(torch.uint8), "scales": torch.randn(5, 2), "route": torch.rand(5, 3) < 0.5,
              "ids": torch.randint(-1, 9, (5, 2))}
    packer = RowPacker([("hidden", torch.float8_e4m3fn, (8,)), ("scales", torch.float32, (2,)),
                        ("route", torch.bool, (3,)), ("ids", torch.int64, (2,))])
    assert packer.row_bytes == 8 + 8 + 3 + 16
    back = packer.unpack(packer.pack(5, values, torch.device("cpu")))
    assert torch.equal(back["hidden"].view(torch.uint8), values["hidden"]) and back["hidden"].dtype == rows.dtype
    for name in ("scales", "route", "ids"):
        assert back[name].dtype == values[name].dtype and torch.equal(back[name], values[name]), name
    empty = {name: value[:0] for name, value in values.items()}
    assert packer.unpack(packer.pack(0, empty, torch.device("cpu")))["ids"].shape == (0, 2)
    # Views where the 35-byte rows allow them (hidden, route), copies elsewhere (scales, ids): the same values.
    viewed = packer.unpack(packer.pack(5, values, torch.device("cpu")), copy=False)
    for name in values:
        assert torch.equal(viewed[name].view(torch.uint8), back[name].view(torch.uint8)), name
    # Gathered (take) and scattered (at) straight into the rows: as packing the indexed values.
    order = torch.tensor([4, 0, 0, 2])
    taken = packer.pack_into(torch.empty(4, packer.row_bytes, dtype=torch.uint8), values, take=order)
    assert torch.equal(taken, packer.pack(4, {name: value[order] for name, value in values.items()}, "cpu"))
    where = torch.tensor([6, 1, 3, 0, 5])
    placed = packer.pack_into(torch.zeros(7, packer.row_bytes, dtype=torch.uint8), values, at=where)
    assert torch.equal(placed[where], packer.pack(5, values, "cpu")) and not placed[[2, 4]].any()


def one_more_group_on_rank_zero(ctx) -> tuple:
    """Rank 0 belongs to one group more than its peers (made on it alone), then every rank builds 2 x 2
    forced domains."""
    if ctx.rank == 0:
        dist.new_group([0], use_local_synchronization=True)
    start = time.monotonic()
    try:
        _reference(Config.from_env(timeout_s=20.0), Topology(4, 2, ctx.rank)).destroy()
        return "built", "", time.monotonic() - start
    except EPError as error:
        return type(error).__name__, str(error), time.monotonic() - start


def test_ranks_in_different_numbers_of_groups_are_told_before_the_groups_are_made():
    """Before: torch named each domain group after its members' group counts, the ranks of domain 0
    looked for each other under two names, and all waited out the group's own timeout (30 min) silently."""
    for kind, message, seconds in run_ranks(one_more_group_on_rank_zero, 4, timeout_s=120):
        assert kind == "EPError", (kind, message)
        assert "different numbers of process groups" in message and "rank 0: " in message, message
        assert seconds < 15, seconds
