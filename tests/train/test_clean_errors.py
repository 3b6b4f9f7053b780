"""Every misuse of ``nsa train`` gets one ``nsa: error:`` line naming the setting to change, before
any work starts: a launch or machine that does not fit the settings, contradictory flags, data
that is missing, empty or too small. A run that needs nothing it cannot have still ends."""

import json
import sys
from pathlib import Path

import pytest
import torch

import nsa.cli
from nsa.config_tree import replace_fields
from nsa.train import build_config, train, trainer
from nsa.train.errors import SetupError
from tests.optional import needs_datasets


@pytest.fixture
def no_step(monkeypatch):
    """Fail the test if a training step starts: the error must come before the first one."""
    def step(*args, **kwargs):
        raise AssertionError("a training step ran before the error")

    # Every step, eager or graphed (the default on a GPU), runs forward_backward.
    monkeypatch.setattr(trainer, "forward_backward", step)


@pytest.fixture
def not_launched(monkeypatch):
    """No torchrun environment."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def write_jsonl(path: Path, num_docs: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"document {i}: " + "x" * 40}) + "\n"
                            for i in range(num_docs)))
    return path


@pytest.mark.parametrize("overrides, message", [
    (["parallel=ddp"], "parallel=ddp needs torchrun: torchrun --nproc_per_node N -m nsa.train "
                       "... parallel=ddp, or parallel=none"),
    (["parallel=fsdp"], "parallel=fsdp needs torchrun"),
    (["device=cuda"], "device=cuda but no CUDA GPU is available here: device=cpu or device=auto"),
    (["backend=triton", "device=cpu"], "backend=triton needs a CUDA GPU (device=cuda): "
                                       "backend=auto or backend=torch runs on the CPU"),
], ids=["ddp", "fsdp", "cuda", "triton"])
def test_a_launch_that_cannot_run_is_one_error_line(tiny_overrides, cli_error, monkeypatch,
                                                     not_launched, overrides, message):
    if "device=cuda" in overrides and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setattr(trainer, "TRITON_INTERPRET", False)  # as on a user's CPU machine
    line = cli_error(["train", *tiny_overrides, *overrides])
    assert line.startswith("nsa: error: ") and message in line
    assert not Path(tiny_overrides[-1].split("=", 1)[1]).exists()  # before any work


def test_the_triton_backend_needs_triton_and_a_gpu_for_nsa_attention(monkeypatch):
    model = build_config("tiny", ["backend=triton"]).model
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(trainer, "TRITON_INTERPRET", False)
    with pytest.raises(SetupError, match="backend=triton needs a CUDA GPU"):
        trainer.check_attention_backend(model, cpu)
    trainer.check_attention_backend(model, gpu)
    trainer.check_attention_backend(replace_fields(model, attention="dense"), cpu)  # backend unused
    monkeypatch.setattr(trainer, "TRITON_INTERPRET", True)  # Triton's CPU interpreter (CI)
    trainer.check_attention_backend(model, cpu)
    monkeypatch.setattr(trainer, "TRITON_AVAILABLE", False)
    with pytest.raises(SetupError, match=r"backend=triton needs Triton \(.*\): .*backend=auto"):
        trainer.check_attention_backend(model, gpu)


def test_several_processes_without_parallel_is_one_error_line(tiny_overrides, cli_error,
                                                                monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    line = cli_error(["train", *tiny_overrides])
    assert line == "nsa: error: 2 processes (torchrun) need parallel=ddp or parallel=fsdp"


@pytest.mark.parametrize("flags", [["--resume", "--overwrite"], ["--auto-resume", "--overwrite"],
                                   ["--resume", "--auto-resume"]])
def test_resume_and_overwrite_exclude_each_other(tiny_overrides, cli_error, flags):
    assert "not allowed with argument" in cli_error(["train", *tiny_overrides, *flags])
    config = build_config("tiny", tiny_overrides)
    for resume in (True, "auto"):
        with pytest.raises(SetupError, match="--overwrite starts over"):
            train(config, resume=resume, overwrite=True)


def test_resuming_with_another_model_is_one_error_line(tiny_overrides, cli_error):
    """A checkpoint of another model shape: the setting that differs, not a traceback."""
    train(build_config("tiny", [*tiny_overrides, "max_steps=1", "sample_tokens=0"]))
    line = cli_error(["train", *tiny_overrides, "max_steps=2", "dim=48", "--resume"])
    assert line.startswith("nsa: error: the model config differs") and "dim" in line


def test_a_missing_datasets_package_fails_at_once_naming_the_install(
        tmp_path, tiny_overrides, cli_error, monkeypatch, no_step, sleeps):
    for name in ("datasets", "datasets.distributed"):
        monkeypatch.setitem(sys.modules, name, None)  # import datasets raises
    data = write_jsonl(tmp_path / "docs.jsonl", 30)
    line = cli_error(["train", *tiny_overrides, f"data={data}", "val_docs=5"])
    assert 'needs the datasets package: pip install "nsa[train]"' in line
    assert sleeps == []  # not retried


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.parquet", "empty.txt"])
def test_an_empty_data_file_is_named_before_the_first_step(tmp_path, tiny_overrides, cli_error,
                                                            no_step, sleeps, name):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / name
    if name.endswith(".parquet"):
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    else:
        path.write_text("")
    assert f"{path} holds no document" in cli_error(["train", *tiny_overrides, f"data={path}"])
    assert sleeps == []


def test_too_few_documents_for_val_docs_is_named_before_the_first_step(tmp_path, tiny_overrides,
                                                                       cli_error, no_step):
    data = write_jsonl(tmp_path / "docs.jsonl", 10)
    line = cli_error(["train", *tiny_overrides, f"data={data}"])  # val_docs=1000
    assert "holds 10 documents" in line and "set val_docs=9 or lower" in line


@needs_datasets
def test_a_val_split_too_small_for_eval_steps_is_named_before_the_first_step(
        tmp_path, tiny_overrides, cli_error, no_step):
    data = write_jsonl(tmp_path / "docs.jsonl", 30)
    line = cli_error(["train", *tiny_overrides, f"data={data}", "val_docs=2", "eval_steps=50"])
    assert "val_docs=2 documents" in line and "only 1 batch of 2 x 33 tokens" in line
    assert "set eval_steps=1 or lower" in line


@needs_datasets
def test_local_documents_train_when_they_suffice(tmp_path, tiny_overrides):
    data = write_jsonl(tmp_path / "docs.jsonl", 30)
    result = train(build_config("tiny", [*tiny_overrides, f"data={data}", "val_docs=4",
                                         "max_steps=2"]))
    assert result.steps == 2


def test_synthetic_data_trains_without_the_gpt2_files(tmp_path, tiny_overrides, capsys,
                                                       monkeypatch):
    import tiktoken.load
    import tiktoken.registry

    def offline(url):
        raise ConnectionError(f"cannot reach {url}: no network")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # none loaded in this process
    nsa.cli.main(["train", *tiny_overrides, "data=synthetic", "tokenizer=gpt2",
                  "vocab_size=50304", "max_steps=2"])
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if "sample skipped" in line]
    assert len(skipped) == 1 and "TIKTOKEN_CACHE_DIR" in skipped[0], out
    assert "final val loss" in out
