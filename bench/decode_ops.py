"""Count the operations one decode step launches, NSA against dense, per layer and per token.

    python bench/decode_ops.py                     # m7c-125m, on the CPU
    python bench/decode_ops.py --preset tiny --batch 2

A graphed decode step of a small model costs about the same per kernel whatever the kernel
does (BENCHMARKS.md, Decoding v2: ~2.7 µs on an H200 for NSA and dense alike), so the count of
kernels predicts tokens/s. This runs one ``decode_step`` of the preset (random weights,
float32, after a prefill) under a dispatch mode that records every aten op except views and
allocations (which launch nothing). The ops inside ``nsa_decode`` are counted apart: on CUDA
they are the three fused Triton kernels, here the PyTorch step. A RoPE rotation counts as one
kernel (``rope``) for up to three tensors, as it runs on CUDA (nsa/ops/triton/rope.py: the
queries of NSA, the queries and keys of dense, nsa.layers.projection), and so does the append of a
step's keys and values to NSA's caches (``append_kv``, nsa/ops/triton/cache_append.py); the
compressed-token update counts as its kernels (``compress``, nsa/ops/triton/cache_compress.py:
two per K/V set for the MLP compressor, one for the mean).
"""

from __future__ import annotations

import argparse
import collections
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nsa.layers.attention
import nsa.layers.projection
from nsa.models import LanguageModel, model_preset

NO_KERNEL_OPS = {"view", "_unsafe_view", "_reshape_alias", "reshape", "expand", "transpose",
            "permute", "t", "slice", "select", "unsqueeze", "squeeze", "split",
            "split_with_sizes", "unbind", "as_strided", "alias", "detach", "lift_fresh",
            "flatten", "view_as", "unfold", "narrow", "empty"}  # views and allocations
FUSED_DECODE_KERNELS = 3  # nsa/ops/triton/decode.py
ATTENTION = "nsa_decode"  # OpCounter.apart: the ops of the attention step, counted apart


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that launch work, dispatched while active: apart inside
    ``nsa_decode``, and as one kernel inside a function that is one kernel on CUDA."""

    def __init__(self):
        super().__init__()
        self.layer = collections.Counter()  # op name -> count, outside nsa_decode
        self.attention = 0  # ops inside nsa_decode
        self.scope: str | None = None  # the counted-apart call being run: ATTENTION or a kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in NO_KERNEL_OPS and self.scope is None:
            self.layer[name] += 1
        elif name not in NO_KERNEL_OPS and self.scope == ATTENTION:
            self.attention += 1
        return func(*args, **(kwargs or {}))

    def apart(self, real, kernel: str = ATTENTION, launches: int = 1):
        """``real`` counted apart: its ops into ``attention`` (``kernel=ATTENTION``, for
        ``nsa_decode``), or as the ``launches`` kernels ``kernel`` it launches on CUDA. Within
        an outer counted-apart call, the outer one decides."""
        def counted(*args, **kwargs):
            outer = self.scope
            self.scope = outer or kernel
            try:
                return real(*args, **kwargs)
            finally:
                self.scope = outer
                if outer is None and kernel != ATTENTION:
                    self.layer[kernel] += launches
        return counted


def count_decode_step(preset: str, kind: str, batch: int, prompt: int,
                      compress: bool = True) -> OpCounter:
    """The ops of one decode step of ``preset`` with ``kind`` attention after a prompt
    (``compress=False``: without NSA's compressed-token update, as the sampling loop runs the
    steps that complete none)."""
    config = model_preset(preset, kind=kind)
    torch.manual_seed(0)
    model = LanguageModel(config).eval()
    cache = model.new_cache(batch, prompt + 8)
    tokens = torch.randint(0, config.vocab_size, (batch, prompt))
    counter = OpCounter()
    with torch.no_grad():
        model.prefill(tokens, cache, torch.full((batch,), prompt))
        rope = counter.apart(nsa.layers.projection._rotated, "rope")  # up to 3 tensors
        append = counter.apart(nsa.layers.attention.append_kv, "append_kv")
        # per K/V set on CUDA (nsa/ops/triton/cache_compress.py): two kernels for the MLP
        # compressor (its first product, then the rest), one for the mean
        per_set = 2 if config.attention.compressor == "mlp" else 1
        update = counter.apart(nsa.layers.attention.NSAttention._append_compressed,
                               "compress", launches=2 * per_set)
        with mock.patch.object(nsa.layers.attention, "nsa_decode",
                               counter.apart(nsa.layers.attention.nsa_decode)), \
                mock.patch.object(nsa.layers.projection, "_rotated", rope), \
                mock.patch.object(nsa.layers.attention, "append_kv", append), \
                mock.patch.object(nsa.layers.attention.NSAttention, "_append_compressed",
                                  update), counter:
            model.decode_step(tokens[:, -1], cache, compress)
    return counter


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="m7c-125m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--top", type=int, default=12, help="most frequent ops to list")
    args = parser.parse_args(argv)
    config = model_preset(args.preset)
    layers, every = config.num_layers, config.attention.nsa.cmp_stride
    print(f"# {args.preset}, {layers} layers, B={args.batch}, one decode step on the CPU")
    print("| step | ops per token | per layer | + fused attention kernels (CUDA) | "
          "most frequent |\n|---|---|---|---|---|")
    full, skipped = "nsa, completing a compressed token", f"nsa, the other {every - 1} of {every}"
    rows = {}
    for name, kind, compress in ((full, "nsa", True), (skipped, "nsa", False),
                                 ("dense", "dense", True)):
        counter = count_decode_step(args.preset, kind, args.batch, args.prompt, compress)
        total = sum(counter.layer.values())
        launches = FUSED_DECODE_KERNELS * layers if counter.attention else 0
        rows[name] = total + launches
        common = ", ".join(f"{n} {c}" for n, c in counter.layer.most_common(args.top))
        print(f"| {name} | {total} | {total / layers:.1f} | {launches} | {common} |")
    rows["nsa, mean"] = (rows[full] + (every - 1) * rows[skipped]) / every
    print(f"\nNSA / dense kernels per token on CUDA: {rows[full] / rows['dense']:.2f} with the "
          f"compressed-token update, {rows['nsa, mean'] / rows['dense']:.2f} averaged over "
          f"the {every} steps of a compression stride")
    return rows


if __name__ == "__main__":
    main()
