"""nsa_attention against the naive oracle and the spec's consequences: output, every gradient."""

import pytest
import torch

import nsa
from tests.ops.helpers import (
    INPUT_NAMES,
    SMALL,
    assert_all_rel_close,
    assert_rel_close,
    assert_selection_valid,
    call,
    causal_mask,
    compressed_mask,
    dtype_id,
    forward_backward,
    gqa_sdpa,
    make_inputs,
    params_id,
    score_params,
    seeded_randn,
    select_params,
    selection_margin,
    shape_id,
    to_double,
)
from tests.ops.naive_reference import (
    compressed_length,
    naive_attention,
    naive_group_scores,
    naive_select,
    sets_to_index,
)

SHAPES = [  # B, T, HQ, H, Dk, Dv
    (1, 1, 1, 1, 8, 8),  # a single token, no compressed token
    (2, 3, 2, 1, 8, 4),  # T < cmp_block
    (1, 9, 2, 2, 4, 12),  # T just past a selection block, G = 1
    (2, 37, 6, 2, 16, 8),  # T a multiple of no block, G = 3
    (1, 24, 8, 1, 8, 16),  # T a multiple of every block, G = 8
]
SHAPE_IDS = [shape_id(*s) for s in SHAPES]

PARAMS = [
    SMALL,
    dict(cmp_block=4, cmp_stride=2, sel_block=4, num_selected=4, window=3, num_init=1, num_local=2),
    dict(cmp_block=8, cmp_stride=4, sel_block=4, num_selected=3, window=7, num_init=0, num_local=0),
    dict(cmp_block=4, cmp_stride=4, sel_block=8, num_selected=2, window=1, num_init=2, num_local=0),
    dict(
        cmp_block=6, cmp_stride=3, sel_block=9, num_selected=2, window=40, num_init=0, num_local=1
    ),
]

# The spec's tolerances; float16 (3 more mantissa bits than bfloat16) gets 1e-2 / 5.
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
SCORE_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}

LENGTHS = [5, 1, 17, 9]


