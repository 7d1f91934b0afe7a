"""Device time of each kernel of a dispatch + combine (hybrid or elastic), from torch.profiler (CUPTI).

The benchmark times whole ops; this splits them into stages (layout, notify, send, permute,
combine send / receive, torch's own kernels) to show which one bounds an op. Rank 0's profile
is printed; spin-waiting kernels include the time they waited for the slowest rank.

  python benchmarks/kernel_times.py --backend elastic --ranks 8 --tokens 4096 --hidden 7168 --sms 16 [--nonblocking]
      [--in-place]   (combine rows read in place; elastic also pushes dispatch rows into the receivers' buffers)
      [--host-profile]  (cProfile of rank 0's host calls per step, for eager latency at small token counts)
      [--trace DIR]  (each rank's chrome trace to DIR/rank<r>.json; rank 0 also prints how busy its stream
                      was: kernel time against the span from the first kernel to the last, and the widest gaps)
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def profile_rank(ctx, args) -> str | None:
    import ep_plugin
    from ep_plugin.bench.workload import Shape
    from ep_plugin.config import Config

    device = torch.device(ctx.device)
    shape = Shape(args.tokens, args.hidden, args.topk, args.experts, "bf16", "balanced")
    # Non-blocking hybrid: a budget of the rows the step's top-k routing can produce, as a Megatron user
    # sets it (the routing-map worst case, every local expert, would not fit an in-place combine input).
    budget = ctx.world_size * args.tokens * min(args.topk, args.experts // ctx.world_size) if args.nonblocking else 0
    config = Config.from_env(num_sms=args.sms, blocking=not args.nonblocking, max_tokens_per_rank=args.tokens,
                             num_permuted_tokens=budget)
    cls = ep_plugin.get_backend(args.backend)
    options = cls.in_place_options(num_ranks=ctx.world_size, max_tokens_per_rank=args.tokens, num_experts=args.experts,
                                   topk=args.topk, pad_multiple=config.pad_multiple) if args.in_place else {}
    backend = cls(hidden_size=args.hidden, num_experts=args.experts, config=config, device=device, **options)
    step = eager_step(backend, shape, ctx.rank, device, in_place=args.in_place, constant_hidden=args.constant_hidden)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if args.host_profile:
        return host_profile(ctx, step, args.iters)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(args.iters):
            step()
        torch.cuda.synchronize()
    backend.destroy()
    trace = None
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        trace = os.path.join(args.trace, f"rank{ctx.rank}.json")
        profiler.export_chrome_trace(trace)
    if ctx.rank != 0:
        return None
    rows = []
    for event in profiler.key_averages():
        device_us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if device_us > 0:
            rows.append((device_us / args.iters, event.count // args.iters, event.key))
    rows.sort(reverse=True)
    lines = [f"{'us/iter':>9s} {'calls':>5s}  kernel"]
    lines += [f"{us:9.1f} {calls:5d}  {name[:110]}" for us, calls, name in rows[:25]]
    if trace:
        lines.append(timeline_summary(trace, args.iters))
    return "\n".join(lines)


def decode_backend(variant: str, group, num_ranks: int, device: torch.device, tokens: int = 128, hidden: int = 7168):
    """The bench's decode backend on ``group`` (None: the default group): 16 SMs, non-blocking, top-8 of 256
    experts, a budget of the rows top-8 routing can produce. ``variant``: "hybrid", "elastic+in_place", ..."""
    import ep_plugin
    from ep_plugin.config import Config

    name, _, option = variant.partition("+")
    cls = ep_plugin.get_backend(name)
    budget = num_ranks * tokens * min(8, 256 // num_ranks)
    config = Config.from_env(num_sms=16, blocking=False, max_tokens_per_rank=tokens, num_permuted_tokens=budget)
    options = cls.in_place_options(num_ranks=num_ranks, max_tokens_per_rank=tokens, num_experts=256, topk=8,
                                   pad_multiple=config.pad_multiple) if option in ("in_place", "arena") else {}
    return cls(group, hidden_size=hidden, num_experts=256, config=config, device=device, **options)


def eager_step(backend, shape, rank: int, device: torch.device, *, in_place: bool = False,
               constant_hidden: bool = False, arena: bool = False):
    """One eager dispatch + combine of ``shape`` on ``backend`` (this rank's bench inputs), as a callable.
    ``in_place``: combined from the backend's own buffer (``combine_input``), and where the backend can
    (elastic) the rows pushed into the receivers' buffers. ``arena`` (hybrid): the combine input is
    allocated anew in ``combine_input_arena()`` each step, as Megatron's experts allocate theirs (its
    values are whatever the memory holds: the step is timed, not checked)."""
    from ep_plugin.bench.runner import in_place_dispatch
    from ep_plugin.bench.workload import make_hidden, make_routing, make_topk

    if "routing_map" in backend.capabilities.routing_forms:
        routing_map, probs = make_routing(shape, rank, 0, device)
        routing = dict(routing_map=routing_map, probs=probs)
    else:
        topk_idx, topk_weights = make_topk(shape, rank, 0, device)
        routing = dict(topk_idx=topk_idx, topk_weights=topk_weights)
    hidden = make_hidden(shape, rank, device, torch.bfloat16)
    if constant_hidden:  # same bytes moved; tells data-dependent memory rates apart
        hidden.fill_(1.0)

    def step():
        if arena:
            out = backend.dispatch(hidden, **routing)
            with backend.combine_input_arena():
                rows = torch.empty(out.handle.num_rows, shape.hidden, device=device, dtype=torch.bfloat16)
            backend.combine(rows, out.handle)
        elif in_place:
            out = backend.dispatch(hidden, **routing, **in_place_dispatch(backend, True))
            backend.combine(backend.combine_input(out.handle), out.handle)
        else:
            out = backend.dispatch(hidden, **routing)
            backend.combine(out.hidden, out.handle)

    return step


def timeline_summary(trace_path: str, iters: int, widest: int = 8) -> str:
    """How busy one rank's GPU work was in a chrome trace: kernel time against the span from the first
    kernel's start to the last one's end (per step), and the widest idle gaps between kernels with the
    kernels on either side. A stream that is idle most of its span waits for launches, not for work."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                     if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and e.get("dur", 0) > 0)
    if not kernels:
        return "timeline: no kernels in the trace"
    span = kernels[-1][1] - kernels[0][0]
    busy = sum(end - start for start, end, _ in kernels)
    gaps = []
    reach = kernels[0][1]  # the latest end so far: overlapping kernels leave no gap
    for (start, end, name), (_, _, before) in zip(kernels[1:], kernels[:-1], strict=True):
        if start > reach:
            gaps.append((start - reach, before, name))
        reach = max(reach, end)
    gaps.sort(reverse=True)
    lines = [f"timeline (rank 0): {len(kernels)} kernels, span {span / iters:.1f} us per step, kernels busy "
             f"{busy / iters:.1f} us per step, idle {sum(g for g, _, _ in gaps) / iters:.1f} us per step",
             "widest gaps (us, kernel before -> kernel after):"]
    lines += [f"{gap:9.1f}  {before[:50]} -> {after[:50]}" for gap, before, after in gaps[:widest]]
    return "\n".join(lines)


