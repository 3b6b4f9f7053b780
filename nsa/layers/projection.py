"""A layer's input projections as one product, and that product split into the heads the
attention reads.

``fused_weight`` concatenates the weights of several linear layers, each padded with zero rows
to a multiple of FUSED_ALIGN, so that one product y = x·Wᵀ [B, T, W] computes all of them:
under autocast x is cast once, and the backward runs one product for x's gradient instead of
one per layer plus their sum. The padding makes every layer's columns start and stride on 16
bytes (a stride off that slows every kernel that reads them), and the last layer's rows are
padded further so that W is a multiple of ROW_ALIGN: each token's row of y then starts on a
128-byte cache line in 16-bit dtypes, and a head of 64 channels, which the attention and RoPE
kernels read from y or write into its gradient, spans one line instead of two. At m7c-125m
(W 1576 -> 1600) the graphed training step took 42.3 ms instead of 43.5, the RoPE launches
0.67 ms a step instead of 0.93 and the compressors' forward 0.27 instead of 0.44
(bench/NOTES.md, forty-ninth session).

``split_heads`` gives the [B, T, heads, dim] tensors a layer reads from y's columns (one
:class:`Heads` each: the queries, each K/V set's keys and values, the gate logits), those it
marks rotated by RoPE, in one autograd node. Unrotated heads are views of y; rotated ones are
new tensors, one RoPE launch for up to three. Its backward writes y's gradient once: each
tensor's gradient straight into its columns (through the inverse rotation where the tensor was
rotated), zeros where no tensor reads. With the kernel, the unrotated tensors of the rotated
ones' head dim are copied by the inverse rotation's launches too (a layer's keys and values:
one launch per three tensors instead of a copy kernel each). Split by views (a split of y, the
K/V's split into keys and values, the sets' unbind), the backward assembled y's gradient level
by level, a stack, then two concatenations, each a copy of what the previous wrote
(bench/NOTES.md, v36).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nsa.layers.rope import rotate_torch
from nsa.ops.triton_support import triton_takes

FUSED_ALIGN = 8  # elements: 16 bytes in bf16, what vector loads and TMA descriptors need
ROW_ALIGN = 64  # elements of the product's width: a row of 128 bytes' lines in bf16


def _fused_pads(layers: Sequence[nn.Linear]) -> list[int]:
    """Zero rows after each layer's in a fused weight: its rows to a multiple of FUSED_ALIGN,
    and the last layer's further, to a width that is a multiple of ROW_ALIGN."""
    pads = [-layer.out_features % FUSED_ALIGN for layer in layers]
    pads[-1] += -(sum(layer.out_features for layer in layers) + sum(pads)) % ROW_ALIGN
    return pads


def fused_weight(*layers: nn.Linear) -> torch.Tensor:
    """The layers' weights as one [W, in_features] matrix, each layer's rows followed by its
    zero rows (``_fused_pads``)."""
    return torch.cat([F.pad(layer.weight, (0, 0, 0, pad)) if pad else layer.weight
                      for layer, pad in zip(layers, _fused_pads(layers), strict=True)])


def fused_columns(*layers: nn.Linear) -> list[int]:
    """The first column of each layer's outputs in the product with ``fused_weight(*layers)``,
    then the product's width W."""
    starts = [0]
    for layer, pad in zip(layers, _fused_pads(layers), strict=True):
        starts.append(starts[-1] + layer.out_features + pad)
    return starts


def fused_product(x: torch.Tensor, layers: Sequence[nn.Linear],
                  weight: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in_features] times the layers' fused weight (``weight``: :func:`fused_weight` of
    the layers, made once by a caller whose weights do not change between calls, a decode
    cache) -> [..., Σ padded out_features], without the layers' biases."""
    return F.linear(x, fused_weight(*layers) if weight is None else weight)


