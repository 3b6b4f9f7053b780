"""bench/op_host.py on the CPU (PyTorch backend): one row of host times, and k/v passed as the
layer passes them (strided views of one projection)."""

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


def test_layer_inputs_are_views_of_one_projection():
    q, k, v, k_cmp, v_cmp, gates, k_win, v_win = op_host.layer_inputs(
        1, 8, 4, 2, 4, torch.float32, "cpu")
    assert k._base is v._base is k_win._base is v_win._base
    assert k.stride(-1) == 1 and not k.is_contiguous()
