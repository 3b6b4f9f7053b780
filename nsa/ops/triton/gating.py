"""The gated combination of the three branches: the forward's sum, which the selected branch's
forward kernels store at the end of each tile (no pass of its own), and the backward's kernel,
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

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nsa.ops.triton.common import all_finite, load_tile, store_rows
from nsa.ops.triton.jit import kernel
from nsa.ops.triton.launch import cdiv, pow2, strides

GATE_ROWS = 16  # rows per program of the gate backward
GATE_CHUNK = tl.constexpr(16)  # columns per step of the gated sum: 32 spill 1.2 KB (masked, m7c)
# Most values of a tile a thread holds where the gated sum is taken from the selected output in
# registers (``sum_in_registers``).
REGISTER_VALUES = 32


@triton.jit
def _rows(N, DV: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """This program's rows, (row, column) offsets into [N, DV] and the in-bounds mask."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    row_ok = r < N
    offsets = r.to(tl.int64)[:, None] * DV + d[None, :]
    return r, row_ok, offsets, row_ok[:, None] & (d[None, :] < DV)


@triton.jit
def _row_gates(GATES, gate_rows, row_ok):
    """(g_cmp, g_slc, g_win) [rows, 1] float32 of the rows whose gates are at GATES + 3
    ``gate_rows``."""
    gates = GATES + gate_rows * 3
    g_cmp = tl.load(gates, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    g_slc = tl.load(gates + 1, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    g_win = tl.load(gates + 2, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    return g_cmp, g_slc, g_win


@triton.jit
def store_gated_sum(O_CMP, O_SLC, O_WIN, GATES, OUT, o_rows, gate_rows, row_ok,
                    DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    """out = g_cmp o_cmp + g_slc o_slc + g_win o_win for one tile of rows, at the end of a
    selected forward kernel (the last branch), which has just stored its o_slc. O_CMP, O_SLC,
    O_WIN (float32) and OUT share one layout: ``o_rows`` are the rows' offsets into it; the
    gates of row r are at GATES + 3 ``gate_rows[r]``. The outputs are read back GATE_CHUNK
    columns at a time, so that the epilogue holds no whole tile in registers (one did: 1.6 →
    4.6 KB of stack per thread at 128 rows of 128, offline sm_90 compile, bench/NOTES.md v16)."""
    tl.debug_barrier()  # this program's stores of o_slc, visible to all its threads
    g_cmp, g_slc, g_win = _row_gates(GATES, gate_rows, row_ok)
    rows = o_rows[:, None]
    for d0 in tl.static_range(0, BLOCK_DV, GATE_CHUNK):
        cols = (d0 + tl.arange(0, GATE_CHUNK))[None, :]
        mask = row_ok[:, None] & (cols < DV)
        out = (g_cmp * tl.load(O_CMP + rows + cols, mask=mask, other=0.0)
               + g_slc * tl.load(O_SLC + rows + cols, mask=mask, other=0.0)
               + g_win * tl.load(O_WIN + rows + cols, mask=mask, other=0.0))
        tl.store(OUT + rows + cols, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def store_gated_sum_of(o_slc, O_CMP, O_WIN, GATES, OUT, o_rows, gate_rows, row_ok,
                       DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    """out = g_cmp o_cmp + g_slc o_slc + g_win o_win for one tile of rows from the selected
    branch's output ``o_slc`` [rows, BLOCK_DV] still in registers: only the other two branches'
    outputs are read, as whole tiles (``sum_in_registers``). Offsets as in
    ``store_gated_sum``."""
    g_cmp, g_slc, g_win = _row_gates(GATES, gate_rows, row_ok)
    cols = tl.arange(0, BLOCK_DV)[None, :]
    offsets = o_rows[:, None] + cols
    mask = row_ok[:, None] & (cols < DV)
    out = (g_cmp * tl.load(O_CMP + offsets, mask=mask, other=0.0) + g_slc * o_slc
           + g_win * tl.load(O_WIN + offsets, mask=mask, other=0.0))
    tl.store(OUT + offsets, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def store_selected_rows(O, LSE, O_CMP, O_WIN, GATES, OUT, b, t, hq, T, HQ, m, l, acc, row_ok,
                        stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, scale_log2,
                        DV: tl.constexpr, BLOCK_DV: tl.constexpr, GATED: tl.constexpr,
                        IN_REGISTERS: tl.constexpr = False):
    """The selected forward kernels' epilogue for rows (b, t, hq): their output and
    log-sum-exp (common.store_rows) and, with GATED, the gated sum of the three branches: with
    IN_REGISTERS from the output in registers (``store_gated_sum_of``), else read back
    (``store_gated_sum``)."""
    o_rows = b * stride_ob + t * stride_ot + hq * stride_oh
    o_slc = store_rows(O + o_rows, LSE + b * stride_lb + t * stride_lt + hq, m, l, acc, row_ok,
                       scale_log2, DV, BLOCK_DV)
    if GATED:
        gate_rows = (b * T + t) * HQ + hq
        if IN_REGISTERS:
            store_gated_sum_of(o_slc, O_CMP, O_WIN, GATES, OUT, o_rows, gate_rows, row_ok, DV,
                               BLOCK_DV)
        else:
            store_gated_sum(O_CMP, O, O_WIN, GATES, OUT, o_rows, gate_rows, row_ok, DV,
                            BLOCK_DV)


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


@kernel
def _gate_backward_kernel(DO, GATES, O_CMP, O_SLC, O_WIN, GATE_CMP, GATE_SLC, GATE_WIN,
                          DELTA_CMP, DELTA_SLC, DELTA_WIN, DGATES, Q, QUERY_FINITE, N, T, HQ, G,
                          stride_qb, stride_qt, stride_qh, DV: tl.constexpr,
                          BLOCK_D: tl.constexpr, DK: tl.constexpr, BLOCK_DK: tl.constexpr,
                          ROWS: tl.constexpr):
    """The branches' dg_i, delta_i and g_i (module docstring), and QUERY_FINITE[b, h] = 0
    (from 1) where a row of KV head h of batch b has a non-finite query, output gradient or
    gate (finite.py; programs that find one store the same 0)."""
    r, row_ok, offsets, mask = _rows(N, DV, BLOCK_D, ROWS)
    do = tl.load(DO + offsets, mask=mask, other=0.0).to(tl.float32)
    b = (r // (T * HQ)).to(tl.int64)
    t = ((r // HQ) % T).to(tl.int64)
    hq = r % HQ
    q = load_tile(Q + b * stride_qb + t * stride_qt + hq * stride_qh, row_ok, DK, BLOCK_DK)
    gates = tl.load(GATES + r.to(tl.int64)[:, None] * 3 + tl.arange(0, 4)[None, :],
                    mask=row_ok[:, None] & (tl.arange(0, 4)[None, :] < 3), other=0.0)
    finite = all_finite(do, 1) & all_finite(q, 1) & all_finite(gates, 1)
    tl.store(QUERY_FINITE + b * (HQ // G) + hq // G, tl.zeros([ROWS], tl.int8),
             mask=row_ok & (finite == 0))
    _branch_gate_grad(do, O_CMP, GATES, GATE_CMP, DELTA_CMP, DGATES, 0, r, row_ok, offsets,
                      mask)
    _branch_gate_grad(do, O_SLC, GATES, GATE_SLC, DELTA_SLC, DGATES, 1, r, row_ok, offsets,
                      mask)
    _branch_gate_grad(do, O_WIN, GATES, GATE_WIN, DELTA_WIN, DGATES, 2, r, row_ok, offsets,
                      mask)


# Launch wrappers -------------------------------------------------------------------------


class GatedSum(NamedTuple):
    """What a selected forward launch needs to also write out = Σ g_i o_i: the compressed and
    window branches' float32 outputs [B, T, HQ, Dv], the gates [B, T, HQ, 3] and ``out``
    [B, T, HQ, Dv] in the inputs' dtype, all contiguous."""

    o_cmp: torch.Tensor
    o_win: torch.Tensor
    gates: torch.Tensor
    out: torch.Tensor


def gated_sum_args(gated: GatedSum | None, o_slc: torch.Tensor) -> dict:
    """The gated-sum arguments of a selected forward kernel (``o_slc`` stands in for every
    tensor when ``gated`` is None: GATED off, nothing read or written)."""
    o_cmp, o_win, gates, out = (o_slc,) * 4 if gated is None else gated
    return dict(O_CMP=o_cmp, O_WIN=o_win, GATES=gates, OUT=out, GATED=gated is not None)


def sum_in_registers(rows: int, dv: int, num_warps: int) -> bool:
    """Whether a selected forward kernel whose tile is ``rows`` x pow2(dv) at ``num_warps``
    takes the gated sum from its output in registers: at most REGISTER_VALUES a thread. So
    the masked forward at m7c-125m's 64 rows of 64 (4 warps) reads 50 MB less a layer at 8 x
    2k at the same 168 registers and no stack (offline sm_90); a per-position program's 16 rows
    of 128 at one warp (64 a thread) went from 194 registers to 240, and reads back."""
    return rows * pow2(dv) <= REGISTER_VALUES * 32 * num_warps


def gate_backward(grad_out, gates, o_cmp, o_slc, o_win, q, H: int):
    """-> (gate [3, B, T, HQ] float32, delta [3, B, T, HQ] float32, dgates in the gates' dtype,
    query_finite [B, H] int8 (finite.py)) for grad_out [B, T, HQ, Dv], gates [B, T, HQ, 3],
    the float32 branch outputs and the queries q [B, T, HQ, Dk] (unit last stride) of H KV
    heads."""
    B, T, HQ, Dv = o_cmp.shape
    N, Dk = B * T * HQ, q.shape[-1]
    gate = torch.empty(3, B, T, HQ, dtype=torch.float32, device=o_cmp.device)
    delta = torch.empty_like(gate)
    dgates = torch.empty(gates.shape, dtype=gates.dtype, device=o_cmp.device)
    query_finite = torch.ones(B, H, dtype=torch.int8, device=o_cmp.device)
    _gate_backward_kernel[(cdiv(N, GATE_ROWS),)](
        grad_out, gates, o_cmp, o_slc, o_win, *gate, *delta, dgates, q, query_finite, N, T, HQ,
        HQ // H, *strides(q), DV=Dv, BLOCK_D=pow2(Dv), DK=Dk, BLOCK_DK=pow2(Dk),
        ROWS=GATE_ROWS)
    return gate, delta, dgates, query_finite
