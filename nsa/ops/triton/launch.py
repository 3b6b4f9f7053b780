"""Launch shapes shared by the Triton branch modules: tile rows, warps and pipelining stages
per kernel family (measured choices: bench/NOTES.md), and small helpers of the launchers."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake
from triton.tools.tensor_descriptor import TensorDescriptor

from nsa.ops.params import LOG2E

# Launch shapes per kernel family: rows (position x head pairs) per tile and warps. Rows grow
# to the next power of two >= G when a group is larger. Measured choices: see bench/NOTES.md.
TUNING = {
    # The compressed (cmp) and window (win) branches: compressed_window.py.
    # keys: per step of the forward and dq, per program of dK/dV (bench/NOTES.md, v25: 128
    # in the compressed dq, and the compressed dK/dV at 64 rows and 4 warps, were 3-14 %
    # faster from 16k to 64k at G = 1-16, D = 128; every other 128 or 32 was slower).
    "cmp_fwd": dict(rows=128, num_warps=4, num_stages=2, keys=64),
    "win_fwd": dict(rows=128, num_warps=4, num_stages=2, keys=64),
    # cw_dq: the compressed and window dq in one kernel; keys: the compressed branch's per
    # step, win_keys: the window's. v25's 128 compressed keys (3-14 % faster from 16k to 64k
    # at D = 128 in the compressed dq alone) spill in the fused kernel (offline sm_90: 96 B
    # of stack; 64: 255 registers, none; bench/NOTES.md, thirty-eighth session).
    "cw_dq": dict(rows=128, num_warps=8, num_stages=2, keys=64, win_keys=64),
    # transposed_min_group: groups of at least this many heads, a power of two, compute p^T
    # and dS^T as [keys, rows] (common.dkdv_tile). v27, the kernels no longer serialized by
    # ptxas (compressed_window.py): the window dK/dV at 64 rows / 4 warps 10-14 % faster than
    # at 128 / 8 from 8k to 64k at G = 4-16 transposed, 24 % at G = 1 not; the compressed
    # dK/dV transposed level at 64k, 7 % slower at G = 4 and 1.5x at 8k.
    "cmp_dkdv": dict(rows=64, num_warps=4, num_stages=2, keys=64, transposed_min_group=None),
    "win_dkdv": dict(rows=64, num_warps=4, num_stages=2, keys=64, transposed_min_group=4),
    # select: rows = positions of a tile (its G heads are looped), tokens = compressed tokens
    # per step; num_stages: the head loop's, for groups of at least staged_group heads
    # (smaller groups lost more to the pipeline's prologue than it hid); step_stages: the step
    # loop's for one-head groups (Triton pipelines innermost loops only: at G = 1 no head
    # loop is left inside it; 2 against 1: 32k 0.468 -> 0.428 ms, 64k 1.67 -> 1.52, 3 and 256
    # tokens slower; bench/NOTES.md, v35).
    "select": dict(rows=64, num_warps=4, num_stages=3, tokens=128, staged_group=16,
                   step_stages=2),
    # One program per position: its rows are the G heads of the position (BLOCK_G), not tuned;
    # warps for head dim 128 (selected.py halves them for smaller heads).
    "selected_fwd": dict(num_warps=1, num_stages=2),
    # The forward with two positions a program (selected.position_pairs) for groups of at most
    # max_group heads (at most 8: both positions' heads in the 16 rows one position's take).
    # At m7c 16k (head dim 64: one warp) 0.699 ms, 3 stages 0.668 alone but level in the step
    # (59.1 / 58.9 ms against 59.0 / 59.1), two warps 0.836 at best (its step 1.8 ms slower
    # than one warp's; bench/NOTES.md, fifty-seventh session).
    "selected_pair_fwd": dict(num_warps=1, num_stages=2, max_group=8),
    "selected_dq": dict(num_warps=2, num_stages=2),
    # The per-block selected kernels (selected_blocks.py): one stage was 13-52 % faster than
    # two at 8k G = 16, 32k G = 1 and 4, with dq 2.1-2.3x (bench/NOTES.md, thirtieth session).
    # segment: most entries (positions) of a block's list one program takes, for the groups
    # whose forward runs per position. dq_max_group: the dq also runs per block (in this
    # kernel) up to this group size where the forward runs per position; 8 against 4 took the
    # op's forward+backward at m7c 16k (G = 6) 3.85 -> 3.71 ms and at 32k G = 8 33.9 -> 28.9
    # (bench/NOTES.md, thirty-third session). Its partials, Dk elements of q's dtype per query
    # row and slot, are n times dq's size while a layer's backward runs (4.3 GB at 32k G = 8).
    "selected_dkdv": dict(rows=64, num_warps=4, num_stages=1, segment=256, dq_max_group=8),
    # The selected forward and dq per key block for groups of at most max_group heads; larger
    # ones run one program per position (at G = 8 and 6 the per-block op was slower, also at
    # one stage). segment: as above for these groups; 1024 took the op at 32k G = 1 / 2 / 4
    # 6-12 % below 256 (fewer dK/dV partials; bench/NOTES.md, thirty-first session).
    "selected_block_fwd": dict(rows=64, num_warps=4, num_stages=1, max_group=4, segment=1024),
    # The selected forward, dq and dK/dV at short T as masked causal attention
    # (selected_masked.py). The dK/dV at 4 x 2k, 64/4/128: 1.215 ms at 64 / 4 / 3 against the
    # 1.56 of 128 / 8 / 1 before both its loops were pipelined (forty-fourth session).
    "masked_fwd": dict(rows=128, num_warps=4, num_stages=3),
    "masked_dq": dict(rows=128, num_warps=4, num_stages=3),
    "masked_dkdv": dict(rows=64, num_warps=4, num_stages=3),
}
# Head dims <= 64 (16-bit; m7c-125m's 64): the families whose best launch differs there,
# measured at 8 x 2k (bench/NOTES.md, v18; masked_dkdv v19; masked_fwd v20; cmp_dkdv v23;
# the dq's 64 rows, 4 warps, 3 stages v18). branches: the masked dq also computes the
# compressed and window branches' dq, the op's one dq kernel at short T (selected_masked.py):
# at 64 rows, 4 warps, 3 stages and at most 168 registers (maxnreg: three programs an SM; 185
# without the cap, two programs, no stack either way offline) 0.273 ms where the selected dq
# alone (0.173) and the compressed+window dq (0.138) took 0.311; uncapped 0.360 (fifty-fourth
# session). Not for wider tiles: at 2k, 64/4/128 an uncapped one-kernel dq made the op's
# forward+backward 2.47 ms against 2.35 (forty-fifth session), and none was measured since.
# cw_dq's 32 compressed keys keep its m7c launch at 168 registers (offline sm_90; 64 keys:
# 204, two programs an SM where 168 fit three; bench/NOTES.md, thirty-eighth session). The
# masked dK/dV over each block's positions, both loops pipelined: 128 / 4 / 2 (0.312 ms; 64 /
# 4 / 2 0.331, 128 / 4 / 3 0.47, its wgmma serialized by ptxas; forty-fourth session). The
# compressed and window forwards at 64 rows since their tiles hold launch.tile_heads' heads
# (32 positions x 2 heads at G = 6): window 0.109 -> 0.095 ms, compressed 0.050 -> 0.046 (at
# 64 rows of 10 x 6 they were 0.110-0.116 and 0.055-0.058; fifty-first session); at most 96
# registers (offline sm_90: 128 -> 96, no stack, four -> five programs an SM): window 91.8 ->
# 89.0 us, compressed 42.4 -> 40.1 a layer at 8 x 2k (fifty-fifth session), although under
# the cap ptxas serializes their wgmma (C7512, too few registers for its pipeline); no stack
# offline at G = 1, 2, 4, 6, 16, Dk != Dv, fp16, without TMA or the small scale, but for the
# programs of non-finite keys (FINITE off: 112 B); launches with unaligned strides
# (strides_aligned) and float32 ones (launch_shape) run uncapped. The dK/dV kernels capped
# at 168 (243 / 238 registers -> 144 / 160 B of stack, two -> three programs an SM) went from
# 51 and 159 us to 71 and 254: no cap there.
NARROW_TUNING = {
    "cmp_fwd": dict(rows=64, maxnreg=96),
    "win_fwd": dict(rows=64, maxnreg=96),
    "cw_dq": dict(rows=64, num_warps=4, num_stages=3, keys=32),
    "cmp_dkdv": dict(rows=64, num_warps=4, num_stages=3, transposed_min_group=None),
    "win_dkdv": dict(rows=64, num_warps=4, num_stages=3, transposed_min_group=None),
    "masked_dkdv": dict(rows=128, num_warps=4, num_stages=2),
    "masked_fwd": dict(rows=64, num_warps=4, num_stages=3),
    "masked_dq": dict(rows=64, num_warps=4, num_stages=3, maxnreg=168, branches=True),
}


class BranchGrad(NamedTuple):
    """One branch's output gradient as its backward kernels take it: gate · do, never formed
    (the kernels multiply what they compute from do by each row's gate). do [B, T, HQ, Dv];
    gate [B, T, HQ] float32, contiguous like the branch's log-sum-exp."""

    do: torch.Tensor
    gate: torch.Tensor

    @classmethod
    def ungated(cls, do: torch.Tensor) -> BranchGrad:
        """do itself as a branch's output gradient (gates of 1)."""
        return cls(do, torch.ones(do.shape[:-1], dtype=torch.float32, device=do.device))


def call_op(op, impl, *args):
    """``impl(*args)`` through its torch.library registration ``op`` while torch.compile traces
    (the graph keeps it as one opaque node) or when the tensors hold no data (meta or fake
    tensors: the op's fake implementation gives the shapes); directly otherwise, for real
    tensors in eager mode: the dispatcher's path into a Python op costs the host 0.03-0.4 ms
    per call on the GPU machine, more than a kernel launch (bench/NOTES.md, v20)."""
    tensor = next(t for a in args for t in (a if isinstance(a, list) else [a])
                  if isinstance(t, torch.Tensor))  # the first, also inside a list argument
    if torch.compiler.is_compiling() or tensor.is_meta or is_fake(tensor):
        return op(*args)
    return impl(*args)


# Host arithmetic of the launch wrappers in plain Python: triton.cdiv and
# triton.next_power_of_2 are constexpr functions in Triton 3.6, ~2 µs a call from the host
# (argument unwrapping and an import per call), and a forward+backward made ~130 such calls
# (bench/NOTES.md, the op's host time, seventeenth session).


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for host ints (b > 0)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for n = 0, as triton.next_power_of_2)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def pow2(x: int, minimum: int = 16) -> int:
    """The tile size of a dimension of x: the next power of two, at least ``minimum``."""
    return max(minimum, next_pow2(x))


