"""Ranks that disagree get a named error on every rank: never a crash, a hang or wrong rows.

Each launch runs several scenarios inside the rank processes (launches are the slow part);
every scenario records, per rank, the exception type, its message and how long it took, so
a test can check that *every* rank got the error and that no process died (``run_ranks``
raises if one does).
"""

import time
from types import SimpleNamespace

import pytest
import torch

import ep_plugin
from ep_plugin.agreement import OP_COMBINE, OP_DISPATCH, OpFingerprint, check_construction, mismatch_message
from ep_plugin.backends.compiled import CompiledBackend, op_range
from ep_plugin.config import Config
from ep_plugin.errors import EPError, TooManyTokensError
from ep_plugin.host_collectives import HostCollectives
from ep_plugin.testing import run_ranks
from ep_plugin.testing.launcher import _environment

HIDDEN = 8
TIMEOUT_S = 20.0  # nothing here waits for it: a mismatch must be reported at once
NUM_RANKS = 3  # the odd rank out is the last: the two that agree with each other must raise too
ODD = NUM_RANKS - 1


def _outcome(action) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        action()
        return "ok", "", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 - the test inspects the type
        return type(exc).__name__, str(exc), time.monotonic() - start


def _reference(**kwargs):
    config = Config.from_env(timeout_s=TIMEOUT_S, **kwargs.pop("config", {}))
    return ep_plugin.get_backend("reference")(config=config, device="cpu", **kwargs)


class _Picky(ep_plugin.get_backend("reference")):
    """A backend subclass with an argument of its own, which its ``check_build_arguments`` refuses."""

    def __init__(self, group=None, *, flavour: int = 0, **kwargs):
        super().__init__(group, **kwargs)

    @classmethod
    def check_build_arguments(cls, group=None, *, flavour: int = 0, **kwargs):
        super().check_build_arguments(group, flavour=flavour, **kwargs)
        if flavour < 0:
            raise ValueError(f"flavour must be >= 0, got {flavour}")


def construction_scenarios(ctx) -> dict:
    odd = ctx.rank == ODD
    experts = 2 * NUM_RANKS
    outcomes = {
        "hidden_size": _outcome(lambda: _reference(hidden_size=2 * HIDDEN if odd else HIDDEN, num_experts=experts)),
        "num_experts": _outcome(lambda: _reference(hidden_size=HIDDEN, num_experts=2 * experts if odd else experts)),
        "max_tokens_per_rank": _outcome(lambda: _reference(hidden_size=HIDDEN, num_experts=experts,
                                                           config=dict(max_tokens_per_rank=64 if odd else 128))),
    }

    # Refused on one rank alone, before any exchange of its own: the topology's exchange tells the others.
    outcomes["indivisible"] = _outcome(lambda: _reference(hidden_size=HIDDEN,
                                                          num_experts=experts + 1 if odd else experts))
    outcomes["bad_hidden"] = _outcome(lambda: _reference(hidden_size=0 if odd else HIDDEN, num_experts=experts))
    outcomes["bad_kwarg"] = _outcome(lambda: _reference(hidden_size=HIDDEN, num_experts=experts,
                                                        **({"flavour": 1} if odd else {})))
    outcomes["bad_device"] = _outcome(lambda: ep_plugin.get_backend("reference")(
        hidden_size=HIDDEN, num_experts=experts, device="cuda:99" if odd else "cpu",
        config=Config.from_env(timeout_s=TIMEOUT_S)))
    # The subclass's own check, which Backend.__new__ must ask before the exchange (nothing after it would).
    outcomes["own_check"] = _outcome(lambda: _Picky(hidden_size=HIDDEN, num_experts=experts, device="cpu",
                                                     config=Config.from_env(timeout_s=TIMEOUT_S),
                                                     flavour=-1 if odd else 0))
    outcomes["bad_knob"] = _outcome(lambda: _built_under_env(
        {"EP_PLUGIN_TIMEOUT_S": str(TIMEOUT_S), **({"EP_PLUGIN_MAX_TOKENS_PER_RANK": "0"} if odd else {})},
        lambda: ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=experts, device="cpu")))

    def agreed_build_still_works():
        backend = _reference(hidden_size=HIDDEN, num_experts=experts)
        out = backend.dispatch(torch.ones(4, HIDDEN), topk_idx=torch.tensor([[0], [1], [2], [3]]))
        # Every rank sends one token to each of experts 0-3: ranks 0 and 1 own them.
        assert out.tokens_per_expert.tolist() == ([NUM_RANKS] * 2 if ctx.rank < 2 else [0, 0])

    outcomes["agreed"] = _outcome(agreed_build_still_works)
    # A backend version that checks one field more on some ranks (a mixed install): the others, whose own
    # fields all agree, must raise too.
    facts = {"hidden_size": HIDDEN, **({"num_sms": 8} if odd else {})}
    outcomes["fields"] = _outcome(lambda: check_construction(None, "reference", facts, timeout_s=TIMEOUT_S))
    # The same, where the field's value on that rank is None: a missing field read as None there, and the odd
    # rank, whose fields hold every rank's, passed while the others raised (or waited in its next collective).
    facts = {"hidden_size": HIDDEN, **({"arena": None} if odd else {})}
    outcomes["fields_none"] = _outcome(lambda: check_construction(None, "reference", facts, timeout_s=TIMEOUT_S))
    return outcomes


