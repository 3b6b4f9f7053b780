"""The Triton cross-entropy (nsa/ops/triton/cross_entropy.py) equals ``F.cross_entropy`` in
float64, forward and backward: one step of classes and several with a partial last one, ignored
targets (-100), a loss gradient other than 1, logits with a row stride above their width, 16-bit
logits (on a GPU) with the gradient in their dtype; no counted row (or no row) gives NaN as
PyTorch does, a target out of range makes the loss NaN, bad shapes, no classes and float targets
are refused, the ops pass opcheck, and a CPU model keeps ``F.cross_entropy``. On a machine
without CUDA it runs in Triton's interpreter."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import nsa.models.transformer as transformer

pytest.importorskip("triton")

import nsa.ops.triton.cross_entropy as ce_module  # noqa: E402
from nsa.ops.triton.cross_entropy import (  # noqa: E402
    BLOCK_V,
    cross_entropy_backward_op,
    cross_entropy_op,
    cross_entropy_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", [37, 2 * BLOCK_V + 5], ids=["one-step", "partial-last-step"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "row-stride"])
def test_cross_entropy_equals_float64_forward_and_backward(V, dtype, strided):
    g = torch.Generator().manual_seed(0)
    N = 6
    base = torch.randn(N, V + 3 * strided, generator=g) * 4
    logits = base.to(DEVICE, dtype)[:, :V].requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[1, 4]] = -100
    targets = targets.to(DEVICE)
    loss = cross_entropy_triton(logits, targets)
    (grad,) = torch.autograd.grad(loss * 2.5, logits)
    leaf = logits.detach().double().requires_grad_()
    ref = F.cross_entropy(leaf, targets)
    (ref_grad,) = torch.autograd.grad(ref * 2.5, leaf)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert grad.dtype == dtype and grad.shape == (N, V)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    tol = (dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32
           else dict(rtol=1e-2, atol=1e-4))  # 16-bit: the gradient rounded once to the dtype
    torch.testing.assert_close(grad.double(), ref_grad, **tol)
    assert grad[[1, 4]].abs().sum() == 0  # ignored rows get no gradient


def test_no_counted_row_gives_nan_as_pytorch():
    logits = torch.randn(3, 8, device=DEVICE)
    targets = torch.full((3,), -100, device=DEVICE)
    assert cross_entropy_triton(logits, targets).isnan()
    assert F.cross_entropy(logits, targets).isnan()


def test_no_rows_give_nan_and_an_empty_gradient_as_pytorch():
    logits = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    loss = cross_entropy_triton(logits, torch.zeros(0, dtype=torch.long, device=DEVICE))
    loss.backward()
    assert loss.isnan() and logits.grad.shape == (0, 8)


def test_a_target_out_of_range_makes_the_loss_nan():
    logits = torch.randn(3, 8, device=DEVICE)
    assert cross_entropy_triton(logits, torch.tensor([0, 8, 3], device=DEVICE)).isnan()
    assert cross_entropy_triton(logits, torch.tensor([0, -2, 3], device=DEVICE)).isnan()


def test_bad_inputs_are_refused():
    logits = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"logits \[N, V\] and targets \[N\]"):
        cross_entropy_triton(logits, torch.zeros(4, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match=r"logits \[N, V\]"):
        cross_entropy_triton(logits[None], torch.zeros(3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="at least one class"):
        cross_entropy_triton(logits[:, :0], torch.zeros(3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="integer targets"):
        cross_entropy_triton(logits, torch.zeros(3, device=DEVICE))


def test_cross_entropy_ops_pass_opcheck():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 11, generator=g).to(DEVICE)
    targets = torch.tensor([3, -100, 0, 10], device=DEVICE)
    _, lse = cross_entropy_op(logits, targets)
    torch.library.opcheck(cross_entropy_op, (logits, targets))
    torch.library.opcheck(cross_entropy_backward_op,
                          (logits, targets, lse, torch.tensor([0.5], device=DEVICE)))


def test_the_cpu_model_keeps_f_cross_entropy():
    logits, targets = torch.randn(4, 11), torch.tensor([3, -100, 0, 10])
    with mock.patch.object(ce_module, "cross_entropy_triton") as kernel:
        loss = transformer.next_token_loss(logits, targets)
    kernel.assert_not_called()
    torch.testing.assert_close(loss, F.cross_entropy(logits, targets))