def decode_projection(layers) -> torch.Tensor:
    """:func:`fused_weight` of ``layers`` for a decode cache (detached), made with the cache
    (under FSDP2 from the gathered weights: a block's ``new_cache`` is one of its forward
    methods), so that a decode step does not concatenate (and pad) the weights at every token.
    A cache so reads the weights as they were when it was made, and holds a copy of them (in
    their dtype): for m7c-125m 14.7 M values over its 12 layers, 12 % of the model's."""
    with torch.no_grad():
        return fused_weight(*layers)


class Heads(NamedTuple):
    """Columns of a product y [B, T, W] read as [B, T, heads, dim]: head i is the ``dim``
    columns from start + i·stride; rotated by RoPE when ``rotate``."""

    start: int
    heads: int
    stride: int
    dim: int
    rotate: bool = False

    def columns(self) -> frozenset[int]:
        """The product's columns this group reads."""
        return frozenset(self.start + i * self.stride + j for i in range(self.heads)
                         for j in range(self.dim))

    def of(self, y: torch.Tensor) -> torch.Tensor:
        """This head group of y [B, T, W], a view."""
        span = (self.heads - 1) * self.stride + self.dim
        return y.narrow(-1, self.start, span).unfold(-1, self.dim, self.stride)

    def of_new(self, y: torch.Tensor) -> torch.Tensor:
        """:meth:`of` of a new contiguous y, for writes: through as_strided, whose writes a
        compiled backward keeps (it lost writes through :meth:`of`'s narrow-then-unfold views:
        torch 2.13, tests/ops/test_compile.py)."""
        B, T, W = y.shape
        return y.as_strided((B, T, self.heads, self.dim), (T * W, W, self.stride, 1),
                            self.start)


