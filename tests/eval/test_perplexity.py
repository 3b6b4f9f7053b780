"""Perplexity: every text token scored once in windows of seq_len, the arithmetic of bits per
token and per byte, documents read alone under doc_masking, and the texts of a run's validation
split and of local files."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from nsa.eval.perplexity import Perplexity, file_texts, perplexity, validation_texts
from nsa.models import LanguageModel, model_preset
from nsa.train import TrainConfig
from nsa.train.data import read_corpus
from nsa.train.errors import SetupError
from nsa.train.tokenizer import ByteTokenizer
from tests.optional import needs_datasets

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: threads only wait
BYTES = ByteTokenizer()
TEXTS = ["ROMEO:\nBut, soft! what light through yonder window breaks?", "héllo wörld 🙂",
         "It is the east, and Juliet is the sun."]


class PairTokenizer:
    """One token per two UTF-8 bytes (the last may hold one): a tokenizer whose bits per byte
    are half its bits per token."""

    name, vocab_size, eot = "pairs", 256, 0

    def encode(self, text: str) -> list[int]:
        data = text.encode()
        return [1 + data[i] % 255 for i in range(0, len(data), 2)]


def model(seed: int = 0, max_seq_len: int = 64) -> LanguageModel:
    """A small NSA model whose weights (std 1) make the next token depend on the context."""
    torch.manual_seed(seed)
    lm = LanguageModel(model_preset("tiny", max_seq_len=max_seq_len, dim=32, num_heads=4,
                                    num_kv_heads=2, head_dim_k=8, head_dim_v=8, cmp_block=8,
                                    cmp_stride=4, sel_block=8, num_selected=3, window=12)).eval()
    with torch.no_grad():
        for parameter in lm.parameters():
            parameter.normal_(0, 1)
    return lm


def uniform_model() -> LanguageModel:
    """Logits 0 everywhere: every token costs ln(vocab_size) nats."""
    lm = model()
    with torch.no_grad():
        for parameter in lm.parameters():
            parameter.zero_()
    return lm


@pytest.mark.parametrize("tokenizer, bits_per_byte", [(BYTES, 8.0), (PairTokenizer(), None)])
def test_a_uniform_model_costs_log2_vocab_bits_per_token(tokenizer, bits_per_byte):
    result = perplexity(uniform_model(), tokenizer, TEXTS, 16)
    tokens = sum(len(tokenizer.encode(text)) for text in TEXTS)
    num_bytes = sum(len(text.encode()) for text in TEXTS)
    assert (result.tokens, result.bytes) == (tokens, num_bytes)
    assert math.isclose(result.nats, tokens * math.log(256), rel_tol=1e-6)
    assert math.isclose(result.bits_per_token, 8.0, rel_tol=1e-6)
    assert math.isclose(result.perplexity, 256.0, rel_tol=1e-5)
    assert math.isclose(result.bits_per_byte, bits_per_byte or 8.0 * tokens / num_bytes,
                        rel_tol=1e-6)


def test_the_arithmetic_of_a_known_case():
    result = Perplexity(seq_len=8, tokens=100, bytes=250, nats=100 * math.log(4))
    assert math.isclose(result.nats_per_token, math.log(4))
    assert math.isclose(result.bits_per_token, 2.0) and math.isclose(result.perplexity, 4.0)
    assert math.isclose(result.bits_per_byte, 0.8)  # 200 bits over 250 bytes
    assert json.loads(json.dumps(result.to_dict()))["bits_per_byte"] == result.bits_per_byte


def stream(texts) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, scored) as the module documents them: eot, then each text and an eot."""
    tokens, scored = [0], [False]
    for text in texts:
        tokens += [*BYTES.encode(text), 0]
        scored += [True] * len(BYTES.encode(text)) + [False]
    return torch.tensor(tokens), torch.tensor(scored)


def window_nats(lm, tokens, scored, start, end) -> float:
    """Nats of the scored targets start + 1 .. end, read from the window tokens[start:end]."""
    logits = lm(tokens[None, start:end])[0]
    losses = F.cross_entropy(logits, tokens[start + 1:end + 1], reduction="none")
    return float((losses * scored[start + 1:end + 1]).sum())


