"""Host (issue) time against GPU time of one NSA op forward+backward at a training shape.

    python bench/op_host.py                        # m7c-125m layer shape, B = 8, T = 2048
    python bench/op_host.py --batch 1 --seq 16384
    python bench/op_host.py --kernels --json op.json   # also the GPU time of each kernel

The op is host-bound where the Python that issues its kernels takes longer than the GPU runs
them (issue 11 asks host time below GPU time at the m7c shape, B = 8). The inputs are shaped
and laid out as the layer passes them (``layer_inputs``), so their backward costs what the
layer's does. Host time: ``--calls``
calls issued without a synchronize, median of ``--repeats``; GPU time: the kernels' time from
torch.profiler (CUDA only). On the CPU (PyTorch backend) the two are one. ``--kernels`` adds
the time of each kernel of one forward+backward (``kernel_ms``; on the CPU each operator's):
run it in two trees to compare versions kernel by kernel.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from attention import PAPER  # bench/attention.py: the paper's block parameters
from train_step import synchronize

import nsa
from nsa.layers.projection import Heads, HeadsLayout, split_heads
from nsa.train.checkpoint import atomic_write_json


def layer_inputs(B, T, HQ, H, D, dtype, device):
    """The inputs of the op as an NSA layer passes them -> (a function that gives q, k, v,
    k_cmp, v_cmp, gates, k_win, v_win; the leaves their gradients reach). The values are
    strided views of one projection [B, T, 3 · H · 2D] (its K/V sets), split from it at each
    call as the layer splits it at each forward (``split_heads``: its backward writes the
    projection's gradient once), so the leaves hold the projection in place of the values. The
    queries and keys are contiguous tensors, as the layer's RoPE kernel writes them."""
    Tc = nsa.compressed_length(T, PAPER["cmp_block"], PAPER["cmp_stride"])
    make = lambda *s: torch.randn(*s, dtype=dtype, device=device, requires_grad=True)  # noqa: E731
    width = 3 * H * 2 * D
    projection = make(B, T, width)
    values = HeadsLayout(tuple(Heads(s * H * 2 * D + D, H, 2 * D, D) for s in (1, 2)), width)
    gates = torch.rand(B, T, HQ, 3, dtype=dtype, device=device, requires_grad=True)
    q, k, k_cmp, v_cmp, k_win = (make(B, T, HQ, D), make(B, T, H, D), make(B, Tc, H, D),
                                 make(B, Tc, H, D), make(B, T, H, D))

    def inputs():
        v, v_win = split_heads(projection, values)
        return q, k, v, k_cmp, v_cmp, gates, k_win, v_win

    return inputs, (q, k, projection, k_cmp, v_cmp, gates, k_win)


def measure(B, T, HQ, H, D, calls: int, repeats: int, device: torch.device,
            kernels: bool = False) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    inputs, leaves = layer_inputs(B, T, HQ, H, D, dtype, device)
    grad = torch.randn_like(leaves[0])

    def forward():
        q, k, v, k_cmp, v_cmp, gates, k_win, v_win = inputs()
        return nsa.nsa_attention(q, k, v, k_cmp, v_cmp, gates, k_win=k_win, v_win=v_win,
                                 **PAPER)

    def forward_backward():
        # The gradients are returned, not accumulated into .grad: in the layer they flow on to
        # the projections, with no addition into a leaf's gradient.
        torch.autograd.grad(forward(), leaves, grad)

    result = {}
    for name, fn in (("fwd", forward), ("fwd_bwd", forward_backward)):
        for _ in range(3):  # compile, build tables
            fn()
        synchronize(device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start) / calls * 1e3)
            synchronize(device)
        result[f"{name}_host_ms"] = statistics.median(times)
    if device.type == "cuda" or kernels:  # one profile gives both
        times = kernel_ms(forward_backward, calls, device)
        if device.type == "cuda":
            result["fwd_bwd_gpu_ms"] = sum(times.values())
        if kernels:
            result["fwd_bwd_kernels_ms"] = times
    return result


def kernel_ms(fn, calls: int, device: torch.device) -> dict[str, float]:
    """Milliseconds per call of fn by kernel name, largest first: the self device time of
    each CUDA kernel it launches (torch.profiler), free of the host time that a call's wall
    time is wherever the host is slower than the GPU (small shapes); on the CPU each
    operator's self CPU time. One call first, unprofiled (compiles, allocates)."""
    cuda = device.type == "cuda"
    fn()
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(calls):
            fn()
        synchronize(device)
    times = {}
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us > 0:
            times[event.key] = us / calls / 1e3
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def gpu_ms(fn, calls: int, kernels: tuple[str, ...] = ("",)) -> float:
    """Milliseconds of GPU time per call of fn (``kernel_ms``), only the kernels whose names
    contain one of ``kernels`` when given."""
    times = kernel_ms(fn, calls, torch.device("cuda"))
    return sum(ms for name, ms in times.items() if any(k in name for k in kernels))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", default="12,2", help="HQ,H (default: m7c-125m)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kernels", action="store_true",
                        help="also the time of each kernel of one forward+backward")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args(argv)
    HQ, H = (int(x) for x in args.heads.split(","))
    device = torch.device(args.device)
    r = measure(args.batch, args.seq, HQ, H, args.dim, args.calls, args.repeats, device,
                args.kernels)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}, B={args.batch}, T={args.seq}, HQ={HQ}, H={H}, D={args.dim}")
    print("| fwd host ms | fwd+bwd host ms | fwd+bwd GPU ms |")
    print("|---|---|---|")
    gpu = f"{r['fwd_bwd_gpu_ms']:.2f}" if "fwd_bwd_gpu_ms" in r else "(CPU)"
    print(f"| {r['fwd_host_ms']:.2f} | {r['fwd_bwd_host_ms']:.2f} | {gpu} |")
    if args.kernels:
        print("\n| kernel (one forward+backward) | ms |\n|---|---|")
        for kernel, ms in r["fwd_bwd_kernels_ms"].items():
            print(f"| {kernel[:80]} | {ms:.4f} |")
    if args.json:
        shape = dict(batch=args.batch, seq=args.seq, heads=[HQ, H], dim=args.dim)
        atomic_write_json(Path(args.json), dict(device=name, torch=torch.__version__,
                                                shape=shape, **r))
    return r


if __name__ == "__main__":
    main()
