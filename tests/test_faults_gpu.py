"""Faults of the compiled backends (``hybrid`` and ``elastic``), each test run for both: a rank that never
calls, a rank whose process is gone, ranks that disagree about an op, more SMs than can be resident.

What every case must show (DESIGN §3.3): the other ranks get an ``EPError`` naming the phase and the
peer, no hang and no crash, and their GPU stays usable. All need a GPU and the compiled extension; four
ranks, one GPU each where there are enough, else sharing GPUs under MPS.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from test_hybrid import make_inputs

import ep_plugin
from ep_plugin.config import Config
from ep_plugin.testing import run_ranks

pytestmark = pytest.mark.gpu

NUM_EXPERTS = 32
MAX_TOKENS = 128
BACKENDS = ["hybrid", "elastic"]
# The phase a rank waits in when a peer never reaches dispatch: hybrid's count notify, elastic's exchange.
DISPATCH_WAIT = {"hybrid": "dispatch/notify", "elastic": "dispatch/exchange"}


def make_backend(ctx, backend_name: str, hidden: int = 256, options: dict | None = None, **config):
    """A backend of the suite's size; ``options`` go to the backend, ``config`` to its Config."""
    config = Config.from_env(**{"max_tokens_per_rank": MAX_TOKENS, "timeout_s": 20.0, "num_sms": 8, **config})
    options = {"max_topk": 8, **(options or {})} if backend_name == "elastic" else options or {}
    return ep_plugin.get_backend(backend_name)(hidden_size=hidden, num_experts=NUM_EXPERTS, device=ctx.device,
                                               config=config, **options)


def routed_tokens(ctx, seed: int, hidden: int = 256):
    x, idx, w, _, _ = make_inputs(seed, ctx.rank, ctx.world_size, 20, hidden, NUM_EXPERTS, 2, skewed=False,
                                  drop_some=False)
    return x, dict(topk_idx=idx, topk_weights=w)


def timed_dispatch(backend, x, routing) -> dict:
    """Dispatch expecting an EPError: the error as 'Type: message' (None when none came) and the seconds."""
    start = time.monotonic()
    try:
        backend.dispatch(x, **routing)
        error = None
    except ep_plugin.EPError as caught:
        error = f"{type(caught).__name__}: {caught}"
    return {"error": error, "seconds": time.monotonic() - start}


def gpu_usable(ctx):
    try:
        return float(torch.ones(4, device=ctx.device).sum()) == 4.0
    except RuntimeError as error:
        return str(error)


# ---- a rank that never calls -------------------------------------------------------------------

def missing_rank(ctx, backend_name: str) -> dict:
    """Rank 0 never calls dispatch: every other rank must raise EPTimeoutError naming phase and peer."""
    backend = make_backend(ctx, backend_name, timeout_s=3.0)
    x, routing = routed_tokens(ctx, 800)
    result = timed_dispatch(backend, x, routing) if ctx.rank != 0 else {}
    torch.distributed.barrier()
    return result


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_missing_rank_times_out_naming_phase_and_peer(backend_name):
    results = run_ranks(missing_rank, 4, backend_name, device="cuda", timeout_s=120)
    for rank, result in enumerate(results[1:], start=1):
        assert result["error"] is not None, f"rank {rank} did not raise"
        assert result["error"].startswith("EPTimeoutError: "), (rank, result)
        assert DISPATCH_WAIT[backend_name] in result["error"] and "peer rank 0" in result["error"], (rank, result)
        assert result["seconds"] < 10, (rank, result)


def missing_rank_of_a_subgroup(ctx, backend_name: str) -> dict:
    """A backend on global ranks 2 and 3 (as on Megatron's EP group): rank 2, the group's rank 0, never dispatches."""
    group = torch.distributed.new_group([2, 3])
    result = {}
    if ctx.rank in (2, 3):
        config = Config.from_env(max_tokens_per_rank=MAX_TOKENS, timeout_s=3.0, num_sms=8)
        options = {"max_topk": 8} if backend_name == "elastic" else {}
        backend = ep_plugin.get_backend(backend_name)(hidden_size=256, num_experts=NUM_EXPERTS, device=ctx.device,
                                                      config=config, group=group, **options)
        x, idx, w, _, _ = make_inputs(801, ctx.rank - 2, 2, 20, 256, NUM_EXPERTS, 2, skewed=False, drop_some=False)
        if ctx.rank == 3:
            result = timed_dispatch(backend, x, dict(topk_idx=idx, topk_weights=w))
    torch.distributed.barrier()
    return result


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_missing_rank_of_a_subgroup_is_named_by_its_global_rank_too(backend_name):
    """The device's reports named the group's ranks only ("peer rank 0"): on an EP subgroup that is another
    process's number, and the user opened the wrong log."""
    error = run_ranks(missing_rank_of_a_subgroup, 4, backend_name, device="cuda", timeout_s=120)[3]["error"]
    assert error is not None and error.startswith("EPTimeoutError: "), error
    assert "rank 1 (global rank 3) timed out" in error and "peer rank 0 (global rank 2)" in error, error


