"""Plot versions' kernel times side by side (a results JSON whose "kernels" rows hold kernel,
shape, version, launch and ms): the shipped launches, one panel per shape; the title says
"kernel time, shipped launch" unless the JSON's meta has its own "title", and the y axis "ms"
unless the meta has a "unit" (rows of another quantity, e.g. peak memory in GB, keep the key
"ms").

    python bench/plot_versions.py bench/results/dkdv-race-fix-h200-2026-11-29.json \
        docs/dkdv-race-fix-h200-2026-11-29.png
"""

from __future__ import annotations

from plotting import bars, plot_arguments, plt


def main(argv=None):
    args, data = plot_arguments(__doc__, argv)
    rows = [r for r in data["kernels"] if r["launch"] == "shipped"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    versions = list(dict.fromkeys(r["version"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        ms = {(r["kernel"], r["version"]): r["ms"] for r in rows if r["shape"] == shape}
        kernels = list(dict.fromkeys(kernel for kernel, _ in ms))
        bars(ax, kernels, [[ms[k, v] for v in versions] for k in kernels], versions, shape,
             data["meta"].get("unit", "ms"))
    title = data["meta"].get("title", "kernel time, shipped launch")
    fig.suptitle(f"{data['meta']['device']}, {data['meta']['date']}: {title}")
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
