"""The PyTorch backend of NSA: ``NSA_SPEC.md`` in plain, vectorised PyTorch.

It is the CPU backend and the oracle the kernels are tested against. Queries are processed in
fixed-size chunks; each chunk computes its three branches with boolean masks over the key
range it can see, so no [T, T] tensor is ever built and there is no loop over tokens. Every
chunk runs under activation checkpointing when gradients are needed, so the memory autograd
keeps is linear in T. Selection runs under ``torch.no_grad()``; gradients come from autograd
through the three attentions. Nothing here reads a tensor value on the host.

Layout inside a chunk: query heads are split as [B, H, G, C, D] (H KV heads, G query heads per
group, C queries); keys as [B, H, S, D].
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from nsa.ops.layout import SequenceLayout
from nsa.ops.params import NSAParams

# Largest number of attention scores (B * HQ * C * keys) one chunk may hold.
SCORE_BUDGET = 1 << 25
MIN_CHUNK = 64


def query_chunk_size(batch: int, num_q_heads: int, seq_len: int) -> int:
    per_query = max(1, batch * num_q_heads * seq_len)
    return max(MIN_CHUNK, SCORE_BUDGET // per_query)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision inputs are computed in float32 (scores, softmax and accumulation)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _split_heads(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, C, HQ, D] -> [B, H, G, C, D]"""
    B, C, HQ, D = x.shape
    return x.view(B, C, num_kv_heads, HQ // num_kv_heads, D).permute(0, 2, 3, 1, 4)


def _kv_heads_first(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] -> [B, H, 1, S, D] (broadcasts over the G query heads of a group)"""
    return x.permute(0, 2, 1, 3).unsqueeze(2)


def finite_part(x: torch.Tensor):
    """(x with its non-finite entries replaced by 0, [...] per row of x: 0, or NaN where the
    row holds a non-finite entry).

    A masked (query, key) pair still meets in a matrix product, with a probability or a score
    gradient of 0, and 0 · NaN is NaN: the products take finite parts only, and a non-finite
    row reaches the pairs that see it through the scores instead (``masked_attention``).
    """
    finite = torch.isfinite(x)
    poison = torch.where(finite.all(-1), 0.0, float("nan")).to(x.dtype)
    return torch.where(finite, x, torch.zeros_like(x)), poison


class _MaskedValues(torch.autograd.Function):
    """probs @ v whose backward keeps masked pairs out of dv: a non-finite output gradient of
    one row reaches only the values that row attends to (``mask``), not every value."""

    @staticmethod
    def forward(ctx, probs, v, mask):
        ctx.save_for_backward(probs, v, mask)
        return torch.matmul(probs, v)

    @staticmethod
    def backward(ctx, grad):
        probs, v, mask = ctx.saved_tensors
        # Under autocast the forward's product ran in the autocast dtype, so grad may come in
        # that dtype while probs and v (the same dtype) do not: take it in theirs.
        grad = grad.to(v.dtype)
        finite_grad, poison = finite_part(grad)
        seen = torch.where(mask, probs + poison[..., None], torch.zeros_like(probs))
        dv = torch.matmul(seen.transpose(-1, -2), finite_grad).sum_to_size(v.shape)
        return torch.matmul(grad, v.transpose(-1, -2)), dv, None


def masked_attention(q, k, v, mask, scale):
    """Softmax attention restricted to ``mask``; rows with no visible key give 0.

    q [B, H, G, C, Dk], k [B, H, 1, S, Dk], v [B, H, 1, S, Dv], mask broadcastable to
    [B, H, G, C, S]. Returns (out [B, H, G, C, Dv], probabilities [B, H, G, C, S]), in q's
    dtype. Keys and values may be in a lower precision than q (a decode step's cache): the
    products then run in theirs, scores and softmax in q's.

    Masked pairs take no part: a non-finite query, key or value makes exactly the rows that
    see it NaN (``finite_part``), in the output and in the gradients. The scale multiplies
    score differences from the row maximum, never the scores, so any finite scale gives the
    softmax (scale · q·k may overflow where exp(scale · (q·k - max)) cannot).
    """
    q, q_poison = finite_part(q)
    k, k_poison = finite_part(k)
    v, v_poison = finite_part(v)
    scores = torch.matmul(q.to(k.dtype), k.transpose(-1, -2)).to(q.dtype)
    if scores.shape[-1] == 0:  # no key in range (e.g. no compressed token yet)
        return torch.matmul(scores, v.to(q.dtype)), scores
    scores = scores + q_poison[..., None] + (k_poison + v_poison)[..., None, :]
    scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp((scores - row_max) * scale)
    denom = weights.sum(dim=-1, keepdim=True)
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    probs = weights / denom
    out = _MaskedValues.apply(probs.to(v.dtype), v, mask)
    return out.to(q.dtype), probs


def block_overlap(cmp_idx: torch.Tensor, num_blocks: int, params: NSAParams, dtype) -> torch.Tensor:
    """[Nc, NB]: |[i·d, i·d+l) ∩ [j·l', (j+1)·l')| / l for compressed token i and block j."""
    start = (cmp_idx * params.cmp_stride).unsqueeze(1)  # [Nc, 1]
    end = start + params.cmp_block
    block_start = torch.arange(num_blocks, device=cmp_idx.device).unsqueeze(0) * params.sel_block
    block_end = block_start + params.sel_block
    overlap = (torch.minimum(end, block_end) - torch.maximum(start, block_start)).clamp_min(0)
    return overlap.to(dtype) / params.cmp_block


@torch.no_grad()
def select_blocks(p_cmp, cmp_idx, pos, params: NSAParams, num_blocks: int) -> torch.Tensor:
    """Top-n selection for one chunk of queries.

    p_cmp [B, H, G, C, Nc]: compressed-attention probabilities; cmp_idx [Nc]: index of each
    compressed token within its sequence; pos [C]: query positions within their sequences.
    Returns [B, H, C, min(n, num_blocks)] int64 block indices, ascending, padded at the end
    with -1.
    """
    group_p = p_cmp.sum(dim=2)  # [B, H, C, Nc]
    score = torch.matmul(group_p, block_overlap(cmp_idx, num_blocks, params, group_p.dtype))
    return top_blocks(score, (pos // params.sel_block).unsqueeze(1), params)


@torch.no_grad()
def top_blocks(score: torch.Tensor, current: torch.Tensor, params: NSAParams) -> torch.Tensor:
    """The spec's top-n from block scores [..., NB] of queries whose own block is ``current``
    (broadcastable to score[..., :1]): the forced blocks, then the highest scores, ties to the
    lower index. Returns [..., min(n, NB)] int64, ascending, padded at the end with -1: no
    query has more than NB candidates, so a larger n selects (and allocates) no more."""
    num_blocks = score.shape[-1]
    blocks = torch.arange(num_blocks, device=score.device)  # [NB]
    candidate = blocks <= current
    forced = candidate & ((blocks < params.num_init) | (blocks > current - params.num_local))
    key = torch.where(forced, torch.full_like(score, float("inf")), score)
    key = torch.where(candidate, key, torch.full_like(score, float("-inf")))
    take = min(params.num_selected, num_blocks)
    # A stable descending sort keeps equal scores in index order: ties go to the lower index.
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :take]
    chosen = torch.gather(key, -1, order) > float("-inf")
    order = torch.where(chosen, order, torch.full_like(order, num_blocks))
    order = torch.sort(order, dim=-1).values
    return torch.where(order == num_blocks, torch.full_like(order, -1), order)


def _compressed_branch(q, k_cmp, v_cmp, layout, t0, t1, params, scale):
    """Compressed attention for queries [t0, t1). q [B, H, G, C, Dk].

    Returns (out [B, H, G, C, Dv], probabilities [B, H, G, C, Nc], cmp_idx [Nc]).
    """
    visible_end = 0 if t1 < params.cmp_block else (t1 - params.cmp_block) // params.cmp_stride + 1
    nc = min(k_cmp.shape[1], visible_end)
    cmp_idx = layout.cmp_idx[:nc]
    cmp_last = cmp_idx * params.cmp_stride + params.cmp_block - 1  # last token each one covers
    mask = (layout.cmp_seq[:nc] == layout.seq[t0:t1, None]) & (cmp_last <= layout.pos[t0:t1, None])
    k = _kv_heads_first(k_cmp[:, :nc])
    v = _kv_heads_first(v_cmp[:, :nc])
    out, probs = masked_attention(q, k, v, mask, scale)
    return out, probs, cmp_idx


def _selected_branch(q, k, v, indices, layout, t0, t1, params, scale):
    """Attention of queries [t0, t1) over their selected blocks. indices [B, H, C, <= n]."""
    B, H, C, _ = indices.shape
    num_blocks = (t1 - 1) // params.sel_block + 1
    # Scatter the indices into a [B, H, C, NB] block mask (-1 goes to a spare column).
    picked = torch.where(indices < 0, torch.full_like(indices, num_blocks), indices)
    block_mask = torch.zeros(B, H, C, num_blocks + 1, dtype=torch.bool, device=indices.device)
    block_mask.scatter_(-1, picked, True)
    key_block = (layout.pos[:t1] // params.sel_block).expand(B, H, C, t1)
    key_mask = torch.gather(block_mask, -1, key_block)  # [B, H, C, S]
    queries = torch.arange(t0, t1, device=indices.device)[:, None]
    causal = (layout.seq[:t1] == layout.seq[t0:t1, None]) & (
        torch.arange(t1, device=indices.device) <= queries)
    mask = (key_mask & causal).unsqueeze(2)  # [B, H, 1, C, S]
    out, _ = masked_attention(q, _kv_heads_first(k[:, :t1]), _kv_heads_first(v[:, :t1]), mask,
                              scale)
    return out


def _window_branch(q, k_win, v_win, layout, t0, t1, params, scale):
    """Sliding-window attention of queries [t0, t1) over [t - w + 1, t]."""
    s0 = max(0, t0 - params.window + 1)
    keys = torch.arange(s0, t1, device=q.device)
    queries = torch.arange(t0, t1, device=q.device)[:, None]
    mask = (keys <= queries) & (keys > queries - params.window)
    mask &= layout.seq[s0:t1] == layout.seq[t0:t1, None]
    k = _kv_heads_first(k_win[:, s0:t1])
    v = _kv_heads_first(v_win[:, s0:t1])
    out, _ = masked_attention(q, k, v, mask, scale)
    return out


def _attention_chunk(q, k, v, k_cmp, v_cmp, k_win, v_win, gates, *, layout, t0, t1, params, scale,
                     indices=None):
    """NSA output for queries [t0, t1): q [B, C, HQ, Dk], gates [B, C, HQ, 3] -> [B, C, HQ, Dv].

    ``indices`` [B, C, H, n], when given, replaces the selection (tests compare backends on
    the same blocks this way)."""
    B, C, HQ, _ = q.shape
    H = k.shape[2]
    dtype = _compute_dtype(q.dtype)
    qh = _split_heads(q.to(dtype), H)  # [B, H, G, C, Dk]
    o_cmp, p_cmp, cmp_idx = _compressed_branch(qh, k_cmp, v_cmp, layout, t0, t1, params, scale)
    if indices is None:
        num_blocks = (t1 - 1) // params.sel_block + 1
        indices = select_blocks(p_cmp.detach(), cmp_idx, layout.pos[t0:t1], params, num_blocks)
    else:
        indices = indices.permute(0, 2, 1, 3).long()  # [B, H, C, n]
    o_slc = _selected_branch(qh, k, v, indices, layout, t0, t1, params, scale)
    o_win = _window_branch(qh, k_win, v_win, layout, t0, t1, params, scale)
    g = _split_heads(gates.to(dtype), H)  # [B, H, G, C, 3]
    out = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win  # [B, H, G, C, Dv]
    return out.permute(0, 3, 1, 2, 4).reshape(B, C, HQ, v.shape[-1]).to(q.dtype)


def nsa_attention_torch(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, params: NSAParams,
                        scale: float, cu_seqlens=None, chunk_size: int | None = None,
                        indices=None):
    """PyTorch NSA forward (autograd gives the backward). Inputs already validated.

    ``indices`` [B, T, H, n] optionally fixes the selected blocks instead of selecting them.
    """
    B, T, HQ, _ = q.shape
    dtype = _compute_dtype(q.dtype)
    # Keys and values are cast once, not per chunk.
    k, v, k_cmp, v_cmp, k_win, v_win = (x.to(dtype) for x in (k, v, k_cmp, v_cmp, k_win, v_win))
    layout = SequenceLayout(T, k_cmp.shape[1], cu_seqlens, params, q.device)
    chunk = chunk_size or query_chunk_size(B, HQ, T)
    needs_grad = torch.is_grad_enabled() and any(
        x.requires_grad for x in (q, k, v, k_cmp, v_cmp, k_win, v_win, gates)
    )
    outputs = []
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        run = partial(_attention_chunk, layout=layout, t0=t0, t1=t1, params=params, scale=scale,
                      indices=None if indices is None else indices[:, t0:t1])
        args = (q[:, t0:t1], k, v, k_cmp, v_cmp, k_win, v_win, gates[:, t0:t1])
        outputs.append(checkpoint(run, *args, use_reentrant=False) if needs_grad else run(*args))
    if not outputs:  # T == 0: an empty output that is still part of every input's graph
        inputs = sum(x.sum() for x in (q, k, v, k_cmp, v_cmp, k_win, v_win, gates))
        return q.new_zeros(B, 0, HQ, v.shape[-1]) + 0 * inputs
    return torch.cat(outputs, dim=1)


@torch.no_grad()
def nsa_select_torch(q, k_cmp, params: NSAParams, scale: float, cu_seqlens=None,
                     chunk_size: int | None = None) -> torch.Tensor:
    """Selected block indices [B, T, H, n] (int64, ascending, -1 padded): the spec's shape,
    whose columns past a query's candidates are padding only."""
    B, T, HQ, _ = q.shape
    H = k_cmp.shape[2]
    dtype = _compute_dtype(q.dtype)
    k_cmp = k_cmp.to(dtype)
    layout = SequenceLayout(T, k_cmp.shape[1], cu_seqlens, params, q.device)
    chunk = chunk_size or query_chunk_size(B, HQ, T)
    no_values = k_cmp[..., :0]
    out = torch.full((B, T, H, params.num_selected), -1, dtype=torch.long, device=q.device)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        qh = _split_heads(q[:, t0:t1].to(dtype), H)
        _, p_cmp, cmp_idx = _compressed_branch(qh, k_cmp, no_values, layout, t0, t1, params, scale)
        num_blocks = (t1 - 1) // params.sel_block + 1
        indices = select_blocks(p_cmp, cmp_idx, layout.pos[t0:t1], params, num_blocks)
        out[:, t0:t1, :, :indices.shape[-1]] = indices.permute(0, 2, 1, 3)  # [B, C, H, <= n]
    return out
