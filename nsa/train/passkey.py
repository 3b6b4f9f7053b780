"""Passkey documents: filler text with a random key planted at a chosen depth, and the question
that asks for it (the retrieval test of Mohtashami & Jaggi, 2023, "Landmark Attention"):

    <filler> The pass key is 71432. Remember it. <filler> What is the pass key? The pass key is
    | 71432      (the answer, after the prompt)

Lengths count tokens of the model's tokenizer and are exact: the filler (one paragraph repeated,
cut anywhere) takes whatever the needle and the question leave. Depth d (percent) puts the
needle after ``round(d / 100 * F)`` of the F filler tokens: 0 first, 100 right before the
question. Every draw (keys, lengths, depths) comes from a ``torch.Generator``, so documents are
pure functions of its seed.

Two users: ``nsa eval --tasks passkey`` asks for the key (:mod:`nsa.eval.passkey`), and the
training source ``data=passkey[:MIN-MAX[:LO-HI|:distance]][:answers]`` (:func:`passkey_batch`)
packs whole documents, answer included, into rows (with ``:answers`` the loss reads the answers'
tokens only). Depths drawn uniformly make long distances from needle to question rare (they need
the longest documents and the smallest depths), and a model learns to retrieve only over the
distances its training holds often (QUALITY.md, twenty-second session); with ``:distance`` the
needle's distance is drawn uniformly instead, then a document long enough to hold it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from nsa.train.data import batch_generator
from nsa.train.errors import SetupError
from nsa.train.tokenizer import Tokenizer

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")
NEEDLE = "The pass key is {key}. Remember it. "
QUESTION = "What is the pass key? The pass key is"
ANSWER = " {key}"
KEY_DIGITS = 5
# Tokens a model generates to answer: the answer's bytes, since no token of our tokenizers (bytes,
# GPT-2's BPE) is shorter than a byte.
ANSWER_TOKENS = len(ANSWER.format(key="9" * KEY_DIGITS).encode())
IGNORED = -100  # a target the loss skips (F.cross_entropy's default ignore_index)
_SOURCE = re.compile(
    r"passkey(?::(\d+)-(\d+)(?::(?:(\d+(?:\.\d*)?)-(\d+(?:\.\d*)?)|(distance)))?)?(:answers)?")


def random_key(generator: torch.Generator) -> str:
    """A key of KEY_DIGITS digits, the first not 0."""
    return str(int(torch.randint(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS, (1,),
                                 generator=generator)))


@dataclass(frozen=True)
class PasskeyPrompt:
    tokens: list[int]  # filler, needle, filler, question: exactly the length asked for
    key: str
    needle_start: int  # index in tokens of the needle's first token


class PasskeyText:
    """Passkey prompts and documents in a tokenizer's tokens (the fixed pieces encoded once)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._filler = tokenizer.encode(FILLER)
        self._question = tokenizer.encode(QUESTION)
        # Needle and question of any key fit in this many tokens (at most one per byte).
        self.shortest_prompt = len((NEEDLE.format(key="9" * KEY_DIGITS) + QUESTION).encode())

    @property
    def shortest_context(self) -> int:
        """The shortest context length of :func:`nsa.eval.passkey.passkey_accuracy`: a prompt
        and ``ANSWER_TOKENS`` generated tokens."""
        return self.shortest_prompt + ANSWER_TOKENS

    @property
    def shortest_document(self) -> int:
        """The shortest training document: prompt, answer and end-of-text."""
        return self.shortest_context + 1

    def prompt(self, length: int, depth: float, key: str) -> PasskeyPrompt:
        """Exactly ``length`` tokens ending in the question; the needle at ``depth`` percent of
        the filler. ValueError when ``length`` is shorter than needle and question or the depth
        is outside [0, 100]."""
        if not 0 <= depth <= 100:
            raise ValueError(f"a passkey depth is a percentage in [0, 100], got {depth}")
        needle = self.tokenizer.encode(NEEDLE.format(key=key))
        num_filler = length - len(needle) - len(self._question)
        if num_filler < 0:
            raise ValueError(f"a passkey prompt needs at least {len(needle) + len(self._question)} "
                             f"tokens, got {length}")
        filler = (self._filler * (num_filler // len(self._filler) + 1))[:num_filler]
        at = round(depth / 100 * num_filler)
        return PasskeyPrompt(filler[:at] + needle + filler[at:] + self._question, key, at)

    def answer(self, key: str) -> list[int]:
        return self.tokenizer.encode(ANSWER.format(key=key))

    def fixed_tokens(self, key: str) -> int:
        """The tokens of a document of ``key`` that are not filler: needle, question, answer and
        end-of-text."""
        return (len(self.tokenizer.encode(NEEDLE.format(key=key))) + len(self._question)
                + len(self.answer(key)) + 1)

    def document(self, length: int, depth: float, key: str) -> tuple[list[int], list[bool]]:
        """(tokens, is_answer): prompt, answer and the tokenizer's end-of-text id, exactly
        ``length`` tokens, and which of them are the answer's."""
        answer = self.answer(key)
        prompt = self.prompt(length - len(answer) - 1, depth, key)
        is_answer = [False] * len(prompt.tokens) + [True] * len(answer) + [False]
        return prompt.tokens + answer + [self.tokenizer.eot], is_answer


@dataclass(frozen=True)
class PasskeySource:
    """The documents of ``data=passkey:MIN-MAX:LO-HI[:answers]``: lengths MIN to MAX tokens
    (end-of-text included), needle depths LO to HI percent, each drawn uniformly; with
    ``uniform_distance`` (``:distance`` for LO-HI) the filler tokens between needle and question
    are drawn uniformly from 0 to what a MAX-token document holds, then the length uniformly
    from those that hold them. With ``answers_only`` every target but the answers' tokens is
    ignored by the loss."""

    min_length: int
    max_length: int
    min_depth: float
    max_depth: float
    answers_only: bool = False
    uniform_distance: bool = False


def is_passkey_source(source: str) -> bool:
    return source == "passkey" or source.startswith("passkey:")


def parse_passkey_source(source: str, text: PasskeyText, row_length: int) -> PasskeySource:
    """``passkey`` (documents from the shortest one to a whole row of ``row_length`` tokens,
    depths 0 to 100), ``passkey:MIN-MAX``, ``passkey:MIN-MAX:LO-HI`` or
    ``passkey:MIN-MAX:distance`` (:class:`PasskeySource`), each optionally ending in
    ``:answers`` (the loss on the answers only); SetupError naming the problem."""
    match = _SOURCE.fullmatch(source)
    if match is None:
        raise SetupError(f"data={source!r}: write passkey, passkey:MIN-MAX (document lengths in "
                         f"tokens), passkey:MIN-MAX:LO-HI (needle depths in percent) or "
                         f"passkey:MIN-MAX:distance (needle distances drawn uniformly), "
                         f"optionally followed by :answers (the loss on the answers only)")
    lengths, depths = match.group(1, 2), match.group(3, 4)
    low, high = (int(n) for n in lengths) if lengths[0] else (text.shortest_document, row_length)
    depth_low, depth_high = (float(d) for d in depths) if depths[0] else (0.0, 100.0)
    if not text.shortest_document <= low <= high <= row_length:
        raise SetupError(f"data={source!r}: document lengths must satisfy {text.shortest_document} "
                         f"(a passkey document of any key in the {text.tokenizer.name} "
                         f"tokenizer fits) <= MIN <= MAX <= {row_length} (seq_len + 1, a row), "
                         f"got {low}-{high}")
    if not 0 <= depth_low <= depth_high <= 100:
        raise SetupError(f"data={source!r}: depths must satisfy 0 <= LO <= HI <= 100, got "
                         f"{depth_low:g}-{depth_high:g}")
    return PasskeySource(low, high, depth_low, depth_high, answers_only=match.group(6) is not None,
                         uniform_distance=match.group(5) is not None)


def passkey_row(text: PasskeyText, source: PasskeySource, row_length: int,
                generator: torch.Generator) -> tuple[list[int], list[bool]]:
    """(tokens, is_answer): ``row_length`` tokens of documents of random length, depth and key,
    back to back, and which are answers' tokens. Each document is whole, shortened to fit what
    is left of the row when that is less than its length; when less than ``source.min_length``
    is left, a last document is cut at the row's end, as packing cuts documents."""
    row: list[int] = []
    is_answer: list[bool] = []
    while len(row) < row_length:
        left = row_length - len(row)
        if source.uniform_distance:
            length, depth, key = _distance_draw(text, source, generator)
        else:
            length = int(torch.randint(source.min_length, source.max_length + 1, (1,),
                                       generator=generator))
            fraction = float(torch.rand((), generator=generator))
            depth = source.min_depth + (source.max_depth - source.min_depth) * fraction
            key = random_key(generator)
        tokens, answer = text.document(max(min(length, left), source.min_length), depth, key)
        row += tokens[:left]
        is_answer += answer[:left]
    return row, is_answer


def _distance_draw(text: PasskeyText, source: PasskeySource,
                   generator: torch.Generator) -> tuple[int, float, str]:
    """(length, depth, key) of a ``uniform_distance`` document: after the needle come
    ``after`` filler tokens, uniform over 0 to what a ``max_length`` document holds; the length
    is uniform over the lengths that hold them."""
    key = random_key(generator)
    fixed = text.fixed_tokens(key)
    after = int(torch.randint(0, source.max_length - fixed + 1, (1,), generator=generator))
    length = int(torch.randint(max(source.min_length, after + fixed), source.max_length + 1,
                               (1,), generator=generator))
    filler = length - fixed
    return length, 100.0 * (filler - after) / filler if filler else 0.0, key


def passkey_batch(index: int, *, text: PasskeyText, source: PasskeySource, seed: int,
                  stream: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (x, y) [B, T]: rows of passkey documents (:func:`passkey_row`), a pure function of
    (seed, stream, index). The loss reads every token: the filler too, which a model soon
    predicts, leaving the key the part still to learn; with ``source.answers_only`` the other
    targets are IGNORED (every row holds one whole document, so one answer at least)."""
    generator = batch_generator(seed, stream, index)
    rows, answers = zip(*(passkey_row(text, source, seq_len + 1, generator)
                          for _ in range(batch_size)), strict=True)
    rows = torch.tensor(rows)  # [B, T + 1]
    x, y = rows[:, :-1], rows[:, 1:]
    if source.answers_only:
        y = y.masked_fill(~torch.tensor(answers)[:, 1:], IGNORED)
    return x, y
