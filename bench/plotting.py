"""What the plot scripts share: matplotlib without a display, and their command line (a results
JSON in, a PNG out, plus each script's own options)."""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402,F401  (re-exported: `from plotting import plt`)


def plot_arguments(doc: str, argv=None, add_options=None):
    """(parsed arguments, the results JSON) of a plot script whose usage is ``doc``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("png")
    if add_options is not None:
        add_options(parser)
    args = parser.parse_args(argv)
    with open(args.results) as f:
        return args, json.load(f)


def bars(ax, labels, pairs, names, title, unit="ms"):
    """Side-by-side bars: for each label, one bar per series in ``names``; ``unit`` labels the
    y axis."""
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, [p[i] for p in pairs], width, label=name)
    # Labels turned where several would overlap.
    ax.set_xticks(range(len(labels)), labels, rotation=30 if len(labels) > 3 else 0,
                  ha="right" if len(labels) > 3 else "center")
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.legend()
