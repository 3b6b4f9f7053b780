"""The language model's RMSNorm, y = x · rsqrt(mean(x²) + eps) · weight over the last dim, in
Triton, forward and backward: alone (:func:`rms_norm_triton`) and after a residual add
(:func:`add_rms_norm_triton`: h = x + update and y = norm(h) in one pass), registered as the
ops ``nsa::rms_norm`` and ``nsa::rms_norm_backward``.

Why: under bf16 autocast the residual stream is float32 and PyTorch's RMSNorm writes a float32
output that every projection reading it casts to bf16 again (an NSA layer's norm is read by
several); its backward is a reduction kernel at a fraction of the HBM's rate, and the residual
add before it is one more pass each way. At m7c-125m's training shape (8 × 2048 tokens, width
768) that was 0.80 ms forward and 2.42 backward of an H200's step for the norms, ~1.9 for the
adds and most of the step's 1.86 ms of casts (bench/NOTES.md, forty-seventh session).

Here the forward reads x (and the update) once and writes y once, in ``out_dtype`` (the
caller passes autocast's dtype: the cast the projections made), with h and each row's
1 / rms (float32) for the backward. The backward reads h, the rows' 1 / rms and y's gradient
once and writes x's gradient once (plus h's own gradient added in, and the update's gradient
where its dtype differs from x's); the weight's gradient is summed per program over a fixed
run of rows into float32 partials, which one sum adds in a fixed order: deterministic.

Math in float32. With x̂ = x · r (r = 1 / rms) and g = dy · weight:
dx = r · (g - x̂ · mean(x̂ · g)), dweight = Σ_rows dy · x̂.
"""

from __future__ import annotations

import torch
import triton.language as tl

from nsa.ops.triton.jit import kernel
from nsa.ops.triton.launch import as_rows, call_op, cdiv, next_pow2, unit_stride

RMS_MAX_WIDTH = 16384  # widest rows a program holds in registers (wider: PyTorch's form)
RMS_TILE = 4096  # elements (rows × padded width) of a program's tile per step
RMS_PARTIALS = 1024  # most programs of the backward (its weight gradient's float32 partials)
RMS_MIN_RUN = 32  # fewest rows a backward program sums its weight gradient over


