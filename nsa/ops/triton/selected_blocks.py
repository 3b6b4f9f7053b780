"""The selected branch per key block: Triton kernels, then their launch wrappers.

Each (batch, KV head, selection block) has the list of the positions that selected it (an
inverse index of the selection, built by a sort: ``InverseIndex``). Its entries are the flat
indices (b, t, h, slot) of the selection tensor [B, T, H, n], so one entry names a position,
its KV head and the slot the block fills there, and the lists are cut into segments of at most
``segment_entries(G)`` entries (the forced first block is chosen by every position: no program
runs alone for long). ``_segment_starts_kernel`` numbers the segments (one program, a running
sum over the lists) and each program finds its list by a binary search, so the index costs a
sort, a search, three elementwise ops and three launches rather than some forty small PyTorch
ops (host time: bench/NOTES.md, v11). A program loads its block's keys and values once and
takes the segment's entries P = R / G at a time, with the G query heads of each as rows: R-row
tiles however small G is, where one program per position has G rows (selected.py). Entries of
positions inside the block (they see part of it) and a segment's last tile run first,
multiplying finite parts only (common.py, Masks); the others see the whole block: plain
products.

* ``_block_fwd_kernel`` (``per_block``: groups of at most ``TUNING["selected_block_fwd"]
  ["max_group"]`` heads): each entry's attention over its one block, normalised, with its
  log-sum-exp, into a partial [B, TC, H, n, G] row; ``_merge_partials_kernel`` combines a
  position's n partials in slot order (and writes the gated sum of the three branches, as the
  per-position kernel).
* ``_block_bwd_kernel``: dK, dV of the block from the segment's entries, written directly
  when the segment is its list's only one, else as a partial per segment that
  ``_sum_segments_kernel`` adds up in segment order (``SUM_ROWS`` tokens a program); with
  ``DQ`` (``dq_per_block``), also each entry's dq through this block, into a partial row that
  ``_sum_dq_kernel`` adds up over a position's slots in order. Deterministic: every partial
  has one writer, every sum a fixed order, no atomics.

Partials cost 4 (Dv + 1) bytes (forward) and Dk elements of q's dtype (backward: dq's own
precision) per (position, query head, slot): n times the branch's float32 output or dq. So the
kernels run over chunks of positions (``position_chunks``) whose partials take at most
PARTIALS_BYTES, each chunk with its own inverse index, partials and sums (``T0``, ``TC``: its
first position and length; a partial [B, TC, H, n, G] row per entry); with more than one
chunk, dK and dV are summed over the chunks in float32, in order. Larger groups keep the
per-position kernels, whose programs already have many rows: the forward above 4 heads (per
block it was slower at 6 and 8: its partials' bytes), the dq above 8 (at 16 per block it was
3 % faster for 2.4x the peak memory at 16k). The forward's stay float32: o_slc feeds the gate
gradient, a dot product with do that 16-bit outputs put past its tolerance (bench/NOTES.md,
v6).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops.layout import expand_counts
from nsa.ops.params import LOG2E, NSAParams
from nsa.ops.triton.common import (
    accumulate_tile,
    attend_tile,
    dkdv_dq_tile,
    dot,
    exp_scale,
    finite_part,
    load_tile,
    partial_tile,
    query_rows_tile,
    softmax_finish,
    split_tiles,
    store_tile,
)
from nsa.ops.triton.gating import GatedSum, gated_sum_args, store_selected_rows
from nsa.ops.triton.jit import kernel
from nsa.ops.triton.launch import (
    TUNING,
    BranchGrad,
    cdiv,
    launch_shape,
    pow2,
    shapes,
    small_scale,
    strides,
)
from nsa.ops.triton.tables import KernelTables, i32

SUM_ROWS = 16  # block tokens one program of the dK/dV partials' sum adds up
# The most bytes of partials (forward, or the backward's dq) one chunk of positions writes: the
# per-block kernels run over chunks of positions whose partials fit (``position_chunks``).
# Each further chunk costs time (H200, 128k, 32/8/128: 4 GiB +3 %, 2 GiB +8 %; bench/NOTES.md).
PARTIALS_BYTES = 2**32
CHUNK_ALIGN = 64  # chunks of at least this many positions are a multiple of it


def position_chunks(T: int, bytes_per_position: int) -> list[tuple[int, int]]:
    """(first position, positions) of the chunks, in order, that cover positions 0 .. T - 1
    with at most PARTIALS_BYTES of partials each (and one position at least): as few as
    that allows, of near-equal lengths."""
    most = max(1, PARTIALS_BYTES // max(bytes_per_position, 1))
    size = cdiv(T, cdiv(T, most)) if T else 1
    if most >= CHUNK_ALIGN:
        size = min(most - most % CHUNK_ALIGN, cdiv(size, CHUNK_ALIGN) * CHUNK_ALIGN)
    return [(t0, min(size, T - t0)) for t0 in range(0, max(T, 1), size)]


def per_block(G: int) -> bool:
    """Whether the selected forward runs per key block for groups of G heads (else one program
    per position: selected.py)."""
    return G <= TUNING["selected_block_fwd"]["max_group"]


def dq_per_block(G: int) -> bool:
    """Whether the selected dq runs per key block, inside the dK/dV kernel (else one program
    per position): wherever the forward does, and up to ``TUNING["selected_dkdv"]
    ["dq_max_group"]`` heads."""
    return per_block(G) or G <= TUNING["selected_dkdv"]["dq_max_group"]


def segment_entries(G: int) -> int:
    """The most entries of a block's list one per-block program takes, for groups of G."""
    return TUNING["selected_block_fwd" if per_block(G) else "selected_dkdv"]["segment"]


