"""The Triton branch gates (nsa/ops/triton/branch_gates.py) equal sigmoid(logits + bias) computed
in float64, forward and backward: the layer's strided logits (a view of a wider projection),
contiguous ones and ones that no row view reads, rows that are not a multiple of a program's,
head counts whose HQ · 3 gates are not a power of two, 16-bit dtypes (on a GPU) rounded once;
the bias gradient is the same on every run; malformed inputs are refused, the ops pass
opcheck, a CPU layer keeps the PyTorch form and a layer whose logits Triton takes (on a GPU;
here, interpreted, where made to) trains as with it. On a machine without CUDA the kernels run
in Triton's interpreter."""

import contextlib
from unittest import mock

import pytest
import torch

import nsa.layers.attention as attention
from nsa.config_tree import replace_fields
from nsa.layers import AttentionConfig, NSAttention

pytest.importorskip("triton")

import nsa.ops.triton.branch_gates as branch_gates_module  # noqa: E402
from nsa.ops.triton.branch_gates import (  # noqa: E402
    GATES_ROWS,
    branch_gates_backward_op,
    branch_gates_op,
    branch_gates_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])


def make_logits(B: int, T: int, HQ: int, dtype, layout: str, g: torch.Generator):
    """Gate logits [B, T, HQ, 3]: a view of a wider projection's rows, as the layer has them
    ("row-view"); contiguous; or branch-major (a last stride of HQ), which the kernels read
    through a copy ("copied")."""
    if layout == "copied":
        return (torch.randn(B, T, 3, HQ, generator=g) * 3).to(DEVICE, dtype).transpose(-1, -2)
    pad = 10 if layout == "row-view" else 0
    y = (torch.randn(B, T, HQ * 3 + pad, generator=g) * 3).to(DEVICE, dtype)  # [B, T, W]
    return y[..., pad // 2:pad // 2 + HQ * 3].unflatten(-1, (HQ, 3))


def reference(logits: torch.Tensor, bias: torch.Tensor, grad: torch.Tensor):
    """float64 sigmoid(logits + bias) and, by autograd, its logits' and bias's gradients."""
    leaf, b = (x.detach().double().requires_grad_() for x in (logits, bias))
    gates = torch.sigmoid(leaf + b.view(-1, 3))
    return gates, *torch.autograd.grad(gates, (leaf, b), grad.double())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 75, 12), (1, 2 * GATES_ROWS, 5), (1, 3, 1)],
                         ids=["B2-T75-HQ12", "B1-T128-HQ5", "B1-T3-HQ1"])
