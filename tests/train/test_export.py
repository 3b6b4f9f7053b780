"""Exported model files: a checksum over config and weights, read with weights_only=True; any
file that is not one (text, empty, random bytes, a pickle, truncated, flipped bytes) is refused
with a ModelFileError naming it; writes are atomic; a bad --out is refused before any work."""

import re
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from nsa.models import LanguageModel
from nsa.train import build_config
from nsa.train.checkpoint import (
    ModelFileError,
    export_model,
    latest_checkpoint,
    load_exported,
    load_model,
    save_checkpoint,
)
from nsa.train.distributed import DistContext
from nsa.train.trainer import build_optimizer

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: threads only wait
SINGLE = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture
def checkpoint(tmp_path, tiny_overrides):
    config = build_config("tiny", tiny_overrides)
    torch.manual_seed(0)
    model = LanguageModel(config.model)
    save_checkpoint(tmp_path, 3, model, build_optimizer(model, config.train), config, {},
                    SINGLE, keep=1)
    return latest_checkpoint(tmp_path)


@pytest.fixture
def exported(checkpoint, tmp_path) -> Path:
    return export_model(checkpoint, tmp_path / "model.pt")


def test_an_exported_file_round_trips(exported, checkpoint):
    from nsa.train.checkpoint import model_from_checkpoint

    config, model, step = model_from_checkpoint(checkpoint)
    exported_config, weights, exported_step = load_exported(exported)
    assert (exported_config, exported_step) == (config, step)
    loaded_config, loaded, loaded_step = load_model(exported)
    assert (loaded_config, loaded_step) == (config, step)
    assert loaded.head.weight is loaded.embed.weight
    for name, value in model.state_dict().items():
        assert torch.equal(weights[name], value) and torch.equal(loaded.state_dict()[name],
                                                                  value), name


def weight_record(path: Path) -> tuple[int, int]:
    """(offset in the file, size) of the largest tensor's bytes in a torch.save zip."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename),
                   key=lambda i: i.file_size)
    raw = path.read_bytes()
    name_length, extra_length = struct.unpack("<HH", raw[info.header_offset + 26:
                                                         info.header_offset + 30])
    return info.header_offset + 30 + name_length + extra_length, info.file_size


def flip_weight_bytes(path: Path) -> None:
    start, size = weight_record(path)
    raw = bytearray(path.read_bytes())
    for offset in (size // 3, size // 2, size - 5):
        raw[start + offset] ^= 0x5A
    path.write_bytes(bytes(raw))


class Pickled:  # not a tensor, dict or plain value: weights_only refuses to build it
    pass


BAD_FILES = {
    "text": lambda path: path.write_text("JULIET: not a model\n"),
    "empty": lambda path: path.write_bytes(b""),
    "random-bytes": lambda path: path.write_bytes(
        bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                            dtype=torch.uint8).tolist())),
    "truncated": lambda path: path.write_bytes(path.read_bytes()[:path.stat().st_size // 2]),
    "flipped-weight-bytes": flip_weight_bytes,
    "another-dict": lambda path: torch.save({"model": {}}, path),
    "arbitrary-object": lambda path: torch.save({"model": Pickled()}, path),
}


@pytest.mark.parametrize("damage", BAD_FILES)
def test_a_bad_model_file_is_refused_naming_it(exported, damage):
    BAD_FILES[damage](exported)
    for load in (load_exported, load_model):
        with pytest.raises(ModelFileError, match=re.escape(str(exported))):
            load(exported)


def test_flipped_weight_bytes_are_reported_as_corruption(exported):
    flip_weight_bytes(exported)
    with pytest.raises(ModelFileError, match="checksum mismatch"):
        load_exported(exported)


def test_export_refuses_a_directory_or_a_missing_one(checkpoint, tmp_path):
    with pytest.raises(ModelFileError, match="is a directory"):
        export_model(checkpoint, tmp_path)
    with pytest.raises(ModelFileError, match="does not exist"):
        export_model(checkpoint, tmp_path / "missing" / "model.pt")


def test_a_failed_export_leaves_the_previous_file(exported, checkpoint, monkeypatch):
    before = exported.read_bytes()

    def disk_full(state, f):
        f.write(b"half a model")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(ModelFileError, match="No space left on device"):
        export_model(checkpoint, exported)
    assert exported.read_bytes() == before
    assert sorted(p.name for p in exported.parent.iterdir() if p.is_file()) == ["model.pt"]


def test_files_of_other_format_versions_are_refused_by_name(exported, tmp_path):
    from nsa.train.checkpoint import _model_file_crc32

    state = torch.load(exported, weights_only=True)
    header = state["header"].replace('"nsa-model-v2"', '"nsa-model-v9"')
    newer = tmp_path / "newer.pt"
    torch.save({**state, "header": header, "crc32": _model_file_crc32(header, state["weights"])},
               newer)
    with pytest.raises(ModelFileError, match="has format 'nsa-model-v9', not nsa-model-v2"):
        load_exported(newer)
    older = tmp_path / "older.pt"  # the first layout: format, step, config, model
    torch.save({"format": "nsa-model-v1", "step": 3, "config": {}, "model": state["weights"]},
               older)
    with pytest.raises(ModelFileError, match="is not a model file of format nsa-model-v2"):
        load_exported(older)
