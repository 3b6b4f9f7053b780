"""Perplexity of a model on texts: mean loss in nats and bits per token, and bits per byte.

The texts are documents joined as training joins them, each followed by the end-of-text id,
and one more in front: ``[eot, doc 1, eot, doc 2, eot, ...]``. That stream is cut into
non-overlapping windows of ``seq_len`` inputs (the last one shorter): window k predicts tokens
``k * seq_len + 1`` to ``(k + 1) * seq_len`` from the tokens of the window before each, so every
token is predicted once, from 0 to ``seq_len - 1`` tokens of context (no stride, no overlap).
Only the texts' own tokens are scored, not the eot separators:

    nats/token = total nats / text tokens          bits/token = nats/token / ln 2
    bits/byte  = total nats / ln 2 / UTF-8 bytes of the texts

(bits/byte equals bits/token for the bytes tokenizer, and compares models across tokenizers).
A model trained with ``doc_masking`` reads each document alone here too. Nothing is random.
"""

from __future__ import annotations

import glob
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from nsa.models import LanguageModel
from nsa.train.config import TrainConfig
from nsa.train.errors import SetupError
from nsa.train.passkey import is_passkey_source
from nsa.train.streams import (
    DatasetSpec,
    DocumentStream,
    build_stream,
    corpus_split,
    resolve_local_files,
)
from nsa.train.tokenizer import Tokenizer
from nsa.train.trainer import autocast, model_inputs, to_device


@dataclass(frozen=True)
class Perplexity:
    seq_len: int  # inputs per window
    tokens: int  # text tokens scored
    bytes: int  # UTF-8 bytes of the texts
    nats: float  # summed over the scored tokens

    @property
    def nats_per_token(self) -> float:
        return self.nats / self.tokens

    @property
    def bits_per_token(self) -> float:
        return self.nats_per_token / math.log(2)

    @property
    def bits_per_byte(self) -> float:
        return self.nats / math.log(2) / self.bytes

    @property
    def perplexity(self) -> float:
        return math.exp(self.nats_per_token)

    def to_dict(self) -> dict:
        return {**asdict(self), "nats_per_token": self.nats_per_token,
                "bits_per_token": self.bits_per_token, "bits_per_byte": self.bits_per_byte,
                "perplexity": self.perplexity}


def join_documents(texts: Sequence[str], tokenizer: Tokenizer) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """-> (tokens [N] int64: eot, then each text's tokens and an eot; scored [N] bool: the
    texts' own tokens)."""
    tokens, scored = [tokenizer.eot], [False]
    for text in texts:
        ids = tokenizer.encode(text)
        tokens += [*ids, tokenizer.eot]
        scored += [True] * len(ids) + [False]
    return torch.tensor(tokens, dtype=torch.int64), torch.tensor(scored)


@torch.no_grad()
def perplexity(model: LanguageModel, tokenizer: Tokenizer, texts: Sequence[str], seq_len: int, *,
               batch_size: int = 4, device: torch.device | None = None,
               use_autocast: bool = True, doc_masking: bool = False) -> Perplexity:
    """The perplexity of ``model`` (on ``device``, default its own) on ``texts`` in windows of
    ``seq_len`` tokens, ``batch_size`` windows per forward pass (see the module docstring).
    ``use_autocast``: bf16 autocast on CUDA, as the trainer evaluates. ``doc_masking``: each
    document read alone (:func:`~nsa.train.trainer.model_inputs`). ValueError when ``seq_len``
    is outside [1, max_seq_len] or the texts hold no token."""
    if not 1 <= seq_len <= model.config.max_seq_len:
        raise ValueError(f"seq_len must be in [1, max_seq_len={model.config.max_seq_len}], got "
                         f"{seq_len}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    tokens, scored = join_documents(texts, tokenizer)  # [N] each
    if not scored.any():
        raise ValueError("the texts hold no token to score")
    device = device or model.embed.weight.device
    eot = tokenizer.eot if doc_masking else None
    inputs, targets, counted = tokens[:-1], tokens[1:], scored[1:]  # [N - 1] each
    full = len(inputs) // seq_len * seq_len
    windows = [t[:full].view(-1, seq_len) for t in (inputs, targets, counted)]  # [W, seq_len]
    batches = [[t[i:i + batch_size] for t in windows]
               for i in range(0, len(windows[0]), batch_size)]
    if full < len(inputs):
        batches.append([t[None, full:] for t in (inputs, targets, counted)])  # [1, rest]
    model.eval()
    nats = torch.zeros((), dtype=torch.float64, device=device)
    for x, y, mask in batches:
        batch = model_inputs(x, y, device, eot)
        with autocast(device, use_autocast):
            logits = model(batch["tokens"], cu_seqlens=batch.get("cu_seqlens"))
        losses = F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten(),
                                 reduction="none")  # [B·T]
        nats += (losses.double() * to_device(mask.flatten(), device)).sum()
    return Perplexity(seq_len, int(scored.sum()), sum(len(t.encode()) for t in texts),
                      nats.item())


def validation_texts(t: TrainConfig, tokenizer: Tokenizer) -> list[str]:
    """The texts of a run's validation split: the bundled corpus's last ``val_fraction`` (as
    one text), or the first ``val_docs`` documents of a document source. SetupError for
    sources without texts (synthetic tokens, passkey documents)."""
    if t.data == "synthetic" or is_passkey_source(t.data):
        raise SetupError(f"the run's data={t.data} has no held-out text: give --files")
    if t.data == "shakespeare":
        return [tokenizer.decode(corpus_split(tokenizer, "val", t.val_fraction))]
    stream = build_stream(t.data, "val", tokenizer=tokenizer, batch_size=1, seq_len=1,
                          val_docs=t.val_docs, dataset_config=t.dataset_config,
                          retries=t.data_retries, backoff_s=t.data_backoff_s)
    return list(stream.texts())


def file_texts(paths: Sequence[str], tokenizer: Tokenizer) -> list[str]:
    """The documents of local files, as ``data=`` reads them: each path a .txt, .jsonl or
    .parquet file, a directory or a glob of them, all of one format. SetupError naming a path
    that matches nothing."""
    found: dict[str, set[str]] = {}
    for path in paths:
        if not (Path(path).expanduser().exists() or glob.glob(path, recursive=True)):
            raise SetupError(f"--files {path}: no such file, directory or glob match")
        builder, files = resolve_local_files(path)
        found.setdefault(builder, set()).update(files)
    if len(found) > 1:
        raise SetupError(f"--files must all be of one format (.txt, .jsonl or .parquet), got "
                         f"{sorted(found)} files")
    ((builder, files),) = found.items()
    stream = DocumentStream(DatasetSpec(builder, data_files=tuple(sorted(files))), "train",
                            tokenizer=tokenizer, batch_size=1, seq_len=1, rank=0, world_size=1,
                            val_docs=0, retries=0, backoff_s=0.0)
    return list(stream.texts())