@kernel
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
def _list_segments(SEG_FIRST, list_id):
    """(first segment, end segment, whether the list is one segment long: then its block's
    dK/dV program writes dK/dV itself and ``_sum_segments_kernel`` leaves it alone, unless
    they ACCUMULATE)."""
    first = tl.load(SEG_FIRST + list_id)
    end = tl.load(SEG_FIRST + list_id + 1)
    return first, end, end - first == 1


@triton.jit
def _entry_position(entry, T0, TC, H, NUM_SELECTED: tl.constexpr):
    """The position t of a flat index (b, t - T0, h, slot) of a chunk's selection [B, TC, H, n]
    (positions T0 .. T0 + TC - 1: ``position_chunks``)."""
    return T0 + entry // (H * NUM_SELECTED) % TC


@triton.jit
def _segment_block(SEG_FIRST, OFFSETS, ENTRIES, K, V, block_token_start, block_token_end,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, T0, TC, H,
                   NUM_GLOBAL_BLOCKS, NUM_LISTS, DK: tl.constexpr, DV: tl.constexpr,
                   BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
                   P: tl.constexpr, NUM_SELECTED: tl.constexpr, SEGMENT: tl.constexpr,
                   SEARCH_STEPS: tl.constexpr):
    """This program's segment: (b, h, the block's tokens s [BLOCK_S] and their mask, keys,
    values, the end of its entries, its tiles of P entries as ``split_tiles`` gives them:
    full_lo, full_hi, number of partial tiles, first entry; and whether it is its list's only
    segment)."""
    list_id, e_lo, e_hi = _find_segment(SEG_FIRST, OFFSETS, tl.program_id(0), NUM_LISTS,
                                        SEARCH_STEPS, SEGMENT)
    pid_bh = list_id // NUM_GLOBAL_BLOCKS
    gblock = list_id % NUM_GLOBAL_BLOCKS
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    s_hi = tl.load(block_token_end + gblock)
    s = tl.load(block_token_start + gblock) + tl.arange(0, BLOCK_S)
    s64 = s.to(tl.int64)
    k_ok = s < s_hi
    k = load_tile(K + b * stride_kb + s64 * stride_kt + h * stride_kh, k_ok, DK, BLOCK_DK)
    v = load_tile(V + b * stride_vb + s64 * stride_vt + h * stride_vh, k_ok, DV, BLOCK_DV)
    # A list's positions ascend (a stable sort of (b, t, h, slot)); those before the block's
    # last token (t < s_hi - 1: inside the block, fewer than BLOCK_S) see only part of it and
    # come first. Entries from e_full on see the whole block.
    e = e_lo + tl.arange(0, BLOCK_S)
    in_seg = e < e_hi
    t = _entry_position(tl.load(ENTRIES + e, mask=in_seg, other=0), T0, TC, H, NUM_SELECTED)
    e_full = e_lo + tl.sum((in_seg & (t < s_hi - 1)).to(tl.int32), axis=0)
    full_lo, full_hi, num_partial = split_tiles(e_lo, e_hi, e_full, e_hi, P)
    # The list's only segment (an unused program's segment is empty, never alone).
    _, _, single = _list_segments(SEG_FIRST, list_id)
    alone = single & (e_hi > e_lo)
    return b, h, s, k_ok, k, v, e_hi, full_lo, full_hi, num_partial, e_lo, alone


