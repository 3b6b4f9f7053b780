"""Block selection: the Triton kernel, then its launch wrapper.

``_select_kernel``: one program per (tile of ``BLOCK_P`` consecutive positions of one sequence,
KV head), the last tiles (the most compressed keys) started first (``common.longest_first``).
Each step loads the compressed keys of ``BJ`` selection blocks once and, for each of
the G query heads of the group in turn, recomputes the compressed probabilities from the
compressed log-sum-exp and adds them up (the group score is a sum over heads). One loop is
software-pipelined: for large groups the head loop, the next heads' q tiles loading while this
head's products run (``HEAD_STAGES``); for one-head groups, whose head loop the compiler
removes, the step loop, the next step's compressed keys loading while this step's scores and
top-n merge run (``STEP_STAGES``). A step's
columns are ordered (token of a block, block), so the probabilities reshape to
[positions, tokens per block, BJ]; a block's score is a weighted sum of its own tokens plus
the shares of the tokens of the ``SPILL`` blocks before it, rolled along the blocks with
``tl.gather`` (exact float32 sums; the share rolling past the step is carried to the next).
Products with an overlap-weight matrix on the tensor cores did the same but spilled
registers (bench/NOTES.md v8). A running top-n per position is kept, sorted descending, as
``BEST`` keys of score bits and reversed block index (``block_keys``: larger score first, ties
to the lower index; int64 and exact for float32 inputs, int32 for 16-bit ones); each step
takes its own best ``BEST`` keys (a bitonic top-k), and the elementwise maximum of those
against the running keys reversed is a bitonic sequence holding the best of both, which one
bitonic merge sorts. No score matrix is written: memory is
linear in T.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops.params import LOG2E
from nsa.ops.triton.common import compressed_count, dot, exp_from, load_tile, longest_first
from nsa.ops.triton.jit import kernel
from nsa.ops.triton.launch import (
    TUNING,
    cdiv,
    next_pow2,
    pow2,
    shapes,
    small_scale,
    strides,
    tile_width,
)
from nsa.ops.triton.tables import tile_table

MAX_BLOCK = tl.constexpr(2**31 - 1)  # the low word of a top-n key: block ^ MAX_BLOCK (reversed)
# Most score bits an int32 top-n key gives to the block index: 12 of the float32 score's 23
# mantissa bits stay, a relative 2.4e-4, below float16's rounding (4.9e-4) and bfloat16's.
MAX_INDEX_BITS = 11


def spill_blocks(params) -> int:
    """Blocks after its own that a compressed token reaches into, at most: it covers l/d
    strides, and l'/d tokens start in each block (the prefill's and the decode step's SPILL)."""
    tokens_per_block = params.sel_block // params.cmp_stride
    cells = params.cmp_block // params.cmp_stride  # a token's length in strides
    return (tokens_per_block + cells - 2) // tokens_per_block


@triton.jit
def overlap_weights(tok_lo, blk_lo, ok, CMP_BLOCK: tl.constexpr, SEL_BLOCK: tl.constexpr):
    """The share of a compressed token in a selection block (NSA_SPEC.md, Eq. 9):
    |[tok_lo, tok_lo + l) ∩ [blk_lo, blk_lo + l')| / l, broadcast over the token starts
    ``tok_lo`` and block starts ``blk_lo``; 0 where not ``ok``."""
    both = tl.minimum(tok_lo + CMP_BLOCK, blk_lo + SEL_BLOCK) - tl.maximum(tok_lo, blk_lo)
    return tl.where(ok, tl.maximum(both, 0).to(tl.float32) / CMP_BLOCK, 0.0)


@triton.jit
def block_keys(score, block, candidate, current, NUM_INIT: tl.constexpr,
               NUM_LOCAL: tl.constexpr, INDEX_BITS: tl.constexpr = 0):
    """Top-n keys of blocks by their group ``score`` (larger score first, ties to the lower
    index): forced blocks (the first NUM_INIT, the last NUM_LOCAL up to ``current``) score
    inf; -1 where not ``candidate``. INDEX_BITS = 0: int64 ``score_bits << 32 | (block ^
    MAX_BLOCK)``, exact. INDEX_BITS > 0: int32, the score's low INDEX_BITS bits replaced by
    ``block ^ (2**INDEX_BITS - 1)`` (blocks < 2**INDEX_BITS): scores that differ in those
    bits only (a relative 2**(INDEX_BITS - 23)) tie, to the lower index."""
    forced = candidate & ((block < NUM_INIT) | (block > current - NUM_LOCAL))
    bits = tl.where(forced, float("inf"), tl.maximum(score, 0.0)).to(tl.int32, bitcast=True)
    if INDEX_BITS == 0:
        key = (bits.to(tl.int64) << 32) | (block ^ MAX_BLOCK).to(tl.int64)
    else:
        low: tl.constexpr = (1 << INDEX_BITS) - 1
        key = (bits & ~low) | (block ^ low)
    return tl.where(candidate, key, -1)


