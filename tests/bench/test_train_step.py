"""bench/train_step.py on the CPU: one row per attention kind and depth, with the step's host
time no larger than its wall time; --count-ops' operators and launches per layer."""

import sys
from pathlib import Path

import pytest
import torch

from nsa.ops.triton_support import TRITON_INTERPRET

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


@pytest.mark.skipif(not TRITON_INTERPRET, reason="the Triton backend on the CPU: the interpreter")
def test_count_ops_gives_each_layers_operators_and_launches(capsys):
    """--count-ops: the aten operators and Triton launches of one more forward+backward. With
    the Triton backend (the interpreter on the CPU) every layer launches the same kernels, an
    NSA layer more than a dense one (whose RoPE runs in PyTorch on the CPU: none), and a layer
    adds operators."""
    train_step.main(["--layers", "1,2", "--steps", "1", "--warmup", "0", "--device", "cpu",
                     "--batch", "1", "--seq", "48", "--backend", "triton", "--count-ops"])
    out = capsys.readouterr().out
    assert "| aten ops | Triton launches |" in out
    rows = {(r[0].strip(), int(r[1])): (int(r[7]), int(r[8]))
            for r in (line.split("|")[1:-1] for line in out.splitlines()
                      if line.startswith(("| nsa", "| dense")))}
    for kind in ("nsa", "dense"):
        (ops_1, launches_1), (ops_2, launches_2) = rows[kind, 1], rows[kind, 2]
        assert launches_2 == 2 * launches_1 and ops_2 > ops_1 > 0
    assert rows["nsa", 1][1] > rows["dense", 1][1]


@pytest.mark.skipif(not TRITON_INTERPRET, reason="a CPU launch runs in the interpreter")
def test_count_host_work_leaves_out_what_a_launch_does_inside():
    """One RoPE launch in the interpreter: the wrapper's one allocation and the launch are
    counted, not the interpreter's copies of the launch's tensors (dozens of operators)."""
    from nsa.layers.rope import rope_angles, rope_frequencies
    from nsa.ops.triton.rope import rope

    x = torch.randn(1, 5, 2, 8)
    cos, sin = rope_angles(torch.arange(5.0)[None], rope_frequencies(8, 10000.0, "cpu"))
    counts = {}
    with train_step.count_host_work(counts):
        rope([x], cos, sin, False)
    assert counts == {"ops": 1, "launches": 1}


def test_gpu_timeline_counts_busy_idle_and_overlapped_time():
    """Two streams' intervals: busy is their union, idle the gaps inside the span, and
    overlapped the time two or more run at once (three at once counts once)."""
    intervals = [(10.0, 20.0), (15.0, 30.0), (16.0, 18.0), (40.0, 45.0), (45.0, 50.0)]
    assert train_step.gpu_timeline(intervals) == {
        "span": 40.0, "busy": 30.0, "idle": 10.0, "overlapped": 5.0}
    assert train_step.gpu_timeline([(3.0, 4.0)]) == {
        "span": 1.0, "busy": 1.0, "idle": 0.0, "overlapped": 0.0}


def test_profile_prints_the_kernel_table(capsys):
    """--profile N on the CPU: the table of one more eager step (no GPU kernels, so no rows and
    no GPU timeline), after the timing row."""
    train_step.main(["--layers", "1", "--steps", "1", "--warmup", "0", "--device", "cpu",
                     "--batch", "1", "--attention", "dense", "--profile", "3"])
    out = capsys.readouterr().out
    assert "GPU time of one eager step: 0.0 ms" in out
    assert "| kernel | grid | calls | µs each | ms | share |" in out
    assert "GPU timeline" not in out
    assert out.index("| dense | 1 |") < out.index("## dense, 1 layers") < out.index(
        "GPU time of one")


def test_the_kernel_table_groups_by_kernel_and_grid():
    """One kernel at two grids is two rows (largest first), with calls, mean µs, ms and share;
    a fill without a grid is its own row; the total is every activity's."""
    def event(name, dur, grid=None):
        return {"name": name, "dur": dur, "args": {"grid": grid} if grid else {}}

    events = [event("_rope_kernel", 27.0, [8192, 1, 1]), event("_rope_kernel", 27.0, [8192, 1, 1]),
              event("_rope_kernel", 6.0, [1024, 1, 1]), event("Memset (Device)", 40.0)]
    lines = train_step.kernel_table(events, rows=2)
    assert lines[2:] == ["| _rope_kernel | 8192×1×1 | 2 | 27.0 | 0.05 | 54.0% |",
                         "| Memset (Device) | - | 1 | 40.0 | 0.04 | 40.0% |"]
    assert len(train_step.kernel_table(events, rows=10)) == 2 + 3
