"""bench/op_host.py on the CPU (PyTorch backend): one row of host times, and the inputs laid
out as the layer passes them (values: strided views of one projection, split at each call;
queries and keys: contiguous, as RoPE writes them)."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import op_host  # noqa: E402


def test_op_host_prints_host_times(capsys):
    op_host.main(["--batch", "1", "--seq", "40", "--heads", "4,2", "--dim", "8", "--calls", "2",
                  "--repeats", "1", "--device", "cpu"])
    row = capsys.readouterr().out.strip().splitlines()[-1].split("|")[1:-1]
    fwd, fwd_bwd, gpu = (cell.strip() for cell in row)
    assert 0 < float(fwd) and 0 < float(fwd_bwd) and gpu == "(CPU)"


def test_op_host_times_each_kernel_and_writes_json(tmp_path, capsys):
    """--kernels: the time of each kernel (on the CPU, each operator) of one forward+backward,
    largest first, printed and written with the host times by --json."""
    path = tmp_path / "op.json"
    result = op_host.main(["--batch", "1", "--seq", "40", "--heads", "4,2", "--dim", "8",
                           "--calls", "2", "--repeats", "1", "--device", "cpu", "--kernels",
                           "--json", str(path)])
    written = json.loads(path.read_text())
    kernels = written["fwd_bwd_kernels_ms"]
    assert kernels == result["fwd_bwd_kernels_ms"] and len(kernels) > 1
    times = list(kernels.values())
    assert all(ms > 0 for ms in times) and times == sorted(times, reverse=True)
    assert written["shape"] == dict(batch=1, seq=40, heads=[4, 2], dim=8)
    assert written["fwd_host_ms"] > 0 and written["fwd_bwd_host_ms"] > 0
    out = capsys.readouterr().out
    assert "| kernel (one forward+backward) | ms |" in out and next(iter(kernels))[:80] in out


def test_layer_inputs_are_laid_out_as_the_layer_passes_them():
    inputs, leaves = op_host.layer_inputs(1, 8, 4, 2, 4, torch.float32, "cpu")
    q, k, v, k_cmp, v_cmp, gates, k_win, v_win = inputs()
    projection = leaves[2]
    assert projection.shape == (1, 8, 3 * 2 * 8)  # [B, T, sets · H · 2D]
    for value in (v, v_win):  # views of the projection
        assert value.untyped_storage().data_ptr() == projection.untyped_storage().data_ptr()
        assert value.stride(-1) == 1 and not value.is_contiguous()
    expected = (q, k, projection, k_cmp, v_cmp, gates, k_win)
    assert len(leaves) == len(expected) and all(a is b for a, b in zip(leaves, expected))
    assert all(x.is_leaf and x.is_contiguous() for x in (q, k, k_win, k_cmp, v_cmp, gates))
    # One autograd node for both values, as in the layer: split_heads'.
    assert v.grad_fn is v_win.grad_fn and "SplitHeads" in type(v.grad_fn).__name__
    assert inputs()[2].grad_fn is not v.grad_fn  # split again at each call
