"""The selected branch's forward, dq and dK/dV as masked causal attention (nsa/ops/triton/
selected_masked.py) against a float64 oracle on the same selected blocks: every position
attends to the tokens <= itself of the blocks it selected. Random selections (ascending, -1
padded, the position's own block and block 0 always in) give tiles every row selected, tiles
some rows selected and tiles none did."""

import pytest
import torch

from nsa.ops.params import LOG2E, NSAParams

pytest.importorskip("triton")

from nsa.ops.triton import selected  # noqa: E402
from nsa.ops.triton.finite import kv_finite_flags  # noqa: E402
from nsa.ops.triton.launch import BranchGrad, tile_heads  # noqa: E402
from nsa.ops.triton.selected_masked import (  # noqa: E402
    POSITIONS_CHUNK,
    block_positions,
    masked_causal_selection,
    masked_dkdv,
    masked_dq,
    masked_forward,
    masked_selection,
)
from nsa.ops.triton.tables import build_tables  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# (B, T, HQ, H, Dk, Dv, l', n)
CASES = [
    (2, 37, 6, 2, 16, 8, 16, 2),  # G = 3, Dk != Dv, T not a multiple of the block
    (1, 70, 16, 1, 16, 16, 16, 3),  # G = 16: 8 positions per tile
    (1, 100, 4, 4, 32, 16, 16, 4),  # G = 1: one tile of 128 positions
    (1, 200, 8, 2, 16, 16, 16, 7),  # G = 4: many full tiles, plain, masked and skipped
    (1, 300, 8, 2, 16, 16, 128, 2),  # l' = 128: two key tiles per block
    (1, 5, 8, 2, 16, 16, 16, 1),  # T below one block
    (1, 1, 4, 4, 16, 16, 16, 1),  # T = 1
    (1, 45, 12, 2, 16, 16, 16, 3),  # G = 6: tiles of 2 heads, three a KV head
]


def case_id(c):
    B, T, HQ, H, Dk, Dv, ls, n = c
    return f"B{B}-T{T}-HQ{HQ}-H{H}-Dk{Dk}-Dv{Dv}-ls{ls}-n{n}"


def random_selection(B, T, H, sel_block, n, gen):
    """[B, T, H, n] int32: block 0, the position's own block and random others among the
    candidates, ascending, -1 padded. Every third block (shifted per b, h) is never an
    "other", so tiles whose rows all passed it by are skipped."""
    idx = torch.full((B, T, H, n), -1, dtype=torch.int32)
    for t in range(T):
        own = t // sel_block
        count = min(n, own + 1)
        for b in range(B):
            for h in range(H):
                others = torch.randperm(own + 1, generator=gen)
                others = others[(others != own) & (others != 0) & ((others + b + h) % 3 != 0)]
                others = others[:max(0, count - 2)]
                blocks = sorted({0, own, *others.tolist()})
                idx[b, t, h, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return idx


def make_case(case, dtype, seed=0):
    B, T, HQ, H, Dk, Dv, ls, n = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HQ, Dk, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, Dk, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H, Dv, generator=gen, dtype=torch.float64)
    do = torch.randn(B, T, HQ, Dv, generator=gen, dtype=torch.float64)
    idx = random_selection(B, T, H, ls, n, gen)
    params = NSAParams(cmp_block=ls, cmp_stride=ls // 2, sel_block=ls, num_selected=n,
                       num_init=1, num_local=1 if n > 1 else 0)
    moved = [x.to(DEVICE, dtype) for x in (q, k, v, do)]
    return moved, idx.to(DEVICE), params, (q, k, v, do)


