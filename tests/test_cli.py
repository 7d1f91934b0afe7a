"""The command lines a newcomer meets: one-line errors, defaults that fit the machine, clean logs."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ep_plugin import _cuda
from ep_plugin.__main__ import main as ep_main
from ep_plugin.bench.__main__ import DEFAULT_OUT, GPU_PRESETS
from ep_plugin.bench.__main__ import main as bench_main
from ep_plugin.bench.__main__ import parse_args as bench_args
from ep_plugin.demo import main as demo_main
from ep_plugin.testing.launcher import max_cpu_ranks

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = not torch.cuda.is_available()
needs_no_gpu = pytest.mark.skipif(not NO_GPU, reason="checks the refusal on a machine without a GPU")

# (flag list, words the error must hold); each must be refused before any process starts.
BAD_DEMO_FLAGS = [
    pytest.param(["--backend", "hybrid"], "hybrid", marks=pytest.mark.skipif(
        _cuda.available(), reason="hybrid runs here")),
    pytest.param(["--device", "cuda"], "no GPU", marks=needs_no_gpu),
    (["--steps", "0"], "--steps"),
    (["--tokens", "0"], "--tokens"),
    (["--topk", "9", "--experts", "8"], "--topk 9"),
    (["--ranks", "3", "--experts", "8"], "divisible"),
    (["--backend", "no_such_backend"], "no_such_backend"),
    (["--steps", "many"], "--steps"),
    (["--tokens", "9000"], "max_tokens_per_rank=8192"),  # the backend would refuse it inside a rank
    (["--ranks", str(max_cpu_ranks() + 1)], "CPU ranks here"),  # more processes than the cores can run
]


def _one_line_error(run, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        run()
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.mark.parametrize("flags, words", BAD_DEMO_FLAGS)
def test_demo_refuses_bad_flags_in_one_line(flags, words, capsys):
    line = _one_line_error(lambda: demo_main(flags + ["--device", "cpu"] * ("--device" not in flags)), capsys)
    assert words in line, line


BAD_BENCH_FLAGS = [
    pytest.param(["--backends", "hybrid"], "hybrid", marks=pytest.mark.skipif(
        _cuda.available(), reason="hybrid runs here")),
    pytest.param(["--device", "cuda"], "no GPU", marks=needs_no_gpu),
    (["--iters", "0"], "--iters"),
    (["--tokens", "0"], "--tokens"),
    (["--tokens", "64,lots"], "--tokens"),
    (["--topk", "9", "--experts", "8", "--ranks", "2"], "--topk 9"),
    (["--experts", "10", "--ranks", "4"], "divisible"),
    (["--payloads", "fp16"], "fp16"),
    (["--reference-iters", "0"], "--reference-iters"),
    (["--timeout", "0"], "--timeout"),
    (["--backends", "reference", "--modes", "nonblocking"], "no case to run"),
    (["--backends", "reference", "--payloads", "fp8"], "no case to run"),
    (["--payloads", "bf16,fp8", "--hidden", "256,100"], "divisible by 128"),  # the backend's error, in a rank
    # The GPU presets' shapes grind for many minutes on CPU ranks; --tokens alone does not set the size.
    *[(["--preset", preset], "--preset cpu") for preset in GPU_PRESETS],
    (["--preset", "standard", "--tokens", "16"], "--preset cpu"),
    (["--ranks", str(max_cpu_ranks() + 1)], "CPU ranks here"),
]


@pytest.mark.parametrize("flags, words", BAD_BENCH_FLAGS)
def test_bench_refuses_bad_flags_in_one_line(flags, words, capsys):
    line = _one_line_error(lambda: bench_args(flags + ["--device", "cpu"] * ("--device" not in flags)), capsys)
    assert words in line, line


@pytest.mark.parametrize("factory", ["no_such_module_for_ep_plugin:Backend", "ep_plugin.registry:NoSuchBackend"])
def test_a_registered_backend_that_does_not_import_is_refused_in_one_line(factory, monkeypatch, capsys):
    """A third-party backend (an entry point) whose module fails to import gave a traceback, not the one-line
    refusal an unknown name gets: only ValueError was caught."""
    from ep_plugin import registry

    monkeypatch.setitem(registry._registry, "broken", factory)
    for run in (lambda: bench_args(["--device", "cpu", "--backends", "broken"]),
                lambda: demo_main(["--device", "cpu", "--backend", "broken"])):
        line = _one_line_error(run, capsys)
        assert "backend 'broken' is registered but cannot be imported (" in line, line


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_a_gpu_preset_runs_on_cpu_when_tokens_and_hidden_set_the_shape(preset):
    args = bench_args(["--device", "cpu", "--preset", preset, "--tokens", "16", "--hidden", "128", "--ranks", "2"])
    assert (args.preset, args.tokens, args.hidden) == (preset, "16", "128")


def test_a_bad_knob_is_refused_before_any_rank_starts(monkeypatch, capsys):
    """An EP_PLUGIN_* value that makes no Config: one line naming it, not a rank's traceback."""
    monkeypatch.setenv("EP_PLUGIN_TIMEOUT_S", "abc")
    for run in (lambda: demo_main(["--device", "cpu", "--ranks", "1", "--steps", "1"]),
                lambda: bench_args(["--device", "cpu"])):
        assert "EP_PLUGIN_TIMEOUT_S='abc'" in _one_line_error(run, capsys)


