"""The compiled extension imports without a GPU and says so instead of crashing."""

import subprocess
import sys

import pytest

from ep_plugin import _cuda


def test_import_without_driver_reports_no_device():
    if _cuda._module is None:
        pytest.skip(f"extension not built here: {_cuda._import_error}")
    # A fresh interpreter: importing _C alone must not crash, whatever the machine has.
    code = "import ep_plugin._C as c; print(c.cuda_device_count()); print(c.describe_devices())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    count_line, description = result.stdout.split("\n", 1)
    if int(count_line) == 0:
        assert description.startswith("no CUDA device")
    else:
        assert "cuda:0" in description
    assert _cuda._module.cuda_runtime_version() >= 12000


def test_missing_extension_explains_itself(monkeypatch):
    monkeypatch.setattr(_cuda, "_module", None)
    monkeypatch.setattr(_cuda, "_import_error", ImportError("no module named ep_plugin._C"))
    assert not _cuda.available()
    assert "nvcc" in _cuda.describe()
    with pytest.raises(Exception, match="nvcc"):
        _cuda.extension()
