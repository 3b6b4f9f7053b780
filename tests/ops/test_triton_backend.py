"""The Triton backend against the float64 PyTorch reference.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (set in tests/conftest.py)
on tiny shapes; with CUDA the same tests run compiled, plus larger shapes (``gpu`` cases).
Outputs and every gradient are compared with the reference computed in float64 on the *same*
selected blocks; the selection itself is compared modulo near-ties.
"""

import itertools

import pytest
import torch

import nsa
from nsa.ops.params import LOG2E, NSAParams
from nsa.ops.torch_backend import block_overlap, nsa_attention_torch
from tests.ops.helpers import seeded_randn, transpose_dkdv_tiles

triton = pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
INPUTS = ("q", "k", "v", "k_cmp", "v_cmp", "gates", "k_win", "v_win")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def case_id(c):
    B, T, HQ, H, Dk, Dv, cu, p = c
    varlen = "" if cu is None else "-varlen" + "_".join(map(str, cu))
    return f"B{B}-T{T}-HQ{HQ}-H{H}-Dk{Dk}-Dv{Dv}{varlen}-l{p['cmp_block']}-n{p['num_selected']}"


SMALL = dict(cmp_block=4, cmp_stride=2, sel_block=8, num_selected=3, window=5)
PAPER = dict(cmp_block=32, cmp_stride=16, sel_block=64, num_selected=16, window=512)
# Interpreter-sized cases (CI) ...
CASES = [
    (2, 37, 6, 2, 16, 8, None, SMALL),  # G = 3, Dk != Dv, T not a multiple of any block
    (1, 40, 4, 4, 16, 16, [0, 5, 6, 23, 40], SMALL),  # G = 1, varlen, a length-1 sequence
    (1, 70, 16, 1, 16, 16, None, dict(SMALL, num_selected=4, num_init=0, num_local=1)),  # G=16
    (1, 3, 2, 1, 16, 16, None, SMALL),  # T < cmp_block
    # Dk = 128: wide float32 tiles, their rows and keys shrunk (launch.FLOAT32_SHRINK; the
    # masked selected kernels then take half a selection block a step)
    (1, 200, 4, 2, 128, 64, None, dict(SMALL, sel_block=64)),
    # l' = 16: whole selection blocks load through tensor descriptors (TMA), G = 4
    (1, 75, 8, 2, 16, 32, None, dict(cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3,
                                     window=9)),
    # Full 64-key tiles in the compressed and window branches (their K/V, and dK/dV's q/do
    # with G = 4, load through tensor descriptors) beside partial ones.
    (1, 300, 8, 2, 16, 16, None, dict(cmp_block=4, cmp_stride=2, sel_block=16, num_selected=3,
                                      window=130)),
]
# ... and GPU-sized ones: every case in bf16, the first two also in fp16 and fp32.
GPU_CASES = [
    (1, 2001, 8, 4, 128, 64, None, PAPER),  # G = 2, Dk != Dv
    (1, 2500, 6, 1, 64, 192, None, PAPER),  # G = 6, Dv = 192: forward per position, dq per block
    (2, 1000, 16, 2, 64, 64, None, PAPER),  # G = 8
    (1, 1, 4, 4, 64, 64, None, PAPER),  # T = 1
    (1, 2100, 32, 2, 128, 128, [0, 1000, 1001, 2100], PAPER),  # G = 16, varlen
    (2, 700, 8, 8, 192, 128, None, dict(PAPER, window=100)),  # G = 1, Dk = 192
    (1, 3000, 16, 4, 64, 64, [0, 17, 2000, 3000], PAPER),  # G = 4, varlen, T_1 < l
]
GPU_RUNS = ([(c, torch.bfloat16) for c in GPU_CASES]
            + [(c, dt) for c in GPU_CASES[:2] for dt in (torch.float16, torch.float32)])
LONG_CASE = (1, 131072, 16, 1, 64, 64, None, PAPER)  # T = 128k: 64-bit offsets, G = 16
LONG_CHECKED_POSITIONS = 2048  # selection checked on a sample of positions (scores are dense)


