"""The training loop: build the parts, restore, step, evaluate, checkpoint, sample.

One process, or one per GPU under torchrun (``parallel=ddp|fsdp``). ``batch_size`` is the
global number of sequences per micro-batch: each of W ranks takes ``batch_size / W`` of them,
so a run computes the same losses at any world size (up to reduction order).

Everything that can be known to fail is checked before the first step, on every rank together:
the launch and the machine against the settings, the run directory (one training at a time,
``run_dir/.lock``), the data against ``val_docs`` and ``eval_steps``.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from nsa.models import LanguageModel
from nsa.models.config import ModelConfig
from nsa.ops.triton_support import TRITON_AVAILABLE, TRITON_INTERPRET, TRITON_MISSING_REASON
from nsa.train.checkpoint import (
    CHECKPOINTS,
    RunDirError,
    checkpoint_dirs,
    latest_checkpoint,
    load_checkpoint,
    load_init_weights,
    load_model,
    save_checkpoint,
)
from nsa.train.config import RunConfig, TrainConfig
from nsa.train.data import document_offsets
from nsa.train.distributed import (
    DistContext,
    all_gather_objects,
    all_reduce_mean,
    barrier,
    fail_together,
    gradient_sync,
    init_distributed,
    resolve_device,
    shutdown_distributed,
    unwrap,
    wrap_model,
)
from nsa.train.errors import SetupError
from nsa.train.flops import flops_metrics, matmul_params, model_flops_per_token, peak_flops
from nsa.train.graphs import DDP_WARMUP_STEPS, WARMUP_STEPS, CUDAGraphStep
from nsa.train.metrics import MetricsLog, Progress
from nsa.train.streams import TokenStream, build_stream, local_batch_size
from nsa.train.tokenizer import TOKENIZERS, Tokenizer, TokenizerUnavailableError, get_tokenizer
from nsa.train.watchdog import Heartbeat, Watchdog

RUN_LOCK = ".lock"  # in run_dir: flock'ed by the run's rank 0, it records the holder


@dataclass(frozen=True)
class TrainResult:
    steps: int
    train_loss: float | None  # loss of the last step; None when the run had no step left to do
    val_loss: float  # nats per token
    run_dir: Path
    sample: str


class TrainingDiverged(RuntimeError):
    """A loss or gradient norm became NaN/inf; every rank stops, no checkpoint is written."""


def train(config: RunConfig, resume: bool | str = False, overwrite: bool = False) -> TrainResult:
    """Train ``config`` in ``config.train.run_dir``.

    ``resume``: True continues from the newest good checkpoint (an error if there is none);
    "auto" continues when there is one and starts fresh otherwise (for restarts under
    ``torchrun --max-restarts``). ``overwrite`` lets a fresh run replace an earlier one.
    Under torchrun every rank calls this with the same config.
    SetupError (a setting, the data or the machine does not fit) and RunDirError (the run
    directory is in use, or holds no checkpoint to resume / a run to keep) come before the
    first step.
    """
    t = config.train
    if resume and overwrite:
        raise SetupError(f"--resume and --auto-resume continue the run in {t.run_dir}, "
                         "--overwrite starts over: pass one of them")
    if t.num_threads is not None:
        torch.set_num_threads(t.num_threads)
    ctx = init_distributed(t.device, t.parallel)
    try:
        check_attention_backend(config.model, ctx.device)
        graphed = graphed_step(t, ctx.device)
        with run_dir_lock(Path(t.run_dir), ctx):
            return _train(config, ctx, resume, overwrite, graphed)
    finally:
        shutdown_distributed()


def graphed_step(t: TrainConfig, device: torch.device) -> bool:
    """Whether the training step is replayed from a CUDA graph (:mod:`nsa.train.graphs`):
    ``cuda_graph`` when given, and for None ("auto") wherever a graph applies: a CUDA device,
    one process or DDP, fixed shapes (no ``doc_masking``: ``TrainConfig.graph_fits``). An eager
    step of a small model is bound by the host issuing its kernels (m7c-125m with NSA at 8 x 2k
    on an H200: 73 ms eager against 61 graphed in bench/train_step.py), so the graph is the
    default where it can run.

    A function of the config and the resolved device alone: every rank of a run gets the same
    answer. ``cuda_graph=true`` off a CUDA device is a SetupError (its other refusals,
    ``parallel=fsdp`` and ``doc_masking``, come with the config).
    """
    if t.cuda_graph is None:
        return device.type == "cuda" and t.graph_fits
    if t.cuda_graph and device.type != "cuda":
        raise SetupError(f"cuda_graph=true needs a CUDA device, got {device.type}")
    return t.cuda_graph


def _train(config: RunConfig, ctx: DistContext, resume: bool, overwrite: bool,
           graphed: bool) -> TrainResult:
    """The run, on a checked launch and a locked run directory; ``graphed``: the step replayed
    from a CUDA graph (:func:`graphed_step`)."""
    t, device = config.train, ctx.device
    if resume == "auto":
        resume = bool(checkpoint_dirs(Path(t.run_dir)))
    run_dir = prepare_run_dir(Path(t.run_dir), resume, overwrite, ctx)
    tokenizer, train_stream, val_stream = open_data(t, ctx)
    eot = tokenizer.eot if t.doc_masking else None

    torch.manual_seed(t.seed)
    model = LanguageModel(config.model).to(device)
    if t.init_from is not None:
        init_weights(model, config, resume, ctx)
    model.checkpoint_blocks = t.activation_checkpointing
    flops_per_token = model_flops_per_token(config.model, t.seq_len, matmul_params(model))
    bf16 = t.autocast and device.type == "cuda"
    check_disk_space(run_dir, model)
    # A graphed step: the warm-up steps and the capture run on one side stream, on which DDP
    # is built too (nsa/train/graphs.py).
    graph_stream = torch.cuda.Stream(device) if graphed else None
    model = wrap_model(model, t.parallel, ctx, bf16=bf16, compile_blocks=t.compile,
                       fsdp_reshard=t.fsdp_reshard, fsdp_prefetch=t.fsdp_prefetch,
                       stream=graph_stream)
    optimizer = build_optimizer(model, t)
    start = 0
    if resume:
        start, data_state = load_checkpoint(latest_checkpoint(run_dir), model, optimizer, config,
                                            ctx)
        train_stream.load_state_dict(data_state)
    if start > t.max_steps:
        raise ValueError(f"the checkpoint is at step {start}, past max_steps={t.max_steps}")
    if ctx.is_main:
        (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")

    graph_step = None
    if graphed:
        graph_step = CUDAGraphStep(
            lambda inputs: forward_backward(model, inputs, device, t, graphed=True), optimizer,
            warmup=DDP_WARMUP_STEPS if t.parallel == "ddp" else WARMUP_STEPS,
            stream=graph_stream)
    tokens_per_step = t.batch_size * t.grad_accum * t.seq_len
    peak = peak_flops(device)
    log = print if ctx.is_main else (lambda *args, **kwargs: None)
    log(f"{unwrap(model).num_parameters():,} parameters ({config.model.attention.kind} "
        f"attention) on {ctx.world_size} x {device.type} ({t.parallel}) with "
        f"{torch.get_num_threads()} threads; {tokens_per_step:,} tokens/step; CUDA graph "
        f"{'on' if graphed else 'off'}{' (auto)' if t.cuda_graph is None else ''}; steps "
        f"{start} -> {t.max_steps}; run_dir {run_dir}", flush=True)
    metrics = MetricsLog(run_dir, start, tensorboard=t.tensorboard,
                         wandb_project=t.wandb_project,
                         wandb_config=config.to_dict()) if ctx.is_main else None
    progress = Progress(start, t.max_steps) if ctx.is_main else None
    throughput = Throughput(tokens_per_step)
    heartbeat = Heartbeat(run_dir, ctx.rank)
    watchdog = (Watchdog(run_dir, ctx.rank, t.watchdog_timeout_s,
                         first_timeout_s=t.watchdog_first_timeout_s)
                if t.watchdog_timeout_s is not None else None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    began = time.perf_counter()
    loss = None
    diverged = torch.zeros((), dtype=torch.bool, device=device)  # any bad step since the check
    with watchdog if watchdog is not None else nullcontext():
        for step in range(start + 1, t.max_steps + 1):
            lr = set_learning_rate(optimizer, step, t)
            micro = (train_stream.next_batch() for _ in range(t.grad_accum))
            if graph_step is None:
                local_loss, grad_norm = train_step(model, optimizer, micro, device, t, eot)
            else:
                local_loss, grad_norm = graph_step([model_inputs(x, y, device) for x, y in micro])
            loss = all_reduce_mean(local_loss, ctx)
            diverged |= ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
            throughput.step()
            heartbeat.beat(step)
            checkpoint_due = step % t.checkpoint_interval == 0 or step == t.max_steps
            if step % t.log_interval == 0 or checkpoint_due:
                check_finite(diverged, step, ctx)  # before any checkpoint: never save a bad one
            if step % t.log_interval == 0 or step == t.max_steps:
                record = step_record(step, loss, grad_norm, lr, throughput.read(),
                                     time.perf_counter() - began, flops_per_token, peak, ctx,
                                     device)
                if ctx.is_main:
                    metrics.log(record)
                    progress.update(step, summarize(record))
            if step % t.eval_interval == 0 and step < t.max_steps:
                val_loss = evaluate(model, val_stream, t.eval_steps, device, t.autocast, ctx,
                                    eot)
                if ctx.is_main:
                    metrics.log({"step": step, "val_loss": val_loss})
                    progress.write(f"step {step}: val loss {val_loss:.4f}")
                throughput.restart()
            if checkpoint_due:
                save_checkpoint(run_dir, step, model, optimizer, config,
                                train_stream.state_dict(), ctx, t.keep_checkpoints)
                throughput.restart()
            if watchdog is not None:
                watchdog.step_done(step)
        if progress is not None:
            progress.close()
        val_loss = evaluate(model, val_stream, t.eval_steps, device, t.autocast, ctx, eot)
    sample = ""
    if t.sample_tokens:  # every rank: FSDP gathers weights
        sample_tokenizer = load_sample_tokenizer(tokenizer, t, ctx)
        if sample_tokenizer is not None:
            sample = generate_sample(unwrap(model), sample_tokenizer, t, device)
    if ctx.is_main:
        metrics.log({"step": t.max_steps, "val_loss": val_loss,
                     "elapsed_s": time.perf_counter() - began})
        metrics.close()
        log(f"\n{sample}\n\nfinal val loss {val_loss:.4f} nats/token "
            f"({val_loss / math.log(2):.3f} bits/token) after {t.max_steps} steps", flush=True)
    barrier(ctx)
    train_loss = None if loss is None else loss.item()
    return TrainResult(t.max_steps, train_loss, val_loss, run_dir, sample)


def init_weights(model: nn.Module, config: RunConfig, resume: bool, ctx: DistContext) -> None:
    """``init_from`` into the plain (not yet wrapped) ``model`` of a fresh run: every rank reads
    the weights alike, and a failure on any rank stops them all. A resumed run started from
    them already: it keeps its own checkpoint's."""
    t = config.train
    if resume:
        if ctx.is_main:
            print(f"init_from={t.init_from} not applied: resuming the run in {t.run_dir}",
                  flush=True)
        return
    error = step = None
    try:
        step = load_init_weights(Path(t.init_from), model, config)
    except Exception as caught:  # raised below, on every rank
        error = caught
    fail_together(error, ctx, SetupError)
    if ctx.is_main:
        print(f"init from {t.init_from} (step {'not recorded' if step is None else step})",
              flush=True)


