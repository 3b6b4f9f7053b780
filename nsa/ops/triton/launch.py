"""Launch shapes shared by the Triton branch modules: tile rows, warps and pipelining stages
per kernel family (measured choices: bench/NOTES.md), and small helpers of the launchers."""

from __future__ import annotations

import functools

import torch
import triton

# Launch shapes per kernel family: rows (position x head pairs) per tile and warps. Rows grow
# to the next power of two >= G when a group is larger. Measured choices: see bench/NOTES.md.
TUNING = {
    "dense_fwd": dict(rows=128, num_warps=4, num_stages=2),
    "dense_dq": dict(rows=128, num_warps=8, num_stages=2),
    "dense_dkdv": dict(rows=128, num_warps=8, num_stages=2),
    # select: rows = positions of a tile (its G heads are looped), tokens = compressed tokens
    # per step.
    "select": dict(rows=64, num_warps=4, num_stages=1, tokens=128),
    # One program per position: its rows are the G heads of the position (BLOCK_G), not tuned;
    # warps for head dim 128 (selected.py halves them for smaller heads).
    "selected_fwd": dict(num_warps=1, num_stages=2),
    "selected_dq": dict(num_warps=2, num_stages=2),
    "selected_dkdv": dict(rows=64, num_warps=4, num_stages=2),
}


def pow2(x: int, minimum: int = 16) -> int:
    """The tile size of a dimension of x: the next power of two, at least ``minimum``."""
    return max(minimum, triton.next_power_of_2(x))


def launch_shape(kind: str, G: int, head_dim: int):
    """(rows per tile, launch options) for a kernel family; rows >= G, a power of two >= 16.

    Head dims above 128 (padded to 256) halve the rows and drop software pipelining so the
    tiles fit in shared memory."""
    tuning = TUNING[kind]
    rows, stages = tuning["rows"], tuning["num_stages"]
    if pow2(head_dim) > 128:
        rows, stages = rows // 2, 1
    return max(rows, pow2(G, 16)), dict(num_warps=tuning["num_warps"], num_stages=stages)


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 for the interpreter on the CPU)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def strides(x: torch.Tensor, n: int = 3):
    """The first n strides of x (batch, token, head) for a kernel's pointer arithmetic."""
    return x.stride()[:n]


def shapes(q, k, v):
    """(B, T, HQ, H, G, Dk, Dv) of q [B, T, HQ, Dk], k [B, *, H, Dk], v [B, *, H, Dv]."""
    B, T, HQ, Dk = q.shape
    H, Dv = k.shape[2], v.shape[3]
    G = HQ // H
    return B, T, HQ, H, G, Dk, Dv
