"""Checkpoints: everything a resumed run needs to continue exactly where it stopped.

A checkpoint is written to a temporary file in the run directory, flushed to disk and then
renamed over ``checkpoint.pt``, so a crash mid-save leaves the previous checkpoint intact.
The learning rate is a function of the step and each batch a function of (seed, step), so
the step number stands in for scheduler and data-loader state.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from nsa.train.config import RunConfig

CHECKPOINT = "checkpoint.pt"


class RunDirError(Exception):
    """There is no checkpoint where one was asked for."""


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    config: RunConfig) -> Path:
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "config": config.to_dict(),
        "rng": {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all()},
    }
    path = run_dir / CHECKPOINT
    atomic_save(state, path)
    return path


def atomic_save(state: dict, path: Path) -> None:
    """torch.save to ``path`` such that ``path`` is either the old file or the complete new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(run_dir: Path) -> dict:
    """The saved state, on the CPU (``restore`` moves it to the model's device)."""
    path = run_dir / CHECKPOINT
    if not path.is_file():
        raise RunDirError(f"no checkpoint to resume from at {path}")
    return torch.load(path, map_location="cpu", weights_only=True)


def restore(state: dict, model: nn.Module, optimizer: torch.optim.Optimizer,
            config: RunConfig) -> int:
    """Load ``state`` into ``model`` and ``optimizer``; returns the step it was saved at.

    The model configuration must match the checkpoint's; training settings may differ (for
    example a larger ``max_steps`` to extend a finished run).
    """
    saved = RunConfig.from_dict(state["config"])
    if saved.model != config.model:
        diff = config_diff(saved.model, config.model)
        raise ValueError(f"the model config differs from the checkpoint's: {diff}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"]


def config_diff(old, new) -> str:
    """'name: old -> new' for every field where two configs of one class differ."""
    changed = [f"{k}: {v!r} -> {new.__dict__[k]!r}" for k, v in old.__dict__.items()
               if new.__dict__[k] != v]
    return ", ".join(changed)
