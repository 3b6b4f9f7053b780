"""Training and validation token streams: the bundled corpus, synthetic tokens, passkey
documents, and documents streamed from the Hugging Face hub (FineWeb-Edu) or read from local
files.

:func:`build_stream` makes them all. A stream yields one rank's batches ``(x [B, T], y [B, T])``
of int64 tokens, ``y`` being ``x`` shifted by one token, and its position is a small dict of ints
(``state_dict`` / ``load_state_dict``) from which a resumed run reads exactly the rows an unbroken
run would have read next.

Indexed streams (``"shakespeare"``, ``"synthetic"``, ``"passkey..."``): global batch ``index``
(``B * world_size`` rows) is a pure function of (seed, stream, index) and rank r gets its rows
[r * B, (r + 1) * B), so every world size sees the same rows for the same global batch. State:
the next batch index.

Document streams (``"fineweb"``, ``"hf:<name>"``, local files) read the dataset's documents in
order through ``datasets`` streaming. The first ``val_docs`` documents are the validation split,
the others the training split. Each split is dealt to ranks one document at a time (rank r keeps
documents r, r + W, r + 2W, ...: ``split_dataset_by_node``'s "examples" strategy, which keeps the
validation split the same documents whatever the world size, at the cost of every rank reading
every document; it tokenizes only its own). A rank tokenizes its documents, follows each with
the tokenizer's end-of-text id and cuts the resulting token stream into consecutive rows of
``T + 1`` tokens (inputs ``row[:-1]``, targets ``row[1:]``), so a document may span rows. The
training split starts over when it ends (the next epoch, same order); the validation split
raises instead. Documents are not shuffled, so ``seed`` does not apply to them.

Local files are checked when a stream is built: each must hold a document, and together more than
``val_docs`` (one training document per rank). A read that fails with a network or I/O error is
retried; any other failure (a missing package, a malformed file, a wrong path or a refused
permission) would fail again, and raises at once.
"""

from __future__ import annotations

import glob
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
import torch

from nsa.train.data import (
    TRAIN_STREAM,
    VAL_STREAM,
    BatchSampler,
    batch_generator,
    read_corpus,
    split_tokens,
)
from nsa.train.errors import SetupError
from nsa.train.passkey import PasskeyText, is_passkey_source, parse_passkey_source, passkey_batch
from nsa.train.tokenizer import Tokenizer

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

FINEWEB = "HuggingFaceFW/fineweb-edu"
FINEWEB_CONFIG = "sample-10BT"
SPLITS = ("train", "val")
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".parquet": "parquet"}  # suffix -> builder
_READ_BATCH = 256  # documents per arrow table read from a dataset
_END = object()  # marks the end of an iterator
# Reading again finds these as they were: a wrong path, a refused permission.
_PERMANENT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
_RETRIED_HTTP_STATUSES = (408, 429)  # and every 5xx: the server may answer next time

Split = Literal["train", "val"]


class StreamError(RuntimeError):
    """Reading a dataset kept failing through every retry."""


class DataFormatError(SetupError):
    """A dataset holds something that is not a document: bad JSON, a missing text column..."""


class TokenStream(Protocol):
    """One rank's batches of a training or validation stream, and its position."""

    batch_size: int  # rows per batch on this rank
    seq_len: int

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (x [B, T], y [B, T]) int64 with y[:, t] the token after x[:, t]."""

    def state_dict(self) -> dict[str, int]:
        """The position: plain ints, small, ``torch.load(weights_only=True)``-safe."""

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a position ``state_dict`` returned."""

    def reset(self) -> None:
        """Go back to the first batch (validation reads the same rows every evaluation)."""


