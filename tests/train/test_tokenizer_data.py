import pytest
import torch

from nsa.train.data import (
    TRAIN_STREAM,
    VAL_STREAM,
    BatchSampler,
    document_offsets,
    load_corpus,
    split_tokens,
)
from nsa.train.tokenizer import VOCAB_SIZE, decode, encode


def test_round_trip_with_multibyte_text():
    text = "ROMEO: Wherefore art thou — ünïcödé ✓\n"
    tokens = encode(text)
    assert tokens.dtype == torch.int64 and len(tokens) == len(text.encode("utf-8"))
    assert int(tokens.max()) < VOCAB_SIZE
    assert decode(tokens) == text
    assert decode(tokens.tolist()) == text


def test_invalid_bytes_and_ids_decode_as_replacement():
    assert decode([72, 0xC3]) == "H\ufffd"  # truncated UTF-8 sequence
    assert decode([72, 300, -1, 105]) == "H\ufffd\ufffdi"  # ids outside the byte range


def test_corpus_is_bundled_and_split_at_the_tail():
    tokens = load_corpus()
    assert len(tokens) > 1_000_000 and decode(tokens[:9]) == "First Cit"
    train, val = split_tokens(tokens, 0.1)
    assert len(val) == int(len(tokens) * 0.1)
    assert torch.equal(torch.cat([train, val]), tokens)


def test_batches_are_shifted_windows():
    tokens = torch.arange(1000)
    x, y = BatchSampler(tokens, batch_size=4, seq_len=16, seed=0, stream=TRAIN_STREAM).batch(0)
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(y, x + 1)  # y[t] is the token after x[t]
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)  # contiguous windows


def test_batches_depend_only_on_seed_stream_and_index():
    tokens = torch.arange(10_000)
    sampler = BatchSampler(tokens, 8, 32, seed=3, stream=TRAIN_STREAM)
    replay = BatchSampler(tokens, 8, 32, seed=3, stream=TRAIN_STREAM)
    later = [sampler.batch(i)[0] for i in range(5)]
    assert torch.equal(replay.batch(4)[0], later[4])  # no hidden state: index 4 first
    assert not torch.equal(later[0], later[1])
    assert not torch.equal(BatchSampler(tokens, 8, 32, 4, TRAIN_STREAM).batch(0)[0], later[0])
    assert not torch.equal(BatchSampler(tokens, 8, 32, 3, VAL_STREAM).batch(0)[0], later[0])


def test_windows_cover_the_whole_range():
    tokens = torch.arange(40)
    x, y = BatchSampler(tokens, batch_size=2000, seq_len=8, seed=0, stream=0).batch(0)
    assert int(x[:, 0].min()) == 0 and int(y[:, -1].max()) == 39


def test_too_short_split_is_rejected():
    with pytest.raises(ValueError, match="seq_len=16"):
        BatchSampler(torch.arange(16), batch_size=1, seq_len=16, seed=0, stream=0)


def test_documents_start_at_each_row_and_after_each_eot():
    eot = 0
    x = torch.tensor([[5, 0, 7, 7, 0],    # eot inside a row: a document starts after it
                      [0, 3, 3, 3, 3],    # eot first: a one-token document
                      [4, 4, 4, 4, 0]])   # eot last: the next row starts one anyway
    assert document_offsets(x, eot).tolist() == [0, 2, 5, 6, 10, 15]
    assert document_offsets(x, eot).dtype == torch.int32


def test_the_bundled_corpus_has_no_eot_so_each_row_is_one_document():
    x, _ = BatchSampler(load_corpus(), batch_size=4, seq_len=64, seed=0, stream=0).batch(0)
    assert document_offsets(x, 0).tolist() == [0, 64, 128, 192, 256]
