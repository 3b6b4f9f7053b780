"""Pieces shared by the NSA Triton kernels: the matrix product, one online-softmax step and the
backward's recomputed probabilities."""

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
def softmax_step(scores, m, l, acc, v, IEEE: tl.constexpr):
    """Fold a tile of base-2 scores (-inf where masked) and its values into (m, l, acc)."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return m_new, l, acc


@triton.jit
def softmax_finish(m, l, acc):
    """(output, base-2 log-sum-exp); rows that saw no key give 0 and +inf."""
    has_keys = l > 0
    safe_l = tl.where(has_keys, l, 1.0)
    return acc / safe_l[:, None], tl.where(has_keys, m + tl.log2(safe_l), float("inf"))


@triton.jit
def probs_and_dscores(q, k, v, do, lse, delta, valid, scale_log2, IEEE: tl.constexpr):
    """Backward of one tile: recomputed probabilities p and dS = p (dP - delta)."""
    p = tl.where(valid, tl.exp2(dot(q, tl.trans(k), IEEE) * scale_log2 - lse[:, None]), 0.0)
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