def build_stream(source: str, split: Split, *, tokenizer: Tokenizer, batch_size: int,
                 seq_len: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 val_fraction: float = 0.1, val_docs: int = 1000,
                 dataset_config: str | None = None, text_column: str = "text", retries: int = 5,
                 backoff_s: float = 1.0) -> TokenStream:
    """Rank ``rank``'s stream of ``split`` ("train" or "val") of ``source``.

    ``source``: "shakespeare" (the bundled corpus, its last ``val_fraction`` is "val"),
    "synthetic" (uniform random tokens of the tokenizer's vocabulary), "passkey",
    "passkey:MIN-MAX", "passkey:MIN-MAX:LO-HI" or "passkey:MIN-MAX:distance" (passkey documents
    of MIN to MAX tokens with the key at LO to HI percent depth, or at distances before the
    question drawn uniformly, :mod:`nsa.train.passkey`), "fineweb" (FineWeb-Edu,
    ``dataset_config`` default "sample-10BT"), "hf:<name>" (the "train" split of any hub dataset,
    ``dataset_config`` its config) or local files: a file, a directory or a glob of .txt (a
    document per file), .jsonl (a JSON object per line) or .parquet files.
    ``batch_size``: rows per batch on this rank. ``seed``: the indexed streams' randomness.
    ``val_docs``: documents of a document stream held out for "val". ``text_column``: the
    document text's column (field) of hub, .jsonl and .parquet datasets.
    ``retries``, ``backoff_s``: a document stream that fails to read with a network or I/O error
    (:func:`is_transient`) is reopened at its position after ``backoff_s``, then twice that, ...
    up to ``retries`` times in a row (a document read in between starts the count over), then
    raises :class:`StreamError`. Other failures raise at once: :class:`SetupError` for a missing
    package, a malformed (:class:`DataFormatError`) or empty file, a wrong path or permission.
    """
    _check_at_least(batch_size=batch_size, seq_len=seq_len, world_size=world_size)
    _check_rank(rank, world_size)
    _check_at_least(0, val_docs=val_docs, retries=retries)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not backoff_s >= 0:
        raise ValueError(f"backoff_s must be >= 0, got {backoff_s}")
    global_batch_size = batch_size * world_size
    stream = TRAIN_STREAM if split == "train" else VAL_STREAM
    if source == "synthetic":
        batches = partial(synthetic_batch, seed=seed, stream=stream, batch_size=global_batch_size,
                          seq_len=seq_len, vocab_size=tokenizer.vocab_size)
        return IndexedStream(batches, global_batch_size, seq_len, rank, world_size)
    if is_passkey_source(source):
        text = PasskeyText(tokenizer)
        batches = partial(passkey_batch, text=text,
                          source=parse_passkey_source(source, text, seq_len + 1), seed=seed,
                          stream=stream, batch_size=global_batch_size, seq_len=seq_len)
        return IndexedStream(batches, global_batch_size, seq_len, rank, world_size)
    if source == "shakespeare":
        sampler = BatchSampler(corpus_split(tokenizer, split, val_fraction), global_batch_size,
                               seq_len, seed, stream)
        return IndexedStream(sampler.batch, global_batch_size, seq_len, rank, world_size)
    if split == "val" and val_docs < world_size:
        raise SetupError(f"val_docs={val_docs} leaves some of the {world_size} ranks without a "
                         f"validation document of {source!r}: set val_docs={world_size} or more")
    spec = dataset_spec(source, dataset_config, text_column)
    if spec.data_files:
        check_enough_documents(spec, val_docs, world_size)
    return DocumentStream(spec, split, tokenizer=tokenizer, batch_size=batch_size,
                          seq_len=seq_len, rank=rank, world_size=world_size, val_docs=val_docs,
                          retries=retries, backoff_s=backoff_s)


def corpus_split(tokenizer: Tokenizer, split: Split, val_fraction: float) -> torch.Tensor:
    """[N] int64: ``split`` of the bundled corpus in ``tokenizer``'s tokens ("val": the last
    ``val_fraction`` of them)."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    tokens = torch.tensor(tokenizer.encode(read_corpus()), dtype=torch.int64)  # [N]
    train_tokens, val_tokens = split_tokens(tokens, val_fraction)
    return train_tokens if split == "train" else val_tokens


def local_batch_size(global_batch_size: int, world_size: int) -> int:
    """Rows per rank of a global batch; SetupError unless ``world_size`` divides it."""
    _check_at_least(global_batch_size=global_batch_size, world_size=world_size)
    if global_batch_size % world_size:
        raise SetupError(f"global_batch_size={global_batch_size} must be divisible by "
                         f"world_size={world_size}")
    return global_batch_size // world_size


def synthetic_batch(index: int, *, seed: int, stream: int, batch_size: int, seq_len: int,
                    vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (x, y) [B, T]: uniform random tokens, a pure function of (seed, stream, index)."""
    rows = torch.randint(vocab_size, (batch_size, seq_len + 1),
                         generator=batch_generator(seed, stream, index))  # [B, T + 1]
    return rows[:, :-1], rows[:, 1:]