# ---- a rank that fails alone while the backend is built ----------------------------------------

class _ExtensionOutOfMemory:
    """The compiled extension as one rank sees it when its buffer's cudaMalloc fails (the GPU's memory taken
    by something else on that rank alone): every other entry point is the real one."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    @staticmethod
    def SymmetricBuffer(*args, **kwargs):  # noqa: N802 - the extension's class name
        raise RuntimeError("ep_plugin: cudaMalloc(&base_, total_bytes_) failed: cudaErrorMemoryAllocation "
                           "(out of memory; injected on this rank)")


class _BufferWithoutIpcExport:
    """A real buffer whose CUDA IPC handle cannot be exported (as in a container that forbids IPC)."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def export_handle(self):
        raise RuntimeError("ep_plugin: cudaIpcGetMemHandle failed: cudaErrorInvalidValue (injected)")


class _BufferWithoutIpcOpen(_BufferWithoutIpcExport):
    """A real buffer that cannot open its peers' IPC handles (processes in separate IPC namespaces)."""

    def export_handle(self):
        return self._real.export_handle()

    def open_peers(self, handles):
        raise RuntimeError("ep_plugin: cudaIpcOpenMemHandle failed: cudaErrorMapBufferObjectFailed (injected)")


class _ExtensionWithoutIpcExport(_ExtensionOutOfMemory):
    buffer = _BufferWithoutIpcExport

    def SymmetricBuffer(self, *args, **kwargs):  # noqa: N802 - the extension's class name
        return self.buffer(self._real.SymmetricBuffer(*args, **kwargs))


class _ExtensionWithoutIpcOpen(_ExtensionWithoutIpcExport):
    buffer = _BufferWithoutIpcOpen


# What the last rank meets -> (the stand-in extension, its error, what its peers are told, the advice every
# rank's message carries)
MADE_NONE = "could not make or share its own buffer, so no rank opens the peers' buffers (rank 3: RuntimeError: "
SETUP_FAILURES = {
    "out_of_memory": (_ExtensionOutOfMemory, "cudaErrorMemoryAllocation", MADE_NONE, "free memory on its GPU"),
    "no_ipc_export": (_ExtensionWithoutIpcExport, "cudaIpcGetMemHandle", MADE_NONE, "allow CUDA IPC"),
    "no_ipc_open": (_ExtensionWithoutIpcOpen, "cudaIpcOpenMemHandle",
                    "could not open its peers' buffers through CUDA IPC, so no rank uses them (rank 3: RuntimeError: ",
                    "allow CUDA IPC"),
}


def rank_failing_in_setup(ctx, backend_name: str, failure: str) -> dict:
    """The last rank's buffer cannot be allocated (or shared), after the build's exchanges (settings, grid)
    agreed, and it stays alive a while; the others go on to open the peers' buffers. The failure travels in that
    exchange: they raise EPError naming the rank and its error at once, not EPTimeoutError after their timeout
    (as before), nor after the process group's own (30 min on gloo) with the engine's raw error. (Settings that
    differ on one rank are refused on every rank: test_faults_gpu's grid tests, test_agreement.)"""
    last = ctx.rank == ctx.world_size - 1
    if last:
        from ep_plugin import _cuda

        real = _cuda.extension()
        _cuda.extension = lambda: SETUP_FAILURES[failure][0](real)
    start = time.monotonic()
    try:
        make_backend(ctx, backend_name, timeout_s=30.0)  # a wait for rank 3 would stand out
        result = {"error": None}
    except Exception as error:  # noqa: BLE001 - the test compares the type and text
        result = {"error": f"{type(error).__name__}: {error}", "notes": " ".join(getattr(error, "__notes__", []))}
    result["seconds"] = time.monotonic() - start
    if last:
        time.sleep(8.0)  # alive a while: its exit would end a waiting peer too
    return result


@pytest.mark.parametrize("backend_name, failure", [(name, "out_of_memory") for name in BACKENDS]
                         + [("hybrid", "no_ipc_export"), ("hybrid", "no_ipc_open")])
def test_a_rank_failing_alone_while_the_backend_is_built_is_named(backend_name, failure):
    # Before (fifth of December) the last rank's own EP_PLUGIN_MAX_SMS_PER_GPU failed it alone; since the grid
    # check is an exchange, every rank refuses that together, so an allocation failure stands in. Before the
    # 27th session a rank that could not open its peers' buffers raised alone, the others waiting for it.
    results = run_ranks(rank_failing_in_setup, 4, backend_name, failure, device="cuda", timeout_s=120)
    _, error, told, advice = SETUP_FAILURES[failure]
    assert error in results[-1]["error"] and advice in results[-1]["notes"], results[-1]
    for rank, result in enumerate(results[:-1]):
        assert result["error"] is not None and result["error"].startswith("EPError: "), (rank, result)
        assert told in result["error"], (rank, result)
        assert error in result["error"] and advice in result["error"], (rank, result)
        # Before rank 3's sleep ends (its exit would end a wait too), far under the timeout: nobody waited.
        assert result["seconds"] < 8.0, (rank, result)


