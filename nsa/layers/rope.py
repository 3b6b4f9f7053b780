"""Rotary position embedding (RoPE) at arbitrary, possibly fractional, positions."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from nsa.ops.triton_support import triton_takes


def rope_frequencies(head_dim: int, base: float, device=None) -> torch.Tensor:
    """[head_dim // 2] inverse frequencies."""
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    return base ** (-exponent)


class RotaryFrequencies(nn.Module):
    """RoPE's inverse frequencies of one layer (a non-persistent buffer, ``inv_freq``), always
    float32: casting the model (``.to(torch.bfloat16)``) recomputes them on the new device
    rather than rounding them, so a bf16 model rotates by the angles it was trained with
    (under autocast they stay float32) whichever way it was cast or loaded."""

    def __init__(self, head_dim: int, base: float):
        super().__init__()
        self.head_dim, self.base = head_dim, base
        self.register_buffer("inv_freq", rope_frequencies(head_dim, base), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = rope_frequencies(self.head_dim, self.base, self.inv_freq.device)
        return self

    def angles(self, positions: torch.Tensor):
        """:func:`rope_angles` of ``positions`` at these frequencies: (cos, sin)."""
        return rope_angles(positions, self.inv_freq)


class PositionAngles:
    """The RoPE angles one forward or decode step needs (:func:`rope_angles`' cos, sin,
    float32): of each token's position (``tokens``), and, for NSA's forward, of each
    compressed token's centre (``compressed``). They depend on the positions and the
    frequencies only, so a model computes them once for all its layers (its attention layers'
    ``position_angles``, or its first layer's ``rope`` for a decode step) and passes this
    object to each block.

    A plain class on purpose, not a tuple or a dataclass: FSDP2's mixed precision casts every
    floating tensor it finds in a block's inputs, through tuples and dataclasses, to the
    parameters' dtype (bf16), and the angles must stay float32."""

    __slots__ = ("tokens", "compressed")

    def __init__(self, tokens: tuple[torch.Tensor, torch.Tensor],
                 compressed: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.tokens = tokens
        self.compressed = compressed


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor):
    """cos, sin [B or 1, T, 1, D/2] of ``positions`` [T] or [B, T] (one row per sequence; float
    ok): computed once, they rotate every tensor at these positions (:func:`rotate`)."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)  # [(B,) T, D/2]
    if angles.dim() == 2:
        angles = angles[None]
    return angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + D/2) of ``x`` [B, T, heads, D] by the angles of
    :func:`rope_angles`: :func:`rotate_many` of one tensor."""
    return rotate_many((x,), cos, sin)[0]


def rotate_many(xs: Sequence[torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Rotate channel pairs (i, i + D/2) of each x [B, T, heads_x, D] of ``xs`` (one B, T, D,
    dtype and device; heads may differ; any strides, e.g. views of one projection) by the same
    angles of :func:`rope_angles` (cos, sin [B or 1, T, 1, D/2] float32), in float32, each
    result in x's dtype. For CUDA tensors where Triton is installed: one autograd node and one
    kernel launch, forward and backward, for up to three tensors (a layer's queries and keys:
    eager training is host-bound, and each launch costs the host more than the rotation costs
    the GPU); :func:`rotate_torch` on each otherwise."""
    xs = tuple(xs)
    if not xs:
        raise ValueError("rotate_many needs at least one tensor")
    x = xs[0]
    for other in xs[1:]:
        if (other.shape[:2] != x.shape[:2] or other.shape[-1] != x.shape[-1]
                or other.dtype != x.dtype or other.device != x.device):
            raise ValueError(
                "rotate_many's tensors must agree in B, T, D, dtype and device, got "
                f"{tuple(x.shape)} {x.dtype} {x.device} and "
                f"{tuple(other.shape)} {other.dtype} {other.device}")
    if triton_takes(x):
        from nsa.ops.triton.rope import rope_triton_many

        return rope_triton_many(xs, cos, sin)
    return tuple(rotate_torch(x, cos, sin) for x in xs)


def rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rotate` in PyTorch ops (the CPU form and the reference)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated.to(x.dtype)
