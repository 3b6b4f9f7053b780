"""NSA attention vs dense SDPA (flash, cuDNN) and public NSA kernels: time and peak memory.

    python bench/attention.py                          # the issue-3 sweep on one GPU
    python bench/attention.py --seqs 8192 --groups 16 --impls nsa-triton,sdpa-cudnn
    python bench/attention.py --peers .peers --sweep issue11 --json $OUT/attention-peers.json
    python bench/attention.py --peers .peers --profile 65536   # CUDA kernels: ours, then mdy's

Median times from ``triton.testing.do_bench`` of one forward (no grad) and one forward +
backward; peak memory is the allocator's peak during one forward+backward above what the inputs
already hold. Dense SDPA gets K/V expanded to all query heads (GQA by repeat_interleave),
causal masking. ``--peers DIR`` adds the impls ``mdy`` and ``fla``, the public NSA kernels whose
sources are in DIR/mdy and DIR/fla (``bench/peers.py`` says what exactly each one runs);
a shape a peer cannot take is reported as refused, with the reason.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import peers  # bench/peers.py (bench/ is on sys.path when this file is run)
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import nsa
from nsa.train.checkpoint import atomic_write_json

PAPER = dict(cmp_block=32, cmp_stride=16, sel_block=64, num_selected=16, window=512)

# Named sweeps: (impls, [(T, HQ, H, D), ...]).
SWEEPS = {
    # issue 11: ours against the public NSA kernels and cuDNN, all in one process.
    "issue11": (("nsa-triton", "mdy", "fla", "sdpa-cudnn"),
                [(T, 64, 4, 128) for T in (8192, 16384, 32768, 65536, 131072)]
                + [(32768, 4 * G, 4, 128) for G in (1, 2, 4)]
                + [(T, 12, 2, 64) for T in (2048, 16384)]),
}
SWEEP_BUDGET_S = 450  # a named sweep's default --time-budget: it must fit one ~8-minute call


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


def setup(impl: str, x: dict):
    """``(run, inputs)``: ``run(x)`` is one forward of ``impl``, ``inputs`` what its backward
    differentiates. Raises ``peers.Refused`` for a shape a peer cannot take."""
    if impl in peers.PEERS:
        return peers.build(impl, x, PAPER)
    # Dense attention reads only q, k, v: differentiate what each implementation uses.
    inputs = list(x.values()) if impl.startswith("nsa") else [x["q"], x["k"], x["v"]]
    return IMPLS[impl], inputs


def rep_ms(T: int) -> int:
    """do_bench's measuring time: at long T a call takes 0.1-2 s and do_bench's own estimate
    (1 + 5 calls) dominates, so more would only lengthen the run."""
    return 200 if T <= 32768 else 400


def measure(impl: str, T: int, HQ: int, H: int, D: int, dtype) -> dict:
    from triton.testing import do_bench

    row = {"impl": impl, "T": T, "HQ": HQ, "H": H, "D": D}
    x = nsa_inputs(T, HQ, H, D, dtype, "cuda")
    try:
        run, inputs = setup(impl, x)
    except peers.Refused as error:
        return {**row, "refused": str(error)}
    grad = torch.randn(1, T, HQ, D, dtype=dtype, device="cuda")

    def fwd():
        with torch.no_grad():
            run(x)

    def fwd_bwd():
        out = run(x)
        torch.autograd.grad(out, inputs, grad)

    fwd_bwd()  # compile / warm up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    rep = rep_ms(T)
    return {**row,
            "fwd_ms": do_bench(fwd, warmup=20, rep=rep, return_mode="median"),
            "fwd_bwd_ms": do_bench(fwd_bwd, warmup=20, rep=rep, return_mode="median"),
            "peak_mb": peak / 2**20}


def _device_us(event) -> float:
    if hasattr(event, "self_device_time_total"):
        return event.self_device_time_total
    return event.self_cuda_time_total  # torch < 2.4


def kernel_table(impl: str, events, rows: int = 20) -> float:
    """Print the CUDA kernels of a profile by time (markdown); return their total in ms."""
    from torch.autograd import DeviceType

    kernels = [e for e in events if e.device_type == DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    kernels.sort(key=_device_us, reverse=True)
    total = sum(_device_us(e) for e in kernels) / 1e3
    print(f"\n### {impl}: CUDA kernels of one forward+backward, {total:.2f} ms in all\n")
    print("| kernel | calls | ms | % |")
    print("|---|---|---|---|")
    for e in kernels[:rows]:
        ms = _device_us(e) / 1e3
        print(f"| {e.key[:90]} | {e.count} | {ms:.2f} | {100 * ms / max(total, 1e-9):.1f} |")
    if len(kernels) > rows:
        ms = sum(_device_us(e) for e in kernels[rows:]) / 1e3
        print(f"| {len(kernels) - rows} other kernels | {sum(e.count for e in kernels[rows:])} "
              f"| {ms:.2f} | {100 * ms / max(total, 1e-9):.1f} |")
    print(f"| **total** | {sum(e.count for e in kernels)} | **{total:.2f}** | 100 |")
    return total


def profile(impls, T, HQ, H, D, dtype) -> None:
    """Per-kernel CUDA time of one forward+backward of each impl (one after the other, each
    with its total), then each one's host-side ops by CPU time, then the totals side by side."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, B=1, T={T}, "
          f"HQ={HQ}, H={H}, D={D}, paper NSA parameters {PAPER}")
    totals = {}
    for impl in impls:
        x = nsa_inputs(T, HQ, H, D, dtype, "cuda")
        try:
            run, inputs = setup(impl, x)
        except peers.Refused as error:
            print(f"\n### {impl}: refused: {error}")
            continue
        grad = torch.randn(1, T, HQ, D, dtype=dtype, device="cuda")
        try:
            for _ in range(2):  # compile, autotune, caches
                torch.autograd.grad(run(x), inputs, grad)
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                torch.autograd.grad(run(x), inputs, grad)
                torch.cuda.synchronize()
        except Exception as error:  # a peer's compile error, OOM: report, go on with the next
            print(f"\n### {impl}: failed: {type(error).__name__}: {error}")
            continue
        events = prof.key_averages()
        totals[impl] = kernel_table(impl, events)
        print(f"\n{impl}: host-side ops by CPU time")
        print(events.table(sort_by="self_cpu_time_total", row_limit=12))
        del x, inputs, grad, run
        torch.cuda.empty_cache()
    print(f"\n### CUDA kernel time of one forward+backward at T={T}\n")
    print("| impl | ms |")
    print("|---|---|")
    for impl, total in totals.items():
        print(f"| {impl} | {total:.2f} |")


