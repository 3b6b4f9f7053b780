"""The command line: the README's generation and evaluation examples with the tiny preset, and
every misuse answered with exactly one 'nsa: error:' line (exit code 2, no traceback)."""

import json
import math
import sys

import pytest
import torch

import nsa.cli
import nsa.models.decoding as decoding
from nsa.models.decoding import sample_token
from nsa.train import build_config
from nsa.train.checkpoint import export_model, latest_checkpoint
from tests.optional import needs_datasets

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: threads only wait
LONG_PROMPT = "ROMEO:\nBut, soft! what light through yonder window breaks?\n" * 6  # > 128 bytes


@pytest.fixture(scope="module")
def model_file(run_dir):
    return export_model(latest_checkpoint(run_dir), run_dir / "model.pt")


def test_readme_generate_with_a_prompt_file_longer_than_the_context(run_dir, model_file,
                                                                    tmp_path, capsys):
    """'nsa generate --model model.pt --prompt-file prompt.txt ...': a prompt of 348 bytes and
    200 new ones with a max_seq_len of 128."""
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(LONG_PROMPT)
    for model in (run_dir, model_file):
        nsa.cli.main(["generate", "--model", str(model), "--prompt-file", str(prompt_file),
                      "--temperature", "0.7", "--top-k", "50"])
        out, err = capsys.readouterr()
        assert out.startswith(LONG_PROMPT) and len(out) > len(LONG_PROMPT)
        assert "the model reads its last 128" in err and "[200 tokens in" in err


def test_readme_sample_400_tokens_is_the_generate_loop(run_dir, capsys, monkeypatch):
    """'nsa sample --tokens 400' runs past max_seq_len (128) through the loop of 'nsa
    generate': with the run's seed and temperature both sample the same 400 tokens. Both on
    the CPU, where both compute in float32. On a GPU sample runs the float32 weights under
    bf16 autocast and generate casts the weights to bf16 (a float32 residual stream against a
    bf16 one), so their logits differ slightly, enough to flip a draw of this untrained
    model's near-uniform distribution now and then."""
    runs = []

    def recording_sample_token(*args, **kwargs):
        runs[-1].append(sample_token(*args, **kwargs))
        return runs[-1][-1]

    monkeypatch.setattr(decoding, "sample_token", recording_sample_token)
    runs.append([])
    nsa.cli.main(["sample", "--run-dir", str(run_dir), "--prompt", "JULIET:", "--tokens", "400",
                  "--device", "cpu"])
    assert capsys.readouterr().out.startswith("JULIET:")
    runs.append([])
    seed = build_config("tiny", []).train.seed
    nsa.cli.main(["generate", "--model", str(run_dir), "--prompt", "JULIET:", "--max-tokens",
                  "400", "--temperature", "0.8", "--seed", str(seed), "--device", "cpu"])
    assert "[400 tokens in" in capsys.readouterr().err
    assert len(runs[0]) == 400 and torch.equal(torch.cat(runs[0]), torch.cat(runs[1]))


HELD_OUT = ["JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n" * 3, "Deny thy father.\n"]


@needs_datasets
def test_readme_eval_perplexity_and_passkey(run_dir, model_file, tmp_path, capsys):
    """'nsa eval --tasks perplexity,passkey ... --json': the same results from the run
    directory and its exported file, every held-out byte scored, a cell per length and depth."""
    for i, text in enumerate(HELD_OUT):
        (tmp_path / f"held_out{i}.txt").write_text(text)
    results = []
    for model in (run_dir, model_file):
        out_json = tmp_path / f"{model.name}.json"
        nsa.cli.main(["eval", "--model", str(model), "--files", str(tmp_path / "held_out*.txt"),
                      "--tasks", "perplexity,passkey", "--passkey-lengths", "96,128",
                      "--passkey-depths", "0,50,100", "--passkey-trials", "2", "--seed", "3",
                      "--json", str(out_json)])
        out = capsys.readouterr().out
        assert "bits/byte" in out and "length \\ depth      0%     50%    100%" in out
        results.append(json.loads(out_json.read_text()))
    assert results[0]["perplexity"] == results[1]["perplexity"]
    assert results[0]["passkey"] == results[1]["passkey"]
    perplexity = results[0]["perplexity"]
    assert perplexity["tokens"] == perplexity["bytes"] == sum(len(t) for t in HELD_OUT)
    assert perplexity["seq_len"] == 128 and perplexity["bits_per_token"] == pytest.approx(
        perplexity["bits_per_byte"])
    assert 7.0 < perplexity["bits_per_byte"] < 9.0  # untrained: about log2(256) = 8
    assert math.isclose(perplexity["nats_per_token"], perplexity["nats"] / perplexity["tokens"])
    cells = results[0]["passkey"]["cells"]
    assert [(c["length"], c["depth"], c["trials"]) for c in cells] == [
        (length, depth, 2) for length in (96, 128) for depth in (0, 50, 100)]


