"""Modules: attention layers, compressors, RoPE."""

from nsa.layers.attention import AttentionConfig, DenseAttention, NSAttention
from nsa.layers.compressor import Compressor

__all__ = ["AttentionConfig", "Compressor", "DenseAttention", "NSAttention"]