@pytest.mark.parametrize("seq_len", [7, 16, 64])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_windows_do_not_overlap_and_score_every_text_token_once(seq_len, batch_size):
    lm = model()
    tokens, scored = stream(TEXTS)
    with torch.no_grad():
        expected = sum(window_nats(lm, tokens, scored, start, min(start + seq_len,
                                                                  len(tokens) - 1))
                       for start in range(0, len(tokens) - 1, seq_len))
    result = perplexity(lm, BYTES, TEXTS, seq_len, batch_size=batch_size)
    assert result.tokens == int(scored.sum()) and result.seq_len == seq_len
    assert math.isclose(result.nats, expected, rel_tol=1e-5)


def test_doc_masking_reads_each_document_alone():
    """A text's first token is predicted from the document before it (its eot's target, as in
    training), every other token from its own document only, at positions from 0."""
    lm = model(max_seq_len=128)
    first, second = (BYTES.encode(text) for text in TEXTS[:2])
    assert len(first) + len(second) + 3 <= 128  # one window

    def nats(context: list[int], targets: list[int]) -> float:
        logits = lm(torch.tensor([context]))[0, -len(targets):]
        return float(F.cross_entropy(logits, torch.tensor(targets), reduction="sum"))

    with torch.no_grad():
        expected = (nats([0], first[:1]) + nats(first[:-1], first[1:])
                    + nats([*first, 0], second[:1]) + nats(second[:-1], second[1:]))
    masked = perplexity(lm, BYTES, TEXTS[:2], 128, doc_masking=True)
    assert math.isclose(masked.nats, expected, rel_tol=1e-5)
    assert not math.isclose(perplexity(lm, BYTES, TEXTS[:2], 128).nats, expected, rel_tol=1e-3)


@pytest.mark.parametrize("seq_len, texts, message", [
    (0, TEXTS, "seq_len must be in \\[1, max_seq_len=64\\]"),
    (65, TEXTS, "seq_len must be in"),
    (16, ["", ""], "no token to score"),
])
def test_bad_arguments_are_named(seq_len, texts, message):
    with pytest.raises(ValueError, match=message):
        perplexity(model(), BYTES, texts, seq_len)


def test_the_bundled_corpus_validation_split_is_its_last_tenth():
    (text,) = validation_texts(TrainConfig(val_fraction=0.1), BYTES)
    corpus = read_corpus()
    assert corpus.endswith(text) and len(text) == int(len(corpus.encode()) * 0.1)


@pytest.mark.parametrize("data", ["synthetic", "passkey:80-100"])
def test_sources_without_text_ask_for_files(data):
    with pytest.raises(SetupError, match=f"data={data} has no held-out text: give --files"):
        validation_texts(TrainConfig(data=data), BYTES)


@needs_datasets
def test_a_document_source_validation_split_is_its_first_documents(tmp_path):
    docs = [f"document {i}: " + "x" * i for i in range(12)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    config = TrainConfig(data=str(tmp_path / "docs.jsonl"), val_docs=4)
    assert validation_texts(config, BYTES) == docs[:4]


@needs_datasets
def test_files_are_read_as_data_reads_them(tmp_path):
    for i, text in enumerate(TEXTS):
        (tmp_path / f"{i}.txt").write_text(text)
    (tmp_path / "more.jsonl").write_text(json.dumps({"text": "a line"}) + "\n")
    assert file_texts([str(tmp_path / "0.txt"), str(tmp_path / "[12].txt")], BYTES) == TEXTS
    assert file_texts([str(tmp_path / "more.jsonl")], BYTES) == ["a line"]
    with pytest.raises(SetupError, match="--files .*missing.txt: no such file"):
        file_texts([str(tmp_path / "missing.txt")], BYTES)
    with pytest.raises(SetupError, match="--files must all be of one format"):
        file_texts([str(tmp_path / "0.txt"), str(tmp_path / "more.jsonl")], BYTES)