def make_inputs(B, T, HQ, H, Dk, Dv, cu, p, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if cu is None:
        Tc = nsa.compressed_length(T, p["cmp_block"], p["cmp_stride"])
    else:
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        Tc = sum(nsa.compressed_length(L, p["cmp_block"], p["cmp_stride"]) for L in lengths)
    shapes = dict(q=(B, T, HQ, Dk), k=(B, T, H, Dk), v=(B, T, H, Dv), k_cmp=(B, Tc, H, Dk),
                  v_cmp=(B, Tc, H, Dv), k_win=(B, T, H, Dk), v_win=(B, T, H, Dv))
    x = {name: torch.randn(shape, generator=g, dtype=torch.float64)
         for name, shape in shapes.items()}
    x["gates"] = torch.rand(B, T, HQ, 3, generator=g, dtype=torch.float64)
    x = {name: t.to(DEVICE, dtype) for name, t in x.items()}
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    return x, cu_seqlens


def rel(a, b):
    """Relative error; a gradient that is exactly 0 (e.g. dq at T = 1) is judged on a 1e-3 scale."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-3)).item()


def poison_allocator():
    """Make the next allocations come back full of NaN, so unwritten outputs show."""
    if CUDA:
        torch.full((1 << 28,), float("nan"), device="cuda")
        torch.cuda.synchronize()


def block_scores(q, k_cmp, params: NSAParams, scale, cu_seqlens, positions=None):
    """float64 group block scores [B, P, H, NB] by the spec's formula, for the (packed) token
    indices ``positions`` [P] (default: all), dense over the compressed tokens."""
    B, T, HQ, _ = q.shape
    H = k_cmp.shape[2]
    positions = torch.arange(T, device=q.device) if positions is None else positions
    starts = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    out = torch.zeros(B, len(positions), H, -(-T // params.sel_block), dtype=torch.float64,
                      device=q.device)
    c0 = 0
    for s0, s1 in zip(starts[:-1], starts[1:]):
        Tc = nsa.compressed_length(s1 - s0, params.cmp_block, params.cmp_stride)
        rows = ((positions >= s0) & (positions < s1)).nonzero().flatten()
        pos = positions[rows] - s0
        qs = q[:, positions[rows]].double()
        kc = k_cmp[:, c0:c0 + Tc].double().repeat_interleave(HQ // H, dim=2)
        logits = torch.einsum("bthd,bihd->bthi", qs, kc) * scale
        visible = (torch.arange(Tc, device=q.device) * params.cmp_stride + params.cmp_block - 1
                   <= pos[:, None])  # [P_s, Tc]
        p = torch.softmax(logits.masked_fill(~visible[None, :, None], float("-inf")), dim=-1)
        p = torch.nan_to_num(p)  # rows with nothing visible
        NB = -(-(s1 - s0) // params.sel_block)
        overlap = block_overlap(torch.arange(Tc, device=q.device), NB, params, torch.float64)
        per_head = p @ overlap  # [B, P_s, HQ, NB]
        out[:, rows, :, :NB] = per_head.view(B, len(rows), H, HQ // H, NB).sum(3)
        c0 += Tc
    return out


def assert_valid_selection(idx, scores, params, cu_seqlens, tolerance, positions=None):
    """``idx`` [B, P, H, n] is a spec-valid top-n of ``scores`` [B, P, H, NB] up to score
    differences below ``tolerance``; rows are the token indices ``positions`` (default: all)."""
    B, T, H, n = idx.shape
    tokens = torch.arange(T, device=idx.device) if positions is None else positions
    starts = torch.zeros_like(tokens)
    if cu_seqlens is not None:
        cu = cu_seqlens.long()
        starts = cu[torch.searchsorted(cu[1:], tokens, right=True)]
    pos = tokens - starts
    current = pos // params.sel_block  # [T]
    NB = scores.shape[-1]
    blocks = torch.arange(NB, device=idx.device)
    candidate = blocks <= current[:, None]  # [T, NB]
    forced = candidate & ((blocks < params.num_init)
                          | (blocks > current[:, None] - params.num_local))
    chosen = torch.zeros(B, T, H, NB + 1, dtype=torch.bool, device=idx.device)
    chosen.scatter_(-1, torch.where(idx < 0, NB, idx.long()), True)
    chosen = chosen[..., :NB]
    count = candidate.sum(-1)  # [T]
    # Ascending, -1 padded at the end, the right number of blocks.
    valid = idx >= 0
    assert (valid.sum(-1) == count.clamp_max(n)[None, :, None]).all()
    assert (idx[..., 1:][valid[..., 1:]] > idx[..., :-1][valid[..., 1:]]).all()
    assert not (chosen & ~candidate[None, :, None]).any(), "a block past the query was chosen"
    assert (chosen | ~forced[None, :, None]).all(), "a forced block is missing"
    free = candidate[None, :, None] & ~forced[None, :, None]
    worst_in = torch.where(chosen & free, scores, torch.inf).amin(-1)
    best_out = torch.where(~chosen & free, scores, -torch.inf).amax(-1)
    assert (worst_in >= best_out - tolerance).all(), (worst_in - best_out).min()


# (l, d, l'): a compressed token reaches 0-3 blocks past its own; 1-5 tokens per block (the
# kernel pads 3 and 5 to 4 and 8); T = 300 spans several steps of the selection kernel.
BLOCK_MAPPINGS = [(4, 4, 8), (8, 2, 4), (16, 4, 4), (6, 2, 6), (10, 2, 10), (2, 1, 3)]


@pytest.mark.parametrize("l,d,ls", BLOCK_MAPPINGS,
                         ids=[f"l{a}-d{b}-ls{c}" for a, b, c in BLOCK_MAPPINGS])
def test_triton_selection_maps_tokens_onto_blocks(l, d, ls):
    """The kernel's block scores (own tokens plus the tokens spilling from the blocks before,
    across step boundaries) pick a spec-valid top-n of the float64 block scores."""
    p = dict(cmp_block=l, cmp_stride=d, sel_block=ls, num_selected=3, num_init=1, num_local=1)
    params = NSAParams(**p)
    x, _ = make_inputs(1, 300, 4, 2, 16, 16, None, p, torch.float32, seed=l + d + ls)
    idx = nsa.nsa_select(x["q"], x["k_cmp"], backend="triton", **p)
    scores = block_scores(x["q"], x["k_cmp"], params, 16**-0.5, None)
    assert_valid_selection(idx, scores, params, None, 1e-4)


def run_case(case, dtype, scale=None):
    """The Triton op (selection, output, gradients) against the float64 reference; ``scale``
    default 1/sqrt(Dk)."""
    B, T, HQ, H, Dk, Dv, cu, p = case
    params = NSAParams(**p)
    x, cu_seqlens = make_inputs(*case, dtype)
    scale = Dk**-0.5 if scale is None else scale
    poison_allocator()
    idx = nsa.nsa_select(x["q"], x["k_cmp"], cu_seqlens=cu_seqlens, scale=scale,
                         backend="triton", **{k: v for k, v in p.items() if k != "window"})
    positions = None
    if T > LONG_CHECKED_POSITIONS:  # the dense score check would not fit: check a sample
        g = torch.Generator().manual_seed(1)
        positions = torch.randperm(T, generator=g)[:LONG_CHECKED_POSITIONS].sort().values
        positions = positions.to(DEVICE)
    scores = block_scores(x["q"], x["k_cmp"], params, scale, cu_seqlens, positions)
    near_tie = 1e-4 if dtype == torch.float32 else 2e-2
    checked = idx if positions is None else idx[:, positions]
    assert_valid_selection(checked, scores, params, cu_seqlens, near_tie, positions)

    inputs = {name: t.clone().requires_grad_() for name, t in x.items()}
    poison_allocator()
    out = nsa.nsa_attention(*(inputs[n] for n in INPUTS[:6]), k_win=inputs["k_win"],
                            v_win=inputs["v_win"], cu_seqlens=cu_seqlens, scale=scale,
                            backend="triton", **p)
    grad_out = seeded_randn(*out.shape).to(out)
    grads = torch.autograd.grad(out, [inputs[n] for n in INPUTS], grad_out)
    # The reference on the same blocks, in float64.
    ref_inputs = {name: t.double().requires_grad_() for name, t in x.items()}
    ref = nsa_attention_torch(*(ref_inputs[n] for n in INPUTS), params, scale, cu_seqlens,
                              indices=idx)
    ref_grads = torch.autograd.grad(ref, [ref_inputs[n] for n in INPUTS], grad_out.double())
    tolerance = TOLERANCE[dtype]
    assert not out.isnan().any()
    assert rel(out, ref) <= tolerance, ("out", rel(out, ref))
    for name, g, r in zip(INPUTS, grads, ref_grads):
        assert not g.isnan().any(), name
        if r.numel():
            assert rel(g, r) <= tolerance, (name, rel(g, r))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_matches_reference_small(case):
    run_case(case, torch.float32)


@pytest.mark.parametrize("s", [0.9, 1.1], ids=["s0.9", "s1.1"])
@pytest.mark.parametrize("case", CASES[:3], ids=case_id)
def test_triton_matches_reference_on_both_sides_of_a_unit_exp_scale(case, s):
    """At s = scale · log2(e) <= 1 the attention kernels leave a multiply and a clamp per
    pair out (launch.small_scale); s on both sides of 1: the masked selected kernels (the
    first case), the per-block ones (the second: G = 1, varlen), the per-position ones (the
    third: G = 16)."""
    run_case(case, torch.float32, scale=s / LOG2E)


def run_id(run):
    case, dtype = run
    return f"{case_id(case)}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("run", GPU_RUNS, ids=run_id)
def test_triton_matches_reference_gpu(run):
    run_case(*run)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_triton_matches_reference_long_sequence():
    """T = 128k, bf16: outputs and every gradient against float64 (64-bit offsets)."""
    run_case(LONG_CASE, torch.bfloat16)


def test_triton_rejects_float64():
    x, _ = make_inputs(1, 8, 2, 1, 16, 16, None, SMALL, torch.float64)
    with pytest.raises(ValueError, match="backend"):
        nsa.nsa_attention(*(x[n] for n in INPUTS[:6]), backend="triton", **SMALL)


def test_segmented_backward_equals_unsegmented(monkeypatch):
    """dK/dV split into many segments (summed in a fixed order) equal one segment per list."""
    from nsa.ops.triton import compressed_window
    from nsa.ops.triton.launch import TUNING

    case = (1, 61, 4, 2, 16, 16, [0, 9, 61], SMALL)
    x, cu_seqlens = make_inputs(*case, torch.float32)

    def grads():
        inputs = {name: t.clone().requires_grad_() for name, t in x.items()}
        out = nsa.nsa_attention(*(inputs[n] for n in INPUTS[:6]), k_win=inputs["k_win"],
                                v_win=inputs["v_win"], cu_seqlens=cu_seqlens, backend="triton",
                                **SMALL)
        return torch.autograd.grad(out.square().sum(), [inputs[n] for n in INPUTS])

    whole = grads()
    monkeypatch.setattr(compressed_window, "CMP_SEGMENT", 8)
    for kind in ("selected_dkdv", "selected_block_fwd"):  # the segment of each regime
        monkeypatch.setitem(TUNING, kind, dict(TUNING[kind], segment=3))
    split = grads()
    for name, a, b in zip(INPUTS, split, whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", [(1, 61, 4, 2, 16, 16, [0, 9, 61], SMALL),
                                  (2, 61, 6, 2, 16, 8, None, SMALL),
                                  (1, 61, 12, 2, 16, 16, None, SMALL)],
                         ids=["varlen-G2", "G3-Dk-ne-Dv", "G6-dq-only"])
def test_chunked_partials_equal_one_chunk(case, monkeypatch):
    """The per-block kernels over chunks of positions (``PARTIALS_BYTES`` small: chunks of a
    few positions, the last one shorter) equal one chunk: the output and dq bitwise (each
    entry's partial and each position's sum are the same), dK / dV summed over the chunks
    within float32 rounding. G = 2 and 3 run the forward and dq per block, G = 6 the dq."""
    from nsa.ops.triton import selected_blocks

    x, cu_seqlens = make_inputs(*case, torch.float32)

    def run():
        inputs = {name: t.clone().requires_grad_() for name, t in x.items()}
        out = nsa.nsa_attention(*(inputs[n] for n in INPUTS[:6]), k_win=inputs["k_win"],
                                v_win=inputs["v_win"], cu_seqlens=cu_seqlens, backend="triton",
                                **SMALL)
        return (out, *torch.autograd.grad(out.square().sum(), [inputs[n] for n in INPUTS]))

    whole = run()
    chunks = []
    position_chunks = selected_blocks.position_chunks
    monkeypatch.setattr(selected_blocks, "position_chunks",
                        lambda *a: chunks.append(position_chunks(*a)) or chunks[-1])
    monkeypatch.setattr(selected_blocks, "PARTIALS_BYTES", 10_000)
    chunked = run()
    T = case[1]
    for spans in chunks:  # in order, covering 0 .. T - 1
        starts = itertools.accumulate([0] + [n for _, n in spans[:-1]])
        assert [t0 for t0, _ in spans] == list(starts)
        assert sum(n for _, n in spans) == T
    assert max(len(spans) for spans in chunks) > 2
    for name, a, b in zip(("out", *INPUTS), chunked, whole):
        if name in ("out", "q"):
            assert torch.equal(a, b), name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("case,max_group,dq_max_group,pair_max_group",
                         [(CASES[1], 0, 0, 8), (CASES[-1], 0, 0, 8), (CASES[2], 16, 0, 8),
                          (CASES[0], 0, 16, 0)],
                         ids=["varlen-G1-per-position", "full-tiles-G4-pairs",
                              "G16-per-block", "G3-forward-per-position-dq-per-block"])
def test_triton_matches_reference_with_the_other_selected_kernels(case, max_group, dq_max_group,
                                                                  pair_max_group, monkeypatch):
    """The selected forward and dq per key block (selected_blocks.py) and per position or
    pair of positions (selected.py), each forced where the shipped group thresholds take the
    other, and the dq per block beside the forward per position."""
    from nsa.ops.triton import selected
    from nsa.ops.triton.launch import TUNING

    monkeypatch.setitem(TUNING, "selected_block_fwd",
                        dict(TUNING["selected_block_fwd"], max_group=max_group))
    monkeypatch.setitem(TUNING, "selected_dkdv",
                        dict(TUNING["selected_dkdv"], dq_max_group=dq_max_group))
    monkeypatch.setitem(TUNING, "selected_pair_fwd",
                        dict(TUNING["selected_pair_fwd"], max_group=pair_max_group))
    calls = []
    for name in ("block_forward", "pair_forward", "position_forward", "position_dq"):
        kernel = getattr(selected, name)
        monkeypatch.setattr(selected, name,
                            lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    run_case(case, torch.float32)
    G = case[2] // case[3]
    expected = ["block_forward" if G <= max_group
                else "pair_forward" if selected.position_pairs(G, case[6] is not None)
                else "position_forward"]
    if G > max(max_group, dq_max_group):
        expected.append("position_dq")
    assert calls == expected


@pytest.mark.parametrize("case,launches", [
    (CASES[5], [("_masked_dq_kernel", True)]),  # Dk 16, Dv 32: narrow even in float32
    (CASES[4], [("_masked_dq_kernel", False), ("_branches_dq_kernel", None)]),  # Dk 128
    (CASES[6], [("_branches_dq_kernel", None)]),  # 19 selection blocks, n = 3
], ids=["masked-narrow", "masked-wide-float32", "not-masked"])
def test_the_backward_computes_dq_in_one_kernel_where_the_selection_is_masked(case, launches,
                                                                             monkeypatch):
    """Where the selected branch runs as masked causal attention (selected_masked.py) in tiles
    of head dims <= 64 in 16 bits (launch.NARROW_TUNING's ``branches``), the backward's one dq
    kernel is the masked dq with the compressed and window branches' loops (BRANCHES), and the
    compressed+window dq kernel is not launched; elsewhere (wide float32 tiles, or no masked
    selection) that kernel adds the compressed and window branches to the selected branch's
    float32 dq. Either way the gradients match the float64 reference (run_case)."""
    from nsa.ops.triton import compressed_window, selected_masked

    dq_launches = []
    for module in (compressed_window, selected_masked):
        launch = module.launch_per_flag

        def recording(kernel, grid, *args, _launch=launch, **kwargs):
            name = kernel.fn.__name__
            if name in ("_masked_dq_kernel", "_branches_dq_kernel"):
                dq_launches.append((name, kwargs.get("BRANCHES")))
            return _launch(kernel, grid, *args, **kwargs)

        monkeypatch.setattr(module, "launch_per_flag", recording)
    run_case(case, torch.float32)
    assert dq_launches == launches


def test_the_forwards_register_cap_is_taken_where_every_stride_is_a_multiple_of_16(monkeypatch):
    """launch.NARROW_TUNING caps the compressed and window forwards at 96 registers, measured
    on 16-bit launches whose strides are multiples of 16 (``launch.strides_aligned``;
    offline, with every stride unaligned, the cap spills 416 B where uncapped they spill
    nothing): a q whose head stride is not (a view of wider rows) runs them uncapped, with
    the same output (to bfloat16 rounding: other kernels, other schedules), and so do float32
    inputs (their exact products spilled 112-704 B under the cap)."""
    from nsa.ops.triton import compressed_window

    caps = []
    launch = compressed_window.launch_per_flag

    def recording(kernel, grid, *args, **kwargs):
        if kernel.fn.__name__ == "_branch_fwd_kernel":
            caps.append(kwargs.get("maxnreg"))
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(compressed_window, "launch_per_flag", recording)
    B, T, HQ, H, Dk, Dv, cu, p = CASES[5]  # Dk 16, Dv 32: narrow tiles
    x, _ = make_inputs(B, T, HQ, H, Dk, Dv, cu, p, torch.bfloat16)
    wide = torch.zeros(B, T, HQ, Dk + 8, dtype=torch.bfloat16, device=DEVICE)
    padded_q = wide[..., :Dk].copy_(x["q"])  # head stride Dk + 8 = 24
    outputs = []
    for q in (x["q"], padded_q):
        outputs.append(nsa.nsa_attention(q, *(x[n] for n in INPUTS[1:6]), k_win=x["k_win"],
                                         v_win=x["v_win"], backend="triton", **p))
    assert caps == [96, 96, None, None]  # window, compressed (launched in that order); uncapped
    torch.testing.assert_close(outputs[1], outputs[0])
    x, _ = make_inputs(B, T, HQ, H, Dk, Dv, cu, p, torch.float32)
    nsa.nsa_attention(*(x[n] for n in INPUTS[:6]), k_win=x["k_win"], v_win=x["v_win"],
                      backend="triton", **p)
    assert caps[4:] == [None, None]


@pytest.mark.skipif(not CUDA, reason="needs CUDA (the interpreter runs programs in order)")
@pytest.mark.parametrize("case", [GPU_CASES[4], GPU_CASES[2], GPU_CASES[0]],
                         ids=["per-block", "masked", "G2"])
def test_triton_gradients_are_bitwise_reproducible(case):
    """Four forward+backward runs on the same inputs and output gradient give bitwise-identical
    outputs and gradients: no float atomics, every reduction in a fixed order, no copy racing
    a tensor-core product (v27's compressed/window dK/dV at G = 2 agreed in half of such runs
    on an H200). bf16; G = 16, varlen: the selected dK/dV per block, its lists long enough to
    be split into segments; G = 8, B = 2, T = 1000: the selected branch as masked attention,
    its dK/dV split into query segments; G = 2, Dk != Dv: full query tiles in the compressed
    and window dK/dV, and the selected forward and dq per key block (partials summed in slot
    order)."""
    x, cu_seqlens = make_inputs(*case, torch.bfloat16)
    first = _output_and_grads(x, cu_seqlens, case)
    for _ in range(3):
        for name, a, b in zip(("output", *INPUTS), first,
                              _output_and_grads(x, cu_seqlens, case)):
            assert torch.equal(a, b), f"{name} differs between two runs"


def _output_and_grads(x, cu_seqlens, case):
    """The Triton op's output and input gradients (bf16 inputs ``x``, a seeded output
    gradient)."""
    inputs = {name: t.clone().requires_grad_() for name, t in x.items()}
    out = nsa.nsa_attention(*(inputs[n] for n in INPUTS[:6]), k_win=inputs["k_win"],
                            v_win=inputs["v_win"], cu_seqlens=cu_seqlens, backend="triton",
                            **case[-1])
    grad_out = seeded_randn(*out.shape).to(out)
    grads = torch.autograd.grad(out, [inputs[n] for n in INPUTS], grad_out)
    return (out, *grads)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", [GPU_CASES[2], GPU_CASES[0]], ids=["masked", "G2"])
def test_triton_op_called_on_another_stream_equals_the_default_stream(case):
    """The op's second stream (launch.fork) starts after the caller's current stream, whichever
    it is, and the caller's stream waits for it: called on a new stream right after its inputs
    were written there, the op gives the default stream's outputs and gradients bitwise."""
    x, cu_seqlens = make_inputs(*case, torch.bfloat16)
    expected = _output_and_grads(x, cu_seqlens, case)
    caller = torch.cuda.Stream()
    caller.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(caller):
        x = {name: t.clone() for name, t in x.items()}  # written on the caller's stream
        got = _output_and_grads(x, cu_seqlens, case)
    torch.cuda.current_stream().wait_stream(caller)
    for name, a, b in zip(("output", *INPUTS), expected, got):
        assert torch.equal(a, b), f"{name} differs on another stream"


