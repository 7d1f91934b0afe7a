"""The stream policy both compiled backends follow (one place, so they cannot drift apart).

Ops run on the caller's current stream. Inputs that our kernels read are tied to that stream with
``record_stream`` (unless ``avoid_record_stream`` is set, or a CUDA graph is being captured), so the
caching allocator does not hand their memory to another stream while a kernel may still read it.

Outputs are ordinary allocator tensors owned by the caller. A consumer on another stream calls
``DispatchOutput.use_on(stream)``, which does both halves of the hand-off: the stream waits on the
output's ready event (readiness), and every output storage is ``record_stream``-ed on it
(ownership: the allocator will not reuse the memory before that stream's work is done, even after
the caller dropped its references). A prefix view keeps its whole allocation alive.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Optional

import torch

# torch's accessor for the current stream's raw handle (what its own kernels launch on): 0.1-0.2 µs where
# current_stream(device).cuda_stream costs 3-5 µs (benchmarks/host_costs.py), and an eager op asks
# several times. Private, hence the fallbacks.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# torch.cuda.Stream objects by (device index, raw handle). A handle names one stream of its device for
# the process's life (pool and default streams are never destroyed; an external stream's id is its
# handle), so an object made once stands for every later current_stream(device) with that key, at a
# dict lookup instead of 3-5 µs. The device is part of the key: every device's default stream is
# handle 0.
_streams_by_handle: dict[tuple[int, int], torch.cuda.Stream] = {}
_MAX_CACHED_STREAMS = 256  # a program that cycles through external streams must not grow this forever


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """torch.cuda.current_stream(device), for the record_stream and event calls on every op."""
    if _current_raw_stream is None or device.index is None:
        return torch.cuda.current_stream(device)
    key = (device.index, _current_raw_stream(device.index))
    stream = _streams_by_handle.get(key)
    if stream is None:
        if len(_streams_by_handle) >= _MAX_CACHED_STREAMS:
            _streams_by_handle.clear()
        stream = _streams_by_handle[key] = torch.cuda.current_stream(device)
    return stream


def stream_handle(device: torch.device) -> int:
    """The cudaStream_t of the current stream, as the launchers take it."""
    if _current_raw_stream is not None and device.index is not None:
        return _current_raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def keep_on_stream(device: torch.device, tensors: Iterable[Optional[torch.Tensor]], *,
                   avoid_record_stream: bool) -> None:
    """Tie caller-owned inputs to the stream our kernels read them on."""
    if avoid_record_stream or torch.cuda.is_current_stream_capturing():
        return
    stream = current_stream(device)
    for tensor in tensors:
        if tensor is not None and tensor.numel():
            tensor.record_stream(stream)


def record_ready(device: torch.device) -> Optional[torch.cuda.Event]:
    """An event on the current stream, after the last kernel that writes an op's outputs (None while a
    CUDA graph is captured: such an event could not be waited on outside the graph)."""
    if torch.cuda.is_current_stream_capturing():
        return None
    event = torch.cuda.Event()
    event.record(current_stream(device))
    return event


def use_on(stream: torch.cuda.Stream, ready: Optional[torch.cuda.Event],
           tensors: Iterable[Optional[torch.Tensor]]) -> None:
    """Make outputs safe to read on ``stream``: wait until they are ready, then tie every storage to it."""
    if ready is not None:
        stream.wait_event(ready)
    for tensor in tensors:
        if tensor is not None and tensor.is_cuda:
            tensor.record_stream(stream)


def wait_for_stream(device: torch.device, timeout_s: float, what: str) -> None:
    """Host wait, with a timeout, until the current stream has run what was queued so far.

    Raises EPTimeoutError naming ``what`` when it runs past ``timeout_s``.
    """
    from .errors import EPTimeoutError

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise EPTimeoutError(f"{what}: the stream did not finish its queued work within {timeout_s:.1f} s")
        time.sleep(5e-5)


def wait_for_device(device: torch.device, timeout_s: float, what: str,
                    before_timeout: Optional[Callable[[], None]] = None) -> None:
    """Host wait, with a timeout, until every stream of ``device`` has run what was queued so far.

    ``torch.cuda.synchronize`` cannot be abandoned, so it runs in a helper thread (which releases the GIL)
    and this thread waits for it. Past ``timeout_s``, ``before_timeout`` may raise a more precise error
    (a device report); else EPTimeoutError names ``what``. The helper thread then stays blocked until the
    device drains: the process is expected to stop, but it gets a message instead of a silent hang.
    """
    if device.index is None:  # resolved here: the helper thread's current device is its own
        device = torch.device("cuda", torch.cuda.current_device())
    run_until_done(lambda: torch.cuda.synchronize(device), timeout_s, what, before_timeout,
                   hint="some kernel on this GPU is still running: ours report their own timeouts, so most "
                        "likely another library's (an NCCL collective waiting for a peer, a user kernel)")


def run_until_done(call: Callable[[], None], timeout_s: float, what: str,
                   before_timeout: Optional[Callable[[], None]] = None, hint: str = "") -> None:
    """Run ``call`` (a blocking wait that cannot time out by itself) in a daemon thread; raise its error,
    or EPTimeoutError naming ``what`` when it has not returned within ``timeout_s``."""
    from .errors import EPTimeoutError

    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread, which raises it
            failure.append(error)
        finally:
            done.set()

    threading.Thread(target=run, name="ep_plugin-wait", daemon=True).start()
    if not done.wait(timeout_s):
        if before_timeout is not None:
            before_timeout()
        raise EPTimeoutError(f"{what}: not done within {timeout_s:.1f} s" + (f" ({hint})" if hint else ""))
    if failure:
        raise failure[0]
