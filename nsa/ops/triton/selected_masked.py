"""The selected branch's forward, dq and dK/dV at short T: causal attention masked to each
position's selected blocks, Triton kernels then their launch wrappers.

At T = 2k with the paper's blocks (l' = 64, n = 16) a position selects up to half of the 32
blocks before it, so the branch is nearly causal attention; the per-position kernels of
``selected.py`` (one program per position and KV head, G rows) run it at ~50 TFLOP/s where
causal attention runs at ~360 (bench/NOTES.md, v14). Here a tile is P positions x heads of one
KV head's group (all G heads where G is a power of two, else G's largest power-of-two part, so
that no row is idle: ``launch.tile_heads``; the forward and dq start the last tiles first,
``common.longest_first``) and the keys are the causal range in tiles of
``BLOCK_N = min(64, l')`` tokens (fewer for wide float32 tiles: launch.wide_keys), aligned to
selection blocks: whether a row selected a tile's block is one bit of its row mask (the OR of
1 << block over its slots, ``masked_selection``, one word per (batch, position, KV head)
computed once by the op's forward, whose backward reads it again; at most 64 blocks). A
tile every valid row selected takes the plain products (keys through TMA where the layout
allows), a tile some rows selected is masked per row and multiplies finite parts only
(common.py, Masks), a tile no row selected is skipped, and the tiles on the diagonal are
masked by position too. ``masked_causal_selection`` says when this runs: fixed-length batches
whose blocks (a power of two >= 16 tokens) number at most 64 and at most 2n, so that the
union of a tile's blocks stays close to the work each position asks for.

Non-finite keys and values. A tile some rows selected meets, in its masked pairs, keys and
values those rows must not see, and 0 · NaN is NaN (common.py, Masks); multiplying only the
finite parts of each such tile, with the bookkeeping to poison the rows that do see a
non-finite value, and branching around its products, made these kernels a third slower than
one branch-free loop (bench/NOTES.md, v19). So the forward and dq read the flags of each
(batch, KV head) whose keys and values are all finite (nearly always all of them; finite.py),
and are launched twice, FINITE on and off, each running the programs of its flag and
returning at once elsewhere: with FINITE, every tile takes its row mask alone, in one
pipelined loop that also computes the tiles no row selected; without, tiles are skipped, plain
or masked as above (loaded either way: loads outside the branches are pipelined).

For head dims <= 64 in 16 bits (launch.NARROW_TUNING's ``branches``) the op's dq kernel is
the backward's one dq kernel (``masked_dq`` with ``branches``): after its own keys it runs the
compressed and window branches' (compressed_window.py's ``branch_dq_rows``) into the same
accumulator and writes dq in q's dtype, so q and do are read once and no float32 dq passes
between kernels; its flag is then that all three branches' keys and values are finite. At
m7c-125m's 8 x 2k this one kernel took 0.273 ms where the two took 0.311 (bench/NOTES.md,
fifty-fourth session); for wider tiles the compressed+window dq kernel adds them.

dK/dV runs per key tile (one program per BLOCK_N keys of a KV head, as in
``compressed_window.py``) over the positions that selected the tile's block, listed in
ascending order by one kernel from the row masks (``block_positions``: a cumulative sum per
(batch, KV head, block), no sort), P positions x G heads a tile. Only the first entries (fewer
than l', inside the block) are masked by position; every later tile takes the plain products,
with no branch and no test for non-finite values (the rows past a list's end load as padding
rows: zeros, lse = +inf). A position's rows are computed only for the blocks it selected,
where looping over every later position with the others as padding rows computed all of causal
attention's. Both loops are pipelined; rows' offsets are int32 unless an offset inside one
batch entry reaches 2^31 (``launch.wide_rows``): at m7c's 8 x 2k, 0.415 ms a layer over every later
position, 0.385 over the lists with int64 offsets and the first loop not pipelined, 0.31-0.33
now (bench/NOTES.md, forty-third and forty-fourth sessions). Each program writes its own keys'
gradients, or with small B x H a partial per segment of the list, summed in order:
deterministic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nsa.ops.params import LOG2E, NSAParams
from nsa.ops.triton.common import (
    accumulate_tile,
    attend_tile,
    dkdv_tile,
    dq_tile,
    group_program,
    key_value_tile,
    load_tile,
    longest_first,
    query_rows_tile,
    query_tile_rows,
    store_tile,
)
from nsa.ops.triton.compressed_window import (
    DqBranch,
    branch_dq_args,
    branch_dq_placeholders,
    branch_dq_rows,
)
from nsa.ops.triton.finite import launch_per_flag
from nsa.ops.triton.gating import (
    GatedSum,
    gated_sum_args,
    store_selected_rows,
    sum_in_registers,
)
from nsa.ops.triton.jit import kernel
from nsa.ops.triton.launch import (
    BranchGrad,
    cdiv,
    descriptor_pair,
    dkdv_buffers,
    dkdv_segment,
    launch_shape,
    pow2,
    query_tile_grid,
    shapes,
    small_scale,
    strides,
    sum_segments,
    wide_keys,
    wide_rows,
)
from nsa.ops.triton.tables import KernelTables

MAX_BLOCKS = 64  # blocks of a row mask (int64 bits)
MAX_TILE = 64  # most keys per step
BITS_ROWS = 128  # rows per program of masked_selection's bits
POSITIONS_CHUNK = 512  # positions per step of block_positions' kernel


def masked_causal_selection(T: int, params: NSAParams, packed: bool) -> bool:
    """Whether the selected forward and dq run as masked causal attention (module docstring):
    not ``packed``, l' a power of two >= 16, at most min(64, 2n) blocks of l' in T."""
    blocks = cdiv(T, params.sel_block)
    return (not packed and params.sel_block == pow2(params.sel_block)
            and blocks <= min(MAX_BLOCKS, 2 * params.num_selected))


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _bit_and(a, b):
    return a & b


@triton.jit
def _row_bits(BITS, b, h, t64, row_ok, stride_bb, stride_bt):
    """Per row (position t64 of batch b, KV head h), the mask of the blocks its position
    selected (``masked_selection``); 0 for padding rows."""
    return tl.load(BITS + b * stride_bb + t64 * stride_bt + h, mask=row_ok, other=0)


@triton.jit
def _tile_masks(bits, row_ok):
    """(blocks every valid row selected, blocks some valid row selected) as int64 masks, once
    per program: the key loop then tests bits of two scalars, with no reduction over the rows
    per key tile."""
    every = tl.reduce(tl.where(row_ok, bits, -1), 0, _bit_and)
    some = tl.reduce(tl.where(row_ok, bits, 0), 0, _bit_or)
    return every, some


@triton.jit
def _tile_selection(bits, every_bits, some_bits, start, SEL_BLOCK: tl.constexpr):
    """(which rows selected the block of the key tile at ``start``, whether every valid row
    did, whether any did)."""
    block = start // SEL_BLOCK
    chosen = ((bits >> block) & 1) != 0
    return chosen, ((every_bits >> block) & 1) != 0, ((some_bits >> block) & 1) != 0


@kernel
def _selection_bits_kernel(IDX, BITS, N, NUM_SELECTED: tl.constexpr, BLOCK_NSEL: tl.constexpr,
                           ROWS: tl.constexpr):
    """BITS[r] = the int64 mask of the blocks of IDX[r] (slots of -1 are unused), for ROWS of
    the N flattened (batch, position, KV head) rows of a contiguous IDX [N, NUM_SELECTED]."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    slot = tl.arange(0, BLOCK_NSEL)
    blocks = tl.load(IDX + r.to(tl.int64)[:, None] * NUM_SELECTED + slot[None, :],
                     mask=(r[:, None] < N) & (slot[None, :] < NUM_SELECTED), other=-1)
    one = tl.full([1, 1], 1, tl.int64)
    bits = tl.where(blocks >= 0, one << tl.maximum(blocks, 0).to(tl.int64), 0)
    tl.store(BITS + r, tl.reduce(bits, 1, _bit_or), mask=r < N)


