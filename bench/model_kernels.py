"""The language model's own kernels against the PyTorch forms they replace, forward+backward at
a training shape: the norm and the residual add with the norm after it (nsa/ops/triton/
rms_norm.py), the MLP activation (silu(gate) · up, nsa/ops/triton/swiglu.py) and the loss (the
mean cross-entropy, nsa/ops/triton/cross_entropy.py).

    python bench/model_kernels.py                          # m7c-125m: 8 x 2048 tokens, bf16
    python bench/model_kernels.py --tokens 4096 --json model_kernels.json

Each row: the PyTorch form as the model ran it before (``F.rms_norm`` of the float32 residual
stream, its output cast once to the dtype as autocast's projections cast it, after ``x +
update`` in the second row; ``F.silu(gate) * up`` of the product's halves; ``F.cross_entropy``
of the float32 logits) and the kernels, each timed over one forward and its backward
(on CUDA the GPU time of its kernels, bench/op_host.py's ``gpu_ms`` (torch.profiler), as a
graphed training step runs them: a wall-clock timer measured the norms' host path, their
Python autograd functions, which exceeds their kernels at this size; on the CPU the median
wall time of a few calls, the kernels in Triton's interpreter), and the largest
difference of their outputs and input gradients, which must agree to the dtype's rounding.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.nn.functional as F
from decode import bench
from op_host import gpu_ms

from nsa.models.config import ModelConfig
from nsa.train.checkpoint import atomic_write_json

NORM_EPS = ModelConfig.norm_eps  # the model's default


def _pytorch_activation(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _pytorch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps).to(dtype)


def _pytorch_add_norm(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float,
                      dtype: torch.dtype):
    h = x + update
    return h, _pytorch_norm(h, weight, eps, dtype)


def _pytorch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets)


def cases(tokens: int, dim: int, hidden: int, vocab: int, dtype: torch.dtype,
          device: torch.device):
    """(name, PyTorch form, kernel form, inputs, the leaf whose gradient is compared, the
    outputs' gradients) of each kernel; inputs seeded. The norms read a float32 residual
    stream [tokens, dim] (an update in ``dtype``) and write ``dtype``, as under autocast."""
    from nsa.ops.triton.cross_entropy import cross_entropy_triton
    from nsa.ops.triton.rms_norm import add_rms_norm_triton, rms_norm_triton
    from nsa.ops.triton.swiglu import swiglu_triton

    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=g).to(device).requires_grad_()
    update = torch.randn(tokens, dim, generator=g).to(device, dtype).requires_grad_()
    weight = (1 + torch.randn(dim, generator=g) / 4).to(device).requires_grad_()
    d_normed = torch.randn(tokens, dim, generator=g).to(device, dtype)
    d_sum = torch.randn(tokens, dim, generator=g).to(device)
    gate_up = torch.randn(tokens, 2 * hidden, generator=g).to(device, dtype).requires_grad_()
    d_activation = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    logits = torch.randn(tokens, vocab, generator=g).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    return [
        ("RMSNorm", _pytorch_norm, rms_norm_triton, (x, weight, NORM_EPS, dtype), x, d_normed),
        ("add + RMSNorm", _pytorch_add_norm, add_rms_norm_triton,
         (x, update, weight, NORM_EPS, dtype), x, (d_sum, d_normed)),
        ("MLP activation", _pytorch_activation, swiglu_triton, (gate_up,), gate_up,
         d_activation),
        ("loss", _pytorch_loss, cross_entropy_triton, (logits, targets), logits,
         torch.ones((), device=device)),
    ]


def forward_backward(form, inputs, leaf: torch.Tensor, grad):
    """(form's output, its last where several, the leaf's gradient) of one forward and its
    backward (``grad``: the output's gradient, or a tuple of the outputs')."""
    out = form(*inputs)
    outs, grads = (out, grad) if isinstance(out, tuple) else ((out,), (grad,))
    return outs[-1], torch.autograd.grad(outs, leaf, grads)[0]


def timed(fn, cuda: bool) -> float:
    """ms of fn(): its kernels' GPU time per call on CUDA, wall time on the CPU (module
    docstring)."""
    return gpu_ms(fn, calls=20) if cuda else bench(fn, cuda=False)


def run(tokens: int, dim: int, hidden: int, vocab: int, dtype: torch.dtype,
        device: torch.device) -> list[dict]:
    rows, cuda = [], device.type == "cuda"
    for name, pytorch_form, kernel_form, inputs, leaf, grad in cases(tokens, dim, hidden, vocab,
                                                                     dtype, device):
        args = inputs, leaf, grad
        out, leaf_grad = forward_backward(kernel_form, *args)
        ref, ref_grad = forward_backward(pytorch_form, *args)
        rows.append({
            "kernel": name, "tokens": tokens,
            "pytorch_ms": timed(partial(forward_backward, pytorch_form, *args), cuda),
            "triton_ms": timed(partial(forward_backward, kernel_form, *args), cuda),
            "max_out_diff": (out.float() - ref.float()).abs().max().item(),
            "max_grad_diff": (leaf_grad.float() - ref_grad.float()).abs().max().item(),
        })
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8 * 2048, help="rows (batch x sequence)")
    parser.add_argument("--dim", type=int, default=768, help="the model's width (the norms')")
    parser.add_argument("--hidden", type=int, default=2048, help="the MLP's hidden width")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = run(args.tokens, args.dim, args.hidden, args.vocab, dtype, device)
    print(f"# {name}, {args.tokens} tokens, width {args.dim}, hidden {args.hidden}, "
          f"vocabulary {args.vocab}, {args.dtype}, forward+backward")
    print("| kernel | PyTorch (ms) | Triton (ms) | speed-up | max out diff | max grad diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['pytorch_ms']:.3f} | {r['triton_ms']:.3f} | "
              f"{r['pytorch_ms'] / r['triton_ms']:.2f}x | {r['max_out_diff']:.2e} | "
              f"{r['max_grad_diff']:.2e} |")
    if args.json:
        atomic_write_json(args.json, {"device": name, "dtype": args.dtype, "rows": rows})


if __name__ == "__main__":
    main()
