"""Modules: attention layers, compressors, RoPE."""

from nsa.layers.attention import AttentionConfig, DenseAttention, NSAttention, attention_layer
from nsa.layers.compressor import Compressor

__all__ = ["AttentionConfig", "Compressor", "DenseAttention", "NSAttention", "attention_layer"]