@kernel
def _masked_fwd_kernel(
    Q, K, V, KD, VD, BITS, KV_FINITE, O, LSE,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_bb, stride_bt,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    T, H, scale_log2, O_CMP, O_WIN, GATES, OUT,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, TILE_G: tl.constexpr,
    BLOCK_N: tl.constexpr, SEL_BLOCK: tl.constexpr,
    IEEE: tl.constexpr, TMA: tl.constexpr, GATED: tl.constexpr, FINITE: tl.constexpr,
    SMALL_SCALE: tl.constexpr, IN_REGISTERS: tl.constexpr,
):
    """O, LSE = the selected branch's output (float32) and log-sum-exp of this tile's rows;
    with GATED (the last branch), also OUT = the gated sum of the three branches (gating.py;
    O_CMP, O_WIN and OUT have O's layout; IN_REGISTERS: gating.sum_in_registers). Runs the
    programs whose KV_FINITE flag equals FINITE (module docstring)."""
    tile, pid = longest_first()
    if (tl.load(KV_FINITE + group_program(pid, G, TILE_G)) != 0) == FINITE:
        b, h, hq, row_ok, t64, t_first, t_last = query_tile_rows(tile, pid, T, H, G, BLOCK_R,
                                                                 TILE_G)
        q = load_tile(Q + b * stride_qb + t64 * stride_qt + hq * stride_qh, row_ok, DK,
                      BLOCK_DK)
        bits = _row_bits(BITS, b, h, t64, row_ok, stride_bb, stride_bt)
        every_bits, some_bits = _tile_masks(bits, row_ok)
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
        # Tiles before the first position: causal for every row, masked by selection only.
        full_hi = (t_first + 1) // BLOCK_N * BLOCK_N
        for start in range(0, full_hi, BLOCK_N):
            chosen, every, some = _tile_selection(bits, every_bits, some_bits, start,
                                                  SEL_BLOCK)
            # Loaded whether or not a row selected the tile (pipelined; module docstring).
            k, v = key_value_tile(K, V, KD, VD, b, h, start, T, stride_kb, stride_kt,
                                  stride_kh, stride_vb, stride_vt, stride_vh, DK, DV, BLOCK_DK,
                                  BLOCK_DV, BLOCK_N, TMA)
            if FINITE:
                m, l, acc = attend_tile(q, k, v, chosen[:, None], m, l, acc, scale_log2, IEEE,
                                        False, SMALL_SCALE=SMALL_SCALE)
            elif every:
                m, l, acc = attend_tile(q, k, v, None, m, l, acc, scale_log2, IEEE, False,
                                        False, SMALL_SCALE)
            elif some:
                m, l, acc = attend_tile(q, k, v, chosen[:, None], m, l, acc, scale_log2, IEEE,
                                        True, SMALL_SCALE=SMALL_SCALE)
        # Tiles on the diagonal: masked by position as well.
        for start in range(full_hi, t_last + 1, BLOCK_N):
            chosen, every, some = _tile_selection(bits, every_bits, some_bits, start,
                                                  SEL_BLOCK)
            if some:
                k, v = key_value_tile(K, V, KD, VD, b, h, start, t_last + 1, stride_kb,
                                      stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                      DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N, False)
                s = start + tl.arange(0, BLOCK_N)
                valid = chosen[:, None] & (s[None, :] <= t64[:, None])
                m, l, acc = attend_tile(q, k, v, valid, m, l, acc, scale_log2, IEEE,
                                        not FINITE, SMALL_SCALE=SMALL_SCALE)
        store_selected_rows(O, LSE, O_CMP, O_WIN, GATES, OUT, b, t64, hq, T, H * G, m, l, acc,
                            row_ok, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
                            scale_log2, DV, BLOCK_DV, GATED, IN_REGISTERS)


