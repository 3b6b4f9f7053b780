"""Plot a launch-shape sweep (bench/tune_kernels.py --json): per kernel family, each launch's
kernel time relative to the shipped launch's at every shape.

    python bench/plot_tuning.py bench/results/tuning-v25-h200-2026-11-28.json docs/tuning-v25.png
"""

from __future__ import annotations

from collections import defaultdict
from statistics import mean

from plotting import plot_arguments, plt


def launch_label(row) -> str:
    keys = f"k{row['keys']} " if "keys" in row else ""
    transposed = " transposed" if row.get("transposed") else ""
    rows = f"r{row['rows']} " if "rows" in row else ""  # none for the selected forward/dq
    return f"{keys}{rows}w{row['num_warps']} s{row['num_stages']}{transposed}"


def relative_times(rows):
    """{family: {shape: {launch: ms / shipped ms}}}: launches timed more than once are
    averaged; a launch that did not run (ms None or inf) is left out."""
    times = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    shipped = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["ms"] is None or r["ms"] == float("inf"):
            continue
        times[r["family"]][r["shape"]][launch_label(r)].append(r["ms"])
        if r["shipped"]:
            shipped[r["family"]][r["shape"]].append(r["ms"])
    return {family: {shape: {launch: mean(ms) / mean(shipped[family][shape])
                             for launch, ms in launches.items()}
                     for shape, launches in shapes.items() if shipped[family][shape]}
            for family, shapes in times.items()}


def main(argv=None):
    args, data = plot_arguments(__doc__, argv)
    ratios = relative_times(data["rows"])
    fig, axes = plt.subplots(len(ratios), 1, figsize=(11, 3.2 * len(ratios)), squeeze=False)
    for ax, (family, shapes) in zip(axes[:, 0], ratios.items()):
        launches = sorted({launch for per_shape in shapes.values() for launch in per_shape})
        width = 0.8 / len(launches)
        colors = plt.get_cmap("tab20").colors
        for i, launch in enumerate(launches):
            xs = [j + (i - (len(launches) - 1) / 2) * width for j in range(len(shapes))]
            ax.bar(xs, [per_shape.get(launch, 0.0) for per_shape in shapes.values()], width,
                   label=launch, color=colors[i % len(colors)])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(shapes)), [shape.replace(", ", "\n") for shape in shapes])
        ax.set_ylabel("time / shipped")
        ax.set_title(family)
        ax.legend(fontsize=7, ncol=4)
    fig.suptitle(f"{data['meta']['device']}: kernel time by launch shape (lower is faster)")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
