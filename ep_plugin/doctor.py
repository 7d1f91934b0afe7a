"""``python -m ep_plugin doctor``: say what will work on this machine before a job hangs or crashes.

Prints the fabric model (``transport.fabric``) as tables, then one verdict per path, each
problem with its fix on one line:

- NVLink domain (the ``hybrid`` / ``elastic`` kernels): GPUs, driver, extension, peer access,
  co-residency of spin-waiting kernels;
- scale-out (NCCL): GPUDirect RDMA via DMA-BUF / via nvidia-peermem / staged through host
  memory / TCP sockets / unavailable, and why;
- MPS, for ranks that share a GPU;
- gloo, which carries the host words of an NCCL group (and Megatron's own gloo groups);
- the EP_PLUGIN_* knobs, and the installed megatron-core against the versions the integration takes.

``--backend NAME``, ``--scaleout [gdr|rdma|socket]`` and ``--nodes N`` (N > 1: at least sockets) name
the paths the job needs: the exit code is 1 when one of them cannot work, else 0. ``--json`` prints
the same as one JSON object. ``--nccl-probe`` lets a 2-rank NCCL init decide the scale-out mode from
its own log.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

from . import _cuda
from .transport import nccl_probe
from .transport.fabric import Fabric, ib_hca_selects, nccl_list_picks, probe_fabric
from .transport.sizing import SmSizing, autosize_sms, co_residency_limit

OK, DEGRADED, UNAVAILABLE, NOT_NEEDED = "ok", "degraded", "unavailable", "not needed"
UNCHECKED = "not checked"  # a path doctor knows nothing of (a third-party backend): never shown as ok
KERNEL_BACKENDS = ("hybrid", "elastic")
GIB = 1 << 30
# The kernel counts every host page an RDMA NIC registers against RLIMIT_MEMLOCK: NCCL's queues, and its
# staging buffers when GPUDirect RDMA is off. ep_plugin registers nothing itself and NCCL's need depends
# on its channels and peers, so this is a floor with room, not a computed size: the common defaults
# (64 KiB, 8 MiB) have made NCCL init fail. Unlimited is always fine.
MEMLOCK_NEEDED_BYTES = GIB
# Ranks one NVLink domain's compiled kernels serve (the extension's MAX_RANKS, csrc/include/ep/limits.h).
MAX_DOMAIN_RANKS = getattr(_cuda._module, "MAX_RANKS", 32)


@dataclass
class Problem:
    text: str
    fix: str


@dataclass
class Verdict:
    """One path's verdict. ``passed`` is what the exit code reads when the user ``asked`` for it."""

    path: str  # "nvlink", "scaleout", "mps", "gloo", "backend"
    title: str
    status: str  # ok / degraded / unavailable / not needed / not checked
    summary: str
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    mode: Optional[str] = None  # scale-out mode
    asked: bool = False
    passed: bool = True


@dataclass
class Options:
    backend: Optional[str] = None
    scaleout: Optional[str] = None  # "gdr", "rdma", "socket"
    ranks_per_gpu: int = 1
    nodes: int = 1
    num_experts: int = 256
    hidden: int = 7168


def _extension_state() -> tuple[bool, str]:
    if _cuda._module is None:
        return False, f"ep_plugin._C is not built ({_cuda._import_error})"
    return True, "ep_plugin._C is built"


def _registered_backends() -> list[str]:
    from .registry import list_backends

    return list(list_backends())


def _config(environ: Mapping[str, str]):
    from .config import Config

    return Config.from_env(dict(environ))


# ---- verdicts ---------------------------------------------------------------------------------

def _peer_groups(fabric: Fabric) -> list[list[int]]:
    """GPUs grouped so that every two GPUs of a group map each other's memory, in ordinal order (each GPU joins
    the first group all of whose GPUs it maps both ways). Not connected components: on a DGX-1's hybrid cube
    mesh GPU 0 maps 4 and 4 maps 5, but 0 cannot map 5, and one CUDA IPC domain needs every pair."""
    access = fabric.driver.peer_access

    def mutual(i: int, j: int) -> bool:
        return i < len(access) and j < len(access) and j < len(access[i]) and i < len(access[j]) \
            and bool(access[i][j]) and bool(access[j][i])

    groups: list[list[int]] = []
    for gpu in range(len(fabric.gpus)):
        for group in groups:
            if all(mutual(gpu, member) for member in group):
                group.append(gpu)
                break
        else:
            groups.append([gpu])
    return groups


def _detected_domain_size(fabric: Fabric, ranks_per_gpu: int) -> int:
    """The domain size ``detect_topology`` finds for one node's ranks, placed in blocks of ``ranks_per_gpu``
    per GPU in ordinal order (the rule is topology's own, so the advice matches what a job does)."""
    from .topology import mappable_domain_size

    placements = [{"host": "", "gpu": gpu.info.index, "peers": gpu.peers}
                  for gpu in fabric.gpus for _ in range(max(1, ranks_per_gpu))]
    return mappable_domain_size(placements)


def _domain_sizes(fabric: Fabric, options: Options, environ: Optional[Mapping[str, str]]) -> tuple[int, int]:
    """(forced, detected): EP_PLUGIN_SCALEUP_SIZE (0 where unset, or where a knob does not parse: the knobs'
    verdict reports that) and the domain size ``detect_topology`` finds here."""
    try:
        forced = _config(os.environ if environ is None else environ).scaleup_size
    except (ValueError, TypeError):
        forced = 0
    return forced, _detected_domain_size(fabric, options.ranks_per_gpu)


def _no_gpu_reason(fabric: Fabric) -> Optional[Problem]:
    if fabric.gpus:
        return None
    if not fabric.driver.loaded:
        if fabric.pci_nvidia_gpus:
            return Problem(f"NVIDIA GPU(s) on the PCI bus ({', '.join(fabric.pci_nvidia_gpus)}) but no CUDA driver: "
                           f"{fabric.driver.error}", "install / load the NVIDIA driver (nvidia.ko and libcuda.so.1)")
        return Problem(f"no GPU: no NVIDIA GPU on the PCI bus, {fabric.driver.error}",
                       "run on a machine with an NVIDIA GPU; here only the 'reference' backend works (CPU, gloo)")
    why = fabric.driver.error or "the driver reports 0 devices"
    return Problem(f"no GPU visible to CUDA: {why}", "check CUDA_VISIBLE_DEVICES and that the GPU is not in a "
                                                     "failed state (dmesg)")


def nvlink_verdict(fabric: Fabric, options: Options, environ: Mapping[str, str], extension: tuple[bool, str],
                   registered: list[str], runtime_version: Optional[int] = None) -> Verdict:
    """``runtime_version``: the CUDA runtime the extension was built with (``_cuda.runtime_version``)."""
    verdict = Verdict("nvlink", "NVLink domain (hybrid / elastic kernels)", OK, "",
                      asked=options.backend in KERNEL_BACKENDS)
    problems = verdict.problems
    if options.backend in KERNEL_BACKENDS and options.backend not in registered:
        problems.append(Problem(f"backend {options.backend!r} is not in this build (registered: "
                                f"{', '.join(registered)})", "upgrade ep_plugin, or use --backend hybrid"))
        verdict.status = UNAVAILABLE
    no_gpu = _no_gpu_reason(fabric)
    if no_gpu is not None:
        problems.append(no_gpu)
        verdict.status, verdict.summary = UNAVAILABLE, "unavailable: no GPU"
        verdict.passed = False
        return verdict
    if fabric.driver.error:
        problems.append(Problem(f"the driver probe stopped early: {fabric.driver.error}",
                                "check dmesg / the GPU's health; the tables may be incomplete"))
        verdict.status = _worst(verdict.status, DEGRADED)
    if fabric.driver.nvml_error:
        verdict.notes.append(f"NVLink state unknown: {fabric.driver.nvml_error}")
    built, why = extension
    if not built:
        archs = ";".join(sorted({"%d%d" % gpu.info.compute_capability for gpu in fabric.gpus}))
        build_for = "" if archs == "90" else f'EP_PLUGIN_CUDA_ARCHS="{archs}" '  # the default build is sm_90's
        problems.append(Problem(why, f"reinstall with nvcc on PATH: pip install pybind11, then {build_for}pip "
                                     f"install --no-build-isolation -e ."))
        verdict.status = UNAVAILABLE
    too_old = _driver_too_old(runtime_version, fabric.driver.driver_version) if built else None
    if too_old is not None:
        problems.append(too_old)
        verdict.status = UNAVAILABLE
    torch_problem = _torch_cannot_use_gpus(fabric)
    if torch_problem is not None:
        problems.append(torch_problem)
        verdict.status = UNAVAILABLE
    gpus = fabric.gpus
    in_mig = [gpu.info.index for gpu in gpus if gpu.info.mig_enabled]
    if in_mig:  # NVIDIA's MIG guide: no CUDA IPC between MIG devices, and no peer access or NVLink under MIG
        problems.append(Problem(f"GPU(s) {in_mig} in MIG mode: CUDA IPC and peer access are not supported there, so "
                                "ranks cannot map each other's buffers (the hybrid / elastic kernels need that)",
                                "turn MIG off on them (nvidia-smi -i <gpu> -mig 0 as root, then reset the GPU); "
                                "'reference' runs on MIG devices over NCCL meanwhile"))
        verdict.status = UNAVAILABLE
    groups = _peer_groups(fabric)
    if len(gpus) == 1:
        verdict.summary = f"1 GPU ({gpus[0].info.name}): its ranks share memory through CUDA IPC"
    elif len(groups) == 1:
        links = [gpu.info.nvlink_active_links for gpu in gpus]
        if all(links):
            verdict.summary = (f"{len(gpus)} GPUs, all peer-accessible over NVLink ({min(links)}+ active links, "
                               f"~{min(g.nvlink_gbytes_per_s for g in gpus):g} GB/s per GPU)")
        elif any(link == 0 for link in links):
            verdict.summary = f"{len(gpus)} GPUs, peer-accessible over PCIe (no active NVLink)"
            problems.append(Problem("peer access without NVLink runs over PCIe: correct, several times slower",
                                    "use NVLink-connected GPUs for the hybrid / elastic kernels"))
            verdict.status = _worst(verdict.status, DEGRADED)
        else:
            verdict.summary = f"{len(gpus)} GPUs, all peer-accessible (NVLink state unknown: " \
                              f"{fabric.driver.nvml_error or 'NVML gave no answer'})"
    else:
        sizes = [len(group) for group in groups]
        verdict.summary = f"{len(gpus)} GPUs in {len(groups)} peer-access groups {groups}"
        detected = _detected_domain_size(fabric, options.ranks_per_gpu)
        fix = f"nothing to set: detection makes NVLink domains of {detected} rank(s) on its own"
        if detected < math.gcd(*sizes) * max(1, options.ranks_per_gpu):
            fix += "; list each group's GPUs next to each other in CUDA_VISIBLE_DEVICES for larger domains"
        problems.append(Problem(f"not every GPU can map every other's memory (groups of {sizes})", fix))
        verdict.status = _worst(verdict.status, DEGRADED)
    if in_mig:
        verdict.summary = f"unavailable: GPU(s) {in_mig} in MIG mode (no CUDA IPC between ranks)"
    for gpu in gpus:
        major, minor = gpu.info.compute_capability
        mismatch = _cuda.arch_mismatch((major, minor))
        if mismatch:  # the installed kernels cannot run there
            problems.append(Problem(f"GPU {gpu.info.index}: {mismatch[0]}", mismatch[1]))
            verdict.status = _worst(verdict.status, UNAVAILABLE)
        elif major < 9 and not _cuda.built_archs():  # not built here: the default build targets sm_90
            problems.append(Problem(f"GPU {gpu.info.index} is sm_{major}{minor}; the extension's default build "
                                    f"targets sm_90", f"build with EP_PLUGIN_CUDA_ARCHS={major}{minor}"))
            verdict.status = _worst(verdict.status, DEGRADED)
    _check_scaleup_size(fabric, options, environ, verdict)
    _check_co_residency(fabric, options, environ, verdict)
    verdict.passed = verdict.status != UNAVAILABLE
    return verdict