def time_steps(step, iters: int) -> tuple[float, float]:
    """(GPU µs per step, host µs per step) of ``iters`` calls of ``step``, timed from one barrier of all
    ranks (so no rank's GPU time holds a wait for a rank still starting): two events around the loop,
    and the host's time to enqueue it."""
    import time

    torch.cuda.synchronize()
    dist.barrier()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    begin.record()
    for _ in range(iters):
        step()
    end.record()
    host_us = (time.perf_counter() - start) * 1e6 / iters
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / iters, host_us


def host_profile(ctx, step, iters: int) -> str | None:
    """Where the host's time goes in eager calls: cProfile of rank 0's steps (every rank runs them)."""
    import cProfile
    import io
    import pstats
    import time

    # First without the profiler: the host's time to enqueue a step against the GPU's time per step.
    # When they are about equal the host bounds eager calls (the GPU waits for launches).
    gpu_us, plain_us = time_steps(step, iters)
    paces = [None] * ctx.world_size  # every rank's (host, GPU) µs per step: the slowest host paces all
    dist.all_gather_object(paces, (plain_us, gpu_us))
    profiler = cProfile.Profile()
    dist.barrier()
    start = time.perf_counter()
    if ctx.rank == 0:
        profiler.enable()
    for _ in range(iters):
        step()
    if ctx.rank == 0:
        profiler.disable()
    wall_us = (time.perf_counter() - start) * 1e6 / iters
    torch.cuda.synchronize()
    if ctx.rank != 0:
        return None
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats("ep_plugin", 40)  # inclusive time of our own functions
    hosts = sorted(host for host, _ in paces)
    return (f"host wall per step (dispatch + combine): {plain_us:.1f} us plain, GPU {gpu_us:.1f} us per step; "
            f"{wall_us:.1f} us under cProfile\nevery rank's host per step: min {hosts[0]:.1f}, median "
            f"{hosts[len(hosts) // 2]:.1f}, max {hosts[-1]:.1f} us; GPU per step "
            f"{', '.join(f'{gpu:.0f}' for _, gpu in paces)} us\n" + text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="hybrid", help="hybrid or elastic")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--sms", type=int, default=16)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--nonblocking", action="store_true")
    parser.add_argument("--in-place", action="store_true",
                        help="combine from combine_input (elastic: in-place dispatch too)")
    parser.add_argument("--constant-hidden", action="store_true", help="every activation 1.0 instead of random")
    parser.add_argument("--host-profile", action="store_true", help="cProfile rank 0's host calls instead")
    parser.add_argument("--trace", help="folder for each rank's chrome trace (rank 0 prints a timeline summary)")
    args = parser.parse_args()
    from ep_plugin.testing import run_ranks

    print(run_ranks(profile_rank, args.ranks, args, device="cuda", timeout_s=300)[0])


if __name__ == "__main__":
    main()
