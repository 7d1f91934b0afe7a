"""The stream policy's helpers on a real GPU: launches go to the caller's current stream."""

import time

import pytest
import torch

from ep_plugin import streams


@pytest.mark.gpu(extension=False)
def test_stream_handle_follows_the_current_stream():
    # stream_handle takes torch's private raw accessor when it has one (a fast path on every launch):
    # it must name the same stream as the public API, also inside a `with torch.cuda.stream(...)`.
    device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device)
    assert side.cuda_stream != torch.cuda.current_stream(device).cuda_stream
    assert streams.stream_handle(device) == torch.cuda.current_stream(device).cuda_stream
    with torch.cuda.stream(side):
        assert streams.stream_handle(device) == side.cuda_stream
    assert streams.stream_handle(device) == torch.cuda.current_stream(device).cuda_stream


@pytest.mark.gpu(extension=False)
def test_current_stream_follows_the_current_stream():
    # streams.current_stream keeps one Stream object per raw handle (record_stream and the ready
    # events take it on every op): it must still be the caller's current stream each time.
    device = torch.device("cuda", torch.cuda.current_device())
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    for _ in range(2):  # the second round answers from the cache
        assert streams.current_stream(device) == main
        with torch.cuda.stream(side):
            assert streams.current_stream(device) == side
            assert streams.current_stream(device).cuda_stream == side.cuda_stream
        assert streams.current_stream(device) == main


@pytest.mark.gpu(extension=False)
def test_current_stream_is_per_device():
    # Every device's default stream has the raw handle 0: the cache must not answer device 1 with
    # device 0's stream object (record_stream would then name another device's stream).
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two visible GPUs (the default streams of two devices share handle 0)")
    first, second = torch.device("cuda", 0), torch.device("cuda", 1)
    for _ in range(2):  # the second round answers from the cache
        assert streams.current_stream(first).device == first
        assert streams.current_stream(second).device == second
        assert streams.current_stream(second) == torch.cuda.current_stream(second)


# ---- waits that cannot time out by themselves (CPU) --------------------------------------------

def test_a_wait_that_cannot_time_out_is_left_with_a_message():
    # torch.cuda.synchronize has no timeout; run_until_done gives up on it and says what it waited for.
    import threading
    import time

    from ep_plugin.errors import EPTimeoutError

    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(EPTimeoutError, match=r"rank 3: destroy: not done within 0\.2 s \(a hint\)"):
        streams.run_until_done(release.wait, 0.2, "rank 3: destroy", hint="a hint")
    assert time.monotonic() - start < 2.0

    # A more precise error (the device report) goes first; a call's own error comes back as it is.
    def report():
        raise ValueError("the device reported a peer")

    with pytest.raises(ValueError, match="the device reported a peer"):
        streams.run_until_done(release.wait, 0.1, "check_errors", before_timeout=report)
    with pytest.raises(ZeroDivisionError):
        streams.run_until_done(lambda: 1 / 0, 5.0, "a failing call")
    streams.run_until_done(lambda: None, 5.0, "a quick call")  # returns at once
    release.set()  # the abandoned waits end


# ---- one backend, ops on two streams (GPU, compiled backends) -----------------------------------

def _ops_on_two_streams(ctx, backend_name: str) -> dict:
    """Two sync-free dispatches, the first on one stream and the second on another. On rank 0 the first
    is held back by a sleep queued ahead of it, so without ordering its second dispatch would run first
    and meet rank 1's first: rows of the wrong op, or an error. The backend must make the second stream
    wait; the rows then equal the same two dispatches on one stream."""
    from test_faults_gpu import make_backend, routed_tokens

    backend = make_backend(ctx, backend_name, timeout_s=5.0, blocking=False)
    x, routing = routed_tokens(ctx, 803)
    main = torch.cuda.current_stream(ctx.device)
    first_stream, second_stream = torch.cuda.Stream(ctx.device), torch.cuda.Stream(ctx.device)

    def two_dispatches(sleep_cycles: int):
        """(first, second, whether rank 0's sleep was still running when the second was issued, whether the
        first was done when a host wait issued after both returned)."""
        for stream in (first_stream, second_stream):
            stream.wait_stream(main)  # the inputs were made on the main stream
        slept, first_done = torch.cuda.Event(), torch.cuda.Event()
        with torch.cuda.stream(first_stream):
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)
            slept.record()
            first = backend.dispatch(x, **routing)
            first_done.record()
        with torch.cuda.stream(second_stream):
            second = backend.dispatch(x * 2, **routing)
        overtaking_possible = not slept.query()
        # A host wait on yet another stream (the hierarchical barrier's, before its rail traffic) covers
        # the ops on both.
        backend._wait_for_host("the test's wait")
        waited = first_done.query()
        torch.cuda.synchronize()
        return first, second, overtaking_possible, waited

    # A first round without the sleep fills the allocator's cache on both streams: a fresh cudaMalloc may
    # wait for the device, and would hold the host back until the sleep ended (no overtaking then).
    two_dispatches(0)
    first, second, overtaking_possible, waited = two_dispatches(int(2e9) if ctx.rank == 0 else 0)  # ~1 s on rank 0
    result = {"overtaking_possible": overtaking_possible or ctx.rank != 0, "host_wait_covered_both": waited,
              **_compare_with_one_stream(backend, x, routing, first, second)}
    backend.destroy()
    return result


