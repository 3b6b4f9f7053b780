import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nsa.cli
from nsa.models import LanguageModel
from nsa.train import build_config, sample_checkpoint, train
from nsa.train.checkpoint import (
    RunDirError,
    latest_checkpoint,
    load_model_weights,
    read_trainer_state,
)
from nsa.train.data import BatchSampler, read_corpus
from nsa.train.metrics import METRICS, MetricsLog, Progress, read_metrics
from nsa.train.trainer import build_optimizer, learning_rate, train_step
from tests.optional import needs_datasets


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / METRICS) if "loss" in r}


def saved_step(run_dir):
    return read_trainer_state(latest_checkpoint(run_dir))["step"]


def saved_weights(run_dir, config):
    model = LanguageModel(config.model)
    load_model_weights(latest_checkpoint(run_dir), model)
    return model.state_dict()


def val_losses(run_dir):
    return [(r["step"], r["val_loss"]) for r in read_metrics(run_dir / METRICS) if "val_loss" in r]


def test_training_writes_checkpoint_metrics_and_sample(tiny_overrides, capsys):
    result = train(build_config("tiny", [*tiny_overrides, "max_steps=3", "eval_interval=2"]))
    assert result.steps == 3 and result.sample.startswith("ROMEO:")
    assert math.isfinite(result.train_loss) and math.isfinite(result.val_loss)
    assert saved_step(result.run_dir) == 3
    assert sorted(losses(result.run_dir)) == [1, 2, 3]
    (step_a, _), (step_b, final) = val_losses(result.run_dir)  # one mid-run, one at the end
    assert (step_a, step_b, final) == (2, 3, result.val_loss)
    assert (result.run_dir / "config.json").is_file()
    assert "final val loss" in capsys.readouterr().out


def test_loss_goes_down(tiny_overrides):
    result = train(build_config("tiny", [*tiny_overrides, "max_steps=30", "lr=1e-2",
                                         "warmup_steps=5", "eval_interval=100"]))
    history = losses(result.run_dir)
    assert history[30] < history[1] - 1.0


def test_resume_after_crash_matches_unbroken_run(tmp_path, tiny_overrides, monkeypatch):
    common = [*tiny_overrides, "max_steps=6", "checkpoint_interval=3", "eval_interval=2",
              "grad_accum=2"]
    straight = train(build_config("tiny", [*common, f"run_dir={tmp_path / 'straight'}"]))

    crashed = build_config("tiny", [*common, f"run_dir={tmp_path / 'crashed'}"])
    real_batch = BatchSampler.batch

    def crash_in_step_5(self, index):
        if index == 8:  # step 5, first micro-batch: step 4 is logged but not checkpointed
            raise KeyboardInterrupt
        return real_batch(self, index)

    monkeypatch.setattr(BatchSampler, "batch", crash_in_step_5)
    with pytest.raises(KeyboardInterrupt):
        train(crashed)
    assert saved_step(tmp_path / "crashed") == 3
    assert sorted(losses(tmp_path / "crashed")) == [1, 2, 3, 4]
    monkeypatch.undo()

    resumed = train(crashed, resume=True)
    assert losses(resumed.run_dir) == losses(straight.run_dir)  # exactly, steps 1..6 once each
    assert val_losses(resumed.run_dir) == val_losses(straight.run_dir)
    assert resumed.sample == straight.sample
    a, b = saved_weights(straight.run_dir, crashed), saved_weights(resumed.run_dir, crashed)
    for name, value in a.items():
        assert torch.equal(b[name], value), name


def test_resume_extends_a_finished_run(tiny_overrides):
    first = train(build_config("tiny", [*tiny_overrides, "max_steps=2"]))
    more = train(build_config("tiny", [*tiny_overrides, "max_steps=4"]), resume=True)
    assert more.steps == 4 and sorted(losses(more.run_dir)) == [1, 2, 3, 4]
    assert losses(more.run_dir)[2] == first.train_loss
    again = train(build_config("tiny", [*tiny_overrides, "max_steps=4"]), resume=True)
    assert again.train_loss is None and again.val_loss == more.val_loss  # nothing left to do


def test_resume_needs_a_checkpoint_before_max_steps(tiny_overrides):
    config = build_config("tiny", [*tiny_overrides, "max_steps=2"])
    with pytest.raises(RunDirError, match="no checkpoint"):
        train(config, resume=True)
    train(config)
    with pytest.raises(ValueError, match="past max_steps=1"):
        train(build_config("tiny", [*tiny_overrides, "max_steps=1"]), resume=True)


