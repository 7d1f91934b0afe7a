"""What every rank runs: build backends, time dispatch/combine, time the ceiling, gather samples.

Timing (docs/design.md, performance method). Per case: one barrier (host + device) so ranks start together, then the
warm-up and timed iterations back to back — dispatch, combine, dispatch, combine, ... — with a
CUDA event recorded before dispatch, between dispatch and combine, and after combine of every
iteration. All events are allocated up front and read after one synchronize at the end, so
nothing on the host sits between the calls. A rank's time still includes waiting for slower
ranks inside the op's own handshake (that is part of the op), but no longer the skew of leaving
a host barrier (hundreds of µs with gloo and 8 processes). ``sync_each_iter`` restores the old
method, a barrier before every iteration. On CPU the host clock marks the same points.

Step (the "step" row): the same iterations again with no event between them, one event before and one
after the loop (warm-up first, so the ranks' skew out of the barrier is not timed): µs per dispatch +
combine as a training or decode loop runs them. The per-op events cost time of their own when ranks
share a GPU, so this can be lower than the round trip summed from them.

CUDA graphs (``graph``; non-blocking mode on CUDA, backends with ``capabilities.cuda_graphs``):
after eager warm-up on a side stream, one dispatch is captured into a graph and one combine of
its output (same backend, same handle) into a second; replays are timed like eager calls and
reported as mode "nonblocking+graph". A failed capture is recorded as ``graph_error``, not raised.

Ceiling, timed by rank 0 in the same run with ranks sharing one GPU: one device-to-device copy of
as many bytes as all ranks' outputs together. A yardstick that every pass shares, not a floor: a
dispatch must read each token once and write each of its k rows (a copy moves both k times), so
ceil/ours above 1 is reachable (an in-place combine reads the rows where they are). Ranks spread
over several GPUs get none. With one GPU per rank the report derives it from ``link_floor_bytes``
and the line rate.

Values: after the timed loops every case runs one checked dispatch and combine (``verify.py``); a case
whose ops moved a wrong row, or reported dropped rows or ids (``_outputs_problem``), is recorded with an
``error`` and gives no figure. CUDA-graph records reuse the eager case's backend and kernels: their values
are not checked again, what the replays' kernels report is (their record's ``error``).
"""

from __future__ import annotations

import functools
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.backends.compiled import worst_case_rows
from ep_plugin.cli import host_memory
from ep_plugin.config import Config
from ep_plugin.host_collectives import nccl_moves_cuda
from ep_plugin.routing import route_counts
from ep_plugin.testing import RankContext

from . import verify
from .workload import Shape, make_hidden, make_routing, make_topk, traffic

GRAPH_MODE = "nonblocking+graph"
# The transport baseline in --backends (no ep_plugin backend): all_to_all_single of the compact rows.
ALL_TO_ALL = "all_to_all"


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
    reference_max_tokens: int = 4096  # 0 = no limit
    reference_iters: int = 3
    seed: int = 0
    sync_each_iter: bool = False  # a barrier before every iteration (the old, skewed method)
    graph: bool = False  # also time CUDA-graph replays of non-blocking dispatch/combine
    extra_config: dict = field(default_factory=dict)
    # Ranks per NVLink domain to run each backend with (0 = detected); a smaller size splits the ranks into
    # domains joined by scale-out rails. The reference also runs flat (0, whatever EP_PLUGIN_SCALEUP_SIZE says),
    # as the baseline.
    scaleup_sizes: tuple[int, ...] = (0,)
    # Where rank 0 appends each finished record (a JSON line): a sweep that the launcher's timeout ends keeps
    # what finished. "" = nowhere.
    records_path: str = ""


def supported(backend_cls, payload: str, mode: str) -> bool:
    """Whether the backend runs this payload in this mode (its capabilities)."""
    caps = backend_cls.capabilities
    if payload == "fp8" and not caps.fp8_dispatch:
        return False
    return mode == "blocking" or caps.non_blocking


def _graph_applies(spec: SweepSpec, backend_cls, mode: str, device: torch.device) -> bool:
    return spec.graph and mode == "nonblocking" and device.type == "cuda" and backend_cls.capabilities.cuda_graphs


def _reference_skips(spec: SweepSpec, name: str, tokens: int) -> bool:
    return name == "reference" and 0 < spec.reference_max_tokens < tokens


