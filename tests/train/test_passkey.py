"""Passkey documents: exact lengths, the needle at its depth, keys and documents from the seed,
and the ``data=passkey`` training source (rows of whole documents, a training run)."""

import math
import re

import pytest
import torch

import nsa.cli
from nsa.train.data import batch_generator
from nsa.train.errors import SetupError
from nsa.train.passkey import (
    ANSWER_TOKENS,
    FILLER,
    IGNORED,
    KEY_DIGITS,
    NEEDLE,
    QUESTION,
    PasskeyText,
    parse_passkey_source,
    passkey_row,
    random_key,
)
from nsa.train.streams import build_stream
from nsa.train.tokenizer import ByteTokenizer

BYTES = ByteTokenizer()
TEXT = PasskeyText(BYTES)


def test_the_shortest_lengths_are_needle_question_and_answer():
    needle, question = len(NEEDLE.format(key="12345")), len(QUESTION)
    assert TEXT.shortest_prompt == needle + question
    assert (TEXT.shortest_context, TEXT.shortest_document) == (needle + question + ANSWER_TOKENS,
                                                              needle + question + ANSWER_TOKENS + 1)
    assert ANSWER_TOKENS == len(" 12345")
    assert len(TEXT.prompt(TEXT.shortest_prompt, 50, "12345").tokens) == TEXT.shortest_prompt
    with pytest.raises(ValueError, match=f"needs at least {TEXT.shortest_prompt} tokens"):
        TEXT.prompt(TEXT.shortest_prompt - 1, 50, "12345")


@pytest.mark.parametrize("length", [73, 100, 128, 1000])
@pytest.mark.parametrize("depth", [0, 25, 50, 12.5, 100])
def test_a_prompt_has_its_length_and_the_needle_at_its_depth(length, depth):
    prompt = TEXT.prompt(length, depth, "71432")
    needle = BYTES.encode(NEEDLE.format(key="71432"))
    num_filler = length - len(needle) - len(QUESTION)
    assert len(prompt.tokens) == length and prompt.key == "71432"
    assert prompt.needle_start == round(depth / 100 * num_filler)
    assert prompt.tokens[prompt.needle_start:prompt.needle_start + len(needle)] == needle
    text = BYTES.decode(prompt.tokens)
    assert text.endswith(QUESTION) and text.count("71432") == 1
    assert text.replace(NEEDLE.format(key="71432"), "") == (FILLER * 20)[:num_filler] + QUESTION


def test_depths_outside_0_to_100_are_refused():
    for depth in (-1, 100.5):
        with pytest.raises(ValueError, match="percentage in \\[0, 100\\]"):
            TEXT.prompt(100, depth, "71432")


def test_a_document_is_prompt_answer_and_eot_of_exactly_its_length():
    document, is_answer = TEXT.document(120, 30, "50001")
    assert len(document) == 120 and document[-1] == BYTES.eot
    assert is_answer == [False] * 113 + [True] * 6 + [False]
    assert BYTES.decode(document[:-1]).endswith(QUESTION + " 50001")
    assert document[:-7] == TEXT.prompt(113, 30, "50001").tokens


def test_keys_come_from_the_generator():
    keys = [random_key(batch_generator(7, 0, i)) for i in range(50)]
    assert all(re.fullmatch(rf"[1-9]\d{{{KEY_DIGITS - 1}}}", key) for key in keys)
    assert len(set(keys)) > 45
    assert keys == [random_key(batch_generator(7, 0, i)) for i in range(50)]


def documents(row: list[int]) -> list[list[int]]:
    """The whole documents of a row (each ended by eot); a cut last one is left out."""
    text = BYTES.decode(row)
    return [BYTES.encode(doc) + [BYTES.eot] for doc in text.split("\0")[:-1]]


@pytest.mark.parametrize("spec, lengths, depths", [
    ("passkey", (80, 301), (0, 100)),
    ("passkey:90-150", (90, 150), (0, 100)),
    ("passkey:200-200:0-10", (200, 200), (0, 10)),
    ("passkey:80-120:50-50", (80, 120), (50, 50)),
    ("passkey:answers", (80, 301), (0, 100)),
    ("passkey:90-150:answers", (90, 150), (0, 100)),
    ("passkey:80-120:50-50:answers", (80, 120), (50, 50)),
    ("passkey:90-150:distance", (90, 150), (0, 100)),
    ("passkey:80-301:distance:answers", (80, 301), (0, 100)),
])
def test_rows_hold_whole_documents_within_the_spec(spec, lengths, depths):
    source = parse_passkey_source(spec, TEXT, 301)
    assert (source.min_length, source.max_length) == lengths
    assert (source.min_depth, source.max_depth) == depths
    assert source.uniform_distance is (":distance" in spec)
    generator = batch_generator(0, 0, 0)
    seen = []
    for _ in range(20):
        row, is_answer = passkey_row(TEXT, source, 301, generator)
        assert len(row) == len(is_answer) == 301
        assert source.answers_only is spec.endswith(":answers")
        seen += documents(row)
    assert seen
    for document in seen:
        text = BYTES.decode(document[:-1])
        key = re.search(r"The pass key is (\d+)\. Remember it\. ", text).group(1)
        assert text.endswith(f"{QUESTION} {key}")
        filler = len(document) - len(NEEDLE.format(key=key)) - len(QUESTION) - ANSWER_TOKENS - 1
        assert lengths[0] <= len(document) <= lengths[1]
        assert (round(depths[0] / 100 * filler) <= text.index("The pass key is")
                <= round(depths[1] / 100 * filler))
    if lengths[0] < lengths[1]:
        assert len({len(d) for d in seen}) > 5


