"""A late, missing or departed peer: every waiting rank gets a named error within the timeout.

Never a hang, never a raw engine exception: ``EPTimeoutError`` naming this rank, the op and
phase, and the late peer; ``EPError`` carrying the engine's message when a peer went away.
"""

import os
import signal
import subprocess
import time
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.backends.base import Backend, Capabilities
from ep_plugin.config import Config
from ep_plugin.host_collectives import (
    _STORE_ANSWER_S,
    HostCollectives,
    _grace_s,
    engine_for,
    moves_host_memory,
    nccl_moves_cuda,
    word_device,
)
from ep_plugin.testing import run_ranks

TIMEOUT_S = 2.0
SLACK_S = 3.0  # process scheduling on a busy 2-core machine
HIDDEN, EXPERTS = 8, 6


def test_a_timed_out_rank_reports_a_tenth_of_the_timeout_later_between_0_2_and_2_s():
    """How long a rank that timed out waits for its peers' posts before it reports: the time bounds of the
    tests below add it, so a grace that grew (a report a quarter of a minute late) would widen them too."""
    assert [_grace_s(t) for t in (1.0, 2.0, 10.0, 100.0, 1000.0)] == [0.2, 0.2, 1.0, 2.0, 2.0]


def _reference():
    return ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=EXPERTS, device="cpu",
                                              config=Config.from_env(timeout_s=TIMEOUT_S))


def _dispatch(backend):
    topk_idx = torch.arange(4).remainder(EXPERTS).unsqueeze(1)
    return backend.dispatch(torch.ones(4, HIDDEN), topk_idx=topk_idx)


def _outcome(action) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        action()
        return "ok", "", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 - the test inspects the type
        return type(exc).__name__, str(exc), time.monotonic() - start


def late_peer(ctx):
    """Rank 2 builds the backend, then arrives at dispatch only after the others gave up."""
    backend = _reference()
    if ctx.rank == 2:
        time.sleep(TIMEOUT_S + _grace_s(TIMEOUT_S) + 1.5)
    outcomes = _outcome(lambda: _dispatch(backend)), _outcome(lambda: _dispatch(backend))
    if ctx.rank != 2:  # stay until rank 2 timed out too (leaving would close the connection it waits on)
        time.sleep(TIMEOUT_S + 2 * _grace_s(TIMEOUT_S) + 2.5)
    return outcomes


@pytest.fixture(scope="module")
def late_outcomes():
    return run_ranks(late_peer, 3, timeout_s=120)


def test_ranks_waiting_for_a_missing_peer_name_it(late_outcomes):
    for rank in (0, 1):
        kind, message, seconds = late_outcomes[rank][0]
        assert kind == "EPTimeoutError", (rank, kind, message)
        assert f"rank {rank} timed out" in message and "dispatch #1 (opening exchange)" in message, message
        assert "Late peer(s): rank 2" in message and f"Waiting here too: rank {1 - rank}" in message, message
        assert TIMEOUT_S <= seconds < TIMEOUT_S + _grace_s(TIMEOUT_S) + SLACK_S, seconds


def test_the_late_peer_times_out_too_and_learns_who_gave_up(late_outcomes):
    kind, message, seconds = late_outcomes[2][0]
    assert kind == "EPTimeoutError", (kind, message)
    assert "rank 2 timed out" in message and "dispatch #1" in message, message
    assert "rank 0 gave up earlier, in dispatch #1 (opening exchange)" in message, message
    assert seconds < TIMEOUT_S + _grace_s(TIMEOUT_S) + SLACK_S, seconds


def test_after_a_timeout_the_backend_refuses_at_once(late_outcomes):
    for rank in range(3):
        kind, message, seconds = late_outcomes[rank][1]
        assert kind == "EPError" and "after an earlier failure" in message and "timed out" in message, message
        assert seconds < 1.0


def barriers_after_a_peer_gave_up(ctx) -> list[tuple[str, str, float]]:
    """Rank 0 gives up in a barrier; only then rank 1 calls barrier twice: the first meets what rank 0 left
    behind, the second waits alone."""
    store = dist.distributed_c10d._get_default_store()
    words = HostCollectives(None, owner="ep_plugin test", timeout_s=TIMEOUT_S, label="repeated barrier")
    if ctx.rank == 0:
        outcomes = [_outcome(lambda: words.barrier(where="barrier"))]
        store.set("repeated barrier: rank 0 gave up", "1")
        store.wait(["repeated barrier: rank 1 is done"], timedelta(seconds=60))  # its report reads our post
        return outcomes
    store.wait(["repeated barrier: rank 0 gave up"], timedelta(seconds=60))
    outcomes = [_outcome(lambda: words.barrier(where="barrier")) for _ in range(2)]
    store.set("repeated barrier: rank 1 is done", "1")
    return outcomes


def test_a_peer_that_gave_up_in_an_earlier_call_of_the_same_name_is_not_waiting_here():
    """Posts named the call only: rank 1, alone in its second barrier, read rank 0's post from the first and said
    "Waiting here too: rank 0" (and named no late peer), though rank 0 had given up a call earlier."""
    first, second = run_ranks(barriers_after_a_peer_gave_up, 2, timeout_s=120)
    assert first[0][0] == "EPTimeoutError", first
    met_leftover, alone = second
    assert met_leftover[0] == "ok", met_leftover
    kind, message, _ = alone
    assert kind == "EPTimeoutError" and "Waiting here too" not in message, message
    assert "rank 0 gave up earlier, in barrier (an earlier call of that name)" in message, message


