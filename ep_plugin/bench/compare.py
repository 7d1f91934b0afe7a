"""Compare bench runs: which shapes got slower. ``python -m ep_plugin.bench.compare --help``.

Each side is one or more ``bench.json`` files of the same sweep (rounds of an A/B run in one call,
``scripts/gpu_ab.sh``); a case's figure on a side is the median over its files of the case's
median µs. Cases are matched by everything that names them (backend, mode, payload, shape, SMs,
routing, ranks, domains, op). Prints one line per case, slowest first, the geometric mean of the
ratios per op, and the cases found on one side only; exits 1 when any case is slower than
``--worse`` allows (default 5%), when a case of base is missing in new (it failed there, or was not
run; ``--allow-missing`` accepts that), when a case of new failed in some of its files (a median of
the rounds that passed would hide the others), when the runs were timed on unlike machines or ways
(``TIMING_ENVIRONMENT``; ``--allow-env-diff`` accepts that) or when no case is on both sides, so a
script can stop on a regression.

  python -m ep_plugin.bench.compare --new new_1/bench.json new_2/bench.json --base base_1/bench.json

``--ops roundtrip`` judges only the round trips: in one run time moves between the dispatch and
combine columns (a combine's interval starts where its dispatch's GPU work ended, so it takes up
the waits a faster dispatch no longer has), and the round trip is what a layer pays. Files may be
gzipped (``bench.json.gz``).

With as many files on each side (rounds of one A/B call), it also prints the geomeans round by
round (file i of new against file i of base): an effect shows in every round; noise straddles 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import os
import re
import statistics
import sys
from typing import Optional

from .report import ROW_OPS, TIMES_READING, summarize

# What names a case in a bench.json summary row (its figures are the other keys).
CASE_KEYS = ("backend", "mode", "payload", "tokens", "hidden", "topk", "experts", "sms", "routing", "ranks",
             "domains", "op")


# What in a bench.json's environment sets its timings: runs that differ here are not compared (a GPU of another
# kind, ranks over another process group or sharing GPUs otherwise, the other timing method, other warm-up or
# timed iteration counts, the reference's own iteration count, other EP_PLUGIN_* knobs, another MPS share of the SMs).
TIMING_ENVIRONMENT = ("device", "gpu", "process_group", "ranks_per_gpu", "timing", "warmup", "iters",
                      "reference_iters", "ep_plugin_variables", "mps_thread_percentage")
# Keys that bench.json files written before them lack: such a file says nothing of them, which is no difference
# (an A/B run against an older tree compares its bench.json with one that has them).
RECORDED_LATER = ("warmup", "iters", "reference_iters", "ep_plugin_variables", "mps_thread_percentage")
# Knobs that bound waits and change no timing: runs that differ only there are compared.
UNTIMED_VARIABLES = ("EP_PLUGIN_TIMEOUT_S", "EP_PLUGIN_PEER_WATCH_S")


def _read(path: str) -> dict:
    try:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            report = json.load(f)
    except (OSError, EOFError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read a bench.json ({error})") from error
    return report if isinstance(report, dict) else {}


def read_environment(path: str) -> dict:
    """The environment of one bench.json ({} in one written without it), with the reference's iteration count
    (recorded under "reference", next to its token limit, which sets what runs and no timing) as
    "reference_iters"."""
    environment = _read(path).get("environment")
    if not isinstance(environment, dict):
        return {}
    reference = environment.get("reference")
    if isinstance(reference, dict) and "iters" in reference:
        environment["reference_iters"] = reference["iters"]
    return environment


def read_summary(path: str) -> list[dict]:
    """The summary rows of one bench.json; ValueError naming the file when it is none.

    A file written before a case's time was its slowest rank's per iteration (no ``times`` mark) held the
    pooled median of every rank's samples: its rows are made again from its records (their raw samples) by
    this version's ``summarize``, so that both sides of a comparison read time alike; the file's own rows
    where its records cannot be (none kept, or a field this version needs missing).
    """
    report = _read(path)
    rows = report.get("summary")
    if not isinstance(rows, list):
        raise ValueError(f"{path}: no 'summary' list: not a bench.json written by python -m ep_plugin.bench")
    records = report.get("records")
    if report.get("times") != TIMES_READING and isinstance(records, list) and records:
        try:
            return [row for record in records for row in summarize(record, link_gbps=0.0)]
        except (KeyError, TypeError, IndexError, ValueError):
            pass
    return rows


def case_figures(paths: list[str], ops: Optional[set] = None) -> dict[tuple, list[float]]:
    """Case -> its median µs in each file where it has one (cases with an error or no median are left out,
    and with ``ops`` those of other ops)."""
    per_case: dict[tuple, list[float]] = {}
    for path in paths:
        for row in read_summary(path):
            if row.get("error") or not row.get("median_us") or (ops and row.get("op") not in ops):
                continue
            per_case.setdefault(tuple(row.get(key) for key in CASE_KEYS), []).append(row["median_us"])
    return per_case


def case_medians(paths: list[str], ops: Optional[set] = None) -> dict[tuple, float]:
    """Case -> the median over the files of the case's median µs (``case_figures``)."""
    return {case: statistics.median(values) for case, values in case_figures(paths, ops).items()}


