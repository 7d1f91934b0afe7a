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