def late_to_the_next_call(ctx, setup: bool):
    """Rank 1 comes late, to its next call: rank 0 times out in a combine (a barrier, ``setup``) and rank 1's
    dispatch (another barrier) then meets the exchange rank 0 left behind."""
    if setup:
        words = HostCollectives(None, owner="test", timeout_s=TIMEOUT_S, label="late")
        first, late = (lambda: words.barrier(where="barrier A")), (lambda: words.barrier(where="barrier B"))
        again = words.check_usable
    else:
        backend = _reference()
        dispatched = _dispatch(backend)
        first = lambda: backend.combine(dispatched.hidden, dispatched.handle)  # noqa: E731
        late = again = lambda: _dispatch(backend)  # noqa: E731
    return _late_rank_meets_what_the_others_left(ctx, 1, first, late, again)


def _late_rank_meets_what_the_others_left(ctx, late_rank: int, first, late, again):
    """The other ranks run ``first`` (they time out in it, waiting for ``late_rank``); once every one of them
    raised (its timeout post written before), ``late_rank`` runs ``late`` and then ``again``. The others stay
    until then: leaving would close the connections it meets. Store keys, not sleeps: a loaded machine."""
    store = dist.distributed_c10d._get_default_store()
    if ctx.rank != late_rank:
        outcome = _outcome(first)
        store.set(f"late test: rank {ctx.rank} gave up", "1")
        store.wait(["late test: the late rank is done"], timedelta(seconds=90))
        return outcome
    store.wait([f"late test: rank {q} gave up" for q in range(ctx.world_size) if q != late_rank],
               timedelta(seconds=90))
    outcomes = _outcome(late), _outcome(again)
    store.set("late test: the late rank is done", "1")
    return outcomes


@pytest.mark.parametrize("setup", [False, True], ids=["op", "setup step"])
def test_a_rank_late_to_its_next_call_is_told_it_came_late_not_that_ranks_disagree(setup):
    """The late rank's exchange met the one its peer left when it timed out: it raised "ranks disagree on
    dispatch / combine" (which names a wrong call, and says the backend stays usable), and its next op then
    waited out a timeout of its own."""
    gave_up, (late, again) = run_ranks(late_to_the_next_call, 2, setup, timeout_s=120)
    assert gave_up[0] == "EPTimeoutError", gave_up
    where = "barrier A" if setup else "combine of dispatch #1 (opening exchange)"
    assert late[0] == "EPError" and "rank 1 came late to" in late[1], late
    assert f"rank 0 timed out waiting for it, in {where}" in late[1] and "disagree" not in late[1], late
    assert again[0] == "EPError" and "after an earlier failure" in again[1] and again[2] < 1.0, again


def late_to_the_next_call_across_domains(ctx):
    """Two domains of two ranks (forced): global rank 3 comes late, to its next call; its rail peer (rank 1)
    and its domain peer (rank 2) time out in a combine, and rank 3's dispatch meets what they left."""
    backend = ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=8, device="cpu",
                                                 config=Config.from_env(timeout_s=TIMEOUT_S))
    dispatched = _dispatch(backend)
    return _late_rank_meets_what_the_others_left(ctx, 3, lambda: backend.combine(dispatched.hidden, dispatched.handle),
                                                 lambda: _dispatch(backend), lambda: _dispatch(backend))


def test_a_rank_late_to_its_next_call_across_domains_is_told_it_came_late():
    """The same across NVLink domains: the late rank's rail and domain stages met its peers' abandoned ones, and
    it raised "ranks disagree on dispatch / combine", then waited out a timeout in its next op."""
    results = run_ranks(late_to_the_next_call_across_domains, 4, timeout_s=120, env={"EP_PLUGIN_SCALEUP_SIZE": "2"})
    late, again = results[3]
    assert late[0] == "EPError" and "ep_plugin reference: rank 3 came late to dispatch #2" in late[1], late
    # Named as the EP group knows them (rank 1's rail, rank 2's domain), not by their index in the rail or domain
    assert "rank 1 timed out waiting for it, in combine of dispatch #1: rail" in late[1], late
    assert "rank 2 timed out waiting for it, in combine of dispatch #1: domain" in late[1], late
    assert "disagree" not in late[1] and "rank 0" not in late[1], late
    assert again[0] == "EPError" and "after an earlier failure" in again[1] and again[2] < 1.0, again


def refused_in_a_subgroup_after_a_timeout(ctx):
    """Ranks 1 and 2 of a 3-rank world share a group; rank 2 comes late, so rank 1 (the group's rank 0) times out
    and then refuses its next op: both messages must name it as the group's rank and the world's."""
    group = dist.new_group([1, 2])
    if ctx.rank == 0:
        return None
    words = HostCollectives(group, owner="test", timeout_s=TIMEOUT_S, label="subgroup")
    if ctx.rank == 2:
        time.sleep(TIMEOUT_S + _grace_s(TIMEOUT_S) + 1.5)
    outcomes = _outcome(lambda: words.barrier(where="a barrier")), _outcome(words.check_usable)
    if ctx.rank == 1:  # stay until rank 2 timed out too (leaving would close the connection it waits on)
        time.sleep(TIMEOUT_S + 2 * _grace_s(TIMEOUT_S) + 2.5)
    return outcomes


