"""bench/dq_accumulation.py's kernels in Triton's interpreter: every way of handing on dq
contributions (per query tile in registers, float atomics, int64 fixed-point atomics, in key
order per query tile) gives the causal dq of the float64 reference, at a T that is no
multiple of either tile; the deterministic ways give the same bits twice."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import dq_accumulation  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter multiplies float32 tiles in float32; a GPU in TF32 (10-bit mantissas).
TOLERANCE = dict(cpu=1e-4, cuda=1e-2)[DEVICE]


@pytest.mark.parametrize("mode", ["rows", "float-atomics", "int64-atomics", "ordered"])
def test_every_hand_off_gives_the_causal_dq(mode):
    torch.manual_seed(0)
    q, k = (torch.randn(2, 45, 16, device=DEVICE) for _ in range(2))
    expected = dq_accumulation.reference(q, k)
    got = dq_accumulation.dq(mode, q, k, block_r=16, block_n=16)
    torch.testing.assert_close(got, expected, rtol=TOLERANCE, atol=TOLERANCE)
    if mode != "float-atomics":
        assert torch.equal(got, dq_accumulation.dq(mode, q, k, block_r=16, block_n=16))
