"""GPU time of a layer's two MLP compressors (nsa.layers.compressor) forward and
forward+backward: the Triton kernels (nsa/ops/triton/compressor.py) taking both in one launch
("pair", as the layer runs them) or each in its own, against the PyTorch form, measured in the
same run, each kernel listed.

    python bench/compressor.py                          # m7c-125m's: 8 x 2048, 2 heads, D 64
    python bench/compressor.py --rows 16,32,64 --splits 4,8,16 --json out.json

The inputs are strided views of a projection as the layer passes them (three K/V sets of H
heads: the first set's keys and values); weights in float32 under bf16 autocast, as in
training. ``--rows`` also times each Triton kernel with each of the given rows per program
(the others as shipped), ``--splits`` the weights' gradients with each number of row splits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from op_host import kernel_ms  # bench/op_host.py

from nsa.layers.compressor import Compressor, compress_all
from nsa.ops.triton import compressor as triton_compressor
from nsa.train.checkpoint import atomic_write_json

CALLS = 30
KERNELS = dict(forward="_compress_fwd_kernel", hidden_grad="_hidden_grad_kernel",
               input_grad="_input_grad_kernel", weight_grads="_weight_grads_kernel")


def workload(B, T, H, D, block, stride, hidden):
    """A layer's two compressors (keys', values') on their strided views of one projection
    -> (the compressors, forward, forward+backward)."""
    torch.manual_seed(0)
    modules = [Compressor(D, block, stride, "mlp", hidden).cuda() for _ in range(2)]
    projection = torch.randn(B, T, 3 * H * 2 * D, device="cuda", dtype=torch.bfloat16)
    heads = projection.view(B, T, 3 * H, 2 * D)
    xs = [heads[:, :, :H, :D].requires_grad_(), heads[:, :, :H, D:].requires_grad_()]
    leaves = [*xs, *(p for m in modules for p in m.parameters())]
    form = ["pair"]

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if form[0] == "pair":
                return compress_all(modules, xs)
            return [m(x) for m, x in zip(modules, xs)]

    grads = [torch.randn_like(out) for out in forward()]

    def forward_backward():
        torch.autograd.grad(forward(), leaves, grads)

    return modules, form, forward, forward_backward


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=2, help="KV heads")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--stride", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=None, help="default 2 x dim")
    parser.add_argument("--rows", default="", help="rows per program to sweep, e.g. 16,32,64")
    parser.add_argument("--splits", default="",
                        help="row splits of the weights' gradients to sweep, e.g. 4,8,16")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the Triton form runs on CUDA only)")
    modules, form, forward, forward_backward = workload(args.batch, args.seq, args.heads,
                                                        args.dim, args.block, args.stride,
                                                        args.hidden)
    print(f"# {torch.cuda.get_device_name()}, B={args.batch}, T={args.seq}, H={args.heads}, "
          f"D={args.dim}, l={args.block}, d={args.stride}, bf16 autocast; GPU ms per call of "
          f"a layer's two compressors")
    results = {}
    for name in ("triton pair", "triton each", "pytorch"):
        form[0] = name.split()[-1]
        if name == "pytorch":  # the modules' own fallback: the PyTorch form
            for m in modules:
                m.triton_dtype = lambda x, first: None
        fwd, fwd_bwd = kernel_ms(forward, CALLS, torch.device("cuda")), \
            kernel_ms(forward_backward, CALLS, torch.device("cuda"))
        results[name] = dict(fwd_ms=sum(fwd.values()), fwd_bwd_ms=sum(fwd_bwd.values()),
                             kernels=fwd_bwd)
    for m in modules:
        del m.triton_dtype
    form[0] = "pair"
    print("| form | fwd | fwd+bwd | kernels (fwd+bwd) |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['fwd_ms']:.4f} | {r['fwd_bwd_ms']:.4f} | {len(r['kernels'])} |")
    for name, r in results.items():
        print(f"\n{name}: " + ", ".join(f"{kernel[:48]} {ms * 1e3:.1f} µs"
                                         for kernel, ms in r["kernels"].items()))
    sweep = []
    shipped = dict(triton_compressor.ROWS)
    for kind, name in KERNELS.items():
        for rows in (int(r) for r in args.rows.split(",") if r):
            triton_compressor.ROWS[kind] = rows
            ms = kernel_ms(forward_backward, CALLS, torch.device("cuda")).get(name, 0.0)
            sweep.append(dict(kernel=kind, rows=rows, ms=ms, shipped=rows == shipped[kind]))
            print(f"{kind:13s} rows {rows:4d}: {ms * 1e3:.1f} µs")
        triton_compressor.ROWS[kind] = shipped[kind]
    shipped_splits = triton_compressor.WEIGHT_SPLITS
    for splits in (int(k) for k in args.splits.split(",") if k):
        triton_compressor.WEIGHT_SPLITS = splits
        kernels = kernel_ms(forward_backward, CALLS, torch.device("cuda"))
        ms, total = kernels.get(KERNELS["weight_grads"], 0.0), sum(kernels.values())
        sweep.append(dict(kernel="weight_grads", splits=splits, ms=ms, fwd_bwd_ms=total,
                          shipped=splits == shipped_splits))
        print(f"weight_grads  splits {splits:3d}: {ms * 1e3:.1f} µs (forward+backward "
              f"{total * 1e3:.1f} µs)")
    triton_compressor.WEIGHT_SPLITS = shipped_splits
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                    command="python bench/compressor.py " + " ".join(argv or sys.argv[1:]))
        atomic_write_json(Path(args.json), dict(meta=meta, forms=results, sweep=sweep))


if __name__ == "__main__":
    main()
