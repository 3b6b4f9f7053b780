"""bench/model_kernels.py at tiny shapes (on a GPU where there is one, else on the CPU with the
kernels in Triton's interpreter): one row per kernel, with times and the kernels' agreement
with the PyTorch forms, and its JSON."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytest.importorskip("triton")

import model_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels launch on CUDA tensors


def test_model_kernels_table_and_json(capsys, tmp_path):
    out = tmp_path / "rows.json"
    model_kernels.main(["--tokens", "6", "--dim", "24", "--hidden", "40", "--vocab", "300",
                        "--dtype", "fp32", "--device", DEVICE, "--json", str(out)])
    names = ["RMSNorm", "add + RMSNorm", "MLP activation", "loss"]
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.split("|")[1:2] and line.split("|")[1].strip() in names]
    assert [line.split("|")[1].strip() for line in lines] == names
    rows = json.loads(out.read_text())["rows"]
    for row in rows:
        assert row["pytorch_ms"] > 0 and row["triton_ms"] > 0
        assert row["max_out_diff"] < 1e-5 and row["max_grad_diff"] < 1e-5
