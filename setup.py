"""Build: the Python package always; the CUDA extension ep_plugin._C when nvcc is found.

The extension is compiled by nvcc alone (pybind11 headers, static CUDA runtime) and never
links libtorch: it talks to torch through data pointers and stream handles, so it does not
need rebuilding when torch changes. Without nvcc the package installs without it and the
CUDA backends report themselves unavailable.

Environment:
  EP_PLUGIN_CUDA_ARCHS   semicolon list of SM versions to build (default "90"; e.g. "80;90;100")
  EP_PLUGIN_NO_CUDA=1    skip the extension even when nvcc is present
  EP_PLUGIN_NVCC_FLAGS   extra nvcc flags, space-separated (e.g. -G, or -DNAME to build a variant)
  CUDA_HOME / nvcc on PATH  which toolkit to use
"""

import concurrent.futures
import glob
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def find_nvcc():
    if os.environ.get("EP_PLUGIN_NO_CUDA", "0") not in ("", "0"):
        return None
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return os.path.join(cuda_home, "bin", "nvcc")
    return shutil.which("nvcc")


class NvccBuildExt(build_ext):
    """Compile ep_plugin._C with nvcc: one object per source, in parallel, then one link."""

    def build_extension(self, ext):
        nvcc = find_nvcc()
        import pybind11

        archs = [a.strip() for a in os.environ.get("EP_PLUGIN_CUDA_ARCHS", "90").split(";") if a.strip()]
        output = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(output), exist_ok=True)
        flags = [
            "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-lineinfo", "--expt-relaxed-constexpr",
            "-I" + os.path.join(ROOT, "csrc", "include"),
            "-I" + os.path.join(ROOT, "csrc"),
            "-I" + pybind11.get_include(),
            "-I" + sysconfig.get_paths()["include"],
        ] + [f"-gencode=arch=compute_{arch},code=sm_{arch}" for arch in archs]
        # The module says what it was built for (_C.BUILT_ARCHS): a GPU outside it is refused by name
        # when a backend is built, not met with CUDA's "no kernel image" at the first launch.
        flags.append(f'-DEP_PLUGIN_BUILT_ARCHS="{";".join(archs)}"')
        flags += os.environ.get("EP_PLUGIN_NVCC_FLAGS", "").split()  # e.g. -DNAME for a measured variant
        object_dir = os.path.join(self.build_temp, "ep_plugin_objects")
        os.makedirs(object_dir, exist_ok=True)
        objects = [os.path.join(object_dir, source.replace("/", "_") + ".o") for source in ext.sources]

        def compile_one(pair):
            source, obj = pair
            subprocess.check_call([nvcc, *flags, "-c", source, "-o", obj], cwd=ROOT)

        print(f"ep_plugin: nvcc {' '.join(flags)} ({len(ext.sources)} sources)", file=sys.stderr)
        try:
            with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                list(pool.map(compile_one, zip(ext.sources, objects, strict=True)))
            subprocess.check_call([nvcc, "-shared", "-cudart", "static", *objects, "-o", output], cwd=ROOT)
        except subprocess.CalledProcessError as error:
            # nvcc's own message is above; say what a CPU-only install needs (the reference backend runs there).
            raise SystemExit(f"ep_plugin: {nvcc} failed ({' '.join(map(str, error.cmd[:2]))} ...: exit status "
                             f"{error.returncode}). Fix the toolkit (EP_PLUGIN_CUDA_ARCHS={';'.join(archs)} needs an "
                             "nvcc that knows those SMs), or install without the CUDA extension (the reference "
                             "backend only): EP_PLUGIN_NO_CUDA=1") from None


# csrc/ holds the shared transport and routing layout; csrc/<backend>/ each backend's kernels.
sources = sorted(glob.glob("csrc/**/*.cu", recursive=True)) + sorted(glob.glob("csrc/**/*.cpp", recursive=True))
# Decided up front: an extension listed but not built breaks editable installs.
ext_modules = [Extension("ep_plugin._C", sources=sources)] if find_nvcc() else []
if not ext_modules:
    print("ep_plugin: nvcc not found (or EP_PLUGIN_NO_CUDA=1); installing without the CUDA extension "
          "(only the reference backend will be available)", file=sys.stderr)

setup(
    name="ep_plugin",
    version="0.1.0",
    description="Expert-parallel dispatch/combine for MoE training: a Megatron-Core / NeMo plugin",
    python_requires=">=3.10",
    packages=find_packages(include=["ep_plugin", "ep_plugin.*"]),
    # The flat layout, said out loud: an editable install is then a plain .pth entry for the
    # checkout (setuptools otherwise installs an import hook and prints a warning box each build).
    package_dir={"": "."},
    ext_modules=ext_modules,
    cmdclass={"build_ext": NvccBuildExt},
    install_requires=["torch>=2.1", "numpy", "tqdm"],
    extras_require={"test": ["pytest", "matplotlib"], "plots": ["matplotlib"],
                    "megatron": ["megatron-core>=0.16.1"]},
    entry_points={"console_scripts": ["ep-plugin=ep_plugin.__main__:run"]},
)
