"""The main job: the README's demo command trains, its loss goes down, and its losses (every step's and the
held-out batch's) are the ones the same model gets when trained in one process without dispatch or combine."""

import dataclasses
import re
import signal
import subprocess
import sys
from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ep_plugin.backends.reference import ReferenceBackend
from ep_plugin.demo import DemoResult, DemoSpec, MoELayer, held_out_tokens, synthetic_tokens, teacher, train
from ep_plugin.testing import run_ranks


def test_demo_command_loss_decreases_on_4_ranks():
    result = subprocess.run([sys.executable, "-m", "ep_plugin", "demo", "--ranks", "4", "--steps", "20",
                             "--device", "cpu", "--backend", "reference"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    losses = [float(v) for v in re.findall(r"step +\d+ +loss ([0-9.]+)", result.stdout + result.stderr)]
    assert len(losses) == 20
    assert losses[-1] < 0.6 * losses[0], losses


def train_in_one_process(spec: DemoSpec, world_size: int, payload_dtype: torch.dtype,
                         device: str = "cpu") -> DemoResult:
    """The demo's training with every rank's tokens and experts in one process, summed densely.

    The same parameters (the demo's own MoELayer, built for each rank on the ranks' device type, so
    that the same seeds draw the same values), the same inputs, loss and optimizer, but no dispatch or
    combine: each token's output is the sum over its chosen experts of expert(x) * prob, rounded to
    the payload dtype where the demo sends payloads.
    """
    local = spec.num_experts // world_size
    device = torch.device(device)
    # Stand-ins for each rank's backend: what MoELayer reads of it (the dense twin moves no tokens).
    ranks = [SimpleNamespace(rank=rank, num_local_experts=local, capabilities=ReferenceBackend.capabilities)
             for rank in range(world_size)]
    layers = [MoELayer(spec, rank, payload_dtype, device) for rank in ranks]
    router = layers[0].router  # every rank builds the same router (one seed); ranks sum its gradients
    parameters = list(router.parameters()) + [p for layer in layers for p in (layer.w_in, layer.w_out)]
    optimizer = torch.optim.Adam(parameters, lr=spec.lr)

    def global_loss(draw) -> torch.Tensor:
        """The mean loss over every rank's tokens, ``draw(rank, world_size)``."""
        loss = torch.zeros((), device=device)
        for rank in range(world_size):
            x = draw(rank, world_size).to(device)
            routing = layers[0].route(x)  # the reference takes the routing-map form
            routing_map, probs = routing["routing_map"], routing["probs"]
            payload = x.to(payload_dtype).float()
            moe = torch.zeros_like(x)
            for expert in range(spec.num_experts):
                chosen = routing_map[:, expert].nonzero().flatten()
                rows = layers[expert // local].expert(expert % local, payload[chosen]) * probs[chosen, expert, None]
                moe = moe.index_add(0, chosen, rows.to(payload_dtype).float())
            y = x + moe.to(payload_dtype).float()
            loss = loss + F.mse_loss(y, teacher(x, spec.seed)) / world_size
        return loss

    def held_out() -> float:
        with torch.no_grad():
            return float(global_loss(partial(held_out_tokens, spec)))

    held_out_before, losses = held_out(), []
    for step in range(spec.steps):
        loss = global_loss(partial(synthetic_tokens, spec, step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return DemoResult(losses, held_out_before, held_out())


DENSE_CHECK_SPEC = DemoSpec(steps=8, tokens_per_rank=32, hidden_size=16, ffn_size=32, num_experts=8, topk=2)


def losses_of(result: DemoResult) -> torch.Tensor:
    """Every step's loss, then the held-out batch's before and after training."""
    return torch.tensor([*result.losses, result.held_out_before, result.held_out_after])


def test_demo_losses_equal_single_process_training():
    """Every step's global loss equals the one-process dense run's: a wrong dispatch or combine (even
    one the model could still learn around) changes the first loss, a wrong backward the later ones. The
    held-out losses are the dense model's on the held-out batch before the first step and after the last."""
    spec = DENSE_CHECK_SPEC
    distributed = run_ranks(train, 4, spec, timeout_s=180)
    single = train_in_one_process(spec, 4, torch.float32)
    torch.testing.assert_close(losses_of(distributed[0]), losses_of(single), rtol=1e-5, atol=0)


@pytest.mark.gpu
def test_hybrid_demo_losses_equal_single_process_training():
    spec = replace(DENSE_CHECK_SPEC, backend="hybrid")
    distributed = run_ranks(train, 2, spec, device="cuda", timeout_s=300)
    single = train_in_one_process(spec, 2, torch.bfloat16, device="cuda")
    # hybrid rounds each rank's partial sum to bf16 (the dense twin rounds once): a few bf16 ulps.
    torch.testing.assert_close(losses_of(distributed[0]), losses_of(single), rtol=2e-2, atol=0)


@pytest.mark.gpu
def test_hybrid_demo_trains_alike_in_non_blocking_mode():
    """EP_PLUGIN_BLOCKING=0 sizes the dispatch output to a budget (more rows than arrived): the demo split it by
    the counts and stopped on every rank (split sizes did not add up). Its losses are the blocking run's."""
    spec = replace(DENSE_CHECK_SPEC, backend="hybrid", steps=3)
    blocking = run_ranks(train, 2, spec, device="cuda", timeout_s=300)
    non_blocking = run_ranks(train, 2, spec, device="cuda", timeout_s=300, env={"EP_PLUGIN_BLOCKING": "0"})
    torch.testing.assert_close(losses_of(non_blocking[0]), losses_of(blocking[0]), rtol=1e-3, atol=0)


class _ShapeLimitedReference(ReferenceBackend):
    """The reference with a kernel-like shape limit (the compiled backends' hidden size divisible by 8)."""

    @classmethod
    def shape_problem(cls, hidden_size, num_local_experts):
        return None if hidden_size % 8 == 0 else f"needs hidden_size divisible by 8, got {hidden_size}"


def test_demo_refuses_a_shape_the_backend_cannot_take_before_any_rank_starts(monkeypatch, capsys):
    """--hidden 60 with hybrid failed in every rank, building the backend, not in one line up front."""
    import ep_plugin.demo as demo
    from ep_plugin.registry import register_backend

    register_backend("reference_shape_limited", _ShapeLimitedReference, overwrite=True)
    monkeypatch.setattr(demo, "run_ranks", lambda *args, **kwargs: pytest.fail("ranks started"))
    with pytest.raises(SystemExit) as stop:
        demo.main(["--backend", "reference_shape_limited", "--hidden", "60", "--device", "cpu", "--ranks", "2"])
    assert stop.value.code == 2
    assert "--backend reference_shape_limited: needs hidden_size divisible by 8, got 60" in capsys.readouterr().err


def test_demo_refuses_sizes_this_machine_cannot_hold_before_any_rank_starts(monkeypatch, capsys):
    """--hidden 99999999999 passed the checks and every rank died allocating, one traceback each."""
    import ep_plugin.demo as demo

    monkeypatch.setattr(demo, "run_ranks", lambda *args, **kwargs: pytest.fail("ranks started"))
    for option in (["--hidden", "99999999999"], ["--experts", "99999999998"]):
        with pytest.raises(SystemExit) as stop:
            demo.main(option + ["--device", "cpu", "--ranks", "2", "--backend", "reference"])
        assert stop.value.code == 2
        assert re.search(r"need about [\d,.]+ GiB, more than half of the host's available memory \([\d,.]+ GiB\)",
                         capsys.readouterr().err), option


def test_the_memory_check_counts_a_containers_limit(monkeypatch):
    """The check compared the need with half the machine's physical memory: in a container with --memory, a size
    past the container's limit passed and the OOM killer ended the ranks. It reads the bench's figure (MemAvailable,
    or a container's limit below it) and names which limit it met."""
    import ep_plugin.demo as demo
    from ep_plugin.cli import AVAILABLE, CONTAINER_LIMIT, HostMemory

    args = SimpleNamespace(tokens=2048, hidden=1024, experts=64, topk=8, ranks=8, device="cpu")  # ~4.8 GiB
    monkeypatch.setattr(demo, "host_memory", lambda: HostMemory(2 * 2**30, CONTAINER_LIMIT))
    assert demo._memory_problem(args).endswith("more than half of what the memory limit of its cgroup (a container's, "
                                               "a job's) leaves (2.0 GiB)")
    monkeypatch.setattr(demo, "host_memory", lambda: HostMemory(64 * 2**30, AVAILABLE))
    assert demo._memory_problem(args) is None
    monkeypatch.setattr(demo, "host_memory", lambda: HostMemory(5 * 2**30, AVAILABLE))
    assert "more than half of the host's available memory (5.0 GiB)" in demo._memory_problem(args)
    monkeypatch.setattr(demo, "host_memory", lambda: None)  # not known here: no check
    assert demo._memory_problem(args) is None


def test_demo_refuses_a_top_k_the_backend_cannot_take():
    """--backend elastic --topk 33 passed the checks, then every rank raised at its first dispatch."""
    from ep_plugin.backends.elastic import ElasticBackend
    from ep_plugin.demo import backend_limits_problem

    args = SimpleNamespace(backend="elastic", hidden=256, experts=64, ranks=2, topk=ElasticBackend.MAX_TOPK + 1)
    assert backend_limits_problem(args) == "--topk 33: backend 'elastic' takes at most 32 experts per token, got 33"
    assert backend_limits_problem(SimpleNamespace(**{**vars(args), "topk": ElasticBackend.MAX_TOPK})) is None


class _TopkOnlyReference(ReferenceBackend):
    """The reference taking only top-k ids, as elastic does: the demo's other routing form, on CPU."""

    capabilities = dataclasses.replace(ReferenceBackend.capabilities, routing_forms=("topk",))


def train_in_topk_form(ctx, spec):
    from ep_plugin.registry import register_backend

    register_backend("reference_topk", _TopkOnlyReference, overwrite=True)  # in this rank's process
    return train(ctx, replace(spec, backend="reference_topk"))


def test_a_backend_that_takes_top_k_ids_trains_alike():
    """The demo hands a backend the routing form it takes (elastic: top-k ids only; it used to pass a routing
    map to every backend, so `--backend elastic` crashed on every rank): the same losses either way."""
    spec = replace(DENSE_CHECK_SPEC, steps=3)
    topk = run_ranks(train_in_topk_form, 2, spec, timeout_s=180)
    routing_map = run_ranks(train, 2, spec, timeout_s=180)
    assert topk[0] == routing_map[0]


# What a stubbed run_ranks returns (no rank process starts): rank 0's result of a run whose held-out loss fell.
TRAINED = [DemoResult([0.5], held_out_before=0.5, held_out_after=0.4)]


def test_device_cpu_on_a_gpu_machine_defaults_to_the_reference(monkeypatch):
    """The default backend follows --device (it was chosen from the machine before the options were read,
    so `--device cpu` on a GPU machine stopped with 'backend hybrid runs on cuda only')."""
    import ep_plugin.demo as demo

    launched = []
    monkeypatch.setattr(demo, "default_device_and_backend", lambda: ("cuda", "hybrid"))
    monkeypatch.setattr(demo, "run_ranks", lambda fn, ranks, spec, **kwargs: launched.append(spec) or TRAINED)
    assert demo.main(["--device", "cpu", "--steps", "1", "--ranks", "2"]) == 0
    assert launched[0].backend == "reference"


def test_a_default_launch_without_the_mps_tools_runs_on_the_cpu(monkeypatch, capsys):
    """README's first command on one GPU without nvidia-cuda-mps-control (a container, WSL): the default 4
    ranks cannot share the GPU, and the demo stopped with exit status 2. Left to the defaults it now runs on
    the CPU and says why (an explicit --device cuda still gets mps_problem's refusal)."""
    import ep_plugin.demo as demo
    import ep_plugin.testing.launcher as launcher

    launched = []
    monkeypatch.setattr(demo, "default_device_and_backend", lambda: ("cuda", "hybrid"))
    monkeypatch.setattr(demo, "gpu_count", lambda: 1)
    monkeypatch.setattr(launcher.shutil, "which", lambda name: None)
    monkeypatch.setattr(demo, "run_ranks", lambda fn, ranks, spec, **kwargs: launched.append(
        (ranks, spec.backend, kwargs["device"])) or TRAINED)
    assert demo.main(["--steps", "1"]) == 0
    assert launched == [(4, "reference", "cpu")]
    assert "Running on the CPU instead" in capsys.readouterr().out
    assert demo.default_launch("cuda", 4, 4) == ("cuda", None)  # a GPU per rank: no MPS needed


def test_demo_rejects_experts_not_divisible_by_ranks():
    result = subprocess.run([sys.executable, "-m", "ep_plugin", "demo", "--ranks", "3", "--experts", "8",
                             "--device", "cpu"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "divisible" in result.stderr


def test_demo_rejects_a_learning_rate_adam_cannot_take():
    """--lr inf was accepted and trained into NaN losses."""
    import ep_plugin.demo as demo

    for lr in ("inf", "1e39"):  # 1e39 passed, and every rank's optimizer step failed to make it a float32
        with pytest.raises(SystemExit) as stop:
            demo.main(["--lr", lr, "--device", "cpu", "--backend", "reference"])
        assert stop.value.code == 2, lr


def test_the_verdict_compares_the_held_out_losses_not_the_steps(monkeypatch, capsys):
    """The first and the last step's losses are on different batches: on tiny shapes their difference was the
    batches', and a run that learned read "DID NOT DECREASE" (exit 1). The held-out batch is one batch, measured
    before the first step and after the last. run_ranks is stubbed so that no rank process starts."""
    import ep_plugin.demo as demo

    argv = ["--steps", "2", "--ranks", "2", "--device", "cpu", "--backend", "reference"]
    learned = DemoResult([0.50, 0.56], held_out_before=0.55, held_out_after=0.54)  # steps rose, held-out fell
    monkeypatch.setattr(demo, "run_ranks", lambda *args, **kwargs: [learned])
    assert demo.main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ("held-out loss: before 0.55000 -> after 0.54000 over 2 steps "
                                                        "(decreased)")
    did_not = DemoResult([0.56, 0.50], held_out_before=0.54, held_out_after=0.55)  # steps fell, held-out rose
    monkeypatch.setattr(demo, "run_ranks", lambda *args, **kwargs: [did_not])
    assert demo.main(argv) == 1
    assert capsys.readouterr().out.splitlines()[-1].endswith("(DID NOT DECREASE)")


def test_one_step_is_judged_like_any_run(monkeypatch, capsys):
    """One step had no loss to compare with (a smoke run, exit 0 whatever happened); the held-out batch gives it
    one."""
    import ep_plugin.demo as demo

    monkeypatch.setattr(demo, "run_ranks", lambda *args, **kwargs: TRAINED)
    assert demo.main(["--steps", "1", "--ranks", "2", "--device", "cpu", "--backend", "reference"]) == 0
    assert "before 0.50000 -> after 0.40000 over 1 step (decreased)" in capsys.readouterr().out


def test_a_tiny_run_that_learns_passes():
    """--tokens 8 --steps 2 printed "DID NOT DECREASE" and exited 1 (here the second step's batch had a higher loss
    than the first's), though the held-out loss falls by some 3%."""
    result = subprocess.run([sys.executable, "-m", "ep_plugin", "demo", "--ranks", "2", "--tokens", "8", "--steps",
                             "2", "--device", "cpu", "--backend", "reference"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert re.fullmatch(r"held-out loss: before [0-9.]+ -> after [0-9.]+ over 2 steps \(decreased\)",
                        result.stdout.splitlines()[-1]), result.stdout


def test_a_reader_that_leaves_early_ends_the_printing_not_the_training():
    """``ep-plugin demo | head -1``: rank 0's step lines met a closed pipe, the rank raised BrokenPipeError, and
    the launcher reported it as a failed rank (two tracebacks, exit 1)."""
    command = [sys.executable, "-m", "ep_plugin", "demo", "--steps", "3", "--ranks", "2"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        process.stdout.readline()
        process.stdout.close()  # the reader leaves after the first line
        stderr = process.stderr.read().decode()
        assert process.wait(timeout=300) == 0, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_ctrl_c_stops_the_demo_in_one_line():
    """Ctrl-C printed a 30-line traceback through the launcher (and the ranks' own, from the terminal's
    process group). The ranks lead process groups of their own, so only the launcher gets the signal."""
    command = [sys.executable, "-m", "ep_plugin", "demo", "--steps", "100000", "--ranks", "2"]
    # A shell's background job (CI under nohup ... &) ignores SIGINT, and Python keeps an ignored SIGINT ignored:
    # the demo gets the terminal's default, as under Ctrl-C.
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as process:
        try:
            for line in process.stdout:
                if line.startswith("step"):  # the ranks are training
                    break
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=120)
        finally:
            if process.poll() is None:  # never leave the demo training when the test fails
                process.kill()
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr, stderr


def test_the_launcher_waits_past_ep_plugins_own_timeout(monkeypatch):
    """With EP_PLUGIN_TIMEOUT_S above the launcher's 600 s, the launcher's generic 'did not finish' came before the
    rank's own report naming the late peer."""
    import ep_plugin.demo as demo

    asked = []
    monkeypatch.setenv("EP_PLUGIN_TIMEOUT_S", "1000")
    monkeypatch.setattr(demo, "run_ranks",
                        lambda fn, ranks, spec, **kwargs: asked.append(kwargs["timeout_s"]) or TRAINED)
    assert demo.main(["--steps", "1", "--ranks", "2", "--device", "cpu", "--backend", "reference"]) == 0
    assert asked[0] > 1000, asked
