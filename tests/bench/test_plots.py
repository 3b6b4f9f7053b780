"""The plot scripts draw the results kept in bench/results (what BENCHMARKS.md shows)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import plot_attention  # noqa: E402
import plot_decode  # noqa: E402
import plot_generation  # noqa: E402
import plot_host  # noqa: E402
import plot_train_step  # noqa: E402
import plot_tuning  # noqa: E402
import plot_versions  # noqa: E402

RESULTS = BENCH / "results"


@pytest.mark.parametrize("script, results, options", [
    (plot_attention, "attention-peers-h100-2026-11-25-v10.json", ["--heads", "64,4"]),
    (plot_attention, "attention-peers-h100-2026-11-26-v15.json", []),  # with peak memory
    (plot_decode, "decode-v2-h100-2026-11-25.json", []),
    (plot_generation, "generation-cache-append-h100-2026-11-25.json", []),
    (plot_host, "host-v11-h100-2026-11-25.json", []),
    (plot_train_step, "train-step-cuda-graph-h100-2026-11-25.json", []),
    (plot_tuning, "tuning-v25-h200-2026-11-28.json", []),
    (plot_tuning, "tuning-v26-h200-2026-11-28.json", []),  # tiles transposed or not
    (plot_versions, "dkdv-race-fix-h200-2026-11-29.json", []),
    (plot_versions, "selected-per-block-h200-2026-11-29.json", []),  # its own title
], ids=["attention", "attention-memory", "decode", "generation", "host", "train-step",
        "tuning", "tuning-transposed", "versions", "versions-titled"])
def test_plot_writes_a_png(script, results, options, tmp_path):
    png = tmp_path / "plot.png"
    script.main([str(RESULTS / results), str(png), *options])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
