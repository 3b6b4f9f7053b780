"""nsa_select against the naive oracle: block sets, index format, forced blocks, ties, varlen."""

import math
import random

import pytest
import torch

import nsa
from tests.ops.helpers import (
    assert_index_format,
    assert_selection_valid,
    dtype_id,
    make_inputs,
    params_id,
    score_params,
    shape_id,
)
from tests.ops.naive_reference import (
    compressed_length,
    exact_group_scores,
    forced_blocks,
    naive_group_scores,
    naive_select,
    select_from_scores,
    sets_to_index,
)

SHAPES = [  # B, T, HQ, H, Dk
    (1, 1, 1, 1, 8),
    (2, 3, 2, 1, 8),
    (1, 9, 2, 2, 4),
    (2, 37, 6, 2, 16),
    (1, 24, 8, 1, 8),
    (1, 50, 3, 1, 8),
]

PARAMS = [
    dict(cmp_block=4, cmp_stride=2, sel_block=8, num_selected=3, num_init=1, num_local=1),
    dict(cmp_block=4, cmp_stride=2, sel_block=4, num_selected=4, num_init=1, num_local=2),
    dict(cmp_block=8, cmp_stride=4, sel_block=4, num_selected=3, num_init=0, num_local=0),
    dict(cmp_block=4, cmp_stride=4, sel_block=8, num_selected=2, num_init=2, num_local=0),
    dict(cmp_block=6, cmp_stride=3, sel_block=9, num_selected=2, num_init=0, num_local=1),
    dict(cmp_block=2, cmp_stride=1, sel_block=3, num_selected=5, num_init=3, num_local=2),
]

# Near-tie tolerance on group scores (sums of G probabilities) per precision.
SCORE_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _select_inputs(B, T, HQ, H, Dk, p, dtype=torch.float64, seed=0, cu_seqlens=None):
    x = make_inputs(B, T, HQ, H, Dk, 1, dtype=dtype, seed=seed, cu_seqlens=cu_seqlens, **p)
    return x["q"], x["k_cmp"]


