"""``nsa export --hf DIR``: a run's model as a Hugging Face directory, and reading one back
for ``nsa generate`` / ``nsa sample``.

The directory holds ``config.json`` (:class:`NSAConfig`: the model config tree, the run's
training settings under ``train``), ``model.safetensors``, ``generation_config.json``, the
tokenizer (``tokenizer.json``, ``tokenizer_config.json``) and ``manifest.json`` (size and CRC-32
of the weights). It is written into a temporary
directory beside ``DIR`` and renamed once complete.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import torch

from nsa.hf.configuration import NSAConfig
from nsa.hf.modeling import NSAForCausalLM
from nsa.hf.tokenizer import hf_tokenizer
from nsa.train.checkpoint import ModelFileError, model_from_checkpoint
from nsa.train.config import RunConfig, TrainConfig


def export_hf(checkpoint: Path, out: Path) -> Path:
    """Write the model of DCP ``checkpoint`` and its run's tokenizer as a Hugging Face
    directory ``out`` (which must not exist, or be empty, in an existing directory)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelFileError(f"{out} exists and is not an empty directory: give a new one")
    if not out.parent.is_dir():
        raise ModelFileError(f"cannot write {out}: the directory {out.parent} does not exist")
    config, model, _ = model_from_checkpoint(checkpoint)
    tokenizer = hf_tokenizer(config.train.tokenizer, config.model.max_seq_len)
    hf_config = NSAConfig.from_model_config(
        config.model, eos_token_id=tokenizer.eos_token_id, train=dataclasses.asdict(config.train),
        dtype=torch.float32)
    hf_model = NSAForCausalLM(hf_config)
    hf_model.model.load_state_dict(model.state_dict())
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer.save_pretrained(tmp)
        hf_model.save_pretrained(tmp)  # the manifest last
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelFileError(f"writing {out} failed: {error}") from error
    return out


def load_hf_dir(path: Path) -> tuple[RunConfig, torch.nn.Module]:
    """(run config, LanguageModel on the CPU) of a directory ``nsa export --hf`` wrote (or
    ``save_pretrained`` of a model loaded from one): the run's settings come from the
    config's ``train``."""
    model = NSAForCausalLM.from_pretrained(path, dtype=torch.float32)
    if model.config.train is None:
        raise ModelFileError(f"{path}/config.json holds no 'train' settings (the tokenizer nsa "
                             f"needs): write the directory with 'nsa export --hf'")
    try:
        train = TrainConfig(**model.config.train)
        return RunConfig(model.config.model_config, train), model.model
    except (TypeError, ValueError) as error:
        raise ModelFileError(f"{path}/config.json: its 'train' settings do not fit this version "
                             f"of nsa ({error})") from None
