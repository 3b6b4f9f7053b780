"""Attention over the selected blocks: Triton kernels, then their launch wrappers. At short T
(fixed-length batches of few blocks: ``masked_causal_selection``) the forward, dq and dK/dV run
as causal attention masked to each position's blocks instead (selected_masked.py).

* ``_selected_fwd_kernel`` / ``_selected_bwd_dq_kernel``: one program per (position, KV head),
  the G query heads as rows, iterating only that position's own blocks (its first
  min(n, candidates) slots: the rest are padding). The slots are ascending, so all but the
  last hold whole blocks before the position's own: those load unmasked, each as one
  tensor-descriptor (TMA) load where the layout allows; in the last, keys past the position
  load as zeros and are never multiplied in.
* ``_selected_bwd_dkdv_kernel``: one program per segment of at most ``SELECTED_SEGMENT``
  entries of a key block's list of the positions that selected it (an inverse index built by a
  sort); long lists (the forced first block is chosen by every position) are split so no
  program runs alone for long. ``_segment_starts_kernel`` numbers the segments (one program,
  a running sum over the lists) and each dK/dV program finds its list by a binary search, so
  the index costs a sort, a search, three elementwise ops and three launches rather than some
  forty small PyTorch ops (host time: bench/NOTES.md, v11). Each segment writes a partial
  dK/dV; ``_sum_segments_kernel`` adds a block's partials in a fixed order and writes dK and
  dV in their dtypes: deterministic, no atomics. Entries of positions inside the block (they
  see part of it) and a segment's last tile run first, multiplying finite parts only
  (common.py, Masks); the others see the whole block: plain products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops.layout import expand_counts
from nsa.ops.params import LOG2E, NSAParams
from nsa.ops.triton.common import (
    accumulate_tile,
    dkdv_tile,
    dot,
    load_tile,
    masked_products,
    partial_tile,
    probs_and_dscores,
    query_rows_tile,
    softmax_step,
    split_tiles,
)
from nsa.ops.triton.gating import GatedSum, gated_sum_args, store_selected_rows
from nsa.ops.triton.launch import (
    TUNING,
    BranchGrad,
    cdiv,
    descriptor_pair,
    launch_shape,
    pow2,
    shapes,
    strides,
    tile_width,
)
from nsa.ops.triton.selected_masked import (
    masked_causal_selection,
    masked_dkdv,
    masked_dq,
    masked_forward,
    masked_selection,
)
from nsa.ops.triton.tables import KernelTables, i32

SELECTED_SEGMENT = 256  # most (position) entries one selected-branch dK/dV program handles


@triton.jit
def _position_rows(Q, TOK_POS, stride_qb, stride_qt, stride_qh, H, G: tl.constexpr,
                   DK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DK: tl.constexpr,
                   NUM_SELECTED: tl.constexpr, SEL_BLOCK: tl.constexpr):
    """Program (t, b·H + h): (b, h, t, its sequence's start, query heads hq [BLOCK_G], row
    mask, q [BLOCK_G, BLOCK_DK], number of selected blocks min(n, candidates))."""
    t = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    pos = tl.load(TOK_POS + t)
    g = tl.arange(0, BLOCK_G)
    row_ok = g < G
    hq = h * G + g
    q = load_tile(Q + b * stride_qb + t * stride_qt + hq * stride_qh, row_ok, DK, BLOCK_DK)
    num_blocks = tl.minimum(NUM_SELECTED, pos // SEL_BLOCK + 1)
    return b, h, t, t - pos, hq, row_ok, q, num_blocks


@triton.jit
def _selected_block(K, V, KD, VD, IDX, b, h, t, seq_start, slot, stride_kb, stride_kt,
                    stride_kh, stride_vb, stride_vt, stride_vh, stride_ib, stride_it, stride_ih,
                    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                    BLOCK_DV: tl.constexpr, SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
                    TMA: tl.constexpr, WHOLE: tl.constexpr):
    """Keys, values [BLOCK_S, D] of the block in ``slot`` of position t, and the mask of its
    tokens. ``WHOLE``: a block before the last slot's, so every token is <= t; with ``TMA``
    it is one tensor-descriptor load (KD, VD: [B, T, H, D] descriptors; BLOCK_S ==
    SEL_BLOCK). Otherwise (the last slot, which may hold t) tokens past t load as 0, so nothing
    beyond t is multiplied in."""
    block = tl.load(IDX + b * stride_ib + t * stride_it + h * stride_ih + slot)
    offs = tl.arange(0, BLOCK_S)
    start = seq_start + block * SEL_BLOCK
    s = start + offs
    k_ok = offs < SEL_BLOCK
    if not WHOLE:
        k_ok = k_ok & (s <= t)
    if WHOLE and TMA:
        where = [b.to(tl.int32), start.to(tl.int32), h, 0]
        k = KD.load(where).reshape(BLOCK_S, BLOCK_DK)
        v = VD.load(where).reshape(BLOCK_S, BLOCK_DV)
    else:
        s64 = s.to(tl.int64)
        k = load_tile(K + b * stride_kb + s64 * stride_kt + h * stride_kh, k_ok, DK, BLOCK_DK)
        v = load_tile(V + b * stride_vb + s64 * stride_vt + h * stride_vh, k_ok, DV, BLOCK_DV)
    return k, v, k_ok


@triton.jit
def _selected_fwd_kernel(
    Q, K, V, KD, VD, IDX, O, LSE, TOK_POS,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ib, stride_it, stride_ih,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    T, H, scale_log2, O_CMP, O_WIN, GATES, OUT,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SELECTED: tl.constexpr,
    SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr,
    GATED: tl.constexpr,
):
    """O, LSE = the selected branch's output (float32) and log-sum-exp of position t's G
    heads; with GATED (the last branch), also OUT = the gated sum of the three branches
    (gating.py; O_CMP, O_WIN and OUT have O's layout)."""
    b, h, t, seq_start, hq, row_ok, q, num_blocks = _position_rows(
        Q, TOK_POS, stride_qb, stride_qt, stride_qh, H, G, DK, BLOCK_G, BLOCK_DK,
        NUM_SELECTED, SEL_BLOCK)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    # Slots are ascending: all but the last hold whole blocks before t's own block.
    for slot in range(0, num_blocks - 1):
        k, v, k_ok = _selected_block(K, V, KD, VD, IDX, b, h, t, seq_start, slot, stride_kb,
                                     stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                     stride_ib, stride_it, stride_ih, DK, DV, BLOCK_DK,
                                     BLOCK_DV, SEL_BLOCK, BLOCK_S, TMA, True)
        qk = masked_products(q, k, k_ok[None, :], IEEE, BLOCK_S != SEL_BLOCK)
        m, l, acc = softmax_step(qk, m, l, acc, v, scale_log2, IEEE)
    k, v, k_ok = _selected_block(K, V, KD, VD, IDX, b, h, t, seq_start, num_blocks - 1,
                                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                 stride_vh, stride_ib, stride_it, stride_ih, DK, DV, BLOCK_DK,
                                 BLOCK_DV, SEL_BLOCK, BLOCK_S, TMA, False)
    qk = masked_products(q, k, k_ok[None, :], IEEE)
    m, l, acc = softmax_step(qk, m, l, acc, v, scale_log2, IEEE)
    store_selected_rows(O, LSE, O_CMP, O_WIN, GATES, OUT, b, t, hq, T, H * G, m, l, acc, row_ok,
                        stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, scale_log2, DV,
                        BLOCK_DV, GATED)


@triton.jit
def _selected_bwd_dq_kernel(
    Q, K, V, KD, VD, IDX, DO, GATE, LSE, DELTA, DQ_IN, DQ_OUT, TOK_POS,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ib, stride_it, stride_ih,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    H, scale_log2, scale,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SELECTED: tl.constexpr,
    SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
    TMA: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    b, h, t, seq_start, hq, row_ok, q, num_blocks = _position_rows(
        Q, TOK_POS, stride_qb, stride_qt, stride_qh, H, G, DK, BLOCK_G, BLOCK_DK,
        NUM_SELECTED, SEL_BLOCK)
    lse_rows = b * stride_lb + t * stride_lt + hq
    do = load_tile(DO + b * stride_ob + t * stride_ot + hq * stride_oh, row_ok, DV, BLOCK_DV)
    gate = tl.load(GATE + lse_rows, mask=row_ok, other=0.0)
    lse = tl.load(LSE + lse_rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + lse_rows, mask=row_ok, other=0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_DK], tl.float32)
    # Slots are ascending: all but the last hold whole blocks before t's own block.
    for slot in range(0, num_blocks - 1):
        k, v, k_ok = _selected_block(K, V, KD, VD, IDX, b, h, t, seq_start, slot, stride_kb,
                                     stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                     stride_ib, stride_it, stride_ih, DK, DV, BLOCK_DK,
                                     BLOCK_DV, SEL_BLOCK, BLOCK_S, TMA, True)
        p, ds = probs_and_dscores(q, k, v, do, lse, delta, row_ok[:, None] & k_ok[None, :],
                                  scale_log2, IEEE)
        acc += dot(ds.to(k.dtype), k, IEEE)
    k, v, k_ok = _selected_block(K, V, KD, VD, IDX, b, h, t, seq_start, num_blocks - 1,
                                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                 stride_vh, stride_ib, stride_it, stride_ih, DK, DV, BLOCK_DK,
                                 BLOCK_DV, SEL_BLOCK, BLOCK_S, TMA, False)
    p, ds = probs_and_dscores(q, k, v, do, lse, delta, row_ok[:, None] & k_ok[None, :],
                              scale_log2, IEEE)
    acc += dot(ds.to(k.dtype), k, IEEE)
    rows = b * stride_qb + t * stride_qt + hq * stride_qh
    accumulate_tile(DQ_IN + rows, DQ_OUT + rows, acc * (scale * gate[:, None]), row_ok, DK,
                    BLOCK_DK, ACCUMULATE)


@triton.jit
def _entry_tile(e_start, e_hi, s, k_ok, Q, DO, GATE, LSE, DELTA, entry_pos, b, h, stride_qb,
                stride_qt, stride_qh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
                G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr):
    """q, do, gate, lse, delta of the P entries (positions) from e_start (below e_hi) x G heads, and
    the mask of their pairs with the block's tokens s (s <= t)."""
    P: tl.constexpr = BLOCK_R // G
    r = tl.arange(0, BLOCK_R)
    e = e_start + r // G
    row_ok = (r < P * G) & (e < e_hi)
    t = tl.load(entry_pos + e, mask=row_ok, other=0)
    hq = h * G + r % G
    q, do, gate, lse, delta = query_rows_tile(
        Q, DO, GATE, LSE, DELTA, b, t.to(tl.int64), hq, row_ok, stride_qb, stride_qt,
        stride_qh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, DK, DV, BLOCK_DK,
        BLOCK_DV)
    valid = row_ok[:, None] & k_ok[None, :] & (s[None, :] <= t[:, None])
    return q, do, gate, lse, delta, valid


@triton.jit
def _segment_starts_kernel(OFFSETS, SEG_FIRST, NUM_LISTS, SEGMENT: tl.constexpr,
                           BLOCK: tl.constexpr):
    """SEG_FIRST [NUM_LISTS + 1]: the first segment of each list (lists of OFFSETS[i + 1] -
    OFFSETS[i] entries, cut into segments of SEGMENT), then the number of segments. One
    program: a running sum over chunks of BLOCK lists."""
    total = tl.full([], 0, tl.int32)
    for start in range(0, NUM_LISTS, BLOCK):
        i = start + tl.arange(0, BLOCK)
        ok = i < NUM_LISTS
        count = tl.load(OFFSETS + i + 1, mask=ok, other=0) - tl.load(OFFSETS + i, mask=ok,
                                                                      other=0)
        segments = ((count + SEGMENT - 1) // SEGMENT).to(tl.int32)
        tl.store(SEG_FIRST + i, total + tl.cumsum(segments, axis=0) - segments, mask=ok)
        total += tl.sum(segments, axis=0)
    tl.store(SEG_FIRST + NUM_LISTS, total)


@triton.jit
def _find_segment(SEG_FIRST, OFFSETS, seg, NUM_LISTS, SEARCH_STEPS: tl.constexpr,
                  SEGMENT: tl.constexpr):
    """(list, first entry, end entry) of segment ``seg``: its list is the last one whose first
    segment is <= seg (a binary search of SEG_FIRST); a segment past the last is empty."""
    lo = tl.full([], 0, tl.int32)
    hi = lo + NUM_LISTS
    for _ in range(SEARCH_STEPS):  # invariant: SEG_FIRST[lo] <= seg < SEG_FIRST[hi]
        mid = (lo + hi) // 2
        below = tl.load(SEG_FIRST + mid) <= seg
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    e_lo = tl.load(OFFSETS + lo) + (seg - tl.load(SEG_FIRST + lo)) * SEGMENT
    e_hi = tl.minimum(e_lo + SEGMENT, tl.load(OFFSETS + lo + 1))
    used = seg < tl.load(SEG_FIRST + NUM_LISTS)
    return lo, e_lo, tl.where(used, e_hi, e_lo)


@triton.jit
def _selected_bwd_dkdv_kernel(
    Q, K, V, DO, GATE, LSE, DELTA, DK_PART, DV_PART, block_token_start, block_token_end,
    SEG_FIRST, OFFSETS, entry_pos,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    H, NUM_GLOBAL_BLOCKS, NUM_LISTS, scale_log2, scale,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
    SEGMENT: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    """Partial dK, dV [BLOCK_S, D] of one block of one KV head from one segment of its list
    (entry_pos: the positions of all lists, one after the other; OFFSETS: each list's start)."""
    P: tl.constexpr = BLOCK_R // G
    seg = tl.program_id(0)
    list_id, e_lo, e_hi = _find_segment(SEG_FIRST, OFFSETS, seg, NUM_LISTS, SEARCH_STEPS,
                                        SEGMENT)
    pid_bh = list_id // NUM_GLOBAL_BLOCKS
    gblock = list_id % NUM_GLOBAL_BLOCKS
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    s_lo = tl.load(block_token_start + gblock)
    s_hi = tl.load(block_token_end + gblock)
    s = s_lo + tl.arange(0, BLOCK_S)
    s64 = s.to(tl.int64)
    k_ok = s < s_hi
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    k = load_tile(K + b * stride_kb + s64 * stride_kt + h * stride_kh, k_ok, DK, BLOCK_DK)
    v = load_tile(V + b * stride_vb + s64 * stride_vt + h * stride_vh, k_ok, DV, BLOCK_DV)
    # A list's positions ascend (a stable sort of (b, t, h, slot)); those before the block's
    # last token (t < s_hi - 1: inside the block, fewer than BLOCK_S) see only part of it and
    # come first. Entries from e_full on see the whole block.
    e = e_lo + tl.arange(0, BLOCK_S)
    in_seg = e < e_hi
    before = tl.load(entry_pos + e, mask=in_seg, other=0) < s_hi - 1
    e_full = e_lo + tl.sum((in_seg & before).to(tl.int32), axis=0)
    full_lo, full_hi, num_partial = split_tiles(e_lo, e_hi, e_full, e_hi, P)
    acc_k = tl.zeros([BLOCK_S, BLOCK_DK], tl.float32)
    acc_v = tl.zeros([BLOCK_S, BLOCK_DV], tl.float32)
    for i in range(0, num_partial):
        q, do, gate, lse, delta, valid = _entry_tile(
            partial_tile(i, e_lo, full_lo, full_hi, P), e_hi, s, k_ok, Q, DO, GATE, LSE, DELTA,
            entry_pos, b, h, stride_qb, stride_qt, stride_qh, stride_ob, stride_ot, stride_oh,
            stride_lb, stride_lt, G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_R)
        acc_k, acc_v = dkdv_tile(q, k, v, do, gate, lse, delta, valid, acc_k, acc_v, scale_log2,
                                 IEEE, True)
    for e_start in range(full_lo, full_hi, P):
        q, do, gate, lse, delta, valid = _entry_tile(
            e_start, e_hi, s, k_ok, Q, DO, GATE, LSE, DELTA, entry_pos, b, h, stride_qb,
            stride_qt, stride_qh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, G, DK,
            DV, BLOCK_DK, BLOCK_DV, BLOCK_R)
        acc_k, acc_v = dkdv_tile(q, k, v, do, gate, lse, delta, valid, acc_k, acc_v, scale_log2,
                                 IEEE, False)
    rows = seg.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    tl.store(DK_PART + rows[:, None] * BLOCK_DK + dk[None, :], acc_k * scale)
    tl.store(DV_PART + rows[:, None] * BLOCK_DV + dv[None, :], acc_v)


@triton.jit
def _sum_block_segments(PART, OUT, b, h, s, s_ok, first, end, stride_b, stride_t, stride_h,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """OUT[b, s, h] (its dtype) = the sum of the partials of segments first..end-1, in order."""
    d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    for seg in range(first, end):
        rows = tl.arange(0, BLOCK_S).to(tl.int64) + seg * BLOCK_S
        acc += tl.load(PART + rows[:, None] * BLOCK_D + d[None, :])
    tl.store(OUT + b * stride_b + s.to(tl.int64)[:, None] * stride_t + h * stride_h + d[None, :],
             acc.to(OUT.dtype.element_ty), mask=s_ok[:, None] & (d[None, :] < D))


@triton.jit
def _sum_segments_kernel(
    DK_PART, DV_PART, DK, DV, block_token_start, block_token_end, SEG_FIRST,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, H, NUM_GLOBAL_BLOCKS,
    DK_DIM: tl.constexpr, DV_DIM: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """dK, dV [b, block tokens, h] = the sums of the block's segment partials, in segment order
    (every token is in one block of its sequence: every row is written)."""
    list_id = tl.program_id(0)
    pid_bh = list_id // NUM_GLOBAL_BLOCKS
    gblock = list_id % NUM_GLOBAL_BLOCKS
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    s = tl.load(block_token_start + gblock) + tl.arange(0, BLOCK_S)
    s_ok = s < tl.load(block_token_end + gblock)
    first = tl.load(SEG_FIRST + list_id)
    end = tl.load(SEG_FIRST + list_id + 1)
    _sum_block_segments(DK_PART, DK, b, h, s, s_ok, first, end, stride_kb, stride_kt,
                        stride_kh, DK_DIM, BLOCK_DK, BLOCK_S)
    _sum_block_segments(DV_PART, DV, b, h, s, s_ok, first, end, stride_vb, stride_vt,
                        stride_vh, DV_DIM, BLOCK_DV, BLOCK_S)


# Launch wrappers -------------------------------------------------------------------------


def _selected_meta(q, k, v, params):
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    return dict(G=G, DK=Dk, DV=Dv, BLOCK_DK=pow2(Dk), BLOCK_DV=pow2(Dv),
                NUM_SELECTED=params.num_selected, SEL_BLOCK=params.sel_block,
                BLOCK_S=pow2(params.sel_block), IEEE=q.dtype == torch.float32)


def _block_descriptors(k, v, params):
    """(KD, VD, TMA): [B, T, H, D] descriptors of one selection block when every block can be
    one TMA load (l' a power of two >= 16: the tile BLOCK_S; aligned layouts), else
    (k, v, False)."""
    if params.sel_block != pow2(params.sel_block):
        return k, v, False
    return descriptor_pair(k, v, [1, params.sel_block, 1])


def _selected_launch(kind: str, q, k, v, params) -> dict:
    """Meta-parameters and launch options of the selected forward or dq (one program per
    position and KV head; no pipelining stages for tiles wider than 128 16-bit values: shared
    memory; the tuned warps are for head dim 128, halved per halving below it)."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    tuning = TUNING[f"selected_{kind}"]
    dim = pow2(max(Dk, Dv))
    stages = 1 if tile_width(dim, q.element_size()) > 128 else tuning["num_stages"]
    warps = max(1, tuning["num_warps"] * min(dim, 128) // 128)
    return dict(_selected_meta(q, k, v, params), BLOCK_G=pow2(G), num_warps=warps,
                num_stages=stages)


def selected_forward(q, k, v, idx, tables, params, scale, kv_finite,
                     gated: GatedSum | None = None):
    """Attention over each position's selected blocks -> (o, lse2): masked causal attention
    where ``masked_causal_selection`` says so (selected_masked.py; ``kv_finite``: the [B, H]
    flags of k and v, finite.py), else per position. With ``gated`` (the branch runs last),
    the kernel also writes gated.out = Σ g_i o_i."""
    if masked_causal_selection(q.shape[1], params, tables.packed):
        selection = masked_selection(idx, kv_finite)
        return masked_forward(q, k, v, selection, params, scale, gated)
    return position_forward(q, k, v, idx, tables, params, scale, gated)


def position_forward(q, k, v, idx, tables, params, scale, gated: GatedSum | None = None):
    """The selected forward with one program per (position, KV head) -> (o, lse2)."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    o = torch.empty(B, T, HQ, Dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, T, HQ, dtype=torch.float32, device=q.device)
    kd, vd, tma = _block_descriptors(k, v, params)
    _selected_fwd_kernel[(T, B * H)](
        q, k, v, kd, vd, idx, o, lse, tables.tok_pos,
        *strides(q), *strides(k), *strides(v), *strides(idx), *strides(o),
        *lse.stride()[:2], T, H, scale * LOG2E, TMA=tma, **gated_sum_args(gated, o),
        **_selected_launch("fwd", q, k, v, params),
    )
    return o, lse


def _selection_blocks(tables: KernelTables, params: NSAParams, B: int, H: int):
    """Layout-only parts of the inverse index, built once per tables: the number of global
    blocks (a host-known bound), the token range of every global block (blocks past the last
    one are empty), the list id of block 0 of each (b, position's sequence, h) [B, T, H, 1],
    and the list boundaries (0 .. lists)."""
    key = ("blocks", B, H)
    if key not in tables.memo:
        layout = tables.layout
        device = layout.starts.device
        T = layout.seq.numel()
        blocks_per_seq = (layout.ends - layout.starts + params.sel_block - 1) // params.sel_block
        block_first = torch.cumsum(blocks_per_seq, 0) - blocks_per_seq
        num_global = cdiv(T, params.sel_block) + layout.starts.numel()
        block_seq, index, used = expand_counts(blocks_per_seq, num_global)
        block_start = layout.starts[block_seq] + index * params.sel_block
        block_end = torch.where(used, torch.minimum(block_start + params.sel_block,
                                                    layout.ends[block_seq]), block_start)
        bh = (torch.arange(B, device=device).view(B, 1, 1, 1) * H
              + torch.arange(H, device=device).view(1, 1, H, 1))  # [B, 1, H, 1]
        list_first = bh * num_global + block_first[layout.seq].view(1, T, 1, 1)
        tables.memo[key] = (num_global, i32(block_start), i32(block_end), list_first,
                            torch.arange(B * H * num_global + 1, device=device))
    return tables.memo[key]


def _inverse_index(idx, tables, params):
    """For each (b, h, global block), the positions that selected it, as CSR: (number of
    global blocks, block token ranges, int32 ``offsets`` [lists + 1] of each list in
    ``entry_pos``, the int32 positions of all lists, each ascending)."""
    B, T, H, n = idx.shape
    num_global, block_start, block_end, list_first, boundaries = (
        _selection_blocks(tables, params, B, H))
    list_id = torch.where(idx >= 0, list_first + idx, B * H * num_global)
    order = torch.sort(list_id.flatten(), stable=True)
    entry_pos = i32(order.indices // (H * n) % T)  # flat index (b, t, h, slot) -> t
    offsets = torch.searchsorted(order.values, boundaries, out_int32=True)
    return num_global, block_start, block_end, offsets, entry_pos


def selected_backward(q, k, v, idx, grad: BranchGrad, lse, delta, dq, tables, params, scale,
                      kv_finite, *, accumulate=True, dq_out=None):
    """This branch's dq goes into ``dq_out`` (default: ``dq``, float32), added to ``dq`` when
    ``accumulate``; returns (dk, dv) in the dtypes of k and v. ``kv_finite`` as in the
    forward."""
    if masked_causal_selection(q.shape[1], params, tables.packed):
        selection = masked_selection(idx, kv_finite)
        masked_dq(q, k, v, selection, grad, lse, delta, dq, params, scale,
                  accumulate=accumulate, dq_out=dq_out)
        return masked_dkdv(q, k, v, selection, grad, lse, delta, params, scale)
    position_dq(q, k, v, idx, grad, lse, delta, dq, tables, params, scale,
                accumulate=accumulate, dq_out=dq_out)
    return selected_dkdv(q, k, v, idx, grad, lse, delta, tables, params, scale)


def position_dq(q, k, v, idx, grad: BranchGrad, lse, delta, dq, tables, params, scale, *,
                accumulate=True, dq_out=None):
    """The selected dq with one program per (position, KV head)."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    kd, vd, tma = _block_descriptors(k, v, params)
    _selected_bwd_dq_kernel[(T, B * H)](
        q, k, v, kd, vd, idx, grad.do, grad.gate, lse, delta, dq,
        dq if dq_out is None else dq_out, tables.tok_pos, *strides(q), *strides(k), *strides(v),
        *strides(idx), *strides(grad.do), *lse.stride()[:2], H, scale * LOG2E, scale,
        TMA=tma, ACCUMULATE=accumulate,
        **_selected_launch("dq", q, k, v, params),
    )


def selected_dkdv(q, k, v, idx, grad: BranchGrad, lse, delta, tables, params, scale):
    """dK, dV of the selected branch (per block, from the positions that selected it), in
    the dtypes of k and v."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    meta = _selected_meta(q, k, v, params)
    strides_qkv = (*strides(q), *strides(k), *strides(v))
    num_global, block_start, block_end, offsets, entry_pos = _inverse_index(idx, tables, params)
    # Every list of positions is cut into segments of at most SELECTED_SEGMENT entries.
    num_lists = offsets.numel() - 1
    seg_first = torch.empty(num_lists + 1, dtype=torch.int32, device=q.device)
    _segment_starts_kernel[(1,)](offsets, seg_first, num_lists, SEGMENT=SELECTED_SEGMENT,
                                 BLOCK=1024)
    num_segments = idx.numel() // SELECTED_SEGMENT + num_lists  # bound known on the host
    bs, bdk, bdv = meta["BLOCK_S"], meta["BLOCK_DK"], meta["BLOCK_DV"]
    dk_part = torch.empty(num_segments * bs, bdk, dtype=torch.float32, device=q.device)
    dv_part = torch.empty(num_segments * bs, bdv, dtype=torch.float32, device=q.device)
    R, launch = launch_shape("selected_dkdv", G, max(Dk, Dv), q.element_size())
    _selected_bwd_dkdv_kernel[(num_segments,)](
        q, k, v, grad.do, grad.gate, lse, delta, dk_part, dv_part, block_start, block_end,
        seg_first, offsets, entry_pos, *strides_qkv, *strides(grad.do), *lse.stride()[:2],
        H, num_global, num_lists, scale * LOG2E, scale,
        G=G, DK=Dk, DV=Dv, BLOCK_DK=bdk, BLOCK_DV=bdv, BLOCK_R=R, BLOCK_S=bs,
        IEEE=meta["IEEE"], SEGMENT=SELECTED_SEGMENT,
        SEARCH_STEPS=num_lists.bit_length(), **launch,
    )
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    _sum_segments_kernel[(num_lists,)](
        dk_part, dv_part, dk, dv, block_start, block_end, seg_first, *strides(dk), *strides(dv),
        H, num_global, DK_DIM=Dk, DV_DIM=Dv, BLOCK_DK=bdk, BLOCK_DV=bdv, BLOCK_S=bs,
    )
    return dk, dv
