"""The package builds and installs on a machine without nvcc, with its Megatron / NeMo adapters."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_without_nvcc_has_the_package_and_no_extension(tmp_path):
    source = tmp_path / "src"
    # A clean copy of the sources (no build/ left over from an nvcc build).
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns("build", ".venv", "*.so", "*.egg-info", ".git",
                                                                "__pycache__", ".whl", "bench_out"))
    env = {**os.environ, "EP_PLUGIN_NO_CUDA": "1"}
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w",
                             str(tmp_path / "wheels"), str(source)], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("ep_plugin-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "ep_plugin/integrations/__init__.py" in names
    assert "ep_plugin/integrations/megatron/manager.py" in names
    # One import identity: a top-level `integrations` package would hold its own install state.
    assert not [n for n in names if n.startswith("integrations/")]
    assert "ep_plugin/backends/reference.py" in names
    assert not [n for n in names if n.startswith("ep_plugin/_C")]
