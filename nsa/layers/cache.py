"""Pre-allocated per-layer KV caches for decoding (static shapes: a step can be captured in a
CUDA graph). Positions are per sequence, so a batch may hold sequences of different lengths."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa.layers.rope import rotate
from nsa.ops.decode import window_ring_positions
from nsa.ops.triton_support import TRITON_AVAILABLE


@dataclass
class NSACache:
    """The state one NSA layer keeps between decode steps, for B sequences of capacity S.

    k, v [B, S, H, D]: keys (RoPE applied) and values by position, read by the selected branch
    (and by the window branch when K/V are shared). k_win, v_win [B, w, H, D]: ring buffers of
    the window branch's own keys/values (position p at slot p % w), or None when shared.
    src_k, src_v [B, l, H, D]: ring of the last l un-rotated compressed-branch keys/values, the
    compressor's input. k_cmp, v_cmp [B, C, H, D]: compressed tokens, appended when complete.
    projection: the layer's fused projection weight (q, K/V sets, gates; attention.py,
    ``decode_projection``), made with the cache so that a step does not concatenate the weights
    again; None: each step does.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_win: torch.Tensor | None
    v_win: torch.Tensor | None
    src_k: torch.Tensor
    src_v: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor
    projection: torch.Tensor | None = None


@dataclass
class DenseCache:
    """Keys (RoPE applied) and values by position, [B, S, H, D]; ``projection`` as in
    :class:`NSACache` (q and K/V)."""

    k: torch.Tensor
    v: torch.Tensor
    projection: torch.Tensor | None = None


def write_at(buffers: tuple[torch.Tensor, ...], index: torch.Tensor,
             values: tuple[torch.Tensor, ...], enabled: torch.Tensor | None = None) -> None:
    """buffer[b, index[b]] = value[b] for every b (where ``enabled[b]``) and every (buffer,
    value) pair of ``buffers`` and ``values`` (a key cache and its value cache), in place.

    buffer [B, N, ...], index [B] int64 in [0, N), value [B, ...]."""
    rows = torch.arange(buffers[0].shape[0], device=index.device)
    for buffer, value in zip(buffers, values, strict=True):
        value = value.to(buffer.dtype)
        if enabled is not None:
            keep = enabled.view(-1, *([1] * (value.dim() - 1)))
            value = torch.where(keep, value, buffer[rows, index])
        buffer[rows, index] = value


def split_kv_sets(kv: torch.Tensor, head_dim_k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An NSA layer's K/V projection [B, T, sets, H, Dk + Dv] -> [(k, v)] of the compressed,
    selected and window branches, each [B, T, H, D] (one set serves all three when shared):
    views, for a decode step (training splits the projection with ``split_heads``)."""
    k, v = kv.split([head_dim_k, kv.shape[-1] - head_dim_k], dim=-1)  # [B, T, sets, H, D]
    sets = list(zip(k.unbind(2), v.unbind(2)))
    return sets * 3 if len(sets) == 1 else sets


def append_kv(cache: NSACache, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              pos: torch.Tensor) -> None:
    """Write one decode step's K/V projection kv [B, 1, sets, H, Dk + Dv] at positions ``pos``
    [B] into ``cache``: the selected branch's key (rotated by cos/sin [B, 1, 1, Dk/2]) and value
    at pos, the window branch's in its ring (when it has its own), the compressor's input (as
    projected) in its ring. One Triton kernel on CUDA (nsa/ops/triton/cache_append.py),
    :func:`append_kv_torch` otherwise."""
    buffers = (cache.k, cache.v, cache.k_win, cache.v_win, cache.src_k, cache.src_v)
    if (kv.is_cuda and TRITON_AVAILABLE and cos.dtype == torch.float32
            and all(b is None or b.is_contiguous() for b in buffers)):
        from nsa.ops.triton.cache_append import append_kv_triton

        append_kv_triton(kv, cos, sin, pos, *buffers)
    else:
        append_kv_torch(kv, cos, sin, pos, *buffers)


def append_kv_torch(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, k_win: torch.Tensor | None,
                    v_win: torch.Tensor | None, src_k: torch.Tensor, src_v: torch.Tensor) -> None:
    """:func:`append_kv` in PyTorch ops (the CPU form and the reference), on the buffers of an
    :class:`NSACache`."""
    (k_src, v_src), (k_slc, v_slc), (k_ring, v_ring) = split_kv_sets(kv, k.shape[-1])
    write_at((k, v), pos, (rotate(k_slc, cos, sin)[:, 0], v_slc[:, 0]))
    if k_win is not None:
        write_at((k_win, v_win), pos % k_win.shape[1],
                 (rotate(k_ring, cos, sin)[:, 0], v_ring[:, 0]))
    write_at((src_k, src_v), pos % src_k.shape[1], (k_src[:, 0], v_src[:, 0]))


def ring_from_prefix(x: torch.Tensor, lengths: torch.Tensor, size: int) -> torch.Tensor:
    """A ring buffer [B, size, ...] of the first ``lengths[b]`` positions of ``x`` [B, P, ...]:
    slot j holds the latest position p < lengths[b] with p ≡ j (mod size), zeros where none."""
    positions = window_ring_positions(lengths - 1, size)  # [B, size]
    valid = positions >= 0
    index = positions.clamp_min(0).view(*positions.shape, *([1] * (x.dim() - 2)))
    ring = torch.gather(x, 1, index.expand(-1, -1, *x.shape[2:]))
    return ring * valid.view(*valid.shape, *([1] * (x.dim() - 2))).to(x.dtype)
