"""Checkpoints with torch.distributed.checkpoint (DCP): any world size in, any world size out.

Layout: ``run_dir/checkpoints/step_000100/`` holds the DCP shards of the model and optimizer
(written by every rank) and ``trainer_state.pt`` (rank 0: step, config, every rank's data state
and RNG state). Every rank writes into ``.step_000100.tmp/``; once all have finished, rank 0
adds the trainer state, renames the directory and syncs it: a crash mid-save leaves only a
temporary directory, never a half-written ``step_*``, and the previous checkpoint stays.
The newest ``keep`` checkpoints are kept. The learning rate is a function of the step.

Every checkpoint ends with ``manifest.json``: the size and CRC-32 of each of its files, written
last. A checkpoint without one is incomplete; one whose files disagree with it is corrupted and
refused with the name of the file (``CheckpointCorrupted``), and resuming falls back to the
newest checkpoint that verifies.

``nsa export`` writes one model file (:func:`export_model`): a JSON header (format, step,
config), the weights and the CRC-32 of both, read back with ``weights_only=True``; a file that
is not one, or is truncated or corrupted, is refused naming it (``ModelFileError``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
import zlib
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import BinaryIO

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from nsa.config_tree import differences
from nsa.train.config import RunConfig
from nsa.train.distributed import DistContext, all_gather_objects, barrier
from nsa.train.errors import SetupError

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.pt"
MANIFEST = "manifest.json"
EXPORT_FORMAT = "nsa-model-v2"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class RunDirError(Exception):
    """There is no checkpoint where one was asked for, or a fresh run would replace one."""


class CheckpointCorrupted(Exception):
    """A checkpoint's files disagree with its manifest (truncated, altered or missing)."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (disk full, directory not writable, ...)."""


class ModelFileError(Exception):
    """A model file is not one :func:`export_model` wrote (another kind of file, truncated,
    corrupted, another format version), or cannot be written where asked."""


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The complete (manifest written) checkpoints of a run, oldest first; not yet verified."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path, report=print) -> Path:
    """The newest checkpoint that verifies; corrupted ones are skipped with a ``report``."""
    problems = []
    for path in reversed(checkpoint_dirs(run_dir)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointCorrupted as error:
            problems.append(str(error))
            report(f"skipping a corrupted checkpoint: {error}")
    detail = f" ({'; '.join(problems)})" if problems else ""
    raise RunDirError(f"no checkpoint to resume from in {run_dir / CHECKPOINTS}{detail}")


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(path: Path, names: list[str] | None = None) -> None:
    """Record the size and CRC-32 of every file of checkpoint directory ``path`` (or of the
    files ``names`` in it)."""
    found = ([path / name for name in names] if names is not None
             else [f for f in sorted(path.rglob("*")) if f.is_file() and f.name != MANIFEST])
    files = {str(f.relative_to(path)): {"size": f.stat().st_size, "crc32": _crc32(f)}
             for f in found}
    tmp = path / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)


def verify_checkpoint(path: Path) -> None:
    """Raise :class:`CheckpointCorrupted` naming the first file that disagrees with the
    manifest (missing, another size, another checksum)."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointCorrupted(f"{path / MANIFEST}: unreadable manifest ({error})") from None
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointCorrupted(f"{file}: missing")
        size = file.stat().st_size
        if size != expected["size"]:
            raise CheckpointCorrupted(f"{file}: {size} bytes, expected {expected['size']} "
                                      f"(truncated or altered)")
        if _crc32(file) != expected["crc32"]:
            raise CheckpointCorrupted(f"{file}: checksum mismatch (corrupted)")


# DCP's save and load outside a process group work in the one process and warn so on every call,
# even given no_dist=True (torch 2.13: the warning follows no_dist whoever set it).
_SINGLE_PROCESS_WARNING = (r"torch\.distributed is disabled, unavailable or uninitialized, "
                           r"assuming the intent is to (save|load) in a single process")


@contextmanager
def dcp_single_process_intended(no_dist: bool = False):
    """Around a DCP save or load: under torchrun DCP runs over the process group, unchanged,
    unless the call passes ``no_dist=True`` (this process alone); with that, or without a
    process group, a single process is this code's intent (a plain ``python`` run, an export,
    each rank reading ``init_from``), so DCP's warning that it assumes so, and only that
    warning, is not shown."""
    with warnings.catch_warnings():
        if no_dist or not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", _SINGLE_PROCESS_WARNING, UserWarning)
        yield


def rng_state() -> dict:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    config: RunConfig, data_state: dict, ctx: DistContext, keep: int) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory."""
    root = run_dir / CHECKPOINTS
    final = root / f"step_{step:06d}"
    tmp = root / f".{final.name}.tmp"
    try:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed save's leftovers
            root.mkdir(parents=True, exist_ok=True)
        barrier(ctx)
        model_state, optim_state = get_state_dict(model, optimizer)
        with dcp_single_process_intended():
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
        data_states = all_gather_objects(data_state, ctx)
        rng_states = all_gather_objects(rng_state(), ctx)
        if ctx.is_main:
            trainer_state = {"step": step, "config": config.to_dict(),
                             "world_size": ctx.world_size, "data": data_states,
                             "rng": rng_states}
            atomic_save(trainer_state, tmp / TRAINER_STATE)
            write_manifest(tmp)  # last: only now is the directory a checkpoint
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync_dir(root)
            for old in checkpoint_dirs(run_dir)[:-keep]:
                shutil.rmtree(old)
    except OSError as error:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(
            f"writing the step {step} checkpoint to {tmp} failed: {error}; earlier "
            f"checkpoints in {root} are intact") from error
    barrier(ctx)
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    config: RunConfig, ctx: DistContext) -> tuple[int, dict]:
    """Collective: load a checkpoint into ``model`` and ``optimizer``, at any world size.

    Returns (step, this rank's data state). The model config must match the checkpoint's;
    training settings may differ (for example a larger ``max_steps`` to extend a run).
    """
    verify_checkpoint(path)
    state = read_trainer_state(path)
    saved = RunConfig.from_dict(state["config"])
    if saved.model != config.model:
        raise SetupError(f"the model config differs from the checkpoint's: "
                         f"{config_diff(saved.model, config.model)}")
    model_state, optim_state = get_state_dict(model, optimizer)
    to_load = {"model": model_state, "optim": optim_state}
    with dcp_single_process_intended():
        dcp.load(to_load, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=to_load["model"],
                   optim_state_dict=to_load["optim"])
    same_world = state["world_size"] == ctx.world_size
    set_rng_state(state["rng"][ctx.rank if same_world else 0])
    return state["step"], data_state_for_rank(state["data"], ctx, path)