def _driver_too_old(runtime_version: Optional[int], driver_version: Optional[int]) -> Optional[Problem]:
    """A driver whose CUDA major version is older than the extension's runtime's starts none of its kernels
    (CUDA's minor-version compatibility holds within one major version only)."""
    if runtime_version is None or driver_version is None or runtime_version // 1000 <= driver_version // 1000:
        return None
    built = f"{runtime_version // 1000}.{runtime_version % 1000 // 10}"
    has = f"{driver_version // 1000}.{driver_version % 1000 // 10}"
    needs = " (R580 or newer)" if runtime_version // 1000 == 13 else ""
    return Problem(f"ep_plugin._C was built with CUDA {built}; this driver supports CUDA {has}: the extension sees "
                   f"no CUDA device", f"update the NVIDIA driver to one for CUDA {runtime_version // 1000}{needs}, "
                   f"or rebuild ep_plugin with a CUDA {driver_version // 1000}.x nvcc (CUDA_HOME=...; pip install "
                   f"--no-build-isolation -e .)")


def _cpu_ranks(fabric: Fabric) -> bool:
    """Whether a job's ranks here are CPU processes: no GPU, or a torch that cannot use one."""
    return _no_gpu_reason(fabric) is not None or fabric.torch_cuda is None


def _torch_cannot_use_gpus(fabric: Fabric) -> Optional[Problem]:
    """The extension reaches the GPUs without torch, but the backends take their device, streams and tensors from
    torch: a CPU build of torch, or one built with a CUDA major version newer than the driver's, sees no GPU."""
    driver = fabric.driver.driver_version
    if fabric.torch_cuda is None:
        return Problem("this torch has no CUDA (a CPU or ROCm build: torch.version.cuda is None): the backends take "
                       "their device and tensors from torch, which sees no NVIDIA GPU", "install a CUDA build of "
                       f"torch (its CUDA major version at most the driver's, {fabric.driver.driver_version_text})")
    try:
        major = int(fabric.torch_cuda.split(".")[0])
    except ValueError:
        return None
    if driver is None or major <= driver // 1000:
        return None
    return Problem(f"torch was built with CUDA {fabric.torch_cuda}; this driver supports CUDA "
                   f"{fabric.driver.driver_version_text}: torch sees no GPU",
                   f"update the NVIDIA driver, or install a torch built for CUDA {driver // 1000}.x")


def _check_scaleup_size(fabric: Fabric, options: Options, environ: Mapping[str, str], verdict: Verdict) -> None:
    problem = _scaleup_size_problem(fabric, options, environ)
    if problem is not None:
        verdict.problems.append(problem)
        verdict.status = UNAVAILABLE
    problem = _domain_too_large_problem(fabric, options, environ)
    if problem is not None:
        verdict.problems.append(problem)
        verdict.status = UNAVAILABLE


def _domain_too_large_problem(fabric: Fabric, options: Options, environ: Mapping[str, str]) -> Optional[Problem]:
    """The compiled backends serve at most ``MAX_RANKS`` ranks per NVLink domain (a build past it raises)."""
    if not fabric.gpus:
        return None
    ranks, _ = _autosized_domain(fabric, options, environ)
    if ranks <= MAX_DOMAIN_RANKS:
        return None
    _, detected = _domain_sizes(fabric, options, environ)
    divisors = [size for size in range(MAX_DOMAIN_RANKS, 0, -1) if detected % size == 0]
    return Problem(f"an NVLink domain of {ranks} ranks ({options.ranks_per_gpu} rank(s) per GPU): the hybrid / "
                   f"elastic kernels serve at most {MAX_DOMAIN_RANKS} ranks per domain, so a build raises",
                   f"fewer ranks per GPU, or EP_PLUGIN_SCALEUP_SIZE={divisors[0]} (domains of that many ranks, "
                   f"joined over NCCL)")


def _scaleup_size_problem(fabric: Fabric, options: Options, environ: Mapping[str, str]) -> Optional[Problem]:
    """A forced domain size must divide the detected one, or building any backend on GPU ranks raises EPError
    (the topology every build settles first)."""
    if not fabric.gpus:
        return None
    forced, detected = _domain_sizes(fabric, options, environ)
    if not forced or detected % forced == 0:
        return None
    return Problem(f"EP_PLUGIN_SCALEUP_SIZE={forced} does not divide the NVLink domain of {detected} rank(s) found "
                   f"here ({options.ranks_per_gpu} rank(s) per GPU, --ranks-per-gpu): building a backend raises "
                   f"EPError", f"unset EP_PLUGIN_SCALEUP_SIZE (0 = detect) or set a divisor of {detected}")


def _check_co_residency(fabric: Fabric, options: Options, environ: Mapping[str, str], verdict: Verdict) -> None:
    try:
        config = _config(environ)
    except (ValueError, TypeError):
        verdict.notes.append("co-residency not checked: an EP_PLUGIN_* value is refused (the knobs' verdict)")
        return
    real_sms = min(gpu.info.sm_count for gpu in fabric.gpus)
    device_sms = config.max_sms_per_gpu or real_sms
    if config.max_sms_per_gpu and real_sms > 0 and config.max_sms_per_gpu > real_sms:
        verdict.problems.append(Problem(f"EP_PLUGIN_MAX_SMS_PER_GPU={config.max_sms_per_gpu} is more than the "
                                        f"{real_sms} SMs this GPU has: the backends size their grids for SMs that "
                                        f"are not there, and spin-waiting kernels that cannot all be resident "
                                        f"can deadlock", f"EP_PLUGIN_MAX_SMS_PER_GPU={real_sms} or less (or unset it)"))
        verdict.status = _worst(verdict.status, DEGRADED)
        device_sms = real_sms  # a grid set below is judged against the SMs that are there
    if device_sms <= 0:
        verdict.notes.append("co-residency not checked: the driver did not report the SM count")
        return
    sharing = max(1, options.ranks_per_gpu)
    percentage = fabric.mps.active_thread_percentage
    limit = co_residency_limit(device_sms, sharing, percentage)
    where = f"{sharing} rank(s) x {{}} SMs on a GPU that offers {device_sms} SMs" + \
        (f" (MPS active threads {percentage:g}%)" if percentage else "")
    if limit < 1:
        verdict.problems.append(Problem(f"{sharing} ranks share a GPU with {device_sms} SMs: not one block each "
                                        f"can be resident", "run fewer ranks per GPU"))
        verdict.status = UNAVAILABLE
        return
    # Across domains (more than one node, or a forced domain smaller than the one found) the domain kernels
    # run forward_sms blocks where it is set, and a build past the limit is refused on every rank.
    forced, detected = _domain_sizes(fabric, options, environ)
    node_ranks = len(fabric.gpus) * sharing  # a node whose GPUs do not all map each other's memory splits too
    across_domains = options.nodes > 1 or 0 < forced < detected or detected < node_ranks
    knob, grid = (("EP_PLUGIN_FORWARD_SMS", config.forward_sms) if across_domains and config.forward_sms else
                  ("EP_PLUGIN_NUM_SMS", config.num_sms))
    if grid > limit:
        # The build checks the grid against EP_PLUGIN_MAX_SMS_PER_GPU where set: one above the SMs there lets it pass.
        build_limit = co_residency_limit(config.max_sms_per_gpu or device_sms, sharing, percentage)
        refused = "a build is refused" if grid > build_limit else \
            "a build is not refused (EP_PLUGIN_MAX_SMS_PER_GPU counts SMs that are not there)"
        verdict.problems.append(Problem(where.format(grid) + f" ({knob}): the spin-waiting kernels cannot all be "
                                        f"resident and would deadlock; {refused}",
                                        f"{knob}={limit}" + (" (or 0 to autosize)" if knob == "EP_PLUGIN_NUM_SMS" else
                                                             " (or 0: EP_PLUGIN_NUM_SMS's)")))
        verdict.status = UNAVAILABLE
    else:
        shown = "autosized" if grid == 0 else str(grid)
        verdict.notes.append(f"co-residency: {where.format(shown)}: fits (limit {limit} per rank)")


