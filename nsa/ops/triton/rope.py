"""Rotary position embedding of tensors at the same positions, up to three per Triton launch,
forward and backward (the rotation's backward is the rotation by the opposite angle),
registered as the op ``nsa::rope``; ``nsa::rope_into`` writes its rotations into given tensors
(the views of one gradient in ``nsa.layers.projection``), and copies there the tensors it is
told not to rotate (a layer's unrotated keys and values: one launch for what took one copy
kernel each).

The PyTorch form (``nsa.layers.rope.rotate_torch``) runs eight kernels per rotation (a float
copy, four products, a difference, a sum, a concatenation and the cast back) and about as many
in its backward. This kernel reads each x once and writes its rotation once.

Why several tensors per launch: eager training is host-bound, and each Triton launch costs the
host ~45 µs on the GPU machine, each autograd.Function call more. An NSA layer rotates its
queries and the keys of the selected and window branches at the same positions; one autograd
node with one launch forward and one backward for all of them replaces three of each. The grid
is the concatenation of the tensors' row tiles: a program finds its tensor from its program id
and reads that tensor's pointers, head count and strides.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton.language as tl

from nsa.ops.triton.jit import kernel
from nsa.ops.triton.launch import call_op, cdiv, pow2, unit_stride

ROPE_ROWS = 32  # (b, t, head) rows per program
ROPE_MAX_TENSORS = 3  # tensors rotated by one launch (the kernel's slots)


@kernel
def _rope_kernel(X0, X1, X2, OUT0, OUT1, OUT2, COS, SIN, B, T, HEADS0, HEADS1, HEADS2,
                 ROTATE0, ROTATE1, ROTATE2, END0, END1, stride_x0b, stride_x0t, stride_x0h,
                 stride_x1b, stride_x1t, stride_x1h, stride_x2b, stride_x2t, stride_x2h,
                 stride_o0b, stride_o0t, stride_o0h, stride_o1b, stride_o1t, stride_o1h,
                 stride_o2b, stride_o2t, stride_o2h, stride_cb, stride_ct,
                 SIGN: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 ROWS: tl.constexpr):
    """OUTk [B, T, HEADSk, 2·HALF] = Xk [B, T, HEADSk, 2·HALF] rotated (both in their strides,
    the last one 1): channel pairs (i, i + HALF) by the angle of the row's (b, t) (cos, sin
    [B or 1, T, HALF]), SIGN = -1: the inverse; copied where ROTATEk is 0 (no angle read: cos
    1, sin 0). Programs [0, END0) take X0, [END0, END1) X1, [END1, grid) X2."""
    pid = tl.program_id(0)
    in1 = pid >= END0
    in2 = pid >= END1
    # This program's tensor: scalar selects among the three slots.
    X = tl.where(in2, X2, tl.where(in1, X1, X0))
    OUT = tl.where(in2, OUT2, tl.where(in1, OUT1, OUT0))
    heads = tl.where(in2, HEADS2, tl.where(in1, HEADS1, HEADS0))
    rotate = tl.where(in2, ROTATE2, tl.where(in1, ROTATE1, ROTATE0)) != 0
    stride_xb = tl.where(in2, stride_x2b, tl.where(in1, stride_x1b, stride_x0b))
    stride_xt = tl.where(in2, stride_x2t, tl.where(in1, stride_x1t, stride_x0t))
    stride_xh = tl.where(in2, stride_x2h, tl.where(in1, stride_x1h, stride_x0h))
    stride_ob = tl.where(in2, stride_o2b, tl.where(in1, stride_o1b, stride_o0b))
    stride_ot = tl.where(in2, stride_o2t, tl.where(in1, stride_o1t, stride_o0t))
    stride_oh = tl.where(in2, stride_o2h, tl.where(in1, stride_o1h, stride_o0h))
    first_tile = tl.where(in2, END1, tl.where(in1, END0, 0))

    r = (pid - first_tile) * ROWS + tl.arange(0, ROWS)  # [ROWS] rows of this tensor
    row_ok = r < B * T * heads
    head = r % heads
    t = ((r // heads) % T).to(tl.int64)
    b = (r // (heads * T)).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    mask = row_ok[:, None] & (i[None, :] < HALF)
    x_rows = X + b * stride_xb + t * stride_xt + head * stride_xh
    x1 = tl.load(x_rows[:, None] + i[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows[:, None] + HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
    angle_rows = b * stride_cb + t * stride_ct
    cos = tl.load(COS + angle_rows[:, None] + i[None, :], mask=mask & rotate, other=1.0)
    sin = tl.load(SIN + angle_rows[:, None] + i[None, :], mask=mask & rotate, other=0.0) * SIGN
    out_rows = OUT + b * stride_ob + t * stride_ot + head * stride_oh
    out_ty = OUT.dtype.element_ty
    tl.store(out_rows[:, None] + i[None, :], (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(out_rows[:, None] + HALF + i[None, :], (x2 * cos + x1 * sin).to(out_ty), mask=mask)


def _launch_slots(xs: list[torch.Tensor], outs: list[torch.Tensor], cos: torch.Tensor,
                  sin: torch.Tensor, inverse: bool, rotate: list[bool]) -> None:
    """outs[k] = xs[k] rotated by cos/sin (their opposites if ``inverse``), or copied where
    not rotate[k], 1 to ROPE_MAX_TENSORS tensors in one launch."""
    B, T, _, D = xs[0].shape
    tiles = [cdiv(B * T * x.shape[2], ROPE_ROWS) for x in xs]
    if sum(tiles) == 0:
        return
    # Unused slots: the first tensor again, with no tiles (no program selects them).
    unused = ROPE_MAX_TENSORS - len(xs)
    slots, out_slots, tiles = xs + xs[:1] * unused, outs + outs[:1] * unused, tiles + [0] * unused
    rotate = [int(r) for r in rotate] + [0] * unused
    stride_cb = 0 if cos.shape[0] == 1 else cos.stride(0)
    end0 = tiles[0]
    end1 = end0 + tiles[1]
    _rope_kernel[(end1 + tiles[2],)](
        *slots, *out_slots, cos, sin, B, T, *(x.shape[2] for x in slots), *rotate, end0, end1,
        *(stride for x in slots for stride in x.stride()[:3]),
        *(stride for out in out_slots for stride in out.stride()[:3]), stride_cb, cos.stride(1),
        SIGN=-1 if inverse else 1, HALF=D // 2, BLOCK_HALF=pow2(D // 2, 1), ROWS=ROPE_ROWS)


def _launch(xs: list[torch.Tensor], outs: list[torch.Tensor], cos: torch.Tensor,
            sin: torch.Tensor, inverse: bool, rotate: list[bool]) -> None:
    """outs[k] = xs[k] rotated by cos/sin (their opposites if ``inverse``), or copied where
    not rotate[k]: one launch per ROPE_MAX_TENSORS tensors."""
    if not len(outs) == len(rotate) == len(xs):
        raise ValueError(f"nsa::rope takes as many outputs and rotate flags as tensors, got "
                         f"{len(xs)} tensors, {len(outs)} outputs, {len(rotate)} flags")
    cos, sin = cos.contiguous(), sin.contiguous()
    for first in range(0, len(xs), ROPE_MAX_TENSORS):
        last = first + ROPE_MAX_TENSORS
        _launch_slots(xs[first:last], outs[first:last], cos, sin, inverse, rotate[first:last])


def rope(xs: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
         inverse: bool) -> list[torch.Tensor]:
    """xs (tensors [B, T, heads_k, D] of one B, T, D and dtype; any strides) rotated by the
    angles of cos/sin [B or 1, T, 1, D/2] (float32), or by their opposites if ``inverse``, one
    launch per ROPE_MAX_TENSORS tensors: a new contiguous tensor per x, in x's dtype."""
    xs = [unit_stride(x) for x in xs]
    outs = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
    _launch(xs, outs, cos, sin, inverse, [True] * len(xs))
    return outs