def check_finite(diverged: torch.Tensor, step: int, ctx: DistContext) -> None:
    """Raise on every rank together: a NaN in one rank's gradients reaches only that rank's
    norm, so the flag is combined over ranks first."""
    if ctx.distributed:
        flag = diverged.to(torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        diverged = flag.bool()
    if diverged.item():
        raise TrainingDiverged(f"a loss or gradient norm became NaN/inf at or before step "
                               f"{step}; stopped without saving (the last checkpoint is intact)")


def check_disk_space(run_dir: Path, model: nn.Module, margin: float = 1.5) -> None:
    """Fail before training when the run directory cannot hold one checkpoint (weights and two
    AdamW moments in float32, with ``margin``)."""
    needed = margin * 12 * sum(p.numel() for p in model.parameters())
    free = shutil.disk_usage(run_dir).free
    if free < needed:
        raise RunDirError(f"{run_dir} has {free / 2**30:.2f} GiB free; a checkpoint of this "
                          f"model needs about {needed / 2**30:.2f} GiB")


def step_record(step, loss, grad_norm, lr, tokens_per_s, elapsed, flops_per_token, peak,
                ctx: DistContext, device) -> dict:
    world_peak = None if peak is None else peak * ctx.world_size
    record = {"step": step, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
              "tokens_per_s": tokens_per_s, "elapsed_s": elapsed,
              **flops_metrics(tokens_per_s, flops_per_token, world_peak)}
    if device.type == "cuda":
        record["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return record


def load_tokenizer(t: TrainConfig) -> Tokenizer | type:
    """The tokenizer the data needs; synthetic data needs only the vocabulary size, which the
    tokenizer's class carries (so gpt2's files need not be present)."""
    if t.data == "synthetic":
        return TOKENIZERS[t.tokenizer]
    return get_tokenizer(t.tokenizer)


def tokenizer_loaded(tokenizer) -> bool:
    return not isinstance(tokenizer, type)


def load_sample_tokenizer(tokenizer: Tokenizer | type, t: TrainConfig,
                          ctx: DistContext) -> Tokenizer | None:
    """The tokenizer of the end-of-run sample: the data's, else loaded now. None on every rank,
    said in one line, when some rank cannot load it (tiktoken's GPT-2 files on a machine
    without internet access): synthetic data trains without it, and the run still ends well."""
    if tokenizer_loaded(tokenizer):
        return tokenizer
    try:
        loaded, problem = get_tokenizer(t.tokenizer), None
    except TokenizerUnavailableError as error:
        loaded, problem = None, str(error)
    problems = [p for p in all_gather_objects(problem, ctx) if p is not None]
    if not problems:
        return loaded
    if ctx.is_main:
        print(f"sample skipped (sample_tokens=0 turns it off): {problems[0]}", flush=True)
    return None


def open_data(t: TrainConfig, ctx: DistContext) -> tuple[Tokenizer | type, TokenStream,
                                                         TokenStream]:
    """(tokenizer, training stream, validation stream), checked before the first step on every
    rank together: the validation batches are read once, so that data which is missing,
    unreadable or too small for ``val_docs`` and ``eval_steps`` fails now, not at the first
    evaluation, and a rank that fails stops the others too."""
    error = None
    try:
        tokenizer = load_tokenizer(t)
        rows = local_batch_size(t.batch_size, ctx.world_size)
        stream_args = dict(tokenizer=tokenizer, batch_size=rows, seq_len=t.seq_len,
                           rank=ctx.rank, world_size=ctx.world_size, seed=t.seed,
                           val_fraction=t.val_fraction, val_docs=t.val_docs,
                           dataset_config=t.dataset_config, retries=t.data_retries,
                           backoff_s=t.data_backoff_s)
        train_stream = build_stream(t.data, "train", **stream_args)
        val_stream = build_stream(t.data, "val", **stream_args)
        for _ in range(t.eval_steps):
            val_stream.next_batch()
        val_stream.reset()
    except Exception as caught:  # raised below, on every rank
        error = caught
    fail_together(error, ctx, SetupError)
    return tokenizer, train_stream, val_stream


def check_attention_backend(model: ModelConfig, device: torch.device) -> None:
    """SetupError, before any work, when NSA's ``backend`` cannot run on ``device``."""
    if model.attention.kind != "nsa" or model.attention.backend != "triton":
        return
    if not TRITON_AVAILABLE:
        raise SetupError(f"backend=triton needs Triton ({TRITON_MISSING_REASON}): install it on "
                         "a CUDA machine, or backend=auto")
    if device.type != "cuda" and not TRITON_INTERPRET:
        raise SetupError("backend=triton needs a CUDA GPU (device=cuda): backend=auto or "
                         "backend=torch runs on the CPU")


def summarize(record: dict) -> str:
    text = (f"loss {record['loss']:.4f} | lr {record['lr']:.2e} | grad {record['grad_norm']:.2f}"
            f" | {record['tokens_per_s']:,.0f} tok/s | {record['tflops_per_s']:.1f} TFLOP/s")
    if "mfu" in record:
        text += f" | MFU {record['mfu']:.1%}"
    if "peak_mem_gb" in record:
        text += f" | {record['peak_mem_gb']:.1f} GB"
    return text


@contextmanager
def run_dir_lock(run_dir: Path, ctx: DistContext) -> Iterator[None]:
    """Hold ``run_dir``'s lock (:func:`lock_run_dir`) for the block. Rank 0 takes it; when it
    cannot, every rank raises the same RunDirError."""
    lock, error = None, None
    if ctx.is_main:
        try:
            lock = lock_run_dir(run_dir)
        except RunDirError as caught:
            error = caught
    fail_together(error, ctx, RunDirError)
    try:
        yield
    finally:
        if lock is not None:
            os.close(lock)


def lock_run_dir(run_dir: Path) -> int:
    """Take an exclusive ``flock`` on ``run_dir/.lock`` (creating ``run_dir``) and write the
    holder's pid and host into it; -> its file descriptor, whose closing releases the lock.
    The kernel releases it when the process dies, however it dies, so no lock outlives its run.
    RunDirError when another process holds it, naming that process, or ``run_dir`` cannot be
    written."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise RunDirError(f"run_dir {run_dir} is not writable: {error}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(lock, 256).decode(errors="replace").strip() or "another process"
        os.close(lock)
        raise RunDirError(f"run_dir {run_dir} is in use by {holder} (holding "
                          f"{run_dir / RUN_LOCK}): wait for that run to end, or train in "
                          "another run_dir=...") from None
    except OSError as error:  # a file system without locks
        os.close(lock)
        raise RunDirError(f"cannot lock run_dir {run_dir}: {error}") from None
    os.ftruncate(lock, 0)
    os.write(lock, f"pid {os.getpid()} on {socket.gethostname()}".encode())
    return lock


def prepare_run_dir(run_dir: Path, resume: bool, overwrite: bool = False,
                    ctx: DistContext | None = None) -> Path:
    """Create ``run_dir``. A fresh run never silently replaces an earlier run's checkpoints."""
    has_checkpoint = bool(checkpoint_dirs(run_dir))
    if resume and not has_checkpoint:
        raise RunDirError(f"no checkpoint to resume from in {run_dir / CHECKPOINTS}")
    if not resume and has_checkpoint:
        if not overwrite:
            raise RunDirError(
                f"{run_dir} already holds a run: pass --resume to continue it, --overwrite to "
                f"start over, or run_dir=... for a new directory")
        if ctx is None or ctx.is_main:
            print(f"{run_dir} holds an earlier run: starting over (--overwrite)")
            shutil.rmtree(run_dir / CHECKPOINTS)
    if ctx is not None:
        barrier(ctx)
    try:  # every rank: an unwritable directory fails here, before any training
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test.{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as error:
        raise RunDirError(f"run_dir {run_dir} is not writable: {error}") from None
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


def autocast(device: torch.device, enabled: bool, cache: bool = True) -> torch.autocast:
    """bf16 autocast on CUDA when ``enabled``; a no-op on the CPU. ``cache``: reuse a weight's
    bf16 copy within the autocast region."""
    return torch.autocast(device.type, dtype=torch.bfloat16,
                          enabled=enabled and device.type == "cuda", cache_enabled=cache)


def model_inputs(x: torch.Tensor, y: torch.Tensor, device: torch.device,
                 eot: int | None = None) -> dict[str, torch.Tensor]:
    """The model's arguments for a host batch (x, y) [B, T]: tokens and targets on ``device``.

    Document masking (``eot`` given): the rows are flattened into one packed row of B·T tokens
    and ``cu_seqlens`` gives its documents (:func:`~nsa.train.data.document_offsets`: row
    starts and the token after each eot), on the host, so one attention call serves the batch.
    The loss is the same mean over the same (token, target) pairs: the eot's target is still
    the next document's first token; only what each token attends to changes.
    """
    if eot is None:
        return {"tokens": to_device(x, device), "targets": to_device(y, device)}
    return {"tokens": to_device(x.reshape(1, -1), device),
            "targets": to_device(y.reshape(1, -1), device),
            "cu_seqlens": document_offsets(x, eot)}


def forward_backward(model: nn.Module, inputs: list[dict[str, torch.Tensor]],
                     device: torch.device, t: TrainConfig,
                     graphed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward and backward passes of one step over ``grad_accum`` micro-batches (the model's
    arguments, :func:`model_inputs`), then gradient clipping; gradients are reduced across ranks
    only on the last micro-batch. Returns (this rank's mean loss, global gradient norm before
    clipping) as device tensors (no host sync). No optimizer step. ``graphed``: the passes run
    in a :class:`~nsa.train.graphs.CUDAGraphStep` (the trainer's :func:`graphed_step`), not
    ``t.cuda_graph``, which may be None ("auto")."""
    total = torch.zeros((), device=device)
    for i, micro in enumerate(inputs):
        with gradient_sync(model, enabled=i == len(inputs) - 1):
            # No autocast weight cache in a CUDA graph: its casts would be captured once.
            with autocast(device, t.autocast, cache=not graphed):
                loss = model(**micro) / t.grad_accum
            loss.backward()
        total += loss.detach()
    max_norm = math.inf if t.grad_clip is None else t.grad_clip
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
        grad_norm = grad_norm.full_tensor()
    return total, grad_norm


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
               t: TrainConfig, eot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One eager optimizer step over ``grad_accum`` host micro-batches (x, y); ``eot``: masks
    documents (:func:`model_inputs`). Returns :func:`forward_backward`'s (loss, grad norm)."""
    inputs = [model_inputs(x, y, device, eot) for x, y in batches]
    loss, grad_norm = forward_backward(model, inputs, device, t)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host batch -> device without blocking the host: a copy from pageable memory would wait
    for the GPU to drain, and the host could no longer queue the next step's kernels early."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


@torch.no_grad()
def evaluate(model: nn.Module, stream: TokenStream, num_batches: int, device: torch.device,
             use_autocast: bool, ctx: DistContext, eot: int | None = None) -> float:
    """Mean loss (nats per token) over the first ``num_batches`` batches of ``stream``, averaged
    over ranks (every evaluation reads the same rows), documents masked as in training when
    ``eot`` is given."""
    model.eval()
    stream.reset()
    losses = []
    for _ in range(num_batches):
        x, y = stream.next_batch()
        with autocast(device, use_autocast):
            losses.append(model(**model_inputs(x, y, device, eot)))
    model.train()
    return all_reduce_mean(torch.stack(losses).mean(), ctx).item()


@torch.no_grad()
def generate_sample(model: LanguageModel, tokenizer: Tokenizer, t: TrainConfig,
                    device: torch.device) -> str:
    """``t.sample_prompt`` followed by ``t.sample_tokens`` sampled tokens, decoded, by the one
    sampling loop and its context rule (:mod:`nsa.models.decoding`). A bad setting raises
    ``ValueError`` naming the field."""
    from nsa.models.decoding import check_sampling

    check_sampling(max_new_tokens=t.sample_tokens, temperature=t.sample_temperature,
                   names={"max_new_tokens": "sample_tokens", "temperature": "sample_temperature"})
    if not t.sample_prompt:
        raise ValueError("sample_prompt must not be empty")
    model.eval()
    prompt = torch.tensor(tokenizer.encode(t.sample_prompt), device=device)[None]  # [1, P]
    generator = torch.Generator(device).manual_seed(t.seed)
    with autocast(device, t.autocast):
        tokens = model.generate(prompt, t.sample_tokens, temperature=t.sample_temperature,
                                generator=generator)
    model.train()
    return tokenizer.decode(tokens[0])


def sample_checkpoint(path: Path, prompt: str | None = None, num_tokens: int | None = None,
                      temperature: float | None = None, device: str = "auto") -> str:
    """A sample from a run directory's newest checkpoint or from an exported model file.
    ``prompt``, ``num_tokens`` and ``temperature`` override the run's ``sample_prompt``,
    ``sample_tokens`` and ``sample_temperature``; a bad value raises ``ValueError`` naming
    that field."""
    config, model, _ = load_model(path)
    overrides = {"sample_prompt": prompt, "sample_tokens": num_tokens,
                 "sample_temperature": temperature}
    t = replace(config.train, **{k: v for k, v in overrides.items() if v is not None})
    target = resolve_device(device)
    return generate_sample(model.to(target), get_tokenizer(t.tokenizer), t, target)


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
