"""The bundled corpus as a byte-token stream, its train/val split, and random batches.

Batch ``index`` of a sampler depends only on (seed, stream, index), so a resumed run draws
exactly the batches an unbroken run would: the step number is the whole sampler state.
"""

from __future__ import annotations

from importlib import resources

import numpy as np
import torch

CORPUS = "tiny_shakespeare.txt"
TRAIN_STREAM, VAL_STREAM = 0, 1


def load_corpus(name: str = CORPUS) -> torch.Tensor:
    """[N] int64 byte tokens of a corpus shipped in ``nsa.data``."""
    data = resources.files("nsa.data").joinpath(name).read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def read_corpus(name: str = CORPUS) -> str:
    """The text of a corpus shipped in ``nsa.data``, for tokenizers other than bytes."""
    return resources.files("nsa.data").joinpath(name).read_text(encoding="utf-8")


def batch_generator(seed: int, stream: int, index: int) -> torch.Generator:
    """A generator seeded from (seed, stream, index) alone: batch ``index``'s randomness."""
    state = np.random.SeedSequence([seed, stream, index]).generate_state(1, np.uint64)
    return torch.Generator().manual_seed(int(state[0]))


def split_tokens(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): val is the last ``val_fraction`` of the tokens."""
    num_val = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - num_val], tokens[len(tokens) - num_val:]


def document_offsets(x: torch.Tensor, eot: int) -> torch.Tensor:
    """cu_seqlens (int32 [N+1], on x's device) of the documents of rows x [B, T] read as one
    packed row of B·T tokens: a document starts at each row's first token and after each
    ``eot`` token (which ends, and belongs to, the document before it). Streams join documents
    with the eot id; a corpus without it (the bundled one is one long text) gives one document
    per row."""
    B, T = x.shape
    starts = torch.ones(B, T, dtype=torch.bool, device=x.device)
    starts[:, 1:] = x[:, :-1] == eot
    first = starts.flatten().nonzero().flatten()  # [N]
    return torch.cat([first, first.new_tensor([B * T])]).to(torch.int32)


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens from ``tokens``, as (inputs, targets)."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int, stream: int):
        if len(tokens) <= seq_len:
            raise ValueError(f"need more than seq_len={seq_len} tokens, got {len(tokens)}")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.seed, self.stream = seed, stream

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (x [B, T], y [B, T]) int64 with y[:, t] = x[:, t + 1] in the stream."""
        starts = torch.randint(len(self.tokens) - self.seq_len, (self.batch_size,),
                               generator=batch_generator(self.seed, self.stream, index))
        windows = self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)]  # [B, T + 1]
        return windows[:, :-1], windows[:, 1:]