def scaleout_verdict(fabric: Fabric, options: Options, environ: Mapping[str, str],
                     probe: Optional[nccl_probe.NcclProbeResult] = None) -> Verdict:
    # More than one node crosses nodes whatever --scaleout says: at least some path must work.
    least = options.scaleout or ("socket" if options.nodes > 1 else None)
    verdict = Verdict("scaleout", "scale-out (NCCL across nodes)", OK, "", asked=least is not None)
    cpu_ranks = options.backend in (None, "reference") and _cpu_ranks(fabric)
    if cpu_ranks or (options.backend == "reference" and options.ranks_per_gpu > 1):
        # A job of CPU ranks (no GPU or no CUDA torch here, so no other backend), or reference's ranks sharing
        # a GPU (NCCL refuses two ranks on one GPU, so their group is gloo, staged through the host): reference
        # crosses nodes over gloo, TCP sockets.
        verdict.mode, verdict.title = nccl_probe.SOCKET, "scale-out (gloo across nodes)"
        why = (("no GPU" if _no_gpu_reason(fabric) is not None else "a torch without CUDA") + ", so CPU ranks"
               if cpu_ranks else f"{options.ranks_per_gpu} ranks share each GPU (NCCL takes one), so a gloo group")
        verdict.summary = f"{nccl_probe.SOCKET}: {why}; the reference backend uses gloo (TCP)"
        verdict.status = DEGRADED
        verdict.passed = nccl_probe.RANK[nccl_probe.SOCKET] >= nccl_probe.REQUIREMENTS.get(least or "", 0)
        if not verdict.passed:
            ranks, remedy = (("CPU ranks", "run on GPUs with RDMA NICs") if cpu_ranks else
                             ("ranks sharing a GPU", "one rank per GPU, whose group can be NCCL"))
            verdict.problems.append(Problem(
                f"--scaleout {options.scaleout} asks for RDMA between nodes; {ranks} cross nodes over gloo "
                f"(TCP sockets) only", f"--scaleout socket for {ranks} (or {remedy})"))
        if probe is not None and not probe.ran:  # said in the text too, not only in --json
            verdict.notes.append(f"NCCL probe skipped: {probe.reason}")
        return verdict
    mode, summary = _static_scaleout(fabric, environ, verdict)
    if fabric.gpus:
        widths = ", ".join(f"GPU {g.info.index}: {g.scaleout_gbytes_per_s:g}"
                           + ("" if g.scaleout_measured else " (default)") for g in fabric.gpus)
        verdict.notes.append(f"scale-out GB/s per GPU (nearest ACTIVE NICs, shared evenly): {widths}")
    if fabric.queue_pair_cap is not None:
        verdict.notes.append(f"EFA ({fabric.efa_reason}): queue pairs capped at {fabric.queue_pair_cap} per peer")
    if probe is not None:
        if not probe.ran:
            verdict.notes.append(f"NCCL probe skipped: {probe.reason}")
        elif probe.mode is None:
            verdict.notes.append(f"NCCL probe inconclusive ({probe.reason}): {probe.why}")
        else:
            if probe.mode != mode:
                verdict.notes.append(f"the static checks expected '{mode}'; the NCCL log decides")
            mode, summary = probe.mode, f"{probe.why} (NCCL probe)"
        if probe.ran and probe.facts is not None:
            for line in probe.facts.warnings[:5]:
                verdict.notes.append(f"NCCL: {line}")
    verdict.mode = mode
    verdict.summary = f"{mode}: {summary}"
    rank = nccl_probe.RANK[mode]
    verdict.status = OK if rank >= 3 else (DEGRADED if rank >= 1 else UNAVAILABLE)
    if verdict.status == OK and any(p for p in verdict.problems):
        verdict.status = DEGRADED
    required = nccl_probe.REQUIREMENTS.get(least or "", 0)
    verdict.passed = rank >= required and rank > 0
    if probe is not None and probe.ran and not probe.succeeded:
        # The probe's ranks could not run NCCL over the network transport: neither can a job's across nodes,
        # whatever the log lines before the failure said about the path.
        warned = probe.facts.warnings[-1] if probe.facts is not None and probe.facts.warnings else None
        if not probe.log_lines:  # not one NCCL line: its ranks failed before NCCL started
            verdict.problems.append(Problem(
                f"the NCCL probe failed before NCCL started: its ranks left no NCCL log ({probe.reason})",
                "fix what that error names (a GPU torch can use: see the NVLink verdict; the driver), then run "
                "doctor --nccl-probe again"))
            verdict.summary = "unavailable: the NCCL probe failed before NCCL started"
        else:
            verdict.problems.append(Problem(
                f"the NCCL probe failed ({probe.reason})" + (f"; NCCL's last warning: {warned}" if warned else ""),
                "fix what NCCL's warning names (memlock for 'Cannot allocate memory', the NICs' state), then run "
                "doctor --nccl-probe again; NCCL_DEBUG=INFO shows the whole log"))
            verdict.summary = "unavailable: the NCCL probe failed" + (
                f" (its log had said {probe.mode})" if probe.mode is not None else "")
        verdict.status, verdict.passed = UNAVAILABLE, False
        verdict.mode = nccl_probe.UNAVAILABLE
    return verdict


def _kernel_at_least(release: Optional[str], major: int, minor: int) -> Optional[bool]:
    if not release:
        return None
    parts = release.split(".")
    try:  # the minor's leading digits: "5.1-rc3" is 5.1, not 5.13
        return (int(parts[0]), int(re.match(r"\d*", parts[1]).group() or 0)) >= (major, minor)
    except (IndexError, ValueError):
        return None


def _nccl_int(text: Optional[str]) -> Optional[int]:
    """An integer NCCL variable as NCCL reads it (C's strtoll, base 0: leading blanks, a sign, 0x hex, a leading 0
    octal, up to the first other character; a value no digit starts reads 0): None where NCCL keeps its default
    (unset, empty, or past int64)."""
    if not text:
        return None
    match = re.match(r"[ \t\n\v\f\r]*([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)", text)  # C's isspace
    if match is None:
        return 0
    sign, digits = match.groups()
    value = int(digits, 16) if digits[:2].lower() == "0x" else int(digits, 8) if digits[0] == "0" else int(digits)
    value = -value if sign == "-" else value
    return value if -2**63 <= value < 2**63 else None  # ERANGE: NCCL keeps the default


