"""Triton kernels for one NSA decode step (one query per sequence), split across thread blocks
so that a batch of one still fills the GPU (flash-decoding style partials, merged after).

* ``_decode_cmp_kernel``: program (b·H + h, split) attends the G query heads of KV head h to
  one chunk of the visible compressed tokens; it writes the chunk's softmax partials and the
  raw (base-2) scores, from which the block scores are computed without reading keys again.
* ``_decode_sparse_kernel``: program (b·H + h, j) attends to selected block j (j < n) or to
  window chunk j - n; it writes that split's softmax partials.
Each kernel reads only the tokens the spec counts: masked loads never touch the rest.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nsa.ops.triton.common import load_tile, masked_scores, softmax_step, store_tile


@triton.jit
def _group_rows(Q, stride_qb, stride_qh, H, G: tl.constexpr, DK: tl.constexpr,
                BLOCK_G: tl.constexpr, BLOCK_DK: tl.constexpr):
    """(b, h, query heads hq [BLOCK_G], row mask, q [BLOCK_G, BLOCK_DK]) of this program."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    g = tl.arange(0, BLOCK_G)
    row_ok = g < G
    hq = h * G + g
    q = load_tile(Q + b * stride_qb + hq * stride_qh, row_ok, DK, BLOCK_DK)
    return b, h, hq, row_ok, q


@triton.jit
def _store_partials(M, L, ACC, b, hq, split, row_ok, m, l, acc, stride_mb, stride_mh,
                    stride_ab, stride_ah, stride_as, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    tl.store(M + b * stride_mb + hq * stride_mh + split, m, mask=row_ok)
    tl.store(L + b * stride_mb + hq * stride_mh + split, l, mask=row_ok)
    store_tile(ACC + b * stride_ab + hq * stride_ah + split * stride_as, acc, row_ok, DV,
               BLOCK_DV)


@triton.jit
def _decode_cmp_kernel(
    Q, KC, VC, POS, SCORES, M, L, ACC,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_sb, stride_sh, stride_mb, stride_mh, stride_ab, stride_ah, stride_as,
    H, chunk, scale_log2,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, IEEE: tl.constexpr,
):
    b, h, hq, row_ok, q = _group_rows(Q, stride_qb, stride_qh, H, G, DK, BLOCK_G, BLOCK_DK)
    split = tl.program_id(1)
    pos = tl.load(POS + b)
    visible = tl.where(pos >= CMP_BLOCK - 1, (pos - CMP_BLOCK + 1) // CMP_STRIDE + 1, 0)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, visible)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        s = start + tl.arange(0, BLOCK_N)
        k_ok = s < hi
        s64 = s.to(tl.int64)
        k = load_tile(KC + b * stride_kb + s64 * stride_kt + h * stride_kh, k_ok, DK, BLOCK_DK)
        v = load_tile(VC + b * stride_vb + s64 * stride_vt + h * stride_vh, k_ok, DV, BLOCK_DV)
        scores = masked_scores(q, k, k_ok[None, :], scale_log2, IEEE)
        tl.store(SCORES + b * stride_sb + hq[:, None] * stride_sh + s64[None, :], scores,
                 mask=row_ok[:, None] & k_ok[None, :])
        m, l, acc = softmax_step(scores, m, l, acc, v, scale_log2, IEEE)
    _store_partials(M, L, ACC, b, hq, split, row_ok, m, l, acc, stride_mb, stride_mh,
                    stride_ab, stride_ah, stride_as, DV, BLOCK_DV)


@triton.jit
def _decode_sparse_kernel(
    Q, K, V, KW, VW, IDX, POS, M, L, ACC,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_wkb, stride_wkt, stride_wkh, stride_wvb, stride_wvt, stride_wvh,
    stride_ib, stride_ih, stride_mb, stride_mh, stride_ab, stride_ah, stride_as,
    H, scale_log2,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
    NUM_SELECTED: tl.constexpr, SEL_BLOCK: tl.constexpr, WINDOW: tl.constexpr,
    WINDOW_RING: tl.constexpr, IEEE: tl.constexpr,
):
    """Split j < NUM_SELECTED: the j-th selected block (from K, V by position); otherwise window
    chunk j - NUM_SELECTED of BLOCK_S keys (from the ring KW, VW, or from KW, VW by position)."""
    b, h, hq, row_ok, q = _group_rows(Q, stride_qb, stride_qh, H, G, DK, BLOCK_G, BLOCK_DK)
    split = tl.program_id(1)
    pos = tl.load(POS + b)
    offs = tl.arange(0, BLOCK_S)
    if split < NUM_SELECTED:
        block = tl.load(IDX + b * stride_ib + h * stride_ih + split)
        key = block * SEL_BLOCK + offs
        k_ok = (block >= 0) & (offs < SEL_BLOCK) & (key <= pos)
        key64 = key.to(tl.int64)
        k = load_tile(K + b * stride_kb + key64 * stride_kt + h * stride_kh, k_ok, DK, BLOCK_DK)
        v = load_tile(V + b * stride_vb + key64 * stride_vt + h * stride_vh, k_ok, DV, BLOCK_DV)
    else:
        back = (split - NUM_SELECTED) * BLOCK_S + offs  # how far behind pos (positional)
        if WINDOW_RING:
            slot = back  # ring slot; it holds the latest position <= pos congruent to it
            k_ok = (slot < WINDOW) & (pos - ((pos - slot) % WINDOW + WINDOW) % WINDOW >= 0)
            row = slot.to(tl.int64)
        else:
            k_ok = (back < WINDOW) & (back <= pos)
            row = (pos - back).to(tl.int64)
        k = load_tile(KW + b * stride_wkb + row * stride_wkt + h * stride_wkh, k_ok, DK,
                      BLOCK_DK)
        v = load_tile(VW + b * stride_wvb + row * stride_wvt + h * stride_wvh, k_ok, DV,
                      BLOCK_DV)
    scores = masked_scores(q, k, k_ok[None, :], scale_log2, IEEE)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    m, l, acc = softmax_step(scores, m, l, acc, v, scale_log2, IEEE)
    _store_partials(M, L, ACC, b, hq, split, row_ok, m, l, acc, stride_mb, stride_mh,
                    stride_ab, stride_ah, stride_as, DV, BLOCK_DV)
