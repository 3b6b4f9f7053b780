"""The NSA layer's branch gates, sigmoid(logits + bias) of its gate logits [..., HQ, 3] and the
gate projection's bias [HQ · 3], in Triton, forward and backward, registered as the ops
``nsa::branch_gates`` and ``nsa::branch_gates_backward``.

The logits are a strided view of the layer's fused projection (rows of its width, heads of 3
columns). The PyTorch form casts the float32 bias to their dtype, adds it to the strided view
and takes the sigmoid forward; backward, sigmoid's backward, the bias gradient's reduction over
every token, its cast back and copies: ~8 small kernels, ~33 µs of an H200's time a layer at
m7c-125m's training shape (8 × 2048 tokens, HQ = 12, bf16), ~10 of them in the reduction. Here
one kernel each way: the forward reads the logits once and writes the gates once; the backward
reads the gates and their gradient once, writes the logits' gradient once and each program's
column sums of it (float32 partials), which one sum adds in a fixed order: a deterministic
bias gradient. Only the gates are kept for the backward (d sigmoid = g · (1 - g)).

Both compute in float32 and round once to the logits' dtype (the PyTorch form in a 16-bit
dtype also rounds the bias and the sum before the sigmoid).
"""

from __future__ import annotations

import torch
import triton.language as tl

from nsa.ops.triton.jit import kernel
from nsa.ops.triton.launch import as_rows, call_op, cdiv, next_pow2

GATES_ROWS = 64  # tokens per program, each its HQ · 3 gates (one row of the [N, HQ · 3] matrix)


@kernel
def _branch_gates_fwd_kernel(LOGITS, BIAS, GATES, N, C, stride_ln, ROWS: tl.constexpr,
                             COLUMNS: tl.constexpr):
    """GATES[n, c] = sigmoid(LOGITS[n, c] + BIAS[c]) for this program's ROWS of the N rows
    (LOGITS [N, C] with a last stride of 1, BIAS [C], GATES [N, C] contiguous; COLUMNS >= C)."""
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, COLUMNS)
    ok = (n < N)[:, None] & (c < C)[None, :]
    x = tl.load(LOGITS + n.to(tl.int64)[:, None] * stride_ln + c[None, :], mask=ok,
                other=0.0).to(tl.float32)
    b = tl.load(BIAS + c, mask=c < C, other=0.0).to(tl.float32)
    gates = tl.sigmoid(x + b[None, :])
    tl.store(GATES + n.to(tl.int64)[:, None] * C + c[None, :],
             gates.to(GATES.dtype.element_ty), mask=ok)


@kernel
def _branch_gates_bwd_kernel(DGATES, GATES, DLOGITS, PARTIALS, N, C, stride_dn,
                             ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """DLOGITS[n, c] = DGATES[n, c] · g · (1 - g) with g = GATES[n, c] for this program's rows
    (DGATES [N, C] with a last stride of 1; GATES, DLOGITS [N, C] contiguous), and their
    column sums, the bias gradient's share of these rows, in PARTIALS[program] (float32)."""
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, COLUMNS)
    ok = (n < N)[:, None] & (c < C)[None, :]
    n64 = n.to(tl.int64)[:, None]
    dg = tl.load(DGATES + n64 * stride_dn + c[None, :], mask=ok, other=0.0).to(tl.float32)
    g = tl.load(GATES + n64 * C + c[None, :], mask=ok, other=0.0).to(tl.float32)
    d = dg * g * (1.0 - g)  # 0 outside the rows and columns
    tl.store(DLOGITS + n64 * C + c[None, :], d.to(DLOGITS.dtype.element_ty), mask=ok)
    tl.store(PARTIALS + tl.program_id(0) * C + c, tl.sum(d, axis=0), mask=c < C)


# Launch wrappers -------------------------------------------------------------------------


def branch_gates(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """sigmoid(logits + bias), contiguous [..., HQ, 3] in logits' dtype, of logits
    [..., HQ, 3] and a bias of HQ · 3 values."""
    x = as_rows(logits.flatten(-2))  # [N, HQ · 3]: a view of the layer's strided logits
    gates = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if gates.numel() == 0:
        return gates
    N, C = x.shape
    _branch_gates_fwd_kernel[(cdiv(N, GATES_ROWS),)](
        x, bias.reshape(C).contiguous(), gates, N, C, x.stride(0), ROWS=GATES_ROWS,
        COLUMNS=next_pow2(C))
    return gates


def branch_gates_backward(grad: torch.Tensor, gates: torch.Tensor,
                          bias_dtype: torch.dtype) -> list[torch.Tensor]:
    """[d logits, d bias] from the gates' gradient ``grad`` and the gates [..., HQ, 3]: d logits
    contiguous in the gates' dtype, d bias [HQ · 3] in ``bias_dtype``."""
    dg = as_rows(grad.flatten(-2))  # [N, HQ · 3]
    N, C = dg.shape
    dlogits = torch.empty(gates.shape, dtype=gates.dtype, device=gates.device)
    programs = cdiv(N, GATES_ROWS)
    partials = torch.empty(programs, C, dtype=torch.float32, device=gates.device)
    if dlogits.numel():
        _branch_gates_bwd_kernel[(programs,)](
            dg, gates, dlogits, partials, N, C, dg.stride(0), ROWS=GATES_ROWS,
            COLUMNS=next_pow2(C))
    return [dlogits, partials.sum(0).to(bias_dtype)]  # no rows: zeros


branch_gates_op = torch.library.custom_op("nsa::branch_gates", branch_gates, mutates_args=())
branch_gates_backward_op = torch.library.custom_op("nsa::branch_gates_backward",
                                                   branch_gates_backward, mutates_args=())


@branch_gates_op.register_fake
def _(logits, bias):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


@branch_gates_backward_op.register_fake
def _(grad, gates, bias_dtype):
    return [torch.empty(gates.shape, dtype=gates.dtype, device=gates.device),
            gates.new_empty(gates.shape[-2] * 3, dtype=bias_dtype)]


class _BranchGatesFunction(torch.autograd.Function):
    """:func:`branch_gates` forward, :func:`branch_gates_backward` backward; keeps the gates
    alone (and the bias's shape and dtype)."""

    @staticmethod
    def forward(ctx, logits, bias):
        gates = call_op(branch_gates_op, branch_gates, logits, bias)
        ctx.save_for_backward(gates)
        ctx.bias = bias.shape, bias.dtype
        return gates

    @staticmethod
    def backward(ctx, grad):
        (gates,) = ctx.saved_tensors
        bias_shape, bias_dtype = ctx.bias
        dlogits, dbias = call_op(branch_gates_backward_op, branch_gates_backward, grad, gates,
                                 bias_dtype)
        return dlogits, dbias.view(bias_shape)


def branch_gates_triton(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """sigmoid(logits + bias) of gate logits [..., HQ, 3] and a bias of HQ · 3 values (the gate
    projection's, head-major), contiguous in logits' dtype, with autograd (module docstring)."""
    if logits.dim() < 2 or logits.shape[-1] != 3:
        raise ValueError(f"branch_gates takes logits [..., HQ, 3], got {tuple(logits.shape)}")
    if bias.numel() != logits.shape[-2] * 3:
        raise ValueError(f"branch_gates takes a bias of HQ · 3 = {logits.shape[-2] * 3} values, "
                         f"got {bias.numel()}")
    return _BranchGatesFunction.apply(logits, bias)