def _static_scaleout(fabric: Fabric, environ: Mapping[str, str], verdict: Verdict) -> tuple[str, str]:
    """The mode sysfs, the driver and the environment predict, with problems and fixes."""
    problems = verdict.problems
    if _no_gpu_reason(fabric) is not None:
        return nccl_probe.UNAVAILABLE, "no GPU (see the NVLink verdict)"
    if fabric.nccl.version is None:
        problems.append(Problem(f"no NCCL: {fabric.nccl.version_error}", "install a CUDA build of torch"))
        return nccl_probe.UNAVAILABLE, "torch has no NCCL"
    no_bootstrap = _nccl_socket_unusable(fabric, environ)
    if no_bootstrap is not None:
        problems.append(no_bootstrap)
        return nccl_probe.UNAVAILABLE, f"NCCL_SOCKET_IFNAME={environ['NCCL_SOCKET_IFNAME']} leaves NCCL no " \
                                       "interface the other nodes reach"
    missing_net = _named_net_missing(fabric, environ)
    if missing_net is not None:
        problems.append(missing_net)
        return nccl_probe.UNAVAILABLE, f"NCCL_NET={environ['NCCL_NET']} names a network NCCL cannot start here"
    forced = _socket_forced_by_env(fabric, environ)
    if forced is not None:
        name = forced.split("=")[0]
        problems.append(Problem(f"{forced} makes NCCL use TCP sockets even where RDMA NICs are present",
                                _unset(fabric, name)))
        return nccl_probe.SOCKET, f"{forced} in {fabric.nccl.config_source.get(name, 'the environment')}"
    if not fabric.rdma_devices:
        problems.append(Problem("no RDMA device in /sys/class/infiniband: NCCL falls back to TCP sockets",
                                "for multi-node EP use InfiniBand / RoCE / EFA NICs with their kernel drivers"))
        return nccl_probe.SOCKET, "no RDMA NIC"
    software = [nic for nic in fabric.rdma_devices if nic.software]
    hardware = [nic for nic in fabric.rdma_devices if not nic.software]
    if software:
        named = "; ".join(f"{nic.name}: software RDMA ({nic.model}), no GPUDirect" for nic in software)
        if not hardware:  # NCCL runs its IB transport over them, staging every transfer through the CPU
            problems.append(Problem(f"{named}; no hardware RDMA NIC",
                                    "for multi-node EP use InfiniBand / RoCE / EFA NICs with their kernel drivers"))
            # That transport still opens the uverbs nodes and pins its staging buffers, as over a real NIC.
            if _uverbs_missing(fabric, problems):
                return nccl_probe.SOCKET, "RDMA devices not reachable from user space"
            _check_memlock(fabric, problems)
            return nccl_probe.STAGED, "software RDMA only"
        verdict.notes.append(f"{named} (not counted; NCCL_IB_HCA=^{','.join(nic.name for nic in software)} "
                             f"keeps NCCL off them)")
    usable = fabric.usable_nics
    if not usable:
        states = ", ".join(f"{nic.name} {'/'.join(p.state for p in nic.ports) or 'no ports'}" for nic in hardware)
        problems.append(Problem(f"no RDMA port is ACTIVE ({states})",
                                "bring the links up: cable, switch port, subnet manager (ports must read ACTIVE)"))
        return nccl_probe.SOCKET, "RDMA NICs present, every port down"
    down = [nic.name for nic in hardware if not nic.usable]
    if down:
        problems.append(Problem(f"NIC(s) {', '.join(down)} have no ACTIVE port; their GPUs use farther NICs",
                                "bring those links up (ports must read ACTIVE)"))
    if _uverbs_missing(fabric, problems):
        return nccl_probe.SOCKET, "RDMA NICs not reachable from user space"
    hca = environ.get("NCCL_IB_HCA", "")
    if hca and not fabric.efa and not any(ib_hca_selects(hca, nic) for nic in usable):
        problems.append(Problem(f"NCCL_IB_HCA={hca} selects none of the usable RDMA NICs "
                                f"({', '.join(nic.name for nic in usable)}): NCCL's IB transport finds no device "
                                "('NET/IB : No device found') and falls back to TCP sockets",
                                _unset(fabric, "NCCL_IB_HCA") + ", or name these NICs there"))
        return nccl_probe.SOCKET, f"NCCL_IB_HCA={hca} selects no NIC"
    if fabric.efa and not fabric.nccl.plugin_may_load:
        problems.append(Problem("EFA needs the aws-ofi-nccl NCCL net plugin and none was found",
                                "install aws-ofi-nccl; set NCCL_NET_PLUGIN or put its lib directory on "
                                "LD_LIBRARY_PATH"))
        return nccl_probe.SOCKET, "EFA without its NCCL plugin"
    _check_memlock(fabric, problems)
    gpus = fabric.gpus
    first = gpus[0].info
    gdr_text = environ.get("NCCL_NET_GDR_LEVEL", "")
    gdr_level = _gdr_level(gdr_text)
    if gdr_level is not None and gdr_level < _NCCL_PATH_TYPES.index("PIX"):  # no NIC is nearer than one switch
        problems.append(Problem(f"NCCL_NET_GDR_LEVEL={gdr_text} disables GPUDirect RDMA (a NIC on PCIe is PIX or "
                                "farther from its GPU)", _unset(fabric, "NCCL_NET_GDR_LEVEL")))
        return nccl_probe.STAGED, "GPUDirect RDMA disabled by NCCL_NET_GDR_LEVEL"
    if any(gpu.info.gpudirect_rdma is False for gpu in gpus):
        problems.append(Problem("the GPU does not support GPUDirect RDMA (attribute 116 is 0)",
                                "use a data-center GPU for RDMA scale-out"))
        return nccl_probe.STAGED, "GPU without GPUDirect RDMA"
    dmabuf_ok, dmabuf_why = _dmabuf_usable(fabric, environ, first)
    peermem = bool(fabric.peermem)
    efa_flags = {nic.efa_gdr for nic in fabric.usable_nics if nic.efa}
    efa_registers = True in efa_flags  # AWS's efa driver registers GPU memory itself (device/gdr)
    # NCCL reads the PCI paths from a topology file where one is given (cloud VMs whose sysfs shows each device
    # on a root of its own ship one): sysfs then says nothing about the distance NCCL sees.
    topology_file = environ.get("NCCL_TOPO_FILE", "")
    if topology_file and os.path.isfile(topology_file):
        verdict.notes.append(f"NCCL_TOPO_FILE={topology_file}: NCCL takes the GPUs' and NICs' PCI paths from that "
                             "file, not from sysfs, so their distance (GPUDirect RDMA or staging) was not judged "
                             "here; doctor --nccl-probe reads NCCL's own choice")
    elif (dmabuf_ok or peermem or efa_registers) and _too_far_for_gdr(fabric, gdr_text, problems):
        return nccl_probe.STAGED, "every GPU's NIC is farther than NCCL_NET_GDR_LEVEL allows"
    else:
        _note_gdr_distance(fabric, verdict)
    if dmabuf_ok:
        also = " (nvidia-peermem is loaded too)" if peermem else ""
        return nccl_probe.GDR_DMABUF, f"DMA-BUF export works on GPU {first.index}{also}"
    if peermem:
        verdict.notes.append(f"DMA-BUF not used: {dmabuf_why}")
        return nccl_probe.GDR_PEERMEM, f"nvidia-peermem loaded ({fabric.peermem[0]})"
    if efa_registers:
        verdict.notes.append(f"DMA-BUF not used: {dmabuf_why}")
        return nccl_probe.GDR_UNSPECIFIED, "the efa driver registers GPU memory itself (its devices' gdr reads 1)"
    if fabric.efa:
        if False in efa_flags:
            problems.append(Problem("the efa driver cannot register GPU memory (its devices' gdr reads 0: it found "
                                    f"no NVIDIA driver to register through), and DMA-BUF is not usable ({dmabuf_why}): "
                                    "NCCL stages every transfer through host memory",
                                    "with the open GPU kernel modules load efa_nv_peermem; else reinstall the EFA "
                                    "installer's efa driver after the NVIDIA driver"))
        else:
            problems.append(Problem(f"EFA without a way to register GPU memory: DMA-BUF is not usable ({dmabuf_why}), "
                                    "and this efa driver does not register it itself (no device/gdr file: the "
                                    "upstream driver): NCCL stages every transfer through host memory",
                                    "install the efa driver of AWS's EFA installer, or use the open GPU kernel "
                                    "modules on Linux >= 5.12 for DMA-BUF"))
        return nccl_probe.STAGED, "EFA without GPUDirect RDMA"
    problems.append(Problem(f"neither nvidia-peermem nor a working DMA-BUF export ({dmabuf_why}): NCCL stages "
                            f"every transfer through host memory ('GPU Direct RDMA Disabled')",
                            "modprobe nvidia_peermem, or use the open GPU kernel modules on Linux >= 5.12 "
                            "for DMA-BUF"))
    return nccl_probe.STAGED, "no GPUDirect RDMA mechanism"


def _unset(fabric: Fabric, name: str) -> str:
    """The fix for an NCCL variable that is in the way, wherever it is set."""
    source = fabric.nccl.config_source.get(name)
    return f"unset {name}" + (f" and remove it from {source} (NCCL's config file)" if source else "")


def _uverbs_missing(fabric: Fabric, problems: list[Problem]) -> bool:
    """No /dev/infiniband/uverbs*: NCCL cannot open any RDMA device, hardware or software, and uses sockets."""
    if fabric.uverbs:
        return False
    problems.append(Problem("no /dev/infiniband/uverbs*: user-space verbs cannot open the NICs",
                            "load ib_uverbs; in a container pass --device=/dev/infiniband"))
    return True


def _check_memlock(fabric: Fabric, problems: list[Problem]) -> None:
    soft, hard = fabric.memlock_soft_bytes, fabric.memlock_hard_bytes
    if soft is None or soft >= MEMLOCK_NEEDED_BYTES:
        return
    if hard is None or hard >= MEMLOCK_NEEDED_BYTES:  # the user can raise it up to the hard limit
        fix = f"ulimit -l {'unlimited' if hard is None else hard // 1024} (the hard limit allows it)"
    else:
        fix = (f"ulimit -l unlimited, after raising the hard limit ({_bytes(hard)}): memlock in "
               f"/etc/security/limits.conf (docker: --ulimit memlock=-1)")
    needed = _bytes(MEMLOCK_NEEDED_BYTES)
    problems.append(Problem(f"memlock limit (ulimit -l) is {_bytes(soft)}, under the {needed} NCCL's RDMA "
                            f"registration may pin: NCCL init can fail with 'Cannot allocate memory'", fix))


def _socket_forced_by_env(fabric: Fabric, environ: Mapping[str, str]) -> Optional[str]:
    """The variable that turns NCCL's RDMA transports off ("NAME=value"), or None."""
    net = environ.get("NCCL_NET", "")
    if net.lower() == "socket":
        return f"NCCL_NET={net}"
    # NCCL reads NCCL_IB_DISABLE as an integer; it turns off only its built-in IB transport, not a net plugin.
    ib_disable = environ.get("NCCL_IB_DISABLE")
    if not fabric.nccl.plugin_may_load and _nccl_int(ib_disable):
        return f"NCCL_IB_DISABLE={ib_disable}"
    return None


def _gloo_socket_names(value: str) -> list[str]:
    """GLOO_SOCKET_IFNAME as torch's gloo groups read it: a value of one character or none is ignored (torch
    looks at longer ones only); else the names between commas as written, a trailing comma ending the list."""
    if len(value) <= 1:
        return []
    names = value.split(",")
    return names[:-1] if names[-1] == "" else names


