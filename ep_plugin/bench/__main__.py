"""python -m ep_plugin.bench: dispatch/combine side by side with a baseline and the ceiling.

Launches N ranks (one per GPU over NCCL, or several per GPU under a private MPS daemon;
CPU ranks over gloo with --device cpu) and sweeps the shapes below for each backend.
Reports per call: median / p10 / p90 µs over ranks x iterations, algorithm GB/s of the busiest rank
(bytes of the tokens it receives, once per (token, source rank) — DeepEP's convention, so a rank's bytes
to itself count — over its median time), and two ratios measured in the same run:

  ceil/ours  ceiling time / our time. Ranks sharing one GPU: the ceiling is one device-to-device
             copy of as many bytes as all ranks' dispatch outputs together (combine: all ranks'
             combine inputs), timed in this run: a yardstick, not a floor (a dispatch reads a token
             once for its k rows), so above 1 is reachable; none when ranks share several GPUs.
             One GPU per rank: the busiest rank's link bytes
             in hybrid's format (each token once per remote rank: the least any backend moves),
             at --link-gbps (478 GB/s per direction on two H200s with NV18).
  ref/ours   the reference backend's time / ours (when ranks share a GPU the reference runs over
             gloo through host memory: reported, but no target there). The reference runs blocking
             and bf16 only, so an fp8 or non-blocking row's ratio is against that bf16 blocking time.
  a2a/ours   with "all_to_all" in --backends (the nvlink preset has it): the time of
             torch.distributed.all_to_all_single moving the compact rows (each token once to every
             rank holding one of its experts; combine: as many bf16 rows back) / ours. The engine
             alone, no layout or permute: the baseline for elastic's compact form. Timed over NCCL
             (one GPU per rank) and on CPU; skipped with a message when ranks share a GPU (gloo).

One GPU per rank also gets link_MB (the busiest rank's bytes sent to other ranks in this
backend's own wire format), link_GB/s (that over the median time) and link% (of --link-gbps).

Timing: per case one barrier, then warm-up and timed iterations back to back (dispatch,
combine, dispatch, ...) with CUDA events before dispatch, between the ops and after combine,
all read after one final synchronize (host clock on CPU). --sync-each-iter puts a host+device
barrier before every iteration instead (the old method: it adds the barrier's exit skew to
every rank's time). --graph also times CUDA-graph replays of one captured non-blocking
dispatch and one combine (rows with mode nonblocking+graph; CUDA and graph-capable backends, one
domain; refused when no case of the sweep could be captured).

Defaults follow the machine: --device cuda with a GPU, else cpu (with the small cpu preset);
--backends every backend that can run there. A backend name with "+in_place" (e.g. elastic+in_place)
times that backend with dispatch rows written by the sources into the receivers' buffers
(``in_place=True``: views, valid until the next such dispatch) and combine rows already in the
backend's buffer (``combine_input``: the expert wrote its output there). "hybrid+arena" allocates
each combine's rows inside ``combine_input_arena()`` instead, as Megatron's experts do (no graph rows:
a captured allocation is not redone by a replay).

Writes a table to stdout (last), and under --out (default ./bench_out, which the repository's
.gitignore covers): bench.json (every sample + environment) and PNG plots (GB/s vs tokens; GB/s
vs SMs with the reference as dashed levels); when no plot is written the output says why. A sweep
that --timeout ends still writes the cases that finished (rank 0 writes each down as it finishes), with
``environment.incomplete`` saying so, and exits 1; one whose ranks crash or hang on their way out after
the last case writes every case, with ``environment.teardown`` saying so, and exits 1. A case whose values
were wrong (or whose graph capture failed) reads FAILED in the table and makes the exit status 1 too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from typing import Optional

import ep_plugin
from ep_plugin.cli import (
    OneLineParser,
    available_backends,
    backend_problem,
    config_problem,
    default_device,
    device_problem,
)
from ep_plugin.config import Config, variables_set
from ep_plugin.errors import EPError, EPTimeoutError
from ep_plugin.testing.launcher import CPU_RANKS_PER_CORE, cpu_ranks_problem

from .report import attach_all_to_all_ratio, attach_reference_ratio, format_table, summarize, write_json, write_plots
from .runner import ALL_TO_ALL, GRAPH_MODE, SweepSpec, bench_rank, environment, supported
from .workload import FP8_BLOCK


def _ints(text: str) -> tuple[int, ...]:
    """The listed values, each once, in order (--tokens 16,16 ran every case twice, and compare took the
    median of the two as if they were rounds)."""
    return tuple(dict.fromkeys(int(v) for v in text.split(",") if v))


def _words(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))


PRESETS = {
    # The standard shape: 8 ranks sharing a GPU, 16 SMs, 4096 tokens, H=7168, top-8, 256 experts.
    "standard": dict(tokens="4096", hidden="7168", sms="16", payloads="bf16,fp8", routings="balanced",
                     modes="blocking"),
    # A decode step is ~0.2-0.4 ms: 250 of them cost a tenth of a second per case, and give each rank
    # 200 samples instead of 10 (on the H200 bed the medians came out alike either way).
    "decode": dict(tokens="128", hidden="7168", sms="16", payloads="bf16", routings="balanced",
                   modes="nonblocking,blocking", warmup=50, iters=200),
    "full": dict(tokens="128,1024,4096,8192", hidden="4096,7168", sms="8,16,24,32", payloads="bf16,fp8",
                 routings="balanced,skewed", modes="blocking,nonblocking"),
    # Two ranks with a GPU each over real NVLink; NCCL's all_to_all is fast, so the reference
    # runs at every token count.
    "nvlink": dict(ranks=2, tokens="128,1024,4096,8192", hidden="7168", sms="8,16,24", payloads="bf16,fp8",
                   routings="balanced", modes="blocking", reference_max_tokens=0),
    # Without a GPU: a quick look at the reference on CPU ranks (the GPU shapes would take hours there).
    "cpu": dict(ranks=4, tokens="64,256", hidden="256", sms="16", payloads="bf16", routings="balanced,skewed",
                modes="blocking"),
}
# Every preset but cpu is sized for GPUs: on CPU ranks it grinds for many minutes to hours, so
# --device cpu refuses them unless --tokens and --hidden (the axes that set the size) are both given.
GPU_PRESETS = tuple(name for name in PRESETS if name != "cpu")
DEFAULT_OUT = "bench_out"  # relative to the current folder; the repository's .gitignore covers it
PARTIAL_RECORDS = "records.partial.jsonl"  # under --out while the sweep runs (see SweepSpec.records_path)
DEFAULT_RANKS = 8
DEFAULT_WARMUP, DEFAULT_ITERS = 3, 10
# The reference over gloo (CPU, or ranks sharing a GPU) goes through host memory: keep it short there.
GLOO_REFERENCE_MAX_TOKENS, GLOO_REFERENCE_ITERS = 4096, 3


def parse_args(argv: list[str]) -> argparse.Namespace:
    device = default_device()
    parser = OneLineParser(prog="python -m ep_plugin.bench", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="default values for the sweep axes (explicit options override them): standard "
                             "(ranks sharing a GPU), decode (128 tokens), full, nvlink (2 ranks, one GPU each; the "
                             "reference at every token count), cpu (small shapes on CPU ranks). Default: full "
                             "with --device cuda, cpu with --device cpu. With --device cpu the GPU presets are "
                             "refused unless --tokens and --hidden are both given (they set the size; the preset "
                             "fills the other axes)")
    parser.add_argument("--ranks", type=int, help=f"rank processes (default {DEFAULT_RANKS}; 2 with --preset nvlink, "
                                                  f"4 with --preset cpu; on CPU at most {CPU_RANKS_PER_CORE} per core)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=device, help=f"default here: {device}")
    parser.add_argument("--backends", help="comma list (default: every backend that can run on --device here)")
    parser.add_argument("--tokens", help="tokens per rank, comma list")
    parser.add_argument("--hidden", help="hidden sizes, comma list")
    parser.add_argument("--topk", default="8", help="experts per token (default 8)")
    parser.add_argument("--experts", default="256", help="total experts (default 256)")
    parser.add_argument("--payloads", help="bf16 and/or fp8 (fp8 = e4m3 + one fp32 scale per 128 for dispatch)")
    parser.add_argument("--sms", help="SMs (blocks) per rank, comma list")
    parser.add_argument("--routings", help="balanced and/or skewed (expert popularity decays e^6 across ids)")
    parser.add_argument("--modes", help="blocking (exact size, one host read) and/or nonblocking (no host sync)")
    parser.add_argument("--scaleup-size", default="0",
                        help="ranks per NVLink domain, comma list (default 0 = detected, or EP_PLUGIN_SCALEUP_SIZE "
                             "when set): e.g. 8,4 runs each "
                             "compiled backend as 1x8 and as 2x4 domains joined by scale-out rails, and reports "
                             "scale-out bytes per rank (scaleout_MB, scaleout_GB/s) next to the other figures")
    parser.add_argument("--warmup", type=int, help=f"untimed iterations per case (default {DEFAULT_WARMUP}; "
                                                      "decode preset 50)")
    parser.add_argument("--iters", type=int, help=f"timed iterations per case and rank (default {DEFAULT_ITERS}; "
                                                     "decode preset 200)")
    parser.add_argument("--reference-iters", type=int,
                        help=f"timed iterations of the reference (default: --iters over NCCL, "
                             f"{GLOO_REFERENCE_ITERS} over gloo, where it goes through host memory)")
    parser.add_argument("--reference-max-tokens", type=int,
                        help=f"skip the reference above this many tokens per rank, 0 = never (default: 0 over "
                             f"NCCL, {GLOO_REFERENCE_MAX_TOKENS} over gloo)")
    parser.add_argument("--sync-each-iter", action="store_true",
                        help="host+device barrier before every iteration instead of once per case (adds the "
                             "barrier's exit skew to each rank's times; the old method)")
    parser.add_argument("--graph", action="store_true",
                        help="non-blocking mode on CUDA: also time replays of one captured dispatch and one "
                             "captured combine (mode nonblocking+graph); refused when no case could be captured "
                             "(no nonblocking in --modes, no graph-capable backend, every layout split into "
                             "domains); ignored on CPU")
    parser.add_argument("--link-gbps", type=float, default=478.0,
                        help="per-direction link rate for the one-GPU-per-rank ceiling (default 478: 2 x H200 NV18)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"folder for bench.json and the plots (default ./{DEFAULT_OUT}, which .gitignore covers)")
    parser.add_argument("--timeout", type=float, default=580.0, help="seconds before the launcher gives up")
    args = parser.parse_args(argv)
    if args.preset is None:
        args.preset = "full" if args.device == "cuda" else "cpu"
    if args.device == "cpu" and args.preset in GPU_PRESETS and (args.tokens is None or args.hidden is None):
        shape = PRESETS[args.preset]
        parser.error(f"--preset {args.preset} is a GPU shape (tokens {shape['tokens']}, hidden {shape['hidden']}) "
                     "that would take many minutes on CPU ranks: use --preset cpu, or give both --tokens and "
                     "--hidden to set a small shape yourself")
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.ranks is None:
        args.ranks = DEFAULT_RANKS
    if args.warmup is None:
        args.warmup = DEFAULT_WARMUP
    if args.iters is None:
        args.iters = DEFAULT_ITERS
    if args.backends is None:  # the nvlink preset adds the all_to_all baseline (a2a/ours)
        args.backends = ",".join(available_backends(args.device) + ([ALL_TO_ALL] if args.preset == "nvlink" else []))
    problem = _argument_problem(args)
    if problem:
        parser.error(problem)  # one line, exit status 2, before any process starts
    return args


def _argument_problem(args: argparse.Namespace) -> Optional[str]:
    """The first thing wrong with the options, in one line, or None."""
    problem = device_problem(args.device) or config_problem()
    if problem:
        return problem
    backends = _words(args.backends)
    if not backends:
        return f"--backends {args.backends!r} names no backend"
    classes = {}  # base backend name -> its class (capabilities)
    for name in backends:
        if name == ALL_TO_ALL:  # the transport baseline, no backend
            continue
        base, plus, variant = name.partition("+")
        problem = backend_problem(base, args.device)
        if problem:
            return f"--backends: {problem}"
        cls = classes[base] = ep_plugin.get_backend(base)
        # (Every backend has combine_input and combine_input_arena, refusing or routing nothing without a buffer.)
        if plus and not ((variant == "in_place" and hasattr(cls, "in_place_options"))
                         or (variant == "arena" and cls.has_combine_input_arena)):
            return (f"--backends: {name}: the variants are '+in_place', for a backend that combines its input "
                    "in its buffer (hybrid, elastic), and '+arena', for one with a combine-input arena (hybrid)")
    allowed = {"payloads": {"bf16", "fp8"}, "routings": {"balanced", "skewed"}, "modes": {"blocking", "nonblocking"}}
    for key, choices in allowed.items():
        unknown = set(_words(getattr(args, key))) - choices
        if unknown:
            return f"--{key}: unknown value(s) {sorted(unknown)}; choose from {sorted(choices)}"
    axes = {}
    try:
        sizes = _ints(args.scaleup_size)
    except ValueError:
        return f"--scaleup-size takes a comma list of integers, got {args.scaleup_size!r}"
    bad = [size for size in sizes if size < 0 or (size and args.ranks % size)]
    if not sizes or bad:
        return f"--scaleup-size values must divide --ranks {args.ranks} (or be 0 = detected), got {args.scaleup_size!r}"
    for key in ("tokens", "hidden", "topk", "experts", "sms"):
        try:
            axes[key] = _ints(getattr(args, key))
        except ValueError:
            return f"--{key} takes a comma list of integers, got {getattr(args, key)!r}"
        if not axes[key] or min(axes[key]) < 1:
            return f"--{key} values must be at least 1, got {getattr(args, key)!r}"
    for flag, field, value in (("--sms", "num_sms", max(axes["sms"])),
                               ("--tokens", "max_tokens_per_rank", max(axes["tokens"]))):
        try:  # every case's backend takes these as its config: the knob's own bounds, said here, once
            Config.from_env(**{field: value})
        except ValueError as error:
            return f"{flag} {value}: {error}"
    for flag, value, least in (("--ranks", args.ranks, 1), ("--iters", args.iters, 1), ("--warmup", args.warmup, 0),
                               ("--reference-iters", args.reference_iters, 1),
                               ("--reference-max-tokens", args.reference_max_tokens, 0)):
        if value is not None and value < least:
            return f"{flag} must be at least {least}, got {value}"
    problem = cpu_ranks_problem(args.ranks, args.device)
    if problem:
        return f"--ranks {args.ranks}: {problem}"
    if not 0 < args.timeout < math.inf:
        return f"--timeout must be a finite, positive number of seconds, got {args.timeout}"
    if not 0 < args.link_gbps < math.inf:
        return f"--link-gbps must be a positive finite GB/s, got {args.link_gbps}"
    problem = _out_problem(args.out)
    if problem:
        return problem
    def runs_a_case(name: str) -> bool:  # the baseline runs every payload, modeless
        cls = None if name == ALL_TO_ALL else ep_plugin.get_backend(name.partition("+")[0])
        return cls is None or any(supported(cls, payload, mode) for payload in _words(args.payloads)
                                  for mode in _words(args.modes))

    if not any(runs_a_case(name) for name in backends):
        return (f"no case to run: none of {', '.join(backends)} runs --payloads {args.payloads} in --modes "
                f"{args.modes} (the reference moves bf16 in blocking mode only)")
    problem = graph_problem(args, classes, Config.from_env().scaleup_size)
    if problem:
        return problem
    odd = [hidden for hidden in axes["hidden"] if hidden % FP8_BLOCK]
    if "fp8" in _words(args.payloads) and odd:
        return (f"--payloads fp8 needs every --hidden divisible by {FP8_BLOCK} (one fp32 scale per {FP8_BLOCK} "
                f"elements), got {', '.join(map(str, odd))}")
    if max(axes["topk"]) > min(axes["experts"]):
        return f"--topk {max(axes['topk'])} is more than the {min(axes['experts'])} experts (--experts)"
    for experts in axes["experts"]:
        if experts % args.ranks:
            return f"--experts {experts} is not divisible by --ranks {args.ranks}"
    return None


def graph_problem(args: argparse.Namespace, classes: dict, scaleup_from_env: int) -> Optional[str]:
    """Why --graph could capture no case of this sweep on CUDA (one line), or None: from the options, the
    backends' capabilities (``classes``: base name -> class) and EP_PLUGIN_SCALEUP_SIZE (``scaleup_from_env``,
    0 = unset) alone. Without this the sweep ran with no graph row while bench.json said graphs applied.
    On CPU --graph is accepted and not applied (one command line for both kinds of machine); a split into
    domains that only detection finds shows at run time, where the runner says so."""
    if not args.graph or args.device == "cpu":
        return None
    if "nonblocking" not in _words(args.modes):
        return f"--graph captures non-blocking ops: add nonblocking to --modes (got {args.modes})"
    payloads = _words(args.payloads)

    def capturable(name: str) -> bool:  # a captured allocation is not redone by a replay: no "+arena" graphs
        base, _, variant = name.partition("+")
        cls = classes.get(base)
        return (cls is not None and variant != "arena" and cls.capabilities.cuda_graphs
                and any(supported(cls, payload, "nonblocking") for payload in payloads))

    if not any(capturable(name) for name in _words(args.backends)):
        return (f"--graph: none of --backends {args.backends} captures non-blocking {args.payloads} ops into CUDA "
                f"graphs (the reference, {ALL_TO_ALL} and '+arena' variants never do)")
    sizes = {size or scaleup_from_env for size in _ints(args.scaleup_size)}
    if all(0 < size < args.ranks for size in sizes):
        forced = f"--scaleup-size {args.scaleup_size}" + (f", EP_PLUGIN_SCALEUP_SIZE={scaleup_from_env}"
                                                          if scaleup_from_env and 0 in _ints(args.scaleup_size) else "")
        return (f"--graph: every layout splits the {args.ranks} ranks into domains ({forced}), and no backend "
                "captures CUDA graphs across domains")
    return None


def _out_problem(out: str) -> Optional[str]:
    """Why the results could not be written to the folder ``out`` (found before the sweep, not after), or None."""
    if not out.strip():
        return "--out names no folder"
    existing = out
    while existing and not os.path.exists(existing):  # the nearest folder that exists must take a new one
        existing = os.path.dirname(existing.rstrip(os.sep)) or (os.curdir if not os.path.isabs(out) else os.sep)
    if not os.path.isdir(existing):
        return f"--out {out}: {existing} is a file, not a folder (the results go into a folder)"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--out {out}: {existing} is not writable"
    return None


def reference_limits(args: argparse.Namespace, plan) -> tuple[int, int]:
    """(reference_max_tokens, reference_iters): explicit options, else by process group.

    Over NCCL (one GPU per rank) the reference is a real baseline: every token count, as many
    iterations as ours. Over gloo it goes through host memory: a few iterations, short shapes."""
    nccl = plan.process_group_backend == "nccl"
    max_tokens = args.reference_max_tokens
    if max_tokens is None:
        max_tokens = 0 if nccl else GLOO_REFERENCE_MAX_TOKENS
    iters = args.reference_iters
    if iters is None:
        iters = args.iters if nccl else GLOO_REFERENCE_ITERS
    return max_tokens, iters


def _graph_note(args: argparse.Namespace, records: list[dict]) -> str:
    """What --graph did, for bench.json: how many cases it captured, not what it was asked."""
    if not args.graph:
        return "off"
    if args.device == "cpu":
        return "not applied (CPU)"
    graphed = sum(record["mode"] == GRAPH_MODE and not record.get("graph_error") for record in records)
    if not graphed:  # each case that could have been captured says above why it was not
        return "no case captured (see the output: failed, skipped or split into domains)"
    return f"{graphed} case(s) as {GRAPH_MODE} (non-blocking mode, graph-capable backends, one domain)"


def _why_no_plots(rows: list[dict]) -> str:
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed: pip install matplotlib, or the ep_plugin[plots] extra"
    failed = sum(1 for row in rows if row.get("error"))
    if failed == len(rows):  # a failed case has no figure, whatever the axes
        return "every case FAILED: no figure to draw"
    return ("a plot draws a line over at least two token counts (--tokens) or SM counts (--sms); the cases that ran "
            "have one" + (" among those that did not fail" if failed else ""))


def _mps_share(environ=None) -> str:
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE as bench.json records it: the share as the SM sizing reads it
    (``sizing.mps_thread_percentage``), in one spelling ("50" and "50.0" alike), or "unset" (also for the whole
    GPU, 100, and for what the sizing does not take)."""
    from ep_plugin.transport.sizing import mps_thread_percentage

    share = mps_thread_percentage(environ)
    return "unset" if share is None or share >= 100 else f"{share:g}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    import torch

    from ep_plugin.testing import TeardownError, run_ranks
    from ep_plugin.testing.launcher import plan_launch

    num_gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    plan = plan_launch(args.ranks, args.device, num_gpus)
    reference_max_tokens, reference_iters = reference_limits(args, plan)
    spec = SweepSpec(backends=_words(args.backends), tokens=_ints(args.tokens), hidden=_ints(args.hidden),
                     topk=_ints(args.topk), experts=_ints(args.experts), payloads=_words(args.payloads),
                     sms=_ints(args.sms), routings=_words(args.routings), modes=_words(args.modes),
                     warmup=args.warmup, iters=args.iters, reference_iters=reference_iters,
                     reference_max_tokens=reference_max_tokens, sync_each_iter=args.sync_each_iter,
                     graph=args.graph, scaleup_sizes=_ints(args.scaleup_size),
                     records_path=os.path.join(args.out, PARTIAL_RECORDS))
    os.makedirs(args.out, exist_ok=True)
    if os.path.exists(spec.records_path):  # left by an earlier run that was killed before it could clean up
        os.remove(spec.records_path)
    incomplete = teardown = None
    try:
        records = run_ranks(bench_rank, args.ranks, spec, device=args.device, timeout_s=args.timeout)[0]
    except TeardownError as error:  # every case ran; a rank then crashed or hung on its way out: say so, keep them
        records, teardown = error.results[0], str(error)
    except EPError as error:  # keep what finished: a long sweep's first hours are worth a table
        records = _finished_records(spec.records_path)
        timed_out = isinstance(error, EPTimeoutError)
        if not records:
            if not timed_out:
                raise  # the rank's traceback is the whole story
            print(f"python -m ep_plugin.bench: no case finished within --timeout {args.timeout:g} s ({error})",
                  file=sys.stderr)
            return 1
        ended = f"--timeout {args.timeout:g} s ended" if timed_out else "a rank failed, which ended"
        incomplete = (f"{ended} the sweep after {len(records)} record(s); the cases after them did not run "
                      f"({error})")
    if os.path.exists(spec.records_path):
        os.remove(spec.records_path)
    if not records:  # every case was skipped (the lines above say why): no empty table
        print("python -m ep_plugin.bench: no case ran (every one was skipped, see above)", file=sys.stderr)
        return 1
    link_gbps = 0.0 if plan.use_mps or args.device == "cpu" else args.link_gbps
    rows = [row for record in records for row in summarize(record, link_gbps)]
    attach_reference_ratio(rows)
    attach_all_to_all_ratio(rows)
    os.makedirs(args.out, exist_ok=True)
    env = environment(args.device, plan)
    env["ceiling"] = ("in-run device copy (ranks share a GPU)" if plan.use_mps and len(set(plan.gpu_of_rank)) == 1
                      else f"none: the ranks share {len(set(plan.gpu_of_rank))} GPUs (the copy ceiling is one GPU's; "
                      "CUDA_VISIBLE_DEVICES=0 puts them on one)" if plan.use_mps else
                      f"link line rate {link_gbps} GB/s per direction" if link_gbps else "none (CPU)")
    env["timing"] = "barrier before every iteration" if args.sync_each_iter else "one barrier, then back to back"
    env["graph"] = _graph_note(args, records)
    # What else sets the timings: the preset's defaults are not in "command", and the knobs not in the options.
    env["warmup"], env["iters"] = args.warmup, args.iters
    env["ep_plugin_variables"] = variables_set()
    # An MPS client's share of the SMs: with ranks sharing a GPU it bounds the kernels and the copy ceiling alike.
    env["mps_thread_percentage"] = _mps_share()
    env["reference"] = {"max_tokens": reference_max_tokens or "no limit", "iters": reference_iters}
    if incomplete:
        env["incomplete"] = incomplete
    if teardown:
        env["teardown"] = teardown
    write_json(os.path.join(args.out, "bench.json"), env, records, rows, argv)
    plots = write_plots(args.out, rows)
    print(f"environment: {env}")
    if not plots:
        print(f"plots: none written ({_why_no_plots(rows)})")
    for record in records:
        if record.get("graph_error"):
            print(f"graph capture failed ({record['backend']} {record['payload']} tokens={record['tokens']} "
                  f"hidden={record['hidden']} sms={record['sms']}): {record['graph_error']}")
    print(f"wrote {os.path.join(args.out, 'bench.json')}" + "".join(f", {p}" for p in plots))
    print(format_table(rows))  # last, so the table ends the output
    if incomplete:
        print(f"python -m ep_plugin.bench: INCOMPLETE: {incomplete}", file=sys.stderr)
    if teardown:
        print(f"python -m ep_plugin.bench: every case ran, but {teardown}", file=sys.stderr)
    failed = [record for record in records if record.get("error") or record.get("graph_error")]
    if failed:  # a script that runs the bench (scripts/gpu_validate.sh) must not read wrong values as a pass
        print(f"python -m ep_plugin.bench: {len(failed)} case(s) FAILED (their rows above; bench.json's records "
              f"say why)", file=sys.stderr)
    return 1 if incomplete or teardown or failed else 0


def _finished_records(path: str) -> list[dict]:
    """The records rank 0 wrote down before the launcher gave up (a line cut short by the kill is dropped)."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C: the launcher has stopped the ranks on its way out; no traceback
        print("python -m ep_plugin.bench: interrupted", file=sys.stderr)
        sys.exit(130)