@triton.jit
def _entry_rows(ENTRIES, e_start, e_hi, T0, TC, H, G: tl.constexpr, NUM_SELECTED: tl.constexpr,
                BLOCK_R: tl.constexpr):
    """The rows of the P = BLOCK_R // G entries from e_start (below e_hi) x G heads: (position
    t (int64), query head offset g in the group, row mask, partial row (entry·G + g, int64))."""
    P: tl.constexpr = BLOCK_R // G
    r = tl.arange(0, BLOCK_R)
    e = e_start + r // G
    row_ok = (r < P * G) & (e < e_hi)
    entry = tl.load(ENTRIES + e, mask=row_ok, other=0).to(tl.int64)
    g = r % G
    return _entry_position(entry, T0, TC, H, NUM_SELECTED), g, row_ok, entry * G + g


@triton.jit
def _attend_entries(e_start, e_hi, s, k_ok, k, v, Q, ENTRIES, O_PART, LSE_PART, b, h,
                    stride_qb, stride_qt, stride_qh, T0, TC, H, scale_log2, G: tl.constexpr,
                    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                    BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, NUM_SELECTED: tl.constexpr,
                    IEEE: tl.constexpr, PARTIAL: tl.constexpr, SMALL_SCALE: tl.constexpr):
    """Attention of a tile of entries over the block (keys s <= t), stored normalised as
    partial rows with their log-sum-exps."""
    t, g, row_ok, part = _entry_rows(ENTRIES, e_start, e_hi, T0, TC, H, G, NUM_SELECTED, BLOCK_R)
    q = load_tile(Q + b * stride_qb + t * stride_qt + (h * G + g) * stride_qh, row_ok, DK,
                  BLOCK_DK)
    valid = row_ok[:, None] & k_ok[None, :] & (s[None, :] <= t[:, None])
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    m, l, acc = attend_tile(q, k, v, valid, m, l, acc, scale_log2, IEEE, PARTIAL,
                            SMALL_SCALE=SMALL_SCALE)
    out, lse = softmax_finish(m, l, acc, scale_log2)
    store_tile(O_PART + part * DV, out, row_ok, DV, BLOCK_DV)
    tl.store(LSE_PART + part, lse, mask=row_ok)


@kernel
def _block_fwd_kernel(
    Q, K, V, O_PART, LSE_PART, block_token_start, block_token_end, SEG_FIRST, OFFSETS, ENTRIES,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    T0, TC, H, NUM_GLOBAL_BLOCKS, NUM_LISTS, scale_log2,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
    NUM_SELECTED: tl.constexpr, IEEE: tl.constexpr, SEGMENT: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, SMALL_SCALE: tl.constexpr,
):
    """Partial outputs O_PART [B·TC·H·n·G, DV] and log-sum-exps LSE_PART of one segment's
    entries over its block."""
    P: tl.constexpr = BLOCK_R // G
    b, h, s, k_ok, k, v, e_hi, full_lo, full_hi, num_partial, e_lo, _ = _segment_block(
        SEG_FIRST, OFFSETS, ENTRIES, K, V, block_token_start, block_token_end, stride_kb,
        stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, T0, TC, H, NUM_GLOBAL_BLOCKS,
        NUM_LISTS, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_S, P, NUM_SELECTED, SEGMENT, SEARCH_STEPS)
    for i in range(0, num_partial):
        _attend_entries(partial_tile(i, e_lo, full_lo, full_hi, P), e_hi, s, k_ok, k, v, Q,
                        ENTRIES, O_PART, LSE_PART, b, h, stride_qb, stride_qt, stride_qh, T0, TC, H,
                        scale_log2, G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_R, NUM_SELECTED, IEEE,
                        True, SMALL_SCALE)
    for e_start in range(full_lo, full_hi, P):
        _attend_entries(e_start, e_hi, s, k_ok, k, v, Q, ENTRIES, O_PART, LSE_PART, b, h,
                        stride_qb, stride_qt, stride_qh, T0, TC, H, scale_log2, G, DK, DV, BLOCK_DK,
                        BLOCK_DV, BLOCK_R, NUM_SELECTED, IEEE, False, SMALL_SCALE)


