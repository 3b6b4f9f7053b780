import errno
import io
import itertools
import json
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nsa.train import streams
from nsa.train.data import TRAIN_STREAM, BatchSampler, load_corpus, split_tokens
from nsa.train.errors import SetupError
from nsa.train.streams import (
    SPLITS,
    DataFormatError,
    IndexedStream,
    StreamError,
    build_stream,
    local_batch_size,
)
from nsa.train.tokenizer import ByteTokenizer, TokenizerUnavailableError, get_tokenizer
from tests.optional import needs_datasets

BYTES = ByteTokenizer()
DOCS = [f"doc{i:02d} " + "abcdefghij"[: i % 10] * (i % 4 + 1) + "ü" * (i % 3)
        for i in range(36)]
VAL_DOCS = 5


def packed(docs: list[str]) -> list[int]:
    """The byte tokens of ``docs``, each followed by eot (byte 0)."""
    return [token for doc in docs for token in [*BYTES.encode(doc), BYTES.eot]]


def rows(stream, num_batches: int) -> list[int]:
    """The tokens of the next ``num_batches`` batches' rows, in order (x plus y's last column)."""
    tokens = []
    for _ in range(num_batches):
        x, y = stream.next_batch()
        assert x.dtype == y.dtype == torch.int64
        assert x.shape == y.shape == (stream.batch_size, stream.seq_len)
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
        tokens += torch.cat([x, y[:, -1:]], dim=1).flatten().tolist()
    return tokens


def write_parquet(path, docs):
    """``docs`` in FineWeb's schema; small row groups so tables split inside the file."""
    table = pa.table({"text": docs, "id": [f"<urn:{i}>" for i in range(len(docs))],
                      "url": [f"https://example.com/{i}" for i in range(len(docs))],
                      "token_count": [len(doc) for doc in docs]})
    pq.write_table(table, path, row_group_size=7)
    return path


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": doc, "id": i}) + "\n"
                            for i, doc in enumerate(docs)))
    return path


@pytest.fixture
def parquet_file(tmp_path):
    return str(write_parquet(tmp_path / "docs.parquet", DOCS))


def stream_of(source, split="train", **options):
    arguments = dict(tokenizer=BYTES, batch_size=2, seq_len=15, val_docs=VAL_DOCS, backoff_s=0.001)
    return build_stream(source, split, **{**arguments, **options})


@needs_datasets
def test_rows_pack_the_training_documents_and_start_over_when_they_end(parquet_file):
    stream = stream_of(parquet_file)
    expected = packed(DOCS[VAL_DOCS:])
    num_batches = len(expected) // (2 * 16) + 3  # past the end of the first epoch
    tokens = rows(stream, num_batches)
    assert tokens == (expected * 2)[: len(tokens)]
    assert stream.state_dict()["epoch"] == 1


@needs_datasets
def test_val_split_is_the_first_documents_and_restarts(parquet_file):
    stream = stream_of(parquet_file, "val", batch_size=1)
    num_batches = len(packed(DOCS[:VAL_DOCS])) // 16
    first = rows(stream, num_batches)
    assert first == packed(DOCS[:VAL_DOCS])[: len(first)]
    with pytest.raises(ValueError, match="val_docs=5"):
        stream.next_batch()
    stream.reset()
    assert rows(stream, num_batches) == first


@needs_datasets
def test_texts_are_the_documents_of_the_split_and_rank(parquet_file):
    stream = stream_of(parquet_file, "val", batch_size=1)
    first = stream.next_batch()
    assert list(stream.texts()) == DOCS[:VAL_DOCS]
    assert all(torch.equal(a, b) for a, b in zip(stream.next_batch(), first, strict=True))
    second_rank = stream_of(parquet_file, rank=1, world_size=2)
    assert list(second_rank.texts()) == DOCS[VAL_DOCS:][1::2]  # once each: no second epoch


def documents_read(stream, num_batches: int) -> list[str]:
    """The whole documents in the next ``num_batches`` batches (the last one may be cut)."""
    return BYTES.decode(rows(stream, num_batches)).split("\0")[:-1]


