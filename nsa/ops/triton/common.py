"""Pieces shared by the NSA Triton kernels: the matrix product, one online-softmax step and the
backward's recomputed probabilities.

Units of the scores. With s = scale · log2(e), a score is kept as q·k · min(s, 1) and
exponentiated as exp2(max(s, 1) · (score - max)): for s <= 1 that is the usual s · q·k and
exp2(score - max); for s > 1 the scale only multiplies differences from the row maximum, which
are <= 0, so no finite scale overflows (q·k · s would, past float32's range, while the softmax
is still defined). Log-sum-exps are in the same units: max + log2(sum) / max(s, 1).

Masks. A masked (query, key) pair still meets in the tile products, with a probability or a
score gradient of 0, and 0 · NaN is NaN: a NaN in a key or value after a query's position can
reach it in a tile both share. Taking every tile through a finiteness mask cost 42 ms of a
182 ms forward+backward at 64k (bench/NOTES.md, v5), so the kernels do not: non-finite
inputs are the PyTorch backend's contract for now (tests/ops/test_robustness.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b in float32; exact float32 products for float32 inputs (no tf32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def score_scale(scale_log2):
    """What q·k is multiplied by: min(s, 1) (see the module docstring)."""
    return tl.minimum(scale_log2, 1.0)


@triton.jit
def exp_scale(scale_log2):
    """What score differences are multiplied by before exp2: max(s, 1)."""
    return tl.maximum(scale_log2, 1.0)


@triton.jit
def masked_scores(q, k, valid, scale_log2, IEEE: tl.constexpr):
    """Scores [rows, keys] of q against k in the units above; -inf where not ``valid``."""
    return tl.where(valid, dot(q, tl.trans(k), IEEE) * score_scale(scale_log2), float("-inf"))


@triton.jit
def softmax_step(scores, m, l, acc, v, scale_log2, IEEE: tl.constexpr):
    """Fold a tile of scores (-inf where masked) and its values into (m, l, acc)."""
    c = exp_scale(scale_log2)
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m - m_safe) * c)
    p = tl.exp2((scores - m_safe[:, None]) * c)
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return m_new, l, acc


@triton.jit
def softmax_finish(m, l, acc, scale_log2):
    """(output, log-sum-exp); rows that saw no key give 0 and +inf."""
    has_keys = l > 0
    safe_l = tl.where(has_keys, l, 1.0)
    lse = m + tl.log2(safe_l) / exp_scale(scale_log2)
    return acc / safe_l[:, None], tl.where(has_keys, lse, float("inf"))


@triton.jit
def store_rows(o_rows, lse_rows, m, l, acc, row_ok, scale_log2, DV: tl.constexpr,
               BLOCK_DV: tl.constexpr):
    """Finish the online softmax; store each row's output (at ``o_rows``) and log-sum-exp."""
    out, lse = softmax_finish(m, l, acc, scale_log2)
    store_tile(o_rows, out, row_ok, DV, BLOCK_DV)
    tl.store(lse_rows, lse, mask=row_ok)


@triton.jit
def probs_and_dscores(q, k, v, do, lse, delta, valid, scale_log2, IEEE: tl.constexpr):
    """Backward of one tile: recomputed probabilities p and dS = p (dP - delta)."""
    scores = dot(q, tl.trans(k), IEEE) * score_scale(scale_log2)
    p = tl.where(valid, tl.exp2((scores - lse[:, None]) * exp_scale(scale_log2)), 0.0)
    ds = p * (dot(do, tl.trans(v), IEEE) - delta[:, None])
    return p, ds


@triton.jit
def load_tile(row_ptrs, row_ok, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """[rows, BLOCK_D] from ``row_ptrs`` (one pointer per row start); 0 where masked."""
    d = tl.arange(0, BLOCK_D)
    return tl.load(row_ptrs[:, None] + d[None, :], mask=row_ok[:, None] & (d[None, :] < D),
                   other=0.0)


@triton.jit
def store_tile(row_ptrs, value, row_ok, D: tl.constexpr, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    tl.store(row_ptrs[:, None] + d[None, :], value, mask=row_ok[:, None] & (d[None, :] < D))


@triton.jit
def add_tile(row_ptrs, value, row_ok, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tile += value (read-modify-write by the one program that owns these rows)."""
    d = tl.arange(0, BLOCK_D)
    ptrs = row_ptrs[:, None] + d[None, :]
    mask = row_ok[:, None] & (d[None, :] < D)
    tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + value, mask=mask)
