"""Plot graphed generation tokens/s, NSA and dense, of several `bench/decode.py` runs that one
JSON holds side by side ({"runs": {name: decode.json}}), one bar per (run, attention).

    python bench/plot_generation.py bench/results/generation-cache-append-h100-2026-11-25.json \
        docs/generation-cache-append-h100.png
"""

from __future__ import annotations

from plotting import bars, plot_arguments, plt


def main(argv=None):
    args, data = plot_arguments(__doc__, argv)
    runs = data["runs"]
    series = [(run, attention) for run in runs for attention in ("nsa", "dense")]
    rows = {(run, r["attention"], r["context"]): r["tokens_per_s"]
            for run, result in runs.items() for r in result["generation"] if r["cuda_graph"]}
    contexts = sorted({context for _, _, context in rows})
    fig, ax = plt.subplots(figsize=(8, 4.2))
    bars(ax, [f"{c // 1024}k context" for c in contexts],
         [[rows[run, attention, c] for run, attention in series] for c in contexts],
         [f"{attention}, {run}" for run, attention in series],
         f"m7c-125m generation, B=1, CUDA graphs, {data['device']}")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=7, loc="lower center")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