def test_strided_inputs_get_their_contiguous_copies_output_and_gradients():
    """Every input a view with padded rows (last stride 1, the others larger), as views of a
    user's fused projection are: the op reads them through their strides and writes each
    gradient into a new tensor, and gives the contiguous copies' output and gradients bitwise.
    (The backward wrote dq through q's strides into contiguous tensors, past their end, until
    the fifty-third session.)"""
    B, T, HQ, H, D = 1, 100, 4, 2, 16
    p = dict(cmp_block=16, cmp_stride=8, sel_block=16, num_selected=4, window=32)
    Tc = (T - p["cmp_block"]) // p["cmp_stride"] + 1
    shapes = {"q": (T, HQ, D), "k": (T, H, D), "v": (T, H, D), "k_cmp": (Tc, H, D),
              "v_cmp": (Tc, H, D), "gates": (T, HQ, 3), "k_win": (T, H, D), "v_win": (T, H, D)}
    padded = {name: seeded_randn(B, *shape[:-1], shape[-1] + 8, seed=3 + i).to(DEVICE)
              for i, (name, shape) in enumerate(shapes.items())}
    padded["gates"] = padded["gates"].sigmoid()
    results = []
    for contiguous in (True, False):
        x = {name: t[..., :shapes[name][-1]] for name, t in padded.items()}
        x = {name: (t.contiguous() if contiguous else t).detach().requires_grad_()
             for name, t in x.items()}
        assert contiguous or not x["q"].is_contiguous()
        out = nsa.nsa_attention(x["q"], x["k"], x["v"], x["k_cmp"], x["v_cmp"], x["gates"],
                                k_win=x["k_win"], v_win=x["v_win"], backend="triton", **p)
        grads = torch.autograd.grad(out, list(x.values()), seeded_randn(*out.shape, seed=9)
                                    .to(out))
        results.append((out, *grads))
    for name, a, b in zip(("output", *shapes), *results, strict=True):
        assert torch.equal(a, b), f"{name} differs for strided inputs"


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_triton_256k_bf16_has_no_overflow():
    """T = 256k in bf16 (HQ=16, G=16, D=64): output and every gradient finite, outputs bounded
    by the values (each branch is a convex combination of value rows)."""
    case = (1, 262144, 16, 1, 64, 64, None, PAPER)
    x, _ = make_inputs(*case, torch.bfloat16)
    inputs = {name: t.requires_grad_() for name, t in x.items()}
    out = nsa.nsa_attention(*(inputs[n] for n in INPUTS[:6]), k_win=inputs["k_win"],
                            v_win=inputs["v_win"], backend="triton", **PAPER)
    out.float().square().mean().backward()
    assert torch.isfinite(out).all()
    bound = 3 * max(x[n].abs().max().item() for n in ("v", "v_cmp", "v_win"))
    assert out.abs().max().item() <= bound
    for name in INPUTS:
        assert torch.isfinite(inputs[name].grad).all(), name