def read_trainer_state(path: Path) -> dict:
    """Step, config, world size, data and RNG states of a checkpoint directory."""
    return torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)


def load_model_weights(path: Path, model: nn.Module) -> None:
    """The weights of a checkpoint directory into a plain (unwrapped) model, in this process
    alone (no collective, also under torchrun)."""
    to_load = {"model": model.state_dict()}
    with dcp_single_process_intended(no_dist=True):
        dcp.load(to_load, checkpoint_id=path, no_dist=True)
    model.load_state_dict(to_load["model"])


def data_state_for_rank(states: list[dict], ctx: DistContext, path: Path) -> dict:
    """This rank's data state. Index-based streams (bundled corpus, synthetic) continue at any
    world size; a document stream's position is per rank and needs the same world size."""
    if len(states) == ctx.world_size:
        return states[ctx.rank]
    if all(set(s) == {"batch_index"} for s in states):
        return states[0]
    raise SetupError(f"{path} was saved by {len(states)} ranks reading a document stream; "
                     f"its data position cannot be split over {ctx.world_size} ranks")


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(file)`` into a temporary file beside ``path``, then rename it to ``path``: a
    reader finds either the old file or the complete new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj) -> None:
    """``obj`` as indented JSON at ``path``, written as ``atomic_write`` writes; the folder
    is made if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(obj, indent=1).encode()
    atomic_write(path, lambda file: file.write(data))


def atomic_save(state: dict, path: Path) -> None:
    """torch.save to ``path`` such that ``path`` is either the old file or the complete new one."""
    atomic_write(path, partial(torch.save, state))


def _fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def model_from_checkpoint(checkpoint: Path):
    """(config, model on the CPU with the checkpoint's weights, step); one process."""
    from nsa.models import LanguageModel

    verify_checkpoint(checkpoint)
    state = read_trainer_state(checkpoint)
    config = RunConfig.from_dict(state["config"])
    model = LanguageModel(config.model)
    load_model_weights(checkpoint, model)
    return config, model, state["step"]


def export_model(checkpoint: Path, out: Path) -> Path:
    """One file with the model's config and weights (no optimizer), from a DCP checkpoint;
    :func:`load_exported` reads it. Written atomically (a temporary file, then renamed), in a
    single process. ``out`` must be a file path in an existing directory (``ModelFileError``)."""
    out = Path(out)
    if out.is_dir():
        raise ModelFileError(f"{out} is a directory: give the model file's path, e.g. "
                             f"{out / 'model.pt'}")
    if not out.parent.is_dir():
        raise ModelFileError(f"cannot write {out}: the directory {out.parent} does not exist")
    config, model, step = model_from_checkpoint(checkpoint)
    header = json.dumps({"format": EXPORT_FORMAT, "step": step, "config": config.to_dict()})
    weights = model.state_dict()
    try:
        atomic_save({"header": header, "weights": weights,
                     "crc32": _model_file_crc32(header, weights)}, out)
    except OSError as error:
        raise ModelFileError(f"writing {out} failed: {error}") from error
    return out


def _model_file_crc32(header: str, weights: dict[str, torch.Tensor]) -> int:
    """CRC-32 of the header, then of each weight's name and bytes, in name order."""
    crc = zlib.crc32(header.encode())
    for name in sorted(weights):
        tensor = weights[name].detach().cpu().contiguous().reshape(-1)
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(tensor.view(torch.uint8).numpy(), crc)
    return crc


def load_exported(path: Path) -> tuple[RunConfig, dict, int]:
    """(config, model state dict, step) of a file written by :func:`export_model`. Any other
    file (not a model file, truncated, checksum mismatch, another format version) raises
    :class:`ModelFileError` naming it."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # whatever the zip reader or the unpickler raises
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ModelFileError(f"{path}: not a readable model file ({reason[:200]})") from None
    if not (isinstance(state, dict) and set(state) == {"header", "weights", "crc32"}
            and isinstance(state["header"], str) and isinstance(state["crc32"], int)
            and isinstance(state["weights"], dict)
            and all(isinstance(w, torch.Tensor) for w in state["weights"].values())):
        raise ModelFileError(f"{path} is not a model file of format {EXPORT_FORMAT} (write one "
                             f"with 'nsa export')")
    if _model_file_crc32(state["header"], state["weights"]) != state["crc32"]:
        raise ModelFileError(f"{path}: checksum mismatch (the file is corrupted)")
    try:
        header = json.loads(state["header"])
        if header["format"] != EXPORT_FORMAT:
            raise ModelFileError(f"{path} has format {header['format']!r}, not "
                                 f"{EXPORT_FORMAT}: export it again with this version of nsa")
        return RunConfig.from_dict(header["config"]), state["weights"], header["step"]
    except (KeyError, TypeError, ValueError) as error:
        raise ModelFileError(f"{path}: its header does not fit this version of nsa "
                             f"({error!r})") from None


def load_model(path: Path) -> tuple[RunConfig, nn.Module, int | None]:
    """(config, model on the CPU, step) from a run directory's newest checkpoint, one checkpoint
    directory, an exported file or a Hugging Face directory (``nsa export --hf``, read with the
    ``hf`` extra; it records no step: None). A bad file or checkpoint raises
    :class:`ModelFileError`, a directory without a checkpoint :class:`RunDirError`."""
    from nsa.models import LanguageModel

    path = Path(path)
    if path.is_dir() and not (path / CHECKPOINTS).is_dir() and any(
            (path / name).is_file() for name in ("model.safetensors",
                                                 "model.safetensors.index.json")):
        try:
            from nsa.hf.export import load_hf_dir
        except ImportError as error:
            raise ModelFileError(f"{path} is a Hugging Face directory: reading it needs the hf "
                                 f"extra (pip install 'nsa[hf]'; {error})") from None
        return *load_hf_dir(path), None
    if path.is_file():
        config, weights, step = load_exported(path)
        model = LanguageModel(config.model)
        try:
            model.load_state_dict(weights)
        except RuntimeError as error:
            raise ModelFileError(f"{path}: its weights do not fit its config ({error})") from None
        return config, model, step
    if (path / TRAINER_STATE).is_file():
        try:
            return model_from_checkpoint(path)
        except CheckpointCorrupted as error:
            raise ModelFileError(str(error)) from None
    return model_from_checkpoint(latest_checkpoint(path))


def load_init_weights(path: Path, model: nn.Module, config: RunConfig) -> int | None:
    """``init_from``: the weights at ``path`` (whatever :func:`load_model` reads) into the plain
    (unwrapped) ``model`` of ``config``, in this process; -> the step they were trained to (None
    where not recorded). Every weight must have this model's name and shape, and the source
    this run's tokenizer; config fields that shape no weight (``max_seq_len``, ``backend``, ...)
    may differ. Otherwise, or when ``path`` cannot be read, SetupError naming what differs."""
    if not path.exists():
        raise SetupError(f"init_from={path}: no such file or directory")
    try:
        source, source_model, step = load_model(path)
    except (RunDirError, ModelFileError) as error:
        raise SetupError(f"init_from={path}: {error}") from None
    if source.train.tokenizer != config.train.tokenizer:
        raise SetupError(f"init_from={path} was trained with tokenizer={source.train.tokenizer}, "
                         f"this run reads tokenizer={config.train.tokenizer}")
    weights = source_model.state_dict()
    mismatch = weight_mismatch(weights, model.state_dict())
    if mismatch is not None:
        raise SetupError(f"init_from={path}: its model differs from this run's "
                         f"({config_diff(source.model, config.model)}): {mismatch}")
    model.load_state_dict(weights)
    return step


def weight_mismatch(source: dict[str, torch.Tensor],
                    target: dict[str, torch.Tensor]) -> str | None:
    """The first weight, in ``target``'s order then ``source``'s, that one of two state dicts
    lacks or that differs in shape ('NAME is SHAPE there and SHAPE here'); None when all match."""
    def shape(weights: dict[str, torch.Tensor], name: str) -> str:
        return str(tuple(weights[name].shape)) if name in weights else "absent"

    for name in [*target, *(name for name in source if name not in target)]:
        if shape(source, name) != shape(target, name):
            return f"{name} is {shape(source, name)} there and {shape(target, name)} here"
    return None


def config_diff(old, new) -> str:
    """'path: old -> new' for every field where two configs of one class differ."""
    return ", ".join(differences(old, new))