def test_fresh_run_refuses_to_replace_an_earlier_one_unless_asked(tiny_overrides, capsys):
    first = train(build_config("tiny", [*tiny_overrides, "max_steps=3"]))
    kept = saved_step(first.run_dir)
    with pytest.raises(RunDirError, match="--overwrite"):
        train(build_config("tiny", [*tiny_overrides, "max_steps=2"]))
    assert saved_step(first.run_dir) == kept
    again = train(build_config("tiny", [*tiny_overrides, "max_steps=2", "lr=1e-2"]),
                  overwrite=True)
    assert "starting over" in capsys.readouterr().out
    assert sorted(losses(again.run_dir)) == [1, 2]
    assert [step for step, _ in val_losses(again.run_dir)] == [2]
    config = read_trainer_state(latest_checkpoint(first.run_dir))["config"]
    assert config["train"]["lr"] == 1e-2


def test_learning_rate_schedule():
    t = build_config("tiny", ["max_steps=100", "warmup_steps=10", "lr=1e-3", "min_lr=1e-4"]).train
    rates = [learning_rate(step, t) for step in range(1, 101)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)  # linear warmup
    assert all(a >= b for a, b in zip(rates[9:-1], rates[10:], strict=True))  # then decays
    assert rates[-1] == pytest.approx(1e-4)
    no_warmup = build_config("tiny", ["max_steps=100", "warmup_steps=0", "lr=1e-3"]).train
    assert learning_rate(1, no_warmup) == pytest.approx(1e-3, rel=1e-3)


def test_weight_decay_only_on_matrices(tiny_overrides):
    config = build_config("tiny", tiny_overrides)
    model = LanguageModel(config.model)
    decay, no_decay = build_optimizer(model, config.train).param_groups
    assert decay["weight_decay"] == config.train.weight_decay and no_decay["weight_decay"] == 0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize("grad_clip", ["none", "0.5"])
def test_gradient_accumulation_matches_one_big_batch(tiny_overrides, grad_clip):
    x = torch.randint(0, 256, (4, 32))
    y = torch.randint(0, 256, (4, 32))
    results = []
    for accum, batches in ((1, [(x, y)]), (2, [(x[:2], y[:2]), (x[2:], y[2:])])):
        config = build_config("tiny", [*tiny_overrides, f"grad_accum={accum}",
                                       f"grad_clip={grad_clip}"])
        torch.manual_seed(0)
        model = LanguageModel(config.model)
        optimizer = build_optimizer(model, config.train)
        loss, norm = train_step(model, optimizer, batches, torch.device("cpu"), config.train)
        results.append((loss, norm, torch.nn.utils.parameters_to_vector(model.parameters())))
    (loss1, norm1, params1), (loss2, norm2, params2) = results
    torch.testing.assert_close(loss2, loss1)
    torch.testing.assert_close(norm2, norm1)
    # AdamW's first update is lr · g / (|g| + eps): where a gradient is near eps, summing it
    # in two halves moves the update by a few percent of lr (1.4e-5 once, on a GPU machine's
    # CPU); a wrong accumulation shows in the loss and the norm above.
    torch.testing.assert_close(params2, params1, rtol=1.3e-6, atol=5e-5)


def test_doc_masking_without_eot_in_the_rows_is_the_unmasked_step(tiny_overrides):
    """Rows holding no eot are one document each: the packed step (rows flattened into one row
    with their boundaries) computes the loss, gradients and update of the batched one."""
    x = torch.randint(1, 256, (2, 32))
    y = torch.randint(0, 256, (2, 32))
    config = build_config("tiny", tiny_overrides)
    results = []
    for eot in (None, 0):
        torch.manual_seed(0)
        model = LanguageModel(config.model)
        optimizer = build_optimizer(model, config.train)
        loss, norm = train_step(model, optimizer, [(x, y)], torch.device("cpu"), config.train,
                                eot)
        results.append((loss, norm, torch.nn.utils.parameters_to_vector(model.parameters())))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b)