def environment_differences(new_paths: list[str], base_paths: list[str], *,
                            reference_compared: bool = True) -> list[str]:
    """"key: new value(s) vs base value(s)" for each TIMING_ENVIRONMENT key whose values differ between the
    files (within a side too: one side's rounds ran alike); the reference's iteration count only where
    ``reference_compared`` (a reference case is on both sides)."""
    sides = [[read_environment(path) for path in paths] for paths in (new_paths, base_paths)]
    differences = []
    for key in TIMING_ENVIRONMENT:
        if key == "reference_iters" and not reference_compared:
            continue
        values = [sorted({_shown(env.get(key)) for env in side if key in env or key not in RECORDED_LATER})
                  for side in sides]
        if len(set(values[0]) | set(values[1])) > 1:
            new, base = (" / ".join(side) or "not recorded" for side in values)
            differences.append(f"{key}: {new} (new) vs {base} (base)")
    return differences


def _shown(value) -> str:
    """An environment value as a difference line shows it (the variables as NAME=value, those that change a
    timing only, and not those set to their knob's default: "none" when none)."""
    if isinstance(value, dict):
        return " ".join(f"{name}={item}" for name, item in sorted(value.items())
                        if name not in UNTIMED_VARIABLES and not _at_default(name, item)) or "none"
    return str(value)


def _at_default(name: str, value: str) -> bool:
    """Whether an ``EP_PLUGIN_*`` variable sets its knob to the knob's default (``EP_PLUGIN_PAD_MULTIPLE=1``): a
    run with it times as one without it. A variable of no knob (the build's), or one that does not parse, is
    not."""
    from ep_plugin.config import Config, env_var_name

    for knob in dataclasses.fields(Config):
        if env_var_name(knob.name) == name:
            try:
                return getattr(Config.from_env({name: value}), knob.name) == getattr(Config(), knob.name)
            except (ValueError, TypeError):
                return False
    return False


def match_domains(new: dict[tuple, float], base: dict[tuple, float]) -> tuple[dict, dict]:
    """Runs from before the bench reported domains have none: when one side has none, match on the
    other keys (ValueError when that leaves two cases of a side alike: runs across domains)."""
    index = CASE_KEYS.index("domains")
    if all(case[index] is not None for side in (new, base) for case in side):
        return new, base
    matched = []
    for side in (new, base):
        plain = {case[:index] + (None,) + case[index + 1:]: value for case, value in side.items()}
        if len(plain) < len(side):
            raise ValueError("one side names no domains and the other has one shape in several: "
                             "compare runs of one domain")
        matched.append(plain)
    return matched[0], matched[1]


def compare(new: dict[tuple, float], base: dict[tuple, float], worse: float) -> tuple[list[tuple], list[tuple]]:
    """(rows for the cases on both sides: (ratio new / base, new µs, base µs, case, slower) sorted slowest
    first, the cases on one side only as (side, case))."""
    rows = []
    for case in new.keys() & base.keys():
        ratio = new[case] / base[case]
        rows.append((ratio, new[case], base[case], case, ratio > 1.0 + worse))
    rows.sort(key=lambda row: -row[0])
    alone = sorted([("new", case) for case in new.keys() - base.keys()] +
                   [("base", case) for case in base.keys() - new.keys()], key=str)
    return rows, alone


def _describe(case: tuple) -> str:
    named = dict(zip(CASE_KEYS, case, strict=True))
    return (f"{named['backend']} {named['mode']} {named['payload']} T={named['tokens']} H={named['hidden']} "
            f"top{named['topk']}/{named['experts']} sms={named['sms']} {named['routing']} ranks={named['ranks']} "
            f"{named['domains']} {named['op']}")


def geomeans(rows: list[tuple]) -> dict[str, float]:
    """Op -> geometric mean of its cases' ratios."""
    logs: dict[str, list[float]] = {}
    for ratio, _, _, case, _ in rows:
        logs.setdefault(case[CASE_KEYS.index("op")], []).append(math.log(ratio))
    return {op: math.exp(sum(values) / len(values)) for op, values in sorted(logs.items())}


def round_pairs(new_paths: list[str], base_paths: list[str]) -> list[tuple[str, str, str]]:
    """(round, new file, base file) of the rounds both sides ran: by the round number in the names
    (scripts/gpu_ab.sh writes new_3.json and base_3.json), else file i with file i. By position alone, a
    side that lost round 2 and one that lost round 3 had their rounds 3 and 2 compared."""
    numbers = [{_round_of(path): path for path in paths} for paths in (new_paths, base_paths)]
    if all(None not in side and len(side) == len(paths)
           for side, paths in zip(numbers, (new_paths, base_paths), strict=True)):
        both = sorted(set(numbers[0]) & set(numbers[1]))
        return [(str(n), numbers[0][n], numbers[1][n]) for n in both]
    if len(new_paths) != len(base_paths):
        return []
    return [(str(i), new, base) for i, (new, base) in enumerate(zip(new_paths, base_paths, strict=True), start=1)]