def _cu_seqlens(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _grad_out(x, seed=123):
    q, v = x["q"], x["v"]
    return seeded_randn(*q.shape[:3], v.shape[-1], seed=seed, dtype=torch.float64).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Against the naive oracle
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", PARAMS, ids=params_id)
@pytest.mark.parametrize("B,T,HQ,H,Dk,Dv", SHAPES, ids=SHAPE_IDS)
def test_matches_naive_float64(B, T, HQ, H, Dk, Dv, p):
    x = make_inputs(B, T, HQ, H, Dk, Dv, seed=T, **p)
    do = _grad_out(x)
    out, grads = forward_backward(nsa.nsa_attention, x, do, **p)
    ref, ref_grads = forward_backward(naive_attention, x, do, **p)
    assert out.dtype == torch.float64
    assert_all_rel_close(out, grads, ref, ref_grads, TOL[torch.float64])


@pytest.mark.parametrize("B,T,HQ,H,Dk,Dv", [SHAPES[3], SHAPES[4]], ids=SHAPE_IDS[3:5])
def test_window_kv_default_to_k_v(B, T, HQ, H, Dk, Dv):
    p = SMALL
    x = make_inputs(B, T, HQ, H, Dk, Dv, seed=1, separate_win=False, **p)
    do = _grad_out(x)
    out, grads = forward_backward(nsa.nsa_attention, x, do, **p)
    ref, ref_grads = forward_backward(naive_attention, x, do, **p)
    assert_all_rel_close(out, grads, ref, ref_grads, TOL[torch.float64])
    # passing k_win=k, v_win=v explicitly is the same function
    explicit = nsa.nsa_attention(
        x["q"], x["k"], x["v"], x["k_cmp"], x["v_cmp"], x["gates"], k_win=x["k"], v_win=x["v"], **p
    )
    assert_rel_close("explicit k_win=k, v_win=v", explicit, out, 1e-14)


@pytest.mark.parametrize("which", ["k_win", "v_win"])
def test_one_window_tensor_given_other_defaults(which):
    """Spec: k_win, v_win default to k, v (each on its own)."""
    B, T, HQ, H, Dk, Dv = 1, 20, 4, 2, 8, 8
    p = SMALL
    x = make_inputs(B, T, HQ, H, Dk, Dv, seed=2, **p)
    del x["v_win" if which == "k_win" else "k_win"]
    do = _grad_out(x)
    out, grads = forward_backward(nsa.nsa_attention, x, do, **p)
    ref, ref_grads = forward_backward(naive_attention, x, do, **p)
    assert_all_rel_close(out, grads, ref, ref_grads, TOL[torch.float64])


def test_default_parameters():
    B, T, HQ, H, Dk, Dv = 1, 150, 2, 1, 8, 8
    x = make_inputs(B, T, HQ, H, Dk, Dv, cmp_block=32, cmp_stride=16, seed=4)
    do = _grad_out(x)
    out, grads = forward_backward(nsa.nsa_attention, x, do)
    ref, ref_grads = forward_backward(naive_attention, x, do)
    assert_all_rel_close(out, grads, ref, ref_grads, TOL[torch.float64])


def test_non_default_scale():
    B, T, HQ, H, Dk, Dv = 2, 29, 4, 2, 8, 6
    p = dict(SMALL, scale=0.37)
    x = make_inputs(B, T, HQ, H, Dk, Dv, seed=5, **p)
    do = _grad_out(x)
    out, grads = forward_backward(nsa.nsa_attention, x, do, **p)
    ref, ref_grads = forward_backward(naive_attention, x, do, **p)
    assert_all_rel_close(out, grads, ref, ref_grads, TOL[torch.float64])


LOW_SHAPES = [(2, 37, 6, 2, 16, 8), (1, 40, 4, 1, 32, 16), (1, 5, 2, 1, 8, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("p", PARAMS[:3], ids=params_id)
@pytest.mark.parametrize("B,T,HQ,H,Dk,Dv", LOW_SHAPES, ids=[shape_id(*s) for s in LOW_SHAPES])
def test_low_precision_matches_float64_with_same_blocks(B, T, HQ, H, Dk, Dv, p, dtype):
    """Low-precision output and gradients vs the float64 oracle run on the same (upcast) inputs
    and the blocks the package selected; those blocks must be right modulo near-ties."""
    x = make_inputs(B, T, HQ, H, Dk, Dv, seed=T + 2, dtype=dtype, **p)
    do = _grad_out(x)
    idx = nsa.nsa_select(x["q"], x["k_cmp"], **select_params(p))
    scores = naive_group_scores(x["q"].double(), x["k_cmp"].double(), **score_params(p))
    assert_selection_valid(idx, scores, T, B=B, tol=SCORE_TOL[dtype] * (HQ // H), **p)
    out, grads = forward_backward(nsa.nsa_attention, x, do, **p)
    assert out.dtype == dtype
    for name, g in grads.items():
        assert g.dtype == dtype, f"d{name} dtype {g.dtype}"
    ref, ref_grads = forward_backward(naive_attention, to_double(x), do.double(), selected=idx, **p)
    assert_all_rel_close(out, grads, ref, ref_grads, TOL[dtype])


# ---------------------------------------------------------------------------------------------
# Consequences of the spec, against SDPA
# ---------------------------------------------------------------------------------------------

SDPA_SHAPES = [(1, 1, 1, 1, 8, 8), (2, 13, 2, 2, 8, 4), (1, 33, 3, 1, 16, 8), (1, 20, 8, 1, 4, 12)]
SDPA_IDS = [shape_id(*s) for s in SDPA_SHAPES]


def _sdpa_fwd_bwd(q, kk, vv, mask, do, scale=None):
    q, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, kk, vv))
    out = gqa_sdpa(q, kk, vv, mask, scale)
    out.backward(do)
    return out.detach(), q.grad, kk.grad, vv.grad


@pytest.mark.parametrize("window", ["full", 1, 4])
@pytest.mark.parametrize("B,T,HQ,H,Dk,Dv", SDPA_SHAPES, ids=SDPA_IDS)
def test_window_branch_equals_sdpa(B, T, HQ, H, Dk, Dv, window):
    """gates (0, 0, 1): w ≥ T is full causal attention; a small w is a causal band."""
    w = T + 3 if window == "full" else window
    p = dict(SMALL, window=w)
    x = make_inputs(B, T, HQ, H, Dk, Dv, seed=6, gates=(0.0, 0.0, 1.0), **p)
    do = _grad_out(x)
    out, grads = forward_backward(nsa.nsa_attention, x, do, **p)
    mask = causal_mask(T) if window == "full" else causal_mask(T, w)
    ref, dq, dk, dv = _sdpa_fwd_bwd(x["q"], x["k_win"], x["v_win"], mask, do)
    assert_rel_close("output", out, ref, 1e-12)
    assert_rel_close("dq", grads["q"], dq, 1e-12)
    assert_rel_close("dk_win", grads["k_win"], dk, 1e-12)
    assert_rel_close("dv_win", grads["v_win"], dv, 1e-12)
    for name in ("k", "v", "k_cmp", "v_cmp"):
        assert torch.count_nonzero(grads[name]) == 0, f"d{name} should be 0 with gates (0, 0, 1)"


SLC_CASES = [  # T, sel_block, num_selected with n·l' ≥ T
    (24, 8, 3),
    (37, 4, 10),
    (9, 8, 2),
    (1, 8, 1),
    (50, 16, 4),
]


@pytest.mark.parametrize("T,ls,n", SLC_CASES, ids=[f"T{T}-ls{ls}-n{n}" for T, ls, n in SLC_CASES])
@pytest.mark.parametrize("HQ,H", [(2, 2), (6, 2), (8, 1)], ids=["G1", "G3", "G8"])
def test_selected_branch_with_all_blocks_equals_causal_sdpa(T, ls, n, HQ, H):
    p = dict(
        cmp_block=4, cmp_stride=2, sel_block=ls, num_selected=n, window=2, num_init=1, num_local=0
    )
    x = make_inputs(1, T, HQ, H, 8, 4, seed=7, gates=(0.0, 1.0, 0.0), **p)
    do = _grad_out(x)
    out, grads = forward_backward(nsa.nsa_attention, x, do, **p)
    ref, dq, dk, dv = _sdpa_fwd_bwd(x["q"], x["k"], x["v"], causal_mask(T), do)
    assert_rel_close("output", out, ref, 1e-12)
    assert_rel_close("dq", grads["q"], dq, 1e-12)
    assert_rel_close("dk", grads["k"], dk, 1e-12)
    assert_rel_close("dv", grads["v"], dv, 1e-12)


CMP_CASES = [(4, 2), (4, 4), (8, 4), (6, 3), (1, 1)]


@pytest.mark.parametrize("lc,d", CMP_CASES, ids=[f"l{lc}-d{d}" for lc, d in CMP_CASES])
@pytest.mark.parametrize("B,T,HQ,H,Dk,Dv", SDPA_SHAPES, ids=SDPA_IDS)
def test_compressed_branch_equals_masked_sdpa(B, T, HQ, H, Dk, Dv, lc, d):
    """gates (1, 0, 0): attention over the compressed tokens with i·d + l - 1 ≤ t (0 if none)."""
    p = dict(
        cmp_block=lc,
        cmp_stride=d,
        sel_block=2 * lc,
        num_selected=2,
        window=3,
        num_init=1,
        num_local=1,
    )
    x = make_inputs(B, T, HQ, H, Dk, Dv, seed=8, gates=(1.0, 0.0, 0.0), **p)
    do = _grad_out(x)
    out, grads = forward_backward(nsa.nsa_attention, x, do, **p)
    Tc = compressed_length(T, lc, d)
    ref, dq, dk, dv = _sdpa_fwd_bwd(
        x["q"], x["k_cmp"], x["v_cmp"], compressed_mask(T, Tc, lc, d), do
    )
    assert_rel_close("output", out, ref, 1e-12)
    assert_rel_close("dq", grads["q"], dq, 1e-12)
    assert_rel_close("dk_cmp", grads["k_cmp"], dk, 1e-12)
    assert_rel_close("dv_cmp", grads["v_cmp"], dv, 1e-12)
    empty = min(T, lc - 1)  # positions t < l - 1 see no compressed token
    assert torch.count_nonzero(out[:, :empty]) == 0, (
        "o_cmp must be 0 when no compressed token is visible"
    )


BRANCH_GATES = {"cmp": (1.0, 0.0, 0.0), "slc": (0.0, 1.0, 0.0), "win": (0.0, 0.0, 1.0), "all": None}


@pytest.mark.parametrize("branch", list(BRANCH_GATES))
@pytest.mark.parametrize("p", PARAMS[:3], ids=params_id)
def test_causality(branch, p):
    """No output at t changes when any input at a position > t changes (compressed token i
    sits at position i·d + l - 1)."""
    B, T, HQ, H, Dk, Dv = 2, 33, 4, 2, 8, 8
    x = make_inputs(B, T, HQ, H, Dk, Dv, seed=9, gates=BRANCH_GATES[branch], **p)
    out = call(nsa.nsa_attention, x, **p)
    cmp_pos = torch.arange(x["k_cmp"].shape[1]) * p["cmp_stride"] + p["cmp_block"] - 1
    gen = torch.Generator().manual_seed(10)
    for t in (0, 3, 8, 17, 31):
        y = {}
        for name, val in x.items():
            future = (cmp_pos > t) if name in ("k_cmp", "v_cmp") else (torch.arange(T) > t)
            noise = 50.0 * torch.randn(val.shape, generator=gen, dtype=val.dtype)
            if name == "gates" and BRANCH_GATES[branch] is not None:
                noise = noise.abs()  # keep the other branches' gates at 0: only the future moves
                noise *= torch.tensor(BRANCH_GATES[branch], dtype=val.dtype)
            y[name] = torch.where(future[None, :, None, None], val + noise, val)
        moved = call(nsa.nsa_attention, y, **p)
        torch.testing.assert_close(
            moved[:, : t + 1],
            out[:, : t + 1],
            rtol=0,
            atol=1e-12,
            msg=lambda m, t=t: f"output at ≤ {t} changed with the future: {m}",
        )
        assert not torch.allclose(moved[:, t + 1 :], out[:, t + 1 :]), "perturbation did nothing"


@pytest.mark.parametrize("HQ,H", [(2, 2), (6, 2), (8, 1)], ids=["G1", "G3", "G8"])
def test_group_consistent_selection(HQ, H):
    """nsa_select gives one set per KV head [B, T, H, n]; the op reads exactly those blocks for
    every query head of the group."""
    B, T, Dk, Dv = 2, 41, 8, 8
    p = dict(
        cmp_block=4, cmp_stride=2, sel_block=4, num_selected=3, window=2, num_init=1, num_local=1
    )
    x = make_inputs(B, T, HQ, H, Dk, Dv, seed=12, gates=(0.0, 1.0, 0.0), **p)
    idx = nsa.nsa_select(x["q"], x["k_cmp"], **select_params(p))
    assert tuple(idx.shape) == (B, T, H, 3)
    assert torch.equal(
        idx.long(), sets_to_index(naive_select(x["q"], x["k_cmp"], **select_params(p)), 3)
    )
    do = _grad_out(x)
    out, grads = forward_backward(nsa.nsa_attention, x, do, **p)
    ref, ref_grads = forward_backward(naive_attention, x, do, selected=idx, **p)
    assert_all_rel_close(out, grads, ref, ref_grads, TOL[torch.float64])


def test_backend_choices():
    B, T, HQ, H, Dk, Dv = 1, 12, 2, 1, 8, 8
    x = make_inputs(B, T, HQ, H, Dk, Dv, **SMALL)
    auto = call(nsa.nsa_attention, x, **SMALL)
    torch_ = call(nsa.nsa_attention, x, backend="torch", **SMALL)
    assert torch.equal(auto, torch_)


# ---------------------------------------------------------------------------------------------
# gradcheck
# ---------------------------------------------------------------------------------------------

GRADCHECK_P = dict(
    cmp_block=4, cmp_stride=2, sel_block=4, num_selected=2, window=4, num_init=1, num_local=0
)
BRANCH_INPUTS = {
    "cmp": ("q", "k_cmp", "v_cmp", "gates"),
    "slc": ("q", "k", "v", "gates"),
    "win": ("q", "k_win", "v_win", "gates"),
    "all": INPUT_NAMES,
}


def _gradcheck(x, names, **kw):
    """gradcheck w.r.t. x[names]; the other inputs are constants."""
    leaves = [x[n].detach().clone().requires_grad_(True) for n in names]

    def fn(*args):
        return call(nsa.nsa_attention, dict(x, **dict(zip(names, args, strict=True))), **kw)

    return torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("branch", list(BRANCH_GATES))
def test_gradcheck(branch):
    B, T, HQ, H, Dk, Dv = 1, 13, 2, 1, 4, 3
    p = GRADCHECK_P
    x = make_inputs(B, T, HQ, H, Dk, Dv, seed=13, gates=BRANCH_GATES[branch], **p)
    # the hard selection must stay put under gradcheck's perturbations
    scores = naive_group_scores(x["q"], x["k_cmp"], **score_params(p))
    assert selection_margin(scores, T, **p) > 1e-3
    assert (T - 1) // p["sel_block"] + 1 > p["num_selected"], "selection must be non-trivial"
    assert _gradcheck(x, BRANCH_INPUTS[branch], **p)


@pytest.mark.usefixtures("single_thread")
def test_gradcheck_varlen():
    p = GRADCHECK_P
    cu = _cu_seqlens([6, 1, 9])
    T = int(cu[-1])
    x = make_inputs(1, T, 2, 1, 3, 2, seed=14, cu_seqlens=cu, **p)
    scores = naive_group_scores(x["q"], x["k_cmp"], cu_seqlens=cu, **score_params(p))
    assert selection_margin(scores, T, cu_seqlens=cu, **p) > 1e-3
    assert _gradcheck(x, INPUT_NAMES, cu_seqlens=cu, **p)


# ---------------------------------------------------------------------------------------------
# Variable-length batches
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("p", PARAMS[:3], ids=params_id)
@pytest.mark.parametrize("HQ,H", [(4, 2), (3, 1)], ids=["G2", "G3"])
def test_varlen_equals_each_sequence_alone(HQ, H, p, dtype):
    cu = _cu_seqlens(LENGTHS)
    T = int(cu[-1])
    Dk, Dv = 8, 4
    x = make_inputs(1, T, HQ, H, Dk, Dv, seed=15, cu_seqlens=cu, dtype=dtype, **p)
    do = _grad_out(x)
    out, grads = forward_backward(nsa.nsa_attention, x, do, cu_seqlens=cu, **p)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    cbos = 0
    for bos, eos in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        Tc = compressed_length(eos - bos, p["cmp_block"], p["cmp_stride"])
        piece = {
            n: (t[:, cbos : cbos + Tc] if n in ("k_cmp", "v_cmp") else t[:, bos:eos])
            for n, t in x.items()
        }
        o, g = forward_backward(nsa.nsa_attention, piece, do[:, bos:eos], **p)
        where = f"sequence [{bos}, {eos})"
        assert_rel_close(f"{where} output", out[:, bos:eos], o, tol)
        for n, gn in g.items():
            sl = slice(cbos, cbos + Tc) if n in ("k_cmp", "v_cmp") else slice(bos, eos)
            assert_rel_close(f"{where} d{n}", grads[n][:, sl], gn, tol)
        cbos += Tc
    assert cbos == x["k_cmp"].shape[1]
    if dtype == torch.float64:
        ref, ref_grads = forward_backward(naive_attention, x, do, cu_seqlens=cu, **p)
        assert_all_rel_close(out, grads, ref, ref_grads, TOL[torch.float64])


def test_varlen_with_an_empty_sequence():
    p = SMALL
    cu = _cu_seqlens([5, 0, 7])
    T = int(cu[-1])
    x = make_inputs(1, T, 4, 2, 8, 4, seed=17, cu_seqlens=cu, **p)
    do = _grad_out(x)
    out, grads = forward_backward(nsa.nsa_attention, x, do, cu_seqlens=cu, **p)
    ref, ref_grads = forward_backward(naive_attention, x, do, cu_seqlens=cu, **p)
    assert_all_rel_close(out, grads, ref, ref_grads, TOL[torch.float64])
    idx = nsa.nsa_select(x["q"], x["k_cmp"], cu_seqlens=cu, **select_params(p))
    ref_idx = sets_to_index(
        naive_select(x["q"], x["k_cmp"], cu_seqlens=cu, **select_params(p)), p["num_selected"]
    )
    assert torch.equal(idx.long(), ref_idx)


def test_varlen_sequences_are_isolated():
    """Changing one sequence changes no output of the others."""
    p = SMALL
    cu = _cu_seqlens(LENGTHS)
    T = int(cu[-1])
    x = make_inputs(1, T, 4, 2, 8, 8, seed=16, cu_seqlens=cu, **p)
    out = call(nsa.nsa_attention, x, cu_seqlens=cu, **p)
    bos, eos = 6, 23  # the third sequence, 17 tokens
    cbos, ceos = 1, 8  # its compressed tokens: Tc(5) = 1, Tc(1) = 0, Tc(17) = 7
    assert compressed_length(5, 4, 2) == 1 and compressed_length(17, 4, 2) == 7
    y = {n: t.clone() for n, t in x.items()}
    for n, t in y.items():
        sl = slice(cbos, ceos) if n in ("k_cmp", "v_cmp") else slice(bos, eos)
        t[:, sl] = (
            30.0 * torch.rand_like(t[:, sl]) if n == "gates" else 30.0 * torch.randn_like(t[:, sl])
        )
    moved = call(nsa.nsa_attention, y, cu_seqlens=cu, **p)
    keep = torch.ones(T, dtype=torch.bool)
    keep[bos:eos] = False
    torch.testing.assert_close(moved[:, keep], out[:, keep], rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Invalid input
# ---------------------------------------------------------------------------------------------


def _valid(B=2, T=12, HQ=4, H=2, Dk=8, Dv=4):
    return make_inputs(B, T, HQ, H, Dk, Dv, **SMALL)


def _word(name):
    return rf"\b{name}\b"


def _shape_cases():
    x = _valid()
    Tc = x["k_cmp"].shape[1]
    yield "q-rank3", dict(q=x["q"][..., 0]), _word("q")
    yield "q-rank5", dict(q=x["q"][..., None]), _word("q")
    yield "k-wrong-T", dict(k=x["k"][:, :-1]), _word("k")
    yield "k-wrong-B", dict(k=x["k"][:1]), _word("k")
    yield "k-wrong-Dk", dict(k=x["k"][..., :-1]), _word("k")
    yield "v-wrong-H", dict(v=x["v"][:, :, :1]), _word("v")
    yield (
        "k_cmp-wrong-Tc",
        dict(k_cmp=x["k_cmp"][:, : Tc - 1], v_cmp=x["v_cmp"][:, : Tc - 1]),
        _word("k_cmp"),
    )
    yield (
        "k_cmp-too-long",
        dict(
            k_cmp=torch.cat([x["k_cmp"], x["k_cmp"][:, :1]], 1),
            v_cmp=torch.cat([x["v_cmp"], x["v_cmp"][:, :1]], 1),
        ),
        _word("k_cmp"),
    )
    yield "v_cmp-wrong-Tc", dict(v_cmp=x["v_cmp"][:, :-1]), _word("v_cmp")
    yield "v_cmp-wrong-Dv", dict(v_cmp=x["v_cmp"][..., :-1]), _word("v_cmp")
    yield "k_cmp-wrong-Dk", dict(k_cmp=x["k_cmp"][..., :-1]), _word("k_cmp")
    yield "gates-last-dim-2", dict(gates=x["gates"][..., :2]), _word("gates")
    yield "gates-wrong-HQ", dict(gates=x["gates"][:, :, :2]), _word("gates")
    yield "k_win-wrong-T", dict(k_win=x["k_win"][:, :-1]), _word("k_win")
    yield "v_win-wrong-Dv", dict(v_win=x["v_win"][..., :-1]), _word("v_win")
    yield (
        "HQ-not-multiple-of-H",
        dict(q=x["q"][:, :, :3], gates=x["gates"][:, :, :3]),
        r"\b(q|k|HQ|H)\b",
    )
    yield "gates-dtype", dict(gates=x["gates"].float()), _word("gates")
    yield "k-dtype", dict(k=x["k"].float()), _word("k")
    yield "v_cmp-dtype", dict(v_cmp=x["v_cmp"].float()), _word("v_cmp")
    yield "k_win-dtype", dict(k_win=x["k_win"].float()), _word("k_win")
    yield "q-integer", {n: t.long() for n, t in x.items()}, _word("q")


SHAPE_CASES = list(_shape_cases())


@pytest.mark.parametrize(
    "change,match", [c[1:] for c in SHAPE_CASES], ids=[c[0] for c in SHAPE_CASES]
)
def test_invalid_tensors_raise(change, match):
    x = dict(_valid(), **change)
    with pytest.raises(ValueError, match=match):
        call(nsa.nsa_attention, x, **SMALL)


PARAM_CASES = [
    (
        "cmp_stride-not-dividing-cmp_block",
        dict(cmp_block=4, cmp_stride=3, sel_block=6),
        "cmp_stride",
    ),
    (
        "cmp_stride-not-dividing-sel_block",
        dict(cmp_block=4, cmp_stride=4, sel_block=6),
        r"cmp_stride|sel_block",
    ),
    ("num_selected-below-forced", dict(num_selected=3, num_init=2, num_local=2), "num_selected"),
    ("window-0", dict(window=0), "window"),
    ("window-negative", dict(window=-3), "window"),
    ("cmp_block-0", dict(cmp_block=0), "cmp_block"),
    ("cmp_stride-0", dict(cmp_stride=0), "cmp_stride"),
    ("sel_block-0", dict(sel_block=0), "sel_block"),
    ("num_init-negative", dict(num_init=-1), "num_init"),
    ("num_local-negative", dict(num_local=-1), "num_local"),
    ("scale-negative", dict(scale=-1.0), "scale"),
    ("backend-unknown", dict(backend="cuda"), "backend"),
    ("backend-triton-float64", dict(backend="triton"), "backend"),
]


@pytest.mark.parametrize(
    "change,match", [c[1:] for c in PARAM_CASES], ids=[c[0] for c in PARAM_CASES]
)
def test_invalid_parameters_raise(change, match):
    p = dict(SMALL, **change)
    # inputs consistent with the (possibly invalid) block sizes where those make sense
    lc, d = p["cmp_block"], p["cmp_stride"]
    Tc_ok = lc > 0 and d > 0
    x = make_inputs(1, 12, 4, 2, 8, 4, cmp_block=lc if Tc_ok else 4, cmp_stride=d if Tc_ok else 2)
    with pytest.raises(ValueError, match=match):
        call(nsa.nsa_attention, x, **p)
    if "window" not in change:  # nsa_select has no window
        with pytest.raises(ValueError, match=match):
            nsa.nsa_select(x["q"], x["k_cmp"], **{k: v for k, v in p.items() if k != "window"})


def _varlen_cases():
    ok = _cu_seqlens([5, 7])
    yield "not-starting-at-0", torch.tensor([1, 5, 12], dtype=torch.int32)
    yield "decreasing", torch.tensor([0, 7, 5, 12], dtype=torch.int32)
    yield "not-ending-at-T", torch.tensor([0, 5, 11], dtype=torch.int32)
    yield "past-T", torch.tensor([0, 5, 13], dtype=torch.int32)
    yield "int64", ok.long()
    yield "float", ok.float()
    yield "2d", ok[None]
    yield "single-entry", torch.tensor([0], dtype=torch.int32)


VARLEN_CASES = list(_varlen_cases())


@pytest.mark.parametrize("cu", [c[1] for c in VARLEN_CASES], ids=[c[0] for c in VARLEN_CASES])
def test_malformed_cu_seqlens_raise(cu):
    good = _cu_seqlens([5, 7])
    x = make_inputs(1, 12, 4, 2, 8, 4, cu_seqlens=good, **SMALL)
    with pytest.raises(ValueError, match="cu_seqlens"):
        call(nsa.nsa_attention, x, cu_seqlens=cu, **SMALL)
    with pytest.raises(ValueError, match="cu_seqlens"):
        nsa.nsa_select(x["q"], x["k_cmp"], cu_seqlens=cu, **select_params(SMALL))


def test_cu_seqlens_with_batch_above_one_raises():
    cu = _cu_seqlens([5, 7])
    x = make_inputs(2, 12, 4, 2, 8, 4, **SMALL)
    with pytest.raises(ValueError, match="cu_seqlens"):
        call(nsa.nsa_attention, x, cu_seqlens=cu, **SMALL)
    with pytest.raises(ValueError, match="cu_seqlens"):
        nsa.nsa_select(x["q"], x["k_cmp"], cu_seqlens=cu, **select_params(SMALL))


def test_varlen_wrong_compressed_length_raises():
    """k_cmp must hold Σ Tc of the sequences, not Tc of the packed length."""
    cu = _cu_seqlens([5, 7])  # Tc = 1 + 2 = 3, while compressed_length(12) = 5
    x = make_inputs(1, 12, 4, 2, 8, 4, **SMALL)
    assert x["k_cmp"].shape[1] == 5
    with pytest.raises(ValueError, match="k_cmp"):
        call(nsa.nsa_attention, x, cu_seqlens=cu, **SMALL)
    with pytest.raises(ValueError, match="k_cmp"):
        nsa.nsa_select(x["q"], x["k_cmp"], cu_seqlens=cu, **select_params(SMALL))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["k", "v_cmp", "gates", "k_win"])
def test_mixed_devices_raise(name):
    x = _valid()
    x[name] = x[name].cuda()
    with pytest.raises(ValueError, match=_word(name)):
        call(nsa.nsa_attention, x, **SMALL)