def parquet_source(tmp_path, num_files: int) -> str:
    """DOCS in ``num_files`` parquet files: a file path, or a glob of them."""
    if num_files == 1:
        return str(write_parquet(tmp_path / "docs.parquet", DOCS))
    size = -(-len(DOCS) // num_files)
    for i in range(num_files):  # consecutive documents per file; files are read in name order
        write_parquet(tmp_path / f"part{i}.parquet", DOCS[i * size:(i + 1) * size])
    return str(tmp_path / "part*.parquet")


@needs_datasets
@pytest.mark.parametrize("num_files", [1, 2])  # 2: as many files as ranks, still dealt by doc
def test_ranks_read_every_other_training_document(tmp_path, num_files):
    source, docs = parquet_source(tmp_path, num_files), DOCS[VAL_DOCS:]
    for rank in (0, 1):
        stream = stream_of(source, rank=rank, world_size=2, batch_size=1)
        num_rows = -(-len(packed(docs[rank::2])) // 16)  # the rank's epoch and a bit of the next
        assert documents_read(stream, num_rows) == docs[rank::2]


@needs_datasets
@pytest.mark.parametrize("num_files", [1, 2])
def test_ranks_share_out_the_first_documents_for_val(tmp_path, num_files):
    source, docs = parquet_source(tmp_path, num_files), DOCS[:VAL_DOCS]
    for rank in (0, 1):
        stream = stream_of(source, "val", rank=rank, world_size=2, batch_size=1)
        read = documents_read(stream, len(packed(docs[rank::2])) // 16)
        assert len(read) >= 1 and read == docs[rank::2][: len(read)]


@pytest.mark.parametrize("source", ["synthetic", "shakespeare",
                                    pytest.param("parquet", marks=needs_datasets)])
@pytest.mark.parametrize("first", [3, 9])  # 9: the parquet stream is in its second epoch
def test_a_restored_stream_continues_with_the_next_batch(parquet_file, source, first):
    source = parquet_file if source == "parquet" else source
    options = dict(rank=1, world_size=2, batch_size=3, seq_len=10)
    unbroken = rows(stream_of(source, **options), first + 5)
    stream = stream_of(source, **options)
    rows(stream, first)
    buffer = io.BytesIO()
    torch.save(stream.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    if source == parquet_file:
        assert state["epoch"] == (first == 9) and state["offset"] > 0  # resumes inside a doc
    resumed = stream_of(source, **options)
    resumed.load_state_dict(state)
    assert rows(resumed, 5) == unbroken[-5 * 3 * 11:]


@needs_datasets
def test_a_state_must_match_the_stream(parquet_file):
    stream = stream_of(parquet_file)
    state = stream.state_dict()
    with pytest.raises(ValueError, match="keys"):
        stream.load_state_dict({"batch_index": 3})
    with pytest.raises(ValueError, match="'doc' must be an int >= 0"):
        stream.load_state_dict({**state, "doc": -1})
    with pytest.raises(ValueError, match="rank 0 of 1"):
        stream_of(parquet_file, rank=1, world_size=2).load_state_dict(state)
    stream.load_state_dict({**state, "offset": 1000})
    with pytest.raises(ValueError, match="offset 1000 is past the end of document 0"):
        stream.next_batch()


@needs_datasets
@pytest.mark.parametrize("layout", ["txt directory", "jsonl file", "jsonl glob", "parquet glob"])
def test_local_formats_read_the_same_documents(tmp_path, layout):
    if layout == "txt directory":
        for i, doc in enumerate(DOCS):
            (tmp_path / f"doc{i:02d}.txt").write_text(doc, encoding="utf-8")
        source = str(tmp_path)
    elif layout == "jsonl file":
        source = str(write_jsonl(tmp_path / "docs.jsonl", DOCS))
    elif layout == "jsonl glob":  # two files, read in name order
        write_jsonl(tmp_path / "a.jsonl", DOCS[:20])
        write_jsonl(tmp_path / "b.jsonl", DOCS[20:])
        source = str(tmp_path / "*.jsonl")
    else:
        write_parquet(tmp_path / "a.parquet", DOCS[:10])
        write_parquet(tmp_path / "b.parquet", DOCS[10:])
        source = str(tmp_path / "*.parquet")
    expected = packed(DOCS[VAL_DOCS:])
    assert rows(stream_of(source), len(expected) // 32) == expected[: len(expected) // 32 * 32]


@needs_datasets
@pytest.mark.parametrize("name, content, message", [
    ("docs.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": broken\n{"text": "d"}\n',
     r"docs\.jsonl: line 3: not valid JSON"),
    ("docs.jsonl", '{"text": "a"}\n{"body": "b"}\n',
     r"docs\.jsonl: line 2: not a JSON object with a string 'text'"),
    ("doc.txt", b"ok\nstill ok\n\xff\xfe\n", r"doc\.txt: line 3: not UTF-8"),
    ("docs.parquet", pa.table({"body": ["a", "b"]}), r"docs\.parquet: no 'text' column"),
    ("docs.parquet", pa.table({"text": ["a", None]}), r"docs\.parquet: row 1: 'text' is null"),
])
def test_a_corrupted_file_is_named_and_not_retried(tmp_path, sleeps, name, content, message):
    path = tmp_path / name
    if isinstance(content, pa.Table):
        pq.write_table(content, path)
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataFormatError, match=message):
        stream_of(str(path), val_docs=0).next_batch()
    assert sleeps == []


def fail_after(texts, count, error):
    yield from itertools.islice(texts, count)
    raise error


def failing_opens(monkeypatch, plan: list[int], error: Exception | None = None) -> list[int]:
    """Make the i-th opening of a dataset yield ``plan[i]`` documents and raise ``error``, by
    default a ConnectionError (openings past the plan work). -> the start document of each
    opening, appended as they come."""
    open_documents, starts = streams.open_documents, []

    def open_failing(*args, start, **kwargs):
        texts = open_documents(*args, start=start, **kwargs)
        starts.append(start)
        if len(starts) > len(plan):
            return texts
        return fail_after(texts, plan[len(starts) - 1], error or ConnectionError("network down"))

    monkeypatch.setattr(streams, "open_documents", open_failing)
    return starts


@needs_datasets
@pytest.mark.parametrize("plan, retries, starts, delays", [
    ([7, 0, 0], 3, [0, 7, 7, 7], [1, 2, 4]),  # consecutive failures back off exponentially
    ([4, 4, 4], 1, [0, 4, 8, 12], [1, 1, 1]),  # a document read in between resets the count
])
def test_a_failing_stream_is_reopened_where_it_failed(parquet_file, monkeypatch, sleeps, plan,
                                                       retries, starts, delays):
    expected = rows(stream_of(parquet_file), 15)  # within the first epoch
    opened = failing_opens(monkeypatch, plan)
    assert rows(stream_of(parquet_file, retries=retries), 15) == expected
    assert opened == starts
    assert sleeps == pytest.approx([0.001 * delay for delay in delays])


@needs_datasets
def test_a_stream_that_keeps_failing_stops_with_the_last_error(parquet_file, monkeypatch,
                                                               sleeps):
    opened = failing_opens(monkeypatch, [3, 0, 0, 0])
    stream = stream_of(parquet_file, retries=2)
    with pytest.raises(StreamError, match=r"docs\.parquet failed 3 times.*network down"):
        rows(stream, 10)
    assert opened == [0, 3, 3] and sleeps == pytest.approx([0.001, 0.002])


def hub_http_error(status: int) -> Exception:
    """The error the hub client raises for an HTTP response with ``status``."""
    httpx2 = pytest.importorskip("httpx2", reason="huggingface_hub of another HTTP client")
    from huggingface_hub.errors import HfHubHTTPError

    request = httpx2.Request("GET", "https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu")
    return HfHubHTTPError(f"{status} error", response=httpx2.Response(status, request=request))


def hub_network_error() -> Exception:
    """The error the hub client raises when it cannot reach the hub."""
    httpx2 = pytest.importorskip("httpx2", reason="huggingface_hub of another HTTP client")
    return httpx2.ConnectError("[Errno 101] Network is unreachable")


@needs_datasets
@pytest.mark.parametrize("make_error", [
    lambda: ConnectionError("connection reset"), lambda: TimeoutError("read timed out"),
    lambda: OSError(errno.EIO, "Input/output error"), hub_network_error,
    lambda: hub_http_error(503), lambda: hub_http_error(429),
], ids=["ConnectionError", "TimeoutError", "EIO", "hub-unreachable", "hub-503", "hub-429"])
def test_network_and_io_errors_are_retried(parquet_file, monkeypatch, sleeps, make_error):
    expected = rows(stream_of(parquet_file), 3)
    opened = failing_opens(monkeypatch, [0], make_error())
    assert rows(stream_of(parquet_file), 3) == expected
    assert opened == [0, 0] and sleeps == [0.001]


@pytest.mark.parametrize("make_error, message", [
    (lambda: ModuleNotFoundError("No module named 'datasets'", name="datasets"),
     r'needs the datasets package: pip install "nsa\[train\]"'),
    (lambda: PermissionError(errno.EACCES, "Permission denied", "/data/docs.parquet"),
     "Permission denied: '/data/docs.parquet'"),
    (lambda: FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/docs.parquet"),
     "No such file or directory: '/data/docs.parquet'"),
    (lambda: hub_http_error(404), "404 error"),
], ids=["missing-module", "permission", "not-found", "hub-404"])
def test_a_deterministic_error_fails_at_once(parquet_file, monkeypatch, sleeps, make_error,
                                             message):
    opened = failing_opens(monkeypatch, [0], make_error())
    with pytest.raises(SetupError, match=message):
        stream_of(parquet_file, backoff_s=60.0).next_batch()
    assert opened == [0] and sleeps == []


@pytest.mark.parametrize("package, missing", [
    ("datasets", ["datasets", "datasets.distributed"]),
    ("pyarrow", ["datasets", "datasets.distributed", "pyarrow"]),  # read before datasets
])
def test_a_missing_package_names_the_install(parquet_file, monkeypatch, sleeps, package,
                                             missing):
    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ModuleNotFoundError
    with pytest.raises(SetupError, match=rf'{package} package: pip install "nsa\[train\]"'):
        stream_of(parquet_file, backoff_s=60.0).next_batch()
    assert sleeps == []


@pytest.mark.parametrize("name", ["empty.jsonl", "blank-lines.jsonl", "empty.parquet",
                                  "empty.txt"])
def test_an_empty_file_is_named_when_the_stream_is_built(tmp_path, sleeps, name):
    path = tmp_path / name
    if name.endswith(".parquet"):
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    else:
        path.write_text("\n\n" if name.startswith("blank") else "")
    for split in SPLITS:
        with pytest.raises(SetupError, match=rf"{re.escape(str(path))} holds no document"):
            stream_of(str(path), split)
    assert sleeps == []


def test_an_empty_file_among_others_is_named(tmp_path):
    (tmp_path / "a.txt").write_text("a document")
    (tmp_path / "b.txt").write_text("")
    with pytest.raises(SetupError, match=r"b\.txt holds no document"):
        stream_of(str(tmp_path), val_docs=0)


@pytest.mark.parametrize("val_docs, world_size, message", [
    (1000, 1, "holds 36 documents, and the first val_docs=1000 are held out for validation, "
              "leaving none for training: set val_docs=35 or lower"),
    (35, 2, "leaving 1 for training, and each of 2 ranks needs one: set val_docs=34 or lower"),
], ids=["none-left", "too-few-for-the-ranks"])
def test_too_few_documents_for_val_docs_is_named(parquet_file, val_docs, world_size, message):
    for split in SPLITS:
        with pytest.raises(SetupError, match=re.escape(message)):
            stream_of(parquet_file, split, val_docs=val_docs, world_size=world_size)
    stream_of(parquet_file, val_docs=34, world_size=2)  # one training document per rank


@needs_datasets
def test_a_val_split_too_small_for_the_batches_names_eval_steps(parquet_file):
    stream = stream_of(parquet_file, "val", batch_size=1)
    with pytest.raises(SetupError, match=r"val_docs=5 .* set eval_steps=\d+ or lower"):
        rows(stream, 100)


@needs_datasets
def test_fineweb_streams_the_hub_dataset(parquet_file, monkeypatch):
    import datasets

    calls, load_dataset = [], datasets.load_dataset

    def load_hub_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        return load_dataset("parquet", data_files=[parquet_file], **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", load_hub_dataset)
    tokens = rows(stream_of("fineweb"), 4)
    assert tokens == packed(DOCS[VAL_DOCS:])[: len(tokens)]
    assert calls == [("HuggingFaceFW/fineweb-edu", "sample-10BT",
                      {"split": "train", "streaming": True})]
    rows(stream_of("hf:someone/corpus", dataset_config="en"), 1)
    assert calls[-1][:2] == ("someone/corpus", "en")


@pytest.mark.parametrize("source", ["synthetic", "shakespeare"])
@pytest.mark.parametrize("split", ["train", "val"])
def test_ranks_get_their_rows_of_the_global_batch(source, split):
    whole = stream_of(source, split, batch_size=4, seq_len=8, seed=3)
    ranks = [stream_of(source, split, batch_size=2, seq_len=8, seed=3, rank=rank, world_size=2)
             for rank in (0, 1)]
    for _ in range(3):
        x, y = whole.next_batch()
        parts = [stream.next_batch() for stream in ranks]
        assert torch.equal(torch.cat([part[0] for part in parts]), x)
        assert torch.equal(torch.cat([part[1] for part in parts]), y)


def test_shakespeare_batches_are_the_bundled_corpus_windows():
    train_tokens, _ = split_tokens(load_corpus(), 0.1)
    sampler = BatchSampler(train_tokens, 4, 16, seed=2, stream=TRAIN_STREAM)
    stream = stream_of("shakespeare", batch_size=4, seq_len=16, seed=2)
    for index in range(3):
        for ours, theirs in zip(stream.next_batch(), sampler.batch(index), strict=True):
            assert torch.equal(ours, theirs)


def test_synthetic_tokens_depend_on_seed_split_and_index():
    def first_batch(split="train", seed=0):
        return stream_of("synthetic", split, seed=seed, batch_size=64).next_batch()[0]

    x = first_batch()
    assert int(x.min()) >= 0 and int(x.max()) < 256 and len(x.unique()) > 200
    assert torch.equal(first_batch(), x)
    assert not torch.equal(first_batch("val"), x)
    assert not torch.equal(first_batch(seed=1), x)
    stream = stream_of("synthetic", batch_size=64)
    stream.next_batch()
    assert not torch.equal(stream.next_batch()[0], x)
    stream.reset()
    assert torch.equal(stream.next_batch()[0], x) and stream.state_dict() == {"batch_index": 1}


def test_global_batch_must_split_evenly():
    assert local_batch_size(8, 4) == 2
    with pytest.raises(ValueError, match="global_batch_size=6 must be divisible by world_size=4"):
        local_batch_size(6, 4)
    with pytest.raises(ValueError, match="global_batch_size=5"):
        IndexedStream(lambda index: (torch.zeros(5, 4), torch.zeros(5, 4)), 5, 4, 0, 2)


@pytest.mark.parametrize("source, options, name", [
    ("synthetic", {"batch_size": 0}, "batch_size"),
    ("synthetic", {"seq_len": 0}, "seq_len"),
    ("synthetic", {"world_size": 0}, "world_size"),
    ("synthetic", {"rank": 2, "world_size": 2}, "rank"),
    ("synthetic", {"rank": -1}, "rank"),
    ("synthetic", {"split": "test"}, "split"),
    ("fineweb", {"val_docs": -1}, "val_docs"),
    ("fineweb", {"split": "val", "val_docs": 0}, "val_docs"),
    ("fineweb", {"retries": -1}, "retries"),
    ("fineweb", {"backoff_s": -0.5}, "backoff_s"),
    ("shakespeare", {"val_fraction": 1.0}, "val_fraction"),
    ("no/such/file.jsonl", {}, "source"),
    ("hf:", {}, "source"),
    ("{data}", {"dataset_config": "en"}, "dataset_config"),
    ("{data}/*", {}, "source"),  # .csv and .parquet files: one format only
])
def test_bad_arguments_are_named(tmp_path, parquet_file, source, options, name):
    (tmp_path / "notes.csv").write_text("a,b\n")
    split = options.pop("split", "train")
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        stream_of(source.format(data=tmp_path), split, **options)


def test_byte_tokenizer_separates_documents_with_byte_zero():
    tokenizer = get_tokenizer("bytes")
    assert (tokenizer.vocab_size, tokenizer.eot) == (256, 0)
    assert tokenizer.encode("hé") == [104, 195, 169] and tokenizer.decode([104, 195, 169]) == "hé"
    with pytest.raises(ValueError, match="tokenizer must be one of"):
        get_tokenizer("sentencepiece")


def test_gpt2_explains_how_to_load_its_files_offline(monkeypatch):
    import tiktoken

    def offline(name):
        raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(TokenizerUnavailableError, match="TIKTOKEN_CACHE_DIR.*Failed to resolve"):
        get_tokenizer("gpt2")


def test_gpt2_encodes_ordinary_text_and_decodes_padding_ids_as_replacement(monkeypatch):
    import tiktoken

    class Encoding:  # a stand-in for tiktoken's gpt2 with a three-token vocabulary
        n_vocab = 3

        def encode_ordinary(self, text):
            return [{"a": 0, "b": 1, "<": 2}[char] for char in text]

        def decode_single_token_bytes(self, token):
            return [b"a", b"b", b"<"][token]

    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: Encoding())
    tokenizer = get_tokenizer("gpt2")
    assert (tokenizer.vocab_size, tokenizer.eot) == (50304, 50256)
    assert tokenizer.encode("ab<") == [0, 1, 2]
    assert tokenizer.decode(torch.tensor([1, 50300, 0, -1])) == "b\ufffda\ufffd"


def test_importing_the_trainer_loads_neither_datasets_nor_tiktoken():
    code = ("import sys, nsa.train, nsa.train.streams\n"
            "assert not {'datasets', 'tiktoken'} & set(sys.modules), 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