def _compare_with_one_stream(backend, x, routing, first, second) -> dict:
    """{"error": the backend's pending error or None, "same": (first, second) rows equal to the same two
    dispatches issued on one stream (None after an error)}; synchronizes."""
    import ep_plugin

    try:
        backend.check_errors()
    except ep_plugin.EPError as error:
        return {"error": str(error), "same": None}
    want_first, want_second = backend.dispatch(x, **routing), backend.dispatch(x * 2, **routing)
    torch.cuda.synchronize()

    def rows(out):
        valid = out.hidden.shape[0] if out.num_valid_rows is None else int(out.num_valid_rows.item())
        return out.hidden[:valid]

    return {"error": None,
            "same": (torch.equal(rows(first), rows(want_first)), torch.equal(rows(second), rows(want_second)))}


def _ops_on_two_streams_in_one_graph(ctx, backend_name: str) -> dict:
    """The same two dispatches captured in one CUDA graph: the second on a stream forked from the capture
    stream before the first was issued, so the graph holds them as two branches, which a replay may run in
    either order, unless the backend made the second wait for the first (an edge of the graph). On rank 0
    a sleep captured ahead of the first holds that branch back."""
    from test_faults_gpu import make_backend, routed_tokens

    backend = make_backend(ctx, backend_name, timeout_s=5.0, blocking=False)
    x, routing = routed_tokens(ctx, 805)
    twice = x * 2
    backend.dispatch(x, **routing)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph, capture, branch = torch.cuda.CUDAGraph(), torch.cuda.Stream(ctx.device), torch.cuda.Stream(ctx.device)
    with torch.cuda.graph(graph, stream=capture):
        branch.wait_stream(capture)  # the fork: the branch sees none of what follows on the capture stream
        if ctx.rank == 0:
            torch.cuda._sleep(int(2e9))  # ~1 s
        first = backend.dispatch(x, **routing)
        with torch.cuda.stream(branch):
            second = backend.dispatch(twice, **routing)
        capture.wait_stream(branch)  # the join: a capture ends with every branch joined
    graph.replay()
    torch.cuda.synchronize()
    result = _compare_with_one_stream(backend, x, routing, first, second)
    backend.destroy()
    return result


def _on_two_ranks_with_many_queues(case, backend_name: str) -> list:
    from ep_plugin.testing import run_ranks

    # Streams share a hardware queue when a process has fewer connections than streams (Megatron often sets
    # CUDA_DEVICE_MAX_CONNECTIONS=1; MPS may give its clients few), and then run in issue order anyway.
    return run_ranks(case, 2, backend_name, device="cuda", timeout_s=120, env={"CUDA_DEVICE_MAX_CONNECTIONS": "32"})


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["hybrid", "elastic"])
def test_ops_on_two_streams_run_in_the_order_they_were_issued(backend_name):
    for rank, result in enumerate(_on_two_ranks_with_many_queues(_ops_on_two_streams, backend_name)):
        # overtaking_possible: rank 0 issued the second dispatch while the sleep still ran (else the test
        # proves nothing).
        assert result == {"error": None, "same": (True, True), "overtaking_possible": True,
                          "host_wait_covered_both": True}, (rank, result)


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["hybrid", "elastic"])
def test_ops_on_two_streams_of_one_capture_replay_in_the_order_they_were_issued(backend_name):
    for rank, result in enumerate(_on_two_ranks_with_many_queues(_ops_on_two_streams_in_one_graph, backend_name)):
        assert result == {"error": None, "same": (True, True)}, (rank, result)


