"""One decode step's compressed-token update in Triton: two kernels per key/value set (one for
the mean compressor).

When a step appends the last token of a compressed block (position i·d + l - 1), the layer
compresses the block from the compressor's input ring and writes compressed token i. The
PyTorch form (``NSAttention.decode``) gathers the ring, runs the compressor (the MLP's two
products with the position embedding's share in the first's bias, a GELU), rotates the key at
the block's centre and writes both caches with their index arithmetic: about forty small
kernels per layer on such a step, which a graphed decode step of a small model pays for kernel
by kernel (bench/decode_ops.py). Here:

1. ``_first_product_kernel`` (MLP only), one program per (sequence, KV head, slice of the
   flattened block's l·D inputs): that slice of the first product, a float32 partial per
   hidden unit. The slices spread W1 (hidden × l·D) over many programs: at B = 1 one program
   per (sequence, KV head) would read all of it alone, a latency chain on one SM (measured:
   ~96 µs per launch at m7c-125m's shape, bench/NOTES.md, decode v5).
2. ``_finish_kernel``, one program per (sequence, KV head): the partials summed in a fixed
   order (deterministic), bias, GELU, the second product (or the block's mean), the rotation
   at the block's centre, and the write where the step completes a token.

The kernels compute what the PyTorch form computes in its dtypes: the first product of the
block and, as a bias, that of the position embedding plus b1 (``Compressor``), each product
and the GELU rounded to the compute dtype (the autocast dtype, or the weights' dtype without
autocast), products accumulated in float32, the rotated key rounded to the compute dtype, then
stored in the cache's dtype. (The PyTorch form sums a block's product from chunks of d
tokens, each rounded; here it is one sum: the results differ by that rounding.) The rotation's
cos/sin come from a table of every compressed token's centre that the layer builds once with
the PyTorch form's own ops (no trigonometry in the kernel: the same angles, bit for bit).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nsa.ops.triton.common import gelu
from nsa.ops.triton.jit import kernel
from nsa.ops.triton.launch import cdiv, pow2

FIRST_PRODUCT_TILE = 8192  # most elements one program loads at once: W1's, or the partials'


@triton.jit
def _block_start(POS, b, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr):
    """-> (the first position of the block that appending POS[b] would complete, clamped to
    0; whether it completes one)."""
    start = tl.load(POS + b) - (CMP_BLOCK - 1)
    complete = (start >= 0) & (start % CMP_STRIDE == 0)
    return tl.maximum(start, 0), complete


@kernel
def _first_product_kernel(RING, POS, POSITION, W1, PARTIAL, POSITION_PARTIAL, COMPUTE_DTYPE,
                          stride_rb, stride_rs, stride_rh, H, HIDDEN,
                          CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, D: tl.constexpr,
                          INPUTS: tl.constexpr, BLOCK_HID: tl.constexpr):
    """Program (b·H + h, s): PARTIAL[b·H + h, s, j] = Σ_f W1[j, f] · x[f] over inputs f of
    slice s (INPUTS of them), x = the flattened block (ring token (start + f // D) % l, channel
    f % D) in the compute dtype; programs (0, s) also write POSITION_PARTIAL[s, j], the same
    sum over the flattened POSITION [l, D] (the position embedding's share, for every row)."""
    COMPUTE = COMPUTE_DTYPE.dtype.element_ty
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    start, _ = _block_start(POS, b, CMP_BLOCK, CMP_STRIDE)
    f = tl.program_id(1) * INPUTS + tl.arange(0, INPUTS)
    f_ok = f < CMP_BLOCK * D
    t = f // D
    row = RING + b.to(tl.int64) * stride_rb + h * stride_rh + ((start + t) % CMP_BLOCK) * stride_rs
    x = tl.load(row + f % D, mask=f_ok, other=0.0).to(COMPUTE).to(tl.float32)
    j = tl.arange(0, BLOCK_HID)
    w = tl.load(W1 + j[:, None] * (CMP_BLOCK * D) + f[None, :],
                mask=(j < HIDDEN)[:, None] & f_ok[None, :], other=0.0).to(COMPUTE).to(tl.float32)
    partial = tl.sum(w * x[None, :], axis=1)
    tl.store(PARTIAL + (bh * tl.num_programs(1) + tl.program_id(1)) * BLOCK_HID + j, partial)
    if bh == 0:
        p = tl.load(POSITION + f, mask=f_ok, other=0.0).to(COMPUTE).to(tl.float32)
        tl.store(POSITION_PARTIAL + tl.program_id(1) * BLOCK_HID + j,
                 tl.sum(w * p[None, :], axis=1))


@kernel
def _finish_kernel(RING, POS, PARTIAL, POSITION_PARTIAL, B1, W2, B2, COS, SIN, OUT,
                   COMPUTE_DTYPE,
                   stride_rb, stride_rs, stride_rh, stride_ob, stride_on, stride_oh,
                   H, NUM_CMP, HIDDEN, SLICES,
                   CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, D: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HID: tl.constexpr,
                   BLOCK_SLICES: tl.constexpr, BLOCK_L: tl.constexpr, MLP: tl.constexpr,
                   ROTATE: tl.constexpr):
    """Program b·H + h: if appending POS[b] completes compressed token i, OUT[b, i, h] = the
    compressor's output (MLP: the SLICES partials of PARTIAL summed, BLOCK_SLICES at a time,
    + the bias (POSITION_PARTIAL's summed the same way, + B1), GELU, W2 [D, HIDDEN], + B2;
    else the mean of the block in RING [B, l, H, D]), rotated at the block's
    centre by COS/SIN [NUM_CMP, HALF] when ROTATE. Channels are handled as two halves, [0,
    HALF) and [HALF, D) (the rotation's pairs)."""
    COMPUTE = COMPUTE_DTYPE.dtype.element_ty
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    start, complete = _block_start(POS, b, CMP_BLOCK, CMP_STRIDE)
    index = tl.minimum(start // CMP_STRIDE, NUM_CMP - 1)
    i = tl.arange(0, BLOCK_HALF)
    lo_ok = i < HALF
    hi_ok = HALF + i < D
    if MLP:
        j = tl.arange(0, BLOCK_HID)
        j_ok = j < HIDDEN
        acc = tl.zeros([BLOCK_HID], tl.float32)
        acc_position = tl.zeros([BLOCK_HID], tl.float32)
        for s0 in range(0, SLICES, BLOCK_SLICES):  # a fixed order: deterministic
            s = s0 + tl.arange(0, BLOCK_SLICES)
            parts = tl.load(PARTIAL + (bh * SLICES + s[:, None]) * BLOCK_HID + j[None, :],
                            mask=(s < SLICES)[:, None], other=0.0)
            acc += tl.sum(parts, axis=0)
            parts = tl.load(POSITION_PARTIAL + s[:, None] * BLOCK_HID + j[None, :],
                            mask=(s < SLICES)[:, None], other=0.0)
            acc_position += tl.sum(parts, axis=0)
        b1 = tl.load(B1 + j, mask=j_ok, other=0.0).to(COMPUTE).to(tl.float32)
        bias = (acc_position + b1).to(COMPUTE).to(tl.float32)
        hidden = (acc.to(COMPUTE).to(tl.float32) + bias).to(COMPUTE).to(tl.float32)
        hidden = gelu(hidden).to(COMPUTE)
        hidden = hidden.to(tl.float32)
        w2 = W2 + i[:, None] * HIDDEN + j[None, :]
        w2_lo = tl.load(w2, mask=lo_ok[:, None] & j_ok[None, :], other=0.0)
        w2_hi = tl.load(w2 + HALF * HIDDEN, mask=hi_ok[:, None] & j_ok[None, :], other=0.0)
        lo = tl.sum(w2_lo.to(COMPUTE).to(tl.float32) * hidden[None, :], axis=1)
        hi = tl.sum(w2_hi.to(COMPUTE).to(tl.float32) * hidden[None, :], axis=1)
        lo += tl.load(B2 + i, mask=lo_ok, other=0.0).to(COMPUTE).to(tl.float32)
        hi += tl.load(B2 + HALF + i, mask=hi_ok, other=0.0).to(COMPUTE).to(tl.float32)
    else:
        t = tl.arange(0, BLOCK_L)
        rows = (RING + b.to(tl.int64) * stride_rb + h * stride_rh
                + ((start + t) % CMP_BLOCK)[:, None] * stride_rs)
        t_ok = (t < CMP_BLOCK)[:, None]
        lo = tl.sum(tl.load(rows + i[None, :], mask=t_ok & lo_ok[None, :], other=0.0)
                    .to(tl.float32), axis=0) / CMP_BLOCK
        hi = tl.sum(tl.load(rows + HALF + i[None, :], mask=t_ok & hi_ok[None, :], other=0.0)
                    .to(tl.float32), axis=0) / CMP_BLOCK
    lo = lo.to(COMPUTE).to(tl.float32)
    hi = hi.to(COMPUTE).to(tl.float32)
    if ROTATE:
        cos = tl.load(COS + index * HALF + i, mask=lo_ok, other=0.0)
        sin = tl.load(SIN + index * HALF + i, mask=lo_ok, other=0.0)
        rotated_lo = lo * cos - hi * sin
        hi = hi * cos + lo * sin
        lo = rotated_lo
    out = OUT + b.to(tl.int64) * stride_ob + index * stride_on + h * stride_oh
    out_ty = OUT.dtype.element_ty
    tl.store(out + i, lo.to(COMPUTE).to(out_ty), mask=lo_ok & complete)
    tl.store(out + HALF + i, hi.to(COMPUTE).to(out_ty), mask=hi_ok & complete)


@functools.cache
def _dtype_pointer(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A one-element tensor whose pointer tells a kernel a dtype (kept: graph-safe)."""
    return torch.zeros(1, dtype=dtype, device=device)


def compress_step_triton(ring: torch.Tensor, pos: torch.Tensor, compressor, out: torch.Tensor,
                         compute_dtype: torch.dtype, rope=None, *,
                         inputs_per_program: int | None = None) -> None:
    """Write the compressed token that appending ``pos`` [B] completes (sequences completing
    none are left as they are) into ``out`` [B, C, H, D] (contiguous last dim), from the ring
    ``ring`` [B, l, H, D] of ``compressor`` (nsa.layers.compressor.Compressor), computed in
    ``compute_dtype``; keys rotated at the block's centre by ``rope`` = (cos, sin) [C, D/2]
    float32, contiguous (one row per compressed token). ``inputs_per_program`` (a power of
    two): the slice of the block's l·D inputs one program of the MLP's first product takes
    (default: FIRST_PRODUCT_TILE elements of W1 per program)."""
    B, block, H, D = ring.shape
    mlp = compressor.kind == "mlp"
    cos, sin = (out, out) if rope is None else rope  # (out: not read)
    compute = _dtype_pointer(compute_dtype, ring.device)
    ring_strides = (ring.stride(0), ring.stride(1), ring.stride(2))
    if inputs_per_program is not None and (inputs_per_program < 1
                                           or inputs_per_program & (inputs_per_program - 1)):
        raise ValueError(f"inputs_per_program must be a power of two, got {inputs_per_program}")
    hidden, slices, block_hid = 1, 1, 1
    partial = position_partial = bias1 = w2 = bias2 = out  # not read by the mean compressor
    if mlp:
        first, last = compressor.mlp[0], compressor.mlp[2]
        hidden, block_hid = first.out_features, pow2(first.out_features, 1)
        inputs = inputs_per_program or min(pow2(block * D, 1),
                                           max(16, FIRST_PRODUCT_TILE // block_hid))
        slices = cdiv(block * D, inputs)
        partial = torch.empty(B * H, slices, block_hid, dtype=torch.float32,
                              device=ring.device)
        position_partial = torch.empty(slices, block_hid, dtype=torch.float32,
                                       device=ring.device)
        _first_product_kernel[(B * H, slices)](
            ring, pos, compressor.position.contiguous(), first.weight.contiguous(), partial,
            position_partial, compute, *ring_strides, H, hidden, CMP_BLOCK=block,
            CMP_STRIDE=compressor.stride, D=D, INPUTS=inputs, BLOCK_HID=block_hid, num_warps=4)
        bias1, w2, bias2 = (w.contiguous() for w in (first.bias, last.weight, last.bias))
    half = (D + 1) // 2
    _finish_kernel[(B * H,)](
        ring, pos, partial, position_partial, bias1, w2, bias2, cos, sin, out, compute,
        *ring_strides, out.stride(0), out.stride(1), out.stride(2), H, out.shape[1], hidden, slices,
        CMP_BLOCK=block, CMP_STRIDE=compressor.stride, D=D, HALF=half,
        BLOCK_HALF=pow2(half, 1), BLOCK_HID=block_hid,
        BLOCK_SLICES=min(pow2(slices, 1), max(1, FIRST_PRODUCT_TILE // block_hid)),
        BLOCK_L=pow2(block, 1), MLP=mlp, ROTATE=rope is not None, num_warps=4)