@triton.jit
def key_blocks(keys, chosen, INDEX_BITS: tl.constexpr = 0):
    """The blocks of top-n keys (``block_keys``' with the same INDEX_BITS) where ``chosen``,
    MAX_BLOCK (sorting last) elsewhere."""
    # No return inside the constexpr branches: the compiler would go on to the code after.
    if INDEX_BITS == 0:
        block = (keys & 0xFFFFFFFF).to(tl.int32) ^ MAX_BLOCK
    else:
        low: tl.constexpr = (1 << INDEX_BITS) - 1
        block = (keys & low) ^ low
    return tl.where(chosen, block, MAX_BLOCK)


@kernel
def _select_kernel(
    Q, KC, LSE, IDX, tile_start, tile_end, tile_seq_start, tile_cmp_start,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_lb, stride_lt,
    stride_ib, stride_it, stride_ih,
    H, scale_log2,
    G: tl.constexpr, DK: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_P: tl.constexpr,
    NUM_SELECTED: tl.constexpr, BEST: tl.constexpr, BJ: tl.constexpr,
    TOK_PAD: tl.constexpr, M_PAD: tl.constexpr, SPILL: tl.constexpr,
    CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr,
    NUM_INIT: tl.constexpr, NUM_LOCAL: tl.constexpr, IEEE: tl.constexpr,
    SMALL_SCALE: tl.constexpr,
    HEAD_STAGES: tl.constexpr, STEP_STAGES: tl.constexpr, INDEX_BITS: tl.constexpr,
):
    """IDX[b, t, h, :NUM_SELECTED] for the tile's positions t (ascending, -1 padded)."""
    tile, pid_bh = longest_first()
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    t0 = tl.load(tile_start + tile)
    t_end = tl.load(tile_end + tile)
    seq_start = tl.load(tile_seq_start + tile)
    cmp_start = tl.load(tile_cmp_start + tile)
    seq_len = t_end - seq_start
    num_cmp = compressed_count(seq_len, CMP_BLOCK, CMP_STRIDE)
    t = t0 + tl.arange(0, BLOCK_P)
    row_ok = t < t_end
    t64 = t.to(tl.int64)
    pos = t - seq_start
    current = pos // SEL_BLOCK  # [P] block of the query itself
    TOKENS_PER_BLOCK: tl.constexpr = SEL_BLOCK // CMP_STRIDE
    # A step's columns are (token i of a block, block c of the step), i-major: i·BJ + c.
    col = tl.arange(0, TOK_PAD)
    col_block = col % BJ
    col_token = col // BJ
    c = tl.arange(0, BJ)
    # Share of token i of a block in that block and in the k-th block after it, k ≤ SPILL.
    i = tl.arange(0, M_PAD)
    w_own = overlap_weights(i * CMP_STRIDE, 0, i < TOKENS_PER_BLOCK, CMP_BLOCK, SEL_BLOCK)
    q_rows = Q + b * stride_qb + t64 * stride_qt + h * G * stride_qh
    lse_rows = LSE + b * stride_lb + t64 * stride_lt + h * G
    carry = tl.zeros([BLOCK_P, BJ], tl.float32)
    if INDEX_BITS == 0:  # the running top-n keys, descending
        best = tl.full([BLOCK_P, BEST], -1, tl.int64)
    else:
        best = tl.full([BLOCK_P, BEST], -1, tl.int32)
    num_blocks = tl.max(tl.where(row_ok, current, -1), axis=0) + 1
    # Triton pipelines innermost loops only: the step loop where G = 1 (no head loop left),
    # its loads of the next steps' compressed keys issued STEP_STAGES - 1 steps ahead
    # (cp.async).
    for j0 in tl.range(0, num_blocks, BJ, num_stages=STEP_STAGES):
        i_loc = (j0 + col_block) * TOKENS_PER_BLOCK + col_token  # compressed index in the sequence
        k_ok = (col_token < TOKENS_PER_BLOCK) & (i_loc < num_cmp)
        kc = load_tile(KC + b * stride_kb + (cmp_start + i_loc).to(tl.int64) * stride_kt
                       + h * stride_kh, k_ok, DK, BLOCK_DK)
        p = tl.zeros([BLOCK_P, TOK_PAD], tl.float32)  # group probabilities, summed over heads
        # With HEAD_STAGES > 1 the head loop is pipelined, its loads of the next heads' q
        # tiles issued HEAD_STAGES - 1 heads ahead.
        for g in tl.range(G, num_stages=HEAD_STAGES):
            q = load_tile(q_rows + g * stride_qh, row_ok, DK, BLOCK_DK)
            lse = tl.load(lse_rows + g, mask=row_ok, other=float("inf"))
            p += exp_from(dot(q, tl.trans(kc), IEEE), lse, scale_log2,
                          SMALL_SCALE=SMALL_SCALE)
        # Invisible tokens (past a row's position or the sequence) may have summed to inf or
        # NaN: masked once per step, after the sum over heads.
        visible = k_ok[None, :] & (i_loc[None, :] * CMP_STRIDE + CMP_BLOCK - 1 <= pos[:, None])
        p = tl.where(visible, p, 0.0)
        # Block scores: each block's own tokens, then the tokens of the SPILL blocks before it
        # (rolled by k along the blocks; what rolls past the step is carried to the next).
        p3 = tl.reshape(p, [BLOCK_P, M_PAD, BJ])
        score = carry + tl.sum(p3 * w_own[None, :, None], axis=1)  # [P, BJ]
        carry = tl.zeros([BLOCK_P, BJ], tl.float32)
        for k in tl.static_range(1, SPILL + 1):
            w_k = overlap_weights(i * CMP_STRIDE, k * SEL_BLOCK, i < TOKENS_PER_BLOCK, CMP_BLOCK,
                                  SEL_BLOCK)
            spilled = tl.sum(p3 * w_k[None, :, None], axis=1)  # into block c + k
            rolled = tl.gather(spilled, tl.broadcast_to(((c + BJ - k) % BJ)[None, :],
                                                        [BLOCK_P, BJ]), axis=1)
            score += tl.where(c[None, :] >= k, rolled, 0.0)
            carry += tl.where(c[None, :] < k, rolled, 0.0)
        block = j0 + c
        candidate = (block[None, :] <= current[:, None]) & row_ok[:, None]
        key = block_keys(score, block[None, :], candidate, current[:, None], NUM_INIT,
                         NUM_LOCAL, INDEX_BITS)
        # Merge: the step's best BEST keys (descending) against the running ones reversed;
        # the elementwise maximum holds the best BEST of both as a bitonic sequence.
        if BJ > BEST:
            key = tl.topk(key, BEST)
        else:
            key = tl.sort(key, descending=True)
        best = tl.bitonic_merge(tl.maximum(best, tl.flip(key, 1)), descending=True)
    slot = tl.arange(0, BEST)
    chosen = (best >= 0) & (slot[None, :] < NUM_SELECTED)
    blocks = tl.sort(key_blocks(best, chosen, INDEX_BITS), dim=1)
    blocks = tl.where(blocks == MAX_BLOCK, -1, blocks)
    tl.store(IDX + b * stride_ib + t64[:, None] * stride_it + h * stride_ih + slot[None, :],
             blocks, mask=row_ok[:, None] & (slot[None, :] < NUM_SELECTED))