def rope_into(xs: list[torch.Tensor], outs: list[torch.Tensor], cos: torch.Tensor,
              sin: torch.Tensor, inverse: bool, rotate: list[bool]) -> None:
    """:func:`rope` written into ``outs`` (each of its x's shape and dtype, any strides whose
    last is 1, e.g. views of one gradient), xs[k] copied as it is where not rotate[k], one
    launch per ROPE_MAX_TENSORS tensors."""
    if any(out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1
           for x, out in zip(xs, outs)):
        raise ValueError("nsa::rope_into's outputs must match its inputs in shape and dtype, "
                         "with a last stride of 1")
    _launch([unit_stride(x) for x in xs], outs, cos, sin, inverse, rotate)


rope_op = torch.library.custom_op("nsa::rope", rope, mutates_args=())
rope_into_op = torch.library.custom_op("nsa::rope_into", rope_into, mutates_args=("outs",))


@rope_op.register_fake
def _(xs, cos, sin, inverse):
    return [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]


class _RopeFunction(torch.autograd.Function):
    """The rotation of (cos, sin, *xs) and its backward, the inverse rotation of the gradients
    (the angles are constants: positions carry no gradient), each one launch. An output left
    out of the loss gets a zero gradient (autograd materialises it): rotated like the others."""

    @staticmethod
    def forward(ctx, cos, sin, *xs):
        ctx.save_for_backward(cos, sin)
        return tuple(call_op(rope_op, rope, list(xs), cos, sin, False))

    @staticmethod
    def backward(ctx, *grads):
        cos, sin = ctx.saved_tensors
        return None, None, *call_op(rope_op, rope, list(grads), cos, sin, True)


def rope_triton_many(xs: Sequence[torch.Tensor], cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each x [B, T, heads_k, D] of ``xs`` (one B, T, D and dtype) rotated by cos/sin [B or 1, T,
    1, D/2] (float32), in x's dtype: one autograd node, and one launch forward and one backward
    per ROPE_MAX_TENSORS tensors."""
    return _RopeFunction.apply(cos, sin, *xs)
