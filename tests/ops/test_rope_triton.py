"""The Triton RoPE kernel (nsa/ops/triton/rope.py) equals the PyTorch rotation, forward and
backward: strided inputs as the layer passes them, angles per sequence or shared, a head dim
whose half is not a power of two, and the op passes opcheck. On a machine without CUDA it runs
in Triton's interpreter."""

import pytest
import torch

from nsa.layers.rope import rope_angles, rope_frequencies, rotate_torch

pytest.importorskip("triton")

from nsa.ops.triton.rope import rope_op, rope_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def angles(B_angles, T, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    positions = torch.rand(B_angles, T, generator=g) * 100  # fractional positions too
    return rope_angles(positions.to(DEVICE), rope_frequencies(D, 10000.0, DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B_angles", [1, 2], ids=["shared-angles", "per-sequence"])
@pytest.mark.parametrize("D", [16, 10])
def test_triton_rope_equals_torch_forward_and_backward(D, B_angles, dtype):
    B, T, heads = 2, 7, 3
    g = torch.Generator().manual_seed(1)
    # A strided view, as the layer's keys: [B, T, 2, heads, D + 4] -> [..., :D] of set 1.
    base = torch.randn(B, T, 2, heads, D + 4, generator=g).to(DEVICE, dtype)
    cos, sin = angles(B_angles, T, D)
    grad = torch.randn(B, T, heads, D, generator=g).to(DEVICE, dtype)

    def run(fn):
        leaf = base.clone().requires_grad_()
        out = fn(leaf[:, :, 1, :, :D], cos, sin)
        (x_grad,) = torch.autograd.grad(out, leaf, grad)
        return out, x_grad

    out, x_grad = run(rope_triton)
    ref, ref_grad = run(rotate_torch)
    assert out.dtype == dtype and out.shape == (B, T, heads, D)
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(x_grad, ref_grad, **tol)
    assert x_grad[:, :, 0].abs().sum() == 0  # the other set gets no gradient


def test_inverse_rope_undoes_rope():
    x = torch.randn(1, 5, 2, 8).to(DEVICE)
    cos, sin = angles(1, 5, 8)
    back = rope_op(rope_op(x, cos, sin, False), cos, sin, True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


def test_rope_op_passes_opcheck():
    x = torch.randn(2, 3, 2, 8).to(DEVICE)
    cos, sin = angles(2, 3, 8)
    torch.library.opcheck(rope_op, (x, cos, sin, False))
