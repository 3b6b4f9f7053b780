"""cuda_graph: the training step replayed from one CUDA graph (nsa/train/graphs.py) trains
exactly as the eager step does. On the CPU: what the default ("auto") resolves to, and the
settings an explicit cuda_graph=true refuses; on a GPU: graphed against eager steps on real
text, step by step, and through the trainer, whose default graphs the step."""

import math
import sys
from importlib import resources

import pytest
import torch

from nsa.models import LanguageModel
from nsa.train import TRAIN_PRESETS, build_config, train, trainer
from nsa.train.config import parse_value
from nsa.train.data import BatchSampler
from nsa.train.errors import SetupError
from nsa.train.graphs import DDP_WARMUP_STEPS, WARMUP_STEPS, CUDAGraphStep
from nsa.train.trainer import (
    build_optimizer,
    forward_backward,
    graphed_step,
    model_inputs,
    train_step,
)

from .processes import SMALL_RUN, run
from .test_trainer import losses

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.mark.parametrize("override", ["parallel=fsdp", "doc_masking=true"])
def test_cuda_graph_refuses_what_changes_between_steps(override):
    with pytest.raises(ValueError, match="cuda_graph=true replays one fixed step"):
        build_config("tiny", ["cuda_graph=true", override, "data=shakespeare"])


def test_cuda_graph_takes_ddp():
    assert build_config("tiny", ["cuda_graph=true", "parallel=ddp"]).train.cuda_graph


def test_cuda_graph_needs_a_cuda_device(tiny_overrides):
    with pytest.raises(SetupError, match="cuda_graph=true needs a CUDA device, got cpu"):
        train(build_config("tiny", [*tiny_overrides, "cuda_graph=true", "device=cpu"]))
    with pytest.raises(SetupError, match="cuda_graph=true needs a CUDA device, got cpu"):
        graphed_step(build_config("tiny", ["cuda_graph=true"]).train, torch.device("cpu"))


@pytest.mark.parametrize("text,value", [("auto", None), ("AUTO", None), ("none", None),
                                        ("true", True), ("false", False), ("on", True)])
def test_cuda_graph_parses_auto_as_none(text, value):
    assert build_config("tiny", [f"cuda_graph={text}"]).train.cuda_graph is value
    assert parse_value("cuda_graph", text, bool | None) is value


def test_cuda_graph_defaults_to_auto_in_every_preset():
    """No preset pins the step: each leaves it to the device and the parallelism."""
    assert all(build_config(name).train.cuda_graph is None for name in TRAIN_PRESETS)


# The resolver is a function of the config and the device alone: a CUDA device without a GPU.
@pytest.mark.parametrize("overrides,device,graphed", [
    ([], "cpu", False),
    ([], "cuda", True),
    (["parallel=ddp"], "cuda", True),
    (["parallel=fsdp"], "cuda", False),
    (["doc_masking=true"], "cuda", False),
    (["parallel=ddp", "doc_masking=true"], "cuda", False),
    (["parallel=fsdp"], "cpu", False),
    (["cuda_graph=auto", "parallel=ddp"], "cpu", False),
    (["cuda_graph=false"], "cuda", False),
    (["cuda_graph=false", "parallel=ddp"], "cuda", False),
    (["cuda_graph=false"], "cpu", False),
    (["cuda_graph=true"], "cuda", True),
    (["cuda_graph=true", "parallel=ddp"], "cuda", True),
])
def test_graphed_step_resolves_auto_where_a_graph_applies(overrides, device, graphed):
    t = build_config("tiny", overrides).train
    assert graphed_step(t, torch.device(device)) is graphed


def test_the_default_trains_eagerly_on_the_cpu(tiny_overrides, monkeypatch, capsys):
    """Auto on the CPU: no CUDAGraphStep is built (it would need a GPU) and the start-up line
    says what auto chose."""
    def no_graph(*args, **kwargs):
        raise AssertionError("a CUDAGraphStep was built on the CPU")

    monkeypatch.setattr(trainer, "CUDAGraphStep", no_graph)
    result = train(build_config("tiny", [*tiny_overrides, "device=cpu", "max_steps=2"]))
    assert result.steps == 2 and math.isfinite(result.train_loss)
    assert "; CUDA graph off (auto); " in capsys.readouterr().out
    train(build_config("tiny", [*tiny_overrides, "device=cpu", "max_steps=3",
                                "cuda_graph=false"]), resume=True)
    out = capsys.readouterr().out
    assert "; CUDA graph off; " in out and "(auto)" not in out