def test_tensor_descriptors_only_where_tma_can_read():
    from nsa.ops.triton.launch import tile_descriptor

    k = torch.zeros(2, 128, 2, 64, dtype=torch.bfloat16)
    assert tile_descriptor(k, [1, 64, 1, 64]) is not None
    assert tile_descriptor(k[..., :1], [1, 64, 1, 16]) is None  # 2-byte rows: illegal on GPUs
    assert tile_descriptor(k[..., 1:], [1, 64, 1, 64]) is None  # rows and base not aligned
    assert tile_descriptor(k[:, :0], [1, 64, 1, 64]) is None  # empty
    assert tile_descriptor(k, [1, 48, 1, 64]) is None  # a box dim not a power of two
    assert tile_descriptor(k, [1, 512, 1, 64]) is None  # a box dim above 256
    assert tile_descriptor(k.transpose(1, 3), [1, 16, 1, 64]) is None  # strided last dim


def test_host_arithmetic_equals_tritons():
    """The launch wrappers' plain-Python cdiv and next_pow2 (Triton's own are constexpr
    functions, slow from the host) give Triton's values."""
    from nsa.ops.triton.launch import cdiv, next_pow2

    for n in range(0, 2100):
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 129):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert next_pow2(2**40 + 1) == 2**41


