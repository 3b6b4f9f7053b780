"""NSA attention vs dense SDPA (flash, cuDNN): forward and forward+backward time and peak memory.

    python bench/attention.py                          # the issue's sweep on one GPU
    python bench/attention.py --seqs 8192 --groups 16 --impls nsa-triton,sdpa-cudnn

Median times from ``triton.testing.do_bench``; peak memory is the allocator's peak during one
forward+backward above what the inputs already hold. Dense SDPA gets K/V expanded to all query
heads (GQA by repeat_interleave), causal masking.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import nsa

PAPER = dict(cmp_block=32, cmp_stride=16, sel_block=64, num_selected=16, window=512)


def nsa_inputs(T, HQ, H, D, dtype, device):
    Tc = nsa.compressed_length(T, PAPER["cmp_block"], PAPER["cmp_stride"])
    make = lambda *s: torch.randn(*s, dtype=dtype, device=device, requires_grad=True)  # noqa: E731
    return dict(q=make(1, T, HQ, D), k=make(1, T, H, D), v=make(1, T, H, D),
                k_cmp=make(1, Tc, H, D), v_cmp=make(1, Tc, H, D),
                gates=torch.rand(1, T, HQ, 3, dtype=dtype, device=device, requires_grad=True))


def make_nsa(backend):
    def run(x):
        return nsa.nsa_attention(x["q"], x["k"], x["v"], x["k_cmp"], x["v_cmp"], x["gates"],
                                 backend=backend, **PAPER)
    return run


def make_sdpa(backend):
    def run(x):
        G = x["q"].shape[2] // x["k"].shape[2]
        q = x["q"].transpose(1, 2)
        k = x["k"].repeat_interleave(G, dim=2).transpose(1, 2)
        v = x["v"].repeat_interleave(G, dim=2).transpose(1, 2)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    return run


IMPLS = {
    "nsa-triton": make_nsa("triton"),
    "nsa-torch": make_nsa("torch"),
    "sdpa-flash": make_sdpa(SDPBackend.FLASH_ATTENTION),
    "sdpa-cudnn": make_sdpa(SDPBackend.CUDNN_ATTENTION),
}


def profile(T, HQ, H, D, dtype) -> None:
    """Print one nsa-triton forward+backward's CUDA kernels by time, then host-side ops by CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    x = nsa_inputs(T, HQ, H, D, dtype, "cuda")
    run = IMPLS["nsa-triton"]
    grad = torch.randn(1, T, HQ, D, dtype=dtype, device="cuda")
    torch.autograd.grad(run(x), list(x.values()), grad)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(run(x), list(x.values()), grad)
        torch.cuda.synchronize()
    events = prof.key_averages()
    print(events.table(sort_by="cuda_time_total", row_limit=14))
    print(events.table(sort_by="self_cpu_time_total", row_limit=25))  # host-side overhead


def measure(impl: str, T: int, HQ: int, H: int, D: int, dtype) -> dict:
    from triton.testing import do_bench

    run = IMPLS[impl]
    x = nsa_inputs(T, HQ, H, D, dtype, "cuda")
    grad = torch.randn(1, T, HQ, D, dtype=dtype, device="cuda")
    # Dense attention reads only q, k, v: differentiate what each implementation uses.
    params = list(x.values()) if impl.startswith("nsa") else [x["q"], x["k"], x["v"]]

    def fwd():
        with torch.no_grad():
            run(x)

    def fwd_bwd():
        out = run(x)
        torch.autograd.grad(out, params, grad)

    fwd_bwd()  # compile / warm up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    rep = 200 if T <= 32768 else 400
    return {"impl": impl, "T": T, "HQ": HQ, "H": H, "D": D,
            "fwd_ms": do_bench(fwd, warmup=20, rep=rep, return_mode="median"),
            "fwd_bwd_ms": do_bench(fwd_bwd, warmup=20, rep=rep, return_mode="median"),
            "peak_mb": peak / 2**20}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="8192,16384,32768,65536,131072")
    parser.add_argument("--heads", default="64,4", help="HQ,H of the T sweep")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--groups", default="1,2,4,16", help="G sweep at --group-seq (HQ = 4G... )")
    parser.add_argument("--group-seq", type=int, default=32768)
    parser.add_argument("--impls", default="nsa-triton,sdpa-flash,sdpa-cudnn,nsa-torch")
    parser.add_argument("--torch-max-seq", type=int, default=16384,
                        help="longest T for the (slow) PyTorch backend")
    parser.add_argument("--m7c", action=argparse.BooleanOptionalAction, default=True,
                        help="also the m7c-125m layer shape (HQ=12, H=2, D=64)")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--profile", type=int, default=0, help="T of a kernel breakdown (0: none)")
    args = parser.parse_args(argv)

    HQ, H = (int(x) for x in args.heads.split(","))
    if args.profile:
        profile(args.profile, HQ, H, args.dim, torch.bfloat16)
    impls = args.impls.split(",")
    shapes = [(T, HQ, H, args.dim) for T in map(int, args.seqs.split(","))]
    shapes += [(args.group_seq, 4 * G, 4, args.dim) for G in map(int, args.groups.split(","))
               if (args.group_seq, 4 * G, 4, args.dim) not in shapes]
    if args.m7c:
        shapes += [(T, 12, 2, 64) for T in (2048, 16384)]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, B=1, "
          f"paper NSA parameters {PAPER}")
    print("| T | HQ | H | D | impl | fwd ms | fwd+bwd ms | peak MB |")
    print("|---|---|---|---|---|---|---|---|")
    results = []
    for T, hq, h, d in shapes:
        for impl in impls:
            if impl == "nsa-torch" and T > args.torch_max_seq:
                continue
            try:
                r = measure(impl, T, hq, h, d, torch.bfloat16)
            except (RuntimeError, torch.OutOfMemoryError) as error:  # e.g. no cuDNN kernel
                print(f"| {T} | {hq} | {h} | {d} | {impl} | failed: {str(error)[:60]} | | |")
                torch.cuda.empty_cache()
                continue
            results.append(r)
            print(f"| {T} | {hq} | {h} | {d} | {impl} | {r['fwd_ms']:.2f} | "
                  f"{r['fwd_bwd_ms']:.2f} | {r['peak_mb']:.0f} |", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        with open(os.path.join(args.out, "attention.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
