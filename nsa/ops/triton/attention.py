"""Launch wrappers and the torch.library ops (forward, backward, selection) of the Triton backend.

Forward: compressed attention (keeps its log-sum-exp) -> selection (reuses it) -> selected
attention -> window attention -> gated sum. Each branch output is kept in float32 for the
backward, which runs one dq and one dk/dv kernel per branch (deterministic: no atomics).
Per-token and per-tile tables (positions, sequence bounds, tile starts) are built on the device
with vectorised PyTorch, so nothing reads a tensor value on the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton

from nsa.ops.layout import SequenceLayout, expand_counts
from nsa.ops.params import LOG2E, NSAParams
from nsa.ops.triton.dense_branches import (
    MODE_CMP,
    MODE_WIN,
    _branch_bwd_dkdv_kernel,
    _branch_bwd_dq_kernel,
    _branch_fwd_kernel,
)
from nsa.ops.triton.gating import _gate_backward_kernel, _gated_sum_kernel
from nsa.ops.triton.selection import (
    _select_kernel,
    _selected_bwd_dkdv_kernel,
    _selected_bwd_dq_kernel,
    _selected_fwd_kernel,
    _sum_segments_kernel,
)

BLOCK_N = 64  # keys per step of the compressed and window kernels
SELECTED_SEGMENT = 256  # most (position) entries one selected-branch dK/dV program handles
CMP_SEGMENT = 4096  # most query positions one compressed-branch dK/dV program handles
MIN_SEGMENT = 256  # fewest query positions a dK/dV segment is cut down to (to fill the GPU)
GATE_ROWS = 16  # rows per program of the gating kernels

# Launch shapes per kernel family: rows (position x head pairs) per tile and warps. Rows grow
# to the next power of two >= G when a group is larger. Measured choices: see bench/NOTES.md.
TUNING = {
    "dense_fwd": dict(rows=128, num_warps=4, num_stages=2),
    "dense_dq": dict(rows=128, num_warps=8, num_stages=2),
    "dense_dkdv": dict(rows=128, num_warps=8, num_stages=2),
    "select": dict(rows=64, num_warps=4, num_stages=1),  # rows: positions (heads looped)
    "selected_fwd": dict(rows=16, num_warps=4, num_stages=2),  # rows: the G heads of a position
    "selected_dq": dict(rows=16, num_warps=4, num_stages=2),
    "selected_dkdv": dict(rows=64, num_warps=4, num_stages=2),
}


def _pow2(x: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(x))


@dataclass
class KernelTables:
    """Int32 tables the kernels read, from a :class:`SequenceLayout`."""

    layout: SequenceLayout
    tok_pos: torch.Tensor  # [T] position within its sequence
    tok_cmp_start: torch.Tensor  # [T] packed index of its sequence's first compressed token
    tok_t_hi: torch.Tensor  # [T] last query (exclusive) whose window sees this token
    cmp_t_lo: torch.Tensor  # [Tc] first query that sees this compressed token
    cmp_t_hi: torch.Tensor  # [Tc] end (exclusive) of its sequence
    memo: dict = field(default_factory=dict)  # derived tables, built on first use


def _i32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int32).contiguous()


def build_tables(T: int, Tc: int, cu_seqlens, params: NSAParams, device) -> KernelTables:
    """The tables of a batch; those of unpacked batches (no ``cu_seqlens``) depend on shapes
    only and are built once per (T, Tc, params, device)."""
    if cu_seqlens is None:
        return _unpacked_tables(T, Tc, params, device)
    return _build_tables(T, Tc, cu_seqlens, params, device)


@functools.lru_cache(maxsize=64)
def _unpacked_tables(T: int, Tc: int, params: NSAParams, device) -> KernelTables:
    return _build_tables(T, Tc, None, params, device)


def _build_tables(T: int, Tc: int, cu_seqlens, params: NSAParams, device) -> KernelTables:
    layout = SequenceLayout(T, Tc, cu_seqlens, params, device)
    t = torch.arange(T, device=device)
    cmp_seq_start = layout.starts[layout.cmp_seq]
    return KernelTables(
        layout=layout,
        tok_pos=_i32(layout.pos),
        tok_cmp_start=_i32(layout.cmp_starts[layout.seq]),
        tok_t_hi=_i32(torch.minimum(t + params.window, layout.ends[layout.seq])),
        cmp_t_lo=_i32(cmp_seq_start + layout.cmp_idx * params.cmp_stride + params.cmp_block - 1),
        cmp_t_hi=_i32(layout.ends[layout.cmp_seq]),
    )


def tile_table(tables: KernelTables, T: int, positions_per_tile: int):
    """Tiles of ``positions_per_tile`` positions that never straddle two sequences.

    The count is bounded by cdiv(T, P) + N (a shape, known without a sync); unused tiles are
    empty (start == end).
    """
    if ("tiles", positions_per_tile) in tables.memo:
        return tables.memo["tiles", positions_per_tile]
    layout, P = tables.layout, positions_per_tile
    num_tiles = triton.cdiv(T, P) + layout.starts.numel()
    tiles_per_seq = (layout.ends - layout.starts + P - 1) // P
    seq, index, used = expand_counts(tiles_per_seq, num_tiles)
    start = layout.starts[seq] + index * P
    end = torch.where(used, layout.ends[seq], start)
    tiles = (num_tiles, _i32(start), _i32(end), _i32(layout.starts[seq]),
             _i32(layout.cmp_starts[seq]))
    tables.memo["tiles", P] = tiles
    return tiles


def _launch(kind: str, G: int, head_dim: int):
    """(rows per tile, launch options) for a kernel family; rows >= G, a power of two >= 16.

    Head dims above 128 (padded to 256) halve the rows and drop software pipelining so the
    tiles fit in shared memory."""
    tuning = TUNING[kind]
    rows, stages = tuning["rows"], tuning["num_stages"]
    if _pow2(head_dim) > 128:
        rows, stages = rows // 2, 1
    return max(rows, _pow2(G, 16)), dict(num_warps=tuning["num_warps"], num_stages=stages)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 for the interpreter on the CPU)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _dkdv_segment(T: int, programs: int, device: torch.device, longest: int) -> int:
    """Query positions per dK/dV segment: at most ``longest``, fewer (not below MIN_SEGMENT)
    when ``programs`` key tiles alone would leave SMs idle (aim: two programs per SM)."""
    wanted = triton.cdiv(2 * _num_sms(device), max(programs, 1))
    return max(1, min(longest, max(MIN_SEGMENT, triton.cdiv(T, wanted))))


def _strides(x: torch.Tensor, n: int = 3):
    return x.stride()[:n]


def _common(q, k, v):
    B, T, HQ, Dk = q.shape
    H, Dv = k.shape[2], v.shape[3]
    G = HQ // H
    return B, T, HQ, H, G, Dk, Dv


def branch_forward(q, k, v, tables, mode, params, scale):
    """Compressed (mode CMP: k, v compressed) or window (mode WIN) attention -> (o, lse2)."""
    B, T, HQ, H, G, Dk, Dv = _common(q, k, v)
    o = torch.empty(B, T, HQ, Dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, T, HQ, dtype=torch.float32, device=q.device)
    R, launch = _launch("dense_fwd", G, max(Dk, Dv))
    grid = (triton.cdiv(T, R // G), B * H)
    _branch_fwd_kernel[grid](
        q, k, v, o, lse, tables.tok_pos, tables.tok_cmp_start,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o), *lse.stride()[:2],
        T, k.shape[1], H, scale * LOG2E,
        G=G, DK=Dk, DV=Dv, BLOCK_DK=_pow2(Dk), BLOCK_DV=_pow2(Dv), BLOCK_R=R, BLOCK_N=BLOCK_N,
        MODE=mode, WINDOW=params.window, CMP_BLOCK=params.cmp_block,
        CMP_STRIDE=params.cmp_stride, IEEE=q.dtype == torch.float32, **launch,
    )
    return o, lse


def branch_backward(q, k, v, do, lse, delta, dq, tables, mode, params, scale):
    """Adds this branch's dq into ``dq`` (float32) and returns (dk, dv) in float32."""
    B, T, HQ, H, G, Dk, Dv = _common(q, k, v)
    NK = k.shape[1]
    meta = dict(G=G, DK=Dk, DV=Dv, BLOCK_DK=_pow2(Dk), BLOCK_DV=_pow2(Dv),
                BLOCK_N=BLOCK_N, MODE=mode, WINDOW=params.window, CMP_BLOCK=params.cmp_block,
                CMP_STRIDE=params.cmp_stride, IEEE=q.dtype == torch.float32)
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(do), *lse.stride()[:2])
    R, launch = _launch("dense_dq", G, max(Dk, Dv))
    _branch_bwd_dq_kernel[(triton.cdiv(T, R // G), B * H)](
        q, k, v, do, lse, delta, dq, tables.tok_pos, tables.tok_cmp_start, *strides,
        T, NK, H, scale * LOG2E, scale, BLOCK_R=R, **meta, **launch,
    )
    # A compressed key is seen by every later query: split the queries into segments so the
    # first key tiles do not run alone; window keys are seen by at most w queries, and are
    # split only when there are too few key tiles to fill the GPU (short T, small B * H).
    segment = _dkdv_segment(T, triton.cdiv(NK, BLOCK_N) * B * H, q.device,
                            CMP_SEGMENT if mode == MODE_CMP else T)
    segments = triton.cdiv(T, segment)
    dk = torch.empty(segments, *k.shape, dtype=torch.float32, device=q.device)
    dv = torch.empty(segments, *v.shape, dtype=torch.float32, device=q.device)
    if mode == MODE_CMP:
        t_lo, t_hi = tables.cmp_t_lo, tables.cmp_t_hi
    else:
        t_lo, t_hi = torch.arange(T, device=q.device, dtype=torch.int32), tables.tok_t_hi
    if NK:
        R, launch = _launch("dense_dkdv", G, max(Dk, Dv))
        _branch_bwd_dkdv_kernel[(triton.cdiv(NK, BLOCK_N), B * H, segments)](
            q, k, v, do, lse, delta, dk, dv, tables.tok_pos, tables.tok_cmp_start,
            t_lo, t_hi, *strides, *dk.stride()[1:4], *dv.stride()[1:4], dk.stride(0),
            dv.stride(0), T, NK, H, segment, scale * LOG2E,
            scale, BLOCK_R=R, **meta, **launch,
        )
    return dk.sum(0), dv.sum(0)


def select(q, k_cmp, lse_cmp, tables, params, scale):
    """[B, T, H, n] int32 selected blocks (ascending, -1 padded) from the compressed lse."""
    B, T, HQ, H, G, Dk, _ = _common(q, k_cmp, k_cmp)
    tuning = TUNING["select"]
    P = tuning["rows"]
    num_tiles, start, end, seq_start, cmp_start = tile_table(tables, T, P)
    idx = torch.empty(B, T, H, params.num_selected, dtype=torch.int32, device=q.device)
    # Blocks per step: the top-n width, or up to 32 blocks of at most 128 compressed tokens
    # when that is more (wider steps overflow shared memory with the overlap weights).
    tokens_per_block = params.sel_block // params.cmp_stride
    blocks_per_step = max(triton.next_power_of_2(params.num_selected),
                          min(32, triton.next_power_of_2(max(1, 128 // tokens_per_block))))
    tokens = blocks_per_step * tokens_per_block
    _select_kernel[(num_tiles, B * H)](
        q, k_cmp, lse_cmp, idx, start, end, seq_start, cmp_start,
        *_strides(q), *_strides(k_cmp), *lse_cmp.stride()[:2], *_strides(idx),
        H, scale * LOG2E,
        G=G, DK=Dk, BLOCK_DK=_pow2(Dk), BLOCK_P=P, NUM_SELECTED=params.num_selected,
        BJ=blocks_per_step, TOK=tokens, TOK_PAD=_pow2(tokens), CMP_BLOCK=params.cmp_block,
        CMP_STRIDE=params.cmp_stride, SEL_BLOCK=params.sel_block, NUM_INIT=params.num_init,
        NUM_LOCAL=params.num_local, IEEE=q.dtype == torch.float32,
        num_warps=tuning["num_warps"], num_stages=1 if _pow2(Dk) > 128 else tuning["num_stages"],
    )
    return idx


def _selected_meta(q, k, v, params):
    B, T, HQ, H, G, Dk, Dv = _common(q, k, v)
    return dict(G=G, DK=Dk, DV=Dv, BLOCK_DK=_pow2(Dk), BLOCK_DV=_pow2(Dv),
                NUM_SELECTED=params.num_selected, SEL_BLOCK=params.sel_block,
                BLOCK_S=_pow2(params.sel_block), IEEE=q.dtype == torch.float32)


def _selected_launch(kind: str, q, k, v, params) -> dict:
    """Meta-parameters and launch options of the selected forward or dq (one program per
    position and KV head; no pipelining stages for head dims above 128: shared memory)."""
    B, T, HQ, H, G, Dk, Dv = _common(q, k, v)
    tuning = TUNING[f"selected_{kind}"]
    stages = 1 if _pow2(max(Dk, Dv)) > 128 else tuning["num_stages"]
    return dict(_selected_meta(q, k, v, params), BLOCK_G=_pow2(G),
                num_warps=tuning["num_warps"], num_stages=stages)


def selected_forward(q, k, v, idx, tables, params, scale):
    B, T, HQ, H, G, Dk, Dv = _common(q, k, v)
    o = torch.empty(B, T, HQ, Dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, T, HQ, dtype=torch.float32, device=q.device)
    _selected_fwd_kernel[(T, B * H)](
        q, k, v, idx, o, lse, tables.tok_pos,
        *_strides(q), *_strides(k), *_strides(v), *_strides(idx), *_strides(o),
        *lse.stride()[:2], H, scale * LOG2E, **_selected_launch("fwd", q, k, v, params),
    )
    return o, lse


def _selection_blocks(tables: KernelTables, params: NSAParams, B: int, H: int):
    """Layout-only parts of the inverse index, built once per tables: the number of global
    blocks (a host-known bound), each sequence's first global block, the token range of every
    global block (blocks past the last one are empty), list ids of (b, h) and list boundaries."""
    key = ("blocks", B, H)
    if key not in tables.memo:
        layout = tables.layout
        device = layout.starts.device
        T = layout.seq.numel()
        blocks_per_seq = (layout.ends - layout.starts + params.sel_block - 1) // params.sel_block
        block_first = torch.cumsum(blocks_per_seq, 0) - blocks_per_seq
        num_global = triton.cdiv(T, params.sel_block) + layout.starts.numel()
        block_seq, index, used = expand_counts(blocks_per_seq, num_global)
        block_start = layout.starts[block_seq] + index * params.sel_block
        block_end = torch.where(used, torch.minimum(block_start + params.sel_block,
                                                    layout.ends[block_seq]), block_start)
        bh = (torch.arange(B, device=device).view(B, 1, 1, 1) * H
              + torch.arange(H, device=device).view(1, 1, H, 1))  # [B, 1, H, 1]
        seq_first_block = block_first[layout.seq].view(1, T, 1, 1)
        tables.memo[key] = (num_global, seq_first_block, _i32(block_start), _i32(block_end),
                            bh * num_global, torch.arange(B * H * num_global + 1, device=device))
    return tables.memo[key]


def _inverse_index(idx, tables, params):
    """For each (b, h, global block): the positions that selected it, as CSR (offsets, pos)."""
    B, T, H, n = idx.shape
    num_global, seq_first_block, block_start, block_end, list_base, boundaries = (
        _selection_blocks(tables, params, B, H))
    list_id = torch.where(idx >= 0, list_base + seq_first_block + idx, B * H * num_global)
    order = torch.sort(list_id.flatten(), stable=True)
    entry_pos = _i32(order.indices // (H * n) % T)  # flat index (b, t, h, slot) -> t
    offsets = _i32(torch.searchsorted(order.values, boundaries))
    return num_global, block_start, block_end, offsets, entry_pos


def selected_backward(q, k, v, idx, do, lse, delta, dq, tables, params, scale):
    B, T, HQ, H, G, Dk, Dv = _common(q, k, v)
    meta = _selected_meta(q, k, v, params)
    strides_qkv = (*_strides(q), *_strides(k), *_strides(v))
    _selected_bwd_dq_kernel[(T, B * H)](
        q, k, v, idx, do, lse, delta, dq, tables.tok_pos,
        *strides_qkv, *_strides(idx), *_strides(do), *lse.stride()[:2],
        H, scale * LOG2E, scale, **_selected_launch("dq", q, k, v, params),
    )
    num_global, block_start, block_end, offsets, entry_pos = _inverse_index(idx, tables, params)
    # Split every block's list of positions into segments of at most SELECTED_SEGMENT entries.
    counts = (offsets[1:] - offsets[:-1]).long()  # [num_lists]
    seg_count = (counts + SELECTED_SEGMENT - 1) // SELECTED_SEGMENT
    seg_first = torch.cumsum(seg_count, 0) - seg_count
    num_segments = idx.numel() // SELECTED_SEGMENT + counts.numel()  # bound known on the host
    seg_list, index, _ = expand_counts(seg_count, num_segments)
    seg_lo = offsets[seg_list].long() + index * SELECTED_SEGMENT
    seg_hi = torch.minimum(seg_lo + SELECTED_SEGMENT, offsets[seg_list + 1].long())
    bs, bdk, bdv = meta["BLOCK_S"], meta["BLOCK_DK"], meta["BLOCK_DV"]
    dk_part = torch.empty(num_segments * bs, bdk, dtype=torch.float32, device=q.device)
    dv_part = torch.empty(num_segments * bs, bdv, dtype=torch.float32, device=q.device)
    R, launch = _launch("selected_dkdv", G, max(Dk, Dv))
    _selected_bwd_dkdv_kernel[(num_segments,)](
        q, k, v, do, lse, delta, dk_part, dv_part, block_start, block_end,
        _i32(seg_list), _i32(seg_lo), _i32(seg_hi), entry_pos,
        *strides_qkv, *_strides(do), *lse.stride()[:2],
        H, num_global, scale * LOG2E, scale,
        G=G, DK=Dk, DV=Dv, BLOCK_DK=bdk, BLOCK_DV=bdv, BLOCK_R=R, BLOCK_S=bs,
        IEEE=meta["IEEE"], **launch,
    )
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for part, out, D, bd in ((dk_part, dk, Dk, bdk), (dv_part, dv, Dv, bdv)):
        _sum_segments_kernel[(counts.numel(),)](
            part, out, block_start, block_end, _i32(seg_first), _i32(seg_count),
            *_strides(out), H, num_global, D=D, BLOCK_D=bd, BLOCK_S=bs,
        )
    return dk, dv


def _forward(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, params: NSAParams, scale: float,
             cu_seqlens):
    """-> (out, idx, o_cmp, o_slc, o_win, lse_cmp, lse_slc, lse_win); all but ``out`` are what
    the backward reads (branch outputs in float32, log-sum-exps, selected blocks)."""
    tables = build_tables(q.shape[1], k_cmp.shape[1], cu_seqlens, params, q.device)
    o_cmp, lse_cmp = branch_forward(q, k_cmp, v_cmp, tables, MODE_CMP, params, scale)
    idx = select(q, k_cmp, lse_cmp, tables, params, scale)
    o_slc, lse_slc = selected_forward(q, k, v, idx, tables, params, scale)
    o_win, lse_win = branch_forward(q, k_win, v_win, tables, MODE_WIN, params, scale)
    out = torch.empty(o_cmp.shape, dtype=q.dtype, device=q.device)
    N, Dv = out.numel() // out.shape[-1], out.shape[-1]
    _gated_sum_kernel[(triton.cdiv(N, GATE_ROWS),)](
        o_cmp, o_slc, o_win, gates, out, N, DV=Dv, BLOCK_D=_pow2(Dv), ROWS=GATE_ROWS)
    return out, idx, o_cmp, o_slc, o_win, lse_cmp, lse_slc, lse_win


def _backward(grad_out, q, k, v, k_cmp, v_cmp, gates, k_win, v_win, idx, o_cmp, o_slc, o_win,
              lse_cmp, lse_slc, lse_win, params: NSAParams, scale: float, cu_seqlens):
    """-> gradients of (q, k, v, k_cmp, v_cmp, gates, k_win, v_win), in their dtypes."""
    tables = build_tables(q.shape[1], k_cmp.shape[1], cu_seqlens, params, q.device)
    N, Dv = o_cmp.numel() // o_cmp.shape[-1], o_cmp.shape[-1]
    do_branch = torch.empty(3, *o_cmp.shape, dtype=q.dtype, device=q.device)  # [3, B, T, HQ, Dv]
    delta = torch.empty(3, *o_cmp.shape[:-1], dtype=torch.float32, device=q.device)
    dgates = torch.empty(gates.shape, dtype=torch.float32, device=q.device)
    _gate_backward_kernel[(triton.cdiv(N, GATE_ROWS),)](
        grad_out, gates, o_cmp, o_slc, o_win, *do_branch, *delta, dgates, N, DV=Dv,
        BLOCK_D=_pow2(Dv), ROWS=GATE_ROWS)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grads = (
        branch_backward(q, k_cmp, v_cmp, do_branch[0], lse_cmp, delta[0], dq, tables, MODE_CMP,
                        params, scale),
        selected_backward(q, k, v, idx, do_branch[1], lse_slc, delta[1], dq, tables, params,
                          scale),
        branch_backward(q, k_win, v_win, do_branch[2], lse_win, delta[2], dq, tables, MODE_WIN,
                        params, scale),
    )
    (dk_cmp, dv_cmp), (dk, dv), (dk_win, dv_win) = grads
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dk_cmp.to(k_cmp.dtype),
            dv_cmp.to(v_cmp.dtype), dgates.to(gates.dtype), dk_win.to(k_win.dtype),
            dv_win.to(v_win.dtype))


# The op is registered with torch.library so torch.compile traces it as one opaque node (no
# graph break) with shapes from the fake implementations. Block parameters travel as ints.
PARAM_NAMES = ("cmp_block", "cmp_stride", "sel_block", "num_selected", "window", "num_init",
               "num_local")


@torch.library.custom_op("nsa::attention_fwd", mutates_args=())
def attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cmp: torch.Tensor,
                     v_cmp: torch.Tensor, gates: torch.Tensor, k_win: torch.Tensor,
                     v_win: torch.Tensor, cu_seqlens: torch.Tensor | None, cmp_block: int,
                     cmp_stride: int, sel_block: int, num_selected: int, window: int,
                     num_init: int, num_local: int, scale: float) -> list[torch.Tensor]:
    params = NSAParams(cmp_block, cmp_stride, sel_block, num_selected, window, num_init,
                       num_local)
    tensors = (x.contiguous() for x in (q, k, v, k_cmp, v_cmp, gates, k_win, v_win))
    return list(_forward(*tensors, params, scale, cu_seqlens))


@attention_fwd_op.register_fake
def _(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, cu_seqlens, cmp_block, cmp_stride, sel_block,
      num_selected, window, num_init, num_local, scale):
    B, T, HQ, _ = q.shape
    H, Dv = k.shape[2], v.shape[3]
    branch_out = q.new_empty(B, T, HQ, Dv, dtype=torch.float32)
    lse = q.new_empty(B, T, HQ, dtype=torch.float32)
    idx = q.new_empty(B, T, H, num_selected, dtype=torch.int32)
    return [q.new_empty(B, T, HQ, Dv), idx, branch_out, torch.empty_like(branch_out),
            torch.empty_like(branch_out), lse, torch.empty_like(lse), torch.empty_like(lse)]


@torch.library.custom_op("nsa::attention_bwd", mutates_args=())
def attention_bwd_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     k_cmp: torch.Tensor, v_cmp: torch.Tensor, gates: torch.Tensor,
                     k_win: torch.Tensor, v_win: torch.Tensor, idx: torch.Tensor,
                     o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor,
                     lse_cmp: torch.Tensor, lse_slc: torch.Tensor, lse_win: torch.Tensor,
                     cu_seqlens: torch.Tensor | None, cmp_block: int, cmp_stride: int,
                     sel_block: int, num_selected: int, window: int, num_init: int,
                     num_local: int, scale: float) -> list[torch.Tensor]:
    params = NSAParams(cmp_block, cmp_stride, sel_block, num_selected, window, num_init,
                       num_local)
    inputs = (x.contiguous() for x in (q, k, v, k_cmp, v_cmp, gates, k_win, v_win))
    return list(_backward(grad_out.contiguous(), *inputs, idx, o_cmp, o_slc, o_win, lse_cmp,
                          lse_slc, lse_win, params, scale, cu_seqlens))


@attention_bwd_op.register_fake
def _(grad_out, q, k, v, k_cmp, v_cmp, gates, k_win, v_win, *saved_and_params):
    return [torch.empty_like(x) for x in (q, k, v, k_cmp, v_cmp, gates, k_win, v_win)]


def _setup_context(ctx, inputs, output):
    (q, k, v, k_cmp, v_cmp, gates, k_win, v_win, cu_seqlens, *params, scale) = inputs
    _, *saved = output
    ctx.save_for_backward(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, *saved)
    ctx.cu_seqlens, ctx.params, ctx.scale = cu_seqlens, params, scale


def _attention_grad(ctx, grad_outputs):
    grads = attention_bwd_op(grad_outputs[0], *ctx.saved_tensors, ctx.cu_seqlens, *ctx.params,
                             ctx.scale)
    return (*grads, None, *(None for _ in PARAM_NAMES), None)


attention_fwd_op.register_autograd(_attention_grad, setup_context=_setup_context)


@torch.library.custom_op("nsa::select", mutates_args=())
def select_op(q: torch.Tensor, k_cmp: torch.Tensor, cu_seqlens: torch.Tensor | None,
              cmp_block: int, cmp_stride: int, sel_block: int, num_selected: int, num_init: int,
              num_local: int, scale: float) -> torch.Tensor:
    params = NSAParams(cmp_block, cmp_stride, sel_block, num_selected, num_init=num_init,
                       num_local=num_local)
    q, k_cmp = q.contiguous(), k_cmp.contiguous()
    tables = build_tables(q.shape[1], k_cmp.shape[1], cu_seqlens, params, q.device)
    # Only the log-sum-exp of the compressed branch is needed; its output is discarded.
    _, lse = branch_forward(q, k_cmp, k_cmp[..., :1], tables, MODE_CMP, params, scale)
    return select(q, k_cmp, lse, tables, params, scale).long()


@select_op.register_fake
def _(q, k_cmp, cu_seqlens, cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local,
      scale):
    B, T, _, _ = q.shape
    return q.new_empty(B, T, k_cmp.shape[2], num_selected, dtype=torch.long)


def nsa_attention_triton(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, params: NSAParams,
                         scale: float, cu_seqlens=None) -> torch.Tensor:
    values = [getattr(params, name) for name in PARAM_NAMES]
    return attention_fwd_op(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, cu_seqlens, *values,
                            scale)[0]


def nsa_select_triton(q, k_cmp, params: NSAParams, scale: float, cu_seqlens=None):
    return select_op(q, k_cmp, cu_seqlens, params.cmp_block, params.cmp_stride, params.sel_block,
                     params.num_selected, params.num_init, params.num_local, scale)
