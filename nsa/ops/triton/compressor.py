"""The MLP compressor of a training or prefill forward (``nsa.layers.compressor.Compressor``,
a compressed token every d tokens from 0) in Triton, forward and backward, registered as the
ops ``nsa::compress`` and ``nsa::compress_backward``.

The PyTorch form cuts the tokens into chunks of d (a copy), multiplies them by W1, sums each
block's c = l / d chunk products, adds the position embedding's share and b1, applies the GELU
and the second layer: at m7c-125m's shape about 12 kernels forward and 25 backward per
compressor, ~3 ms of a training step's GPU time for its 24 compressors, and ~60 host operators
each (bench/NOTES.md, fortieth session).

A launch takes one compressor or two of one shape (slots; a layer's key and value
compressors): each program reads its slot's input, weights and output gradient, so the two
share each launch's grid and one autograd node. These kernels are short and latency-bound, so
two in one grid take less than twice one's time (a layer's pair on an H200: 146 -> 100 µs
forward+backward; bench/NOTES.md, forty-first session). Per compressor, with x [B, T, H, D]
(any strides, the last 1), block i = tokens [i·d, i·d + l) plus the position embedding P [l,
D], and the weights W1 [hidden, l·D], W2 [D, hidden] in the compute dtype:

- forward, one program per (ROWS compressed tokens, sequence, KV head): the first product as a
  loop over the block's l tokens (step j: the rows' x[i·d + j] + P[j], [ROWS, D], times W1's
  columns of token j, [D, hidden]), + b1: the pre-activation (float32, kept for the backward);
  GELU; the second product, + b2.
- backward:
  1. ``_hidden_grad_kernel``, per tile of compressed-token rows: dh = (dy W2) · GELU'(pre).
  2. ``_input_grad_kernel``, per (tile of d-token chunks m, residue r, sequence, KV head): token
     t = m·d + r is token j = r + k·d of block m - k for k < c, so dx[t] = Σ_k dh[m - k] times
     W1's columns of token j. Every token is written (0 where no block holds it).
  3. ``_weight_grads_kernel``, per (block token j, split of the rows): W1's columns of token j
     get Σ dh^T (x[i·d + j] + P[j]) over the split's (sequence, block, head) rows, and P[j]
     (Σ dh) times those columns; the programs of j = 0 also sum dh (b1's), and those of j = l
     the split's dy^T GELU(pre) (W2's) and dy (b2's). Each split writes its float32 partials
     to its row of one buffer, whose rows one PyTorch sum adds up in order.

No float atomics: the gradients are deterministic. Dtypes as the PyTorch form's under autocast:
operands rounded to the compute dtype (the autocast dtype, or the weights'), products
accumulated in float32, dh and the output rounded to it. (The PyTorch form also rounds each
chunk product, their sum, the bias and the pre-activation: the two differ by those roundings.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops.params import compressed_length
from nsa.ops.triton.common import dot, gelu, gelu_grad
from nsa.ops.triton.jit import kernel
from nsa.ops.triton.launch import call_op, cdiv, pow2, unit_stride

# Rows (compressed tokens, d-token chunks, or gradient rows) per program of each kernel,
# measured on a layer's pair at m7c-125m's shape (H200, `bench/compressor.py --rows 32,64,128
# --splits 2,4,8,16`; rows 16 from the run before: forward 22.3 / 20.0 / 22.0 / 47.3 µs at 16 /
# 32 / 64 / 128, hidden gradient 3.3 / 4.0 / 6.1 / 25.9, input gradient - / 19.5 / 13.8 /
# 16.6; the weight gradients - / 54.1 / 47.2 / 66.5 at 8 splits and 91.4 / 61.6 / 46.7 / 47.3
# at 2 / 4 / 8 / 16 splits of 64 rows, measured with x loaded straight into the product, a
# variant not kept: its cp.async ring raced, offline; bench/NOTES.md, forty-first session).
# Where the hidden width exceeds 128 every kernel takes half as many (at least 16) with 8
# warps: their tiles of rows x hidden (and the weights') spill otherwise (offline sm_90).
ROWS = dict(forward=32, hidden_grad=16, input_grad=64, weight_grads=64)
MAX_DIM, MAX_HIDDEN = 128, 256  # widest tiles (padded to powers of two) the kernels take
WEIGHT_SPLITS = 8  # row splits of the weights' gradients (programs: (l + 1) x splits x slots)


@triton.jit
def _slot(slot, a0, a1):
    """a1 for programs of slot 1, else a0 (scalars or pointers)."""
    return tl.where(slot == 1, a1, a0)


@kernel
def _compress_fwd_kernel(X0, X1, P0, P1, W1_0, W1_1, B1_0, B1_1, W2_0, W2_1, B2_0, B2_1, OUT,
                         PRE, stride_x0b, stride_x0t, stride_x0h, stride_x1b, stride_x1t,
                         stride_x1h, BH, NUM_CMP, H, HIDDEN,
                         CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, D: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_HID: tl.constexpr, ROWS: tl.constexpr,
                         IEEE: tl.constexpr):
    """OUT [S, B, NUM_CMP, H, D] and PRE [S, B, NUM_CMP, H, HIDDEN] (float32, the
    pre-activation) of ROWS compressed tokens of slot s (compressor s: its input Xs and weights
    Ps, W1_s, ...), sequence b, KV head h: program axis 1 is (s·B + b)·H + h (module
    docstring); W1, W2 and OUT in the compute dtype."""
    COMPUTE = OUT.dtype.element_ty
    pid = tl.program_id(1)
    slot = pid // BH
    b = ((pid % BH) // H).to(tl.int64)
    h = pid % H
    X = _slot(slot, X0, X1)
    POSITION = _slot(slot, P0, P1)
    W1 = _slot(slot, W1_0, W1_1)
    W2 = _slot(slot, W2_0, W2_1)
    stride_xb = _slot(slot, stride_x0b, stride_x1b)
    stride_xt = _slot(slot, stride_x0t, stride_x1t)
    stride_xh = _slot(slot, stride_x0h, stride_x1h)
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    i_ok = i < NUM_CMP
    e = tl.arange(0, BLOCK_D)
    e_ok = e < D
    n = tl.arange(0, BLOCK_HID)
    n_ok = n < HIDDEN
    x_rows = X + b * stride_xb + h * stride_xh + (i * CMP_STRIDE).to(tl.int64) * stride_xt
    x_mask = i_ok[:, None] & e_ok[None, :]
    w1_token = W1 + n[None, :] * (CMP_BLOCK * D) + e[:, None]  # [BLOCK_D, BLOCK_HID] at j = 0
    w_mask = e_ok[:, None] & n_ok[None, :]
    pre = tl.zeros([ROWS, BLOCK_HID], tl.float32)
    for j in range(CMP_BLOCK):
        x = tl.load(x_rows[:, None] + j * stride_xt + e[None, :], mask=x_mask, other=0.0)
        p = tl.load(POSITION + j * D + e, mask=e_ok, other=0.0)
        block = (x.to(tl.float32) + p.to(tl.float32)[None, :]).to(COMPUTE)
        pre += dot(block, tl.load(w1_token + j * D, mask=w_mask, other=0.0), IEEE)
    b1 = tl.load(_slot(slot, B1_0, B1_1) + n, mask=n_ok, other=0.0)
    pre += b1.to(COMPUTE).to(tl.float32)[None, :]
    rows = ((slot * (BH // H) + b) * NUM_CMP + i) * H + h  # rows of [S, B, NUM_CMP, H]
    tl.store(PRE + rows[:, None] * HIDDEN + n[None, :], pre, mask=i_ok[:, None] & n_ok[None, :])
    w2 = tl.load(W2 + e[None, :] * HIDDEN + n[:, None], mask=n_ok[:, None] & e_ok[None, :],
                 other=0.0)  # [BLOCK_HID, BLOCK_D]: W2^T
    out = dot(gelu(pre).to(COMPUTE), w2, IEEE)
    b2 = tl.load(_slot(slot, B2_0, B2_1) + e, mask=e_ok, other=0.0)
    out += b2.to(COMPUTE).to(tl.float32)[None, :]
    tl.store(OUT + rows[:, None] * D + e[None, :], out.to(COMPUTE), mask=x_mask)


@kernel
def _hidden_grad_kernel(DY0, DY1, PRE, W2_0, W2_1, DH, N, HIDDEN,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HID: tl.constexpr,
                        ROWS: tl.constexpr, IEEE: tl.constexpr):
    """DH[s] = (DYs W2_s) · GELU'(PRE[s]) [N, HIDDEN] for ROWS of the N rows of slot s =
    program axis 1 (DYs [N, D]; PRE [S, N, HIDDEN] float32); DY, W2 and DH in the compute
    dtype."""
    COMPUTE = DH.dtype.element_ty
    slot = tl.program_id(1)
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    r_ok = r < N
    e = tl.arange(0, BLOCK_D)
    e_ok = e < D
    n = tl.arange(0, BLOCK_HID)
    n_ok = n < HIDDEN
    hid_mask = r_ok[:, None] & n_ok[None, :]
    dy = tl.load(_slot(slot, DY0, DY1) + r[:, None] * D + e[None, :],
                 mask=r_ok[:, None] & e_ok[None, :], other=0.0)
    w2 = tl.load(_slot(slot, W2_0, W2_1) + e[:, None] * HIDDEN + n[None, :],
                 mask=e_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_D, BLOCK_HID]
    hidden_rows = (slot * N + r)[:, None] * HIDDEN + n[None, :]
    pre = tl.load(PRE + hidden_rows, mask=hid_mask, other=0.0)
    d_act = dot(dy, w2, IEEE).to(COMPUTE).to(tl.float32)
    tl.store(DH + hidden_rows, (d_act * gelu_grad(pre)).to(COMPUTE), mask=hid_mask)


@kernel
def _input_grad_kernel(DH, W1_0, W1_1, DX0, DX1, stride_x0b, stride_x0t, stride_x0h,
                       stride_x1b, stride_x1t, stride_x1h, BH, T, NUM_CMP, H, HIDDEN,
                       CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, D: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_HID: tl.constexpr, ROWS: tl.constexpr,
                       IEEE: tl.constexpr):
    """DXs [B, T, H, D] at tokens t = m·CMP_STRIDE + r of ROWS chunks m (program axis 0),
    residue r (axis 1), slot s, sequence b and KV head h (axis 2: (s·B + b)·H + h): Σ over
    the blocks i = m - k (k < CMP_BLOCK / CMP_STRIDE) that hold t as their token j = r +
    k·CMP_STRIDE of DH[s, b, i, h] [HIDDEN] times W1_s's columns of token j (DH and W1 in the
    compute dtype)."""
    m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    residue = tl.program_id(1)
    pid = tl.program_id(2)
    slot = pid // BH
    sb = (pid // H).to(tl.int64)  # s·B + b
    b = sb % (BH // H)
    h = pid % H
    W1 = _slot(slot, W1_0, W1_1)
    t = m * CMP_STRIDE + residue
    t_ok = t < T
    e = tl.arange(0, BLOCK_D)
    e_ok = e < D
    n = tl.arange(0, BLOCK_HID)
    n_ok = n < HIDDEN
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for k in range(CMP_BLOCK // CMP_STRIDE):
        i = m - k
        ok = t_ok & (i >= 0) & (i < NUM_CMP)
        rows = (sb * NUM_CMP + i) * H + h
        dh = tl.load(DH + rows[:, None] * HIDDEN + n[None, :], mask=ok[:, None] & n_ok[None, :],
                     other=0.0)
        token = residue + k * CMP_STRIDE
        w1 = tl.load(W1 + n[:, None] * (CMP_BLOCK * D) + token * D + e[None, :],
                     mask=n_ok[:, None] & e_ok[None, :], other=0.0)
        acc += dot(dh, w1, IEEE)
    stride_xb = _slot(slot, stride_x0b, stride_x1b)
    stride_xt = _slot(slot, stride_x0t, stride_x1t)
    stride_xh = _slot(slot, stride_x0h, stride_x1h)
    dx_rows = _slot(slot, DX0, DX1) + b * stride_xb + h * stride_xh + t.to(tl.int64) * stride_xt
    tl.store(dx_rows[:, None] + e[None, :], acc.to(DX0.dtype.element_ty),
             mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _split_rows(start, end, NUM_CMP, H, ROWS: tl.constexpr):
    """The rows [start, start + ROWS) (those < end valid) of [B, NUM_CMP, H] -> (r as int64,
    valid, b as int64, compressed token i, KV head h)."""
    r = start + tl.arange(0, ROWS)
    return r.to(tl.int64), r < end, (r // (H * NUM_CMP)).to(tl.int64), (r // H) % NUM_CMP, r % H


@triton.jit
def _w1_grads(DH, X, POSITION, W1, row, first, end, j, stride_xb, stride_xt, stride_xh,
              NUM_CMP, H, HIDDEN, POSITION_AT, B1_AT, CMP_BLOCK: tl.constexpr,
              CMP_STRIDE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_HID: tl.constexpr, ROWS: tl.constexpr, IEEE: tl.constexpr):
    """Into ``row``: the sums over rows [first, end) of W1's gradient at its columns of block
    token j and of P[j]'s; b1's too for j = 0."""
    e = tl.arange(0, BLOCK_D)
    e_ok = e < D
    n = tl.arange(0, BLOCK_HID)
    n_ok = n < HIDDEN
    p = tl.load(POSITION + j * D + e, mask=e_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_HID, BLOCK_D], tl.float32)
    dh_sum = tl.zeros([BLOCK_HID], tl.float32)
    for start in range(first, end, ROWS):
        r, r_ok, b, i, h = _split_rows(start, end, NUM_CMP, H, ROWS)
        dh = tl.load(DH + r[:, None] * HIDDEN + n[None, :], mask=r_ok[:, None] & n_ok[None, :],
                     other=0.0)
        x_rows = X + b * stride_xb + h * stride_xh + (i * CMP_STRIDE + j).to(tl.int64) * stride_xt
        x = tl.load(x_rows[:, None] + e[None, :], mask=r_ok[:, None] & e_ok[None, :], other=0.0)
        block = tl.where(r_ok[:, None], x.to(tl.float32) + p[None, :], 0.0).to(DH.dtype.element_ty)
        acc += dot(tl.trans(dh), block, IEEE)
        dh_sum += tl.sum(dh.to(tl.float32), axis=0)
    w_mask = n_ok[:, None] & e_ok[None, :]
    tl.store(row + n[:, None] * (CMP_BLOCK * D) + j * D + e[None, :], acc, mask=w_mask)
    w1 = tl.load(W1 + n[:, None] * (CMP_BLOCK * D) + j * D + e[None, :], mask=w_mask, other=0.0)
    tl.store(row + POSITION_AT + j * D + e, tl.sum(dh_sum[:, None] * w1.to(tl.float32), axis=0),
             mask=e_ok)
    if j == 0:
        tl.store(row + B1_AT + n, dh_sum, mask=n_ok)


@triton.jit
def _w2_grads(DY, PRE, row, first, end, NUM_CMP, H, HIDDEN, W2_AT, B2_AT, D: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_HID: tl.constexpr, ROWS: tl.constexpr,
              IEEE: tl.constexpr):
    """Into ``row``: the sums over rows [first, end) of W2's gradient, dy^T GELU(pre), and of
    b2's."""
    e = tl.arange(0, BLOCK_D)
    e_ok = e < D
    n = tl.arange(0, BLOCK_HID)
    n_ok = n < HIDDEN
    acc_w2 = tl.zeros([BLOCK_D, BLOCK_HID], tl.float32)
    dy_sum = tl.zeros([BLOCK_D], tl.float32)
    for start in range(first, end, ROWS):
        r, r_ok, b, i, h = _split_rows(start, end, NUM_CMP, H, ROWS)
        dy = tl.load(DY + r[:, None] * D + e[None, :], mask=r_ok[:, None] & e_ok[None, :],
                     other=0.0)
        pre = tl.load(PRE + r[:, None] * HIDDEN + n[None, :],
                      mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc_w2 += dot(tl.trans(dy), gelu(pre).to(DY.dtype.element_ty), IEEE)
        dy_sum += tl.sum(dy.to(tl.float32), axis=0)
    tl.store(row + W2_AT + e[:, None] * HIDDEN + n[None, :], acc_w2,
             mask=e_ok[:, None] & n_ok[None, :])
    tl.store(row + B2_AT + e, dy_sum, mask=e_ok)


@kernel
def _weight_grads_kernel(DH, DY0, DY1, PRE, X0, X1, P0, P1, W1_0, W1_1, PARTIAL,
                         stride_x0b, stride_x0t, stride_x0h, stride_x1b, stride_x1t,
                         stride_x1h, stride_ps, N, NUM_CMP, H, HIDDEN,
                         SPLIT_ROWS, W2_AT, POSITION_AT, B1_AT, B2_AT,
                         CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, D: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_HID: tl.constexpr, ROWS: tl.constexpr,
                         IEEE: tl.constexpr):
    """Row s·splits + k of PARTIAL (float32, row stride stride_ps), for slot s = program axis
    2 and split k = axis 1: the sums over split k's rows (SPLIT_ROWS of the N rows of [B,
    NUM_CMP, H], a multiple of ROWS) of slot s's gradients. Program axis 0 is j: for j <
    CMP_BLOCK, W1's at its columns of block token j ([HIDDEN, CMP_BLOCK·D] from column 0) and
    P[j]'s (at POSITION_AT + j·D), and for j = 0 b1's too (at B1_AT); for j = CMP_BLOCK, W2's
    ([D, HIDDEN] at W2_AT) and b2's (at B2_AT), in programs of their own (they were the
    j = 0 programs' second loop, about doubling those programs' work: 49 -> 41 µs a layer's
    pair at m7c-125m; bench/NOTES.md, forty-ninth session). DH [S, N, HIDDEN], DY and W1 in
    the compute dtype, PRE [S, N, HIDDEN] float32 (module docstring)."""
    j = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.program_id(2)
    row = PARTIAL + (slot * tl.num_programs(1) + split).to(tl.int64) * stride_ps
    first = split * SPLIT_ROWS
    end = tl.minimum(N, first + SPLIT_ROWS)
    if j == CMP_BLOCK:
        _w2_grads(_slot(slot, DY0, DY1), PRE + slot.to(tl.int64) * N * HIDDEN, row, first, end,
                  NUM_CMP, H, HIDDEN, W2_AT, B2_AT, D, BLOCK_D, BLOCK_HID, ROWS, IEEE)
    else:
        _w1_grads(DH + slot.to(tl.int64) * N * HIDDEN, _slot(slot, X0, X1), _slot(slot, P0, P1),
                  _slot(slot, W1_0, W1_1), row, first, end, j,
                  _slot(slot, stride_x0b, stride_x1b), _slot(slot, stride_x0t, stride_x1t),
                  _slot(slot, stride_x0h, stride_x1h), NUM_CMP, H, HIDDEN, POSITION_AT,
                  B1_AT, CMP_BLOCK, CMP_STRIDE, D, BLOCK_D, BLOCK_HID, ROWS, IEEE)


# Launch wrappers -------------------------------------------------------------------------


def fits(D: int, hidden: int) -> bool:
    """Whether the kernels take a head dim D and a hidden width: their tiles hold whole rows
    of both."""
    return pow2(D, 16) <= MAX_DIM and pow2(hidden, 16) <= MAX_HIDDEN


def _meta(kind: str, D: int, hidden: int, compute_dtype: torch.dtype) -> dict:
    """Meta-parameters and launch options of kernel ``kind`` (a key of ROWS)."""
    wide = pow2(hidden, 16) > 128
    rows = max(16, ROWS[kind] // 2) if wide else ROWS[kind]
    return dict(D=D, BLOCK_D=pow2(D, 16), BLOCK_HID=pow2(hidden, 16), ROWS=rows,
                IEEE=compute_dtype == torch.float32, num_warps=8 if wide else 4)


SLOT_WEIGHTS = 5  # per compressor: position, w1, b1, w2, b2


def _pair(tensors):
    """(slot 0's, slot 1's) of one or two slots' tensors (one slot: its own twice, unread)."""
    return tensors[0], tensors[-1]


def compress(xs: list[torch.Tensor], weights: list[torch.Tensor], cmp_block: int,
             cmp_stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP compressors of one or two slots (MAX_SLOTS) in one launch: xs [B, T, H, D] of
    one shape (T >= cmp_block) and ``weights`` each slot's position embedding [l, D] and
    layers (w1 [hidden, l·D], b1), (w2 [D, hidden], b2), flattened -> (out [S, B, Tc, H, D],
    the pre-activation [S, B, Tc, H, hidden] float32), computed in w1's dtype (w2's too;
    out's)."""
    S = len(xs)
    B, T, H, D = xs[0].shape
    position, w1, b1, w2, b2 = (_pair([t.contiguous() for t in weights[k::SLOT_WEIGHTS]])
                                for k in range(SLOT_WEIGHTS))
    hidden = w1[0].shape[0]
    Tc = compressed_length(T, cmp_block, cmp_stride)
    x = _pair([unit_stride(x) for x in xs])
    out = torch.empty(S, B, Tc, H, D, dtype=w1[0].dtype, device=x[0].device)
    pre = torch.empty(S, B, Tc, H, hidden, dtype=torch.float32, device=x[0].device)
    meta = _meta("forward", D, hidden, w1[0].dtype)
    _compress_fwd_kernel[(cdiv(Tc, meta["ROWS"]), S * B * H)](
        *x, *position, *w1, *b1, *w2, *b2, out, pre, *x[0].stride()[:3], *x[1].stride()[:3],
        B * H, Tc, H, hidden, CMP_BLOCK=cmp_block, CMP_STRIDE=cmp_stride, **meta)
    return out, pre


def _weight_grad_sizes(cmp_block: int, D: int, hidden: int) -> tuple[int, ...]:
    """Elements of the gradients of W1, W2, P, b1 and b2, in the order the weights' gradient
    buffer holds them."""
    return hidden * cmp_block * D, D * hidden, cmp_block * D, hidden, D


def compress_backward(grads: list[torch.Tensor], xs: list[torch.Tensor], pre: torch.Tensor,
                      weights: list[torch.Tensor], cmp_block: int,
                      cmp_stride: int) -> list[torch.Tensor]:
    """[each slot's x gradient (in x's dtype), ..., the weights' gradients float32 [S, C]
    (split by :func:`split_weight_grads`)] of :func:`compress` given its output's gradients
    ``grads`` (one [B, Tc, H, D] per slot, in w1's dtype); ``weights``: each slot's position
    embedding, w1 and w2, flattened."""
    S = len(xs)
    B, T, H, D = xs[0].shape
    Tc, hidden = pre.shape[2], pre.shape[4]
    position, w1, w2 = (_pair([t.contiguous() for t in weights[k::3]]) for k in range(3))
    x = _pair([unit_stride(x) for x in xs])
    dtype = w1[0].dtype
    dy = _pair([g.to(dtype).contiguous() for g in grads])
    N = B * Tc * H
    meta = _meta("hidden_grad", D, hidden, dtype)
    dh = torch.empty(S, N, hidden, dtype=dtype, device=x[0].device)
    _hidden_grad_kernel[(cdiv(N, meta["ROWS"]), S)](*dy, pre, *w2, dh, N, hidden, **meta)
    dxs = [torch.empty(B, T, H, D, dtype=x.dtype, device=x.device) for x in xs]
    dx = _pair(dxs)
    meta = _meta("input_grad", D, hidden, dtype)
    _input_grad_kernel[(cdiv(cdiv(T, cmp_stride), meta["ROWS"]), cmp_stride, S * B * H)](
        dh, *w1, *dx, *dx[0].stride()[:3], *dx[1].stride()[:3], B * H, T, Tc, H, hidden,
        CMP_BLOCK=cmp_block, CMP_STRIDE=cmp_stride, **meta)
    meta = _meta("weight_grads", D, hidden, dtype)
    row_tiles = cdiv(N, meta["ROWS"])
    splits = min(WEIGHT_SPLITS, row_tiles)
    sizes = _weight_grad_sizes(cmp_block, D, hidden)  # one row per (slot, split)
    at = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    partial = torch.empty(S, splits, at[-1], dtype=torch.float32, device=x[0].device)
    _weight_grads_kernel[(cmp_block + 1, splits, S)](
        dh, *dy, pre, *x, *position, *w1, partial, *x[0].stride()[:3], *x[1].stride()[:3],
        partial.stride(1), N, Tc, H, hidden, cdiv(row_tiles, splits) * meta["ROWS"], at[1],
        at[2], at[3], at[4], CMP_BLOCK=cmp_block, CMP_STRIDE=cmp_stride, **meta)
    return [*dxs, partial.sum(1)]


def split_weight_grads(sums: torch.Tensor, cmp_block: int, D: int,
                       hidden: int) -> tuple[torch.Tensor, ...]:
    """The gradients of P, W1, b1, W2 and b2 (views) from one slot's row of
    :func:`compress_backward`'s weight gradients."""
    sizes = _weight_grad_sizes(cmp_block, D, hidden)
    dw1, dw2, d_position, db1, db2 = sums.split(sizes)
    return (d_position.view(cmp_block, D), dw1.view(hidden, cmp_block * D), db1,
            dw2.view(D, hidden), db2)


compress_op = torch.library.custom_op("nsa::compress", compress, mutates_args=())
compress_backward_op = torch.library.custom_op("nsa::compress_backward", compress_backward,
                                               mutates_args=())


@compress_op.register_fake
def _(xs, weights, cmp_block, cmp_stride):
    B, T, H, D = xs[0].shape
    Tc = compressed_length(T, cmp_block, cmp_stride)
    w1 = weights[1]
    return (xs[0].new_empty(len(xs), B, Tc, H, D, dtype=w1.dtype),
            xs[0].new_empty(len(xs), B, Tc, H, w1.shape[0], dtype=torch.float32))


@compress_backward_op.register_fake
def _(grads, xs, pre, weights, cmp_block, cmp_stride):
    size = sum(_weight_grad_sizes(cmp_block, xs[0].shape[3], weights[1].shape[0]))
    return [*(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs),
            xs[0].new_empty(len(xs), size, dtype=torch.float32)]


class _CompressFunction(torch.autograd.Function):
    """:func:`compress` forward (one launch, after the weights' casts to the compute dtype)
    and :func:`compress_backward` (three launches and one sum), for one or two slots."""

    @staticmethod
    def forward(ctx, cmp_block, cmp_stride, compute_dtype, count, *tensors):
        xs, weights = list(tensors[:count]), tensors[count:]
        cast = [w.to(compute_dtype) if k % SLOT_WEIGHTS in (1, 3) else w
                for k, w in enumerate(weights)]
        out, pre = call_op(compress_op, compress, xs, cast, cmp_block, cmp_stride)
        kept = [w for k, w in enumerate(cast) if k % SLOT_WEIGHTS in (0, 1, 3)]
        ctx.save_for_backward(pre, *xs, *kept)
        ctx.meta = (cmp_block, cmp_stride, count)
        ctx.dtypes = [w.dtype for w in weights]
        return tuple(out.unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        cmp_block, cmp_stride, count = ctx.meta
        pre, *saved = ctx.saved_tensors  # once: activation checkpointing unpacks each once
        xs, kept = saved[:count], saved[count:]
        *dxs, sums = call_op(compress_backward_op, compress_backward, list(grads), xs, pre,
                             kept, cmp_block, cmp_stride)
        D, hidden = xs[0].shape[3], kept[1].shape[0]
        weight_grads = [g for row in sums for g in split_weight_grads(row, cmp_block, D, hidden)]
        return (None, None, None, None, *dxs,
                *(g.to(dtype) for g, dtype in zip(weight_grads, ctx.dtypes)))


MAX_SLOTS = 2  # compressors one launch takes (a layer's keys' and values')


def compress_triton(xs: list[torch.Tensor], weights: list[tuple[torch.Tensor, ...]],
                    cmp_block: int, cmp_stride: int,
                    compute_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The MLP compressors' outputs [B, Tc, H, D] (``compute_dtype``) of 1 or MAX_SLOTS
    inputs xs [B, T, H, D] of one shape and dtype (T >= cmp_block, cmp_stride dividing
    cmp_block), compressor k's ``weights[k]`` (position [l, D], w1 [hidden, l·D], b1, w2 [D,
    hidden], b2; one shape for all): one autograd node, one launch forward and three backward
    (module docstring)."""
    if not 1 <= len(xs) <= MAX_SLOTS or len(weights) != len(xs):
        raise ValueError(f"compress_triton takes 1 to {MAX_SLOTS} inputs and their weights, got "
                         f"{len(xs)} and {len(weights)}")
    return _CompressFunction.apply(cmp_block, cmp_stride, compute_dtype, len(xs), *xs,
                                   *(w for slot in weights for w in slot))
