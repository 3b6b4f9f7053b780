"""bench/train_step.py on the CPU: one row per attention kind and depth, with the step's host
time no larger than its wall time."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import train_step  # noqa: E402


def test_train_step_table_has_host_time(capsys):
    train_step.main(["--layers", "1,2", "--steps", "2", "--warmup", "0", "--device", "cpu",
                     "--batch", "1"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| nsa") or line.startswith("| dense")]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        ("nsa", "1"), ("nsa", "2"), ("dense", "1"), ("dense", "2")]
    for row in rows:
        step_ms, host_ms = float(row[3]), float(row[4])
        assert 0 < host_ms <= step_ms
