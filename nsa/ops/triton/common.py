"""Pieces shared by the NSA Triton kernels: the matrix product, one online-softmax step, the
backward's recomputed probabilities, and the split of a loop into full and partial tiles.

Units of the scores. With s = scale · log2(e), a score is kept as q·k · min(s, 1) and
exponentiated as exp2(max(s, 1) · (score - max)): for s <= 1 that is the usual s · q·k and
exp2(score - max); for s > 1 the scale only multiplies differences from the row maximum, which
are <= 0, so no finite scale overflows (q·k · s would, past float32's range, while the softmax
is still defined). Log-sum-exps are in the same units: max + log2(sum) / max(s, 1).

Masks. A masked (query, key) pair still meets in the tile products, with a probability or a
score gradient of 0, and 0 · NaN is NaN: a NaN key or value after a query's position (or in
another packed sequence) would reach it through a tile both share. Only partial tiles hold a
masked pair of an in-range row and key (the diagonal, the window's lower edge, sequence
boundaries, the ragged end of a range; padding rows and keys load as 0, and what they meet is
never stored or already NaN). Each loop is split (``split_tiles``): its partial tiles first,
which multiply only the ``finite_part`` of what masked pairs meet and keep dS only where
``valid``, then its full tiles with the plain products (every pair valid). A partial tile
gives each valid pair what a full tile gives it, with NaN for any non-finite input: a row
that sees a non-finite value gets a NaN output, a row with a non-finite output gradient a NaN
log-sum-exp in dK/dV (so a NaN p on the pairs it sees). As in the PyTorch backend, a
non-finite input reaches only the outputs and gradients of pairs that see it, and always the
output and dq of a row that sees it; unlike there, the dV of the other keys such a row sees
may stay finite (the PyTorch backend makes the whole softmax row NaN). Taking every tile
through the masks cost 42 ms of a 182 ms forward+backward at 64k; partial tiles are about 7%
of the tiles there (bench/NOTES.md, v5).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b in float32; exact float32 products for float32 inputs (no tf32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


SQRT_HALF = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def gelu(x):
    """GELU(x) = x Φ(x) (the exact form, nn.GELU's default), float32: the compressor MLP's."""
    return 0.5 * x * (1.0 + tl.erf(x * SQRT_HALF))


@triton.jit
def gelu_grad(x):
    """d GELU / dx = Φ(x) + x φ(x), float32."""
    return 0.5 * (1.0 + tl.erf(x * SQRT_HALF)) + x * INV_SQRT_2PI * tl.exp(-0.5 * x * x)


@triton.jit
def longest_first():
    """(tile, pid) of this program in a grid (tiles, B·H or, with ``query_tile_rows``' head
    subsets, B·H·subsets) whose tiles' work grows with the tile's index (query tiles of a
    causal range). Programs start in the order of their linear id (axis 0 fastest); that id
    is mapped to every axis-1 index's last tile, then every one's second-to-last, and so on,
    so the programs that start last are the shortest and the SMs finish together (a
    longest-first list schedule; bench/NOTES.md, v35)."""
    num_tiles = tl.num_programs(0)
    num_pids = tl.num_programs(1)
    linear = tl.program_id(1) * num_tiles + tl.program_id(0)
    return num_tiles - 1 - linear // num_pids, linear % num_pids


@triton.jit
def query_tile_rows(tile, pid, T, H, G: tl.constexpr, BLOCK_R: tl.constexpr,
                    TILE_G: tl.constexpr):
    """The rows of query tile ``tile`` of program ``pid`` = (batch row · H + KV head h) ·
    (G // TILE_G) + s: P = BLOCK_R // TILE_G positions from t_first x the query heads s ·
    TILE_G, ... of KV head h (``launch.tile_heads``) -> (b, h, query heads hq, row mask, t
    (int64), t_first, t_last)."""
    P: tl.constexpr = BLOCK_R // TILE_G
    pid_bh = group_program(pid, G, TILE_G)
    h = pid_bh % H
    r = tl.arange(0, BLOCK_R)
    t_first = tile * P
    t = t_first + r // TILE_G
    row_ok = (r < P * TILE_G) & (t < T)
    t_last = tl.minimum(t_first + P, T) - 1
    hq = h * G + (pid % (G // TILE_G)) * TILE_G + r % TILE_G
    return (pid_bh // H).to(tl.int64), h, hq, row_ok, t.to(tl.int64), t_first, t_last


@triton.jit
def group_program(pid, G: tl.constexpr, TILE_G: tl.constexpr):
    """The (batch row · H + KV head) of program ``pid`` of ``query_tile_rows``."""
    return pid // (G // TILE_G)


@triton.jit
def score_scale(scale_log2):
    """What q·k is multiplied by: min(s, 1) (see the module docstring)."""
    return tl.minimum(scale_log2, 1.0)


@triton.jit
def exp_scale(scale_log2, SMALL_SCALE: tl.constexpr = False):
    """What score differences are multiplied by before exp2: max(s, 1); 1 with SMALL_SCALE
    (the launch's s <= 1, ``launch.small_scale``)."""
    if SMALL_SCALE:  # one return (Triton compiles the statements after a return in an if)
        factor = 1.0
    else:
        factor = tl.maximum(scale_log2, 1.0)
    return factor


@triton.jit
def compressed_count(length, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr):
    """Compressed tokens of a sequence of ``length`` tokens (NSA_SPEC.md: Tc); a query at
    position p sees the first compressed_count(p + 1)."""
    return tl.where(length >= CMP_BLOCK, (length - CMP_BLOCK) // CMP_STRIDE + 1, 0)


@triton.jit
def masked_products(q, k, valid, IEEE: tl.constexpr, MASKED: tl.constexpr = True):
    """q·k [rows, keys], unscaled; -inf where not ``valid`` (all valid unless MASKED)."""
    qk = dot(q, tl.trans(k), IEEE)
    if MASKED:
        qk = tl.where(valid, qk, float("-inf"))
    return qk


@triton.jit
def max_score(qk, scale_log2):
    """Per row, the largest score (units above) of products qk [rows, keys]."""
    return tl.max(qk, axis=1) * score_scale(scale_log2)


@triton.jit
def per_row(x, TRANSPOSED: tl.constexpr = False):
    """A per-row vector x broadcast along a tile's keys: [rows, 1], or [1, rows] for a
    TRANSPOSED tile [keys, rows]."""
    if TRANSPOSED:  # one return (Triton compiles the statements after a return in an if)
        broadcast = x[None, :]
    else:
        broadcast = x[:, None]
    return broadcast


@triton.jit
def exp_from(qk, ref, scale_log2, TRANSPOSED: tl.constexpr = False,
             SMALL_SCALE: tl.constexpr = False):
    """exp2 of (score - ref) in the units above, for products qk [rows, keys] (TRANSPOSED:
    [keys, rows]) and per-row ref (a score): one fused multiply-add and one multiply per pair,
    the multiply left out with SMALL_SCALE (s <= 1: it would be by 1)."""
    exponent = tl.fma(qk, score_scale(scale_log2), -per_row(ref, TRANSPOSED))
    if not SMALL_SCALE:
        exponent = exponent * exp_scale(scale_log2)
    return tl.exp2(exponent)


@triton.jit
def finite_part(x):
    """(x with its non-finite entries 0, per row of x: 0, or NaN where the row held one)."""
    finite = tl.abs(x) < float("inf")
    poison = tl.sum(tl.where(finite, 0.0, float("nan")), axis=1)
    return tl.where(finite, x, 0.0).to(x.dtype), poison


@triton.jit
def all_finite(x, axis: tl.constexpr = None):
    """1 when every entry of the tile x (or of each slice along ``axis``) is finite, else 0."""
    return tl.min((tl.abs(x) < float("inf")).to(tl.int32), axis=axis)


@triton.jit
def split_tiles(lo, hi, seen_lo, seen_hi, STEP: tl.constexpr):
    """Split the tiles lo, lo + STEP, ... (those starting below hi) into full ones, inside
    [seen_lo, seen_hi) (every pair valid), and partial ones -> (full_lo, full_hi, num_partial):
    the full tiles start at full_lo, full_lo + STEP, ... below full_hi; ``partial_tile`` gives
    the start of each of the num_partial others."""
    hi = tl.maximum(hi, lo)
    first = tl.minimum(tl.maximum(seen_lo, lo), hi)
    end = tl.minimum(tl.maximum(seen_hi, lo), hi)
    full_lo = lo + (first - lo + STEP - 1) // STEP * STEP
    full_hi = tl.maximum(full_lo, lo + (end - lo) // STEP * STEP)
    return full_lo, full_hi, (hi - lo + STEP - 1) // STEP - (full_hi - full_lo) // STEP


@triton.jit
def partial_tile(i, lo, full_lo, full_hi, STEP: tl.constexpr):
    """Start of the i-th partial tile of ``split_tiles``: those below the full ones, then
    those above."""
    below = (full_lo - lo) // STEP
    return tl.where(i < below, lo + i * STEP, full_hi + (i - below) * STEP)


@triton.jit
def softmax_step(qk, m, l, acc, v, scale_log2, IEEE: tl.constexpr,
                 SMALL_SCALE: tl.constexpr = False):
    """Fold a tile of products q·k (-inf where masked) and its values into (m, l, acc)."""
    m_new = tl.maximum(m, max_score(qk, scale_log2))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m - m_safe) * exp_scale(scale_log2, SMALL_SCALE))
    p = exp_from(qk, m_safe, scale_log2, SMALL_SCALE=SMALL_SCALE)
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return m_new, l, acc


@triton.jit
def attend_tile(q, k, v, valid, m, l, acc, scale_log2, IEEE: tl.constexpr,
                PARTIAL: tl.constexpr, MASKED: tl.constexpr = True,
                SMALL_SCALE: tl.constexpr = False):
    """Fold a tile of keys and values into the online softmax (m, l, acc) of the rows q. A
    PARTIAL tile multiplies the finite part of v, then adds NaN to the rows that see a
    non-finite value (in a full tile p · v makes them non-finite; m and l stay as there).
    Without MASKED every pair counts (a full tile; its padding rows are never stored)."""
    qk = masked_products(q, k, valid, IEEE, MASKED)
    if PARTIAL:
        v, v_poison = finite_part(v)
        m, l, acc = softmax_step(qk, m, l, acc, v, scale_log2, IEEE, SMALL_SCALE)
        return m, l, acc + tl.sum(tl.where(valid, v_poison[None, :], 0.0), axis=1)[:, None]
    return softmax_step(qk, m, l, acc, v, scale_log2, IEEE, SMALL_SCALE)


@triton.jit
def softmax_finish(m, l, acc, scale_log2):
    """(output, log-sum-exp); rows that saw no key give 0 and +inf."""
    has_keys = l > 0
    safe_l = tl.where(has_keys, l, 1.0)
    lse = m + tl.log2(safe_l) / exp_scale(scale_log2)
    return acc / safe_l[:, None], tl.where(has_keys, lse, float("inf"))


@triton.jit
def store_rows(o_rows, lse_rows, m, l, acc, row_ok, scale_log2, DV: tl.constexpr,
               BLOCK_DV: tl.constexpr):
    """Finish the online softmax; store each row's output (at ``o_rows``) and log-sum-exp ->
    the output (float32, in registers)."""
    out, lse = softmax_finish(m, l, acc, scale_log2)
    store_tile(o_rows, out, row_ok, DV, BLOCK_DV)
    tl.store(lse_rows, lse, mask=row_ok)
    return out


@triton.jit
def probs_and_dscores(q, k, v, do, lse, delta, valid, scale_log2, IEEE: tl.constexpr,
                      PARTIAL: tl.constexpr = False, MASKED: tl.constexpr = True, gate=None,
                      MASK_DS: tl.constexpr = False, TRANSPOSED: tl.constexpr = False,
                      SMALL_SCALE: tl.constexpr = False):
    """Backward of one tile: recomputed probabilities p and dS = p (dP - delta), [rows, keys],
    or p^T and dS^T [keys, rows] when TRANSPOSED (from k q^T and v do^T; ``valid`` in the same
    layout); in a PARTIAL tile, or with MASK_DS, dS is 0 where not ``valid``, whatever v, do
    and delta hold there. Without MASKED every pair counts (a full tile; padding rows have
    lse = +inf, so p = 0 there). With a ``gate`` per row, p and so dS are multiplied by it (a
    non-finite gate makes its row's p non-finite)."""
    if TRANSPOSED:
        qk = dot(k, tl.trans(q), IEEE)
        dp = dot(v, tl.trans(do), IEEE)
    else:
        qk = dot(q, tl.trans(k), IEEE)
        dp = dot(do, tl.trans(v), IEEE)
    # p <= 1 in exact arithmetic; a product recomputed an ulp above the forward's, times a
    # huge scale, would make it inf (NaN stays NaN). With SMALL_SCALE it stays within ulps
    # of 1.
    p = exp_from(qk, lse, scale_log2, TRANSPOSED, SMALL_SCALE)
    if not SMALL_SCALE:
        p = tl.minimum(p, 1.0, propagate_nan=tl.PropagateNan.ALL)
    if MASKED:
        p = tl.where(valid, p, 0.0)
    if gate is not None:
        p *= per_row(gate, TRANSPOSED)
    ds = p * (dp - per_row(delta, TRANSPOSED))
    if PARTIAL or MASK_DS:
        ds = tl.where(valid, ds, 0.0)
    return p, ds


@triton.jit
def dq_tile(q, k, v, do, lse, delta, valid, acc, scale_log2, IEEE: tl.constexpr,
            PARTIAL: tl.constexpr, MASKED: tl.constexpr = True, MASK_DS: tl.constexpr = False,
            SMALL_SCALE: tl.constexpr = False, gate=None):
    """acc [rows, DK] += dS k over a tile of keys; a PARTIAL tile multiplies k's finite part
    (a non-finite key already makes the dS of the pairs that see it NaN). MASK_DS: dS is 0
    where not ``valid`` (a masked tile whose keys and values are known finite, but whose rows'
    do and delta may not be: a row that sees no key gets no gradient). With a ``gate`` per
    row, dS is multiplied by it (one accumulator for two branches of different gates)."""
    p, ds = probs_and_dscores(q, k, v, do, lse, delta, valid, scale_log2, IEEE, PARTIAL,
                              MASKED, gate, MASK_DS=MASK_DS, SMALL_SCALE=SMALL_SCALE)
    if PARTIAL:
        k, _ = finite_part(k)
    return acc + dot(ds.to(k.dtype), k, IEEE)


@triton.jit
def dkdv_tile(q, k, v, do, gate, lse, delta, valid, acc_k, acc_v, scale_log2,
              IEEE: tl.constexpr, PARTIAL: tl.constexpr, MASKED: tl.constexpr = True,
              MASK_DS: tl.constexpr = False, TRANSPOSED: tl.constexpr = False,
              SMALL_SCALE: tl.constexpr = False):
    """acc_k [keys, DK] += dS^T q, acc_v [keys, DV] += p^T do over a tile of query rows whose
    output gradients are gate · do (p and dS are multiplied by each row's gate, float32). A
    PARTIAL tile multiplies the finite parts of q, do and the gates; a row whose do or gate is
    not finite poisons its log-sum-exp, so its p (and dS) are NaN exactly on the pairs it
    sees. MASK_DS: dS is 0 where not ``valid`` (a masked tile whose q, do and gates are known
    finite, but whose rows' delta may not be). TRANSPOSED: p^T and dS^T are computed as such
    (``valid`` [keys, rows]) and enter the products as the tensor cores gave them, with no
    transpose through shared memory (a launch choice: launch.launch_transposed)."""
    acc_k, acc_v, _ = dkdv_dq_tile(q, k, v, do, gate, lse, delta, valid, acc_k, acc_v,
                                   scale_log2, IEEE, PARTIAL, MASKED, MASK_DS, TRANSPOSED,
                                   SMALL_SCALE)
    return acc_k, acc_v


@triton.jit
def dkdv_dq_tile(q, k, v, do, gate, lse, delta, valid, acc_k, acc_v, scale_log2,
                 IEEE: tl.constexpr, PARTIAL: tl.constexpr, MASKED: tl.constexpr = True,
                 MASK_DS: tl.constexpr = False, TRANSPOSED: tl.constexpr = False,
                 SMALL_SCALE: tl.constexpr = False):
    """``dkdv_tile``, also returning the tile's dS [rows, keys] (gated), whose product with
    the keys is the rows' dq through them (unused, it costs nothing)."""
    q_mult = q
    do_mult = do
    gate_mult = gate
    if PARTIAL:
        q_mult, _ = finite_part(q)
        do_mult, do_poison = finite_part(do)
        gate_ok = tl.abs(gate) < float("inf")
        gate_mult = tl.where(gate_ok, gate, 0.0)
        lse = lse + do_poison + tl.where(gate_ok, 0.0, float("nan"))
    p, ds = probs_and_dscores(q, k, v, do, lse, delta, valid, scale_log2, IEEE, PARTIAL,
                              MASKED, gate_mult, MASK_DS, TRANSPOSED, SMALL_SCALE)
    if TRANSPOSED:
        ds_rows = tl.trans(ds)
    else:
        ds_rows = ds
        p = tl.trans(p)
        ds = tl.trans(ds)
    acc_v += dot(p.to(do.dtype), do_mult, IEEE)
    acc_k += dot(ds.to(q.dtype), q_mult, IEEE)
    return acc_k, acc_v, ds_rows


@triton.jit
def load_tile(row_ptrs, row_ok, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """[rows, BLOCK_D] from ``row_ptrs`` (one pointer per row start); 0 where masked."""
    d = tl.arange(0, BLOCK_D)
    return tl.load(row_ptrs[:, None] + d[None, :], mask=row_ok[:, None] & (d[None, :] < D),
                   other=0.0)


@triton.jit
def query_rows_tile(Q, DO, GATE, LSE, DELTA, b, t64, hq, row_ok, stride_qb, stride_qt, stride_qh,
                    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, DK: tl.constexpr,
                    DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """What a backward kernel reads of its query rows (positions t64 x query heads hq of batch
    b): q, do, gate, lse, delta (padding rows: zeros, an lse of +inf)."""
    lse_rows = b * stride_lb + t64 * stride_lt + hq
    q = load_tile(Q + b * stride_qb + t64 * stride_qt + hq * stride_qh, row_ok, DK, BLOCK_DK)
    do = load_tile(DO + b * stride_ob + t64 * stride_ot + hq * stride_oh, row_ok, DV, BLOCK_DV)
    gate = tl.load(GATE + lse_rows, mask=row_ok, other=0.0)
    lse = tl.load(LSE + lse_rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + lse_rows, mask=row_ok, other=0.0)
    return q, do, gate, lse, delta


@triton.jit
def key_value_tile(K, V, KD, VD, b, h, start, key_end, stride_kb, stride_kt, stride_kh,
                   stride_vb, stride_vt, stride_vh, DK: tl.constexpr, DV: tl.constexpr,
                   BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                   TMA: tl.constexpr):
    """Keys, values [BLOCK_N, D] of KV head h from ``start``, 0 from ``key_end`` on. With TMA
    one tensor-descriptor load each (KD, VD: [B, NK, H, D] descriptors of BLOCK_N keys, zeros
    only past NK: for tiles that end at or before key_end); else pointer loads from K and V."""
    if TMA:
        where = [b.to(tl.int32), start, h, 0]
        return (KD.load(where).reshape(BLOCK_N, BLOCK_DK),
                VD.load(where).reshape(BLOCK_N, BLOCK_DV))
    s = start + tl.arange(0, BLOCK_N)
    s64 = s.to(tl.int64)
    k_ok = s < key_end
    k = load_tile(K + b * stride_kb + s64 * stride_kt + h * stride_kh, k_ok, DK, BLOCK_DK)
    v = load_tile(V + b * stride_vb + s64 * stride_vt + h * stride_vh, k_ok, DV, BLOCK_DV)
    return k, v


@triton.jit
def store_tile(row_ptrs, value, row_ok, D: tl.constexpr, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    tl.store(row_ptrs[:, None] + d[None, :], value, mask=row_ok[:, None] & (d[None, :] < D))


@triton.jit
def accumulate_tile(in_rows, out_rows, value, row_ok, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    ACCUMULATE: tl.constexpr):
    """Stores value, plus the tile at ``in_rows`` when ACCUMULATE, at ``out_rows`` in their
    dtype (the one program that owns these rows reads and writes them)."""
    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d[None, :] < D)
    if ACCUMULATE:
        value += tl.load(in_rows[:, None] + d[None, :], mask=mask, other=0.0)
    tl.store(out_rows[:, None] + d[None, :], value.to(out_rows.dtype.element_ty), mask=mask)
