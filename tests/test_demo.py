"""The main job: the README's demo command trains, and its loss goes down."""

import re
import subprocess
import sys

from ep_plugin.demo import DemoSpec, train
from ep_plugin.testing import run_ranks


def test_demo_command_loss_decreases_on_4_ranks():
    result = subprocess.run([sys.executable, "-m", "ep_plugin", "demo", "--ranks", "4", "--steps", "20",
                             "--device", "cpu", "--backend", "reference"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    losses = [float(v) for v in re.findall(r"step +\d+ +loss ([0-9.]+)", result.stdout + result.stderr)]
    assert len(losses) == 20
    assert losses[-1] < 0.6 * losses[0], losses


def test_every_rank_sees_the_same_global_loss():
    spec = DemoSpec(steps=3, tokens_per_rank=32, hidden_size=16, ffn_size=16, num_experts=4)
    per_rank = run_ranks(train, 2, spec, timeout_s=120)
    assert per_rank[0] == per_rank[1] and len(per_rank[0]) == 3


def test_demo_rejects_experts_not_divisible_by_ranks():
    result = subprocess.run([sys.executable, "-m", "ep_plugin", "demo", "--ranks", "3", "--experts", "8",
                             "--device", "cpu"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "divisible" in result.stderr
