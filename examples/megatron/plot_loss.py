"""Plot the loss curves of train_gpt_moe.py runs into one PNG and print how far they differ.

    python examples/megatron/plot_loss.py hybrid.json alltoall.json --out loss.png [--table]

``--table`` also prints the loss of every step, one column per run (and |difference| to the first).
Each JSON file is what ``train_gpt_moe.py --out`` wrote. The first file is the baseline of
the printed differences; the legend names each run by dispatcher, ranks and micro-batches.
"""

from __future__ import annotations

import argparse
import json


def label(run: dict) -> str:
    args = run["args"]
    return (f"{args['dispatcher']} ({args['ranks']} rank(s) x {args['grad_accum']} micro-batch(es), "
            f"{run.get('median_tokens_per_s', 0):,.0f} tokens/s)")


def print_table(runs: list[dict]) -> None:
    """Step, each run's loss, and |each later run - the first| (one row per step all runs reached)."""
    names = [f"{run['args']['dispatcher']} {run['args']['ranks']}x{run['args']['grad_accum']}" for run in runs]
    header = ["step", *names, *(f"|{name} - {names[0]}|" for name in names[1:])]
    widths = [max(len(title), 8) for title in header]
    print("  ".join(title.rjust(width) for title, width in zip(header, widths, strict=True)))
    for step in range(min(len(run["losses"]) for run in runs)):
        losses = [run["losses"][step] for run in runs]
        differences = (f"{abs(loss - losses[0]):.4f}" for loss in losses[1:])
        cells = [str(step), *(f"{loss:.4f}" for loss in losses), *differences]
        print("  ".join(cell.rjust(width) for cell, width in zip(cells, widths, strict=True)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="JSON files written by train_gpt_moe.py --out")
    parser.add_argument("--out", default="loss.png")
    parser.add_argument("--title", default="GPT-MoE on synthetic data: training loss")
    parser.add_argument("--table", action="store_true", help="print every step's loss, one column per run")
    args = parser.parse_args(argv)

    runs = []
    for path in args.runs:
        with open(path) as handle:
            runs.append(json.load(handle))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for run, style in zip(runs, ("-", "--", ":", "-."), strict=False):
        axis.plot(range(len(run["losses"])), run["losses"], style, label=label(run))
    axis.set_xlabel("step")
    axis.set_ylabel("loss (cross-entropy, nats)")
    axis.set_title(args.title)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")

    if args.table:
        print_table(runs)
    baseline = runs[0]["losses"]
    for path, run in zip(args.runs[1:], runs[1:], strict=True):
        steps = min(len(baseline), len(run["losses"]))
        differences = [abs(a - b) for a, b in zip(baseline[:steps], run["losses"][:steps], strict=True)]
        relative = [d / abs(b) for d, b in zip(differences, baseline[:steps], strict=True)]
        print(f"{path} vs {args.runs[0]} over {steps} steps: max |loss difference| {max(differences):.4f} "
              f"(max relative {max(relative):.2%}), final {baseline[steps - 1]:.4f} vs {run['losses'][steps - 1]:.4f}")


if __name__ == "__main__":
    main()
