"""What every rank runs: build backends, time dispatch/combine, time the ceiling, gather samples.

Timing: CUDA events around each call after warm-up, a barrier (host + device) before each
iteration so ranks start together; on CPU, the host clock. Rank 0 also times the ceiling in
the same run: with ranks sharing a GPU, one device-to-device copy of as many bytes as all
ranks' outputs together (the least traffic the operation can cost on that GPU).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.config import Config
from ep_plugin.testing import RankContext

from .workload import Shape, make_hidden, make_routing, traffic


@dataclass(frozen=True)
class SweepSpec:
    backends: tuple[str, ...]
    tokens: tuple[int, ...]
    hidden: tuple[int, ...]
    topk: tuple[int, ...]
    experts: tuple[int, ...]
    payloads: tuple[str, ...]
    sms: tuple[int, ...]
    routings: tuple[str, ...]
    modes: tuple[str, ...]
    warmup: int = 3
    iters: int = 10
    reference_max_tokens: int = 4096
    reference_iters: int = 3
    seed: int = 0
    extra_config: dict = field(default_factory=dict)


def _supported(backend_name: str, backend_cls, payload: str, mode: str) -> bool:
    caps = backend_cls.capabilities
    if payload == "fp8" and not caps.fp8_dispatch:
        return False
    return mode == "blocking" or caps.non_blocking


def _barrier(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


class _Timer:
    """CUDA events on a GPU, the host clock on CPU; returns microseconds between marks."""

    def __init__(self, device: torch.device, marks: int) -> None:
        self.cuda = device.type == "cuda"
        self.marks = [torch.cuda.Event(enable_timing=True) for _ in range(marks)] if self.cuda else [0.0] * marks

    def mark(self, index: int) -> None:
        if self.cuda:
            self.marks[index].record()
        else:
            self.marks[index] = time.perf_counter()

    def elapsed_us(self, start: int, end: int) -> float:
        if self.cuda:
            self.marks[end].synchronize()
            return self.marks[start].elapsed_time(self.marks[end]) * 1e3
        return (self.marks[end] - self.marks[start]) * 1e6


def _time_calls(backend, shape: Shape, rank: int, seed: int, device, warmup: int, iters: int) -> list[list[float]]:
    routing_map, probs = make_routing(shape, rank, seed, device)
    payload_dtype = torch.bfloat16
    hidden = make_hidden(shape, rank, device, payload_dtype)
    timer, samples, combine_rows = _Timer(device, 3), [], None
    for iteration in range(warmup + iters):
        _barrier(device)
        timer.mark(0)
        out = backend.dispatch(hidden, routing_map=routing_map, probs=probs)
        timer.mark(1)
        rows = out.hidden
        if isinstance(rows, tuple):  # fp8 dispatch: combine takes bf16 rows of the same count
            if combine_rows is None or combine_rows.shape[0] != rows[0].shape[0]:
                combine_rows = torch.randn(rows[0].shape[0], shape.hidden, device=device).to(payload_dtype)
            rows = combine_rows
        backend.combine(rows, out.handle)
        timer.mark(2)
        if iteration >= warmup:
            samples.append([timer.elapsed_us(0, 1), timer.elapsed_us(1, 2)])
    return samples


def _time_copy_us(num_bytes: int, device: torch.device, repeats: int = 5) -> float:
    """Median time of one device-to-device copy of num_bytes (the shared-GPU ceiling)."""
    if num_bytes == 0 or device.type != "cuda":
        return float("nan")
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    timer, times = _Timer(device, 2), []
    for _ in range(repeats + 1):
        timer.mark(0)
        dst.copy_(src)
        timer.mark(1)
        times.append(timer.elapsed_us(0, 1))
    del src, dst
    return statistics.median(times[1:])


def _run_case(ctx: RankContext, spec: SweepSpec, backend, shape: Shape, device, shared_gpu: bool,
              ceiling_cache: dict[int, float]) -> dict:
    """Time one shape on every rank; rank 0 also times the ceiling. Returns the record (complete on rank 0)."""
    iters = spec.reference_iters if backend.name == "reference" else spec.iters
    samples = _time_calls(backend, shape, ctx.rank, spec.seed, device, spec.warmup, iters)
    all_samples = [None] * ctx.world_size
    dist.all_gather_object(all_samples, samples)
    # Every rank's routing is reproducible from the seed: no need to gather the maps.
    maps = [make_routing(shape, r, spec.seed, torch.device("cpu"))[0] for r in range(ctx.world_size)]
    bytes_per_rank = traffic(maps, ctx.world_size, shape)
    combine_bytes = sum(bytes_per_rank["out_bytes"]) // shape.row_bytes() * 2 * shape.hidden  # bf16 rows back
    ceilings = {}
    if ctx.rank == 0 and shared_gpu:
        for op, num_bytes in (("dispatch", sum(bytes_per_rank["out_bytes"])), ("combine", combine_bytes)):
            if num_bytes not in ceiling_cache:
                ceiling_cache[num_bytes] = _time_copy_us(num_bytes, device)
            ceilings[op] = ceiling_cache[num_bytes]
    _barrier(device)
    return dict(payload=shape.payload, tokens=shape.tokens, hidden=shape.hidden, topk=shape.topk,
                experts=shape.experts, routing=shape.routing, ranks=ctx.world_size, samples_us=all_samples,
                bytes=bytes_per_rank, ceiling_us=ceilings)


def bench_rank(ctx: RankContext, spec: SweepSpec) -> Optional[list[dict]]:
    """Run the sweep on this rank; rank 0 returns every record (with all ranks' samples)."""
    torch.set_num_threads(1)
    device = torch.device(ctx.device)
    shared_gpu = ctx.plan.use_mps
    records: list[dict] = []
    plan = [(name, hidden, experts, sms, mode)
            for name in spec.backends for hidden in spec.hidden for experts in spec.experts
            for sms in (spec.sms if name != "reference" else spec.sms[:1]) for mode in spec.modes]
    total = len(plan) * len(spec.tokens) * len(spec.topk) * len(spec.payloads) * len(spec.routings)
    progress = None
    if ctx.rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=total, desc="bench", unit="case")
    ceiling_cache: dict[int, float] = {}
    for name, hidden, experts, sms, mode in plan:
        cls = ep_plugin.get_backend(name)
        config = Config.from_env(num_sms=sms, blocking=(mode == "blocking"), max_tokens_per_rank=max(spec.tokens),
                                 **spec.extra_config)
        backend = None
        for tokens, topk, payload, routing in itertools.product(spec.tokens, spec.topk, spec.payloads,
                                                                spec.routings):
            if progress:
                progress.update()
            if not _supported(name, cls, payload, mode) or (name == "reference" and
                                                             tokens > spec.reference_max_tokens):
                continue
            if backend is None:  # built lazily: a backend owns large buffers
                backend = cls(hidden_size=hidden, num_experts=experts, config=config, device=device)
            shape = Shape(tokens, hidden, topk, experts, payload, routing)
            record = _run_case(ctx, spec, backend, shape, device, shared_gpu, ceiling_cache)
            if ctx.rank == 0:
                record.update(backend=name, mode=mode, sms=sms if name != "reference" else None)
                records.append(record)
        if backend is not None:
            backend.destroy()
            del backend
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if progress:
        progress.close()
    return records if ctx.rank == 0 else None


def environment(device: str, plan) -> dict:
    """Versions and hardware, for the JSON next to the figures."""
    info = {"torch": torch.__version__, "ranks": plan.num_ranks, "device": device,
            "process_group": plan.process_group_backend, "ranks_per_gpu": plan.ranks_per_gpu or None}
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms_per_gpu=props.multi_processor_count, cuda=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())), gpus=torch.cuda.device_count())
        try:
            import subprocess

            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=10).stdout.split("\n")[0]
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    return info