def test_a_rank_of_a_subgroup_is_named_by_its_global_rank_too():
    """check_usable (and the twin's failures) said 'rank 0' for the group's rank 0, which is global rank 1."""
    timed_out, refused = run_ranks(refused_in_a_subgroup_after_a_timeout, 3, timeout_s=120)[1]
    assert timed_out[0] == "EPTimeoutError" and "test: rank 0 (global rank 1) timed out" in timed_out[1], timed_out
    assert refused[0] == "EPError" and "test: rank 0 (global rank 1) cannot run more ops" in refused[1], refused


def another_owner_after_a_timeout(ctx):
    """Two backends on one world. Rank 1 comes late: rank 0 times out in the first, then calls the second.
    Before: that call ran on the group left out of step, met rank 1's late ops of the first backend with
    another size, and gloo aborted both processes (SIGABRT); now it is refused at once."""
    first, second = _reference(), _reference()
    if ctx.rank == 1:
        time.sleep(TIMEOUT_S + _grace_s(TIMEOUT_S) + 1.5)
    outcomes = _outcome(lambda: _dispatch(first)), _outcome(lambda: _dispatch(second))
    if ctx.rank == 0:  # stay until rank 1 timed out too (leaving would close the connection it waits on)
        time.sleep(TIMEOUT_S + 2 * _grace_s(TIMEOUT_S) + 2.5)
    return outcomes


def test_after_a_timeout_every_owner_on_the_group_refuses_at_once():
    results = run_ranks(another_owner_after_a_timeout, 2, timeout_s=120)  # raises if a rank was killed
    kind, message, _ = results[0][0]
    assert kind == "EPTimeoutError" and "Late peer(s): rank 1" in message, (kind, message)
    for rank in (0, 1):
        kind, message, seconds = results[rank][1]
        assert kind == "EPError" and "after an earlier failure on this process group" in message, (rank, message)
        assert "timed out in dispatch #1" in message and seconds < 1.0, (rank, message, seconds)


def reference_across_a_restart(ctx):
    """A reference backend on EP groups [0, 1] and [2, 3], then, after destroy_process_group and a new
    world in the same processes, on [0, 2] and [1, 3]: torch gives the new groups the old names, so a count
    of backends by group name (each backend's number, which the ranks compare in every op) differed
    between the ranks of a new group, and every op raised."""
    store = dist.distributed_c10d._get_default_store()
    x, topk_idx = torch.ones(2, HIDDEN), torch.tensor([[0, 1], [2, 3]])
    for world, layout in enumerate(([[0, 1], [2, 3]], [[0, 2], [1, 3]])):
        if world:
            dist.destroy_process_group()
            dist.init_process_group("gloo", store=dist.PrefixStore("restart/", store), rank=ctx.rank, world_size=4)
        groups = [dist.new_group(members) for members in layout]
        mine = next(group for group, members in zip(groups, layout, strict=True) if ctx.rank in members)
        backend = ep_plugin.get_backend("reference")(mine, hidden_size=HIDDEN, num_experts=4, device="cpu",
                                                     config=Config.from_env(timeout_s=TIMEOUT_S))
        out = backend.dispatch(x, topk_idx=topk_idx)
        assert torch.equal(backend.combine(out.hidden, out.handle).hidden, 2 * x)
        backend.destroy()
    return True


def test_a_backend_in_a_restarted_world_meets_its_peers():
    assert run_ranks(reference_across_a_restart, 4, timeout_s=120) == [True] * 4