@needs_datasets
def test_doc_masking_passes_the_documents_of_each_packed_batch(tmp_path, tiny_overrides,
                                                               monkeypatch):
    """Documents (lines of the bundled corpus) joined by the eot id: the model gets each batch's
    rows as one packed row, with a boundary at each row start and after each eot."""
    lines = [line for line in read_corpus().splitlines()[:300] if line]
    data = tmp_path / "lines.jsonl"
    data.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    calls = []
    forward = LanguageModel.forward

    def recording_forward(self, tokens, targets=None, cu_seqlens=None):
        calls.append((tokens.clone(), cu_seqlens))
        return forward(self, tokens, targets, cu_seqlens)

    monkeypatch.setattr(LanguageModel, "forward", recording_forward)
    result = train(build_config("tiny", [*tiny_overrides, f"data={data}", "val_docs=20",
                                         "doc_masking=true", "max_steps=3", "eval_interval=2",
                                         "sample_tokens=0"]))
    assert math.isfinite(result.train_loss) and math.isfinite(result.val_loss)
    assert len(calls) == 3 + 2 * 2  # 3 steps, 2 evaluations of eval_steps=2
    inside = 0
    for tokens, cu in calls:
        assert tokens.shape == (1, 2 * 32) and cu.dtype == torch.int32
        after_eot = [i + 1 for i, token in enumerate(tokens[0].tolist()) if token == 0]
        expected = sorted({0, 32, *after_eot} - {64}) + [64]
        assert cu.tolist() == expected
        inside += len(expected) - 3
    assert inside > 0  # documents ended inside rows


def test_metrics_log_drops_records_after_the_resume_step(tmp_path):
    log = MetricsLog(tmp_path, start_step=0)
    for step in (1, 2, 3):
        log.log({"step": step, "loss": float(step)})
    with (tmp_path / METRICS).open("a") as f:
        f.write('{"step": 4, "lo')  # torn by a crash
    MetricsLog(tmp_path, start_step=2)
    assert read_metrics(tmp_path / METRICS) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]


def test_progress_prints_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails
    progress = Progress(0, 10)
    progress.update(5, "loss 1.0")
    progress.write("val loss 2.0")
    progress.close()
    assert capsys.readouterr().out == "step 5/10 | loss 1.0\nval loss 2.0\n"


def test_progress_uses_tqdm_when_installed(capsys):
    pytest.importorskip("tqdm")
    progress = Progress(2, 10)
    progress.update(5, "loss 1.0")
    assert progress.bar.n == 5
    progress.write("val loss 2.0")
    progress.close()
    assert "val loss 2.0" in capsys.readouterr().out


def test_cli_train_resume_and_sample(tiny_overrides, capsys):
    nsa.cli.main(["train", "--preset", "tiny", *tiny_overrides, "max_steps=2", "grad_clip=none"])
    assert "final val loss" in capsys.readouterr().out
    nsa.cli.main(["train", *tiny_overrides, "--resume", "max_steps=3", "grad_clip=none"])
    assert "steps 2 -> 3" in capsys.readouterr().out
    run_dir = tiny_overrides[-1].split("=", 1)[1]
    nsa.cli.main(["sample", "--run-dir", run_dir, "--prompt", "JULIET:", "--tokens", "5"])
    assert capsys.readouterr().out.startswith("JULIET:")
    with pytest.raises(ValueError, match="sample_tokens must be an integer >= 1, got 0"):
        sample_checkpoint(Path(run_dir), num_tokens=0)
    model_file = Path(run_dir) / "model.pt"
    nsa.cli.main(["export", "--run-dir", run_dir, "--out", str(model_file)])
    assert "wrote" in capsys.readouterr().out
    assert sample_checkpoint(model_file, num_tokens=4) == sample_checkpoint(Path(run_dir),
                                                                            num_tokens=4)
    nsa.cli.main(["generate", "--model", str(model_file), "--prompt", "JULIET:",
                  "--max-tokens", "5", "--top-k", "10", "--top-p", "0.9"])
    out, err = capsys.readouterr()
    assert out.startswith("JULIET:") and "tokens/s" in err
    nsa.cli.main(["generate", "--model", run_dir, "--max-tokens", "300"])  # max_seq_len 128
    assert "[300 tokens in" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["train", "bogus=1"], "unknown config key 'bogus'"),
    (["train", "lr=fast"], "lr: cannot parse 'fast'"),
    (["train", "--preset", "huge"], "invalid choice: 'huge'"),
    (["train", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["sample", "--run-dir", "nowhere", "x=1"], "unrecognized arguments: x=1"),
    (["sample", "--run-dir", "nowhere"], "no checkpoint"),
])
def test_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        nsa.cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_python_m_nsa_train_runs_the_train_command():
    repo = Path(nsa.cli.__file__).parents[1]
    out = subprocess.run([sys.executable, "-m", "nsa.train", "--help"], capture_output=True,
                         text=True, check=True, cwd=repo).stdout
    assert out.startswith("usage: nsa train")