@triton.jit
def slots_in_use(pos, NUM_SELECTED: tl.constexpr, SEL_BLOCK: tl.constexpr):
    """The selection slots a position ``pos`` of its sequence fills: min(n, candidates), its
    candidates the blocks that start at or before it (ascending slots, unused ones last)."""
    return tl.minimum(NUM_SELECTED, pos // SEL_BLOCK + 1)


@triton.jit
def position_program(TOK_POS, H, BLOCK_G: tl.constexpr, NUM_SELECTED: tl.constexpr,
                     SEL_BLOCK: tl.constexpr):
    """Program (t, b·H + h) of a per-position kernel, whose rows are the G query heads of KV
    head h at t: (b, h, t (int64), t's position in its sequence, g [BLOCK_G], slots in use:
    min(n, candidates))."""
    t = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    pos = tl.load(TOK_POS + t)
    return b, h, t, pos, tl.arange(0, BLOCK_G), slots_in_use(pos, NUM_SELECTED, SEL_BLOCK)


@triton.jit
def _position_slots(TOK_POS, T0, TC, H, G: tl.constexpr, BLOCK_G: tl.constexpr,
                    NUM_SELECTED: tl.constexpr, SEL_BLOCK: tl.constexpr):
    """``position_program`` for a sum over slots of a chunk's partials (program t - T0 of
    positions T0 .. T0 + TC - 1): (b, t, query heads hq [BLOCK_G], row mask, the partial row of
    slot 0 per head (int64; slot i's is G·i further), slots in use)."""
    b, h, t, _, g, num_blocks = position_program(TOK_POS + T0, H, BLOCK_G, NUM_SELECTED,
                                                 SEL_BLOCK)
    first = ((b * TC + t) * H + h) * NUM_SELECTED * G + g
    return b, T0 + t, h * G + g, g < G, first, num_blocks


@kernel
def _merge_partials_kernel(
    O_PART, LSE_PART, O, LSE, TOK_POS, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    T, T0, TC, H, scale_log2, O_CMP, O_WIN, GATES, OUT,
    G: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_SELECTED: tl.constexpr, SEL_BLOCK: tl.constexpr, GATED: tl.constexpr,
):
    """O, LSE of position t's G heads from its slots' partials (a softmax over their
    log-sum-exps, in slot order); with GATED, also OUT, the gated sum (gating.py)."""
    b, t, hq, row_ok, first, num_blocks = _position_slots(TOK_POS, T0, TC, H, G, BLOCK_G,
                                                          NUM_SELECTED, SEL_BLOCK)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for slot in range(0, num_blocks):
        rows = first + slot * G
        lse = tl.load(LSE_PART + rows, mask=row_ok, other=float("-inf"))
        o = load_tile(O_PART + rows * DV, row_ok, DV, BLOCK_DV)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m - m_safe) * exp_scale(scale_log2))
        weight = tl.exp2((lse - m_safe) * exp_scale(scale_log2))
        l = l * alpha + weight
        acc = acc * alpha[:, None] + weight[:, None] * o
        m = m_new
    store_selected_rows(O, LSE, O_CMP, O_WIN, GATES, OUT, b, t, hq, T, H * G, m, l, acc, row_ok,
                        stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, scale_log2, DV,
                        BLOCK_DV, GATED)


