"""Public functional API: ``nsa_attention`` and ``nsa_select`` (see ``NSA_SPEC.md``)."""

from __future__ import annotations

import torch

from nsa.ops.params import (
    LOG2E,
    NSAParams,
    check_attention_inputs,
    check_backend,
    check_select_inputs,
)
from nsa.ops.torch_backend import _compute_dtype, nsa_attention_torch, nsa_select_torch
from nsa.ops.triton_support import (
    TRITON_AVAILABLE,
    TRITON_DTYPES,
    TRITON_INTERPRET,
    TRITON_MISSING_REASON,
    triton_takes,
)

# Largest block parameters the Triton kernels take: a selection block is one tile of keys,
# and the selection kernel scores pow2(num_selected) blocks (of sel_block / cmp_stride
# compressed tokens) per step.
TRITON_MAX_SEL_BLOCK = 256
TRITON_MAX_SCORED_TOKENS = 1024


def triton_limits_problem(params: NSAParams | None) -> str | None:
    """Why ``params`` exceed the Triton kernels' tile sizes, or None."""
    if params is None:
        return None
    if params.sel_block > TRITON_MAX_SEL_BLOCK:
        return f"sel_block <= {TRITON_MAX_SEL_BLOCK}, got sel_block={params.sel_block}"
    scored = 1 << (params.num_selected - 1).bit_length()  # next power of two
    if scored * params.sel_block // params.cmp_stride > TRITON_MAX_SCORED_TOKENS:
        return (f"next_pow2(num_selected) * sel_block / cmp_stride <= "
                f"{TRITON_MAX_SCORED_TOKENS}, got num_selected={params.num_selected}, "
                f"sel_block={params.sel_block}, cmp_stride={params.cmp_stride}")
    return None


def _resolve_backend(backend: str, q: torch.Tensor, params: NSAParams | None = None) -> str:
    """"auto": Triton for CUDA tensors (when Triton is installed and the block parameters fit
    its kernels), PyTorch otherwise."""
    check_backend(backend)
    if backend == "auto":
        fits = triton_limits_problem(params) is None
        return "triton" if triton_takes(q) and fits else "torch"
    if backend == "triton":
        problem = triton_limits_problem(params)
        if problem is not None:
            raise ValueError(f"backend='triton' needs {problem}")
        if not TRITON_AVAILABLE:
            raise ValueError(f"backend='triton' needs Triton: {TRITON_MISSING_REASON}")
        if not (q.is_cuda or q.is_meta or TRITON_INTERPRET):  # meta: shapes only (call_op)
            raise ValueError("backend='triton' needs CUDA or meta tensors (or "
                             f"TRITON_INTERPRET=1), got q on {q.device}")
        if q.dtype not in TRITON_DTYPES:
            raise ValueError(f"backend='triton' supports {TRITON_DTYPES}, got q of {q.dtype}")
    return backend


def _scale(scale, head_dim: int, dtype: torch.dtype) -> float:
    """The softmax scale of all three branches, default ``head_dim ** -0.5``.

    Any positive scale gives the spec's (finite) softmax: the backends never form
    scale · q·k, which overflows where the softmax is still defined, but multiply score
    differences from the row maximum by it (only a scale of at most 1 scales the scores).
    What bounds it is the precision the scores are computed in (float32 for float32, bfloat16
    and float16 inputs): the kernels' base-2 scale, scale · log2(e), must be a number there,
    which the dtype tells without reading a tensor.
    """
    if scale is None:
        return head_dim**-0.5
    if (isinstance(scale, bool) or not isinstance(scale, (int, float))
            or not 0 < scale < float("inf")):
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    compute = _compute_dtype(dtype)
    limit = torch.finfo(compute).max / LOG2E
    if scale > limit:
        raise ValueError(f"scale must be <= {limit:.4g} for {dtype} inputs (scale · log2(e) "
                         f"finite in {compute}), got {scale!r}")
    return float(scale)


def nsa_attention(q, k, v, k_cmp, v_cmp, gates, *, k_win=None, v_win=None,
                  cmp_block=32, cmp_stride=16, sel_block=64, num_selected=16,
                  window=512, num_init=1, num_local=2, scale=None,
                  cu_seqlens=None, backend="auto") -> torch.Tensor:
    """Native Sparse Attention: gated sum of compressed, selected and sliding-window attention.

    Args:
        q: [B, T, HQ, Dk] queries (RoPE applied), HQ = G * H.
        k, v: [B, T, H, Dk], [B, T, H, Dv] raw keys/values read by the selected branch.
        k_cmp, v_cmp: [B, Tc, H, Dk], [B, Tc, H, Dv] compressed tokens,
            Tc = (T - cmp_block) // cmp_stride + 1 (0 if T < cmp_block).
        gates: [B, T, HQ, 3] activated gates for (compressed, selected, window).
        k_win, v_win: keys/values of the window branch, default ``k``, ``v``.
        cmp_block, cmp_stride, sel_block, num_selected, window, num_init, num_local:
            l, d, l', n, w and the forced blocks of the spec.
        scale: softmax scale of all three branches, default Dk ** -0.5.
        cu_seqlens: int32 [N+1] with B = 1 packs N sequences along T (k_cmp packed likewise).
        backend: "auto" (Triton for CUDA tensors, PyTorch otherwise), "torch" or "triton".

    Returns:
        [B, T, HQ, Dv] in the dtype of ``q``.
    """
    params = NSAParams(cmp_block, cmp_stride, sel_block, num_selected, window, num_init, num_local)
    check_attention_inputs(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, params, cu_seqlens)
    scale = _scale(scale, q.shape[-1], q.dtype)
    backend = _resolve_backend(backend, q, params)
    k_win = k if k_win is None else k_win
    v_win = v if v_win is None else v_win
    if backend == "triton":
        from nsa.ops.triton.attention import nsa_attention_triton

        return nsa_attention_triton(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, params, scale,
                                    cu_seqlens)
    return nsa_attention_torch(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, params, scale,
                               cu_seqlens)


def nsa_select(q, k_cmp, *, cmp_block=32, cmp_stride=16, sel_block=64, num_selected=16,
               num_init=1, num_local=2, scale=None, cu_seqlens=None,
               backend="auto") -> torch.Tensor:
    """Blocks chosen by the selected branch, shared by the heads of a KV group.

    Args:
        q: [B, T, HQ, Dk] queries; k_cmp: [B, Tc, H, Dk] compressed keys; the rest as
        :func:`nsa_attention`.

    Returns:
        [B, T, H, n] int64 selection-block indices per query position and KV head,
        ascending, padded at the end with -1.
    """
    params = NSAParams(cmp_block, cmp_stride, sel_block, num_selected, num_init=num_init,
                       num_local=num_local)
    check_select_inputs(q, k_cmp, params, cu_seqlens)
    scale = _scale(scale, q.shape[-1], q.dtype)
    if _resolve_backend(backend, q, params) == "triton":
        from nsa.ops.triton.attention import nsa_select_triton

        return nsa_select_triton(q, k_cmp, params, scale, cu_seqlens)
    return nsa_select_torch(q, k_cmp, params, scale, cu_seqlens)
