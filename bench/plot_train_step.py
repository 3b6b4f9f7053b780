"""Plot training-step time, eager against CUDA-graph steps, per attention kind and shape, from a
train-step results JSON (rows of bench/train_step.py, several runs per setting).

    python bench/plot_train_step.py bench/results/train-step-cuda-graph-h100-2026-11-25.json \
        docs/train-step-cuda-graph-h100.png
"""

from __future__ import annotations

import statistics

from plotting import bars, plot_arguments, plt


def main(argv=None):
    args, data = plot_arguments(__doc__, argv)
    rows = data["rows"]
    shapes = sorted({(r["batch"], r["seq"]) for r in rows}, key=lambda s: s[1])
    modes = sorted({r["mode"] for r in rows}, key=lambda m: (m != "eager", m))  # eager first
    kinds = sorted({r["attention"] for r in rows}, key=lambda k: k != "nsa")
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4), squeeze=False)
    for ax, (batch, seq) in zip(axes[0], shapes):
        labels, pairs = [], []
        for kind in kinds:
            for mode in modes:
                runs = [r for r in rows if (r["attention"], r["mode"], r["batch"], r["seq"])
                        == (kind, mode, batch, seq)]
                if runs:  # the median run of each setting
                    labels.append(f"{kind}\n{mode}")
                    pairs.append((statistics.median(r["host_ms"] for r in runs),
                                  statistics.median(r["step_ms"] for r in runs)))
        bars(ax, labels, pairs, ("host (issue)", "step"), f"batch {batch} x {seq} tokens")
    fig.suptitle(f"{data['meta']['device']}: m7c-125m training step")
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
