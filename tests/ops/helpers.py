"""Shared pieces of the NSA op tests: inputs, relative errors, SDPA oracles, selection checks."""

import math

import torch
import torch.nn.functional as F

from tests.ops.naive_reference import compressed_length, forced_blocks, index_to_sets, sequences

INPUT_NAMES = ("q", "k", "v", "k_cmp", "v_cmp", "gates", "k_win", "v_win")
SELECT_KEYS = ("cmp_block", "cmp_stride", "sel_block", "num_selected", "num_init", "num_local")

# Small blocks so that selection is non-trivial at tiny T.
SMALL = dict(
    cmp_block=4, cmp_stride=2, sel_block=8, num_selected=3, window=5, num_init=1, num_local=1
)


def shape_id(B, T, HQ, H, Dk, Dv=None):
    return f"B{B}-T{T}-HQ{HQ}-H{H}-Dk{Dk}" + ("" if Dv is None else f"-Dv{Dv}")


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


def params_id(p):
    names = dict(
        cmp_block="l",
        cmp_stride="d",
        sel_block="ls",
        num_selected="n",
        window="w",
        num_init="init",
        num_local="local",
        scale="scale",
    )
    return "-".join(f"{names[k]}{v}" for k, v in p.items())


def select_params(p):
    """The subset of the parameters that nsa_select takes."""
    return {k: v for k, v in p.items() if k in SELECT_KEYS + ("scale",)}


def score_params(p):
    """The subset of the parameters that the block scores depend on."""
    return {k: v for k, v in p.items() if k in ("cmp_block", "cmp_stride", "sel_block", "scale")}


def total_compressed_length(T, cu_seqlens, cmp_block, cmp_stride):
    if cu_seqlens is None:
        return compressed_length(T, cmp_block, cmp_stride)
    return sum(
        ceos - cbos for _, _, _, cbos, ceos in sequences(1, T, cu_seqlens, cmp_block, cmp_stride)
    )


def make_inputs(
    B,
    T,
    HQ,
    H,
    Dk,
    Dv,
    *,
    cmp_block,
    cmp_stride,
    dtype=torch.float64,
    seed=0,
    cu_seqlens=None,
    separate_win=True,
    gates=None,
    **_,
):
    """Random NSA inputs (drawn in float64, then cast, so every dtype sees the same values).

    gates: None for random values in (0, 1), or a 3-tuple broadcast to [B, T, HQ, 3].
    """
    gen = torch.Generator().manual_seed(seed)
    Tc = total_compressed_length(T, cu_seqlens, cmp_block, cmp_stride)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = dict(
        q=rnd(B, T, HQ, Dk),
        k=rnd(B, T, H, Dk),
        v=rnd(B, T, H, Dv),
        k_cmp=rnd(B, Tc, H, Dk),
        v_cmp=rnd(B, Tc, H, Dv),
        gates=torch.rand(B, T, HQ, 3, generator=gen, dtype=torch.float64),
    )
    if separate_win:
        x["k_win"], x["v_win"] = rnd(B, T, H, Dk), rnd(B, T, H, Dv)
    if gates is not None:
        x["gates"] = torch.tensor(gates, dtype=torch.float64).expand(B, T, HQ, 3).clone()
    return {name: t.to(dtype) for name, t in x.items()}


