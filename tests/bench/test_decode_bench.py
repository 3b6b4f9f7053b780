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