def _built_under_env(env: dict, build):
    """``build()`` with ``env`` set in this process (the backend reads its knobs then), restored after."""
    with _environment(env):
        return build()


@pytest.mark.parametrize("scenario, reason", [
    ("indivisible", f"num_experts={2 * NUM_RANKS + 1} is not divisible by the {NUM_RANKS} ranks"),
    ("bad_hidden", "hidden_size must be a positive int, got 0"),
    ("bad_knob", "EP_PLUGIN_MAX_TOKENS_PER_RANK"),
    ("bad_kwarg", "flavour"),
    ("own_check", "flavour must be >= 0, got -1"),
    ("bad_device", "AssertionError"),  # torch's "not compiled with CUDA enabled", or "Invalid device id" (GPU 99)
])
def test_an_argument_refused_on_one_rank_raises_on_every_rank_at_once(construction_outcomes, scenario, reason):
    """Before, the rank raised alone before the topology's exchange and its peers waited for it there until the
    timeout, then named it a late peer."""
    for rank, outcomes in enumerate(construction_outcomes):
        kind, message, seconds = outcomes[scenario]
        assert reason in f"{kind}: {message}", (rank, kind, message)
        assert kind == "ValueError" if rank != ODD else kind != "EPTimeoutError", (rank, kind, message)
        if rank != ODD:
            assert message.startswith("ep_plugin: building the reference backend was refused on another rank, "
                                      f"so no rank goes on: rank {ODD}: "), message
        assert seconds < TIMEOUT_S / 2, (rank, seconds)


@pytest.mark.parametrize("backend, arguments, error", [
    ("reference", {"flavour": 1}, TypeError),
    ("elastic", {"max_topk": 40}, ValueError),
    ("elastic", {"max_topk": True}, ValueError),
    ("elastic", {"in_place_dispatch": "yes"}, TypeError),
    ("hybrid", {"combine_input_rows": -1}, ValueError),
    ("hybrid", {"combine_input_rows": 1.5}, TypeError),
])
def test_a_backends_own_arguments_are_checked_before_any_exchange(backend, arguments, error):
    """``Backend.__new__`` asks ``check_build_arguments`` before the topology's exchange, which carries the
    refusal: checked in a subclass's ``__init__`` (after that exchange), one rank's raised alone and its peers
    waited in the construction check until the timeout."""
    cls = ep_plugin.get_backend(backend)
    with pytest.raises(error):
        cls.check_build_arguments(None, hidden_size=HIDDEN, num_experts=4, **arguments)
    cls.check_build_arguments(None, hidden_size=HIDDEN, num_experts=4)  # the defaults pass