class IndexedStream:
    """Rank ``rank``'s rows of global batches that are pure functions of their index.

    ``global_batch(index)`` -> (x, y) [G, T] with G = ``global_batch_size``; this rank gets rows
    [rank * B, (rank + 1) * B), B = G / world_size. State: ``{"batch_index": next index}``.
    """

    def __init__(self, global_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 global_batch_size: int, seq_len: int, rank: int, world_size: int):
        self.batch_size = local_batch_size(global_batch_size, world_size)
        _check_rank(rank, world_size)
        self.seq_len = seq_len
        self._global_batch = global_batch
        self._rows = slice(rank * self.batch_size, (rank + 1) * self.batch_size)
        self._index = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self._global_batch(self._index)  # [G, T] each
        self._index += 1
        return x[self._rows], y[self._rows]

    def state_dict(self) -> dict[str, int]:
        return {"batch_index": self._index}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self._index = _checked_state(state, ("batch_index",))["batch_index"]

    def reset(self) -> None:
        self._index = 0


@dataclass(frozen=True)
class DatasetSpec:
    """What ``datasets.load_dataset`` streams: a hub dataset (``path`` its name, ``config``) or
    local files (``path`` the builder, "text", "json" or "parquet", of ``data_files``)."""

    path: str
    config: str | None = None
    data_files: tuple[str, ...] = ()
    text_column: str = "text"

    def __str__(self) -> str:
        if self.data_files:
            shown = ", ".join(self.data_files[:3])
            more = f" and {len(self.data_files) - 3} more" if len(self.data_files) > 3 else ""
            return f"{self.path} files {shown}{more}"
        return f"{self.path} ({self.config})" if self.config else self.path

    def load(self) -> datasets.IterableDataset:
        """The dataset's "train" split as a streamed ``datasets.IterableDataset``."""
        import datasets

        if not self.data_files:
            return datasets.load_dataset(self.path, self.config, split="train", streaming=True)
        options = {"sample_by": "document"} if self.path == "text" else {}
        return datasets.load_dataset(self.path, data_files=list(self.data_files), split="train",
                                     streaming=True, **options)

    def count_documents(self, at_most: int) -> int:
        """The documents of local files, counted up to ``at_most``. Every file is opened:
        SetupError naming the first one that holds no document or cannot be read."""
        count = {"text": _text_documents, "json": _jsonl_documents,
                 "parquet": _parquet_documents}[self.path]
        total = 0
        for file in self.data_files:
            try:
                found = count(file, max(at_most - total, 1))
            except ImportError as error:
                raise missing_package(error, file) from error
            except OSError as error:
                raise SetupError(f"cannot read {file}: {error}") from error
            if found == 0:
                raise SetupError(f"{file} holds no document (it is empty): fill it or leave it "
                                 "out of data=")
            total += found
        return min(total, at_most)

    def find_format_error(self) -> str | None:
        """Where the first malformed document of local files is ("<file>: line <n>: ..."), or
        None when they all parse (and for hub datasets)."""
        check = {"text": _text_problem, "json": _jsonl_problem,
                 "parquet": _parquet_problem}.get(self.path)
        for file in self.data_files if check else ():
            problem = check(file, self.text_column)
            if problem is not None:
                return f"{file}: {problem}"
        return None


def dataset_spec(source: str, config: str | None = None, text_column: str = "text") -> DatasetSpec:
    """The :class:`DatasetSpec` of a document source: "fineweb", "hf:<name>" or local files."""
    if source == "fineweb":
        return DatasetSpec(FINEWEB, config or FINEWEB_CONFIG, text_column=text_column)
    if source.startswith("hf:"):
        if not source[3:]:
            raise SetupError("source='hf:' needs a dataset name: 'hf:<name>'")
        return DatasetSpec(source[3:], config, text_column=text_column)
    if config is not None:
        raise SetupError(f"dataset_config applies to hub datasets, not to source={source!r}")
    builder, files = resolve_local_files(source)
    return DatasetSpec(builder, data_files=files, text_column=text_column)