def _barrier(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


class _Timer:
    """CUDA events on a GPU, the host clock on CPU; mark freely, finish() once, then read µs."""

    def __init__(self, device: torch.device, marks: int) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks = [torch.cuda.Event(enable_timing=True) for _ in range(marks)] if self.cuda else [0.0] * marks

    def mark(self, index: int) -> None:
        if self.cuda:
            self.marks[index].record()
        else:
            self.marks[index] = time.perf_counter()

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def elapsed_us(self, start: int, end: int) -> float:
        if self.cuda:
            return self.marks[start].elapsed_time(self.marks[end]) * 1e3
        return (self.marks[end] - self.marks[start]) * 1e6


# Backend-name variants ("hybrid+arena") whose combine reads the rows where they lie in the buffer.
IN_PLACE_VARIANTS = ("in_place", "arena")


def in_place_dispatch(backend, in_place: bool) -> dict:
    """The dispatch options of an in-place case: rows into the receivers' buffers where the backend
    can write them there (elastic); an empty dict otherwise (hybrid's in-place mode is its combine)."""
    return dict(in_place=True) if in_place and "in_place" in backend.capabilities.dispatch_options else {}


class _Calls:
    """One case's inputs and its two ops; combine consumes the latest dispatch's output. ``variant``
    "in_place": combine reads rows from the backend's own buffer (``combine_input``), filled once: the
    expert's write of its output there belongs to the expert, not to the combine; and where the
    backend can, dispatch writes its rows into the receivers' buffers too (elastic's ``in_place=True``).
    "arena": every combine's rows are allocated anew inside ``combine_input_arena()``, as Megatron's
    experts allocate their output (hybrid), so the pool's host cost is timed with the combine."""

    def __init__(self, backend, shape: Shape, rank: int, seed: int, device: torch.device, variant: str = "") -> None:
        self.backend, self.shape, self.device = backend, shape, device
        self.in_place, self.arena = variant in IN_PLACE_VARIANTS, variant == "arena"
        self._filled = False
        if "routing_map" in backend.capabilities.routing_forms:
            routing_map, probs = make_routing(shape, rank, seed, device)
            self.routing = dict(routing_map=routing_map, probs=probs)
        else:  # the same routing in top-k form
            topk_idx, topk_weights = make_topk(shape, rank, seed, device)
            self.routing = dict(topk_idx=topk_idx, topk_weights=topk_weights)
        self.hidden = make_hidden(shape, rank, device, torch.bfloat16)
        self.out = self.combined = self._bf16_rows = None

    def dispatch(self, hidden=None) -> None:
        """One dispatch of ``hidden`` (default: this case's tokens) along this case's routing."""
        self.out = None  # free the previous output first: non-blocking outputs are worst-case sized
        self.out = self.backend.dispatch(self.hidden if hidden is None else hidden, **self.routing,
                                         **in_place_dispatch(self.backend, self.in_place))

    def combine(self) -> None:
        self.combined = None
        self.combined = self.backend.combine(self.combine_rows(), self.out.handle)

    def combine_rows(self) -> torch.Tensor:
        """The dispatch output, or for fp8 dispatch bf16 rows of the same count (what combine takes)."""
        if self.arena or self.in_place:
            rows = self._rows_in_the_buffer()
            # "in_place": nothing else writes there; "arena": the pool hands the freed block out again. So one
            # fill serves every iteration (verify() checks the values, outside the timing).
            if not self._filled:
                rows.copy_(self._separate_rows())
                self._filled = True
            return rows
        return self._separate_rows()

    def _rows_in_the_buffer(self) -> torch.Tensor:
        """Where an in-place variant's combine reads its rows: a block of the arena, or the backend's buffer."""
        if self.arena:
            with self.backend.combine_input_arena():
                return torch.empty(self.out.handle.num_rows, self.shape.hidden, device=self.device,
                                   dtype=torch.bfloat16)
        return self.backend.combine_input(self.out.handle)

    def verify(self, rank: int, world_size: int) -> Optional[str]:
        """One more dispatch and combine of this case's tokens, checked (``verify.py``): what they got wrong,
        or None. A collective: every rank runs the dispatch, one gather and the combine whatever fails in its
        own checks (a rank that skipped one would pair its next collective with the peers' previous one);
        where a rank's dispatch raised, every rank learns it in the gather and none combines.

        The checked tokens are the timed ones negated (fp8: data sign bits flipped, scales doubled): the same
        routing, other values, so an op that skipped a write (a row, its scales, a token's sum) cannot pass on
        what the timed loop left in memory the allocator hands out again."""
        problem = None
        fresh = _negated(self.hidden)
        try:  # before the dispatch: what this rank sends each expert
            tokens = verify.as_bf16_rows(fresh)
            chosen = verify.chosen_experts(self.routing, self.shape.experts)
            sent = verify.sent_checksums(tokens, chosen, verify.dense_probs(self.routing, self.shape.experts))
        except Exception as exc:  # noqa: BLE001 - reported through the gather below
            problem = f"checking the values (the sent checksums): {type(exc).__name__}: {exc}"
        try:  # one rank's failure (an allocation, say) must not take it past the gather its peers join
            self.dispatch(fresh)
            dispatched = True
        except Exception as exc:  # noqa: BLE001 - reported through the gather below
            problem, dispatched = f"the checked dispatch raised {type(exc).__name__}: {exc}", False
        out, rows, got = self.out, None, None
        if problem is None:
            try:
                # fp8: the dequantized rows go where the timed combines' bf16 rows went (no second copy of that size)
                fp8 = isinstance(out.hidden, tuple)
                rows = verify.as_bf16_rows(out.hidden, out=self._separate_rows() if fp8 else None)
                got = verify.received_per_expert(out, rows)
                verify.scale_copies(out, rows, rank)  # the round trip below then tells a token's copies apart
            except Exception as exc:  # noqa: BLE001
                problem = f"checking the values (the received rows): {type(exc).__name__}: {exc}"
        words: list = [None] * world_size  # each rank's (whether it dispatched, its sent checksums or None)
        dist.all_gather_object(words, (dispatched, None if problem else sent))
        if not all(ok for ok, _ in words):  # no rank combines: one without a dispatch would not meet the others
            return problem  # None: a peer's dispatch failed (its own record says why)
        every = [checksums for _, checksums in words]
        if problem is None and all(s is not None for s in every):
            try:
                problem = verify.dispatch_problem(rank, every, got)
            except Exception as exc:  # noqa: BLE001 - the combine below must still run
                problem = f"checking the values (the checksums): {type(exc).__name__}: {exc}"
        if rows is None:  # this rank could not check: its combine still runs, on the timed loop's rows
            rows = self.combine_rows()
        else:
            rows = self._combine_input_apart(rows)
        self.combined = None
        self.combined = self.backend.combine(rows, out.handle)
        if problem is not None or got is None or any(s is None for s in every):
            return problem  # None: a peer could not check (its own record says why)
        expected = verify.RoundTrip(chosen, out.handle.num_local_experts, out.handle.output_form, self.shape.hidden)
        return verify.round_trip_problem(tokens, expected, self.combined.hidden)

    def _combine_input_apart(self, rows: torch.Tensor) -> torch.Tensor:
        """The checked combine's input: the scaled rows, apart from a bf16 dispatch output, which is then
        overwritten with NaN, so that a combine that read the dispatch output, or its own stash of it, instead of
        its input fails the check (the timed loop combines the dispatch output itself: the same memory). The
        in-place variants' rows go where their combine reads them (the buffer, the arena); fp8's are a bf16
        buffer of their own already, which the timed combines read too. Where a copy does not fit, the rows stay
        where they are and nothing is overwritten."""
        if self.arena or self.in_place:
            rows = self._rows_in_the_buffer().copy_(rows)
        elif rows is self.out.hidden:
            try:
                rows = rows.clone()
            except torch.cuda.OutOfMemoryError:  # (torch.OutOfMemoryError is 2.5's)
                return rows
        hidden = self.out.hidden
        if not isinstance(hidden, tuple) and not _overlap(hidden, rows):
            hidden.fill_(float("nan"))
        return rows

    def _separate_rows(self) -> torch.Tensor:
        rows = self.out.hidden
        if not isinstance(rows, tuple):
            return rows
        if self._bf16_rows is None or self._bf16_rows.shape[0] != rows[0].shape[0]:
            # Drawn in bf16: a float32 draw first would need twice the rows' bytes on top (5 GiB for the busiest
            # rank at 8192 skewed tokens, which ran 8 ranks sharing an H200 out of memory).
            self._bf16_rows = torch.randn(rows[0].shape[0], self.shape.hidden, device=self.device, dtype=torch.bfloat16)
        return self._bf16_rows

    def release(self) -> None:
        self.out = self.combined = None


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes two tensors span overlap (an in-place variant's rows and its dispatch output may be
    regions of one buffer)."""
    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    (a_start, a_end), (b_start, b_end) = span(a), span(b)
    return a_start < b_end and b_start < a_end


def _negated(hidden):
    """-hidden; fp8 (data, scales) as its data's sign bits flipped (float8 has no negation) and its scales doubled
    (exact): dequantized, the values times -2. Both parts differ from the timed loop's, so a dispatch that skipped
    writing either cannot pass on what that loop left (negating the scales alone kept the data bytes)."""
    if isinstance(hidden, tuple):
        data, scales = hidden
        return (data.view(torch.uint8) ^ 0x80).view(torch.float8_e4m3fn), scales * 2
    return -hidden


def _time_pairs(dispatch: Callable[[], None], combine: Callable[[], None], device: torch.device, warmup: int,
                iters: int, sync_each_iter: bool) -> list[list[float]]:
    """[dispatch µs, combine µs] of each timed iteration, by the method in the module docstring."""
    timer = _Timer(device, 3 * (warmup + iters))
    for iteration in range(warmup + iters):
        if iteration == 0 or sync_each_iter:
            _barrier(device)
        first = 3 * iteration
        timer.mark(first)
        dispatch()
        timer.mark(first + 1)
        combine()
        timer.mark(first + 2)
    timer.finish()
    return [[timer.elapsed_us(3 * i, 3 * i + 1), timer.elapsed_us(3 * i + 1, 3 * i + 2)]
            for i in range(warmup, warmup + iters)]


def _time_loop(dispatch: Callable[[], None], combine: Callable[[], None], device: torch.device, warmup: int,
               iters: int) -> float:
    """µs per dispatch + combine over ``iters`` iterations with nothing recorded between them (the step
    row); ``warmup`` untimed iterations after the barrier take up the ranks' skew in leaving it."""
    _barrier(device)
    for _ in range(warmup):
        dispatch()
        combine()
    timer = _Timer(device, 2)
    timer.mark(0)
    for _ in range(iters):
        dispatch()
        combine()
    timer.mark(1)
    timer.finish()
    return timer.elapsed_us(0, 1) / iters


def _warm_up_for_capture(calls: _Calls, warmup: int, device: torch.device) -> torch.cuda.Stream:
    """Eager dispatch + combine on a fresh side stream (torch asks for warm-up there); returns it.

    Every rank runs the same number of these ops: each op handshakes across ranks."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            calls.dispatch()
            calls.combine()
    torch.cuda.current_stream(device).wait_stream(side)
    calls.release()  # nothing eager may be freed while a capture runs
    return side


def _capture_graphs(calls: _Calls, side: torch.cuda.Stream) -> tuple:
    """Capture one dispatch, then one combine of its output (same handle), into two CUDA graphs.

    Capture only records kernels: no handshake runs, so the ranks' device op numbers stay in
    step whatever happens here. Returns (dispatch graph, combine graph); calls.out holds the
    captured dispatch's output, which the combine graph reads.
    """
    dispatch_graph, combine_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(dispatch_graph, stream=side):
        calls.dispatch()
    calls.combine_rows()  # fp8: allocate the bf16 combine input outside the capture
    # The combine graph reads the dispatch graph's outputs: share its memory pool.
    with torch.cuda.graph(combine_graph, stream=side, pool=dispatch_graph.pool()):
        calls.combine()
    return dispatch_graph, combine_graph


def _time_graph_replays(ctx: RankContext, spec: SweepSpec, backend, shape: Shape, device: torch.device,
                        variant: str = "") -> tuple[list[list[float]], Optional[float], Optional[str]]:
    """(samples of graph replays, µs per step of them, None), or ([], None, the error) when capture
    failed on any rank."""
    calls = _Calls(backend, shape, ctx.rank, spec.seed, device, variant)
    side = _warm_up_for_capture(calls, spec.warmup, device)  # eager ops: their errors are real failures
    error = graphs = None
    try:
        graphs = _capture_graphs(calls, side)
    except Exception as exc:  # a capture that fails is a result to report, not a crash
        error = f"{type(exc).__name__}: {exc}"
    # All ranks replay or none does: a lone replay would wait on its peers' handshake forever.
    errors: list[Optional[str]] = [None] * ctx.world_size
    dist.all_gather_object(errors, error)
    failed = [f"rank {rank}: {message}" for rank, message in enumerate(errors) if message]
    if failed:
        return [], None, "; ".join(failed)
    dispatch_graph, combine_graph = graphs
    samples = _time_pairs(dispatch_graph.replay, combine_graph.replay, device, spec.warmup, spec.iters,
                          spec.sync_each_iter)
    step_us = _time_loop(dispatch_graph.replay, combine_graph.replay, device, spec.warmup, spec.iters)
    return samples, step_us, None


COPY_CAP_BYTES = 2 << 30  # larger ceilings are timed on 2 GiB and scaled (linear far past the 60 MB L2)


@functools.lru_cache(maxsize=2)
def _routing_maps(shape: Shape, num_ranks: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Every rank's routing map on the host: reproducible from the seed, so no rank gathers them."""
    return tuple(make_routing(shape, r, seed, torch.device("cpu"))[0] for r in range(num_ranks))


def _busiest_rank_rows(shape: Shape, num_ranks: int, seed: int) -> int:
    """Dispatch output rows of the rank that receives the most."""
    maps = list(_routing_maps(shape, num_ranks, seed))
    return max(traffic(maps, num_ranks, shape)["out_bytes"]) // shape.row_bytes()


def _memory_shortfall(ctx: RankContext, shape: Shape, device: torch.device, seed: int) -> str:
    """Why a case would not fit the GPU's free memory, or on CPU the host's ('' when it fits; same answer on
    every rank).

    The busiest rank (skewed routing at 8192 tokens receives ~5x its share) holds its dispatch
    output and the combine input of as many bf16 rows; ranks sharing a GPU each need that much, CPU ranks
    that and their inputs in the host's memory. An out-of-memory error on one rank would leave the others
    waiting in a handshake (a size typed wrong on CPU failed in every rank, one traceback each).
    """
    message = ""
    if device.type == "cpu" and ctx.rank == 0:  # one host for every rank: one rank says it
        memory = host_memory()
        rows = _busiest_rank_rows(shape, ctx.world_size, seed)
        need = (rows * (shape.row_bytes() + 2 * shape.hidden) + shape.tokens * 4 * shape.hidden) * ctx.world_size
        if memory is not None and need > 0.8 * memory.bytes:
            message = (f"~{need / 2**30:,.1f} GiB of inputs and outputs for the {ctx.world_size} CPU ranks, "
                       f"and {memory.limit} is {memory.bytes / 2**30:,.1f} GiB")
    if device.type == "cuda":
        rows = _busiest_rank_rows(shape, ctx.world_size, seed)
        need = rows * (shape.row_bytes() + 2 * shape.hidden) * max(ctx.plan.ranks_per_gpu, 1)
        torch.cuda.empty_cache()  # our cached blocks would not count as free
        free = torch.cuda.mem_get_info(device)[0]
        if need > 0.8 * free:
            message = (f"rank {ctx.rank}: ~{need / 2**30:.1f} GiB of outputs for the ranks on its GPU, "
                       f"{free / 2**30:.1f} GiB free")
    messages = [None] * ctx.world_size
    dist.all_gather_object(messages, message)
    return "; ".join(m for m in messages if m)


def _tight_budget(shape: Shape, num_ranks: int, seed: int, *, pad_multiple: int = 1,
                  most_rows: Optional[int] = None) -> int:
    """Non-blocking output rows for a case: the next multiple of 4096 above the busiest rank's rows and its
    experts' padding (an exact multiple gets 4096 more: kept so that figures stay comparable across passes),
    as a Megatron user sets num_permuted_tokens from the routing they expect; never more than ``most_rows``,
    the backend's worst case (which a combine-input arena is sized to: a budget past it would not fit there).
    The worst case (every token at every local expert of every rank) would not fit 8 ranks on one GPU at 8192
    tokens."""
    rows = _busiest_rank_rows(shape, num_ranks, seed) + shape.experts // num_ranks * (pad_multiple - 1)
    budget = (rows // 4096 + 1) * 4096
    return budget if most_rows is None else min(budget, most_rows)


def _time_copy_us(num_bytes: int, device: torch.device, repeats: int = 5) -> float:
    """Median time of one device-to-device copy of num_bytes (the shared-GPU ceiling). Above
    COPY_CAP_BYTES the copy is timed at the cap and scaled, so that 8 ranks' outputs at 8192
    tokens (7.5 GB, twice that for source + destination) need not fit beside the ranks' buffers."""
    if num_bytes == 0 or device.type != "cuda":
        return float("nan")
    if num_bytes > COPY_CAP_BYTES:
        return _time_copy_us(COPY_CAP_BYTES, device, repeats) * num_bytes / COPY_CAP_BYTES
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    timer = _Timer(device, 2 * (repeats + 1))
    for repeat in range(repeats + 1):
        timer.mark(2 * repeat)
        dst.copy_(src)
        timer.mark(2 * repeat + 1)
    timer.finish()
    del src, dst
    return statistics.median(timer.elapsed_us(2 * r, 2 * r + 1) for r in range(1, repeats + 1))


def _gather(samples: list, world_size: int) -> list:
    everyone = [None] * world_size
    dist.all_gather_object(everyone, samples)
    return everyone


def _case_bytes(backend_cls, shape: Shape, num_ranks: int, seed: int, in_place: bool = False) -> dict:
    """Byte counts of one case: algorithm bytes, this backend's output and link bytes (its own model;
    ``in_place``: the combine reads rows in the buffer), and the link floor: the busiest rank's payload
    bytes to remote ranks, once per (token, remote rank), the least any design moves."""
    maps = list(_routing_maps(shape, num_ranks, seed))
    common = dict(row_bytes=shape.row_bytes(), hidden=shape.hidden, topk=shape.topk, combine_in_place=in_place)
    # The bench dispatches with probs and combines without.
    dispatch = backend_cls.wire_bytes(maps, num_ranks, with_probs=True, **common)
    combine = backend_cls.wire_bytes(maps, num_ranks, with_probs=False, **common)
    algorithm = traffic(maps, num_ranks, shape)
    algorithm["out_bytes"] = [rows * shape.row_bytes() for rows in dispatch["out_rows"]]
    return dict(bytes=algorithm, link_bytes={"dispatch": dispatch["dispatch"], "combine": combine["combine"]},
                link_floor_bytes=_compact_link_floor(shape, route_counts(maps, num_ranks)[0]))


def _compact_remote_bytes(shape: Shape, packets: list[list[int]]) -> dict[str, list[int]]:
    """Each rank's bytes to other ranks with one row per (token, destination rank) (``packets[source][dest]``
    from ``route_counts``): the dispatch's payload rows, and the combine's bf16 rows back to the sources
    (the least any design moves; what the all_to_all baseline moves)."""
    num_ranks = len(packets)
    sent = [sum(n for dest, n in enumerate(row) if dest != source) * shape.row_bytes()
            for source, row in enumerate(packets)]
    back = [sum(packets[source][dest] for source in range(num_ranks) if source != dest) * 2 * shape.hidden
            for dest in range(num_ranks)]
    return {"dispatch": sent, "combine": back}


def _compact_link_floor(shape: Shape, packets: list[list[int]]) -> dict[str, int]:
    """Per op, the most bytes one rank's link carries in one direction with one row per (token, destination
    rank): a rank sends its remote packets and receives its peers' (the combine the other way round). Under
    skewed routing the popular rank receives several times what any rank sends, and its incoming link bounds
    the op: the sent bytes alone put the floor 3x too low at 8 ranks."""
    num_ranks = len(packets)
    sent = [sum(n for dest, n in enumerate(row) if dest != source) for source, row in enumerate(packets)]
    received = [sum(packets[source][dest] for source in range(num_ranks) if source != dest)
                for dest in range(num_ranks)]
    busiest = max(max(out, into) for out, into in zip(sent, received, strict=True))
    return {"dispatch": busiest * shape.row_bytes(), "combine": busiest * 2 * shape.hidden}


def _layout(backend) -> str:
    """The domains a backend instance runs on ("2x4"); "1xR" for a flat one, whatever its topology detected
    (a CPU reference's ranks are domains of 1, but it runs as one domain)."""
    topology = backend.topology
    if _split(backend):
        return f"{topology.num_domains}x{topology.domain_size}"
    return f"1x{topology.world_size}"


def _split(backend) -> bool:
    """Whether the backend runs split into domains joined by rails (a HierarchicalBackend); a flat one's
    detected topology may still name domains (a CPU reference's of 1 rank)."""
    return getattr(backend, "scaleout", None) is not None


def _scaleout_fields(backend, shape: Shape, num_ranks: int, seed: int) -> dict:
    """The backend's domains ("2x4") and, across domains, each rank's bytes over its rail (the topology's
    byte model: a token once per remote domain holding any of its experts; combine one row back)."""
    fields = {"domains": _layout(backend)}
    if _split(backend):
        maps = list(_routing_maps(shape, num_ranks, seed))
        # The backend's own model: its mode (sync-free moves fixed blocks) and the routing form _Calls passes.
        topk = 0 if "routing_map" in backend.capabilities.routing_forms else shape.topk
        dispatch = backend.scaleout_bytes(maps, row_bytes=shape.row_bytes(), with_probs=True, topk=topk)
        combine = backend.scaleout_bytes(maps, row_bytes=shape.row_bytes(), with_probs=False, topk=topk)
        fields["scaleout_bytes"] = {"dispatch": dispatch["dispatch"], "combine": combine["combine"]}
        fields["scaleout_engine"] = backend.scaleout.engine
    return fields


def _run_case(ctx: RankContext, spec: SweepSpec, backend, shape: Shape, device, shared_gpu: bool,
              ceiling_cache: dict[int, float], variant: str = "") -> dict:
    """Time one shape on every rank; rank 0 also times the ceiling. Returns the record (complete on rank 0)."""
    iters = spec.reference_iters if backend.name == "reference" else spec.iters
    counts_before = dict(getattr(backend, "combine_counts", {}))  # hybrid: combines in place / pushed
    calls = _Calls(backend, shape, ctx.rank, spec.seed, device, variant)
    samples = _time_pairs(calls.dispatch, calls.combine, device, spec.warmup, iters, spec.sync_each_iter)
    step_us = _time_loop(calls.dispatch, calls.combine, device, spec.warmup, iters)
    problems: list[Optional[str]] = [None] * ctx.world_size
    dist.all_gather_object(problems, _outputs_problem(backend))
    if not any(problems):  # decided alike on every rank: the check runs ops, which every rank must join
        dist.all_gather_object(problems, _wrong_values(calls, ctx))
    del calls  # free the last outputs before the ceiling's copy
    all_samples = _gather(samples, ctx.world_size)
    counts = {way: n - counts_before.get(way, 0) for way, n in getattr(backend, "combine_counts", {}).items()}
    arena_stats = _arena_stats(backend)
    # Across domains the outputs are the domain backend's flat ones (its byte model); the rails' bytes
    # are reported apart (_scaleout_fields). Its link bytes and floor model one flat domain of every rank,
    # not the split's NVLink traffic (a token crosses to another domain once, on its rail): none there.
    case_bytes = _case_bytes(getattr(backend, "domain_backend_class", type(backend)), shape, ctx.world_size,
                             spec.seed, in_place=variant in IN_PLACE_VARIANTS)
    if _split(backend):
        case_bytes.update(link_bytes=None, link_floor_bytes=None)
    out_bytes = case_bytes["bytes"]["out_bytes"]
    combine_bytes = sum(out_bytes) // shape.row_bytes() * 2 * shape.hidden  # bf16 rows back
    ceilings = {}
    # The ceiling copies every rank's bytes on one GPU: what ranks that all share it move through its memory.
    # Ranks spread over several GPUs (MPS on each) move about 1/GPUs of that per GPU: no ceiling then.
    if ctx.rank == 0 and shared_gpu and len(set(ctx.plan.gpu_of_rank)) == 1:
        for op, num_bytes in (("dispatch", sum(out_bytes)), ("combine", combine_bytes)):
            if num_bytes not in ceiling_cache:
                ceiling_cache[num_bytes] = _time_copy_us(num_bytes, device)
            ceilings[op] = ceiling_cache[num_bytes]
    _barrier(device)
    one_gpu_per_rank = device.type == "cuda" and not shared_gpu and ctx.world_size > 1
    return dict(payload=shape.payload, tokens=shape.tokens, hidden=shape.hidden, topk=shape.topk,
                experts=shape.experts, routing=shape.routing, ranks=ctx.world_size, samples_us=all_samples,
                step_us=_gather(step_us, ctx.world_size), ceiling_us=ceilings, one_gpu_per_rank=one_gpu_per_rank,
                combine_counts=_gather(counts, ctx.world_size),
                error="; ".join(f"rank {rank}: {text}" for rank, text in enumerate(problems) if text) or None,
                **({"arena": _gather(arena_stats, ctx.world_size)} if arena_stats else {}), **case_bytes)


def _outputs_problem(backend) -> Optional[str]:
    """What the backend reports about the ops just timed, after a sync (its device errors, ids it dropped,
    rows a too small non-blocking budget dropped), or None: ops that lost rows give no figure (they would
    read as faster). The record carries it as ``error``, which compare skips (then "missing in new")."""
    try:
        check = getattr(backend, "check_errors", None)  # the compiled and scale-out backends have one
        if check is not None:
            check()
        overflow = getattr(backend, "over_budget", None)
        if overflow is not None and bool(overflow.any()):
            return "rows past the non-blocking budget were dropped (over_budget; EP_PLUGIN_NUM_PERMUTED_TOKENS)"
    except Exception as exc:  # noqa: BLE001 - recorded, not raised: the other cases still run
        return f"{type(exc).__name__}: {exc}"
    return None


def _wrong_values(calls: _Calls, ctx: RankContext) -> Optional[str]:
    """What one checked dispatch and combine of the case got wrong (``verify.py``), or None."""
    try:
        return calls.verify(ctx.rank, ctx.world_size)
    except Exception as exc:  # noqa: BLE001 - recorded like _outputs_problem's: the other cases still run
        return f"checking the values: {type(exc).__name__}: {exc}"


def _arena_stats(backend) -> dict:
    """The combine-input arena's pool counters so far (pools made, snapshots, fallback segments: each
    beyond 1 / 0 / 0 costs host time in a loop), or {} without an arena."""
    arena = getattr(backend, "arena", None)
    if arena is None:
        return {}
    return {"pools_made": arena.pools_made, "snapshots_taken": arena.snapshots_taken,
            "fallback_segments": arena.fallback_segments()}


def _run_all_to_all_case(ctx: RankContext, spec: SweepSpec, shape: Shape, device) -> dict:
    """The transport baseline for one shape: ``all_to_all_single`` of this rank's compact rows on the
    bench's process group, timed like a backend's ops. Dispatch sends each token once to every rank
    holding one of its experts (payload bytes, fp8 with its scales); combine sends as many bf16 rows
    back. No layout, permute or sum: the bytes of elastic's compact form, moved by the engine alone."""
    maps = list(_routing_maps(shape, ctx.world_size, spec.seed))
    packets, _ = route_counts(maps, ctx.world_size)
    send = [int(n) for n in packets[ctx.rank]]
    recv = [int(packets[source][ctx.rank]) for source in range(ctx.world_size)]
    payload, back = shape.row_bytes(), 2 * shape.hidden
    rows = torch.randint(0, 256, (sum(send), payload), dtype=torch.uint8, device=device)
    received = torch.empty(sum(recv), payload, dtype=torch.uint8, device=device)
    partials = torch.randint(0, 256, (sum(recv), back), dtype=torch.uint8, device=device)
    returned = torch.empty(sum(send), back, dtype=torch.uint8, device=device)

    def dispatch() -> None:
        dist.all_to_all_single(received, rows, recv, send)

    def combine() -> None:
        dist.all_to_all_single(returned, partials, send, recv)

    samples = _time_pairs(dispatch, combine, device, spec.warmup, spec.iters, spec.sync_each_iter)
    step_us = _time_loop(dispatch, combine, device, spec.warmup, spec.iters)
    algorithm = traffic(maps, ctx.world_size, shape)
    algorithm["out_bytes"] = algorithm["recv_token_bytes"]  # its output is the compact rows
    remote = _compact_remote_bytes(shape, packets)
    _barrier(device)
    return dict(payload=shape.payload, tokens=shape.tokens, hidden=shape.hidden, topk=shape.topk,
                experts=shape.experts, routing=shape.routing, ranks=ctx.world_size,
                samples_us=_gather(samples, ctx.world_size), step_us=_gather(step_us, ctx.world_size),
                ceiling_us={}, one_gpu_per_rank=device.type == "cuda" and ctx.world_size > 1, bytes=algorithm,
                link_bytes=remote, link_floor_bytes=_compact_link_floor(shape, packets),
                backend=ALL_TO_ALL, mode="blocking", sms=None, domains=f"1x{ctx.world_size}")


def _all_to_all_problem(device: torch.device) -> str:
    """Why the baseline is not timed here ('' when it is): ranks sharing a GPU talk over gloo, which
    stages CUDA tensors through host memory, so its time says nothing about the GPUs' links."""
    if device.type == "cuda" and not nccl_moves_cuda(dist.get_backend()):
        return "ranks share a GPU: their process group is gloo, which stages CUDA tensors through host memory"
    return ""


def _run_graph_case(ctx: RankContext, spec: SweepSpec, backend, shape: Shape, device, variant: str = "") -> dict:
    """Samples of CUDA-graph replays (all ranks) and the capture error, if any, for one shape."""
    samples, step_us, error = _time_graph_replays(ctx, spec, backend, shape, device, variant)
    all_samples, all_steps = _gather(samples, ctx.world_size), _gather(step_us, ctx.world_size)
    # What the replays' kernels reported (a device timeout, dropped rows): this record's error, not the next
    # case's. (Their values are not checked again: the replays run the checked eager case's ops.)
    problems = _gather(_outputs_problem(backend), ctx.world_size)
    _barrier(device)
    replays = "; ".join(f"rank {rank}: {text}" for rank, text in enumerate(problems) if text)
    # No key without one: the record keeps the eager case's error, if any.
    return dict(samples_us=all_samples, step_us=None if error else all_steps, graph_error=error,
                **({"error": f"in the graph replays: {replays}"} if replays else {}))


def bench_rank(ctx: RankContext, spec: SweepSpec) -> Optional[list[dict]]:
    """Run the sweep on this rank; rank 0 returns every record (with all ranks' samples)."""
    torch.set_num_threads(1)
    device = torch.device(ctx.device)
    shared_gpu = ctx.plan.use_mps
    records: list[dict] = []

    def scaleups(name: str) -> tuple[int, ...]:
        if name == "reference":  # flat, the baseline, and at every size the others are forced to
            from_env = Config.from_env().scaleup_size  # what their 0 runs at when EP_PLUGIN_SCALEUP_SIZE is set
            return (0, *sorted({size or from_env for size in spec.scaleup_sizes} - {0}))
        return (0,) if name == ALL_TO_ALL else spec.scaleup_sizes

    baselines = ("reference", ALL_TO_ALL)  # no SMs to choose; all_to_all has no modes either
    plan = [(name, hidden, experts, sms, mode, scaleup)
            for name in spec.backends for hidden in spec.hidden for experts in spec.experts
            for sms in (spec.sms if name not in baselines else spec.sms[:1])
            for mode in (spec.modes if name != ALL_TO_ALL else ("blocking",))
            for scaleup in scaleups(name)]
    total = len(plan) * len(spec.tokens) * len(spec.topk) * len(spec.payloads) * len(spec.routings)
    progress = None
    if ctx.rank == 0:
        from tqdm import tqdm

        # Into a log file (not a terminal) a redraw every 30 s: progress to tail, not a line per case.
        progress = tqdm(total=total, desc="bench", unit="case", mininterval=0.1 if sys.stderr.isatty() else 30.0)

    def say(line: str) -> None:  # rank 0's messages, above the bar rather than on its line
        if progress is not None:
            progress.write(line)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def keep(record: dict) -> None:  # every rank gathers every record; rank 0 writes it down at once
        records.append(record)
        if ctx.rank == 0 and spec.records_path:
            with open(spec.records_path, "a") as f:
                f.write(json.dumps(record, default=str) + "\n")

    ceiling_cache: dict[int, float] = {}
    layouts_run: set[tuple] = set()  # a forced size that gives a layout already run adds nothing but time
    baseline_skipped = False
    reference_skips_said: set[int] = set()  # token counts whose reference skip was printed
    no_graph_said: set[tuple] = set()  # (backend, layout) whose missing graph rows were explained
    cases_per_entry = total // len(plan) if plan else 0
    for number, (name, hidden, experts, sms, mode, scaleup) in enumerate(plan):
        if progress:  # the cases of an entry skipped part way (a backend that cannot be built) count as done
            progress.update(number * cases_per_entry - progress.n)
        if name == ALL_TO_ALL:
            problem = _all_to_all_problem(device)
            for tokens, topk, payload, routing in itertools.product(spec.tokens, spec.topk, spec.payloads,
                                                                    spec.routings):
                if progress:
                    progress.update()
                if not problem:
                    keep(_run_all_to_all_case(ctx, spec, Shape(tokens, hidden, topk, experts, payload, routing),
                                              device))
            if problem and not baseline_skipped and ctx.rank == 0:
                say(f"skipped {ALL_TO_ALL}: {problem}")
            baseline_skipped = baseline_skipped or bool(problem)
            continue
        base_name, _, variant = name.partition("+")  # "hybrid+in_place", "hybrid+arena": combine rows in the buffer
        cls = ep_plugin.get_backend(base_name)
        # 0: detected, or EP_PLUGIN_SCALEUP_SIZE when set; but the reference's 0 is the flat baseline of ref/ours
        # (a detected layout is one domain for it), which a forced size from the environment would split.
        forced = {"scaleup_size": scaleup} if scaleup or name == "reference" else {}
        config = Config.from_env(num_sms=sms, blocking=(mode == "blocking"), max_tokens_per_rank=max(spec.tokens),
                                 **{**forced, **spec.extra_config})
        backend = None
        for tokens, topk, payload, routing in itertools.product(spec.tokens, spec.topk, spec.payloads,
                                                                spec.routings):
            if progress:
                progress.update()
            if _reference_skips(spec, name, tokens):
                if ctx.rank == 0 and tokens not in reference_skips_said:
                    reference_skips_said.add(tokens)
                    say(f"skipped reference at {tokens} tokens per rank: above --reference-max-tokens "
                        f"{spec.reference_max_tokens} (0 = no limit)")
                continue
            if not supported(cls, payload, mode):
                continue
            if backend is None:  # built lazily: a backend owns large buffers
                try:
                    options = cls.in_place_options(num_ranks=ctx.world_size, max_tokens_per_rank=max(spec.tokens),
                                                   num_experts=experts, topk=max(spec.topk),
                                                   pad_multiple=config.pad_multiple) \
                        if variant in IN_PLACE_VARIANTS else {}
                    backend = cls(hidden_size=hidden, num_experts=experts, config=config, device=device, **options)
                except ValueError as error:  # e.g. 8 ranks x 24 SMs do not fit one GPU: same on every rank
                    if ctx.rank == 0:
                        say(f"skipped {name} sms={sms} {mode} H={hidden}: {error}")
                    break
                if variant in IN_PLACE_VARIANTS and _split(backend):  # rows in a buffer: one domain
                    if ctx.rank == 0:
                        say(f"skipped {name} at {backend.topology.describe()}: in-place rows live in one domain's "
                            f"buffer")
                    break
                layout = (name, hidden, experts, sms, mode, _layout(backend))
                if layout in layouts_run:  # e.g. --scaleup-size equal to the detected domain size
                    if ctx.rank == 0:
                        say(f"skipped {name} at scale-up size {scaleup}: the same layout ({layout[-1]}) already ran")
                    break
                layouts_run.add(layout)
            shape = Shape(tokens, hidden, topk, experts, payload, routing)
            short = _memory_shortfall(ctx, shape, device, spec.seed)
            if short:
                if ctx.rank == 0:
                    say(f"skipped {name} {mode} {shape}: {short}")
                continue
            if mode == "nonblocking" and base_name == "hybrid":
                budgeted = getattr(backend, "domain", backend)  # across domains the domain backend has the output
                most = worst_case_rows(budgeted.num_ranks, budgeted.config.max_tokens_per_rank,
                                       budgeted.num_local_experts, topk, budgeted.config.pad_multiple)
                most = min(most, getattr(budgeted, "combine_input_rows", 0) or most)  # in place: what the arena holds
                budgeted.config = budgeted.config.replace(num_permuted_tokens=_tight_budget(
                    shape, ctx.world_size, spec.seed, pad_multiple=budgeted.config.pad_multiple, most_rows=most))
            record = _run_case(ctx, spec, backend, shape, device, shared_gpu, ceiling_cache, variant)
            if record["error"] and ctx.rank == 0:
                say(f"FAILED {name} {mode} {shape}: {record['error']} (no figure)")
            pushed = sum(counts.get("pushed", 0) for counts in record["combine_counts"])
            if variant in IN_PLACE_VARIANTS and pushed and ctx.rank == 0:  # a rank's rows missed the buffer
                say(f"note: {name} {mode} {shape}: {pushed} combines (all ranks) read pushed partial sums, "
                    f"not rows in place (a rank without rows, or its input outside the arena)")
            record.update(backend=name, mode=mode, sms=sms if name != "reference" else None,
                          **_scaleout_fields(backend, shape, ctx.world_size, spec.seed))
            keep(record)
            # The instance: none across domains. Not "arena": a capture records no allocation for a replay.
            # Not after an error (the same on every rank: gathered): a rank whose op failed mid-way refuses ops.
            if _graph_applies(spec, backend, mode, device) and variant != "arena" and not record["error"]:
                # Same shape, same backend: only the samples differ from the eager record.
                graph = _run_graph_case(ctx, spec, backend, shape, device, variant)
                keep({**record, **graph, "mode": GRAPH_MODE})
            elif (_graph_applies(spec, cls, mode, device) and (variant == "arena" or _split(backend))
                  and ctx.rank == 0 and (name, record["domains"]) not in no_graph_said):
                # --graph was asked for this backend, and the option check cannot know a split that detection finds
                no_graph_said.add((name, record["domains"]))
                why = ("a combine-input arena's allocations are not redone by a replay" if variant == "arena" else
                       "CUDA graphs are not captured across domains")
                say(f"no {GRAPH_MODE} rows for {name} at {record['domains']}: {why}")
        if backend is not None:
            backend.destroy()
            del backend
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if progress:
        progress.update(total - progress.n)
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