class _WithoutTopology(ep_plugin.get_backend("reference")):
    """A backend subclass (a third party's, say) whose constructor takes no ``topology``."""

    def __init__(self, group=None, *, hidden_size, num_experts, config=None, device=None):
        super().__init__(group, hidden_size=hidden_size, num_experts=num_experts, config=config, device=device)


class _WithoutGroup(ep_plugin.get_backend("reference")):
    """One whose constructor takes no group (it always runs on the world)."""

    def __init__(self, *, hidden_size, num_experts, config=None, device=None, topology=None):
        super().__init__(None, hidden_size=hidden_size, num_experts=num_experts, config=config, device=device,
                         topology=topology)


def build_subclasses(ctx) -> list:
    config = Config.from_env(timeout_s=TIMEOUT_S)
    return [type(cls(hidden_size=HIDDEN, num_experts=4, config=config, device="cpu")).__name__
            for cls in (_WithoutTopology, _WithoutGroup)]


def test_subclasses_whose_constructors_take_fewer_arguments_still_build():
    """check_build_arguments binds what the caller passed: it once bound topology=None and the group too, and a
    subclass without them was refused on every rank."""
    assert run_ranks(build_subclasses, 2, timeout_s=120) == [["_WithoutTopology", "_WithoutGroup"]] * 2


def refused_build_leaves_nothing_alive(ctx) -> list:
    """Live HostCollectives (each may hold a gloo twin) before and after a build that rank 1 refuses, with the
    cycle collector off. A refusal raised from a frame that still held it formed a cycle through its traceback:
    the frames, and the topology exchange's collectives with them, stayed alive to a full collection, and a
    build retried at once met a twin its peers had let go."""
    import gc

    def live() -> int:
        return sum(isinstance(obj, HostCollectives) for obj in gc.get_objects())

    config = Config.from_env(timeout_s=TIMEOUT_S)
    gc.collect()
    gc.disable()
    try:
        before = live()
        for bad in ({"flavour": 1}, {"topology": "2x1"}):  # refused in __new__, and in resolve_topology
            try:
                ep_plugin.get_backend("reference")(hidden_size=HIDDEN, num_experts=4, config=config, device="cpu",
                                                   **(bad if ctx.rank == 1 else {}))
            except (TypeError, ValueError):
                pass
        return [before, live()]
    finally:
        gc.enable()


def test_a_refused_build_keeps_no_collectives_alive():
    for rank, (before, after) in enumerate(run_ranks(refused_build_leaves_nothing_alive, 2, timeout_s=120)):
        assert after == before, (rank, before, after)


def test_the_config_a_refusing_rank_exchanges_with_keeps_the_knobs_that_parse():
    """The rank whose EP_PLUGIN_* variable is refused still runs the topology's exchange with the job's timeout
    and host-word engine: with the defaults it made a gloo twin its peers (EP_PLUGIN_GLOO_HOST_WORDS=0) never
    make, and both sides waited out the timeout."""
    config = Config.of_what_parses({"EP_PLUGIN_MAX_TOKENS_PER_RANK": "0", "EP_PLUGIN_TIMEOUT_S": "7",
                                    "EP_PLUGIN_GLOO_HOST_WORDS": "0"})
    assert (config.timeout_s, config.gloo_host_words, config.max_tokens_per_rank) == (7.0, False,
                                                                                    Config().max_tokens_per_rank)


@pytest.mark.parametrize("scenario, field", [("fields", "num_sms"), ("fields_none", "arena")])
def test_ranks_that_check_different_fields_raise_on_every_rank(construction_outcomes, scenario, field):
    others = ", ".join(str(rank) for rank in range(NUM_RANKS) if rank != ODD)
    for rank, outcomes in enumerate(construction_outcomes):
        kind, message, _ = outcomes[scenario]
        assert kind == "ValueError", (rank, kind, message)
        assert f"{field} (checked on rank {ODD} only, not on ranks {others}" in message, message


@pytest.fixture(scope="module")
def construction_outcomes():
    return run_ranks(construction_scenarios, NUM_RANKS, timeout_s=120)


