"""The training loop: build the parts, restore, step, evaluate, checkpoint, sample."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from nsa.models import LanguageModel
from nsa.train.checkpoint import CHECKPOINT, RunDirError, load_checkpoint, restore, save_checkpoint
from nsa.train.config import RunConfig, TrainConfig
from nsa.train.data import TRAIN_STREAM, VAL_STREAM, BatchSampler, load_corpus, split_tokens
from nsa.train.metrics import MetricsLog, Progress
from nsa.train.tokenizer import decode, encode


@dataclass(frozen=True)
class TrainResult:
    steps: int
    train_loss: float | None  # loss of the last step; None when the run had no step left to do
    val_loss: float  # nats per byte
    run_dir: Path
    sample: str


def train(config: RunConfig, resume: bool = False, overwrite: bool = False) -> TrainResult:
    """Train ``config`` in ``config.train.run_dir``.

    ``resume`` continues from its checkpoint; ``overwrite`` lets a fresh run replace one.
    """
    t = config.train
    if t.num_threads is not None:
        torch.set_num_threads(t.num_threads)
    device = resolve_device(t.device)
    run_dir = prepare_run_dir(Path(t.run_dir), resume, overwrite)
    train_tokens, val_tokens = split_tokens(load_corpus(), t.val_fraction)
    train_batches = BatchSampler(train_tokens, t.batch_size, t.seq_len, t.seed, TRAIN_STREAM)
    val_batches = BatchSampler(val_tokens, t.batch_size, t.seq_len, t.seed, VAL_STREAM)

    torch.manual_seed(t.seed)
    model = LanguageModel(config.model).to(device)
    optimizer = build_optimizer(model, t)
    start = restore(load_checkpoint(run_dir), model, optimizer, config) if resume else 0
    if start > t.max_steps:
        raise ValueError(f"the checkpoint is at step {start}, past max_steps={t.max_steps}")
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")

    tokens_per_step = t.batch_size * t.grad_accum * t.seq_len
    print(f"{model.num_parameters():,} parameters ({config.model.attention} attention) on "
          f"{device} with {torch.get_num_threads()} threads; {tokens_per_step:,} tokens/step; "
          f"steps {start} -> {t.max_steps}; run_dir {run_dir}", flush=True)
    metrics = MetricsLog(run_dir, start)
    progress = Progress(start, t.max_steps)
    throughput = Throughput(tokens_per_step)
    began = time.perf_counter()
    loss = None
    for step in range(start + 1, t.max_steps + 1):
        lr = set_learning_rate(optimizer, step, t)
        micro = ((step - 1) * t.grad_accum + i for i in range(t.grad_accum))
        loss, grad_norm = train_step(model, optimizer, (train_batches.batch(i) for i in micro),
                                     device, t)
        throughput.step()
        if step % t.log_interval == 0 or step == t.max_steps:
            record = {"step": step, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
                      "tokens_per_s": throughput.read(),
                      "elapsed_s": time.perf_counter() - began}
            metrics.log(record)
            progress.update(step, summarize(record))
        if step % t.eval_interval == 0 and step < t.max_steps:
            val_loss = evaluate(model, val_batches, t.eval_steps, device, t.autocast)
            metrics.log({"step": step, "val_loss": val_loss})
            progress.write(f"step {step}: val loss {val_loss:.4f}")
            throughput.restart()
        if step % t.checkpoint_interval == 0 or step == t.max_steps:
            save_checkpoint(run_dir, step, model, optimizer, config)
            throughput.restart()
    progress.close()

    val_loss = evaluate(model, val_batches, t.eval_steps, device, t.autocast)
    metrics.log({"step": t.max_steps, "val_loss": val_loss,
                 "elapsed_s": time.perf_counter() - began})
    sample = generate_sample(model, t, device)
    print(f"\n{sample}\n\nfinal val loss {val_loss:.4f} nats/byte "
          f"({val_loss / math.log(2):.3f} bits/byte) after {t.max_steps} steps", flush=True)
    train_loss = None if loss is None else loss.item()
    return TrainResult(t.max_steps, train_loss, val_loss, run_dir, sample)


def summarize(record: dict) -> str:
    return (f"loss {record['loss']:.4f} | lr {record['lr']:.2e} | grad {record['grad_norm']:.2f}"
            f" | {record['tokens_per_s']:,.0f} tok/s")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available")
    return torch.device(name)


def prepare_run_dir(run_dir: Path, resume: bool, overwrite: bool = False) -> Path:
    """Create ``run_dir``. A fresh run never silently replaces an earlier run's checkpoint."""
    checkpoint = run_dir / CHECKPOINT
    if resume and not checkpoint.is_file():
        raise RunDirError(f"no checkpoint to resume from in {run_dir}")
    if not resume and checkpoint.is_file():
        if not overwrite:
            raise RunDirError(
                f"{run_dir} already holds a run: pass --resume to continue it, --overwrite to "
                f"start over, or run_dir=... for a new directory")
        print(f"{run_dir} holds an earlier run: starting over (--overwrite)")
        checkpoint.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def build_optimizer(model: nn.Module, t: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings, none on gains and biases."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2))


def learning_rate(step: int, t: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at
    ``max_steps``. Steps count from 1."""
    if step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def set_learning_rate(optimizer: torch.optim.Optimizer, step: int, t: TrainConfig) -> float:
    lr = learning_rate(step, t)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def autocast(device: torch.device, enabled: bool) -> torch.autocast:
    """bf16 autocast on CUDA when ``enabled``; a no-op on the CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16,
                          enabled=enabled and device.type == "cuda")


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
               t: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over ``grad_accum`` micro-batches.

    Returns (mean loss, gradient norm before clipping) as device tensors (no host sync).
    """
    total = torch.zeros((), device=device)
    for x, y in batches:
        with autocast(device, t.autocast):
            loss = model(x.to(device), y.to(device)) / t.grad_accum
        loss.backward()
        total += loss.detach()
    max_norm = math.inf if t.grad_clip is None else t.grad_clip
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, grad_norm


@torch.no_grad()
def evaluate(model: nn.Module, batches: BatchSampler, num_batches: int, device: torch.device,
             use_autocast: bool) -> float:
    """Mean loss (nats per byte) over the first ``num_batches`` batches of ``batches``."""
    model.eval()
    losses = []
    for i in range(num_batches):
        x, y = batches.batch(i)
        with autocast(device, use_autocast):
            losses.append(model(x.to(device), y.to(device)))
    model.train()
    return torch.stack(losses).mean().item()


@torch.no_grad()
def generate_sample(model: LanguageModel, t: TrainConfig, device: torch.device) -> str:
    """``t.sample_prompt`` followed by ``t.sample_tokens`` sampled bytes, decoded."""
    model.eval()
    prompt = encode(t.sample_prompt).to(device)[None]  # [1, P]
    generator = torch.Generator(device).manual_seed(t.seed)
    with autocast(device, t.autocast):
        tokens = model.generate(prompt, t.sample_tokens, temperature=t.sample_temperature,
                                generator=generator)
    model.train()
    return decode(tokens[0])


def sample_checkpoint(run_dir: Path, prompt: str | None = None, num_tokens: int | None = None,
                      temperature: float | None = None, device: str = "auto") -> str:
    """A sample from the model saved in ``run_dir`` (settings default to the run's own)."""
    state = load_checkpoint(run_dir)
    config = RunConfig.from_dict(state["config"])
    overrides = {"sample_prompt": prompt, "sample_tokens": num_tokens,
                 "sample_temperature": temperature}
    t = replace(config.train, **{k: v for k, v in overrides.items() if v is not None})
    target = resolve_device(device)
    model = LanguageModel(config.model).to(target)
    model.load_state_dict(state["model"])
    return generate_sample(model, t, target)


class Throughput:
    """Tokens per second over the steps since the last reading or restart."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.restart()

    def restart(self) -> None:
        self.steps, self.since = 0, time.perf_counter()

    def step(self) -> None:
        self.steps += 1

    def read(self) -> float:
        rate = self.steps * self.tokens_per_step / max(time.perf_counter() - self.since, 1e-9)
        self.restart()
        return rate
