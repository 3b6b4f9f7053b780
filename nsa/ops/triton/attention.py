"""The Triton backend's op: forward and backward composed from the branch modules, registered
with torch.library (forward, backward, selection) with fake kernels, and differentiated by an
autograd.Function that calls the backward op.

Forward: compressed attention (keeps its log-sum-exp) -> selection (reuses it) -> window
attention -> selected attention, whose kernel also writes the gated sum of the three. Each branch
output is kept in float32 for the backward, which runs one dk/dv kernel per branch, the selected
branch's dq, and one dq kernel for the compressed and window branches together; at short T,
where the selected branch runs as masked causal attention, one dq kernel for all three where
its tuning says so (head dims <= 64 in 16 bits: selected_masked.py, launch.NARROW_TUNING).
Deterministic: no atomics. Keeping the branch outputs in bf16/fp16 (half the bytes) was tried:
the gate backward's delta = do · o then carries the output's rounding, and where dp - delta
cancels the gradients miss the tolerances (bench/NOTES.md, v6). On a GPU the window forward,
and the compressed and window dK/dV, run on a second stream (``launch.fork``/``join``) beside
the branches they do not depend on, filling the SMs those leave idle (bench/NOTES.md, v41).
Modules: ``tables`` (what the kernels read), ``compressed_window``, ``selection``, ``selected``
(with ``selected_blocks`` and ``selected_masked``), ``gating`` (each: kernels, then launch
wrappers), ``launch`` (launch shapes).
"""

from __future__ import annotations

import torch

from nsa.ops.params import NSAParams
from nsa.ops.triton.compressed_window import (
    MODE_CMP,
    MODE_WIN,
    DqBranch,
    branch_dkdv,
    branch_forward,
    branches_dq,
)
from nsa.ops.triton.finite import kv_finite_flags
from nsa.ops.triton.gating import GatedSum, gate_backward
from nsa.ops.triton.launch import (
    BranchGrad,
    call_op,
    fork,
    join,
    launch_choice,
    unit_stride,
)
from nsa.ops.triton.selected import selected_backward, selected_forward
from nsa.ops.triton.selected_masked import (
    MaskedSelection,
    masked_causal_selection,
    masked_dkdv,
    masked_dq,
)
from nsa.ops.triton.selection import select
from nsa.ops.triton.tables import build_tables


def _forward(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, params: NSAParams, scale: float,
             cu_seqlens):
    """-> (out, selection, o_cmp, o_slc, o_win, lse_cmp, lse_slc, lse_win, kv_finite); all
    but ``out`` are what the backward reads (the selected blocks as the selected backward
    reads them: ``selected_forward``; branch outputs in float32, log-sum-exps, the flags of
    the branches' keys and values: finite.py)."""
    tables = build_tables(q.shape[1], k_cmp.shape[1], cu_seqlens, params, q.device)
    kv_finite = kv_finite_flags(((k_cmp, v_cmp), (k, v), (k_win, v_win)))  # [3, B, H]
    # The window branch on a second stream, beside the compressed branch and the selection.
    side = fork(q.device)
    with torch.cuda.stream(side):
        o_win, lse_win = branch_forward(q, k_win, v_win, tables, MODE_WIN, params, scale,
                                        kv_finite[2])
    o_cmp, lse_cmp = branch_forward(q, k_cmp, v_cmp, tables, MODE_CMP, params, scale,
                                    kv_finite[0])
    idx = select(q, k_cmp, lse_cmp, tables, params, scale)
    join(side, o_win, lse_win)
    # The selected branch, last, also writes the gated sum of the three: its programs end at
    # different times, so the sum's memory traffic overlaps other programs' work.
    out = torch.empty(o_cmp.shape, dtype=q.dtype, device=q.device)
    o_slc, lse_slc, selection = selected_forward(q, k, v, idx, tables, params, scale,
                                                 kv_finite[1],
                                                 gated=GatedSum(o_cmp, o_win, gates, out))
    return out, selection, o_cmp, o_slc, o_win, lse_cmp, lse_slc, lse_win, kv_finite


