"""bench/quality.py end to end with a very small model: three variants trained on the bundled
corpus, cut into documents, at equal tokens; their curves, passkey cells, JSON and plot; a
curriculum from an earlier call's runs (--init-from)."""

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from tests.optional import needs_datasets

pytest.importorskip("matplotlib")
SPEC = importlib.util.spec_from_file_location(
    "quality", Path(__file__).parents[2] / "bench" / "quality.py")
quality = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(quality)

SMALL = ["dim=32", "num_layers=1", "num_heads=2", "num_kv_heads=1", "head_dim_k=16",
         "head_dim_v=16", "batch_size=2", "eval_steps=2", "warmup_steps=1", "num_threads=1"]


def test_text_documents_are_paragraphs_of_at_least_min_chars_shuffled_by_seed():
    text = "\n\n".join(f"paragraph {i} " + "x" * (i % 7) for i in range(40))
    documents = quality.text_documents(text, 30, seed=1)
    assert documents == quality.text_documents(text, 30, seed=1)
    assert documents != quality.text_documents(text, 30, seed=2)
    assert sum(len(d) < 30 for d in documents) <= 1  # only the last may be short
    paragraphs = [p for d in documents for p in d.split("\n\n")]
    assert sorted(paragraphs) == sorted(text.split("\n\n"))


@needs_datasets
def test_three_variants_at_equal_tokens(tmp_path, capsys):
    out = tmp_path / "quality"
    quality.main(["--out", str(out), "--seq", "96", "--tokens", str(6 * 2 * 96), "--evals", "2",
                  "--doc-masking", "--passkey-lengths", "96", "--passkey-depths", "0,100",
                  "--passkey-trials", "2", *SMALL])
    summary = json.loads((out / "quality.json").read_text())
    assert (out / "quality.png").read_bytes()[:4] == b"\x89PNG"
    assert summary["max_steps"] == 6 and summary["tokens_per_step"] == 2 * 96
    assert list(summary["runs"]) == ["nsa", "dense", "nsa-win"]
    for name, run in summary["runs"].items():
        config = json.loads((out / name / "config.json").read_text())
        assert config["train"]["doc_masking"] and config["train"]["seq_len"] == 96
        assert config["train"]["data"] == str(out / "corpus.jsonl")
        assert config["model"]["attention"]["force_branch"] == ("win" if name == "nsa-win"
                                                               else None)
        assert [p["step"] for p in run["curve"]] == [3, 6]
        assert [p["tokens"] for p in run["curve"]] == [3 * 192, 6 * 192]
        assert 0 < run["curve"][0]["elapsed_s"] < run["curve"][1]["elapsed_s"]
        assert [(c["length"], c["depth"]) for c in run["passkey"]] == [(96, 0), (96, 100)]
    assert summary["runs"]["dense"]["parameters"] < summary["runs"]["nsa"]["parameters"]
    assert "variant" in capsys.readouterr().out


@needs_datasets
def test_init_from_starts_each_variant_from_its_run_of_an_earlier_call(tmp_path, capsys):
    """A curriculum: seq 96, then seq 128 from its runs."""
    common = ["--tokens", str(2 * 2 * 96), "--evals", "1", "--variants", "nsa,dense",
              "--passkey-depths", "0", "--passkey-trials", "1", *SMALL]
    quality.main(["--out", str(tmp_path / "q96"), "--seq", "96", *common])
    quality.main(["--out", str(tmp_path / "q128"), "--seq", "128", "--init-from",
                  str(tmp_path / "q96"), *common])
    summary = json.loads((tmp_path / "q128" / "quality.json").read_text())
    assert summary["settings"]["init_from"] == str(tmp_path / "q96")
    assert summary["title"].endswith(f", from {tmp_path / 'q96'}")
    for name in ("nsa", "dense"):
        config = json.loads((tmp_path / "q128" / name / "config.json").read_text())
        assert config["train"]["init_from"] == str(tmp_path / "q96" / name)
        assert config["model"]["max_seq_len"] == 128
    assert f"init from {tmp_path / 'q96' / 'dense'} (step 2)" in capsys.readouterr().out


def test_init_from_without_a_run_of_a_variant_fails_before_any_training(run_dir, tmp_path,
                                                                         capsys, monkeypatch):
    earlier = tmp_path / "earlier"
    shutil.copytree(run_dir, earlier / "nsa")  # no dense/
    monkeypatch.setattr(quality, "train", lambda *args, **kwargs: pytest.fail("trained"))
    with pytest.raises(SystemExit) as raised:
        quality.main(["--out", str(tmp_path / "out"), "--init-from", str(earlier),
                      "--variants", "nsa,dense", *SMALL])
    assert raised.value.code == 2
    assert (f"--init-from {earlier}: no checkpoint of variant dense in {earlier / 'dense'}"
            in capsys.readouterr().err)


def summary_of(*variants, seed=0):
    """A quality.json's content as bench/quality.py writes it, for the named variants."""
    runs = {name: {"overrides": quality.VARIANTS[name], "parameters": 1000 + i,
                   "curve": [{"step": 2, "tokens": 192, "elapsed_s": 1.5 + i,
                              "val_loss": 3.0 - i}],
                   "passkey": [{"length": 96, "depth": 0.0, "accuracy": 0.5}],
                   "device": "cpu"}
            for i, name in enumerate(variants)}
    return {"title": "tiny, seq 96", "settings": {"preset": "tiny", "seed": seed},
            "tokens_per_step": 96, "max_steps": 2, "runs": runs}


def write(path, summary):
    path.write_text(json.dumps(summary))
    return str(path)


def test_runs_made_apart_merge_into_one_report(tmp_path, capsys):
    first = write(tmp_path / "a.json", summary_of("nsa"))
    second = write(tmp_path / "b.json", summary_of("dense", "nsa-win"))
    quality.main(["--merge", first, second, "--out", str(tmp_path / "merged")])
    merged = json.loads((tmp_path / "merged" / "quality.json").read_text())
    assert list(merged["runs"]) == ["nsa", "dense", "nsa-win"]
    assert merged["runs"]["nsa-win"] == summary_of("dense", "nsa-win")["runs"]["nsa-win"]
    assert merged["merged_from"] == [first, second] and merged["max_steps"] == 2
    assert (tmp_path / "merged" / "quality.png").read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    assert all(name in table for name in ("nsa ", "dense", "nsa-win"))


@pytest.mark.parametrize("second, message", [
    (summary_of("dense", seed=1), "settings differ"),
    (summary_of("nsa"), r"variant\(s\) \['nsa'\] already"),
    ({"runs": {}}, "not a quality.json"),
])
def test_merging_refuses_runs_that_do_not_compare(tmp_path, capsys, second, message):
    first = write(tmp_path / "a.json", summary_of("nsa"))
    with pytest.raises(SystemExit) as raised:
        quality.main(["--merge", first, write(tmp_path / "b.json", second),
                      "--out", str(tmp_path / "merged")])
    assert raised.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "merged" / "quality.json").exists()
