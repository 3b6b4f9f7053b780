"""The Triton SwiGLU activation (nsa/ops/triton/swiglu.py) equals silu(gate) · up computed in
float64, forward and backward: rows and hidden widths that are not multiples of a program's
tile, one row, a strided input, 16-bit dtypes (on a GPU) rounded once; odd widths are refused,
the ops pass opcheck, and the model's MLP runs through the kernels on a GPU with the losses and
gradients of its PyTorch form. On a machine without CUDA it runs in Triton's interpreter."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import nsa.models.transformer as transformer
from nsa.ops.triton_support import TRITON_AVAILABLE

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


@pytest.mark.skipif(DEVICE != "cuda" or not TRITON_AVAILABLE, reason="needs a GPU")
def test_the_model_trains_the_same_through_the_kernels_on_a_gpu():
    """A tiny model's loss and gradients under bf16 autocast: through the kernels against the
    PyTorch form (TRITON_AVAILABLE patched off for the MLP only)."""
    from nsa.models import LanguageModel
    from nsa.train import build_config

    config = build_config("tiny", ["attention=dense"]).model
    torch.manual_seed(0)
    model = LanguageModel(config).cuda()
    tokens = torch.randint(0, config.vocab_size, (2, 65), device="cuda")

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    with mock.patch.object(swiglu_module, "swiglu_triton",
                           wraps=swiglu_module.swiglu_triton) as kernel:
        loss, grads = loss_and_grads()
    assert kernel.call_count == config.num_layers
    with mock.patch.object(transformer, "TRITON_AVAILABLE", False):
        ref_loss, ref_grads = loss_and_grads()
    torch.testing.assert_close(loss, ref_loss, rtol=2e-3, atol=2e-3)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=5e-2, atol=5e-3, msg=name)
