"""Model configuration and named presets."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from nsa.layers.attention import AttentionConfig, check_positive_float, check_positive_int

ATTENTIONS = ("nsa", "dense")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only language model (RMSNorm, SwiGLU, RoPE) with NSA or dense attention."""

    vocab_size: int = 256
    dim: int = 128
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim_k: int = 16
    head_dim_v: int = 16
    mlp_hidden: int | None = None  # default: 8/3 · dim rounded up to a multiple of 64
    max_seq_len: int = 256
    attention: str = "nsa"
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    # NSA (see NSA_SPEC.md)
    cmp_block: int = 32
    cmp_stride: int = 16
    sel_block: int = 64
    num_selected: int = 16
    window: int = 512
    num_init: int = 1
    num_local: int = 2
    kv_sharing: str = "independent"
    compressor: str = "mlp"
    compressor_hidden: int | None = None
    force_branch: str | None = None
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "max_seq_len"):
            check_positive_int(name, getattr(self, name))
        check_positive_float("norm_eps", self.norm_eps)
        if self.mlp_hidden is not None:
            check_positive_int("mlp_hidden", self.mlp_hidden)
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        _ = self.attention_config  # building AttentionConfig validates the attention fields

    @property
    def attention_config(self) -> AttentionConfig:
        names = {f.name for f in fields(AttentionConfig)}
        return AttentionConfig(**{k: v for k, v in self.__dict__.items() if k in names})

    @property
    def hidden_dim(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return -(-int(8 * self.dim / 3) // 64) * 64


MODEL_PRESETS: dict[str, ModelConfig] = {
    # Trains to < 2.2 nats/byte on the bundled corpus in minutes on 2 CPU cores.
    "tiny": ModelConfig(
        dim=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim_k=32, head_dim_v=32,
        max_seq_len=128, cmp_block=16, cmp_stride=8, sel_block=16, num_selected=4, window=32,
    ),
    # One layer: the shape used in examples and small experiments.
    "showcase": ModelConfig(
        dim=128, num_layers=1, num_heads=8, num_kv_heads=2, head_dim_k=16, head_dim_v=16,
        max_seq_len=128, cmp_block=16, cmp_stride=8, sel_block=32, num_selected=4, window=64,
    ),
    # 125M parameters, paper block sizes, GPT-2 vocabulary padded to 50304.
    "m7c-125m": ModelConfig(
        vocab_size=50304, dim=768, num_layers=12, num_heads=12, num_kv_heads=2,
        head_dim_k=64, head_dim_v=64, max_seq_len=2048, cmp_block=32, cmp_stride=16,
        sel_block=64, num_selected=16, window=512,
    ),
}


def model_preset(name: str, **overrides) -> ModelConfig:
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    return replace(MODEL_PRESETS[name], **overrides)
