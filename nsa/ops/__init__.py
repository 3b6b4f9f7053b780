"""Functional NSA: the op, selection and their parameters (no ``nn.Module`` here)."""

from nsa.ops.attention import nsa_attention, nsa_select
from nsa.ops.params import NSAParams, compressed_length

__all__ = ["NSAParams", "compressed_length", "nsa_attention", "nsa_select"]
