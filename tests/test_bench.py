"""The benchmark harness end to end on CPU ranks (no timing is asserted), and its byte and ceiling logic."""

import json
import subprocess
import sys

import torch

from ep_plugin.bench.report import summarize
from ep_plugin.bench.workload import Shape, make_routing, traffic


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
    assert len(ops) == 12
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
    assert rows["dispatch"]["median_us"] == 20.0 and rows["roundtrip"]["median_us"] == 50.0
    assert rows["dispatch"]["ceiling_ratio"] == rows["dispatch"]["ceiling_us"] / 20.0


def test_skewed_routing_is_skewed():
    shape = Shape(tokens=2048, hidden=8, topk=2, experts=16, payload="bf16", routing="skewed")
    routing_map, probs = make_routing(shape, 0, 0, torch.device("cpu"))
    per_expert = routing_map.sum(0)
    assert per_expert[:4].sum() > 4 * per_expert[-4:].sum()
    torch.testing.assert_close(probs.sum(1), torch.ones(2048))


def test_bench_rejects_unknown_axis_values_before_launching():
    for bad in (["--payloads", "fp16"], ["--modes", "async"], ["--backends", "nccl_magic"],
                ["--experts", "10", "--ranks", "4"]):
        result = subprocess.run([sys.executable, "-m", "ep_plugin.bench", "--device", "cpu", *bad],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "error:" in result.stderr, (bad, result.stderr[-500:])
