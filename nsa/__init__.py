"""nsa: Native Sparse Attention for PyTorch (op, layer, language model, trainer)."""

from nsa.ops import NSAParams, compressed_length, nsa_attention, nsa_select

__all__ = ["NSAParams", "compressed_length", "nsa_attention", "nsa_select"]
__version__ = "0.1.0"
