"""nsa: Native Sparse Attention for PyTorch (op, layer, language model, trainer)."""

from nsa.layers import AttentionConfig, DenseAttention, NSAttention
from nsa.models import LanguageModel, ModelConfig, model_preset
from nsa.ops import NSAParams, compressed_length, nsa_attention, nsa_select

__all__ = [
    "AttentionConfig", "DenseAttention", "LanguageModel", "ModelConfig", "NSAParams",
    "NSAttention", "compressed_length", "model_preset", "nsa_attention", "nsa_select",
]
__version__ = "0.1.0"
