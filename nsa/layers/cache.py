"""Pre-allocated per-layer KV caches for decoding (static shapes: a step can be captured in a
CUDA graph). Positions are per sequence, so a batch may hold sequences of different lengths."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa.ops.decode import window_ring_positions


@dataclass
class NSACache:
    """The state one NSA layer keeps between decode steps, for B sequences of capacity S.

    k, v [B, S, H, D]: keys (RoPE applied) and values by position, read by the selected branch
    (and by the window branch when K/V are shared). k_win, v_win [B, w, H, D]: ring buffers of
    the window branch's own keys/values (position p at slot p % w), or None when shared.
    src_k, src_v [B, l, H, D]: ring of the last l un-rotated compressed-branch keys/values, the
    compressor's input. k_cmp, v_cmp [B, C, H, D]: compressed tokens, appended when complete.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_win: torch.Tensor | None
    v_win: torch.Tensor | None
    src_k: torch.Tensor
    src_v: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor


@dataclass
class DenseCache:
    """Keys (RoPE applied) and values by position, [B, S, H, D]."""

    k: torch.Tensor
    v: torch.Tensor


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


def ring_from_prefix(x: torch.Tensor, lengths: torch.Tensor, size: int) -> torch.Tensor:
    """A ring buffer [B, size, ...] of the first ``lengths[b]`` positions of ``x`` [B, P, ...]:
    slot j holds the latest position p < lengths[b] with p ≡ j (mod size), zeros where none."""
    positions = window_ring_positions(lengths - 1, size)  # [B, size]
    valid = positions >= 0
    index = positions.clamp_min(0).view(*positions.shape, *([1] * (x.dim() - 2)))
    ring = torch.gather(x, 1, index.expand(-1, -1, *x.shape[2:]))
    return ring * valid.view(*valid.shape, *([1] * (x.dim() - 2))).to(x.dtype)
