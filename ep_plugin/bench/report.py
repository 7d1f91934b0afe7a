"""Turn the raw samples into the table, the JSON and the plots."""

from __future__ import annotations

import json
import math
import os
import statistics
from typing import Optional

from .workload import Shape

OPS = ("dispatch", "combine", "roundtrip")  # from the per-op events
ROW_OPS = (*OPS, "step")  # every op a summary row can name; "step": a plain loop's µs per round trip


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _link_ceiling_us(record: dict, op: str, link_gbps: float) -> Optional[float]:
    """One GPU per rank: the busiest rank's least link bytes for the op, at line rate."""
    if link_gbps <= 0 or record["ranks"] < 2:
        return None
    if "link_floor_bytes" in record and record["link_floor_bytes"] is None:  # across domains: no link model
        return None
    floor = record.get("link_floor_bytes")
    # Records written before link_floor_bytes existed: the payload bytes a rank receives over links.
    num_bytes = floor[op] if floor else max(record["bytes"]["remote_bytes_in"])
    return num_bytes / (link_gbps * 1e9) * 1e6


def _ceilings(record: dict, link_gbps: float) -> dict[str, Optional[float]]:
    ceilings = {}
    for op in ("dispatch", "combine"):
        ceiling = record["ceiling_us"].get(op)  # timed in the run when ranks share a GPU
        ceilings[op] = ceiling if ceiling is not None else _link_ceiling_us(record, op, link_gbps)
    both = [ceilings["dispatch"], ceilings["combine"]]
    ceilings["roundtrip"] = ceilings["step"] = sum(both) if None not in both else None
    return ceilings


def _link_sent_bytes(record: dict, op: str) -> Optional[int]:
    """The busiest rank's bytes sent to other ranks (roundtrip: both ops); None unless one GPU per rank."""
    sent = record.get("link_bytes")
    if not record.get("one_gpu_per_rank") or not sent:
        return None
    if op in ("roundtrip", "step"):
        return max(d + c for d, c in zip(sent["dispatch"], sent["combine"], strict=True))
    return max(sent[op])


def _link_columns(record: dict, op: str, median_us: float, link_gbps: float) -> dict:
    """link_mb / link_gbps (measured) / link_pct (of --link-gbps); None where they do not apply."""
    num_bytes = _link_sent_bytes(record, op)
    rate = num_bytes / (median_us * 1e-6) / 1e9 if num_bytes is not None and median_us > 0 else None
    return dict(link_mb=num_bytes / 1e6 if num_bytes is not None else None, link_gbps=rate,
                link_pct=rate / link_gbps * 100 if rate is not None and link_gbps > 0 else None)


def _scaleout_columns(record: dict, op: str, median_us: float) -> dict:
    """Across domains: the busiest rank's bytes over its rail (scaleout_mb) and their rate over the median."""
    sent = record.get("scaleout_bytes")
    if not sent:
        return dict(domains=record.get("domains"), scaleout_mb=None, scaleout_gbps=None)
    if op in ("roundtrip", "step"):
        num_bytes = max(d + c for d, c in zip(sent["dispatch"], sent["combine"], strict=True))
    else:
        num_bytes = max(sent[op])
    rate = num_bytes / (median_us * 1e-6) / 1e9 if median_us > 0 else None
    return dict(domains=record.get("domains"), scaleout_mb=num_bytes / 1e6, scaleout_gbps=rate)