def late_peer_on_a_group_of_a_shorter_timeout(ctx):
    """A group made with a 2 s engine timeout, a backend on it with timeout_s=10; rank 2 comes 4 s late."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    backend = ep_plugin.get_backend("reference")(group, hidden_size=HIDDEN, num_experts=EXPERTS, device="cpu",
                                                 config=Config.from_env(timeout_s=10.0))
    store = dist.distributed_c10d._get_default_store()
    if ctx.rank == 2:
        time.sleep(4.0)
    outcome = _outcome(lambda: _dispatch(backend))
    if ctx.rank == 2:
        store.set("rank 2 done", "1")
    else:
        store.wait(["rank 2 done"])  # alive until then (leaving would close the connection rank 2 waits on)
    return outcome


def test_a_late_peer_is_named_when_the_groups_own_shorter_timeout_ends_the_wait():
    # gloo's own timeout ended the wait first: this was an EPError blaming an exited peer or another collective.
    for rank, (kind, message, seconds) in enumerate(run_ranks(late_peer_on_a_group_of_a_shorter_timeout, 3,
                                                             timeout_s=120)[:2]):
        assert kind == "EPTimeoutError", (rank, kind, message)
        assert "Late peer(s): rank 2" in message and "the process group's own timeout" in message, message
        assert seconds < 2.0 + _grace_s(10.0) + SLACK_S, seconds


def late_peer_under_torchs_debug_wrapper(ctx):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL (set by the test): torch wraps the group's gloo in a ProcessGroupWrapper.
    Rank 1 comes to a barrier long after rank 0's timeout."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    collectives = HostCollectives(group, owner="test", timeout_s=TIMEOUT_S, label="debug wrapper")
    facts = {"wrapped": type(group._get_backend(torch.device("cpu"))).__name__,
             "gathered": collectives.all_gather_object(ctx.rank * 10, where="a gather under the wrapper")}
    store = dist.distributed_c10d._get_default_store()
    if ctx.rank == 1:
        time.sleep(TIMEOUT_S + _grace_s(TIMEOUT_S) + SLACK_S + 2.0)
    facts["late barrier"] = _outcome(lambda: collectives.barrier(where="late barrier"))
    if ctx.rank == 1:
        store.set("debug wrapper/rank 1 done", "1")
    else:
        store.wait(["debug wrapper/rank 1 done"])  # alive until then (leaving would close its connection)
    return facts


def test_torchs_debug_wrapper_does_not_lengthen_the_wait():
    """Before: the wrapper's issue-time check against the peers blocked the caller until the late peer came (or
    the group's 60 s timeout, then "failed in gloo"): rank 0 waited out rank 1's whole delay, and the barrier
    passed. Now the collectives go on the wrapped engine and the timeout holds."""
    facts = run_ranks(late_peer_under_torchs_debug_wrapper, 2, timeout_s=120,
                      env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})[0]
    assert "ProcessGroupWrapper" in facts["wrapped"], facts  # the case under test, not a plain gloo
    assert facts["gathered"] == [0, 10], facts
    kind, message, seconds = facts["late barrier"]
    assert kind == "EPTimeoutError" and "Late peer(s): rank 1" in message, (kind, message)
    assert seconds < TIMEOUT_S + _grace_s(TIMEOUT_S) + SLACK_S, seconds


STORE_FROZEN_S = 15.0  # past the bound below, so a report that waited for the store would fail the test


def _meet_in_rank_0s_tcp_store(ctx) -> None:
    """The launcher's world meets in a file store, which no process hosts: this one meets in rank 0's TCP
    store, which stops with rank 0 (``_freeze_rank_0``)."""
    files = dist.distributed_c10d._get_default_store()
    if ctx.rank == 0:
        hosted = dist.TCPStore("127.0.0.1", 0, ctx.world_size, is_master=True, wait_for_workers=False)
        files.set("frozen store port", str(hosted.port))
    port = int(files.get("frozen store port"))
    dist.destroy_process_group()
    store = hosted if ctx.rank == 0 else dist.TCPStore("127.0.0.1", port, ctx.world_size, is_master=False)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world_size)


def _freeze_rank_0() -> None:
    """SIGSTOP (its store server stops with it, as on a host that froze or dropped off the network without a
    reset), resumed STORE_FROZEN_S later."""
    subprocess.Popen(["sh", "-c", f"sleep {STORE_FROZEN_S}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)


def peers_of_a_frozen_store_host(ctx):
    """Rank 0, which hosts the default store, stops and is resumed later; ranks 1 and 2 dispatch."""
    _meet_in_rank_0s_tcp_store(ctx)
    backend = _reference()
    dist.barrier()
    if ctx.rank == 0:
        _freeze_rank_0()
        return None
    return _outcome(lambda: _dispatch(backend))


def disagreement_under_a_frozen_store_host(ctx):
    """Ranks 1 and 2 run two different setup steps in a group of their own while rank 0, the store's host,
    is stopped: the came-late check reads the store for timeout posts."""
    _meet_in_rank_0s_tcp_store(ctx)
    group = dist.new_group([1, 2])
    words = HostCollectives(group, owner="test", timeout_s=30.0, label="frozen") if ctx.rank else None
    dist.barrier()
    if ctx.rank == 0:
        _freeze_rank_0()
        return None
    return _outcome(lambda: words.barrier(where=f"barrier {ctx.rank}"))


def test_a_disagreement_does_not_wait_for_a_store_that_stopped_answering():
    """The came-late check's store reads had no bound but the store's own timeout (30 min by default): a
    disagreement's error waited for rank 0's resumption. Now the reads give up as the timeout report's do."""
    for rank, (kind, message, seconds) in enumerate(run_ranks(disagreement_under_a_frozen_store_host, 3,
                                                             timeout_s=120)[1:], start=1):
        assert kind == "EPError" and "in another setup step" in message, (rank, kind, message)
        assert seconds < _STORE_ANSWER_S + SLACK_S < STORE_FROZEN_S, seconds


def test_a_timeout_report_does_not_wait_for_a_store_that_stopped_answering():
    # Before: each store call of the report waited for the store's own timeout (30 min by default); the
    # error came only once rank 0 was resumed, STORE_FROZEN_S later.
    for rank, (kind, message, seconds) in enumerate(run_ranks(peers_of_a_frozen_store_host, 3,
                                                             timeout_s=120)[1:], start=1):
        assert kind == "EPTimeoutError", (rank, kind, message)
        assert "the store did not answer within" in message and "any of rank 0, rank" in message, message
        assert seconds < TIMEOUT_S + 2 * _grace_s(TIMEOUT_S) + _STORE_ANSWER_S + SLACK_S, seconds


def departed_peer(ctx):
    """Rank 1 builds the backend and leaves; rank 0 dispatches."""
    backend = _reference()
    if ctx.rank == 1:
        return None
    return _outcome(lambda: _dispatch(backend))


def test_a_departed_peer_gives_an_ep_error_with_the_engine_message():
    kind, message, seconds = run_ranks(departed_peer, 2, timeout_s=120)[0]
    assert kind in ("EPError", "EPTimeoutError"), (kind, message)
    if kind == "EPError":  # gloo noticed the closed connection: its message, wrapped, and the peer named
        assert "rank 0: dispatch #1 (opening exchange) failed in gloo:" in message, message
        assert "No report from rank 1 within" in message, message
    else:  # it did not: the peer is named as late, after the timeout (an engine error told as a timeout at once
        # would send the user to raise EP_PLUGIN_TIMEOUT_S for a peer that is gone)
        assert "Late peer(s): rank 1" in message and seconds >= TIMEOUT_S, (message, seconds)
    assert seconds < TIMEOUT_S + _grace_s(TIMEOUT_S) + SLACK_S, seconds


