"""Probe: what adding dq inside a per-key-tile backward (as FA3 does) would cost with a
deterministic accumulation, against computing it in a kernel of its own (as the masked dq does
today), at the m7c shape. Decides the design before the masked dK/dV is rebuilt (issue 11,
bench/NOTES.md, forty-first session).

    python bench/dq_accumulation.py                    # 8 x 12 heads, T = 2048, D = 64
    python bench/dq_accumulation.py --json out.json

A synthetic causal backward, one head per (batch, head) with its own keys: dS = scale ·
causal(Q K^T) and dq = dS K. Per key tile (BLOCK_N keys, one program) over the query tiles
at or after it, each tile's dq contribution [BLOCK_R, D] (float32) is handed on by:

- ``compute``: kept in registers, no hand-off: the products alone, the floor of the others;
- ``float-atomics``: float32 atomic adds (FA3's default: the sum's order, so its last bits,
  change from run to run; our kernels may not do this);
- ``int64-atomics``: rounded to 64-bit fixed point (FIXED_ONE units), integer atomic adds
  (exact and associative: the same bits in any order), converted back afterwards;
- ``ordered``: per query tile a counter; key tile k waits until k tiles have added theirs,
  then adds (load, add, store) and counts itself (FA3's deterministic mode). Key tile k - 1
  is always the earlier program, so the wait ends if programs start in order.

``rows``: one program per query tile over the key tiles before it, its dq in registers (the
masked dq's design; the real kernel also recomputes dO V^T, a third product).
The fused design pays (mode - compute) and saves the separate kernel's time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from nsa.ops.triton.launch import cdiv
from nsa.train.checkpoint import atomic_write_json

MODES = ("compute", "float-atomics", "int64-atomics", "ordered")
FIXED_ONE = 2.0 ** 32  # int64-atomics: units per 1.0 (|dq| < 2^31, resolution 2^-32)
# ordered: polls of a counter before giving up (NaN rows, not a hang). Triton's interpreter runs
# the programs one after another in key order, so there the first poll must find its turn.
MAX_SPINS = dict(cuda=1 << 26, cpu=1)


@triton.jit
def _contribution(Q, k, base, qt, n, d, T, scale, D: tl.constexpr, BLOCK_R: tl.constexpr):
    """(dq contribution [BLOCK_R, D] float32 of key tile k to query tile qt, its offsets,
    its row mask)."""
    t = qt * BLOCK_R + tl.arange(0, BLOCK_R)
    t_ok = t < T
    offsets = base + t[:, None] * D + d[None, :]
    q = tl.load(Q + offsets, mask=t_ok[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k))
    ds = tl.where((n[None, :] <= t[:, None]) & (n[None, :] < T), s * scale, 0.0)
    return tl.dot(ds.to(k.dtype), k), offsets, t_ok[:, None]


@triton.jit
def _per_key_tile_kernel(Q, K, DQ, DQ_FIXED, COUNTER, T, NUM_QT, scale, fixed_one, max_spins,
                         MODE: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """Key tile program axis 1 of head axis 0: its dq contributions to every query tile at or
    after it, handed on as MODE says (module docstring)."""
    head = tl.program_id(0)
    key_tile = tl.program_id(1)
    n = key_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    base = head.to(tl.int64) * T * D
    k = tl.load(K + base + n[:, None] * D + d[None, :], mask=(n < T)[:, None], other=0.0)
    kept = tl.zeros([BLOCK_R, D], tl.float32)
    for qt in range(key_tile * BLOCK_N // BLOCK_R, NUM_QT):
        c, offsets, mask = _contribution(Q, k, base, qt, n, d, T, scale, D, BLOCK_R)
        if MODE == 0:
            kept += c
        elif MODE == 1:
            tl.atomic_add(DQ + offsets, c, mask=mask, sem="relaxed")
        elif MODE == 2:
            tl.atomic_add(DQ_FIXED + offsets, (c * fixed_one).to(tl.int64), mask=mask,
                          sem="relaxed")
        else:
            counter = COUNTER + head * NUM_QT + qt
            done = tl.atomic_add(counter, 0, sem="acquire")
            spins = 0
            while (done != key_tile) & (spins < max_spins):
                done = tl.atomic_add(counter, 0, sem="acquire")
                spins += 1
            if done != key_tile:  # a broken order: NaN, not a hang
                c = tl.full([BLOCK_R, D], float("nan"), tl.float32)
            total = tl.load(DQ + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(DQ + offsets, total + c, mask=mask, cache_modifier=".cg")
            tl.debug_barrier()  # every thread's store before the count
            tl.atomic_xchg(counter, key_tile + 1, sem="release")
    if MODE == 0:  # stored, so that the products are not optimised away
        t = tl.arange(0, BLOCK_R)
        tl.store(DQ + base + t[:, None] * D + d[None, :], kept, mask=(t < T)[:, None])


@triton.jit
def _per_query_tile_kernel(Q, K, DQ, T, scale, D: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    """dq of query tile program axis 1 of head axis 0 over the key tiles up to its last row,
    in registers (the ``rows`` form)."""
    head = tl.program_id(0)
    qt = tl.program_id(1)
    d = tl.arange(0, D)
    base = head.to(tl.int64) * T * D
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for start in range(0, tl.minimum(T, (qt + 1) * BLOCK_R), BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        k = tl.load(K + base + n[:, None] * D + d[None, :], mask=(n < T)[:, None], other=0.0)
        c, offsets, mask = _contribution(Q, k, base, qt, n, d, T, scale, D, BLOCK_R)
        acc += c
    t = qt * BLOCK_R + tl.arange(0, BLOCK_R)
    tl.store(DQ + base + t[:, None] * D + d[None, :], acc, mask=(t < T)[:, None])


def buffers(mode: str, q: torch.Tensor, block_r: int) -> dict:
    """Zeroed outputs of ``mode`` for q [heads, T, D]: what a real design must zero per call
    too (bytes in the table)."""
    heads, T, D = q.shape
    out = dict(out=torch.zeros(heads, T, D, dtype=torch.float32, device=q.device),
               fixed=torch.zeros(1, dtype=torch.int64, device=q.device),
               counter=torch.zeros(1, dtype=torch.int32, device=q.device))
    if mode == "int64-atomics":
        out["fixed"] = torch.zeros(heads, T, D, dtype=torch.int64, device=q.device)
    if mode == "ordered":
        out["counter"] = torch.zeros(heads, cdiv(T, block_r), dtype=torch.int32,
                                     device=q.device)
    return out


def zeroed_bytes(mode: str, bufs: dict) -> int:
    """Bytes ``mode`` needs zeroed before its kernel."""
    needs = dict(rows=(), compute=(), **{"float-atomics": ("out",),
                                        "int64-atomics": ("fixed",),
                                        "ordered": ("out", "counter")})[mode]
    return sum(bufs[name].numel() * bufs[name].element_size() for name in needs)


def launch(mode: str, q: torch.Tensor, k: torch.Tensor, bufs: dict, block_r: int = 64,
           block_n: int = 64) -> None:
    """The kernel of ``mode`` (MODES or "rows") on q, k [heads, T, D] into ``bufs``."""
    heads, T, D = q.shape
    scale = D ** -0.5
    if mode == "rows":
        _per_query_tile_kernel[(heads, cdiv(T, block_r))](q, k, bufs["out"], T, scale, D=D,
                                                          BLOCK_R=block_r, BLOCK_N=block_n)
        return
    _per_key_tile_kernel[(heads, cdiv(T, block_n))](
        q, k, bufs["out"], bufs["fixed"], bufs["counter"], T, cdiv(T, block_r), scale,
        FIXED_ONE, MAX_SPINS[q.device.type], MODE=MODES.index(mode), D=D, BLOCK_R=block_r,
        BLOCK_N=block_n)


def dq(mode: str, q: torch.Tensor, k: torch.Tensor, block_r: int = 64,
       block_n: int = 64) -> torch.Tensor:
    """dq [heads, T, D] float32 of q, k [heads, T, D] by ``mode`` (not "compute")."""
    bufs = buffers(mode, q, block_r)
    launch(mode, q, k, bufs, block_r, block_n)
    if mode == "int64-atomics":
        return bufs["fixed"].double().div(FIXED_ONE).float()
    return bufs["out"]


def reference(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """dq of the synthetic backward in float64."""
    T, D = q.shape[1], q.shape[2]
    s = q.double() @ k.double().transpose(1, 2) * D ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return (s.masked_fill(~causal, 0) @ k.double()).float()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=96, help="batch x query heads")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rows", default="64,128", help="BLOCK_R values")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the CPU runs it in tests, in Triton's interpreter)")
    torch.manual_seed(0)
    q, k = (torch.randn(args.heads, args.seq, args.dim, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    expected = reference(q, k)
    rows = []
    print(f"# {torch.cuda.get_device_name()}: {args.heads} heads, T={args.seq}, "
          f"D={args.dim}, bf16; kernel µs per call (CUDA events, median of 20; the zeroing "
          f"of the listed bytes before each call is not timed)")
    print("| BLOCK_R | form | µs | zeroed MB | max error | same bits on a rerun |")
    print("|---|---|---|---|---|---|")
    for block_r in (int(r) for r in args.rows.split(",")):
        for mode in ("rows", *MODES):
            bufs = buffers(mode, q, block_r)
            times = []
            for _ in range(20):
                for buffer in bufs.values():
                    buffer.zero_()
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                launch(mode, q, k, bufs, block_r)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            us = sorted(times)[len(times) // 2]
            error, same = float("nan"), None
            if mode != "compute":
                first = dq(mode, q, k, block_r)
                error = (first - expected).abs().max().item()
                same = bool(torch.equal(first, dq(mode, q, k, block_r)))
            mb = zeroed_bytes(mode, bufs) / 1e6
            rows.append(dict(block_r=block_r, form=mode, us=us, zeroed_mb=mb, max_error=error,
                             same_bits=same))
            print(f"| {block_r} | {mode} | {us:.1f} | {mb:.1f} | {error:.2e} | {same} |")
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                    command="python bench/dq_accumulation.py " + " ".join(argv or sys.argv[1:]))
        atomic_write_json(Path(args.json), dict(meta=meta, rows=rows))


if __name__ == "__main__":
    main()