@triton.jit
def _block_bwd_entries(e_start, e_hi, s, k_ok, k, v, acc_k, acc_v, Q, DO, GATE, LSE, DELTA,
                       ENTRIES, DQ_PART, b, h, stride_qb, stride_qt, stride_qh, stride_ob,
                       stride_ot, stride_oh, stride_lb, stride_lt, T0, TC, H, scale_log2, scale,
                       G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr,
                       NUM_SELECTED: tl.constexpr, IEEE: tl.constexpr, PARTIAL: tl.constexpr,
                       DQ: tl.constexpr, SMALL_SCALE: tl.constexpr):
    """Fold a tile of entries into the block's dK, dV; with DQ, store their dq partial rows
    (dS k, a PARTIAL tile multiplying k's finite part)."""
    t, g, row_ok, part = _entry_rows(ENTRIES, e_start, e_hi, T0, TC, H, G, NUM_SELECTED, BLOCK_R)
    q, do, gate, lse, delta = query_rows_tile(
        Q, DO, GATE, LSE, DELTA, b, t, h * G + g, row_ok, stride_qb, stride_qt, stride_qh,
        stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, DK, DV, BLOCK_DK, BLOCK_DV)
    valid = row_ok[:, None] & k_ok[None, :] & (s[None, :] <= t[:, None])
    acc_k, acc_v, ds = dkdv_dq_tile(q, k, v, do, gate, lse, delta, valid, acc_k, acc_v,
                                    scale_log2, IEEE, PARTIAL, SMALL_SCALE=SMALL_SCALE)
    if DQ:
        k_mult = k
        if PARTIAL:
            k_mult, _ = finite_part(k)
        dq = dot(ds.to(k.dtype), k_mult, IEEE) * scale
        store_tile(DQ_PART + part * DK, dq.to(DQ_PART.dtype.element_ty), row_ok, DK, BLOCK_DK)
    return acc_k, acc_v


@kernel
def _block_bwd_kernel(
    Q, K, V, DO, GATE, LSE, DELTA, DK_OUT, DV_OUT, DK_PART, DV_PART, DQ_PART,
    block_token_start, block_token_end, SEG_FIRST, OFFSETS, ENTRIES,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
    T0, TC, H, NUM_GLOBAL_BLOCKS, NUM_LISTS, scale_log2, scale,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
    NUM_SELECTED: tl.constexpr, IEEE: tl.constexpr, SEGMENT: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, DQ: tl.constexpr, ACCUMULATE: tl.constexpr,
    SMALL_SCALE: tl.constexpr,
):
    """dK, dV [BLOCK_S, D] of one block of one KV head from one segment of its list: into
    DK_OUT, DV_OUT (their dtypes) when the segment is the whole list and not ACCUMULATE, else
    as partials DK_PART, DV_PART [segment·BLOCK_S + row, BLOCK_D] for ``_sum_segments_kernel``
    (with ACCUMULATE it adds every list's to dK, dV: this epilogue loads nothing); with DQ, the
    segment's dq partial rows DQ_PART [B·TC·H·n·G, DK] (positions T0 .. T0 + TC - 1)."""
    P: tl.constexpr = BLOCK_R // G
    b, h, s, k_ok, k, v, e_hi, full_lo, full_hi, num_partial, e_lo, alone = _segment_block(
        SEG_FIRST, OFFSETS, ENTRIES, K, V, block_token_start, block_token_end, stride_kb,
        stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, T0, TC, H, NUM_GLOBAL_BLOCKS,
        NUM_LISTS, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_S, P, NUM_SELECTED, SEGMENT, SEARCH_STEPS)
    acc_k = tl.zeros([BLOCK_S, BLOCK_DK], tl.float32)
    acc_v = tl.zeros([BLOCK_S, BLOCK_DV], tl.float32)
    for i in range(0, num_partial):
        acc_k, acc_v = _block_bwd_entries(
            partial_tile(i, e_lo, full_lo, full_hi, P), e_hi, s, k_ok, k, v, acc_k, acc_v, Q,
            DO, GATE, LSE, DELTA, ENTRIES, DQ_PART, b, h, stride_qb, stride_qt, stride_qh,
            stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, T0, TC, H, scale_log2, scale, G,
            DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_R, NUM_SELECTED, IEEE, True, DQ, SMALL_SCALE)
    for e_start in range(full_lo, full_hi, P):
        acc_k, acc_v = _block_bwd_entries(
            e_start, e_hi, s, k_ok, k, v, acc_k, acc_v, Q, DO, GATE, LSE, DELTA, ENTRIES,
            DQ_PART, b, h, stride_qb, stride_qt, stride_qh, stride_ob, stride_ot, stride_oh,
            stride_lb, stride_lt, T0, TC, H, scale_log2, scale, G, DK, DV, BLOCK_DK, BLOCK_DV,
            BLOCK_R, NUM_SELECTED, IEEE, False, DQ, SMALL_SCALE)
    if alone and not ACCUMULATE:
        s64 = s.to(tl.int64)
        store_tile(DK_OUT + b * stride_dkb + s64 * stride_dkt + h * stride_dkh, acc_k * scale,
                   k_ok, DK, BLOCK_DK)
        store_tile(DV_OUT + b * stride_dvb + s64 * stride_dvt + h * stride_dvh, acc_v, k_ok, DV,
                   BLOCK_DV)
    else:
        rows = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
        tl.store(DK_PART + rows[:, None] * BLOCK_DK + tl.arange(0, BLOCK_DK)[None, :],
                 acc_k * scale)
        tl.store(DV_PART + rows[:, None] * BLOCK_DV + tl.arange(0, BLOCK_DV)[None, :], acc_v)


