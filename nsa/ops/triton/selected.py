"""Attention over the selected blocks: Triton kernels, then their launch wrappers. At short T
(fixed-length batches of few blocks: ``masked_causal_selection``) the forward, dq and dK/dV run
as causal attention masked to each position's blocks instead (selected_masked.py).

* ``_selected_fwd_kernel`` / ``_selected_bwd_dq_kernel``: one program per (position, KV head),
  the G query heads as rows, iterating only that position's own blocks (its first
  min(n, candidates) slots: the rest are padding). The slots are ascending, so all but the
  last hold whole blocks before the position's own: those load unmasked, each as one
  tensor-descriptor (TMA) load where the layout allows; in the last, keys past the position
  load as zeros and are never multiplied in.
* ``_selected_pair_fwd_kernel`` (``position_pairs``: fixed-length batches, G <= 8): the
  forward with one program per two consecutive positions, both positions' heads as the 16
  rows one position's G would leave mostly idle, over the union of their blocks: the forced
  blocks and any other both selected load once. At m7c-125m's 16k (G = 6, random inputs)
  0.699 ms a layer against the per-position kernel's 0.823, and the graphed training step
  60.1 / 60.5 -> 59.1 / 59.4 ms (H200, bench/NOTES.md, fifty-seventh session).
* Per key block (selected_blocks.py): the dK/dV always; the forward (``per_block``) and dq
  (``dq_per_block``) too for groups of few heads, whose per-position tiles would have only G
  rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops.params import LOG2E
from nsa.ops.triton.common import (
    accumulate_tile,
    dot,
    exp_from,
    exp_scale,
    load_tile,
    masked_products,
    max_score,
    probs_and_dscores,
    softmax_step,
)
from nsa.ops.triton.gating import GatedSum, gated_sum_args, store_selected_rows
from nsa.ops.triton.jit import kernel
from nsa.ops.triton.launch import (
    TUNING,
    BranchGrad,
    cdiv,
    descriptor_pair,
    pow2,
    shapes,
    small_scale,
    strides,
    tile_width,
)
from nsa.ops.triton.selected_blocks import (
    block_backward,
    block_forward,
    block_meta,
    dq_per_block,
    per_block,
    position_program,
    slots_in_use,
)
from nsa.ops.triton.selected_masked import (
    MaskedSelection,
    masked_causal_selection,
    masked_dkdv,
    masked_dq,
    masked_forward,
    masked_selection,
)


@triton.jit
def _position_rows(Q, TOK_POS, stride_qb, stride_qt, stride_qh, H, G: tl.constexpr,
                   DK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DK: tl.constexpr,
                   NUM_SELECTED: tl.constexpr, SEL_BLOCK: tl.constexpr):
    """``position_program`` with its rows' q: (b, h, t, its sequence's start, query heads hq
    [BLOCK_G], row mask, q [BLOCK_G, BLOCK_DK], number of selected blocks min(n,
    candidates))."""
    b, h, t, pos, g, num_blocks = position_program(TOK_POS, H, BLOCK_G, NUM_SELECTED, SEL_BLOCK)
    row_ok = g < G
    hq = h * G + g
    q = load_tile(Q + b * stride_qb + t * stride_qt + hq * stride_qh, row_ok, DK, BLOCK_DK)
    return b, h, t, t - pos, hq, row_ok, q, num_blocks


@triton.jit
def _block_keys(K, V, KD, VD, b, h, start, last, stride_kb, stride_kt, stride_kh, stride_vb,
                stride_vt, stride_vh, DK: tl.constexpr, DV: tl.constexpr,
                BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
                BLOCK_S: tl.constexpr, TMA: tl.constexpr, WHOLE: tl.constexpr):
    """Keys, values [BLOCK_S, D] of the selection block whose first token is ``start``, and
    the mask of its tokens. ``WHOLE``: every token is <= ``last``; with ``TMA`` it is one
    tensor-descriptor load (KD, VD: [B, T, H, D] descriptors; BLOCK_S == SEL_BLOCK).
    Otherwise tokens past ``last`` load as 0, so nothing beyond it is multiplied in."""
    offs = tl.arange(0, BLOCK_S)
    s = start + offs
    k_ok = offs < SEL_BLOCK
    if not WHOLE:
        k_ok = k_ok & (s <= last)
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
def _selected_block(K, V, KD, VD, IDX, b, h, t, seq_start, slot, stride_kb, stride_kt,
                    stride_kh, stride_vb, stride_vt, stride_vh, stride_ib, stride_it, stride_ih,
                    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                    BLOCK_DV: tl.constexpr, SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
                    TMA: tl.constexpr, WHOLE: tl.constexpr):
    """``_block_keys`` of the block in ``slot`` of position t (``WHOLE``: a block before the
    last slot's, so every token is <= t; the last slot's may hold t)."""
    block = tl.load(IDX + b * stride_ib + t * stride_it + h * stride_ih + slot)
    return _block_keys(K, V, KD, VD, b, h, seq_start + block * SEL_BLOCK, t, stride_kb,
                       stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, DK, DV, BLOCK_DK,
                       BLOCK_DV, SEL_BLOCK, BLOCK_S, TMA, WHOLE)


@kernel
def _selected_fwd_kernel(
    Q, K, V, KD, VD, IDX, O, LSE, TOK_POS,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ib, stride_it, stride_ih,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    T, H, scale_log2, O_CMP, O_WIN, GATES, OUT,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SELECTED: tl.constexpr,
    SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr,
    GATED: tl.constexpr, SMALL_SCALE: tl.constexpr,
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
        m, l, acc = softmax_step(qk, m, l, acc, v, scale_log2, IEEE, SMALL_SCALE)
    k, v, k_ok = _selected_block(K, V, KD, VD, IDX, b, h, t, seq_start, num_blocks - 1,
                                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                 stride_vh, stride_ib, stride_it, stride_ih, DK, DV, BLOCK_DK,
                                 BLOCK_DV, SEL_BLOCK, BLOCK_S, TMA, False)
    qk = masked_products(q, k, k_ok[None, :], IEEE)
    m, l, acc = softmax_step(qk, m, l, acc, v, scale_log2, IEEE, SMALL_SCALE)
    store_selected_rows(O, LSE, O_CMP, O_WIN, GATES, OUT, b, t, hq, T, H * G, m, l, acc, row_ok,
                        stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, scale_log2, DV,
                        BLOCK_DV, GATED)


NO_BLOCK = tl.constexpr(2**30)  # an unused slot of _pair_slots (above every block index)


@triton.jit
def _pair_slots(IDX, b, h, t0, T, stride_ib, stride_it, stride_ih,
                NUM_SELECTED: tl.constexpr, SEL_BLOCK: tl.constexpr, BLOCK_NSEL: tl.constexpr):
    """The blocks of positions t0 and t0 + 1 (fixed-length batches): (t0's slots, t0 + 1's
    slots [BLOCK_NSEL], unused ones NO_BLOCK; the union of both, ascending [2 BLOCK_NSEL],
    NO_BLOCK after its ``count`` entries; count)."""
    slot = tl.arange(0, BLOCK_NSEL)
    first = IDX + b * stride_ib + t0 * stride_it + h * stride_ih
    n0 = slots_in_use(t0, NUM_SELECTED, SEL_BLOCK)
    n1 = tl.where(t0 + 1 < T, slots_in_use(t0 + 1, NUM_SELECTED, SEL_BLOCK), 0)
    blocks0 = tl.load(first + slot, mask=slot < n0, other=NO_BLOCK).to(tl.int32)
    blocks1 = tl.load(first + stride_it + slot, mask=slot < n1, other=NO_BLOCK).to(tl.int32)
    shared = tl.sum((blocks1[:, None] == blocks0[None, :]).to(tl.int32), axis=1) != 0
    only1 = tl.where(shared, NO_BLOCK, blocks1)
    union = tl.sort(tl.reshape(tl.join(blocks0, only1), [2 * BLOCK_NSEL]))
    return blocks0, blocks1, union, tl.sum((union != NO_BLOCK).to(tl.int32), axis=0)


@triton.jit
def _chosen_rows(blocks0, blocks1, block, second):
    """Per row, whether its position (t0, or t0 + 1 where ``second``) selected ``block``."""
    chosen0 = tl.max((blocks0 == block).to(tl.int32), axis=0) != 0
    chosen1 = tl.max((blocks1 == block).to(tl.int32), axis=0) != 0
    return tl.where(second, chosen1, chosen0)


@kernel
def _selected_pair_fwd_kernel(
    Q, K, V, KD, VD, IDX, O, LSE,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ib, stride_it, stride_ih,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    T, H, scale_log2, O_CMP, O_WIN, GATES, OUT,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SELECTED: tl.constexpr,
    BLOCK_NSEL: tl.constexpr, SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
    IEEE: tl.constexpr, TMA: tl.constexpr, GATED: tl.constexpr, SMALL_SCALE: tl.constexpr,
):
    """``_selected_fwd_kernel`` for positions t0 = 2 program_id(0) and t0 + 1 of a fixed-length
    batch: rows 0 .. G - 1 are t0's query heads, G .. 2G - 1 those of t0 + 1 (2G <= BLOCK_G),
    over the union of their blocks (``position_pairs``)."""
    t0 = tl.program_id(0).to(tl.int64) * 2
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    r = tl.arange(0, BLOCK_G)
    second = r >= G
    t = t0 + second.to(tl.int64)
    row_ok = (r < 2 * G) & (t < T)
    hq = h * G + r % G
    q = load_tile(Q + b * stride_qb + t * stride_qt + hq * stride_qh, row_ok, DK, BLOCK_DK)
    blocks0, blocks1, union, count = _pair_slots(IDX, b, h, t0, T, stride_ib, stride_it,
                                                 stride_ih, NUM_SELECTED, SEL_BLOCK,
                                                 BLOCK_NSEL)
    entry = tl.arange(0, 2 * BLOCK_NSEL)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    # Every block but the union's last is whole for the rows that selected it (it ends before
    # t0's block, or t0 is its last token). A row that did not select a block keeps its state:
    # the block's products are computed for all rows, and a value it must not see (NaN, inf)
    # never reaches it.
    for i in range(0, count - 1):
        block = tl.sum(tl.where(entry == i, union, 0), axis=0)
        k, v, k_ok = _block_keys(K, V, KD, VD, b, h, block * SEL_BLOCK, t0, stride_kb,
                                 stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, DK, DV,
                                 BLOCK_DK, BLOCK_DV, SEL_BLOCK, BLOCK_S, TMA, True)
        qk = masked_products(q, k, k_ok[None, :], IEEE, BLOCK_S != SEL_BLOCK)
        m_new, l_new, acc_new = softmax_step(qk, m, l, acc, v, scale_log2, IEEE, SMALL_SCALE)
        chosen = _chosen_rows(blocks0, blocks1, block, second)
        m = tl.where(chosen, m_new, m)
        l = tl.where(chosen, l_new, l)
        acc = tl.where(chosen[:, None], acc_new, acc)
    # The last block holds t0 + 1 (or t0 at the batch's end) and may hold t0: masked by
    # position, and t0's rows take its values with t0 + 1's zeroed (not multiplied by p = 0).
    block = tl.sum(tl.where(entry == count - 1, union, 0), axis=0)
    k, v, k_ok = _block_keys(K, V, KD, VD, b, h, block * SEL_BLOCK, tl.minimum(t0 + 1, T - 1),
                             stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                             DK, DV, BLOCK_DK, BLOCK_DV, SEL_BLOCK, BLOCK_S, TMA, False)
    s = block * SEL_BLOCK + tl.arange(0, BLOCK_S)
    chosen = _chosen_rows(blocks0, blocks1, block, second)
    qk = masked_products(q, k, k_ok[None, :] & (s[None, :] <= t[:, None]), IEEE)
    m_new = tl.maximum(m, max_score(qk, scale_log2))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m - m_safe) * exp_scale(scale_log2, SMALL_SCALE))
    p = exp_from(qk, m_safe, scale_log2, SMALL_SCALE=SMALL_SCALE)
    v0 = tl.where((s <= t0)[:, None], v, 0.0).to(v.dtype)
    pv = tl.where(second[:, None], dot(p.to(v.dtype), v, IEEE), dot(p.to(v.dtype), v0, IEEE))
    m = tl.where(chosen, m_new, m)
    l = tl.where(chosen, l * alpha + tl.sum(p, axis=1), l)
    acc = tl.where(chosen[:, None], acc * alpha[:, None] + pv, acc)
    store_selected_rows(O, LSE, O_CMP, O_WIN, GATES, OUT, b, t, hq, T, H * G, m, l, acc, row_ok,
                        stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, scale_log2, DV,
                        BLOCK_DV, GATED)


@kernel
def _selected_bwd_dq_kernel(
    Q, K, V, KD, VD, IDX, DO, GATE, LSE, DELTA, DQ_IN, DQ_OUT, TOK_POS,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ib, stride_it, stride_ih,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    H, scale_log2, scale,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SELECTED: tl.constexpr,
    SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
    TMA: tl.constexpr, ACCUMULATE: tl.constexpr, SMALL_SCALE: tl.constexpr,
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
                                  scale_log2, IEEE, SMALL_SCALE=SMALL_SCALE)
        acc += dot(ds.to(k.dtype), k, IEEE)
    k, v, k_ok = _selected_block(K, V, KD, VD, IDX, b, h, t, seq_start, num_blocks - 1,
                                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                 stride_vh, stride_ib, stride_it, stride_ih, DK, DV, BLOCK_DK,
                                 BLOCK_DV, SEL_BLOCK, BLOCK_S, TMA, False)
    p, ds = probs_and_dscores(q, k, v, do, lse, delta, row_ok[:, None] & k_ok[None, :],
                              scale_log2, IEEE, SMALL_SCALE=SMALL_SCALE)
    acc += dot(ds.to(k.dtype), k, IEEE)
    rows = b * stride_qb + t * stride_qt + hq * stride_qh
    accumulate_tile(DQ_IN + rows, DQ_OUT + rows, acc * (scale * gate[:, None]), row_ok, DK,
                    BLOCK_DK, ACCUMULATE)


# Launch wrappers -------------------------------------------------------------------------


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
    return dict(block_meta(q, k, v, params), BLOCK_G=pow2(G), SEL_BLOCK=params.sel_block,
                num_warps=warps, num_stages=stages)


def selected_forward(q, k, v, idx, tables, params, scale, kv_finite,
                     gated: GatedSum | None = None):
    """Attention over each position's selected blocks -> (o, lse2, selection): masked causal
    attention where ``masked_causal_selection`` says so (selected_masked.py; ``kv_finite``:
    the [B, H] flags of k and v, finite.py), else per key block for small groups
    (``per_block``), else per position. ``selection`` is the selection as the backward reads
    it (``selected_backward``): the masked kernels' row masks [B, T, H] int64 where they ran,
    so that the backward does not build them again, else idx. With ``gated`` (the branch runs
    last), the kernel also writes gated.out = Σ g_i o_i."""
    if masked_causal_selection(q.shape[1], params, tables.packed):
        selection = masked_selection(idx, kv_finite)
        return (*masked_forward(q, k, v, selection, params, scale, gated), selection.bits)
    G = q.shape[2] // k.shape[2]
    if per_block(G):
        return (*block_forward(q, k, v, idx, tables, params, scale, gated), idx)
    if position_pairs(G, tables.packed):
        return (*pair_forward(q, k, v, idx, params, scale, gated), idx)
    return (*position_forward(q, k, v, idx, tables, params, scale, gated), idx)


def position_pairs(G: int, packed: bool) -> bool:
    """Whether the selected forward takes two consecutive positions a program
    (``_selected_pair_fwd_kernel``): fixed-length batches whose groups of G heads fit twice in
    the 16 rows a per-position program has (G <= 8), up to ``TUNING["selected_pair_fwd"]
    ["max_group"]``. Its keys and values are those of the union of the two positions'
    blocks, where two programs load each position's own: the forced blocks and any others
    both selected load once for twice the rows."""
    return not packed and 2 * G <= pow2(G) and G <= TUNING["selected_pair_fwd"]["max_group"]


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
        SMALL_SCALE=small_scale(scale),
        **_selected_launch("fwd", q, k, v, params),
    )
    return o, lse


def pair_forward(q, k, v, idx, params, scale, gated: GatedSum | None = None):
    """The selected forward of a fixed-length batch with one program per two consecutive
    positions and KV head (``position_pairs``) -> (o, lse2)."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    o = torch.empty(B, T, HQ, Dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, T, HQ, dtype=torch.float32, device=q.device)
    kd, vd, tma = _block_descriptors(k, v, params)
    _selected_pair_fwd_kernel[(cdiv(T, 2), B * H)](
        q, k, v, kd, vd, idx, o, lse, *strides(q), *strides(k), *strides(v), *strides(idx),
        *strides(o), *lse.stride()[:2], T, H, scale * LOG2E, TMA=tma,
        **gated_sum_args(gated, o), SMALL_SCALE=small_scale(scale),
        BLOCK_NSEL=pow2(params.num_selected, 2), **_selected_launch("pair_fwd", q, k, v, params),
    )
    return o, lse