@pytest.mark.parametrize("p", PARAMS, ids=params_id)
@pytest.mark.parametrize("B,T,HQ,H,Dk", SHAPES, ids=[shape_id(*s) for s in SHAPES])
def test_select_matches_naive_float64(B, T, HQ, H, Dk, p):
    q, k_cmp = _select_inputs(B, T, HQ, H, Dk, p, seed=T)
    idx = nsa.nsa_select(q, k_cmp, **p)
    assert_index_format(idx, B, T, H, sel_block=p["sel_block"], num_selected=p["num_selected"])
    ref = sets_to_index(naive_select(q, k_cmp, **p), p["num_selected"])
    assert torch.equal(idx.long(), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("p", PARAMS[:3], ids=params_id)
@pytest.mark.parametrize("B,T,HQ,H,Dk", SHAPES[3:], ids=[shape_id(*s) for s in SHAPES[3:]])
def test_select_low_precision_modulo_near_ties(B, T, HQ, H, Dk, p, dtype):
    q, k_cmp = _select_inputs(B, T, HQ, H, Dk, p, dtype=dtype, seed=T + 1)
    idx = nsa.nsa_select(q, k_cmp, **p)
    assert_index_format(idx, B, T, H, sel_block=p["sel_block"], num_selected=p["num_selected"])
    scores = naive_group_scores(q.double(), k_cmp.double(), **score_params(p))
    assert_selection_valid(idx, scores, T, B=B, tol=SCORE_TOL[dtype] * HQ // H, **p)


def test_select_default_parameters():
    q, k_cmp = _select_inputs(1, 200, 4, 2, 8, dict(cmp_block=32, cmp_stride=16), seed=3)
    idx = nsa.nsa_select(q, k_cmp)
    defaults = dict(
        cmp_block=32, cmp_stride=16, sel_block=64, num_selected=16, num_init=1, num_local=2
    )
    assert_index_format(idx, 1, 200, 2, sel_block=64, num_selected=16)
    assert torch.equal(idx.long(), sets_to_index(naive_select(q, k_cmp, **defaults), 16))


def test_select_candidates_at_most_n_selects_all_and_pads():
    p = dict(cmp_block=4, cmp_stride=2, sel_block=4, num_selected=6, num_init=1, num_local=1)
    T = 30  # candidates 1 … 8: first ≤ n, then > n
    q, k_cmp = _select_inputs(2, T, 4, 2, 8, p, seed=5)
    idx = nsa.nsa_select(q, k_cmp, **p).long()
    for t in range(T):
        c = t // 4 + 1
        if c <= 6:
            want = torch.tensor(list(range(c)) + [-1] * (6 - c))
            assert torch.equal(idx[:, t], want.expand(2, 2, 6)), f"t={t}: {idx[:, t].tolist()}"
        else:
            assert (idx[:, t] >= 0).all(), f"t={t}: {idx[:, t].tolist()}"


@pytest.mark.parametrize("favour", ["early", "late"])
@pytest.mark.parametrize("num_init,num_local", [(1, 1), (2, 2), (0, 3), (3, 0), (2, 3)])
def test_forced_blocks_always_present(num_init, num_local, favour):
    """Forced blocks are selected even when their scores are the lowest."""
    p = dict(
        cmp_block=4,
        cmp_stride=2,
        sel_block=4,
        num_selected=6,
        num_init=num_init,
        num_local=num_local,
    )
    B, T, HQ, H, Dk = 1, 48, 2, 1, 4
    Tc = compressed_length(T, 4, 2)
    q = torch.zeros(B, T, HQ, Dk, dtype=torch.float64)
    q[..., 0] = 1.0
    k_cmp = torch.zeros(B, Tc, H, Dk, dtype=torch.float64)
    ramp = 3.0 * torch.arange(Tc, dtype=torch.float64)
    k_cmp[0, :, 0, 0] = -ramp if favour == "early" else ramp
    idx = nsa.nsa_select(q, k_cmp, scale=1.0, **p).long()
    assert_index_format(idx, B, T, H, sel_block=4, num_selected=6)
    for t in range(T):
        if t // 4 + 1 > 6:
            forced = forced_blocks(t, 4, num_init, num_local)
            got = set(idx[0, t, 0].tolist())
            assert forced <= got, f"t={t}: forced {sorted(forced)} not in {sorted(got)}"
    ref = naive_select(q, k_cmp, scale=1.0, **p)
    assert torch.equal(idx, sets_to_index(ref, 6))


@pytest.mark.parametrize("zero", ["q", "k_cmp"])
@pytest.mark.parametrize("num_init,num_local", [(0, 0), (1, 1), (0, 2), (2, 0)])
@pytest.mark.parametrize("HQ,H", [(1, 1), (4, 2)], ids=["G1", "G2"])
def test_ties_go_to_lower_index(HQ, H, num_init, num_local, zero):
    """l = d = l' makes block j's score exactly p_cmp of compressed token j; with q = 0 (or
    k_cmp = 0) every complete block ties exactly and the incomplete last block scores 0."""
    n = 4
    p = dict(
        cmp_block=4,
        cmp_stride=4,
        sel_block=4,
        num_selected=n,
        num_init=num_init,
        num_local=num_local,
    )
    B, T, Dk = 2, 40, 8
    q, k_cmp = _select_inputs(B, T, HQ, H, Dk, p, seed=11)
    (q if zero == "q" else k_cmp).zero_()
    idx = nsa.nsa_select(q, k_cmp, **p).long()
    for t in range(T):
        last = t // 4
        if last + 1 <= n:
            want = list(range(last + 1))
        else:
            forced = forced_blocks(t, 4, num_init, num_local)
            complete = [j for j in range(last + 1) if 4 * j + 3 <= t and j not in forced]
            incomplete = [j for j in range(last + 1) if 4 * j + 3 > t and j not in forced]
            want = sorted(forced | set((complete + incomplete)[: n - len(forced)]))
        want = torch.tensor(want + [-1] * (n - len(want)))
        assert torch.equal(idx[:, t], want.expand(B, H, n)), (
            f"t={t}: {idx[:, t].tolist()} != {want.tolist()}"
        )
    assert torch.equal(idx, sets_to_index(naive_select(q, k_cmp, **p), n))


# (cmp_block, cmp_stride, sel_block): l' > l, l' not a multiple of l, l' < l, l' = l, odd
MAPPING = [
    (4, 2, 8),
    (4, 2, 6),
    (8, 4, 4),
    (8, 2, 4),
    (4, 4, 4),
    (6, 3, 9),
    (2, 1, 3),
    (6, 2, 4),
]


@pytest.mark.parametrize("num_selected", [1, 2, 3])
@pytest.mark.parametrize("lc,d,ls", MAPPING, ids=[f"l{lc}-d{d}-ls{s}" for lc, d, s in MAPPING])
def test_block_score_mapping_direct_count(lc, d, ls, num_selected):
    """Known compressed probabilities (integer weights on random subsets) make the block scores
    exact rationals Σ_h Σ_i p_cmp[h, i]·|[i·d, i·d+l) ∩ [j·l', (j+1)·l')|/l, computed by direct
    count; every unambiguous top-n decision must match it."""
    rng = random.Random(lc * 100 + d * 10 + ls)
    B, T, H, G = 1, 40, 2, 2
    HQ, Dk = H * G, G
    Tc = compressed_length(T, lc, d)
    # head h of group g puts weight w[g][hh][i] on compressed token i (absent = excluded)
    weights = [
        [{i: rng.randint(1, 6) for i in range(Tc) if rng.random() < 0.4} for _ in range(G)]
        for _ in range(H)
    ]
    q = torch.zeros(B, T, HQ, Dk, dtype=torch.float64)
    for h in range(HQ):
        q[0, :, h, h % G] = 1.0
    k_cmp = torch.full((B, Tc, H, Dk), -1000.0, dtype=torch.float64)
    for g in range(H):
        for hh in range(G):
            for i, w in weights[g][hh].items():
                k_cmp[0, i, g, hh] = math.log(w)
    p = dict(
        cmp_block=lc, cmp_stride=d, sel_block=ls, num_selected=num_selected, num_init=0, num_local=0
    )
    idx = nsa.nsa_select(q, k_cmp, scale=1.0, **p).long()
    checked = 0
    for t in range(T):
        for g in range(H):
            s = exact_group_scores(weights[g], t, Tc, cmp_block=lc, cmp_stride=d, sel_block=ls)
            c = len(s)
            if c <= num_selected:
                continue
            ranked = sorted(s, reverse=True)
            if ranked[num_selected - 1] - ranked[num_selected] < 1e-9:
                continue  # a tie at the boundary: covered by test_ties_go_to_lower_index
            want = select_from_scores(
                s, t, sel_block=ls, num_selected=num_selected, num_init=0, num_local=0
            )
            got = idx[0, t, g].tolist()
            assert got == want, (
                f"t={t}, g={g}: got {got}, want {want}, scores {[float(x) for x in s]}"
            )
            checked += 1
    assert checked >= 20, f"only {checked} unambiguous decisions checked"


def test_single_compressed_token_marks_its_blocks():
    """p_cmp one-hot on token i: the chosen block is the one holding most of [i·d, i·d+l)."""
    lc, d, ls = 8, 2, 4  # token i covers 2 or 3 selection blocks
    T = 32
    Tc = compressed_length(T, lc, d)
    p = dict(cmp_block=lc, cmp_stride=d, sel_block=ls, num_selected=1, num_init=0, num_local=0)
    for i in range(Tc):
        q = torch.zeros(1, T, 1, 1, dtype=torch.float64)
        q[..., 0] = 1.0
        k_cmp = torch.full((1, Tc, 1, 1), -1000.0, dtype=torch.float64)
        k_cmp[0, i, 0, 0] = 0.0
        idx = nsa.nsa_select(q, k_cmp, scale=1.0, **p).long()
        t = T - 1
        start = i * d
        # [start, start + 8) against blocks of 4: start % 4 == 0 fills two blocks (a tie: the
        # lower wins); start % 4 == 2 overlaps 2, 4, 2 tokens (the middle block wins)
        want = start // 4 if start % 4 == 0 else start // 4 + 1
        assert idx[0, t, 0, 0].item() == want, f"i={i}: {idx[0, t, 0].tolist()} != {want}"


LENGTHS = [5, 1, 17, 9]


@pytest.mark.parametrize("p", PARAMS[:3], ids=params_id)
def test_select_varlen_equals_each_sequence_alone(p):
    HQ, H, Dk = 4, 2, 8
    cu = torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0).tolist()), dtype=torch.int32)
    T = int(cu[-1])
    q, k_cmp = _select_inputs(1, T, HQ, H, Dk, p, seed=7, cu_seqlens=cu)
    idx = nsa.nsa_select(q, k_cmp, cu_seqlens=cu, **p).long()
    assert_index_format(
        idx, 1, T, H, sel_block=p["sel_block"], num_selected=p["num_selected"], cu_seqlens=cu
    )
    cbos = 0
    for bos, eos in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        Tc = compressed_length(eos - bos, p["cmp_block"], p["cmp_stride"])
        alone = nsa.nsa_select(q[:, bos:eos], k_cmp[:, cbos : cbos + Tc], **p).long()
        assert torch.equal(idx[:, bos:eos], alone), f"sequence [{bos}, {eos})"
        cbos += Tc
    assert torch.equal(
        idx, sets_to_index(naive_select(q, k_cmp, cu_seqlens=cu, **p), p["num_selected"])
    )


