"""Host cost of the calls an eager dispatch + combine makes, one process, no kernels waited for.

Eager decode (128 tokens) is bound by the host: each op is a few dozen torch and extension calls.
This prints what one of each costs here (median µs over many calls), then the host time of whole
eager steps (dispatch + combine, 128 tokens) of each compiled backend on a one-rank group, split
into argument structs, launches and the rest (cProfile), so that a cut to the host path can be
aimed at what is dear. One rank: its kernels are short, so the host never waits for them; the
host work per step is that of a rank of a larger group but for R-sized loops. Numbers only.

  python benchmarks/host_costs.py [--calls 20000] [--steps 2000] [--lines]

--lines adds a per-line table of the hot functions (needs the line_profiler package): the time each
line of _dispatch, _combine and the helpers they call takes, to find what a cut should aim at.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist


def per_call_us(fn, calls: int, rounds: int = 5) -> float:
    """Median over ``rounds`` of the mean µs per call of ``fn`` over ``calls`` calls."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=2000, help="eager steps per backend in the second table")
    parser.add_argument("--lines", action="store_true", help="per-line times of the hot functions (line_profiler)")
    args = parser.parse_args()
    from ep_plugin import _cuda, streams
    from ep_plugin.backends.compiled import nvtx_range

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    small = torch.empty(64, dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device)
    extension = _cuda.extension()

    def nvtx_range_enter_exit():
        with nvtx_range("ep.host_costs"):
            pass

    def torch_nvtx_range_enter_exit():
        with torch.cuda.nvtx.range("ep.host_costs"):
            pass

    cases = {
        "torch.empty(64) int32": lambda: torch.empty(64, dtype=torch.int32, device=device),
        "torch.empty(128, 7168) bf16": lambda: torch.empty(128, 7168, dtype=torch.bfloat16, device=device),
        "torch.cuda.current_stream(device)": lambda: torch.cuda.current_stream(device),
        "torch.cuda.current_stream(device).cuda_stream": lambda: torch.cuda.current_stream(device).cuda_stream,
        "torch._C._cuda_getCurrentRawStream(index)": lambda: torch._C._cuda_getCurrentRawStream(0),
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "torch.cuda.Event() + record(stream)": lambda: torch.cuda.Event().record(stream),
        "tensor.record_stream(stream)": lambda: small.record_stream(stream),
        "tensor.data_ptr()": small.data_ptr,
        "tensor[0:1] (a view)": lambda: small[0:1],
        "with nvtx_range(...): pass": nvtx_range_enter_exit,
        "with torch.cuda.nvtx.range(...): pass": torch_nvtx_range_enter_exit,
        "streams.stream_handle(device)": lambda: streams.stream_handle(device),
        "_C.cuda_device_count()": extension.cuda_device_count,
        "_C.elastic.SendArgs(3 tensors, 6 ints)": lambda: extension.elastic.SendArgs(
            hidden=small, send_slot=small, topk_idx=small, row_bytes=16, scale_bytes=0, topk=8, num_tokens=128,
            push_payload=True, bulk_copy=True),
    }
    print(f"{'call':<48} {'µs':>8}")
    for name, fn in cases.items():
        print(f"{name:<48} {per_call_us(fn, args.calls):>8.2f}", flush=True)
    torch.cuda.synchronize()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    for backend in ("hybrid", "hybrid+in_place", "elastic+in_place"):
        print(backend_step_costs(backend, device, args.steps, per_line=args.lines), flush=True)
    dist.destroy_process_group()


