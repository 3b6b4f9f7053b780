"""A deliberately simple NSA oracle, written from NSA_SPEC.md alone.

Explicit Python loops over sequences, tokens and heads: slow, for tiny shapes only. It shares
no code with `nsa`. `naive_attention` builds every output row with torch ops and stacks them,
so autograd gives reference gradients; the selection is a hard choice made on detached float64
scores, as the spec requires.

Selected sets are nested lists `sets[b][t][g]` of ascending block indices, local to the
sequence that holds position t (varlen: b is always 0 and t the packed position).
"""

from fractions import Fraction

import torch

__all__ = [
    "compressed_length",
    "overlap",
    "sequences",
    "naive_group_scores",
    "naive_select",
    "naive_attention",
    "forced_blocks",
    "select_from_scores",
    "sets_to_index",
    "index_to_sets",
    "exact_group_scores",
]


def compressed_length(T, cmp_block, cmp_stride):
    """Tc = 0 if T < l, else (T - l) // d + 1."""
    return 0 if T < cmp_block else (T - cmp_block) // cmp_stride + 1


def overlap(a0, a1, b0, b1):
    """|[a0, a1) ∩ [b0, b1)| counted directly."""
    return sum(1 for s in range(a0, a1) if b0 <= s < b1)


def sequences(B, T, cu_seqlens, cmp_block, cmp_stride):
    """Yield (b, bos, eos, cmp_bos, cmp_eos) per sequence: each batch row, or each varlen piece."""
    if cu_seqlens is None:
        Tc = compressed_length(T, cmp_block, cmp_stride)
        for b in range(B):
            yield b, 0, T, 0, Tc
        return
    bounds = [int(x) for x in cu_seqlens.tolist()]
    cmp_bos = 0
    for bos, eos in zip(bounds[:-1], bounds[1:], strict=True):
        Tc = compressed_length(eos - bos, cmp_block, cmp_stride)
        yield 0, bos, eos, cmp_bos, cmp_bos + Tc
        cmp_bos += Tc


def forced_blocks(t, sel_block, num_init, num_local):
    last = t // sel_block
    init = set(range(num_init))
    local = {j for j in range(last - num_local + 1, last + 1) if j >= 0}
    return {j for j in init | local if j <= last}


def select_from_scores(scores, t, *, sel_block, num_selected, num_init, num_local):
    """The spec's rule: all candidates if ≤ n, else forced ∪ best others (ties → lower index)."""
    num_candidates = t // sel_block + 1
    assert len(scores) == num_candidates
    if num_candidates <= num_selected:
        return list(range(num_candidates))
    chosen = forced_blocks(t, sel_block, num_init, num_local)
    others = [j for j in range(num_candidates) if j not in chosen]
    others.sort(key=lambda j: (-scores[j], j))
    chosen |= set(others[: num_selected - len(chosen)])
    return sorted(chosen)


def _visible(t, Tc, cmp_block, cmp_stride):
    """Compressed tokens i with i·d + l - 1 ≤ t."""
    return [i for i in range(Tc) if i * cmp_stride + cmp_block - 1 <= t]


def _head_block_scores(q_th, k_cmp_g, t, Tc, *, cmp_block, cmp_stride, sel_block, scale):
    """p_slc[t, h, j] for j = 0 … ⌊t/l'⌋ (Python floats, float64)."""
    num_candidates = t // sel_block + 1
    vis = _visible(t, Tc, cmp_block, cmp_stride)
    p_slc = [0.0] * num_candidates
    if not vis:
        return p_slc
    logits = torch.stack([scale * torch.dot(q_th, k_cmp_g[i]) for i in vis])
    p_cmp = torch.softmax(logits, dim=0).tolist()
    for j in range(num_candidates):
        total = 0.0
        for p, i in zip(p_cmp, vis, strict=True):
            ov = overlap(
                i * cmp_stride, i * cmp_stride + cmp_block, j * sel_block, (j + 1) * sel_block
            )
            total += p * ov / cmp_block
        p_slc[j] = total
    return p_slc