def _backward(grad_out, q, k, v, k_cmp, v_cmp, gates, k_win, v_win, selection, o_cmp, o_slc,
              o_win, lse_cmp, lse_slc, lse_win, kv_finite, params: NSAParams, scale: float,
              cu_seqlens):
    """-> gradients of (q, k, v, k_cmp, v_cmp, gates, k_win, v_win), in their dtypes."""
    # The dq kernels write dq (and, where two kernels compute it, its float32 sum) through q's
    # strides, into new tensors: a strided q (a view with padded rows) is copied, or they
    # would write past them.
    q = q.contiguous()
    tables = build_tables(q.shape[1], k_cmp.shape[1], cu_seqlens, params, q.device)
    gate, delta, dgates, query_finite = gate_backward(grad_out, gates, o_cmp, o_slc, o_win, q,
                                                      k.shape[2])
    # Branch i's output gradient is gate[i] · grad_out: its kernels apply the gate.
    cmp_grad, slc_grad, win_grad = (BranchGrad(grad_out, g) for g in gate)
    # The compressed and window dK/dV on a second stream, beside the selected backward and the
    # dq (which keep the GPU busy longer: the side's launches fill its idle SMs).
    side = fork(q.device)
    with torch.cuda.stream(side):
        dk_cmp, dv_cmp = branch_dkdv(q, k_cmp, v_cmp, cmp_grad, lse_cmp, delta[0], tables,
                                     MODE_CMP, params, scale, query_finite)
        dk_win, dv_win = branch_dkdv(q, k_win, v_win, win_grad, lse_win, delta[2], tables,
                                     MODE_WIN, params, scale, query_finite)
    cmp_dq = DqBranch(k_cmp, v_cmp, gate[0], lse_cmp, delta[0], kv_finite[0])
    win_dq = DqBranch(k_win, v_win, gate[2], lse_win, delta[2], kv_finite[2])
    if (masked_causal_selection(q.shape[1], params, tables.packed)
            and launch_choice("masked_dq", "branches", max(q.shape[-1], v.shape[-1]),
                              q.element_size())):
        # One dq kernel for the three branches: q and do read once, no float32 sum.
        masked = MaskedSelection(selection, kv_finite[1])
        dq = torch.empty_like(q)
        masked_dq(q, k, v, masked, slc_grad, lse_slc, delta[1], dq, params, scale,
                  accumulate=False, branches=(cmp_dq, win_dq, tables))
        dk, dv = masked_dkdv(q, k, v, masked, slc_grad, lse_slc, delta[1], params, scale)
    else:
        # dq: the selected branch writes its float32 dq, and one kernel adds the compressed
        # and window branches' and writes the total in q's dtype (no zero fill, no cast),
        # into a dq allocated only then: not held through the selected branch's partials.
        dq_sum = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = selected_backward(q, k, v, selection, slc_grad, lse_slc, delta[1], dq_sum,
                                   tables, params, scale, kv_finite[1], accumulate=False)
        dq = torch.empty_like(q)
        branches_dq(q, grad_out, cmp_dq, win_dq, dq_sum, dq, tables, params, scale)
    join(side, dk_cmp, dv_cmp, dk_win, dv_win)
    return dq, dk, dv, dk_cmp, dv_cmp, dgates, dk_win, dv_win


def _kernel_inputs(q, k, v, k_cmp, v_cmp, gates, k_win, v_win):
    """The op's inputs as the kernels read them (the gating kernels read the gates
    contiguous)."""
    return (*map(unit_stride, (q, k, v, k_cmp, v_cmp)), gates.contiguous(),
            *map(unit_stride, (k_win, v_win)))


# The op is registered with torch.library so torch.compile traces it as one opaque node (no
# graph break) with shapes from the fake implementations; eager calls skip the dispatcher
# (launch.call_op). Block parameters travel as ints.
PARAM_NAMES = ("cmp_block", "cmp_stride", "sel_block", "num_selected", "window", "num_init",
               "num_local")


def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cmp: torch.Tensor,
                  v_cmp: torch.Tensor, gates: torch.Tensor, k_win: torch.Tensor,
                  v_win: torch.Tensor, cu_seqlens: torch.Tensor | None, cmp_block: int,
                  cmp_stride: int, sel_block: int, num_selected: int, window: int,
                  num_init: int, num_local: int, scale: float) -> list[torch.Tensor]:
    """The op's forward -> [out, then what the backward reads (``_forward``)]."""
    params = NSAParams(cmp_block, cmp_stride, sel_block, num_selected, window, num_init,
                       num_local)
    tensors = _kernel_inputs(q, k, v, k_cmp, v_cmp, gates, k_win, v_win)
    return list(_forward(*tensors, params, scale, cu_seqlens))


attention_fwd_op = torch.library.custom_op("nsa::attention_fwd", attention_fwd, mutates_args=())


@attention_fwd_op.register_fake
def _(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, cu_seqlens, cmp_block, cmp_stride, sel_block,
      num_selected, window, num_init, num_local, scale):
    B, T, HQ, _ = q.shape
    H, Dv = k.shape[2], v.shape[3]
    branch_out = q.new_empty(B, T, HQ, Dv, dtype=torch.float32)
    lse = q.new_empty(B, T, HQ, dtype=torch.float32)
    params = NSAParams(cmp_block, cmp_stride, sel_block, num_selected, window, num_init,
                       num_local)
    # The selection as the selected backward reads it (selected_forward).
    selection = (q.new_empty(B, T, H, dtype=torch.int64)
                 if masked_causal_selection(T, params, cu_seqlens is not None)
                 else q.new_empty(B, T, H, num_selected, dtype=torch.int32))
    kv_finite = q.new_empty(3, B, H, dtype=torch.int8)
    return [q.new_empty(B, T, HQ, Dv), selection, branch_out, torch.empty_like(branch_out),
            torch.empty_like(branch_out), lse, torch.empty_like(lse), torch.empty_like(lse),
            kv_finite]