def resolve_local_files(source: str) -> tuple[str, tuple[str, ...]]:
    """(builder, sorted absolute paths) of a file, a directory (its .txt, .jsonl and .parquet
    files) or a glob; the files must all have the same format."""
    path = Path(source).expanduser()
    if path.is_dir():
        files = [p for p in path.iterdir() if p.is_file() and p.suffix in LOCAL_BUILDERS]
    elif path.is_file():
        files = [path]
    else:
        files = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
    if not files:
        raise SetupError(f"source={source!r} is not 'shakespeare', 'synthetic', 'passkey...', "
                         "'fineweb' or 'hf:<name>', nor a file, directory or glob of .txt, .jsonl "
                         "or .parquet files")
    suffixes = sorted({p.suffix for p in files})
    if len(suffixes) > 1 or suffixes[0] not in LOCAL_BUILDERS:
        raise SetupError(f"source={source!r} must name files of one format, .txt, .jsonl or "
                         f".parquet; found {suffixes}")
    return LOCAL_BUILDERS[suffixes[0]], tuple(sorted(str(p.resolve()) for p in files))


def check_enough_documents(spec: DatasetSpec, val_docs: int, world_size: int) -> None:
    """SetupError unless local files hold more than ``val_docs`` documents, the held-out
    validation split, with one left for each rank to train on."""
    needed = val_docs + world_size
    found = spec.count_documents(needed)
    if found >= needed:
        return
    left = max(found - val_docs, 0)
    leaving = (f"leaving {left} for training, and each of {world_size} ranks needs one" if left
               else "leaving none for training")
    fix = f"set val_docs={found - world_size} or lower" if found > world_size else "add documents"
    raise SetupError(f"{spec} holds {found} documents, and the first val_docs={val_docs} are "
                     f"held out for validation, {leaving}: {fix}")


def missing_package(error: ImportError, reading: object) -> SetupError:
    """The error to raise when ``reading`` a dataset failed for want of a package."""
    package = (error.name or "datasets").partition(".")[0]
    return SetupError(f"reading {reading} needs the {package} package: "
                      'pip install "nsa[train]"')


def is_transient(error: Exception) -> bool:
    """Whether reading again may succeed: a network or I/O fault (an OSError other than a wrong
    path or a refused permission, an HTTP client's transport error, HTTP 408, 429 or 5xx), not a
    missing package, a malformed file, a missing dataset or a bug."""
    status = _http_status(error)
    if status is not None:
        return status in _RETRIED_HTTP_STATUSES or status >= 500
    if isinstance(error, _PERMANENT_OS_ERRORS):
        return False
    return isinstance(error, OSError) or _is_transport_error(error)


