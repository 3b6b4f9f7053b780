"""Decoder-only language model: embedding -> N x (RMSNorm, attention, RMSNorm, SwiGLU) -> head."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nsa.layers.attention import attention_layer, completes_compressed_token
from nsa.layers.documents import PackedDocuments, pack_documents
from nsa.layers.rope import PositionAngles
from nsa.models.config import ModelConfig
from nsa.models.decoding import stream_tokens
from nsa.ops.triton_support import triton_takes


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of gate_up [..., 2·hidden] = [gate | up]: the Triton kernels
    (nsa/ops/triton/swiglu.py) for CUDA tensors of their dtypes where Triton is installed,
    PyTorch elsewhere."""
    if triton_takes(gate_up):
        from nsa.ops.triton.swiglu import swiglu_triton

        return swiglu_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy (float32) of logits [N, V] against targets [N] (-100: not
    counted): the Triton kernels (nsa/ops/triton/cross_entropy.py) for CUDA logits of their
    dtypes where Triton is installed, ``F.cross_entropy`` of the float32 logits elsewhere."""
    if triton_takes(logits):
        from nsa.ops.triton.cross_entropy import cross_entropy_triton

        return cross_entropy_triton(logits, targets)
    return F.cross_entropy(logits.float(), targets)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (its parameters, state and CPU path) through the Triton kernels
    (nsa/ops/triton/rms_norm.py) for CUDA tensors of their dtypes where Triton is installed.
    There the output is written in autocast's dtype while autocast runs (the projections that
    read it would cast it to that; x's dtype otherwise, as ``nn.RMSNorm``)."""

    def _kernels_take(self, *xs: torch.Tensor) -> bool:
        if self.weight is None or not all(triton_takes(x) for x in xs):
            return False
        from nsa.ops.triton.rms_norm import RMS_MAX_WIDTH  # Triton is installed here

        return xs[0].shape[-1] <= RMS_MAX_WIDTH

    @staticmethod
    def _out_dtype(x: torch.Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return x.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._kernels_take(x):
            return super().forward(x)
        from nsa.ops.triton.rms_norm import rms_norm_triton

        return rms_norm_triton(x, self.weight, self.eps, self._out_dtype(x))

    def add_forward(self, x: torch.Tensor, update: torch.Tensor | None):
        """(h, norm(h)) of the residual update h = x + update (x where update is None), in one
        pass where the kernels take both."""
        if update is None:
            return x, self(x)
        if not self._kernels_take(x, update):
            h = x + update
            return h, self(h)
        from nsa.ops.triton.rms_norm import add_rms_norm_triton

        return add_rms_norm_triton(x, update, self.weight, self.eps,
                                   self._out_dtype(x))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate_up(x)))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attn = attention_layer(config.attention)
        self.mlp_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.mlp = SwiGLU(config.dim, config.hidden_dim)

    def forward(self, x: torch.Tensor, update: torch.Tensor | None = None,
                documents: PackedDocuments | None = None,
                angles: PositionAngles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual, update) of the residual stream x [B, T, dim] and the update the block
        before left to add to it (None: none): the block's output is their sum, left to the
        norm after it (the next block's, the model's) to form in its pass, as each norm here
        forms the sum it reads."""
        x, normed = self.attn_norm.add_forward(x, update)
        x, normed = self.mlp_norm.add_forward(x, self.attn(normed, documents, angles))
        return x, self.mlp(normed)

    def _mlp_residual(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """h + mlp(norm(h)) of h = x + attn_out (the add and the norm in one pass): the block's
        output in prefill and decode."""
        h, normed = self.mlp_norm.add_forward(x, attn_out)
        return h + self.mlp(normed)

    def new_cache(self, batch: int, capacity: int, device, dtype):
        """The attention layer's decode cache (a method of the block so that FSDP2 gathers the
        weights the cache keeps: nsa.train.distributed)."""
        return self.attn.new_cache(batch, capacity, device, dtype)

    def prefill(self, x: torch.Tensor, lengths: torch.Tensor, cache) -> torch.Tensor:
        return self._mlp_residual(x, self.attn.prefill(self.attn_norm(x), lengths, cache))

    def decode(self, x: torch.Tensor, pos: torch.Tensor, cache, compress: bool = True,
               angles: PositionAngles | None = None) -> torch.Tensor:
        return self._mlp_residual(x, self.attn.decode(self.attn_norm(x), pos, cache, compress,
                                                      angles))


@dataclass
class ModelCache:
    """Decoding state of a model: per-sequence lengths [B] (int64, on the device) and one
    cache per layer. ``decode_step`` advances ``lengths`` in place."""

    lengths: torch.Tensor
    layers: list

    @property
    def capacity(self) -> int:
        """Positions each sequence can hold."""
        return self.layers[0].k.shape[1]


class LanguageModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.checkpoint_blocks = False  # activation checkpointing per block (set by the trainer)
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
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

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None):
        """tokens [B, T] -> logits [B, T, vocab], or the mean cross-entropy if ``targets`` given.

        ``cu_seqlens`` (int32 [N+1], B = 1) packs N documents along T, each computed as if
        alone (positions restart; attention and compressed tokens stay inside a document), so
        T may exceed max_seq_len as long as no document does. Pass it on the CPU: its values
        are read on the host (a device sync for a GPU tensor). The loss is unchanged: targets
        are read as given, across boundaries too. Generation takes no documents.
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape [B, T], got {tuple(tokens.shape)}")
        documents = None
        if cu_seqlens is None:
            self._check_length("tokens", tokens.shape[1])
        else:
            documents = pack_documents(cu_seqlens, *tokens.shape, tokens.device,
                                       self.config.attention.nsa)
            self._check_length("a document of cu_seqlens", documents.max_length)
        x = self.embed(tokens)  # [B, T, dim]
        # Every layer has the same RoPE frequencies (one attention config): the angles of the
        # positions once per forward, not per layer (a few small kernels each).
        angles = self.blocks[0].attn.position_angles(tokens.shape[1], documents, tokens.device)
        update = None  # each block's output is x + update, added in the next norm's pass
        for block in self.blocks:
            if self.checkpoint_blocks and torch.is_grad_enabled():
                x, update = checkpoint(block, x, update, documents, angles,
                                       use_reentrant=False)  # recomputed
            else:
                x, update = block(x, update, documents, angles)
        logits = self.head(self.norm.add_forward(x, update)[1])
        if targets is None:
            return logits
        return next_token_loss(logits.flatten(0, 1), targets.flatten())

    def _check_length(self, name: str, length: int) -> None:
        """Refuse more positions than the model was built for (never trained, beyond RoPE's
        training range): the sampling loop never feeds more than max_seq_len tokens."""
        if length > self.config.max_seq_len:
            raise ValueError(
                f"{name}: {length} positions, more than the model's max_seq_len "
                f"({self.config.max_seq_len}); feed at most max_seq_len tokens, or build the "
                f"model with a larger one (ModelConfig(max_seq_len=...), the max_seq_len= "
                f"override of 'nsa train')")

    # Decoding -----------------------------------------------------------------------------

    def new_cache(self, batch: int, capacity: int | None = None, device=None,
                  dtype=None) -> ModelCache:
        """Empty caches for ``batch`` sequences of up to ``capacity`` tokens (1 to max_seq_len,
        default max_seq_len), in the dtype keys and values are computed in unless given: the
        autocast dtype when autocast is on for the device (bf16 keys, half the bytes a step
        reads), else the dtype of the model's weights."""
        if capacity is None:
            capacity = self.config.max_seq_len
        for name, value in (("batch", batch), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self._check_length("capacity", capacity)
        device = torch.device(device or self.embed.weight.device)
        if dtype is None:
            dtype = (torch.get_autocast_dtype(device.type)
                     if torch.is_autocast_enabled(device.type) else self.embed.weight.dtype)
        layers = [block.new_cache(batch, capacity, device, dtype) for block in self.blocks]
        return ModelCache(torch.zeros(batch, dtype=torch.long, device=device), layers)

    def prefill(self, tokens: torch.Tensor, cache: ModelCache,
                lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Run prompts [B, P] (right-padded; sequence b is ``lengths[b]`` long, in [1, P],
        default P) and fill ``cache``, from position 0. Returns the logits [B, vocab] at each
        sequence's last prompt token. Checking ``lengths`` reads it once on the host."""
        if tokens.dim() != 2 or 0 in tokens.shape:
            raise ValueError(f"tokens must have shape [B, P] with B, P >= 1, got "
                             f"{tuple(tokens.shape)}")
        B, P = tokens.shape
        self._check_length("tokens", P)
        if B != cache.lengths.shape[0]:
            raise ValueError(f"tokens hold {B} sequences, the cache {cache.lengths.shape[0]}")
        if P > cache.capacity:
            raise ValueError(f"prompt of {P} tokens exceeds the cache capacity {cache.capacity}")
        if lengths is None:
            lengths = torch.full((B,), P, dtype=torch.long, device=tokens.device)
        elif (lengths.shape != (B,) or lengths.dtype not in (torch.int32, torch.int64)
              or bool(((lengths < 1) | (lengths > P)).any())):
            raise ValueError(f"lengths must be integers of shape [{B}] in [1, P={P}], got "
                             f"{lengths.tolist()}")
        x = self.embed(tokens)
        for block, layer_cache in zip(self.blocks, cache.layers, strict=True):
            x = block.prefill(x, lengths, layer_cache)
        cache.lengths.copy_(lengths)
        last = x[torch.arange(B, device=x.device), lengths - 1]  # [B, dim]
        return self.head(self.norm(last))

    def decode_step(self, tokens: torch.Tensor, cache: ModelCache,
                    compress: bool = True) -> torch.Tensor:
        """One token per sequence, tokens [B] at positions ``cache.lengths`` -> logits
        [B, vocab]. No host sync and static shapes (capturable in a CUDA graph); the caller
        keeps lengths below the cache capacity. ``compress=False`` skips NSA's
        compressed-token update, for a caller that knows no sequence completes a compressed
        token at this step (:meth:`completes_compressed_token`): most steps, d - 1 in d."""
        pos = cache.lengths
        x = self.embed(tokens)[:, None]  # [B, 1, dim]
        # Every layer has the same RoPE frequencies (one attention config): the angles of pos
        # once per step, not per layer (four small kernels each).
        angles = PositionAngles(self.blocks[0].attn.rope.angles(pos[:, None]))
        for block, layer_cache in zip(self.blocks, cache.layers, strict=True):
            x = block.decode(x, pos, layer_cache, compress, angles)
        cache.lengths += 1
        return self.head(self.norm(x[:, 0]))

    def completes_compressed_token(self, position: int) -> bool:
        """Whether a decode step at ``position`` completes a compressed token (then it needs
        ``compress=True``); never for dense attention."""
        return completes_compressed_token(self.config.attention, position)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """prompt [B, P] followed by ``max_new_tokens`` sampled tokens -> [B, P +
        max_new_tokens], by :func:`nsa.models.decoding.stream_tokens` and its context rule
        (a prompt longer than max_seq_len is read from its last max_seq_len tokens; past
        max_seq_len the KV cache restarts from the newest max_seq_len // 2)."""
        new_tokens = stream_tokens(self, prompt, max_new_tokens, temperature=temperature,
                                   top_k=top_k, top_p=top_p, generator=generator)
        return torch.cat([prompt, torch.stack(list(new_tokens), dim=1)], dim=1)
