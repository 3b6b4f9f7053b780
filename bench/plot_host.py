"""Plot host (issue) time against GPU time from a host-time results JSON: the op per
forward+backward by version, and the training step by attention kind.

    python bench/plot_host.py bench/results/host-v11-h100-2026-11-25.json docs/host-v11-h100.png
"""

from __future__ import annotations

from plotting import bars, plot_arguments, plt


def main(argv=None):
    args, data = plot_arguments(__doc__, argv)
    fig, (op_ax, step_ax) = plt.subplots(1, 2, figsize=(11, 4))
    bars(op_ax, [r["version"] for r in data["op"]],
         [(r["fwd_bwd_host_ms"], r["fwd_bwd_gpu_ms"]) for r in data["op"]],
         ("host (issue)", "GPU"), "NSA op, one forward+backward")
    bars(step_ax, [r["attention"] for r in data["step"]],
         [(r["host_ms"], r["wall_ms"]) for r in data["step"]], ("host (issue)", "wall"),
         "m7c-125m training step")
    fig.suptitle(f"{data['meta']['device']}: {data['meta']['shape'].split(';')[0]}")
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
