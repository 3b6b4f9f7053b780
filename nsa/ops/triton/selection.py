"""Triton kernels for block selection and attention over the selected blocks.

* ``_select_kernel``: one program per (tile of ``BLOCK_P`` consecutive positions of one
  sequence, KV head). Each step loads ``TOK`` compressed keys once and, for each of the G query
  heads of the group in turn, recomputes the compressed probabilities from the compressed
  log-sum-exp and adds them up (the group score is a sum over heads). The group probabilities
  are mapped onto ``BJ`` selection blocks by a product with the fixed overlap weights (tf32x3:
  float32 accuracy on the tensor cores); the share of the step's last tokens that falls into
  the next step's blocks is carried. A running top-n per position is kept as int64 keys
  ``score_bits << 32 | (block ^ MAX_BLOCK)`` (larger score first, ties to the lower index),
  merged with each step's keys. No score matrix is written: memory is linear in T.
* ``_selected_fwd_kernel`` / ``_selected_bwd_dq_kernel``: one program per (position, KV head),
  the G query heads as rows, iterating only that position's own blocks (its first
  min(n, candidates) slots: the rest are padding). Keys past the position load as zeros and
  are never multiplied in.
* ``_selected_bwd_dkdv_kernel``: one program per segment of at most ``SEGMENT`` entries of a key
  block's list of the positions that selected it (an inverse index built by a sort); long lists
  (the forced first block is chosen by every position) are split so no program runs alone for
  long. Each segment writes a partial dK/dV; ``_sum_segments_kernel`` adds a block's partials
  in a fixed order: deterministic, no atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nsa.ops.triton.common import (
    add_tile,
    dot,
    exp_scale,
    load_tile,
    probs_and_dscores,
    score_scale,
    softmax_finish,
    softmax_step,
    store_tile,
)


MAX_BLOCK = tl.constexpr(2**31 - 1)  # the low word of a top-n key: block ^ MAX_BLOCK (reversed)


@triton.jit
def _select_kernel(
    Q, KC, LSE, IDX, tile_start, tile_end, tile_seq_start, tile_cmp_start,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_lb, stride_lt,
    stride_ib, stride_it, stride_ih,
    H, scale_log2,
    G: tl.constexpr, DK: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_P: tl.constexpr,
    NUM_SELECTED: tl.constexpr, BJ: tl.constexpr, TOK: tl.constexpr, TOK_PAD: tl.constexpr,
    CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr,
    NUM_INIT: tl.constexpr, NUM_LOCAL: tl.constexpr, IEEE: tl.constexpr,
):
    """IDX[b, t, h, :NUM_SELECTED] for the tile's positions t (ascending, -1 padded)."""
    tile = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    t0 = tl.load(tile_start + tile)
    t_end = tl.load(tile_end + tile)
    seq_start = tl.load(tile_seq_start + tile)
    cmp_start = tl.load(tile_cmp_start + tile)
    seq_len = t_end - seq_start
    num_cmp = tl.where(seq_len >= CMP_BLOCK, (seq_len - CMP_BLOCK) // CMP_STRIDE + 1, 0)
    t = t0 + tl.arange(0, BLOCK_P)
    row_ok = t < t_end
    t64 = t.to(tl.int64)
    pos = t - seq_start
    current = pos // SEL_BLOCK  # [P] block of the query itself
    dk = tl.arange(0, BLOCK_DK)
    # Overlap (/ l) of compressed token a of a step with block c of the step and with block c
    # of the next step.
    a = tl.arange(0, TOK_PAD)
    c = tl.arange(0, BJ)
    tok_lo = (a * CMP_STRIDE)[:, None]
    blk_lo = (c * SEL_BLOCK)[None, :]
    here = tl.minimum(tok_lo + CMP_BLOCK, blk_lo + SEL_BLOCK) - tl.maximum(tok_lo, blk_lo)
    nxt = (tl.minimum(tok_lo + CMP_BLOCK, blk_lo + BJ * SEL_BLOCK + SEL_BLOCK)
           - tl.maximum(tok_lo, blk_lo + BJ * SEL_BLOCK))
    tok_ok = (a < TOK)[:, None]
    w_here = tl.where(tok_ok, tl.maximum(here, 0).to(tl.float32) / CMP_BLOCK, 0.0)
    w_next = tl.where(tok_ok, tl.maximum(nxt, 0).to(tl.float32) / CMP_BLOCK, 0.0)
    q_rows = Q + b * stride_qb + t64 * stride_qt + h * G * stride_qh
    lse_rows = LSE + b * stride_lb + t64 * stride_lt + h * G
    carry = tl.zeros([BLOCK_P, BJ], tl.float32)
    best = tl.full([BLOCK_P, BJ], -1, tl.int64)
    num_blocks = tl.max(tl.where(row_ok, current, -1), axis=0) + 1
    for j0 in range(0, num_blocks, BJ):
        i_loc = j0 * (SEL_BLOCK // CMP_STRIDE) + a  # compressed index within the sequence
        k_ok = (a < TOK) & (i_loc < num_cmp)
        kc = load_tile(KC + b * stride_kb + (cmp_start + i_loc).to(tl.int64) * stride_kt
                       + h * stride_kh, k_ok, DK, BLOCK_DK)
        visible = k_ok[None, :] & (i_loc[None, :] * CMP_STRIDE + CMP_BLOCK - 1 <= pos[:, None])
        p = tl.zeros([BLOCK_P, TOK_PAD], tl.float32)  # group probabilities, summed over heads
        for g in range(G):
            q = load_tile(q_rows + g * stride_qh, row_ok, DK, BLOCK_DK)
            lse = tl.load(lse_rows + g, mask=row_ok, other=float("inf"))
            scores = dot(q, tl.trans(kc), IEEE) * score_scale(scale_log2)
            p += tl.where(visible, tl.exp2((scores - lse[:, None]) * exp_scale(scale_log2)), 0.0)
        score = tl.dot(p, w_here, input_precision="tf32x3") + carry  # [P, BJ]
        carry = tl.dot(p, w_next, input_precision="tf32x3")
        block = j0 + c
        candidate = block[None, :] <= current[:, None]
        forced = candidate & ((block[None, :] < NUM_INIT)
                              | (block[None, :] > current[:, None] - NUM_LOCAL))
        bits = tl.where(forced, float("inf"), tl.maximum(score, 0.0)).to(tl.int32, bitcast=True)
        key = (bits.to(tl.int64) << 32) | (block[None, :] ^ MAX_BLOCK).to(tl.int64)
        key = tl.where(candidate & row_ok[:, None], key, -1)
        best = tl.topk(tl.reshape(tl.join(best, key), (BLOCK_P, 2 * BJ)), BJ)
    slot = tl.arange(0, BJ)
    chosen = (best >= 0) & (slot[None, :] < NUM_SELECTED)
    blocks = tl.where(chosen, (best & 0xFFFFFFFF).to(tl.int32) ^ MAX_BLOCK, MAX_BLOCK)
    blocks = tl.sort(blocks, dim=1)
    blocks = tl.where(blocks == MAX_BLOCK, -1, blocks)
    tl.store(IDX + b * stride_ib + t64[:, None] * stride_it + h * stride_ih + slot[None, :],
             blocks, mask=row_ok[:, None] & (slot[None, :] < NUM_SELECTED))


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
def _selected_block(K, V, IDX, b, h, t, seq_start, slot, stride_kb, stride_kt, stride_kh,
                    stride_vb, stride_vt, stride_vh, stride_ib, stride_it, stride_ih,
                    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                    BLOCK_DV: tl.constexpr, SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
    """Keys, values [BLOCK_S, D] of the block in ``slot`` of position t, and the mask of its
    tokens s <= t (masked rows load as 0, so nothing beyond t is ever read)."""
    block = tl.load(IDX + b * stride_ib + t * stride_it + h * stride_ih + slot)
    offs = tl.arange(0, BLOCK_S)
    s = seq_start + block * SEL_BLOCK + offs
    k_ok = (offs < SEL_BLOCK) & (s <= t)
    s64 = s.to(tl.int64)
    k = load_tile(K + b * stride_kb + s64 * stride_kt + h * stride_kh, k_ok, DK, BLOCK_DK)
    v = load_tile(V + b * stride_vb + s64 * stride_vt + h * stride_vh, k_ok, DV, BLOCK_DV)
    return k, v, k_ok


@triton.jit
def _selected_fwd_kernel(
    Q, K, V, IDX, O, LSE, TOK_POS,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ib, stride_it, stride_ih,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    H, scale_log2,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SELECTED: tl.constexpr,
    SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
):
    b, h, t, seq_start, hq, row_ok, q, num_blocks = _position_rows(
        Q, TOK_POS, stride_qb, stride_qt, stride_qh, H, G, DK, BLOCK_G, BLOCK_DK,
        NUM_SELECTED, SEL_BLOCK)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for slot in range(0, num_blocks):
        k, v, k_ok = _selected_block(K, V, IDX, b, h, t, seq_start, slot, stride_kb,
                                     stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                     stride_ib, stride_it, stride_ih, DK, DV, BLOCK_DK,
                                     BLOCK_DV, SEL_BLOCK, BLOCK_S)
        scores = dot(q, tl.trans(k), IEEE) * score_scale(scale_log2)
        scores = tl.where(k_ok[None, :], scores, float("-inf"))
        m, l, acc = softmax_step(scores, m, l, acc, v, scale_log2, IEEE)
    out, lse = softmax_finish(m, l, acc, scale_log2)
    store_tile(O + b * stride_ob + t * stride_ot + hq * stride_oh, out, row_ok, DV, BLOCK_DV)
    tl.store(LSE + b * stride_lb + t * stride_lt + hq, lse, mask=row_ok)


@triton.jit
def _selected_bwd_dq_kernel(
    Q, K, V, IDX, DO, LSE, DELTA, DQ, TOK_POS,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ib, stride_it, stride_ih,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    H, scale_log2, scale,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SELECTED: tl.constexpr,
    SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
):
    b, h, t, seq_start, hq, row_ok, q, num_blocks = _position_rows(
        Q, TOK_POS, stride_qb, stride_qt, stride_qh, H, G, DK, BLOCK_G, BLOCK_DK,
        NUM_SELECTED, SEL_BLOCK)
    do = load_tile(DO + b * stride_ob + t * stride_ot + hq * stride_oh, row_ok, DV, BLOCK_DV)
    lse = tl.load(LSE + b * stride_lb + t * stride_lt + hq, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + b * stride_lb + t * stride_lt + hq, mask=row_ok, other=0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_DK], tl.float32)
    for slot in range(0, num_blocks):
        k, v, k_ok = _selected_block(K, V, IDX, b, h, t, seq_start, slot, stride_kb,
                                     stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                     stride_ib, stride_it, stride_ih, DK, DV, BLOCK_DK,
                                     BLOCK_DV, SEL_BLOCK, BLOCK_S)
        valid = row_ok[:, None] & k_ok[None, :]
        p, ds = probs_and_dscores(q, k, v, do, lse, delta, valid, scale_log2, IEEE)
        acc += dot(ds.to(k.dtype), k, IEEE)
    add_tile(DQ + b * stride_qb + t * stride_qt + hq * stride_qh, acc * scale, row_ok, DK,
             BLOCK_DK)


@triton.jit
def _selected_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK_PART, DV_PART, block_token_start, block_token_end,
    seg_list, seg_lo, seg_hi, entry_pos,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    H, NUM_GLOBAL_BLOCKS, scale_log2, scale,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
):
    """Partial dK, dV [BLOCK_S, D] of one block of one KV head from one segment of its list."""
    P: tl.constexpr = BLOCK_R // G
    seg = tl.program_id(0)
    list_id = tl.load(seg_list + seg)
    e_lo = tl.load(seg_lo + seg)
    e_hi = tl.load(seg_hi + seg)
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
    acc_k = tl.zeros([BLOCK_S, BLOCK_DK], tl.float32)
    acc_v = tl.zeros([BLOCK_S, BLOCK_DV], tl.float32)
    r = tl.arange(0, BLOCK_R)
    for e0 in range(e_lo, e_hi, P):
        e = e0 + r // G
        row_ok = (r < P * G) & (e < e_hi)
        t = tl.load(entry_pos + e, mask=row_ok, other=0)
        hq = h * G + r % G
        t64 = t.to(tl.int64)
        q = load_tile(Q + b * stride_qb + t64 * stride_qt + hq * stride_qh, row_ok, DK, BLOCK_DK)
        do = load_tile(DO + b * stride_ob + t64 * stride_ot + hq * stride_oh, row_ok, DV, BLOCK_DV)
        lse = tl.load(LSE + b * stride_lb + t64 * stride_lt + hq, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA + b * stride_lb + t64 * stride_lt + hq, mask=row_ok, other=0.0)
        valid = row_ok[:, None] & k_ok[None, :] & (s[None, :] <= t[:, None])
        p, ds = probs_and_dscores(q, k, v, do, lse, delta, valid, scale_log2, IEEE)
        acc_v += dot(tl.trans(p).to(do.dtype), do, IEEE)
        acc_k += dot(tl.trans(ds).to(q.dtype), q, IEEE)
    rows = seg.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    tl.store(DK_PART + rows[:, None] * BLOCK_DK + dk[None, :], acc_k * scale)
    tl.store(DV_PART + rows[:, None] * BLOCK_DV + dv[None, :], acc_v)


@triton.jit
def _sum_segments_kernel(
    PART, OUT, block_token_start, block_token_end, list_seg_first, list_seg_count,
    stride_b, stride_t, stride_h, H, NUM_GLOBAL_BLOCKS,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """OUT[b, block tokens, h] = sum of the block's segment partials, in segment order."""
    list_id = tl.program_id(0)
    pid_bh = list_id // NUM_GLOBAL_BLOCKS
    gblock = list_id % NUM_GLOBAL_BLOCKS
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    s = tl.load(block_token_start + gblock) + tl.arange(0, BLOCK_S)
    s_ok = s < tl.load(block_token_end + gblock)
    d = tl.arange(0, BLOCK_D)
    first = tl.load(list_seg_first + list_id)
    count = tl.load(list_seg_count + list_id)
    acc = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    for seg in range(first, first + count):
        rows = tl.arange(0, BLOCK_S).to(tl.int64) + seg * BLOCK_S
        acc += tl.load(PART + rows[:, None] * BLOCK_D + d[None, :])
    tl.store(OUT + b * stride_b + s.to(tl.int64)[:, None] * stride_t + h * stride_h + d[None, :],
             acc, mask=s_ok[:, None] & (d[None, :] < D))
