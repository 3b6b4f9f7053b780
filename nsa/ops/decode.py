"""One decode step of NSA attention: a new query per sequence against a KV cache.

For the token at position ``pos[b]`` of sequence b (the cache holds its positions 0 … pos[b],
the new token's keys included), the output equals the prefill output at that position
(``NSA_SPEC.md``, "Decoding"). Shapes are static (cache capacities, not lengths), nothing reads
a tensor value on the host, so a step can be captured in a CUDA graph. The masks make the step
attend to exactly the tokens the spec counts: the visible compressed tokens, the selected
blocks' tokens up to ``pos`` and the last ``min(w, pos + 1)`` tokens.
"""

from __future__ import annotations

import torch

from nsa.ops.attention import _resolve_backend, _scale
from nsa.ops.params import NSAParams, compressed_lengths
from nsa.ops.torch_backend import _compute_dtype, masked_attention, top_blocks


def visible_compressed(pos: torch.Tensor, params: NSAParams) -> torch.Tensor:
    """[B] number of compressed tokens a query at ``pos`` sees: those with i·d + l - 1 <= pos,
    i.e. the compressed length of its first pos + 1 tokens."""
    return compressed_lengths(pos + 1, params.cmp_block, params.cmp_stride)


def window_ring_positions(pos: torch.Tensor, window: int) -> torch.Tensor:
    """[B, W]: the position slot j of a ring buffer (slot = position % W) holds once ``pos``
    has been written: the latest p <= pos with p ≡ j (mod W); negative where none yet."""
    j = torch.arange(window, device=pos.device)
    return pos[:, None] - (pos[:, None] - j) % window


def nsa_decode(q, k, v, k_cmp, v_cmp, gates, pos, params: NSAParams, scale=None, *,
               k_win=None, v_win=None, window_ring=False, backend="auto",
               return_tokens_read=False):
    """NSA attention of one new query per sequence.

    Args:
        q: [B, HQ, Dk] queries of the new tokens (RoPE applied).
        k, v: [B, S, H, Dk/Dv] raw keys/values of positions 0 … pos (capacity S).
        k_cmp, v_cmp: [B, C, H, Dk/Dv] compressed tokens (capacity C; those past the visible
            count are ignored).
        gates: [B, HQ, 3] activated gates.
        pos: [B] int64 position of the new token of each sequence.
        k_win, v_win: the window branch's keys/values, default ``k``, ``v``: [B, S, H, D] by
            position, or with ``window_ring`` a ring [B, w, H, D] holding position p at p % w.
        backend: "auto" (the fused Triton step, nsa/ops/triton/decode.py, for CUDA tensors),
            "torch" (the PyTorch step) or "triton".
        return_tokens_read: (PyTorch backend) also return what the step attended to.

    Returns:
        [B, HQ, Dv] in the dtype of ``q``; with ``return_tokens_read`` also [B, H] int64: the
        cached tokens the step attended to per KV head (compressed + selected + window).
    """
    scale = _scale(scale, q.shape[-1], q.dtype)
    # Past the cache's capacity, n, l' and l change nothing but what the step allocates.
    params = params.within(k.shape[1])
    if _resolve_backend(backend, q, params) == "triton":
        if return_tokens_read:
            raise ValueError("return_tokens_read needs backend='torch'")
        return nsa_decode_triton(q, k, v, k_cmp, v_cmp, gates, pos, params, scale, k_win=k_win,
                                 v_win=v_win, window_ring=window_ring)
    B, HQ, Dk = q.shape
    S, H = k.shape[1], k.shape[2]
    G = HQ // H
    dtype = _compute_dtype(q.dtype)
    # The G query heads of a KV head are the rows of one [G, S] score matrix per (b, h):
    # the attention's query dim holds them, so keys are never broadcast over G.
    qh = q.to(dtype).view(B, H, 1, G, Dk)  # [B, H, 1, G, Dk]

    def heads_first(x):  # [B, N, H, D] -> [B, H, 1, N, D]
        return x.permute(0, 2, 1, 3).unsqueeze(2)

    # Compressed branch (its probabilities score the blocks).
    C = k_cmp.shape[1]
    cmp_mask = (torch.arange(C, device=q.device) < visible_compressed(pos, params)[:, None])
    o_cmp, p_cmp = masked_attention(qh, heads_first(k_cmp), heads_first(v_cmp),
                                    cmp_mask.view(B, 1, 1, 1, C), scale)
    blocks = select_from_probs(p_cmp.view(B, H, G, C).sum(2), pos, S, params)  # [B, H, n]
    offsets = torch.arange(params.sel_block, device=q.device)
    key_pos = (blocks[..., None] * params.sel_block + offsets).flatten(2)  # [B, H, n·l']
    slc_mask = (blocks[..., None] >= 0).expand(-1, -1, -1, params.sel_block).flatten(2)
    slc_mask = slc_mask & (key_pos <= pos[:, None, None])
    index = key_pos.clamp(0, S - 1)
    k_slc = torch.gather(k.permute(0, 2, 1, 3), 2, index[..., None].expand(-1, -1, -1, Dk))
    v_slc = torch.gather(v.permute(0, 2, 1, 3), 2,
                         index[..., None].expand(-1, -1, -1, v.shape[-1]))
    o_slc, _ = masked_attention(qh, k_slc.unsqueeze(2), v_slc.unsqueeze(2),
                                slc_mask[:, :, None, None, :], scale)

    # Window branch: from a ring buffer, or the last w positions of a positional buffer.
    if window_ring:
        win_pos = window_ring_positions(pos, k_win.shape[1])  # [B, w]
        win_mask = win_pos >= 0
        k_w, v_w = heads_first(k_win), heads_first(v_win)
    else:
        k_win = k if k_win is None else k_win
        v_win = v if v_win is None else v_win
        win_pos = pos[:, None] - torch.arange(min(params.window, S), device=q.device)  # [B, W]
        win_mask = win_pos >= 0
        index = win_pos.clamp_min(0)[:, :, None, None]
        k_w = heads_first(torch.gather(k_win, 1, index.expand(-1, -1, H, Dk)))
        v_w = heads_first(torch.gather(v_win, 1, index.expand(-1, -1, H, v_win.shape[-1])))
    o_win, _ = masked_attention(qh, k_w, v_w, win_mask[:, None, None, None, :], scale)

    g = gates.to(dtype).view(B, H, 1, G, 3)
    out = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win  # [B, H, 1, G, Dv]
    out = out.reshape(B, HQ, -1).to(q.dtype)
    if not return_tokens_read:
        return out
    read = (cmp_mask.sum(-1)[:, None] + slc_mask.sum(-1) + win_mask.sum(-1)[:, None])
    return out, read


