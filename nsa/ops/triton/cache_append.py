"""One decode step's keys and values appended to an NSA layer's caches in one Triton kernel.

The PyTorch form (``nsa.layers.cache.append_kv_torch``) rotates two key sets, then writes six
buffers with their index arithmetic: about twenty small kernels per layer and token, which is
what a graphed decode step of a small model pays for (bench/decode_ops.py). Here one program
per (sequence, KV head) reads its row of the K/V projection once and writes every buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops.triton.jit import kernel
from nsa.ops.triton.launch import pow2, unit_stride


@triton.jit
def _rotate_copy(OUT, SRC, cos, sin, i, mask, HALF: tl.constexpr):
    """OUT[:2·HALF] = SRC[:2·HALF] with channel pairs (i, i + HALF) rotated by (cos, sin) in
    float32, rounded to SRC's dtype (as the PyTorch form rounds its result), then to OUT's."""
    x1 = tl.load(SRC + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(SRC + HALF + i, mask=mask, other=0.0).to(tl.float32)
    # one name per line: the compiler (not the interpreter) refuses a tuple of dtypes
    src_ty = SRC.dtype.element_ty
    out_ty = OUT.dtype.element_ty
    tl.store(OUT + i, (x1 * cos - x2 * sin).to(src_ty).to(out_ty), mask=mask)
    tl.store(OUT + HALF + i, (x2 * cos + x1 * sin).to(src_ty).to(out_ty), mask=mask)


@kernel
def _append_kernel(KV, COS, SIN, POS, K, V, K_WIN, V_WIN, SRC_K, SRC_V,
                   stride_kv_b, stride_kv_set, stride_kv_h, stride_cos_b,
                   CAPACITY, WINDOW, CMP_BLOCK, H,
                   SET_SLC: tl.constexpr, SET_WIN: tl.constexpr, RING: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_DV: tl.constexpr):
    """Program (b, h): the rows of KV [B, 1, sets, H, DK + DV] (set 0: the compressor's input;
    SET_SLC, SET_WIN: the selected and window sets) at position POS[b]: K, V [B, CAPACITY, H, D]
    at the position (key rotated), K_WIN, V_WIN [B, WINDOW, H, D] at position % WINDOW (key
    rotated; RING only), SRC_K, SRC_V [B, CMP_BLOCK, H, D] at position % CMP_BLOCK (as
    projected). Caches contiguous; cos/sin [B, 1, 1, DK/2] contiguous float32."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(POS + b)
    ok = (pos >= 0) & (pos < CAPACITY)  # the caller keeps positions in range; never write past
    i = tl.arange(0, BLOCK_HALF)
    half_ok = (i < DK // 2) & ok
    j = tl.arange(0, BLOCK_DV)
    dv_ok = (j < DV) & ok
    cos = tl.load(COS + b * stride_cos_b + i, mask=half_ok, other=0.0)
    sin = tl.load(SIN + b * stride_cos_b + i, mask=half_ok, other=0.0)
    row = KV + b * stride_kv_b + h * stride_kv_h

    slc = row + SET_SLC * stride_kv_set
    at = (b * CAPACITY + pos) * H + h
    _rotate_copy(K + at * DK, slc, cos, sin, i, half_ok, DK // 2)
    tl.store(V + at * DV + j, tl.load(slc + DK + j, mask=dv_ok), mask=dv_ok)
    if RING:
        win = row + SET_WIN * stride_kv_set
        at = (b * WINDOW + pos % WINDOW) * H + h
        _rotate_copy(K_WIN + at * DK, win, cos, sin, i, half_ok, DK // 2)
        tl.store(V_WIN + at * DV + j, tl.load(win + DK + j, mask=dv_ok), mask=dv_ok)
    at = (b * CMP_BLOCK + pos % CMP_BLOCK) * H + h
    k_ok = (tl.arange(0, 2 * BLOCK_HALF) < DK) & ok
    k_at = tl.arange(0, 2 * BLOCK_HALF)
    tl.store(SRC_K + at * DK + k_at, tl.load(row + k_at, mask=k_ok), mask=k_ok)
    tl.store(SRC_V + at * DV + j, tl.load(row + DK + j, mask=dv_ok), mask=dv_ok)


def append_kv_triton(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, k_win: torch.Tensor | None,
                     v_win: torch.Tensor | None, src_k: torch.Tensor, src_v: torch.Tensor) -> None:
    """:func:`nsa.layers.cache.append_kv_torch` in one launch (same arguments; the caches must be
    contiguous and cos/sin [B, 1, 1, Dk/2] float32)."""
    B, _, sets, H, width = kv.shape
    Dk, Dv = k.shape[-1], v.shape[-1]
    ring = k_win is not None
    kv = unit_stride(kv)
    cos, sin = cos.contiguous(), sin.contiguous()
    _append_kernel[(B, H)](
        kv, cos, sin, pos, k, v, k_win if ring else k, v_win if ring else v, src_k, src_v,
        kv.stride(0), kv.stride(2), kv.stride(3), cos.stride(0),
        k.shape[1], k_win.shape[1] if ring else 1, src_k.shape[1], H,
        SET_SLC=1 if sets == 3 else 0, SET_WIN=2 if sets == 3 else 0, RING=ring,
        DK=Dk, DV=Dv, BLOCK_HALF=pow2(Dk // 2, 1), BLOCK_DV=pow2(Dv, 1), num_warps=1)
