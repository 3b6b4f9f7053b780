"""The Triton RMSNorm (nsa/ops/triton/rms_norm.py), alone and after a residual add, equals the
norm computed in float64, forward and backward (x, the update, the weight): rows and widths
that are not multiples of a program's tile, one wide row, strided inputs, several backward
programs (the weight gradient's partials, bitwise the same on a second run), an output dtype
other than the input's, mixed addend dtypes, h's gradient given or not; empty inputs, bad
shapes refused, opcheck; the CPU model keeps ``nn.RMSNorm``'s form. On a machine without CUDA
it runs in Triton's interpreter (the GPU model: tests/models/test_model_kernels.py)."""

from unittest import mock

import pytest
import torch
from torch import nn

import nsa.models.transformer as transformer

pytest.importorskip("triton")

import nsa.ops.triton.rms_norm as rms_module  # noqa: E402
from nsa.ops.triton.rms_norm import (  # noqa: E402
    RMS_MAX_WIDTH,
    add_rms_norm_triton,
    rms_norm_backward_op,
    rms_norm_op,
    rms_norm_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])
EPS = 1e-5
SHAPES = {"partial-rows": (3, 7, 48), "one-row-wide": (1, 1, 5000), "2d": (70, 1000)}


def tolerance(dtype: torch.dtype) -> dict:
    """float32 math, one rounding to the dtype: float32 to ~1e-5, 16-bit to its half-ulp."""
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-5)
    return dict(rtol=1.6e-2 if dtype == torch.bfloat16 else 2e-3, atol=2e-2)


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def inputs(shape, dtype, strided, seed=0):
    """x (a row view of a wider tensor where strided), the weight (float32; every other value
    of a longer one where strided), y's gradient."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(*shape[:-1], shape[-1] + 4 * strided, generator=g) * 3
    x = base.to(DEVICE, dtype)[..., :shape[-1]].requires_grad_()
    weight = (1 + torch.randn(shape[-1] * (1 + strided), generator=g) / 4).to(DEVICE)
    weight = weight[::1 + strided].detach().requires_grad_()
    grad = torch.randn(shape, generator=g).to(DEVICE, dtype)
    return x, weight, grad


def float64_grads(out, leaves, grad):
    return torch.autograd.grad(out, leaves, grad.double())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_rms_norm_equals_float64_forward_and_backward(shape, dtype, strided):
    x, weight, grad = inputs(shape, dtype, strided)
    y = rms_norm_triton(x, weight, EPS)
    dx, dw = torch.autograd.grad(y, (x, weight), grad)
    leaves = [t.detach().double().requires_grad_() for t in (x, weight)]
    ref = reference(*leaves, EPS)
    dx_ref, dw_ref = float64_grads(ref, leaves, grad)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, **tolerance(dtype))
    torch.testing.assert_close(dx.double(), dx_ref, **tolerance(dtype))
    # The weight's gradient sums every row's product: relative to the sum's magnitude.
    scale = dw_ref.abs().max().item() + 1
    torch.testing.assert_close(dw.double() / scale, dw_ref / scale, **tolerance(dtype))


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("used", [(0, 1), (1,), (0,)], ids=["both-used", "y-used", "h-used"])
def test_add_rms_norm_equals_float64_forward_and_backward(shape, used):
    """The gradients where both outputs are used, or only one (the other's gradient None)."""
    x, weight, grad_y = inputs(shape, torch.float32, strided=True)
    g = torch.Generator().manual_seed(1)
    update = torch.randn(shape, generator=g).to(DEVICE).requires_grad_()
    grad_h = torch.randn(shape, generator=g).to(DEVICE)
    h, y = add_rms_norm_triton(x, update, weight, EPS)
    grads = (grad_h, grad_y)
    dx, du, dw = torch.autograd.grad([(h, y)[i] for i in used], (x, update, weight),
                                     [grads[i] for i in used], allow_unused=True)
    leaves = [t.detach().double().requires_grad_() for t in (x, update, weight)]
    h_ref = leaves[0] + leaves[1]
    y_ref = reference(h_ref, leaves[2], EPS)
    dx_ref, du_ref, dw_ref = torch.autograd.grad([(h_ref, y_ref)[i] for i in used], leaves,
                                                 [grads[i].double() for i in used],
                                                 allow_unused=True)
    tol = tolerance(torch.float32)
    torch.testing.assert_close(h.double(), h_ref, **tol)
    torch.testing.assert_close(y.double(), y_ref, **tol)
    torch.testing.assert_close(dx.double(), dx_ref, **tol)
    torch.testing.assert_close(du.double(), du_ref, **tol)
    if dw_ref is None:  # y unused
        assert dw is None
        return
    scale = dw_ref.abs().max().item() + 1
    torch.testing.assert_close(dw.double() / scale, dw_ref / scale, **tol)


def test_output_and_addend_dtypes():
    """y in the given output dtype (as under autocast); the addends' gradients each in their
    own dtype, h in the dtype of their sum."""
    x, weight, grad_y = inputs((5, 40), torch.float32, strided=False)
    update = torch.randn(5, 40).to(DEVICE, torch.float16).requires_grad_()
    h, y = add_rms_norm_triton(x, update, weight, None, torch.float16)
    assert h.dtype == torch.float32 and y.dtype == torch.float16
    dx, du = torch.autograd.grad(y, (x, update), grad_y.half())
    assert dx.dtype == torch.float32 and du.dtype == torch.float16
    torch.testing.assert_close(du.float(), dx, rtol=1e-3, atol=1e-3)
    h_ref = x.detach().double() + update.detach().double()
    y_ref = reference(h_ref, weight.detach(), torch.finfo(torch.float32).eps)  # eps None
    torch.testing.assert_close(y.double(), y_ref, **tolerance(torch.float16))
    assert rms_norm_triton(x, weight, EPS, torch.float16).dtype == torch.float16


def test_the_weight_gradient_is_the_same_on_a_second_run():
    """Several backward programs (70 rows of 1000 at 32 a program), their float32 partials
    summed in a fixed order: bitwise the same gradients."""
    x, weight, grad = inputs((70, 1000), torch.float32, strided=False)
    runs = [torch.autograd.grad(rms_norm_triton(x, weight, EPS), (x, weight), grad)
            for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("shape", [(0, 8), (2, 0), (3, 0, 6)],
                         ids=["no-rows", "no-width", "empty-batch"])
def test_empty_inputs_give_empty_outputs_and_gradients(shape):
    x = torch.randn(*shape, device=DEVICE, requires_grad=True)
    weight = torch.ones(shape[-1], device=DEVICE, requires_grad=True)
    update = torch.randn(*shape, device=DEVICE, requires_grad=True)
    h, y = add_rms_norm_triton(x, update, weight, EPS)
    (h.sum() + y.sum() + rms_norm_triton(x, weight, EPS).sum()).backward()
    assert y.shape == shape and x.grad.shape == shape and update.grad.shape == shape
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_bad_shapes_are_refused():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight of the rows' width 8"):
        rms_norm_triton(x, torch.ones(7, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="update of x's shape"):
        add_rms_norm_triton(x, torch.randn(2, 7, device=DEVICE), torch.ones(8, device=DEVICE),
                            EPS)
    wide = RMS_MAX_WIDTH + 1
    with pytest.raises(ValueError, match="at most"):
        rms_norm_triton(torch.randn(1, wide, device=DEVICE), torch.ones(wide, device=DEVICE),
                        EPS)


def test_rms_norm_ops_pass_opcheck():
    g = torch.Generator().manual_seed(2)
    x, update, grad = (torch.randn(2, 3, 16, generator=g).to(DEVICE) for _ in range(3))
    weight = torch.randn(16, generator=g).to(DEVICE)
    rstd = torch.rand(6, generator=g).to(DEVICE) + 0.5
    torch.library.opcheck(rms_norm_op, (x, None, weight, EPS, torch.float32))
    torch.library.opcheck(rms_norm_op, (x, update, weight, EPS, torch.float16))
    torch.library.opcheck(rms_norm_backward_op, (grad, None, x, weight, rstd, None))
    torch.library.opcheck(rms_norm_backward_op, (grad, update, x, weight, rstd, torch.float16))


def test_the_cpu_model_keeps_the_pytorch_form():
    """The model's norms are ``nn.RMSNorm``s (parameters, state dict) that send CPU tensors to
    PyTorch, the residual add before the MLP's norm too."""
    norm = transformer.RMSNorm(16, eps=EPS)
    assert isinstance(norm, nn.RMSNorm) and list(norm.state_dict()) == ["weight"]
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, update = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    plain = nn.RMSNorm(16, eps=EPS)
    plain.load_state_dict(norm.state_dict())
    with mock.patch.object(rms_module, "rms_norm_triton") as kernel, \
            mock.patch.object(rms_module, "add_rms_norm_triton") as add_kernel:
        y = norm(x)
        h, y_of_h = norm.add_forward(x, update)
    kernel.assert_not_called()
    add_kernel.assert_not_called()
    torch.testing.assert_close(y, plain(x))
    torch.testing.assert_close(h, x + update)
    torch.testing.assert_close(y_of_h, plain(x + update))
