"""Per-kernel time of the Triton NSA backend under different launch shapes (rows, warps, stages,
keys per tile for the compressed and window kernels, and whether their dK/dV compute their
tiles transposed).

    python bench/tune_kernels.py --seq 32768

Prints, for every kernel family of ``nsa.ops.triton.launch.TUNING``, the GPU time of its kernel
(its device time alone, torch.profiler: at small shapes a call's wall time is the host's,
whatever the launch shape) for each candidate shape, the best first. Inputs: B=1, HQ=64, H=4,
D=128, bf16, paper parameters (override with --batch/--heads/--dim). The selected forward and dq
are timed both per position (selected_*; dK/dV per block) and as masked causal attention
(masked_*: where T allows it, see nsa/ops/triton/selected_masked.py), on the same selected
blocks.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
from op_host import gpu_ms  # bench/op_host.py

import nsa
from nsa.ops.params import NSAParams
from nsa.ops.triton.compressed_window import (
    MODE_CMP,
    MODE_WIN,
    DqBranch,
    branch_dkdv,
    branch_forward,
    branches_dq,
)
from nsa.ops.triton.finite import kv_finite_flags
from nsa.ops.triton.gating import GatedSum
from nsa.ops.triton.launch import (
    NARROW_TUNING,
    TRANSPOSABLE,
    TUNING,
    BranchGrad,
    family_tuning,
    launch_choice,
    launch_keys,
    launch_shape,
    launch_transposed,
    tile_width,
)
from nsa.ops.triton.selected import (
    pair_forward,
    position_dq,
    position_forward,
    position_pairs,
)
from nsa.ops.triton.selected_blocks import block_backward, block_forward
from nsa.ops.triton.selected_masked import (
    masked_causal_selection,
    masked_dkdv,
    masked_dq,
    masked_forward,
    masked_selection,
)
from nsa.ops.triton.selection import select
from nsa.ops.triton.tables import build_tables
from nsa.train.checkpoint import atomic_write_json

CALLS = 20  # calls profiled per launch shape
KERNELS = {  # family -> the names of the kernels it times (a call may launch others)
    "cmp_fwd": ("_branch_fwd_kernel",), "win_fwd": ("_branch_fwd_kernel",),
    "cw_dq": ("_branches_dq_kernel",),
    "cmp_dkdv": ("_branch_bwd_dkdv_kernel",), "win_dkdv": ("_branch_bwd_dkdv_kernel",),
    "select": ("_select_kernel",), "selected_fwd": ("_selected_fwd_kernel",),
    "selected_pair_fwd": ("_selected_pair_fwd_kernel",),
    "masked_fwd": ("_masked_fwd_kernel",), "selected_dq": ("_selected_bwd_dq_kernel",),
    "selected_dkdv": ("_block_bwd_kernel",), "selected_block_fwd": ("_block_fwd_kernel",),
    "masked_dq": ("_masked_dq_kernel",),
    # with the lists of each block's positions it reads, built in the same call
    "masked_dkdv": ("_masked_dkdv_kernel", "_block_positions_kernel"),
}
PAPER = NSAParams(cmp_block=32, cmp_stride=16, sel_block=64, num_selected=16, window=512)


def stages(B, T, HQ, H, D):
    make = lambda *s: torch.randn(*s, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    Tc = nsa.compressed_length(T, PAPER.cmp_block, PAPER.cmp_stride)
    q, k, v = make(B, T, HQ, D), make(B, T, H, D), make(B, T, H, D)
    kc, vc = make(B, Tc, H, D), make(B, Tc, H, D)
    scale = D**-0.5
    layout = build_tables(T, Tc, None, PAPER, q.device)
    cmp_finite, slc_finite, win_finite = kv_finite_flags(((kc, vc), (k, v), (k, v)))
    o_cmp, lse_cmp = branch_forward(q, kc, vc, layout, MODE_CMP, PAPER, scale, cmp_finite)
    idx = select(q, kc, lse_cmp, layout, PAPER, scale)
    o_slc, lse_slc = position_forward(q, k, v, idx, layout, PAPER, scale)
    o_win, lse_win = branch_forward(q, k, v, layout, MODE_WIN, PAPER, scale, win_finite)
    # The op's selected forward, last, also writes the gated sum of the three branches.
    gated = GatedSum(o_cmp, o_win, make(B, T, HQ, 3), torch.empty_like(q))
    do = make(B, T, HQ, D)  # the op's output gradient, as the backward kernels read it
    dq = torch.zeros(B, T, HQ, D, device="cuda")
    g_cmp = g_slc = g_win = BranchGrad.ungated(do)
    delta = lambda o: (do * o).sum(-1).contiguous()  # noqa: E731
    d_cmp, d_slc, d_win = delta(o_cmp), delta(o_slc), delta(o_win)

    query_finite = torch.ones(B, H, dtype=torch.int8, device="cuda")  # finite inputs

    def dkdv(kv, grad, lse, d, mode):
        return lambda: branch_dkdv(q, *kv, grad, lse, d, layout, mode, PAPER, scale,
                                   query_finite)

    dq_out = torch.empty_like(q)
    cmp_dq = DqBranch(kc, vc, g_cmp.gate, lse_cmp, d_cmp, cmp_finite)
    win_dq = DqBranch(k, v, g_win.gate, lse_win, d_win, win_finite)

    masked = masked_causal_selection(T, PAPER, packed=False)
    selection = masked_selection(idx, slc_finite) if masked else None
    # The masked dq as the op launches it (decided before the sweep changes the tunings): with
    # the compressed and window branches where its tuning says so, else the selected alone.
    dq_branches = ((cmp_dq, win_dq, layout) if launch_choice("masked_dq", "branches", D)
                   else None)
    return {
        "cmp_fwd": [("cmp", lambda: branch_forward(q, kc, vc, layout, MODE_CMP, PAPER, scale,
                                                   cmp_finite))],
        "win_fwd": [("win", lambda: branch_forward(q, k, v, layout, MODE_WIN, PAPER, scale,
                                                   win_finite))],
        "select": [("select", lambda: select(q, kc, lse_cmp, layout, PAPER, scale))],
        "selected_fwd": [
            ("slc+sum", lambda: position_forward(q, k, v, idx, layout, PAPER, scale, gated))],
        "selected_pair_fwd": [
            ("slc+sum", lambda: pair_forward(q, k, v, idx, PAPER, scale, gated))]
        if position_pairs(HQ // H, packed=False) else [],
        "selected_block_fwd": [
            ("slc+sum", lambda: block_forward(q, k, v, idx, layout, PAPER, scale, gated))],
        "masked_fwd": [
            ("slc+sum", lambda: masked_forward(q, k, v, selection, PAPER, scale, gated))]
        if masked else [],
        "cw_dq": [("cmp+win dq", lambda: branches_dq(q, do, cmp_dq, win_dq, dq, dq_out,
                                                     layout, PAPER, scale))],
        "cmp_dkdv": [("cmp dkdv", dkdv((kc, vc), g_cmp, lse_cmp, d_cmp, MODE_CMP))],
        "win_dkdv": [("win dkdv", dkdv((k, v), g_win, lse_win, d_win, MODE_WIN))],
        "selected_dq": [("slc dq", lambda: position_dq(
            q, k, v, idx, g_slc, lse_slc, d_slc, dq, layout, PAPER, scale))],
        "selected_dkdv": [
            ("slc dkdv", lambda: block_backward(
                q, k, v, idx, g_slc, lse_slc, d_slc, layout, PAPER, scale)),
            ("slc dkdv+dq", lambda: block_backward(
                q, k, v, idx, g_slc, lse_slc, d_slc, layout, PAPER, scale, dq=dq))],
        "masked_dq": [("slc dq" if dq_branches is None else "all dq", lambda: masked_dq(
            q, k, v, selection, g_slc, lse_slc, d_slc, dq, PAPER, scale, accumulate=False,
            dq_out=dq_out, branches=dq_branches))] if masked else [],
        "masked_dkdv": [("slc dkdv", lambda: masked_dkdv(
            q, k, v, selection, g_slc, lse_slc, d_slc, PAPER, scale))] if masked else [],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", default="64,4")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rows", default="32,64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--num-stages", default="1,2,3")
    parser.add_argument("--keys", default="",
                        help="keys per tile of the compressed and window families (cw_dq: its "
                        "compressed branch's; default: "
                        "each family's own)")
    parser.add_argument("--transposed", default="",
                        help="0,1: the compressed and window dK/dV with p^T, dS^T computed as "
                        "[keys, rows] (1) or not (0), for every group (default: as shipped)")
    parser.add_argument("--maxnreg", default="",
                        help="register caps a thread, 0 for none (default: each family's own "
                        "at this head dim, as launched)")
    parser.add_argument("--json", help="write every timing here (bench/plot_tuning.py plots it)")
    parser.add_argument("--families", default="cmp_fwd,win_fwd,select,selected_fwd,"
                        "selected_pair_fwd,selected_block_fwd,masked_fwd,"
                        "cw_dq,cmp_dkdv,win_dkdv,selected_dq,selected_dkdv,masked_dq,"
                        "masked_dkdv")
    args = parser.parse_args(argv)
    HQ, H = (int(x) for x in args.heads.split(","))
    work = stages(args.batch, args.seq, HQ, H, args.dim)
    default = {name: dict(t) for name, t in TUNING.items()}
    narrow = dict(NARROW_TUNING)
    # What a swept shape starts from: the family's tuning at this head dim (NARROW_TUNING's
    # fields too, e.g. masked_dq's register cap), as the op launches it.
    launched = {name: family_tuning(name, tile_width(args.dim)) for name in default}
    grid = list(itertools.product(map(int, args.rows.split(",")), map(int, args.warps.split(",")),
                                  map(int, args.num_stages.split(",")),
                                  [int(k) for k in args.keys.split(",") if k] or [None],
                                  [bool(int(t)) for t in args.transposed.split(",") if t]
                                  or [None],
                                  [int(c) for c in args.maxnreg.split(",") if c] or [None]))
    print(f"# B={args.batch}, T={args.seq}, HQ={HQ}, H={H}, D={args.dim}, bf16; "
          f"default {default}")
    where = f"{args.batch} x {args.seq}, {HQ}/{H}/{args.dim}"
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                command="python bench/tune_kernels.py " + " ".join(argv or sys.argv[1:]))
    results = []
    for family in args.families.split(","):
        for label, fn in work[family]:
            timings = []
            keyed = "keys" in default[family]
            rowed = "rows" in default[family]  # the selected forward/dq: rows = the group's heads
            own_keys = launch_keys(family, args.dim) if keyed else None  # as shipped
            transposable = family in TRANSPOSABLE
            own_transposed = launch_transposed(family, HQ // H, args.dim)  # as shipped
            for rows, warps, n_stages, keys, transposed, cap in grid:
                if not keyed and keys != grid[0][3]:
                    continue  # a family without key tiles: each shape once
                if not rowed and rows != grid[0][0]:
                    continue  # ... and without a rows choice
                if not transposable and transposed != grid[0][4]:
                    continue  # ... and without transposed tiles
                shape = dict(num_warps=warps, num_stages=n_stages)
                if rowed:
                    shape["rows"] = rows
                if keyed:
                    shape["keys"] = own_keys if keys is None else keys
                tuning = dict(launched[family], **shape)
                if cap is not None:  # 0: no cap
                    tuning.pop("maxnreg", None)
                    tuning.update({"maxnreg": cap} if cap else {})
                if "maxnreg" in tuning:
                    shape["maxnreg"] = tuning["maxnreg"]
                if transposable:
                    wanted = own_transposed if transposed is None else transposed
                    tuning["transposed_min_group"] = 1 if wanted else None
                TUNING[family] = NARROW_TUNING[family] = tuning
                if transposable:  # as launched: groups not a power of two never are
                    shape["transposed"] = launch_transposed(family, HQ // H, args.dim)
                try:
                    ms = gpu_ms(fn, CALLS, KERNELS[family])
                except Exception as error:  # noqa: BLE001  (e.g. out of shared memory)
                    ms = float("inf")
                    print(f"  {family}/{label} {shape}: {type(error).__name__}")
                timings.append((ms, shape.get("rows"), warps, n_stages, shape.get("keys"),
                                shape.get("transposed"), shape.get("maxnreg")))
                results.append(dict(family=family, shape=where, **shape, ms=ms, shipped=False))
            TUNING[family] = dict(default[family])
            NARROW_TUNING.pop(family)
            if family in narrow:
                NARROW_TUNING[family] = narrow[family]
            ms_default = gpu_ms(fn, CALLS, KERNELS[family])  # as shipped
            if rowed:
                rows_shipped, launch = launch_shape(family, HQ // H, args.dim)
                launch["rows"] = rows_shipped
            else:
                launch = {key: default[family][key] for key in ("num_warps", "num_stages")}
            results.append(dict(family=family, shape=where, **launch,
                                **({"keys": own_keys} if keyed else {}),
                                **({"transposed": own_transposed} if transposable else {}),
                                ms=ms_default, shipped=True))
            timings.sort(key=lambda t: t[0])
            best = ", ".join(f"{ms:.3f}ms " + ("" if r is None else f"r{r}") + f"w{w}s{s}"
                             + ("" if k is None else f"k{k}") + ("t" if t else "")
                             + ("" if c is None else f"c{c}")
                             for ms, r, w, s, k, t, c in timings[:4])
            print(f"{family:13s} {label:9s} default {ms_default:.3f}ms; best: {best}", flush=True)
            if args.json:  # after every family: a call that runs out of time keeps the rows
                atomic_write_json(Path(args.json), dict(meta=meta, rows=results))


if __name__ == "__main__":
    main()