def seeded_randn(*shape, seed=1, dtype=torch.float32):
    """A normal CPU tensor from its own generator: the same on every call (an output gradient
    that does not depend on what ran before)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def call(fn, x, **kw):
    """fn(q, k, v, k_cmp, v_cmp, gates, k_win=..., v_win=..., **kw)."""
    win = {name: x[name] for name in ("k_win", "v_win") if name in x}
    return fn(x["q"], x["k"], x["v"], x["k_cmp"], x["v_cmp"], x["gates"], **win, **kw)


def forward_backward(fn, x, do, **kw):
    """Output and the gradient of <out, do> w.r.t. every input, on fresh leaf copies of x
    (an input the output does not depend on, e.g. an empty k_cmp, gets a zero gradient)."""
    leaves = {name: t.detach().clone().requires_grad_(True) for name, t in x.items()}
    out = call(fn, leaves, **kw)
    out.backward(do)
    grads = {name: torch.zeros_like(t) if t.grad is None else t.grad for name, t in leaves.items()}
    return out.detach(), grads


def to_double(x):
    return {name: t.detach().double() for name, t in x.items()}


def rel_err(a, b, floor=1e-3):
    """‖a − b‖ / max(‖b‖, floor) in float64. A reference below ``floor`` is an analytically
    zero result computed as roundoff (dq at T = 1: one key, probability 1), whose direction
    differs between PyTorch builds: it is judged absolutely."""
    a, b = a.detach().double(), b.detach().double()
    return (a - b).norm().item() / max(b.norm().item(), floor)


def assert_rel_close(name, a, b, tol):
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    err = rel_err(a, b)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"


def assert_all_rel_close(out, grads, ref_out, ref_grads, tol):
    assert_rel_close("output", out, ref_out, tol)
    for name in ref_grads:
        assert_rel_close(f"d{name}", grads[name], ref_grads[name], tol)


def gqa_sdpa(q, k, v, mask, scale=None):
    """SDPA with an explicit boolean mask [T, S] (True = attend); GQA by repeat_interleave.

    q [B, T, HQ, Dk], k [B, S, H, Dk], v [B, S, H, Dv] → [B, T, HQ, Dv]; rows with no key are 0.
    """
    G = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(G, dim=2)
    v = v.repeat_interleave(G, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    ).transpose(1, 2)
    empty = ~mask.any(dim=1)  # [T]
    return out.masked_fill(empty[None, :, None, None], 0.0)


def causal_mask(T, window=None):
    t = torch.arange(T)
    mask = t[None, :] <= t[:, None]
    if window is not None:
        mask &= t[None, :] > t[:, None] - window
    return mask


def compressed_mask(T, Tc, cmp_block, cmp_stride):
    """mask[t, i] = i·d + l - 1 ≤ t."""
    return (torch.arange(Tc) * cmp_stride + cmp_block - 1)[None, :] <= torch.arange(T)[:, None]


def local_positions(T, cu_seqlens=None):
    """[(packed position, local position t)] for every token of one batch row."""
    out = []
    for _, bos, eos, _, _ in sequences(1, T, cu_seqlens, 1, 1):
        out += [(bos + t, t) for t in range(eos - bos)]
    return out


def assert_index_format(idx, B, T, H, *, sel_block, num_selected, cu_seqlens=None):
    """[B, T, H, n], integer, ascending valid blocks of 0 … ⌊t/l'⌋, then -1 padding."""
    assert tuple(idx.shape) == (B, T, H, num_selected), f"index shape {tuple(idx.shape)}"
    assert idx.dtype in (torch.int32, torch.int64), f"index dtype {idx.dtype}"
    rows = idx.tolist()
    for b in range(B):
        for pos, t in local_positions(T, cu_seqlens):
            expected_count = min(t // sel_block + 1, num_selected)
            for g in range(H):
                row = rows[b][pos][g]
                valid = [j for j in row if j != -1]
                assert row == valid + [-1] * (num_selected - len(valid)), (
                    f"(b={b}, t={pos}, g={g}): {row} not padded at the end"
                )
                assert valid == sorted(set(valid)), (
                    f"(b={b}, t={pos}, g={g}): {row} not strictly ascending"
                )
                assert all(0 <= j <= t // sel_block for j in valid), (
                    f"(b={b}, t={pos}, g={g}): {row} not a candidate"
                )
                assert len(valid) == expected_count, (
                    f"(b={b}, t={pos}, g={g}): {row} has {len(valid)} blocks, want {expected_count}"
                )


def boundary_gap(scores, t, *, sel_block, num_selected, num_init, num_local):
    """Gap between the last chosen and the first left-out non-forced score (inf if none)."""
    num_candidates = t // sel_block + 1
    if num_candidates <= num_selected:
        return math.inf
    forced = forced_blocks(t, sel_block, num_init, num_local)
    others = sorted((scores[j] for j in range(num_candidates) if j not in forced), reverse=True)
    k = num_selected - len(forced)
    if k <= 0 or k >= len(others):
        return math.inf
    return others[k - 1] - others[k]


def selection_margin(
    scores, T, *, B=1, cu_seqlens=None, sel_block, num_selected, num_init, num_local, **_
):
    """Smallest boundary gap over every (b, t, g): how far the selection is from a tie."""
    margin = math.inf
    for b, bos, eos, _, _ in sequences(B, T, cu_seqlens, 1, 1):
        for t in range(eos - bos):
            for s in scores[b][bos + t]:
                margin = min(
                    margin,
                    boundary_gap(
                        s,
                        t,
                        sel_block=sel_block,
                        num_selected=num_selected,
                        num_init=num_init,
                        num_local=num_local,
                    ),
                )
    return margin


def assert_selection_valid(
    idx, scores, T, *, B=1, cu_seqlens=None, sel_block, num_selected, num_init, num_local, tol, **_
):
    """The package's sets are a correct selection for the reference scores, modulo near-ties < tol.

    Forced blocks present, n blocks (or all candidates), and no left-out non-forced candidate
    scores more than tol above a chosen one.
    """
    sets = index_to_sets(idx)
    for b, bos, eos, _, _ in sequences(B, T, cu_seqlens, 1, 1):
        for t in range(eos - bos):
            for g, s in enumerate(scores[b][bos + t]):
                chosen = set(sets[b][bos + t][g])
                rounded = [round(x, 6) for x in s]
                where = f"(b={b}, t={bos + t}, g={g}): chosen {sorted(chosen)}, scores {rounded}"
                num_candidates = t // sel_block + 1
                if num_candidates <= num_selected:
                    assert chosen == set(range(num_candidates)), where
                    continue
                forced = forced_blocks(t, sel_block, num_init, num_local)
                assert forced <= chosen, f"forced {sorted(forced)} missing: {where}"
                assert len(chosen) == num_selected, where
                free_in = [s[j] for j in chosen - forced]
                free_out = [s[j] for j in range(num_candidates) if j not in chosen]
                if free_in and free_out:
                    assert min(free_in) >= max(free_out) - tol, where


def transpose_dkdv_tiles(monkeypatch, transposed: bool):
    """The compressed and window dK/dV compute their tiles transposed for every group size and
    head dim (``transposed``) or for none."""
    from nsa.ops.triton.launch import NARROW_TUNING, TRANSPOSABLE, TUNING

    least = 1 if transposed else None
    for family in TRANSPOSABLE:
        monkeypatch.setitem(TUNING, family, dict(TUNING[family], transposed_min_group=least))
        monkeypatch.setitem(NARROW_TUNING, family,
                            dict(NARROW_TUNING[family], transposed_min_group=least))
