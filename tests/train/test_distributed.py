"""DDP and FSDP2 under torchrun with 2 CPU processes (gloo) against one process, resume at a
different world size, a start from another run's weights, and a diverging run stopping without
saving."""

import sys
from pathlib import Path

import pytest
import torch

from nsa.train import build_config, train
from nsa.train.checkpoint import latest_checkpoint, read_trainer_state
from nsa.train.trainer import TrainingDiverged
from tests.train.processes import SMALL_RUN, losses, run

RUN = [*SMALL_RUN, "grad_accum=2", "eval_interval=2"]


def run_single(run_dir: Path, *overrides: str) -> dict[int, float]:
    result = run([sys.executable, "-m", "nsa.train", *RUN, f"run_dir={run_dir}", *overrides])
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(run_dir)


def run_two_ranks(run_dir: Path, *overrides: str) -> dict[int, float]:
    """A 2-rank run that ends, as users' runs do, with a sample (prefill + decode steps)."""
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc_per_node", "2", "-m", "nsa.train", *RUN, f"run_dir={run_dir}",
                  "sample_tokens=12", *overrides])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "final val loss" in result.stdout
    return losses(run_dir)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    return run_dir, run_single(run_dir, "max_steps=6")


@pytest.mark.parametrize("parallel", [
    ["parallel=ddp"],
    ["parallel=fsdp"],
    # parameters kept gathered from forward to backward, the next block gathered explicitly
    ["parallel=fsdp", "fsdp_reshard=false", "fsdp_prefetch=1"],
], ids=["ddp", "fsdp", "fsdp-keep-prefetch"])
def test_two_ranks_match_one_process_and_resume_on_one(tmp_path, single_run, parallel):
    single_dir, single = single_run
    two = run_two_ranks(tmp_path, *parallel, "max_steps=4")
    assert sorted(two) == [1, 2, 3, 4]
    for step, loss in two.items():
        assert loss == pytest.approx(single[step], rel=1e-5, abs=1e-6), step
    state = read_trainer_state(latest_checkpoint(tmp_path))
    assert (state["step"], state["world_size"], len(state["data"])) == (4, 2, 2)

    # The 2-rank checkpoint continues in one process, on the same batches.
    resumed = run([sys.executable, "-m", "nsa.train", *RUN, f"run_dir={tmp_path}", "max_steps=6",
                   "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(tmp_path)
    for step in (5, 6):
        assert after[step] == pytest.approx(single[step], rel=1e-4), step


def test_two_ranks_start_from_a_one_process_run_as_one_process_does(tmp_path, single_run):
    """init_from under FSDP2: every rank loads the source's weights before sharding them."""
    source, trained = single_run
    one = run_single(tmp_path / "one", f"init_from={source}", "max_steps=2")
    two = run_two_ranks(tmp_path / "two", "parallel=fsdp", f"init_from={source}", "max_steps=2")
    assert one[1] != trained[1]  # the same first batch, the trained weights
    assert sorted(two) == [1, 2]
    for step, loss in two.items():
        assert loss == pytest.approx(one[step], rel=1e-5, abs=1e-6), step


def test_a_diverging_run_stops_without_saving(tmp_path, monkeypatch, tiny_overrides):
    from nsa.models import LanguageModel

    config = build_config("tiny", [*tiny_overrides, "max_steps=6", "checkpoint_interval=2",
                                   "log_interval=5"])
    forward = LanguageModel.forward
    calls = []

    def nan_from_step_3(self, tokens, targets=None):
        out = forward(self, tokens, targets)
        if self.training and targets is not None:
            calls.append(1)
            if len(calls) >= 3:
                return out * torch.nan
        return out

    monkeypatch.setattr(LanguageModel, "forward", nan_from_step_3)
    with pytest.raises(TrainingDiverged, match="step 4"):
        train(config)
    assert read_trainer_state(latest_checkpoint(Path(config.train.run_dir)))["step"] == 2
