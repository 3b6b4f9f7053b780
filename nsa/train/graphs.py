"""A training step replayed from one CUDA graph: the host issues the step's forward and
backward (every micro-batch, and gradient clipping) once, and each later step costs one graph
launch. Without it a small model's step is bound by the host: an NSA step of m7c-125m issues
~100 ms of PyTorch and Triton launches for ~93 ms of GPU work (bench/NOTES.md, v12).

What a graph requires, and how the step meets it:
- Static memory: the inputs are copied into tensors the graph owns; gradients are assigned
  (not accumulated) by the captured backward, so they stay where the capture put them and are
  never set to None after it; everything the op caches for a shape (its int32 tables) is
  built by the eager warm-up steps before the capture and kept for the process.
- No host sync and no host decision inside the step: the NSA op and the model make none
  (shapes fix every launch); packed documents (``doc_masking``) change their boundaries per
  batch and are refused by the trainer, as is FSDP2 (it gathers and frees parameters around
  each block).
- DDP (``parallel=ddp``): the gradient all-reduces are captured with the backward (NCCL
  collectives can be, and PyTorch's NCCL watchdog leaves captured work alone). As PyTorch's
  CUDA-graph notes ask, DDP is built on the stream the warm-up and the capture run on
  (``stream``), and at least DDP_WARMUP_STEPS eager steps come before the capture: DDP
  rebuilds its gradient buckets in the first steps, and the graph must hold the final ones.
- The optimizer step runs eagerly after each replay (a few fused launches), so learning-rate
  changes and checkpoints see plain Python numbers and the optimizer's usual state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

WARMUP_STEPS = 2  # eager steps before the capture: Triton compiles, cuBLAS and caches settle
DDP_WARMUP_STEPS = 11  # under DDP (module docstring)

Inputs = list[dict[str, torch.Tensor]]  # the model's keyword arguments, one dict per micro-batch


class CUDAGraphStep:
    """``step(inputs)`` runs ``forward_backward(inputs)`` (the step's forward and backward
    passes, returning tensors such as the loss) and then ``optimizer.step()``: eagerly for the
    first ``warmup`` calls, then from one CUDA graph captured at the next call and replayed at
    every later one. Returns copies of what ``forward_backward`` returned.

    The warm-up steps and the capture run on ``stream`` (a new side stream if None; under DDP
    the one DDP was built on). Every call must pass inputs of the shapes and dtypes of the
    first (ValueError otherwise).
    """

    def __init__(self, forward_backward: Callable[[Inputs], tuple[torch.Tensor, ...]],
                 optimizer: torch.optim.Optimizer, warmup: int = WARMUP_STEPS,
                 stream: torch.cuda.Stream | None = None):
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (the capture needs a warm step), got {warmup}")
        self.forward_backward, self.optimizer, self.warmup = forward_backward, optimizer, warmup
        self.stream = stream
        self.calls = 0
        self.signature: list[dict] | None = None  # the inputs' shapes, dtypes and devices
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: Inputs | None = None
        self.static_outputs: tuple[torch.Tensor, ...] = ()

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, inputs: Inputs) -> tuple[torch.Tensor, ...]:
        self._check(inputs)
        self.calls += 1
        if self.calls <= self.warmup:
            return self._eager(inputs)
        if self.graph is None:
            self._capture(inputs)
        for static, new in zip(self.static_inputs, inputs):
            for name, tensor in new.items():
                static[name].copy_(tensor, non_blocking=True)
        self.graph.replay()
        self.optimizer.step()
        return tuple(out.clone() for out in self.static_outputs)

    def _check(self, inputs: Inputs) -> None:
        signature = [{name: (t.shape, t.dtype, t.device) for name, t in micro.items()}
                     for micro in inputs]
        if self.signature is None:
            self.signature = signature
        elif signature != self.signature:
            raise ValueError("a CUDA-graph step needs the same input shapes at every step: got "
                             f"{signature}, first {self.signature}")

    def _eager(self, inputs: Inputs) -> tuple[torch.Tensor, ...]:
        # On the capture's side stream: lazy initialisations (cuBLAS handles and workspaces,
        # Triton modules) then belong to a stream other than the default one.
        side = self._side_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            outputs = self.forward_backward(inputs)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)  # the capture's backward assigns them
        torch.cuda.current_stream().wait_stream(side)
        return tuple(out.clone() for out in outputs)

    def _side_stream(self) -> torch.cuda.Stream:
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        return self.stream

    def _capture(self, inputs: Inputs) -> None:
        self.static_inputs = [{name: t.clone() for name, t in micro.items()} for micro in inputs]
        self.graph = torch.cuda.CUDAGraph()
        side = self._side_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(self.graph, stream=side):
            self.static_outputs = tuple(self.forward_backward(self.static_inputs))
