"""The selected forward over pairs of positions (nsa/ops/triton/selected.py,
``_selected_pair_fwd_kernel``: positions t0 = 2i and t0 + 1 in one program, over the union of
their blocks) against a float64 oracle on the same selected blocks, and where it runs."""

import pytest
import torch

from nsa.ops.params import NSAParams

pytest.importorskip("triton")

from nsa.ops.triton import selected  # noqa: E402
from nsa.ops.triton.launch import TUNING  # noqa: E402
from tests.ops.test_masked_selected import DTYPES, TOLERANCE, allowed_pairs, oracle, rel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (B, T, HQ, H, Dk, Dv, l', n, own): own = whether every position selects its own block
# (num_local >= 1); without, the union's last block can be one position's only.
CASES = [
    (2, 45, 12, 2, 16, 16, 16, 3, True),  # G = 6, T odd: the last pair has one position
    (1, 61, 5, 1, 16, 32, 8, 3, False),  # G = 5, Dk != Dv, own blocks not forced
    (1, 100, 16, 2, 32, 16, 16, 4, True),  # G = 8: both positions fill the 16 rows
    (1, 50, 7, 1, 16, 16, 12, 3, False),  # G = 7, l' = 12: pointer loads (no TMA), odd l'
    (1, 1, 6, 1, 16, 16, 16, 2, True),  # T = 1
]


def case_id(c):
    B, T, HQ, H, Dk, Dv, ls, n, own = c
    return f"B{B}-T{T}-HQ{HQ}-H{H}-Dk{Dk}-Dv{Dv}-ls{ls}-n{n}-{'own' if own else 'any'}"


def random_selection(B, T, H, sel_block, n, own, gen):
    """[B, T, H, n] int32 as the spec's selection: all candidates while there are at most n,
    else block 0, the position's own block if ``own`` and random others; ascending, -1
    padded."""
    idx = torch.full((B, T, H, n), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            last = t // sel_block
            for h in range(H):
                if last + 1 <= n:
                    blocks = list(range(last + 1))
                else:
                    forced = {0, last} if own else {0}
                    others = [j for j in torch.randperm(last + 1, generator=gen).tolist()
                              if j not in forced]
                    blocks = sorted(forced | set(others[:n - len(forced)]))
                idx[b, t, h, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return idx


def make_case(case, dtype, seed=0):
    B, T, HQ, H, Dk, Dv, ls, n, own = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HQ, Dk, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, Dk, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H, Dv, generator=gen, dtype=torch.float64)
    idx = random_selection(B, T, H, ls, n, own, gen)
    params = NSAParams(cmp_block=ls, cmp_stride=ls // 2, sel_block=ls, num_selected=n,
                       num_init=1, num_local=1 if own else 0)
    return [x.to(DEVICE, dtype) for x in (q, k, v)], idx.to(DEVICE), params, (q, k, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_pair_forward_matches_float64_oracle(case, dtype):
    (q, k, v), idx, params, (q64, k64, v64) = make_case(case, dtype)
    assert selected.position_pairs(q.shape[2] // k.shape[2], packed=False)
    scale = q.shape[-1] ** -0.5
    o, lse = selected.pair_forward(q, k, v, idx, params, scale)
    ref, ref_lse = oracle(q64, k64, v64, idx.cpu(), params.sel_block, scale)
    assert o.dtype == torch.float32
    assert rel(o, ref) <= TOLERANCE[dtype]
    assert rel(lse, ref_lse) <= TOLERANCE[dtype]


@pytest.mark.parametrize("poison", ["k", "v"])
@pytest.mark.parametrize("s", [37, 26], ids=["second-of-a-pair", "first-of-a-pair"])
def test_a_nan_reaches_only_the_rows_that_see_it(poison, s):
    """A NaN key or value at token s: the output of exactly the (position, head) rows that see
    s (s <= t, s's block selected) is NaN. A pair's two positions share a program: t0 = s - 1
    (s odd) computes s's products in its last block, and positions that did not select s's
    block compute them where their pair partner did; neither may take the NaN in."""
    case = (1, 64, 12, 2, 16, 16, 8, 3, False)
    (q, k, v), idx, params, _ = make_case(case, torch.float32, seed=3)
    x = {"k": k, "v": v}
    x[poison][0, s, 0, 0] = float("nan")  # KV head 0
    o, _ = selected.pair_forward(q, x["k"], x["v"], idx, params, q.shape[-1] ** -0.5)
    sees = allowed_pairs(idx.cpu(), q.shape[2], params.sel_block)[..., s].clone()
    sees[:, :, q.shape[2] // 2:] = False  # query heads of KV head 1 never meet head 0's keys
    block = s // params.sel_block
    partners = [t for t in range(s + 1, 64) if (block in idx[0, t ^ 1, 0].tolist())
                and block not in idx[0, t, 0].tolist()]
    assert partners, "no position computes s's block for its pair partner only"
    assert sees.any() and (~sees).any()
    assert o.isnan().any(-1).cpu().equal(sees)


def test_pairs_run_for_fixed_length_groups_of_at_most_8_heads(monkeypatch):
    """Groups whose heads fit twice in a per-position program's 16 rows (G <= 8), fixed-length
    only (a pair could straddle two sequences), and no larger groups than the tuning allows."""
    assert [G for G in range(1, 33) if selected.position_pairs(G, packed=False)] == list(
        range(1, 9))
    assert not selected.position_pairs(6, packed=True)
    monkeypatch.setitem(TUNING, "selected_pair_fwd",
                        dict(TUNING["selected_pair_fwd"], max_group=5))
    assert selected.position_pairs(5, packed=False)
    assert not selected.position_pairs(6, packed=False)
