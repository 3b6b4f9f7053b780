"""The two NSA branches whose keys are a contiguous range per query, Triton kernels then their
launch wrappers: compressed attention (keys: the visible compressed tokens of the query's
sequence) and sliding-window attention (keys: the last ``window`` tokens of the query's
sequence).

Rows of a tile are (position, query head) pairs of one KV head: ``P = BLOCK_R // G`` consecutive
positions times the ``G`` query heads that share the KV head, so small groups still fill a
matrix tile (no padding of G). The forward and dq tiles take G's largest power-of-two part of
the heads (``launch.tile_heads``) so that no row is idle (m7c-125m's G = 6: 32 positions x 2
heads in 64 rows where 10 x 6 left 4 idle: the dq 3-5 % faster; bench/NOTES.md, fifty-first
session). Every row knows its own key range, which also handles packed
variable-length batches. Forward writes the branch output (float32) and its log-sum-exp
(base 2); backward is deterministic, no atomics: one kernel for dK/dV per branch (per key tile,
looping over the queries that can see it), and one dq kernel for both branches (per query
tile: q and do read once, one accumulator, each branch's gate multiplying its dS; it adds the
selected branch's float32 dq and writes dq in q's dtype, so the float32 sum is read once). At
short T, where the selected branch runs as masked causal attention, and for head dims <= 64 in
16 bits (launch.NARROW_TUNING's masked_dq ``branches``), the masked dq kernel runs these two
branches' key loops after its own (``branch_dq_rows``; selected_masked.py) and this one is not
launched.

Each kernel's loop runs in two parts: first the partial tiles, which hold a masked pair (the
diagonal, the window's lower edge, sequence boundaries, the ends) and multiply finite parts
only (common.py, Masks), then the full tiles, where every row sees every key, with the plain
products.

Each kernel is launched twice, FINITE on and off (finite.launch_per_flag), each running the
programs whose (batch row, KV head) flag equals FINITE and doing nothing elsewhere: the flags
say whether the keys and values (forward, dq) or the queries, output gradients and gates
(dK/dV) of a program are all finite (finite.py; nearly always all of them), and with FINITE the
partial tiles take the plain masks, with no bookkeeping of non-finite values. One kernel that
branched between the two ways at run time had its tensor-core instructions serialized by ptxas
(C7515, "non wgmma instructions defining accumulator registers of a wgmma between start and end
of the pipeline stage": each wgmma waited for the one before); the constant FINITE keeps the
fast path free of it (bench/NOTES.md, twenty-fifth session).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nsa.ops.params import LOG2E
from nsa.ops.triton.common import (
    accumulate_tile,
    attend_tile,
    compressed_count,
    dkdv_tile,
    dq_tile,
    group_program,
    key_value_tile,
    load_tile,
    partial_tile,
    query_rows_tile,
    query_tile_rows,
    split_tiles,
    store_rows,
    store_tile,
)
from nsa.ops.triton.finite import launch_per_flag
from nsa.ops.triton.jit import kernel
from nsa.ops.triton.launch import (
    BranchGrad,
    cdiv,
    descriptor_pair,
    dkdv_buffers,
    dkdv_segment,
    launch_keys,
    launch_shape,
    launch_transposed,
    pow2,
    query_tile_grid,
    shapes,
    small_scale,
    strides,
    strides_aligned,
    sum_segments,
)
from nsa.ops.triton.tables import KernelTables

CMP_SEGMENT = 4096  # most query positions one compressed-branch dK/dV program handles
MODE_CMP = 0
MODE_WIN = 1
MODE_NAMES = {MODE_CMP: "cmp", MODE_WIN: "win"}  # of the launch shapes (launch.TUNING)


@triton.jit
def _row_key_range(t, row_ok, tok_pos, tok_cmp_start,
                   MODE: tl.constexpr, WINDOW: tl.constexpr, CMP_BLOCK: tl.constexpr,
                   CMP_STRIDE: tl.constexpr):
    """Per row: the half-open key range [lo, hi) it attends to (empty for invalid rows)."""
    pos = tl.load(tok_pos + t, mask=row_ok, other=0)
    if MODE == 0:
        cstart = tl.load(tok_cmp_start + t, mask=row_ok, other=0)
        nvis = compressed_count(pos + 1, CMP_BLOCK, CMP_STRIDE)
        lo = cstart
        hi = cstart + nvis
    else:
        lo = tl.maximum(t - WINDOW + 1, t - pos)
        hi = t + 1
    lo = tl.where(row_ok, lo, 2147483647)
    hi = tl.where(row_ok, hi, 0)
    return lo, hi


@triton.jit
def _query_rows(tile, pid, T, H, tok_pos, tok_cmp_start, G: tl.constexpr,
                BLOCK_R: tl.constexpr, TILE_G: tl.constexpr, BLOCK_N: tl.constexpr,
                MODE: tl.constexpr, WINDOW: tl.constexpr, CMP_BLOCK: tl.constexpr,
                CMP_STRIDE: tl.constexpr):
    """The rows of query tile ``tile`` of program ``pid`` (P positions x TILE_G heads of KV
    head h, as in ``common.query_tile_rows``), their key ranges, and the key tiles lo,
    lo + BLOCK_N, ... (< hi) their ranges cover, split (``split_tiles``) into full ones
    (inside every valid row's range) and partial ones."""
    b, h, hq, row_ok, t64, _, _ = query_tile_rows(tile, pid, T, H, G, BLOCK_R, TILE_G)
    t = t64.to(tl.int32)
    lo_r, hi_r = _row_key_range(t, row_ok, tok_pos, tok_cmp_start, MODE, WINDOW, CMP_BLOCK,
                                CMP_STRIDE)
    lo = tl.min(lo_r, axis=0)
    hi = tl.max(hi_r, axis=0)
    full_lo, full_hi, num_partial = split_tiles(
        lo, hi, tl.max(tl.where(row_ok, lo_r, 0), axis=0),
        tl.min(tl.where(row_ok, hi_r, 2147483647), axis=0), BLOCK_N)
    return b, h, hq, row_ok, lo_r, hi_r, t64, hi, lo, full_lo, full_hi, num_partial


@triton.jit
def _key_tile(K, V, b, h, start, hi, lo_r, hi_r, stride_kb, stride_kt, stride_kh,
              stride_vb, stride_vt, stride_vh, DK: tl.constexpr, DV: tl.constexpr,
              BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys, values [BLOCK_N, D] from ``start`` (0 from hi on) and the mask of the (row, key)
    pairs inside the rows' ranges."""
    k, v = key_value_tile(K, V, K, V, b, h, start, hi, stride_kb, stride_kt, stride_kh,
                          stride_vb, stride_vt, stride_vh, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N,
                          False)
    s = start + tl.arange(0, BLOCK_N)
    valid = (s[None, :] >= lo_r[:, None]) & (s[None, :] < hi_r[:, None])
    return k, v, valid


@triton.jit
def _partial_forward(q, m, l, acc, K, V, b, h, hi, lo, full_lo, full_hi, num_partial, lo_r, hi_r,
                     stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                     scale_log2, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                     BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                     PARTIAL: tl.constexpr, SMALL_SCALE: tl.constexpr):
    """The forward's partial key tiles: with PARTIAL the non-finite bookkeeping (common.py,
    Masks), else the plain masks (the keys and values are known finite)."""
    for i in range(0, num_partial):
        k, v, valid = _key_tile(K, V, b, h, partial_tile(i, lo, full_lo, full_hi, BLOCK_N), hi,
                                lo_r, hi_r, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                stride_vh, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N)
        m, l, acc = attend_tile(q, k, v, valid, m, l, acc, scale_log2, IEEE, PARTIAL,
                                SMALL_SCALE=SMALL_SCALE)
    return m, l, acc


@triton.jit
def _partial_dq(q, do, lse, delta, acc, K, V, b, h, hi, lo, full_lo, full_hi, num_partial, lo_r,
                hi_r, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                scale_log2, gate, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                PARTIAL: tl.constexpr, SMALL_SCALE: tl.constexpr):
    """dq's partial key tiles, as ``_partial_forward``'s (dS masked either way: a row's do and
    delta may not be finite, and a row that sees no key gets no gradient), dS multiplied by
    each row's gate."""
    for i in range(0, num_partial):
        k, v, valid = _key_tile(K, V, b, h, partial_tile(i, lo, full_lo, full_hi, BLOCK_N), hi,
                                lo_r, hi_r, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                stride_vh, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N)
        acc = dq_tile(q, k, v, do, lse, delta, valid, acc, scale_log2, IEEE, PARTIAL,
                      MASK_DS=True, SMALL_SCALE=SMALL_SCALE, gate=gate)
    return acc


@triton.jit
def branch_dq_rows(tile, pid, q, do, acc, K, V, KD, VD, GATE, LSE, DELTA, T, H, tok_pos,
                   tok_cmp_start, b, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                   stride_vh, stride_lb, stride_lt, scale_log2, G: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                   BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, TILE_G: tl.constexpr,
                   BLOCK_N: tl.constexpr, MODE: tl.constexpr, WINDOW: tl.constexpr,
                   CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, IEEE: tl.constexpr,
                   TMA: tl.constexpr, PARTIAL: tl.constexpr, SMALL_SCALE: tl.constexpr):
    """acc [rows, DK] += one branch's gated Σ_s dS k_s for the rows of query tile ``tile`` of
    program ``pid`` (``_query_rows``; its partial key tiles, then its full ones)."""
    _, h, hq, row_ok, lo_r, hi_r, t64, hi, lo, full_lo, full_hi, num_partial = _query_rows(
        tile, pid, T, H, tok_pos, tok_cmp_start, G, BLOCK_R, TILE_G, BLOCK_N, MODE, WINDOW,
        CMP_BLOCK, CMP_STRIDE)
    rows = b * stride_lb + t64 * stride_lt + hq
    gate = tl.load(GATE + rows, mask=row_ok, other=0.0)
    lse = tl.load(LSE + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)
    acc = _partial_dq(q, do, lse, delta, acc, K, V, b, h, hi, lo, full_lo, full_hi, num_partial,
                      lo_r, hi_r, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                      stride_vh, scale_log2, gate, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N, IEEE,
                      PARTIAL, SMALL_SCALE)
    for start in range(full_lo, full_hi, BLOCK_N):
        k, v = key_value_tile(K, V, KD, VD, b, h, start, hi, stride_kb, stride_kt, stride_kh,
                              stride_vb, stride_vt, stride_vh, DK, DV, BLOCK_DK, BLOCK_DV,
                              BLOCK_N, TMA)
        acc = dq_tile(q, k, v, do, lse, delta, None, acc, scale_log2, IEEE, False, False,
                      SMALL_SCALE=SMALL_SCALE, gate=gate)
    return acc


@kernel
def _branch_fwd_kernel(
    Q, K, V, KD, VD, O, LSE, tok_pos, tok_cmp_start, KV_FINITE,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    T, NK, H, scale_log2,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, TILE_G: tl.constexpr,
    BLOCK_N: tl.constexpr, MODE: tl.constexpr, WINDOW: tl.constexpr, CMP_BLOCK: tl.constexpr,
    CMP_STRIDE: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, FINITE: tl.constexpr,
    SMALL_SCALE: tl.constexpr,
):
    """O, LSE = this branch's output (float32) and log-sum-exp. Runs the programs whose
    KV_FINITE flag equals FINITE (module docstring): KV_FINITE[b, h] (int8) is 1 when every key
    and value of the batch row and KV head is finite, and the partial tiles then take the
    plain masks, with no bookkeeping of non-finite values."""
    if (tl.load(KV_FINITE + group_program(tl.program_id(1), G, TILE_G)) != 0) == FINITE:
        b, h, hq, row_ok, lo_r, hi_r, t64, hi, lo, full_lo, full_hi, num_partial = _query_rows(
            tl.program_id(0), tl.program_id(1), T, H, tok_pos, tok_cmp_start, G, BLOCK_R, TILE_G,
            BLOCK_N, MODE, WINDOW, CMP_BLOCK, CMP_STRIDE)
        q = load_tile(Q + b * stride_qb + t64 * stride_qt + hq * stride_qh, row_ok, DK,
                      BLOCK_DK)
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
        m, l, acc = _partial_forward(
            q, m, l, acc, K, V, b, h, hi, lo, full_lo, full_hi, num_partial, lo_r, hi_r,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, scale_log2, DK, DV,
            BLOCK_DK, BLOCK_DV, BLOCK_N, IEEE, not FINITE, SMALL_SCALE)
        for start in range(full_lo, full_hi, BLOCK_N):
            k, v = key_value_tile(K, V, KD, VD, b, h, start, hi, stride_kb, stride_kt,
                                  stride_kh, stride_vb, stride_vt, stride_vh, DK, DV, BLOCK_DK,
                                  BLOCK_DV, BLOCK_N, TMA)
            m, l, acc = attend_tile(q, k, v, None, m, l, acc, scale_log2, IEEE, False, False,
                                    SMALL_SCALE)
        store_rows(O + b * stride_ob + t64 * stride_ot + hq * stride_oh,
                   LSE + b * stride_lb + t64 * stride_lt + hq, m, l, acc, row_ok, scale_log2, DV,
                   BLOCK_DV)


@kernel
def _branches_dq_kernel(
    Q, DO, DQ_IN, DQ_OUT,
    KC, VC, KCD, VCD, KW, VW, KWD, VWD, GATE_CMP, GATE_WIN, LSE_CMP, LSE_WIN, DELTA_CMP,
    DELTA_WIN, tok_pos, tok_cmp_start, CMP_FINITE, WIN_FINITE,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    stride_kwb, stride_kwt, stride_kwh, stride_vwb, stride_vwt, stride_vwh,
    stride_qb, stride_qt, stride_qh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    T, H, scale_log2, scale,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, TILE_G: tl.constexpr,
    CMP_KEYS: tl.constexpr, WIN_KEYS: tl.constexpr, WINDOW: tl.constexpr, CMP_BLOCK: tl.constexpr,
    CMP_STRIDE: tl.constexpr, IEEE: tl.constexpr, CMP_TMA: tl.constexpr, WIN_TMA: tl.constexpr,
    FINITE: tl.constexpr, SMALL_SCALE: tl.constexpr,
):
    """DQ_OUT = DQ_IN (the selected branch's float32 dq) + the compressed and the window
    branch's scale · Σ_s gate · p (dp − delta) k_s, in DQ_OUT's dtype (all laid out as Q): q
    and do read once, one float32 accumulator, each branch's gate multiplying its dS. Runs the
    programs where both branches' keys and values are finite (CMP_FINITE and WIN_FINITE, [B,
    H] int8) if FINITE, the others if not (module docstring): then both branches' partial
    tiles keep the bookkeeping of non-finite values."""
    tile, pid = tl.program_id(0), tl.program_id(1)
    pid_bh = group_program(pid, G, TILE_G)
    finite = (tl.load(CMP_FINITE + pid_bh) != 0) & (tl.load(WIN_FINITE + pid_bh) != 0)
    if finite == FINITE:
        b, _, hq, row_ok, t64, _, _ = query_tile_rows(tile, pid, T, H, G, BLOCK_R, TILE_G)
        q = load_tile(Q + b * stride_qb + t64 * stride_qt + hq * stride_qh, row_ok, DK,
                      BLOCK_DK)
        do = load_tile(DO + b * stride_ob + t64 * stride_ot + hq * stride_oh, row_ok, DV,
                       BLOCK_DV)
        acc = tl.zeros([BLOCK_R, BLOCK_DK], tl.float32)
        acc = branch_dq_rows(tile, pid, q, do, acc, KC, VC, KCD, VCD, GATE_CMP, LSE_CMP,
                             DELTA_CMP, T, H, tok_pos, tok_cmp_start, b, stride_kcb, stride_kct,
                             stride_kch, stride_vcb, stride_vct, stride_vch, stride_lb,
                             stride_lt, scale_log2, G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_R,
                             TILE_G, CMP_KEYS, 0, WINDOW, CMP_BLOCK, CMP_STRIDE, IEEE, CMP_TMA,
                             not FINITE, SMALL_SCALE)
        acc = branch_dq_rows(tile, pid, q, do, acc, KW, VW, KWD, VWD, GATE_WIN, LSE_WIN,
                             DELTA_WIN, T, H, tok_pos, tok_cmp_start, b, stride_kwb, stride_kwt,
                             stride_kwh, stride_vwb, stride_vwt, stride_vwh, stride_lb,
                             stride_lt, scale_log2, G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_R,
                             TILE_G, WIN_KEYS, 1, WINDOW, CMP_BLOCK, CMP_STRIDE, IEEE, WIN_TMA,
                             not FINITE, SMALL_SCALE)
        rows = b * stride_qb + t64 * stride_qt + hq * stride_qh
        accumulate_tile(DQ_IN + rows, DQ_OUT + rows, acc * scale, row_ok, DK, BLOCK_DK, True)


@triton.jit
def _query_tile(t_start, t_hi, s, k_ok, Q, DO, GATE, LSE, DELTA, tok_pos, tok_cmp_start, b, h,
                stride_qb, stride_qt, stride_qh, stride_ob, stride_ot, stride_oh, stride_lb,
                stride_lt, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr,
                MODE: tl.constexpr, WINDOW: tl.constexpr, CMP_BLOCK: tl.constexpr,
                CMP_STRIDE: tl.constexpr, TRANSPOSED: tl.constexpr):
    """q, do, gate, lse, delta of the P positions from t_start (below t_hi) x G heads, and the mask
    of their pairs with the keys s: [rows, keys], or [keys, rows] when TRANSPOSED."""
    P: tl.constexpr = BLOCK_R // G
    r = tl.arange(0, BLOCK_R)
    t = t_start + r // G
    hq = h * G + r % G
    row_ok = (r < P * G) & (t < t_hi)
    lo_r, hi_r = _row_key_range(t, row_ok, tok_pos, tok_cmp_start, MODE, WINDOW, CMP_BLOCK,
                                CMP_STRIDE)
    q, do, gate, lse, delta = query_rows_tile(
        Q, DO, GATE, LSE, DELTA, b, t.to(tl.int64), hq, row_ok, stride_qb, stride_qt,
        stride_qh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, DK, DV, BLOCK_DK,
        BLOCK_DV)
    if TRANSPOSED:
        valid = (s[:, None] >= lo_r[None, :]) & (s[:, None] < hi_r[None, :]) & k_ok[:, None]
    else:
        valid = (s[None, :] >= lo_r[:, None]) & (s[None, :] < hi_r[:, None]) & k_ok[None, :]
    return q, do, gate, lse, delta, valid


@triton.jit
def _full_query_tile(t_start, Q, DO, GATE, LSE, DELTA, b, h, stride_qb, stride_qt, stride_qh,
                     stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, G: tl.constexpr,
                     DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                     BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr):
    """q, do, gate, lse, delta of the P positions from t_start x G heads in a full query tile (each
    of them sees every key of the tile). q and do come by pointer loads: through tensor
    descriptors, Triton 3.6 pipelined them into a ring of as many buffers as tiles it loads
    ahead, and the next tile's copy landed in the buffer that dK's and dV's asynchronous
    products were still reading (bench/NOTES.md, twenty-eighth session)."""
    P: tl.constexpr = BLOCK_R // G
    r = tl.arange(0, BLOCK_R)
    t64 = (t_start + r // G).to(tl.int64)
    hq = h * G + r % G
    row_ok = r < P * G
    q = load_tile(Q + b * stride_qb + t64 * stride_qt + hq * stride_qh, row_ok, DK, BLOCK_DK)
    do = load_tile(DO + b * stride_ob + t64 * stride_ot + hq * stride_oh, row_ok, DV, BLOCK_DV)
    lse_rows = b * stride_lb + t64 * stride_lt + hq
    gate = tl.load(GATE + lse_rows, mask=row_ok, other=0.0)
    lse = tl.load(LSE + lse_rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + lse_rows, mask=row_ok, other=0.0)
    return q, do, gate, lse, delta


@triton.jit
def _partial_dkdv(k, v, s, k_ok, acc_k, acc_v, t_lo, t_hi, full_lo, full_hi, num_partial, Q, DO,
                  GATE, LSE, DELTA, tok_pos, tok_cmp_start, b, h, stride_qb, stride_qt,
                  stride_qh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, scale_log2,
                  G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, MODE: tl.constexpr,
                  WINDOW: tl.constexpr, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr,
                  IEEE: tl.constexpr, PARTIAL: tl.constexpr, TRANSPOSED: tl.constexpr,
                  SMALL_SCALE: tl.constexpr):
    """dK/dV's partial query tiles: with PARTIAL the non-finite bookkeeping of the query side
    (common.dkdv_tile), else the plain masks (q, do and the gates are known finite; dS masked:
    a row's delta may not be)."""
    P: tl.constexpr = BLOCK_R // G
    for i in range(0, num_partial):
        q, do, gate, lse, delta, valid = _query_tile(
            partial_tile(i, t_lo, full_lo, full_hi, P), t_hi, s, k_ok, Q, DO, GATE, LSE, DELTA,
            tok_pos, tok_cmp_start, b, h, stride_qb, stride_qt, stride_qh, stride_ob, stride_ot,
            stride_oh, stride_lb, stride_lt, G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_R, MODE, WINDOW,
            CMP_BLOCK, CMP_STRIDE, TRANSPOSED)
        acc_k, acc_v = dkdv_tile(q, k, v, do, gate, lse, delta, valid, acc_k, acc_v, scale_log2,
                                 IEEE, PARTIAL, MASK_DS=True, TRANSPOSED=TRANSPOSED,
                                 SMALL_SCALE=SMALL_SCALE)
    return acc_k, acc_v


@kernel
def _branch_bwd_dkdv_kernel(
    Q, K, V, DO, GATE, LSE, DELTA, DK_OUT, DV_OUT, tok_pos, tok_cmp_start, key_t_lo,
    key_t_hi, QUERY_FINITE,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
    stride_dks, stride_dvs, T, NK, H, SEGMENT, scale_log2, scale,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
    WINDOW: tl.constexpr, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr,
    IEEE: tl.constexpr, TRANSPOSED: tl.constexpr, FINITE: tl.constexpr,
    SMALL_SCALE: tl.constexpr,
):
    """dK, dV (float32) of a tile of BLOCK_N keys from the queries of one segment of SEGMENT
    positions (program axis 2) that can see them; segments write separate partials. Runs the
    programs whose QUERY_FINITE flag equals FINITE (module docstring): QUERY_FINITE[b, h]
    (int8) is 1 when the q, do and gates of every query row of KV head h are finite, and the
    partial tiles then take the plain masks (dS masked too: a row's delta may not be finite),
    with no bookkeeping of non-finite values."""
    P: tl.constexpr = BLOCK_R // G
    if (tl.load(QUERY_FINITE + tl.program_id(1)) != 0) == FINITE:
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)
        seg = tl.program_id(2)
        b = (pid_bh // H).to(tl.int64)
        h = pid_bh % H
        s = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        s64 = s.to(tl.int64)
        k_ok = s < NK
        k = load_tile(K + b * stride_kb + s64 * stride_kt + h * stride_kh, k_ok, DK,
                      BLOCK_DK)
        v = load_tile(V + b * stride_vb + s64 * stride_vt + h * stride_vh, k_ok, DV,
                      BLOCK_DV)
        # Key s is seen by the queries [key_t_lo[s], key_t_hi[s]), both bounds non-decreasing
        # in s: some key of the tile by [key_t_lo[first], key_t_hi[last]), every key (full
        # query tiles) by [key_t_lo[last], key_t_hi[first]).
        first = pid_n * BLOCK_N
        last = tl.minimum(first + BLOCK_N, NK) - 1
        t_lo = tl.maximum(tl.load(key_t_lo + first), seg * SEGMENT)
        t_hi = tl.minimum(tl.load(key_t_hi + last), seg * SEGMENT + SEGMENT)
        full_lo, full_hi, num_partial = split_tiles(t_lo, t_hi, tl.load(key_t_lo + last),
                                                    tl.load(key_t_hi + first), P)
        acc_k = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
        acc_v = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        acc_k, acc_v = _partial_dkdv(
            k, v, s, k_ok, acc_k, acc_v, t_lo, t_hi, full_lo, full_hi, num_partial, Q, DO, GATE,
            LSE, DELTA, tok_pos, tok_cmp_start, b, h, stride_qb, stride_qt, stride_qh, stride_ob,
            stride_ot, stride_oh, stride_lb, stride_lt, scale_log2, G, DK, DV, BLOCK_DK, BLOCK_DV,
            BLOCK_R, MODE, WINDOW, CMP_BLOCK, CMP_STRIDE, IEEE, not FINITE, TRANSPOSED,
            SMALL_SCALE)
        for t_start in range(full_lo, full_hi, P):
            q, do, gate, lse, delta = _full_query_tile(
                t_start, Q, DO, GATE, LSE, DELTA, b, h, stride_qb, stride_qt, stride_qh,
                stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, G, DK, DV, BLOCK_DK,
                BLOCK_DV, BLOCK_R)
            acc_k, acc_v = dkdv_tile(q, k, v, do, gate, lse, delta, None, acc_k, acc_v,
                                     scale_log2, IEEE, False, False, TRANSPOSED=TRANSPOSED,
                                     SMALL_SCALE=SMALL_SCALE)
        dk_out = DK_OUT + seg.to(tl.int64) * stride_dks + b * stride_dkb
        dv_out = DV_OUT + seg.to(tl.int64) * stride_dvs + b * stride_dvb
        store_tile(dk_out + s64 * stride_dkt + h * stride_dkh, acc_k * scale, k_ok, DK,
                   BLOCK_DK)
        store_tile(dv_out + s64 * stride_dvt + h * stride_dvh, acc_v, k_ok, DV, BLOCK_DV)


# Launch wrappers -------------------------------------------------------------------------


def branch_forward(q, k, v, tables, mode, params, scale, kv_finite):
    """Compressed (mode CMP: k, v compressed) or window (mode WIN) attention -> (o, lse2);
    ``kv_finite``: the [B, H] flags of k and v (finite.py)."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    o = torch.empty(B, T, HQ, Dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, T, HQ, dtype=torch.float32, device=q.device)
    family = f"{MODE_NAMES[mode]}_fwd"
    R, launch = launch_shape(family, G, max(Dk, Dv), q.element_size(),
                             capped=strides_aligned(q, k, v, o))
    N = launch_keys(family, max(Dk, Dv), q.element_size())
    # [B, NK, H, D] descriptors of N keys: the full key tiles load through TMA.
    kd, vd, tma = descriptor_pair(k, v, [1, N, 1])
    grid, heads = query_tile_grid(B, T, H, G, R)
    launch_per_flag(
        _branch_fwd_kernel, grid,
        q, k, v, kd, vd, o, lse, tables.tok_pos, tables.tok_cmp_start, kv_finite,
        *strides(q), *strides(k), *strides(v), *strides(o), *lse.stride()[:2],
        T, k.shape[1], H, scale * LOG2E,
        G=G, DK=Dk, DV=Dv, BLOCK_DK=pow2(Dk), BLOCK_DV=pow2(Dv), BLOCK_R=R, TILE_G=heads,
        BLOCK_N=N, MODE=mode, WINDOW=params.window, CMP_BLOCK=params.cmp_block,
        CMP_STRIDE=params.cmp_stride, IEEE=q.dtype == torch.float32, TMA=tma,
        SMALL_SCALE=small_scale(scale), **launch,
    )
    return o, lse


class DqBranch(NamedTuple):
    """What ``branches_dq`` reads of the compressed or the window branch: its keys and values
    k [B, NK, H, Dk], v [B, NK, H, Dv], the rows' gates, log-sum-exps and deltas (each [B, T,
    HQ] float32, laid out alike) and the [B, H] flags of k and v (finite.py)."""

    k: torch.Tensor
    v: torch.Tensor
    gate: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor
    kv_finite: torch.Tensor


def branch_dq_args(q, cmp: DqBranch, win: DqBranch, tables: KernelTables,
                   params) -> tuple[list, dict]:
    """(runtime arguments, constexprs) of the compressed and window branches in the kernels
    that compute their dq (``_branches_dq_kernel``, and selected_masked's masked dq at short
    T), in those kernels' order: keys, values and their descriptors, gates, log-sum-exps,
    deltas, the tables, the flags, then the keys' and values' strides."""
    Dk, Dv = cmp.k.shape[-1], cmp.v.shape[-1]
    width = max(Dk, Dv)
    cmp_keys = launch_keys("cw_dq", width, q.element_size())
    win_keys = launch_keys("cw_dq", width, q.element_size(), field="win_keys")
    # [B, NK, H, D] descriptors of a tile of keys: the full key tiles load through TMA.
    kcd, vcd, cmp_tma = descriptor_pair(cmp.k, cmp.v, [1, cmp_keys, 1])
    kwd, vwd, win_tma = descriptor_pair(win.k, win.v, [1, win_keys, 1])
    args = [cmp.k, cmp.v, kcd, vcd, win.k, win.v, kwd, vwd, cmp.gate, win.gate, cmp.lse,
            win.lse, cmp.delta, win.delta, tables.tok_pos, tables.tok_cmp_start, cmp.kv_finite,
            win.kv_finite, *strides(cmp.k), *strides(cmp.v), *strides(win.k), *strides(win.v)]
    return args, dict(CMP_KEYS=cmp_keys, WIN_KEYS=win_keys, WINDOW=params.window,
                      CMP_BLOCK=params.cmp_block, CMP_STRIDE=params.cmp_stride,
                      CMP_TMA=cmp_tma, WIN_TMA=win_tma)


def branch_dq_placeholders(q) -> list:
    """``branch_dq_args``' runtime arguments for a kernel that reads none of them (the masked
    dq without the branches): q for each of its 18 tensors, 0 for each of its 12 strides."""
    return [q] * 18 + [0] * 12


def branches_dq(q, do, cmp: DqBranch, win: DqBranch, dq_sum, dq, tables, params, scale):
    """dq (q's layout and dtype) = dq_sum (float32: the selected branch's dq) + the
    compressed and the window branch's dq for output gradient do [B, T, HQ, Dv] (each times
    its gate), in one kernel (launched per finiteness flag)."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, cmp.k, cmp.v)
    R, launch = launch_shape("cw_dq", G, max(Dk, Dv), q.element_size())
    grid, heads = query_tile_grid(B, T, H, G, R)
    args, meta = branch_dq_args(q, cmp, win, tables, params)
    launch_per_flag(
        _branches_dq_kernel, grid,
        q, do, dq_sum, dq, *args, *strides(q), *strides(do), *cmp.lse.stride()[:2], T, H,
        scale * LOG2E, scale,
        G=G, DK=Dk, DV=Dv, BLOCK_DK=pow2(Dk), BLOCK_DV=pow2(Dv), BLOCK_R=R, TILE_G=heads,
        IEEE=q.dtype == torch.float32, SMALL_SCALE=small_scale(scale), **meta, **launch,
    )


