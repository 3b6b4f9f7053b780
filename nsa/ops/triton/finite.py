"""Which inputs are finite, per (batch, KV head), from one kernel, with no host sync.

A masked (query, key) pair still meets in a tile's products, with a probability or a score
gradient of 0, and 0 · NaN is NaN (common.py, Masks): where a tile holds masked pairs, a
non-finite key or value (forward, dq) or query, output gradient or gate (dK/dV) of a pair that
does not count would reach a row or key that must not see it. The kernels guard against that
with per-tile bookkeeping (finite parts, poisoned rows), which costs the compressed and window
kernels' partial tiles about twice their instructions (bench/NOTES.md, v20), and the masked
selected kernels a third of their time (v19). Nearly always every input is finite, so the
kernels read these flags and take their plain masks wherever the inputs they guard are
finite. The forward computes the flags of the three branches' keys and values here (kept for
the backward); the gate backward kernel, which reads the output gradient and the gates
already, those of the query side (gating.py).
"""

from __future__ import annotations

import torch
import triton.language as tl

from nsa.ops.triton.common import all_finite, load_tile
from nsa.ops.triton.jit import kernel
from nsa.ops.triton.launch import cdiv, pow2, strides

FINITE_ROWS = 64  # tokens per program
MAX_PAIRS = 3  # (keys, values) pairs per launch: the op's three branches


@kernel
def _kv_finite_kernel(
    K0, V0, K1, V1, K2, V2, FINITE, H, N0, N1, N2,
    sk0b, sk0n, sk0h, sv0b, sv0n, sv0h, sk1b, sk1n, sk1h, sv1b, sv1n, sv1h,
    sk2b, sk2n, sk2h, sv2b, sv2n, sv2h,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """FINITE[i, b, h] = 0 (from 1) if a key of Ki [B, Ni, H, DK] or a value of Vi [B, Ni, H,
    DV] at (b, h) among this program's BLOCK_N tokens is not finite (program axis 2: the pair
    i; one DK and one DV for all pairs); programs that find one store the same 0."""
    pid = tl.program_id(0)
    i = tl.program_id(2)
    b = (pid // H).to(tl.int64)
    h = pid % H
    # This program's pair: scalar selects among the three.
    K = tl.where(i == 0, K0, tl.where(i == 1, K1, K2))
    V = tl.where(i == 0, V0, tl.where(i == 1, V1, V2))
    N = tl.where(i == 0, N0, tl.where(i == 1, N1, N2))
    skb = tl.where(i == 0, sk0b, tl.where(i == 1, sk1b, sk2b))
    skn = tl.where(i == 0, sk0n, tl.where(i == 1, sk1n, sk2n))
    skh = tl.where(i == 0, sk0h, tl.where(i == 1, sk1h, sk2h))
    svb = tl.where(i == 0, sv0b, tl.where(i == 1, sv1b, sv2b))
    svn = tl.where(i == 0, sv0n, tl.where(i == 1, sv1n, sv2n))
    svh = tl.where(i == 0, sv0h, tl.where(i == 1, sv1h, sv2h))
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n64 = n.to(tl.int64)
    k = load_tile(K + b * skb + n64 * skn + h * skh, n < N, DK, BLOCK_DK)
    v = load_tile(V + b * svb + n64 * svn + h * svh, n < N, DV, BLOCK_DV)
    if (all_finite(k) & all_finite(v)) == 0:
        tl.store(FINITE + i * tl.num_programs(0) + pid, tl.zeros([], tl.int8))


def launch_per_flag(kernel, grid, *args, **kwargs):
    """Launch a kernel once per value of its FINITE constant, the kernel running only the
    programs whose (batch row, KV head) flag, FLAGS[program_id(1)], equals it (its body under
    ``if (tl.load(FLAGS + tl.program_id(1)) != 0) == FINITE``) and returning at once elsewhere.
    With FINITE a constant the finite path has no run-time branch to the bookkeeping one: in
    one kernel that branched between them, ptxas serialized every wgmma (C7515;
    bench/NOTES.md, twenty-fifth session)."""
    for finite in (True, False):
        kernel[grid](*args, FINITE=finite, **kwargs)


def kv_finite_flags(pairs) -> torch.Tensor:
    """[len(pairs), B, H] int8: flags[i, b, h] is 1 where every key and value of the i-th
    (k, v) pair of ``pairs`` (1 to 3 pairs, e.g. the compressed, selected and window
    branches'; k [B, N_i, H, Dk], v [B, N_i, H, Dv]: N_i may differ, Dk and Dv may not) at
    (b, h) is finite, else 0; one launch."""
    if not 0 < len(pairs) <= MAX_PAIRS:
        raise ValueError(f"kv_finite_flags takes 1 to {MAX_PAIRS} pairs, got {len(pairs)}")
    (k0, v0) = pairs[0]
    B, _, H, Dk = k0.shape
    Dv = v0.shape[-1]
    finite = torch.ones(len(pairs), B, H, dtype=torch.int8, device=k0.device)
    longest = max(k.shape[1] for k, _ in pairs)
    slots = list(pairs) + [pairs[0]] * (MAX_PAIRS - len(pairs))  # unused: no program reads
    if B * H and longest:
        _kv_finite_kernel[(B * H, cdiv(longest, FINITE_ROWS), len(pairs))](
            *(x for pair in slots for x in pair), finite, H, *(k.shape[1] for k, _ in slots),
            *(s for k, v in slots for s in (*strides(k), *strides(v))),
            DK=Dk, DV=Dv, BLOCK_DK=pow2(Dk), BLOCK_DV=pow2(Dv), BLOCK_N=FINITE_ROWS)
    return finite