def tile_heads(G: int) -> int:
    """Query heads per tile of a kernel whose tiles are positions x heads of one KV head's
    group (``common.query_tile_rows``): the largest power of two dividing G. Tiles hold a
    power of two of rows, so a group of G heads that is no power of two left rows of each
    tile idle: at m7c-125m's G = 6, 10 positions x 6 heads used 60 of 64 rows; 32 positions x
    2 heads use all (bench/NOTES.md, fifty-first session)."""
    return G & -G


def query_tile_grid(B: int, T: int, H: int, G: int, rows: int) -> tuple[tuple[int, int], int]:
    """(grid, heads per tile) of a kernel whose programs are ``common.query_tile_rows``' query
    tiles of ``rows`` rows: (query tiles, B·H·head subsets), ``tile_heads(G)`` heads a tile."""
    heads = tile_heads(G)
    return (cdiv(T, rows // heads), B * H * (G // heads)), heads


def small_scale(scale: float) -> bool:
    """Whether the kernels' s = scale · log2(e) is <= 1 (every head dim >= 3 at the default
    scale 1/sqrt(D)), so that score differences enter exp2 unmultiplied (common.exp_scale):
    the SMALL_SCALE kernels leave out a multiply and a clamp per (query, key) pair. A float64
    s <= 1 stays <= 1 in the float32 the kernels take."""
    return scale * LOG2E <= 1.0


def tile_width(head_dim: int, element_size: int = 2) -> int:
    """A head's tile width in 16-bit values: its padded dim, doubled for 4-byte elements.
    Tiles wider than 128 are not software-pipelined (shared memory)."""
    return pow2(head_dim) * element_size // 2


def family_tuning(kind: str, width: int) -> dict:
    """A family's tuned launch for tiles ``width`` wide: TUNING's, with NARROW_TUNING's entries
    for tiles of width <= 64 where it has the family."""
    return TUNING[kind] | (NARROW_TUNING.get(kind, {}) if width <= 64 else {})


def launch_shape(kind: str, G: int, head_dim: int, element_size: int = 2, capped: bool = True):
    """(rows per tile, launch options) for a kernel family; rows >= G, a power of two >= 16.

    The tuned shapes are for 16-bit tiles of head dim <= 128, with NARROW_TUNING's for head
    dims <= 64 where it has the family. Wider tiles (a larger head dim,
    or 4-byte float32 elements, which count as twice the dim) halve the rows per doubling and
    drop software pipelining so the tiles fit in shared memory; wide float32 tiles halve them
    once more (FLOAT32_SHRINK). The options hold a family's register cap (``maxnreg``) where
    its tuning has one, for 16-bit elements (the caps were measured there; float32 tiles,
    whose exact products hold their operands in registers, spilled 112-704 B under the
    forwards' cap offline) and unless not ``capped`` (``strides_aligned``)."""
    width = tile_width(head_dim, element_size)
    tuning = family_tuning(kind, width)
    rows, stages = tuning["rows"], tuning["num_stages"]
    if width > 128:
        rows, stages = max(16, rows * 128 // width), 1
        if element_size == 4:
            rows = max(16, rows // FLOAT32_SHRINK)
    options = dict(num_warps=tuning["num_warps"], num_stages=stages)
    if "maxnreg" in tuning and capped and element_size == 2:
        options["maxnreg"] = tuning["maxnreg"]
    return max(rows, pow2(G, 16)), options


KEYS_WIDE = 64  # keys of a tile of the compressed and window kernels for wide tiles
# Wide float32 tiles (head dims above 64) take 1/FLOAT32_SHRINK of the rows and keys of 16-bit
# tiles of the same width: their products (exact float32, no tensor cores) hold both operands
# in registers, and at 64 x 64 x 128 each launch spilled 10-100 KB and compiled for 8-37 s
# (offline sm_90, bench/NOTES.md, twenty-seventh session).
FLOAT32_SHRINK = 2


def wide_keys(head_dim: int, element_size: int = 2) -> int | None:
    """The most keys of a tile of this head dim and element size: no limit (None) for tiles
    of width <= 128, KEYS_WIDE for wider ones (shared memory), fewer for wide float32 ones
    (FLOAT32_SHRINK)."""
    if tile_width(head_dim, element_size) <= 128:
        return None
    return KEYS_WIDE // (FLOAT32_SHRINK if element_size == 4 else 1)


def launch_choice(kind: str, field: str, head_dim: int, element_size: int = 2) -> bool:
    """A family's tuned yes-or-no choice ``field`` for tiles of this head dim and element size
    (masked_dq's ``branches``); False where its tuning has none."""
    return bool(family_tuning(kind, tile_width(head_dim, element_size)).get(field, False))


def launch_keys(kind: str, head_dim: int, element_size: int = 2, field: str = "keys") -> int:
    """Keys of a tile (BLOCK_N) of a compressed/window kernel family: its tuned ``keys`` (or
    another ``field``: cw_dq's ``win_keys``), at most ``wide_keys``."""
    keys = family_tuning(kind, tile_width(head_dim, element_size))[field]
    limit = wide_keys(head_dim, element_size)
    return keys if limit is None else min(keys, limit)


# The dK/dV families whose tiles can be computed transposed (launch_transposed).
TRANSPOSABLE = tuple(kind for kind, tuning in TUNING.items() if "transposed_min_group" in tuning)


def launch_transposed(kind: str, G: int, head_dim: int, element_size: int = 2) -> bool:
    """Whether a dK/dV kernel family computes its tiles transposed (common.dkdv_tile): for
    groups of G >= its tuned ``transposed_min_group`` heads, G a power of two (query tiles of
    whole positions), in 16-bit tiles of head dim <= 128; never for wider ones (not measured)."""
    width = tile_width(head_dim, element_size)
    min_group = family_tuning(kind, width).get("transposed_min_group")
    return width <= 128 and min_group is not None and G >= min_group and G & (G - 1) == 0


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 for the interpreter on the CPU)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def fork(device: torch.device) -> torch.cuda.Stream | None:
    """A second stream of a CUDA ``device`` that starts after the work issued so far on the
    current one (None on the CPU): launches issued inside ``torch.cuda.stream(fork(...))`` run
    beside the current stream's later ones (in a captured CUDA graph: a parallel branch), where
    one kernel's tail or a small grid leaves SMs idle. ``join`` ends it."""
    if device.type != "cuda":
        return None
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def join(side: torch.cuda.Stream | None, *made: torch.Tensor) -> None:
    """The current stream waits for ``side``'s work (``fork``); ``made``: the tensors allocated
    on ``side`` that the current stream uses, marked so that their memory is not reused before
    its uses."""
    if side is None:
        return
    current = torch.cuda.current_stream(side.device)
    current.wait_stream(side)
    for x in made:
        x.record_stream(current)


MIN_SEGMENT = 256  # fewest query positions a dK/dV segment is cut down to (to fill the GPU)


def dkdv_segment(T: int, programs: int, device: torch.device, longest: int) -> int:
    """Query positions per segment of a dK/dV kernel whose programs each own a key tile and
    loop over the queries that see it: at most ``longest``, fewer (not below MIN_SEGMENT) when
    ``programs`` key tiles alone would leave SMs idle (aim: two programs per SM). Segments
    write separate partials, summed in a fixed order."""
    wanted = cdiv(2 * num_sms(device), max(programs, 1))
    return max(1, min(longest, max(MIN_SEGMENT, cdiv(T, wanted))))


def dkdv_buffers(k: torch.Tensor, v: torch.Tensor, segments: int):
    """dK, dV outputs [segments, *shape] of such a kernel: in k's and v's dtypes for one
    segment, float32 partials for several (``sum_segments`` adds them)."""
    single = segments == 1
    return tuple(torch.empty(segments, *x.shape, dtype=x.dtype if single else torch.float32,
                             device=x.device) for x in (k, v))


def sum_segments(dk: torch.Tensor, dv: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """dK, dV from ``dkdv_buffers``' outputs: the one segment, or the partials summed in a
    fixed order, in k's and v's dtypes."""
    if dk.shape[0] == 1:
        return dk[0], dv[0]
    return dk.sum(0).to(k.dtype), dv.sum(0).to(v.dtype)


def wide_rows(*tensors: torch.Tensor) -> bool:
    """Whether an element offset inside one batch entry (dimensions 1 on) of any of these
    tensors reaches 2^31: kernels that compute their rows' offsets in int32 need int64 then."""
    return any(sum((size - 1) * stride for size, stride in zip(x.shape[1:], x.stride()[1:]))
               >= 2**31 for x in tensors)


def strides_aligned(*tensors: torch.Tensor) -> bool:
    """Whether every stride a kernel takes of these tensors (all but the last, 1) is a multiple
    of 16, which Triton's launch specializes on: its address arithmetic needs fewer registers.
    The compressed and window forwards' register cap holds for those launches only (offline
    sm_90 at m7c's: 96 registers, no stack; with every stride unaligned, 416 B of stack, where
    uncapped they take 192 registers and no stack; fifty-fifth session)."""
    return all(stride % 16 == 0 for x in tensors for stride in x.stride()[:-1])


def strides(x: torch.Tensor, n: int = 3):
    """The first n strides of x (batch, token, head) for a kernel's pointer arithmetic."""
    return x.stride()[:n]


def shapes(q, k, v):
    """(B, T, HQ, H, G, Dk, Dv) of q [B, T, HQ, Dk], k [B, *, H, Dk], v [B, *, H, Dv]."""
    B, T, HQ, Dk = q.shape
    H, Dv = k.shape[2], v.shape[3]
    G = HQ // H
    return B, T, HQ, H, G, Dk, Dv


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """x, or a copy where its last stride is not 1: the kernels read every other layout through
    its strides (a layer's k and v are strided views of one projection: no copy per call)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] as rows [N, C] with a last stride of 1: a view where one exists, else
    :func:`unit_stride`'s copy (the row-wise kernels of the model: its activation, its norms)."""
    return unit_stride(x.reshape(x.shape[:-1].numel(), x.shape[-1]))


def tile_descriptor(x: torch.Tensor, box: list[int]) -> TensorDescriptor | None:
    """A tensor descriptor (TMA loads) of x whose loads are ``box``-shaped tiles (zeros past
    x's edges), or None where TMA cannot read x: an empty x, a box dim that is not a power of
    two or is above 256, rows (last dim) or a base or stride that are not a multiple of 16
    bytes (rows of 2 bytes made illegal accesses on the H100), a non-unit last stride."""
    size = x.element_size()
    if not (x.numel() > 0 and all(n == next_pow2(n) and n <= 256 for n in box)
            and x.shape[-1] * size % 16 == 0 and box[-1] >= x.shape[-1]
            and x.stride(-1) == 1 and x.data_ptr() % 16 == 0
            and all(st * size % 16 == 0 for st in x.stride()[:-1])):
        return None
    return TensorDescriptor(x, list(x.shape), list(x.stride()), box)


def descriptor_pair(a: torch.Tensor, b: torch.Tensor, box: list[int]):
    """(A, B, True): descriptors of a and b whose tiles are ``box`` + their padded last dim
    (pow2), where TMA can read both; else (a, b, False), for pointer loads."""
    ad = tile_descriptor(a, box + [pow2(a.shape[-1])])
    bd = tile_descriptor(b, box + [pow2(b.shape[-1])])
    if ad is None or bd is None:
        return a, b, False
    return ad, bd, True
