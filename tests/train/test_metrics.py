import sys
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nsa.train.metrics import (
    METRICS,
    TENSORBOARD_DIR,
    WANDB_RUN_ID,
    MetricsLog,
    read_metrics,
)


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_tensorboard_gets_the_numeric_fields(tmp_path):
    with MetricsLog(tmp_path, 0, tensorboard=True) as log:
        for step in (1, 2):
            log.log({"step": step, "loss": 1.0 / step, "tokens_per_s": 100 * step,
                     "note": "text", "flag": True})
        log.log({"step": 2, "val_loss": 0.25})
    assert list((tmp_path / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    assert tensorboard_scalars(tmp_path) == {
        "loss": [(1, 1.0), (2, 0.5)],
        "tokens_per_s": [(1, 100.0), (2, 200.0)],
        "val_loss": [(2, 0.25)],
    }
    assert read_metrics(tmp_path / METRICS)[0]["note"] == "text"  # the JSON lines keep all


def test_tensorboard_hides_what_a_crashed_run_logged_after_its_checkpoint(tmp_path):
    with MetricsLog(tmp_path, 0, tensorboard=True) as log:
        for step in (1, 2, 3):
            log.log({"step": step, "loss": float(step)})
    with MetricsLog(tmp_path, 2, tensorboard=True) as log:  # resumed from step 2
        log.log({"step": 3, "loss": 30.0})
    assert tensorboard_scalars(tmp_path) == {"loss": [(1, 1.0), (2, 2.0), (3, 30.0)]}


def test_sinks_are_off_by_default(tmp_path):
    with MetricsLog(tmp_path, 0) as log:
        log.log({"step": 1, "loss": 1.0})
    assert not (tmp_path / TENSORBOARD_DIR).exists()
    assert not (tmp_path / WANDB_RUN_ID).exists()


def test_wandb_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLog(tmp_path, 0, wandb_project="nsa")


class FakeWandbRun:
    def __init__(self, init_kwargs: dict):
        self.init_kwargs = init_kwargs
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def log(self, data: dict, step: int) -> None:
        self.logged.append((data, step))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch) -> list[FakeWandbRun]:
    """A stand-in ``wandb`` module; returns the runs its ``init`` made."""
    runs: list[FakeWandbRun] = []
    ids = iter(["first-id", "second-id"])
    module = types.ModuleType("wandb")
    module.util = types.SimpleNamespace(generate_id=lambda: next(ids))
    module.init = lambda **kwargs: runs.append(FakeWandbRun(kwargs)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def test_wandb_gets_the_numeric_fields_and_resumes_its_run(tmp_path, fake_wandb):
    with MetricsLog(tmp_path, 0, wandb_project="nsa", wandb_config={"lr": 0.1}) as log:
        log.log({"step": 1, "loss": 2.0, "note": "text"})
    with MetricsLog(tmp_path, 1, wandb_project="nsa") as log:
        log.log({"step": 2, "loss": 1.0})
    first, resumed = fake_wandb
    assert first.init_kwargs == {"project": "nsa", "name": tmp_path.name, "id": "first-id",
                                 "resume": "allow", "dir": str(tmp_path),
                                 "config": {"lr": 0.1}}
    assert resumed.init_kwargs["id"] == "first-id"
    assert (first.logged, resumed.logged) == ([({"loss": 2.0}, 1)], [({"loss": 1.0}, 2)])
    assert first.finished and resumed.finished


def test_a_fresh_run_gets_a_new_wandb_run(tmp_path, fake_wandb):
    MetricsLog(tmp_path, 0, wandb_project="nsa").close()
    MetricsLog(tmp_path, 0, wandb_project="nsa").close()
    assert [run.init_kwargs["id"] for run in fake_wandb] == ["first-id", "second-id"]
    assert (tmp_path / WANDB_RUN_ID).read_text() == "second-id\n"