def late_construction(ctx):
    """Rank 1 builds its backend only after rank 0 gave up waiting for it."""
    if ctx.rank == 1:
        time.sleep(TIMEOUT_S + _grace_s(TIMEOUT_S) + 1.5)
    outcome = _outcome(_reference)
    if ctx.rank == 0:  # stay until rank 1 timed out too
        time.sleep(TIMEOUT_S + 2 * _grace_s(TIMEOUT_S) + 2.5)
    return outcome


def test_construction_waits_with_the_timeout_too():
    outcomes = run_ranks(late_construction, 2, timeout_s=120)
    kind, message, seconds = outcomes[0]
    assert kind == "EPTimeoutError", (kind, message)
    assert "building the reference backend" in message and "Late peer(s): rank 1" in message, message
    assert seconds < TIMEOUT_S + _grace_s(TIMEOUT_S) + SLACK_S, seconds
    kind, message, _ = outcomes[1]
    assert kind == "EPTimeoutError" and "rank 0 gave up earlier" in message, (kind, message)


class _ProtocolBarrierBackend(Backend):
    """A backend that keeps the protocol's own ``barrier`` (as a backend from another package may)."""

    name = "protocol_barrier"
    capabilities = Capabilities(devices=("cpu",), hidden_dtypes=(torch.float32,), probs_dtypes=(torch.float32,))

    def _dispatch(self, hidden, routing, probs, pad_multiple, **options):
        raise NotImplementedError

    def _dispatch_again(self, hidden, handle):
        raise NotImplementedError

    def _combine(self, rows, handle, row_probs, **options):
        raise NotImplementedError


def missing_at_the_protocol_barrier(ctx):
    """Rank 1 builds the backend, then stays (alive, silent) until rank 0 gave up on the barrier."""
    backend = _ProtocolBarrierBackend(hidden_size=HIDDEN, num_experts=EXPERTS, device="cpu",
                                      config=Config.from_env(timeout_s=TIMEOUT_S))
    store = dist.distributed_c10d._get_default_store()
    if ctx.rank == 1:  # leaving would close the connection rank 0 waits on: another error than a timeout
        deadline = time.monotonic() + TIMEOUT_S + _grace_s(TIMEOUT_S) + 2 * SLACK_S
        while time.monotonic() < deadline and not store.check(["protocol_barrier/gave_up"]):
            time.sleep(0.05)
        return None
    outcome = _outcome(backend.barrier)
    store.set("protocol_barrier/gave_up", "1")
    return outcome


def test_the_protocol_barrier_waits_with_the_timeout_too():
    """Before: ``Backend.barrier`` was a plain ``dist.barrier``, which waits for the process group's own
    timeout (30 min on gloo) and then says nothing of ep_plugin's rank, phase or peer."""
    kind, message, seconds = run_ranks(missing_at_the_protocol_barrier, 2, timeout_s=60)[0]
    assert kind == "EPTimeoutError", (kind, message)
    assert "rank 0 timed out" in message and "in barrier over gloo" in message, message
    assert "Late peer(s): rank 1" in message, message
    assert seconds < TIMEOUT_S + _grace_s(TIMEOUT_S) + SLACK_S, seconds


