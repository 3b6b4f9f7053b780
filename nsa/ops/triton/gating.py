"""The gated combination of the three branches, forward and backward, one pass each: the
Triton kernels, then their launch wrappers.

Rows are the flattened (batch, position, query head) triples; every tensor is contiguous.
Forward: out = g_cmp o_cmp + g_slc o_slc + g_win o_win. Backward, for each branch i:
dg_i = do · o_i; delta_i, the same sum in float32; and g_i in float32, contiguous per branch.
The branch's output gradient g_i do is not formed: its backward kernels read do, compute
p (dp - delta_i) with dp = do · v, which cancels where it should, and multiply the results by
g_i per row. Three g_i do copies took 3 GiB at 64k with 64 heads of 128 (and rounded g_i do
to the inputs' dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops.triton.launch import pow2

GATE_ROWS = 16  # rows per program of the gating kernels


@triton.jit
def _rows(N, DV: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """This program's rows, (row, column) offsets into [N, DV] and the in-bounds mask."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    row_ok = r < N
    offsets = r.to(tl.int64)[:, None] * DV + d[None, :]
    return r, row_ok, offsets, row_ok[:, None] & (d[None, :] < DV)


@triton.jit
def _gated_sum_kernel(O_CMP, O_SLC, O_WIN, GATES, OUT, N, DV: tl.constexpr,
                      BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    r, row_ok, offsets, mask = _rows(N, DV, BLOCK_D, ROWS)
    gates = GATES + r.to(tl.int64) * 3
    g_cmp = tl.load(gates, mask=row_ok, other=0.0).to(tl.float32)
    g_slc = tl.load(gates + 1, mask=row_ok, other=0.0).to(tl.float32)
    g_win = tl.load(gates + 2, mask=row_ok, other=0.0).to(tl.float32)
    out = (g_cmp[:, None] * tl.load(O_CMP + offsets, mask=mask, other=0.0)
           + g_slc[:, None] * tl.load(O_SLC + offsets, mask=mask, other=0.0)
           + g_win[:, None] * tl.load(O_WIN + offsets, mask=mask, other=0.0))
    tl.store(OUT + offsets, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _branch_gate_grad(do, O, GATES, GATE, DELTA, DGATES, branch: tl.constexpr, r, row_ok,
                      offsets, mask):
    """dg_i, delta_i and g_i of one branch (see the module docstring)."""
    o = tl.load(O + offsets, mask=mask, other=0.0)
    do_o = tl.sum(do * o, axis=1)
    gates = r.to(tl.int64) * 3 + branch
    tl.store(DGATES + gates, do_o.to(DGATES.dtype.element_ty), mask=row_ok)
    tl.store(DELTA + r, do_o, mask=row_ok)
    tl.store(GATE + r, tl.load(GATES + gates, mask=row_ok).to(tl.float32), mask=row_ok)


@triton.jit
def _gate_backward_kernel(DO, GATES, O_CMP, O_SLC, O_WIN, GATE_CMP, GATE_SLC, GATE_WIN,
                          DELTA_CMP, DELTA_SLC, DELTA_WIN, DGATES, N, DV: tl.constexpr,
                          BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    r, row_ok, offsets, mask = _rows(N, DV, BLOCK_D, ROWS)
    do = tl.load(DO + offsets, mask=mask, other=0.0).to(tl.float32)
    _branch_gate_grad(do, O_CMP, GATES, GATE_CMP, DELTA_CMP, DGATES, 0, r, row_ok, offsets,
                      mask)
    _branch_gate_grad(do, O_SLC, GATES, GATE_SLC, DELTA_SLC, DGATES, 1, r, row_ok, offsets,
                      mask)
    _branch_gate_grad(do, O_WIN, GATES, GATE_WIN, DELTA_WIN, DGATES, 2, r, row_ok, offsets,
                      mask)


# Launch wrappers -------------------------------------------------------------------------


def gated_sum(o_cmp, o_slc, o_win, gates, dtype):
    """out [B, T, HQ, Dv] in ``dtype`` = Σ_i gates[..., i] o_i (branch outputs in float32)."""
    out = torch.empty(o_cmp.shape, dtype=dtype, device=o_cmp.device)
    N, Dv = out.numel() // out.shape[-1], out.shape[-1]
    _gated_sum_kernel[(triton.cdiv(N, GATE_ROWS),)](
        o_cmp, o_slc, o_win, gates, out, N, DV=Dv, BLOCK_D=pow2(Dv), ROWS=GATE_ROWS)
    return out


def gate_backward(grad_out, gates, o_cmp, o_slc, o_win):
    """-> (gate [3, B, T, HQ] float32, delta [3, B, T, HQ] float32, dgates in the gates' dtype)
    for grad_out [B, T, HQ, Dv], gates [B, T, HQ, 3] and the float32 branch outputs."""
    N, Dv = o_cmp.numel() // o_cmp.shape[-1], o_cmp.shape[-1]
    gate = torch.empty(3, *o_cmp.shape[:-1], dtype=torch.float32, device=o_cmp.device)
    delta = torch.empty_like(gate)
    dgates = torch.empty(gates.shape, dtype=gates.dtype, device=o_cmp.device)
    _gate_backward_kernel[(triton.cdiv(N, GATE_ROWS),)](
        grad_out, gates, o_cmp, o_slc, o_win, *gate, *delta, dgates, N, DV=Dv, BLOCK_D=pow2(Dv),
        ROWS=GATE_ROWS)
    return gate, delta, dgates