def test_graph_step_needs_a_warm_up_step():
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        CUDAGraphStep(lambda inputs: (), torch.optim.SGD([torch.zeros(1)], lr=1.0), warmup=0)


def text_batches(steps: int, accum: int, batch: int, seq: int) -> list:
    """Byte windows of the bundled corpus, a different stretch for every micro-batch."""
    text = resources.files("nsa.data").joinpath("tiny_shakespeare.txt").read_bytes()
    tokens = torch.tensor(list(text[: 200_000]), dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, tokens.numel() - seq - 1, (steps, accum, batch), generator=g)
    return [[(torch.stack([tokens[s:s + seq] for s in micro]),
              torch.stack([tokens[s + 1:s + seq + 1] for s in micro])) for micro in step]
            for step in starts]


def run_steps(kind: str, graphed: bool, batches: list, overrides=(), device="cuda"):
    """(loss per step, final parameters) of the tiny model trained on ``batches``."""
    seq = batches[0][0][0].shape[1]
    config = build_config("tiny", [f"attention={kind}", "lr=1e-2", "warmup_steps=0",
                                   f"grad_accum={len(batches[0])}", f"seq_len={seq}",
                                   *overrides])
    device = torch.device(device)
    torch.manual_seed(0)
    model = LanguageModel(config.model).to(device)
    model.checkpoint_blocks = config.train.activation_checkpointing
    if config.train.compile:
        for block in model.blocks:
            block.compile()
    optimizer = build_optimizer(model, config.train)
    t = config.train
    step = CUDAGraphStep(lambda inputs: forward_backward(model, inputs, device, t, graphed=True),
                         optimizer)
    step_losses = []
    for micro in batches:
        if graphed:
            loss, _ = step([model_inputs(x, y, device) for x, y in micro])
        else:
            loss, _ = train_step(model, optimizer, micro, device, t)
        step_losses.append(loss.item())
    assert step.captured == graphed and step.calls == (len(batches) if graphed else 0)
    return step_losses, torch.nn.utils.parameters_to_vector(model.parameters()).detach()


@needs_cuda
@pytest.mark.parametrize("kind,accum,overrides", [
    ("nsa", 1, ()), ("dense", 1, ()), ("nsa", 2, ()),
    ("nsa", 1, ("activation_checkpointing=true",)), ("nsa", 1, ("compile=true",)),
    ("nsa", 1, ("force_branch=win",)),
], ids=["nsa", "dense", "nsa-accum2", "nsa-checkpointing", "nsa-compile", "nsa-window-only"])
def test_graphed_steps_train_as_the_eager_steps(kind, accum, overrides):
    steps = WARMUP_STEPS + 5  # eager warm-up, the capture (replayed at once), four replays
    batches = text_batches(steps, accum, batch=2, seq=96)
    eager_losses, eager_params = run_steps(kind, False, batches, overrides)
    graph_losses, graph_params = run_steps(kind, True, batches, overrides)
    # The replays must read each step's new batch: training on a stale one (the first batch
    # again and again) moves the losses by far more than the tolerance.
    stale_losses, _ = run_steps(kind, False, batches[:WARMUP_STEPS + 1] * 2, overrides)
    assert max(abs(a - b) for a, b in zip(stale_losses[WARMUP_STEPS + 1:],
                                          eager_losses[WARMUP_STEPS + 1:])) > 0.05
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses),
                               rtol=0, atol=5e-3)
    torch.testing.assert_close(graph_params, eager_params, rtol=0, atol=5e-3)


@needs_cuda
def test_graph_step_refuses_new_shapes():
    batches = text_batches(WARMUP_STEPS + 2, 1, batch=2, seq=64)
    config = build_config("tiny", ["seq_len=64"])
    device = torch.device("cuda")
    model = LanguageModel(config.model).to(device)
    optimizer = build_optimizer(model, config.train)
    step = CUDAGraphStep(lambda inputs: forward_backward(model, inputs, device, config.train,
                                                         graphed=True), optimizer)
    for micro in batches:
        step([model_inputs(x, y, device) for x, y in micro])
    x, y = batches[0][0]
    with pytest.raises(ValueError, match="same input shapes at every step"):
        step([model_inputs(x[:, :32], y[:, :32], device)])