def _nccl_socket_unusable(fabric: Fabric, environ: Mapping[str, str]) -> Optional[Problem]:
    """NCCL_SOCKET_IFNAME picks the interfaces of NCCL's bootstrap (and of its socket transport), with NCCL's list
    syntax: where it picks none with an address, every NCCL communicator fails to form ("Bootstrap : no socket
    interface found"), one node's too; where it picks loopback ones only, the other nodes cannot reach them."""
    value = environ.get("NCCL_SOCKET_IFNAME", "")
    if not value or not fabric.net_interfaces:
        return None
    addresses = fabric.interface_addresses
    picked = [name for name in fabric.net_interfaces if nccl_list_picks(value, name)]
    if addresses is not None:  # NCCL skips an interface without an address
        picked = [name for name in picked if addresses.get(name)]
    syntax = "a prefix: eth picks eth0 and eth1; =eth0 that name alone; ^lo,docker all but those"
    if not picked:
        return Problem(f"NCCL_SOCKET_IFNAME={value} picks no interface of this host with an address (it has "
                       f"{', '.join(fabric.net_interfaces)}): NCCL's bootstrap finds none ('Bootstrap : no socket "
                       "interface found'), so every NCCL communicator fails to form, one node's too",
                       _unset(fabric, "NCCL_SOCKET_IFNAME") + f", or name this host's interface ({syntax})")
    if addresses is not None and all(_loopback(address) for name in picked for address in addresses[name]):
        others = [name for name in fabric.net_interfaces if name not in picked and addresses.get(name)
                  and not all(_loopback(address) for address in addresses[name])]
        return Problem(f"NCCL_SOCKET_IFNAME={value} picks only {', '.join(picked)}, whose addresses are loopback: "
                       "the other nodes cannot reach NCCL's bootstrap there, so every NCCL communicator across "
                       "nodes fails to connect",
                       f"name the interface the nodes reach each other on (here: {', '.join(others) or 'none'}; "
                       f"{syntax}), or " + _unset(fabric, "NCCL_SOCKET_IFNAME"))
    return None


def _named_net_missing(fabric: Fabric, environ: Mapping[str, str]) -> Optional[Problem]:
    """NCCL_NET picks one network by name; NCCL skips a network that has no device or whose plugin did not load,
    and when the named one is skipped its init fails ("network ... not found"): it does not fall back to
    sockets."""
    net = environ.get("NCCL_NET", "")
    if not net.strip() or net.lower() == "socket":
        return None
    if net != net.strip():  # NCCL compares the name as it is (case aside): "IB " is no network's
        return Problem(f"NCCL_NET={net!r} has blanks around the name, and NCCL compares it as it is: no network is "
                       f"called that, and NCCL init fails ('network {net} not found')",
                       f"NCCL_NET={net.strip()}, or " + _unset(fabric, "NCCL_NET"))
    if net.lower() == "ib":
        ib_disable = environ.get("NCCL_IB_DISABLE")
        why = None
        # NCCL's IB transport also runs over software RDMA (soft-RoCE): it needs an ACTIVE port, hardware or not.
        active = [nic for nic in fabric.rdma_devices if any(port.active for port in nic.ports)]
        hca = environ.get("NCCL_IB_HCA", "")
        # A net plugin may name its network IB too (and NCCL_IB_DISABLE does not turn plugins off).
        if not fabric.nccl.plugin_may_load and _nccl_int(ib_disable):
            why = f"NCCL_IB_DISABLE={ib_disable} turns it off"
        elif not active:
            why = "no RDMA NIC with an ACTIVE port"
        elif not fabric.uverbs:
            why = "no /dev/infiniband/uverbs*"
        elif hca and not any(ib_hca_selects(hca, nic) for nic in active):
            why = f"NCCL_IB_HCA={hca} selects none of {', '.join(nic.name for nic in active)}"
        if why is None:
            return None
        return Problem(f"NCCL_NET={net} names NCCL's IB network, which cannot start here ({why}): NCCL init fails "
                       f"('network {net} not found'), it does not fall back to sockets",
                       _unset(fabric, "NCCL_NET") + " (NCCL then picks what works), or make the NICs usable")
    if fabric.nccl.plugin_may_load:
        return None  # a plugin's network: whether it has devices is the plugin's to say (the probe runs it)
    return Problem(f"NCCL_NET={net} names a network no NCCL net plugin here provides (none found or "
                   f"NCCL_NET_PLUGIN=none): NCCL init fails ('network {net} not found')",
                   _unset(fabric, "NCCL_NET") + ", or install the plugin that provides it")


def _dmabuf_usable(fabric: Fabric, environ: Mapping[str, str], gpu) -> tuple[bool, str]:
    if _nccl_int(environ.get("NCCL_DMABUF_ENABLE")) == 0:  # unset: on; set, read as NCCL reads an integer
        return False, f"NCCL_DMABUF_ENABLE={environ['NCCL_DMABUF_ENABLE']}"
    if fabric.efa and environ.get("OFI_NCCL_DISABLE_DMABUF") == "1":
        return False, "OFI_NCCL_DISABLE_DMABUF=1"
    if gpu.dmabuf_supported is not True:
        return False, f"CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is {gpu.dmabuf_supported}"
    if gpu.dmabuf_export == "not tried":
        pass  # python -m ep_plugin info skips the export: the attribute stands for it
    elif gpu.dmabuf_export != "ok":
        return False, f"live export {gpu.dmabuf_export}"
    if _kernel_at_least(fabric.kernel_release, 5, 12) is False:
        return False, f"Linux {fabric.kernel_release} is older than 5.12"
    return True, "ok"


# NCCL's path types, nearest first (NCCL_NET_GDR_LEVEL takes these names, exactly, up to SYS), and what its old
# numbers 0-4 stand for (a larger number is SYS).
_NCCL_PATH_TYPES = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS")
_OLD_GDR_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS")
_NCCL_DEFAULT_GDR_LEVEL = "PXB"  # NIC and GPU behind PCIe switches, not through the CPU's root complex
# The path type a NIC's affinity to its GPU gives: through one CPU's host bridge(s) is PHB, even between two PCI
# roots of that CPU; SYS crosses the link between CPUs.
_AFFINITY_GDR_LEVEL = {"PCIe switch": "PXB", "PCI root": "PHB", "NUMA node": "PHB", "another CPU": "SYS"}


def _gdr_level(text: str) -> Optional[int]:
    """NCCL_NET_GDR_LEVEL as NCCL reads it, as an index into ``_NCCL_PATH_TYPES``: a path type's name (as it is
    written: "phb" is none), else a leading digit's old number; None where unset or ignored (NCCL's default)."""
    if text in _NCCL_PATH_TYPES:
        return _NCCL_PATH_TYPES.index(text)
    if text[:1] in tuple("0123456789"):
        old = min(_nccl_int(text) or 0, len(_OLD_GDR_LEVELS) - 1)
        return _NCCL_PATH_TYPES.index(_OLD_GDR_LEVELS[old])
    return None


def _too_far_for_gdr(fabric: Fabric, gdr_text: str, problems: list[Problem]) -> bool:
    """Whether every GPU's nearest NIC is farther than NCCL_NET_GDR_LEVEL (``gdr_text``; default PXB) lets NCCL use
    GPUDirect RDMA: then NCCL stages every transfer through host memory (a problem naming the level)."""
    level = _gdr_level(gdr_text)
    allowed = _NCCL_PATH_TYPES.index(_NCCL_DEFAULT_GDR_LEVEL) if level is None else level
    shown = gdr_text if level is not None else \
        f"{_NCCL_DEFAULT_GDR_LEVEL} (the default{f'; {gdr_text!r} is no level NCCL reads' if gdr_text else ''})"
    placed = [g for g in fabric.gpus if g.nearest_nics and g.nic_affinity in _AFFINITY_GDR_LEVEL]

    def needs(gpu) -> int:
        return _NCCL_PATH_TYPES.index(_AFFINITY_GDR_LEVEL[gpu.nic_affinity])

    if not placed or any(needs(g) <= allowed for g in placed):
        return False
    name = _NCCL_PATH_TYPES[max(needs(g) for g in placed)]
    problems.append(Problem(f"every GPU's nearest NIC shares only its {placed[0].nic_affinity} (or less) with it, "
                            f"farther than NCCL_NET_GDR_LEVEL={shown} lets NCCL use GPUDirect RDMA: it stages every "
                            "transfer through host memory",
                            f"give each GPU a NIC behind its PCIe switch (NCCL_IB_HCA); NCCL_NET_GDR_LEVEL={name} "
                            "allows GPUDirect RDMA across that path, which can be slower than the staging: measure "
                            "it"))
    return True


def _note_gdr_distance(fabric: Fabric, verdict: Verdict) -> None:
    far = [f"GPU {g.info.index} ({g.nic_affinity})" for g in fabric.gpus
           if g.nearest_nics and g.nic_affinity != "PCIe switch"]
    if far:
        verdict.notes.append(f"NCCL uses GPUDirect RDMA only up to NCCL_NET_GDR_LEVEL (by default NIC and GPU behind "
                             f"one PCIe switch); {', '.join(far)}: expect host staging unless that level allows it")


