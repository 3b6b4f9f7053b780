"""Training-step time and memory of the language model, NSA vs dense, across depths.

One step = forward + backward + AdamW update. On CUDA memory is the peak allocated; on the CPU
it is the bytes autograd saves for backward (what grows with depth). Both must grow linearly in
the number of layers. "host ms" is the time the step's Python takes to issue its work (before
the final synchronize): where it is close to the step time, the step is bound by host work,
not by the GPU.

    python bench/train_step.py                                   # CPU, the old "hang" shape
    python bench/train_step.py --preset m7c-125m --layers 12 --batch 8 --device cuda
    python bench/train_step.py --preset m7c-125m --layers 12 --batch 8 --cuda-graph
    python bench/train_step.py --preset m7c-125m --layers 12 --batch 8 --profile 25

``--profile N`` then runs one more step (graphed with ``--cuda-graph``, else eager) under
torch.profiler and prints, after the table, its N largest groups of GPU work by kernel and
launch grid (an eager step gives each kernel's own time: the forty-ninth session found NSA's
RoPE launches 1.7x slower than dense's of the same grid there) and the GPU's timeline of that
step: busy (some kernel, copy or fill running), idle, and two or more at once
(streams side by side): where a step's time goes, and whether any of it is left to overlap.
``--count-ops`` adds the host work of one more eager forward+backward as counts, free of the
host's timing noise: the aten operators it dispatches (views included) and the Triton kernels it
launches; two depths' rows give the work a layer adds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nsa.config_tree import replace_fields
from nsa.models import LanguageModel, ModelConfig, model_preset
from nsa.train.graphs import CUDAGraphStep

# The shape on which the earlier system hung in backward at >= 5 layers.
HANG_SHAPE = replace_fields(
    ModelConfig(), vocab_size=256, dim=128, num_layers=1, num_heads=8, num_kv_heads=2,
    head_dim_k=16, head_dim_v=16, max_seq_len=128, cmp_block=16, cmp_stride=8, sel_block=32,
    num_selected=8, window=64,
)


@contextmanager
def count_saved_bytes(total: list[int]):
    def pack(t: torch.Tensor):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


class _HostWork(TorchDispatchMode):
    """Counts the aten operators dispatched while it is active (views included), and the
    Triton launches that ``launch`` wraps, whose own operators (the interpreter's copies on
    the CPU) are not counted."""

    def __init__(self):
        super().__init__()
        self.ops = self.launches = 0
        self.in_launch = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not self.in_launch
        return func(*args, **(kwargs or {}))

    def launch(self, method):
        def counted(*args, **kwargs):
            self.launches += 1
            self.in_launch = True
            try:
                return method(*args, **kwargs)
            finally:
                self.in_launch = False
        return counted


@contextmanager
def count_host_work(counts: dict):
    """counts["ops"], counts["launches"]: the aten operators dispatched and the Triton kernels
    launched (through nsa's FastKernel on a GPU, the interpreter on the CPU) while active."""
    from triton.runtime.interpreter import InterpretedFunction

    from nsa.ops.triton.jit import FastKernel

    launchers = {(FastKernel, "launch"): FastKernel.launch,
                 (InterpretedFunction, "run"): InterpretedFunction.run}
    work = _HostWork()
    for (owner, name), method in launchers.items():
        setattr(owner, name, work.launch(method))
    try:
        with work:
            yield
    finally:
        for (owner, name), method in launchers.items():
            setattr(owner, name, method)
    counts["ops"], counts["launches"] = work.ops, work.launches


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


GPU_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")  # chrome-trace categories of GPU work


def gpu_timeline(intervals: list[tuple[float, float]]) -> dict:
    """Of GPU activities' (start, end) intervals: the span from the first start to the last
    end, the time some activity runs (busy: their union), idle (span - busy) and the time two
    or more run at once, in the intervals' unit."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running, last, busy, overlapped = 0, 0.0, 0.0, 0.0
    for time_point, change in edges:
        busy += (time_point - last) * (running >= 1)
        overlapped += (time_point - last) * (running >= 2)
        running, last = running + change, time_point
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    return {"span": span, "busy": busy, "idle": span - busy, "overlapped": overlapped}


def kernel_table(activities: list[dict], rows: int) -> list[str]:
    """The ``rows`` largest groups of GPU activities (chrome-trace events: name, dur in µs,
    args.grid) by (name, launch grid), as markdown lines under a total: one kernel launched
    with two grids (a branch's two modes, RoPE over more or fewer heads) is two rows, each with
    its calls and mean time. A launch and its FINITE-off twin (finite.launch_per_flag) have one
    grid, so they share a row: its mean is the pair's (e.g. 213.5 and 5.9 µs, mean 109.7)."""
    groups: dict[tuple[str, str], list[float]] = {}
    for event in activities:
        grid = event.get("args", {}).get("grid")
        key = (event["name"], "×".join(map(str, grid)) if grid else "-")
        groups.setdefault(key, []).append(event["dur"])
    total = max(sum(map(sum, groups.values())) / 1e3, 1e-9)  # ms (no division by 0)
    lines = ["| kernel | grid | calls | µs each | ms | share |", "|---|---|---|---|---|---|"]
    for (name, grid), durations in sorted(groups.items(), key=lambda g: -sum(g[1]))[:rows]:
        ms = sum(durations) / 1e3
        lines.append(f"| {name[:70]} | {grid} | {len(durations)} | "
                     f"{sum(durations) / len(durations):.1f} | {ms:.2f} | {ms / total:.1%} |")
    return lines


def profile_report(run_step, rows: int, kind: str) -> str:
    """One call of ``run_step`` (a ``kind`` step) under torch.profiler, as text: the step's GPU
    time, its ``rows`` largest groups of GPU work by kernel and launch grid (``kernel_table``:
    a Triton kernel's name is its function's) and its GPU timeline (``gpu_timeline``). In an
    eager step the GPU waits for the host between kernels, so each kernel's time is its own;
    in a graphed one, kernels on two streams share the SMs."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        run_step()
    with tempfile.TemporaryDirectory() as tmp:  # name, start, length and grid of each activity
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        gpu = [e for e in json.loads(trace.read_text())["traceEvents"]
               if e.get("cat") in GPU_ACTIVITY]
    total = sum(e["dur"] for e in gpu) / 1e3
    lines = [f"GPU time of one {kind} step: {total:.1f} ms", *kernel_table(gpu, rows)]
    if gpu:
        intervals = [(e["ts"], e["ts"] + e["dur"]) for e in gpu]
        t = {name: value / 1e3 for name, value in gpu_timeline(intervals).items()}  # µs -> ms
        lines.append(f"GPU timeline of that step: {t['span']:.1f} ms from its first kernel to "
                     f"its last, busy {t['busy']:.1f}, idle {t['idle']:.1f}, two or more at "
                     f"once {t['overlapped']:.1f}")
    return "\n".join(lines)


def bench_step(config: ModelConfig, batch: int, steps: int, warmup: int, device: torch.device,
               autocast_dtype: torch.dtype | None, compile_blocks: bool = False,
               cuda_graph: bool = False, profile_rows: int = 0,
               count_ops: bool = False) -> dict:
    torch.manual_seed(0)
    model = LanguageModel(config).to(device)
    if compile_blocks:  # as the trainer's compile=true: torch.compile per block
        for block in model.blocks:
            block.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    seq = config.max_seq_len
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    autocast = (torch.autocast(device.type, dtype=autocast_dtype, cache_enabled=not cuda_graph)
                if autocast_dtype else nullcontext())

    def forward_backward(step_inputs):
        with autocast:
            loss = model(**step_inputs[0])
        loss.backward()
        return (loss.detach(),)

    graphed = CUDAGraphStep(forward_backward, optimizer) if cuda_graph else None
    if cuda_graph:  # the eager warm-up steps and the capture are not timed
        warmup = max(warmup, graphed.warmup + 1)
    times, host_times, saved = [], [], [0]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        if graphed is not None:
            graphed([{"tokens": inputs, "targets": targets}])
        else:
            with count_saved_bytes(saved) if i == 0 else nullcontext():
                forward_backward([{"tokens": inputs, "targets": targets}])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        issued = time.perf_counter()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            host_times.append(issued - start)
    step = statistics.median(times)
    memory = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else saved[0])
    extra = {}  # the profile's text, the host work's counts
    if profile_rows:
        def one_step():
            if graphed is not None:
                graphed([{"tokens": inputs, "targets": targets}])
            else:
                forward_backward([{"tokens": inputs, "targets": targets}])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            synchronize(device)

        extra["profile"] = profile_report(one_step, profile_rows,
                                          "eager" if graphed is None else "graphed")
    if count_ops:
        with count_host_work(extra):
            forward_backward([{"tokens": inputs, "targets": targets}])
        optimizer.zero_grad(set_to_none=True)
    return {"step_ms": step * 1e3, "host_ms": statistics.median(host_times) * 1e3,
            "tokens_per_s": batch * seq / step, "memory_mb": memory / 2**20,
            "params_m": model.num_parameters() / 1e6, **extra}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=None, help="model preset (default: the hang shape)")
    parser.add_argument("--layers", default="1,2,4,8,12", help="comma-separated depths")
    parser.add_argument("--attention", default="nsa,dense")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: preset)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                        help="autocast dtype on CUDA (the CPU runs fp32)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each block, as the trainer's compile=true")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="replay each step's forward and backward from one CUDA graph, as "
                             "the trainer's cuda_graph=true (CUDA only)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print the N GPU kernels of largest time of one more step")
    parser.add_argument("--count-ops", action="store_true",
                        help="add the aten operators and Triton launches of one more eager "
                             "forward+backward (needs Triton)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if args.cuda_graph and device.type != "cuda":
        parser.error("--cuda-graph needs a CUDA device")
    base = model_preset(args.preset) if args.preset else HANG_SHAPE
    base = replace_fields(base, backend=args.backend, max_seq_len=args.seq or base.max_seq_len)
    autocast_dtype = torch.bfloat16 if device.type == "cuda" and args.dtype == "bf16" else None
    memory_kind = "peak MB" if device.type == "cuda" else "saved MB"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    heads = f"{base.attention.num_heads}/{base.attention.num_kv_heads}"
    print(f"# {name}, batch {args.batch}, seq {base.max_seq_len}, dim {base.dim}, "
          f"heads {heads}, autocast {autocast_dtype}, "
          f"backend {args.backend}, compiled blocks {args.compile}, "
          f"CUDA graph {args.cuda_graph}, "
          f"median of {args.steps} steps")
    counted = " aten ops | Triton launches |" if args.count_ops else ""
    print(f"| attention | layers | params (M) | step (ms) | host (ms) | tokens/s | {memory_kind} |"
          + counted)
    print("|---|---|---|---|---|---|---|" + "---|---|" * args.count_ops)
    profiles = []  # printed after the table
    for attention in args.attention.split(","):
        for layers in (int(n) for n in args.layers.split(",")):
            config = replace_fields(base, kind=attention, num_layers=layers)
            r = bench_step(config, args.batch, args.steps, args.warmup, device, autocast_dtype,
                           args.compile, args.cuda_graph, args.profile, args.count_ops)
            counts = f" {r['ops']} | {r['launches']} |" if args.count_ops else ""
            print(f"| {attention} | {layers} | {r['params_m']:.1f} | {r['step_ms']:.1f} | "
                  f"{r['host_ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['memory_mb']:.1f} |"
                  + counts, flush=True)
            if "profile" in r:
                profiles.append(f"\n## {attention}, {layers} layers\n{r['profile']}")
    for profile in profiles:
        print(profile)


if __name__ == "__main__":
    main()