@dataclass(frozen=True)
class HeadsLayout:
    """The head groups ``split_heads`` takes from a product of ``width`` columns, in its output
    order. Two groups read the same columns or disjoint ones, and no two rotated groups the
    same (ValueError otherwise): the same columns twice is one tensor read rotated and not (a
    shared K/V set's keys), whose gradients add."""

    groups: tuple[Heads, ...]
    width: int
    uncovered: tuple[tuple[int, int], ...] = field(init=False)  # column ranges no group reads
    # Per group, whether the backward adds its gradient to its columns (written before by a
    # rotated group, which the backward writes first, or by an earlier unrotated one).
    adds: tuple[bool, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a heads layout needs at least one group")
        columns = []
        for group in self.groups:
            if (min(group.heads, group.dim, group.stride) < 1 or group.start < 0
                    or group.stride < group.dim
                    or group.start + (group.heads - 1) * group.stride + group.dim > self.width):
                raise ValueError(f"head group {group} does not fit {self.width} columns")
            mine = group.columns()
            if any(mine & other and mine != other for other in columns):
                raise ValueError(f"head group {group} partly overlaps another")
            columns.append(mine)
        rotated = [mine for mine, group in zip(columns, self.groups) if group.rotate]
        if len(set(rotated)) < len(rotated):
            raise ValueError("two rotated head groups read the same columns")
        written, adds = set(rotated), []
        for mine, group in zip(columns, self.groups):
            adds.append(not group.rotate and mine in written)
            written.add(mine)
        covered = frozenset().union(*columns)
        uncovered, start = [], None
        for column in range(self.width + 1):
            if column < self.width and column not in covered:
                start = column if start is None else start
            elif start is not None:
                uncovered.append((start, column))
                start = None
        object.__setattr__(self, "uncovered", tuple(uncovered))
        object.__setattr__(self, "adds", tuple(adds))


def _use_kernel(y: torch.Tensor) -> bool:
    """Whether ``split_heads`` rotates with the Triton RoPE kernel (CUDA tensors of its dtypes
    where Triton is installed) or with :func:`rotate_torch`."""
    return triton_takes(y)


def _rotated(xs: list[torch.Tensor], cos, sin, kernel: bool) -> list[torch.Tensor]:
    """xs rotated by cos/sin, new tensors (no autograd: inside split_heads' node)."""
    if not kernel:
        return [rotate_torch(x, cos, sin) for x in xs]
    from nsa.ops.triton.launch import call_op
    from nsa.ops.triton.rope import rope, rope_op

    return call_op(rope_op, rope, xs, cos, sin, False) if xs else []


def _rotate_back_into(grads: list[torch.Tensor], outs: list[torch.Tensor], rotate: list[bool],
                      cos, sin, kernel: bool) -> None:
    """outs[k] = grads[k] rotated by the opposite angles (the rotation's backward), or as it is
    where not rotate[k]."""
    if not kernel:
        for grad, out, rotated in zip(grads, outs, rotate, strict=True):
            out.copy_(rotate_torch(grad, cos, -sin) if rotated else grad)
        return
    from nsa.ops.triton.launch import call_op
    from nsa.ops.triton.rope import rope_into, rope_into_op

    if grads:
        call_op(rope_into_op, rope_into, grads, outs, cos, sin, True, rotate)


class _SplitHeads(torch.autograd.Function):
    """split_heads' node: forward views and rotations, backward y's gradient written once."""

    @staticmethod
    def forward(ctx, y, cos, sin, layout: HeadsLayout, kernel: bool):
        ctx.save_for_backward(cos, sin)
        ctx.layout, ctx.kernel, ctx.shape, ctx.dtype = layout, kernel, y.shape, y.dtype
        groups = layout.groups
        rotated = iter(_rotated([g.of(y) for g in groups if g.rotate], cos, sin, kernel))
        return tuple(next(rotated) if g.rotate else g.of(y) for g in groups)

    @staticmethod
    def backward(ctx, *grads):
        cos, sin = ctx.saved_tensors
        layout = ctx.layout
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=grads[0].device)  # [B, T, W]
        for start, end in layout.uncovered:
            grad[..., start:end].zero_()
        grads = [g.to(ctx.dtype) for g in grads]
        outs = [group.of_new(grad) for group in layout.groups]
        # The rotated groups, and with the kernel the unrotated ones it can copy (written, not
        # added to, and of the rotated ones' head dim), through the RoPE launches; the others
        # after.
        dim = next((group.dim for group in layout.groups if group.rotate), None)
        by_rope = [i for i, (group, add) in enumerate(zip(layout.groups, layout.adds))
                   if group.rotate or (ctx.kernel and not add and group.dim == dim)]
        if by_rope:
            _rotate_back_into([grads[i] for i in by_rope], [outs[i] for i in by_rope],
                              [layout.groups[i].rotate for i in by_rope], cos, sin, ctx.kernel)
        for i, (g, out, add) in enumerate(zip(grads, outs, layout.adds)):
            if add:
                out.add_(g)
            elif i not in by_rope:
                out.copy_(g)
        return grad, None, None, None, None


def split_heads(y: torch.Tensor, layout: HeadsLayout, cos: torch.Tensor | None = None,
                sin: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """y [B, T, layout.width] (last stride 1) -> one [B, T, heads, dim] tensor per group of
    ``layout``, in its order: views of y, or new tensors rotated by RoPE's cos/sin [B or 1, T,
    1, dim / 2] (float32, :func:`~nsa.layers.rope.rope_angles`) where the group says so; one
    autograd node, whose backward writes y's gradient once (module docstring)."""
    if y.dim() != 3 or y.shape[-1] != layout.width or y.stride(-1) != 1:
        raise ValueError(f"split_heads takes y [B, T, {layout.width}] with a last stride of 1, "
                         f"got shape {tuple(y.shape)}, strides {y.stride()}")
    if any(g.rotate for g in layout.groups) and cos is None:
        raise ValueError("split_heads needs cos and sin to rotate")
    return _SplitHeads.apply(y, cos, sin, layout, _use_kernel(y))