@pytest.mark.parametrize("field", ["hidden_size", "num_experts", "max_tokens_per_rank"])
def test_construction_mismatch_raises_on_every_rank(construction_outcomes, field):
    for rank, outcomes in enumerate(construction_outcomes):
        kind, message, seconds = outcomes[field]
        assert kind == "ValueError", (rank, kind, message)
        assert field in message and "rank 0:" in message and f"rank {ODD}:" in message, message
        assert seconds < TIMEOUT_S
    assert all(outcomes["agreed"][0] == "ok" for outcomes in construction_outcomes), construction_outcomes


def op_scenarios(ctx) -> dict:
    odd = ctx.rank == ODD
    experts = 2 * NUM_RANKS
    backend = _reference(hidden_size=HIDDEN, num_experts=experts)
    generator = torch.Generator().manual_seed(ctx.rank)
    hidden = torch.randn(5, HIDDEN, generator=generator)
    routing_map = torch.zeros(5, experts, dtype=torch.bool)
    routing_map[torch.arange(5), torch.arange(5) % experts] = True
    routing_map[torch.arange(5), (torch.arange(5) + 3) % experts] = True
    probs = routing_map.float() / 2
    topk_idx = routing_map.float().topk(2, dim=1).indices.sort(dim=1).values
    outcomes = {
        "dtype": _outcome(lambda: backend.dispatch(hidden.bfloat16() if odd else hidden, routing_map=routing_map,
                                                   probs=probs)),
        "probs_on_some_ranks": _outcome(lambda: backend.dispatch(hidden, routing_map=routing_map,
                                                                 probs=None if odd else probs)),
        "probs_dtype": _outcome(lambda: backend.dispatch(hidden, routing_map=routing_map,
                                                         probs=probs.double() if odd else probs)),
        "routing_form": _outcome(lambda: backend.dispatch(hidden, topk_idx=topk_idx) if odd
                                 else backend.dispatch(hidden, routing_map=routing_map)),
        "op_kind": _outcome(lambda: backend.barrier() if odd else backend.dispatch(hidden, routing_map=routing_map)),
    }
    first = backend.dispatch(hidden, routing_map=routing_map, probs=probs)
    second = backend.dispatch(2 * hidden, routing_map=routing_map, probs=probs)
    handles = (second.handle, first.handle) if odd else (first.handle, second.handle)
    rows = {id(first.handle): first.hidden, id(second.handle): second.hidden}
    outcomes["combine_order"] = _outcome(lambda: backend.combine(rows[id(handles[0])], handles[0]))

    # Top-k wider than 127 (any top-k of up to 1023 experts is told apart): the fingerprint's 7 bits of k made
    # 128 and 200 agree.
    wide = _reference(hidden_size=HIDDEN, num_experts=256 * NUM_RANKS)
    wide_k = 200 if odd else 128
    wide_ids = torch.stack([torch.randperm(256 * NUM_RANKS, generator=generator)[:wide_k] for _ in range(5)])
    outcomes["wide_topk"] = _outcome(lambda: wide.dispatch(hidden, topk_idx=wide_ids))

    # A call on some ranks only: the odd rank builds a backend where its peers dispatch, or meets a setup
    # call of another name. gloo aborted the process when the two first exchanges differed in size.
    outcomes["op_vs_build"] = _outcome(lambda: _reference(hidden_size=HIDDEN, num_experts=experts) if odd
                                       else backend.dispatch(hidden, routing_map=routing_map))
    outcomes["barrier_vs_build"] = _outcome(lambda: _reference(hidden_size=HIDDEN, num_experts=experts) if odd
                                            else backend.barrier())
    words = HostCollectives(None, owner="test", timeout_s=TIMEOUT_S, label="setup steps")
    outcomes["setup_vs_setup"] = _outcome(lambda: words.barrier(where="step a") if odd
                                          else words.all_gather_object(ctx.rank, where="step b"))

    def retry_after_refusal():
        """The odd rank's input alone is wrong: it is refused there before anything is sent, as if never
        called; the same call with the input fixed pairs with the dispatch its peers are waiting in."""
        if odd:
            try:
                backend.dispatch(torch.randn(5, HIDDEN + 1), routing_map=routing_map)
                raise AssertionError("a dispatch with the wrong hidden size was accepted")
            except ValueError:
                pass
        out = backend.dispatch(hidden, routing_map=routing_map)
        chosen = routing_map.sum(dim=1, keepdim=True).float()
        assert torch.allclose(backend.combine(out.hidden, out.handle).hidden, hidden * chosen)

    outcomes["retry_after_refusal"] = _outcome(retry_after_refusal)

    def agreed_ops_still_work():  # nothing moved in the rejected ops: the backend is still in step
        chosen = routing_map.sum(dim=1, keepdim=True).float()
        assert torch.allclose(backend.combine(first.hidden, first.handle).hidden, hidden * chosen)
        assert torch.allclose(backend.combine(second.hidden, second.handle).hidden, 2 * hidden * chosen)
        backend.barrier()

    outcomes["agreed"] = _outcome(agreed_ops_still_work)
    return outcomes


