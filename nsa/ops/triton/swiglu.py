"""The model MLP's activation, silu(gate) · up of one product's two halves [gate | up], in
Triton, forward and backward, registered as the ops ``nsa::swiglu`` and ``nsa::swiglu_backward``.

The PyTorch form (``F.silu(gate) * up`` of ``gate_up.chunk(2, -1)``) works on the halves'
strided views: a silu kernel and a product forward; two products, silu's backward and the
concatenation of the halves' gradients backward. Each reads or writes whole [tokens, hidden]
tensors, the strided ones through unvectorised element-wise kernels, and autograd keeps
silu(gate) for the backward. At m7c-125m's training shape (8 × 2048 tokens, hidden 2048, bf16)
that is ~0.5 ms of an H200's time a layer, dense or NSA alike (bench/NOTES.md, forty-seventh
session). Here the forward reads gate_up once and writes the activation once; the backward
reads gate_up and the activation's gradient once and writes gate_up's gradient once; only
gate_up is kept.

Both compute in float32 and round once to gate_up's dtype (the PyTorch form in a 16-bit dtype
also rounds silu(gate) before the product). With s = sigmoid(g): d up = dh · g·s and d gate =
dh · up · s · (1 + g·(1 - s)).
"""

from __future__ import annotations

import torch
import triton.language as tl

from nsa.ops.triton.jit import kernel
from nsa.ops.triton.launch import as_rows, call_op, cdiv

SWIGLU_ROWS = 4  # tokens per program
SWIGLU_COLUMNS = 1024  # hidden units per program


@kernel
def _swiglu_fwd_kernel(X, OUT, N, HIDDEN, stride_xn, stride_on, ROWS: tl.constexpr,
                       COLUMNS: tl.constexpr):
    """OUT[n, j] = silu(X[n, j]) · X[n, HIDDEN + j] for this program's ROWS rows of the N and
    COLUMNS of the HIDDEN columns (X [N, 2·HIDDEN], OUT [N, HIDDEN], last strides 1)."""
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    j = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    ok = (n < N)[:, None] & (j < HIDDEN)[None, :]
    x = X + n.to(tl.int64)[:, None] * stride_xn + j[None, :]
    gate = tl.load(x, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x + HIDDEN, mask=ok, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(OUT + n.to(tl.int64)[:, None] * stride_on + j[None, :],
             out.to(OUT.dtype.element_ty), mask=ok)


@kernel
def _swiglu_bwd_kernel(X, DOUT, DX, N, HIDDEN, stride_xn, stride_dn, stride_dxn,
                       ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """DX [N, 2·HIDDEN] = the gradient of X from the output's DOUT [N, HIDDEN] at this program's
    rows and columns of each half (module docstring)."""
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    j = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    ok = (n < N)[:, None] & (j < HIDDEN)[None, :]
    n64 = n.to(tl.int64)[:, None]
    x = X + n64 * stride_xn + j[None, :]
    gate = tl.load(x, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x + HIDDEN, mask=ok, other=0.0).to(tl.float32)
    dout = tl.load(DOUT + n64 * stride_dn + j[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    d_gate = dout * up * s * (1.0 + gate * (1.0 - s))
    d_up = dout * gate * s
    dx = DX + n64 * stride_dxn + j[None, :]
    tl.store(dx, d_gate.to(DX.dtype.element_ty), mask=ok)
    tl.store(dx + HIDDEN, d_up.to(DX.dtype.element_ty), mask=ok)


# Launch wrappers -------------------------------------------------------------------------


def _grid(N: int, hidden: int) -> tuple[int, int]:
    return cdiv(N, SWIGLU_ROWS), cdiv(hidden, SWIGLU_COLUMNS)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up [..., hidden] of gate_up [..., 2·hidden] = [gate | up], in its dtype."""
    hidden = gate_up.shape[-1] // 2
    x = as_rows(gate_up)
    out = torch.empty(*gate_up.shape[:-1], hidden, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    _swiglu_fwd_kernel[_grid(x.shape[0], hidden)](
        x, out, x.shape[0], hidden, x.stride(0), hidden, ROWS=SWIGLU_ROWS,
        COLUMNS=SWIGLU_COLUMNS)
    return out


def swiglu_backward(grad: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up's gradient (its shape and dtype, contiguous) from the output's ``grad``."""
    hidden = gate_up.shape[-1] // 2
    x, dout = as_rows(gate_up), as_rows(grad)
    dx = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    if dx.numel() == 0:
        return dx
    _swiglu_bwd_kernel[_grid(x.shape[0], hidden)](
        x, dout, dx, x.shape[0], hidden, x.stride(0), dout.stride(0), 2 * hidden,
        ROWS=SWIGLU_ROWS, COLUMNS=SWIGLU_COLUMNS)
    return dx


swiglu_op = torch.library.custom_op("nsa::swiglu", swiglu, mutates_args=())
swiglu_backward_op = torch.library.custom_op("nsa::swiglu_backward", swiglu_backward,
                                             mutates_args=())


@swiglu_op.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@swiglu_backward_op.register_fake
def _(grad, gate_up):
    return torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)


class _SwiGLUFunction(torch.autograd.Function):
    """:func:`swiglu` forward, :func:`swiglu_backward` backward; keeps gate_up alone."""

    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return call_op(swiglu_op, swiglu, gate_up)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        return call_op(swiglu_backward_op, swiglu_backward, grad, gate_up)


def swiglu_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of gate_up [..., 2·hidden] = [gate | up] (an even last dim), with
    autograd (module docstring)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu takes [gate | up] halves, got a last dim of "
                         f"{gate_up.shape[-1]}")
    return _SwiGLUFunction.apply(gate_up)