def needle_distances(spec: str, rows: int) -> list[int]:
    """Filler tokens between needle and question in the first document of each of ``rows``
    rows of 301 tokens (a first document is never shortened to fit its row)."""
    source = parse_passkey_source(spec, TEXT, 301)
    generator = batch_generator(0, 0, 0)
    distances = []
    for _ in range(rows):
        text = BYTES.decode(documents(passkey_row(TEXT, source, 301, generator)[0])[0])
        needle_end = re.search(r"The pass key is \d+\. Remember it\. ", text).end()
        distances.append(text.index(QUESTION) - needle_end)
    return distances


def test_distance_mode_draws_needle_distances_uniformly():
    """``:distance``: distances from needle to question uniform over 0 to the most a longest
    document holds (here 301 - 80 = 221 filler tokens), so the far half as common as the near
    half; with depths drawn uniformly on the same lengths the far half is much rarer."""
    most = 301 - TEXT.shortest_document
    uniform = needle_distances("passkey:80-301:distance", 2000)
    assert 0 <= min(uniform) <= 5 and most - 5 <= max(uniform) <= most
    far = sum(d > most / 2 for d in uniform) / len(uniform)
    farthest = sum(d > 0.9 * most for d in uniform) / len(uniform)
    assert 0.45 < far < 0.55 and 0.07 < farthest < 0.13
    by_depth = needle_distances("passkey:80-301", 2000)
    assert sum(d > most / 2 for d in by_depth) / len(by_depth) < 0.25
    assert sum(d > 0.9 * most for d in by_depth) / len(by_depth) < 0.02


@pytest.mark.parametrize("spec, message", [
    ("passkey:", "write passkey, passkey:MIN-MAX"),
    ("passkey:100", "write passkey"),
    ("passkey:100-90", "MIN <= MAX"),
    ("passkey:79-100", "80 \\(a passkey document of any key in the bytes tokenizer fits\\)"),
    ("passkey:100-302", "<= 301 \\(seq_len \\+ 1"),
    ("passkey:100-200:50-20", "0 <= LO <= HI <= 100"),
    ("passkey:100-200:0-101", "0 <= LO <= HI <= 100"),
    ("passkey:answer", "optionally followed by :answers"),
    ("passkey:answers:100-200", "write passkey"),
    ("passkey:distance", "passkey:MIN-MAX:distance"),
    ("passkey:100-200:10-20:distance", "write passkey"),
])
def test_a_bad_spec_is_named(spec, message):
    with pytest.raises(SetupError, match=message):
        build_stream(spec, "train", tokenizer=BYTES, batch_size=2, seq_len=300)


def test_the_source_is_a_pure_function_of_seed_split_and_index():
    def batches(split="train", seed=0, **options):
        stream = build_stream("passkey:80-129", split, tokenizer=BYTES, seq_len=128, seed=seed,
                              **{"batch_size": 4, **options})
        return [stream.next_batch() for _ in range(2)]

    (x, y), second = batches()
    assert x.shape == y.shape == (4, 128) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert all(torch.equal(a, b) for a, b in zip(batches()[0], (x, y), strict=True))
    assert not torch.equal(second[0], x)
    assert not torch.equal(batches("val")[0][0], x)
    assert not torch.equal(batches(seed=1)[0][0], x)
    rank_rows = [batches(batch_size=2, rank=rank, world_size=2)[0][0] for rank in (0, 1)]
    assert torch.equal(torch.cat(rank_rows), x)


def test_answers_only_keeps_the_same_rows_and_only_the_answers_targets():
    """``:answers``: the same tokens as without it; every target IGNORED but the tokens of each
    document's answer (" " and the key after the question), a cut last document's included."""
    def first_batch(spec):
        return build_stream(spec, "train", tokenizer=BYTES, seq_len=300, batch_size=4).next_batch()

    x, y = first_batch("passkey:80-140")
    x_answers, y_answers = first_batch("passkey:80-140:answers")
    assert torch.equal(x_answers, x)
    kept = y_answers != IGNORED
    assert torch.equal(y_answers[kept], y[kept])
    for row_x, row_y, row_kept in zip(x, y, kept, strict=True):
        text = BYTES.decode(torch.cat([row_x[:1], row_y]).tolist())
        answers = [m.span(1) for m in re.finditer(re.escape(QUESTION) + r"( \d{0,5})", text)]
        expected = torch.zeros(len(row_y), dtype=torch.bool)
        for start, end in answers:  # text positions; target t is text position t + 1
            expected[start - 1:end - 1] = True
        assert torch.equal(row_kept, expected)
        assert sum(end - start for start, end in answers) >= ANSWER_TOKENS


@pytest.mark.parametrize("spec", ["passkey:80-97", "passkey:80-97:answers"])
def test_nsa_trains_on_passkey_documents_with_doc_masking(spec, tiny_overrides, capsys):
    nsa.cli.main(["train", *tiny_overrides, f"data={spec}", "seq_len=96", "max_steps=2",
                  "doc_masking=true"])
    out = capsys.readouterr().out
    assert "(nsa attention) on 1 x " in out
    assert math.isfinite(float(re.search(r"final val loss (\S+) nats/token", out).group(1)))