def _combine_input_on_another_stream(ctx, backend_name: str) -> dict:
    """combine_input hands out memory of the buffer that the backend's queued ops may still use (elastic's
    two-stage combine receives there; peers may read an in-place combine input until the next op met them).
    Taken on another stream than the ops', that stream must wait for them: a sleep queued on the ops' stream
    after the dispatch stands for a slow op still queued there."""
    from test_faults_gpu import make_backend, routed_tokens

    options = {"combine_input_rows": 4096} if backend_name == "hybrid" else {}
    backend = make_backend(ctx, backend_name, options=options, timeout_s=20.0)
    x, routing = routed_tokens(ctx, 807)
    out = backend.dispatch(x, **routing)
    rows = backend.combine_input(out.handle)
    rows.copy_(out.hidden)
    want = backend.combine(rows, out.handle).hidden  # in place, on one stream
    torch.cuda.synchronize()
    writer = torch.cuda.Stream(ctx.device)

    def take_on_writer(sleep_cycles: int) -> tuple:
        out = backend.dispatch(x, **routing)
        slept = torch.cuda.Event()
        torch.cuda._sleep(sleep_cycles)  # on the ops' (current) stream
        slept.record()
        with torch.cuda.stream(writer):
            rows = backend.combine_input(out.handle)
            taken = torch.cuda.Event()
            taken.record()
            time.sleep(0.1)  # an idle stream reaches the event by then; one that waits for the sleep does not
            sleep_running = not slept.query()
            writer_waited = not taken.query()
            rows.copy_(out.hidden)  # the expert's write
        torch.cuda.current_stream(ctx.device).wait_stream(writer)
        same = torch.equal(backend.combine(rows, out.handle).hidden, want)
        torch.cuda.synchronize()
        return writer_waited, sleep_running, same

    # A first round without the sleep makes the stream's, the events' and the allocator's first calls, any of
    # which may wait for the device and so hold the host back until the sleep ended (proving nothing then).
    take_on_writer(0)
    writer_waited, sleep_running, same = take_on_writer(int(2e9))  # ~1 s
    backend.destroy()
    return {"writer_waited": writer_waited, "sleep_running_at_the_query": sleep_running, "same": same}


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["hybrid", "elastic"])
def test_a_combine_input_taken_on_another_stream_waits_for_the_queued_ops(backend_name):
    for rank, result in enumerate(_on_two_ranks_with_many_queues(_combine_input_on_another_stream, backend_name)):
        # sleep_running_at_the_query: the host reached the query while the sleep still ran (else the test
        # proves nothing)
        assert result == {"writer_waited": True, "sleep_running_at_the_query": True, "same": True}, (rank, result)


def _handle_dropped_before_its_combine_on_another_stream_ran(ctx, backend_name: str) -> dict:
    """EP_PLUGIN_AVOID_RECORD_STREAM=1: the caller keeps its own inputs (the rows) alive, nothing else. A
    combine queued on a side stream behind a sleep, then the handle dropped: its layout (our allocation,
    made on the dispatch's stream) must not go back to that stream's pool while the combine still reads it.
    Allocations on the dispatch's stream right after the drop stand for the caller's next work."""
    import gc
    import weakref

    from test_faults_gpu import make_backend, routed_tokens

    backend = make_backend(ctx, backend_name, timeout_s=20.0, blocking=False, avoid_record_stream=True)
    x, routing = routed_tokens(ctx, 809)
    out = backend.dispatch(x, **routing)
    want = backend.combine(out.hidden, out.handle).hidden  # everything kept, one stream
    torch.cuda.synchronize()
    main, side = torch.cuda.current_stream(ctx.device), torch.cuda.Stream(ctx.device)

    def combine_on_side(sleep_cycles: int) -> tuple:
        out = backend.dispatch(x, **routing)
        rows, layout_memory = out.hidden, out.handle.layout.scratch.memory
        words, layout_gone = layout_memory.numel(), weakref.ref(layout_memory)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            torch.cuda._sleep(sleep_cycles)
            got = backend.combine(rows, out.handle).hidden
            combined = torch.cuda.Event()
            combined.record()
        del out, layout_memory  # the caller drops the handle (and with it the layout) at once
        gc.collect()
        # Many: the pool hands out its free blocks of that size lowest address first, and the freed layout's must
        # be among those taken.
        litter = [torch.full((words,), -1, dtype=torch.int32, device=ctx.device) for _ in range(64)]
        littered = torch.cuda.Event()
        littered.record(main)
        littered.synchronize()
        combine_was_queued = not combined.query()
        main.wait_stream(side)
        same = torch.equal(got, want)
        torch.cuda.synchronize()
        del litter
        return layout_gone() is None, combine_was_queued, same

    combine_on_side(0)  # the first calls of the streams, events and allocator, which may wait for the device
    layout_dropped, combine_was_queued, same = combine_on_side(int(2e9))  # ~1 s
    error = None
    try:
        backend.check_errors()
    except Exception as caught:  # noqa: BLE001 - reported in the result
        error = f"{type(caught).__name__}: {caught}"
    backend.destroy()
    return {"layout_dropped": layout_dropped, "combine_was_queued": combine_was_queued, "same": same,
            "error": error}


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["hybrid", "elastic"])
def test_a_handle_dropped_before_its_combine_on_another_stream_ran_keeps_its_layout(backend_name):
    """The layout went back to the dispatch stream's pool with the handle: the next allocation there took it
    and the queued combine read -1s (wrong rows, or a fault)."""
    cases = _on_two_ranks_with_many_queues(_handle_dropped_before_its_combine_on_another_stream_ran, backend_name)
    for rank, result in enumerate(cases):
        # layout_dropped and combine_was_queued: the handle's last reference went while the combine was still
        # queued (else the test proves nothing)
        assert result == {"layout_dropped": True, "combine_was_queued": True, "same": True, "error": None}, \
            (rank, result)


