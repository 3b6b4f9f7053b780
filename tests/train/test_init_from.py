"""``init_from``: a run that starts from another run's weights (its run directory, one of its
checkpoints, an exported file or Hugging Face directory) with a fresh optimizer, step counter
and schedule, at another sequence length too; another architecture, tokenizer or an unreadable
source refused naming what differs; a restarted run resuming its own checkpoint."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from nsa.train import build_config, train, trainer
from nsa.train.checkpoint import (
    checkpoint_dirs,
    export_model,
    latest_checkpoint,
    model_from_checkpoint,
    read_trainer_state,
)
from nsa.train.distributed import unwrap
from nsa.train.errors import SetupError
from nsa.train.trainer import learning_rate
from tests.train.processes import losses


@pytest.fixture
def source(tiny_overrides) -> Path:
    """Run A: three steps of the tiny model; -> its run directory."""
    return train(build_config("tiny", [*tiny_overrides, "max_steps=3"])).run_dir


@pytest.fixture
def first_step(monkeypatch) -> dict:
    """What the trainer holds at its next first step (clear the dict to record another): the
    model's weights, the optimizer's state and its learning rate. Recorded where the eager and
    the graphed step (the default on a GPU) both pass: the learning rate is set on the optimizer
    before the step, whose forward and backward see the weights before its update."""
    seen = {}
    real_set_learning_rate, real_forward_backward = (trainer.set_learning_rate,
                                                     trainer.forward_backward)

    def recording_set_learning_rate(optimizer, *args, **kwargs):
        lr = real_set_learning_rate(optimizer, *args, **kwargs)
        if "optimizer" not in seen:
            seen.update(optimizer=optimizer.state_dict(), lr=lr)
        return lr

    def recording_forward_backward(model, *args, **kwargs):
        if "weights" not in seen:
            # On the CPU, where the checkpoints' weights load (the run's may be on a GPU).
            seen["weights"] = {name: value.detach().to("cpu", copy=True)
                               for name, value in unwrap(model).state_dict().items()}
        return real_forward_backward(model, *args, **kwargs)

    monkeypatch.setattr(trainer, "set_learning_rate", recording_set_learning_rate)
    monkeypatch.setattr(trainer, "forward_backward", recording_forward_backward)
    return seen


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return model_from_checkpoint(latest_checkpoint(run_dir))[1].state_dict()


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]):
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


@pytest.mark.parametrize("stage", [[], ["seq_len=64", "max_seq_len=256"]],
                         ids=["same-length", "longer"])
def test_a_run_starts_from_the_source_weights_with_a_fresh_optimizer(
        source, tmp_path, tiny_overrides, first_step, capsys, stage):
    config = build_config("tiny", [*tiny_overrides, *stage, "max_steps=2",
                                   f"init_from={source}", f"run_dir={tmp_path / 'b'}"])
    result = train(config)
    assert_same_weights(first_step["weights"], final_weights(source))
    assert first_step["optimizer"]["state"] == {}  # no moments, no step count
    assert first_step["lr"] == learning_rate(1, config.train)  # the schedule from its start
    assert sorted(losses(result.run_dir)) == [1, 2]
    assert read_trainer_state(latest_checkpoint(result.run_dir))["step"] == 2
    assert f"init from {source} (step 3)\n" in capsys.readouterr().out
    saved = json.loads((result.run_dir / "config.json").read_text())
    assert saved["train"]["init_from"] == str(source)
    assert saved["model"]["max_seq_len"] == config.model.max_seq_len


def export_hf(checkpoint: Path, out: Path) -> Path:
    pytest.importorskip("transformers")
    from nsa.hf.export import export_hf

    return export_hf(checkpoint, out)


@pytest.mark.parametrize("export, step", [
    (lambda checkpoint, tmp_path: checkpoint, "3"),
    (lambda checkpoint, tmp_path: export_model(checkpoint, tmp_path / "a.pt"), "3"),
    (lambda checkpoint, tmp_path: export_hf(checkpoint, tmp_path / "a-hf"), "not recorded"),
], ids=["checkpoint", "exported-file", "hf-directory"])
def test_one_checkpoint_or_an_exported_model_is_a_source(source, tmp_path, tiny_overrides,
                                                         first_step, capsys, export, step):
    path = export(latest_checkpoint(source), tmp_path)
    train(build_config("tiny", [*tiny_overrides, "max_steps=1", f"init_from={path}",
                                f"run_dir={tmp_path / 'b'}"]))
    assert_same_weights(first_step["weights"], final_weights(source))
    assert f"init from {path} (step {step})\n" in capsys.readouterr().out


@pytest.mark.parametrize("change, message", [
    ("num_layers=2", r"num_layers: 1 -> 2\): blocks\.1\.attn_norm\.weight is absent there and "
                     r"\(32,\) here"),
    ("dim=64", r"dim: 32 -> 64\): embed\.weight is \(256, 32\) there and \(256, 64\) here"),
])
def test_another_architecture_is_refused_naming_the_difference(source, tmp_path,
                                                               tiny_overrides, change, message):
    config = build_config("tiny", [*tiny_overrides, change, f"init_from={source}",
                                   f"run_dir={tmp_path / 'b'}"])
    with pytest.raises(ValueError, match=rf"^init_from={re.escape(str(source))}: .*{message}$"):
        train(config)
    assert not checkpoint_dirs(tmp_path / "b")


def test_a_corrupted_checkpoint_is_refused_naming_its_file(source, tmp_path, tiny_overrides):
    checkpoint = Path(shutil.copytree(latest_checkpoint(source), tmp_path / "step_000003"))
    shard = max(checkpoint.glob("*.distcp"), key=lambda file: file.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:100])
    config = build_config("tiny", [*tiny_overrides, f"init_from={checkpoint}",
                                   f"run_dir={tmp_path / 'b'}"])
    with pytest.raises(SetupError, match=rf"^init_from={re.escape(str(checkpoint))}: "
                                         rf"{re.escape(str(shard))}: 100 bytes, expected"):
        train(config)


@pytest.mark.parametrize("overrides, message", [
    (["init_from={tmp}/nowhere"], "init_from={tmp}/nowhere: no such file or directory"),
    (["init_from={tmp}"], "init_from={tmp}: no checkpoint"),
    (["init_from={source}", "num_layers=2"], "init_from={source}: its model differs from this "
                                             "run's (num_layers: 1 -> 2): blocks.1."),
    (["init_from={source}", "tokenizer=gpt2", "vocab_size=50304", "data=synthetic"],
     "init_from={source} was trained with tokenizer=bytes, this run reads tokenizer=gpt2"),
    (["init_from={source}/checkpoints", "run_dir={source}"], "init_from={source}/checkpoints "
                                                             "is inside run_dir={source}"),
    (["init_from="], "init_from must not be empty"),
])
def test_a_source_that_does_not_fit_is_one_error_line(source, tmp_path, tiny_overrides,
                                                      cli_error, overrides, message):
    names = {"tmp": tmp_path, "source": source}
    line = cli_error(["train", *tiny_overrides, f"run_dir={tmp_path / 'b'}",
                      *(item.format(**names) for item in overrides)])
    assert line.startswith(f"nsa: error: {message.format(**names)}")


def test_a_restarted_run_resumes_its_own_checkpoint(source, tmp_path, tiny_overrides,
                                                    first_step, capsys):
    overrides = [*tiny_overrides, f"init_from={source}", f"run_dir={tmp_path / 'b'}"]
    first = train(build_config("tiny", [*overrides, "max_steps=2"]))
    own = final_weights(first.run_dir)
    first_step.clear()
    train(build_config("tiny", [*overrides, "max_steps=4"]), resume="auto")
    assert_same_weights(first_step["weights"], own)
    assert first_step["optimizer"]["state"]  # AdamW's moments, from the run's checkpoint
    out = capsys.readouterr().out
    assert out.count(f"init from {source}") == 1  # the first launch only
    assert f"init_from={source} not applied: resuming the run in {first.run_dir}\n" in out
    assert sorted(losses(first.run_dir)) == [1, 2, 3, 4]
