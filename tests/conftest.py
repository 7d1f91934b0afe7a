"""Shared pytest setup: the ``gpu`` marker, the ``--require-gpu`` switch, the ``ep_megatron`` fixture.

A GPU test module declares itself with one line and no import-time checks:

    pytestmark = pytest.mark.gpu

(or ``@pytest.mark.gpu`` on single tests). Such tests need a CUDA device and the compiled
extension ``ep_plugin._C`` (``pytest.mark.gpu(extension=False)``: a CUDA device only). Where one
is missing they skip with the reason on a machine without a CUDA device (CI), and fail with it where
torch sees one, or under ``--require-gpu`` (or ``EP_PLUGIN_REQUIRE_GPU=1``), so that a run on a GPU
machine cannot come out green having run no kernel (an extension that did not build, or does not
import). ``EP_PLUGIN_REQUIRE_GPU=0`` makes them skip there too. The module must import without CUDA
and without the extension (collection comes before the check): keep CUDA work inside test and rank
functions, never at module level.
"""

import functools
import os
import signal
import sys
import threading
from typing import Optional

import pytest
import torch

# Rank processes are spawned: they import worker functions from this folder by module name.
sys.path.insert(0, os.path.dirname(__file__))

REQUIRE_GPU_ENV = "EP_PLUGIN_REQUIRE_GPU"


def pytest_configure(config):
    # A timeout's SIGTERM (the GPU stages run pytest under `timeout`) stops the session as Ctrl-C does: pytest
    # then prints what failed so far, where SIGTERM ended it with no summary. (The launcher cleans its ranks
    # up first and then hands SIGTERM on to this handler.)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop_like_ctrl_c)


def _stop_like_ctrl_c(signum, frame):
    raise KeyboardInterrupt(f"signal {signum} (SIGTERM)")


def pytest_addoption(parser):
    parser.addoption("--require-gpu", action="store_true", default=False,
                     help="tests marked gpu fail instead of skipping when CUDA or the compiled ep_plugin._C is "
                          f"missing (also {REQUIRE_GPU_ENV}=1)")


def require_gpu(config) -> bool:
    """Whether a GPU test that cannot run fails (else it skips): asked for, or by default where torch sees a
    CUDA device (on a GPU machine a kernel test that cannot run means the extension did not build)."""
    if config.getoption("--require-gpu"):
        return True
    value = os.environ.get(REQUIRE_GPU_ENV, "").strip()
    if value:
        return value != "0"
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def gpu_missing_reason(extension: bool = True) -> Optional[str]:
    """Why GPU tests cannot run here, or None when a CUDA device (and the extension) are usable."""
    from ep_plugin import _cuda

    reasons = []
    if not torch.cuda.is_available():
        reasons.append(f"torch sees no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    if extension and _cuda._module is None:
        reasons.append(f"ep_plugin._C is not built or does not import ({_cuda._import_error})")
    elif extension and torch.cuda.is_available() and not _cuda.available():
        reasons.append(f"ep_plugin._C sees no CUDA device ({_cuda.describe()})")
    return "; ".join(reasons) or None


def pytest_report_header(config):
    reason = gpu_missing_reason()
    mode = "fail" if require_gpu(config) else "skip"
    return f"ep_plugin GPU tests: {'run' if reason is None else f'{mode} ({reason})'}"


def _gpu_missing_for(item) -> Optional[str]:
    marker = item.get_closest_marker("gpu")
    return None if marker is None else gpu_missing_reason(bool(marker.kwargs.get("extension", True)))


def pytest_runtest_setup(item):
    reason = _gpu_missing_for(item)
    if reason is not None and not require_gpu(item.config):
        pytest.skip(f"needs a CUDA GPU: {reason}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    # Under --require-gpu the test fails (reported FAILED, not skipped) before its body runs.
    reason = _gpu_missing_for(item)
    if reason is not None:
        why = ("--require-gpu" if item.config.getoption("--require-gpu") else f"{REQUIRE_GPU_ENV} is set"
               if os.environ.get(REQUIRE_GPU_ENV, "").strip() else
               f"torch sees a CUDA GPU ({REQUIRE_GPU_ENV}=0 makes these tests skip here)")
        pytest.fail(f"GPU test cannot run ({why}): {reason}", pytrace=False)


@pytest.fixture
def extension(request):
    """The compiled ``ep_plugin._C``, for tests that need it but no GPU (host code, argument structs): they
    skip without it, and fail where GPU tests fail (``require_gpu``: on a GPU machine a missing extension is
    a failed build)."""
    from ep_plugin import _cuda

    if _cuda._module is None:
        reason = f"ep_plugin._C is not built or does not import ({_cuda._import_error})"
        if require_gpu(request.config):
            pytest.fail(f"the extension is required here: {reason}", pytrace=False)
        pytest.skip(reason)
    return _cuda._module


@pytest.fixture
def ep_megatron():
    """ep_plugin.integrations.megatron, installed; restored to Megatron's original state afterwards
    (test_megatron_integration.py, test_nemo_bridge.py). Imports Megatron only when a test uses it."""
    import ep_plugin.integrations.megatron as adapter

    was_installed = adapter.is_installed()
    adapter.install()
    yield adapter
    if not was_installed:
        adapter.uninstall()
    else:
        adapter.install(replace_builtin=False)
