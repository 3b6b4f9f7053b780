"""Documents packed along one row (``cu_seqlens``), as the attention layers read them.

A packed batch is ``[1, T, ...]`` holding N documents back to back; ``cu_seqlens`` (int32
``[N+1]``, ``0 = cu[0] <= cu[1] <= ... <= cu[N] = T``) are their offsets, as
:func:`nsa.nsa_attention` takes them. Each document is computed as if it were alone: positions
restart at 0, no attention and no compressed token crosses a boundary. This is a training (and
plain forward) feature: prefill and decoding keep one sequence per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa.ops.layout import expand_counts
from nsa.ops.params import NSAParams, check_cu_seqlens, compressed_lengths


@dataclass(frozen=True)
class PackedDocuments:
    """What the layers need to know of ``cu_seqlens``, made once per forward on the device of
    the activations and shared by every layer (:func:`pack_documents` builds it)."""

    cu_seqlens: torch.Tensor  # int32 [N+1], on the activations' device
    positions: torch.Tensor  # [T] int64: each token's position within its document
    document: torch.Tensor  # [T] int64: each token's document
    max_length: int  # tokens of the longest document
    compression: tuple[int, int]  # (cmp_block, cmp_stride) the two fields below are for
    cmp_first: torch.Tensor  # [Tc] int64: packed index of each compressed token's first token
    cmp_index: torch.Tensor  # [Tc] int64: index of each compressed token within its document

    @property
    def seq_len(self) -> int:
        return self.positions.numel()

    def attention_mask(self) -> torch.Tensor:
        """[T, T] bool: query t sees key s iff s <= t in the same document (block-diagonal
        causal). O(T²) memory: for the dense baseline only."""
        t = torch.arange(self.seq_len, device=self.positions.device)
        return (self.document[:, None] == self.document[None, :]) & (t[None, :] <= t[:, None])


def pack_documents(cu_seqlens, batch: int, seq_len: int, device: torch.device,
                   params: NSAParams) -> PackedDocuments:
    """Check ``cu_seqlens`` against a [batch, seq_len] input on ``device`` and lay out its
    documents, and the compressed tokens of each (``params``' l and d), on that device.

    ValueError naming ``cu_seqlens`` unless it is an int32 [N+1] tensor (N >= 1) on the CPU or
    on ``device``'s kind, starting at 0, non-decreasing and ending at ``seq_len``, with
    ``batch == 1``. Its values are read on the host once: free for a CPU tensor (what the
    trainer passes), a device sync for a GPU one.
    """
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type not in ("cpu",
                                                                               device.type):
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but the input is on {device}")
    host = cu_seqlens.cpu() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
    check_cu_seqlens(host, batch, seq_len, torch.device("cpu"))
    host_lengths = (host[1:] - host[:-1]).long()
    num_cmp = int(compressed_lengths(host_lengths, params.cmp_block, params.cmp_stride).sum())
    if cu_seqlens.device.type != device.type:  # CPU -> accelerator, without waiting for it
        cu_seqlens = cu_seqlens.pin_memory().to(device, non_blocking=True)
    cu = cu_seqlens.to(device=device)
    lengths = (cu[1:] - cu[:-1]).long()
    document, positions, _ = expand_counts(lengths, seq_len)
    cmp_counts = compressed_lengths(lengths, params.cmp_block, params.cmp_stride)
    cmp_document, cmp_index, _ = expand_counts(cmp_counts, num_cmp)
    return PackedDocuments(
        cu_seqlens=cu, positions=positions, document=document,
        max_length=int(host_lengths.max()), compression=(params.cmp_block, params.cmp_stride),
        cmp_first=cu[:-1].long()[cmp_document] + cmp_index * params.cmp_stride,
        cmp_index=cmp_index)


def as_packed_documents(cu_seqlens, x: torch.Tensor, params: NSAParams) -> PackedDocuments:
    """``cu_seqlens`` (a tensor, or documents a model already packed) for the input ``x``
    [B, T, ...] of a layer whose compressor has ``params``' l and d."""
    if not isinstance(cu_seqlens, PackedDocuments):
        return pack_documents(cu_seqlens, x.shape[0], x.shape[1], x.device, params)
    if x.shape[0] != 1 or cu_seqlens.seq_len != x.shape[1]:
        raise ValueError(f"documents packed for [1, {cu_seqlens.seq_len}] inputs, got "
                         f"{tuple(x.shape[:2])}")
    if cu_seqlens.compression != (params.cmp_block, params.cmp_stride):
        raise ValueError(f"documents packed for (cmp_block, cmp_stride) = "
                         f"{cu_seqlens.compression}, the layer has "
                         f"{(params.cmp_block, params.cmp_stride)}")
    return cu_seqlens
