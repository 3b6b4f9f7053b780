"""Tokenizers: the byte-level one (every UTF-8 byte is a token, a vocabulary of 256) and GPT-2's
BPE through tiktoken, behind one small interface (:class:`Tokenizer`, :func:`get_tokenizer`).

The module-level :func:`encode` / :func:`decode` are the byte tokenizer on tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

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


class Tokenizer(Protocol):
    """Text <-> token ids. ``eot`` ends every document of a packed stream; ``vocab_size`` is the
    embedding size a model needs (it may exceed the ids the tokenizer produces)."""

    name: str
    vocab_size: int
    eot: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: torch.Tensor | Iterable[int]) -> str: ...


class ByteTokenizer:
    """The UTF-8 bytes of the text. Byte 0 (NUL, which text practically never holds) is the
    end-of-text separator between documents, so a document containing NUL reads as two."""

    name = "bytes"
    vocab_size = VOCAB_SIZE
    eot = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: torch.Tensor | Iterable[int]) -> str:
        return decode(ids)


class TokenizerUnavailableError(RuntimeError):
    """A tokenizer's files or package could not be loaded."""


class GPT2Tokenizer:
    """GPT-2's BPE (tiktoken ``gpt2``): 50257 ids, ``<|endoftext|>`` = 50256 ends documents, and
    the vocabulary is padded to 50304 (a multiple of 64) for the model's embedding.

    Text is encoded as ordinary text: a literal ``<|endoftext|>`` in a document is not the eot id.
    """

    name = "gpt2"
    vocab_size = 50304
    eot = 50256

    def __init__(self) -> None:
        try:
            import tiktoken
        except ImportError as error:
            raise TokenizerUnavailableError(
                "the gpt2 tokenizer needs tiktoken: pip install 'nsa[train]'") from error
        try:
            self._encoding = tiktoken.get_encoding("gpt2")
        except Exception as error:
            raise TokenizerUnavailableError(
                "could not load tiktoken's gpt2 BPE files. tiktoken downloads them from the "
                "internet on first use and caches them; without internet access, set "
                "TIKTOKEN_CACHE_DIR to a directory holding the cached files (copied from a "
                "machine where tiktoken.get_encoding('gpt2') worked with the same "
                f"TIKTOKEN_CACHE_DIR). Cause: {error!r}") from error

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: torch.Tensor | Iterable[int]) -> str:
        """Ids -> str; padding ids (>= 50257, which a model may sample), negative ids and
        invalid UTF-8 decode as U+FFFD."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        known = self._encoding.n_vocab
        data = b"".join(self._encoding.decode_single_token_bytes(i) if 0 <= i < known
                        else bytes([_INVALID_BYTE]) for i in ids)
        return data.decode("utf-8", errors="replace")


TOKENIZERS = {"bytes": ByteTokenizer, "gpt2": GPT2Tokenizer}


def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer called ``name`` (a key of :data:`TOKENIZERS`); gpt2 loads tiktoken now."""
    if name not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {sorted(TOKENIZERS)}, got {name!r}")
    return TOKENIZERS[name]()
