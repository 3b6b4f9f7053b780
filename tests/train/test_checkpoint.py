from dataclasses import replace

import pytest
import torch

from nsa.models import LanguageModel
from nsa.train import RunConfig, build_config
from nsa.train.checkpoint import CHECKPOINT, RunDirError, load_checkpoint, restore, save_checkpoint
from nsa.train.trainer import build_optimizer


@pytest.fixture
def parts(tiny_overrides):
    config = build_config("tiny", tiny_overrides)
    torch.manual_seed(0)
    model = LanguageModel(config.model)
    return config, model, build_optimizer(model, config.train)


def test_save_and_restore_round_trip(tmp_path, parts):
    config, model, optimizer = parts
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).backward()
    optimizer.step()
    save_checkpoint(tmp_path, 7, model, optimizer, config)
    rng_after_save = torch.get_rng_state()
    torch.rand(3)

    torch.manual_seed(1)
    fresh = LanguageModel(config.model)
    fresh_optimizer = build_optimizer(fresh, config.train)
    assert restore(load_checkpoint(tmp_path), fresh, fresh_optimizer, config) == 7
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    assert fresh.head.weight is fresh.embed.weight  # tied weights stay tied
    assert str(fresh_optimizer.state_dict()) == str(optimizer.state_dict())
    assert torch.equal(torch.get_rng_state(), rng_after_save)


def test_failure_mid_save_keeps_previous_checkpoint(tmp_path, parts, monkeypatch):
    config, model, optimizer = parts
    save_checkpoint(tmp_path, 1, model, optimizer, config)
    good = (tmp_path / CHECKPOINT).read_bytes()

    def torn_save(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, model, optimizer, config)
    assert (tmp_path / CHECKPOINT).read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT]  # no temporary left behind
    assert load_checkpoint(tmp_path)["step"] == 1


def test_restore_rejects_a_different_model(tmp_path, parts):
    config, model, optimizer = parts
    save_checkpoint(tmp_path, 1, model, optimizer, config)
    other = RunConfig(replace(config.model, dim=48), config.train)
    other_model = LanguageModel(other.model)
    with pytest.raises(ValueError, match="dim: 32 -> 48"):
        restore(load_checkpoint(tmp_path), other_model, build_optimizer(other_model, other.train),
                other)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(RunDirError, match="no checkpoint"):
        load_checkpoint(tmp_path)
