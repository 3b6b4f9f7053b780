"""The op's contract at its edges (NSA_SPEC.md), for both backends and both decode paths:

* a non-finite input reaches only the outputs (and gradients) that see it: not earlier
  positions, not other packed sequences, not cache slots a decode step does not read;
* any positive finite ``scale`` gives the defined (finite) softmax, also where ``scale · q·k``
  is past the float32 range;
* ``num_selected`` and block sizes past what a sequence holds allocate nothing more;
* T = 0 has a zero gradient for every input.

The Triton kernels run under TRITON_INTERPRET=1 without a GPU (tests/conftest.py), on tiny
shapes.
"""

import functools

import pytest
import torch

import nsa
from nsa.ops.decode import nsa_decode, visible_compressed
from nsa.ops.params import NSAParams
from nsa.ops.triton_support import TRITON_AVAILABLE, TRITON_INTERPRET
from tests.ops.helpers import (
    INPUT_NAMES,
    assert_rel_close,
    forward_backward,
    make_inputs,
    seeded_randn,
    to_double,
    transpose_dkdv_tiles,
)
from tests.ops.naive_reference import naive_attention

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(not (TRITON_AVAILABLE and (CUDA or TRITON_INTERPRET)),
                                  reason="needs Triton (CUDA or its interpreter)")
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]

# Blocks of 2 tokens: a position t >= 6 chooses one of its t // 2 - 1 non-forced blocks.
P = dict(cmp_block=4, cmp_stride=2, sel_block=2, num_selected=3, window=5, num_init=1,
         num_local=1)
T = 20  # the last compressed token (i = 8) becomes visible at t = 8·2 + 4 - 1 = T - 1
CU = [0, 8, 12, 20]  # packed: compressed tokens 0-2, 3 (the middle sequence's), 4-6
MIDDLE, MIDDLE_CMP = slice(8, 12), slice(3, 4)
OTHERS, OTHERS_CMP = [*range(8), *range(12, T)], [0, 1, 2, 4, 5, 6]
TOKEN_INPUTS = ("q", "k", "v", "gates", "k_win", "v_win")  # the others are compressed tokens


def inputs(packed=False):
    """float32 inputs on DEVICE: [1, T, 2 query heads, 16] over one KV head (G = 2)."""
    cu = torch.tensor(CU, dtype=torch.int32) if packed else None
    x = make_inputs(1, T, 2, 1, 16, 16, dtype=torch.float32, cu_seqlens=cu, **P)
    return {n: t.to(DEVICE) for n, t in x.items()}, None if cu is None else cu.to(DEVICE)


def grad_out():
    return seeded_randn(1, T, 2, 16).to(DEVICE)


def with_nan(x, name, index):
    y = {n: t.clone() for n, t in x.items()}
    y[name][index] = float("nan")
    return y


@functools.cache
def clean_run(backend, packed):
    """Output and input gradients on the clean inputs (shared by the tests below)."""
    x, cu = inputs(packed)
    return forward_backward(nsa.nsa_attention, x, grad_out(), cu_seqlens=cu, backend=backend,
                            **P)


def assert_same(name, got, want):
    """Finite and equal to the result without the NaN: masking a value out is exact."""
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------------------------------------
# Non-finite values stay behind the masks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", INPUT_NAMES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_at_the_last_position_changes_no_earlier_output(backend, name):
    """A NaN in any input at the last position (for k_cmp, v_cmp the last compressed token,
    first visible there) changes no earlier output, nor the gradients of earlier queries and
    gates: causally masked keys and values are not multiplied in."""
    x, _ = inputs()
    out, grads = clean_run(backend, False)
    last = x[name].shape[1] - 1
    poisoned, poisoned_grads = forward_backward(
        nsa.nsa_attention, with_nan(x, name, (0, last, 0, -1)), grad_out(), backend=backend, **P)
    assert_same("output", poisoned[:, :T - 1], out[:, :T - 1])
    for n in ("q", "gates"):
        assert_same(f"d{n}", poisoned_grads[n][:, :T - 1], grads[n][:, :T - 1])


