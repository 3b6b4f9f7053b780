"""Triton kernels for block selection and attention over the selected blocks.

Tiles come from a tile table (``P`` consecutive positions of one sequence each, so a tile never
straddles two packed sequences); rows are (position, query head) pairs of one KV head.

* ``_select_kernel``: block scores and an online top-n, never writing a score matrix. The
  compressed probabilities are recomputed from the compressed log-sum-exp, mapped onto
  ``BJ`` selection blocks at a time (tokens that straddle into the next chunk of blocks are
  carried), summed over the heads of the group, and merged into a running top-n held as int64
  keys ``score_bits << 32 | (2^31 - 1 - block)``: larger score first, ties to the lower index.
* ``_selected_fwd_kernel`` / ``_selected_bwd_dq_kernel``: attention over the union of the
  blocks the tile's positions selected; each row only sees its own position's blocks.
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
    finite_part,
    load_tile,
    probs_and_dscores,
    score_scale,
    softmax_finish,
    softmax_step,
    store_tile,
)


@triton.jit
def _tile_rows(tile, tile_start, tile_end, tile_seq_start, P: tl.constexpr, G: tl.constexpr,
               BLOCK_R: tl.constexpr):
    r = tl.arange(0, BLOCK_R)
    t0 = tl.load(tile_start + tile)
    t_end = tl.load(tile_end + tile)
    seq_start = tl.load(tile_seq_start + tile)
    t = t0 + r // G
    row_ok = (r < P * G) & (t < t_end)
    return r, t, row_ok, seq_start, t_end


@triton.jit
def _selected_rows(IDX, tile_start, tile_end, tile_seq_start, stride_ib, stride_it, stride_ih, H,
                   G: tl.constexpr, BLOCK_R: tl.constexpr, NUM_SELECTED: tl.constexpr,
                   NPAD: tl.constexpr):
    """This program's rows and the blocks each row's position selected ([R, NPAD], -1 padded)."""
    tile = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    r, t, row_ok, seq_start, t_end = _tile_rows(tile, tile_start, tile_end, tile_seq_start,
                                                BLOCK_R // G, G, BLOCK_R)
    slot = tl.arange(0, NPAD)
    idx_ptr = IDX + b * stride_ib + h * stride_ih
    mine = tl.load(idx_ptr + t.to(tl.int64)[:, None] * stride_it + slot[None, :],
                   mask=row_ok[:, None] & (slot[None, :] < NUM_SELECTED), other=-1)
    return (b, h, r, t, h * G + r % G, row_ok, seq_start, t_end, tl.load(tile_start + tile),
            idx_ptr, mine)


@triton.jit
def _tile_block(idx_ptr, t0, pp, c, stride_it, mine, r, G: tl.constexpr):
    """Slot c of position t0 + pp, and whether this is its first visit in the tile (valid and
    not chosen by an earlier position of the tile): each block is visited once."""
    block = tl.load(idx_ptr + (t0 + pp).to(tl.int64) * stride_it + c)
    earlier = tl.sum(tl.where((mine == block) & ((r // G) < pp)[:, None], 1, 0))
    return block, (block >= 0) & (earlier == 0)


@triton.jit
def _block_keys(block, seq_start, t_end, t, mine, SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
    """Key positions of ``block``; [R, BLOCK_S] mask of the rows that selected it (causal)."""
    s = seq_start + block * SEL_BLOCK + tl.arange(0, BLOCK_S)
    k_ok = (tl.arange(0, BLOCK_S) < SEL_BLOCK) & (s < t_end)
    row_sel = tl.sum(tl.where(mine == block, 1, 0), axis=1) > 0
    valid = row_sel[:, None] & k_ok[None, :] & (s[None, :] <= t[:, None])
    return s.to(tl.int64), k_ok, valid


@triton.jit
def _select_kernel(
    Q, KC, LSE, IDX, tile_start, tile_end, tile_seq_start, tile_cmp_start,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_lb, stride_lt,
    stride_ib, stride_it, stride_ih,
    H, scale_log2,
    G: tl.constexpr, DK: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_R: tl.constexpr,
    NUM_SELECTED: tl.constexpr, NPAD: tl.constexpr, TOK: tl.constexpr, TOK_PAD: tl.constexpr,
    CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr,
    NUM_INIT: tl.constexpr, NUM_LOCAL: tl.constexpr, IEEE: tl.constexpr,
):
    P: tl.constexpr = BLOCK_R // G
    BJ: tl.constexpr = NPAD  # selection blocks scored per step
    tile = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    r, t, row_ok, seq_start, t_end = _tile_rows(tile, tile_start, tile_end, tile_seq_start, P, G,
                                                BLOCK_R)
    cmp_start = tl.load(tile_cmp_start + tile)
    seq_len = t_end - seq_start
    num_cmp = tl.where(seq_len >= CMP_BLOCK, (seq_len - CMP_BLOCK) // CMP_STRIDE + 1, 0)
    pos = t - seq_start
    current = pos // SEL_BLOCK  # [R] block of the query itself
    hq = h * G + r % G
    t64 = t.to(tl.int64)
    dk = tl.arange(0, BLOCK_DK)
    q = load_tile(Q + b * stride_qb + t64 * stride_qt + hq * stride_qh, row_ok, DK, BLOCK_DK)
    lse = tl.load(LSE + b * stride_lb + t64 * stride_lt + hq, mask=row_ok, other=float("inf"))
    # Overlap (/ l) of compressed token a (relative to the chunk) with block c of this chunk
    # and with block c of the next chunk.
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
    # Rows of the same position share one group score: same_pos @ x sums over the group.
    same_pos = ((r[:, None] // G) == (r[None, :] // G)).to(tl.float32)
    carry = tl.zeros([BLOCK_R, BJ], tl.float32)
    best = tl.full([BLOCK_R, NPAD], -1, tl.int64)
    num_blocks = tl.max(tl.where(row_ok, current, -1), axis=0) + 1
    for j0 in range(0, num_blocks, BJ):
        i_loc = j0 * (SEL_BLOCK // CMP_STRIDE) + a  # compressed index within the sequence
        k_ok = (a < TOK) & (i_loc < num_cmp)
        kc = tl.load(KC + b * stride_kb + (cmp_start + i_loc).to(tl.int64)[:, None] * stride_kt
                     + h * stride_kh + dk[None, :], mask=k_ok[:, None] & (dk[None, :] < DK),
                     other=0.0)
        scores = dot(q, tl.trans(kc), IEEE) * score_scale(scale_log2)
        visible = k_ok[None, :] & (i_loc[None, :] * CMP_STRIDE + CMP_BLOCK - 1 <= pos[:, None])
        p = tl.where(visible, tl.exp2((scores - lse[:, None]) * exp_scale(scale_log2)), 0.0)
        mass = tl.dot(p, w_here, input_precision="ieee") + carry  # [R, BJ] per head
        carry = tl.dot(p, w_next, input_precision="ieee")
        # Other positions' rows meet here with weight 0: a NaN row (one that sees a NaN) must
        # not reach them.
        mass, _ = finite_part(mass)
        score = tl.dot(same_pos, mass, input_precision="ieee")  # [R, BJ] per group
        block = j0 + c
        candidate = block[None, :] <= current[:, None]
        forced = candidate & ((block[None, :] < NUM_INIT)
                              | (block[None, :] > current[:, None] - NUM_LOCAL))
        bits = tl.where(forced, float("inf"), tl.maximum(score, 0.0)).to(tl.int32, bitcast=True)
        key = (bits.to(tl.int64) << 32) | (2147483647 - block[None, :]).to(tl.int64)
        key = tl.where(candidate & row_ok[:, None], key, -1)
        merged = tl.reshape(tl.join(best, key), (BLOCK_R, 2 * NPAD))
        best = tl.topk(merged, NPAD)
    slot = tl.arange(0, NPAD)
    chosen = (best >= 0) & (slot[None, :] < NUM_SELECTED)
    blocks = tl.where(chosen, 2147483647 - (best & 0xFFFFFFFF).to(tl.int32), 2147483647)
    blocks = tl.sort(blocks, dim=1)
    blocks = tl.where(blocks == 2147483647, -1, blocks)
    first_head = row_ok & (r % G == 0)
    tl.store(IDX + b * stride_ib + t64[:, None] * stride_it + h * stride_ih + slot[None, :], blocks,
             mask=first_head[:, None] & (slot[None, :] < NUM_SELECTED))


@triton.jit
def _selected_fwd_kernel(
    Q, K, V, IDX, O, LSE, tile_start, tile_end, tile_seq_start,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ib, stride_it, stride_ih,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    H, scale_log2,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, NUM_SELECTED: tl.constexpr,
    NPAD: tl.constexpr, SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
):
    b, h, r, t, hq, row_ok, seq_start, t_end, t0, idx_ptr, mine = _selected_rows(
        IDX, tile_start, tile_end, tile_seq_start, stride_ib, stride_it, stride_ih, H, G,
        BLOCK_R, NUM_SELECTED, NPAD)
    t64 = t.to(tl.int64)
    q = load_tile(Q + b * stride_qb + t64 * stride_qt + hq * stride_qh, row_ok, DK, BLOCK_DK)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    num_pos = tl.minimum(BLOCK_R // G, t_end - t0)
    for pp in range(0, num_pos):
        for c in range(0, NUM_SELECTED):
            block, first_visit = _tile_block(idx_ptr, t0, pp, c, stride_it, mine, r, G)
            if first_visit:
                s64, k_ok, valid = _block_keys(block, seq_start, t_end, t, mine, SEL_BLOCK,
                                               BLOCK_S)
                k = load_tile(K + b * stride_kb + s64 * stride_kt + h * stride_kh, k_ok, DK,
                              BLOCK_DK)
                v, v_poison = finite_part(load_tile(
                    V + b * stride_vb + s64 * stride_vt + h * stride_vh, k_ok, DV, BLOCK_DV))
                scores = dot(q, tl.trans(k), IEEE) * score_scale(scale_log2) + v_poison[None, :]
                scores = tl.where(valid, scores, float("-inf"))
                m, l, acc = softmax_step(scores, m, l, acc, v, scale_log2, IEEE)
    out, lse = softmax_finish(m, l, acc, scale_log2)
    store_tile(O + b * stride_ob + t64 * stride_ot + hq * stride_oh, out, row_ok, DV, BLOCK_DV)
    tl.store(LSE + b * stride_lb + t64 * stride_lt + hq, lse, mask=row_ok)


@triton.jit
def _selected_bwd_dq_kernel(
    Q, K, V, IDX, DO, LSE, DELTA, DQ, tile_start, tile_end, tile_seq_start,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ib, stride_it, stride_ih,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    H, scale_log2, scale,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, NUM_SELECTED: tl.constexpr,
    NPAD: tl.constexpr, SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
):
    b, h, r, t, hq, row_ok, seq_start, t_end, t0, idx_ptr, mine = _selected_rows(
        IDX, tile_start, tile_end, tile_seq_start, stride_ib, stride_it, stride_ih, H, G,
        BLOCK_R, NUM_SELECTED, NPAD)
    t64 = t.to(tl.int64)
    q = load_tile(Q + b * stride_qb + t64 * stride_qt + hq * stride_qh, row_ok, DK, BLOCK_DK)
    do = load_tile(DO + b * stride_ob + t64 * stride_ot + hq * stride_oh, row_ok, DV, BLOCK_DV)
    lse = tl.load(LSE + b * stride_lb + t64 * stride_lt + hq, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + b * stride_lb + t64 * stride_lt + hq, mask=row_ok, other=0.0)
    acc = tl.zeros([BLOCK_R, BLOCK_DK], tl.float32)
    num_pos = tl.minimum(BLOCK_R // G, t_end - t0)
    for pp in range(0, num_pos):
        for c in range(0, NUM_SELECTED):
            block, first_visit = _tile_block(idx_ptr, t0, pp, c, stride_it, mine, r, G)
            if first_visit:
                s64, k_ok, valid = _block_keys(block, seq_start, t_end, t, mine, SEL_BLOCK,
                                               BLOCK_S)
                k = load_tile(K + b * stride_kb + s64 * stride_kt + h * stride_kh, k_ok, DK,
                              BLOCK_DK)
                v = load_tile(V + b * stride_vb + s64 * stride_vt + h * stride_vh, k_ok, DV,
                              BLOCK_DV)
                p, ds = probs_and_dscores(q, k, v, do, lse, delta, valid, scale_log2, IEEE)
                k_finite, _ = finite_part(k)
                acc += dot(ds.to(k.dtype), k_finite, IEEE)
    add_tile(DQ + b * stride_qb + t64 * stride_qt + hq * stride_qh, acc * scale, row_ok, DK,
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
        q_finite, _ = finite_part(q)
        do_finite, do_poison = finite_part(do)
        p, ds = probs_and_dscores(q, k, v, do, lse + do_poison, delta, valid, scale_log2, IEEE)
        acc_v += dot(tl.trans(p).to(do.dtype), do_finite, IEEE)
        acc_k += dot(tl.trans(ds).to(q.dtype), q_finite, IEEE)
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