class _Clock:
    """Wraps the extension's argument structs and launchers to add up their host time (by name)."""

    def __init__(self, extension) -> None:
        self.totals: dict[str, float] = collections.defaultdict(float)
        self.restore: list[tuple[object, str, object]] = []
        for module in (extension, extension.hybrid, extension.elastic):
            for name in dir(module):
                target = getattr(module, name)
                if name.endswith("Args") or name in ("exchange", "layout", "dispatch_send", "dispatch_receive",
                                                      "permute", "combine_send", "combine_recv"):
                    self.restore.append((module, name, target))
                    setattr(module, name, self._timed(target, ("struct " if name.endswith("Args") else "launch ")
                                                      + name))

    def _timed(self, target, label):
        totals = self.totals

        def call(*args, **kwargs):
            start = time.perf_counter()
            result = target(*args, **kwargs)
            totals[label] += time.perf_counter() - start
            return result
        return call

    def close(self) -> None:
        for module, name, target in self.restore:
            setattr(module, name, target)


def _hot_functions() -> list:
    """The functions an eager dispatch + combine runs through (for --lines)."""
    from ep_plugin import routing, streams
    from ep_plugin.backends import base, compiled, elastic, hybrid
    from ep_plugin.transport import symmetric

    return [base.Backend.dispatch, base.Backend.combine, base.Backend.check_dispatch_input, base.Backend.check_hidden,
            base.Backend.check_handle, routing.make_routing, routing.check_tensor, streams.keep_on_stream,
            streams.record_ready, compiled.CompiledBackend._layout, compiled.CompiledBackend._exchange,
            compiled.CompiledBackend._layout_args, compiled.CompiledBackend._layout_and_exchange, compiled.Scratch.args,
            hybrid.HybridBackend._dispatch, hybrid.HybridBackend._combine, hybrid.HybridBackend._fingerprint,
            elastic.ElasticBackend.dispatch, elastic.ElasticBackend.combine, elastic.ElasticBackend._dispatch,
            elastic.ElasticBackend._receive_in_place, elastic.ElasticBackend._combine,
            elastic.ElasticBackend.combine_input, symmetric.SymmetricBuffer.region_tensor]


def _line_table(step, steps: int) -> str:
    import line_profiler

    profiler = line_profiler.LineProfiler()
    for function in _hot_functions():
        profiler.add_function(function)
    profiler.enable_by_count()
    for _ in range(steps):
        step()
    profiler.disable_by_count()
    torch.cuda.synchronize()
    text = io.StringIO()
    profiler.print_stats(stream=text, output_unit=1e-6, stripzeros=True)
    return text.getvalue()


def backend_step_costs(variant: str, device: torch.device, steps: int, per_line: bool = False) -> str:
    """Host µs per eager step of one backend on a one-rank group, and where they go."""
    from kernel_times import decode_backend, eager_step  # this folder: what kernel_times.py times

    from ep_plugin import _cuda
    from ep_plugin.bench.workload import Shape

    in_place = variant.endswith("+in_place")
    shape = Shape(128, 7168, 8, 256, "bf16", "balanced")
    backend = decode_backend(variant, None, 1, device)
    step = eager_step(backend, shape, 0, device, in_place=in_place)
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    plain_us = (time.perf_counter() - start) * 1e6 / steps
    torch.cuda.synchronize()
    clock = _Clock(_cuda.extension())
    start = time.perf_counter()
    for _ in range(steps):
        step()
    clocked_us = (time.perf_counter() - start) * 1e6 / steps
    clock.close()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps // 4):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    line_table = _line_table(step, steps // 4) if per_line else ""
    backend.destroy()
    lines = [f"\n{variant}: {plain_us:.1f} us host per step (dispatch + combine), {clocked_us:.1f} with the clocks",
             f"  {'extension calls':<40} {'us/step':>8}"]
    for label, total in sorted(clock.totals.items(), key=lambda item: -item[1]):
        lines.append(f"  {label:<40} {total * 1e6 / steps:>8.2f}")
    lines.append(f"  {'all of them':<40} {sum(clock.totals.values()) * 1e6 / steps:>8.2f}")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return "\n".join(lines) + "\n" + text.getvalue() + line_table


if __name__ == "__main__":
    main()