def _http_status(error: Exception) -> int | None:
    """The status of the HTTP response an error carries (the hub client's HTTP errors)."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def _is_transport_error(error: Exception) -> bool:
    """An httpx (or httpx2, huggingface_hub's client) failure to reach a server: connecting,
    reading, a timeout. Unlike those of requests and aiohttp, these are not OSErrors."""
    clients = (sys.modules.get(name) for name in ("httpx", "httpx2"))
    return any(isinstance(error, client.TransportError) for client in clients if client)


def open_documents(spec: DatasetSpec, split: Split, *, rank: int, world_size: int, val_docs: int,
                   start: int) -> Iterator[object]:
    """Texts of rank ``rank``'s documents of ``split``, from its ``start``-th on. Lazy: nothing is
    opened before the first ``next``.

    The first ``val_docs`` documents of the dataset are "val", the others "train". Rank r keeps
    documents r, r + W, ... of the split, so its ``start``-th is the split's
    ``start * world_size + rank``-th: skipping ``start * world_size`` documents of the split
    before dealing them out gets there.
    """
    from datasets.distributed import split_dataset_by_node

    dataset = spec.load()
    dataset = dataset.take(val_docs) if split == "val" else dataset.skip(val_docs)
    dataset = split_dataset_by_node(dataset.skip(start * world_size), rank=rank,
                                    world_size=world_size, strategy="examples")
    for table in dataset.with_format("arrow").iter(batch_size=_READ_BATCH):
        if spec.text_column not in table.column_names:
            raise DataFormatError(f"{spec} has no {spec.text_column!r} column; its columns are "
                                  f"{table.column_names}")
        yield from table.column(spec.text_column).to_pylist()


class DocumentStream:
    """Rank ``rank``'s documents of ``split`` of a dataset, tokenized, each followed by the eot
    id, packed into consecutive rows of ``seq_len + 1`` tokens (see the module docstring).

    State: ``{"rank", "world_size", "epoch", "doc", "offset"}``: the next row starts at token
    ``offset`` of the rank's document ``doc`` (counted from the split's start) in pass ``epoch``.
    """

    def __init__(self, spec: DatasetSpec, split: Split, *, tokenizer: Tokenizer, batch_size: int,
                 seq_len: int, rank: int, world_size: int, val_docs: int, retries: int,
                 backoff_s: float):
        self.spec, self.split = spec, split
        self.batch_size, self.seq_len = batch_size, seq_len
        self._tokenizer = tokenizer
        self._rank, self._world_size, self._val_docs = rank, world_size, val_docs
        self._retries, self._backoff_s = retries, backoff_s
        self._epoch = self._doc = self._offset = 0
        self._batches = 0  # batches read since the start, a reset or a restored position
        self._tokens: np.ndarray | None = None  # [n] document doc's tokens and eot, once read
        self._texts: Iterator[object] | None = None  # the open dataset; next yields document doc

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._take(self.batch_size * (self.seq_len + 1))
        rows = torch.from_numpy(rows.reshape(self.batch_size, self.seq_len + 1))  # [B, T + 1]
        self._batches += 1
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"rank": self._rank, "world_size": self._world_size, "epoch": self._epoch,
                "doc": self._doc, "offset": self._offset}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        state = _checked_state(state, ("rank", "world_size", "epoch", "doc", "offset"))
        if (state["rank"], state["world_size"]) != (self._rank, self._world_size):
            raise ValueError(f"the data state is rank {state['rank']} of {state['world_size']}'s, "
                             f"this stream is rank {self._rank} of {self._world_size}'s")
        self._epoch, self._doc, self._offset = state["epoch"], state["doc"], state["offset"]
        self._batches = 0
        self._tokens = self._texts = None

    def reset(self) -> None:
        self._epoch = self._doc = self._offset = self._batches = 0
        self._tokens = self._texts = None

    def texts(self) -> Iterator[str]:
        """The texts of the rank's documents of the split, once each, in order, read as rows
        read them (retries included); the stream is back at its first row afterwards."""
        self.reset()
        while (text := self._read_text()) is not None:
            yield text
            self._doc += 1
        self.reset()

    def _take(self, count: int) -> np.ndarray:
        """The next ``count`` tokens of the packed stream: [count] int64."""
        pieces = []
        while count:
            if self._tokens is None:
                self._tokens = self._next_document()
                if self._offset >= len(self._tokens):
                    raise ValueError(f"the data state's offset {self._offset} is past the end of "
                                     f"document {self._doc} ({len(self._tokens)} tokens): it was "
                                     "saved with another dataset or tokenizer")
            piece = self._tokens[self._offset:self._offset + count]
            pieces.append(piece)
            count -= len(piece)
            self._offset += len(piece)
            if self._offset == len(self._tokens):
                self._doc, self._offset, self._tokens = self._doc + 1, 0, None
        return np.concatenate(pieces)

    def _next_document(self) -> np.ndarray:
        """Document ``doc``'s tokens and eot, [n] int64; after the training split's last
        document, the first one again in the next epoch."""
        text = self._read_text()
        if text is None and self.split == "train" and self._doc > 0:
            self._epoch, self._doc, self._texts = self._epoch + 1, 0, None
            text = self._read_text()
        if text is None and self.split == "val":
            fix = (f"set eval_steps={self._batches} or lower, or val_docs= above "
                   f"{self._val_docs}" if self._batches else
                   f"set val_docs= above {self._val_docs}, or lower batch_size= or seq_len=")
            batches = f"{self._batches} batch{'' if self._batches == 1 else 'es'}"
            raise SetupError(f"the val split (the first val_docs={self._val_docs} documents) of "
                             f"{self.spec} gives rank {self._rank} of {self._world_size} only "
                             f"{batches} of {self.batch_size} x {self.seq_len + 1} tokens, fewer "
                             f"than an evaluation reads (eval_steps): {fix}")
        if text is None:
            raise SetupError(f"the train split of {self.spec} has no document for rank "
                             f"{self._rank} of {self._world_size}: add documents or lower "
                             "val_docs=")
        return np.asarray([*self._tokenizer.encode(text), self._tokenizer.eot], dtype=np.int64)

    def _read_text(self) -> str | None:
        """Document ``doc``'s text, None past the split's end. A read failing with a network or
        I/O error reopens the dataset at document ``doc`` after an exponential backoff,
        ``retries`` times; other failures raise at once."""
        failures = 0
        while True:
            try:
                if self._texts is None:
                    self._texts = open_documents(self.spec, self.split, rank=self._rank,
                                                 world_size=self._world_size,
                                                 val_docs=self._val_docs, start=self._doc)
                text = next(self._texts, _END)
                if text is _END:
                    return None
                if not isinstance(text, str):
                    raise DataFormatError(f"document {self._doc} of rank {self._rank}'s "
                                          f"{self.split} split of {self.spec} has a "
                                          f"{type(text).__name__} text, not a string")
                return text
            except Exception as error:
                self._texts = None
                if isinstance(error, ImportError):
                    raise missing_package(error, self.spec) from error
                problem = self.spec.find_format_error()
                if problem is not None:
                    raise DataFormatError(problem) from error
                if not is_transient(error):
                    if isinstance(error, OSError) or _http_status(error) is not None:
                        raise SetupError(f"cannot read {self.spec}: {error}") from error
                    raise
                if failures == self._retries:
                    raise StreamError(f"reading {self.spec} failed {failures + 1} times in a row "
                                      f"at document {self._doc} of rank {self._rank}'s "
                                      f"{self.split} split; last error: {error!r}") from error
                delay = self._backoff_s * 2**failures
                failures += 1
                logger.warning("reading %s failed (%r); reopening it at document %d in %.3gs "
                               "(retry %d of %d)", self.spec, error, self._doc, delay, failures,
                               self._retries)
                time.sleep(delay)


def _text_documents(path: str, at_most: int) -> int:
    """A .txt file is one document, unless it is empty."""
    return int(Path(path).stat().st_size > 0)


def _jsonl_documents(path: str, at_most: int) -> int:
    """The non-blank lines of a .jsonl file (its documents), counted up to ``at_most``."""
    count = 0
    with open(path, "rb") as file:
        for line in file:
            count += bool(line.strip())
            if count == at_most:
                break
    return count


def _parquet_documents(path: str, at_most: int) -> int:
    """The rows of a .parquet file, from its metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except pa.ArrowInvalid as error:
        raise DataFormatError(f"{path}: not a readable parquet file ({error})") from error


