"""Turn the raw samples into the table, the JSON and the plots."""

from __future__ import annotations

import json
import math
import os
import statistics

OPS = ("dispatch", "combine", "roundtrip")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(record: dict, link_gbps: float) -> list[dict]:
    """One row per op: µs median/p10/p90 over ranks x iterations, algorithm GB/s per rank, ceiling."""
    rows = []
    recv_bytes = record["bytes"]["recv_token_bytes"]
    for op_index, op in enumerate(OPS):
        times, rates = [], []
        for rank, samples in enumerate(record["samples_us"]):
            for sample in samples:
                t = sample[0] + sample[1] if op == "roundtrip" else sample[op_index]
                times.append(t)
                if op != "roundtrip" and t > 0:
                    rates.append(recv_bytes[rank] / (t * 1e-6) / 1e9)
        ceiling = record["ceiling_us"].get(op)
        if ceiling is None and op != "roundtrip" and link_gbps > 0 and record["ranks"] > 1:
            # One GPU per rank: the busiest rank's link-crossing bytes at line rate.
            ceiling = max(record["bytes"]["remote_bytes_in"]) / (link_gbps * 1e9) * 1e6
        if op == "roundtrip" and record["ceiling_us"]:
            ceiling = sum(record["ceiling_us"].get(o, float("nan")) for o in ("dispatch", "combine"))
        median = statistics.median(times) if times else float("nan")
        rows.append(dict(
            backend=record["backend"], mode=record["mode"], payload=record["payload"], tokens=record["tokens"],
            hidden=record["hidden"], topk=record["topk"], experts=record["experts"], sms=record["sms"],
            routing=record["routing"], ranks=record["ranks"], op=op, median_us=median,
            p10_us=_percentile(times, 0.1), p90_us=_percentile(times, 0.9),
            algo_gbps=statistics.median(rates) if rates else None, ceiling_us=ceiling,
            ceiling_ratio=(ceiling / median) if ceiling and median > 0 else None))
    return rows


def attach_reference_ratio(rows: list[dict]) -> None:
    """reference time / our time for the same shape and op (reference runs blocking, bf16)."""
    reference = {(r["tokens"], r["hidden"], r["topk"], r["experts"], r["routing"], r["op"]): r["median_us"]
                 for r in rows if r["backend"] == "reference"}
    for row in rows:
        ref = reference.get((row["tokens"], row["hidden"], row["topk"], row["experts"], row["routing"], row["op"]))
        row["reference_ratio"] = ref / row["median_us"] if ref and row["backend"] != "reference" else None


def format_table(rows: list[dict]) -> str:
    header = ("backend", "mode", "payload", "tokens", "hidden", "sms", "routing", "op", "median_us", "p10_us",
              "p90_us", "algo_GB/s", "ceil_us", "ceil/ours", "ref/ours")
    lines = [" ".join(f"{h:>10s}" for h in header)]

    def fmt(value, digits=1):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return f"{'-':>10s}"
        if isinstance(value, float):
            return f"{value:10.{digits}f}"
        return f"{str(value):>10s}"

    for r in rows:
        lines.append(" ".join([fmt(r["backend"]), fmt(r["mode"]), fmt(r["payload"]), fmt(r["tokens"]),
                               fmt(r["hidden"]), fmt(r["sms"]), fmt(r["routing"]), fmt(r["op"]),
                               fmt(r["median_us"]), fmt(r["p10_us"]), fmt(r["p90_us"]), fmt(r["algo_gbps"], 2),
                               fmt(r["ceiling_us"]), fmt(r["ceiling_ratio"], 2), fmt(r["reference_ratio"], 2)]))
    return "\n".join(lines)


def write_json(path: str, environment: dict, records: list[dict], rows: list[dict], argv: list[str]) -> None:
    with open(path, "w") as f:
        json.dump({"command": argv, "environment": environment, "summary": rows, "records": records}, f, indent=1,
                  default=str)


def write_plots(out_dir: str, rows: list[dict]) -> list[str]:
    """GB/s vs tokens per rank and GB/s vs SMs, one line per (backend, mode, payload, op)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    rows = [r for r in rows if r["algo_gbps"] and r["op"] != "roundtrip"]
    for x_key, x_label, file_name in (("tokens", "tokens per rank", "gbps_vs_tokens.png"),
                                      ("sms", "SMs per rank", "gbps_vs_sms.png")):
        series: dict[tuple, dict] = {}
        for r in rows:
            if r[x_key] is None:
                continue
            # Fix the other swept axes at their most common value so each line varies one axis.
            key = (r["backend"], r["mode"], r["payload"], r["op"], r["routing"], r["hidden"],
                   r["sms"] if x_key == "tokens" else r["tokens"])
            series.setdefault(key, {})[r[x_key]] = r["algo_gbps"]
        series = {k: v for k, v in series.items() if len(v) > 1}
        if not series:
            continue
        figure, axis = plt.subplots(figsize=(9, 5.5))
        for key, points in sorted(series.items(), key=lambda kv: str(kv[0])):
            xs = sorted(points)
            fixed = f"sms={key[6]}" if x_key == "tokens" else f"tokens={key[6]}"
            axis.plot(xs, [points[x] for x in xs], marker="o",
                      label=f"{key[0]} {key[1]} {key[2]} {key[3]} {key[4]} H={key[5]} {fixed}")
        axis.set_xlabel(x_label)
        axis.set_ylabel("algorithm GB/s per rank")
        if x_key == "tokens":
            axis.set_xscale("log", base=2)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=6)
        figure.tight_layout()
        path = os.path.join(out_dir, file_name)
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)
    return written
