"""The language model's loss, the mean cross-entropy of logits [N, V] against targets [N]
(IGNORE_INDEX, -100: not counted, as ``F.cross_entropy``'s default), in Triton, forward and
backward, registered as the ops ``nsa::cross_entropy`` and ``nsa::cross_entropy_backward``.

The PyTorch form (``F.cross_entropy(logits.float(), targets)``) casts the logits to float32
(a copy of [N, V]), keeps their log-softmax for the backward (another), and in the backward
fills a gradient, runs log-softmax's backward and casts the gradient back: at m7c-125m's
training shape (16,384 tokens, 50,304 classes, bf16 logits) ~10.6 ms of an H200's time a step,
a fifth of the dense model's step, and 6.6 GB of float32 tensors (bench/NOTES.md,
forty-seventh session). Here one program a row reads its logits once forward (an online
log-sum-exp in float32, then the target's logit) and writes the row's loss and log-sum-exp;
the backward reads the logits once more and writes their gradient in their dtype, (softmax -
one-hot) · grad / count, where count is the number of counted rows. Only the logits (in their
dtype) and the log-sum-exps are kept.

The mean is a PyTorch sum of the rows' losses over the count, deterministic, and NaN when no
row counts (as ``F.cross_entropy``). A target outside [0, V) that is not IGNORE_INDEX makes its
row's loss NaN (so the mean's): no kernel reads outside the row, and no host sync checks it
(``F.cross_entropy`` stops the GPU with a device assertion).
"""

from __future__ import annotations

import torch
import triton.language as tl

from nsa.ops.triton.jit import kernel
from nsa.ops.triton.launch import call_op, unit_stride

IGNORE_INDEX = -100
BLOCK_V = 4096  # classes per step of a row's loop
CE_WARPS = 8


@kernel
def _cross_entropy_fwd_kernel(LOGITS, TARGETS, LOSS, LSE, V, stride_n, IGNORE: tl.constexpr,
                              BLOCK: tl.constexpr):
    """LOSS[n] = lse - LOGITS[n, target] (0 where the target is IGNORE, NaN where it is out of
    [0, V)) and LSE[n] = log Σ exp LOGITS[n, :] for row n = program 0, in float32."""
    n = tl.program_id(0)
    row = LOGITS + n.to(tl.int64) * stride_n
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(total)
    target = tl.load(TARGETS + n)
    counted = target != IGNORE
    in_range = (target >= 0) & (target < V)
    x_target = tl.load(row + target, mask=counted & in_range, other=0.0).to(tl.float32)
    loss = tl.where(counted, tl.where(in_range, lse - x_target, float("nan")), 0.0)
    tl.store(LOSS + n, loss)
    tl.store(LSE + n, lse)


@kernel
def _cross_entropy_bwd_kernel(LOGITS, TARGETS, LSE, SCALE, DLOGITS, V, stride_n, stride_dn,
                              IGNORE: tl.constexpr, BLOCK: tl.constexpr):
    """DLOGITS[n, :] = (softmax(LOGITS[n, :]) - one_hot(target)) · SCALE[0] for row n =
    program 0 (0 where the target is IGNORE), in DLOGITS' dtype."""
    n = tl.program_id(0)
    row = LOGITS + n.to(tl.int64) * stride_n
    out = DLOGITS + n.to(tl.int64) * stride_dn
    target = tl.load(TARGETS + n)
    lse = tl.load(LSE + n)
    scale = tl.where(target != IGNORE, tl.load(SCALE), 0.0)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - (cols == target).to(tl.float32)) * scale
        tl.store(out + cols, grad.to(DLOGITS.dtype.element_ty), mask=ok)


# Launch wrappers -------------------------------------------------------------------------


def cross_entropy_rows(logits: torch.Tensor,
                       targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's loss, each row's log-sum-exp), float32 [N], of logits [N, V] and int
    targets [N] (module docstring)."""
    logits = unit_stride(logits)
    N, V = logits.shape
    loss = torch.empty(N, dtype=torch.float32, device=logits.device)
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N:
        _cross_entropy_fwd_kernel[(N,)](logits, targets, loss, lse, V, logits.stride(0),
                                        IGNORE=IGNORE_INDEX, BLOCK=BLOCK_V, num_warps=CE_WARPS)
    return loss, lse


def cross_entropy_backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                           scale: torch.Tensor) -> torch.Tensor:
    """The logits' gradient [N, V] in their dtype, (softmax - one-hot) · scale (a float32
    [1] tensor: the loss's gradient over the count), 0 on rows of ignored targets."""
    logits = unit_stride(logits)
    N, V = logits.shape
    grad = torch.empty(N, V, dtype=logits.dtype, device=logits.device)
    if N:
        _cross_entropy_bwd_kernel[(N,)](logits, targets, lse, scale, grad, V, logits.stride(0),
                                        V, IGNORE=IGNORE_INDEX, BLOCK=BLOCK_V,
                                        num_warps=CE_WARPS)
    return grad


cross_entropy_op = torch.library.custom_op("nsa::cross_entropy", cross_entropy_rows,
                                           mutates_args=())
cross_entropy_backward_op = torch.library.custom_op("nsa::cross_entropy_backward",
                                                    cross_entropy_backward, mutates_args=())


@cross_entropy_op.register_fake
def _(logits, targets):
    row = logits.new_empty(logits.shape[0], dtype=torch.float32)
    return row, torch.empty_like(row)


@cross_entropy_backward_op.register_fake
def _(logits, targets, lse, scale):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


class _CrossEntropyFunction(torch.autograd.Function):
    """The rows' losses' sum over the count of counted rows; keeps the logits, the targets,
    the log-sum-exps and the count."""

    @staticmethod
    def forward(ctx, logits, targets):
        loss, lse = call_op(cross_entropy_op, cross_entropy_rows, logits, targets)
        count = (targets != IGNORE_INDEX).sum().to(torch.float32)
        ctx.save_for_backward(logits, targets, lse, count)
        return loss.sum() / count

    @staticmethod
    def backward(ctx, grad):
        logits, targets, lse, count = ctx.saved_tensors
        scale = (grad.to(torch.float32) / count).reshape(1)
        return call_op(cross_entropy_backward_op, cross_entropy_backward, logits, targets,
                       lse, scale), None


def cross_entropy_triton(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy (float32 scalar) of logits [N, V] against int targets [N]
    (IGNORE_INDEX: not counted), with autograd (module docstring)."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy takes logits [N, V] and targets [N], got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    if logits.shape[1] == 0:
        raise ValueError("cross_entropy takes logits of at least one class, got 0")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"cross_entropy takes integer targets, got {targets.dtype}")
    return _CrossEntropyFunction.apply(logits, targets.contiguous())
