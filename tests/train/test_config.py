from dataclasses import fields

import pytest

from nsa.models import MODEL_PRESETS, ModelConfig
from nsa.train import TRAIN_PRESETS, RunConfig, TrainConfig, build_config
from nsa.train.config import parse_value


def test_presets_match_model_presets():
    assert TRAIN_PRESETS.keys() == MODEL_PRESETS.keys()


def test_unprefixed_keys_are_unambiguous():
    model_fields = {f.name for f in fields(ModelConfig)}
    assert not model_fields & {f.name for f in fields(TrainConfig)}


@pytest.mark.parametrize("preset", sorted(TRAIN_PRESETS))
def test_every_preset_builds(preset):
    config = build_config(preset, [])
    assert config.model == MODEL_PRESETS[preset]
    assert 1 <= config.train.seq_len <= config.model.max_seq_len


def test_m7c_trains_8_by_2048_tokens():
    t = build_config("m7c-125m").train
    assert (t.batch_size * t.grad_accum, t.seq_len, t.lr, t.warmup_steps) == (8, 2048, 6e-4, 200)


def test_seq_len_defaults_to_max_seq_len():
    config = RunConfig(ModelConfig(max_seq_len=64), TrainConfig())
    assert config.train.seq_len == 64


def test_overrides_are_parsed_to_field_types():
    config = build_config("tiny", [
        "dim=64", "model.num_layers=1", "train.lr=2e-3", "batch_size=4", "autocast=false",
        "grad_clip=none", "force_branch=win", "rope_base=500", "sample_prompt=JULIET:",
        "num_threads=None", "mlp_hidden=96",
    ])
    assert (config.model.dim, config.model.num_layers, config.model.force_branch) == (64, 1, "win")
    assert config.model.rope_base == 500.0 and isinstance(config.model.rope_base, float)
    assert config.model.mlp_hidden == 96
    t = config.train
    assert (t.lr, t.batch_size, t.autocast, t.grad_clip) == (2e-3, 4, False, None)
    assert (t.sample_prompt, t.num_threads) == ("JULIET:", None)


@pytest.mark.parametrize("text,value", [("true", True), ("1", True), ("Yes", True),
                                        ("off", False), ("0", False), ("False", False)])
def test_bool_spellings(text, value):
    assert parse_value("autocast", text, bool) is value


def test_value_keeps_equals_signs():
    assert build_config("tiny", ["sample_prompt=a=b"]).train.sample_prompt == "a=b"


@pytest.mark.parametrize("override,named", [
    ("nonsense=1", "nonsense"),
    ("model.lr=1e-3", "model.lr"),  # a train field under the model prefix
    ("optim.lr=1e-3", "optim.lr"),
    ("lr=fast", "lr"),
    ("batch_size=2.5", "batch_size"),
    ("autocast=maybe", "autocast"),
    ("dim=none", "dim"),  # not Optional
    ("batch_size=0", "batch_size"),
    ("val_fraction=1.5", "val_fraction"),
    ("min_lr=1", "min_lr"),  # above lr
    ("seq_len=4096", "seq_len"),  # above max_seq_len
    ("device=tpu", "device"),
    ("dim", "dim"),  # no '='
])
def test_bad_override_raises_naming_the_key(override, named):
    with pytest.raises(ValueError, match=named):
        build_config("tiny", [override])


def test_unknown_preset_raises_naming_it():
    with pytest.raises(ValueError, match="huge"):
        build_config("huge", [])


def test_vocab_must_hold_bytes():
    with pytest.raises(ValueError, match="vocab_size"):
        build_config("tiny", ["vocab_size=100"])


def test_dict_round_trip():
    config = build_config("tiny", ["dim=64", "grad_clip=none"])
    assert RunConfig.from_dict(config.to_dict()) == config