@pytest.fixture(scope="module")
def op_outcomes():
    return run_ranks(op_scenarios, NUM_RANKS, timeout_s=120)


# scenario -> words every rank's message must hold
EXPECTED = {
    "dtype": ["dispatch", "dtype", "torch.float32", "torch.bfloat16"],
    "probs_on_some_ranks": ["dispatch", "probs:", "True", "False"],
    "probs_dtype": ["dispatch", "probs dtype", "torch.float32", "torch.float64"],
    "routing_form": ["dispatch", "form", "'routing_map'", "'topk'"],
    "op_kind": ["dispatch", "barrier"],
    "combine_order": ["combine", "handle_id:", "1 on rank", "2 on rank"],
    "wide_topk": ["dispatch", "topk:", "128 on rank", "200 on rank"],
}


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_op_mismatch_raises_on_every_rank(op_outcomes, scenario):
    for rank, outcomes in enumerate(op_outcomes):
        kind, message, seconds = outcomes[scenario]
        assert kind == "EPError", (rank, kind, message)
        assert "disagree" in message, message
        for word in EXPECTED[scenario]:
            assert word in message, (rank, word, message)
        peers = [ODD] if rank != ODD else [q for q in range(NUM_RANKS) if q != ODD]
        assert any(f"rank {q}" in message for q in peers), (rank, message)
        assert seconds < TIMEOUT_S


@pytest.mark.parametrize("scenario", ["op_vs_build", "barrier_vs_build", "setup_vs_setup"])
def test_a_call_on_some_ranks_only_raises_on_every_rank(op_outcomes, scenario):
    """Not a crash (every rank returns), not a wait for the timeout: an EPError naming the other ranks."""
    for rank, outcomes in enumerate(op_outcomes):
        kind, message, seconds = outcomes[scenario]
        assert kind == "EPError", (rank, kind, message)
        assert ("different calls" in message or "another setup step" in message), (rank, message)
        peers = [ODD] if rank != ODD else [q for q in range(NUM_RANKS) if q != ODD]
        assert all(f"rank {q}" in message for q in peers), (rank, message)
        assert seconds < TIMEOUT_S


def test_a_call_refused_on_one_rank_can_be_made_again_with_its_input_fixed(op_outcomes):
    """What a rank may do after a refusal of its own (docs/design.md, errors): call again. Counting refused
    calls in the op fingerprint (to catch a rank that skips to its next op instead) would break this."""
    assert all(outcomes["retry_after_refusal"][0] == "ok" for outcomes in op_outcomes), \
        [o["retry_after_refusal"] for o in op_outcomes]


def test_backend_stays_usable_after_a_rejected_op(op_outcomes):
    assert all(outcomes["agreed"][0] == "ok" for outcomes in op_outcomes), [o["agreed"] for o in op_outcomes]