def mps_verdict(fabric: Fabric, options: Options) -> Verdict:
    mps = fabric.mps
    verdict = Verdict("mps", "MPS (ranks sharing a GPU)", OK, "")
    state = (f"control daemon running (pipe dir {mps.pipe_directory}"
             + (f", pid {mps.pid})" if mps.pid else ")")) if mps.daemon_running \
        else f"no control daemon (pipe dir {mps.pipe_directory})"
    if mps.control_pipe and not mps.daemon_running:
        why = "its control socket refuses connections" if mps.control_answers is False else \
            f"pid {mps.pid} is not running"
        verdict.notes.append(f"stale MPS pipe directory {mps.pipe_directory}: {why}")
    elif mps.daemon_running and mps.pid_alive is False:
        verdict.notes.append(f"the control daemon's pid {mps.pid} is not visible here (another PID namespace, "
                             "a container sharing the pipe directory); its control socket answers")
    if not fabric.gpus:
        verdict.status, verdict.summary = NOT_NEEDED, f"no GPU; {state}"
        return verdict
    sharing = max(1, options.ranks_per_gpu)
    percentage = mps.active_thread_percentage
    if mps.active_thread_percentage_text is not None and not (percentage is not None and 0 < percentage <= 100):
        what = "is not a number" if percentage is None else "is not a share of the SMs in (0, 100]"
        verdict.problems.append(Problem(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={mps.active_thread_percentage_text!r} "
                                        f"{what}", "set a number in (0, 100] or unset it"))
        verdict.status = DEGRADED
        percentage = None
    if sharing == 1:
        verdict.status, verdict.summary = (NOT_NEEDED if verdict.status == OK else verdict.status,
                                           f"one rank per GPU; {state}")
        return verdict
    verdict.summary = f"{sharing} ranks per GPU; {state}"
    if not mps.daemon_running and not any(gpu.info.mps_enabled for gpu in fabric.gpus):
        verdict.problems.append(Problem("without MPS, ranks sharing a GPU time-slice: a cross-rank flag round trip "
                                        "takes ~2 ms instead of ~26 us",
                                        "nvidia-cuda-mps-control -d (ep_plugin.testing.run_ranks starts a private "
                                        "daemon itself when ranks outnumber GPUs)"))
        verdict.status = DEGRADED
    if percentage is not None and percentage * sharing > 100:
        verdict.problems.append(Problem(f"{sharing} ranks x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={percentage:g}% = "
                                        f"{percentage * sharing:g}% > 100%: co-resident ranks compete for SMs and "
                                        f"spin-waiting kernels can starve each other",
                                        f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={100 // sharing} (or lower)"))
        verdict.status = DEGRADED
    return verdict


def gloo_verdict(fabric: Fabric, options: Options, environ: Mapping[str, str]) -> Verdict:
    """gloo carries the host words of an NCCL group (``EP_PLUGIN_GLOO_HOST_WORDS``) and Megatron's own
    gloo groups. A ``GLOO_SOCKET_IFNAME`` that names an interface this host lacks, or across nodes a host
    name that resolves to loopback (gloo's address when that variable is unset), makes every gloo group
    fail to connect, so building a backend over NCCL fails. Asked with ``--backend``, ``--scaleout`` or
    ``--nodes`` above 1, also with ``EP_PLUGIN_GLOO_HOST_WORDS`` off: Megatron makes gloo groups of its own
    unless told not to (``create_gloo_process_groups``, on by default)."""
    try:
        host_words = _config(environ).gloo_host_words
    except (ValueError, TypeError):
        host_words = True  # the knobs' verdict (config_verdict) reports the bad variable
    verdict = Verdict("gloo", "gloo (the host words of NCCL groups)", OK, "",
                      asked=options.backend is not None or options.scaleout is not None or options.nodes > 1)
    if not host_words:
        verdict.notes.append("EP_PLUGIN_GLOO_HOST_WORDS is off: ep_plugin's host words stay on the NCCL groups; "
                             "Megatron's own gloo groups (create_gloo_process_groups, on by default) still need "
                             "gloo")
    # Whether turning the host words off takes ep_plugin off gloo (not where the job's process group is gloo).
    off_helps = host_words and not (options.backend == "reference" or _cpu_ranks(fabric))
    names = _gloo_socket_names(environ.get("GLOO_SOCKET_IFNAME", ""))
    if not names:
        address = fabric.host_address or "nothing (gloo then takes the loopback address)"
        verdict.summary = f"GLOO_SOCKET_IFNAME unset: gloo uses the address this host's name resolves to, {address}"
        across_nodes = options.nodes > 1 or options.scaleout is not None
        if across_nodes and (fabric.host_address is None or _loopback(fabric.host_address)):
            interfaces = ", ".join(name for name in fabric.net_interfaces if name != "lo") or "?"
            verdict.problems.append(Problem(
                f"this host's name resolves to {address}: the other nodes cannot reach gloo there, so every gloo "
                f"group across nodes (the host words, Megatron's gloo groups) fails to connect",
                f"GLOO_SOCKET_IFNAME=<the interface the nodes reach each other on> (here: {interfaces}), or map "
                f"the host name to a routable address in /etc/hosts"))
            verdict.status = UNAVAILABLE
            verdict.passed = False
        return verdict
    verdict.summary = f"GLOO_SOCKET_IFNAME={','.join(names)}"
    odd = [name for name in names if not name or name != name.strip()]
    if odd:  # no interface has such a name, wherever it runs
        verdict.problems.append(Problem(
            f"GLOO_SOCKET_IFNAME={environ['GLOO_SOCKET_IFNAME']!r} has the name(s) {', '.join(map(repr, odd))}: "
            f"gloo takes each name between commas as written (blanks and empty names included), so every gloo "
            f"group (the host words of an NCCL group, Megatron's gloo groups) fails to form",
            f"GLOO_SOCKET_IFNAME={','.join(name.strip() for name in names if name.strip())}"))
        verdict.status = UNAVAILABLE
        verdict.passed = False
        return verdict
    if not fabric.net_interfaces:
        verdict.notes.append("no /sys/class/net here: the interface names were not checked")
        return verdict
    missing = [name for name in names if name not in fabric.net_interfaces]
    if missing:
        verdict.problems.append(Problem(
            f"GLOO_SOCKET_IFNAME names {', '.join(missing)}, which this host does not have: every gloo group (the "
            f"host words of an NCCL group, Megatron's gloo groups) fails to form",
            f"name this host's interface(s) ({', '.join(fabric.net_interfaces)}) or unset it" + _words_off(off_helps)))
        verdict.status = UNAVAILABLE
        verdict.passed = False
        return verdict
    addresses = fabric.interface_addresses
    if addresses is None:
        verdict.summary += ": present here"
        verdict.notes.append("the interfaces' addresses could not be read here: not checked")
        return verdict
    bare = [name for name in names if not addresses.get(name)]
    across_nodes = options.nodes > 1 or options.scaleout is not None
    local = [name for name in names if addresses.get(name) and all(_loopback(a) for a in addresses[name])]
    if bare:
        verdict.problems.append(Problem(
            f"GLOO_SOCKET_IFNAME names {', '.join(bare)}, which has no address: gloo refuses it (\"Unable to find "
            f"address for\"), so every gloo group (the host words of an NCCL group, Megatron's gloo groups) fails "
            f"to form", _addressed_fix(addresses, off_helps)))
    elif across_nodes and local:
        verdict.problems.append(Problem(
            f"GLOO_SOCKET_IFNAME names {', '.join(local)}, whose only address is loopback: the other nodes cannot "
            f"reach gloo there, so every gloo group across nodes fails to connect",
            _addressed_fix(addresses, off_helps)))
    else:
        verdict.summary += ": present here (" + ", ".join(f"{name}: {addresses[name][0]}" for name in names) + ")"
        return verdict
    verdict.status = UNAVAILABLE
    verdict.passed = False
    return verdict


def _addressed_fix(addresses: dict[str, list[str]], off_helps: bool) -> str:
    """The fix for a GLOO_SOCKET_IFNAME that gloo cannot use: the interfaces with a routable address here."""
    usable = [name for name, found in addresses.items() if any(not _loopback(a) for a in found)]
    return (f"name an interface with a routable address ({', '.join(usable) or 'none here'}) or unset it"
            + _words_off(off_helps))


def _words_off(off_helps: bool) -> str:
    return ("; EP_PLUGIN_GLOO_HOST_WORDS=0 keeps only ep_plugin's host words off gloo (a Megatron job also needs "
            "create_gloo_process_groups=False, then doctor's gloo verdict no longer matters)") if off_helps else ""


def _loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "0:0:0:0:0:0:0:1")


def config_verdict(options: Options, environ: Mapping[str, str]) -> Verdict:
    """The EP_PLUGIN_* knobs as every backend reads them (``Config.from_env``): a value it refuses fails
    every backend's build, reference's too. Asked with ``--backend``."""
    verdict = Verdict("config", "EP_PLUGIN_* knobs", OK, "", asked=options.backend is not None)
    from .config import OTHER_VARIABLES, unknown_variables, variables_set

    unknown = unknown_variables(dict(environ))
    set_here = list(variables_set(dict(environ)))
    others = [name for name in OTHER_VARIABLES if environ.get(name, "").strip()]
    if others:
        verdict.notes.append(f"set here, for the build or the tests (no run reads them): {', '.join(others)}")
    # A typo leaves the knob it meant at its default; said here, next to a refused value too (main keeps
    # from_env's warning from saying it again).
    typos = [Problem(f"{name} is not an ep_plugin knob{hint}: ignored",
                     "fix its name, or unset it (python -m ep_plugin info lists every knob)")
             for name, hint in unknown.items()]
    try:
        _config(environ)
    except (ValueError, TypeError) as exc:
        verdict.problems.append(Problem(str(exc), "fix or unset the EP_PLUGIN_* variable named above"))
        verdict.problems += typos
        verdict.status, verdict.passed = UNAVAILABLE, False
        verdict.summary = "a value is refused: building any backend raises"
        return verdict
    verdict.summary = f"set here: {', '.join(set_here)}" if set_here else "none set (the defaults)"
    if typos:
        verdict.problems += typos
        verdict.status = DEGRADED
    return verdict


def backend_verdict(options: Options, registered: list[str], nvlink: Verdict,
                    scaleup_problem: Optional[Problem] = None) -> Optional[Verdict]:
    """The verdict for ``--backend``: reference works unless a forced domain size fails its build on the GPUs
    (``scaleup_problem``); kernel backends follow the NVLink verdict, which has that problem too."""
    if options.backend is None or options.backend in KERNEL_BACKENDS:
        return None
    if options.backend not in registered:
        return Verdict("backend", f"backend {options.backend!r}", UNAVAILABLE,
                       f"not registered (known: {', '.join(registered)})",
                       [Problem(f"no backend named {options.backend!r}", f"use one of {', '.join(registered)}")],
                       asked=True, passed=False)
    if options.backend == "reference" and scaleup_problem is not None:
        return Verdict("backend", "backend 'reference'", UNAVAILABLE, "its build on these GPUs raises",
                       [scaleup_problem], asked=True, passed=False)
    missing = _no_distributed() if options.backend == "reference" else None
    if missing is not None:
        return Verdict("backend", "backend 'reference'", UNAVAILABLE, "torch.distributed is missing",
                       [Problem(missing, "install a torch build with distributed support (the PyPI wheels have it)")],
                       asked=True, passed=False)
    if options.backend == "reference":
        return Verdict("backend", "backend 'reference'", OK, "torch.distributed all-to-all: works on CPU (gloo) "
                       "and GPU (NCCL)", asked=True)
    return Verdict("backend", f"backend {options.backend!r}", UNCHECKED,
                   "registered (third-party: what it needs is not checked here)", asked=True)


def _no_distributed() -> Optional[str]:
    """Why this torch cannot run the reference backend's collectives (every backend's too), or None."""
    try:
        import torch.distributed as dist
    except Exception as exc:  # noqa: BLE001 - a broken torch is a fact to report
        return f"torch.distributed does not import ({type(exc).__name__}: {exc})"
    if not dist.is_available():
        return "this torch was built without torch.distributed (USE_DISTRIBUTED=0): no process group can be made"
    if not dist.is_gloo_available():
        return "this torch has no gloo: CPU ranks (and ep_plugin's host words) have no process group"
    return None


def megatron_verdict() -> Verdict:
    """The installed megatron-core against the versions the Megatron integration supports. Never asked (a job
    may not use Megatron): shown so that a version the plugin refuses is seen before the job."""
    from .integrations.megatron.compat import MIN_VERSION, PIP_PACKAGE, TESTED_UP_TO

    verdict = Verdict("megatron", "Megatron-Core (moe_flex_dispatcher_backend)", OK, "")
    package_info = _megatron_package_info()
    if package_info is None:
        verdict.status = NOT_NEEDED
        verdict.summary = "not installed; only needed for the Megatron integration"
        return verdict
    text = str(getattr(package_info, "__version__", "?"))
    try:
        found = (int(package_info.MAJOR), int(package_info.MINOR), int(package_info.PATCH))
    except (AttributeError, TypeError, ValueError):
        verdict.status, verdict.summary = UNCHECKED, f"{PIP_PACKAGE} {text}: its version could not be read"
        return verdict
    least = ".".join(map(str, MIN_VERSION))
    verdict.summary = f"{PIP_PACKAGE} {text}"
    if found < MIN_VERSION:
        verdict.status = UNAVAILABLE
        verdict.problems.append(Problem(f"{PIP_PACKAGE} {text} is older than {least}: the integration refuses it",
                                        f"pip install '{PIP_PACKAGE}>={least}'"))
    elif found[:2] > TESTED_UP_TO:
        verdict.status = DEGRADED
        verdict.problems.append(Problem(
            f"{PIP_PACKAGE} {text} is newer than the {'.'.join(map(str, TESTED_UP_TO))}.x the integration was "
            f"written against: the flex dispatcher's contract may have changed", "run the Megatron tests "
            f"(tests/test_megatron_*.py), or pin {PIP_PACKAGE}<{TESTED_UP_TO[0]}.{TESTED_UP_TO[1] + 1}"))
    return verdict


def _megatron_package_info() -> Optional[Any]:
    """megatron/core/package_info.py, read without importing megatron.core (whose import pulls in much of
    Megatron and warns about Transformer Engine and Apex); None when there is none."""
    try:
        spec = importlib.util.find_spec("megatron.core")  # imports the bare ``megatron`` package only
        if spec is None or not spec.submodule_search_locations:
            return None
        path = os.path.join(list(spec.submodule_search_locations)[0], "package_info.py")
        loaded = importlib.util.spec_from_file_location("_ep_plugin_megatron_package_info", path)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
        return module
    except Exception:  # noqa: BLE001 - absent, or no package_info: not a Megatron this doctor can read
        return None


_ORDER = {OK: 0, NOT_NEEDED: 0, UNCHECKED: 0, DEGRADED: 1, UNAVAILABLE: 2}


def _worst(a: str, b: str) -> str:
    return a if _ORDER[a] >= _ORDER[b] else b


def sm_sizing(fabric: Fabric, options: Options, environ: Optional[Mapping[str, str]] = None) -> Optional[SmSizing]:
    """What ``num_sms=0`` would pick on this machine: the compiled backend's own call (``--backend``'s, else
    hybrid's), with its per-SM copy rates and the shape it sizes for (top-``autosize_topk``, bf16 rows of
    ``--hidden``), over the ranks of one NVLink domain (across domains each domain's backend sizes itself)."""
    if not fabric.gpus:
        return None
    backend = _autosizing_backend(options.backend)
    if backend is None:
        return None
    gpu = fabric.gpus[0]
    try:  # the backends size from EP_PLUGIN_MAX_SMS_PER_GPU where it is set
        device_sms = _config(os.environ if environ is None else environ).max_sms_per_gpu or gpu.info.sm_count
    except (ValueError, TypeError):
        device_sms = gpu.info.sm_count
    ranks, experts = _autosized_domain(fabric, options, environ)
    try:
        return autosize_sms(device_sms=device_sms, ranks_sharing_gpu=options.ranks_per_gpu, num_ranks=ranks,
                            num_experts=experts,
                            topk=backend.autosize_topk, hidden_bytes=2 * options.hidden,
                            nvlink_gbytes_per_s=gpu.nvlink_gbytes_per_s if gpu.nvlink_measured else None,
                            scaleout_gbytes_per_s=gpu.scaleout_gbytes_per_s if gpu.scaleout_measured else None,
                            mps_thread_percentage=fabric.mps.active_thread_percentage,
                            sm_read_gbytes_per_s=backend.sm_read_gbytes_per_s,
                            sm_write_gbytes_per_s=backend.sm_write_gbytes_per_s)
    except ValueError:
        return None


def _autosized_domain(fabric: Fabric, options: Options, environ: Optional[Mapping[str, str]]) -> tuple[int, int]:
    """(ranks, experts) of the NVLink domain a backend autosizes for: the domain found here (the ranks whose
    GPUs map each other's memory), or a forced size that divides it (EP_PLUGIN_SCALEUP_SIZE; one that does not
    fails the build, which the NVLink verdict says), with the experts of that many ranks."""
    per_node = len(fabric.gpus) * max(1, options.ranks_per_gpu)
    forced, detected = _domain_sizes(fabric, options, environ)
    ranks = forced if forced and detected % forced == 0 else detected
    return ranks, max(1, options.num_experts * ranks // (per_node * max(1, options.nodes)))


def _autosizing_backend(name: Optional[str]):
    """The compiled backend class whose SM autosize the doctor shows (hybrid unless another is named); None for
    a backend that sizes no grid (reference, a third party's)."""
    from .backends.elastic import ElasticBackend
    from .backends.hybrid import HybridBackend

    return {None: HybridBackend, "hybrid": HybridBackend, "elastic": ElasticBackend}.get(name)


def assess(fabric: Fabric, options: Options, *, environ: Optional[Mapping[str, str]] = None,
           extension: Optional[tuple[bool, str]] = None, registered: Optional[list[str]] = None,
           probe: Optional[nccl_probe.NcclProbeResult] = None, runtime_version: Optional[int] = None
           ) -> list[Verdict]:
    """Every verdict for this fabric; pure given its inputs (the defaults read this process: ``extension``,
    ``registered``, and ``runtime_version``, the extension's CUDA runtime). NCCL's config files
    (``fabric.nccl.config``) count as the environment, under it."""
    environ = fabric.nccl.effective_environ(os.environ if environ is None else environ)
    extension = extension if extension is not None else _extension_state()
    registered = registered if registered is not None else _registered_backends()
    if runtime_version is None:
        runtime_version = _cuda.runtime_version()
    nvlink = nvlink_verdict(fabric, options, environ, extension, registered, runtime_version)
    verdicts = [nvlink, scaleout_verdict(fabric, options, environ, probe), mps_verdict(fabric, options),
                gloo_verdict(fabric, options, environ), config_verdict(options, environ), megatron_verdict()]
    extra = backend_verdict(options, registered, nvlink, _scaleup_size_problem(fabric, options, environ))
    if extra is not None:
        verdicts.insert(0, extra)
    return verdicts


def exit_code(verdicts: list[Verdict]) -> int:
    return 1 if any(v.asked and not v.passed for v in verdicts) else 0


# ---- text -------------------------------------------------------------------------------------

def _table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = [indent + "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += [indent + "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
              for row in rows]
    return lines


def _flag(value: Optional[bool]) -> str:
    return "?" if value is None else ("yes" if value else "no")


def _bytes(value: Optional[int]) -> str:
    if value is None:
        return "unlimited"
    return f"{value / GIB:g} GiB" if value >= GIB else f"{value / (1 << 20):g} MiB"


def _uverbs_text(names: list[str]) -> str:
    if not names:
        return "none in /dev/infiniband"
    shown = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
    return f"{len(names)} device(s) in /dev/infiniband ({shown})"


def gpu_headline(fabric: Fabric) -> str:
    if fabric.gpus:
        names = sorted({g.info.name for g in fabric.gpus})
        first = fabric.gpus[0].info
        return (f"{len(fabric.gpus)} x {', '.join(names)} ({first.sm_count} SMs, sm_{first.compute_capability[0]}"
                f"{first.compute_capability[1]}), driver CUDA {fabric.driver.driver_version_text}")
    return _no_gpu_reason(fabric).text  # type: ignore[union-attr]


def render(fabric: Fabric, verdicts: list[Verdict], sizing: Optional[SmSizing], options: Options,
           environ: Optional[Mapping[str, str]] = None) -> str:
    lines = ["ep_plugin doctor: what will work on this machine", "", "Machine"]
    facts = [
        ["GPUs", gpu_headline(fabric)],
        ["NVIDIA kernel module", fabric.nvidia_module_version or "not loaded"],
        ["Linux", fabric.kernel_release or "unknown"],
        ["memlock limit", f"{_bytes(fabric.memlock_soft_bytes)} (hard {_bytes(fabric.memlock_hard_bytes)})"],
        ["GPUDirect RDMA modules", ", ".join(fabric.peermem) or "none (nvidia_peermem not loaded)"],
        ["RDMA user verbs", _uverbs_text(fabric.uverbs)],
        ["EFA", fabric.efa_reason or "no"],
        ["NCCL", fabric.nccl.version or f"none ({fabric.nccl.version_error})"],
        ["NCCL net plugin", fabric.nccl.net_plugin or ", ".join(fabric.nccl.plugin_libraries) or "none (built-in IB / "
                                                                                                  "socket)"],
        ["MPS", ("running" if fabric.mps.daemon_running else "no control daemon")
         + f" (pipe dir {fabric.mps.pipe_directory})"],
    ]
    lines += _table(["", ""], facts)[1:]
    if fabric.nccl.env:
        lines.append("  env: " + " ".join(f"{k}={v}" for k, v in sorted(fabric.nccl.env.items())))
    for path in sorted(set(fabric.nccl.config_source.values())):
        lines.append(f"  NCCL config file {path} (what the environment does not set): "
                     + " ".join(f"{k}={v}" for k, v in sorted(fabric.nccl.config.items())
                                if fabric.nccl.config_source[k] == path))
    if fabric.gpus:
        lines += ["", "GPUs"]
        rows = []
        for g in fabric.gpus:
            info = g.info
            links = "?" if info.nvlink_active_links is None else str(info.nvlink_active_links)
            rows.append([str(info.index), info.name, str(info.sm_count),
                         f"{info.compute_capability[0]}.{info.compute_capability[1]}", info.pci_bus_id,
                         "?" if g.numa_node is None else str(g.numa_node), links,
                         ",".join(map(str, g.peers)) or "-", _flag(info.gpudirect_rdma),
                         f"{_flag(info.dmabuf_supported)} / {info.dmabuf_export}",
                         f"{','.join(g.nearest_nics) or '-'} ({g.nic_affinity})",
                         f"{g.scaleout_gbytes_per_s:g}" + ("" if g.scaleout_measured else "*")])
        lines += _table(["#", "name", "SMs", "cc", "PCI", "NUMA", "NVLinks", "peers", "GDR", "DMA-BUF attr / export",
                         "nearest NICs", "scale-out GB/s"], rows)
        if not all(g.scaleout_measured for g in fabric.gpus):
            lines.append("  * default: no ACTIVE NIC with a known rate near this GPU")
    if fabric.rdma_devices:
        lines += ["", "RDMA devices (/sys/class/infiniband)"]
        rows = []
        for nic in fabric.rdma_devices:
            for port in nic.ports or ():
                numa = "?" if nic.numa_node is None else str(nic.numa_node)
                rows.append([nic.name, nic.vendor, nic.model, str(port.number), port.state, port.rate_text or "?",
                             port.link_layer, numa, nic.pci_path[-1] if nic.pci_path else "?"])
            if not nic.ports:
                rows.append([nic.name, nic.vendor, nic.model, "-", "no ports", "", "", "", ""])
        lines += _table(["device", "vendor", "model", "port", "state", "rate", "link layer", "NUMA", "PCI"], rows)
    else:
        lines += ["", "RDMA devices: none in /sys/class/infiniband"]
    backend = _autosizing_backend(options.backend)
    if sizing is not None and backend is not None:
        ranks, experts = _autosized_domain(fabric, options, environ)
        lines += ["", f"SM autosize (EP_PLUGIN_NUM_SMS=0) of {backend.name} for the {ranks} ranks of an NVLink "
                      f"domain, {experts} experts, hidden {options.hidden} "
                      f"(sized, as the backend does, for top-{backend.autosize_topk} bf16 rows): {sizing.num_sms} "
                      f"SMs per rank (links could use {sizing.demand:.1f}; co-residency limit {sizing.limit})"]
    lines += ["", "Verdicts"]
    for verdict in verdicts:
        tag = {OK: "ok", NOT_NEEDED: "n/a", UNCHECKED: "?", DEGRADED: "warn", UNAVAILABLE: "FAIL"}[verdict.status]
        if verdict.asked and not verdict.passed:  # what the exit code reads: never shown as a mere warning
            tag = "FAIL"
        asked = " (asked)" if verdict.asked else ""
        lines.append(f"  [{tag:4s}] {verdict.title}{asked}: {verdict.summary}")
        for problem in verdict.problems:
            lines.append(f"         problem: {problem.text}")
            lines.append(f"         fix:     {problem.fix}")
        for note in verdict.notes:
            lines.append(f"         note:    {note}")
    warnings = list(fabric.warnings) + (list(sizing.warnings) if sizing else [])
    if warnings:
        lines += ["", "Warnings"] + [f"  - {text}" for text in warnings]
    return "\n".join(lines)


def summary_line(fabric: Fabric, environ: Optional[Mapping[str, str]] = None) -> str:
    """One line for ``python -m ep_plugin info``."""
    environ = fabric.nccl.effective_environ(os.environ if environ is None else environ)
    mode = scaleout_verdict(fabric, Options(), environ).mode  # as doctor says it (CPU ranks: gloo's sockets)
    nics = fabric.usable_nics
    nic_text = (f"{len(nics)} ACTIVE RDMA NIC(s) ({', '.join(sorted({n.model for n in nics}))})" if nics
                else "no ACTIVE RDMA NIC")
    mps = "MPS daemon running" if fabric.mps.daemon_running else "no MPS daemon"
    return f"{gpu_headline(fabric)}; {nic_text}; scale-out: {mode}; {mps} (details: python -m ep_plugin doctor)"


# ---- command line -----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from .cli import OneLineParser, positive_int

    parser = OneLineParser(
        prog="python -m ep_plugin doctor",
        description="Check this machine for the ep_plugin backends: GPUs and NVLink, RDMA NICs and GPUDirect "
                    "RDMA, NCCL, MPS. Exit code 1 when a path named by --backend / --scaleout cannot work.")
    parser.add_argument("--backend", help="the backend the job will use (reference, hybrid, elastic)")
    parser.add_argument("--scaleout", nargs="?", const="rdma", choices=sorted(nccl_probe.REQUIREMENTS),
                        help="the job crosses nodes; the least acceptable path: gdr (GPUDirect RDMA), rdma "
                             "(the default: staging through host memory is acceptable), socket (anything)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--nccl-probe", action="store_true",
                        help="run a 2-rank NCCL init (2 GPUs needed) whose log decides the scale-out verdict")
    parser.add_argument("--ranks-per-gpu", type=functools.partial(positive_int, maximum=MAX_DOMAIN_RANKS),
                        default=1, help=f"ranks that will share each GPU (default 1; at most {MAX_DOMAIN_RANKS}, the "
                                        "ranks of one NVLink domain)")
    parser.add_argument("--nodes", type=positive_int, default=1,
                        help="nodes of the job: for the SM autosize line; above 1 the job needs a scale-out path "
                             "(at least sockets) and gloo reachable at the host name's address")
    parser.add_argument("--experts", type=positive_int, default=256, help="experts, for the SM autosize line")
    parser.add_argument("--hidden", type=positive_int, default=7168, help="hidden size, for the SM autosize line")
    return parser


def main(argv: Optional[list[str]] = None, *, fabric: Optional[Fabric] = None,
         environ: Optional[Mapping[str, str]] = None) -> int:
    """Run the doctor; ``fabric`` / ``environ`` are injectable for tests. Returns the exit code."""
    from .config import claim_unknown_variables

    args = build_parser().parse_args(argv)
    environ = os.environ if environ is None else environ
    claim_unknown_variables(dict(environ))  # the config verdict names them: no warning on stderr as well
    options = Options(backend=args.backend, scaleout=args.scaleout, ranks_per_gpu=args.ranks_per_gpu,
                      nodes=args.nodes, num_experts=args.experts, hidden=args.hidden)
    fabric = fabric if fabric is not None else probe_fabric(environ=environ)
    probe = nccl_probe.run_nccl_probe(len(fabric.gpus)) if args.nccl_probe else None
    verdicts = assess(fabric, options, environ=environ, probe=probe)
    sizing = sm_sizing(fabric, options, environ)
    code = exit_code(verdicts)
    if args.json:
        payload: dict[str, Any] = {
            "fabric": fabric.to_dict(), "verdicts": [asdict(v) for v in verdicts],
            "sm_autosize": asdict(sizing) if sizing else None,
            "nccl_probe": asdict(probe) if probe else None, "exit_code": code,
        }
        print(json.dumps(payload, indent=2, default=str))
    else:
        print(render(fabric, verdicts, sizing, options, environ))
    return code
