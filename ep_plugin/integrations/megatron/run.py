"""Run an unmodified Megatron-LM training script with the ep_plugin backends installed.

    python -m ep_plugin.integrations.megatron.run pretrain_gpt.py --moe-token-dispatcher-type flex \\
        --moe-flex-dispatcher-backend ep_hybrid [more Megatron-LM arguments]
    torchrun --nproc-per-node 8 -m ep_plugin.integrations.megatron.run pretrain_gpt.py ...

Options before the script (all optional):
    --replace-builtin   also route "hybridep" to the plugin's hybrid backend
A ``--local-rank=N`` there (``python -m torch.distributed.launch`` puts it before the script unless
``--use-env``) is passed on to the script, whose Megatron-LM arguments take it.

The script runs as ``__main__`` with ``sys.argv = [script, *its args]`` and its folder first
on ``sys.path``, as ``python script.py`` would run it: a Megatron-LM checkout's ``megatron`` package
next to the script is the one the plugin installs into, ahead of an installed megatron-core.
"""

from __future__ import annotations

import os
import runpy
import sys

from . import install

USAGE = "usage: python -m ep_plugin.integrations.megatron.run [--replace-builtin] <script.py> [script args...]"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    replace_builtin = False
    passed_on = []  # the script's own options that a launcher put before it
    while argv and argv[0].startswith("-"):  # options come before the script
        option = argv.pop(0)
        if option == "--replace-builtin":
            replace_builtin = True
        elif option.startswith(("--local-rank=", "--local_rank=")):  # torch.distributed.launch, without --use-env
            passed_on.append(option)
        elif option in ("-h", "--help"):
            print(USAGE)
            return
        else:
            raise SystemExit(f"unknown option {option!r}\n{USAGE}")
    if not argv:
        raise SystemExit(USAGE)
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"training script not found: {script}\n{USAGE}")
    sys.argv = [script, *passed_on, *argv[1:]]
    # Before install() imports megatron.core: a Megatron-LM checkout next to the script is the one it runs with.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    install(replace_builtin=replace_builtin)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