def block_scores_from(p: torch.Tensor, num_blocks: int, params: NSAParams) -> torch.Tensor:
    """Group block scores [B, H, NB] from compressed probabilities p [B, H, C] (spec):
    score_j = Σ_i p_i · |[i·d, i·d + l) ∩ [j·l', (j+1)·l')| / l. Every block sees the same
    pattern of R + K - 1 tokens (R = l'/d per block, K = l/d per token): a strided window sum."""
    d, l, ls = params.cmp_stride, params.cmp_block, params.sel_block
    R, K = ls // d, l // d
    offset = (torch.arange(R + K - 1, device=p.device) - (K - 1)) * d  # token start - block start
    weight = ((torch.minimum(offset + l, torch.full_like(offset, ls)) - offset.clamp_min(0))
              .clamp_min(0).to(p.dtype) / l)  # [R + K - 1]
    need = num_blocks * R + K - 1  # tokens the windows span, with K - 1 zeros in front
    padded = torch.nn.functional.pad(p, (K - 1, max(0, need - (K - 1) - p.shape[-1])))
    windows = padded[..., :need].unfold(-1, R + K - 1, R)  # [B, H, NB, R + K - 1]
    return windows @ weight


def select_from_probs(p: torch.Tensor, pos: torch.Tensor, capacity: int,
                      params: NSAParams) -> torch.Tensor:
    """[B, H, n] selected blocks of queries at ``pos`` [B] from their group's compressed
    probabilities p [B, H, C], for a cache of ``capacity`` positions."""
    scores = block_scores_from(p, -(-capacity // params.sel_block), params)  # [B, H, NB]
    return top_blocks(scores, (pos // params.sel_block)[:, None, None], params)


def nsa_decode_triton(q, k, v, k_cmp, v_cmp, gates, pos, params: NSAParams, scale: float, *,
                      k_win=None, v_win=None, window_ring=False):
    """:func:`nsa_decode` with the Triton kernels of ``nsa.ops.triton.decode`` (CUDA tensors,
    or the Triton interpreter): three launches, no host sync. The scale and parameters as
    :func:`nsa_decode` passes them (validated, ``within`` the cache)."""
    from nsa.ops.triton.decode import decode_forward

    k_win = k if k_win is None else k_win
    v_win = v if v_win is None else v_win
    cache = (k, v, k_cmp, v_cmp, k_win, v_win)
    if len({x.dtype for x in cache}) > 1:
        raise ValueError("k, v, k_cmp, v_cmp, k_win and v_win must share one dtype, got "
                         f"{[str(x.dtype) for x in cache]}")
    # Products in the cache's dtype (as the PyTorch path): a query from bf16 autocast meets a
    # float32 cache, or the reverse. The output keeps the query's dtype.
    q_cache, k, v, k_cmp, v_cmp, k_win, v_win, gates, pos = (
        x.contiguous() for x in (q.to(k.dtype), *cache, gates, pos))
    return decode_forward(q_cache, k, v, k_cmp, v_cmp, gates, k_win, v_win, pos, params, scale,
                          window_ring, out_dtype=q.dtype)


def tokens_read(pos: torch.Tensor, params: NSAParams) -> torch.Tensor:
    """[B] tokens one decode step reads per KV head (spec): visible compressed tokens + the
    selected blocks' tokens up to ``pos`` + min(w, pos + 1)."""
    current = pos // params.sel_block
    candidates = current + 1
    selected = torch.minimum(candidates, torch.full_like(pos, params.num_selected))
    # The current block (always selected: num_local >= 1) holds pos % l' + 1 tokens so far.
    if params.num_local >= 1:
        selected_tokens = (selected - 1) * params.sel_block + pos % params.sel_block + 1
    else:
        raise ValueError("tokens_read assumes num_local >= 1 (the current block is selected)")
    window = torch.minimum(pos + 1, torch.full_like(pos, params.window))
    return visible_compressed(pos, params) + selected_tokens + window
