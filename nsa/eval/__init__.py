"""Evaluation of trained models (``nsa eval``): perplexity on held-out text and passkey
retrieval."""

from nsa.eval.passkey import PasskeyCell, passkey_accuracy, passkey_correct, passkey_table
from nsa.eval.perplexity import Perplexity, file_texts, perplexity, validation_texts

__all__ = [
    "PasskeyCell", "Perplexity", "file_texts", "passkey_accuracy", "passkey_correct",
    "passkey_table", "perplexity", "validation_texts",
]