def _combine_token_bytes(record: dict) -> list[int]:
    """recv_token_bytes in bf16 rows: what a combine moves back, whatever the dispatch's payload."""
    received = record["bytes"]["recv_token_bytes"]
    if record.get("payload") != "fp8":
        return received
    shape = Shape(record["tokens"], record["hidden"], record["topk"], record["experts"], "fp8", record["routing"])
    return [b // shape.row_bytes() * 2 * shape.hidden for b in received]


def _op_times(record: dict) -> list[tuple[str, list[float], Optional[float]]]:
    """(op, µs samples, GB/s) for each op of a record: the per-op events' samples, each iteration's slowest
    rank's, and the step row's one figure per rank (records written before it existed have none).
    GB/s: the busiest rank's, the tokens it receives in the op's rows (the payload's for dispatch, bf16 for
    combine: an fp8 dispatch is combined in bf16) over its median time. The busiest rank bounds the op; a
    median of every rank's samples pooled described none under skewed routing (with two ranks, the mean of
    the busy rank's slowest sample and the idle one's fastest)."""
    op_bytes = {"dispatch": record["bytes"]["recv_token_bytes"], "combine": _combine_token_bytes(record)}
    ops = []
    for op_index, op in enumerate(OPS):
        per_rank = [[sample[0] + sample[1] if op == "roundtrip" else sample[op_index] for sample in samples]
                    for samples in record["samples_us"]]
        # The op is done when its slowest rank is: each iteration counts its slowest rank's time. A median of
        # every rank's samples pooled counted the idle ranks' short ops (skewed routing: 3-4.5x the copy ceiling
        # where the slowest rank's time gives 0.50; balanced: 1-4% fast). Not strict: a case that failed
        # part-way may hold fewer samples on some rank.
        times = [max(iteration) for iteration in zip(*per_rank, strict=False)]
        rate = None
        if op != "roundtrip":
            busiest = max(range(len(per_rank)), key=lambda rank: op_bytes[op][rank])
            median = statistics.median(per_rank[busiest]) if per_rank[busiest] else 0.0
            if op_bytes[op][busiest] > 0 and median > 0:
                rate = op_bytes[op][busiest] / (median * 1e-6) / 1e9
        ops.append((op, times, rate))
    if record.get("step_us"):
        ops.append(("step", list(record["step_us"]), None))
    return ops


def summarize(record: dict, link_gbps: float) -> list[dict]:
    """One row per op: µs median/p10/p90 over iterations of the slowest rank's time (step: over ranks),
    algorithm GB/s of the busiest rank, ceiling, link use."""
    rows = []
    ceilings = _ceilings(record, link_gbps)
    for op, times, rate in _op_times(record):
        ceiling = ceilings[op]
        median = statistics.median(times) if times else float("nan")
        rows.append(dict(
            backend=record["backend"], mode=record["mode"], payload=record["payload"], tokens=record["tokens"],
            hidden=record["hidden"], topk=record["topk"], experts=record["experts"], sms=record["sms"],
            routing=record["routing"], ranks=record["ranks"], op=op, median_us=median,
            p10_us=_percentile(times, 0.1), p90_us=_percentile(times, 0.9),
            algo_gbps=rate, ceiling_us=ceiling,
            ceiling_ratio=(ceiling / median) if ceiling and median > 0 else None,
            **_link_columns(record, op, median, link_gbps), **_scaleout_columns(record, op, median),
            error=record.get("graph_error") or record.get("error")))
        if record.get("scaleout_bytes"):  # its own line in plots and tables next to the one-domain run
            rows[-1]["backend"] = f"{record['backend']} {record['domains']}"
        if rows[-1]["error"]:  # wrong values or a failed graph: no figure anywhere (table, plots, ratios, JSON)
            rows[-1].update({key: None for key in FIGURES})
    return rows


# The row keys that are figures of the timed ops: none of them stands for a case that failed (``error``).
FIGURES = ("median_us", "p10_us", "p90_us", "algo_gbps", "ceiling_ratio", "link_gbps", "link_pct", "scaleout_gbps")


# The backends that are baselines of a ratio (``ref/ours``, ``a2a/ours``), not ours.
BASELINES = ("reference", "all_to_all")


def _baseline_of(row: dict) -> Optional[str]:
    """The baseline a row times ("reference 2x4" is the reference across domains), or None for ours."""
    name = row["backend"].partition(" ")[0]
    return name if name in BASELINES else None


def _attach_ratio(rows: list[dict], baseline: str, key: str, keys: tuple[str, ...]) -> None:
    """row[key] = the baseline's median / the row's for the rows alike in ``keys`` (any mode and SMs). No
    baseline's row gets one against another baseline: all_to_all over the reference says nothing of ours."""
    times = {tuple(r[k] for k in keys): r["median_us"] for r in rows if r["backend"] == baseline}
    for row in rows:
        time = times.get(tuple(row[k] for k in keys)) if _baseline_of(row) in (None, baseline) else None
        row[key] = time / row["median_us"] if time and row["backend"] != baseline and row["median_us"] else None


def attach_reference_ratio(rows: list[dict]) -> None:
    """ref/ours: reference time / our time for the same shape and op (reference runs blocking, bf16)."""
    _attach_ratio(rows, "reference", "reference_ratio", ("tokens", "hidden", "topk", "experts", "routing", "op"))


def attach_all_to_all_ratio(rows: list[dict]) -> None:
    """a2a/ours: the all_to_all baseline's time / ours for the same shape, payload and op (the baseline
    moves compact rows: one per token and destination rank)."""
    _attach_ratio(rows, "all_to_all", "all_to_all_ratio",
                  ("tokens", "hidden", "topk", "experts", "routing", "payload", "op"))


# (header, row key, decimals for floats)
COLUMNS = (("backend", "backend", 0), ("mode", "mode", 0), ("payload", "payload", 0), ("tokens", "tokens", 0),
           ("hidden", "hidden", 0), ("topk", "topk", 0), ("experts", "experts", 0), ("sms", "sms", 0),
           ("routing", "routing", 0), ("op", "op", 0), ("median_us", "median_us", 1), ("p10_us", "p10_us", 1),
           ("p90_us", "p90_us", 1), ("algo_GB/s", "algo_gbps", 2), ("ceil_us", "ceiling_us", 1),
           ("ceil/ours", "ceiling_ratio", 2), ("ref/ours", "reference_ratio", 2), ("a2a/ours", "all_to_all_ratio", 2),
           ("domains", "domains", 0), ("scaleout_MB", "scaleout_mb", 2), ("scaleout_GB/s", "scaleout_gbps", 1),
           ("link_MB", "link_mb", 2), ("link_GB/s", "link_gbps", 1), ("link%", "link_pct", 1))


def _cell(value, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        if value and abs(value) < 0.5 * 10 ** -digits:  # would print as 0.00 (CPU GB/s of tiny shapes)
            return f"{value:.2g}"
        return f"{value:.{digits}f}"
    return str(value)


def format_table(rows: list[dict]) -> str:
    """Right-aligned columns, each as wide as its longest cell (mode names like nonblocking+graph)."""
    cells = [[header for header, _, _ in COLUMNS]]
    cells += [[("FAILED" if key == "median_us" and row.get("error") else _cell(row.get(key), digits))
               for _, key, digits in COLUMNS] for row in rows]
    widths = [max(10, *(len(line[i]) for line in cells)) for i in range(len(COLUMNS))]
    return "\n".join(" ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True))
                     for line in cells)


def _finite(value):
    """``value`` with every NaN or infinity (a failed graph's median, a zero-byte ceiling) made None:
    JSON has no NaN, and strict readers (jq, JavaScript) refuse Python's bare NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


# How a summary row's times read a record's samples; a file without it pooled every rank's samples
# (``bench.compare`` reads such a file's times again from its records).
TIMES_READING = "slowest rank per iteration"


def write_json(path: str, environment: dict, records: list[dict], rows: list[dict], argv: list[str]) -> None:
    report = _finite({"command": argv, "environment": environment, "times": TIMES_READING, "summary": rows,
                      "records": records})
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str, allow_nan=False)


def _series(rows: list[dict], x_key: str) -> dict[tuple, dict]:
    """Lines of GB/s over x_key, one per (backend, mode, payload, op, routing, hidden, the other axis, topk,
    experts)."""
    series: dict[tuple, dict] = {}
    for r in rows:
        if r[x_key] is None:
            continue
        key = (r["backend"], r["mode"], r["payload"], r["op"], r["routing"], r["hidden"],
               r["sms"] if x_key == "tokens" else r["tokens"], r["topk"], r["experts"])
        series.setdefault(key, {})[r[x_key]] = r["algo_gbps"]
    return {k: v for k, v in series.items() if len(v) > 1}


def _reference_levels(rows: list[dict], series: dict[tuple, dict]) -> dict[str, float]:
    """The reference has no SM axis: one level per (op, payload) at each plotted (routing, hidden, tokens,
    topk, experts)."""
    plotted = {(key[4], key[5], key[6], key[7], key[8]) for key in series}
    return {f"reference {r['mode']} {r['payload']} {r['op']} {r['routing']} H={r['hidden']} tokens={r['tokens']} "
            f"top{r['topk']}/{r['experts']}": r["algo_gbps"] for r in rows
            if r["backend"] == "reference"
            and (r["routing"], r["hidden"], r["tokens"], r["topk"], r["experts"]) in plotted}


def _draw(plt, path: str, x_key: str, x_label: str, series: dict[tuple, dict], levels: dict[str, float]) -> None:
    figure, axis = plt.subplots(figsize=(11, 5.5))
    palette = plt.get_cmap("tab10" if len(series) + len(levels) <= 10 else "tab20").colors  # distinct lines
    for index, (key, points) in enumerate(sorted(series.items(), key=lambda kv: str(kv[0]))):
        xs = sorted(points)
        fixed = "" if key[6] is None else f"sms={key[6]}" if x_key == "tokens" else f"tokens={key[6]}"
        axis.plot(xs, [points[x] for x in xs], marker="o", color=palette[index % len(palette)],
                  label=f"{key[0]} {key[1]} {key[2]} {key[3]} {key[4]} H={key[5]} {fixed} top{key[7]}/{key[8]}")
    for index, (label, gbps) in enumerate(sorted(levels.items()), start=len(series)):
        axis.axhline(gbps, linestyle="--", linewidth=1.2, color=palette[index % len(palette)], label=label)
    axis.set_xlabel(x_label)
    axis.set_ylabel("algorithm GB/s (busiest rank)")
    if x_key == "tokens":
        axis.set_xscale("log", base=2)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: lines stay visible
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def write_plots(out_dir: str, rows: list[dict]) -> list[str]:
    """GB/s vs tokens per rank and GB/s vs SMs (the reference as dashed levels), one line per series. A plot
    of an earlier run in ``out_dir`` goes first (the default folder is reused): one this run does not draw
    stood next to its bench.json as if it were this run's."""
    plots = (("tokens", "tokens per rank", "gbps_vs_tokens.png"), ("sms", "SMs per rank", "gbps_vs_sms.png"))
    for _, _, file_name in plots:
        if os.path.exists(os.path.join(out_dir, file_name)):
            os.remove(os.path.join(out_dir, file_name))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    rows = [r for r in rows if r["algo_gbps"] and r["op"] != "roundtrip"]
    for x_key, x_label, file_name in plots:
        series = _series(rows, x_key)
        if not series:
            continue
        path = os.path.join(out_dir, file_name)
        _draw(plt, path, x_key, x_label, series, _reference_levels(rows, series) if x_key == "sms" else {})
        written.append(path)
    return written
