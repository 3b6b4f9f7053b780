import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nsa.config_tree import replace_fields
from nsa.models import LanguageModel
from nsa.train import RunConfig, build_config
from nsa.train.checkpoint import (
    CHECKPOINTS,
    RunDirError,
    checkpoint_dirs,
    export_model,
    latest_checkpoint,
    load_checkpoint,
    load_exported,
    load_model_weights,
    save_checkpoint,
)
from nsa.train.distributed import DistContext
from nsa.train.trainer import build_optimizer

SINGLE = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture
def parts(tiny_overrides):
    config = build_config("tiny", tiny_overrides)
    torch.manual_seed(0)
    model = LanguageModel(config.model)
    return config, model, build_optimizer(model, config.train)


def take_a_step(model, optimizer):
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).backward()
    optimizer.step()


def test_save_and_load_round_trip(tmp_path, parts):
    config, model, optimizer = parts
    take_a_step(model, optimizer)
    save_checkpoint(tmp_path, 7, model, optimizer, config, {"batch_index": 7}, SINGLE, keep=2)
    rng_after_save = torch.get_rng_state()
    torch.rand(3)

    torch.manual_seed(1)
    fresh = LanguageModel(config.model)
    fresh_optimizer = build_optimizer(fresh, config.train)
    step, data_state = load_checkpoint(latest_checkpoint(tmp_path), fresh, fresh_optimizer,
                                       config, SINGLE)
    assert (step, data_state) == (7, {"batch_index": 7})
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    assert fresh.head.weight is fresh.embed.weight  # tied weights stay tied
    assert str(fresh_optimizer.state_dict()) == str(optimizer.state_dict())
    assert torch.equal(torch.get_rng_state(), rng_after_save)


def test_keeps_the_newest_checkpoints(tmp_path, parts):
    config, model, optimizer = parts
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, optimizer, config, {}, SINGLE, keep=2)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_000003", "step_000004"]


def test_failure_mid_save_keeps_previous_checkpoint(tmp_path, parts, monkeypatch):
    config, model, optimizer = parts
    save_checkpoint(tmp_path, 1, model, optimizer, config, {}, SINGLE, keep=3)

    def failing_save(state_dict, checkpoint_id):
        (checkpoint_id / "__0_0.distcp").parent.mkdir(parents=True, exist_ok=True)
        (checkpoint_id / "__0_0.distcp").write_bytes(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, model, optimizer, config, {}, SINGLE, keep=3)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_000001"]
    monkeypatch.undo()
    # The next save clears the torn directory and succeeds.
    save_checkpoint(tmp_path, 2, model, optimizer, config, {}, SINGLE, keep=3)
    assert sorted(p.name for p in (tmp_path / CHECKPOINTS).iterdir()) == [
        "step_000001", "step_000002"]


def test_load_rejects_a_different_model(tmp_path, parts):
    config, model, optimizer = parts
    save_checkpoint(tmp_path, 1, model, optimizer, config, {}, SINGLE, keep=1)
    other = RunConfig(replace_fields(config.model, dim=48), config.train)
    other_model = LanguageModel(other.model)
    with pytest.raises(ValueError, match="attention.dim: 32 -> 48"):
        load_checkpoint(latest_checkpoint(tmp_path), other_model,
                        build_optimizer(other_model, other.train), other, SINGLE)


def test_document_stream_state_needs_the_same_world_size(tmp_path, parts):
    config, model, optimizer = parts
    save_checkpoint(tmp_path, 1, model, optimizer, config, {"rank": 0, "world_size": 1,
                                                           "epoch": 0, "doc": 3, "offset": 0},
                    SINGLE, keep=1)
    two = DistContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="cannot be split over 2 ranks"):
        load_checkpoint(latest_checkpoint(tmp_path), model, optimizer, config, two)


def test_export_holds_the_model_only(tmp_path, parts):
    config, model, optimizer = parts
    take_a_step(model, optimizer)
    save_checkpoint(tmp_path, 5, model, optimizer, config, {}, SINGLE, keep=1)
    out = export_model(latest_checkpoint(tmp_path), tmp_path / "model.pt")
    exported_config, weights, step = load_exported(out)
    assert exported_config == config and step == 5
    fresh = LanguageModel(exported_config.model)
    fresh.load_state_dict(weights)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_a_single_process_saves_and_loads_without_dcp_warnings(tmp_path, parts):
    """No 'assuming the intent is to save/load in a single process' from DCP in a run without
    a process group, and DCP's own behaviour elsewhere is left alone."""
    config, model, optimizer = parts
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_checkpoint(tmp_path, 1, model, optimizer, config, {}, SINGLE, keep=1)
        load_checkpoint(latest_checkpoint(tmp_path), model, optimizer, config, SINGLE)
        load_model_weights(latest_checkpoint(tmp_path), model)
    assert [str(w.message) for w in caught if "single process" in str(w.message)] == []
    with pytest.warns(UserWarning, match="single process"):  # the filter does not leak
        dcp.save({"x": torch.zeros(2)}, checkpoint_id=tmp_path / "plain")


def test_missing_checkpoint(tmp_path):
    with pytest.raises(RunDirError, match="no checkpoint"):
        latest_checkpoint(tmp_path)