@kernel
def _masked_dq_kernel(
    Q, K, V, KD, VD, BITS, KV_FINITE, DO, GATE, LSE, DELTA, DQ_IN, DQ_OUT,
    KC, VC, KCD, VCD, KW, VW, KWD, VWD, GATE_CMP, GATE_WIN, LSE_CMP, LSE_WIN, DELTA_CMP,
    DELTA_WIN, tok_pos, tok_cmp_start, CMP_FINITE, WIN_FINITE,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    stride_kwb, stride_kwt, stride_kwh, stride_vwb, stride_vwt, stride_vwh,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_bb, stride_bt,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    T, H, scale_log2, scale,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, TILE_G: tl.constexpr,
    BLOCK_N: tl.constexpr, SEL_BLOCK: tl.constexpr,
    IEEE: tl.constexpr, TMA: tl.constexpr, ACCUMULATE: tl.constexpr, FINITE: tl.constexpr,
    SMALL_SCALE: tl.constexpr, WIDE_ROWS: tl.constexpr, BRANCHES: tl.constexpr,
    CMP_KEYS: tl.constexpr = 0, WIN_KEYS: tl.constexpr = 0, WINDOW: tl.constexpr = 0,
    CMP_BLOCK: tl.constexpr = 0, CMP_STRIDE: tl.constexpr = 0, CMP_TMA: tl.constexpr = False,
    WIN_TMA: tl.constexpr = False,
):
    """DQ_OUT = scale · Σ_s gate · dS k_s over the selected keys, plus DQ_IN when ACCUMULATE;
    with BRANCHES, plus the compressed and the window branch's (KC ... WIN_FINITE, as
    compressed_window's ``_branches_dq_kernel`` reads them): q and do read once, one
    accumulator. For the programs whose flags (KV_FINITE, and with BRANCHES CMP_FINITE and
    WIN_FINITE, all [B, H] int8) say all finite if FINITE, the others if not (module
    docstring). DQ_IN and DQ_OUT have Q's layout; past the rows' first loads their positions
    are int32 unless WIDE_ROWS (``launch.wide_rows``), as in the dK/dV."""
    tile, pid = longest_first()
    pid_bh = group_program(pid, G, TILE_G)
    finite = tl.load(KV_FINITE + pid_bh) != 0
    if BRANCHES:
        finite = finite & (tl.load(CMP_FINITE + pid_bh) != 0) & (tl.load(WIN_FINITE + pid_bh) != 0)
    if finite == FINITE:
        b, h, hq, row_ok, t64, t_first, t_last = query_tile_rows(tile, pid, T, H, G, BLOCK_R,
                                                                 TILE_G)
        q, do, gate, lse, delta = query_rows_tile(
            Q, DO, GATE, LSE, DELTA, b, t64, hq, row_ok, stride_qb, stride_qt, stride_qh,
            stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, DK, DV, BLOCK_DK, BLOCK_DV)
        bits = _row_bits(BITS, b, h, t64, row_ok, stride_bb, stride_bt)
        t = t64 if WIDE_ROWS else t64.to(tl.int32)  # live through the loops
        every_bits, some_bits = _tile_masks(bits, row_ok)
        acc = tl.zeros([BLOCK_R, BLOCK_DK], tl.float32)
        full_hi = (t_first + 1) // BLOCK_N * BLOCK_N
        for start in range(0, full_hi, BLOCK_N):
            chosen, every, some = _tile_selection(bits, every_bits, some_bits, start,
                                                  SEL_BLOCK)
            k, v = key_value_tile(K, V, KD, VD, b, h, start, T, stride_kb, stride_kt,
                                  stride_kh, stride_vb, stride_vt, stride_vh, DK, DV, BLOCK_DK,
                                  BLOCK_DV, BLOCK_N, TMA)  # as in the forward
            if FINITE:
                acc = dq_tile(q, k, v, do, lse, delta, chosen[:, None], acc, scale_log2, IEEE,
                              False, SMALL_SCALE=SMALL_SCALE)
            elif every:
                acc = dq_tile(q, k, v, do, lse, delta, None, acc, scale_log2, IEEE, False,
                              False, SMALL_SCALE=SMALL_SCALE)
            elif some:
                acc = dq_tile(q, k, v, do, lse, delta, chosen[:, None], acc, scale_log2, IEEE,
                              True, SMALL_SCALE=SMALL_SCALE)
        for start in range(full_hi, t_last + 1, BLOCK_N):
            chosen, every, some = _tile_selection(bits, every_bits, some_bits, start,
                                                  SEL_BLOCK)
            if some:
                k, v = key_value_tile(K, V, KD, VD, b, h, start, t_last + 1, stride_kb,
                                      stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                      DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N, False)
                s = start + tl.arange(0, BLOCK_N)
                valid = chosen[:, None] & (s[None, :] <= t[:, None])
                acc = dq_tile(q, k, v, do, lse, delta, valid, acc, scale_log2, IEEE,
                              not FINITE, SMALL_SCALE=SMALL_SCALE)
        acc *= gate[:, None]
        if BRANCHES:  # modes 0 and 1: compressed_window's MODE_CMP and MODE_WIN
            acc = branch_dq_rows(tile, pid, q, do, acc, KC, VC, KCD, VCD, GATE_CMP, LSE_CMP,
                                 DELTA_CMP, T, H, tok_pos, tok_cmp_start, b, stride_kcb,
                                 stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                                 stride_lb, stride_lt, scale_log2, G, DK, DV, BLOCK_DK,
                                 BLOCK_DV, BLOCK_R, TILE_G, CMP_KEYS, 0, WINDOW,
                                 CMP_BLOCK, CMP_STRIDE, IEEE, CMP_TMA, not FINITE, SMALL_SCALE)
            acc = branch_dq_rows(tile, pid, q, do, acc, KW, VW, KWD, VWD, GATE_WIN, LSE_WIN,
                                 DELTA_WIN, T, H, tok_pos, tok_cmp_start, b, stride_kwb,
                                 stride_kwt, stride_kwh, stride_vwb, stride_vwt, stride_vwh,
                                 stride_lb, stride_lt, scale_log2, G, DK, DV, BLOCK_DK,
                                 BLOCK_DV, BLOCK_R, TILE_G, WIN_KEYS, 1, WINDOW,
                                 CMP_BLOCK, CMP_STRIDE, IEEE, WIN_TMA, not FINITE, SMALL_SCALE)
        rows = b * stride_qb + t * stride_qt + hq * stride_qh
        accumulate_tile(DQ_IN + rows, DQ_OUT + rows, acc * scale, row_ok, DK, BLOCK_DK,
                        ACCUMULATE)