def allowed_pairs(idx, HQ, sel_block):
    """[B, T, HQ, T]: whether query t (of each head) sees key s: s <= t, in a block t chose."""
    B, T, H, _ = idx.shape
    blocks = (T + sel_block - 1) // sel_block
    chosen = torch.zeros(B, T, H, blocks + 1, dtype=torch.bool)
    chosen.scatter_(-1, torch.where(idx >= 0, idx, blocks).long().cpu(), True)
    t = torch.arange(T)
    allowed = chosen[..., t // sel_block] & (t[None, :] <= t[:, None])[None, :, None, :]
    return allowed.repeat_interleave(HQ // H, dim=2)


def oracle(q, k, v, idx, sel_block, scale):
    """Float64 selected attention -> (output, log-sum-exp in base 2)."""
    G = q.shape[2] // k.shape[2]
    scores = torch.einsum("bthd,bshd->bths", q, k.repeat_interleave(G, dim=2)) * scale
    scores = scores.masked_fill(~allowed_pairs(idx, q.shape[2], sel_block), float("-inf"))
    out = torch.einsum("bths,bshd->bthd", scores.softmax(-1), v.repeat_interleave(G, dim=2))
    return out, torch.logsumexp(scores, -1) * LOG2E


def kernel_forward_and_dq(q, k, v, do, idx, params, scale):
    o, lse, dq, _, _ = kernel_forward_backward(q, k, v, do, idx, params, scale)
    return o, lse, dq


def kernel_forward_backward(q, k, v, do, idx, params, scale, gate=None):
    """(o, lse, dq, dk, dv) of the masked kernels; the output gradient is gate · do (gate
    [B, T, HQ] float32, default 1)."""
    selection = masked_selection(idx, kv_finite_flags(((k, v),))[0])
    o, lse = masked_forward(q, k, v, selection, params, scale)
    grad = BranchGrad.ungated(do) if gate is None else BranchGrad(do, gate)
    delta = (do.float() * o).sum(-1)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    masked_dq(q, k, v, selection, grad, lse, delta, dq, params, scale, accumulate=False)
    dk, dv = masked_dkdv(q, k, v, selection, grad, lse, delta, params, scale)
    return o, lse, dq, dk, dv


def rel(a, b):
    """Relative error; a gradient that is exactly 0 (dq at T = 1) is judged on a unit scale."""
    return ((a.double().cpu() - b).norm() / b.norm().clamp_min(1.0)).item()


# The interpreter's bf16 products are wrong (the window kernel's too): bf16 on the GPU only.
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_masked_selected_matches_float64_oracle(case, dtype):
    (q, k, v, do), idx, params, (q64, k64, v64, do64) = make_case(case, dtype)
    assert masked_causal_selection(q.shape[1], params, packed=False)
    scale = q.shape[-1] ** -0.5  # <= 1 / log2(e): the kernels' lse is the plain base-2 one
    # The branch's output gradient is gate · do (the kernels apply each row's gate).
    gate = torch.rand(q.shape[:-1], generator=torch.Generator().manual_seed(1)) + 0.5
    o, lse, dq, dk, dv = kernel_forward_backward(q, k, v, do, idx, params, scale,
                                                 gate.to(DEVICE))
    for x in (q64, k64, v64):
        x.requires_grad_()
    ref, ref_lse = oracle(q64, k64, v64, idx, params.sel_block, scale)
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref, (q64, k64, v64),
                                                 do64 * gate.double()[..., None])
    assert dk.dtype == k.dtype and dv.dtype == v.dtype
    assert rel(o, ref) <= TOLERANCE[dtype]
    assert rel(lse, ref_lse.detach()) <= TOLERANCE[dtype]
    assert rel(dq, ref_dq) <= TOLERANCE[dtype]
    assert rel(dk, ref_dk) <= TOLERANCE[dtype]
    assert rel(dv, ref_dv) <= TOLERANCE[dtype]


def tile_kinds(idx, G, rows, sel_block):
    """(plain, masked, skipped) counts of the full key tiles (before a tile's first position)
    the kernels see with ``rows`` rows per tile, from the selection alone."""
    B, T, H, _ = idx.shape
    P = rows // tile_heads(G)
    tile = min(64, sel_block)
    kinds = [0, 0, 0]
    for b in range(B):
        for h in range(H):
            for t_first in range(0, T, P):
                sets = [set(idx[b, t, h].tolist()) for t in range(t_first, min(t_first + P, T))]
                for start in range(0, (t_first + 1) // tile * tile, tile):
                    chosen = [start // sel_block in s for s in sets]
                    kinds[0 if all(chosen) else 1 if any(chosen) else 2] += 1
    return kinds


def test_cases_cover_plain_masked_and_skipped_tiles():
    from nsa.ops.triton.launch import launch_shape

    B, T, HQ, H, Dk, Dv, ls, n = CASES[3]
    _, idx, _, _ = make_case(CASES[3], torch.float32)
    rows, _ = launch_shape("masked_fwd", HQ // H, max(Dk, Dv), 4)
    assert min(tile_kinds(idx.cpu(), HQ // H, rows, ls)) > 0


@pytest.mark.parametrize("poison", ["k", "v"])
def test_a_nan_reaches_only_the_rows_that_selected_its_block(poison):
    """A NaN key or value at token s: the output and dq of exactly the (position, head) rows
    that see s (s <= t, s's block selected) are NaN; every other row stays finite (those of
    KV head 1 through the launch for finite keys and values, head 0's through the other)."""
    case = CASES[3]
    (q, k, v, do), idx, params, _ = make_case(case, torch.float32, seed=3)
    s = 37  # block 2 of 16 tokens: selected by some positions after it, not by others
    x = {"k": k, "v": v}
    x[poison][0, s, 0, 0] = float("nan")  # KV head 0 (block 2 can be an "other" there)
    o, lse, dq = kernel_forward_and_dq(q, x["k"], x["v"], do, idx, params, q.shape[-1] ** -0.5)
    sees = allowed_pairs(idx.cpu(), q.shape[2], params.sel_block)[..., s].clone()
    sees[:, :, q.shape[2] // 2:] = False  # query heads of KV head 1 never meet head 0's keys
    assert sees.any() and (~sees).any()
    assert o.isnan().any(-1).cpu().equal(sees)
    assert dq.isnan().any(-1).cpu().equal(sees)


def test_masked_selection_holds_each_rows_blocks():
    """One int64 word per (batch, position, KV head): bit j set exactly when block j is among
    the row's slots (-1 unused; block 63 is the sign bit), for n not a power of two."""
    gen = torch.Generator().manual_seed(0)
    idx = torch.full((2, 70, 3, 3), -1, dtype=torch.int32)
    for row in idx.view(-1, 3):
        count = int(torch.randint(0, 4, (1,), generator=gen))
        row[:count] = torch.randperm(64, generator=gen)[:count].to(torch.int32)
    idx[0, 0, 0] = torch.tensor([63, 0, -1], dtype=torch.int32)
    idx[1, 69, 2] = torch.tensor([5, -1, 40], dtype=torch.int32)
    expected = torch.zeros(2, 70, 3, dtype=torch.int64)
    for i, row in enumerate(idx.view(-1, 3)):
        for block in row.tolist():
            if block >= 0:
                expected.view(-1)[i] |= (1 << block) - (1 << 64 if block == 63 else 0)
    flags = torch.ones(2, 3, dtype=torch.int8, device=DEVICE)
    selection = masked_selection(idx.to(DEVICE), flags)
    assert selection.bits.cpu().equal(expected)
    assert selection.kv_finite is flags


def test_block_positions_list_the_positions_of_each_block_in_order():
    """Per (batch·KV head, block): the positions whose row mask holds the block, ascending,
    and their count; 64 blocks (block 63 is the sign bit), T past one chunk of the kernel and
    not a multiple of the block."""
    gen = torch.Generator().manual_seed(0)
    B, H, sel_block = 2, 3, 9
    T = 64 * sel_block - 4
    assert T > POSITIONS_CHUNK
    own = torch.arange(T)[None, :, None] // sel_block  # a position selects blocks <= its own
    bits = torch.randint(0, 1 << 62, (B, T, H), generator=gen) * 2 + torch.randint(
        0, 2, (B, T, H), generator=gen)
    bits = bits & torch.where(own == 63, -1, (1 << (own + 1)) - 1)
    bits[1, T - 1, 2] = -1  # every block
    positions, counts = block_positions(bits.to(DEVICE), sel_block)
    assert positions.shape == (B * H, 64, T) and counts.shape == (B * H, 64)
    for b in range(B):
        for h in range(H):
            for block in range(64):
                expected = ((bits[b, :, h] >> block) & 1).nonzero().flatten()
                assert counts[b * H + h, block] == len(expected)
                assert positions[b * H + h, block, :len(expected)].cpu().equal(
                    expected.to(torch.int32)), (b, h, block)


def test_kv_finite_flags_mark_each_batch_and_kv_head_holding_a_non_finite_key_or_value():
    """The flags that pick each program's path (finite.py), for three (k, v) pairs of
    different lengths in one launch: 0 exactly where a key or value is NaN or infinite, in any
    chunk of positions (the last one ragged: T = 70)."""
    gen = torch.Generator().manual_seed(0)
    lengths = (5, 70, 70)
    pairs = [(torch.randn(2, n, 3, 16, generator=gen), torch.randn(2, n, 3, 8, generator=gen))
             for n in lengths]
    pairs[1][0][1, 69, 2, 5] = float("inf")
    pairs[1][1][0, 3, 1, 0] = float("nan")
    pairs[2][1][1, 64, 0, 7] = float("-inf")
    pairs[0][0][0, 4, 2, 15] = float("nan")
    expected = torch.ones(3, 2, 3, dtype=torch.int8)
    expected[1, 1, 2] = expected[1, 0, 1] = expected[2, 1, 0] = expected[0, 0, 2] = 0
    flags = kv_finite_flags([(k.to(DEVICE), v.to(DEVICE)) for k, v in pairs])
    assert flags.cpu().equal(expected)
    assert kv_finite_flags([(k.to(DEVICE), v.to(DEVICE)) for k, v in pairs[:1]]).cpu().equal(
        expected[:1])


def test_a_nan_query_reaches_the_key_gradients_of_exactly_the_keys_it_sees():
    """A NaN in one (position, head) row's query: dK and dV are NaN at exactly the keys that
    row sees (its selected blocks up to itself), finite elsewhere."""
    case = CASES[3]
    (q, k, v, do), idx, params, _ = make_case(case, torch.float32, seed=3)
    t, head = 150, 1  # KV head 0
    q[0, t, head, 0] = float("nan")
    _, _, _, dk, dv = kernel_forward_backward(q, k, v, do, idx, params, q.shape[-1] ** -0.5)
    sees = torch.zeros(k.shape[:3], dtype=torch.bool)
    sees[0, :, 0] = allowed_pairs(idx.cpu(), q.shape[2], params.sel_block)[0, t, head]
    assert sees.any() and (~sees[0, :t + 1, 0]).any()
    assert dk.isnan().any(-1).cpu().equal(sees)
    assert dv.isnan().any(-1).cpu().equal(sees)


@pytest.mark.parametrize("case", [CASES[3], CASES[4]], ids=case_id)
def test_dkdv_split_into_query_segments_equals_one_segment(case, monkeypatch):
    """On a GPU whose SMs the key tiles alone would leave idle, dK/dV runs over segments of
    each block's list of positions (float32 partials, summed in order): the same gradients as
    one segment, with segment boundaries among the entries masked by position (segments of 8
    entries: l' = 16 has up to 15 such; 100: the second key tile of l' = 128 has 127)."""
    from nsa.ops.triton import launch

    (q, k, v, do), idx, params, _ = make_case(case, torch.float32)
    whole = kernel_forward_backward(q, k, v, do, idx, params, q.shape[-1] ** -0.5)
    monkeypatch.setattr(launch, "num_sms", lambda device: 1000)
    monkeypatch.setattr(launch, "MIN_SEGMENT", 8 if params.sel_block == 16 else 100)
    T = q.shape[1]
    assert launch.dkdv_segment(T, 1, q.device, T) < T  # more than one segment
    split = kernel_forward_backward(q, k, v, do, idx, params, q.shape[-1] ** -0.5)
    for a, b in zip(split[3:], whole[3:]):
        assert a.dtype == b.dtype == k.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("in_registers", [True, False], ids=["in-registers", "read-back"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=case_id)
def test_the_forward_writes_the_gated_sum_of_the_three_branches(case, in_registers,
                                                                monkeypatch):
    """With the other branches' outputs and the gates, the forward also writes out = Σ g_i o_i
    in q's dtype, whether its epilogue takes o_slc from registers or reads it back
    (gating.sum_in_registers)."""
    from nsa.ops.triton import selected_masked
    from nsa.ops.triton.gating import GatedSum

    monkeypatch.setattr(selected_masked, "sum_in_registers", lambda *shape: in_registers)
    (q, k, v, _), idx, params, _ = make_case(case, torch.float32)
    gen = torch.Generator().manual_seed(2)
    o_cmp, o_win = (torch.randn(*q.shape[:3], v.shape[-1], generator=gen).to(DEVICE)
                    for _ in range(2))
    gates = torch.rand(*q.shape[:3], 3, generator=gen).to(DEVICE)
    out = torch.full_like(o_cmp, float("nan"))
    selection = masked_selection(idx, kv_finite_flags(((k, v),))[0])
    o_slc, _ = masked_forward(q, k, v, selection, params, q.shape[-1] ** -0.5,
                              gated=GatedSum(o_cmp, o_win, gates, out))
    expected = sum(gates[..., i, None] * o for i, o in enumerate((o_cmp, o_slc, o_win)))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_backward_with_wide_row_offsets_equals_narrow(monkeypatch):
    """The dq and dK/dV compute their rows' offsets in int32 unless an offset inside a batch
    entry of their query rows' tensors reaches 2^31 (``launch.wide_rows``): int64 offsets give
    the same gradients."""
    from nsa.ops.triton import selected_masked

    (q, k, v, do), idx, params, _ = make_case(CASES[0], torch.float32)
    narrow = kernel_forward_backward(q, k, v, do, idx, params, q.shape[-1] ** -0.5)
    monkeypatch.setattr(selected_masked, "wide_rows", lambda *tensors: True)
    wide = kernel_forward_backward(q, k, v, do, idx, params, q.shape[-1] ** -0.5)
    for a, b in zip(wide[2:], narrow[2:]):  # dq, dk, dv
        assert a.equal(b)


def test_wide_rows_holds_where_an_offset_inside_a_batch_entry_reaches_2_to_31():
    from nsa.ops.triton.launch import wide_rows

    def view(shape, stride):  # strides past any real allocation (meta tensors hold no data)
        return torch.empty(0, device="meta").as_strided(shape, stride)

    assert not wide_rows(view((2, 2048, 12, 64), (2**40, 768, 64, 1)))  # the batch stride
    assert not wide_rows(view((1, 2, 1), (1, 2**31 - 1, 1)))  # largest offset 2^31 - 1
    assert wide_rows(view((1, 3, 1), (1, 2**30, 1)), view((1, 1), (1, 1)))  # 2^31


def test_masked_path_is_for_short_fixed_length_batches_only():
    paper = NSAParams()
    assert masked_causal_selection(2048, paper, packed=False)  # 32 blocks = 2n
    assert not masked_causal_selection(2048, paper, packed=True)
    assert not masked_causal_selection(2049, paper, packed=False)  # 33 blocks > 2n
    assert masked_causal_selection(4096, NSAParams(num_selected=40), packed=False)  # 64
    assert not masked_causal_selection(4097, NSAParams(num_selected=40), packed=False)  # 65
    assert not masked_causal_selection(100, NSAParams(sel_block=48, cmp_stride=16,
                                                      num_selected=4), packed=False)
    assert not masked_causal_selection(100, NSAParams(sel_block=8, cmp_block=8, cmp_stride=8,
                                                      num_selected=16), packed=False)


def test_the_op_takes_the_masked_path_where_it_applies(monkeypatch):
    """selected_forward and selected_backward dispatch on masked_causal_selection (the
    backward reading the row masks the forward built): the same inputs through packed tables
    (one sequence: the same semantics, per-position and per-block kernels) give the same
    outputs and gradients."""
    (q, k, v, do), idx, params, _ = make_case(CASES[1], torch.float32)
    T = q.shape[1]
    scale = q.shape[-1] ** -0.5
    calls = []
    monkeypatch.setattr(selected, "masked_selection",
                        lambda *a: calls.append("bits") or masked_selection(*a))
    monkeypatch.setattr(selected, "masked_forward",
                        lambda *a: calls.append("fwd") or masked_forward(*a))
    monkeypatch.setattr(selected, "masked_dq",
                        lambda *a, **kw: calls.append("dq") or masked_dq(*a, **kw))
    monkeypatch.setattr(selected, "masked_dkdv",
                        lambda *a: calls.append("dkdv") or masked_dkdv(*a))
    results = []
    kv_finite = kv_finite_flags(((k, v),))[0]
    for cu in (None, torch.tensor([0, T], dtype=torch.int32, device=DEVICE)):
        tables = build_tables(T, params.compressed_length(T), cu, params, q.device)
        o, lse, selection = selected.selected_forward(q, k, v, idx, tables, params, scale,
                                                      kv_finite)
        delta = (do * o).sum(-1)
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = selected.selected_backward(q, k, v, selection, BranchGrad.ungated(do), lse,
                                            delta, dq, tables, params, scale, kv_finite,
                                            accumulate=False)
        results.append((o, lse, dq, dk, dv))
    # The row masks built once, by the forward; the packed tables took the per-position
    # forward and dq, and the per-block dK/dV.
    assert calls == ["bits", "fwd", "dq", "dkdv"]
    for masked, per_position in zip(*results):
        torch.testing.assert_close(masked, per_position, rtol=1e-5, atol=1e-5)