def branch_dkdv(q, k, v, grad: BranchGrad, lse, delta, tables, mode, params, scale,
                query_finite):
    """This branch's (dk, dv) in the dtypes of k and v. ``query_finite``: the [B, H] flags of
    the query side (finite.py)."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    NK = k.shape[1]
    # A compressed key is seen by every later query: split the queries into segments so the
    # first key tiles do not run alone; window keys are seen by at most w queries, and are
    # split only when there are too few key tiles to fill the GPU (short T, small B * H).
    family = f"{MODE_NAMES[mode]}_dkdv"
    N = launch_keys(family, max(Dk, Dv), q.element_size())
    segment = dkdv_segment(T, cdiv(NK, N) * B * H, q.device,
                           CMP_SEGMENT if mode == MODE_CMP else T)
    segments = cdiv(T, segment)
    dk, dv = dkdv_buffers(k, v, segments)
    if mode == MODE_CMP:
        t_lo, t_hi = tables.cmp_t_lo, tables.cmp_t_hi
    else:
        t_lo, t_hi = tables.tok_index, tables.tok_t_hi
    if NK:
        R, launch = launch_shape(family, G, max(Dk, Dv), q.element_size())
        launch_per_flag(
            _branch_bwd_dkdv_kernel, (cdiv(NK, N), B * H, segments),
            q, k, v, grad.do, grad.gate, lse, delta, dk, dv, tables.tok_pos,
            tables.tok_cmp_start, t_lo, t_hi, query_finite, *strides(q), *strides(k),
            *strides(v), *strides(grad.do), *lse.stride()[:2], *dk.stride()[1:4],
            *dv.stride()[1:4], dk.stride(0), dv.stride(0), T, NK, H, segment, scale * LOG2E,
            scale, G=G, DK=Dk, DV=Dv, BLOCK_DK=pow2(Dk), BLOCK_DV=pow2(Dv), BLOCK_R=R,
            BLOCK_N=N, MODE=mode, WINDOW=params.window, CMP_BLOCK=params.cmp_block,
            CMP_STRIDE=params.cmp_stride, IEEE=q.dtype == torch.float32,
            TRANSPOSED=launch_transposed(family, G, max(Dk, Dv), q.element_size()),
            SMALL_SCALE=small_scale(scale), **launch,
        )
    return sum_segments(dk, dv, k, v)
