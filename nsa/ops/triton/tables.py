"""Int32 tables the Triton kernels read (token positions, sequence bounds, tile starts), built on
the device with vectorised PyTorch from a :class:`SequenceLayout`: nothing reads a tensor value
on the host. Tables of unpacked batches depend on shapes only and are cached."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from nsa.ops.layout import SequenceLayout, expand_counts
from nsa.ops.params import NSAParams
from nsa.ops.triton.launch import cdiv


@dataclass
class KernelTables:
    """Int32 tables the kernels read, from a :class:`SequenceLayout`."""

    layout: SequenceLayout
    packed: bool  # built from cu_seqlens (else one sequence of T tokens per batch row)
    tok_pos: torch.Tensor  # [T] position within its sequence
    tok_cmp_start: torch.Tensor  # [T] packed index of its sequence's first compressed token
    tok_t_hi: torch.Tensor  # [T] last query (exclusive) whose window sees this token
    tok_index: torch.Tensor  # [T] its own index t (the first query that sees it)
    cmp_t_lo: torch.Tensor  # [Tc] first query that sees this compressed token
    cmp_t_hi: torch.Tensor  # [Tc] end (exclusive) of its sequence
    memo: dict = field(default_factory=dict)  # derived tables, built on first use


def i32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int32).contiguous()


def build_tables(T: int, Tc: int, cu_seqlens, params: NSAParams, device) -> KernelTables:
    """The tables of a batch; those of unpacked batches (no ``cu_seqlens``) depend on shapes
    only and are built once per (T, Tc, params, device) and kept for the process (a few int32
    vectors of length T each)."""
    if cu_seqlens is None:
        return _unpacked_tables(T, Tc, params, device)
    return _build_tables(T, Tc, cu_seqlens, params, device)


@functools.cache  # never evicted: a captured CUDA graph (nsa.train.graphs) reads them by address
def _unpacked_tables(T: int, Tc: int, params: NSAParams, device) -> KernelTables:
    return _build_tables(T, Tc, None, params, device)


def _build_tables(T: int, Tc: int, cu_seqlens, params: NSAParams, device) -> KernelTables:
    layout = SequenceLayout(T, Tc, cu_seqlens, params, device)
    t = torch.arange(T, device=device)
    cmp_seq_start = layout.starts[layout.cmp_seq]
    return KernelTables(
        layout=layout,
        packed=cu_seqlens is not None,
        tok_pos=i32(layout.pos),
        tok_cmp_start=i32(layout.cmp_starts[layout.seq]),
        tok_t_hi=i32(torch.minimum(t + params.window, layout.ends[layout.seq])),
        tok_index=i32(t),
        cmp_t_lo=i32(cmp_seq_start + layout.cmp_idx * params.cmp_stride + params.cmp_block - 1),
        cmp_t_hi=i32(layout.ends[layout.cmp_seq]),
    )


def tile_table(tables: KernelTables, T: int, positions_per_tile: int):
    """Tiles of ``positions_per_tile`` positions that never straddle two sequences.

    The count is bounded by cdiv(T, P) + N (a shape, known without a sync); unused tiles are
    empty (start == end).
    """
    if ("tiles", positions_per_tile) in tables.memo:
        return tables.memo["tiles", positions_per_tile]
    layout, P = tables.layout, positions_per_tile
    num_tiles = cdiv(T, P) + layout.starts.numel()
    tiles_per_seq = (layout.ends - layout.starts + P - 1) // P
    seq, index, used = expand_counts(tiles_per_seq, num_tiles)
    start = layout.starts[seq] + index * P
    end = torch.where(used, layout.ends[seq], start)
    tiles = (num_tiles, i32(start), i32(end), i32(layout.starts[seq]),
             i32(layout.cmp_starts[seq]))
    tables.memo["tiles", P] = tiles
    return tiles
