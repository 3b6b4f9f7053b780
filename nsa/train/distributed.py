"""torch.distributed for the trainer: the process group under torchrun, and the model wrappers.

torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) is read once, in :func:`init_distributed`,
before the model is built; a plain ``python`` run (``parallel=none``) is a world of one with no
process group.
Every rank builds the same model and runs the same graph: nothing below branches on the rank.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from nsa.train.errors import SetupError

PARALLEL = ("none", "ddp", "fsdp")


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def init_distributed(device_name: str, parallel: str) -> DistContext:
    """Join torchrun's process group when ``parallel`` is "ddp" or "fsdp" (NCCL on CUDA, gloo on
    the CPU). SetupError, before anything starts, when the launch does not fit the settings:
    ``parallel`` without torchrun, several processes without ``parallel``, no GPU for CUDA
    or for a local rank."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if parallel != "none" and not launched:
        raise SetupError(f"parallel={parallel} needs torchrun: torchrun --nproc_per_node N -m "
                         f"nsa.train ... parallel={parallel}, or parallel=none for one process")
    if parallel == "none" and world_size > 1:
        raise SetupError(f"{world_size} processes (torchrun) need parallel=ddp or parallel=fsdp")
    device = resolve_device(device_name)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise SetupError(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} "
                             f"visible; start at most that many processes per node "
                             f"(torchrun --nproc_per_node) or train with device=cpu")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if parallel != "none" and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=_attempt_store(rank, world_size), rank=rank,
                                world_size=world_size,
                                device_id=device if device.type == "cuda" else None)
    return DistContext(rank, world_size, local_rank, device)


def resolve_device(name: str) -> torch.device:
    """"auto" (CUDA when there is a GPU, else the CPU), "cpu" or "cuda"; SetupError for "cuda"
    without a GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SetupError("device=cuda but no CUDA GPU is available here: device=cpu or "
                         "device=auto")
    return torch.device(name)


def _attempt_store(rank: int, world_size: int) -> dist.Store:
    """torchrun's store, with keys prefixed by the restart attempt: after ``--max-restarts``
    brings a job back, the new processes must not read the dead ones' addresses (which makes
    the process group's connection fail)."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_store)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"nsa/attempt_{attempt}", store)


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def all_reduce_mean(x: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """The mean of ``x`` over ranks (a new tensor; asynchronous on the device, no host sync)."""
    x = x.detach().clone()
    if ctx.distributed:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x /= ctx.world_size
    return x


def all_gather_objects(obj, ctx: DistContext) -> list:
    """Every rank's ``obj``, in rank order (picklable objects)."""
    if not ctx.distributed:
        return [obj]
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def fail_together(error: Exception | None, ctx: DistContext,
                  error_type: type[Exception]) -> None:
    """Every rank calls this after work that may fail on some ranks only (``error`` is this
    rank's failure, or None). When any rank failed, every rank raises: a failed rank its own
    ``error``, the others ``error_type`` with the first failed rank's message. So no rank goes on
    into a collective that a stopped rank will never join."""
    messages = all_gather_objects(None if error is None else str(error), ctx)
    if error is not None:
        raise error
    failed = [message for message in messages if message is not None]
    if failed:
        raise error_type(failed[0])


def wrap_model(model: nn.Module, parallel: str, ctx: DistContext, *, bf16: bool,
               compile_blocks: bool, fsdp_reshard: bool = True, fsdp_prefetch: int = 0,
               stream: torch.cuda.Stream | None = None) -> nn.Module:
    """Per-block torch.compile, then DDP or FSDP2 (``fully_shard`` per block, then the root).

    DDP is built on ``stream`` where one is given: the stream a CUDA-graph step warms up and
    captures on (nsa/train/graphs.py).

    FSDP2 keeps bf16 parameters for compute (``bf16``) and reduces gradients in float32; each
    block frees its gathered parameters after its forward (``fsdp_reshard``) or keeps them for
    its backward, and gathers the next ``fsdp_prefetch`` blocks' (0: FSDP2's own order) ahead
    of use, in forward and in backward.
    """
    if parallel not in PARALLEL:
        raise ValueError(f"parallel must be one of {PARALLEL}, got {parallel!r}")
    if compile_blocks:
        for block in model.blocks:
            block.compile()
    if parallel == "ddp":
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        if stream is None:
            return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
        # Its broadcast of rank 0's weights runs on ``stream``: ordered against the work
        # before it and after it on the current stream.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            wrapped = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
        torch.cuda.current_stream().wait_stream(stream)
        return wrapped
    if parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            MixedPrecisionPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )

        # The mesh names the run's device type: FSDP2's default mesh takes the accelerator
        # whenever one exists, so CPU ranks on a one-GPU machine would ask for GPU 1.
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                      reduce_dtype=torch.float32)
        # Decoding enters blocks and the root through methods other than forward: FSDP must
        # gather their parameters around those calls too (a block's new_cache keeps a fused
        # copy of its projection weights).
        blocks = list(model.blocks)
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy,
                        reshard_after_forward=fsdp_reshard)
            for method in ("new_cache", "prefill", "decode"):
                register_fsdp_forward_method(block, method)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        for method in ("prefill", "decode_step"):
            register_fsdp_forward_method(model, method)
        if fsdp_prefetch:
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + fsdp_prefetch])
                block.set_modules_to_backward_prefetch(
                    blocks[max(0, i - fsdp_prefetch):i][::-1])
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The LanguageModel inside a DDP wrapper (FSDP2 shards in place, keeping the class)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def gradient_sync(model: nn.Module, enabled: bool):
    """Context for one micro-batch: reduce gradients only on the last one of an accumulation."""
    if isinstance(model, nn.parallel.DistributedDataParallel) and not enabled:
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
    return nullcontext()
