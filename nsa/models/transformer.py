"""Decoder-only language model: embedding -> N x (RMSNorm, attention, RMSNorm, SwiGLU) -> head."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nsa.layers.attention import DenseAttention, NSAttention
from nsa.models.config import ModelConfig


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        attention = NSAttention if config.attention == "nsa" else DenseAttention
        self.attn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attn = attention(config.attention_config)
        self.mlp_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.mlp = SwiGLU(config.dim, config.hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LanguageModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.checkpoint_blocks = False  # activation checkpointing per block (set by the trainer)
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.num_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.o_proj.weight, std=residual_std)
            nn.init.normal_(block.mlp.down.weight, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        """tokens [B, T] -> logits [B, T, vocab], or the mean cross-entropy if ``targets`` given."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape [B, T], got {tuple(tokens.shape)}")
        x = self.embed(tokens)  # [B, T, dim]
        for block in self.blocks:
            if self.checkpoint_blocks and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)  # recomputed in backward
            else:
                x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` after ``tokens`` [B, T] by re-running the whole context."""
        for _ in range(max_new_tokens):
            context = tokens[:, -self.config.max_seq_len:]
            logits = self(context)[:, -1].float() / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, next_token], dim=1)
        return tokens