@triton.jit
def _sum_block_segments(PART, OUT, b, h, s, s_ok, rows, first, end, stride_b, stride_t,
                        stride_h, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_S: tl.constexpr, ROWS: tl.constexpr, ACCUMULATE: tl.constexpr):
    """OUT[b, s, h] (its dtype) = the sum of rows ``rows`` of the partials of segments
    first..end-1, in order (added to OUT when ACCUMULATE)."""
    d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for seg in range(first, end):
        acc += tl.load(PART + (rows.to(tl.int64) + seg * BLOCK_S)[:, None] * BLOCK_D + d[None, :])
    out_rows = OUT + b * stride_b + s.to(tl.int64) * stride_t + h * stride_h
    accumulate_tile(out_rows, out_rows, acc, s_ok, D, BLOCK_D, ACCUMULATE)


@kernel
def _sum_segments_kernel(
    DK_PART, DV_PART, DK, DV, block_token_start, block_token_end, SEG_FIRST,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, H, NUM_GLOBAL_BLOCKS,
    DK_DIM: tl.constexpr, DV_DIM: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, ROWS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """dK, dV [b, block tokens, h], ROWS of the block's tokens a program, = the sums of the
    block's segment partials in segment order, for the lists whose segments are not one (one
    segment writes its own rows; none: zeros). Every token is in one block of its sequence:
    every row is written. With ACCUMULATE the sums of every list with segments (one too) are
    added to dK, dV, and lists of no segment are left alone."""
    list_id = tl.program_id(0)
    first, end, single = _list_segments(SEG_FIRST, list_id)
    if ACCUMULATE:
        skip = end == first
    else:
        skip = single
    if not skip:
        pid_bh = list_id // NUM_GLOBAL_BLOCKS
        gblock = list_id % NUM_GLOBAL_BLOCKS
        b = (pid_bh // H).to(tl.int64)
        h = pid_bh % H
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        s = tl.load(block_token_start + gblock) + rows
        s_ok = s < tl.load(block_token_end + gblock)
        _sum_block_segments(DK_PART, DK, b, h, s, s_ok, rows, first, end, stride_kb,
                            stride_kt, stride_kh, DK_DIM, BLOCK_DK, BLOCK_S, ROWS, ACCUMULATE)
        _sum_block_segments(DV_PART, DV, b, h, s, s_ok, rows, first, end, stride_vb,
                            stride_vt, stride_vh, DV_DIM, BLOCK_DV, BLOCK_S, ROWS, ACCUMULATE)


@kernel
def _sum_dq_kernel(
    DQ_PART, DQ_IN, DQ_OUT, TOK_POS, stride_qb, stride_qt, stride_qh, T0, TC, H,
    G: tl.constexpr, DK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DK: tl.constexpr,
    NUM_SELECTED: tl.constexpr, SEL_BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """dq of position t's G heads = the sum of its slots' partials, in slot order (plus DQ_IN's
    rows when ACCUMULATE), stored at DQ_OUT in its dtype."""
    b, t, hq, row_ok, first, num_blocks = _position_slots(TOK_POS, T0, TC, H, G, BLOCK_G,
                                                          NUM_SELECTED, SEL_BLOCK)
    acc = tl.zeros([BLOCK_G, BLOCK_DK], tl.float32)
    for slot in range(0, num_blocks):
        acc += load_tile(DQ_PART + (first + slot * G) * DK, row_ok, DK, BLOCK_DK)
    rows = b * stride_qb + t * stride_qt + hq * stride_qh
    accumulate_tile(DQ_IN + rows, DQ_OUT + rows, acc, row_ok, DK, BLOCK_DK, ACCUMULATE)


# Launch wrappers -------------------------------------------------------------------------


def _selection_blocks(tables: KernelTables, params: NSAParams, B: int, H: int):
    """Layout-only parts of the inverse index, built once per tables: the number of global
    blocks (a host-known bound), the token range of every global block (blocks past the last
    one are empty), the list id of block 0 of each (b, position's sequence, h) [B, T, H, 1],
    and the list boundaries (0 .. lists), ids in int32 where they fit."""
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
        # List ids in int32 where they fit: the sort's radix passes are one per key byte.
        id_dtype = torch.int32 if B * H * num_global < 2**31 else torch.int64
        tables.memo[key] = (num_global, i32(block_start), i32(block_end),
                            list_first.to(id_dtype),
                            torch.arange(B * H * num_global + 1, device=device, dtype=id_dtype))
    return tables.memo[key]


class InverseIndex:
    """For each (b, h, global block), the entries of the positions that selected it, as CSR,
    cut into segments of at most ``segment`` entries."""

    def __init__(self, idx: torch.Tensor, tables: KernelTables, params: NSAParams,
                 segment: int, chunk: tuple[int, int]):
        """``idx`` [B, T, H, n]: the selection; the index is of its chunk (t0, TC): positions
        t0 .. t0 + TC - 1 (``position_chunks``)."""
        t0, TC = chunk
        B, _, H, _ = idx.shape
        num_global, self.block_start, self.block_end, list_first, boundaries = (
            _selection_blocks(tables, params, B, H))
        idx = idx[:, t0:t0 + TC]
        list_id = torch.where(idx >= 0, list_first[:, t0:t0 + TC] + idx, B * H * num_global)
        order = torch.sort(list_id.flatten(), stable=True)
        # Flat (b, t - t0, h, slot) indices, each list ascending in t; int64 past int32's
        # range.
        self.entries = order.indices if idx.numel() >= 2**31 else i32(order.indices)
        self.offsets = torch.searchsorted(order.values, boundaries, out_int32=True)
        self.num_global = num_global
        self.num_lists = self.offsets.numel() - 1
        self.seg_first = torch.empty(self.num_lists + 1, dtype=torch.int32, device=idx.device)
        _segment_starts_kernel[(1,)](self.offsets, self.seg_first, self.num_lists,
                                     SEGMENT=segment, BLOCK=1024)
        self.segment = segment
        self.num_segments = idx.numel() // segment + self.num_lists  # a host bound

    def args(self) -> tuple:
        """The kernels' index arguments, from the block token ranges to the entries."""
        return (self.block_start, self.block_end, self.seg_first, self.offsets, self.entries)

    def meta(self) -> dict:
        return dict(SEGMENT=self.segment, SEARCH_STEPS=self.num_lists.bit_length())


def block_meta(q, k, v, params) -> dict:
    """The meta-parameters every selected-branch kernel outside the masked ones takes."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    return dict(G=G, DK=Dk, DV=Dv, BLOCK_DK=pow2(Dk), BLOCK_DV=pow2(Dv),
                BLOCK_S=pow2(params.sel_block), NUM_SELECTED=params.num_selected,
                IEEE=q.dtype == torch.float32)


def block_forward(q, k, v, idx, tables, params, scale, gated: GatedSum | None = None):
    """The selected forward per key block -> (o, lse2), as ``selected.position_forward``."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    n = params.num_selected
    R, launch = launch_shape("selected_block_fwd", G, max(Dk, Dv), q.element_size())
    meta = block_meta(q, k, v, params)
    o = torch.empty(B, T, HQ, Dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, T, HQ, dtype=torch.float32, device=q.device)
    # Per chunk: partials [B, TC, H, n, G] of Dv + 1 floats, in buffers of the first (longest)
    # chunk's size that every chunk reuses.
    chunks = position_chunks(T, B * H * n * G * (Dv + 1) * 4)
    o_part = torch.empty(B * chunks[0][1] * H * n * G, Dv, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(o_part.shape[0], dtype=torch.float32, device=q.device)
    for t0, TC in chunks:
        index = InverseIndex(idx, tables, params, segment_entries(G), (t0, TC))
        _block_fwd_kernel[(index.num_segments,)](
            q, k, v, o_part, lse_part, *index.args(), *strides(q), *strides(k), *strides(v),
            t0, TC, H, index.num_global, index.num_lists, scale * LOG2E, BLOCK_R=R,
            SMALL_SCALE=small_scale(scale), **meta,
            **index.meta(), **launch,
        )
        _merge_partials_kernel[(TC, B * H)](
            o_part, lse_part, o, lse, tables.tok_pos, *strides(o), *lse.stride()[:2], T, t0,
            TC, H, scale * LOG2E, **gated_sum_args(gated, o), G=G, DV=Dv, BLOCK_G=pow2(G),
            BLOCK_DV=pow2(Dv), NUM_SELECTED=n, SEL_BLOCK=params.sel_block, num_warps=1,
        )
    return o, lse


def block_backward(q, k, v, idx, grad: BranchGrad, lse, delta, tables, params, scale, *,
                   dq=None, accumulate=True, dq_out=None):
    """dK, dV of the selected branch (per block, from the positions that selected it), in the
    dtypes of k and v. With ``dq`` (float32), also this branch's dq per block: into ``dq_out``
    (default ``dq``), added to ``dq`` when ``accumulate``."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    n = params.num_selected
    meta = block_meta(q, k, v, params)
    bs, bdk, bdv = meta["BLOCK_S"], meta["BLOCK_DK"], meta["BLOCK_DV"]
    R, launch = launch_shape("selected_dkdv", G, max(Dk, Dv), q.element_size())
    # Per chunk with dq: partials [B, TC, H, n, G] of Dk elements in q's dtype (each slot's
    # rounding is one of the kind dq's own gets), in a buffer of the first (longest) chunk's
    # size that every chunk reuses.
    chunks = position_chunks(T, 0 if dq is None else B * H * n * G * Dk * q.element_size())
    dq_part = (None if dq is None else
               torch.empty(B * chunks[0][1] * H * n * G, Dk, dtype=q.dtype, device=q.device))
    # With more than one chunk, each chunk's dK/dV is added into float32 sums (in chunk order),
    # cast at the end.
    many = len(chunks) > 1
    dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=x.device) if many else
              torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (k, v))
    for t0, TC in chunks:
        index = InverseIndex(idx, tables, params, segment_entries(G), (t0, TC))
        dk_part = torch.empty(index.num_segments * bs, bdk, dtype=torch.float32,
                              device=q.device)
        dv_part = torch.empty(index.num_segments * bs, bdv, dtype=torch.float32,
                              device=q.device)
        _block_bwd_kernel[(index.num_segments,)](
            q, k, v, grad.do, grad.gate, lse, delta, dk, dv, dk_part, dv_part,
            dk_part if dq_part is None else dq_part,  # (not read without dq)
            *index.args(), *strides(q), *strides(k), *strides(v), *strides(grad.do),
            *lse.stride()[:2], *strides(dk), *strides(dv), t0, TC, H, index.num_global,
            index.num_lists, scale * LOG2E, scale,
            BLOCK_R=R, DQ=dq is not None, ACCUMULATE=many, SMALL_SCALE=small_scale(scale),
            **meta, **index.meta(), **launch,
        )
        _sum_segments_kernel[(index.num_lists, cdiv(bs, SUM_ROWS))](
            dk_part, dv_part, dk, dv, index.block_start, index.block_end, index.seg_first,
            *strides(dk), *strides(dv), H, index.num_global, DK_DIM=Dk, DV_DIM=Dv,
            BLOCK_DK=bdk, BLOCK_DV=bdv, BLOCK_S=bs, ROWS=min(SUM_ROWS, bs), ACCUMULATE=many,
        )
        if dq is not None:
            _sum_dq_kernel[(TC, B * H)](
                dq_part, dq, dq if dq_out is None else dq_out, tables.tok_pos, *strides(q),
                t0, TC, H, G=G, DK=Dk, BLOCK_G=pow2(G), BLOCK_DK=bdk, NUM_SELECTED=n,
                SEL_BLOCK=params.sel_block, ACCUMULATE=accumulate, num_warps=1,
            )
    if many:
        return dk.to(k.dtype), dv.to(v.dtype)
    return dk, dv