def test_small_scale_is_an_exp_scale_of_one_in_float32():
    """launch.small_scale holds exactly where the kernels' float32 s = scale · log2(e) is at
    most 1: every head dim from 3 at the default scale, none of the huge scales."""
    from nsa.ops.triton.launch import small_scale

    for scale in (3**-0.5, 64**-0.5, 1 / LOG2E, 0.5 / LOG2E):
        assert small_scale(scale) and torch.tensor(scale * LOG2E).item() <= 1.0, scale
    for scale in (2**-0.5, 1.0, 1.0001 / LOG2E, 1e30, 2e38):
        assert not small_scale(scale), scale


def test_key_tiles_are_tuned_for_16_bit_tiles_only():
    from nsa.ops.triton.launch import (
        FLOAT32_SHRINK,
        KEYS_WIDE,
        NARROW_TUNING,
        TUNING,
        launch_keys,
    )

    assert launch_keys("cw_dq", 128, 2) == TUNING["cw_dq"]["keys"]
    assert launch_keys("cw_dq", 64, 2) == NARROW_TUNING["cw_dq"]["keys"]
    # A field the narrow entry leaves out comes from TUNING's.
    assert launch_keys("cw_dq", 64, 2, field="win_keys") == TUNING["cw_dq"]["win_keys"]
    assert launch_keys("cmp_fwd", 64, 2) == TUNING["cmp_fwd"]["keys"]  # no narrow entry
    # Wide tiles take at most KEYS_WIDE keys, wide float32 ones (float32 counts as twice the
    # head dim) 1 / FLOAT32_SHRINK of that; float32 tiles of width <= 128 their tuned keys.
    assert launch_keys("win_fwd", 192, 2) == min(TUNING["win_fwd"]["keys"], KEYS_WIDE)
    assert launch_keys("cw_dq", 128, 4) == KEYS_WIDE // FLOAT32_SHRINK
    assert launch_keys("cw_dq", 128, 4, field="win_keys") == KEYS_WIDE // FLOAT32_SHRINK
    assert launch_keys("cw_dq", 64, 4) == TUNING["cw_dq"]["keys"]