class _BufferOnABusyGpu(_BufferWithoutIpcExport):
    """A real buffer on a GPU that another library keeps busy from the moment its handle is exported: a kernel
    of ~25 s on a stream of its own (an NCCL collective waiting for its peer, say)."""

    def export_handle(self):
        handle = self._real.export_handle()
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda._sleep(int(5e10))  # ~25 s at the H200's ~2 GHz (longer on a slower clock)
        return handle


class _ExtensionOnABusyGpu(_ExtensionWithoutIpcExport):
    buffer = _BufferOnABusyGpu


def busy_rank_told_of_a_failed_build(ctx) -> dict:
    """Rank 3's allocation fails; rank 0's GPU runs another kernel meanwhile. Every rank refuses the build and
    frees its buffer: rank 0's free began with the extension's device-wide wait, without a timeout (and with
    the GIL held), so its refusal came once the other kernel ended, however long that took."""
    from ep_plugin import _cuda

    real = _cuda.extension()
    if ctx.rank == ctx.world_size - 1:
        _cuda.extension = lambda: _ExtensionOutOfMemory(real)
    elif ctx.rank == 0:
        _cuda.extension = lambda: _ExtensionOnABusyGpu(real)
    start = time.monotonic()
    try:
        make_backend(ctx, "hybrid", timeout_s=3.0)
        error = None
    except Exception as caught:  # noqa: BLE001 - the test reads the text
        error = f"{type(caught).__name__}: {caught}"
    return {"error": error, "seconds": time.monotonic() - start}


def test_a_refused_build_on_a_busy_gpu_is_raised_within_the_timeout():
    results = run_ranks(busy_rank_told_of_a_failed_build, 4, device="cuda", timeout_s=120)
    busy = results[0]
    assert busy["error"] is not None and busy["error"].startswith("EPError: ") and MADE_NONE in busy["error"], busy
    # The free's wait gives up after the buffer's 3 s (and destroy's margin), leaving the memory allocated, and says so.
    assert "stays allocated" in busy["error"] and "freeing the refused buffer" in busy["error"], busy
    assert busy["seconds"] < 15.0, busy  # not the other kernel's ~25 s
    for rank, result in enumerate(results[1:3], start=1):  # idle GPUs: freed at once, nothing to say
        assert result["error"] is not None and MADE_NONE in result["error"], (rank, result)
        assert "stays allocated" not in result["error"], (rank, result)


class _BufferLateToOpen(_BufferWithoutIpcExport):
    """A real buffer whose rank opens its peers' buffers only after they gave up waiting for it."""

    def export_handle(self):
        return self._real.export_handle()

    def open_peers(self, handles):
        time.sleep(8.0)
        return self._real.open_peers(handles)


class _ExtensionLateToOpen(_ExtensionWithoutIpcExport):
    buffer = _BufferLateToOpen