@pytest.mark.parametrize("name", ["q", "gates"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_the_first_query_reaches_only_what_it_sees(backend, name):
    """A NaN query or gate at t = 0 (which sees only the tokens at 0, and no compressed token)
    leaves every other output and every gradient but those at position 0 as they were."""
    x, _ = inputs()
    out, grads = clean_run(backend, False)
    poisoned, poisoned_grads = forward_backward(
        nsa.nsa_attention, with_nan(x, name, (0, 0, 0, -1)), grad_out(), backend=backend, **P)
    assert_same("output", poisoned[:, 1:], out[:, 1:])
    for n in INPUT_NAMES:
        later = slice(1, None) if n in TOKEN_INPUTS else slice(None)
        assert_same(f"d{n}", poisoned_grads[n][:, later], grads[n][:, later])


@pytest.mark.parametrize("name", INPUT_NAMES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_one_packed_sequence_leaves_the_others_alone(backend, name):
    """Every value of one input in the middle of three packed sequences NaN: the outputs of
    the other two, and the gradients of all their inputs, are as without it."""
    x, cu = inputs(packed=True)
    out, grads = clean_run(backend, True)
    rows = MIDDLE if name in TOKEN_INPUTS else MIDDLE_CMP
    poisoned, poisoned_grads = forward_backward(
        nsa.nsa_attention, with_nan(x, name, (slice(None), rows)), grad_out(), cu_seqlens=cu,
        backend=backend, **P)
    assert_same("output", poisoned[:, OTHERS], out[:, OTHERS])
    for n in INPUT_NAMES:
        keep = OTHERS if n in TOKEN_INPUTS else OTHERS_CMP
        assert_same(f"d{n}", poisoned_grads[n][:, keep], grads[n][:, keep])


def finite_flags(*tensors):
    """[B, 1] int8: 1 where every entry of the tensors [B, N, heads(, D)] of one KV head is
    finite (the flags the kernels read, finite.py; computed here in PyTorch)."""
    return torch.stack([t.flatten(1).isfinite().all(1) for t in tensors]).all(0).to(
        torch.int8)[:, None]


# The compressed and window kernels alone, at a shape where full and partial tiles meet: 64-row
# query tiles of P = 4 positions (G = 16 query heads over one KV head), key tiles of 64, w = 136
# and l = 4, d = 2 (query tiles from t = 136 on hold full key tiles of both branches). The NaN
# is first seen inside a query tile: at t = 123 (compressed token 60, in the key tile [0, 64)
# that is full for t >= 136) and t = 149 (window, full for some query tiles from t = 160).
BRANCH_T, BRANCH_G = 200, 16
FIRST_SEEN = {"compressed": 123, "window": 149}
BRANCH_P = NSAParams(cmp_block=4, cmp_stride=2, sel_block=8, num_selected=3, window=136)


def run_branch(mode, q, do, k, v):
    """The compressed (mode "compressed") or window branch's kernels alone at the BRANCH_
    shape, forward and backward (output gradient do, gates of 1), with the flags of their
    inputs (finite_flags) -> (o, lse, dq, dk, dv). The dq kernel runs both branches: the
    other one silent (zero keys and values, gates of 0)."""
    from nsa.ops.triton.compressed_window import (
        MODE_CMP,
        MODE_WIN,
        DqBranch,
        branch_dkdv,
        branch_forward,
        branches_dq,
    )
    from nsa.ops.triton.launch import BranchGrad
    from nsa.ops.triton.tables import build_tables

    T, p, D = BRANCH_T, BRANCH_P, q.shape[-1]
    tables = build_tables(T, p.compressed_length(T), None, p, DEVICE)
    branch = MODE_CMP if mode == "compressed" else MODE_WIN
    grad = BranchGrad.ungated(do)
    kv_finite = finite_flags(k, v)
    o, lse = branch_forward(q, k, v, tables, branch, p, D ** -0.5, kv_finite)
    delta = (o * do).sum(-1)
    this = DqBranch(k, v, grad.gate, lse, delta, kv_finite)
    keys = T if mode == "compressed" else p.compressed_length(T)  # the other branch's
    silent = torch.zeros(q.shape[0], keys, *k.shape[2:], device=DEVICE)
    rows = torch.zeros_like(lse)
    other = DqBranch(silent, silent, rows, rows, rows, finite_flags(silent, silent))
    dq = torch.empty_like(q)
    branches_dq(q, do, *((this, other) if mode == "compressed" else (other, this)),
                torch.zeros_like(q), dq, tables, p, D ** -0.5)
    dk, dv = branch_dkdv(q, k, v, grad, lse, delta, tables, branch, p, D ** -0.5,
                         finite_flags(q, do, grad.gate))
    return o, lse, dq, dk, dv


def branch_inputs(mode, B, seed, heads=BRANCH_G):
    """q, do [B, BRANCH_T, heads, 16] and k, v [B, keys, 1, 16] of run_branch."""
    g = torch.Generator().manual_seed(seed)
    keys = BRANCH_P.compressed_length(BRANCH_T) if mode == "compressed" else BRANCH_T
    shapes = {"q": (B, BRANCH_T, heads, 16), "do": (B, BRANCH_T, heads, 16),
              "k": (B, keys, 1, 16), "v": (B, keys, 1, 16)}
    return {n: torch.randn(*shape, generator=g).to(DEVICE) for n, shape in shapes.items()}


@needs_triton
@pytest.mark.parametrize("heads", [BRANCH_G, 6], ids=["G16", "G6"])
@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("mode", ["compressed", "window"])
def test_nan_after_a_query_in_its_tile_reaches_only_the_queries_that_see_it(mode, name, heads):
    """A NaN key or value first seen by a query in the middle of a query tile: the queries
    before it (earlier ones of the same tile included) keep their outputs, log-sum-exps and dq
    bit for bit; every query that sees it gets a non-finite output and dq (through full tiles
    too); window keys that no such query sees keep their dk and dv. At G = 6 a tile holds 32
    positions x 2 of the group's heads (launch.tile_heads): three programs of the KV head
    read its one flag."""
    T, p = BRANCH_T, BRANCH_P
    x = branch_inputs(mode, 1, seed=4, heads=heads)
    first_seen = FIRST_SEEN[mode]
    nan_at = (first_seen - p.cmp_block + 1) // p.cmp_stride if mode == "compressed" else first_seen
    seen = slice(first_seen, T if mode == "compressed" else first_seen + p.window)
    o, lse, dq, dk, dv = run_branch(mode, **x)
    x = with_nan(x, name, (0, nan_at, 0, -1))
    o_nan, lse_nan, dq_nan, dk_nan, dv_nan = run_branch(mode, **x)
    before = slice(0, first_seen)
    assert_same("output", o_nan[:, before], o[:, before])
    assert_same("dq", dq_nan[:, before], dq[:, before])
    torch.testing.assert_close(lse_nan[:, before], lse[:, before], rtol=0, atol=0, msg="lse")
    for what, y in (("output", o_nan), ("dq", dq_nan)):
        assert not torch.isfinite(y[:, seen]).all(-1).any(), f"{what}: a finite row sees the NaN"
    if mode == "window":  # keys that no query seeing the NaN attends to
        unseen = slice(0, first_seen - p.window + 1)
        assert_same("dk", dk_nan[:, unseen], dk[:, unseen])
        assert_same("dv", dv_nan[:, unseen], dv[:, unseen])


@needs_triton
@pytest.mark.parametrize(("transposed", "heads"), [(False, BRANCH_G), (True, BRANCH_G), (False, 6)],
                         ids=["tiles", "transposed-dkdv-tiles", "tiles-G6"])
@pytest.mark.parametrize("name", ["k", "v", "q", "do"])
@pytest.mark.parametrize("mode", ["compressed", "window"])
def test_a_nan_in_one_batch_row_leaves_the_other_rows_path_and_results(mode, name, transposed,
                                                                        heads, monkeypatch):
    """The compressed and window kernels take their partial tiles without the non-finite
    bookkeeping for each (batch row, KV head) whose keys and values (forward, dq) or whose
    queries, output gradients and gates (dK/dV) are all finite (finite.py; each kernel is
    launched once per flag value). A NaN in batch row 1 sends row 1 through the bookkeeping
    while row 0 takes the plain masks, its outputs and gradients bit for bit as when both rows
    are finite; with the dK/dV's tiles computed either way (``transposed``: p^T and dS^T as
    [keys, rows]); at G = 6 the forward and dq tiles hold 2 of the group's heads
    (launch.tile_heads), three programs of a (batch row, KV head) reading its one flag."""
    transpose_dkdv_tiles(monkeypatch, transposed)
    x = branch_inputs(mode, 2, seed=5, heads=heads)
    clean = run_branch(mode, **x)
    x[name] = x[name].clone()
    x[name][1, x[name].shape[1] // 2, 0, 3] = float("nan")
    results = run_branch(mode, **x)
    for what, a, b in zip(("output", "lse", "dq", "dk", "dv"), results, clean, strict=True):
        assert torch.equal(a[0], b[0]), f"{what} of the finite batch row changed"
    assert not all(torch.isfinite(a[1]).all() for a in results), "the NaN reached nothing"


@needs_triton
def test_gate_backward_flags_each_batch_and_kv_head_with_a_non_finite_query_side_row():
    """The query side's flags (finite.py), from the gate backward kernel: 0 exactly where a
    row of the KV head's query heads has a non-finite query, output gradient or gate (q a
    strided view, Dk != Dv, T ragged against the kernel's rows)."""
    from nsa.ops.triton.gating import gate_backward

    g = torch.Generator().manual_seed(6)
    B, T, HQ, H, Dk, Dv = 2, 70, 6, 2, 16, 8
    q = torch.randn(B, T, HQ, Dk + 4, generator=g)[..., :Dk]
    do, o = torch.randn(B, T, HQ, Dv, generator=g), torch.randn(3, B, T, HQ, Dv, generator=g)
    gates = torch.rand(B, T, HQ, 3, generator=g)
    q[1, 69, 4, 3] = float("nan")  # KV head 1 of batch 1
    do[0, 3, 0, 0] = float("inf")  # KV head 0 of batch 0
    gates[1, 10, 1, 2] = float("nan")  # KV head 0 of batch 1
    *_, flags = gate_backward(*(x.to(DEVICE) for x in (do, gates, *o, q)), H)
    assert flags.cpu().tolist() == [[0, 1], [0, 0]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_changes_no_other_selection(backend):
    """nsa_select: a NaN compressed key changes no selection made before it is visible, and a
    NaN query or compressed key of one packed sequence none of the others'."""
    select = dict((k, v) for k, v in P.items() if k != "window")
    x, _ = inputs()
    idx = nsa.nsa_select(x["q"], x["k_cmp"], backend=backend, **select)
    flipped = nsa.nsa_select(-x["q"], x["k_cmp"], backend=backend, **select)
    assert not torch.equal(flipped[:, :T - 1], idx[:, :T - 1]), "the scores must matter"
    x = with_nan(x, "k_cmp", (0, -1, 0, -1))
    poisoned = nsa.nsa_select(x["q"], x["k_cmp"], backend=backend, **select)
    assert torch.equal(poisoned[:, :T - 1], idx[:, :T - 1])

    x, cu = inputs(packed=True)
    idx = nsa.nsa_select(x["q"], x["k_cmp"], cu_seqlens=cu, backend=backend, **select)
    x = with_nan(with_nan(x, "q", (0, MIDDLE)), "k_cmp", (0, MIDDLE_CMP))
    poisoned = nsa.nsa_select(x["q"], x["k_cmp"], cu_seqlens=cu, backend=backend, **select)
    assert torch.equal(poisoned[:, OTHERS], idx[:, OTHERS])


def decode_inputs(params, dtype=torch.float32, window_ring=False):
    """Random caches of S = 45 positions and one query per sequence (B = 3, H = 2, G = 2)."""
    g = torch.Generator().manual_seed(3)
    B, S, H, G, Dk, Dv = 3, 45, 2, 2, 16, 8
    C = params.compressed_length(S)

    def make(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE, dtype)

    W = params.window if window_ring else S
    return dict(q=make(B, H * G, Dk), k=make(B, S, H, Dk), v=make(B, S, H, Dv),
                k_cmp=make(B, C, H, Dk), v_cmp=make(B, C, H, Dv),
                gates=torch.rand(B, H * G, 3, generator=g, dtype=torch.float64).to(DEVICE, dtype),
                k_win=make(B, W, H, Dk), v_win=make(B, W, H, Dv))


def decode(x, pos, params, backend, window_ring=False, scale=None):
    return nsa_decode(x["q"], x["k"], x["v"], x["k_cmp"], x["v_cmp"], x["gates"], pos, params,
                      scale, k_win=x["k_win"], v_win=x["v_win"], window_ring=window_ring,
                      backend=backend)


@pytest.mark.parametrize("window_ring", [False, True], ids=["positional", "ring"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_reads_nothing_past_the_cache(backend, window_ring):
    """Cache slots a step does not read (positions after ``pos``, compressed tokens not yet
    visible, ring slots not yet written) may hold NaN; a NaN query or gate of one sequence
    changes no other sequence's output."""
    params = NSAParams(**P)
    x = decode_inputs(params, window_ring=window_ring)
    pos = torch.tensor([3, 20, 31], device=DEVICE)  # at 3, ring slot 4 is not written yet
    out = decode(x, pos, params, backend, window_ring)
    garbage = {n: t.clone() for n, t in x.items()}
    for b, p in enumerate(pos.tolist()):
        visible = int(visible_compressed(pos[b:b + 1], params))
        for n in ("k", "v", "k_win", "v_win"):  # a ring's slots past p: not written yet
            garbage[n][b, p + 1:] = float("nan")
        for n in ("k_cmp", "v_cmp"):
            garbage[n][b, visible:] = float("nan")
    assert_same("output", decode(garbage, pos, params, backend, window_ring), out)
    for name in ("q", "gates"):
        poisoned = decode(with_nan(x, name, (0, 1)), pos, params, backend, window_ring)
        assert_same(f"output with a NaN {name}", poisoned[1:], out[1:])


# ---------------------------------------------------------------------------------------------
# Any finite scale
# ---------------------------------------------------------------------------------------------

HUGE_SCALES = [1e30, 2e38]  # scale · q·k overflows float32 (max 3.4e38)


@pytest.mark.parametrize("scale", HUGE_SCALES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_scale_gives_the_finite_softmax(backend, scale):
    """Past the float32 range of scale · q·k the softmax is still defined (it is one-hot on
    the largest score, here): outputs match the float64 oracle on the same blocks, the
    gradients that do not cancel match it too, and every gradient is finite.

    The backward recomputes p from q·k, so at such scales it matches only where the products
    are bitwise those of the forward. The Triton interpreter's products are numpy's, whose
    rounding depends on the matrix shape on some CPUs (OpenBLAS on AMD EPYC: a [2, 16] by
    [16, 16] product differs in the last bit from the same rows of a [16, 16] one), and the
    kernels' tiles differ between forward and backward: there, gradients are only checked
    finite (p is clamped to <= 1, so a recomputed product an ulp high cannot make one inf)."""
    x, _ = inputs()
    do = grad_out()
    select = dict((k, v) for k, v in P.items() if k != "window")
    idx = nsa.nsa_select(x["q"], x["k_cmp"], scale=scale, backend=backend, **select)
    out, grads = forward_backward(nsa.nsa_attention, x, do, scale=scale, backend=backend, **P)
    ref, ref_grads = forward_backward(naive_attention, to_double(x), do.double(), scale=scale,
                                      selected=idx, **P)
    assert_rel_close("output", out, ref, 1e-5)
    for name in INPUT_NAMES:  # dq, dk: scale times a cancellation (zero in exact arithmetic)
        assert torch.isfinite(grads[name]).all(), f"d{name}: non-finite values"
    if backend == "triton" and DEVICE == "cpu":
        return
    for name in ("v", "v_cmp", "v_win", "gates"):
        assert_rel_close(f"d{name}", grads[name], ref_grads[name], 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_huge_scale_gives_the_finite_softmax(backend):
    """A decode step at scale 2e38 against the float64 PyTorch step."""
    params = NSAParams(**P)
    x = decode_inputs(params)
    pos = torch.tensor([3, 20, 44], device=DEVICE)
    out = decode(x, pos, params, backend, scale=2e38)
    ref = decode({n: t.double() for n, t in x.items()}, pos, params, "torch", scale=2e38)
    assert_rel_close("output", out, ref, 1e-5)


@pytest.mark.parametrize("op", ["attention", "select", "decode"])
def test_scale_past_the_compute_precision_is_refused(op):
    """scale · log2(e) must be finite in the precision the scores are computed in (float32 for
    float32, bfloat16 and float16 inputs): known from the dtype alone. float64 inputs (PyTorch
    backend) take it; decode validates its scale like the other ops."""
    for dtype, scale in ((torch.float32, 3e38), (torch.float32, float("inf")),
                         (torch.float64, 3e38)):
        if op == "decode":
            params = NSAParams(**P)
            x = decode_inputs(params, dtype)
            run = functools.partial(decode, x, torch.tensor([3, 20, 44], device=DEVICE), params,
                                    "torch", scale=scale)
        else:
            x, _ = inputs()
            x = {n: t.to(dtype) for n, t in x.items()}
            if op == "select":
                select = dict((k, v) for k, v in P.items() if k != "window")
                run = functools.partial(nsa.nsa_select, x["q"], x["k_cmp"], scale=scale,
                                        backend="torch", **select)
            else:
                run = functools.partial(nsa.nsa_attention, *(x[n] for n in INPUT_NAMES[:6]),
                                        scale=scale, backend="torch", **P)
        if dtype == torch.float64 and scale < float("inf"):
            assert torch.isfinite(run()).all()
        else:
            with pytest.raises(ValueError, match="scale"):
                run()


# ---------------------------------------------------------------------------------------------
# num_selected and block sizes past what a sequence holds
# ---------------------------------------------------------------------------------------------

ALL_BLOCKS = -(-T // P["sel_block"])  # n = 10 selects every candidate of every position


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_num_selected_past_the_blocks_allocates_nothing_more(backend):
    """n = 2**31 - 1 selects every candidate (NSA_SPEC.md), as n = ⌈T / l'⌉ does; it used to
    allocate [B, C, H, n] indices (here 20 · 2**31 int64: 340 GB)."""
    x, cu = inputs(packed=True)
    huge = dict(P, num_selected=2**31 - 1)
    out, grads = forward_backward(nsa.nsa_attention, x, grad_out(), cu_seqlens=cu,
                                  backend=backend, **huge)
    ref, ref_grads = forward_backward(nsa.nsa_attention, x, grad_out(), cu_seqlens=cu,
                                      backend="torch", **dict(P, num_selected=ALL_BLOCKS))
    assert_same("output", out, ref)
    for name in INPUT_NAMES:
        assert_same(f"d{name}", grads[name], ref_grads[name])


@needs_triton
def test_triton_refuses_num_selected_past_its_tiles():
    """The Triton selection scores next_pow2(n) blocks per step: past its tile limit it
    raises naming num_selected (and "auto" runs the PyTorch backend, as above)."""
    x, _ = inputs()
    with pytest.raises(ValueError, match="num_selected"):
        nsa.nsa_attention(*(x[n] for n in INPUT_NAMES[:6]), backend="triton",
                          **dict(P, num_selected=2**31 - 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nsa_select_pads_num_selected_past_the_blocks(backend):
    """The index keeps the spec's [B, T, H, n] shape: the selection of n = ⌈T / l'⌉, then -1."""
    x, cu = inputs(packed=True)
    select = dict((k, v) for k, v in P.items() if k != "window")
    idx = nsa.nsa_select(x["q"], x["k_cmp"], cu_seqlens=cu, backend=backend,
                         **dict(select, num_selected=16))
    ref = nsa.nsa_select(x["q"], x["k_cmp"], cu_seqlens=cu, backend=backend,
                         **dict(select, num_selected=ALL_BLOCKS))
    assert idx.shape == (1, T, 1, 16)
    assert torch.equal(idx[..., :ALL_BLOCKS], ref)
    assert (idx[..., ALL_BLOCKS:] == -1).all()


# Past the cache's capacity S = 45: one selection block (l' >= S), no compressed token ever
# visible (l > S), every block selected; the same step as with these sizes cut down.
HUGE_DECODE = dict(cmp_block=2**29, cmp_stride=2, sel_block=2**30, num_selected=2**31 - 1,
                   window=5, num_init=1, num_local=1)
CUT_DECODE = dict(cmp_block=46, cmp_stride=2, sel_block=46, num_selected=1, window=5,
                  num_init=0, num_local=1)


@pytest.mark.parametrize("sizes", ["num_selected", "all"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_sizes_past_the_cache_allocate_nothing_more(backend, sizes):
    """nsa_decode with num_selected (and l', l) far past a 45-position cache equals the step
    with them cut to the cache: it used to allocate n blocks of l' positions (and a block
    pattern of l'/d + l/d), or refuse the Triton path."""
    if sizes == "num_selected":
        huge, cut = NSAParams(**dict(P, num_selected=2**31 - 1)), NSAParams(**dict(
            P, num_selected=-(-45 // P["sel_block"])))
    else:
        huge, cut = NSAParams(**HUGE_DECODE), NSAParams(**CUT_DECODE)
    x = decode_inputs(cut)
    pos = torch.tensor([3, 20, 44], device=DEVICE)
    assert_same("output", decode(x, pos, huge, backend), decode(x, pos, cut, backend))


# ---------------------------------------------------------------------------------------------
# T = 0
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["B1", "B2", "packed", "shared-window"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sequence_has_zero_gradients(backend, layout):
    """T = 0: every input gets a zero gradient of its shape (none is left out of the graph)."""
    B = 2 if layout == "B2" else 1
    cu = torch.tensor([0, 0], dtype=torch.int32, device=DEVICE) if layout == "packed" else None
    x = make_inputs(B, 0, 2, 1, 16, 16, dtype=torch.float32,
                    separate_win=layout != "shared-window", **P)
    x = {n: t.to(DEVICE).requires_grad_() for n, t in x.items()}
    windows = {n: x[n] for n in ("k_win", "v_win") if n in x}
    out = nsa.nsa_attention(*(x[n] for n in INPUT_NAMES[:6]), **windows, cu_seqlens=cu,
                            backend=backend, **P)
    assert out.shape == (B, 0, 2, 16)
    grads = torch.autograd.grad(out.sum(), list(x.values()))
    for (name, t), g in zip(x.items(), grads):
        assert g.shape == t.shape and not g.any(), name
