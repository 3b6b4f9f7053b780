"""Decoder-only language model: embedding -> N x (RMSNorm, attention, RMSNorm, SwiGLU) -> head."""

from __future__ import annotations

import math
from dataclasses import dataclass

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

    def prefill(self, x: torch.Tensor, lengths: torch.Tensor, cache) -> torch.Tensor:
        x = x + self.attn.prefill(self.attn_norm(x), lengths, cache)
        return x + self.mlp(self.mlp_norm(x))

    def decode(self, x: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
        x = x + self.attn.decode(self.attn_norm(x), pos, cache)
        return x + self.mlp(self.mlp_norm(x))


@dataclass
class ModelCache:
    """Decoding state of a model: per-sequence lengths [B] (int64, on the device) and one
    cache per layer. ``decode_step`` advances ``lengths`` in place."""

    lengths: torch.Tensor
    layers: list


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

    # Decoding -----------------------------------------------------------------------------

    def new_cache(self, batch: int, capacity: int | None = None, device=None,
                  dtype=None) -> ModelCache:
        """Empty caches for ``batch`` sequences of up to ``capacity`` (default max_seq_len)
        tokens, in the dtype keys and values are computed in unless given: the autocast dtype
        when autocast is on for the device (bf16 keys, half the bytes a step reads), else the
        dtype of the model's weights."""
        capacity = capacity or self.config.max_seq_len
        device = torch.device(device or self.embed.weight.device)
        if dtype is None:
            dtype = (torch.get_autocast_dtype(device.type)
                     if torch.is_autocast_enabled(device.type) else self.embed.weight.dtype)
        layers = [block.attn.new_cache(batch, capacity, device, dtype) for block in self.blocks]
        return ModelCache(torch.zeros(batch, dtype=torch.long, device=device), layers)

    def prefill(self, tokens: torch.Tensor, cache: ModelCache,
                lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Run prompts [B, P] (right-padded; sequence b is ``lengths[b]`` long, default P) and
        fill ``cache``. Returns the logits [B, vocab] at each sequence's last prompt token."""
        B, P = tokens.shape
        if P > cache.layers[0].k.shape[1]:
            raise ValueError(f"prompt of {P} tokens exceeds the cache capacity "
                             f"{cache.layers[0].k.shape[1]}")
        if lengths is None:
            lengths = torch.full((B,), P, dtype=torch.long, device=tokens.device)
        x = self.embed(tokens)
        for block, layer_cache in zip(self.blocks, cache.layers, strict=True):
            x = block.prefill(x, lengths, layer_cache)
        cache.lengths.copy_(lengths)
        last = x[torch.arange(B, device=x.device), lengths - 1]  # [B, dim]
        return self.head(self.norm(last))

    def decode_step(self, tokens: torch.Tensor, cache: ModelCache) -> torch.Tensor:
        """One token per sequence, tokens [B] at positions ``cache.lengths`` -> logits
        [B, vocab]. No host sync and static shapes (capturable in a CUDA graph); the caller
        keeps lengths below the cache capacity."""
        pos = cache.lengths
        x = self.embed(tokens)[:, None]  # [B, 1, dim]
        for block, layer_cache in zip(self.blocks, cache.layers, strict=True):
            x = block.decode(x, pos, layer_cache)
        cache.lengths += 1
        return self.head(self.norm(x[:, 0]))

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` after ``tokens`` [B, T]: prefill a KV cache, then one
        decode step per token. Past max_seq_len the model re-runs its last max_seq_len tokens
        for every new one (positions cannot grow beyond what it was trained on)."""
        B, T = tokens.shape
        if T + max_new_tokens <= self.config.max_seq_len:
            cache = self.new_cache(B, T + max_new_tokens)
            logits = self.prefill(tokens, cache)
            for _ in range(max_new_tokens):
                next_token = sample_token(logits, temperature, top_k, top_p, generator)
                tokens = torch.cat([tokens, next_token[:, None]], dim=1)
                logits = self.decode_step(next_token, cache)
            return tokens
        for _ in range(max_new_tokens):
            logits = self(tokens[:, -self.config.max_seq_len:])[:, -1]
            next_token = sample_token(logits, temperature, top_k, top_p, generator)
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        return tokens


def sample_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> [B] sampled ids: temperature, then top-k, then top-p (nucleus)."""
    logits = logits.float() / max(temperature, 1e-6)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        outside = probs.cumsum(-1) - probs > top_p  # keeps the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)[:, 0]
