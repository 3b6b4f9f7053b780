"""Passkey retrieval: accuracy of a model at repeating a key planted in filler text, per context
length and needle depth (the prompts of :mod:`nsa.train.passkey`).

A context of L tokens is a prompt of ``L - ANSWER_TOKENS`` tokens ending in "The pass key is"
followed by ``ANSWER_TOKENS`` tokens decoded greedily, so the model never reads more than L
tokens (L <= max_seq_len: no position it was not trained on, no KV-cache restart). The answer
is right when its first run of digits is the key (:func:`passkey_correct`). The keys of a cell
(L, depth) depend only on the seed, L and the depth.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from nsa.models import LanguageModel
from nsa.models.decoding import stream_tokens
from nsa.train.checkpoint import atomic_write
from nsa.train.data import batch_generator
from nsa.train.errors import SetupError
from nsa.train.passkey import ANSWER_TOKENS, PasskeyText, random_key
from nsa.train.tokenizer import Tokenizer
from nsa.train.trainer import autocast

_LEADING_NUMBER = re.compile(r"\s*(\d+)")


@dataclass(frozen=True)
class PasskeyCell:
    length: int  # context length in tokens
    depth: float  # needle depth in percent
    trials: int
    correct: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.trials

    def to_dict(self) -> dict:
        return {**asdict(self), "accuracy": self.accuracy}


def passkey_correct(generated: str, key: str) -> bool:
    """Whether the text generated after "The pass key is" answers ``key``: its first run of
    digits, after any white space, is exactly the key ("71432." and " 71432 is" are right,
    " 7143", " 714329" and "key 71432" are not)."""
    match = _LEADING_NUMBER.match(generated)
    return match is not None and match.group(1) == key


def check_passkey_grid(text: PasskeyText, max_seq_len: int, lengths: Sequence[int],
                       depths: Sequence[float], trials: int) -> None:
    """ValueError naming the first context length outside [shortest context, max_seq_len],
    depth outside [0, 100], a repeated one or a trial count below 1."""
    if not lengths or not depths:
        raise ValueError("passkey retrieval needs at least one length and one depth")
    if len(set(lengths)) < len(lengths) or len(set(depths)) < len(depths):
        raise ValueError(f"passkey lengths and depths must be distinct, got {list(lengths)} and "
                         f"{list(depths)}")
    for length in lengths:
        if not text.shortest_context <= length <= max_seq_len:
            raise ValueError(f"passkey length {length} is outside [{text.shortest_context}, "
                             f"{max_seq_len}]: a needle, the question and the answer of any key "
                             f"fit in {text.shortest_context} tokens of the "
                             f"{text.tokenizer.name} tokenizer, and the model reads at most "
                             f"max_seq_len={max_seq_len}")
    for depth in depths:
        if not 0 <= depth <= 100:
            raise ValueError(f"passkey depth {depth:g} is outside [0, 100] (percent of the "
                             f"filler before the needle)")
    if trials < 1:
        raise ValueError(f"passkey trials must be >= 1, got {trials}")


def cell_keys(seed: int, length: int, depth: float, trials: int) -> list[str]:
    """The keys of cell (length, depth): a generator of (seed, length, depth in thousandths of
    a percent)."""
    generator = batch_generator(seed, length, round(depth * 1000))
    return [random_key(generator) for _ in range(trials)]


@torch.no_grad()
def passkey_accuracy(model: LanguageModel, tokenizer: Tokenizer, lengths: Sequence[int],
                     depths: Sequence[float], trials: int, seed: int = 0, *,
                     batch_size: int = 8, device: torch.device | None = None,
                     use_autocast: bool = True) -> list[PasskeyCell]:
    """One cell per (length, depth), lengths outermost: ``trials`` prompts with their own keys,
    answered greedily in batches of ``batch_size`` by the model's sampling loop
    (:func:`~nsa.models.decoding.stream_tokens`, ``top_k=1``) on ``device`` (default the
    model's), under bf16 autocast on CUDA when ``use_autocast``. ValueError for a bad grid
    (:func:`check_passkey_grid`)."""
    text = PasskeyText(tokenizer)
    check_passkey_grid(text, model.config.max_seq_len, lengths, depths, trials)
    device = device or model.embed.weight.device
    generator = torch.Generator(device).manual_seed(seed)  # breaks ties between equal logits
    model.eval()
    cells = []
    for length in lengths:
        for depth in depths:
            keys = cell_keys(seed, length, depth, trials)
            prompts = torch.tensor([text.prompt(length - ANSWER_TOKENS, depth, key).tokens
                                    for key in keys], device=device)  # [trials, P]
            correct = 0
            for start in range(0, trials, batch_size):
                batch = slice(start, start + batch_size)
                with autocast(device, use_autocast):
                    answers = torch.stack(list(stream_tokens(
                        model, prompts[batch], ANSWER_TOKENS, top_k=1, generator=generator)),
                        dim=1)  # [b, ANSWER_TOKENS]
                correct += sum(passkey_correct(tokenizer.decode(answer), key)
                               for answer, key in zip(answers.cpu(), keys[batch], strict=True))
            cells.append(PasskeyCell(length, depth, trials, correct))
    return cells


def _grid(cells: Sequence[PasskeyCell]) -> tuple[list[int], list[float], np.ndarray]:
    """(lengths, depths, accuracy [len(lengths), len(depths)]) of a full grid of cells."""
    lengths = list(dict.fromkeys(cell.length for cell in cells))
    depths = list(dict.fromkeys(cell.depth for cell in cells))
    accuracy = np.array([cell.accuracy for cell in cells]).reshape(len(lengths), len(depths))
    return lengths, depths, accuracy


def passkey_table(cells: Sequence[PasskeyCell]) -> str:
    """Accuracy per context length (rows) and depth (columns), as text."""
    lengths, depths, accuracy = _grid(cells)
    lines = ["length \\ depth" + "".join(f"{f'{d:g}%':>8}" for d in depths)]
    lines += [f"{length:>14}" + "".join(f"{a:8.2f}" for a in row)
              for length, row in zip(lengths, accuracy, strict=True)]
    return "\n".join(lines)


def check_matplotlib() -> None:
    """SetupError when matplotlib, which draws heat maps, is not installed."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError as error:
        raise SetupError(f"a heat map needs matplotlib: pip install matplotlib ({error})") from None


def save_heatmap(cells: Sequence[PasskeyCell], path: Path, title: str) -> None:
    """Draw the accuracy grid as a PNG heat map at ``path`` (written atomically)."""
    from matplotlib.figure import Figure

    lengths, depths, accuracy = _grid(cells)
    figure = Figure(figsize=(1.6 + 0.9 * len(depths), 1.6 + 0.5 * len(lengths)))
    axes = figure.add_subplot()
    image = axes.imshow(accuracy, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    axes.set_xticks(range(len(depths)), [f"{d:g}%" for d in depths])
    axes.set_yticks(range(len(lengths)), [str(length) for length in lengths])
    axes.set(xlabel="needle depth", ylabel="context length (tokens)", title=title)
    for (row, column), value in np.ndenumerate(accuracy):
        axes.text(column, row, f"{value:.2f}", ha="center", va="center", fontsize=8)
    figure.colorbar(image, ax=axes, label="accuracy")
    figure.tight_layout()
    atomic_write(Path(path), lambda file: figure.savefig(file, format="png", dpi=110))