def test_words_over_nccl_go_to_the_owners_gpu_not_the_current_one():
    """A job that passes ``device=`` without ``torch.cuda.set_device`` had every rank's host words on the
    current GPU (GPU 0 everywhere), which NCCL refuses or waits on; gloo moves host memory."""
    assert word_device("nccl", torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert word_device("nccl", "cuda:1") == torch.device("cuda", 1)
    assert word_device("gloo", torch.device("cuda", 3)) == torch.device("cpu")
    assert word_device("gloo", None) == torch.device("cpu")


# ---- the gloo twin: host words of an NCCL group travel on gloo ------------------------------------
# These run on gloo groups, calling ``use_gloo_twin`` directly: the twin is made for NCCL groups
# (``on_host=True``), which need a GPU per rank; making and using it is the same code.

def twin_of_subgroups(ctx):
    """EP groups [0, 2] and [1, 3] of a 4-rank world, each rank's words gathered over the twin; rank 0
    belongs to one more group than the others (the case where torch's own names for new groups differ)."""
    subgroups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    if ctx.rank == 0:
        dist.new_group([0], use_local_synchronization=True)
    mine = subgroups[ctx.rank % 2]
    first = HostCollectives(mine, owner="test", timeout_s=TIMEOUT_S, label="twin a")
    first.use_gloo_twin()
    second = HostCollectives(mine, owner="test", timeout_s=TIMEOUT_S, label="twin b")
    second.use_gloo_twin()
    facts = {
        "shared": first._twin is not None and second._twin is first._twin,
        "engine": first.engine,
        "word device": str(first.word_device),
        "rank": (first.rank, first._twin.gloo.rank(), dist.get_rank(mine)),
        "gathered": first.all_gather_object(dist.get_rank(), where="twin gather"),
    }
    # The twin goes with its last owner (its sockets, its hold on the store); a later owner meets anew.
    twin = weakref.ref(first._twin)
    first.release()
    facts["kept by the second owner"] = twin() is not None
    second.release()
    facts["gone with the last"] = twin() is None
    third = HostCollectives(mine, owner="test", timeout_s=TIMEOUT_S, label="twin c")
    third.use_gloo_twin()
    facts["gathered anew"] = third.all_gather_object(dist.get_rank() + 1, where="twin gather anew")
    # An in-process restart with another layout: the groups of the new world reuse the old names for other
    # ranks ("1" was [0, 2], is now [0, 1]); the ranks must still meet.
    store = dist.distributed_c10d._get_default_store()
    del third
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("restart/", store), rank=ctx.rank, world_size=4)
    subgroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = subgroups[ctx.rank // 2]
    fourth = HostCollectives(mine, owner="test", timeout_s=TIMEOUT_S, label="twin d")
    fourth.use_gloo_twin()
    facts["gathered after a restart"] = fourth.all_gather_object(dist.get_rank() * 10, where="after a restart")
    return facts


def test_a_gloo_twin_has_its_groups_ranks_in_order_and_goes_with_its_last_owner():
    results = run_ranks(twin_of_subgroups, 4, timeout_s=120)
    for rank, facts in enumerate(results):
        members = [0, 2] if rank % 2 == 0 else [1, 3]
        assert facts["shared"] and facts["kept by the second owner"] and facts["gone with the last"], facts
        assert facts["engine"] == "gloo" and facts["word device"] == "cpu", facts
        assert facts["rank"] == (members.index(rank),) * 3, facts
        assert facts["gathered"] == members and facts["gathered anew"] == [m + 1 for m in members], facts
        after = [0, 10] if rank < 2 else [20, 30]
        assert facts["gathered after a restart"] == after, facts


def missing_at_the_twin(ctx):
    """Ranks 0 and 1 make the twin of the world; rank 2 stays silent until both gave up."""
    store = dist.distributed_c10d._get_default_store()
    if ctx.rank == 2:  # alive and connected: the others must time out, not see a closed socket
        deadline = time.monotonic() + 3 * (TIMEOUT_S + SLACK_S)
        while time.monotonic() < deadline and not store.check(["twin/gave_up/0", "twin/gave_up/1"]):
            time.sleep(0.05)
        return None
    collectives = HostCollectives(None, owner="ep_plugin test", timeout_s=TIMEOUT_S, label="twin")
    outcome = _outcome(collectives.use_gloo_twin)
    store.set(f"twin/gave_up/{ctx.rank}", "1")
    # No collective ran on the group itself: its other owners may still use it.
    other = _outcome(HostCollectives(None, owner="ep_plugin test", timeout_s=TIMEOUT_S, label="other").check_usable)
    return outcome + (other,)


def test_a_peer_that_never_comes_to_make_the_twin_is_named():
    """Without the wrap, torch's DistStoreError ("wait timeout after ... keys: ...") named no rank. And the
    twin's making marks only its owner failed: it marked the group itself, refusing every owner on it."""
    for kind, message, seconds, other in run_ranks(missing_at_the_twin, 3, timeout_s=120)[:2]:
        assert other[0] == "ok", other
        assert kind == "EPTimeoutError", (kind, message)
        assert "making a gloo group of the gloo group's ranks" in message, message
        assert "Late peer(s): rank 2" in message, message
        assert seconds < TIMEOUT_S + 3 * _grace_s(TIMEOUT_S) + 1.0 + SLACK_S, seconds


def failing_at_the_twin(ctx, peers_first: bool):
    """Rank 1's gloo cannot connect (a wrong interface, say): its making fails at once. ``peers_first``: ranks 0
    and 2 are waiting in theirs by then (rank 1 comes after them); else they come once it failed. Each rank
    stays until all three are done (leaving would close connections the others wait on)."""
    store = dist.distributed_c10d._get_default_store()
    if ctx.rank == 1:
        def refuse(*args, **kwargs):
            raise RuntimeError("[gloo] Connect refused (simulated)\nmore of gloo's text")

        dist.ProcessGroupGloo = refuse  # this rank process's own, gone with it
        if peers_first:
            store.wait(["failing twin/coming/0", "failing twin/coming/2"])
            time.sleep(0.5)  # they are in gloo's making by then
    elif peers_first:
        store.set(f"failing twin/coming/{ctx.rank}", "1")
    else:
        store.wait(["failing twin/rank 1 failed"])
    outcome = _outcome(HostCollectives(None, owner="ep_plugin test", timeout_s=TIMEOUT_S, label="twin").use_gloo_twin)
    if ctx.rank == 1:
        store.set("failing twin/rank 1 failed", "1")
    store.set(f"failing twin/done/{ctx.rank}", "1")
    store.wait([f"failing twin/done/{rank}" for rank in range(3)])
    return outcome


@pytest.mark.parametrize("peers_first", [True, False])
def test_a_peer_that_failed_making_the_twin_is_quoted_not_called_late(peers_first):
    """Before: ranks already waiting timed out and named rank 1 a late peer ("came late or never ... Raise
    EP_PLUGIN_TIMEOUT_S"), although it had come and failed at once; ranks that came after its failure heard
    only "rank 1 could not connect or timed out". It said why in its own error alone."""
    results = run_ranks(failing_at_the_twin, 3, peers_first, timeout_s=120)
    kind, message, seconds = results[1]
    assert kind == "EPError" and "gloo could not connect: [gloo] Connect refused (simulated)" in message, results[1]
    for rank in (0, 2):
        kind, message, seconds = results[rank]
        assert kind == "EPError", (rank, kind, message)
        if peers_first:
            assert "peers that came and failed: rank 1: [gloo] Connect refused (simulated)." in message, message
            assert "Late peer(s): rank 1" not in message and "GLOO_SOCKET_IFNAME" in message, message
            assert seconds < TIMEOUT_S + 3 * _grace_s(TIMEOUT_S) + 1.0 + SLACK_S, seconds
        else:
            assert "gave up making this gloo group (rank 1 could not connect: [gloo] Connect refused (simulated))" \
                in message, message
            assert seconds < 1.0, seconds


def slow_peer_on_a_twin_of_a_longer_timeout(ctx):
    """Two owners on one group: the twin is made by one with a short timeout, then used by one with a
    longer timeout, whose peer arrives after the short one but well within the long one."""
    short = HostCollectives(None, owner="test", timeout_s=1.0, label="short")
    short.use_gloo_twin()
    long = HostCollectives(None, owner="test", timeout_s=30.0, label="long")
    long.use_gloo_twin()
    if ctx.rank == 1:
        time.sleep(4.0)
    return _outcome(lambda: long.all_gather_object(ctx.rank, where="a slow gather"))


def twin_again_after_a_failed_making(ctx):
    """Ranks 0 and 1 make the twin of the world while rank 2 does not (its EP_PLUGIN_GLOO_HOST_WORDS differed,
    say); once both gave up, all three make it again in the same processes."""
    store = dist.distributed_c10d._get_default_store()
    first = None
    if ctx.rank < 2:
        first = _outcome(HostCollectives(None, owner="ep_plugin test", timeout_s=TIMEOUT_S,
                                         label="first twin").use_gloo_twin)
        store.set(f"again/gave_up/{ctx.rank}", "1")
    store.wait(["again/gave_up/0", "again/gave_up/1"])
    again = _outcome(HostCollectives(None, owner="ep_plugin test", timeout_s=TIMEOUT_S,
                                     label="second twin").use_gloo_twin)
    store.set(f"again/done/{ctx.rank}", "1")
    store.wait([f"again/done/{rank}" for rank in range(3)])  # no rank leaves while another waits
    return first, again


def test_a_twin_made_again_after_a_making_a_rank_never_joined_is_refused_at_once():
    # Before: the makings' count in the store was out of step, so the ranks split across two numbers: rank 2
    # met stale addresses ("Connection refused"), the others timed out blaming it although it had come.
    results = run_ranks(twin_again_after_a_failed_making, 3, timeout_s=120)
    for rank in (0, 1):
        first, again = results[rank]
        assert first[0] == "EPTimeoutError" and "Late peer(s): rank 2" in first[1], first
        kind, message, seconds = again
        assert kind == "EPError" and "an earlier making of it failed in this process (timed out" in message, again
        assert "build a new process group" in message and seconds < 1.0, again
    kind, message, seconds = results[2][1]  # the ranks it comes to gave up on that making: it hears so
    assert kind == "EPError" and "the other ranks gave up making this gloo group" in message, results[2]
    assert "EP_PLUGIN_GLOO_HOST_WORDS=0" in message and seconds < 1.0, results[2]


def test_each_owner_waits_its_own_timeout_on_a_shared_twin():
    """Before: the twin's gloo timeout was its maker's, so the 30 s owner's gather failed after ~3 s."""
    for kind, message, _ in run_ranks(slow_peer_on_a_twin_of_a_longer_timeout, 2, timeout_s=120):
        assert kind == "ok", (kind, message)


def test_only_groups_that_move_no_host_memory_get_a_twin():
    assert not moves_host_memory("nccl") and not moves_host_memory("cuda:nccl")
    assert moves_host_memory("gloo") and moves_host_memory("cpu:gloo,cuda:nccl")


@pytest.mark.parametrize("engine, host, cuda", [
    ("gloo", True, "gloo"), ("nccl", False, "nccl"), ("NCCL", False, "nccl"),
    ("cuda:nccl", False, "nccl"),  # init_process_group("cuda:nccl")
    ("cpu:gloo", True, None), ("cpu:gloo,cuda:nccl", True, "nccl"), ("cuda:nccl,cpu:gloo", True, "nccl"),
    ("cpu:gloo,cuda:gloo", True, "gloo"), ("ucc", True, "ucc"),
])
def test_every_spelling_of_a_groups_engine_is_read_alike(engine, host, cuda):
    """Before: word_device, the reference's staging and the rails' engine compared with "nccl" exactly, so a
    "cuda:nccl" group got its host-read words in host memory, which NCCL alone cannot move, and the reference
    staged its CUDA rows through the host on it."""
    assert engine_for(engine, "cuda") == cuda, engine
    assert moves_host_memory(engine) == host, engine
    assert nccl_moves_cuda(engine) == (cuda == "nccl"), engine
    expected = torch.device("cpu") if host else torch.device("cuda", 3)
    assert word_device(engine, torch.device("cuda", 3)) == expected, engine


def reference_on_a_group_made_cpu_gloo(ctx):
    """torch spells a group made with backend="cpu:gloo" as such: what the engine questions read there."""
    group = dist.new_group([0, 1], backend="cpu:gloo")
    engine = dist.get_backend(group)
    backend = ep_plugin.get_backend("reference")(group, hidden_size=HIDDEN, num_experts=4, device="cpu",
                                                 config=Config.from_env(timeout_s=TIMEOUT_S))
    x = torch.arange(4 * HIDDEN, dtype=torch.float32).reshape(4, HIDDEN)
    out = backend.dispatch(x, topk_idx=torch.tensor([[0], [1], [2], [3]]))
    back = backend.combine(out.hidden, out.handle).hidden
    return (engine, moves_host_memory(engine), nccl_moves_cuda(engine), str(backend._comm.word_device),
            bool(torch.equal(back, x)))


def test_a_cpu_gloo_group_is_read_as_gloo():
    for facts in run_ranks(reference_on_a_group_made_cpu_gloo, 2, timeout_s=60):
        assert facts == ("cpu:gloo", True, False, "cpu", True), facts


def on_host_over_gloo(ctx):
    collectives = HostCollectives(None, owner="test", timeout_s=TIMEOUT_S, label="on host", on_host=True)
    return collectives._twin is None and collectives.group is dist.group.WORLD


def test_host_words_of_a_gloo_group_stay_on_it():
    assert run_ranks(on_host_over_gloo, 2, timeout_s=60) == [True, True]


# ---- on the GPU: the twin chosen for an NCCL group ------------------------------------------------
# One rank per GPU makes an NCCL world: one rank on one GPU, two where two are visible.

NCCL_RANKS = max(1, min(2, torch.cuda.device_count()))


def host_words_over_nccl(ctx):
    """Each backend built with the knob on and off: where its host words went, and a round trip."""
    facts = {"engine": dist.get_backend()}
    experts = 4 * ctx.world_size
    for name in ("reference", "hybrid"):
        for on in (True, False):
            config = Config.from_env(gloo_host_words=on, timeout_s=30.0, max_tokens_per_rank=64)
            backend = ep_plugin.get_backend(name)(hidden_size=256, num_experts=experts, device=ctx.device,
                                                  config=config)
            words = backend._words if name == "reference" else backend.buffer._collectives
            x = torch.arange(32 * 256, device=ctx.device).remainder(7).reshape(32, 256).to(torch.bfloat16)
            topk_idx = torch.stack([torch.arange(32), torch.arange(32) + 1], 1).remainder(experts).to(ctx.device)
            out = backend.dispatch(x, topk_idx=topk_idx)
            back = backend.combine(out.hidden, out.handle).hidden
            facts[(name, on)] = (words._twin is not None, backend._host._twin is not None, words.engine,
                                 bool(torch.equal(back, x * 2)))
            backend.destroy()
    return facts


@pytest.mark.gpu
def test_host_words_of_an_nccl_group_go_over_its_gloo_twin():
    for facts in run_ranks(host_words_over_nccl, NCCL_RANKS, device="cuda", timeout_s=300):
        assert facts["engine"] == "nccl", facts
        for name in ("reference", "hybrid"):
            assert facts[(name, True)] == (True, True, "gloo", True), (name, facts)
            assert facts[(name, False)] == (False, False, "nccl", True), (name, facts)


def nccl_under_torchs_debug_wrapper(ctx):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL over NCCL: the reference backend's words and payload go on the engine under
    the wrapper (host words on the NCCL group itself: gloo_host_words off); on two GPUs rank 1 comes late to a
    barrier (one exchange the host reads: a late op would leave rank 1 a payload kernel waiting for rank 0)."""
    experts = 4 * ctx.world_size
    config = Config.from_env(gloo_host_words=False, timeout_s=TIMEOUT_S, max_tokens_per_rank=64)
    backend = ep_plugin.get_backend("reference")(hidden_size=256, num_experts=experts, device=ctx.device,
                                                 config=config)
    x = torch.arange(32 * 256, device=ctx.device).remainder(7).reshape(32, 256).to(torch.bfloat16)
    topk_idx = torch.stack([torch.arange(32), torch.arange(32) + 1], 1).remainder(experts).to(ctx.device)
    out = backend.dispatch(x, topk_idx=topk_idx)
    facts = {"wrapped": type(dist.group.WORLD._get_backend(torch.device("cuda"))).__name__,
             "issued on": type(backend._comm._engine_under_wrapper("cuda")).__name__,
             "round trip": bool(torch.equal(backend.combine(out.hidden, out.handle).hidden, x * 2))}
    if ctx.world_size == 2:
        store = dist.distributed_c10d._get_default_store()
        if ctx.rank == 1:
            time.sleep(TIMEOUT_S + _grace_s(TIMEOUT_S) + SLACK_S + 2.0)
        facts["late barrier"] = _outcome(lambda: backend._comm.barrier(where="late barrier"))
        if ctx.rank == 1:
            store.set("nccl debug wrapper/rank 1 done", "1")
        else:
            store.wait(["nccl debug wrapper/rank 1 done"])
    return facts


@pytest.mark.gpu
def test_torchs_debug_wrapper_does_not_lengthen_the_wait_over_nccl():
    facts = run_ranks(nccl_under_torchs_debug_wrapper, NCCL_RANKS, device="cuda", timeout_s=300,
                      env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})[0]
    assert "ProcessGroupWrapper" in facts["wrapped"] and "NCCL" in facts["issued on"], facts
    assert facts["round trip"], facts
    if NCCL_RANKS == 2:
        kind, message, seconds = facts["late barrier"]
        assert kind == "EPTimeoutError" and "Late peer(s): rank 1" in message, (kind, message)
        assert seconds < TIMEOUT_S + _grace_s(TIMEOUT_S) + SLACK_S, seconds
