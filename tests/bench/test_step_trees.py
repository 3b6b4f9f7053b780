"""bench/step_trees.py on the CPU: two trees archived from this repository's HEAD, their steps
run alternating (one row per round, kind and tree, with the trees' commits, for
bench/plot_train_step.py), and bad tree names, revisions and depths refused."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import step_trees  # noqa: E402

pytestmark = pytest.mark.skipif(
    subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0,
    reason="needs this repository's git history")
STEP = ["--steps", "1", "--warmup", "0", "--device", "cpu", "--batch", "1", "--seq", "32"]


def test_trees_alternate_and_their_rows_are_written(tmp_path, capsys):
    trees = tmp_path / "trees"
    step_trees.main(["prepare", str(trees), "a=HEAD", "b=HEAD"])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert (trees / "a" / "REVISION").read_text().strip() == head
    assert (trees / "b" / "bench" / "train_step.py").is_file()
    out = tmp_path / "steps.json"
    step_trees.main(["run", str(trees), "--rounds", "1", "--json", str(out), "--",
                     "--layers", "1", *STEP])
    printed = capsys.readouterr().out
    assert "| a |" in printed and "NSA / dense" in printed
    data = json.loads(out.read_text())
    assert data["meta"]["trees"] == {"a": head, "b": head} and data["meta"]["device"] == "cpu"
    assert [(r["run"], r["attention"], r["mode"]) for r in data["rows"]] == [
        (1, "nsa", "a"), (1, "nsa", "b"), (1, "dense", "a"), (1, "dense", "b")]
    assert all(r["step_ms"] > 0 and (r["batch"], r["seq"]) == (1, 32) for r in data["rows"])


def test_a_folder_given_relative_to_the_working_directory_runs(tmp_path, monkeypatch, capsys):
    """Each run's working directory is its tree's bench/: a relative folder (as the device
    call gives, `.scratch/trees`) must still put the tree's nsa on the import path."""
    monkeypatch.chdir(tmp_path)
    step_trees.main(["prepare", "trees", "a=HEAD"])
    step_trees.main(["run", "trees", "--rounds", "1", "--attention", "dense", "--",
                     "--layers", "1", *STEP])
    assert "| a |" in capsys.readouterr().out


def test_bad_trees_and_depths_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="NAME=REV"):
        step_trees.main(["prepare", str(tmp_path), "HEAD"])
    with pytest.raises(SystemExit, match="names no commit"):
        step_trees.main(["prepare", str(tmp_path), "a=no-such-revision"])
    with pytest.raises(SystemExit, match="no tree"):
        step_trees.main(["run", str(tmp_path), "--trees", "a", "--", *STEP])
    step_trees.main(["prepare", str(tmp_path), "a=HEAD"])
    with pytest.raises(SystemExit, match="exists"):
        step_trees.main(["prepare", str(tmp_path), "a=HEAD"])
    with pytest.raises(SystemExit, match="one depth a run"):
        step_trees.main(["run", str(tmp_path), "--rounds", "1", "--attention", "dense", "--",
                         "--layers", "1,2", *STEP])
