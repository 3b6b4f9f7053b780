"""Our tokenizers as Hugging Face fast tokenizers (a ``tokenizer.json``), which
``AutoTokenizer.from_pretrained(DIR)`` loads with no import of nsa and no remote code.

Both are byte-level BPE as the ``tokenizers`` library runs it (GPT-2's layout: each byte is one
printable character of the vocabulary), and encode and decode exactly as
:mod:`nsa.train.tokenizer` does:

* ``bytes``: the 256 single bytes, id = byte value, no merges and no splitting of the text;
* ``gpt2``: tiktoken's ``gpt2`` ranks, pattern and end-of-text id, its merges recovered from the
  ranks (the merge that makes token ``r`` is the split BPE reaches using ranks below ``r``).
  ``ignore_merges`` emits a piece that is one token as that token, as tiktoken does.

The end-of-text token is the ``eos_token``; ``split_special_tokens`` makes its text in a
document encode as ordinary text (``encode_ordinary``, and the byte tokenizer's NUL byte), so
``encode`` never differs from ours.
"""

from __future__ import annotations

from functools import cache

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from nsa.train.tokenizer import TOKENIZERS, get_tokenizer


@cache
def byte_to_char() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (the byte-level alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + i) for i, b in enumerate(others)})
    return chars


def _text(token: bytes) -> str:
    chars = byte_to_char()
    return "".join(chars[b] for b in token)


def _bpe_split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's BPE of ``token`` using only the ranks below ``max_rank``."""
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < max_rank and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            return parts
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
    """The BPE merges, in rank order, that make every multi-byte token of ``ranks``."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            first, second = _bpe_split(ranks, token, rank)
            merges.append((_text(first), _text(second)))
    return merges


def byte_level_bpe(ranks: dict[bytes, int], pattern: str | None,
                   special: dict[str, int]) -> Tokenizer:
    """A ``tokenizers`` byte-level BPE: vocabulary ``ranks`` (token bytes -> id) plus
    ``special`` (text -> id), pieces split by the regex ``pattern`` (None: the whole text)."""
    vocab = {_text(token): rank for token, rank in ranks.items()} | special
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges_from_ranks(ranks),
                                     ignore_merges=True))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pattern is None:
        tokenizer.pre_tokenizer = byte_level
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def hf_tokenizer(name: str, model_max_length: int) -> PreTrainedTokenizerFast:
    """Our tokenizer ``name`` (``bytes`` or ``gpt2``) as a Hugging Face fast tokenizer; gpt2
    needs tiktoken's files (``TokenizerUnavailableError`` otherwise)."""
    if name not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {sorted(TOKENIZERS)}, got {name!r}")
    if name == "bytes":
        eot = get_tokenizer("bytes").eot
        backend = byte_level_bpe({bytes([b]): b for b in range(256)}, None, {})
        eos_token = _text(bytes([eot]))  # the vocabulary's own token for NUL
    else:
        encoding = get_tokenizer("gpt2")._encoding
        backend = byte_level_bpe(encoding._mergeable_ranks, encoding._pat_str,
                                 encoding._special_tokens)
        eos_token = "<|endoftext|>"
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=eos_token, split_special_tokens=True,
        clean_up_tokenization_spaces=False, model_max_length=model_max_length)
