"""The Triton append of a decode step's keys and values (nsa/ops/triton/cache_append.py) writes
the caches exactly as the PyTorch form (nsa.layers.cache.append_kv_torch) does: both K/V
modes, positions that wrap the rings, Dk != Dv, a head dim whose half is not a power of two;
and it writes nothing for a position outside the cache. On a machine without CUDA it runs in
Triton's interpreter."""

import pytest
import torch

from nsa.layers.cache import append_kv_torch
from nsa.layers.rope import rope_angles, rope_frequencies

pytest.importorskip("triton")

from nsa.ops.triton.cache_append import append_kv_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
CAPACITY, WINDOW, CMP_BLOCK = 40, 8, 4


def caches(B, H, Dk, Dv, ring, dtype, seed):
    """Buffers of an NSA cache, filled with noise (slots not written must keep it)."""
    g = torch.Generator().manual_seed(seed)
    make = lambda n, d: torch.randn(B, n, H, d, generator=g).to(DEVICE, dtype)  # noqa: E731
    return [make(CAPACITY, Dk), make(CAPACITY, Dv),
            make(WINDOW, Dk) if ring else None, make(WINDOW, Dv) if ring else None,
            make(CMP_BLOCK, Dk), make(CMP_BLOCK, Dv)]


def step_inputs(B, sets, H, Dk, Dv, positions, dtype):
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(B, 1, sets, H, Dk + Dv, generator=g).to(DEVICE, dtype)
    pos = torch.tensor(positions, device=DEVICE)
    cos, sin = rope_angles(pos[:, None], rope_frequencies(Dk, 10000.0, DEVICE))
    return kv, cos, sin, pos


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sets", [3, 1], ids=["independent", "shared"])
@pytest.mark.parametrize("Dk,Dv", [(16, 8), (10, 12)])
def test_triton_append_writes_what_the_torch_append_writes(Dk, Dv, sets, dtype):
    B, H = 3, 2
    positions = [0, 13, CAPACITY - 1]  # 13 and 39 wrap both rings
    kv, cos, sin, pos = step_inputs(B, sets, H, Dk, Dv, positions, dtype)
    expected = caches(B, H, Dk, Dv, sets == 3, dtype, seed=0)
    actual = caches(B, H, Dk, Dv, sets == 3, dtype, seed=0)
    untouched = caches(B, H, Dk, Dv, sets == 3, dtype, seed=0)
    append_kv_torch(kv, cos, sin, pos, *expected)
    append_kv_triton(kv, cos, sin, pos, *actual)
    atol = 1e-6 if dtype == torch.float32 else 1e-2  # rounding of the rotation's products
    for name, want, got, before in zip(("k", "v", "k_win", "v_win", "src_k", "src_v"),
                                       expected, actual, untouched):
        if want is None:
            assert got is None
            continue
        assert not torch.equal(want, before), name  # the step wrote this buffer
        torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=name)


def test_triton_append_writes_nothing_outside_the_cache():
    B, H, Dk, Dv = 2, 2, 16, 16
    kv, cos, sin, pos = step_inputs(B, 3, H, Dk, Dv, [CAPACITY, -1], torch.float32)
    actual = caches(B, H, Dk, Dv, True, torch.float32, seed=0)
    append_kv_triton(kv, cos, sin, pos, *actual)
    for got, before in zip(actual, caches(B, H, Dk, Dv, True, torch.float32, seed=0)):
        assert torch.equal(got, before)