# Launch wrappers -------------------------------------------------------------------------


def loop_stages(G: int, Dk: int, element_size: int) -> tuple[int, int]:
    """(HEAD_STAGES, STEP_STAGES) of a selection launch: the head loop pipelined for large
    groups whose tiles are narrow enough to pipeline, the step loop for one-head groups."""
    tuning = TUNING["select"]
    staged = G >= tuning["staged_group"] and tile_width(Dk, element_size) <= 128
    return (tuning["num_stages"] if staged else 1), (tuning["step_stages"] if G == 1 else 1)


def select(q, k_cmp, lse_cmp, tables, params, scale):
    """[B, T, H, n] int32 selected blocks (ascending, -1 padded) from the compressed lse."""
    B, T, HQ, H, G, Dk, _ = shapes(q, k_cmp, k_cmp)
    tuning = TUNING["select"]
    P = tuning["rows"]
    num_tiles, start, end, seq_start, cmp_start = tile_table(tables, T, P)
    idx = torch.empty(B, T, H, params.num_selected, dtype=torch.int32, device=q.device)
    # Blocks per step: the top-n width, or as many as hold tuning["tokens"] compressed tokens.
    tokens_per_block = params.sel_block // params.cmp_stride
    best = max(2, next_pow2(params.num_selected))  # running top-n width
    spill = spill_blocks(params)
    blocks_per_step = max(best, next_pow2(spill + 1),
                          next_pow2(max(1, tuning["tokens"] // tokens_per_block)))
    m_pad = next_pow2(tokens_per_block)
    head_stages, step_stages = loop_stages(G, Dk, q.element_size())
    # 16-bit inputs: int32 top-n keys (half the merge's compares) where the block index takes
    # few enough of the score's bits to keep it well inside the inputs' rounding.
    index_bits = max(1, (cdiv(T, params.sel_block) - 1).bit_length())
    narrow_keys = q.element_size() == 2 and index_bits <= MAX_INDEX_BITS
    _select_kernel[(num_tiles, B * H)](
        q, k_cmp, lse_cmp, idx, start, end, seq_start, cmp_start,
        *strides(q), *strides(k_cmp), *lse_cmp.stride()[:2], *strides(idx),
        H, scale * LOG2E,
        G=G, DK=Dk, BLOCK_DK=pow2(Dk), BLOCK_P=P, NUM_SELECTED=params.num_selected, BEST=best,
        BJ=blocks_per_step, TOK_PAD=blocks_per_step * m_pad, M_PAD=m_pad, SPILL=spill,
        CMP_BLOCK=params.cmp_block,
        CMP_STRIDE=params.cmp_stride, SEL_BLOCK=params.sel_block, NUM_INIT=params.num_init,
        NUM_LOCAL=params.num_local, IEEE=q.dtype == torch.float32,
        SMALL_SCALE=small_scale(scale),
        HEAD_STAGES=head_stages, STEP_STAGES=step_stages,
        INDEX_BITS=index_bits if narrow_keys else 0,
        num_warps=tuning["num_warps"], num_stages=1,
    )
    return idx
