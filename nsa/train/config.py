"""Training configuration, named presets and ``key=value`` command-line overrides."""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from nsa.config_tree import replace_fields, resolve_key
from nsa.models.config import MODEL_PRESETS, ModelConfig
from nsa.train.distributed import PARALLEL
from nsa.train.tokenizer import TOKENIZERS

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class TrainConfig:
    """Everything the trainer needs besides the model; validated once, when built."""

    batch_size: int = 32  # sequences per micro-batch
    seq_len: int | None = None  # default: the model's max_seq_len
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int = 1000  # optimizer steps
    lr: float = 1e-3  # peak learning rate, reached after warmup
    min_lr: float = 1e-4  # end of the cosine decay, at max_steps
    warmup_steps: int = 100
    weight_decay: float = 0.1  # on matrices and embeddings only (params with >= 2 dims)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float | None = 1.0  # max global grad norm; None disables clipping
    val_fraction: float = 0.1  # the held-out tail of the corpus
    eval_interval: int = 100  # steps between validation runs
    eval_steps: int = 20  # validation batches per run (always the same ones)
    log_interval: int = 10  # steps between log lines / metrics records
    checkpoint_interval: int = 500  # steps between checkpoints (one is always written at the end)
    run_dir: str = "runs/nsa"
    # Start from another run's model weights (curriculum, fine-tuning): a run directory (its
    # newest good checkpoint), one checkpoint directory, or a file or Hugging Face directory
    # written by 'nsa export'. Weights only: the optimizer, step, learning-rate schedule, RNG
    # and data position start fresh. Every weight must have this model's name and shape
    # (max_seq_len may differ). A run that resumes its own checkpoint does not apply it again.
    init_from: str | None = None
    seed: int = 0
    device: str = "auto"  # "auto": cuda if available, else cpu
    autocast: bool = True  # bf16 autocast on CUDA; the CPU always computes in float32
    num_threads: int | None = None  # torch.set_num_threads; None keeps torch's default
    # Data: "shakespeare" (bundled), "synthetic",
    # "passkey[:MIN-MAX[:LO-HI|:distance]][:answers]", "fineweb", "hf:<name>" or local files
    # (a .txt/.jsonl/.parquet file, directory or glob); see nsa.train.streams.build_stream.
    data: str = "shakespeare"
    tokenizer: str = "bytes"  # "bytes" or "gpt2" (tiktoken)
    dataset_config: str | None = None  # hub config, default "sample-10BT" for fineweb
    val_docs: int = 1000  # documents of a document stream held out for validation
    # Document masking: each document of a packed row attends only to itself, positions
    # restarting (documents end at the tokenizer's eot id; see nsa.train.data.document_offsets).
    doc_masking: bool = False
    data_retries: int = 5  # re-opens of a failing stream, with exponential backoff
    data_backoff_s: float = 2.0
    # Parallelism under torchrun: "none", "ddp" or "fsdp" (FSDP2). batch_size is global.
    parallel: str = "none"
    # FSDP2 only: free each block's gathered parameters after its forward and gather them again
    # for its backward (less memory), or keep them until the backward (one all-gather per block
    # and step); and how many blocks ahead to gather explicitly, in forward and in backward
    # (0: FSDP2's own prefetching).
    fsdp_reshard: bool = True
    fsdp_prefetch: int = 0
    activation_checkpointing: bool = False  # per block, non-reentrant
    compile: bool = False  # torch.compile per block
    # Replay each step's forward and backward from one CUDA graph (nsa.train.graphs) after two
    # eager steps (eleven under DDP): no host launch cost per step. CUDA devices, one process or
    # DDP, fixed shapes (no doc_masking). None ("auto", the default): on wherever that holds for
    # the resolved device (nsa.train.trainer.graphed_step), since an eager step of a small model
    # is bound by the host; false: the eager step everywhere; true: refused where it cannot run.
    cuda_graph: bool | None = None
    keep_checkpoints: int = 3  # newest checkpoints kept
    watchdog_timeout_s: float | None = 900.0  # no step for this long: dump stacks and exit
    watchdog_first_timeout_s: float | None = 3600.0  # allowance for the first step (compiling)
    tensorboard: bool = False
    wandb_project: str | None = None
    sample_prompt: str = "ROMEO:"
    sample_tokens: int = 200  # bytes generated after the prompt at the end of training
    sample_temperature: float = 0.8

    @property
    def graph_fits(self) -> bool:
        """Whether one captured step can replay every step: one process or DDP (FSDP2 gathers
        and frees parameters around each block) and fixed shapes (documents change per batch).
        ``cuda_graph=true`` is refused where not; ``auto`` graphs a CUDA device's step where it
        does (nsa.train.trainer.graphed_step)."""
        return self.parallel != "fsdp" and not self.doc_masking

    def __post_init__(self) -> None:
        for f in fields(self):  # None, not inf, disables grad_clip and the watchdog
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name} must be finite, got {value}")
        positive = ("batch_size", "grad_accum", "max_steps", "eval_interval", "eval_steps",
                    "log_interval", "checkpoint_interval")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("seq_len", "num_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be None or >= 1, got {value}")
        for name in ("warmup_steps", "weight_decay", "seed", "sample_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be None or > 0, got {self.grad_clip}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {sorted(TOKENIZERS)}, got "
                             f"{self.tokenizer!r}")
        if self.parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {PARALLEL}, got {self.parallel!r}")
        if self.fsdp_prefetch < 0:
            raise ValueError(f"fsdp_prefetch must be >= 0, got {self.fsdp_prefetch}")
        if self.parallel != "fsdp" and (not self.fsdp_reshard or self.fsdp_prefetch):
            raise ValueError(f"fsdp_reshard and fsdp_prefetch tune FSDP2: they need "
                             f"parallel=fsdp, got parallel={self.parallel}")
        for name in ("val_docs", "data_retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.data_backoff_s >= 0:
            raise ValueError(f"data_backoff_s must be >= 0, got {self.data_backoff_s}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        for name in ("watchdog_timeout_s", "watchdog_first_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be None or > 0, got {value}")
        if not self.data:
            raise ValueError("data must not be empty")
        if self.doc_masking and self.data == "synthetic":
            raise ValueError("doc_masking=true needs data made of documents (each ended by the "
                             "tokenizer's eot id): data=synthetic has none, and holds the eot id "
                             "at random")
        if self.cuda_graph and not self.graph_fits:
            raise ValueError("cuda_graph=true replays one fixed step: it needs parallel=none or "
                             f"ddp and doc_masking=false, got parallel={self.parallel}, "
                             f"doc_masking={str(self.doc_masking).lower()}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if not self.sample_prompt:
            raise ValueError("sample_prompt must not be empty")
        if not self.sample_temperature > 0:
            raise ValueError(f"sample_temperature must be > 0, got {self.sample_temperature}")
        if not self.run_dir:
            raise ValueError("run_dir must not be empty")
        if self.init_from is not None:
            if not self.init_from:
                raise ValueError("init_from must not be empty (none: start from random weights)")
            if Path(self.init_from).resolve().is_relative_to(Path(self.run_dir).resolve()):
                raise ValueError(f"init_from={self.init_from} is inside run_dir={self.run_dir}: "
                                 f"give another run's weights (--resume continues this run)")


@dataclass(frozen=True)
class RunConfig:
    """A model and how to train it. ``train.seq_len`` is resolved to an int when built."""

    model: ModelConfig
    train: TrainConfig

    def __post_init__(self) -> None:
        vocab = TOKENIZERS[self.train.tokenizer].vocab_size
        if self.model.vocab_size < vocab:
            raise ValueError(f"vocab_size must be >= {vocab} for the {self.train.tokenizer} "
                             f"tokenizer, got {self.model.vocab_size}")
        if self.train.seq_len is None:
            object.__setattr__(self, "train", replace(self.train, seq_len=self.model.max_seq_len))
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"seq_len ({self.train.seq_len}) must be <= max_seq_len ({self.model.max_seq_len})"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        """From :meth:`to_dict` output; the model part may also be the flat layout of
        checkpoints written before the config tree (:meth:`ModelConfig.from_dict`)."""
        return cls(model=ModelConfig.from_dict(data["model"]), train=TrainConfig(**data["train"]))


TRAIN_PRESETS: dict[str, TrainConfig] = {
    # 1.85 nats/byte of validation loss on the bundled corpus after 600 steps, 3.5 minutes on
    # a 2-core CPU. One thread: a second speeds a step up ~1.4x on an idle machine but slows it
    # ~20x while another process holds a core (every small op waits at an OpenMP barrier).
    "tiny": TrainConfig(
        batch_size=16, seq_len=128, max_steps=600, lr=3e-3, min_lr=3e-4, warmup_steps=50,
        eval_interval=100, eval_steps=10, checkpoint_interval=200, run_dir="runs/tiny",
        num_threads=1,
    ),
    "showcase": TrainConfig(
        batch_size=32, seq_len=128, max_steps=2000, lr=2e-3, min_lr=2e-4, warmup_steps=100,
        eval_interval=200, checkpoint_interval=500, run_dir="runs/showcase",
    ),
    # A GPU run: 8 x 2048 tokens per step, paper-scale learning rate.
    "m7c-125m": TrainConfig(
        batch_size=8, seq_len=2048, max_steps=20000, lr=6e-4, min_lr=6e-5, warmup_steps=200,
        eval_interval=500, eval_steps=50, checkpoint_interval=1000, run_dir="runs/m7c-125m",
        data="fineweb", tokenizer="gpt2", sample_prompt="The", sample_tokens=64,
    ),
}


def build_config(preset: str, overrides: Sequence[str] = ()) -> RunConfig:
    """The named preset with ``key=value`` overrides applied.

    A key names one field of the config tree (``RunConfig`` -> ``model`` / ``train``,
    ``model.attention``, ``model.attention.nsa``) by its path or any part of it that ends in
    the field's name and finds one field only: ``window``, ``attention.window``,
    ``model.attention.nsa.window``. ``attention=dense`` sets ``attention.kind``. Values are
    parsed to the field's type (``none`` for None, and ``auto`` too for an optional bool such
    as ``cuda_graph``).
    """
    if preset not in TRAIN_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(TRAIN_PRESETS)}")
    changes: dict[str, dict] = {"model": {}, "train": {}}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} must have the form key=value")
        (section, *path), annotation = resolve_key(RunConfig, key.strip())
        changes[section][".".join(path)] = parse_value(key.strip(), text.strip(), annotation)
    return RunConfig(model=replace_fields(MODEL_PRESETS[preset], **changes["model"]),
                     train=replace_fields(TRAIN_PRESETS[preset], **changes["train"]))


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse_value(name: str, text: str, annotation) -> object:
    """Parse ``text`` as ``annotation`` (int, float, bool, str, or an Optional of one; an
    Optional bool also takes ``auto`` for None)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        options = typing.get_args(annotation)
    else:
        options = (annotation,)
    if type(None) in options and text.lower() in ("none", "null"):
        return None
    (kind,) = (t for t in options if t is not type(None))
    # An optional bool's None is the automatic choice (cuda_graph): "auto" names it.
    if kind is bool and type(None) in options and text.lower() == "auto":
        return None
    try:
        if kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError
            return text.lower() in _TRUE
        return kind(text)
    except ValueError:
        optional = ((" or auto" if kind is bool else " or none") if type(None) in options
                    else "")
        raise ValueError(f"{name}: cannot parse {text!r} as {kind.__name__}{optional}") from None
