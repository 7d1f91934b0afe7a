"""Host time of one hierarchical dispatch + combine on CPU, by phase, next to a bare gloo all-to-all.

    python benchmarks/scaleout_host.py                       # 2 ranks as 2x1, 4096 x 7168 bf16, top-8 of 256
    python benchmarks/scaleout_host.py --ranks 4 --domain-size 2 --tokens 2048
    python benchmarks/scaleout_host.py --sync-free --profile  # + cProfile of rank 0's last iteration

Ranks run on CPU over gloo (``ep_plugin.testing.run_ranks``), the ``reference`` backend inside each
domain. Phases are timed on rank 0 by wrapping the hierarchical backend's stages (median over the
timed iterations, ms); "rest" is the op's time outside the named phases. ``gloo a2a`` is the rail
collectives' own time, ``bare gloo`` one all_to_all_single of the same bytes on the same rail
group: what the wire costs here. The domain backend's time is ``reference``'s, not the GPU's.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.backends import hierarchical
from ep_plugin.host_collectives import HostCollectives
from ep_plugin.testing import run_ranks
from ep_plugin.topology import Topology
from ep_plugin.transport import scaleout

# (owner, attribute, phase): the stages that exist are timed; a missing one is skipped (a renamed stage's
# time shows up in "rest").
_STAGES = [
    (hierarchical.HierarchicalBackend, "_rail_agreement", "rail/counts"),
    (hierarchical.HierarchicalBackend, "_domain_agreement", "domain agreement"),
    (hierarchical.HierarchicalBackend, "_pack_for_rail", "pack"),
    (scaleout.RowPacker, "pack", "pack"),
    (scaleout.RowPacker, "pack_into", "pack"),
    (scaleout.ScaleOut, "exchange_rows", "rail exchange"),
    (scaleout.RowPacker, "unpack", "unpack"),
    (hierarchical.HierarchicalBackend, "_segment_counts", "domain/segment counts"),
    (hierarchical, "flat_order_index", "reorder"),
    (hierarchical, "_to_flat", "reorder"),
    (hierarchical.HierarchicalBackend, "_add_returned", "sum"),
]


class PhaseTimer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.depth = 0  # only the outermost timed stage counts (a stage may call another)

    def wrap(self, owner, attribute: str, phase: str) -> None:
        inner = getattr(owner, attribute, None)
        if inner is None:
            return
        timer = self

        def timed(*args, **kwargs):
            if timer.depth:
                return inner(*args, **kwargs)
            timer.depth += 1
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                timer.totals[phase] += time.perf_counter() - start
                timer.depth -= 1

        setattr(owner, attribute, staticmethod(timed) if isinstance(owner, type) and _is_static(owner, attribute)
                else timed)

    def take(self) -> dict[str, float]:
        totals, self.totals = dict(self.totals), defaultdict(float)
        return totals


def _is_static(owner, attribute: str) -> bool:
    return isinstance(owner.__dict__.get(attribute), staticmethod)


def run(ctx, args) -> dict:
    torch.set_num_threads(max(1, args.threads))
    timer = PhaseTimer()
    for owner, attribute, phase in _STAGES:
        timer.wrap(owner, attribute, phase)
    # The rail collectives' own time (the wire and gloo's copies), outside the phase nesting.
    gloo = {"seconds": 0.0}
    plain_all_to_all = HostCollectives.all_to_all

    def timed_all_to_all(self, tensor, *a, **kw):
        start = time.perf_counter()
        try:
            return plain_all_to_all(self, tensor, *a, **kw)
        finally:
            if "rail" in self.site and tensor.dtype == torch.uint8:
                gloo["seconds"] += time.perf_counter() - start

    HostCollectives.all_to_all = timed_all_to_all

    config = ep_plugin.Config.from_env().replace(blocking=not args.sync_free, max_tokens_per_rank=args.tokens,
                                                 scaleout_chunk_tokens=args.chunk)
    topology = Topology(ctx.world_size, args.domain_size, ctx.rank)
    backend = ep_plugin.get_backend("reference")(hidden_size=args.hidden, num_experts=args.experts, device="cpu",
                                                 config=config, topology=topology)
    timer.wrap(backend.domain, "dispatch", "domain dispatch")
    timer.wrap(backend.domain, "combine", "domain combine")
    generator = torch.Generator().manual_seed(1 + ctx.rank)
    hidden = torch.randn(args.tokens, args.hidden, generator=generator).to(torch.bfloat16)
    scores = torch.softmax(torch.randn(args.tokens, args.experts, generator=generator), 1)
    topk_weights, topk_idx = scores.topk(args.topk, 1)

    rows_out = []
    phases: dict[str, list[dict]] = {"dispatch": [], "combine": []}
    profile_text = ""
    for iteration in range(args.warmup + args.iters):
        profiler = cProfile.Profile() if args.profile and ctx.rank == 0 and iteration == args.warmup + args.iters - 1 \
            else None
        dist.barrier()
        timer.take()
        gloo["seconds"] = 0.0
        if profiler:
            profiler.enable()
        start = time.perf_counter()
        out = backend.dispatch(hidden, topk_idx=topk_idx, topk_weights=topk_weights)
        took = time.perf_counter() - start
        dispatch_phases = {**timer.take(), "gloo a2a": gloo["seconds"], "total": took}
        gloo["seconds"] = 0.0
        dist.barrier()
        start = time.perf_counter()
        combined = backend.combine(out.hidden, out.handle, row_probs=out.probs)
        took = time.perf_counter() - start
        if profiler:
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
            profile_text = text.getvalue()
        combine_phases = {**timer.take(), "gloo a2a": gloo["seconds"], "total": took}
        if iteration >= args.warmup:
            phases["dispatch"].append(dispatch_phases)
            phases["combine"].append(combine_phases)
        rows_out.append(int(out.hidden.shape[0]))
        send_splits, recv_splits = out.handle.layout.splits.send, out.handle.layout.splits.recv
        del out, combined

    # The wire alone: one all_to_all_single of the dispatch payload's bytes on the rail group.
    rail_group = backend.scaleout.rail_group
    row_bytes = 2 * args.hidden + 12 * args.topk  # bf16 hidden, int64 top-k ids, fp32 weights
    payload = torch.randint(0, 255, (sum(send_splits), row_bytes), dtype=torch.uint8)
    received = torch.empty(sum(recv_splits), row_bytes, dtype=torch.uint8)
    bare = []
    for _ in range(args.warmup + args.iters):
        dist.barrier()
        start = time.perf_counter()
        dist.all_to_all_single(received, payload, recv_splits, send_splits, group=rail_group)
        bare.append(time.perf_counter() - start)
    return {"phases": phases, "bare": bare[args.warmup:], "rows": rows_out[-1],
            "payload_mb": payload.numel() / 1e6, "profile": profile_text}


def _median_ms(samples: list[dict], key: str) -> float:
    return 1e3 * statistics.median(sample.get(key, 0.0) for sample in samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--domain-size", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=0, help="scaleout_chunk_tokens")
    parser.add_argument("--sync-free", action="store_true")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--profile", action="store_true", help="print cProfile of rank 0's last iteration")
    args = parser.parse_args()
    result = run_ranks(run, args.ranks, args, timeout_s=1800)[0]
    order = ["rail/counts", "pack", "rail exchange", "gloo a2a", "unpack", "domain/segment counts", "domain dispatch",
             "reorder", "domain combine", "sum"]
    print(f"{args.ranks} ranks as {args.ranks // args.domain_size}x{args.domain_size}, {args.tokens} tokens x "
          f"{args.hidden} bf16, top-{args.topk} of {args.experts}, {'sync-free' if args.sync_free else 'blocking'}, "
          f"chunk {args.chunk}; rank 0, median of {args.iters} (ms)")
    summary = {}
    for op, samples in result["phases"].items():
        named = [key for key in order if any(key in sample for sample in samples)]
        named += sorted({key for sample in samples for key in sample} - set(named) - {"total"})
        print(f"  {op}")
        outside = [sample["total"] - sum(v for k, v in sample.items() if k not in ("total", "gloo a2a"))
                   for sample in samples]
        summary[op] = {key: round(_median_ms(samples, key), 1) for key in named + ["total"]}
        summary[op]["rest"] = round(1e3 * statistics.median(outside), 1)
        for key in named + ["rest", "total"]:
            label = f"    ({key})" if key == "gloo a2a" else f"    {key}"
            print(f"{label:<28}{summary[op][key]:>9.1f}")
    bare_ms = 1e3 * statistics.median(result["bare"])
    print(f"  bare gloo all_to_all_single of {result['payload_mb']:.0f} MB per rank on the rail: {bare_ms:.1f}")
    if result["profile"]:
        print(result["profile"])
    print(json.dumps({"args": vars(args), "ms": summary, "bare_gloo_ms": round(bare_ms, 1)}))


if __name__ == "__main__":
    main()
