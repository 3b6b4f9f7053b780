"""Where tokens and compressed tokens sit in their (possibly packed) sequences.

Shared by both backends and built on the device with vectorised PyTorch: nothing here reads a
tensor value on the host, so every size it returns is a bound known from shapes alone.
"""

from __future__ import annotations

import torch

from nsa.ops.params import NSAParams, compressed_lengths


def expand_counts(counts: torch.Tensor, bound: int):
    """Number the items of consecutive owners, owner i having ``counts[i]`` items.

    For k in [0, bound): (owner of item k, index of k within its owner, whether item k exists);
    items past the total are given to the last owner and marked unused.
    """
    first = torch.cumsum(counts, 0) - counts
    k = torch.arange(bound, device=counts.device)
    owner = torch.searchsorted(first + counts, k, right=True).clamp_max(counts.numel() - 1)
    return owner, k - first[owner], k < counts.sum()


class SequenceLayout:
    """Per sequence: starts, ends, cmp_starts, cmp_counts [N]; per token: seq, pos [T];
    per compressed token: cmp_seq, cmp_idx [Tc] (its sequence and index within it)."""

    def __init__(self, seq_len: int, num_cmp: int, cu_seqlens, params: NSAParams, device):
        if cu_seqlens is None:
            cu = torch.arange(2, device=device) * seq_len  # [0, T], no host-to-device copy
        else:
            cu = cu_seqlens.to(device=device, dtype=torch.long)
        self.starts, self.ends = cu[:-1], cu[1:]
        lengths = self.ends - self.starts
        self.cmp_counts = compressed_lengths(lengths, params.cmp_block, params.cmp_stride)
        self.cmp_starts = torch.cumsum(self.cmp_counts, 0) - self.cmp_counts
        self.seq, self.pos, _ = expand_counts(lengths, seq_len)
        self.cmp_seq, self.cmp_idx, _ = expand_counts(self.cmp_counts, num_cmp)