def test_eval_past_the_trained_length(run_dir, capsys):
    """'nsa eval --max-seq-len 256' evaluates a model of max_seq_len 128 at contexts up to 256
    with the same weights, saying so; the model's own length gives the same cells as without
    the flag."""
    argv = ["eval", "--model", str(run_dir), "--tasks", "passkey", "--passkey-depths", "0,100",
            "--passkey-trials", "1"]
    nsa.cli.main([*argv, "--passkey-lengths", "128,256", "--max-seq-len", "256"])
    out = capsys.readouterr().out
    assert "max_seq_len 128 -> 256 for this evaluation: positions past 128 were not trained" in out
    rows = [line.split()[0] for line in out.splitlines() if line.strip().startswith(("128", "256"))]
    assert rows == ["128", "256"]
    nsa.cli.main([*argv, "--passkey-lengths", "128", "--max-seq-len", "256"])
    longer = capsys.readouterr().out.split("\n", 1)[1]
    nsa.cli.main([*argv, "--passkey-lengths", "128"])
    assert capsys.readouterr().out == longer


def test_eval_heatmap_needs_matplotlib(run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import raises ImportError
    with pytest.raises(SystemExit):
        nsa.cli.main(["eval", "--model", str(run_dir), "--tasks", "passkey", "--heatmap",
                      str(tmp_path / "passkey.png")])
    err = capsys.readouterr().err
    assert "nsa: error: a heat map needs matplotlib: pip install matplotlib" in err
    assert not (tmp_path / "passkey.png").exists()


@pytest.fixture
def files(tmp_path, run_dir, model_file):
    """The paths the misuses below name."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("ROMÉO:".encode("latin-1"))
    (tmp_path / "corrupt.pt").write_bytes(model_file.read_bytes()[:1000])
    return {"run": str(run_dir), "tmp": str(tmp_path), **{
        name: str(tmp_path / f"{name}.{ext}")
        for name, ext in (("empty", "txt"), ("latin1", "txt"), ("missing", "txt"),
                          ("corrupt", "pt"))}}


GENERATE = ["generate", "--model", "{run}"]
SAMPLE = ["sample", "--run-dir", "{run}"]
EXPORT = ["export", "--run-dir", "{run}"]
EVAL = ["eval", "--model", "{run}"]
PASSKEY = [*EVAL, "--tasks", "passkey"]
MISUSES = {  # argv ({name} is a path of ``files``) -> the error's message
    "generate-empty-prompt": ([*GENERATE, "--prompt", ""], "--prompt must not be empty"),
    "generate-empty-prompt-file": ([*GENERATE, "--prompt-file", "{empty}"],
                                   "--prompt-file {empty} is empty"),
    "generate-non-utf8-prompt-file": ([*GENERATE, "--prompt-file", "{latin1}"],
                                      "--prompt-file {latin1} is not UTF-8 text"),
    "generate-missing-prompt-file": ([*GENERATE, "--prompt-file", "{missing}"],
                                     "--prompt-file {missing}: No such file or directory"),
    "generate-zero-tokens": ([*GENERATE, "--max-tokens", "0"],
                             "--max-tokens must be an integer >= 1, got 0"),
    "generate-zero-temperature": ([*GENERATE, "--temperature", "0"],
                                  "--temperature must be a finite number > 0"),
    "generate-nan-temperature": ([*GENERATE, "--temperature", "nan"],
                                 "--temperature must be a finite number > 0"),
    "generate-zero-top-k": ([*GENERATE, "--top-k", "0"],
                            "--top-k must be None or an integer >= 1"),
    "generate-top-p-above-1": ([*GENERATE, "--top-p", "1.5"], "--top-p must be None or in (0, 1]"),
    "generate-nan-top-p": ([*GENERATE, "--top-p", "nan"], "--top-p must be None or in (0, 1]"),
    "generate-corrupt-model": (["generate", "--model", "{corrupt}"],
                               "{corrupt}: not a readable model file"),
    "sample-negative-tokens": ([*SAMPLE, "--tokens", "-4"],
                               "--tokens must be an integer >= 1, got -4"),
    "sample-zero-temperature": ([*SAMPLE, "--temperature", "0"],
                                "--temperature must be a finite number > 0"),
    "sample-empty-prompt": ([*SAMPLE, "--prompt", ""], "--prompt must not be empty"),
    "sample-corrupt-model": (["sample", "--run-dir", "{corrupt}"],
                             "{corrupt}: not a readable model file"),
    "export-out-directory": ([*EXPORT, "--out", "{tmp}"], "{tmp} is a directory"),
    "export-out-missing-directory": ([*EXPORT, "--out", "{tmp}/no/model.pt"],
                                     "the directory {tmp}/no does not exist"),
    "train-abbreviated-resume": (["train", "--resum", "max_steps=1"],
                                 "unrecognized arguments: --resum"),
    "train-abbreviated-overwrite": (["train", "--ov"], "unrecognized arguments: --ov"),
    "train-abbreviated-auto-resume": (["train", "--auto", "max_steps=1"],
                                      "unrecognized arguments: --auto"),
    "sample-abbreviated-tokens": ([*SAMPLE, "--tok", "4"], "unrecognized arguments: --tok 4"),
    "generate-abbreviated-max-tokens": ([*GENERATE, "--max", "4"],
                                        "unrecognized arguments: --max 4"),
    "export-abbreviated-out": ([*EXPORT, "--out", "{tmp}/m.pt", "--o", "{tmp}/other.pt"],
                               "unrecognized arguments: --o {tmp}/other.pt"),
    "eval-missing-model": (["eval", "--model", "{tmp}/no-run"],
                           "--model {tmp}/no-run: no such file or directory"),
    "eval-corrupt-model": (["eval", "--model", "{corrupt}"],
                           "{corrupt}: not a readable model file"),
    "eval-unknown-task": ([*EVAL, "--tasks", "perplexity,mmlu"],
                          "--tasks takes comma-separated tasks of ('perplexity', 'passkey')"),
    "eval-passkey-flag-without-the-task": ([*EVAL, "--passkey-lengths", "128"],
                                           "--passkey-lengths applies to --tasks passkey"),
    "eval-files-without-perplexity": ([*PASSKEY, "--files", "{empty}"],
                                      "--files applies to --tasks perplexity"),
    "eval-missing-files": ([*EVAL, "--files", "{missing}"],
                           "--files {missing}: no such file, directory or glob match"),
    "eval-non-utf8-files": ([*EVAL, "--files", "{latin1}"], "{latin1}: line 1: not UTF-8 text"),
    "eval-seq-beyond-max-seq-len": ([*EVAL, "--seq", "129"],
                                    "--seq must be in [1, max_seq_len=128], got 129"),
    "eval-length-beyond-max-seq-len": ([*PASSKEY, "--passkey-lengths", "96,256"],
                                       "passkey length 256 is outside [79, 128]"),
    "eval-max-seq-len-not-longer": ([*PASSKEY, "--max-seq-len", "128"],
                                    "--max-seq-len must exceed the model's max_seq_len (128), "
                                    "got 128"),
    "eval-length-beyond-the-longer-max-seq-len": (
        [*PASSKEY, "--max-seq-len", "192", "--passkey-lengths", "256"],
        "passkey length 256 is outside [79, 192]"),
    "eval-length-shorter-than-the-question": ([*PASSKEY, "--passkey-lengths", "40"],
                                              "passkey length 40 is outside [79, 128]"),
    "eval-length-not-a-number": ([*PASSKEY, "--passkey-lengths", "2k"],
                                 "--passkey-lengths takes comma-separated ints, got '2k'"),
    "eval-depth-above-100": ([*PASSKEY, "--passkey-depths", "0,50,120"],
                             "passkey depth 120 is outside [0, 100]"),
    "eval-depth-nan": ([*PASSKEY, "--passkey-depths", "nan"], "--passkey-depths must be finite"),
    "eval-zero-trials": ([*PASSKEY, "--passkey-trials", "0"], "passkey trials must be >= 1"),
    "eval-zero-batch-size": ([*EVAL, "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    "eval-json-in-missing-directory": ([*EVAL, "--json", "{tmp}/no/results.json"],
                                       "--json {tmp}/no/results.json: not a file path in an "
                                       "existing directory"),
}


READS_DOCUMENTS = {"eval-non-utf8-files"}  # misuses found by the document reader (datasets)


@pytest.mark.parametrize("misuse", [pytest.param(m, marks=needs_datasets) if m in READS_DOCUMENTS
                                    else m for m in MISUSES])
def test_a_misuse_gets_one_error_line(misuse, files, capsys, monkeypatch):
    monkeypatch.setattr(nsa.cli, "train", lambda *args, **kwargs: pytest.fail("it trained"))
    argv, message = MISUSES[misuse]
    with pytest.raises(SystemExit) as exit_info:
        nsa.cli.main([arg.format(**files) for arg in argv])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert [line for line in err.splitlines() if "error" in line.lower()] == [
        f"nsa: error: {err.split('nsa: error: ', 1)[-1].strip()}"]
    assert message.format(**files) in err and "Traceback" not in out + err