def selected_backward(q, k, v, selection, grad: BranchGrad, lse, delta, dq, tables, params,
                      scale, kv_finite, *, accumulate=True, dq_out=None):
    """This branch's dq goes into ``dq_out`` (default: ``dq``, float32), added to ``dq`` when
    ``accumulate``; returns (dk, dv) in the dtypes of k and v. ``selection``: the forward's
    (row masks or idx, ``selected_forward``); ``kv_finite`` as in the forward."""
    if masked_causal_selection(q.shape[1], params, tables.packed):
        masked = MaskedSelection(selection, kv_finite)
        masked_dq(q, k, v, masked, grad, lse, delta, dq, params, scale, accumulate=accumulate,
                  dq_out=dq_out)
        return masked_dkdv(q, k, v, masked, grad, lse, delta, params, scale)
    if dq_per_block(q.shape[2] // k.shape[2]):
        return block_backward(q, k, v, selection, grad, lse, delta, tables, params, scale, dq=dq,
                              accumulate=accumulate, dq_out=dq_out)
    position_dq(q, k, v, selection, grad, lse, delta, dq, tables, params, scale,
                accumulate=accumulate, dq_out=dq_out)
    return block_backward(q, k, v, selection, grad, lse, delta, tables, params, scale)


def position_dq(q, k, v, idx, grad: BranchGrad, lse, delta, dq, tables, params, scale, *,
                accumulate=True, dq_out=None):
    """The selected dq with one program per (position, KV head)."""
    B, T, HQ, H, G, Dk, Dv = shapes(q, k, v)
    kd, vd, tma = _block_descriptors(k, v, params)
    _selected_bwd_dq_kernel[(T, B * H)](
        q, k, v, kd, vd, idx, grad.do, grad.gate, lse, delta, dq,
        dq if dq_out is None else dq_out, tables.tok_pos, *strides(q), *strides(k), *strides(v),
        *strides(idx), *strides(grad.do), *lse.stride()[:2], H, scale * LOG2E, scale,
        TMA=tma, ACCUMULATE=accumulate, SMALL_SCALE=small_scale(scale),
        **_selected_launch("dq", q, k, v, params),
    )