@kernel
def _block_positions_kernel(BITS, POSITIONS, COUNTS, T, H, NUM_BLOCKS, stride_bb, stride_bt,
                            SEL_BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """POSITIONS[b·H + h, j, :COUNTS[b·H + h, j]] = the positions whose row mask holds block j
    (KV head h of batch b), ascending; one program per list, CHUNK positions a step."""
    pid_bh = tl.program_id(0)
    block = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    list_id = pid_bh * NUM_BLOCKS + block
    out = POSITIONS + list_id.to(tl.int64) * T
    count = tl.full([], 0, tl.int32)
    # A position selects only blocks that start at or before it.
    for lo in range(block * SEL_BLOCK, T, CHUNK):
        t = lo + tl.arange(0, CHUNK)
        bits = tl.load(BITS + b * stride_bb + t.to(tl.int64) * stride_bt + h, mask=t < T,
                       other=0)
        chosen = ((bits >> block) & 1).to(tl.int32)
        tl.store(out + count + tl.cumsum(chosen, 0) - 1, t, mask=chosen != 0)
        count += tl.sum(chosen, 0)
    tl.store(COUNTS + list_id, count)


@triton.jit
def _listed_rows(positions, e_start, e_end, G: tl.constexpr, BLOCK_R: tl.constexpr,
                 WIDE_ROWS: tl.constexpr):
    """The rows of entries e_start .. e_start + P - 1 (below e_end) of a block's positions
    (P = BLOCK_R // G) x the G query heads of each: (position t, row mask). t is int32, so
    that the rows' offsets inside a batch entry are too (half the registers of int64 ones),
    unless WIDE_ROWS (``wide_rows``)."""
    P: tl.constexpr = BLOCK_R // G
    r = tl.arange(0, BLOCK_R)
    e = e_start + r // G
    rows_ok = (r < P * G) & (e < e_end)
    t = tl.load(positions + e, mask=rows_ok, other=0)
    if WIDE_ROWS:
        t = t.to(tl.int64)
    return t, rows_ok


@kernel
def _masked_dkdv_kernel(
    Q, K, V, DO, GATE, LSE, DELTA, POSITIONS, COUNTS, DK_OUT, DV_OUT,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
    stride_dks, stride_dvs, T, H, NUM_BLOCKS, SEGMENT, scale_log2, scale,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    SEL_BLOCK: tl.constexpr,
    IEEE: tl.constexpr, SMALL_SCALE: tl.constexpr, WIDE_ROWS: tl.constexpr,
):
    """dK, dV of a tile of BLOCK_N keys of KV head h from the positions that selected its
    block (``block_positions``: P positions x G heads a tile), those of one segment of SEGMENT
    entries of the list (program axis 2); segments write separate partials. Program axis 0 is
    (b, h), so the first key tiles (block 0: every position's) start first."""
    P: tl.constexpr = BLOCK_R // G
    pid_bh = tl.program_id(0)
    start = tl.program_id(1) * BLOCK_N
    seg = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    block = start // SEL_BLOCK
    s = start + tl.arange(0, BLOCK_N)
    s64 = s.to(tl.int64)
    k_ok = s < T
    k = load_tile(K + b * stride_kb + s64 * stride_kt + h * stride_kh, k_ok, DK, BLOCK_DK)
    v = load_tile(V + b * stride_vb + s64 * stride_vt + h * stride_vh, k_ok, DV, BLOCK_DV)
    list_id = pid_bh * NUM_BLOCKS + block
    positions = POSITIONS + list_id.to(tl.int64) * T
    e_lo = seg * SEGMENT
    e_hi = tl.minimum(tl.load(COUNTS + list_id), e_lo + SEGMENT)
    # Entry i of the ascending list is a position >= the block's first + i, so the entries
    # from e_full on see every key of the tile (up to its last below T); those before it
    # (fewer than l', inside the block) are masked by position too.
    e_full = tl.minimum(tl.maximum(tl.minimum(start + BLOCK_N, T) - 1 - block * SEL_BLOCK,
                                   e_lo), e_hi)
    hq = h * G + tl.arange(0, BLOCK_R) % G
    acc_k = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    acc_v = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for e_start in range(e_lo, e_full, P):
        t, rows_ok = _listed_rows(positions, e_start, e_full, G, BLOCK_R, WIDE_ROWS)
        q, do, gate, lse, delta = query_rows_tile(
            Q, DO, GATE, LSE, DELTA, b, t, hq, rows_ok, stride_qb, stride_qt, stride_qh,
            stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, DK, DV, BLOCK_DK, BLOCK_DV)
        valid = rows_ok[:, None] & k_ok[None, :] & (s[None, :] <= t[:, None])
        acc_k, acc_v = dkdv_tile(q, k, v, do, gate, lse, delta, valid, acc_k, acc_v,
                                 scale_log2, IEEE, True, SMALL_SCALE=SMALL_SCALE)
    # Rows past the list's end load as padding rows (zeros, lse = +inf: p = 0).
    for e_start in range(e_full, e_hi, P):
        t, rows_ok = _listed_rows(positions, e_start, e_hi, G, BLOCK_R, WIDE_ROWS)
        q, do, gate, lse, delta = query_rows_tile(
            Q, DO, GATE, LSE, DELTA, b, t, hq, rows_ok, stride_qb, stride_qt, stride_qh,
            stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, DK, DV, BLOCK_DK, BLOCK_DV)
        acc_k, acc_v = dkdv_tile(q, k, v, do, gate, lse, delta, None, acc_k, acc_v,
                                 scale_log2, IEEE, False, False, SMALL_SCALE=SMALL_SCALE)
    dk_out = DK_OUT + seg.to(tl.int64) * stride_dks + b * stride_dkb
    dv_out = DV_OUT + seg.to(tl.int64) * stride_dvs + b * stride_dvb
    store_tile(dk_out + s64 * stride_dkt + h * stride_dkh, acc_k * scale, k_ok, DK, BLOCK_DK)
    store_tile(dv_out + s64 * stride_dvt + h * stride_dvh, acc_v, k_ok, DV, BLOCK_DV)


# Launch wrappers -------------------------------------------------------------------------


def _meta(kind: str, q, k, v, params: NSAParams) -> dict:
    """Meta-parameters and launch options of a masked kernel."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    R, launch = launch_shape(kind, G, max(Dk, Dv), q.element_size())
    return dict(G=G, DK=Dk, DV=Dv, BLOCK_DK=pow2(Dk), BLOCK_DV=pow2(Dv), BLOCK_R=R,
                BLOCK_N=min(MAX_TILE, params.sel_block,
                            wide_keys(max(Dk, Dv), q.element_size()) or MAX_TILE),
                SEL_BLOCK=params.sel_block,
                IEEE=q.dtype == torch.float32, **launch)


def _launch(kind: str, q, k, v, params: NSAParams):
    """(grid, meta-parameters and launch options, key descriptors) of the masked forward or
    dq (one program per query tile of ``launch.tile_heads`` heads of a group; each is launched
    twice, FINITE on and off, module docstring)."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    meta = _meta(kind, q, k, v, params)
    grid, meta["TILE_G"] = query_tile_grid(B, T, H, G, meta["BLOCK_R"])
    kd, vd, meta["TMA"] = descriptor_pair(k, v, [1, meta["BLOCK_N"], 1])
    return grid, meta, kd, vd


class MaskedSelection(NamedTuple):
    """What the masked kernels read of a selection: the row masks ``bits`` [B, T, H] int64,
    built once by the forward (``masked_selection``) and saved for the backward, which pairs
    them with the flags again (``selected.selected_backward``), and the flags ``kv_finite``
    [B, H] int8 of the branch's keys and values (finite.py)."""

    bits: torch.Tensor
    kv_finite: torch.Tensor


def masked_selection(idx, kv_finite) -> MaskedSelection:
    """The selection idx [B, T, H, n] as the masked kernels read it, with the [B, H] flags of
    the branch's keys and values (finite.py): ``bits`` [B, T, H] int64, per (batch, position,
    KV head) the OR of 1 << block over the blocks of its slots (-1 unused; at most MAX_BLOCKS
    blocks), one word per row where the kernels read n slots before (bench/NOTES.md, v20);
    one kernel, no host sync."""
    idx = idx.contiguous()
    bits = torch.empty(idx.shape[:3], dtype=torch.int64, device=idx.device)
    N = bits.numel()
    if N:
        _selection_bits_kernel[(cdiv(N, BITS_ROWS),)](
            idx, bits, N, NUM_SELECTED=idx.shape[-1], BLOCK_NSEL=pow2(idx.shape[-1], 1),
            ROWS=BITS_ROWS)
    return MaskedSelection(bits, kv_finite)


def masked_forward(q, k, v, selection: MaskedSelection, params: NSAParams, scale: float,
                   gated: GatedSum | None = None):
    """Selected attention of fixed-length batches as masked causal attention -> (o, lse2);
    with ``gated``, the kernel also writes gated.out = Σ g_i o_i."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    o = torch.empty(B, T, HQ, Dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, T, HQ, dtype=torch.float32, device=q.device)
    grid, meta, kd, vd = _launch("masked_fwd", q, k, v, params)
    bits, finite = selection
    launch_per_flag(
        _masked_fwd_kernel, grid,
        q, k, v, kd, vd, bits, finite, o, lse, *strides(q), *strides(k), *strides(v),
        *strides(bits, 2), *strides(o), *lse.stride()[:2], T, H, scale * LOG2E,
        **gated_sum_args(gated, o), SMALL_SCALE=small_scale(scale),
        IN_REGISTERS=sum_in_registers(meta["BLOCK_R"], Dv, meta["num_warps"]), **meta,
    )
    return o, lse


def masked_dq(q, k, v, selection: MaskedSelection, grad: BranchGrad, lse, delta, dq,
              params: NSAParams, scale: float, *, accumulate=True, dq_out=None,
              branches: tuple[DqBranch, DqBranch, KernelTables] | None = None):
    """The selected branch's dq into ``dq_out`` (default ``dq``), added to ``dq`` when
    ``accumulate``. With ``branches`` = (compressed, window, the op's tables), plus the
    compressed and window branches' dq for the same output gradient grad.do (each times its
    own gate), in the same kernel: the op's backward at short T (its one dq kernel)."""
    grid, meta, kd, vd = _launch("masked_dq", q, k, v, params)
    bits, finite = selection
    if branches is None:
        extra, extra_meta = branch_dq_placeholders(q), {}
    else:
        extra, extra_meta = branch_dq_args(q, *branches, params)
    launch_per_flag(
        _masked_dq_kernel, grid,
        q, k, v, kd, vd, bits, finite, grad.do, grad.gate, lse, delta, dq,
        dq if dq_out is None else dq_out, *extra, *strides(q), *strides(k), *strides(v),
        *strides(bits, 2), *strides(grad.do), *lse.stride()[:2], q.shape[1], k.shape[2],
        scale * LOG2E, scale, ACCUMULATE=accumulate, SMALL_SCALE=small_scale(scale),
        WIDE_ROWS=wide_rows(q), BRANCHES=branches is not None, **extra_meta, **meta,
    )


def block_positions(bits, sel_block: int):
    """The positions that selected each block, from the row masks ``bits`` [B, T, H] int64:
    (positions [B·H, blocks, T] int32, of which list (b·H + h, j) holds its first
    counts[b·H + h, j] entries, ascending; counts [B·H, blocks] int32); one kernel."""
    B, T, H = bits.shape
    blocks = cdiv(T, sel_block)
    positions = torch.empty(B * H, blocks, T, dtype=torch.int32, device=bits.device)
    counts = torch.empty(B * H, blocks, dtype=torch.int32, device=bits.device)
    if counts.numel():
        _block_positions_kernel[(B * H, blocks)](
            bits, positions, counts, T, H, blocks, *strides(bits, 2), SEL_BLOCK=sel_block,
            CHUNK=POSITIONS_CHUNK)
    return positions, counts


def masked_dkdv(q, k, v, selection: MaskedSelection, grad: BranchGrad, lse, delta,
                params: NSAParams, scale: float):
    """dK, dV of the selected branch of fixed-length batches (in the dtypes of k and v): per key
    tile, from the positions that selected its block (``block_positions``); the lists are
    split into segments where the key tiles alone would leave SMs idle (small B x H)."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    positions, counts = block_positions(selection.bits, params.sel_block)
    meta = _meta("masked_dkdv", q, k, v, params)
    tiles = cdiv(T, meta["BLOCK_N"])
    segment = dkdv_segment(T, tiles * B * H, q.device, T)
    segments = cdiv(T, segment)
    dk, dv = dkdv_buffers(k, v, segments)
    _masked_dkdv_kernel[(B * H, tiles, segments)](
        q, k, v, grad.do, grad.gate, lse, delta, positions, counts, dk, dv, *strides(q),
        *strides(k), *strides(v), *strides(grad.do), *lse.stride()[:2], *dk.stride()[1:4],
        *dv.stride()[1:4], dk.stride(0), dv.stride(0), T, H, counts.shape[1], segment,
        scale * LOG2E, scale, SMALL_SCALE=small_scale(scale),
        WIDE_ROWS=wide_rows(q, grad.do, lse), **meta,
    )
    return sum_segments(dk, dv, k, v)
