"""The selected branch's forward and dq at short T: causal attention masked to each position's
selected blocks, Triton kernels then their launch wrappers.

At T = 2k with the paper's blocks (l' = 64, n = 16) a position selects up to half of the 32
blocks before it, so the branch is nearly causal attention; the per-position kernels of
``selected.py`` (one program per position and KV head, G rows) run it at ~50 TFLOP/s where
causal attention runs at ~360 (bench/NOTES.md, v14). Here a tile is P positions x G heads of one
KV head (as in ``compressed_window.py``) and the keys are the causal range in tiles of
``BLOCK_N = min(64, l')`` tokens, aligned to selection blocks: whether a row selected a tile's
block is one bit of its row mask (the OR of 1 << block over its slots; at most 64 blocks). A
tile every valid row selected takes the plain products (keys through TMA where the layout
allows), a tile some rows selected is masked per row and multiplies finite parts only
(common.py, Masks), a tile no row selected is skipped, and the tiles on the diagonal are
masked by position too. ``masked_causal_selection`` says when this runs: fixed-length batches
whose blocks (a power of two >= 16 tokens) number at most 64 and at most 2n, so that the
union of a tile's blocks stays close to the work each position asks for. dK/dV always runs per
block (``selected.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops.params import LOG2E, NSAParams
from nsa.ops.triton.common import (
    accumulate_tile,
    attend_tile,
    dq_tile,
    key_value_tile,
    load_tile,
)
from nsa.ops.triton.gating import GatedSum, gated_sum_args, store_selected_rows
from nsa.ops.triton.launch import (
    BranchGrad,
    descriptor_pair,
    launch_shape,
    pow2,
    shapes,
    strides,
)

MAX_BLOCKS = 64  # blocks of a row mask (int64 bits)
MAX_TILE = 64  # most keys per step


def masked_causal_selection(T: int, params: NSAParams, packed: bool) -> bool:
    """Whether the selected forward and dq run as masked causal attention (module docstring):
    not ``packed``, l' a power of two >= 16, at most min(64, 2n) blocks of l' in T."""
    blocks = triton.cdiv(T, params.sel_block)
    return (not packed and params.sel_block == pow2(params.sel_block)
            and blocks <= min(MAX_BLOCKS, 2 * params.num_selected))


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _bit_and(a, b):
    return a & b


@triton.jit
def _tile_rows(T, H, G: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's rows: P = BLOCK_R // G positions from t_first x the G query heads of KV
    head h -> (b, h, query heads hq, row mask, t (int64), t_first, t_last)."""
    P: tl.constexpr = BLOCK_R // G
    pid_bh = tl.program_id(1)
    h = pid_bh % H
    r = tl.arange(0, BLOCK_R)
    t_first = tl.program_id(0) * P
    t = t_first + r // G
    row_ok = (r < P * G) & (t < T)
    t_last = tl.minimum(t_first + P, T) - 1
    return (pid_bh // H).to(tl.int64), h, h * G + r % G, row_ok, t.to(tl.int64), t_first, t_last


@triton.jit
def _selection_bits(IDX, b, h, t64, row_ok, stride_ib, stride_it, stride_ih,
                    NUM_SELECTED: tl.constexpr, BLOCK_NSEL: tl.constexpr):
    """Per row, the int64 mask of the blocks its position selected (slots of -1 are unused)."""
    slot = tl.arange(0, BLOCK_NSEL)
    blocks = tl.load(IDX + b * stride_ib + t64[:, None] * stride_it + h * stride_ih
                     + slot[None, :], mask=row_ok[:, None] & (slot[None, :] < NUM_SELECTED),
                     other=-1)
    one = tl.full([1, 1], 1, tl.int64)
    bits = tl.where(blocks >= 0, one << tl.maximum(blocks, 0).to(tl.int64), 0)
    return tl.reduce(bits, 1, _bit_or)


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


@triton.jit
def _masked_fwd_kernel(
    Q, K, V, KD, VD, IDX, O, LSE,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ib, stride_it, stride_ih,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    T, H, scale_log2, O_CMP, O_WIN, GATES, OUT,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SELECTED: tl.constexpr, BLOCK_NSEL: tl.constexpr, SEL_BLOCK: tl.constexpr,
    IEEE: tl.constexpr, TMA: tl.constexpr, GATED: tl.constexpr,
):
    """O, LSE = the selected branch's output (float32) and log-sum-exp of this tile's rows;
    with GATED (the last branch), also OUT = the gated sum of the three branches (gating.py;
    O_CMP, O_WIN and OUT have O's layout)."""
    b, h, hq, row_ok, t64, t_first, t_last = _tile_rows(T, H, G, BLOCK_R)
    q = load_tile(Q + b * stride_qb + t64 * stride_qt + hq * stride_qh, row_ok, DK, BLOCK_DK)
    bits = _selection_bits(IDX, b, h, t64, row_ok, stride_ib, stride_it, stride_ih,
                           NUM_SELECTED, BLOCK_NSEL)
    every_bits, some_bits = _tile_masks(bits, row_ok)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    # Tiles before the first position: causal for every row, masked by selection only.
    full_hi = (t_first + 1) // BLOCK_N * BLOCK_N
    for start in range(0, full_hi, BLOCK_N):
        chosen, every, some = _tile_selection(bits, every_bits, some_bits, start, SEL_BLOCK)
        if every:
            k, v = key_value_tile(K, V, KD, VD, b, h, start, T, stride_kb, stride_kt, stride_kh,
                                  stride_vb, stride_vt, stride_vh, DK, DV, BLOCK_DK, BLOCK_DV,
                                  BLOCK_N, TMA)
            m, l, acc = attend_tile(q, k, v, None, m, l, acc, scale_log2, IEEE, False, False)
        elif some:
            k, v = key_value_tile(K, V, KD, VD, b, h, start, T, stride_kb, stride_kt, stride_kh,
                                  stride_vb, stride_vt, stride_vh, DK, DV, BLOCK_DK, BLOCK_DV,
                                  BLOCK_N, TMA)
            m, l, acc = attend_tile(q, k, v, chosen[:, None], m, l, acc, scale_log2, IEEE, True)
    # Tiles on the diagonal: masked by position as well.
    for start in range(full_hi, t_last + 1, BLOCK_N):
        chosen, every, some = _tile_selection(bits, every_bits, some_bits, start, SEL_BLOCK)
        if some:
            k, v = key_value_tile(K, V, KD, VD, b, h, start, t_last + 1, stride_kb, stride_kt,
                                  stride_kh, stride_vb, stride_vt, stride_vh, DK, DV, BLOCK_DK,
                                  BLOCK_DV, BLOCK_N, False)
            s = start + tl.arange(0, BLOCK_N)
            valid = chosen[:, None] & (s[None, :] <= t64[:, None])
            m, l, acc = attend_tile(q, k, v, valid, m, l, acc, scale_log2, IEEE, True)
    store_selected_rows(O, LSE, O_CMP, O_WIN, GATES, OUT, b, t64, hq, T, H * G, m, l, acc,
                        row_ok, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, scale_log2,
                        DV, BLOCK_DV, GATED)


@triton.jit
def _masked_dq_kernel(
    Q, K, V, KD, VD, IDX, DO, GATE, LSE, DELTA, DQ_IN, DQ_OUT,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ib, stride_it, stride_ih,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    T, H, scale_log2, scale,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SELECTED: tl.constexpr, BLOCK_NSEL: tl.constexpr, SEL_BLOCK: tl.constexpr,
    IEEE: tl.constexpr, TMA: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """DQ_OUT = scale · Σ_s dS k_s over the selected keys, plus DQ_IN when ACCUMULATE."""
    b, h, hq, row_ok, t64, t_first, t_last = _tile_rows(T, H, G, BLOCK_R)
    lse_rows = b * stride_lb + t64 * stride_lt + hq
    q = load_tile(Q + b * stride_qb + t64 * stride_qt + hq * stride_qh, row_ok, DK, BLOCK_DK)
    do = load_tile(DO + b * stride_ob + t64 * stride_ot + hq * stride_oh, row_ok, DV, BLOCK_DV)
    gate = tl.load(GATE + lse_rows, mask=row_ok, other=0.0)
    lse = tl.load(LSE + lse_rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + lse_rows, mask=row_ok, other=0.0)
    bits = _selection_bits(IDX, b, h, t64, row_ok, stride_ib, stride_it, stride_ih,
                           NUM_SELECTED, BLOCK_NSEL)
    every_bits, some_bits = _tile_masks(bits, row_ok)
    acc = tl.zeros([BLOCK_R, BLOCK_DK], tl.float32)
    full_hi = (t_first + 1) // BLOCK_N * BLOCK_N
    for start in range(0, full_hi, BLOCK_N):
        chosen, every, some = _tile_selection(bits, every_bits, some_bits, start, SEL_BLOCK)
        if every:
            k, v = key_value_tile(K, V, KD, VD, b, h, start, T, stride_kb, stride_kt, stride_kh,
                                  stride_vb, stride_vt, stride_vh, DK, DV, BLOCK_DK, BLOCK_DV,
                                  BLOCK_N, TMA)
            acc = dq_tile(q, k, v, do, lse, delta, None, acc, scale_log2, IEEE, False, False)
        elif some:
            k, v = key_value_tile(K, V, KD, VD, b, h, start, T, stride_kb, stride_kt, stride_kh,
                                  stride_vb, stride_vt, stride_vh, DK, DV, BLOCK_DK, BLOCK_DV,
                                  BLOCK_N, TMA)
            acc = dq_tile(q, k, v, do, lse, delta, chosen[:, None], acc, scale_log2, IEEE, True)
    for start in range(full_hi, t_last + 1, BLOCK_N):
        chosen, every, some = _tile_selection(bits, every_bits, some_bits, start, SEL_BLOCK)
        if some:
            k, v = key_value_tile(K, V, KD, VD, b, h, start, t_last + 1, stride_kb, stride_kt,
                                  stride_kh, stride_vb, stride_vt, stride_vh, DK, DV, BLOCK_DK,
                                  BLOCK_DV, BLOCK_N, False)
            s = start + tl.arange(0, BLOCK_N)
            valid = chosen[:, None] & (s[None, :] <= t64[:, None])
            acc = dq_tile(q, k, v, do, lse, delta, valid, acc, scale_log2, IEEE, True)
    rows = b * stride_qb + t64 * stride_qt + hq * stride_qh
    accumulate_tile(DQ_IN + rows, DQ_OUT + rows, acc * (scale * gate[:, None]), row_ok, DK,
                    BLOCK_DK, ACCUMULATE)


# Launch wrappers -------------------------------------------------------------------------


def _launch(kind: str, q, k, v, idx, params: NSAParams):
    """(grid, meta-parameters and launch options, key descriptors) of a masked kernel."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    R, launch = launch_shape(kind, G, max(Dk, Dv), q.element_size())
    block_n = min(MAX_TILE, params.sel_block)
    kd, vd, tma = descriptor_pair(k, v, [1, block_n, 1])
    meta = dict(G=G, DK=Dk, DV=Dv, BLOCK_DK=pow2(Dk), BLOCK_DV=pow2(Dv), BLOCK_R=R,
                BLOCK_N=block_n, NUM_SELECTED=idx.shape[-1],
                BLOCK_NSEL=pow2(idx.shape[-1], 1), SEL_BLOCK=params.sel_block,
                IEEE=q.dtype == torch.float32, TMA=tma, **launch)
    return (triton.cdiv(T, R // G), B * H), meta, kd, vd


def masked_forward(q, k, v, idx, params: NSAParams, scale: float,
                   gated: GatedSum | None = None):
    """Selected attention of fixed-length batches as masked causal attention -> (o, lse2);
    with ``gated``, the kernel also writes gated.out = Σ g_i o_i."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    o = torch.empty(B, T, HQ, Dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, T, HQ, dtype=torch.float32, device=q.device)
    grid, meta, kd, vd = _launch("masked_fwd", q, k, v, idx, params)
    _masked_fwd_kernel[grid](
        q, k, v, kd, vd, idx, o, lse, *strides(q), *strides(k), *strides(v), *strides(idx),
        *strides(o), *lse.stride()[:2], T, H, scale * LOG2E,
        **gated_sum_args(gated, o), **meta,
    )
    return o, lse


def masked_dq(q, k, v, idx, grad: BranchGrad, lse, delta, dq, tables, params: NSAParams,
              scale: float, *, accumulate=True, dq_out=None):
    """The selected branch's dq into ``dq_out`` (default ``dq``), added to ``dq`` when
    ``accumulate`` (``tables`` unused: the signature of selected.position_dq)."""
    grid, meta, kd, vd = _launch("masked_dq", q, k, v, idx, params)
    _masked_dq_kernel[grid](
        q, k, v, kd, vd, idx, grad.do, grad.gate, lse, delta, dq,
        dq if dq_out is None else dq_out, *strides(q), *strides(k), *strides(v), *strides(idx),
        *strides(grad.do), *lse.stride()[:2], q.shape[1], k.shape[2], scale * LOG2E, scale,
        ACCUMULATE=accumulate, **meta,
    )
