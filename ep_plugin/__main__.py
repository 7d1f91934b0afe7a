"""Command line: ``python -m ep_plugin {demo,info,doctor} ...``."""

from __future__ import annotations

import os
import sys


def info() -> int:
    import torch

    import ep_plugin
    from ep_plugin import _cuda
    from ep_plugin.cli import available_backends, config_problem, default_device, describe_gpus
    from ep_plugin.config import claim_unknown_variables, describe

    unknown = claim_unknown_variables()  # before anything builds a Config: listed below, not warned on stderr
    print(f"ep_plugin {ep_plugin.__version__}, torch {torch.__version__}")
    print(f"GPU: {describe_gpus()}")
    print(f"backends: {', '.join(ep_plugin.list_backends())} (usable here: "
          f"{', '.join(available_backends(default_device())) or 'none'})")
    archs = _cuda.built_archs()
    built = f"built for {', '.join(f'sm_{arch}' for arch in archs)}; " if archs else ""
    print(f"CUDA extension: {built}{_cuda.describe()}")
    print(f"fabric: {_fabric_summary()}")
    problem = config_problem()
    refused = f" REFUSED, every backend's build would raise: {problem}" if problem else ""
    print(f"knobs (default; the value set here, if any):{refused}")
    for variable, hint in unknown.items():  # before the long list, so that `info | head` still shows them
        print(f"  {variable} is set but is not a knob: ignored{hint}")
    for env_name, default, help_text in describe():
        set_here = os.environ.get(env_name, "").strip()
        print(f"  {env_name:36s} {default:10s} {help_text}" + (f"  [set here: {set_here}]" if set_here else ""))
    return 0



def _fabric_summary() -> str:
    from ep_plugin.doctor import summary_line
    from ep_plugin.transport.fabric import probe_fabric

    try:
        return summary_line(probe_fabric(dmabuf_export=False))
    except Exception as exc:  # noqa: BLE001 - info must print the rest even if the probe breaks
        return f"probe failed ({type(exc).__name__}: {exc}); python -m ep_plugin doctor says more"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"demo": "train a small MoE across ranks (the main job)", "info": "versions, backends and knobs",
                "doctor": "what will work on this machine: GPUs, NVLink, RDMA, GPUDirect, NCCL, MPS"}
    if not argv or argv[0] not in commands:
        asked = bool(argv) and argv[0] in ("-h", "--help", "help")
        out = sys.stdout if asked else sys.stderr
        if argv and not asked:
            print(f"python -m ep_plugin: unknown command {argv[0]!r}", file=out)
        print("usage: python -m ep_plugin {demo,info,doctor} [options]", file=out)
        for name, text in commands.items():
            print(f"  {name:6s} {text}", file=out)
        print("python -m ep_plugin demo --help lists the demo's options; python -m ep_plugin.bench --help the "
              "benchmark's.", file=out)
        return 0 if asked else 2
    if argv[0] == "demo":
        from ep_plugin.demo import main as demo_main

        return demo_main(argv[1:])
    if argv[0] == "doctor":
        from ep_plugin.doctor import main as doctor_main

        return doctor_main(argv[1:])
    if argv[1:] in (["-h"], ["--help"]):
        print("usage: python -m ep_plugin info   (versions, the GPU, the backends usable here, the extension, "
              "the fabric and every knob; takes no options)")
        return 0
    if argv[1:]:
        print(f"python -m ep_plugin info: takes no options, got {' '.join(argv[1:])!r} (info --help)", file=sys.stderr)
        return 2
    return info()


def run() -> None:
    """The process entry (``python -m ep_plugin`` and the ``ep-plugin`` console script): ``main``'s status."""
    try:
        status = main()
        sys.stdout.flush()  # here, not at exit, where a closed pipe could no longer be caught
        sys.exit(status)
    except BrokenPipeError:  # `ep-plugin info | head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except KeyboardInterrupt:  # Ctrl-C: the launcher has stopped the ranks on its way out; no traceback
        print("python -m ep_plugin: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    run()