def attention_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_cmp: torch.Tensor, v_cmp: torch.Tensor, gates: torch.Tensor,
                  k_win: torch.Tensor, v_win: torch.Tensor, selection: torch.Tensor,
                  o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor,
                  lse_cmp: torch.Tensor, lse_slc: torch.Tensor, lse_win: torch.Tensor,
                  kv_finite: torch.Tensor, cu_seqlens: torch.Tensor | None, cmp_block: int,
                  cmp_stride: int, sel_block: int, num_selected: int, window: int,
                  num_init: int, num_local: int, scale: float) -> list[torch.Tensor]:
    """The op's backward -> gradients of (q, k, v, k_cmp, v_cmp, gates, k_win, v_win)."""
    params = NSAParams(cmp_block, cmp_stride, sel_block, num_selected, window, num_init,
                       num_local)
    inputs = _kernel_inputs(q, k, v, k_cmp, v_cmp, gates, k_win, v_win)
    return list(_backward(grad_out.contiguous(), *inputs, selection, o_cmp, o_slc, o_win,
                          lse_cmp, lse_slc, lse_win, kv_finite, params, scale, cu_seqlens))


attention_bwd_op = torch.library.custom_op("nsa::attention_bwd", attention_bwd, mutates_args=())


@attention_bwd_op.register_fake
def _(grad_out, q, k, v, k_cmp, v_cmp, gates, k_win, v_win, *saved_and_params):
    return [torch.empty_like(x) for x in (q, k, v, k_cmp, v_cmp, gates, k_win, v_win)]


class _AttentionFunction(torch.autograd.Function):
    """The op's autograd: the forward op, then the backward op on what it saved (through
    ``call_op``: the registered ops under torch.compile, which traces them as opaque nodes;
    their functions in eager). A plain autograd.Function rather than torch.library's
    ``register_autograd``: it issues about 0.5 ms less host work per forward+backward on the
    GPU machine's host (bench/NOTES.md, v11)."""

    @staticmethod
    def forward(ctx, q, k, v, k_cmp, v_cmp, gates, k_win, v_win, cu_seqlens, values, scale):
        out, *saved = call_op(attention_fwd_op, attention_fwd, q, k, v, k_cmp, v_cmp, gates,
                              k_win, v_win, cu_seqlens, *values, scale)
        ctx.save_for_backward(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, *saved)
        ctx.cu_seqlens, ctx.values, ctx.scale = cu_seqlens, values, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grads = call_op(attention_bwd_op, attention_bwd, grad_out, *ctx.saved_tensors,
                        ctx.cu_seqlens, *ctx.values, ctx.scale)
        return (*grads, None, None, None)


def select_blocks(q: torch.Tensor, k_cmp: torch.Tensor, cu_seqlens: torch.Tensor | None,
                  cmp_block: int, cmp_stride: int, sel_block: int, num_selected: int, num_init: int,
                  num_local: int, scale: float) -> torch.Tensor:
    """The blocks each position selects -> [B, T, H, n] int64 (``nsa_select``)."""
    params = NSAParams(cmp_block, cmp_stride, sel_block, num_selected, num_init=num_init,
                       num_local=num_local)
    q, k_cmp = q.contiguous(), k_cmp.contiguous()
    tables = build_tables(q.shape[1], k_cmp.shape[1], cu_seqlens, params, q.device)
    # Only the log-sum-exp of the compressed branch is needed; its output is discarded.
    v_cmp = k_cmp[..., :1]
    _, lse = branch_forward(q, k_cmp, v_cmp, tables, MODE_CMP, params, scale,
                            kv_finite_flags(((k_cmp, v_cmp),))[0])
    return select(q, k_cmp, lse, tables, params, scale).long()


select_op = torch.library.custom_op("nsa::select", select_blocks, mutates_args=())


@select_op.register_fake
def _(q, k_cmp, cu_seqlens, cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local,
      scale):
    B, T, _, _ = q.shape
    return q.new_empty(B, T, k_cmp.shape[2], num_selected, dtype=torch.long)


def nsa_attention_triton(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, params: NSAParams,
                         scale: float, cu_seqlens=None) -> torch.Tensor:
    values = tuple(getattr(params, name) for name in PARAM_NAMES)
    return _AttentionFunction.apply(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, cu_seqlens,
                                    values, scale)


def nsa_select_triton(q, k_cmp, params: NSAParams, scale: float, cu_seqlens=None):
    return call_op(select_op, select_blocks, q, k_cmp, cu_seqlens, params.cmp_block,
                   params.cmp_stride, params.sel_block, params.num_selected, params.num_init,
                   params.num_local, scale)
