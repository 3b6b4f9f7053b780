"""Plot time vs T from the JSON that ``bench/attention.py`` writes (``--out DIR`` or ``--json``).

    python bench/plot_attention.py bench/results/attention-h200-2026-11-22.json docs/attention.png
"""

from __future__ import annotations

import matplotlib
from plotting import plot_arguments, plt


def main(argv=None):
    args, data = plot_arguments(__doc__, argv, lambda parser: parser.add_argument(
        "--heads", default="64,4", help="HQ,H of the T sweep to plot"))
    HQ, H = (int(x) for x in args.heads.split(","))
    rows = data["rows"] if isinstance(data, dict) else data  # --json: {meta, rows}
    # The GPU named by --json's meta (bare --out lists predate it: those runs were on H200s).
    device = data["meta"]["device"] if isinstance(data, dict) else "NVIDIA H200"
    # Refused, failed or skipped measurements have no times.
    rows = [r for r in rows if r["HQ"] == HQ and r["H"] == H and "fwd_ms" in r]
    # Peak memory too, where every row has it (rows of older runs may not).
    panels = [("fwd_ms", "forward", "ms"), ("fwd_bwd_ms", "forward + backward", "ms")]
    if all("peak_mb" in r for r in rows):
        panels.append(("peak_mb", "peak memory, forward + backward", "MB"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), sharex=True)
    for ax, (key, title, unit) in zip(axes, panels, strict=True):
        for impl in sorted({r["impl"] for r in rows}):
            points = sorted((r["T"], r[key]) for r in rows if r["impl"] == impl)
            ax.plot(*zip(*points, strict=True), marker="o", label=impl)
        ax.set(xscale="log", yscale="log", xlabel="T (tokens)", ylabel=unit, title=title)
        ax.set_xticks([p for p in sorted({r["T"] for r in rows})])
        ax.set_xticklabels([f"{t // 1024}k" for t in sorted({r["T"] for r in rows})])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"NSA vs dense causal attention, one {device}, bf16, B=1, HQ={HQ}, H={H}, "
                 f"D=128")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