def test_a_domain_size_that_does_not_divide_the_ranks_is_refused_in_one_line(monkeypatch, capsys):
    """It was a rank's 40-line traceback ending in topology's EPError."""
    monkeypatch.setenv("EP_PLUGIN_SCALEUP_SIZE", "3")
    message = _one_line_error(lambda: demo_main(["--device", "cpu", "--ranks", "2", "--steps", "1"]), capsys)
    assert "EP_PLUGIN_SCALEUP_SIZE=3 does not divide --ranks 2" in message, message


def test_info_takes_no_options(capsys):
    assert ep_main(["info", "--bogus"]) == 2
    assert "takes no options" in capsys.readouterr().err
    assert ep_main(["info", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m ep_plugin info")


def test_a_bad_flag_gives_no_traceback_from_the_command_line():
    result = subprocess.run([sys.executable, "-m", "ep_plugin", "demo", "--steps", "0"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.strip() == ("python -m ep_plugin demo: error: --steps must be at least 1, got 0 "
                                     "(--help lists the options)")


@needs_no_gpu
def test_bench_defaults_to_what_runs_here():
    args = bench_args([])
    assert args.device == "cpu" and args.backends == "reference" and args.preset == "cpu"
    assert args.out == DEFAULT_OUT == "bench_out"
    assert "/bench_out/" in (ROOT / ".gitignore").read_text().splitlines()


def test_bench_says_why_it_wrote_no_plot(tmp_path, capsys):
    argv = ["--device", "cpu", "--ranks", "2", "--backends", "reference", "--tokens", "16", "--hidden", "64",
            "--experts", "8", "--topk", "2", "--iters", "1", "--warmup", "0", "--routings", "balanced",
            "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    stdout = capsys.readouterr().out
    assert "plots: none written (" in stdout and "--tokens" in stdout, stdout[-2000:]


def test_help_exits_0_with_usage(capsys):
    assert ep_main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m ep_plugin {demo,info,doctor}")
    assert ep_main(["nonsense"]) == 2
    assert "unknown command 'nonsense'" in capsys.readouterr().err


@needs_no_gpu
def test_info_says_no_gpu_plainly(capsys):
    assert ep_main(["info"]) == 0
    assert "GPU: no GPU" in capsys.readouterr().out


def test_info_shows_the_knobs_set_here_and_a_value_every_backend_refuses(monkeypatch, capsys):
    """It printed the defaults only: EP_PLUGIN_NUM_SMS=8 read as 16, and an unparseable value went unsaid."""
    monkeypatch.setenv("EP_PLUGIN_NUM_SMS", "8")
    assert ep_main(["info"]) == 0
    out = capsys.readouterr().out
    assert "[set here: 8]" in out and "REFUSED" not in out, out
    monkeypatch.setenv("EP_PLUGIN_BLOCKING", "maybe")
    assert ep_main(["info"]) == 0
    assert "REFUSED, every backend's build would raise" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["info"], ["doctor"], ["doctor", "--backend", "reference"]])
def test_a_variable_that_names_no_knob_is_named_once_by_the_commands_that_list_them(command):
    """info and doctor list such a name themselves, and the config's warning named it again on stderr. In a
    subprocess: pytest's log capture would swallow the warning in this one."""
    env = dict(os.environ, EP_PLUGIN_FOO="1")
    result = subprocess.run([sys.executable, "-m", "ep_plugin", *command], capture_output=True, text=True,
                            timeout=120, env=env)
    said = result.stdout + result.stderr
    assert said.count("EP_PLUGIN_FOO") == 1, said


def test_dev_prints_usage_before_building_anything(tmp_path):
    shutil.copy(ROOT / "dev", tmp_path / "dev")  # alone: anything past the usage check would fail here
    for argv, status in (([], 2), (["--help"], 0), (["tset"], 2)):
        result = subprocess.run(["bash", str(tmp_path / "dev"), *argv], capture_output=True, text=True, timeout=30)
        assert result.returncode == status, result
        assert "usage: ./dev demo" in result.stdout + result.stderr
    assert not (tmp_path / ".venv").exists() and not (tmp_path / "build").exists()


def test_demo_log_is_clean_when_not_a_terminal():
    result = subprocess.run([sys.executable, "-m", "ep_plugin", "demo", "--device", "cpu", "--backend", "reference",
                             "--ranks", "2", "--steps", "3", "--tokens", "32", "--hidden", "16", "--experts", "4"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("ep_plugin demo: backend reference, device cpu, 2 ranks"), lines[0]
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 3 and all("tokens/s" in line for line in steps), lines
    assert any(line.startswith("tokens/s: median") and "steps 2-3" in line for line in lines), lines
    # No progress bar (or its carriage returns) in either stream when neither is a terminal.
    assert "\r" not in result.stdout + result.stderr and "%|" not in result.stderr, result.stderr[-2000:]


def test_the_readme_api_example_runs_under_torchrun():
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             str(ROOT / "examples" / "api.py")], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "rank 0/2 (cpu, reference)" in result.stdout and "rank 1/2" in result.stdout, result.stdout


def test_product_text_speaks_for_itself():
    """No tracker numbers and no paths outside the repository in what users read."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "ep_plugin").rglob("*.py")),
             *sorted((ROOT / "examples").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))]
    found = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bissues?[ -]#?\d", line, re.IGNORECASE) or "../shared" in line or "/work/" in line:
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
    assert "docs/design.md" in (ROOT / "README.md").read_text()


def test_the_api_example_started_wrongly_says_what_to_do_in_one_line():
    """Started without torchrun: one line that says how to start it, not a rendezvous traceback."""
    plain = subprocess.run([sys.executable, str(ROOT / "examples" / "api.py")], capture_output=True, text=True,
                           timeout=60, env={k: v for k, v in os.environ.items() if k != "LOCAL_WORLD_SIZE"})
    assert plain.returncode == 2 and "Traceback" not in plain.stderr, plain.stderr
    assert "torchrun --nproc-per-node 2 examples/api.py" in plain.stderr.strip().splitlines()[-1], plain.stderr


def test_the_api_example_with_a_kernel_backend_and_too_few_gpus_says_so_in_one_line():
    """It fell back to CPU ranks, and every rank raised "backend 'hybrid' runs on cuda, not on cpu"."""
    env = {**os.environ, "LOCAL_WORLD_SIZE": "64"}  # more ranks than any machine's GPUs
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "api.py"), "--backend", "hybrid"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "runs on cuda only" in result.stderr and "one rank per GPU" in result.stderr, result.stderr


@needs_no_gpu
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_megatron_example_without_a_gpu_says_so_in_one_line(device):
    """Megatron's layers call CUDA on either --device: one line pointing to the CPU path, not a rank's traceback."""
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "megatron" / "train_gpt_moe.py"), "--ranks", "2",
                             "--steps", "1", "--device", device], capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and result.stdout == "", result.stderr[-2000:]
    assert "needs a CUDA GPU" in lines[0] and "./dev demo" in lines[0], lines[0]
