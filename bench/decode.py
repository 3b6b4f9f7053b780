"""NSA decode step vs dense SDPA over the same KV cache, and end-to-end generation speed.

    python bench/decode.py                       # the issue's sweep on one GPU
    python bench/decode.py --contexts 8192 --batches 1

Per context T and batch B (HQ=64, H=4, D=128, bf16, paper parameters, every sequence at
position T-1): median time of one decode-step attention (``triton.testing.do_bench``) for NSA
(Triton kernels and the PyTorch path, each eager and replayed as a CUDA graph) and dense SDPA
with each backend that runs; bytes each reads per step (NSA: the spec's token count; dense: the
whole cache) and the achieved bandwidth, against a device-to-device copy measured in the same
run. Then tokens/s of the m7c-125m model (random weights) generating with and without CUDA
graphs.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nsa.models import LanguageModel, model_preset
from nsa.models.decoding import capture_cuda_graph, stream_tokens
from nsa.ops import NSAParams
from nsa.ops.decode import nsa_decode, tokens_read

PARAMS = NSAParams()  # paper defaults: l=32, d=16, l'=64, n=16, w=512
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION}


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (bytes read + written)."""
    from triton.testing import do_bench

    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median")
    return 2 * src.numel() * 2 / ms / 1e6


def graphed(fn):
    """fn() captured in a CUDA graph; returns the replay function."""
    return capture_cuda_graph(fn)[0].replay


def step_inputs(T: int, B: int, HQ: int, H: int, D: int):
    make = lambda *shape: torch.randn(*shape, dtype=torch.bfloat16, device="cuda")  # noqa
    C = PARAMS.compressed_length(T)
    return dict(q=make(B, HQ, D), k=make(B, T, H, D), v=make(B, T, H, D),
                k_cmp=make(B, C, H, D), v_cmp=make(B, C, H, D),
                gates=torch.rand(B, HQ, 3, dtype=torch.bfloat16, device="cuda"),
                k_win=make(B, PARAMS.window, H, D), v_win=make(B, PARAMS.window, H, D),
                pos=torch.full((B,), T - 1, dtype=torch.long, device="cuda"))


def measure_step(T: int, B: int, HQ: int, H: int, D: int) -> list[dict]:
    from triton.testing import do_bench

    x = step_inputs(T, B, HQ, H, D)
    bench = lambda fn: do_bench(fn, warmup=10, rep=100, return_mode="median")  # noqa
    tokens = tokens_read(x["pos"], PARAMS)  # [B] per KV head
    nsa_bytes = int(tokens.sum()) * H * 2 * D * 2 + x["q"].numel() * 2
    rows = []
    for backend in ("triton", "torch"):
        nsa = lambda backend=backend: nsa_decode(  # noqa: E731
            x["q"], x["k"], x["v"], x["k_cmp"], x["v_cmp"], x["gates"], x["pos"], PARAMS,
            k_win=x["k_win"], v_win=x["v_win"], window_ring=True, backend=backend)
        rows += [dict(impl=f"nsa-{backend}", ms=bench(nsa), bytes=nsa_bytes),
                 dict(impl=f"nsa-{backend}+graph", ms=bench(graphed(nsa)), bytes=nsa_bytes)]
    q = x["q"].view(B, HQ, 1, D)
    k, v = x["k"].transpose(1, 2), x["v"].transpose(1, 2)  # [B, H, T, D]
    dense_bytes = B * H * T * 2 * D * 2 + x["q"].numel() * 2
    for name, backend in SDPA_BACKENDS.items():
        # One query at the last position sees every cached key: no mask (is_causal=True
        # with a single query would let it see key 0 only).
        dense = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa
        try:
            with sdpa_kernel(backend):
                rows.append(dict(impl=f"sdpa-{name}", ms=bench(dense), bytes=dense_bytes))
        except RuntimeError:  # this backend has no kernel for the shape
            continue
    for row in rows:
        row.update(T=T, B=B, GBps=row["bytes"] / row["ms"] / 1e6)
    return rows


def generation_speed(attention: str, cuda_graph: bool, prompt_len: int, new_tokens: int) -> float:
    config = model_preset("m7c-125m", attention=attention)
    torch.manual_seed(0)
    model = LanguageModel(config).to("cuda", torch.bfloat16).eval()
    prompt = torch.randint(0, config.vocab_size, (1, prompt_len), device="cuda")
    for _ in stream_tokens(model, prompt, 8, cuda_graph=cuda_graph):  # warm-up, compile
        pass
    torch.cuda.synchronize()
    began = time.perf_counter()
    for token in stream_tokens(model, prompt, new_tokens, cuda_graph=cuda_graph):
        token.item()  # streamed: each token reaches the host
    return new_tokens / (time.perf_counter() - began)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,16384,32768,65536,131072")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--heads", default="64,4")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--generate", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args(argv)
    HQ, H = (int(x) for x in args.heads.split(","))
    copy = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, HQ={HQ}, H={H}, "
          f"D={args.dim}, device-to-device copy {copy:,.0f} GB/s")
    print("| T | B | impl | step ms | MB read | GB/s | % of copy |")
    print("|---|---|---|---|---|---|---|")
    results = {"copy_GBps": copy, "steps": [], "generation": []}
    for T in map(int, args.contexts.split(",")):
        for B in map(int, args.batches.split(",")):
            for r in measure_step(T, B, HQ, H, args.dim):
                results["steps"].append(r)
                print(f"| {T} | {B} | {r['impl']} | {r['ms']:.3f} | {r['bytes'] / 1e6:.1f} | "
                      f"{r['GBps']:,.0f} | {100 * r['GBps'] / copy:.0f}% |", flush=True)
            torch.cuda.empty_cache()
    if args.generate:
        print("\n| model | CUDA graph | tokens/s (B=1, prompt 128, 256 new) |\n|---|---|---|")
        for attention in ("nsa", "dense"):
            for cuda_graph in (False, True):
                rate = generation_speed(attention, cuda_graph, 128, 256)
                results["generation"].append(dict(attention=attention, cuda_graph=cuda_graph,
                                                  tokens_per_s=rate))
                print(f"| m7c-125m {attention} | {cuda_graph} | {rate:,.1f} |", flush=True)
    if args.out:
        with open(os.path.join(args.out, "decode.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
