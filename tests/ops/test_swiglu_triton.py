"""The Triton SwiGLU activation (nsa/ops/triton/swiglu.py) equals silu(gate) · up computed in
float64, forward and backward: rows and hidden widths that are not multiples of a program's
tile, one row, a strided input, 16-bit dtypes (on a GPU) rounded once; odd widths are refused,
the ops pass opcheck, and a CPU model keeps the PyTorch form (the GPU model's kernels:
tests/models/test_model_kernels.py). On a machine without CUDA it runs in Triton's
interpreter."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import nsa.models.transformer as transformer

pytest.importorskip("triton")

import nsa.ops.triton.swiglu as swiglu_module  # noqa: E402
from nsa.ops.triton.swiglu import (  # noqa: E402
    SWIGLU_COLUMNS,
    swiglu_backward_op,
    swiglu_op,
    swiglu_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])


def reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 7, 48), (1, 1, 2 * SWIGLU_COLUMNS + 6), (3, 10)],
                         ids=["partial-rows", "one-row-wide", "2d"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_swiglu_equals_float64_forward_and_backward(shape, dtype, strided):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(*shape[:-1], shape[-1] + 4 * strided, generator=g) * 3
    gate_up = base.to(DEVICE, dtype)[..., :shape[-1]].requires_grad_()  # strided: a row view
    grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(DEVICE, dtype)
    out = swiglu_triton(gate_up)
    (d_gate_up,) = torch.autograd.grad(out, gate_up, grad)
    leaf = gate_up.detach().double().requires_grad_()
    ref = reference(leaf)
    (d_ref,) = torch.autograd.grad(ref, leaf, grad.double())
    # float32 math, one rounding to the dtype: float32 to ~1e-6, 16-bit to its half-ulp.
    tol = (dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32
           else dict(rtol=8e-3 if dtype == torch.bfloat16 else 1e-3, atol=1e-2))
    assert out.dtype == dtype and out.shape == (*shape[:-1], shape[-1] // 2)
    assert d_gate_up.dtype == dtype and d_gate_up.shape == gate_up.shape
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(d_gate_up.double(), d_ref, **tol)


@pytest.mark.parametrize("shape", [(0, 8), (2, 0), (3, 0, 6)], ids=["no-rows", "no-width",
                                                                   "empty-batch"])
def test_empty_inputs_give_empty_outputs_and_gradients(shape):
    gate_up = torch.randn(*shape, device=DEVICE, requires_grad=True)
    out = swiglu_triton(gate_up)
    out.sum().backward()
    assert out.shape == (*shape[:-1], shape[-1] // 2) and gate_up.grad.shape == shape


def test_an_odd_width_is_refused():
    with pytest.raises(ValueError, match="halves"):
        swiglu_triton(torch.randn(2, 5, device=DEVICE))


def test_swiglu_ops_pass_opcheck():
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(2, 3, 16, generator=g).to(DEVICE)
    grad = torch.randn(2, 3, 8, generator=g).to(DEVICE)
    torch.library.opcheck(swiglu_op, (gate_up,))
    torch.library.opcheck(swiglu_backward_op, (grad, gate_up))


def test_the_cpu_mlp_keeps_the_pytorch_form():
    """swiglu() sends CPU tensors to PyTorch (the kernels are for CUDA tensors)."""
    gate_up = torch.randn(2, 3, 16)
    with mock.patch.object(swiglu_module, "swiglu_triton") as kernel:
        out = transformer.swiglu(gate_up)
    kernel.assert_not_called()
    torch.testing.assert_close(out, F.silu(gate_up[..., :8]) * gate_up[..., 8:])