@pytest.mark.parametrize("keys", [16, 128])
def test_triton_matches_reference_at_other_key_tiles(keys, monkeypatch):
    """The compressed and window kernels at key tiles other than the shipped ones (forward, dq
    and dK/dV each): full tiles of 128 keys beside partial ones (T = 300: 148 compressed
    tokens, a window of 130)."""
    from nsa.ops.triton.launch import NARROW_TUNING, TUNING

    fields = {"cw_dq": ("keys", "win_keys")}
    for family in ("cmp_fwd", "win_fwd", "cw_dq", "cmp_dkdv", "win_dkdv"):
        tiles = dict.fromkeys(fields.get(family, ("keys",)), keys)
        monkeypatch.setitem(TUNING, family, dict(TUNING[family], **tiles))
        if family in NARROW_TUNING:
            monkeypatch.setitem(NARROW_TUNING, family, dict(NARROW_TUNING[family], **tiles))
    run_case(CASES[-1], torch.float32)


def test_dkdv_tiles_are_transposed_for_power_of_two_groups_of_16_bit_tiles_only():
    from nsa.ops.triton.launch import TUNING, launch_transposed

    least = TUNING["win_dkdv"]["transposed_min_group"]
    assert launch_transposed("win_dkdv", 16, 128, 2)
    assert launch_transposed("win_dkdv", least, 128, 2)
    assert not launch_transposed("win_dkdv", least // 2, 128, 2)  # G = 2 unmeasured, G = 1 slower
    assert not launch_transposed("win_dkdv", 6, 128, 2)  # tiles of partial positions
    assert not launch_transposed("win_dkdv", 16, 64, 2)  # narrow tiles: not measured
    assert not launch_transposed("win_dkdv", 16, 128, 4)  # wide (float32) tiles
    for family in ("cmp_dkdv", "selected_dkdv", "masked_dkdv"):  # measured slower / no such
        assert not launch_transposed(family, 16, 128, 2)


@pytest.mark.parametrize("case", [CASES[1], CASES[-1]], ids=["varlen-G1", "full-tiles-G4"])
def test_triton_matches_reference_with_transposed_dkdv_tiles(case, monkeypatch):
    """The compressed and window dK/dV with p^T and dS^T computed as [keys, rows] (the
    shipped launches take them at D = 128 only, which the interpreter cases do not reach)."""
    transpose_dkdv_tiles(monkeypatch, True)
    run_case(case, torch.float32)


def test_launch_shapes_halve_rows_per_doubling_of_the_tile_width():
    from nsa.ops.triton.launch import TUNING, launch_shape

    rows = TUNING["cw_dq"]["rows"]
    assert launch_shape("cw_dq", 2, 128, 2) == (rows, dict(num_warps=8, num_stages=2))
    # float32 counts as twice the head dim (the float32 GPU cases ran out of shared memory),
    # and its wide tiles halve their rows once more (FLOAT32_SHRINK: spills of the products).
    assert launch_shape("cw_dq", 2, 64, 4) == launch_shape("cw_dq", 2, 128, 2)  # width 128
    assert launch_shape("cw_dq", 2, 128, 4) == (rows // 4, dict(num_warps=8, num_stages=1))
    assert launch_shape("cw_dq", 6, 192, 4)[0] == rows // 8
    assert launch_shape("cw_dq", 64, 192, 4)[0] == 64  # never below the group
