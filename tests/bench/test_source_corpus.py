"""bench/source_corpus.py: installed Python sources as a JSON-lines corpus."""

import importlib.util
import json
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "source_corpus", Path(__file__).parents[2] / "bench" / "source_corpus.py")
source_corpus = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(source_corpus)


@pytest.fixture
def roots(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b" / "pkg"
    b.mkdir(parents=True)
    a.mkdir()
    for i in range(6):
        (a / f"m{i}.py").write_text(f"def f{i}():\n    return {i}\n" + "# x\n" * (10 + i))
    (b / "copy.py").write_text((a / "m0.py").read_text())  # the same module twice
    (b / "short.py").write_text("x = 1\n")
    (b / "latin.py").write_bytes(b"# \xe9\xe8 not utf-8\n" * 20)
    (b / "notes.txt").write_text("not python\n" * 20)
    return [tmp_path / "a", tmp_path / "b"]


def read(path):
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def test_documents_are_distinct_utf8_python_files_of_min_chars(roots):
    documents = source_corpus.source_documents(roots, min_chars=30)
    assert len(documents) == 6  # m0..m5; the copy, the short, latin-1 and .txt files left out
    assert all(d.startswith("def f") for d in documents)


def test_corpus_is_shuffled_by_seed_and_capped(roots, tmp_path):
    out = tmp_path / "corpus.jsonl"
    assert source_corpus.build_corpus(roots, out, 1.0, 30, seed=1)[0] == 6
    first = read(out)
    source_corpus.build_corpus(roots, out, 1.0, 30, seed=1)
    assert read(out) == first
    source_corpus.build_corpus(roots, out, 1.0, 30, seed=2)
    assert sorted(read(out)) == sorted(first) and read(out) != first
    count, chars = source_corpus.build_corpus(roots, out, 100e-6, 30, seed=1)  # 100 chars
    assert 1 <= count < 6 and chars == sum(map(len, read(out))) and chars >= 100


def test_nothing_to_read_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit):
        source_corpus.main(["--out", str(tmp_path / "c.jsonl"), "--roots", str(tmp_path)])
    assert not (tmp_path / "c.jsonl").exists()
