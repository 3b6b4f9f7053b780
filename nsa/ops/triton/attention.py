"""Launch wrappers and the autograd Function of the Triton NSA backend.

Forward: compressed attention (keeps its log-sum-exp) -> selection (reuses it) -> selected
attention -> window attention -> gated sum. Each branch output is kept in float32 for the
backward, which runs one dq and one dk/dv kernel per branch (deterministic: no atomics).
Per-token and per-tile tables (positions, sequence bounds, tile starts) are built on the device
with vectorised PyTorch, so nothing reads a tensor value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from nsa.ops.params import NSAParams
from nsa.ops.triton.dense_branches import (
    MODE_CMP,
    MODE_WIN,
    _branch_bwd_dkdv_kernel,
    _branch_bwd_dq_kernel,
    _branch_fwd_kernel,
)
from nsa.ops.triton.selection import (
    _select_kernel,
    _selected_bwd_dkdv_kernel,
    _selected_bwd_dq_kernel,
    _selected_fwd_kernel,
    _sum_segments_kernel,
)

LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys per step of the compressed and window kernels
SELECTED_SEGMENT = 256  # most (position) entries one selected-branch dK/dV program handles
CMP_SEGMENT = 4096  # most query positions one compressed-branch dK/dV program handles

# Launch shapes per kernel family: rows (position x head pairs) per tile and warps. Rows grow
# to the next power of two >= G when a group is larger. Measured choices: see bench/NOTES.md.
TUNING = {
    "dense_fwd": dict(rows=128, num_warps=4, num_stages=2),
    "dense_dq": dict(rows=128, num_warps=8, num_stages=2),
    "dense_dkdv": dict(rows=128, num_warps=8, num_stages=2),
    "select": dict(rows=32, num_warps=4, num_stages=2),
    "selected_fwd": dict(rows=64, num_warps=4, num_stages=2),
    "selected_dq": dict(rows=64, num_warps=4, num_stages=2),
    "selected_dkdv": dict(rows=64, num_warps=4, num_stages=2),
}


def _pow2(x: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(x))


@dataclass
class Layout:
    """Int32 tables describing where every token, compressed token and tile sits."""

    tok_pos: torch.Tensor  # [T] position within its sequence
    tok_cmp_start: torch.Tensor  # [T] packed index of its sequence's first compressed token
    tok_t_hi: torch.Tensor  # [T] last query (exclusive) whose window sees this token
    cmp_t_lo: torch.Tensor  # [Tc] first query that sees this compressed token
    cmp_t_hi: torch.Tensor  # [Tc] end (exclusive) of its sequence
    seq_starts: torch.Tensor  # [N] first token of each sequence
    seq_ends: torch.Tensor  # [N]
    cmp_starts: torch.Tensor  # [N]


def build_layout(T: int, Tc: int, cu_seqlens, params: NSAParams, device) -> Layout:
    if cu_seqlens is None:
        cu = torch.tensor([0, T], dtype=torch.long, device=device)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.long)
    starts, ends = cu[:-1], cu[1:]
    lengths = ends - starts
    cmp_per_seq = torch.where(
        lengths >= params.cmp_block,
        (lengths - params.cmp_block).div(params.cmp_stride, rounding_mode="floor") + 1,
        torch.zeros_like(lengths),
    )
    cmp_starts = torch.cumsum(cmp_per_seq, 0) - cmp_per_seq
    t = torch.arange(T, device=device)
    seq = torch.searchsorted(ends, t, right=True)
    c = torch.arange(Tc, device=device)
    cmp_seq = torch.searchsorted(cmp_starts + cmp_per_seq, c, right=True).clamp_max(len(starts) - 1)
    cmp_local = c - cmp_starts[cmp_seq]
    i32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
    return Layout(
        tok_pos=i32(t - starts[seq]),
        tok_cmp_start=i32(cmp_starts[seq]),
        tok_t_hi=i32(torch.minimum(t + params.window, ends[seq])),
        cmp_t_lo=i32(starts[cmp_seq] + cmp_local * params.cmp_stride + params.cmp_block - 1),
        cmp_t_hi=i32(ends[cmp_seq]),
        seq_starts=starts, seq_ends=ends, cmp_starts=cmp_starts,
    )


def tile_table(layout: Layout, T: int, positions_per_tile: int):
    """Tiles of ``positions_per_tile`` positions that never straddle two sequences.

    The count is bounded by cdiv(T, P) + N (a shape, known without a sync); unused tiles are
    empty (start == end).
    """
    P = positions_per_tile
    lengths = layout.seq_ends - layout.seq_starts
    per_seq = (lengths + P - 1) // P
    first = torch.cumsum(per_seq, 0) - per_seq
    num_tiles = (T + P - 1) // P + len(lengths)
    k = torch.arange(num_tiles, device=lengths.device)
    seq = torch.searchsorted(first + per_seq, k, right=True).clamp_max(len(lengths) - 1)
    start = layout.seq_starts[seq] + (k - first[seq]) * P
    used = k < (first + per_seq)[-1]
    end = torch.where(used, layout.seq_ends[seq], start)
    i32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
    return (num_tiles, i32(start), i32(end), i32(layout.seq_starts[seq]),
            i32(layout.cmp_starts[seq]))


def _launch(kind: str, G: int, head_dim: int):
    """(rows per tile, launch options) for a kernel family; rows >= G, a power of two >= 16.

    Head dims above 128 (padded to 256) halve the rows and drop software pipelining so the
    tiles fit in shared memory."""
    tuning = TUNING[kind]
    rows, stages = tuning["rows"], tuning["num_stages"]
    if _pow2(head_dim) > 128:
        rows, stages = rows // 2, 1
    return max(rows, _pow2(G, 16)), dict(num_warps=tuning["num_warps"], num_stages=stages)


def _strides(x: torch.Tensor, n: int = 3):
    return x.stride()[:n]


def _common(q, k, v):
    B, T, HQ, Dk = q.shape
    H, Dv = k.shape[2], v.shape[3]
    G = HQ // H
    return B, T, HQ, H, G, Dk, Dv


def branch_forward(q, k, v, layout, mode, params, scale):
    """Compressed (mode CMP: k, v compressed) or window (mode WIN) attention -> (o, lse2)."""
    B, T, HQ, H, G, Dk, Dv = _common(q, k, v)
    o = torch.empty(B, T, HQ, Dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, T, HQ, dtype=torch.float32, device=q.device)
    R, launch = _launch("dense_fwd", G, max(Dk, Dv))
    grid = (triton.cdiv(T, R // G), B * H)
    _branch_fwd_kernel[grid](
        q, k, v, o, lse, layout.tok_pos, layout.tok_cmp_start,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o), *lse.stride()[:2],
        T, k.shape[1], H, scale * LOG2E,
        G=G, DK=Dk, DV=Dv, BLOCK_DK=_pow2(Dk), BLOCK_DV=_pow2(Dv), BLOCK_R=R, BLOCK_N=BLOCK_N,
        MODE=mode, WINDOW=params.window, CMP_BLOCK=params.cmp_block,
        CMP_STRIDE=params.cmp_stride, IEEE=q.dtype == torch.float32, **launch,
    )
    return o, lse


def branch_backward(q, k, v, do, lse, delta, dq, layout, mode, params, scale):
    """Adds this branch's dq into ``dq`` (float32) and returns (dk, dv) in float32."""
    B, T, HQ, H, G, Dk, Dv = _common(q, k, v)
    NK = k.shape[1]
    meta = dict(G=G, DK=Dk, DV=Dv, BLOCK_DK=_pow2(Dk), BLOCK_DV=_pow2(Dv),
                BLOCK_N=BLOCK_N, MODE=mode, WINDOW=params.window, CMP_BLOCK=params.cmp_block,
                CMP_STRIDE=params.cmp_stride, IEEE=q.dtype == torch.float32)
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(do), *lse.stride()[:2])
    R, launch = _launch("dense_dq", G, max(Dk, Dv))
    _branch_bwd_dq_kernel[(triton.cdiv(T, R // G), B * H)](
        q, k, v, do, lse, delta, dq, layout.tok_pos, layout.tok_cmp_start, *strides,
        T, NK, H, scale * LOG2E, scale, BLOCK_R=R, **meta, **launch,
    )
    # A compressed key is seen by every later query: split the queries into segments so the
    # first key tiles do not run alone; window keys are seen by at most w queries.
    segments = triton.cdiv(T, CMP_SEGMENT) if mode == MODE_CMP else 1
    dk = torch.empty(segments, *k.shape, dtype=torch.float32, device=q.device)
    dv = torch.empty(segments, *v.shape, dtype=torch.float32, device=q.device)
    if mode == MODE_CMP:
        t_lo, t_hi = layout.cmp_t_lo, layout.cmp_t_hi
    else:
        t_lo, t_hi = torch.arange(T, device=q.device, dtype=torch.int32), layout.tok_t_hi
    if NK:
        R, launch = _launch("dense_dkdv", G, max(Dk, Dv))
        _branch_bwd_dkdv_kernel[(triton.cdiv(NK, BLOCK_N), B * H, segments)](
            q, k, v, do, lse, delta, dk, dv, layout.tok_pos, layout.tok_cmp_start,
            t_lo, t_hi, *strides, *dk.stride()[1:4], *dv.stride()[1:4], dk.stride(0),
            dv.stride(0), T, NK, H, CMP_SEGMENT if mode == MODE_CMP else T, scale * LOG2E,
            scale, BLOCK_R=R, **meta, **launch,
        )
    return dk.sum(0), dv.sum(0)


def select(q, k_cmp, lse_cmp, layout, params, scale):
    """[B, T, H, n] int32 selected blocks (ascending, -1 padded) from the compressed lse."""
    B, T, HQ, H, G, Dk, _ = _common(q, k_cmp, k_cmp)
    R, launch = _launch("select", G, Dk)
    num_tiles, start, end, seq_start, cmp_start = tile_table(layout, T, R // G)
    idx = torch.empty(B, T, H, params.num_selected, dtype=torch.int32, device=q.device)
    npad = triton.next_power_of_2(params.num_selected)
    tokens = npad * params.sel_block // params.cmp_stride
    _select_kernel[(num_tiles, B * H)](
        q, k_cmp, lse_cmp, idx, start, end, seq_start, cmp_start,
        *_strides(q), *_strides(k_cmp), *lse_cmp.stride()[:2], *_strides(idx),
        H, scale * LOG2E,
        G=G, DK=Dk, BLOCK_DK=_pow2(Dk), BLOCK_R=R, NUM_SELECTED=params.num_selected, NPAD=npad,
        TOK=tokens, TOK_PAD=_pow2(tokens), CMP_BLOCK=params.cmp_block,
        CMP_STRIDE=params.cmp_stride, SEL_BLOCK=params.sel_block, NUM_INIT=params.num_init,
        NUM_LOCAL=params.num_local, IEEE=q.dtype == torch.float32, **launch,
    )
    return idx


def _selected_meta(q, k, v, params):
    B, T, HQ, H, G, Dk, Dv = _common(q, k, v)
    return dict(G=G, DK=Dk, DV=Dv, BLOCK_DK=_pow2(Dk), BLOCK_DV=_pow2(Dv),
                NUM_SELECTED=params.num_selected, NPAD=triton.next_power_of_2(params.num_selected),
                SEL_BLOCK=params.sel_block, BLOCK_S=_pow2(params.sel_block),
                IEEE=q.dtype == torch.float32)


def selected_forward(q, k, v, idx, layout, params, scale):
    B, T, HQ, H, G, Dk, Dv = _common(q, k, v)
    meta = _selected_meta(q, k, v, params)
    R, launch = _launch("selected_fwd", G, max(Dk, Dv))
    num_tiles, start, end, seq_start, _ = tile_table(layout, T, R // G)
    o = torch.empty(B, T, HQ, Dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, T, HQ, dtype=torch.float32, device=q.device)
    _selected_fwd_kernel[(num_tiles, B * H)](
        q, k, v, idx, o, lse, start, end, seq_start,
        *_strides(q), *_strides(k), *_strides(v), *_strides(idx), *_strides(o),
        *lse.stride()[:2], H, scale * LOG2E, BLOCK_R=R, **meta, **launch,
    )
    return o, lse


def _inverse_index(idx, layout, params):
    """For each (b, h, global block): the positions that selected it, as CSR (offsets, pos)."""
    B, T, H, n = idx.shape
    lengths = layout.seq_ends - layout.seq_starts
    blocks_per_seq = (lengths + params.sel_block - 1) // params.sel_block
    block_first = torch.cumsum(blocks_per_seq, 0) - blocks_per_seq
    num_global = triton.cdiv(T, params.sel_block) + len(lengths)  # a bound known on the host
    seq = torch.searchsorted(layout.seq_ends, torch.arange(T, device=idx.device), right=True)
    gblock = block_first[seq].view(1, T, 1, 1) + idx.long()  # [B, T, H, n]
    bh = (torch.arange(B, device=idx.device).view(B, 1, 1, 1) * H
          + torch.arange(H, device=idx.device).view(1, 1, H, 1))
    list_id = torch.where(idx >= 0, bh * num_global + gblock, B * H * num_global)
    order = torch.sort(list_id.flatten(), stable=True)
    positions = torch.arange(T, device=idx.device).view(1, T, 1, 1).expand(B, T, H, n).flatten()
    entry_pos = positions[order.indices].to(torch.int32).contiguous()
    boundaries = torch.arange(B * H * num_global + 1, device=idx.device)
    offsets = torch.searchsorted(order.values, boundaries).to(torch.int32).contiguous()
    # Token range of every global block (blocks past the last one are empty).
    g = torch.arange(num_global, device=idx.device)
    block_seq = torch.searchsorted(block_first + blocks_per_seq, g, right=True).clamp_max(
        len(lengths) - 1)
    block_start = layout.seq_starts[block_seq] + (g - block_first[block_seq]) * params.sel_block
    used = g < (block_first + blocks_per_seq)[-1]
    block_end = torch.where(used, torch.minimum(block_start + params.sel_block,
                                                layout.seq_ends[block_seq]), block_start)
    return (num_global, block_start.to(torch.int32).contiguous(),
            block_end.to(torch.int32).contiguous(), offsets, entry_pos)


def selected_backward(q, k, v, idx, do, lse, delta, dq, layout, params, scale):
    B, T, HQ, H, G, Dk, Dv = _common(q, k, v)
    meta = _selected_meta(q, k, v, params)
    R, launch = _launch("selected_dq", G, max(Dk, Dv))
    num_tiles, start, end, seq_start, _ = tile_table(layout, T, R // G)
    strides_qkv = (*_strides(q), *_strides(k), *_strides(v))
    _selected_bwd_dq_kernel[(num_tiles, B * H)](
        q, k, v, idx, do, lse, delta, dq, start, end, seq_start,
        *strides_qkv, *_strides(idx), *_strides(do), *lse.stride()[:2],
        H, scale * LOG2E, scale, BLOCK_R=R, **meta, **launch,
    )
    num_global, block_start, block_end, offsets, entry_pos = _inverse_index(idx, layout, params)
    # Split every block's list of positions into segments of at most SELECTED_SEGMENT entries.
    counts = (offsets[1:] - offsets[:-1]).long()  # [num_lists]
    seg_count = (counts + SELECTED_SEGMENT - 1) // SELECTED_SEGMENT
    seg_first = torch.cumsum(seg_count, 0) - seg_count
    num_segments = idx.numel() // SELECTED_SEGMENT + counts.numel()  # bound known on the host
    k_seg = torch.arange(num_segments, device=q.device)
    seg_list = torch.searchsorted(seg_first + seg_count, k_seg, right=True).clamp_max(
        counts.numel() - 1)
    seg_lo = offsets[seg_list].long() + (k_seg - seg_first[seg_list]) * SELECTED_SEGMENT
    seg_hi = torch.minimum(seg_lo + SELECTED_SEGMENT, offsets[seg_list + 1].long())
    i32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
    bs, bdk, bdv = meta["BLOCK_S"], meta["BLOCK_DK"], meta["BLOCK_DV"]
    dk_part = torch.empty(num_segments * bs, bdk, dtype=torch.float32, device=q.device)
    dv_part = torch.empty(num_segments * bs, bdv, dtype=torch.float32, device=q.device)
    R, launch = _launch("selected_dkdv", G, max(Dk, Dv))
    _selected_bwd_dkdv_kernel[(num_segments,)](
        q, k, v, do, lse, delta, dk_part, dv_part, block_start, block_end,
        i32(seg_list), i32(seg_lo), i32(seg_hi), entry_pos,
        *strides_qkv, *_strides(do), *lse.stride()[:2],
        H, num_global, scale * LOG2E, scale,
        G=G, DK=Dk, DV=Dv, BLOCK_DK=bdk, BLOCK_DV=bdv, BLOCK_R=R, BLOCK_S=bs,
        IEEE=meta["IEEE"], **launch,
    )
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for part, out, D, bd in ((dk_part, dk, Dk, bdk), (dv_part, dv, Dv, bdv)):
        _sum_segments_kernel[(counts.numel(),)](
            part, out, block_start, block_end, i32(seg_first), i32(seg_count),
            *_strides(out), H, num_global, D=D, BLOCK_D=bd, BLOCK_S=bs,
        )
    return dk, dv


class NSAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_cmp, v_cmp, gates, k_win, v_win, params, scale, cu_seqlens):
        q, k, v, k_cmp, v_cmp, gates, k_win, v_win = (
            x.contiguous() for x in (q, k, v, k_cmp, v_cmp, gates, k_win, v_win))
        layout = build_layout(q.shape[1], k_cmp.shape[1], cu_seqlens, params, q.device)
        o_cmp, lse_cmp = branch_forward(q, k_cmp, v_cmp, layout, MODE_CMP, params, scale)
        idx = select(q, k_cmp, lse_cmp, layout, params, scale)
        o_slc, lse_slc = selected_forward(q, k, v, idx, layout, params, scale)
        o_win, lse_win = branch_forward(q, k_win, v_win, layout, MODE_WIN, params, scale)
        g = gates.float()
        out = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win
        ctx.save_for_backward(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, idx, o_cmp, o_slc,
                              o_win, lse_cmp, lse_slc, lse_win)
        ctx.layout, ctx.params, ctx.scale = layout, params, scale
        ctx.mark_non_differentiable()
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (q, k, v, k_cmp, v_cmp, gates, k_win, v_win, idx, o_cmp, o_slc, o_win, lse_cmp, lse_slc,
         lse_win) = ctx.saved_tensors
        layout, params, scale = ctx.layout, ctx.params, ctx.scale
        do = grad_out.float().contiguous()
        g = gates.float()
        dgates = torch.stack([(do * o).sum(-1) for o in (o_cmp, o_slc, o_win)], dim=-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grads = []
        for i, (o, lse) in enumerate(((o_cmp, lse_cmp), (o_slc, lse_slc), (o_win, lse_win))):
            do_branch = (g[..., i:i + 1] * do).contiguous()
            # The kernels read do in the input dtype: delta must use the same rounded values, or
            # p·(dp − delta) leaves a rounding residue where it should cancel exactly.
            delta = (do_branch.to(q.dtype).float() * o).sum(-1).contiguous()
            if i == 0:
                grads.append(branch_backward(q, k_cmp, v_cmp, do_branch, lse, delta, dq, layout,
                                             MODE_CMP, params, scale))
            elif i == 1:
                grads.append(selected_backward(q, k, v, idx, do_branch, lse, delta, dq, layout,
                                               params, scale))
            else:
                grads.append(branch_backward(q, k_win, v_win, do_branch, lse, delta, dq, layout,
                                             MODE_WIN, params, scale))
        (dk_cmp, dv_cmp), (dk, dv), (dk_win, dv_win) = grads
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dk_cmp.to(k_cmp.dtype),
                dv_cmp.to(v_cmp.dtype), dgates.to(gates.dtype), dk_win.to(k_win.dtype),
                dv_win.to(v_win.dtype), None, None, None)


def nsa_attention_triton(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, params: NSAParams,
                         scale: float, cu_seqlens=None) -> torch.Tensor:
    return NSAFunction.apply(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, params, scale,
                             cu_seqlens)


def nsa_select_triton(q, k_cmp, params: NSAParams, scale: float, cu_seqlens=None):
    q, k_cmp = q.contiguous(), k_cmp.contiguous()
    layout = build_layout(q.shape[1], k_cmp.shape[1], cu_seqlens, params, q.device)
    # Only the log-sum-exp of the compressed branch is needed; its output is discarded.
    _, lse = branch_forward(q, k_cmp, k_cmp[..., :1], layout, MODE_CMP, params, scale)
    return select(q, k_cmp, lse, layout, params, scale).long()

