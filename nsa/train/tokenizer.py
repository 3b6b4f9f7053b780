"""Byte-level tokenizer: every UTF-8 byte is a token (vocabulary of 256)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

VOCAB_SIZE = 256
_INVALID_BYTE = 0xFF  # never valid in UTF-8, so it decodes to U+FFFD


def encode(text: str) -> torch.Tensor:
    """str -> [N] int64 tokens, the UTF-8 bytes of ``text``."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(tokens: torch.Tensor | Iterable[int]) -> str:
    """Tokens -> str. Invalid UTF-8, and ids outside [0, 256) (a model with a larger
    vocabulary may sample them), decode as U+FFFD."""
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    data = bytes(i if 0 <= i < VOCAB_SIZE else _INVALID_BYTE for i in ids)
    return data.decode("utf-8", errors="replace")
