"""Compressors: l consecutive keys (or values) every d tokens -> one compressed token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nsa.ops.triton_support import TRITON_AVAILABLE, TRITON_DTYPES

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
    call, instead of through a copy of every block. Blocks every ``stride`` tokens (no
    ``first``; the stride divides the block, as NSA_SPEC.md asks) are never built: the tokens
    are cut into chunks of ``stride`` tokens, one product takes each chunk against the block's
    c = block / stride slices of W1, and block i sums the products of chunks i, ..., i + c - 1
    (:meth:`_strided_product`). That reads each token once where the blocks would copy it c
    times, for c - 1 extra chunks of products per sequence and head. Blocks from given starts
    (packed documents) are gathered.

    On CUDA the MLP of blocks every ``stride`` tokens runs as Triton kernels instead, one
    launch forward and three backward, for two compressors at once through
    :func:`compress_all` (nsa/ops/triton/compressor.py); the PyTorch form above is the CPU's,
    the packed documents' and the reference.
    """

    def __init__(self, head_dim: int, block: int, stride: int, kind: str = "mlp",
                 hidden: int | None = None):
        super().__init__()
        if kind not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {COMPRESSORS}, got {kind!r}")
        if block % stride:
            raise ValueError(f"stride ({stride}) must divide block ({block})")
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
        compute_dtype = self.triton_dtype(x, first)
        if compute_dtype is not None:
            from nsa.ops.triton.compressor import compress_triton

            return compress_triton([x], [self.weights()], self.block, self.stride,
                                   compute_dtype)[0]
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

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype this compressor computes x in: autocast's where autocast is on for x's
        device, else the MLP's weights'; the mean compressor computes in x's."""
        if self.kind != "mlp":
            return x.dtype
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return self.mlp[0].weight.dtype

    def triton_dtype(self, x: torch.Tensor, first: torch.Tensor | None) -> torch.dtype | None:
        """The compute dtype (autocast's, or the weights') in which the Triton kernels
        (nsa/ops/triton/compressor.py) take this compressor of x [B, T, H, D]; None where they
        do not: off CUDA, the mean compressor, given ``first``, T < block, other dtypes or
        widths."""
        if (self.kind != "mlp" or first is not None or not x.is_cuda or not TRITON_AVAILABLE
                or x.shape[1] < self.block):
            return None
        from nsa.ops.triton.compressor import fits

        compute_dtype = self.compute_dtype(x)
        if (compute_dtype not in TRITON_DTYPES or x.dtype not in TRITON_DTYPES
                or not fits(x.shape[-1], self.mlp[0].out_features)):
            return None
        return compute_dtype

    def weights(self) -> tuple[torch.Tensor, ...]:
        """(P, W1, b1, W2, b2) of the MLP compressor."""
        first_layer, _, second_layer = self.mlp
        return (self.position, first_layer.weight, first_layer.bias, second_layer.weight,
                second_layer.bias)

    def _strided_product(self, x: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """W1·flatten(x's block i) for the num_blocks >= 1 blocks every ``stride`` tokens of x
        [B, T, H, D] -> [B, num_blocks, H, hidden]: block i is chunks i, ..., i + c - 1 of
        ``stride`` tokens (c = block / stride), and chunk m's product with W1's slice j (the
        columns of the block's tokens j·d, ..., j·d + d - 1) is every c-th column from j of one
        product of every chunk with W1 viewed as [hidden·c, d·D] (row o·c + j: unit o's slice
        j)."""
        B, T, H, D = x.shape
        weight = self.mlp[0].weight  # [hidden, block·D]
        hidden = weight.shape[0]
        d, c = self.stride, self.block // self.stride
        num_chunks = num_blocks + c - 1  # <= T // d
        chunks = (x[:, :num_chunks * d].reshape(B, num_chunks, d, H, D).transpose(2, 3)
                  .reshape(B, num_chunks, H, d * D))  # one copy of the tokens used
        products = F.linear(chunks, weight.view(hidden * c, d * D))  # [B, chunks, H, hidden·c]
        out = products[:, :num_blocks, :, 0::c]
        for j in range(1, c):
            out = out + products[:, j:j + num_blocks, :, j::c]
        return out


def compress_all(compressors: list[Compressor], xs: list[torch.Tensor],
                 first: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each compressor applied to its x [B, T, H, D] (``first`` as in Compressor.forward):
    those the Triton kernels take in one dtype, with one shape of input and weights, in one
    launch forward and three backward for every two (nsa/ops/triton/compressor.py: a layer's
    key and value compressors together), the others each by its own forward."""
    dtypes = {c.triton_dtype(x, first) for c, x in zip(compressors, xs)}
    if None in dtypes or len(dtypes) > 1 or len(
            {(x.shape, x.dtype, c.block, c.stride, *(w.shape for w in c.weights()))
             for c, x in zip(compressors, xs)}) > 1:
        return [c(x, first) for c, x in zip(compressors, xs)]
    from nsa.ops.triton.compressor import MAX_SLOTS, compress_triton

    (compute_dtype,) = dtypes
    block, stride = compressors[0].block, compressors[0].stride
    outs = []
    for k in range(0, len(xs), MAX_SLOTS):
        outs += compress_triton(xs[k:k + MAX_SLOTS],
                                [c.weights() for c in compressors[k:k + MAX_SLOTS]], block,
                                stride, compute_dtype)
    return outs
