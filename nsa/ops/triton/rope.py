"""Rotary position embedding in one Triton kernel, forward and backward (the rotation's
backward is the rotation by the opposite angle), registered as the op ``nsa::rope``.

The PyTorch form (``nsa.layers.rope.rotate``) runs eight kernels per rotation (a float copy,
four products, a difference, a sum, a concatenation and the cast back) and about as many in its
backward; an NSA layer rotates four tensors per step. This kernel reads x once and writes the
rotated x once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops.triton.launch import call_op, pow2, unit_stride

ROPE_ROWS = 32  # (b, t, head) rows per program


@triton.jit
def _rope_kernel(X, COS, SIN, OUT, N, T, HEADS, stride_xb, stride_xt, stride_xh, stride_cb,
                 stride_ct, SIGN: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 ROWS: tl.constexpr):
    """OUT [N = B·T·HEADS rows, 2·HALF] (contiguous) = x rotated: channel pairs (i, i + HALF)
    by the angle of the row's (b, t) (cos, sin [B or 1, T, HALF]), SIGN = -1: the inverse."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = r < N
    head = r % HEADS
    t = (r // HEADS) % T
    b = (r // (HEADS * T)).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    mask = row_ok[:, None] & (i[None, :] < HALF)
    x_rows = X + b * stride_xb + t.to(tl.int64) * stride_xt + head * stride_xh
    x1 = tl.load(x_rows[:, None] + i[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows[:, None] + HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
    angle_rows = b * stride_cb + t.to(tl.int64) * stride_ct
    cos = tl.load(COS + angle_rows[:, None] + i[None, :], mask=mask, other=0.0)
    sin = tl.load(SIN + angle_rows[:, None] + i[None, :], mask=mask, other=0.0) * SIGN
    out_rows = OUT + r.to(tl.int64) * (2 * HALF)
    out_ty = OUT.dtype.element_ty
    tl.store(out_rows[:, None] + i[None, :], (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(out_rows[:, None] + HALF + i[None, :], (x2 * cos + x1 * sin).to(out_ty), mask=mask)


def _rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int):
    """x [B, T, heads, D] (unit last stride), cos/sin [B or 1, T, 1, D/2] float32 -> x rotated,
    contiguous, in x's dtype."""
    B, T, heads, D = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    N = B * T * heads
    if N == 0:
        return out
    cos, sin = cos.contiguous(), sin.contiguous()
    stride_cb = 0 if cos.shape[0] == 1 else cos.stride(0)
    _rope_kernel[(triton.cdiv(N, ROPE_ROWS),)](
        x, cos, sin, out, N, T, heads, *x.stride()[:3], stride_cb, cos.stride(1),
        SIGN=sign, HALF=D // 2, BLOCK_HALF=pow2(D // 2, 1), ROWS=ROPE_ROWS)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x rotated by the angles of cos/sin, or by their opposites if ``inverse``."""
    return _rope_launch(unit_stride(x), cos, sin, -1 if inverse else 1)


rope_op = torch.library.custom_op("nsa::rope", rope, mutates_args=())


@rope_op.register_fake
def _(x, cos, sin, inverse):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


class _RopeFunction(torch.autograd.Function):
    """The rotation and its backward, the inverse rotation of the gradient (the angles are
    constants: positions carry no gradient)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return call_op(rope_op, rope, x, cos, sin, False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return call_op(rope_op, rope, grad, cos, sin, True), None, None


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D] rotated by cos/sin [B or 1, T, 1, D/2] (float32), in x's dtype."""
    return _RopeFunction.apply(x, cos, sin)
