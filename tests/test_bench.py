"""The benchmark harness end to end on CPU ranks (no timing is asserted), and its byte and ceiling logic."""

import json
import pathlib
import subprocess
import sys

import pytest
import torch

import ep_plugin
from ep_plugin.backends.reference import ReferenceBackend
from ep_plugin.bench.__main__ import main, parse_args, reference_limits
from ep_plugin.bench.report import (
    _reference_levels,
    _series,
    attach_reference_ratio,
    format_table,
    summarize,
    write_plots,
)
from ep_plugin.bench.runner import SweepSpec, bench_rank
from ep_plugin.bench.workload import Shape, make_routing, traffic
from ep_plugin.testing import run_ranks
from ep_plugin.testing.launcher import plan_launch


def test_bench_cli_writes_table_json_and_plot(tmp_path):
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "ep_plugin.bench", "--device", "cpu", "--ranks", "2", "--backends", "reference",
               "--tokens", "16,32", "--hidden", "64", "--experts", "8", "--topk", "2", "--payloads", "bf16",
               "--sms", "4", "--routings", "balanced,skewed", "--modes", "blocking", "--iters", "2",
               "--reference-iters", "2", "--warmup", "1", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "median_us" in result.stdout and "roundtrip" in result.stdout
    report = json.loads((out / "bench.json").read_text())
    assert report["environment"]["ranks"] == 2 and report["environment"]["process_group"] == "gloo"
    assert len(report["records"]) == 4  # 2 token counts x 2 routings
    for record in report["records"]:
        assert len(record["samples_us"]) == 2 and all(len(s) == 2 for s in record["samples_us"])
        # Every (token, expert) pair lands as one output row somewhere.
        assert sum(record["bytes"]["out_bytes"]) == 2 * record["tokens"] * 2 * (2 * 64)
    ops = {(row["tokens"], row["routing"], row["op"]) for row in report["summary"]}
    assert len(ops) == 16  # dispatch, combine, roundtrip and step of each case
    assert (out / "gbps_vs_tokens.png").stat().st_size > 1000


def test_traffic_counts_tokens_once_per_destination_rank():
    shape = Shape(tokens=5, hidden=128, topk=2, experts=4, payload="bf16", routing="balanced")
    # rank 0: token 0 -> experts 0,1 (both on rank 0); token 1 -> experts 0,3 (ranks 0 and 1)
    first = torch.zeros(2, 4, dtype=torch.bool)
    first[0, [0, 1]] = True
    first[1, [0, 3]] = True
    second = torch.zeros(1, 4, dtype=torch.bool)
    second[0, [2, 3]] = True  # rank 1's token -> both experts on rank 1
    counts = traffic([first, second], 2, shape)
    row = 2 * 128
    assert counts["recv_token_bytes"] == [2 * row, 2 * row]
    assert counts["out_bytes"] == [3 * row, 3 * row]
    assert counts["remote_bytes_in"] == [0, 1 * row]
    fp8 = Shape(tokens=5, hidden=256, topk=2, experts=4, payload="fp8", routing="balanced")
    assert fp8.row_bytes() == 256 + 2 * 4


def test_ceiling_per_gpu_link_uses_the_busiest_ranks_remote_bytes():
    record = dict(backend="hybrid", mode="blocking", payload="bf16", tokens=4, hidden=8, topk=1, experts=2, sms=8,
                  routing="balanced", ranks=2, samples_us=[[[10.0, 20.0]], [[30.0, 40.0]]],
                  bytes={"recv_token_bytes": [1000, 2000], "out_bytes": [1000, 2000],
                         "remote_bytes_in": [500, 1500]}, ceiling_us={})
    rows = {row["op"]: row for row in summarize(record, link_gbps=1.0)}
    assert rows["dispatch"]["ceiling_us"] == 1500 / 1e9 * 1e6
    # One iteration: the slower rank's times (rank 1's: 30 and 30 + 40)
    assert rows["dispatch"]["median_us"] == 30.0 and rows["roundtrip"]["median_us"] == 70.0
    assert rows["dispatch"]["ceiling_ratio"] == rows["dispatch"]["ceiling_us"] / 30.0
    assert "step" not in rows  # a record written before the step row existed has none


def test_an_iterations_time_is_its_slowest_ranks():
    """Each rank is slowest in another iteration: the op's time is per iteration the slowest rank's (30 in the
    median), not the median of every rank's samples pooled (15: mostly idle ranks' short ops), which made the
    ceiling ratio read 4x under skewed routing. The round trip adds a rank's two ops before taking the max."""
    record = dict(backend="hybrid", mode="blocking", payload="bf16", tokens=4, hidden=8, topk=1, experts=2, sms=8,
                  routing="skewed", ranks=2,
                  samples_us=[[[10.0, 1.0], [30.0, 1.0], [10.0, 1.0]], [[20.0, 5.0], [10.0, 5.0], [40.0, 5.0]]],
                  bytes={"recv_token_bytes": [1000, 2000], "out_bytes": [1000, 2000], "remote_bytes_in": [500, 1500]},
                  ceiling_us={"dispatch": 15.0, "combine": 2.0})
    rows = {row["op"]: row for row in summarize(record, link_gbps=0.0)}
    assert (rows["dispatch"]["median_us"], rows["dispatch"]["p10_us"], rows["dispatch"]["p90_us"]) == \
        (30.0, pytest.approx(22.0), pytest.approx(38.0))
    assert rows["dispatch"]["ceiling_ratio"] == pytest.approx(0.5)
    assert rows["combine"]["median_us"] == 5.0
    assert rows["roundtrip"]["median_us"] == 31.0  # per iteration max(11, 25), max(31, 15), max(11, 45)


def test_compare_judges_both_files_by_this_versions_times(tmp_path):
    """A bench.json's summary holds the times its writer's version computed; compare makes a file's times
    from before the slowest-rank reading (no "times" mark) again from its records' samples, so a base file
    from before is judged in the same unit; a marked file's own rows stand (the other compare tests edit them)."""
    import json

    from ep_plugin.bench.compare import case_medians
    from ep_plugin.bench.report import TIMES_READING

    record = dict(backend="hybrid", mode="blocking", payload="bf16", tokens=4, hidden=8, topk=1, experts=2, sms=8,
                  routing="balanced", ranks=2, samples_us=[[[10.0, 2.0]], [[30.0, 4.0]]],
                  bytes={"recv_token_bytes": [1000, 2000], "out_bytes": [1000, 2000], "remote_bytes_in": [500, 1500]},
                  ceiling_us={})
    old_rows = [dict(row, median_us=20.0) for row in summarize(record, link_gbps=0.0)]  # the pooled median
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"summary": old_rows, "records": [record]}))
    medians = {case[-1]: median for case, median in case_medians([str(path)]).items()}
    assert medians["dispatch"] == 30.0 and medians["combine"] == 4.0, medians
    path.write_text(json.dumps({"summary": old_rows}))  # no records kept: the file's own rows
    assert {case[-1]: m for case, m in case_medians([str(path)]).items()}["dispatch"] == 20.0
    path.write_text(json.dumps({"times": TIMES_READING, "summary": old_rows, "records": [record]}))
    assert {case[-1]: m for case, m in case_medians([str(path)]).items()}["dispatch"] == 20.0


def test_the_link_floor_counts_the_busiest_direction():
    """Skewed: ranks 1 and 2 each send rank 0 five tokens and rank 0 sends one to each, so rank 0 receives 10
    where no rank sends more than 6: its incoming link bounds the dispatch (and its outgoing the combine)."""
    from ep_plugin.bench.runner import _compact_link_floor

    shape = Shape(tokens=8, hidden=64, topk=1, experts=3, payload="bf16", routing="skewed")
    packets = [[2, 1, 1], [5, 2, 1], [5, 0, 3]]  # packets[source][dest], the own rank's not over a link
    assert _compact_link_floor(shape, packets) == {"dispatch": 10 * 128, "combine": 10 * 128}


def test_step_row_is_the_median_over_ranks_of_the_loop_figure():
    record = dict(backend="hybrid", mode="nonblocking", payload="bf16", tokens=4, hidden=8, topk=1, experts=2,
                  sms=8, routing="balanced", ranks=3, samples_us=[[[10.0, 20.0]]] * 3, step_us=[25.0, 31.0, 40.0],
                  bytes={"recv_token_bytes": [1000] * 3, "out_bytes": [1000] * 3, "remote_bytes_in": [500] * 3},
                  ceiling_us={"dispatch": 5.0, "combine": 10.0})
    rows = {row["op"]: row for row in summarize(record, link_gbps=0.0)}
    assert rows["roundtrip"]["median_us"] == 30.0  # the per-op events' sum
    step = rows["step"]
    assert (step["median_us"], step["p10_us"], step["p90_us"]) == (31.0, pytest.approx(26.2), pytest.approx(38.2))
    assert step["ceiling_us"] == 15.0 and step["ceiling_ratio"] == pytest.approx(15.0 / 31.0)
    assert step["algo_gbps"] is None  # no bytes per rank to rate: it is the round trip's time


def test_an_fp8_dispatch_is_rated_in_its_rows_and_its_combine_in_bf16():
    """An fp8 dispatch moves H + H/128 * 4 bytes a token, its combine 2H (bf16): the combine's GB/s once came
    from the fp8 bytes, about half the real rate."""
    hidden, tokens_in = 256, 10
    fp8_row = hidden + hidden // 128 * 4
    record = dict(backend="hybrid", mode="blocking", payload="fp8", tokens=8, hidden=hidden, topk=2, experts=4,
                  sms=8, routing="balanced", ranks=1, samples_us=[[[10.0, 10.0]]],
                  bytes={"recv_token_bytes": [tokens_in * fp8_row], "out_bytes": [0], "remote_bytes_in": [0]},
                  ceiling_us={})
    rows = {row["op"]: row for row in summarize(record, link_gbps=0.0)}
    assert rows["dispatch"]["algo_gbps"] == pytest.approx(tokens_in * fp8_row / 10e-6 / 1e9)
    assert rows["combine"]["algo_gbps"] == pytest.approx(tokens_in * 2 * hidden / 10e-6 / 1e9)


