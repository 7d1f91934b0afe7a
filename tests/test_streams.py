"""The stream policy's helpers on a real GPU: launches go to the caller's current stream."""

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