def _ops_from_gpu_0(ctx, backend_name: str) -> dict:
    """A job that passes ``device=`` without torch.cuda.set_device: every rank's current device is GPU 0.
    Each step's current device afterwards, and whether the round trip matches the same ops issued with
    the backend's own GPU current. Hybrid also routes an expert output to its combine-input arena (whose
    memory pool is made at that first use) and combines it in place."""
    from test_faults_gpu import MAX_TOKENS, make_backend, routed_tokens

    torch.cuda.set_device(0)
    current = {}
    options = {"combine_input_rows": MAX_TOKENS * 4} if backend_name == "hybrid" else {}
    backend = make_backend(ctx, backend_name, **options)
    current["build"] = torch.cuda.current_device()
    with torch.cuda.device(ctx.device):  # the tokens on the backend's GPU, as a job that passes device= has them
        x, routing = routed_tokens(ctx, 809)
    out = backend.dispatch(x, **routing)
    current["dispatch"] = torch.cuda.current_device()
    back = backend.combine(out.hidden, out.handle).hidden
    current["combine"] = torch.cuda.current_device()
    with torch.cuda.device(ctx.device):
        again = backend.dispatch(x, **routing)
        want = backend.combine(again.hidden, again.handle).hidden
        torch.cuda.synchronize()
    result = {"same": torch.equal(back, want)}
    if backend_name == "hybrid":
        out = backend.dispatch(x, **routing)
        with backend.combine_input_arena() as usable:
            rows = out.hidden * 1  # on the backend's GPU: in its arena where the pool took it
        current["arena"] = torch.cuda.current_device()
        in_place_before = backend.combine_counts.get("in_place", 0)
        in_arena = backend.combine(rows, out.handle).hidden
        result["arena"] = (usable, backend.arena.unusable_reason,
                           backend.combine_counts.get("in_place", 0) - in_place_before,
                           torch.allclose(in_arena.float(), back.float(), rtol=1e-2, atol=1e-2))
        del rows
    backend.destroy()
    current["destroy"] = torch.cuda.current_device()
    return {"current": current, **result}


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["hybrid", "elastic"])
def test_ops_leave_the_callers_current_device_on_two_gpus(backend_name):
    # The extension's entry points select the backend's GPU for their CUDA calls; they must give the
    # caller's current device back (else rank 1's next torch.empty(device="cuda") lands on GPU 1).
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two visible GPUs (one rank each, the current device GPU 0 on both)")
    from ep_plugin.testing import run_ranks

    steps = ["build", "dispatch", "combine"] + ["arena"] * (backend_name == "hybrid") + ["destroy"]
    for rank, result in enumerate(run_ranks(_ops_from_gpu_0, 2, backend_name, device="cuda", timeout_s=120)):
        assert result["current"] == dict.fromkeys(steps, 0) and result["same"], (rank, result)
        # The arena's pool belongs to the backend's GPU: made on the caller's (GPU 0), rank 1's outputs
        # came from plain cudaMalloc, the arena was marked unusable and every combine went two-stage.
        assert backend_name != "hybrid" or result["arena"] == (True, None, 1, True), (rank, result)
