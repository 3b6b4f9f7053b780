"""Plot decode-step time vs context from the JSON that ``bench/decode.py --out DIR`` writes.

    python bench/plot_decode.py bench/results/decode-h200-2026-11-22.json docs/decode-h200.png
"""

from __future__ import annotations

from matplotlib.ticker import NullFormatter
from plotting import plot_arguments, plt


def main(argv=None):
    args, data = plot_arguments(__doc__, argv)
    steps = data["steps"]
    batches = sorted({r["B"] for r in steps})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    for ax, B in zip(axes[0], batches, strict=True):
        rows = [r for r in steps if r["B"] == B]
        for impl in sorted({r["impl"] for r in rows}):
            points = sorted((r["T"], r["ms"]) for r in rows if r["impl"] == impl)
            ax.plot(*zip(*points, strict=True), marker="o", label=impl)
        contexts = sorted({r["T"] for r in rows})
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per step",
               title=f"decode-step attention, B={B}")
        ax.set_xticks(contexts)
        ax.set_xticklabels([f"{t // 1024}k" for t in contexts])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"NSA vs dense decode attention, {data.get('device', 'one H200')}, bf16, "
                 "HQ=64, H=4, D=128")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
