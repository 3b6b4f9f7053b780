"""Compressors: l consecutive keys (or values) every d tokens -> one compressed token."""

from __future__ import annotations

import torch
from torch import nn

COMPRESSORS = ("mlp", "mean")


def compression_blocks(x: torch.Tensor, block: int, stride: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, Tc, H, block, D]: the tokens [i·stride, i·stride + block) of each i."""
    B, T, H, D = x.shape
    if T < block:
        return x.new_zeros(B, 0, H, block, D)
    return x.unfold(1, block, stride).permute(0, 1, 2, 4, 3)


def blocks_from(x: torch.Tensor, first: torch.Tensor, block: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, Tc, H, block, D]: the tokens [first[i], first[i] + block) of each i
    (``first`` [Tc], e.g. the compressed tokens of documents packed along T)."""
    index = first[:, None] + torch.arange(block, device=x.device)  # [Tc, block]
    return x[:, index].transpose(2, 3)


class Compressor(nn.Module):
    """phi of the paper: maps each block of ``block`` tokens to one token.

    ``kind="mlp"`` (the paper's): add a learnable intra-block position embedding to the block,
    flatten it and pass it through a two-layer MLP. ``kind="mean"``: average the block.
    """

    def __init__(self, head_dim: int, block: int, stride: int, kind: str = "mlp",
                 hidden: int | None = None):
        super().__init__()
        if kind not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {COMPRESSORS}, got {kind!r}")
        self.block, self.stride, self.kind = block, stride, kind
        if kind == "mlp":
            hidden = hidden or 2 * head_dim
            self.position = nn.Parameter(torch.randn(block, head_dim) * 0.02)
            self.mlp = nn.Sequential(
                nn.Linear(block * head_dim, hidden), nn.GELU(), nn.Linear(hidden, head_dim)
            )

    def forward(self, x: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, H, D] -> [B, Tc, H, D]: a compressed token every ``stride`` tokens from 0, or,
        given ``first`` [Tc], one for each block of ``block`` tokens starting at first[i]."""
        if first is None:
            blocks = compression_blocks(x, self.block, self.stride)  # [B, Tc, H, l, D]
        else:
            blocks = blocks_from(x, first, self.block)  # [B, Tc, H, l, D]
        if self.kind == "mean":
            return blocks.mean(dim=-2)
        # The embedding in the blocks' dtype: a float32 one would promote the blocks (bf16 under
        # autocast) to float32, for the MLP to cast back.
        return self.mlp((blocks + self.position.to(blocks.dtype)).flatten(-2))