def dtypes_differ_in_a_subgroup(ctx):
    """A reference backend on global ranks 1 and 2 (as on Megatron's EP group); the group's rank 1 dispatches
    float64 rows, its rank 0 float32."""
    group = torch.distributed.new_group([1, 2])
    if ctx.rank == 0:
        return None
    backend = _reference(group=group, hidden_size=HIDDEN, num_experts=4)
    dtype = torch.float64 if ctx.rank == 2 else torch.float32
    return _outcome(lambda: backend.dispatch(torch.ones(2, HIDDEN, dtype=dtype),
                                             topk_idx=torch.tensor([[0], [3]])))


def test_ranks_that_disagree_in_a_subgroup_are_named_by_their_global_rank_too():
    """The mismatch message numbered ranks as the group does: on an EP subgroup 'rank 0' sent users to the log of
    another process (global rank 0 here is no member)."""
    for rank, (kind, message, _) in enumerate(run_ranks(dtypes_differ_in_a_subgroup, 3, timeout_s=120)[1:], 1):
        assert kind == "EPError", (rank, kind, message)
        assert "on rank 0 (global rank 1), torch.float64 on rank 1 (global rank 2)" in message \
            or "on rank 1 (global rank 2), torch.float32 on rank 0 (global rank 1)" in message, (rank, message)


def test_mismatch_message_names_fields_and_ranks():
    mine = OpFingerprint(OP_COMBINE, dtype=torch.bfloat16, handle_id=1).pack()
    theirs = OpFingerprint(OP_COMBINE, dtype=torch.bfloat16, handle_id=2).pack()
    message = mismatch_message("reference", 0, 1, mine, theirs)
    assert "handle_id: 1 on rank 0, 2 on rank 1" in message and "dtype" not in message.split(".")[0]
    dispatch = OpFingerprint(OP_DISPATCH, dtype=torch.float32, probs=True, form="topk", topk=8)
    assert OpFingerprint.unpack(dispatch.pack()) == dispatch


def test_fingerprints_pack_to_distinct_values_that_unpack_to_themselves():
    # pack() remembers the bits of the fields below handle_id: a stale or shared entry would give
    # two different fingerprints one value (ranks that disagree would then agree), or unpack wrong.
    from itertools import product

    from ep_plugin import agreement

    seen = {}
    for _ in range(2):  # the second round packs from the remembered bits
        for op, dtype, probs, form, topk, grad, probs_grad, handle_id in product(
                agreement._OPS[1:], agreement._DTYPES, (False, True), agreement._FORMS, (0, 1, 127, 128, 200, 1023),
                (False, True),
                (False, True), (0, 1, 2**41 - 1)):
            fingerprint = OpFingerprint(op, dtype=dtype, probs=probs, form=form, topk=topk, handle_id=handle_id,
                                        grad=grad, probs_grad=probs_grad)
            value = fingerprint.pack()
            assert 0 <= value < 2**63 and OpFingerprint.unpack(value) == fingerprint
            assert seen.setdefault(value, fingerprint) == fingerprint
    for field, bad in (("topk", 1024), ("handle_id", 2**41), ("handle_id", -1)):
        with pytest.raises(ValueError, match=f"field {field}={bad} does not fit"):
            OpFingerprint(OP_DISPATCH, **{field: bad}).pack()


class _OpsAfterTheirFirstLaunch:
    """The compiled backends' op wrapper (``op_range``) around an op that fails after enqueueing its first kernel:
    its peers ran that op, so the rank is out of step."""

    name, rank, num_ranks, num_experts, num_local_experts, _failed_mid_op, _launches = "hybrid", 0, 2, 8, 4, None, 0
    _out_of_step_error = CompiledBackend._out_of_step_error
    _dispatch_counts = CompiledBackend._dispatch_counts
    _refuse_flagged_input = CompiledBackend._refuse_flagged_input
    # The count read's words: rank 1 passed an expert id out of range (the exchange told every rank).
    _C = SimpleNamespace(MAILBOX_INPUT_FLAGS=0, MAILBOX_FLAGGED_RANKS=1, MAILBOX_EXPERT_ROWS=2,
                         INPUT_ID_OUT_OF_RANGE=1, INPUT_ID_REPEATED=2, INPUT_TOO_MANY_TOKENS=4)
    buffer = SimpleNamespace(mailbox=lambda first, count: [1, 0b10] + [0] * (count - 2))

    def _wait_for_host(self, what, mark=None):
        pass

    @op_range("dispatch")
    def dispatch(self, error: BaseException):
        self._launches += 1
        raise error

    @op_range("dispatch")
    def refuse_before_launching(self, error: BaseException):
        raise error

    @op_range("dispatch")
    def dispatch_a_peer_flagged(self):
        self._launches += 1  # the layout and its count exchange
        self._dispatch_counts(None, routing=None)

    @op_range("dispatch")
    def dispatch_over_budget(self):
        self._launches += 1  # this rank's count exchange told its peers that it refused (no tokens sent)
        self._dispatch_counts(None, routing=None, refused="3 tokens, more than max_tokens_per_rank=2")