@pytest.mark.parametrize("layout", ["row-view", "contiguous", "copied"])
def test_branch_gates_equal_float64_forward_and_backward(shape, dtype, layout):
    g = torch.Generator().manual_seed(0)
    logits = make_logits(*shape, dtype, layout, g).requires_grad_()
    bias = torch.randn(shape[-1] * 3, generator=g).to(DEVICE).requires_grad_()
    grad = torch.randn(logits.shape, generator=g).to(DEVICE, dtype)
    gates = branch_gates_triton(logits, bias)
    d_logits, d_bias = torch.autograd.grad(gates, (logits, bias), grad)
    ref, d_logits_ref, d_bias_ref = reference(logits, bias, grad)
    assert gates.dtype == dtype and gates.shape == logits.shape and gates.is_contiguous()
    assert d_logits.dtype == dtype and d_logits.shape == logits.shape
    assert d_bias.dtype == torch.float32 and d_bias.shape == bias.shape
    if dtype == torch.float32:
        tol = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gates.double(), ref, **tol)
        torch.testing.assert_close(d_logits.double(), d_logits_ref, **tol)
        torch.testing.assert_close(d_bias.double(), d_bias_ref, **tol)
        return
    # Each gate (< 1) rounded once, to within half a unit in the last place: eps / 4.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(gates.double(), ref, rtol=0, atol=eps / 4 + 1e-6)
    # The backward reads the rounded gates, as PyTorch's sigmoid backward reads its output,
    # which moves a gradient by up to |grad| · eps / 4, summed over the rows in the bias's:
    # it equals the float64 gradients at those gates, the logits' rounded once.
    s = gates.double()
    d = grad.double() * s * (1 - s)
    torch.testing.assert_close(d_logits.double(), d, rtol=eps, atol=1e-6)
    torch.testing.assert_close(d_bias.double(), d.flatten(0, -3).sum(0).flatten(), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("shape", [(0, 5, 4, 3), (2, 3, 0, 3)], ids=["no-rows", "no-heads"])
def test_empty_inputs_give_empty_outputs_and_zero_bias_gradients(shape):
    logits = torch.randn(*shape, device=DEVICE, requires_grad=True)
    bias = torch.randn(shape[-2] * 3, device=DEVICE, requires_grad=True)
    gates = branch_gates_triton(logits, bias)
    gates.sum().backward()
    assert gates.shape == shape and logits.grad.shape == shape
    assert bias.grad.shape == bias.shape and not bias.grad.any()


@pytest.mark.parametrize("logits_shape, bias_size, match", [
    ((2, 4, 2), 8, r"logits \[..., HQ, 3\]"),
    ((6,), 6, r"logits \[..., HQ, 3\]"),
    ((2, 4, 3), 8, "HQ · 3 = 12"),
], ids=["two-branches", "one-dim", "short-bias"])
def test_malformed_inputs_are_refused(logits_shape, bias_size, match):
    with pytest.raises(ValueError, match=match):
        branch_gates_triton(torch.randn(logits_shape, device=DEVICE),
                            torch.randn(bias_size, device=DEVICE))


def test_branch_gates_ops_pass_opcheck():
    g = torch.Generator().manual_seed(1)
    logits = make_logits(2, 3, 4, torch.float32, "row-view", g)
    bias = torch.randn(12, generator=g).to(DEVICE)
    grad = torch.randn(logits.shape, generator=g).to(DEVICE)
    torch.library.opcheck(branch_gates_op, (logits, bias))
    gates = branch_gates_op(logits, bias)
    torch.library.opcheck(branch_gates_backward_op, (grad, gates, torch.float32))


def test_the_bias_gradient_is_the_same_on_every_run():
    """Each program's column sums go to their own partials, added in a fixed order (no
    atomics): two backward passes give bitwise the same bias gradient."""
    g = torch.Generator().manual_seed(2)
    logits = make_logits(2, 150, 12, torch.float32, "row-view", g).requires_grad_()
    bias = torch.randn(36, generator=g).to(DEVICE).requires_grad_()
    grad = torch.randn(logits.shape, generator=g).to(DEVICE)
    runs = [torch.autograd.grad(branch_gates_triton(logits, bias), bias, grad)[0]
            for _ in range(2)]
    assert torch.equal(*runs)


def small_layer(device) -> NSAttention:
    torch.manual_seed(0)
    config = replace_fields(AttentionConfig(), dim=32, num_heads=4, num_kv_heads=2,
                            head_dim_k=8, head_dim_v=8, cmp_block=4, cmp_stride=2, sel_block=8,
                            num_selected=3, window=6, backend="torch")
    return NSAttention(config).to(device)


def test_the_cpu_layer_keeps_the_pytorch_form():
    """_gates sends CPU logits to PyTorch (the kernels are for CUDA tensors)."""
    layer = small_layer("cpu")
    logits = torch.randn(2, 5, 4, 3)
    with mock.patch.object(branch_gates_module, "branch_gates_triton") as kernel:
        layer(torch.randn(2, 5, 32))
        gates = layer._gates(logits)
    kernel.assert_not_called()
    torch.testing.assert_close(gates, torch.sigmoid(logits + layer.gate_proj.bias.view(4, 3)),
                               rtol=0, atol=0)


def test_a_layer_whose_logits_triton_takes_trains_as_with_the_pytorch_form():
    """On a GPU under bf16 autocast the layer's gates come from the kernels (on the CPU: made
    to, interpreted, in float32), one call a forward; its output and gradients equal those of
    the PyTorch form's gates."""
    layer = small_layer(DEVICE)
    x = torch.randn(2, 20, 32, device=DEVICE)
    autocast = DEVICE == "cuda"

    def output_and_grads():
        layer.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            out = layer(x)
        out.float().square().sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()}

    forced = mock.patch.object(attention, "triton_takes", lambda t: True)
    with forced if DEVICE == "cpu" else contextlib.nullcontext(), \
            mock.patch.object(branch_gates_module, "branch_gates_triton",
                              wraps=branch_gates_module.branch_gates_triton) as kernel:
        out, grads = output_and_grads()
    assert kernel.call_count == 1
    with mock.patch.object(attention, "triton_takes", lambda t: False):
        ref, ref_grads = output_and_grads()
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, **tol)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **tol, msg=name)
