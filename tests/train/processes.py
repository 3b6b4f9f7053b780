"""Shared by the tests that train in subprocesses (torchrun or plain python)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import nsa
from nsa.train.metrics import METRICS, read_metrics

REPO = Path(nsa.__file__).parents[1]
# A two-layer model (FSDP shards each block and the root), global batch 4 = 2 ranks x 2 rows,
# a checkpoint every 2 steps, every step logged; ranks on the CPU (gloo), GPUs or not.
SMALL_RUN = ["--preset", "tiny", "dim=32", "num_layers=2", "num_heads=2", "num_kv_heads=1",
             "head_dim_k=16", "head_dim_v=16", "seq_len=32", "batch_size=4", "eval_steps=2",
             "checkpoint_interval=2", "log_interval=1", "sample_tokens=0", "num_threads=1",
             "device=cpu"]


def losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} of a run's metrics."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / METRICS) if "loss" in r}


def run(command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