def test_an_interrupt_midway_through_a_compiled_op_stays_an_interrupt(monkeypatch):
    """A Ctrl-C in a blocking dispatch's host wait (a late peer) came out as EPError, so a handler for
    KeyboardInterrupt never ran and one for RuntimeError swallowed it. It still leaves the backend out of step."""
    import contextlib

    from ep_plugin.backends import compiled

    monkeypatch.setattr(compiled, "nvtx_range", lambda name: contextlib.nullcontext())  # no CUDA build here
    monkeypatch.setattr(compiled.torch.cuda, "is_current_stream_capturing", lambda: False)
    for interrupt in (KeyboardInterrupt(), SystemExit(3)):
        ops = _OpsAfterTheirFirstLaunch()
        with pytest.raises(type(interrupt)):
            ops.dispatch(interrupt)
        with pytest.raises(EPError, match="dispatch refused: an earlier dispatch failed after its first launch"):
            ops.dispatch(RuntimeError("never reached"))
    ops = _OpsAfterTheirFirstLaunch()
    with pytest.raises(EPError, match="this dispatch failed after its first launch .MemoryError") as raised:
        ops.dispatch(MemoryError("its count sized an allocation past the memory"))
    assert isinstance(raised.value.__cause__, MemoryError)


def test_only_a_refusal_every_rank_raises_leaves_a_compiled_op_retryable_after_its_first_launch(monkeypatch):
    """op_range let any ValueError or TypeError through as a refusal, also one of this rank alone after a launch
    (a launcher refusing an argument the Python checks let by: a bug): its peers had run the op, and a retry
    met their next one. Only the count read's refusals, raised by every rank alike, leave the ranks in step."""
    import contextlib

    from ep_plugin.backends import compiled

    monkeypatch.setattr(compiled, "nvtx_range", lambda name: contextlib.nullcontext())  # no CUDA build here
    monkeypatch.setattr(compiled.torch.cuda, "is_current_stream_capturing", lambda: False)
    ops = _OpsAfterTheirFirstLaunch()
    with pytest.raises(ValueError, match="bad input"):  # before any launch
        ops.refuse_before_launching(ValueError("bad input"))
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] of the group passed topk_idx with an expert id outside"):
        ops.dispatch_a_peer_flagged()
    assert ops._failed_mid_op is None
    ops.buffer = SimpleNamespace(mailbox=lambda first, count: [4, 0b01] + [0] * (count - 2))  # rank 0: too many
    with pytest.raises(TooManyTokensError, match="3 tokens, more than max_tokens_per_rank=2 .on rank 0.; every rank"):
        ops.dispatch_over_budget()
    assert ops._failed_mid_op is None
    for error in (ValueError("ep_plugin hybrid: the permute needs out"),
                  TypeError("field 'out' takes None, an int address or a tensor, got str")):
        ops = _OpsAfterTheirFirstLaunch()
        with pytest.raises(EPError, match=f"this dispatch failed after its first launch .{type(error).__name__}: "
                                          f"{error}") as raised:
            ops.dispatch(error)
        assert raised.value.__cause__ is error
        with pytest.raises(EPError, match="dispatch refused: an earlier dispatch failed after its first launch"):
            ops.refuse_before_launching(ValueError("never reached"))
