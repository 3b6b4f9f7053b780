"""Model configuration and named presets.

One tree: :class:`ModelConfig` holds an :class:`~nsa.layers.attention.AttentionConfig`, which
holds the op's block parameters (:class:`~nsa.ops.NSAParams`). Each field lives in one place;
``nsa.config_tree`` changes fields by name (``window=256``, ``attention.window=256``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from nsa.config_tree import from_dict, replace_fields
from nsa.layers.attention import (
    AttentionConfig,
    check_positive_float,
    check_positive_int,
)
from nsa.ops.params import NSAParams


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only language model (RMSNorm, SwiGLU, RoPE) with NSA or dense attention; its
    width and heads are the attention's (``attention.dim``)."""

    vocab_size: int = 256
    num_layers: int = 2
    mlp_hidden: int | None = None  # default: 8/3 · dim rounded up to a multiple of 64
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    attention: AttentionConfig = AttentionConfig()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "max_seq_len"):
            check_positive_int(name, getattr(self, name))
        check_positive_float("norm_eps", self.norm_eps)
        if self.mlp_hidden is not None:
            check_positive_int("mlp_hidden", self.mlp_hidden)
        if not isinstance(self.attention, AttentionConfig):
            raise ValueError(f"attention must be an AttentionConfig, got "
                             f"{type(self.attention).__name__}")

    @property
    def dim(self) -> int:
        """The residual stream's width."""
        return self.attention.dim

    @property
    def hidden_dim(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return -(-int(8 * self.dim / 3) // 64) * 64

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        """From ``dataclasses.asdict`` output, or from the flat dict that checkpoints and
        exported files written before the config tree hold (``attention`` the kind, every
        attention and block field beside it)."""
        if isinstance(data, dict) and isinstance(data.get("attention"), str):
            data = _nest_flat(data)
        return from_dict(cls, data)


def _nest_flat(flat: dict) -> dict:
    """The flat layout (before the tree) -> nested dicts."""
    flat = dict(flat)
    attention = {"kind": flat.pop("attention")}
    for name in [f.name for f in fields(AttentionConfig)]:
        if name in flat:
            attention[name] = flat.pop(name)
    attention["nsa"] = {f.name: flat.pop(f.name) for f in fields(NSAParams) if f.name in flat}
    return {**flat, "attention": attention}


MODEL_PRESETS: dict[str, ModelConfig] = {
    # Trains to < 2.2 nats/byte on the bundled corpus in minutes on 2 CPU cores.
    "tiny": ModelConfig(
        num_layers=2, max_seq_len=128,
        attention=AttentionConfig(dim=128, num_heads=4, num_kv_heads=2, head_dim_k=32,
                                  head_dim_v=32, nsa=NSAParams(cmp_block=16, cmp_stride=8,
                                                               sel_block=16, num_selected=4,
                                                               window=32)),
    ),
    # One layer: the shape used in examples and small experiments.
    "showcase": ModelConfig(
        num_layers=1, max_seq_len=128,
        attention=AttentionConfig(dim=128, num_heads=8, num_kv_heads=2, head_dim_k=16,
                                  head_dim_v=16, nsa=NSAParams(cmp_block=16, cmp_stride=8,
                                                               sel_block=32, num_selected=4,
                                                               window=64)),
    ),
    # 125M parameters, paper block sizes, GPT-2 vocabulary padded to 50304.
    "m7c-125m": ModelConfig(
        vocab_size=50304, num_layers=12, max_seq_len=2048,
        attention=AttentionConfig(dim=768, num_heads=12, num_kv_heads=2, head_dim_k=64,
                                  head_dim_v=64, nsa=NSAParams(cmp_block=32, cmp_stride=16,
                                                               sel_block=64, num_selected=16,
                                                               window=512)),
    ),
}


def model_preset(name: str, **overrides) -> ModelConfig:
    """The named preset with fields changed by name (``model_preset("tiny", kind="dense",
    window=64)``; see :func:`nsa.config_tree.replace_fields`)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    return replace_fields(MODEL_PRESETS[name], **overrides)
