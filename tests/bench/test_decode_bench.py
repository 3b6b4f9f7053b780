"""bench/decode.py --smoke on the CPU: the code paths on tiny shapes, and the results file
written into an --out directory that does not exist yet (the H200 run of 2026-11-27 lost its
JSON there after the whole benchmark had run)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import decode  # noqa: E402


def test_smoke_run_writes_its_results_into_a_new_directory(tmp_path, capsys):
    out = tmp_path / "not" / "there"
    decode.main(["--smoke", "--out", str(out)])
    results = json.loads((out / "decode.json").read_text())
    assert results["steps"] and results["generation"]
    assert "nsa-torch" in {row["impl"] for row in results["steps"]}
    assert not list(out.glob(".*.tmp"))  # written through a temporary file, renamed
    assert "| tiny nsa |" in capsys.readouterr().out


def test_targets_keep_the_graph_of_layer_steps_apart():
    """The ratios and the one-step row use one step per graph, even where the graph of
    LAYER_STEPS steps (one cache each) is faster per step; the per-layer row uses that graph."""
    row = lambda T, B, impl, ms: dict(T=T, B=B, impl=impl, ms=ms, GBps=1.0)  # noqa: E731
    graph8 = f"nsa-triton+graph{decode.LAYER_STEPS}"
    steps = [row(65536, 1, "nsa-triton", 0.1), row(65536, 1, "nsa-triton+graph", 0.026),
             row(65536, 1, graph8, 0.021), row(65536, 16, "nsa-triton+graph", 0.08),
             row(65536, 16, graph8, 0.07), row(65536, 16, "sdpa-cudnn", 0.56)]
    found = {t["target"]: t for t in decode.targets(
        dict(steps=steps, copy_GBps=1.0, generation=[]))}
    assert abs(found["64k B=16: best dense / NSA"]["value"] - 7.0) < 1e-9
    one = found["64k B=1: µs per layer step, one step per graph"]
    assert abs(one["value"] - 26.0) < 1e-9 and not one["met"]
    layer = found[f"64k B=1: µs per layer step, {decode.LAYER_STEPS} steps in one graph"]
    assert abs(layer["value"] - 21.0) < 1e-9 and layer["met"]
