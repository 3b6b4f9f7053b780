"""Peak memory of one forward+backward of the Triton op at any shape, on the CPU, and where it
goes: the tensors live at the peak by the line of nsa that allocated them.

    python bench/op_memory.py --seq 32768 --heads 16,4 --dim 128

The kernels are not run (under the Triton interpreter every launch returns at once) but every
tensor the op allocates is, with the sizes a GPU run allocates, so the peak is that of
``bench/attention.py``'s peak column (bytes allocated above the inputs during one
forward+backward after a warm-up call). Checked against an H200 (2026-11-29): 1,274 and 5,046
MB at 32k 4/4/128 and 16/4/128 before v33 (the GPU: the same), 1,314 and 3,689 after (1,338
and 3,689), 11,856 at 64k 64/4/128 (11.9 GB). The sizes that depend on the GPU's SM count
(the dK/dV segments of the compressed and window branches) take the interpreter's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import traceback
from collections import defaultdict
from pathlib import Path

if __name__ == "__main__":  # (a test process on a GPU machine must keep its real launches)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import torch  # noqa: E402
from attention import make_nsa, nsa_inputs  # noqa: E402 (bench/attention.py)
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

NSA_DIR = str(Path(__file__).resolve().parents[1] / "nsa")


@contextlib.contextmanager
def launches_skipped():
    """Triton launches (under the interpreter) that return without running the kernel."""
    run = InterpretedFunction.run
    InterpretedFunction.run = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        InterpretedFunction.run = run


class AllocationSites(TorchDispatchMode):
    """(storage address, the nsa line that made it) of every op output in new storage (not a
    view or an in-place result of an input), in order."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ours = [f for f in traceback.extract_stack() if f.filename.startswith(NSA_DIR)]
        site = (f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].line.strip()}"
                if ours else f"(outside nsa) {func}")
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        self.log += [(address, site) for address in dict.fromkeys(
            t.untyped_storage().data_ptr() for t in tree_leaves(out)
            if isinstance(t, torch.Tensor)) if address not in inputs]
        return out


def _allocations(prof) -> list[tuple[int, int, int]]:
    """(time ns, address, bytes: negative for a free) of every allocation the profiler saw."""
    def walk(node):
        yield node
        for child in node.children:
            yield from walk(child)

    return sorted((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size)
                  for root in prof.profiler.kineto_results.experimental_event_tree()
                  for node in walk(root)
                  if type(node.extra_fields).__name__ == "_ExtraFields_Allocation")


def peak_sites(allocations, log) -> tuple[int, dict[str, int]]:
    """(peak bytes above the start, bytes per site live at the peak): ``allocations`` in time
    order, each address's allocations matched in order to ``log``'s outputs at that address."""
    sites_at = defaultdict(list)
    for address, site in log:
        sites_at[address].append(site)
    live, peak, alive, at_peak = 0, 0, {}, {}
    for _, address, size in allocations:
        live += size
        if size > 0:
            alive[address] = (size, sites_at[address].pop(0) if sites_at[address]
                              else "(an op's own workspace)")
        else:
            alive.pop(address, None)
        if live > peak:
            peak, at_peak = live, dict(alive)
    by_site = defaultdict(int)
    for size, site in at_peak.values():
        by_site[site] += size
    return peak, dict(by_site)


def measure(T: int, HQ: int, H: int, D: int, dtype=torch.bfloat16) -> dict:
    """{"peak_mb", "sites": {site: MB live at the peak}} of one forward+backward at B = 1 with
    the paper's block parameters, the inputs of bench/attention.py."""
    x = nsa_inputs(T, HQ, H, D, dtype, "cpu")
    run = make_nsa("triton")
    grad = torch.zeros(1, T, HQ, D, dtype=dtype)

    def forward_backward():
        torch.autograd.grad(run(x), list(x.values()), grad)

    with launches_skipped():
        forward_backward()  # builds the cached tables
        sites = AllocationSites()
        with sites, profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            forward_backward()
    peak, by_site = peak_sites(_allocations(prof), sites.log)
    return {"peak_mb": peak / 2**20,
            "sites": {site: size / 2**20 for site, size in
                      sorted(by_site.items(), key=lambda item: -item[1])}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", default="16,4", help="HQ,H")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--min-mb", type=float, default=1.0, help="smallest site listed")
    args = parser.parse_args(argv)
    HQ, H = (int(n) for n in args.heads.split(","))
    result = measure(args.seq, HQ, H, args.dim)
    print(f"# T={args.seq}, HQ={HQ}, H={H}, D={args.dim}, bf16, B=1, paper parameters: "
          f"peak {result['peak_mb']:,.0f} MB above the inputs")
    print("| MB live at the peak | allocated at |")
    print("|---|---|")
    for site, mb in result["sites"].items():
        if mb >= args.min_mb:
            print(f"| {mb:,.1f} | `{site}` |")
    return result


if __name__ == "__main__":
    main()