def rank_late_to_open(ctx) -> dict:
    """The last rank opens the peers' buffers past the others' timeout: they give up in the exchange that says
    every rank opened them, after they opened theirs (so the last rank may map their memory). Their buffers are
    kept, not freed (as a backend dropped without destroy()), and the last rank's too, which gives up next."""
    import gc
    import logging

    last = ctx.rank == ctx.world_size - 1
    if last:
        from ep_plugin import _cuda

        real = _cuda.extension()
        _cuda.extension = lambda: _ExtensionLateToOpen(real)
    said: list[str] = []

    class Said(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logging.getLogger("ep_plugin.transport.symmetric").addHandler(Said())
    try:
        make_backend(ctx, "hybrid", timeout_s=3.0)
        error = None
    except Exception as caught:  # noqa: BLE001 - the test reads the type
        error = type(caught).__name__
        del caught
    gc.collect()  # the half-built backend, held by the traceback until now
    return {"error": error, "kept": any("was let go without destroy()" in text for text in said)}


def test_a_build_that_gives_up_after_opening_the_peers_keeps_its_memory():
    """A build whose exchange after opening the peers' buffers gave up (a peer late, say) let the extension's
    destructor free the rank's memory while a peer might map it (and no barrier said it closed it); now the
    buffer is kept until the process ends, as a backend dropped without destroy() is."""
    results = run_ranks(rank_late_to_open, 2, device="cuda", timeout_s=120)
    for rank, result in enumerate(results):
        assert result["error"] is not None, (rank, result)
        assert result["kept"], (rank, result)


# ---- a rank whose process exited ---------------------------------------------------------------

def exited_rank(ctx, backend_name: str, peer_watch_s: float) -> dict:
    """The last rank's process ends after the backend is built (its CUDA context, and the buffer its
    peers opened with CUDA IPC, go with it); the others then dispatch. They must raise EPError naming
    that rank, not die on an illegal address, and their GPU must stay usable. With the peer watch on,
    the wait stops at the watch's mark, long before the timeout; with it off, the timeout reports."""
    timeout_s = 30.0 if peer_watch_s else 3.0
    backend = make_backend(ctx, backend_name, timeout_s=timeout_s, peer_watch_s=peer_watch_s)
    x, routing = routed_tokens(ctx, 801)
    torch.cuda.synchronize()
    torch.distributed.barrier()
    if ctx.rank == ctx.world_size - 1:
        return {}  # the launcher's rank process exits now
    time.sleep(5.0)  # until that process (and its CUDA context) is gone
    result = timed_dispatch(backend, x, routing)
    result["gpu_ok"] = gpu_usable(ctx)
    # destroy() meets a gone peer: it may raise, and the backend must count as destroyed all the same (it
    # stayed half-destroyed and usable-looking, its twin and watch held, when its barrier raised).
    try:
        backend.destroy()
    except ep_plugin.EPError:
        pass
    try:
        backend.dispatch(x, **routing)
        result["after destroy"] = "no error"
    except RuntimeError as caught:
        result["after destroy"] = f"{type(caught).__name__}: {caught}"
    return result


@pytest.mark.parametrize("peer_watch_s", [0.5, 0.0])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_rank_whose_process_exited_is_named(backend_name, peer_watch_s):
    results = run_ranks(exited_rank, 4, backend_name, peer_watch_s, device="cuda", timeout_s=120)
    for rank, result in enumerate(results[:-1]):
        assert result["error"] is not None, f"rank {rank} did not raise"
        if peer_watch_s:  # the watch's mark: "exited", well inside the 30 s timeout
            assert result["error"].startswith("EPError: ") and "the process of rank 3" in result["error"], \
                (rank, result)
            assert "has exited" in result["error"] and result["seconds"] < 10, (rank, result)
        else:
            assert result["error"].startswith("EPTimeoutError: ") and "peer rank 3" in result["error"], \
                (rank, result)
        assert result["gpu_ok"] is True, (rank, result["gpu_ok"])
        assert result["after destroy"].startswith("RuntimeError: ") and "destroyed" in result["after destroy"], \
            (rank, result)


# ---- ranks that disagree -----------------------------------------------------------------------

def disagreeing_ranks(ctx, backend_name: str) -> dict:
    """Three ways ranks disagree, each on a fresh backend: every rank must get EPError naming the op and
    the field (no hang, no wrong rows). 1) combine on two handles in opposite orders; 2) rank 0
    combines a copy while the others combine in place (elastic; hybrid combines that: rank 0 pushes its
    partial sums, and the result is the two-stage combine's up to its rounding); 3) an FP8 dispatch on
    rank 0 while the others send bf16."""
    hidden = 256
    errors = {}
    x, routing = routed_tokens(ctx, 850, hidden)

    def build(**options):
        return make_backend(ctx, backend_name, hidden, options, timeout_s=10.0)

    backend = build()
    first, second = backend.dispatch(x, **routing), backend.dispatch(x * 2, **routing)
    order = (first, second) if ctx.rank % 2 == 0 else (second, first)
    try:
        for out in order:
            backend.combine(out.hidden, out.handle)
        backend.check_errors()
        errors["order"] = None
    except ep_plugin.EPError as error:
        errors["order"] = str(error)
    backend.destroy()

    # hybrid combines in place from its combine-input arena
    backend = build(combine_input_rows=4096) if backend_name == "hybrid" else build()
    out = backend.dispatch(x, **routing)
    rows = backend.combine_input(out.handle)
    rows.copy_(out.hidden)
    try:
        back = backend.combine(rows.clone() if ctx.rank == 0 else rows, out.handle).hidden.float()
        backend.check_errors()
        errors["in_place"] = None
        staged = backend.combine(out.hidden, out.handle).hidden.float()
        errors["mixed_difference"] = float((back - staged).abs().max() / staged.abs().max())
    except ep_plugin.EPError as error:
        errors["in_place"] = str(error)
    backend.destroy()

    backend = build()
    data = x if ctx.rank != 0 else (x.to(torch.float8_e4m3fn), torch.ones(x.shape[0], hidden // 128,
                                                                           device=x.device))
    try:
        backend.dispatch(data, **routing)
        backend.check_errors()
        errors["dtype"] = None
    except ep_plugin.EPError as error:
        errors["dtype"] = str(error)
    backend.destroy()
    return errors


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_ranks_that_disagree_get_an_error_on_every_rank(backend_name):
    results = run_ranks(disagreeing_ranks, 4, backend_name, device="cuda", timeout_s=180)
    for rank, errors in enumerate(results):
        assert errors["order"] is not None and "combine" in errors["order"] and "handle_id" in errors["order"], \
            (rank, errors)
        assert errors["dtype"] is not None and "dispatch" in errors["dtype"] and "dtype" in errors["dtype"], \
            (rank, errors)
        if backend_name == "elastic":
            assert errors["in_place"] is not None and "combine_in_place" in errors["in_place"], (rank, errors)
        else:  # one pass rounds once, the two-stage combine once per rank: a few bf16 ulps apart at most
            assert errors["in_place"] is None and errors["mixed_difference"] <= 4 * 2 ** -7, (rank, errors)


# ---- a failure on one rank in the middle of an op --------------------------------------------------

def allocation_failures(ctx, backend_name: str) -> dict:
    """Rank 0's first output allocation fails (a planted out-of-memory error). Blocking mode allocates the
    dispatch output after the count read, so after the layout and send ran: the peers complete that op, and
    rank 0 must say it is out of step (EPError, at once again at its next op), not let a retry meet their
    next op. Non-blocking mode allocates before any launch: the same call again pairs with the peers'."""
    x, routing = routed_tokens(ctx, 870)
    seen: dict = {True: [], False: []}
    for blocking in (True, False):
        backend = make_backend(ctx, backend_name, blocking=blocking)
        if ctx.rank == 0:
            def failing_once(*shape, dtype, backend=backend):
                del backend._empty  # later allocations are the backend's own again
                raise torch.cuda.OutOfMemoryError("planted: the output allocation fails")

            backend._empty = failing_once
            attempts = [functools.partial(backend.dispatch, x, **routing)] * (2 if blocking else 1)
            if blocking:  # the barrier too refuses at once (it would enter a handshake the peers never join)
                attempts.append(backend.barrier)
            for attempt in attempts:
                start = time.monotonic()
                try:
                    attempt()
                    seen[blocking].append(("no error", 0.0))
                except Exception as caught:  # noqa: BLE001 - the test compares the type and text
                    seen[blocking].append((f"{type(caught).__name__}: {caught}", time.monotonic() - start))
        if ctx.rank != 0 or not blocking:  # rank 1 pairs with rank 0's op; non-blocking, rank 0's retry joins
            out = backend.dispatch(x, **routing)
            if not blocking:
                back = backend.combine(out.hidden, out.handle).hidden
                seen[blocking].append((f"combined {tuple(back.shape)}", 0.0))
        torch.cuda.synchronize()
        backend.destroy()
    return seen


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_failure_after_the_first_launch_is_reported_as_out_of_step(backend_name):
    results = run_ranks(allocation_failures, 2, backend_name, device="cuda", timeout_s=180)
    (first, _), (again, seconds), (barrier, barrier_seconds) = results[0][True]
    assert first.startswith("EPError: ") and "after its first launch" in first and "planted" in first, first
    assert again.startswith("EPError: ") and "out of step" in again and seconds < 1.0, (again, seconds)
    assert barrier.startswith("EPError: ") and "barrier refused" in barrier and barrier_seconds < 1.0, barrier
    assert results[0][False][0][0].startswith("OutOfMemoryError: planted"), results[0]
    for rank in (0, 1):
        assert results[rank][False][-1][0] == "combined (20, 256)", (rank, results[rank])


# ---- more SMs than can be resident -------------------------------------------------------------

def co_residency(ctx, backend_name: str) -> str:
    # One more block per rank than the GPU's SMs allow for the ranks placed on it.
    sharing = -(-ctx.world_size // torch.cuda.device_count())
    too_many = torch.cuda.get_device_properties(ctx.device).multi_processor_count // sharing + 1
    try:
        make_backend(ctx, backend_name, num_sms=too_many)
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_oversubscribed_sms_are_refused(backend_name):
    results = run_ranks(co_residency, 4, backend_name, device="cuda", timeout_s=120)
    assert all("resident" in message for message in results), results


def co_residency_on_one_rank(ctx, backend_name: str, num_sms: int) -> str:
    # Rank 1 says its GPU offers one SM too few for its share of 4 blocks (its own EP_PLUGIN_MAX_SMS_PER_GPU);
    # autosized (num_sms=0), too few for one block per rank.
    sharing = -(-ctx.world_size // torch.cuda.device_count())
    limiting = 4 * sharing - 1 if num_sms else sharing - 1
    try:
        make_backend(ctx, backend_name, num_sms=num_sms, max_sms_per_gpu=limiting if ctx.rank == 1 else 0)
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.parametrize("num_sms", [4, 0], ids=["num_sms=4", "autosized"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_grid_past_one_ranks_limit_is_refused_on_every_rank(backend_name, num_sms):
    """A co-residency limit (EP_PLUGIN_MAX_SMS_PER_GPU, the MPS percentage) that only one rank's grid passes:
    that rank refused alone and its peers waited for it in the buffer's exchange (or, autosized, in the
    autosizing exchange); every rank refuses now. 4 ranks: at least 2 share a GPU on a 1- or 2-GPU machine."""
    results = run_ranks(co_residency_on_one_rank, 4, backend_name, num_sms, device="cuda", timeout_s=120)
    for rank, message in enumerate(results):
        assert "resident" in message or "not one block" in message.lower(), (rank, message)
        assert ("on this rank" if rank == 1 else "on rank(s) [1]") in message, (rank, message)


# ---- more tokens than the buffer holds, on one rank ---------------------------------------------

def over_budget_on_one_rank(ctx, backend_name: str, form: str) -> list:
    """Rank 1 dispatches one token more than max_tokens_per_rank; then again, while rank 0 names an expert out
    of range (top-k forms); then every rank validly (blocking mode): each outcome is the error, or the largest
    error of the round trip (every token back times its experts)."""
    in_place = form == "topk_in_place"
    backend = make_backend(ctx, backend_name, options={"in_place_dispatch": True} if in_place else None)
    options = {"in_place": True} if in_place else {}
    outcomes = []
    over = MAX_TOKENS + 1 if ctx.rank == 1 else 20
    rounds = [(over, False)] + ([(over, ctx.rank == 0)] if form != "routing_map" else []) + [(20, False)]
    for num_tokens, bad_id in rounds:
        x, idx, w, routing_map, probs = make_inputs(804, ctx.rank, ctx.world_size, num_tokens, 256, NUM_EXPERTS,
                                                    2, skewed=False, drop_some=False)
        if bad_id:
            idx[0, 0] = NUM_EXPERTS
        routing = dict(routing_map=routing_map, probs=probs) if form == "routing_map" else dict(topk_idx=idx,
                                                                                               topk_weights=w)
        try:
            out = backend.dispatch(x, **routing, **options)
            combined = backend.combine(out.hidden, out.handle).hidden.float()
            # Copies of a token: one per expert (hybrid's rows), one per destination rank (elastic's compact rows).
            ranks = routing_map.view(num_tokens, ctx.world_size, -1).any(2)
            copies = (ranks if backend_name == "elastic" else routing_map).sum(1, keepdim=True).float()
            outcomes.append(float((combined - x.float() * copies).abs().max()))
        except ValueError as error:
            outcomes.append(f"{type(error).__name__}: {error}")
    torch.cuda.synchronize()
    backend.destroy()
    return outcomes


@pytest.mark.parametrize("backend_name, form", [("hybrid", "routing_map"), ("hybrid", "topk"), ("elastic", "topk"),
                                                ("elastic", "topk_in_place")])
def test_more_tokens_than_the_budget_on_one_rank_are_refused_on_every_rank(backend_name, form):
    """A longer micro-batch on one rank (variable-length data under Megatron): that rank refused alone and
    its peers waited out the timeout in the dispatch. It runs the op with no tokens now and its count
    exchange says why: every rank raises TooManyTokensError (a caller may grow the backend), or ValueError
    where another rank's ids were refused in the same dispatch, and the next round trip is exact."""
    results = run_ranks(over_budget_on_one_rank, 2, backend_name, form, device="cuda", timeout_s=180)
    refused = results[1][0]
    assert refused.startswith(f"TooManyTokensError: hidden has {MAX_TOKENS + 1} tokens, over max_tokens_per_rank="), \
        results
    assert "(on rank 1)" in refused and "stays usable" in refused, results
    assert results[0][0].startswith("TooManyTokensError: rank(s) [1] of the group passed more tokens than "
                                    f"max_tokens_per_rank={MAX_TOKENS}"), results
    if form != "routing_map":  # both reasons at once: plain ValueError on both ranks
        assert results[0][1].startswith("ValueError: topk_idx holds expert id") and "(on rank 0)" in results[0][1], \
            results
        assert results[1][1].startswith(f"ValueError: hidden has {MAX_TOKENS + 1} tokens"), results
    assert results[0][-1] == results[1][-1] == 0.0, results  # 2 copies of a bf16 token sum exactly


# ---- a device kept busy by someone else's kernel -------------------------------------------------

def busy_device(ctx, backend_name: str) -> dict:
    """A kernel that is not ours (torch's sleep, standing in for an NCCL collective stuck on a peer) keeps
    the GPU busy past the backend's timeout: check_errors, which syncs the device, must raise
    EPTimeoutError after that timeout plus its margin (as long again, at 1 s), not wait as long as the
    kernel runs; once the kernel is done the backend works. Both ranks sleep, so every rank's wait is the same."""
    backend = make_backend(ctx, backend_name, timeout_s=1.0)
    x, routing = routed_tokens(ctx, 802)
    first = backend.dispatch(x, **routing)
    backend.combine(first.hidden, first.handle)
    torch.cuda.synchronize()
    side = torch.cuda.Stream(ctx.device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(8e9))  # ~4 s at the H200's ~2 GHz (longer on a slower clock)
    start = time.monotonic()
    try:
        backend.check_errors()
        error = None
    except ep_plugin.EPError as caught:
        error = f"{type(caught).__name__}: {caught}"
    seconds = time.monotonic() - start
    torch.cuda.synchronize()
    torch.distributed.barrier()
    out = backend.dispatch(x, **routing)
    back = backend.combine(out.hidden, out.handle).hidden
    works = bool(torch.isfinite(back.float()).all()) and back.shape == x.shape
    backend.check_errors()
    backend.destroy()
    return {"error": error, "seconds": seconds, "works": works}


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_check_errors_times_out_on_a_busy_device(backend_name):
    results = run_ranks(busy_device, 2, backend_name, device="cuda", timeout_s=120)
    for rank, result in enumerate(results):
        assert result["error"] is not None and result["error"].startswith("EPTimeoutError: "), (rank, result)
        assert "check_errors" in result["error"] and "another library" in result["error"], (rank, result)
        assert result["seconds"] < 3.0, (rank, result)
        assert result["works"], (rank, result)



def stuck_behind_a_foreign_kernel(ctx, backend_name: str, op: str) -> dict:
    """Rank 0's stream is stuck behind a kernel that is not ours, far past the backend's timeout: its host wait
    (a blocking dispatch's count read, or the barrier's) gives up while the op's kernels are still queued (the
    device has reported nothing). Those kernels will take their place in the handshakes, so a retry must be
    refused as out of step at once, not enqueue a second op the peers never match."""
    backend = make_backend(ctx, backend_name, timeout_s=1.0)
    x, routing = routed_tokens(ctx, 803)
    # A first round fills the allocator's and the backend's caches: a fresh allocation may wait for the
    # device, and would hold the host back until the sleep ended (the dispatch would then just run).
    first = backend.dispatch(x, **routing)
    backend.combine(first.hidden, first.handle)
    torch.cuda.synchronize()
    errors = []
    if ctx.rank == 0:
        torch.cuda._sleep(int(3e10))  # ~15 s at the H200's ~2 GHz, past the host wait's 1 s + 5 s
    for _ in range(2 if ctx.rank == 0 else 1):
        try:
            backend.dispatch(x, **routing) if op == "dispatch" else backend.barrier()
            errors.append(None)
        except ep_plugin.EPError as caught:
            errors.append(f"{type(caught).__name__}: {caught}")
    torch.cuda.synchronize()  # the sleep, then rank 0's op, which times out on its own (rank 1 gave up)
    torch.distributed.barrier()
    backend.destroy()
    return {"errors": errors}


@pytest.mark.parametrize("op", ["dispatch", "barrier"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_retry_after_a_host_timeout_mid_op_is_refused_as_out_of_step(backend_name, op):
    """Before: the retry enqueued a second op behind the first and waited out the host timeout again (a
    barrier's retry was let through: its handshake met the peers' next op)."""
    first, second = run_ranks(stuck_behind_a_foreign_kernel, 2, backend_name, op, device="cuda", timeout_s=180)
    timed_out, retry = first["errors"]
    assert timed_out is not None and timed_out.startswith("EPTimeoutError: ") and "reported nothing" in timed_out, \
        first
    assert retry is not None and retry.startswith("EPError: ") and "out of step" in retry, first
    assert op in retry and "timed out on the host" in retry, first
    assert second["errors"][0] is not None and second["errors"][0].startswith("EPTimeoutError: "), second


# ---- a backend dropped without destroy() ---------------------------------------------------------

def dropped_without_destroy(ctx, backend_name: str) -> dict:
    """Rank 1 drops its backend after a round trip without destroy(), while rank 0 keeps its own: rank 1's
    buffer must stay allocated (a peer may still read or write there), with a warning that says so."""
    import gc
    import logging

    backend = make_backend(ctx, backend_name)
    x, routing = routed_tokens(ctx, 71)
    out = backend.dispatch(x, **routing)
    backend.combine(out.hidden, out.handle)
    torch.cuda.synchronize()
    raw = backend.buffer.raw  # the extension's buffer object, kept here to look at it afterwards
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("ep_plugin.transport.symmetric").addHandler(handler)
    if ctx.rank == 1:
        del backend, out
        gc.collect()
    torch.distributed.barrier()
    try:
        raw.export_handle()  # refused once the buffer was destroyed or abandoned
        state = "usable"
    except RuntimeError as error:
        state = f"RuntimeError: {error}"
    # (Rank 0 cannot destroy its backend: destroy is a collective that rank 1 no longer joins.)
    return {"state": state, "warnings": [record.getMessage() for record in records]}


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_backend_dropped_without_destroy_keeps_its_memory(backend_name):
    """Before: the extension's destructor freed the buffer once this rank's own work was done, while a peer
    could still pull rows from it or push into it (an illegal address in the peer's kernel, or another
    allocation overwritten). Now the memory stays allocated until the process ends, and a warning says so."""
    results = run_ranks(dropped_without_destroy, 2, backend_name, device="cuda", timeout_s=120)
    dropped = results[1]
    assert dropped["state"].startswith("RuntimeError: ") and "destroyed" in dropped["state"], dropped
    assert len(dropped["warnings"]) == 1 and "let go without destroy()" in dropped["warnings"][0], dropped
    assert results[0]["state"] == "usable" and results[0]["warnings"] == [], results[0]


def test_the_extension_refuses_a_launch_on_a_destroyed_or_abandoned_buffer():
    """Python refuses first (``SymmetricBuffer.raw``), but the extension's launchers took a destroyed buffer and
    handed its kernels the freed pointers (its view kept them): a caller of ``_C`` launched on freed memory."""
    from ep_plugin import _cuda

    C = _cuda.extension()
    stream = torch.cuda.current_stream().cuda_stream
    for end in ("destroy", "abandon"):
        buffer = C.SymmetricBuffer(device=torch.cuda.current_device(), rank=0, num_ranks=1, region_bytes=1 << 20,
                                   count_words=8, timeout_s=5.0)
        buffer.open_peers([b""])  # a group of one: its own buffer, no IPC handle read
        C.exchange(buffer, C.ExchangeArgs(phase=1, fingerprint=7), stream)  # usable until then
        torch.cuda.synchronize()
        getattr(buffer, end)()
        with pytest.raises(RuntimeError, match="launch on a destroyed buffer"):
            C.exchange(buffer, C.ExchangeArgs(phase=2, fingerprint=7), stream)
    torch.cuda.synchronize()  # nothing was launched on the freed memory: no sticky CUDA error here


def test_a_buffer_is_made_while_another_stream_is_busy():
    """The extension zeroed a new buffer and copied its peer table with device-wide waits (a synchronize, the
    legacy default stream): a backend built while any kernel of the process ran (a collective stuck on a dead
    peer, say) waited for it, with no timeout. Its setup copies now run on a stream of their own: neither a
    side stream's kernel nor one on the default stream holds the build up. And the memory is still zeroed before
    anything runs on it (dirtied first, then freed and made again: cudaMalloc tends to give the same memory)."""
    from ep_plugin import _cuda

    C = _cuda.extension()
    device = torch.cuda.current_device()
    size = 64 << 20

    def region(buffer) -> torch.Tensor:  # the buffer's region, as a tensor (no copy), as the Python side makes it
        from ep_plugin.transport.symmetric import _DeviceMemory

        return torch.as_tensor(_DeviceMemory(buffer.region_address, (size,), "|u1", owner=buffer),
                               device=f"cuda:{device}")

    dirty = C.SymmetricBuffer(device=device, rank=0, num_ranks=1, region_bytes=size, count_words=8, timeout_s=5.0)
    dirty.open_peers([b""])
    region(dirty).fill_(0xFF)
    torch.cuda.synchronize()
    dirty.destroy()
    outcomes = {}
    for name, busy in (("side stream", torch.cuda.Stream()), ("default stream", torch.cuda.default_stream())):
        torch.cuda.synchronize()
        with torch.cuda.stream(busy):
            torch.cuda._sleep(int(8e9))  # ~4 s at the H200's ~2 GHz (longer on a slower clock)
        start = time.monotonic()
        buffer = C.SymmetricBuffer(device=device, rank=0, num_ranks=1, region_bytes=size, count_words=8,
                                   timeout_s=5.0)
        buffer.open_peers([b""])
        outcomes[name] = (time.monotonic() - start, not busy.query())
        stream = torch.cuda.Stream()  # not behind the sleep
        C.exchange(buffer, C.ExchangeArgs(phase=1, fingerprint=7), stream.cuda_stream)
        with torch.cuda.stream(stream):
            outcomes[name + " zeroed"] = bool((region(buffer) == 0).all().item())
        stream.synchronize()  # the handshake ran (its flags started at zero)
        buffer.destroy()  # (a device-wide wait: after the sleep)
    for name in ("side stream", "default stream"):
        _, still_busy = outcomes[name]
        assert still_busy, (name, outcomes)  # the build did not wait for the busy stream
        assert outcomes[name + " zeroed"], (name, outcomes)


@pytest.mark.gpu
def test_destroy_lets_other_threads_run_while_it_waits_for_the_device():
    """destroy (and close_peers) begin with a device-wide synchronize: it held the GIL, so while a kernel of the
    process ran on (a stuck one, say), every other Python thread stopped too, a watchdog that would print why
    among them. The wait now runs without the GIL: another thread runs while destroy waits for a kernel."""
    import threading

    from ep_plugin import _cuda

    C = _cuda.extension()
    device = torch.cuda.current_device()
    sleep_done = torch.cuda.Event()
    in_destroy, stop = threading.Event(), threading.Event()
    ticks_in_the_wait = []

    def tick():  # a thread that only needs the GIL now and then: counts its turns inside destroy's wait
        while not stop.is_set():
            if in_destroy.is_set() and not sleep_done.query():
                ticks_in_the_wait.append(1)
            time.sleep(0.01)

    buffer = C.SymmetricBuffer(device=device, rank=0, num_ranks=1, region_bytes=1 << 20, count_words=8, timeout_s=5.0)
    buffer.open_peers([b""])
    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        torch.cuda.synchronize()
        torch.cuda._sleep(int(4e9))  # ~2 s at the H200's ~2 GHz
        sleep_done.record()
        running_at_the_call = not sleep_done.query()
        in_destroy.set()
        buffer.destroy()
        in_destroy.clear()
        done_at_the_return = sleep_done.query()
    finally:
        stop.set()
        ticker.join()
    assert running_at_the_call and done_at_the_return, "destroy did not wait for the sleeping kernel"
    # Held for the wait, the GIL let the thread in once or twice at most (before destroy took it); ~200 turns free.
    assert len(ticks_in_the_wait) >= 20, f"{len(ticks_in_the_wait)} turns of another thread in destroy's wait"
