"""The gated combination of the three branches: the forward's sum, which the window branch's
forward kernel stores at the end of each tile (no pass of its own), and the backward's kernel,
then its launch wrapper.

Forward: out = g_cmp o_cmp + g_slc o_slc + g_win o_win. Backward (rows are the flattened
(batch, position, query head) triples; every tensor is contiguous), for each branch i:
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

GATE_ROWS = 16  # rows per program of the gate backward
GATE_CHUNK = tl.constexpr(32)  # columns per step of the forward's gated sum (store_gated_sum)


@triton.jit
def _rows(N, DV: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """This program's rows, (row, column) offsets into [N, DV] and the in-bounds mask."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    row_ok = r < N
    offsets = r.to(tl.int64)[:, None] * DV + d[None, :]
    return r, row_ok, offsets, row_ok[:, None] & (d[None, :] < DV)


@triton.jit
def store_gated_sum(win_rows, cmp_rows, slc_rows, gate_rows, out_rows, row_ok,
                    DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    """out = g_cmp o_cmp + g_slc o_slc + g_win o_win for one tile of rows, at the end of the
    window branch's forward (the last branch), which has just stored o_win: the three branch
    outputs (float32) are read at their rows' starts, GATE_CHUNK columns at a time, so that the
    epilogue holds no whole tile in registers (one did: 1.6 → 4.6 KB of stack per thread at
    128 rows of 128, offline sm_90 compile); the gates at ``gate_rows`` (stride 1)."""
    tl.debug_barrier()  # this program's stores of o_win, visible to all its threads
    g_cmp = tl.load(gate_rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    g_slc = tl.load(gate_rows + 1, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    g_win = tl.load(gate_rows + 2, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    for d0 in tl.static_range(0, BLOCK_DV, GATE_CHUNK):
        cols = (d0 + tl.arange(0, GATE_CHUNK))[None, :]
        mask = row_ok[:, None] & (cols < DV)
        out = (g_cmp * tl.load(cmp_rows[:, None] + cols, mask=mask, other=0.0)
               + g_slc * tl.load(slc_rows[:, None] + cols, mask=mask, other=0.0)
               + g_win * tl.load(win_rows[:, None] + cols, mask=mask, other=0.0))
        tl.store(out_rows[:, None] + cols, out.to(out_rows.dtype.element_ty), mask=mask)


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