@kernel
def _rms_norm_fwd_kernel(X, UPDATE, W, H, Y, RSTD, N, C, eps, stride_x, stride_u, stride_h,
                         stride_y, HAS_UPDATE: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_C: tl.constexpr):
    """Y = norm(X (+ UPDATE, written to H in its dtype and normed as written)) · W and
    RSTD = 1 / rms for this program's ROWS rows of [N, C] (last strides 1)."""
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK_C)
    ok = (n < N)[:, None] & (c < C)[None, :]
    n64 = n.to(tl.int64)[:, None]
    x = tl.load(X + n64 * stride_x + c[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_UPDATE:
        x += tl.load(UPDATE + n64 * stride_u + c[None, :], mask=ok, other=0.0).to(tl.float32)
        h = x.to(H.dtype.element_ty)
        tl.store(H + n64 * stride_h + c[None, :], h, mask=ok)
        x = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / C + eps)  # [ROWS]
    w = tl.load(W + c, mask=c < C, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + n64 * stride_y + c[None, :], y.to(Y.dtype.element_ty), mask=ok)
    tl.store(RSTD + n, rstd, mask=n < N)


@kernel
def _rms_norm_bwd_kernel(X, W, RSTD, DY, DH, DX, DU, DW, N, C, steps, stride_x, stride_dy,
                         stride_dh, stride_dx, stride_du, HAS_DH: tl.constexpr,
                         HAS_DU: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """DX (and DU, in its dtype) = the normed input's gradient (+ DH, its own) and
    DW[program] = this program's rows' share of the weight's gradient, float32, over its run
    of ``steps`` × ROWS rows of [N, C] (module docstring)."""
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    w = tl.load(W + c, mask=c < C, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_C], tl.float32)
    for step in range(steps):
        n = (pid * steps + step) * ROWS + tl.arange(0, ROWS)
        ok = (n < N)[:, None] & (c < C)[None, :]
        n64 = n.to(tl.int64)[:, None]
        x = tl.load(X + n64 * stride_x + c[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + n64 * stride_dy + c[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + n, mask=n < N, other=0.0)
        x_hat = x * rstd[:, None]
        g = dy * w[None, :]
        dw += tl.sum(dy * x_hat, axis=0)
        dx = (g - x_hat * (tl.sum(x_hat * g, axis=1) / C)[:, None]) * rstd[:, None]
        if HAS_DH:
            dx += tl.load(DH + n64 * stride_dh + c[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(DX + n64 * stride_dx + c[None, :], dx.to(DX.dtype.element_ty), mask=ok)
        if HAS_DU:
            tl.store(DU + n64 * stride_du + c[None, :], dx.to(DU.dtype.element_ty), mask=ok)
    tl.store(DW + pid * C + c, dw, mask=c < C)


# Launch wrappers -------------------------------------------------------------------------


def _tile(C: int) -> tuple[int, int, int]:
    """(rows per step, padded width, warps) of a program for rows C wide: RMS_TILE elements a
    step (at least one row), 32 float32 values a thread."""
    block_c = max(16, next_pow2(C))
    rows = max(1, RMS_TILE // block_c)
    return rows, block_c, min(16, max(4, rows * block_c // 1024))


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm takes a weight of the rows' width {x.shape[-1]}, got "
                         f"{tuple(weight.shape)}")
    if x.shape[-1] > RMS_MAX_WIDTH:
        raise ValueError(f"rms_norm's kernels take rows of at most {RMS_MAX_WIDTH}, got "
                         f"{x.shape[-1]}")


def rms_norm_forward(x: torch.Tensor, update: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, out_dtype: torch.dtype) -> list[torch.Tensor]:
    """[y, rstd] of x [..., C], or [h, y, rstd] with h = x + update (x's shape, the dtype of
    the sum) normed in place of x: y [..., C] in out_dtype, rstd [N] float32 (1 / rms)."""
    rows, weight = as_rows(x), unit_stride(weight)
    N, C = rows.shape
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rstd = torch.empty(N, dtype=torch.float32, device=x.device)
    h = None
    if update is not None:
        update_rows = as_rows(update)
        h_dtype = torch.promote_types(x.dtype, update.dtype)
        h = torch.empty(x.shape, dtype=h_dtype, device=x.device)
    if N and C:
        tile_rows, block_c, warps = _tile(C)
        _rms_norm_fwd_kernel[(cdiv(N, tile_rows),)](
            rows, rows if update is None else update_rows, weight, y if h is None else h, y,
            rstd, N, C, eps, rows.stride(0), 0 if update is None else update_rows.stride(0),
            C, C, HAS_UPDATE=update is not None, ROWS=tile_rows, BLOCK_C=block_c,
            num_warps=warps)
    return [y, rstd] if h is None else [h, y, rstd]


def rms_norm_backward(grad_y: torch.Tensor, grad_h: torch.Tensor | None, x: torch.Tensor,
                      weight: torch.Tensor, rstd: torch.Tensor,
                      update_dtype: torch.dtype | None) -> list[torch.Tensor]:
    """[dx, dweight], or [dx, dupdate, dweight] where an ``update_dtype`` other than x's is
    given: the gradients from y's (``grad_y``) and, where given, h's own (``grad_h``, added
    in); x is the normed input (h after an add). dx in x's dtype, dweight in weight's."""
    rows, dy, weight = as_rows(x), as_rows(grad_y), unit_stride(weight)
    dh = None if grad_h is None else as_rows(grad_h)
    N, C = rows.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    du = None
    if update_dtype is not None and update_dtype != x.dtype:
        du = torch.empty(x.shape, dtype=update_dtype, device=x.device)
    tile_rows, block_c, warps = _tile(C)
    steps = cdiv(max(RMS_MIN_RUN, cdiv(N, RMS_PARTIALS)), tile_rows)
    programs = cdiv(N, steps * tile_rows)
    partials = torch.empty(programs, C, dtype=torch.float32, device=x.device)
    if N and C:
        _rms_norm_bwd_kernel[(programs,)](
            rows, weight, rstd, dy, rows if dh is None else dh, dx, dx if du is None else du,
            partials, N, C, steps, rows.stride(0), dy.stride(0), 0 if dh is None else dh.stride(0),
            C, C, HAS_DH=dh is not None, HAS_DU=du is not None, ROWS=tile_rows,
            BLOCK_C=block_c, num_warps=warps)
    dweight = partials.sum(0).to(weight.dtype)
    return [dx, dweight] if du is None else [dx, du, dweight]


rms_norm_op = torch.library.custom_op("nsa::rms_norm", rms_norm_forward, mutates_args=())
rms_norm_backward_op = torch.library.custom_op("nsa::rms_norm_backward", rms_norm_backward,
                                               mutates_args=())


@rms_norm_op.register_fake
def _(x, update, weight, eps, out_dtype):
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rstd = x.new_empty(x.shape[:-1].numel(), dtype=torch.float32)
    if update is None:
        return [y, rstd]
    h = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, update.dtype), device=x.device)
    return [h, y, rstd]


@rms_norm_backward_op.register_fake
def _(grad_y, grad_h, x, weight, rstd, update_dtype):
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dweight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    if update_dtype is None or update_dtype == x.dtype:
        return [dx, dweight]
    return [dx, torch.empty(x.shape, dtype=update_dtype, device=x.device), dweight]


class _RMSNormFunction(torch.autograd.Function):
    """y = norm(x) · weight; keeps x, weight and the rows' 1 / rms."""

    @staticmethod
    def forward(ctx, x, weight, eps, out_dtype):
        y, rstd = call_op(rms_norm_op, rms_norm_forward, x, None, weight, eps, out_dtype)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = call_op(rms_norm_backward_op, rms_norm_backward, grad_y, None, x, weight,
                              rstd, None)
        return dx, dweight, None, None


class _AddRMSNormFunction(torch.autograd.Function):
    """(h, y) = (x + update, norm(h) · weight); keeps h, weight and the rows' 1 / rms. x's and
    the update's gradients are one tensor where their dtypes agree (as an add's backward)."""

    @staticmethod
    def forward(ctx, x, update, weight, eps, out_dtype):
        h, y, rstd = call_op(rms_norm_op, rms_norm_forward, x, update, weight, eps, out_dtype)
        ctx.save_for_backward(h, weight, rstd)
        ctx.dtypes = x.dtype, update.dtype
        ctx.set_materialize_grads(False)  # an unused output's gradient is None, not zeros
        return h, y

    @staticmethod
    def backward(ctx, grad_h, grad_y):
        h, weight, rstd = ctx.saved_tensors
        x_dtype, update_dtype = ctx.dtypes
        if grad_y is None:  # y unused: the add's backward alone
            if grad_h is None:
                return None, None, None, None, None
            return grad_h.to(x_dtype), grad_h.to(update_dtype), None, None, None
        grads = call_op(rms_norm_backward_op, rms_norm_backward, grad_y, grad_h, h, weight,
                        rstd, update_dtype)
        dh, dweight = grads[0], grads[-1]
        d_update = grads[1] if len(grads) == 3 else dh
        return dh.to(x_dtype), d_update, dweight, None, None


def _checked_eps(dtype: torch.dtype, eps: float | None) -> float:
    """eps, or the normed input's dtype's machine epsilon where None (as ``nn.RMSNorm``)."""
    return torch.finfo(dtype).eps if eps is None else float(eps)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float | None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """norm(x) · weight over x's last dim (eps None: x's dtype's machine epsilon), written in
    ``out_dtype`` (default: x's, as ``nn.RMSNorm``), with autograd (module docstring)."""
    _check(x, weight)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    return _RMSNormFunction.apply(x, weight, _checked_eps(x.dtype, eps), out_dtype)


def add_rms_norm_triton(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor,
                        eps: float | None, out_dtype: torch.dtype | None = None):
    """(h, y): h = x + update (the dtype of the sum) and y = norm(h) · weight as
    :func:`rms_norm_triton`'s, in one pass, with autograd."""
    if update.shape != x.shape:
        raise ValueError(f"add_rms_norm takes an update of x's shape {tuple(x.shape)}, got "
                         f"{tuple(update.shape)}")
    _check(x, weight)
    h_dtype = torch.promote_types(x.dtype, update.dtype)
    out_dtype = h_dtype if out_dtype is None else out_dtype
    return _AddRMSNormFunction.apply(x, update, weight, _checked_eps(h_dtype, eps),
                                     out_dtype)