def _cell(r: dict | None) -> str:
    if r is None:
        return "—"
    for key in ("refused", "failed", "skipped"):
        if key in r:
            return f"{key}: {r[key]}"
    return f"{r['fwd_ms']:.3g} / {r['fwd_bwd_ms']:.3g} ({r['peak_mb']:.0f} MB)"


def summary_table(rows: list[dict], impls) -> str:
    """One line per shape: fwd / fwd+bwd ms (peak MB) of every impl, then ours relative to each."""
    shapes = list(dict.fromkeys((r["T"], r["HQ"], r["H"], r["D"]) for r in rows))
    by = {(r["T"], r["HQ"], r["H"], r["D"], r["impl"]): r for r in rows}
    others = [i for i in impls if i != "nsa-triton"] if "nsa-triton" in impls else []
    head = ["T", "HQ/H", "D"] + [f"{i} fwd / fwd+bwd ms (peak)" for i in impls]
    head += [f"nsa-triton ÷ {i} (fwd / fwd+bwd)" for i in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for T, HQ, H, D in shapes:
        cells = [f"{T // 1024}k" if T % 1024 == 0 else str(T), f"{HQ}/{H}", str(D)]
        cells += [_cell(by.get((T, HQ, H, D, i))) for i in impls]
        ours = by.get((T, HQ, H, D, "nsa-triton"), {})
        for i in others:
            other = by.get((T, HQ, H, D, i), {})
            if "fwd_ms" in ours and "fwd_ms" in other:
                cells.append(f"{ours['fwd_ms'] / other['fwd_ms']:.2f} / "
                             f"{ours['fwd_bwd_ms'] / other['fwd_bwd_ms']:.2f}")
            else:
                cells.append("—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="8192,16384,32768,65536,131072")
    parser.add_argument("--heads", default="64,4", help="HQ,H of the T sweep and of --profile")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--groups", default="1,2,4,16", help="G sweep at --group-seq (HQ = 4G... )")
    parser.add_argument("--group-seq", type=int, default=32768)
    parser.add_argument("--impls", default="nsa-triton,sdpa-flash,sdpa-cudnn,nsa-torch")
    parser.add_argument("--torch-max-seq", type=int, default=16384,
                        help="longest T for the (slow) PyTorch backend")
    parser.add_argument("--m7c", action=argparse.BooleanOptionalAction, default=True,
                        help="also the m7c-125m layer shape (HQ=12, H=2, D=64)")
    parser.add_argument("--peers", metavar="DIR",
                        help="directory with the public NSA sources (DIR/mdy, DIR/fla): adds "
                             "the impls mdy and fla")
    parser.add_argument("--sweep", choices=sorted(SWEEPS),
                        help="a named sweep (its own shapes and impls; needs --peers): "
                             "issue11 = nsa-triton, mdy, fla, sdpa-cudnn on the issue's rows")
    parser.add_argument("--part", default="1/1", metavar="K/N",
                        help="only the K-th of N consecutive slices of the shapes (to split a "
                             "sweep over several calls)")
    parser.add_argument("--json", metavar="PATH",
                        help="write {meta, rows} here after every measurement")
    parser.add_argument("--time-budget", type=float, default=None, metavar="S",
                        help="skip the measurements left after S seconds (default: none; "
                             f"{SWEEP_BUDGET_S} with --sweep)")
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="directory for attention.json (the measured rows)")
    parser.add_argument("--profile", type=int, default=0, metavar="T",
                        help="only print the CUDA kernels of one forward+backward at T "
                             "(HQ,H from --heads, D from --dim) for --profile-impls")
    parser.add_argument("--profile-impls", default=None,
                        help="default: nsa-triton, and mdy with --peers")
    args = parser.parse_args(argv)

    if args.peers:
        peers.set_root(args.peers)
    known = set(IMPLS) | (set(peers.PEERS) if args.peers else set())
    if args.sweep:
        if not args.peers:
            parser.error(f"--sweep {args.sweep} needs --peers DIR")
        impls, shapes = SWEEPS[args.sweep]
        budget = SWEEP_BUDGET_S if args.time_budget is None else args.time_budget
    else:
        impls = args.impls.split(",")
        budget = args.time_budget or 0
    HQ, H = (int(x) for x in args.heads.split(","))
    if args.profile:
        default = "nsa-triton,mdy" if args.peers else "nsa-triton"
        impls = (args.profile_impls or default).split(",")
    unknown = [i for i in impls if i not in known]
    if unknown:
        parser.error(f"unknown impl(s) {unknown}" + ("" if args.peers else " (peers need --peers)"))
    if args.profile:
        profile(impls, args.profile, HQ, H, args.dim, torch.bfloat16)
        return
    if not args.sweep:
        shapes = [(T, HQ, H, args.dim) for T in map(int, args.seqs.split(","))]
        shapes += [(args.group_seq, 4 * G, 4, args.dim) for G in map(int, args.groups.split(","))
                   if (args.group_seq, 4 * G, 4, args.dim) not in shapes]
        if args.m7c:
            shapes += [(T, 12, 2, 64) for T in (2048, 16384)]
    part, parts = (int(p) for p in args.part.split("/"))
    if not 1 <= part <= parts:
        parser.error(f"--part {args.part}: need 1 <= K <= N")
    shapes = shapes[(part - 1) * len(shapes) // parts: part * len(shapes) // parts]

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "dtype": "bfloat16", "B": 1, "params": PAPER, "sweep": args.sweep,
            "impls": list(impls), "peers": args.peers, "part": args.part}
    print(f"# {meta['device']}, torch {meta['torch']}, bf16, B=1, paper NSA parameters {PAPER}")
    print("| T | HQ | H | D | impl | fwd ms | fwd+bwd ms | peak MB |")
    print("|---|---|---|---|---|---|---|---|")
    start = time.monotonic()
    results = []
    for T, hq, h, d in shapes:
        for impl in impls:
            if impl == "nsa-torch" and T > args.torch_max_seq:
                continue
            row = {"impl": impl, "T": T, "HQ": hq, "H": h, "D": d}
            if budget and time.monotonic() - start > budget:
                r = {**row, "skipped": f"time budget {budget:g} s"}
            else:
                try:
                    r = measure(impl, T, hq, h, d, torch.bfloat16)
                except Exception as error:  # e.g. no cuDNN kernel, OOM, a peer's compile error
                    message = " ".join(f"{type(error).__name__}: {error}".split())
                    r = {**row, "failed": message[:100]}
            r["elapsed_s"] = round(time.monotonic() - start, 1)
            results.append(r)
            if "fwd_ms" in r:
                print(f"| {T} | {hq} | {h} | {d} | {impl} | {r['fwd_ms']:.2f} | "
                      f"{r['fwd_bwd_ms']:.2f} | {r['peak_mb']:.0f} |", flush=True)
            else:
                print(f"| {T} | {hq} | {h} | {d} | {impl} | {_cell(r)} | | |", flush=True)
            torch.cuda.empty_cache()
            if args.json:  # after every row: a call that runs out of time keeps the rows
                atomic_write_json(Path(args.json), {"meta": meta, "rows": results})
    if args.out:
        atomic_write_json(Path(args.out) / "attention.json",
                          [r for r in results if "fwd_ms" in r])
    print(f"\n# {meta['device']}, bf16, B=1, paper parameters; {time.monotonic() - start:.0f} s\n")
    print(summary_table(results, impls))


if __name__ == "__main__":
    main()
