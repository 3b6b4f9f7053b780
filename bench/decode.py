"""NSA decode step vs dense SDPA over the same KV cache, and end-to-end generation speed.

    python bench/decode.py                       # the issue's sweep on one GPU
    python bench/decode.py --contexts 8192 --batches 1 --gen-contexts 2048
    TRITON_INTERPRET=1 python bench/decode.py --smoke   # the same code paths, tiny, on a CPU

Per context T and batch B (HQ=64, H=4, D=128, bf16, paper parameters, every sequence at
position T-1): median time of one decode-step attention (``triton.testing.do_bench``) for NSA
(Triton kernels and the PyTorch path, each eager and replayed as a CUDA graph; the Triton step
also as 8 steps on 8 caches in one graph, as a model's layers run it: ms per step) and dense SDPA
with each backend that runs; bytes each reads per step (NSA: the spec's token count; dense: the
whole cache) and the achieved bandwidth, against a device-to-device copy measured in the same
run; the time of each Triton kernel of the step (profiler). Then the decoding speed of the
m7c-125m model (random weights, B=1) after a prompt of 2k, 8k and 32k tokens, NSA and dense,
with and without CUDA graphs, and on the GPU the time of one graphed decode step between CUDA
events (each graph variant replayed many times: NSA's step that completes a compressed token
and its other steps), averaged per token over a compression stride: what tokens/s measure
without the host's sampling loop, whose noise spreads them by ~15 % between runs; and the
issue's targets, met or missed, from these numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nsa.models import LanguageModel, model_preset
from nsa.models.decoding import GraphedDecodeStep, capture_cuda_graph, stream_tokens
from nsa.ops import NSAParams
from nsa.ops.decode import nsa_decode, tokens_read
from nsa.ops.triton_support import TRITON_AVAILABLE, TRITON_INTERPRET
from nsa.train.checkpoint import atomic_write_json

PARAMS = NSAParams()  # paper defaults: l=32, d=16, l'=64, n=16, w=512
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION}
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DECODE_KERNELS = ("_compressed_kernel", "_select_kernel", "_selected_kernel")
LAYER_STEPS = 8  # layers' steps in one graph, each on its own cache ("nsa-triton+graph8")


def bench(fn, cuda: bool = CUDA) -> float:
    """Median ms of fn(): ``do_bench`` where ``cuda`` (the GPU's tensors), wall time of a few
    calls otherwise."""
    if cuda:
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


def copy_bandwidth() -> float:
    """GB/s of a device-to-device copy (bytes read + written): 1 GiB on the GPU."""
    src = torch.empty(1 << (29 if CUDA else 22), dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / bench(lambda: dst.copy_(src)) / 1e6


def graphed(fn):
    """fn() captured in a CUDA graph; returns the replay function."""
    return capture_cuda_graph(fn)[0].replay


def step_inputs(T: int, B: int, HQ: int, H: int, D: int, params: NSAParams):
    dtype = torch.bfloat16 if CUDA else torch.float16  # the interpreter has no correct bf16
    make = lambda *shape: torch.randn(*shape, dtype=dtype, device=DEVICE)  # noqa: E731
    C = params.compressed_length(T)
    return dict(q=make(B, HQ, D), k=make(B, T, H, D), v=make(B, T, H, D),
                k_cmp=make(B, C, H, D), v_cmp=make(B, C, H, D),
                gates=torch.rand(B, HQ, 3, dtype=dtype, device=DEVICE),
                k_win=make(B, params.window, H, D), v_win=make(B, params.window, H, D),
                pos=torch.full((B,), T - 1, dtype=torch.long, device=DEVICE))


def nsa_step(x: dict, params: NSAParams, backend: str) -> torch.Tensor:
    """One NSA decode step on the inputs of ``step_inputs``."""
    return nsa_decode(x["q"], x["k"], x["v"], x["k_cmp"], x["v_cmp"], x["gates"], x["pos"],
                      params, k_win=x["k_win"], v_win=x["v_win"], window_ring=True,
                      backend=backend)


def kernel_times(fn) -> dict:
    """Mean µs of each Triton kernel of the decode step over 20 eager calls (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        name = next((k for k in DECODE_KERNELS if k in event.key), None)
        if name is not None:
            total = getattr(event, "device_time_total", None) or event.cuda_time_total
            times[name] = total / event.count
    return times


def measure_step(T: int, B: int, HQ: int, H: int, D: int, params: NSAParams) -> list[dict]:
    x = step_inputs(T, B, HQ, H, D, params)
    tokens = tokens_read(x["pos"], params)  # [B] per KV head
    element = x["k"].element_size()
    nsa_bytes = int(tokens.sum()) * H * 2 * D * element + x["q"].numel() * element
    backends = ["torch"] + (["triton"] if TRITON_AVAILABLE and (CUDA or TRITON_INTERPRET)
                            else [])
    rows = []
    for backend in backends:
        nsa = lambda backend=backend: nsa_step(x, params, backend)  # noqa: E731
        row = dict(impl=f"nsa-{backend}", ms=bench(nsa), bytes=nsa_bytes)
        if CUDA and backend == "triton":
            row["kernels_us"] = kernel_times(nsa)
        rows.append(row)
        if CUDA:
            rows.append(dict(impl=f"nsa-{backend}+graph", ms=bench(graphed(nsa)),
                             bytes=nsa_bytes))
    if CUDA and "triton" in backends:
        # A model's decode step runs its layers' steps back to back in one graph, so the
        # graph's own launch (~5 µs) is paid once a token, not once a layer; each layer reads
        # its own cache, so no step finds the last one's keys in L2 (do_bench flushes L2
        # before each replay, not between the steps inside it).
        layers = [x] + [step_inputs(T, B, HQ, H, D, params) for _ in range(LAYER_STEPS - 1)]
        steps = graphed(lambda: [nsa_step(y, params, "triton") for y in layers])
        rows.append(dict(impl=f"nsa-triton+graph{LAYER_STEPS}",
                         ms=bench(steps) / LAYER_STEPS, bytes=nsa_bytes))
        del layers, steps
    q = x["q"].view(B, HQ, 1, D)
    k, v = x["k"].transpose(1, 2), x["v"].transpose(1, 2)  # [B, H, T, D]
    dense_bytes = B * H * T * 2 * D * element + x["q"].numel() * element
    for name, backend in SDPA_BACKENDS.items():
        # One query at the last position sees every cached key: no mask (is_causal=True
        # with a single query would let it see key 0 only).
        dense = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa
        try:
            with sdpa_kernel(backend):
                rows.append(dict(impl=f"sdpa-{name}", ms=bench(dense), bytes=dense_bytes))
        except RuntimeError:  # this backend has no kernel for the shape (or device)
            continue
    for row in rows:
        row.update(T=T, B=B, GBps=row["bytes"] / row["ms"] / 1e6)
    return rows


def decoding_speed(model, cuda_graph: bool, context: int, new_tokens: int) -> dict:
    """Decoding tokens/s (B=1) after a prompt of ``context`` tokens, each token copied to the
    host as it comes (streamed), and the prefill time (the second of two identical runs: the
    first compiles what this context's shapes need)."""
    prompt = torch.randint(0, model.config.vocab_size, (1, context), device=DEVICE)
    for _ in range(2):
        began = time.perf_counter()
        stream = stream_tokens(model, prompt, new_tokens, top_k=1, cuda_graph=cuda_graph)
        next(stream).item()  # prefill (and the graph's capture)
        first = time.perf_counter()
        for token in stream:
            token.item()
        done = time.perf_counter()
    return dict(tokens_per_s=(new_tokens - 1) / (done - first), prefill_s=first - began)


def graphed_step_us(model, context: int, replays: int) -> dict:
    """µs of one graphed decode step (B=1, after a prompt of ``context`` tokens): each graph
    variant of ``GraphedDecodeStep`` replayed ``replays`` times from the same position between
    CUDA events (NSA: ``completing``, the step that completes a compressed token, and
    ``other``), and ``per_token``, their mean over a compression stride."""
    cache = model.new_cache(1, context + replays)
    step = GraphedDecodeStep(model, cache)
    model.prefill(torch.randint(0, model.config.vocab_size, (1, context), device=DEVICE), cache)
    start = cache.lengths.clone()
    token = torch.zeros(1, dtype=torch.long, device=DEVICE)
    times = {}
    for name, compress in (("completing", True), ("other", False))[:len(step.graphs)]:
        cache.lengths.copy_(start)
        step(token, compress=compress)
        cache.lengths.copy_(start)
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        for _ in range(replays):
            step(token, compress=compress)
        ended.record()
        torch.cuda.synchronize()
        times[name] = 1e3 * began.elapsed_time(ended) / replays
    stride = model.config.attention.nsa.cmp_stride if "other" in times else 1
    times["per_token"] = (times["completing"] + (stride - 1) * times.get("other", 0.0)) / stride
    return times


def generation(contexts: list[int], new_tokens: int, preset: str) -> list[dict]:
    rows = []
    dtype = torch.bfloat16 if CUDA else torch.float32
    for attention in ("nsa", "dense"):
        config = model_preset(preset, attention=attention,
                              max_seq_len=max(contexts) + new_tokens)
        torch.manual_seed(0)
        model = LanguageModel(config).to(DEVICE, dtype).eval()
        for context in contexts:
            for cuda_graph in (False, True) if CUDA else (False,):
                rate = decoding_speed(model, cuda_graph, context, new_tokens)
                if cuda_graph:
                    rate["step_us"] = graphed_step_us(model, context, new_tokens)
                rows.append(dict(model=preset, attention=attention, context=context,
                                 cuda_graph=cuda_graph, **rate))
                steps = " / ".join(f"{us:.1f}" for us in rate.get("step_us", {}).values())
                print(f"| {preset} {attention} | {context} | {cuda_graph} | "
                      f"{rate['tokens_per_s']:,.1f} | {rate['prefill_s']:.2f} | {steps} |",
                      flush=True)
        del model
        if CUDA:
            torch.cuda.empty_cache()
    return rows


def targets(results: dict) -> list[dict]:
    """The issue's targets from this run's numbers: (name, value, goal, met)."""
    steps, copy = results["steps"], results["copy_GBps"]

    def best(T, B, prefix):  # one step per launch or graph (the ratios' and bandwidth's basis)
        rows = [r for r in steps if r["T"] == T and r["B"] == B and r["impl"].startswith(prefix)
                and not r["impl"].endswith(f"graph{LAYER_STEPS}")]
        return min(rows, key=lambda r: r["ms"]) if rows else None

    out = []
    nsa, dense = best(65536, 16, "nsa-triton"), best(65536, 16, "sdpa")
    if nsa and dense:
        out.append(dict(target="64k B=16: best dense / NSA", value=dense["ms"] / nsa["ms"],
                        goal=">= 8", met=dense["ms"] / nsa["ms"] >= 8))
    for T in (32768, 65536, 131072):
        nsa = best(T, 16, "nsa-triton")
        if nsa:
            share = nsa["GBps"] / copy
            out.append(dict(target=f"{T // 1024}k B=16: share of copy bandwidth", value=share,
                            goal=">= 0.5", met=share >= 0.5))
    nsa = best(65536, 1, "nsa-triton")
    if nsa:
        out.append(dict(target="64k B=1: µs per layer step, one step per graph",
                        value=1e3 * nsa["ms"], goal="<= 25", met=1e3 * nsa["ms"] <= 25))
    layer = [r for r in steps if r["T"] == 65536 and r["B"] == 1
             and r["impl"] == f"nsa-triton+graph{LAYER_STEPS}"]
    if layer:
        us = 1e3 * layer[0]["ms"]
        out.append(dict(target=f"64k B=1: µs per layer step, {LAYER_STEPS} steps in one graph",
                        value=us, goal="<= 25", met=us <= 25))
    rate = {(r["attention"], r["context"]): r["tokens_per_s"]
            for r in results["generation"] if r["cuda_graph"] == CUDA}
    per_token = {(r["attention"], r["context"]): r["step_us"]["per_token"]
                 for r in results["generation"] if "step_us" in r}
    for context, goal in ((32768, 3.0), (2048, 1.0)):
        if ("nsa", context) in rate and ("dense", context) in rate:
            ratio = rate["nsa", context] / rate["dense", context]
            out.append(dict(target=f"generation at {context // 1024}k: NSA / dense tokens/s",
                            value=ratio, goal=f">= {goal:g}", met=ratio >= goal))
        if ("nsa", context) in per_token and ("dense", context) in per_token:
            ratio = per_token["dense", context] / per_token["nsa", context]
            out.append(dict(target=f"generation at {context // 1024}k: dense / NSA graphed "
                                   f"step µs per token", value=ratio, goal=f">= {goal:g}",
                            met=ratio >= goal))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,16384,32768,65536,131072")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--heads", default="64,4")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--gen-contexts", default="2048,8192,32768")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--generate", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes and the tiny model: the code paths, on a CPU too")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args(argv)
    params, preset = PARAMS, "m7c-125m"
    if args.smoke:
        params, preset = NSAParams(cmp_block=16, cmp_stride=8, sel_block=16, num_selected=4,
                                   window=32), "tiny"
        args.contexts, args.batches, args.heads, args.dim = "256", "1,2", "4,2", 32
        args.gen_contexts, args.new_tokens = "32,64", 4
    HQ, H = (int(x) for x in args.heads.split(","))
    copy = copy_bandwidth()
    name = torch.cuda.get_device_name() if CUDA else "CPU"
    print(f"# {name}, torch {torch.__version__}, HQ={HQ}, H={H}, D={args.dim}, "
          f"device-to-device copy {copy:,.0f} GB/s")
    print("| T | B | impl | step ms | MB read | GB/s | % of copy | kernels µs |")
    print("|---|---|---|---|---|---|---|---|")
    results = {"device": name, "copy_GBps": copy, "steps": [], "generation": []}
    for T in map(int, args.contexts.split(",")):
        for B in map(int, args.batches.split(",")):
            for r in measure_step(T, B, HQ, H, args.dim, params):
                results["steps"].append(r)
                kernels = " / ".join(f"{us:.1f}" for us in r.get("kernels_us", {}).values())
                print(f"| {T} | {B} | {r['impl']} | {r['ms']:.3f} | {r['bytes'] / 1e6:.1f} | "
                      f"{r['GBps']:,.0f} | {100 * r['GBps'] / copy:.0f}% | {kernels} |",
                      flush=True)
            if CUDA:
                torch.cuda.empty_cache()
    if args.generate:
        print(f"\n| model | context | CUDA graph | decoding tokens/s (B=1, {args.new_tokens} "
              f"new) | prefill s | graphed step µs: completing / other / per token (NSA; "
              f"dense: step / per token) |\n|---|---|---|---|---|---|")
        results["generation"] = generation(
            [int(x) for x in args.gen_contexts.split(",")], args.new_tokens, preset)
    results["targets"] = targets(results)
    if results["targets"]:
        print("\n| target | this run | goal | met |\n|---|---|---|---|")
        for t in results["targets"]:
            print(f"| {t['target']} | {t['value']:.4g} | {t['goal']} | {t['met']} |")
    if args.out:
        atomic_write_json(Path(args.out) / "decode.json", results)


if __name__ == "__main__":
    main()
