"""Command line: ``python -m ep_plugin {demo,info,doctor} ...``."""

from __future__ import annotations

import sys


def info() -> int:
    import torch

    import ep_plugin
    from ep_plugin import _cuda
    from ep_plugin.config import describe

    print(f"ep_plugin {ep_plugin.__version__}, torch {torch.__version__}")
    print(f"backends: {', '.join(ep_plugin.list_backends())}")
    print(f"CUDA extension: {_cuda.describe()}")
    print(f"fabric: {_fabric_summary()}")
    print("knobs:")
    for env_name, default, help_text in describe():
        print(f"  {env_name:36s} {default:10s} {help_text}")
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
        print("usage: python -m ep_plugin {demo,info,doctor} [options]")
        for name, text in commands.items():
            print(f"  {name:6s} {text}")
        return 2
    if argv[0] == "demo":
        from ep_plugin.demo import main as demo_main

        return demo_main(argv[1:])
    if argv[0] == "doctor":
        from ep_plugin.doctor import main as doctor_main

        return doctor_main(argv[1:])
    return info()


if __name__ == "__main__":
    sys.exit(main())
