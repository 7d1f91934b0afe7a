"""The package builds and installs on a machine without nvcc, with its Megatron / NeMo adapters."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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


def test_an_nvcc_that_fails_says_how_to_install_without_the_extension(tmp_path):
    """A toolkit too old for the default sm_90 (or without Python headers) failed the install with a bare
    CalledProcessError; the message now names nvcc and EP_PLUGIN_NO_CUDA=1 (the CPU path still works)."""
    toolkit = tmp_path / "cuda" / "bin"
    toolkit.mkdir(parents=True)
    (toolkit / "nvcc").write_text("#!/bin/sh\necho 'nvcc fatal: Unsupported gpu architecture' >&2\nexit 1\n")
    (toolkit / "nvcc").chmod(0o755)
    env = {**os.environ, "CUDA_HOME": str(tmp_path / "cuda")}
    env.pop("EP_PLUGIN_NO_CUDA", None)
    result = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "-b", str(tmp_path / "lib"), "-t",
                             str(tmp_path / "tmp")], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0
    assert f"{toolkit / 'nvcc'} failed" in result.stderr and "EP_PLUGIN_NO_CUDA=1" in result.stderr, result.stderr


def _dev_installs(*arguments: str) -> str:
    """What ``./dev``'s ensure_module would install for ``arguments`` in this interpreter ("" for nothing):
    its definitions taken from the script, pip replaced by a line that names what it would install."""
    script = (ROOT / "dev").read_text()
    start = script.index("VERSION_CHECK='")
    definitions = script[start:script.index("\n}\n", script.index("ensure_module() {")) + 3]
    program = (f"pip_quiet() {{ shift; echo \"would install: $*\"; }}\nPY={sys.executable}\n{definitions}\n"
               f"ensure_module {' '.join(arguments)}\n")
    result = subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_dev_installs_a_module_that_is_missing_or_outside_its_spec():
    """Before: any importable version passed ("megatron-core==0.16.1" was met by whatever megatron the
    interpreter saw, through the .pth of a reused python3 too)."""
    assert _dev_installs("pytest", "'pytest>=1'") == ""
    assert _dev_installs("pytest", "pytest") == ""
    assert _dev_installs("pytest", "'pytest>=999'") == "would install: pytest>=999"
    assert _dev_installs("pytest", "'pytest==0.1'") == "would install: pytest==0.1"
    assert _dev_installs("no_such_module_here", "no-such-module-here") == "would install: no-such-module-here"
    # torch: python3's own build is reused whatever its version (it is the CUDA one on a GPU machine).
    assert _dev_installs("--any-version", "pytest", "'pytest>=999'") == ""


def test_every_pending_gpu_test_names_a_gpu_test_that_exists():
    """scripts/pending_gpu_tests.txt is what the first device call of a session runs: a name that matches
    nothing (a typo, a renamed test) would spend scarce device time on "no tests ran"."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    lines = (root / "scripts" / "pending_gpu_tests.txt").read_text().splitlines()
    for entry in (line.strip() for line in lines if line.strip() and not line.startswith("#")):
        path, _, name = entry.partition("::")
        assert (root / path).is_file(), entry
        if not name:
            continue
        tree = ast.parse((root / path).read_text())
        tests = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
        function = name.partition("[")[0]
        assert function in tests, f"{entry}: no test {function} in {path}"
        # Its own decorators, or the module's pytestmark: the stage selects -m "gpu or megatron".
        module_marks = [ast.unparse(node.value) for node in tree.body if isinstance(node, ast.Assign)
                        and any(getattr(target, "id", None) == "pytestmark" for target in node.targets)]
        marks = " ".join([ast.unparse(d) for d in tests[function].decorator_list] + module_marks)
        assert "mark.gpu" in marks or "mark.megatron" in marks, f"{entry}: not marked gpu or megatron ({marks})"


def test_gpu_tests_that_cannot_run_fail_on_a_machine_with_a_gpu(monkeypatch):
    """On a GPU machine a kernel test that cannot run (the extension did not build, or does not import) fails
    by default: it skipped unless --require-gpu was passed, so ./dev test there came out green having run no
    kernel. Without a GPU (CI) it skips; EP_PLUGIN_REQUIRE_GPU decides where set."""
    import conftest

    class Config:
        def __init__(self, flag):
            self.flag = flag

        def getoption(self, name):
            return self.flag

    monkeypatch.delenv(conftest.REQUIRE_GPU_ENV, raising=False)
    for cuda, flag, env, fails in ((True, False, None, True), (False, False, None, False), (False, True, None, True),
                                   (True, False, "0", False), (False, False, "1", True), (True, False, " ", True)):
        monkeypatch.setattr(conftest.torch.cuda, "is_available", lambda cuda=cuda: cuda)
        if env is None:
            monkeypatch.delenv(conftest.REQUIRE_GPU_ENV, raising=False)
        else:
            monkeypatch.setenv(conftest.REQUIRE_GPU_ENV, env)
        assert conftest.require_gpu(Config(flag)) is fails, (cuda, flag, env)


GPU_TESTS_HERE = """
import pytest

@pytest.mark.gpu
def test_a_kernel():
    pass

@pytest.mark.gpu(extension=False)
def test_cuda_only():
    pass
"""


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine without CUDA: its GPU tests cannot run")
def test_gpu_tests_that_cannot_run_are_reported_failed_not_skipped_when_required(tmp_path):
    """The hooks that act on ``require_gpu``: a pytest run of GPU tests that cannot run here reports them failed
    under EP_PLUGIN_REQUIRE_GPU=1 (a GPU machine whose extension did not build must not come out green) and
    skipped under EP_PLUGIN_REQUIRE_GPU=0 (CI)."""
    shutil.copy(Path(__file__).parent / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    (tmp_path / "test_gpu_here.py").write_text(GPU_TESTS_HERE)
    outcomes = {}
    for required in ("1", "0"):
        env = dict(os.environ, EP_PLUGIN_REQUIRE_GPU=required, PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        outcomes[required] = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    assert "2 failed" in outcomes["1"] and "skipped" not in outcomes["1"], outcomes
    assert "2 skipped" in outcomes["0"] and "failed" not in outcomes["0"], outcomes