def _round_of(path: str) -> Optional[int]:
    match = re.search(r"_(\d+)\.json$", os.path.basename(path))
    return int(match.group(1)) if match else None


def round_geomeans(pairs: list[tuple[str, str, str]], ops: Optional[set] = None) -> list[tuple[str, dict[str, float]]]:
    """Per round of ``round_pairs``: (round, op -> geomean of the cases' ratios)."""
    rounds = []
    for label, new_path, base_path in pairs:
        new, base = match_domains(case_medians([new_path], ops), case_medians([base_path], ops))
        rounds.append((label, geomeans(compare(new, base, 0.0)[0])))
    return rounds


def main(argv: Optional[list[str]] = None) -> int:
    from ..cli import OneLineParser

    parser = OneLineParser(prog="python -m ep_plugin.bench.compare", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", nargs="+", required=True, help="bench.json file(s) of the tree under test")
    parser.add_argument("--base", nargs="+", required=True, help="bench.json file(s) of the tree to compare against")
    parser.add_argument("--worse", type=float, default=0.05,
                        help="a case slower than base by more than this fraction counts as a regression (default 0.05)")
    parser.add_argument("--ops", default="",
                        help="comma list of the ops to compare (dispatch, combine, roundtrip, step; default all)")
    parser.add_argument("--allow-missing", action="store_true",
                        help="a case of base that new lacks (it failed, or was not run), or that failed in some of "
                             "new's files, is not a regression")
    parser.add_argument("--allow-env-diff", action="store_true",
                        help="compare runs timed on unlike machines or ways (" + ", ".join(TIMING_ENVIRONMENT) + ")")
    args = parser.parse_args(argv)
    if not 0 <= args.worse < 10:
        parser.error(f"--worse is a fraction (0.05 = 5%), got {args.worse}")
    ops = {op.strip() for op in args.ops.split(",") if op.strip()}
    if ops - set(ROW_OPS):
        parser.error(f"--ops takes {', '.join(ROW_OPS)}; got {', '.join(sorted(ops - set(ROW_OPS)))}")
    try:
        new_figures = case_figures(args.new, ops)
        new, base = match_domains({case: statistics.median(values) for case, values in new_figures.items()},
                                  case_medians(args.base, ops))
    except ValueError as error:
        parser.error(str(error))
    rows, alone = compare(new, base, args.worse)
    print(f"{'new/base':>8s} {'new µs':>10s} {'base µs':>10s}  case")
    for ratio, new_us, base_us, case, slower in rows:
        print(f"{ratio:8.3f} {new_us:10.1f} {base_us:10.1f}  {_describe(case)}{'  SLOWER' if slower else ''}")
    for op, mean in geomeans(rows).items():
        print(f"geomean new/base {op}: {mean:.3f}")
    pairs = round_pairs(args.new, args.base)
    if len(pairs) > 1:
        print("round by round (new_N.json against base_N.json, else file i against file i), geomean new/base:")
        for label, means in round_geomeans(pairs, ops):
            print(f"  round {label}: " + ", ".join(f"{op} {mean:.3f}" for op, mean in means.items()))
    missing = [case for side, case in alone if side == "base"]
    # A case new failed in some rounds: its median is the passing rounds' alone, which hides the others.
    partial = sorted((case for case, values in new_figures.items() if len(values) < len(args.new)), key=str)
    for case in partial:
        print(f"failed or not run in {len(args.new) - len(new_figures[case])} of {len(args.new)} new file(s): "
              f"{_describe(case)}")
    missing += partial
    for name, paths in (("new", args.new), ("base", args.base)):
        for path in paths:
            environment = read_environment(path)
            for key in ("incomplete", "teardown"):
                if environment.get(key):
                    how = "incompletely" if key == "incomplete" else "with a teardown error"
                    print(f"note: {name} file {path} ran {how}: {environment[key]}")
    reference_compared = any(case[CASE_KEYS.index("backend")] == "reference" for _, _, _, case, _ in rows)
    differences = environment_differences(args.new, args.base, reference_compared=reference_compared)
    for difference in differences:
        print(f"timed unlike: {difference}")
    for side, case in alone:
        # A case base ran and new did not is a regression (new failed it, or stopped running it), not a detail.
        print(f"missing in new (failed or not run): {_describe(case)}" if side == "base" else
              f"only in {side}: {_describe(case)}")
    slower = sum(1 for row in rows if row[4])
    print(f"{len(rows)} cases compared, {slower} slower than base by more than {args.worse:.0%}"
          + (f", {len(missing)} missing in new" if missing else ""))
    if not rows:
        print("no case is on both sides: nothing was compared")
        return 1
    if differences and not args.allow_env_diff:
        print("the runs were timed on unlike machines or ways (above): their ratios say nothing of the code "
              "(--allow-env-diff compares them anyway)")
        return 1
    return 1 if slower or (missing and not args.allow_missing) else 0


if __name__ == "__main__":
    sys.exit(main())
