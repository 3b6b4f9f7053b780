"""Registers, spilled registers and shared memory of every compiled NSA Triton kernel after one
forward+backward of the op (a kernel that spills is the first thing to fix; bench/NOTES.md v8).

    PYTHONPATH=. python3 bench/registers.py --seq 16384 --heads 64,4 --dim 128
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import torch
import triton

import nsa
import nsa.ops.triton as kernels
from nsa.ops.triton.jit import triton_function


def compiled_kernels():
    """(module.kernel name, compiled kernel) for every compiled variant of every Triton kernel of
    nsa.ops.triton."""
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, fn in vars(module).items():
            fn = triton_function(fn)
            if isinstance(fn, triton.runtime.jit.JITFunction):
                for cache in fn.device_caches.values():
                    for kernel in cache[0].values():
                        kernel._init_handles()
                        yield f"{info.name}.{name}", kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--heads", default="64,4", help="HQ,H")
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    HQ, H = map(int, args.heads.split(","))
    T, D, C = args.seq, args.dim, nsa.compressed_length(args.seq, 32, 16)

    def make(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, device="cuda", requires_grad=True)

    q, k, v = make(1, T, HQ, D), make(1, T, H, D), make(1, T, H, D)
    gates = torch.rand(1, T, HQ, 3, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    out = nsa.nsa_attention(q, k, v, make(1, C, H, D), make(1, C, H, D), gates,
                            backend="triton")
    out.float().square().sum().backward()
    torch.cuda.synchronize()
    print(f"T={T} HQ={HQ} H={H} D={D} on {torch.cuda.get_device_name()}")
    print("| kernel | registers | spilled | shared KiB | warps |\n|---|---|---|---|---|")
    for name, kernel in compiled_kernels():
        print(f"| {name} | {kernel.n_regs} | {kernel.n_spills} | "
              f"{kernel.metadata.shared / 1024:.0f} | {kernel.metadata.num_warps} |")


if __name__ == "__main__":
    main()