CUDA = torch.cuda.is_available()
# Triton 3.6's interpreter multiplies bfloat16 tiles wrongly (tl.dot of two bf16 16 x 16 tiles
# is off by ~1e10), so bfloat16 kernels are checked on CUDA only.
INTERPRETED_BF16 = pytest.mark.skipif(not CUDA, reason="the Triton interpreter's bf16 tl.dot")


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=INTERPRETED_BF16),
                                   torch.float16], ids=dtype_id)
@pytest.mark.parametrize("p", PARAMS[:3], ids=params_id)
@pytest.mark.parametrize("B,T,HQ,H,Dk", SHAPES[3:], ids=[shape_id(*s) for s in SHAPES[3:]])
def test_triton_select_low_precision_modulo_near_ties(B, T, HQ, H, Dk, p, dtype):
    """The Triton kernel's 16-bit path (int32 top-n keys: the low bits of a score hold the
    block index) against the float64 scores, modulo near-ties; the interpreter on the CPU."""
    device = "cuda" if CUDA else "cpu"
    q, k_cmp = _select_inputs(B, T, HQ, H, Dk, p, dtype=dtype, seed=T + 2)
    idx = nsa.nsa_select(q.to(device), k_cmp.to(device), backend="triton", **p).cpu()
    assert_index_format(idx, B, T, H, sel_block=p["sel_block"], num_selected=p["num_selected"])
    scores = naive_group_scores(q.double(), k_cmp.double(), **score_params(p))
    assert_selection_valid(idx, scores, T, B=B, tol=SCORE_TOL[dtype] * HQ // H, **p)


def test_triton_select_low_precision_ties_go_to_the_lower_block():
    """Equal scores in float16: every compressed key the same, so every candidate block of
    a position scores the same (blocks whose tokens all count) and the lowest win, as the
    float64 oracle picks them."""
    p = PARAMS[0]
    device = "cuda" if CUDA else "cpu"
    q, k_cmp = _select_inputs(1, 64, 4, 2, 8, p, dtype=torch.float16, seed=3)
    k_cmp = torch.ones_like(k_cmp)
    idx = nsa.nsa_select(q.to(device), k_cmp.to(device), backend="triton", **p).cpu()
    ref = sets_to_index(naive_select(q.double(), k_cmp.double(), **p), p["num_selected"])
    assert torch.equal(idx.long(), ref)


def test_select_backends_and_no_grad():
    p = PARAMS[0]
    q, k_cmp = _select_inputs(1, 20, 2, 1, 8, p)
    q.requires_grad_(True)
    k_cmp.requires_grad_(True)
    idx = nsa.nsa_select(q, k_cmp, **p)
    assert not idx.requires_grad and idx.grad_fn is None
    assert torch.equal(idx, nsa.nsa_select(q, k_cmp, backend="torch", **p))


def test_select_scale_argument():
    p = PARAMS[0]
    q, k_cmp = _select_inputs(2, 37, 4, 2, 8, p, seed=9)
    for scale in (0.05, 1.7):
        idx = nsa.nsa_select(q, k_cmp, scale=scale, **p).long()
        assert torch.equal(
            idx, sets_to_index(naive_select(q, k_cmp, scale=scale, **p), p["num_selected"])
        )


def test_compressed_length_helper():
    for lc, d in [(32, 16), (4, 2), (4, 4), (6, 3), (1, 1)]:
        for T in range(0, 80):
            assert nsa.ops.compressed_length(T, lc, d) == compressed_length(T, lc, d), (T, lc, d)


SELECT_BAD = [
    ("q-rank3", lambda q, kc: (q[..., 0], kc), r"\bq\b"),
    ("k_cmp-rank3", lambda q, kc: (q, kc[..., 0]), r"\bk_cmp\b"),
    ("k_cmp-wrong-Tc", lambda q, kc: (q, kc[:, :-1]), r"\bk_cmp\b"),
    ("k_cmp-wrong-Dk", lambda q, kc: (q, kc[..., :-1]), r"\bk_cmp\b"),
    ("k_cmp-wrong-B", lambda q, kc: (q, kc[:1]), r"\bk_cmp\b"),
    ("HQ-not-multiple-of-H", lambda q, kc: (q[:, :, :3], kc), r"\b(q|k_cmp|HQ|H)\b"),
    ("k_cmp-dtype", lambda q, kc: (q, kc.float()), r"\bk_cmp\b"),
]


@pytest.mark.parametrize("bad,match", [c[1:] for c in SELECT_BAD], ids=[c[0] for c in SELECT_BAD])
def test_select_invalid_tensors_raise(bad, match):
    q, k_cmp = _select_inputs(2, 12, 4, 2, 8, PARAMS[0])
    q, k_cmp = bad(q, k_cmp)
    with pytest.raises(ValueError, match=match):
        nsa.nsa_select(q, k_cmp, **PARAMS[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_select_mixed_devices_raise():
    q, k_cmp = _select_inputs(2, 12, 4, 2, 8, PARAMS[0])
    with pytest.raises(ValueError, match=r"\bk_cmp\b"):
        nsa.nsa_select(q, k_cmp.cuda(), **PARAMS[0])