def _text_problem(path: str, text_column: str) -> str | None:
    """Why a .txt file is not a document (it is unless it is not UTF-8)."""
    data = Path(path).read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        return f"line {line}: not UTF-8 text (byte {error.start}: {error.reason})"
    return None


def _jsonl_problem(path: str, text_column: str) -> str | None:
    """The first line of a .jsonl file that is not a JSON object with a string text field."""
    with open(path, "rb") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:  # also UnicodeDecodeError
                return f"line {number}: not valid JSON ({error})"
            if not isinstance(record, dict) or not isinstance(record.get(text_column), str):
                return f"line {number}: not a JSON object with a string {text_column!r} field"
    return None


def _parquet_problem(path: str, text_column: str) -> str | None:
    """Why a .parquet file does not hold a non-null string column ``text_column``."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        if text_column not in file.schema_arrow.names:
            return f"no {text_column!r} column; its columns are {file.schema_arrow.names}"
        texts = file.read(columns=[text_column]).column(text_column)
    except (pa.ArrowException, OSError) as error:
        return f"not a readable parquet file ({error})"
    if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type)):
        return f"column {text_column!r} holds {texts.type}, not strings"
    if texts.null_count:
        return f"row {pc.index(pc.is_null(texts), True).as_py()}: {text_column!r} is null"
    return None


def _check_at_least(minimum: int = 1, **values: int) -> None:
    for name, value in values.items():
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_rank(rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")


def _checked_state(state: Mapping[str, int], keys: Sequence[str]) -> dict[str, int]:
    """``state`` as a dict, if it has exactly ``keys`` and their values are ints >= 0."""
    if set(state) != set(keys):
        raise ValueError(f"a data state needs the keys {sorted(keys)}, got {sorted(state)}")
    for key, value in state.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"data state {key!r} must be an int >= 0, got {value!r}")
    return dict(state)
