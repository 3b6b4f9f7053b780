import dataclasses
import json

import pytest

from nsa.config_tree import field_paths, is_section, replace_fields
from nsa.layers import AttentionConfig
from nsa.models import MODEL_PRESETS, ModelConfig
from nsa.ops import NSAParams
from nsa.train import TRAIN_PRESETS, RunConfig, TrainConfig, build_config
from nsa.train.checkpoint import config_diff
from nsa.train.config import parse_value


def test_presets_match_model_presets():
    assert TRAIN_PRESETS.keys() == MODEL_PRESETS.keys()


def test_unprefixed_keys_are_unambiguous():
    names = [path[-1] for path, hint in field_paths(RunConfig).items() if not is_section(hint)]
    assert len(names) == len(set(names))


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
    a = config.model.attention
    assert (config.model.dim, config.model.num_layers, a.force_branch) == (64, 1, "win")
    assert a.rope_base == 500.0 and isinstance(a.rope_base, float)
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
    ("train.window=8", "train.window"),
    ("nsa.attention.window=8", "nsa.attention.window"),  # sections out of order
    ("model=dense", "model"),  # a section without a kind
    ("attention.=3", "attention."),
    ("optim.lr=1e-3", "optim.lr"),
    ("lr=fast", "lr"),
    ("batch_size=2.5", "batch_size"),
    ("autocast=maybe", "autocast"),
    ("autocast=auto", "autocast"),  # "auto" is None, only for an Optional bool (cuda_graph)
    ("num_threads=auto", "num_threads"),
    ("dim=none", "dim"),  # not Optional
    ("batch_size=0", "batch_size"),
    ("val_fraction=1.5", "val_fraction"),
    ("min_lr=1", "min_lr"),  # above lr
    ("seq_len=4096", "seq_len"),  # above max_seq_len
    ("device=tpu", "device"),
    ("fsdp_prefetch=-1", "fsdp_prefetch"),
    ("fsdp_reshard=false", "fsdp_reshard"),  # parallel=none: FSDP2 options refused
    ("fsdp_prefetch=1", "fsdp_prefetch"),
    ("dim", "dim"),  # no '='
])
def test_bad_override_raises_naming_the_key(override, named):
    with pytest.raises(ValueError, match=named):
        build_config("tiny", [override])


def test_fsdp_options_go_with_fsdp():
    train = build_config("tiny", ["parallel=fsdp", "fsdp_reshard=false", "fsdp_prefetch=2"]).train
    assert (train.fsdp_reshard, train.fsdp_prefetch) == (False, 2)
    with pytest.raises(ValueError, match="need parallel=fsdp, got parallel=ddp"):
        build_config("tiny", ["parallel=ddp", "fsdp_prefetch=1"])


def test_doc_masking_needs_documents():
    assert build_config("tiny", ["doc_masking=true"]).train.doc_masking
    with pytest.raises(ValueError, match="doc_masking=true needs data made of documents"):
        build_config("tiny", ["doc_masking=true", "data=synthetic"])


def test_unknown_preset_raises_naming_it():
    with pytest.raises(ValueError, match="huge"):
        build_config("huge", [])


def test_vocab_must_hold_bytes():
    with pytest.raises(ValueError, match="vocab_size"):
        build_config("tiny", ["vocab_size=100"])


def test_dict_round_trip():
    config = build_config("tiny", ["dim=64", "grad_clip=none"])
    assert RunConfig.from_dict(config.to_dict()) == config


def test_the_config_is_one_tree_with_no_field_copied():
    """model -> attention -> nsa (the op's NSAParams); every field name appears once."""
    config = build_config("tiny").model
    assert isinstance(config.attention, AttentionConfig)
    assert isinstance(config.attention.nsa, NSAParams)
    own = {f.name for f in dataclasses.fields(ModelConfig)}
    attention = {f.name for f in dataclasses.fields(AttentionConfig)}
    params = {f.name for f in dataclasses.fields(NSAParams)}
    assert not own & attention and not attention & params and not own & params
    assert config.dim is config.attention.dim


@pytest.mark.parametrize("key", ["window", "attention.window", "nsa.window", "model.window",
                                 "attention.nsa.window", "model.attention.nsa.window"])
def test_a_field_is_named_by_its_path_or_any_unique_part_of_it(key):
    config = build_config("tiny", [f"{key}=24"])
    assert config.model.attention.nsa.window == 24
    assert config.model == replace_fields(MODEL_PRESETS["tiny"], window=24)


def test_a_section_given_a_plain_value_sets_its_kind():
    for override in ("attention=dense", "kind=dense", "attention.kind=dense"):
        assert build_config("tiny", [override]).model.attention.kind == "dense"
    assert replace_fields(ModelConfig(), attention="dense").attention.kind == "dense"


def test_overrides_of_one_section_are_validated_together():
    """num_heads=2 alone does not divide by the preset's num_kv_heads=4 ... applied together
    with num_kv_heads=1, each section is built once, so the pair is accepted."""
    config = build_config("tiny", ["num_kv_heads=1", "num_heads=2", "cmp_stride=4",
                                   "sel_block=8", "cmp_block=8"])
    a = config.model.attention
    assert (a.num_heads, a.num_kv_heads, a.nsa.cmp_block, a.nsa.cmp_stride) == (2, 1, 8, 4)


def test_the_flat_layout_of_older_checkpoints_still_loads():
    """Checkpoints and exported files written before the tree hold ModelConfig flat."""
    model = build_config("tiny", ["attention=dense", "window=24", "compressor=mean"]).model
    flat = {"vocab_size": 256, "dim": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
            "head_dim_k": 32, "head_dim_v": 32, "mlp_hidden": None, "max_seq_len": 128,
            "attention": "dense", "rope_base": 10000.0, "norm_eps": 1e-5,
            "tie_embeddings": True, "cmp_block": 16, "cmp_stride": 8, "sel_block": 16,
            "num_selected": 4, "window": 24, "num_init": 1, "num_local": 2,
            "kv_sharing": "independent", "compressor": "mean", "compressor_hidden": None,
            "force_branch": None, "backend": "auto"}
    assert ModelConfig.from_dict(flat) == model
    nested = json.loads(json.dumps(dataclasses.asdict(model)))
    assert ModelConfig.from_dict(nested) == model
    with pytest.raises(TypeError, match="dims"):
        ModelConfig.from_dict({**flat, "dims": 3})


def test_config_diff_names_paths():
    old = build_config("tiny").model
    new = replace_fields(old, window=24, num_layers=3)
    assert config_diff(old, new) == "num_layers: 2 -> 3, attention.nsa.window: 32 -> 24"