def naive_group_scores(
    q, k_cmp, *, cmp_block=32, cmp_stride=16, sel_block=64, scale=None, cu_seqlens=None
):
    """s[b][t][g] = list over candidates j of Σ_{h in group g} p_slc[t, h, j] (float64, no grad)."""
    B, T, HQ, Dk = q.shape
    H = k_cmp.shape[2]
    G = HQ // H
    scale = Dk**-0.5 if scale is None else scale
    q = q.detach().double()
    k_cmp = k_cmp.detach().double()
    out = [[None] * T for _ in range(B)]
    for b, bos, eos, cbos, ceos in sequences(B, T, cu_seqlens, cmp_block, cmp_stride):
        for t in range(eos - bos):
            row = []
            for g in range(H):
                s = [0.0] * (t // sel_block + 1)
                for h in range(g * G, (g + 1) * G):
                    p_slc = _head_block_scores(
                        q[b, bos + t, h],
                        k_cmp[b, cbos:ceos, g],
                        t,
                        ceos - cbos,
                        cmp_block=cmp_block,
                        cmp_stride=cmp_stride,
                        sel_block=sel_block,
                        scale=scale,
                    )
                    s = [a + c for a, c in zip(s, p_slc, strict=True)]
                row.append(s)
            out[b][bos + t] = row
    return out


def naive_select(
    q,
    k_cmp,
    *,
    cmp_block=32,
    cmp_stride=16,
    sel_block=64,
    num_selected=16,
    num_init=1,
    num_local=2,
    scale=None,
    cu_seqlens=None,
):
    """sets[b][t][g]: ascending list of the selected block indices (local to the sequence)."""
    B, T = q.shape[:2]
    scores = naive_group_scores(
        q,
        k_cmp,
        cmp_block=cmp_block,
        cmp_stride=cmp_stride,
        sel_block=sel_block,
        scale=scale,
        cu_seqlens=cu_seqlens,
    )
    sets = [[None] * T for _ in range(B)]
    for b, bos, eos, _, _ in sequences(B, T, cu_seqlens, cmp_block, cmp_stride):
        for t in range(eos - bos):
            sets[b][bos + t] = [
                select_from_scores(
                    s,
                    t,
                    sel_block=sel_block,
                    num_selected=num_selected,
                    num_init=num_init,
                    num_local=num_local,
                )
                for s in scores[b][bos + t]
            ]
    return sets


def sets_to_index(sets, num_selected):
    """Nested sets → LongTensor [B, T, H, n], ascending, padded at the end with -1."""
    B, T, H = len(sets), len(sets[0]), len(sets[0][0])
    idx = torch.full((B, T, H, num_selected), -1, dtype=torch.long)
    for b in range(B):
        for t in range(T):
            for g in range(H):
                blocks = sorted(sets[b][t][g])
                idx[b, t, g, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
    return idx


def index_to_sets(idx):
    """Index tensor [B, T, H, n] (-1 = padding) → nested sets (sorted lists)."""
    idx = idx.tolist()
    return [
        [[sorted(j for j in row if j >= 0) for row in per_t] for per_t in per_b] for per_b in idx
    ]


def _attend(q_th, keys, values, scale):
    """softmax(scale · keys q) · values; zeros when there is no key."""
    if keys.shape[0] == 0:
        return values.new_zeros(values.shape[-1])
    p = torch.softmax(scale * (keys @ q_th), dim=0)
    return p @ values


def naive_attention(
    q,
    k,
    v,
    k_cmp,
    v_cmp,
    gates,
    *,
    k_win=None,
    v_win=None,
    cmp_block=32,
    cmp_stride=16,
    sel_block=64,
    num_selected=16,
    window=512,
    num_init=1,
    num_local=2,
    scale=None,
    cu_seqlens=None,
    selected=None,
):
    """NSA output [B, T, HQ, Dv] in the inputs' dtype; differentiable.

    `selected` overrides the selection: nested sets or an index tensor [B, T, H, n]
    (-1 = padding), e.g. what `nsa.nsa_select` returned, to compare with the same blocks.
    """
    B, T, HQ, Dk = q.shape
    H = k.shape[2]
    G = HQ // H
    scale = Dk**-0.5 if scale is None else scale
    k_win = k if k_win is None else k_win
    v_win = v if v_win is None else v_win
    if selected is None:
        selected = naive_select(
            q,
            k_cmp,
            cmp_block=cmp_block,
            cmp_stride=cmp_stride,
            sel_block=sel_block,
            num_selected=num_selected,
            num_init=num_init,
            num_local=num_local,
            scale=scale,
            cu_seqlens=cu_seqlens,
        )
    elif torch.is_tensor(selected):
        selected = index_to_sets(selected)

    rows = [[None] * T for _ in range(B)]
    for b, bos, eos, cbos, ceos in sequences(B, T, cu_seqlens, cmp_block, cmp_stride):
        for t in range(eos - bos):
            pos = bos + t
            vis = _visible(t, ceos - cbos, cmp_block, cmp_stride)
            win = list(range(max(0, t - window + 1), t + 1))
            heads = []
            for h in range(HQ):
                g = h // G
                q_th = q[b, pos, h]
                cmp_rows = [cbos + i for i in vis]
                o_cmp = _attend(q_th, k_cmp[b, cmp_rows, g], v_cmp[b, cmp_rows, g], scale)
                toks = [
                    s
                    for j in selected[b][pos][g]
                    for s in range(j * sel_block, (j + 1) * sel_block)
                    if s <= t
                ]
                slc_rows = [bos + s for s in toks]
                o_slc = _attend(q_th, k[b, slc_rows, g], v[b, slc_rows, g], scale)
                win_rows = [bos + s for s in win]
                o_win = _attend(q_th, k_win[b, win_rows, g], v_win[b, win_rows, g], scale)
                gt = gates[b, pos, h]
                heads.append(gt[0] * o_cmp + gt[1] * o_slc + gt[2] * o_win)
            rows[b][pos] = torch.stack(heads)
    return torch.stack([torch.stack(r) for r in rows])


def exact_group_scores(weights, t, Tc, *, cmp_block, cmp_stride, sel_block):
    """Exact (Fraction) group scores for known per-head compressed probabilities.

    weights: list over the heads of a group of dicts {i: positive int weight} on compressed
    tokens; p_cmp[h, i] = w_i / Σ w over the visible i in the dict, or uniform over all
    visible tokens when none of them is in the dict. Direct overlap count, exact arithmetic.
    """
    vis = _visible(t, Tc, cmp_block, cmp_stride)
    s = [Fraction(0)] * (t // sel_block + 1)
    if not vis:
        return s
    for w in weights:
        wv = {i: Fraction(w[i]) for i in vis if i in w} or {i: Fraction(1) for i in vis}
        total = sum(wv.values())
        for j in range(len(s)):
            for i, wi in wv.items():
                ov = overlap(
                    i * cmp_stride, i * cmp_stride + cmp_block, j * sel_block, (j + 1) * sel_block
                )
                s[j] += wi / total * Fraction(ov, cmp_block)
    return s