@needs_cuda
def test_trainer_with_cuda_graph_matches_the_eager_trainer(tmp_path, tiny_overrides):
    overrides = [*tiny_overrides, "device=cuda", "max_steps=8", "lr=1e-2", "warmup_steps=2",
                 "eval_interval=4", "checkpoint_interval=4"]
    eager = train(build_config("tiny", [*overrides, f"run_dir={tmp_path / 'eager'}",
                                        "cuda_graph=false"]))
    graphed = train(build_config("tiny", [*overrides, f"run_dir={tmp_path / 'graph'}",
                                          "cuda_graph=true"]))
    history, graph_history = losses(eager.run_dir), losses(graphed.run_dir)
    assert sorted(graph_history) == list(range(1, 9))
    for step in history:
        assert math.isclose(graph_history[step], history[step], abs_tol=5e-3), step
    assert math.isclose(graphed.val_loss, eager.val_loss, abs_tol=5e-3)
    assert graphed.sample.startswith("ROMEO:")


@needs_cuda
def test_the_default_graphs_the_step_on_a_gpu(tiny_overrides, monkeypatch, capsys):
    """Auto on one GPU: the trainer builds a CUDAGraphStep, captures it after the warm-up steps
    and replays every later step, and its start-up line says so."""
    steps = []

    class RecordedStep(CUDAGraphStep):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            steps.append(self)

    monkeypatch.setattr(trainer, "CUDAGraphStep", RecordedStep)
    result = train(build_config("tiny", [*tiny_overrides, "device=cuda", "max_steps=5"]))
    assert result.steps == 5 and math.isfinite(result.train_loss)
    assert "; CUDA graph on (auto); " in capsys.readouterr().out
    (step,) = steps
    assert step.captured and step.calls == 5 and step.warmup == WARMUP_STEPS


@needs_cuda
def test_graphed_run_resumed_after_a_crash_matches_the_unbroken_run(tmp_path, tiny_overrides,
                                                                   monkeypatch):
    """A resumed run warms up eagerly again and captures a new graph: its steps must be those
    the unbroken run took."""
    common = [*tiny_overrides, "device=cuda", "cuda_graph=true", "max_steps=8", "lr=1e-2",
              "warmup_steps=2", "checkpoint_interval=4", "eval_interval=100"]
    straight = train(build_config("tiny", [*common, f"run_dir={tmp_path / 'straight'}"]))
    crashed = build_config("tiny", [*common, f"run_dir={tmp_path / 'crashed'}"])
    real_batch = BatchSampler.batch

    def crash_in_step_6(self, index):
        if index == 5:  # step 6: steps 5 and 6 are lost, step 4 is checkpointed
            raise KeyboardInterrupt
        return real_batch(self, index)

    monkeypatch.setattr(BatchSampler, "batch", crash_in_step_6)
    with pytest.raises(KeyboardInterrupt):
        train(crashed)
    monkeypatch.undo()
    resumed = train(crashed, resume=True)
    history, resumed_history = losses(straight.run_dir), losses(resumed.run_dir)
    assert sorted(resumed_history) == list(range(1, 9))
    for step in history:
        assert math.isclose(resumed_history[step], history[step], abs_tol=5e-3), step


@needs_two_gpus
def test_graphed_ddp_run_trains_as_the_eager_ddp_run(tmp_path):
    """Two ranks under torchrun (NCCL): the steps replayed from a graph that holds DDP's
    all-reduces give the eager DDP run's losses, after DDP_WARMUP_STEPS eager steps."""
    steps = DDP_WARMUP_STEPS + 3  # eager warm-up, the capture (replayed at once), two replays

    def two_ranks(name, *overrides):
        run_dir = tmp_path / name
        result = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc_per_node", "2", "-m", "nsa.train", *SMALL_RUN, "device=cuda",
                      "parallel=ddp", f"max_steps={steps}", "lr=1e-2", "warmup_steps=2",
                      "eval_interval=100", f"checkpoint_interval={steps}", f"run_dir={run_dir}",
                      *overrides])
        assert result.returncode == 0, result.stderr[-3000:]
        return losses(run_dir)

    eager, graphed = two_ranks("eager", "cuda_graph=false"), two_ranks("graph", "cuda_graph=true")
    assert sorted(graphed) == list(range(1, steps + 1))
    for step in eager:
        assert math.isclose(graphed[step], eager[step], abs_tol=5e-3), step
