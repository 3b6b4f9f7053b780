"""Attention layers: NSA (the paper's three gated branches) and dense causal (the baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nsa.layers.compressor import COMPRESSORS, Compressor
from nsa.layers.rope import apply_rope, rope_frequencies
from nsa.ops import NSAParams, nsa_attention
from nsa.ops.params import BACKENDS

KV_SHARING = ("independent", "shared")
BRANCHES = ("cmp", "slc", "win")


@dataclass(frozen=True)
class AttentionConfig:
    """Everything an attention layer needs; validated once, when built."""

    dim: int
    num_heads: int  # HQ
    num_kv_heads: int  # H
    head_dim_k: int
    head_dim_v: int
    rope_base: float = 10000.0
    # NSA only
    cmp_block: int = 32
    cmp_stride: int = 16
    sel_block: int = 64
    num_selected: int = 16
    window: int = 512
    num_init: int = 1
    num_local: int = 2
    kv_sharing: str = "independent"  # separate K/V per branch (paper §3.3.3) or one for all
    compressor: str = "mlp"  # "mlp" (paper) or "mean"
    compressor_hidden: int | None = None  # MLP width, default 2 * head_dim
    force_branch: str | None = None  # debug: use only "cmp", "slc" or "win"
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("dim", "num_heads", "num_kv_heads", "head_dim_k", "head_dim_v"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim_k % 2:
            raise ValueError(f"head_dim_k must be even for RoPE, got {self.head_dim_k}")
        if self.kv_sharing not in KV_SHARING:
            raise ValueError(f"kv_sharing must be one of {KV_SHARING}, got {self.kv_sharing!r}")
        if self.compressor not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {COMPRESSORS}, got {self.compressor!r}")
        if self.force_branch is not None and self.force_branch not in BRANCHES:
            raise ValueError(f"force_branch must be None or one of {BRANCHES}, got {self.force_branch!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        self.nsa_params  # validates the block parameters

    @property
    def nsa_params(self) -> NSAParams:
        return NSAParams(self.cmp_block, self.cmp_stride, self.sel_block, self.num_selected,
                         self.window, self.num_init, self.num_local)


class NSAttention(nn.Module):
    """Native Sparse Attention layer: x [B, T, dim] -> [B, T, dim].

    Positions: queries and the keys of the selected and window branches are rotated at their
    token position t. Compressed keys are built from un-rotated keys (the compressor's own
    intra-block position embedding encodes order inside a block) and then rotated at the centre
    of the tokens they summarise, i·d + (l - 1) / 2, so q·k_cmp sees the distance to the block.
    """

    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.config = c = config
        self.num_kv_sets = 3 if c.kv_sharing == "independent" else 1  # (cmp, slc, win) or one
        self.q_proj = nn.Linear(c.dim, c.num_heads * c.head_dim_k, bias=False)
        kv_width = self.num_kv_sets * c.num_kv_heads * (c.head_dim_k + c.head_dim_v)
        self.kv_proj = nn.Linear(c.dim, kv_width, bias=False)
        self.compress_k = Compressor(c.head_dim_k, c.cmp_block, c.cmp_stride, c.compressor,
                                     c.compressor_hidden)
        self.compress_v = Compressor(c.head_dim_v, c.cmp_block, c.cmp_stride, c.compressor,
                                     c.compressor_hidden)
        self.gate_proj = nn.Linear(c.dim, c.num_heads * 3)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim_v, c.dim, bias=False)
        self.register_buffer("inv_freq", rope_frequencies(c.head_dim_k, c.rope_base), persistent=False)

    def _kv(self, x: torch.Tensor):
        """-> (k_cmp_src, v_cmp_src, k_slc, v_slc, k_win, v_win), each [B, T, H, D]."""
        c = self.config
        B, T, _ = x.shape
        kv = self.kv_proj(x).view(B, T, self.num_kv_sets, c.num_kv_heads, c.head_dim_k + c.head_dim_v)
        k, v = kv.split([c.head_dim_k, c.head_dim_v], dim=-1)  # [B, T, sets, H, D]
        sets = [(k[:, :, i], v[:, :, i]) for i in range(self.num_kv_sets)]
        if self.num_kv_sets == 1:
            sets = sets * 3
        return [t for pair in sets for t in pair]

    def gates(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, dim] -> [B, T, HQ, 3] sigmoid gates, or a one-hot when a branch is forced."""
        c = self.config
        B, T, _ = x.shape
        if c.force_branch is not None:
            one_hot = torch.zeros(3, dtype=x.dtype, device=x.device)
            one_hot[BRANCHES.index(c.force_branch)] = 1
            return one_hot.expand(B, T, c.num_heads, 3)
        return torch.sigmoid(self.gate_proj(x)).view(B, T, c.num_heads, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        B, T, _ = x.shape
        positions = torch.arange(T, device=x.device)
        q = self.q_proj(x).view(B, T, c.num_heads, c.head_dim_k)
        q = apply_rope(q, positions, self.inv_freq)
        k_cmp_src, v_cmp_src, k_slc, v_slc, k_win, v_win = self._kv(x)
        k_cmp = self.compress_k(k_cmp_src)  # [B, Tc, H, Dk]
        v_cmp = self.compress_v(v_cmp_src)  # [B, Tc, H, Dv]
        centres = torch.arange(k_cmp.shape[1], device=x.device) * c.cmp_stride + (c.cmp_block - 1) / 2
        k_cmp = apply_rope(k_cmp, centres, self.inv_freq)
        k_slc = apply_rope(k_slc, positions, self.inv_freq)
        k_win = k_slc if self.num_kv_sets == 1 else apply_rope(k_win, positions, self.inv_freq)
        p = c.nsa_params
        out = nsa_attention(
            q, k_slc, v_slc, k_cmp, v_cmp, self.gates(x), k_win=k_win, v_win=v_win,
            cmp_block=p.cmp_block, cmp_stride=p.cmp_stride, sel_block=p.sel_block,
            num_selected=p.num_selected, window=p.window, num_init=p.num_init,
            num_local=p.num_local, backend=c.backend,
        )  # [B, T, HQ, Dv]
        return self.o_proj(out.reshape(B, T, c.num_heads * c.head_dim_v))


class DenseAttention(nn.Module):
    """Causal softmax attention with GQA through SDPA: the baseline NSA is measured against."""

    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.config = c = config
        self.q_proj = nn.Linear(c.dim, c.num_heads * c.head_dim_k, bias=False)
        self.kv_proj = nn.Linear(c.dim, c.num_kv_heads * (c.head_dim_k + c.head_dim_v), bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim_v, c.dim, bias=False)
        self.register_buffer("inv_freq", rope_frequencies(c.head_dim_k, c.rope_base), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        B, T, _ = x.shape
        positions = torch.arange(T, device=x.device)
        q = apply_rope(self.q_proj(x).view(B, T, c.num_heads, c.head_dim_k), positions, self.inv_freq)
        kv = self.kv_proj(x).view(B, T, c.num_kv_heads, c.head_dim_k + c.head_dim_v)
        k, v = kv.split([c.head_dim_k, c.head_dim_v], dim=-1)
        k = apply_rope(k, positions, self.inv_freq)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=c.num_heads != c.num_kv_heads,
        )  # [B, HQ, T, Dv]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, c.num_heads * c.head_dim_v))
