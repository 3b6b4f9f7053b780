"""One NSA decode step (one query per sequence against a KV cache) in three Triton kernels, with
no PyTorch op and no host sync between them: kernels, then the launch plan and wrapper.

A step's work per (sequence b, KV head h) is reading the visible compressed tokens (~pos/d of
them), choosing n selection blocks from their probabilities, and reading the n·l' selected and
the w window tokens. Every read is split across programs (flash-decoding partials), so that a
batch of one fills the GPU, and every merge of partials runs in a fixed order: a step is
deterministic, bit for bit. Rows of every tile are the G query heads of a KV head (or a slice
of GS of them), so keys are loaded once per group. Every key and value load is masked to the
tokens the spec counts, the rest load as 0, so no tile needs the finite-part products of the
training kernels (common.py, Masks): a NaN past ``pos`` is never read.

1. ``_compressed_kernel``, grid (B·H, S1 + NGS·P_WIN), two kinds of program:
   * compressed split s < S1: an equal share of the tiles of its sequence (a tile: TB
     selection blocks, a power of two, i.e. the TB·l'/d compressed tokens that start in
     them). Reads q and the visible compressed K, V once. Writes per tile and head the
     block-score partials ``p @ W`` (``BLK``; W: the spec's overlap weights
     |[i·d, i·d + l) ∩ block| / l) in units of the program's running maximum up to that tile
     (``REF``), and per program and head the softmax partial (m, l, acc [Dv]). No score per
     token is written. A tile's columns are block-minor (token i of block c at i·TB + c), so
     a block's own share is a reshape and a sum, and the shares its last tokens spill into
     the next blocks are rolled along the blocks; what rolls past the tile is carried to the
     next (rescaled to its maximum). A program's first tile takes that carry from the keys of
     the K - 1 = l/d - 1 tokens before it, read once;
   * window item S1 + k (k < NGS·P_WIN): item k % P_WIN of the slice k // P_WIN of GS heads,
     a range of the window's tokens, a softmax partial (kernel 3's item P_SEL + k % P_WIN).
   The window depends on nothing the step computes (it reads q, pos and the window's K, V), so
   it runs here, not behind a wait on kernel 1. Its programs come after the splits in the
   grid, so they are scheduled after them: on the SMs the splits leave free, or in the tail
   of the splits' wave.
2. ``_select_kernel``, grid (B·H, NS2 + NGS), two kinds of program:
   * selection tile j < NS2: the group score of BJ blocks (the G heads' partials, each scaled
     to its head's softmax: exp2(REF - max) / sum, from the S1 partials), the forced blocks,
     and the tile's top NSEL_PAD as int64 keys ``score_bits << 32 | (block ^ MAX_BLOCK)``
     (larger score first, ties to the lower index; the prefill's keys: ``block_keys`` and
     ``overlap_weights`` of selection.py) into ``CAND``; the last tile of (b, h) to finish
     merges them into the selection (``BLOCKS``, ascending); tile 0 also zeroes the (b, h)
     tickets of kernel 3 (kernel 1 zeroes the selection tiles' own);
   * NS2 + slice, per slice of GS heads: the compressed merge, g_cmp·o_cmp from the S1
     partials (``BASE``).
3. ``_selected_kernel``, grid (B·H·NGS, P_SEL). Each program reads the selection kernel 2's
   last selection tile of (b, h) wrote (that tile, found by an atomic ticket, merges every
   tile's candidate lists in one top-k: once per (b, h) rather than in every program here),
   reads its share of the selected blocks' tokens (laid end to end in ascending order) for its
   GS heads and writes a softmax partial. The last program of (b, h, slice) to finish (an
   atomic ticket, acq_rel after a CTA barrier) merges the selected and kernel 1's window
   partials in item order and writes g_cmp·o_cmp + g_slc·o_slc + g_win·o_win.

Every merge of partials (``_merge_partials``: the compressed splits in kernel 2, the items in
kernel 3) loads the maxima and sums of all its partials at once, then their accumulators up to
MERGE_TILE values at a time, each chunk weighted and summed by one reduction with no running
rescale, so its chain of dependent loads is 1 + ⌈partials / chunk⌉ long, not one load per
partial: at B = 1 those chains were much of the step's latency (bench/NOTES.md, decode v3
and v4).

Launch shapes (``decode_plan``). Bytes per step per (b, h), bf16, D = 128 (512 B a token):
compressed ≈ 512·pos/16 (2.1 MB at 64k), selected n·l' = 1024 tokens (0.5 MB), window 512
tokens (0.26 MB). A partial is G·Dv·4 B (8 KB for G = 16): a program should read many times
that, and a merge in one program should read few of them (one SM pulls ~100 GB/s: 100 KB is
~1 µs). Hence, on an H200 (132 SMs) with H = 4, G = 16, paper parameters:
* kernel 1: tiles of 64 compressed tokens (32 KB of K, V), or 32 / 16 when B·H·tiles would be
  fewer than one program per SM; S1 = min(tiles, 64, ⌊4·SMs / (B·H)⌋ − the window items of
  a (b, h)), at least 1: the splits and the window items in one wave of 4 programs an SM,
  evened so no program is idle.
  B = 1, 64k: 64 programs of one 64-token tile per head (256); B = 16: 6 programs of eleven
  64-token tiles (384, with the 128 window items 512 of the H200's 528 slots; partials are
  2 % of what they read). Then the window items
  (below): 128 programs at B = 1 and at B = 16. Two warps, two stages
  (``COMPRESSED_LAUNCH``, the window items' too): four programs an SM, which hide each
  other's loads; measured on the H200 at 64k, decode v9's kernel 1 (the splits alone) took
  40 µs at B = 16 and 6 µs at B = 1 (bench/NOTES.md, decode v9).
* selected and window items (kernels 3 and 1): 64-token tiles; items of one tile, or of
  ⌊B·H·tiles / (2·SMs)⌋ tiles (evened) once B·H·tiles reaches 2 programs per SM; the G heads
  cut into NGS ≤ 4 slices while there are fewer selected items than SMs. B = 1, 64k: 4 slices
  of 4 heads, 16 selected items of 64 tokens (256 programs), 8 window items per slice (128),
  and each final merge reads 24 partials of 2 KB; B = 16: 4 selected items of 256 tokens,
  2 window items, one slice.
* kernel 2: BJ = 128 blocks per selection tile (NS2 = 8 at 64k), and NGS compressed merges.
``PDL`` (sm90+): each kernel waits on the previous one (griddepcontrol.wait) before touching
memory and lets the next one launch once its own work is issued, so launches overlap. Kernel 3
reads kernel 1's window partials behind its wait on kernel 2: kernel 2 finishes only after
every one of its programs' waits on kernel 1 returned.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nsa.ops.params import LOG2E, NSAParams
from nsa.ops.triton.common import (
    attend_tile,
    compressed_count,
    exp_from,
    exp_scale,
    load_tile,
    masked_products,
    max_score,
    store_tile,
)
from nsa.ops.triton.jit import kernel
from nsa.ops.triton.launch import num_sms, pow2
from nsa.ops.triton.selection import (
    MAX_BLOCK,
    block_keys,
    key_blocks,
    overlap_weights,
    spill_blocks,
)
from nsa.ops.triton_support import DECODE_PDL


@triton.jit
def _fold(m, l, acc, m_i, l_i, acc_i, scale_log2):
    """Merge the softmax partial (m_i, l_i, acc_i) into (m, l, acc); empty ones have m = -inf."""
    c = exp_scale(scale_log2)
    m_new = tl.maximum(m, m_i)
    safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m - safe) * c)
    beta = tl.exp2((m_i - safe) * c)
    return m_new, l * alpha + l_i * beta, acc * alpha[:, None] + acc_i * beta[:, None]


@triton.jit
def _lse_parts(M_ROWS, L_ROWS, row_ok, count, scale_log2, PAD: tl.constexpr,
               CACHE: tl.constexpr):
    """(max, 1 / sum) of the softmax whose ``count`` partials start at M_ROWS / L_ROWS [rows];
    1 / sum is 0 for rows that saw no key."""
    s = tl.arange(0, PAD)
    ok = row_ok[:, None] & (s < count)[None, :]
    m = tl.load(M_ROWS[:, None] + s[None, :], mask=ok, other=float("-inf"), cache_modifier=CACHE)
    l = tl.load(L_ROWS[:, None] + s[None, :], mask=ok, other=0.0, cache_modifier=CACHE)
    m_max = tl.max(m, axis=1)
    safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.sum(l * tl.exp2((m - safe[:, None]) * exp_scale(scale_log2)), axis=1)
    return safe, tl.where(total > 0, 1.0 / total, 0.0)


@triton.jit
def _head_rows(pid_bhs, H, G: tl.constexpr, GS: tl.constexpr, NGS: tl.constexpr,
               BLOCK_R: tl.constexpr):
    """(b, h, slice, query heads [BLOCK_R], row mask) of program (b·H + h)·NGS + slice."""
    gs = pid_bhs % NGS
    pid_bh = pid_bhs // NGS
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    r = tl.arange(0, BLOCK_R)
    g = gs * GS + r
    return b, h, gs, h * G + g, (r < GS) & (g < G)


@triton.jit
def _store_partial(P_M, P_L, P_ACC, rows, count, item, row_ok, m, l, acc, DV: tl.constexpr,
                   BLOCK_DV: tl.constexpr):
    """Partial ``item`` of rows (b·HQ + hq) in buffers of ``count`` partials per row."""
    at = rows * count + item
    tl.store(P_M + at, m, mask=row_ok)
    tl.store(P_L + at, l, mask=row_ok)
    store_tile(P_ACC + at * DV, acc, row_ok, DV, BLOCK_DV)


@triton.jit
def _window_item(Q, KW, VW, POS, P_M, P_L, P_ACC, slice_id, item, H, SW, NWIN, P_SEL, P_WIN,
                 scale_log2, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, GS: tl.constexpr,
                 NGS: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr,
                 ITEM_WIN: tl.constexpr, WINDOW_RING: tl.constexpr, IEEE: tl.constexpr):
    """Window item ``item`` of head slice ``slice_id``: the window's tokens [u0, u0 + ITEM_WIN)
    back from pos, a softmax partial: item P_SEL + item of the P_SEL + P_WIN kernel 3 merges."""
    b, h, _, hq, row_ok = _head_rows(slice_id, H, G, GS, NGS, BLOCK_R)
    rows = b * H * G + hq  # [BLOCK_R]
    pos = tl.load(POS + b)
    q = load_tile(Q + rows * DK, row_ok, DK, BLOCK_DK)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    u0 = item * ITEM_WIN
    u_end = tl.minimum(u0 + ITEM_WIN, tl.minimum(NWIN, pos + 1))
    for start in range(u0, u_end, CHUNK):
        back = start + tl.arange(0, CHUNK)  # how far behind pos; in a ring, the slot
        ok = back < u_end
        if WINDOW_RING:
            row = back
        else:
            row = pos - back
        at = (b * SW + row) * H + h
        k = load_tile(KW + at * DK, ok, DK, BLOCK_DK)
        v = load_tile(VW + at * DV, ok, DV, BLOCK_DV)
        m, l, acc = attend_tile(q, k, v, ok[None, :], m, l, acc, scale_log2, IEEE, False)
    _store_partial(P_M, P_L, P_ACC, rows, P_SEL + P_WIN, P_SEL + item, row_ok, m, l, acc, DV,
                   BLOCK_DV)


@kernel
def _compressed_kernel(
    Q, KC, VC, KW, VW, POS, PART_M, PART_L, PART_ACC, BLK, REF, SEL_TICKET, P_M, P_L, P_ACC,
    H, C, NB, NT, S1, SW, NWIN, P_SEL, P_WIN, scale_log2,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, TB: tl.constexpr, R: tl.constexpr,
    R_PAD: tl.constexpr, SPILL: tl.constexpr, PRE: tl.constexpr, PRE_PAD: tl.constexpr,
    CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr,
    GS: tl.constexpr, NGS: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr,
    ITEM_WIN: tl.constexpr, WINDOW_RING: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    """Compressed splits, then per slice of GS heads the window items."""
    if PDL:
        gdc_wait()
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    if split < S1:
        b, h, _, hq, row_ok = _head_rows(pid_bh, H, G, G, 1, BLOCK_G)
        if split == 0:  # kernel 2's selection tickets for (b, h) start at 0
            tl.store(SEL_TICKET + pid_bh, 0)
        rows = b * H * G + hq  # [BLOCK_G] row of (b, hq) in the [B, HQ, ...] buffers
        q = load_tile(Q + rows * DK, row_ok, DK, BLOCK_DK)
        pos = tl.load(POS + b)
        visible = compressed_count(pos + 1, CMP_BLOCK, CMP_STRIDE)
        tiles = (pos // SEL_BLOCK) // TB + 1  # every block <= pos's gets its score written
        per_split = tl.cdiv(tiles, S1)
        t_lo = split * per_split
        t_hi = tl.minimum(t_lo + per_split, tiles)
        # A tile's columns are (token i of a block, block c of the tile), i-major: i·TB + c, so
        # the probabilities reshape to [rows, R_PAD, TB] and a block's score is a sum over axis 1
        # (as the prefill's selection kernel). Share of token i in its own block and in the k-th
        # after it (k <= SPILL): the same for every block.
        col = tl.arange(0, R_PAD * TB)
        col_i = col // TB
        c = tl.arange(0, TB)
        i = tl.arange(0, R_PAD)
        w_own = overlap_weights(i * CMP_STRIDE, 0, i < R, CMP_BLOCK, SEL_BLOCK)
        # The first tile's carry: the shares of the PRE tokens before it in its blocks, in units
        # of their own maximum (later tiles take it from the tile before them).
        ap = tl.arange(0, PRE_PAD)
        ip = t_lo * TB * R - PRE + ap
        ok_p = (ap < PRE) & (ip >= 0) & (ip < visible)
        qk_p = masked_products(q, load_tile(KC + ((b * C + ip) * H + h) * DK, ok_p, DK, BLOCK_DK),
                               ok_p[None, :], IEEE)
        ref_run = max_score(qk_p, scale_log2)
        w_pre = overlap_weights(((ap - PRE) * CMP_STRIDE)[:, None], (c * SEL_BLOCK)[None, :],
                                (ap < PRE)[:, None], CMP_BLOCK, SEL_BLOCK)
        e_p = exp_from(qk_p, tl.where(ref_run == float("-inf"), 0.0, ref_run), scale_log2)
        carry = tl.sum(e_p[:, :, None] * w_pre[None, :, :], axis=1)  # [BLOCK_G, TB]
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
        for t in range(t_lo, t_hi):
            tok = (t * TB + col % TB) * R + col_i
            ok = (col_i < R) & (tok < visible)
            k = load_tile(KC + ((b * C + tok) * H + h) * DK, ok, DK, BLOCK_DK)
            v = load_tile(VC + ((b * C + tok) * H + h) * DV, ok, DV, BLOCK_DV)
            qk = masked_products(q, k, ok[None, :], IEEE)
            # The running maximum of the program's tiles: the carry rescales to it (never up).
            ref_t = tl.maximum(ref_run, max_score(qk, scale_log2))
            ref = tl.where(ref_t == float("-inf"), 0.0, ref_t)
            p = exp_from(qk, ref, scale_log2)
            p3 = tl.reshape(p, [BLOCK_G, R_PAD, TB])
            blk = tl.sum(p3 * w_own[None, :, None], axis=1)
            blk += carry * tl.exp2((ref_run - ref) * exp_scale(scale_log2))[:, None]
            carry = tl.zeros([BLOCK_G, TB], tl.float32)
            for s in tl.static_range(1, SPILL + 1):  # shares in block c + s: rolled by s
                w_s = overlap_weights(i * CMP_STRIDE, s * SEL_BLOCK, i < R, CMP_BLOCK, SEL_BLOCK)
                rolled = tl.gather(tl.sum(p3 * w_s[None, :, None], axis=1),
                                   tl.broadcast_to(((c + TB - s) % TB)[None, :], [BLOCK_G, TB]),
                                   axis=1)
                blk += tl.where(c[None, :] >= s, rolled, 0.0)
                carry += tl.where(c[None, :] < s, rolled, 0.0)  # into the next tile's blocks
            ref_run = ref_t
            j = t * TB + c
            tl.store(BLK + rows[:, None] * NB + j[None, :], blk,
                     mask=row_ok[:, None] & (j < NB)[None, :])
            tl.store(REF + rows * NT + t, ref_t, mask=row_ok)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            m, l, acc = _fold(m, l, acc, ref_t, tl.sum(p, axis=1), pv, scale_log2)
        _store_partial(PART_M, PART_L, PART_ACC, rows, S1, split, row_ok, m, l, acc, DV, BLOCK_DV)
    else:  # window item (split - S1) % P_WIN of head slice (split - S1) // P_WIN of (b, h)
        window = split - S1
        _window_item(Q, KW, VW, POS, P_M, P_L, P_ACC, pid_bh * NGS + window // P_WIN,
                     window % P_WIN, H, SW, NWIN, P_SEL, P_WIN, scale_log2, G, DK, DV, BLOCK_DK,
                     BLOCK_DV, GS, NGS, BLOCK_R, CHUNK, ITEM_WIN, WINDOW_RING, IEEE)
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _select_tile(PART_M, PART_L, BLK, REF, SCORE, CAND, SEL_TICKET, BLOCKS, COUNTER, b, h, j,
                 pos, H, NB, NT, S1, NS2, NGS, scale_log2, G: tl.constexpr,
                 BLOCK_G: tl.constexpr, S1_PAD: tl.constexpr, BJ: tl.constexpr,
                 NS2_PAD: tl.constexpr, TB: tl.constexpr, NSEL: tl.constexpr,
                 NSEL_PAD: tl.constexpr, SEL_BLOCK: tl.constexpr, NUM_INIT: tl.constexpr,
                 NUM_LOCAL: tl.constexpr):
    """Candidate keys of blocks [j·BJ, (j+1)·BJ): the local top NSEL_PAD, descending. The last
    tile of (b, h) to finish merges every tile's candidates into the selection (BLOCKS)."""
    g = tl.arange(0, BLOCK_G)
    row_ok = g < G
    rows = b * H * G + h * G + g
    m_max, inv_sum = _lse_parts(PART_M + rows * S1, PART_L + rows * S1, row_ok, S1, scale_log2,
                                S1_PAD, "")
    current = pos // SEL_BLOCK
    block = j * BJ + tl.arange(0, BJ)
    candidate = block <= current
    ok = row_ok[:, None] & candidate[None, :]
    part = tl.load(BLK + rows[:, None] * NB + block[None, :], mask=ok, other=0.0)
    ref = tl.load(REF + rows[:, None] * NT + (block // TB)[None, :], mask=ok,
                  other=float("-inf"))
    weight = tl.exp2((ref - m_max[:, None]) * exp_scale(scale_log2)) * inv_sum[:, None]
    # [BJ] group score: the G heads' shares summed. It goes through memory (SCORE row of
    # (b, h), this CTA's own stores, ordered by the barrier) so the top-k sorts a plain 1-D
    # tensor: on the H200, tl.topk of int64 keys built from the reduction's layout directly
    # paired block indices with other blocks' scores (Triton 3.6; bench/NOTES.md, decode v2).
    at = SCORE + (b * H + h) * NB + block
    tl.store(at, tl.sum(part * weight, axis=0), mask=block < NB)
    tl.debug_barrier()
    score = tl.load(at, mask=candidate, other=0.0)
    top = tl.topk(block_keys(score, block, candidate, current, NUM_INIT, NUM_LOCAL), NSEL_PAD)
    slot = tl.arange(0, NSEL_PAD)
    tl.store(CAND + ((b * H + h) * NS2 + j) * NSEL_PAD + slot, top)
    # The last tile of (b, h) to finish (an atomic ticket, acq_rel after a CTA barrier) takes
    # the top NSEL of the candidate lists, ascending (as the spec's index: the same selection
    # is summed in the same order, however its blocks ranked), MAX_BLOCK past the chosen.
    tl.debug_barrier()
    ticket = tl.atomic_add(SEL_TICKET + b * H + h, 1, sem="acq_rel", scope="gpu")
    if ticket == NS2 - 1:
        lists = tl.arange(0, NS2_PAD)
        keys = tl.load(CAND + ((b * H + h) * NS2 + lists[:, None]) * NSEL_PAD + slot[None, :],
                       mask=(lists < NS2)[:, None], other=-1, cache_modifier=".cg")
        if NS2_PAD == 1:
            best = tl.reshape(keys, [NSEL_PAD])  # a list is sorted already
        else:
            best = tl.topk(tl.reshape(keys, [NS2_PAD * NSEL_PAD]), NSEL_PAD)
        chosen = (best >= 0) & (slot < NSEL)
        tl.store(BLOCKS + (b * H + h) * NSEL_PAD + slot, tl.sort(key_blocks(best, chosen)))
    if j == 0:  # kernel 3's tickets for (b, h) start at 0
        z = tl.arange(0, 16)
        for z0 in range(0, NGS, 16):
            tl.store(COUNTER + (b * H + h) * NGS + z0 + z, tl.zeros([16], tl.int32),
                     mask=z0 + z < NGS)


@triton.jit
def _merge_partials(P_M, P_L, P_ACC, rows, row_ok, count, first, last, scale_log2,
                    DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
                    CHUNK: tl.constexpr, ALL: tl.constexpr, CACHE: tl.constexpr):
    """o [rows, DV] of the softmax whose partials are items [first, last) of buffers of
    ``count`` partials per row (0 for rows that saw no key): the maxima and sums of all of
    them first (one load of at most ALL each), then their accumulators CHUNK at a time, each
    weighted by one reduction, chunks in item order."""
    m_max, inv_sum = _lse_parts(P_M + rows * count + first, P_L + rows * count + first, row_ok,
                                last - first, scale_log2, ALL, CACHE)
    c = exp_scale(scale_log2)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    i = tl.arange(0, CHUNK)
    d = tl.arange(0, BLOCK_DV)
    for start in range(first, last, CHUNK):
        in_chunk = row_ok[:, None] & (start + i < last)[None, :]  # [BLOCK_R, CHUNK]
        at_chunk = rows[:, None] * count + start + i[None, :]
        m_i = tl.load(P_M + at_chunk, mask=in_chunk, other=float("-inf"), cache_modifier=CACHE)
        acc_i = tl.load(P_ACC + at_chunk[:, :, None] * DV + d[None, None, :],
                        mask=in_chunk[:, :, None] & (d < DV)[None, None, :], other=0.0,
                        cache_modifier=CACHE)  # [BLOCK_R, CHUNK, BLOCK_DV]
        acc += tl.sum(acc_i * tl.exp2((m_i - m_max[:, None]) * c)[:, :, None], axis=1)
    return acc * inv_sum[:, None]


@triton.jit
def _merge_compressed(PART_M, PART_L, PART_ACC, GATES, BASE, rows, row_ok, S1, scale_log2,
                      DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
                      CHUNK_S1: tl.constexpr, S1_PAD: tl.constexpr):
    """BASE[rows] = g_cmp · o_cmp of (b, hq) rows from their S1 partials, in split order."""
    o = _merge_partials(PART_M, PART_L, PART_ACC, rows, row_ok, S1, 0, S1, scale_log2, DV,
                        BLOCK_R, BLOCK_DV, CHUNK_S1, S1_PAD, "")
    gate = tl.load(GATES + rows * 3, mask=row_ok, other=0.0).to(tl.float32)
    store_tile(BASE + rows * DV, o * gate[:, None], row_ok, DV, BLOCK_DV)


@kernel
def _select_kernel(
    POS, GATES, PART_M, PART_L, PART_ACC, BLK, REF, SCORE, CAND, SEL_TICKET, BLOCKS, COUNTER,
    BASE,
    H, NB, NT, S1, NS2, scale_log2,
    G: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr,
    S1_PAD: tl.constexpr, BJ: tl.constexpr, NS2_PAD: tl.constexpr, TB: tl.constexpr,
    NSEL: tl.constexpr, NSEL_PAD: tl.constexpr, SEL_BLOCK: tl.constexpr,
    NUM_INIT: tl.constexpr, NUM_LOCAL: tl.constexpr, GS: tl.constexpr, NGS: tl.constexpr,
    MERGE_R: tl.constexpr, CHUNK_S1: tl.constexpr, PDL: tl.constexpr,
):
    """Selection tiles, then per slice of GS heads the compressed merge."""
    if PDL:
        gdc_wait()
    pid_bh = tl.program_id(0)
    task = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    if task < NS2:
        _select_tile(PART_M, PART_L, BLK, REF, SCORE, CAND, SEL_TICKET, BLOCKS, COUNTER, b, h,
                     task, tl.load(POS + b), H, NB, NT, S1, NS2, NGS, scale_log2, G, BLOCK_G,
                     S1_PAD, BJ, NS2_PAD, TB, NSEL, NSEL_PAD, SEL_BLOCK, NUM_INIT, NUM_LOCAL)
    else:
        _, _, _, hq, row_ok = _head_rows(pid_bh * NGS + task - NS2, H, G, GS, NGS, MERGE_R)
        _merge_compressed(PART_M, PART_L, PART_ACC, GATES, BASE, b * H * G + hq, row_ok, S1,
                          scale_log2, DV, MERGE_R, BLOCK_DV, CHUNK_S1, S1_PAD)
    if PDL:
        gdc_launch_dependents()


@kernel
def _selected_kernel(
    Q, K, V, POS, GATES, BLOCKS, COUNTER, BASE, P_M, P_L, P_ACC, OUT,
    H, S, P_SEL, P_WIN, scale_log2,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, NSEL: tl.constexpr, NSEL_PAD: tl.constexpr,
    SEL_BLOCK: tl.constexpr, GS: tl.constexpr, NGS: tl.constexpr,
    BLOCK_R: tl.constexpr, CHUNK: tl.constexpr, ITEM_SEL: tl.constexpr,
    MERGE_R: tl.constexpr, CHUNK_ITEMS: tl.constexpr, ITEMS_PAD: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    b, h, _, hq, row_ok = _head_rows(pid, H, G, GS, NGS, BLOCK_R)
    item = tl.program_id(1)
    rows = b * H * G + hq
    pos = tl.load(POS + b)
    current = pos // SEL_BLOCK
    # The selection kernel 2 wrote: ascending blocks, MAX_BLOCK past the chosen.
    slot = tl.arange(0, NSEL_PAD)
    blocks = tl.load(BLOCKS + (b * H + h) * NSEL_PAD + slot)
    # Tokens [u0, u0 + ITEM_SEL) of the selected blocks laid end to end (slot u // l').
    q = load_tile(Q + rows * DK, row_ok, DK, BLOCK_DK)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    u0 = item * ITEM_SEL
    u_end = tl.minimum(u0 + ITEM_SEL, tl.minimum(NSEL, current + 1) * SEL_BLOCK)
    for start in range(u0, u_end, CHUNK):
        u = start + tl.arange(0, CHUNK)
        at_slot = (u // SEL_BLOCK)[:, None] == slot[None, :]
        block = tl.sum(tl.where(at_slot, blocks[None, :], 0), axis=1)
        key = block * SEL_BLOCK + u % SEL_BLOCK
        ok = (u < u_end) & (block != MAX_BLOCK) & (key <= pos)
        at = (b * S + key) * H + h
        k = load_tile(K + at * DK, ok, DK, BLOCK_DK)
        v = load_tile(V + at * DV, ok, DV, BLOCK_DV)
        m, l, acc = attend_tile(q, k, v, ok[None, :], m, l, acc, scale_log2, IEEE, False)
    count = P_SEL + P_WIN
    _store_partial(P_M, P_L, P_ACC, rows, count, item, row_ok, m, l, acc, DV, BLOCK_DV)
    if PDL:
        gdc_launch_dependents()
    # The last program of (b, h, slice) to finish merges: the barrier orders every thread's
    # stores before the ticket (release); the ticket orders the merge's reads after (acquire).
    tl.debug_barrier()
    ticket = tl.atomic_add(COUNTER + pid, 1, sem="acq_rel", scope="gpu")
    if ticket == P_SEL - 1:  # rows of the slice unpadded (MERGE_R): no products here
        _, _, _, hq_m, ok_m = _head_rows(pid, H, G, GS, NGS, MERGE_R)
        rows_m = b * H * G + hq_m
        # Read past L1: the other programs wrote these partials during this kernel.
        o_slc = _merge_partials(P_M, P_L, P_ACC, rows_m, ok_m, count, 0, P_SEL, scale_log2, DV,
                                MERGE_R, BLOCK_DV, CHUNK_ITEMS, ITEMS_PAD, ".cg")
        o_win = _merge_partials(P_M, P_L, P_ACC, rows_m, ok_m, count, P_SEL, count, scale_log2,
                                DV, MERGE_R, BLOCK_DV, CHUNK_ITEMS, ITEMS_PAD, ".cg")
        g_slc = tl.load(GATES + rows_m * 3 + 1, mask=ok_m, other=0.0).to(tl.float32)
        g_win = tl.load(GATES + rows_m * 3 + 2, mask=ok_m, other=0.0).to(tl.float32)
        d = tl.arange(0, BLOCK_DV)
        base = tl.load(BASE + rows_m[:, None] * DV + d[None, :],
                       mask=ok_m[:, None] & (d < DV)[None, :], other=0.0)
        out = base + g_slc[:, None] * o_slc + g_win[:, None] * o_win
        store_tile(OUT + rows_m * DV, out, ok_m, DV, BLOCK_DV)


# Launch plan and wrapper --------------------------------------------------------------------

FILL = 2  # programs per SM the selected and window items should reach at B = 1
COMPRESSED_LAUNCH = dict(num_warps=2, num_stages=2)  # kernel 1: four programs an SM
SELECT_LAUNCH = dict(num_warps=4, num_stages=3)  # kernel 2
SELECTED_LAUNCH = dict(num_warps=4, num_stages=3)  # kernel 3
SPLITS_PER_SM = 4  # compressed programs per SM at large B·H (each loops over its tiles)
MAX_SPLITS = 64  # compressed programs per (b, h): a merge reads S1 partials of its heads
MAX_HEAD_SLICES = 4  # G cut into at most this many slices (each re-reads the same keys)
BLOCK_TILE = 128  # blocks one selection program scores
TILE = 64  # tokens per step of the selected and window loops
MERGE_TILE = 4096  # most float32 partial values one merge step loads (32 a thread)


@dataclass(frozen=True)
class DecodePlan:
    """Launch shapes of one decode step (see the module docstring)."""

    tile_blocks: int  # TB: selection blocks per compressed tile
    splits: int  # S1: compressed programs per (b, h)
    block_tile: int  # BJ: blocks per selection program
    select_tiles: int  # NS2: selection programs per (b, h)
    head_slices: int  # NGS: slices of the G heads in the selected and window items
    selected_items: int  # P_SEL
    selected_item_tokens: int
    window_items: int  # P_WIN
    window_item_tokens: int


def decode_plan(B: int, H: int, G: int, S: int, window_tokens: int, params: NSAParams,
                sms: int) -> DecodePlan:
    """Launch shapes for B sequences of capacity S on a device of ``sms`` SMs."""
    fill = FILL * sms
    R = params.sel_block // params.cmp_stride  # compressed tokens starting in one block
    spill = spill_blocks(params)
    num_blocks = -(-S // params.sel_block)
    for tokens in (64, 32, 16):  # the largest tile that gives every SM a program
        # A power of two of blocks (kernel 1 reshapes by it), at least 16 columns of R_PAD
        # tokens, and at least the blocks a token spills into (its carry goes to the next).
        tile_blocks = max(1 << (max(1, tokens // R).bit_length() - 1), 16 // pow2(R, 1),
                          pow2(spill, 1))
        tiles = -(-num_blocks // tile_blocks)
        if B * H * tiles >= sms:
            break
    block_tile = max(pow2(params.num_selected, 2), min(BLOCK_TILE, pow2(num_blocks, 1)))
    sel_tiles = -(-params.num_selected * params.sel_block // TILE)
    win_tiles = -(-window_tokens // TILE)
    per_item = max(1, B * H * (sel_tiles + win_tiles) // fill)
    selected_items, window_items = -(-sel_tiles // per_item), -(-win_tiles // per_item)
    head_slices = 1
    while B * H * head_slices * selected_items < sms and head_slices < min(G, MAX_HEAD_SLICES):
        head_slices *= 2
    head_slices = -(-G // -(-G // head_slices))  # no empty slice
    # Kernel 1's splits and window items in one wave of SPLITS_PER_SM programs an SM where
    # the splits alone would fill it (a second wave would start after the first's splits).
    wave = SPLITS_PER_SM * sms // (B * H) - head_slices * window_items
    splits = max(1, min(tiles, MAX_SPLITS, wave))
    splits = -(-tiles // -(-tiles // splits))  # as many as have tiles at full capacity
    return DecodePlan(
        tile_blocks=tile_blocks, splits=splits, block_tile=block_tile,
        select_tiles=-(-num_blocks // block_tile), head_slices=head_slices,
        selected_items=selected_items,
        selected_item_tokens=-(-sel_tiles // selected_items) * TILE,
        window_items=window_items, window_item_tokens=-(-win_tiles // window_items) * TILE)


@functools.cache
def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: on sm90+ GPUs, unless NSA_DECODE_PDL=0 (read once, at
    import: ``nsa.ops.triton_support``)."""
    return (DECODE_PDL and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def decode_forward(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, pos, params: NSAParams,
                   scale: float, window_ring: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """[B, HQ, Dv] output of one decode step, in ``out_dtype``. Tensors contiguous, in one
    dtype (gates any float dtype); q [B, HQ, Dk], k/v [B, S, H, D], k_cmp/v_cmp [B, C, H, D],
    k_win/v_win [B, SW, H, D] (SW = S by position, or a ring of SW slots), pos [B] int64."""
    B, HQ, Dk = q.shape
    S, H, Dv, C, SW = k.shape[1], k.shape[2], v.shape[-1], k_cmp.shape[1], k_win.shape[1]
    G = HQ // H
    window_tokens = SW if window_ring else min(params.window, S)
    plan = decode_plan(B, H, G, S, window_tokens, params, num_sms(q.device))
    R, K = params.sel_block // params.cmp_stride, params.cmp_block // params.cmp_stride
    TB = plan.tile_blocks
    NB = -(-S // params.sel_block)
    NT = -(-NB // TB)
    S1, NS2, NGS = plan.splits, plan.select_tiles, plan.head_slices
    P_SEL, P_WIN = plan.selected_items, plan.window_items
    nsel_pad = pow2(params.num_selected, 2)
    GS = -(-G // NGS)
    f32 = dict(dtype=torch.float32, device=q.device)
    part_m, part_l = torch.empty(B, HQ, S1, **f32), torch.empty(B, HQ, S1, **f32)
    part_acc = torch.empty(B, HQ, S1, Dv, **f32)
    blk, ref = torch.empty(B, HQ, NB, **f32), torch.empty(B, HQ, NT, **f32)
    score = torch.empty(B, H, NB, **f32)
    cand = torch.empty(B, H, NS2, nsel_pad, dtype=torch.int64, device=q.device)
    sel_ticket = torch.empty(B, H, dtype=torch.int32, device=q.device)
    blocks = torch.empty(B, H, nsel_pad, dtype=torch.int32, device=q.device)
    counter = torch.empty(B, H, NGS, dtype=torch.int32, device=q.device)
    base = torch.empty(B, HQ, Dv, **f32)
    p_m, p_l = torch.empty(B, HQ, P_SEL + P_WIN, **f32), torch.empty(B, HQ, P_SEL + P_WIN, **f32)
    p_acc = torch.empty(B, HQ, P_SEL + P_WIN, Dv, **f32)
    out = torch.empty(B, HQ, Dv, dtype=out_dtype, device=q.device)
    pdl = use_pdl(q.device)
    launch = dict(launch_pdl=True) if pdl else {}
    shared = dict(G=G, DV=Dv, BLOCK_DV=pow2(Dv), PDL=pdl)
    products = dict(DK=Dk, BLOCK_DK=pow2(Dk), IEEE=k.dtype == torch.float32)
    merge_rows = pow2(GS, 1)  # a merge has no products: its rows need no padding to 16
    rows = dict(GS=GS, NGS=NGS, BLOCK_R=pow2(GS), CHUNK=TILE)

    def merge_chunk(partials: int) -> int:  # partials per merge step, a power of two
        fits = max(1, MERGE_TILE // (merge_rows * pow2(Dv)))
        return min(pow2(partials, 1), 1 << (fits.bit_length() - 1))

    scale_log2 = scale * LOG2E
    _compressed_kernel[(B * H, S1 + NGS * P_WIN)](
        q, k_cmp, v_cmp, k_win, v_win, pos, part_m, part_l, part_acc, blk, ref, sel_ticket,
        p_m, p_l, p_acc,
        H, C, NB, NT, S1, SW, window_tokens, P_SEL, P_WIN, scale_log2,
        BLOCK_G=pow2(G), TB=TB, R=R, R_PAD=pow2(R, 1), SPILL=spill_blocks(params), PRE=K - 1,
        PRE_PAD=pow2(K - 1), CMP_BLOCK=params.cmp_block, CMP_STRIDE=params.cmp_stride,
        SEL_BLOCK=params.sel_block, ITEM_WIN=plan.window_item_tokens, WINDOW_RING=window_ring,
        **rows, **products, **shared, **launch, **COMPRESSED_LAUNCH)
    _select_kernel[(B * H, NS2 + NGS)](
        pos, gates, part_m, part_l, part_acc, blk, ref, score, cand, sel_ticket, blocks,
        counter, base,
        H, NB, NT, S1, NS2, scale_log2,
        BLOCK_G=pow2(G), S1_PAD=pow2(S1, 1), BJ=plan.block_tile, NS2_PAD=pow2(NS2, 1), TB=TB,
        NSEL=params.num_selected, NSEL_PAD=nsel_pad,
        SEL_BLOCK=params.sel_block, NUM_INIT=params.num_init, NUM_LOCAL=params.num_local,
        GS=GS, NGS=NGS, MERGE_R=merge_rows, CHUNK_S1=merge_chunk(S1), **shared, **launch,
        **SELECT_LAUNCH)
    _selected_kernel[(B * H * NGS, P_SEL)](
        q, k, v, pos, gates, blocks, counter, base, p_m, p_l, p_acc, out,
        H, S, P_SEL, P_WIN, scale_log2,
        NSEL=params.num_selected, NSEL_PAD=nsel_pad,
        SEL_BLOCK=params.sel_block, ITEM_SEL=plan.selected_item_tokens, MERGE_R=merge_rows,
        CHUNK_ITEMS=merge_chunk(max(P_SEL, P_WIN)), ITEMS_PAD=pow2(max(P_SEL, P_WIN), 1), **rows,
        **products, **shared, **launch, **SELECTED_LAUNCH)
    return out
