"""Compressors: l consecutive keys (or values) every d tokens -> one compressed token."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
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

    ``kind="mlp"`` (the paper's): add a learnable intra-block position embedding P to the block,
    flatten it and pass it through a two-layer MLP. ``kind="mean"``: average the block.

    The MLP's first product is linear, so W1·flatten(block + P) + b1 is computed as
    W1·flatten(block) + (W1·flatten(P) + b1): the embedding enters through the bias, once per
    call, instead of through a copy of every block. Blocks every ``stride`` tokens (no ``first``)
    overlap when stride < block; they are then never built: the tokens are cut into chunks of
    g = gcd(block, stride) tokens, one product takes each chunk against the block's c = block /
    g slices of W1, and block i sums the products of its c chunks (:meth:`_strided_product`).
    That reads each token once where the blocks would copy it block / stride times.
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
        first_layer, activation, second_layer = self.mlp
        # W1·flatten(P) + b1 [hidden]: the position embedding's share of every block's product.
        bias = F.linear(self.position.flatten(), first_layer.weight, first_layer.bias)
        if first is None and blocks.shape[1] > 0:
            product = self._strided_product(x, blocks.shape[1])  # [B, Tc, H, hidden]
        else:
            product = F.linear(blocks.flatten(-2), first_layer.weight)
        return second_layer(activation(product + bias))

    def _strided_product(self, x: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """W1·flatten(x's block i) for the num_blocks >= 1 blocks every ``stride`` tokens of x
        [B, T, H, D] -> [B, num_blocks, H, hidden], from chunks of g = gcd(block, stride) tokens:
        block i is chunks i·s, ..., i·s + c - 1 (s = stride / g, c = block / g), and chunk m's
        product with W1's slice j (the columns of the block's tokens j·g, ..., j·g + g - 1) is
        every c-th column from j of one product of every chunk with W1 viewed as [hidden·c,
        g·D] (row o·c + j: unit o's slice j)."""
        B, T, H, D = x.shape
        weight = self.mlp[0].weight  # [hidden, block·D]
        hidden = weight.shape[0]
        g = math.gcd(self.block, self.stride)
        c, s = self.block // g, self.stride // g
        num_chunks = (num_blocks - 1) * s + c  # <= T // g
        chunks = (x[:, :num_chunks * g].reshape(B, num_chunks, g, H, D).transpose(2, 3)
                  .reshape(B, num_chunks, H, g * D))  # one copy of the tokens used
        products = F.linear(chunks, weight.view(hidden * c, g * D))  # [B, chunks, H, hidden·c]
        end = (num_blocks - 1) * s + 1
        out = products[:, 0:end:s, :, 0::c]
        for j in range(1, c):
            out = out + products[:, j:j + end:s, :, j::c]
        return out
