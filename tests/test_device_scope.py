"""The C++ entry points' DeviceScope: makes the buffer's device current and gives the caller's back; and
check_cuda, which raises a failed call's error once (not again at the next launch's check).

It runs here on a stand-in for the CUDA runtime (tests/cpp/device_scope_check.cpp), built with the host
compiler and the CUDA headers, so its logic is checked on every machine: with one GPU, or none, the caller's
device is always the buffer's and the real check (two GPUs, tests/test_streams.py) cannot run. A scope that
never switched (it once built another scope in its place, recursing until the stack ran out) fails here.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _nvcc():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def test_device_scope_switches_to_the_buffers_device_and_gives_the_callers_back(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc (it builds the extension too)")
    binary = tmp_path / "device_scope_check"
    # nvcc as the host compiler's driver (it knows where the CUDA headers are); no CUDA runtime linked: the
    # check defines the calls DeviceScope makes.
    build = subprocess.run([nvcc, "-x", "c++", "-std=c++17", "-cudart", "none", f"-I{ROOT / 'csrc' / 'include'}",
                            str(ROOT / "tests" / "cpp" / "device_scope_check.cpp"), "-o", str(binary)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stdout, run.stderr)