def test_the_rate_is_the_busiest_ranks():
    """Under skewed routing one rank receives far more than another: the median of every rank's rates pooled
    described no rank (two ranks: the mean of the busy one's slowest sample and the idle one's fastest), and
    the skewed lines of the plot zig-zagged. The rate is the busiest rank's bytes over its median time."""
    record = dict(backend="reference", mode="blocking", payload="bf16", tokens=8, hidden=64, topk=2, experts=4,
                  sms=None, routing="skewed", ranks=2,
                  samples_us=[[[10.0, 20.0], [12.0, 24.0], [14.0, 28.0]], [[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]],
                  bytes={"recv_token_bytes": [120_000, 600], "out_bytes": [0, 0], "remote_bytes_in": [0, 0]},
                  ceiling_us={})
    rows = {row["op"]: row for row in summarize(record, link_gbps=0.0)}
    assert rows["dispatch"]["algo_gbps"] == pytest.approx(120_000 / 12e-6 / 1e9)
    assert rows["combine"]["algo_gbps"] == pytest.approx(120_000 / 24e-6 / 1e9)
    assert rows["roundtrip"]["algo_gbps"] is None
    # No rank receives anything: no rate (not a division by zero, nor 0 GB/s as if the op were slow).
    record["bytes"]["recv_token_bytes"] = [0, 0]
    assert all(row["algo_gbps"] is None for row in summarize(record, link_gbps=0.0))


def test_skewed_routing_is_skewed():
    shape = Shape(tokens=2048, hidden=8, topk=2, experts=16, payload="bf16", routing="skewed")
    routing_map, probs = make_routing(shape, 0, 0, torch.device("cpu"))
    per_expert = routing_map.sum(0)
    assert per_expert[:4].sum() > 4 * per_expert[-4:].sum()
    torch.testing.assert_close(probs.sum(1), torch.ones(2048))


def test_bench_rejects_unknown_axis_values_before_launching():
    for bad in (["--payloads", "fp16"], ["--modes", "async"], ["--backends", "nccl_magic"],
                ["--backends", "reference+in_place"], ["--backends", "reference+arena"],
                ["--backends", "reference+fast"], ["--experts", "10", "--ranks", "4"], ["--sms", "2000"],
                ["--link-gbps", "-1"], ["--link-gbps", "nan"]):
        result = subprocess.run([sys.executable, "-m", "ep_plugin.bench", "--device", "cpu", *bad],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "error:" in result.stderr, (bad, result.stderr[-500:])


def test_an_option_the_launcher_or_the_folder_cannot_take_is_refused_by_name():
    """--timeout inf passed the check and failed in the launcher with a traceback; --backends ',' was told that
    no backend can run on cpu (reference can); --out '' was called 'a file, not a folder'."""
    for bad, said in ((["--timeout", "inf"], "--timeout must be a finite, positive number of seconds, got inf"),
                      (["--backends", ","], "--backends ',' names no backend"),
                      (["--out", ""], "--out names no folder")):
        result = subprocess.run([sys.executable, "-m", "ep_plugin.bench", "--device", "cpu", *bad],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and said in result.stderr, (bad, result.stderr[-500:])


def test_an_axis_value_listed_twice_runs_once():
    """--tokens 16,16 ran every case twice, and compare then took the two as if they were rounds."""
    from ep_plugin.bench.__main__ import _ints, _words

    assert _ints("16,8,16") == (16, 8) and _words("reference, hybrid,reference") == ("reference", "hybrid")


def test_an_out_folder_that_cannot_be_made_is_refused_before_the_sweep(tmp_path):
    """It used to run the whole sweep, then fail making the folder, keeping nothing."""
    taken = tmp_path / "bench.json"
    taken.write_text("{}")
    for out in (taken, taken / "inside"):
        result = subprocess.run([sys.executable, "-m", "ep_plugin.bench", "--device", "cpu", "--out", str(out)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and f"{taken} is a file, not a folder" in result.stderr, result.stderr[-500:]


def _tiny_maps():
    """2 ranks, 4 experts (rank 0 owns 0-1, rank 1 owns 2-3), 3 tokens each."""
    first = torch.zeros(3, 4, dtype=torch.bool)
    first[0, [0, 2]] = True  # both ranks: one packet / one row to rank 1
    first[1, [2, 3]] = True  # rank 1 only: one packet, two rows to rank 1
    first[2, [1]] = True  # local only: nothing crosses
    second = torch.zeros(3, 4, dtype=torch.bool)
    second[0, [0, 1]] = True  # rank 0 only: one packet, two rows to rank 0
    second[1, [0, 3]] = True  # both ranks: one packet / one row to rank 0
    second[2, [0]] = True  # rank 0 only: one packet / one row
    return [first, second]


def test_wire_bytes_by_hand():
    """Each backend's own byte model (what the bench reports), on two tiny routing maps counted by hand."""
    from ep_plugin.backends.elastic import ElasticBackend
    from ep_plugin.backends.hybrid import HybridBackend
    from ep_plugin.backends.reference import ReferenceBackend

    maps, hidden, local, topk = _tiny_maps(), 256, 2, 2
    row = 2 * hidden
    fp8_row = hidden + hidden // 128 * 4

    def model(cls, row_bytes=row, with_probs=True, **options):
        return cls.wire_bytes(maps, 2, row_bytes=row_bytes, hidden=hidden, topk=topk, with_probs=with_probs,
                              **options)

    # hybrid: rank 0 sends 2 packets (tokens 0, 1), rank 1 sends 3; each packet carries L x (int32 + fp32).
    hybrid = model(HybridBackend, with_probs=False)
    assert hybrid["dispatch"] == [2 * (row + local * 8), 3 * (row + local * 8)]
    # combine goes back from the expert rank: rank 0 returns rank 1's 3 packets, rank 1 returns 2.
    assert hybrid["combine"] == [3 * row, 2 * row]
    assert model(HybridBackend)["combine"] == [3 * (row + local * 4), 2 * (row + local * 4)]
    assert model(HybridBackend, row_bytes=fp8_row)["dispatch"] == [2 * (fp8_row + 16), 3 * (fp8_row + 16)]
    # In place each source reads its tokens' remote expert rows where they lie: rank 1 serves rank 0's
    # 3 rows, rank 0 serves rank 1's 4; the routed-back probs still go once per packet.
    in_place = model(HybridBackend, with_probs=False, combine_in_place=True)
    assert in_place["combine"] == [4 * row, 3 * row]
    assert in_place["dispatch"] == hybrid["dispatch"] and in_place["out_rows"] == hybrid["out_rows"]
    assert model(HybridBackend, combine_in_place=True)["combine"] == [4 * row + 3 * local * 4, 3 * row + 2 * local * 4]
    # Output rows: one per (token, local expert) at each rank: rank 0 gets 2 + 4, rank 1 gets 3 + 1.
    assert hybrid["out_rows"] == [6, 4]
    # reference: one row per (token, remote expert): rank 0 sends 3 rows, rank 1 sends 4.
    reference = model(ReferenceBackend)
    assert reference["dispatch"] == [3 * (row + 4), 4 * (row + 4)]
    assert reference["combine"] == [4 * (row + 4), 3 * (row + 4)]
    assert model(ReferenceBackend, with_probs=False)["combine"] == [4 * row, 3 * row]
    # elastic: packets as hybrid, with a token index and k ids (+ k weights, + k offsets when expanded).
    elastic = model(ElasticBackend)
    assert elastic["dispatch"] == [2 * (row + 4 + 16), 3 * (row + 4 + 16)]
    assert elastic["combine"] == [3 * (row + 8), 2 * (row + 8)]
    assert model(ElasticBackend, with_probs=False, expand=True)["dispatch"] == [2 * (row + 4 + 16), 3 * (row + 20)]
    # Compact output: one row per packet (rank 0: 2 own + 3 from rank 1 ... counted per destination).
    packets_to = [sum(1 for m in maps for t in range(m.shape[0]) if m[t].view(2, local)[d].any()) for d in (0, 1)]
    assert elastic["out_rows"] == packets_to
    assert model(ElasticBackend, expand=True)["out_rows"] == hybrid["out_rows"]


def _per_gpu_record(**overrides):
    record = dict(backend="reference", mode="blocking", payload="bf16", tokens=4, hidden=8, topk=1, experts=2,
                  sms=None, routing="balanced", ranks=2, samples_us=[[[10.0, 20.0]], [[10.0, 20.0]]],
                  bytes={"recv_token_bytes": [1000, 2000], "out_bytes": [1000, 2000], "remote_bytes_in": [500, 1500]},
                  ceiling_us={}, one_gpu_per_rank=True,
                  link_bytes={"dispatch": [3000, 4000], "combine": [6000, 1000]},
                  link_floor_bytes={"dispatch": 2000, "combine": 1800})
    record.update(overrides)
    return record


def test_link_columns_and_ceiling_with_one_gpu_per_rank():
    rows = {row["op"]: row for row in summarize(_per_gpu_record(), link_gbps=1.0)}
    assert rows["dispatch"]["link_mb"] == 4000 / 1e6
    assert rows["dispatch"]["link_gbps"] == pytest.approx(4000 / 10e-6 / 1e9)
    assert rows["dispatch"]["link_pct"] == pytest.approx(rows["dispatch"]["link_gbps"] / 1.0 * 100)
    assert rows["combine"]["link_mb"] == 6000 / 1e6
    assert rows["roundtrip"]["link_mb"] == 9000 / 1e6  # the busiest rank over both ops, not a sum of maxima
    # The ceiling is the hybrid floor at line rate, for every backend.
    assert rows["dispatch"]["ceiling_us"] == pytest.approx(2000 / 1e9 * 1e6)
    assert rows["combine"]["ceiling_us"] == pytest.approx(1800 / 1e9 * 1e6)
    assert rows["roundtrip"]["ceiling_us"] == pytest.approx(3800 / 1e9 * 1e6)


def test_link_columns_are_blank_when_ranks_share_a_gpu():
    record = _per_gpu_record(one_gpu_per_rank=False, ceiling_us={"dispatch": 5.0, "combine": 6.0})
    rows = summarize(record, link_gbps=0.0)
    assert all(row["link_mb"] is None and row["link_gbps"] is None and row["link_pct"] is None for row in rows)
    assert rows[0]["ceiling_us"] == 5.0
    lines = format_table(rows).splitlines()
    assert lines[0].split()[-3:] == ["link_MB", "link_GB/s", "link%"]
    assert all(line.split()[-3:] == ["-", "-", "-"] for line in lines[1:])


def test_failed_graph_capture_summarizes_without_samples():
    record = _per_gpu_record(backend="hybrid", mode="nonblocking+graph", sms=8, samples_us=[[], []],
                             graph_error="rank 1: RuntimeError: capture refused")
    rows = summarize(record, link_gbps=1.0)
    assert all(row["algo_gbps"] is None and row["link_gbps"] is None and row["error"] for row in rows)
    assert "nonblocking+graph" in format_table(rows)


def test_a_case_that_failed_shows_no_figure_anywhere():
    """An error record's rows showed a median, GB/s and ceil/ours in the table and plots (only the JSON's error
    said otherwise), and an errored reference was a ratio's baseline."""
    bad = summarize(_per_gpu_record(backend="reference", mode="blocking", sms=None, error="rank 0: wrong rows"),
                    link_gbps=1.0)
    good = summarize(_per_gpu_record(backend="hybrid", mode="blocking", sms=8), link_gbps=1.0)
    assert all(row[key] is None for row in bad for key in ("median_us", "algo_gbps", "ceiling_ratio", "link_pct"))
    attach_reference_ratio(bad + good)
    assert all(row["reference_ratio"] is None for row in good)
    lines = format_table(bad + good).splitlines()
    assert all("FAILED" in line for line in lines[1:len(bad) + 1]) and "FAILED" not in "".join(lines[len(bad) + 1:])


def test_a_case_whose_ops_dropped_rows_is_an_error_row_that_compare_counts_as_missing(tmp_path, capsys):
    """The bench never asked a backend what its timed ops dropped (check_errors, over_budget): a kernel that
    lost rows read as faster. Such a case's rows now carry the error, and compare refuses to pass them."""
    from ep_plugin.bench import compare

    record = _per_gpu_record(backend="hybrid", mode="nonblocking", sms=8,
                             error="rank 1: rows past the non-blocking budget were dropped (over_budget)")
    rows = summarize(record, link_gbps=1.0)
    assert rows and all("over_budget" in row["error"] for row in rows)
    good = summarize({**record, "error": None}, link_gbps=1.0)
    paths = {}
    for name, summary in (("new", rows), ("base", good)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps({"summary": summary}))
    assert compare.main(["--new", str(paths["new"]), "--base", str(paths["base"])]) == 1
    assert "missing in new" in capsys.readouterr().out


class _RowLosingReference(ReferenceBackend):
    """A dispatch that hands an expert a zeroed row in place of a token (the combine then sums it too)."""

    def _dispatch(self, hidden, routing, probs, pad_multiple):
        out = super()._dispatch(hidden, routing, probs, pad_multiple)
        out.hidden[0] = 0
        return out


class _SegmentShiftingReference(ReferenceBackend):
    """A dispatch whose counts put expert 0's last row in expert 1's segment: the rows and the layout are
    right, so a round trip still comes back whole, but an expert computes on another expert's token."""

    def _dispatch(self, hidden, routing, probs, pad_multiple):
        out = super()._dispatch(hidden, routing, probs, pad_multiple)
        padded, real = out.handle.tokens_per_expert, out.handle.num_real_tokens_per_expert
        for counts in (padded,) if real is padded else (padded, real):
            counts[0] -= 1
            counts[1] += 1
        return out


class _ProbsDoublingReference(ReferenceBackend):
    """A dispatch whose rows are right but whose first row carries twice its prob (the expert would weigh it
    wrong; the round trip of the rows alone cannot see it)."""

    def _dispatch(self, hidden, routing, probs, pad_multiple):
        out = super()._dispatch(hidden, routing, probs, pad_multiple)
        out.probs[0] *= 2
        return out


class _HalvingReference(ReferenceBackend):
    """A combine that returns half of each sum."""

    def _combine(self, rows, handle, row_probs):
        combined = super()._combine(rows, handle, row_probs)
        return combined._replace(hidden=combined.hidden / 2)


class _TwoPercentLowReference(ReferenceBackend):
    """A combine that returns each sum x 0.98: within the old tolerance (1/32 of a value, + 0.01), so it got a
    figure; past any correct rounding (under 3 * 2**-8 of a value, bench/verify.py)."""

    def _combine(self, rows, handle, row_probs):
        combined = super()._combine(rows, handle, row_probs)
        return combined._replace(hidden=(combined.hidden.float() * 0.98).to(combined.hidden.dtype))


class _StaleLastTokenReference(ReferenceBackend):
    """A combine that writes into one buffer it keeps and, after its first call, skips the last token's sum (a
    kernel that skips a write): right whenever its input repeats the last call's, as the timed loop's do."""

    kept = None

    def _combine(self, rows, handle, row_probs):
        combined = super()._combine(rows, handle, row_probs)
        if self.kept is None or self.kept.shape != combined.hidden.shape:
            self.kept = combined.hidden.clone()
        else:
            self.kept[:-1] = combined.hidden[:-1]
        return combined._replace(hidden=self.kept)


class _StashingReference(ReferenceBackend):
    """A combine that reads the rows of its dispatch's output, kept from the dispatch, instead of its input (a
    kernel reading the receive buffer): right wherever the combine is given the dispatch output itself, as the
    timed loop's are."""

    def _dispatch(self, hidden, routing, probs, pad_multiple):
        out = super()._dispatch(hidden, routing, probs, pad_multiple)
        self.stash = out.hidden
        return out

    def _combine(self, rows, handle, row_probs):
        return super()._combine(self.stash, handle, row_probs)


class _InRowShiftingReference(ReferenceBackend):
    """A dispatch whose rows come out with their values moved by one column (a copy at a wrong offset), and a
    combine that moves them back (the same copy): every row sum, and the round trip, stay right."""

    def _dispatch(self, hidden, routing, probs, pad_multiple):
        out = super()._dispatch(hidden, routing, probs, pad_multiple)
        return out._replace(hidden=out.hidden.roll(1, dims=1))

    def _combine(self, rows, handle, row_probs):
        return super()._combine(rows.roll(-1, dims=1), handle, row_probs)


class _UncheckableOnRankOne(ReferenceBackend):
    """Rank 1's dispatch handle lists one expert count too few, so its own value check raises, after its
    dispatch and before the gather and the combine its peer runs."""

    def _dispatch(self, hidden, routing, probs, pad_multiple):
        out = super()._dispatch(hidden, routing, probs, pad_multiple)
        if self.rank == 1:
            out.handle.num_real_tokens_per_expert = out.handle.num_real_tokens_per_expert[:-1]
        return out


class _CheckedDispatchFailingOnRankOne(ReferenceBackend):
    """Rank 1's checked dispatch (``checking``: set around the bench's value check) raises after its exchange, as
    an allocation only that rank's counts could size would: its peer's went through."""

    checking = False

    def _dispatch(self, hidden, routing, probs, pad_multiple):
        out = super()._dispatch(hidden, routing, probs, pad_multiple)
        if self.rank == 1 and _CheckedDispatchFailingOnRankOne.checking:
            raise torch.cuda.OutOfMemoryError("no room for the checked dispatch's rows (planted)")
        return out


def _bench_with_a_failing_checked_dispatch(ctx, tokens: tuple):
    from ep_plugin.bench import runner

    verify = runner._Calls.verify

    def flagged(self, *args, **kwargs):
        _CheckedDispatchFailingOnRankOne.checking = True
        try:
            return verify(self, *args, **kwargs)
        finally:
            _CheckedDispatchFailingOnRankOne.checking = False

    runner._Calls.verify = flagged
    return _bench_broken(ctx, _CheckedDispatchFailingOnRankOne, 0, tokens)


def _bench_broken(ctx, backend_class, scaleup: int, tokens: tuple = (32,)):
    ep_plugin.register_backend("broken", backend_class, overwrite=True)
    spec = SweepSpec(backends=("broken",), tokens=tokens, hidden=(64,), topk=(2,), experts=(8,), payloads=("bf16",),
                     sms=(4,), routings=("balanced",), modes=("blocking",), warmup=1, iters=1,
                     scaleup_sizes=(scaleup,), extra_config={"timeout_s": 20.0})
    return bench_rank(ctx, spec)


def test_a_rank_whose_own_value_check_fails_keeps_the_collectives_in_step():
    """The check is collective (the dispatch, one gather, the combine): a rank whose own part raised used to skip
    the rest, so its next collective met its peer's previous one (a hang, or the gathers shifted by one). It
    now runs them all and says why it could not check; the next case runs as usual."""
    first, second = run_ranks(_bench_broken, 2, _UncheckableOnRankOne, 0, (32, 48), timeout_s=120)[0]
    for record in (first, second):
        assert record["error"].startswith("rank 1: checking the values (the received rows): ValueError"), record
        assert "rank 0" not in record["error"], record


def test_a_checked_dispatch_failing_on_one_rank_keeps_the_collectives_in_step():
    """The checked dispatch raised on one rank only (its peers' went through): that rank skipped the check's
    gather and met its peers there with the case's next collective, a hang or crossed records. Every rank now
    learns it in the gather, none combines, and the next case runs as usual."""
    first, second = run_ranks(_bench_with_a_failing_checked_dispatch, 2, (32, 48), timeout_s=120)[0]
    for record in (first, second):
        assert record["error"] == "rank 1: the checked dispatch raised OutOfMemoryError: no room for the checked " \
                                  "dispatch's rows (planted)", record["error"]
        assert record["samples_us"] and all(record["samples_us"]), record  # the timed loop ran before


@pytest.mark.parametrize("backend_class, words", [
    (_RowLosingReference, "the wrong rows"),
    (_SegmentShiftingReference, "rows, the sources routed"),
    (_HalvingReference, "combine of the dispatched rows is wrong"),
    (_TwoPercentLowReference, "combine of the dispatched rows is wrong"),
    (_ProbsDoublingReference, "the wrong probs"),
    (_StaleLastTokenReference, "combine of the dispatched rows is wrong"),  # passed on the timed loop's values
    (_StashingReference, "combine of the dispatched rows is wrong"),  # passed: combine's input was that output
    (_InRowShiftingReference, "the wrong rows"),  # passed: a plain row sum does not see values move in a row
])
@pytest.mark.parametrize("scaleup", [0, 1])  # flat; and across two domains (a domain backend per rank)
def test_a_case_whose_ops_moved_wrong_values_is_an_error_row(backend_class, words, scaleup):
    """The bench timed what the kernels did without asking whether it was right: a fast wrong kernel read as a
    win. Each case now ends with one checked dispatch and combine (bench/verify.py); a backend that loses a
    row, shifts a segment's boundary, hands a row the wrong prob or sums wrong (2% low too) gives an error record
    (no figure) naming what went wrong."""
    [record] = run_ranks(_bench_broken, 2, backend_class, scaleup)[0]
    assert record["error"] and words in record["error"], record["error"]
    [healthy] = run_ranks(_bench_broken, 2, ReferenceBackend, scaleup)[0]
    assert healthy["error"] is None and healthy["domains"] == ("2x1" if scaleup else "1x2")


def test_a_tight_budget_holds_the_padding_and_never_passes_the_worst_case():
    """The non-blocking budget rounds the busiest rank's rows up to 4096s: it left out the experts' padding (a
    false "rows dropped" with EP_PLUGIN_PAD_MULTIPLE set), and past the worst case it did not fit the arena
    that hybrid+in_place sizes to it (decode at 2 ranks: combine_input refused the budget mid-case)."""
    from ep_plugin.backends.compiled import worst_case_rows
    from ep_plugin.bench.runner import _busiest_rank_rows, _tight_budget

    decode = Shape(128, 7168, 8, 256, "bf16", "balanced")
    worst = worst_case_rows(2, 128, 128, 8)
    assert _tight_budget(decode, 2, 0) > worst  # the rounding alone overshoots here
    assert _tight_budget(decode, 2, 0, most_rows=worst) == worst
    standard = Shape(4096, 7168, 8, 256, "bf16", "balanced")
    rows, padding = _busiest_rank_rows(standard, 8, 0), 32 * (4096 - 1)
    assert _tight_budget(standard, 8, 0) > rows
    assert _tight_budget(standard, 8, 0, pad_multiple=4096) > rows + padding


def test_in_place_options_hold_the_padded_worst_case():
    """hybrid's arena from in_place_options left out the experts' padding: with EP_PLUGIN_PAD_MULTIPLE set, the
    bench's padded budget (and any padded dispatch near the worst case) did not fit it."""
    from ep_plugin.backends.compiled import worst_case_rows
    from ep_plugin.backends.hybrid import HybridBackend

    shape = dict(num_ranks=8, max_tokens_per_rank=128, num_experts=256, topk=8)
    for pad in (1, 128):
        rows = HybridBackend.in_place_options(**shape, pad_multiple=pad)["combine_input_rows"]
        assert rows == worst_case_rows(8, 128, 32, 8, pad), (pad, rows)
    assert HybridBackend.in_place_options(**shape)["combine_input_rows"] == worst_case_rows(8, 128, 32, 8)
    for bad in (0, -3, 2.0, 10**9):  # a padding a dispatch refuses sizes no arena either (0 sized it too small)
        with pytest.raises(ValueError, match="pad_multiple must be an int"):
            HybridBackend.in_place_options(**shape, pad_multiple=bad)


def test_bench_json_is_strict_json(tmp_path):
    """A case without samples has a NaN median; bench.json had it as a bare NaN, which jq and JavaScript refuse.
    (A failed case's figures are None anyway.)"""
    from ep_plugin.bench.report import write_json

    record = _per_gpu_record(backend="hybrid", mode="nonblocking+graph", sms=8, samples_us=[[], []])
    rows = summarize(record, link_gbps=1.0)
    assert any(isinstance(v, float) and v != v for row in rows for v in row.values())  # a NaN to write
    path = tmp_path / "bench.json"
    write_json(str(path), {"device": "cuda"}, [record], rows, ["--graph"])

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    report = json.loads(path.read_text(), parse_constant=refuse)
    assert report["summary"][0]["median_us"] is None


def test_sms_plot_draws_the_reference_as_levels(tmp_path):
    base = dict(mode="blocking", payload="bf16", tokens=64, hidden=8, routing="balanced", op="dispatch", topk=2,
                experts=8)
    rows = [dict(base, backend="hybrid", sms=8, algo_gbps=10.0), dict(base, backend="hybrid", sms=16, algo_gbps=20.0),
            dict(base, backend="reference", sms=None, algo_gbps=5.0),
            dict(base, backend="reference", sms=None, algo_gbps=7.0, tokens=128)]  # no hybrid line at 128 tokens
    written = write_plots(str(tmp_path), rows)
    assert str(tmp_path / "gbps_vs_sms.png") in written
    # A run of one token count draws no token plot: an earlier run's left the folder, where it stood next to
    # this run's bench.json as if it were this run's.
    again = tmp_path / "again"
    again.mkdir()
    (again / "gbps_vs_tokens.png").write_bytes(b"an earlier run's plot")
    assert write_plots(str(again), rows[:3]) == [str(again / "gbps_vs_sms.png")]
    assert not (again / "gbps_vs_tokens.png").exists()
    levels = _reference_levels(rows, {("hybrid", "blocking", "bf16", "dispatch", "balanced", 8, 64, 2, 8): {}})
    assert list(levels.values()) == [5.0]
    # Another top-k is another line, not points written over the first one's.
    rows += [dict(row, topk=1, algo_gbps=row["algo_gbps"] + 1) for row in rows]
    lines = _series(rows, "sms")
    assert sorted(lines.values(), key=str) == [{8: 10.0, 16: 20.0}, {8: 11.0, 16: 21.0}], lines
    # ... and the table names both: rows of two top-k values are told apart.
    table = format_table(summarize(_per_gpu_record(), link_gbps=1.0))
    header, first = (line.split() for line in table.splitlines()[:2])
    assert header[5:7] == ["topk", "experts"] and first[5:7] == ["1", "2"], (header, first)


def _run_main(tmp_path, capsys, *extra):
    out = tmp_path / "bench"
    argv = ["--device", "cpu", "--ranks", "2", "--backends", "reference", "--tokens", "16", "--hidden", "64",
            "--experts", "8", "--topk", "2", "--payloads", "bf16", "--sms", "4", "--routings", "balanced",
            "--iters", "4", "--warmup", "2", "--out", str(out), *extra]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    return json.loads((out / "bench.json").read_text()), stdout


def _bench_rank_with_a_halving_reference(ctx, spec):
    from ep_plugin.bench.runner import bench_rank as real

    ep_plugin.register_backend("reference", _HalvingReference, overwrite=True)
    return real(ctx, spec)


def test_a_sweep_with_a_failed_case_exits_1(tmp_path, capsys, monkeypatch):
    """The bench exited 0 with FAILED rows: scripts/gpu_validate.sh's value check of every compiled form (its
    pending stage) came out green whatever the check found."""
    from ep_plugin.bench import __main__ as bench_main

    monkeypatch.setattr(bench_main, "bench_rank", _bench_rank_with_a_halving_reference)
    argv = ["--device", "cpu", "--ranks", "2", "--backends", "reference", "--tokens", "16", "--hidden", "64",
            "--experts", "8", "--topk", "2", "--routings", "balanced", "--modes", "blocking", "--iters", "2",
            "--warmup", "1", "--out", str(tmp_path / "bench")]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "1 case(s) FAILED" in captured.err and "FAILED" in captured.out.splitlines()[-1], captured
    # Not "this sweep has one token count": a failed case has no figure whatever the axes.
    assert "plots: none written (every case FAILED: no figure to draw)" in captured.out, captured.out
    from ep_plugin.bench.__main__ import _why_no_plots

    why = _why_no_plots([{"error": None}, {"error": "wrong rows"}])
    assert why.endswith("the cases that ran have one among those that did not fail"), why


def test_back_to_back_timing_through_main(tmp_path, capsys):
    report, stdout = _run_main(tmp_path, capsys, "--modes", "blocking")
    assert report["environment"]["timing"] == "one barrier, then back to back"
    # gloo: the reference defaults to 3 timed iterations (it goes through host memory).
    assert report["environment"]["reference"] == {"max_tokens": 4096, "iters": 3}
    [record] = report["records"]
    assert len(record["samples_us"]) == 2 and all(len(s) == 3 for s in record["samples_us"])
    assert all(t > 0 for samples in record["samples_us"] for sample in samples for t in sample)
    assert record["one_gpu_per_rank"] is False and record["link_bytes"]["dispatch"][0] > 0
    assert len(record["step_us"]) == 2 and all(t > 0 for t in record["step_us"])  # a loop's µs per rank
    assert " step " in stdout.strip().splitlines()[-1]  # the table ends the output, the step row last


def test_all_to_all_baseline_moves_compact_rows(tmp_path, capsys):
    """The all_to_all baseline: blocking rows per payload, its bytes one row per (token, destination
    rank) (counted here from the routing itself), and no ratio between the two baselines."""
    from ep_plugin.bench.workload import make_topk

    report, stdout = _run_main(tmp_path, capsys, "--modes", "blocking,nonblocking", "--backends",
                               "reference,all_to_all", "--payloads", "bf16,fp8", "--hidden", "256")
    baseline = [row for row in report["summary"] if row["backend"] == "all_to_all"]
    assert {(row["payload"], row["op"]) for row in baseline} == {
        (payload, op) for payload in ("bf16", "fp8") for op in ("dispatch", "combine", "roundtrip", "step")}
    assert all(row["mode"] == "blocking" and row["sms"] is None and row["median_us"] > 0 for row in baseline)
    records = {record["payload"]: record for record in report["records"] if record["backend"] == "all_to_all"}
    # 8 experts over 2 ranks: rank d holds experts 4d..4d+3; a token goes once to every rank it names.
    shape = Shape(16, 256, 2, 8, "bf16", "balanced")
    reaches = [[{int(e) // 4 for e in row} for row in make_topk(shape, rank, 0, torch.device("cpu"))[0]]
               for rank in range(2)]
    to_other = [sum(1 - rank in ranks for ranks in reaches[rank]) for rank in range(2)]
    for payload, row_bytes in (("bf16", 2 * 256), ("fp8", 256 + 2 * 4)):  # fp8: one fp32 scale per 128
        assert records[payload]["link_bytes"]["dispatch"] == [n * row_bytes for n in to_other]
        assert records[payload]["link_bytes"]["combine"] == [to_other[1 - rank] * 2 * 256 for rank in range(2)]
    assert all(row["all_to_all_ratio"] is None and row["reference_ratio"] is None for row in report["summary"])
    assert "a2a/ours" in stdout


def test_a_baseline_row_gets_no_ratio_against_the_other_baseline():
    """all_to_all rows got a ref/ours and reference rows an a2a/ours: baselines over each other, not ours. Ours
    gets both; the reference across domains keeps its ratio to the flat reference (what the split costs)."""
    from ep_plugin.bench.report import attach_all_to_all_ratio

    def row(backend, median_us):
        return dict(backend=backend, median_us=median_us, tokens=16, hidden=64, topk=2, experts=8,
                    routing="balanced", payload="bf16", op="dispatch")

    rows = [row("reference", 80.0), row("reference 2x1", 100.0), row("all_to_all", 20.0), row("hybrid", 10.0)]
    attach_reference_ratio(rows)
    attach_all_to_all_ratio(rows)
    ratios = {r["backend"]: (r["reference_ratio"], r["all_to_all_ratio"]) for r in rows}
    assert ratios == {"reference": (None, None), "reference 2x1": (0.8, None), "all_to_all": (None, None),
                      "hybrid": (8.0, 2.0)}


def test_sync_each_iter_and_explicit_reference_iters(tmp_path, capsys):
    report, _ = _run_main(tmp_path, capsys, "--modes", "blocking", "--sync-each-iter", "--reference-iters", "4")
    assert report["environment"]["timing"] == "barrier before every iteration"
    assert all(len(s) == 4 for s in report["records"][0]["samples_us"])


def test_graph_flag_on_cpu_is_accepted_and_not_applied(tmp_path, capsys):
    report, _ = _run_main(tmp_path, capsys, "--modes", "blocking,nonblocking", "--graph")
    assert report["environment"]["graph"] == "not applied (CPU)"
    assert [record["mode"] for record in report["records"]] == ["blocking"]  # reference has no non-blocking mode


def _graph_options(**overrides):
    import argparse

    values = dict(graph=True, device="cuda", modes="nonblocking", payloads="bf16", backends="hybrid",
                  scaleup_size="0", ranks=8)
    return argparse.Namespace(**{**values, **overrides})


def test_graph_with_no_case_to_capture_is_refused(monkeypatch, capsys):
    """--graph on CUDA ran with no graph row (blocking modes only, no graph-capable backend, every layout split
    into domains) while bench.json said graphs applied: refused before the sweep, in one line."""
    from types import SimpleNamespace

    from ep_plugin.backends.base import Capabilities
    from ep_plugin.bench.__main__ import graph_problem

    def backend(**capabilities):
        return SimpleNamespace(capabilities=Capabilities(devices=("cuda",), hidden_dtypes=(), probs_dtypes=(),
                                                         **capabilities))

    classes = {"hybrid": backend(non_blocking=True, cuda_graphs=True), "reference": backend()}
    assert graph_problem(_graph_options(), classes, 0) is None
    assert graph_problem(_graph_options(scaleup_size="8,4"), classes, 0) is None  # the 1x8 run is captured
    assert graph_problem(_graph_options(device="cpu", modes="blocking"), classes, 0) is None  # ignored on CPU
    assert "add nonblocking to --modes" in graph_problem(_graph_options(modes="blocking"), classes, 0)
    for backends in ("reference,all_to_all", "hybrid+arena"):
        assert "none of --backends" in graph_problem(_graph_options(backends=backends), classes, 0)
    assert "none of" in graph_problem(_graph_options(payloads="fp8"), classes, 0)  # no fp8 dispatch here
    assert "across domains" in graph_problem(_graph_options(scaleup_size="4,2"), classes, 0)
    assert "EP_PLUGIN_SCALEUP_SIZE=4" in graph_problem(_graph_options(), classes, 4)
    # Through the command line, as every other option error: one line, exit status 2, nothing started.
    monkeypatch.setattr("ep_plugin.cli.gpu_count", lambda: 1)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--device", "cuda", "--backends", "reference", "--modes", "blocking,nonblocking", "--graph",
                    "--tokens", "16", "--hidden", "64", "--experts", "8", "--topk", "2", "--payloads", "bf16"])
    assert exit_info.value.code == 2
    assert "--graph: none of --backends reference" in capsys.readouterr().err


def test_the_environment_says_how_many_cases_graphs_captured():
    from ep_plugin.bench.__main__ import _graph_note

    assert _graph_note(_graph_options(graph=False), []) == "off"
    assert _graph_note(_graph_options(device="cpu"), []) == "not applied (CPU)"
    assert _graph_note(_graph_options(), [{"mode": "nonblocking"}]).startswith("no case captured")
    assert _graph_note(_graph_options(), [{"mode": "nonblocking"}, {"mode": "nonblocking+graph"}]).startswith(
        "1 case(s) as nonblocking+graph")
    failed = {"mode": "nonblocking+graph", "graph_error": "RuntimeError: capture failed"}  # recorded, not captured
    assert _graph_note(_graph_options(), [failed]).startswith("no case captured")
    assert _graph_note(_graph_options(), [failed, {"mode": "nonblocking+graph"}]).startswith("1 case(s)")


def test_nvlink_preset_and_reference_defaults(monkeypatch):
    monkeypatch.setattr("ep_plugin.cli.gpu_count", lambda: 1)  # the GPU presets are for --device cuda
    args = parse_args(["--preset", "nvlink", "--device", "cuda"])
    assert args.ranks == 2 and args.tokens == "128,1024,4096,8192" and args.hidden == "7168"
    assert args.sms == "8,16,24" and args.payloads == "bf16,fp8" and args.modes == "blocking"
    assert args.backends.split(",")[-1] == "all_to_all"  # the baseline for a2a/ours, after what runs here
    assert "all_to_all" not in parse_args(["--device", "cpu"]).backends
    assert reference_limits(args, plan_launch(2, "cuda", 2)) == (0, args.iters)  # never skipped
    assert parse_args(["--device", "cuda", "--preset", "full"]).ranks == 8
    assert parse_args(["--device", "cpu"]).ranks == 4  # the cpu preset, the default without a GPU
    cpu = parse_args(["--device", "cpu"])
    assert (cpu.warmup, cpu.iters) == (3, 10)
    # Decode steps are short: the preset takes more samples of them.
    decode = parse_args(["--device", "cuda", "--preset", "decode"])
    assert (decode.warmup, decode.iters) == (50, 200)
    assert parse_args(["--device", "cuda", "--preset", "decode", "--iters", "5"]).iters == 5  # explicit wins
    default = parse_args(["--device", "cpu", "--iters", "7"])
    assert reference_limits(default, plan_launch(2, "cuda", 2)) == (0, 7)  # NCCL: a real baseline
    assert reference_limits(default, plan_launch(8, "cuda", 1)) == (4096, 3)  # gloo + MPS: through the host
    explicit = parse_args(["--device", "cpu", "--reference-max-tokens", "1024", "--reference-iters", "2"])
    assert reference_limits(explicit, plan_launch(2, "cuda", 2)) == (1024, 2)


def capture_refused_on_rank_1(ctx):
    """Rank 1's capture raises, rank 0's 'succeeds': neither may replay (rank 0's fake graphs cannot)."""
    from ep_plugin.bench import runner

    def capture(calls, side):
        if ctx.rank == 1:
            raise RuntimeError("capture refused")
        return object(), object()

    runner._warm_up_for_capture = lambda calls, warmup, device: None
    runner._capture_graphs = capture
    backend = ep_plugin.get_backend("reference")(hidden_size=64, num_experts=8, device="cpu")
    spec = SweepSpec(backends=("reference",), tokens=(8,), hidden=(64,), topk=(2,), experts=(8,), payloads=("bf16",),
                     sms=(4,), routings=("balanced",), modes=("nonblocking",), graph=True)
    shape = Shape(tokens=8, hidden=64, topk=2, experts=8, payload="bf16", routing="balanced")
    return runner._time_graph_replays(ctx, spec, backend, shape, torch.device("cpu"))


def all_to_all_problems(ctx):
    from ep_plugin.bench import runner

    return [runner._all_to_all_problem(torch.device(kind)) for kind in ("cpu", "cuda")]


def test_all_to_all_baseline_is_skipped_where_gloo_carries_cuda_tensors():
    """Ranks sharing a GPU talk over gloo (through host memory): no baseline there; on CPU it runs."""
    [(on_cpu, on_cuda)] = run_ranks(all_to_all_problems, 1, timeout_s=120)
    assert on_cpu == "" and "gloo" in on_cuda


def test_a_capture_failure_on_one_rank_stops_every_rank():
    results = run_ranks(capture_refused_on_rank_1, 2, timeout_s=120)
    assert results == [([], None, "rank 1: RuntimeError: capture refused")] * 2


def test_scaleup_size_from_the_environment(tmp_path, capsys, monkeypatch):
    """EP_PLUGIN_SCALEUP_SIZE forces domains in the bench as everywhere (--scaleup-size 0 = not forced here),
    but not on the reference's baseline run: that one was split too ("reference 2x1"), and no row had a
    "reference" to take ref/ours from."""
    monkeypatch.setenv("EP_PLUGIN_SCALEUP_SIZE", "1")
    report, _ = _run_main(tmp_path, capsys, "--modes", "blocking")
    assert [record["domains"] for record in report["records"]] == ["1x2", "2x1"]
    assert [bool(record.get("scaleout_bytes")) for record in report["records"]] == [False, True]
    split = [row for row in report["summary"] if row["backend"] == "reference 2x1"]
    assert split and all(row["reference_ratio"] for row in split), split  # against the flat run
    # The link byte model and floor are one flat domain's: none for the split (they repeated the flat ones).
    flat, across = report["records"]
    assert flat["link_bytes"] and flat["link_floor_bytes"], flat
    assert across["link_bytes"] is None and across["link_floor_bytes"] is None, across
    # One GPU per rank (no copy ceiling timed): a link ceiling for the flat run only.
    from ep_plugin.bench.report import _link_ceiling_us
    assert _link_ceiling_us(flat, "dispatch", 478.0) > 0
    assert _link_ceiling_us(across, "dispatch", 478.0) is None


def test_scaleout_bytes_and_the_scaleup_option():
    import torch

    from ep_plugin.backends.hierarchical import scaleout_bytes
    from ep_plugin.bench.report import _scaleout_columns
    from ep_plugin.topology import Topology

    # 4 ranks as 2 domains of 2, 8 experts (4 per domain). Rank 0's tokens: one to domain 0 only, one to
    # both domains, one to domain 1 only: two cross the rail. Rank 3 sends one token to domain 0.
    maps = [torch.zeros(3, 8, dtype=torch.bool) for _ in range(4)]
    maps[0][0, 1] = maps[0][1, 2] = maps[0][1, 6] = maps[0][2, 7] = True
    maps[3] = torch.zeros(1, 8, dtype=torch.bool)
    maps[3][0, 0] = True
    sent = scaleout_bytes(maps, Topology(4, 2), row_bytes=100, hidden=10, with_probs=False)
    assert sent["dispatch"] == [2 * (100 + 4), 0, 0, 1 * (100 + 4)]
    assert sent["combine"] == [2 * 20, 0, 0, 20]
    row = _scaleout_columns({"domains": "2x2", "scaleout_bytes": sent}, "dispatch", 1.0)
    assert row["domains"] == "2x2" and row["scaleout_mb"] == 208 / 1e6
    assert parse_args(["--device", "cpu", "--ranks", "4", "--scaleup-size", "4,2"]).scaleup_size == "4,2"
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--ranks", "4", "--scaleup-size", "3"])


def _rail_bytes_against_the_model(ctx, blocking: bool, form: str, max_tokens: int) -> tuple:
    """(bytes this rank's dispatch and combine sent over the rail, counted in ScaleOut.exchange_rows, which runs
    as always; the backend's model of each), 2 domains of 1 rank."""
    from ep_plugin.bench.workload import make_routing, make_topk
    from ep_plugin.topology import Topology
    from ep_plugin.transport import scaleout

    sent = [0]
    exchange_rows = scaleout.ScaleOut.exchange_rows

    def counted(self, rows, splits, **options):
        own = self.topology.domain_index
        sent[0] += sum(n for d, n in enumerate(splits.send) if d != own) * rows.shape[1] * rows.element_size()
        return exchange_rows(self, rows, splits, **options)

    scaleout.ScaleOut.exchange_rows = counted
    shape = Shape(48, 64, 4, 8, "bf16", "balanced")
    config = ep_plugin.Config.from_env(blocking=blocking, max_tokens_per_rank=max_tokens)
    backend = ep_plugin.get_backend("reference")(hidden_size=64, num_experts=8, device="cpu", config=config,
                                                 topology=Topology(2, 1, ctx.rank))
    cpu = torch.device("cpu")
    x = torch.randn(48, 64).to(torch.bfloat16)
    if form == "map":
        routing = dict(zip(("routing_map", "probs"), make_routing(shape, ctx.rank, 0, cpu), strict=True))
    else:
        routing = dict(zip(("topk_idx", "topk_weights"), make_topk(shape, ctx.rank, 0, cpu), strict=True))
    out = backend.dispatch(x, **routing)
    dispatched, sent[0] = sent[0], 0
    backend.combine(out.hidden, out.handle)
    maps = [make_routing(shape, rank, 0, cpu)[0] for rank in range(2)]
    topk = shape.topk if form == "topk" else 0
    model = [backend.scaleout_bytes(maps, row_bytes=shape.row_bytes(), with_probs=probs, topk=topk)
             for probs in (True, False)]
    return dispatched, model[0]["dispatch"][ctx.rank], sent[0], model[1]["combine"][ctx.rank]


@pytest.mark.parametrize("blocking,form,max_tokens", [(True, "map", 48), (True, "topk", 48), (False, "map", 48),
                                                      (False, "map", 512)])
def test_the_rail_byte_model_is_what_the_rails_move(blocking, form, max_tokens):
    """The model counted blocking mode's exact rows and routing-map columns for every case: sync-free mode
    moves blocks of max_tokens_per_rank rows (the bench builds with the sweep's largest token count: 32x off
    at 128 of 4096), and top-k ids travel as 12k bytes, not G + 4G."""
    for rank, (dispatched, modelled, combined, modelled_back) in enumerate(
            run_ranks(_rail_bytes_against_the_model, 2, blocking, form, max_tokens, timeout_s=120)):
        assert (dispatched, combined) == (modelled, modelled_back), (rank, dispatched, modelled, combined,
                                                                     modelled_back)


def test_compare_flags_the_slower_case_only(tmp_path, capsys):
    """A real CPU run as the base; the new side is that run with one case 20% slower (and, in a second
    file, 50% faster: the median of the two files' figures decides), plus a case base lacks."""
    from ep_plugin.bench import compare

    report, _ = _run_main(tmp_path, capsys, "--modes", "blocking")
    base = tmp_path / "base.json"
    base.write_text(json.dumps(report))
    assert compare.main(["--new", str(base), "--base", str(base)]) == 0
    same = capsys.readouterr().out
    assert "0 slower" in same and "geomean new/base roundtrip: 1.000" in same

    def variant(name, scale):
        copy = json.loads(json.dumps(report))
        copy["summary"][0]["median_us"] *= scale
        copy["summary"].append({**copy["summary"][1], "tokens": 999})
        path = tmp_path / name
        path.write_text(json.dumps(copy))
        return str(path)

    slower_twice = [variant("new_1.json", 1.2), variant("new_2.json", 1.3), variant("new_3.json", 0.5)]
    assert compare.main(["--new", *slower_twice, "--base", str(base)]) == 1
    out = capsys.readouterr().out
    flagged = [line for line in out.splitlines() if line.endswith("SLOWER")]
    first = report["summary"][0]
    assert len(flagged) == 1 and flagged[0].startswith("   1.200") and first["op"] in flagged[0], out
    assert "only in new" in out and "T=999" in out and "1 slower than base by more than 5%" in out
    # Allowing 25% it passes; a 20% slower case is then within bounds.
    assert compare.main(["--new", *slower_twice, "--base", str(base), "--worse", "0.25"]) == 0
    capsys.readouterr()
    # As many files on each side: the geomeans round by round (round 1 has the 1.2 case, round 2 not).
    assert compare.main(["--new", slower_twice[0], str(base), "--base", str(base), str(base), "--ops",
                         first["op"]]) == 1
    out = capsys.readouterr().out
    cases = sum(1 for row in report["summary"] if row["op"] == first["op"] and row.get("median_us"))
    assert f"round 1: {first['op']} {1.2 ** (1 / cases):.3f}" in out and f"round 2: {first['op']} 1.000" in out, out
    # gpu_ab.sh's files pair by their round number, in whatever order the shell listed them (by position
    # the new side's round 3 met the base side's round 1).
    renamed = {}
    for name, source in (("new_3.json", base), ("new_1.json", slower_twice[0]), ("base_1.json", base),
                         ("base_3.json", base)):
        renamed[name] = tmp_path / "rounds" / name
        renamed[name].parent.mkdir(exist_ok=True)
        renamed[name].write_text(pathlib.Path(source).read_text())
    compare.main(["--new", str(renamed["new_3.json"]), str(renamed["new_1.json"]), "--base",
                  str(renamed["base_1.json"]), str(renamed["base_3.json"]), "--ops", first["op"]])
    out = capsys.readouterr().out
    assert f"round 1: {first['op']} {1.2 ** (1 / cases):.3f}" in out and f"round 3: {first['op']} 1.000" in out, out
    # Files that are no bench.json, and a threshold that is no fraction: one line (exit status 2), no traceback.
    (tmp_path / "other.json").write_text("[1, 2]")
    for argv, message in ((["--new", str(tmp_path / "missing.json")], "cannot read a bench.json"),
                          (["--new", str(tmp_path / "other.json")], "no 'summary' list"),
                          (["--new", str(base), "--worse", "-0.1"], "--worse is a fraction")):
        with pytest.raises(SystemExit) as stop:
            compare.main([*argv, "--base", str(base)])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)
        assert err.startswith("python -m ep_plugin.bench.compare: error:"), err  # how it is run, no usage block
    # A base run from before the bench reported domains (its rows have no "domains") is one domain.
    old = json.loads(json.dumps(report))
    for row in old["summary"]:
        row.pop("domains")
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert compare.main(["--new", str(base), "--base", str(tmp_path / "old.json")]) == 0
    assert f"{len(report['summary'])} cases compared" in capsys.readouterr().out
    # --ops roundtrip judges the round trips only: the slower case above is a per-op row; gzipped files read.
    import gzip

    zipped = tmp_path / "new_1.json.gz"
    with gzip.open(zipped, "wt") as f:
        f.write((tmp_path / "new_1.json").read_text())
    assert compare.main(["--new", str(zipped), "--base", str(base), "--ops", "roundtrip"]) == 0
    out = capsys.readouterr().out
    assert "1 cases compared, 0 slower" in out and "geomean new/base roundtrip" in out and " dispatch" not in out
    with pytest.raises(SystemExit) as stop:
        compare.main(["--new", str(base), "--base", str(base), "--ops", "roundtrip,total"])
    assert stop.value.code == 2 and "--ops takes" in capsys.readouterr().err


def test_a_reference_skipped_for_its_token_limit_says_so(tmp_path, capfd):
    """'no case ran (every one was skipped, see above)' must have a line above that says why."""
    argv = ["--device", "cpu", "--ranks", "2", "--backends", "reference", "--tokens", "64", "--hidden", "64",
            "--experts", "8", "--topk", "2", "--routings", "balanced", "--reference-max-tokens", "32",
            "--out", str(tmp_path / "bench")]
    assert main(argv) == 1
    output = capfd.readouterr()
    assert "skipped reference at 64 tokens per rank: above --reference-max-tokens 32" in output.out, output


def test_compare_fails_when_new_lost_a_case_or_nothing_matched(tmp_path, capsys):
    """A case base ran that new failed (an error row) or did not run is a regression (it passed, listed as
    'only in base', which scripts/gpu_ab.sh filters out); so is a comparison with no case on both sides."""
    from ep_plugin.bench import compare

    report, _ = _run_main(tmp_path, capsys, "--modes", "blocking")
    base = tmp_path / "base.json"
    base.write_text(json.dumps(report))

    def new_side(name, change):
        copy = json.loads(json.dumps(report))
        change(copy["summary"])
        path = tmp_path / name
        path.write_text(json.dumps(copy))
        return str(path)

    lost = new_side("lost.json", lambda rows: rows.pop(0))
    failed = new_side("failed.json", lambda rows: rows[0].update(error="graph capture failed", median_us=None))
    for new in (lost, failed):
        assert compare.main(["--new", new, "--base", str(base)]) == 1
        out = capsys.readouterr().out
        assert "missing in new (failed or not run)" in out and "1 missing in new" in out, out
        assert compare.main(["--new", new, "--base", str(base), "--allow-missing"]) == 0
        capsys.readouterr()
    # A case that failed in one round of two: the passing round's median alone hid it (0 slower, exit 0).
    assert compare.main(["--new", failed, str(base), "--base", str(base)]) == 1
    out = capsys.readouterr().out
    assert "failed or not run in 1 of 2 new file(s)" in out, out
    assert compare.main(["--new", failed, str(base), "--base", str(base), "--allow-missing"]) == 0
    capsys.readouterr()
    # Runs timed on another GPU kind, or another way, are not compared unless asked (0.7 read as a speed-up).
    elsewhere_timed = json.loads(json.dumps(report))
    elsewhere_timed["environment"].update(gpu="NVIDIA H100 80GB HBM3", timing="barrier before every iteration")
    other = tmp_path / "other_gpu.json"
    other.write_text(json.dumps(elsewhere_timed))
    assert compare.main(["--new", str(other), "--base", str(base)]) == 1
    out = capsys.readouterr().out
    assert "timed unlike: gpu: NVIDIA H100 80GB HBM3 (new) vs None (base)" in out and "timing:" in out, out
    assert compare.main(["--new", str(other), "--base", str(base), "--allow-env-diff"]) == 0
    capsys.readouterr()
    elsewhere = new_side("elsewhere.json", lambda rows: [row.update(tokens=row["tokens"] + 1) for row in rows])
    assert compare.main(["--new", elsewhere, "--base", str(base), "--allow-missing"]) == 1
    assert "no case is on both sides" in capsys.readouterr().out


def test_the_mps_share_is_recorded_in_one_spelling():
    """compare tells runs apart by the recorded text: "50" and "50.0" are one share, and 100 is the whole GPU."""
    from ep_plugin.bench.__main__ import _mps_share

    def share(text: str) -> str:
        return _mps_share({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": text})

    assert share("50") == share("50.0") == share(" 5e1 ") == "50"
    assert share("100") == share("") == share("half") == _mps_share({}) == "unset"


def test_compare_refuses_runs_timed_with_other_iterations_or_knobs(tmp_path, capsys, monkeypatch):
    """bench.json recorded neither the iteration counts (a preset's defaults are not in its command) nor the
    EP_PLUGIN_* knobs, so compare took runs timed with 10 and 200 iterations, or with other knobs, for alike;
    the reference's iteration count was recorded but not compared.
    A file written before these were recorded says nothing of them: no difference (an A/B against an older
    tree)."""
    from ep_plugin.bench import compare

    monkeypatch.setenv("EP_PLUGIN_TIMEOUT_S", "300")
    monkeypatch.setenv("EP_PLUGIN_PAD_MULTIPLE", "4")
    monkeypatch.setenv("EP_PLUGIN_CUDA_ARCHS", "90")  # the build's: changes no timing, not recorded
    report, _ = _run_main(tmp_path, capsys, "--modes", "blocking")
    environment = report["environment"]
    assert (environment["warmup"], environment["iters"]) == (2, 4)
    assert environment["ep_plugin_variables"] == {"EP_PLUGIN_PAD_MULTIPLE": "4", "EP_PLUGIN_TIMEOUT_S": "300"}
    base = tmp_path / "base.json"
    base.write_text(json.dumps(report))

    def new_side(name, **changes):
        copy = json.loads(json.dumps(report))
        copy["environment"].update(changes)
        for key in [key for key, value in changes.items() if value is None]:
            del copy["environment"][key]
        (tmp_path / name).write_text(json.dumps(copy))
        return str(tmp_path / name)

    for changes, line in ((dict(warmup=50), "warmup: 50 (new) vs 2 (base)"),
                          (dict(iters=200), "iters: 200 (new) vs 4 (base)"),
                          (dict(reference={**environment["reference"], "iters": 7}),
                           f"reference_iters: 7 (new) vs {environment['reference']['iters']} (base)"),
                          (dict(ep_plugin_variables={}),
                           "ep_plugin_variables: none (new) vs EP_PLUGIN_PAD_MULTIPLE=4"),
                          # ranks sharing a GPU with half its SMs each time their kernels and the copy ceiling slower
                          (dict(mps_thread_percentage="50"), "mps_thread_percentage: 50 (new) vs unset (base)")):
        new = new_side("new.json", **changes)
        assert compare.main(["--new", new, "--base", str(base)]) == 1
        assert f"timed unlike: {line}" in capsys.readouterr().out
        assert compare.main(["--new", new, "--base", str(base), "--allow-env-diff"]) == 0
        capsys.readouterr()
    # A wait's bound changes no timing: runs that differ there alone are compared.
    waits_longer = new_side("waits.json", ep_plugin_variables={"EP_PLUGIN_PAD_MULTIPLE": "4",
                                                               "EP_PLUGIN_TIMEOUT_S": "60"})
    assert compare.main(["--new", waits_longer, "--base", str(base)]) == 0
    assert "timed unlike" not in capsys.readouterr().out
    # Nor does a knob set to its default (EP_PLUGIN_BLOCKING=1): it was "none (new) vs EP_PLUGIN_BLOCKING=1".
    said_default = new_side("default.json", ep_plugin_variables={"EP_PLUGIN_PAD_MULTIPLE": "4",
                                                                 "EP_PLUGIN_BLOCKING": "1"})
    assert compare.main(["--new", said_default, "--base", str(base)]) == 0
    assert "timed unlike" not in capsys.readouterr().out
    # Where no reference case is on both sides (its rows named another backend on both), its iteration count
    # times nothing that is compared.
    sides = []
    for name, iters in (("renamed_new.json", 7), ("renamed_base.json", environment["reference"]["iters"])):
        path = new_side(name, reference={**environment["reference"], "iters": iters})
        renamed = json.loads(pathlib.Path(path).read_text())
        for row in renamed["summary"]:
            row["backend"] = "hybrid"
        (tmp_path / name).write_text(json.dumps(renamed))
        sides.append(str(tmp_path / name))
    assert compare.main(["--new", sides[0], "--base", sides[1]]) == 0
    assert "timed unlike" not in capsys.readouterr().out
    # The reference's token limit sets which cases run, not how long one takes.
    fewer_references = new_side("fewer.json", reference={**environment["reference"], "max_tokens": 1})
    assert compare.main(["--new", fewer_references, "--base", str(base)]) == 0
    assert "timed unlike" not in capsys.readouterr().out
    older = new_side("older.json", warmup=None, iters=None, reference=None, ep_plugin_variables=None,
                     mps_thread_percentage=None)
    for new, old in ((str(base), older), (older, older)):
        assert compare.main(["--new", new, "--base", old]) == 0
        assert "timed unlike" not in capsys.readouterr().out


def test_a_forced_size_that_gives_a_layout_already_run_is_skipped(tmp_path, capfd):
    """--scaleup-size 2 on 2 CPU ranks is one domain of 2: the flat layout the detected run (0) already
    timed. It ran twice (duplicate rows, the reference's time doubled); a real split (1) still runs, and
    the flat one is labelled one domain (it read 2x1 like the split)."""
    report, stdout = _run_main(tmp_path, capfd, "--modes", "blocking", "--scaleup-size", "2,1")
    assert [record["domains"] for record in report["records"]] == ["1x2", "2x1"]
    assert "skipped reference at scale-up size 2: the same layout (1x2) already ran" in stdout


def test_a_sweep_the_timeout_ends_keeps_the_cases_that_finished(tmp_path, capfd):
    """Before: when the launcher's --timeout ended a long sweep, every finished case was lost with it. Now
    bench.json holds them, says the sweep is incomplete, and the exit status is 1. The second case (16384
    tokens, 100 iterations through gloo) runs for minutes; the first is done in seconds."""
    out = tmp_path / "bench"
    argv = ["--device", "cpu", "--ranks", "2", "--backends", "reference", "--tokens", "8,16384", "--hidden", "1024",
            "--experts", "16", "--topk", "8", "--routings", "balanced", "--modes", "blocking", "--payloads", "bf16",
            "--warmup", "1", "--iters", "100", "--reference-iters", "100", "--reference-max-tokens", "0",
            "--timeout", "40", "--out", str(out)]
    assert main(argv) == 1
    report = json.loads((out / "bench.json").read_text())
    assert [record["tokens"] for record in report["records"]] == [8]
    assert {row["op"] for row in report["summary"]} == {"dispatch", "combine", "roundtrip", "step"}
    assert "--timeout 40 s ended the sweep after 1 record(s)" in report["environment"]["incomplete"]
    assert not (out / "records.partial.jsonl").exists()
    output = capfd.readouterr()
    assert "INCOMPLETE" in output.err and " step " in output.out


def _small_cpu_sweep(out, *, tokens: str = "8", hidden: str = "64") -> list[str]:
    """The options of a few seconds' sweep: the reference on 2 CPU ranks, one mode, payload and routing."""
    return ["--device", "cpu", "--ranks", "2", "--backends", "reference", "--tokens", tokens, "--hidden", hidden,
            "--experts", "8", "--topk", "2", "--routings", "balanced", "--modes", "blocking", "--payloads", "bf16",
            "--warmup", "1", "--iters", "2", "--out", str(out)]


class _FailingAtWideRowsReference(ReferenceBackend):
    """A dispatch that fails in the rank (out of memory, say) for rows wider than 64."""

    def _dispatch(self, *args, **kwargs):
        if self.hidden_size > 64:
            raise RuntimeError("planted: the rank could not allocate its rows")
        return super()._dispatch(*args, **kwargs)


def _bench_rank_failing_at_wide_rows(ctx, spec):
    from ep_plugin.bench.runner import bench_rank as real

    ep_plugin.register_backend("reference", _FailingAtWideRowsReference, overwrite=True)
    return real(ctx, spec)


def test_a_sweep_a_rank_failure_ends_keeps_the_cases_that_finished(tmp_path, capfd, monkeypatch):
    """A case that fails in a rank ended the sweep with the rank's traceback alone, and the finished cases,
    written down by rank 0, were lost with it."""
    from ep_plugin.bench import __main__ as bench_main

    monkeypatch.setattr(bench_main, "bench_rank", _bench_rank_failing_at_wide_rows)
    out = tmp_path / "bench"
    assert main(_small_cpu_sweep(out, tokens="16,32", hidden="64,128")) == 1
    report = json.loads((out / "bench.json").read_text())
    assert [(record["tokens"], record["hidden"]) for record in report["records"]] == [(16, 64), (32, 64)]
    incomplete = report["environment"]["incomplete"]
    assert "a rank failed, which ended the sweep after 2 record(s)" in incomplete and "planted" in incomplete
    assert not (out / "records.partial.jsonl").exists()
    output = capfd.readouterr()
    assert "INCOMPLETE" in output.err and " step " in output.out


def test_a_case_too_large_for_the_hosts_memory_is_skipped_on_cpu(tmp_path, capfd):
    """A size typed wrong (2**40 columns) failed in every CPU rank, one traceback each: the GPU's cases were
    measured against its free memory, the host's never."""
    out = tmp_path / "bench"
    assert main(_small_cpu_sweep(out, tokens="16", hidden=f"64,{2**40}")) == 0
    report = json.loads((out / "bench.json").read_text())
    assert [record["hidden"] for record in report["records"]] == [64]
    output = capfd.readouterr()
    said = output.out + output.err
    assert f"hidden={2**40}" in said and "and the host's available memory is" in said


def test_a_containers_memory_limit_bounds_what_the_cpu_check_counts_as_available(tmp_path):
    """MemAvailable is the host's: in a container with --memory, a case past the cgroup's limit passed the check
    and the OOM killer ended a rank."""
    from ep_plugin.cli import AVAILABLE, CONTAINER_LIMIT, host_memory

    own = tmp_path / "self_cgroup"
    own.write_text("0::/\n")  # a container's own cgroup namespace: its cgroup is the tree's root
    host = host_memory(str(tmp_path), str(own))  # no cgroup files there: the host's figure
    assert host is not None and host.bytes > 0 and host.limit == AVAILABLE
    (tmp_path / "memory.max").write_text(f"{2 * 2**30}\n")
    (tmp_path / "memory.current").write_text(f"{2**30 - 4096}\n")
    limited = (2**30 + 4096, CONTAINER_LIMIT) if host.bytes > 2**30 + 4096 else host  # the limit less what it uses
    assert host_memory(str(tmp_path), str(own)) == limited
    (tmp_path / "memory.max").write_text("max\n")  # no limit: the host's figure again (it moves a little)
    assert abs(host_memory(str(tmp_path), str(own)).bytes - host.bytes) < 2**30


def test_the_memory_check_reads_the_limit_of_the_processs_own_cgroup_and_those_above(tmp_path):
    """Outside a container's namespace (a Slurm job on cgroup v2, or any job on v1, still RHEL 8's default) the
    limit is not at the tree's root: it lies on the job's cgroup, above the step this process is in. Only
    the root was read, so such a job's limit went unseen. Page cache the kernel drops first is not counted."""
    from ep_plugin.cli import AVAILABLE, CONTAINER_LIMIT, host_memory

    own = tmp_path / "self_cgroup"
    host = host_memory(str(tmp_path / "none"), str(own))  # nothing readable: the host's figure
    assert host is not None and host.limit == AVAILABLE and host.bytes > 2**30
    # v2: a 1 GiB job limit two levels above this process's cgroup (whose own limit is "max").
    step = tmp_path / "v2" / "system.slice" / "job_7" / "step_0"
    step.mkdir(parents=True)
    (step / "memory.max").write_text("max\n")
    (step.parent / "memory.max").write_text(f"{2**30}\n")
    (step.parent / "memory.current").write_text(f"{768 * 2**20}\n")
    (step.parent / "memory.stat").write_text(f"anon 1\ninactive_file {512 * 2**20}\nactive_file 3\n")
    own.write_text("0::/system.slice/job_7/step_0\n")
    assert host_memory(str(tmp_path / "v2"), str(own)) == (768 * 2**20, CONTAINER_LIMIT)  # 1 GiB - (768 - 512) MiB
    # v1: the memory controller's own line and mount; "no limit" is the largest page-aligned int64.
    job = tmp_path / "v1" / "memory" / "slurm" / "uid_0" / "job_9"
    job.mkdir(parents=True)
    (job / "memory.limit_in_bytes").write_text(f"{2**30}\n")
    (job / "memory.usage_in_bytes").write_text(f"{2**29}\n")
    (job / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {2**28}\n")
    (job.parent / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    own.write_text("12:pids:/slurm/uid_0/job_9\n4:memory:/slurm/uid_0/job_9\n0::/\n")
    assert host_memory(str(tmp_path / "v1"), str(own)) == (2**30 - 2**28, CONTAINER_LIMIT)
    (job / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited all the way up
    assert host_memory(str(tmp_path / "v1"), str(own)).limit == AVAILABLE


def test_the_progress_bar_ends_full_when_a_backend_is_skipped(tmp_path, capfd):
    """A backend skipped at its first case (here a forced scale-up size that repeats a layout) left its
    other cases off the bar, which ended short of its total as if the sweep had stopped."""
    argv = ["--device", "cpu", "--ranks", "2", "--backends", "reference", "--tokens", "16,32", "--hidden", "64",
            "--experts", "8", "--topk", "2", "--payloads", "bf16", "--routings", "balanced", "--modes", "blocking",
            "--iters", "2", "--warmup", "1", "--scaleup-size", "2,1", "--out", str(tmp_path / "bench")]
    assert main(argv) == 0
    err = capfd.readouterr().err
    assert "6/6" in err, err[-500:]


def test_a_sweep_whose_ranks_crash_on_their_way_out_keeps_every_case(tmp_path, capfd, monkeypatch):
    """The launcher fails a run whose ranks crash or hang after returning (tests/test_launcher.py shows it
    with real processes); a benchmark then keeps its figures, says what happened and exits 1, where the
    error lost the whole sweep. The teardown failure is put in place of the launcher's check here."""
    from ep_plugin.testing import launcher

    def teardown_fails(processes, timeout_s, results):
        raise launcher.TeardownError("launcher: every rank returned, but exited with an error after returning its "
                                     "result (rank 1: killed by SIGSEGV)", results)

    monkeypatch.setattr(launcher, "_check_exits", teardown_fails)
    out = tmp_path / "bench"
    assert main(_small_cpu_sweep(out)) == 1
    report = json.loads((out / "bench.json").read_text())
    assert [record["tokens"] for record in report["records"]] == [8]
    assert "killed by SIGSEGV" in report["environment"]["teardown"] and "incomplete" not in report["environment"]
    output = capfd.readouterr()
    assert "every case ran, but" in output.err and " step " in output.out


def test_a_figure_too_small_for_its_decimals_is_not_printed_as_zero():
    """The CPU bench's tiny shapes printed 0.00 GB/s: read as a kernel that moved nothing."""
    rows = [{"backend": "reference", "median_us": 812.0, "algo_gbps": 0.0031, "ceiling_ratio": 0.0}]
    cells = format_table(rows).splitlines()[1].split()
    assert "0.0031" in cells and "0.00" in cells  # the small figure kept; a true zero still 0.00
