"""Attention layers: NSA (the paper's three gated branches) and dense causal (the baseline)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nsa.layers.cache import (
    DenseCache,
    NSACache,
    append_kv,
    ring_from_prefix,
    write_at,
)
from nsa.layers.compressor import COMPRESSORS, Compressor, compress_all
from nsa.layers.documents import PackedDocuments, as_packed_documents
from nsa.layers.projection import (
    Heads,
    HeadsLayout,
    decode_projection,
    fused_columns,
    fused_product,
    split_heads,
)
from nsa.layers.rope import (
    PositionAngles,
    RotaryFrequencies,
    rope_angles,
    rope_frequencies,
    rotate,
)
from nsa.ops import NSAParams, nsa_attention
from nsa.ops.decode import nsa_decode
from nsa.ops.params import BACKENDS
from nsa.ops.triton_support import TRITON_AVAILABLE, TRITON_DTYPES, triton_takes

ATTENTIONS = ("nsa", "dense")
KV_SHARING = ("independent", "shared")
BRANCHES = ("cmp", "slc", "win")


def check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def check_positive_float(name: str, value) -> None:
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not 0 < value < math.inf):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class AttentionConfig:
    """Everything an attention layer needs; validated once, when built. ``nsa`` (the op's block
    parameters) and the fields after it are read by NSA layers only."""

    kind: str = "nsa"  # "nsa" or "dense" (causal SDPA: the baseline)
    dim: int = 128
    num_heads: int = 8  # HQ
    num_kv_heads: int = 2  # H
    head_dim_k: int = 16
    head_dim_v: int = 16
    rope_base: float = 10000.0
    nsa: NSAParams = NSAParams()  # l, d, l', n, w, forced blocks (NSA_SPEC.md)
    kv_sharing: str = "independent"  # separate K/V per branch (paper §3.3.3) or one for all
    compressor: str = "mlp"  # "mlp" (paper) or "mean"
    compressor_hidden: int | None = None  # MLP width, default 2 * head_dim
    force_branch: str | None = None  # debug: use only "cmp", "slc" or "win"
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.kind not in ATTENTIONS:
            raise ValueError(f"attention kind must be one of {ATTENTIONS}, got {self.kind!r}")
        for name in ("dim", "num_heads", "num_kv_heads", "head_dim_k", "head_dim_v"):
            check_positive_int(name, getattr(self, name))
        check_positive_float("rope_base", self.rope_base)
        if not isinstance(self.nsa, NSAParams):
            raise ValueError(f"nsa must be an NSAParams, got {type(self.nsa).__name__}")
        if self.compressor_hidden is not None:
            check_positive_int("compressor_hidden", self.compressor_hidden)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim_k % 2:
            raise ValueError(f"head_dim_k must be even for RoPE, got {self.head_dim_k}")
        if self.kv_sharing not in KV_SHARING:
            raise ValueError(f"kv_sharing must be one of {KV_SHARING}, got {self.kv_sharing!r}")
        if self.compressor not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {COMPRESSORS}, got {self.compressor!r}")
        if self.force_branch is not None and self.force_branch not in BRANCHES:
            raise ValueError(f"force_branch must be None or one of {BRANCHES}, got "
                             f"{self.force_branch!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")


class NSAttention(nn.Module):
    """Native Sparse Attention layer: x [B, T, dim] -> [B, T, dim].

    Positions: queries and the keys of the selected and window branches are rotated at their
    token position t. Compressed keys are built from un-rotated keys (the compressor's own
    intra-block position embedding encodes order inside a block) and then rotated at the centre
    of the tokens they summarise, i·d + (l - 1) / 2, so q·k_cmp sees the distance to the block.

    Packed documents (``forward(x, cu_seqlens)``, B = 1): t and i count from each document's
    start, and compressed tokens are made per document (never across a boundary), packed as
    the op takes them; each document's output is the one it would have alone.
    """

    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.config = c = config
        self.num_kv_sets = 3 if c.kv_sharing == "independent" else 1  # (cmp, slc, win) or one
        self.q_proj = nn.Linear(c.dim, c.num_heads * c.head_dim_k, bias=False)
        kv_width = self.num_kv_sets * c.num_kv_heads * (c.head_dim_k + c.head_dim_v)
        self.kv_proj = nn.Linear(c.dim, kv_width, bias=False)
        p = c.nsa
        self.compress_k = Compressor(c.head_dim_k, p.cmp_block, p.cmp_stride, c.compressor,
                                     c.compressor_hidden)
        self.compress_v = Compressor(c.head_dim_v, p.cmp_block, p.cmp_stride, c.compressor,
                                     c.compressor_hidden)
        self.gate_proj = nn.Linear(c.dim, c.num_heads * 3)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim_v, c.dim, bias=False)
        self.rope = RotaryFrequencies(c.head_dim_k, c.rope_base)
        self._heads, self._decode_heads = self._layout(False), self._layout(True)

    def _layout(self, decoding: bool) -> HeadsLayout:
        """The head groups of the layer's fused product (:func:`split_heads`): queries
        (rotated), the K/V sets' keys and values, gate logits. Training and prefill take each
        set's keys and values, the selected and window branches' keys rotated (a shared set's
        keys both as they are, for the compressor, and rotated); a decode step takes the sets
        as one group [sets · H, Dk + Dv], whose keys its cache rotates."""
        c = self.config
        q_start, kv_start, gate_start, width = fused_columns(*self._fused_layers())
        H, Dk, Dv = c.num_kv_heads, c.head_dim_k, c.head_dim_v
        q = Heads(q_start, c.num_heads, Dk, Dk, rotate=True)
        gates = Heads(gate_start, c.num_heads, 3, 3)
        if decoding:
            kv = Heads(kv_start, self.num_kv_sets * H, Dk + Dv, Dk + Dv)
            return HeadsLayout((q, kv, gates), width)
        starts = [kv_start + s * H * (Dk + Dv) for s in range(self.num_kv_sets)]
        keys = [Heads(start, H, Dk + Dv, Dk) for start in starts]
        values = [Heads(start + Dk, H, Dk + Dv, Dv) for start in starts]
        if self.num_kv_sets == 3:  # (compressed, selected, window): the last two rotated
            kv = (keys[0], values[0], keys[1]._replace(rotate=True), values[1],
                  keys[2]._replace(rotate=True), values[2])
        else:
            kv = (keys[0], values[0], keys[0]._replace(rotate=True))
        return HeadsLayout((q, *kv, gates), width)

    def _gates(self, logits: torch.Tensor) -> torch.Tensor:
        """Gate logits [B, T, HQ, 3] before the bias -> the gates: sigmoids, or a one-hot when
        a branch is forced: then the sigmoids enter times zero, so ``gate_proj`` still gets a
        (zero) gradient, as every parameter must on every rank (DDP waits for each one). The
        sigmoids: one Triton kernel each way (nsa/ops/triton/branch_gates.py) for CUDA logits
        of their dtypes where Triton is installed, in place of ~8 small PyTorch kernels;
        PyTorch elsewhere."""
        c = self.config
        if triton_takes(logits):
            from nsa.ops.triton.branch_gates import branch_gates_triton

            gates = branch_gates_triton(logits, self.gate_proj.bias)
        else:
            bias = self.gate_proj.bias.view(c.num_heads, 3).to(logits.dtype)
            gates = torch.sigmoid(logits + bias)
        if c.force_branch is not None:
            # Built on the device (no host-to-device copy: CUDA graph capture refuses one).
            branch = torch.arange(3, device=logits.device) == BRANCHES.index(c.force_branch)
            gates = branch.to(gates.dtype) + gates * 0
        return gates

    def _fused_layers(self) -> tuple[nn.Linear, ...]:
        """The projections taken as one product (:func:`fused_product`), in its order."""
        return self.q_proj, self.kv_proj, self.gate_proj

    def _project(self, x: torch.Tensor, angles):
        """x [B, T, dim] at positions of RoPE ``angles`` (cos, sin of :func:`rope_angles`) ->
        q [B, T, HQ, Dk]; the compressor's un-rotated inputs (k_src, v_src); (k_slc, v_slc,
        k_win, v_win), [B, T, H, D]; the gates [B, T, HQ, 3]. One product and one
        :func:`split_heads` (q, k_slc and k_win rotated in one kernel on CUDA, forward and
        backward); with one shared K/V set, k_win is k_slc and every value is the set's."""
        *heads, logits = split_heads(fused_product(x, self._fused_layers()),
                                     self._heads, *angles)
        if self.num_kv_sets == 3:
            q, k_src, v_src, k_slc, v_slc, k_win, v_win = heads
        else:
            q, k_src, v_src, k_slc = heads
            v_slc = v_win = v_src
            k_win = k_slc
        return q, k_src, v_src, k_slc, v_slc, k_win, v_win, self._gates(logits)

    def _compress(self, k_src: torch.Tensor, v_src: torch.Tensor, angles,
                  first: torch.Tensor | None = None):
        """Compressed tokens of [B, T, H, D] sources: each summarises tokens [i·d, i·d + l) of
        its sequence, or, for packed documents, the l tokens from ``first`` [Tc]. Keys rotated
        by ``angles``, those of the centres of the tokens they summarise
        (:meth:`compressed_angles`)."""
        k_cmp, v_cmp = compress_all([self.compress_k, self.compress_v], [k_src, v_src],
                                    first)  # [B, Tc, H, Dk], [B, Tc, H, Dv]
        return rotate(k_cmp, *angles), v_cmp

    def compressed_angles(self, index: torch.Tensor):
        """RoPE angles (cos, sin) of the compressed tokens of index ``index`` ([Tc] or [B, Tc])
        within their sequences: at the centre of the tokens each summarises."""
        p = self.config.nsa
        return self.rope.angles(index * p.cmp_stride + (p.cmp_block - 1) / 2)

    def position_angles(self, T: int, documents: PackedDocuments | None,
                        device) -> PositionAngles:
        """The RoPE angles of a forward over T positions (restarting per document of
        ``documents``): the same for every layer of one config, so a model computes them once
        and passes them to each (:meth:`forward`'s ``angles``)."""
        if documents is None:
            positions = torch.arange(T, device=device)
            cmp_index = torch.arange(self.config.nsa.compressed_length(T), device=device)
        else:
            positions, cmp_index = documents.positions, documents.cmp_index
        return PositionAngles(self.rope.angles(positions), self.compressed_angles(cmp_index))

    def _attend(self, q, k_slc, v_slc, k_cmp, v_cmp, gates, k_win, v_win,
                cu_seqlens=None) -> torch.Tensor:
        c, p = self.config, self.config.nsa
        return nsa_attention(
            q, k_slc, v_slc, k_cmp, v_cmp, gates, k_win=k_win, v_win=v_win,
            cmp_block=p.cmp_block, cmp_stride=p.cmp_stride, sel_block=p.sel_block,
            num_selected=p.num_selected, window=p.window, num_init=p.num_init,
            num_local=p.num_local, cu_seqlens=cu_seqlens, backend=c.backend,
        )  # [B, T, HQ, Dv]

    def _run(self, x: torch.Tensor, documents: PackedDocuments | None = None,
             angles: PositionAngles | None = None):
        """x [B, T, dim] -> (output [B, T, dim], the keys/values a cache keeps: k_src, v_src,
        k_slc, v_slc, k_win, v_win [B, T, H, D] and k_cmp, v_cmp [B, Tc, H, D])."""
        c = self.config
        B, T, _ = x.shape
        if angles is None:
            angles = self.position_angles(T, documents, x.device)
        cmp_first = cu_seqlens = None
        if documents is not None:
            cmp_first, cu_seqlens = documents.cmp_first, documents.cu_seqlens
        q, k_src, v_src, k_slc, v_slc, k_win, v_win, gates = self._project(x, angles.tokens)
        k_cmp, v_cmp = self._compress(k_src, v_src, angles.compressed, cmp_first)
        out = self._attend(q, k_slc, v_slc, k_cmp, v_cmp, gates, k_win, v_win, cu_seqlens)
        out = self.o_proj(out.reshape(B, T, c.num_heads * c.head_dim_v))
        return out, (k_src, v_src, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp)

    def forward(self, x: torch.Tensor,
                cu_seqlens: torch.Tensor | PackedDocuments | None = None,
                angles: PositionAngles | None = None) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]. ``cu_seqlens`` (int32 [N+1], B = 1; or the
        :class:`~nsa.layers.documents.PackedDocuments` a model made of it) packs N documents
        along T, each computed as if alone (see :mod:`nsa.layers.documents`); ValueError when
        it is malformed. Prefill and decoding take no documents. ``angles``: this forward's
        :meth:`position_angles`, when the caller computed them once for all its layers."""
        documents = None if cu_seqlens is None else as_packed_documents(cu_seqlens, x,
                                                                       self.config.nsa)
        return self._run(x, documents, angles)[0]

    # Decoding ---------------------------------------------------------------------------

    def new_cache(self, batch: int, capacity: int, device, dtype) -> NSACache:
        c, p = self.config, self.config.nsa
        zeros = lambda n, d: torch.zeros(batch, n, c.num_kv_heads, d, device=device,  # noqa
                                         dtype=dtype)
        ring = self.num_kv_sets == 3
        num_cmp = p.compressed_length(capacity)
        return NSACache(
            k=zeros(capacity, c.head_dim_k), v=zeros(capacity, c.head_dim_v),
            k_win=zeros(p.window, c.head_dim_k) if ring else None,
            v_win=zeros(p.window, c.head_dim_v) if ring else None,
            src_k=zeros(p.cmp_block, c.head_dim_k), src_v=zeros(p.cmp_block, c.head_dim_v),
            k_cmp=zeros(num_cmp, c.head_dim_k), v_cmp=zeros(num_cmp, c.head_dim_v),
            projection=decode_projection(self._fused_layers()))

    def prefill(self, x: torch.Tensor, lengths: torch.Tensor, cache: NSACache) -> torch.Tensor:
        """forward(x) for [B, P, dim] prompts, right-padded (sequence b is ``lengths[b]``
        long), and fill ``cache`` with their first lengths[b] positions."""
        p = self.config.nsa
        P = x.shape[1]
        out, (k_src, v_src, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp) = self._run(x)
        # Later positions of shorter prompts are overwritten by their decode steps before they
        # are read (and compressed tokens past a prompt are invisible until recomputed).
        cache.k[:, :P] = k_slc
        cache.v[:, :P] = v_slc
        cache.k_cmp[:, :k_cmp.shape[1]] = k_cmp
        cache.v_cmp[:, :v_cmp.shape[1]] = v_cmp
        if cache.k_win is not None:
            cache.k_win.copy_(ring_from_prefix(k_win, lengths, p.window))
            cache.v_win.copy_(ring_from_prefix(v_win, lengths, p.window))
        cache.src_k.copy_(ring_from_prefix(k_src, lengths, p.cmp_block))
        cache.src_v.copy_(ring_from_prefix(v_src, lengths, p.cmp_block))
        return out

    def decode(self, x: torch.Tensor, pos: torch.Tensor, cache: NSACache,
               compress: bool = True, angles: PositionAngles | None = None) -> torch.Tensor:
        """One new token per sequence: x [B, 1, dim] at positions ``pos`` [B] -> [B, 1, dim].
        Appends its keys/values (and a compressed token when one completes) to ``cache``.
        ``compress=False`` skips the compressed-token update (about 40 small ops): right only
        for a step at which no sequence completes a compressed token, which a caller that
        knows the positions can tell (:func:`completes_compressed_token`). ``angles``: the
        RoPE angles of ``pos[:, None]`` (in ``tokens``), when the caller computed them once for
        all its layers."""
        c, p = self.config, self.config.nsa
        B = x.shape[0]
        angles = self.rope.angles(pos[:, None]) if angles is None else angles.tokens
        q, kv, logits = split_heads(
            fused_product(x, self._fused_layers(), cache.projection), self._decode_heads, *angles)
        gates = self._gates(logits)
        append_kv(cache, kv.view(B, 1, self.num_kv_sets, c.num_kv_heads, -1), *angles, pos)
        if cache.k_cmp.shape[1] and compress:
            self._append_compressed(cache, pos)
        out = nsa_decode(q[:, 0], cache.k, cache.v, cache.k_cmp, cache.v_cmp,
                         gates[:, 0], pos, p, k_win=cache.k_win,
                         v_win=cache.v_win, window_ring=cache.k_win is not None,
                         backend=c.backend)
        return self.o_proj(out.reshape(B, 1, c.num_heads * c.head_dim_v))

    def _append_compressed(self, cache: NSACache, pos: torch.Tensor) -> None:
        """Write the compressed token that appending positions ``pos`` [B] completes (where
        one does) from the compressor's input rings into cache.k_cmp / v_cmp: two Triton
        kernels per set on CUDA, one for the mean compressor (nsa/ops/triton/cache_compress.py),
        PyTorch ops otherwise."""
        c, p = self.config, self.config.nsa
        num_cmp = cache.k_cmp.shape[1]
        if cache.src_k.is_cuda and TRITON_AVAILABLE:
            from nsa.ops.triton.cache_compress import compress_step_triton

            sets = ((cache.src_k, self.compress_k, cache.k_cmp),
                    (cache.src_v, self.compress_v, cache.v_cmp))
            dtypes = [compressor.compute_dtype(ring) for ring, compressor, _ in sets]
            if all(dtype in TRITON_DTYPES for dtype in (*dtypes, cache.src_k.dtype)):
                rope = compressed_rope_table(num_cmp, p.cmp_block, p.cmp_stride, c.head_dim_k,
                                             c.rope_base, cache.src_k.device)
                for (ring, compressor, out), dtype, angles in zip(sets, dtypes, (rope, None)):
                    compress_step_triton(ring, pos, compressor, out, dtype, angles)
                return
        start, complete = completing_block(p, pos)  # [B], [B]
        index = (start // p.cmp_stride).clamp(0, num_cmp - 1)  # [B]
        slots = (start[:, None]
                 + torch.arange(p.cmp_block, device=pos.device)) % p.cmp_block  # [B, l]
        gather = lambda ring: torch.gather(  # noqa: E731
            ring, 1, slots[:, :, None, None].expand(-1, -1, *ring.shape[2:]))
        k_new, v_new = self._compress(gather(cache.src_k), gather(cache.src_v),
                                      self.compressed_angles(index[:, None]))
        write_at((cache.k_cmp, cache.v_cmp), index, (k_new[:, 0], v_new[:, 0]), complete)


class DenseAttention(nn.Module):
    """Causal softmax attention with GQA through SDPA: the baseline NSA is measured against.

    Packed documents (``forward(x, cu_seqlens)``, B = 1): positions restart per document and
    SDPA takes a block-diagonal causal mask, a [T, T] bool tensor: O(T²) memory, fine for the
    baseline at training lengths, and SDPA then runs a kernel that takes a mask, not flash.
    """

    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.config = c = config
        self.q_proj = nn.Linear(c.dim, c.num_heads * c.head_dim_k, bias=False)
        self.kv_proj = nn.Linear(c.dim, c.num_kv_heads * (c.head_dim_k + c.head_dim_v), bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim_v, c.dim, bias=False)
        self.rope = RotaryFrequencies(c.head_dim_k, c.rope_base)
        q_start, kv_start, width = fused_columns(*self._fused_layers())
        H, Dk, Dv = c.num_kv_heads, c.head_dim_k, c.head_dim_v
        self._heads = HeadsLayout((Heads(q_start, c.num_heads, Dk, Dk, rotate=True),
                                   Heads(kv_start, H, Dk + Dv, Dk, rotate=True),
                                   Heads(kv_start + Dk, H, Dk + Dv, Dv)), width)

    def _project(self, x: torch.Tensor, angles, weight: torch.Tensor | None = None):
        """x [B, T, dim] at positions of RoPE ``angles`` -> q, k (rotated), v: one product
        (``weight``: the fused weight a decode cache keeps) and one :func:`split_heads`."""
        return split_heads(fused_product(x, self._fused_layers(), weight), self._heads, *angles)

    def _attend(self, q, k, v, **mask) -> torch.Tensor:
        """SDPA over [B, T, heads, D] tensors -> [B, T, HQ * Dv]."""
        c = self.config
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            enable_gqa=c.num_heads != c.num_kv_heads, **mask,
        )  # [B, HQ, T, Dv]
        return out.transpose(1, 2).flatten(2)

    def _fused_layers(self) -> tuple[nn.Linear, ...]:
        """The projections :meth:`_project` takes as one product, in its order."""
        return self.q_proj, self.kv_proj

    def forward(self, x: torch.Tensor,
                cu_seqlens: torch.Tensor | PackedDocuments | None = None,
                angles: PositionAngles | None = None) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]; ``cu_seqlens`` and ``angles`` as
        :meth:`NSAttention.forward`."""
        documents = None if cu_seqlens is None else as_packed_documents(cu_seqlens, x,
                                                                       self.config.nsa)
        if angles is None:
            angles = self.position_angles(x.shape[1], documents, x.device)
        q, k, v = self._project(x, angles.tokens)
        if documents is None:
            return self.o_proj(self._attend(q, k, v, is_causal=True))
        return self.o_proj(self._attend(q, k, v, attn_mask=documents.attention_mask()))

    def position_angles(self, T: int, documents: PackedDocuments | None,
                        device) -> PositionAngles:
        """:meth:`NSAttention.position_angles` (the tokens' only)."""
        positions = torch.arange(T, device=device) if documents is None else documents.positions
        return PositionAngles(self.rope.angles(positions))

    def new_cache(self, batch: int, capacity: int, device, dtype) -> DenseCache:
        c = self.config
        shape = (batch, capacity, c.num_kv_heads)
        return DenseCache(torch.zeros(*shape, c.head_dim_k, device=device, dtype=dtype),
                          torch.zeros(*shape, c.head_dim_v, device=device, dtype=dtype),
                          decode_projection(self._fused_layers()))

    def prefill(self, x: torch.Tensor, lengths: torch.Tensor, cache: DenseCache) -> torch.Tensor:
        q, k, v = self._project(x, self.position_angles(x.shape[1], None, x.device).tokens)
        cache.k[:, :x.shape[1]] = k
        cache.v[:, :x.shape[1]] = v
        return self.o_proj(self._attend(q, k, v, is_causal=True))

    def decode(self, x: torch.Tensor, pos: torch.Tensor, cache: DenseCache,
               compress: bool = True, angles: PositionAngles | None = None) -> torch.Tensor:
        """:meth:`NSAttention.decode` for dense attention (``compress`` has nothing to skip)."""
        angles = self.rope.angles(pos[:, None]) if angles is None else angles.tokens
        q, k, v = self._project(x, angles, cache.projection)
        write_at((cache.k, cache.v), pos, (k[:, 0], v[:, 0]))
        visible = torch.arange(cache.k.shape[1], device=x.device) <= pos[:, None]  # [B, S]
        out = self._attend(q, cache.k.to(q.dtype), cache.v.to(q.dtype),
                           attn_mask=visible[:, None, None, :])
        return self.o_proj(out)


@functools.cache  # never evicted: a captured CUDA graph reads the tables by address
def compressed_rope_table(num_cmp: int, cmp_block: int, cmp_stride: int, head_dim: int,
                          base: float, device: torch.device):
    """cos, sin [num_cmp, head_dim / 2] float32 (contiguous) of compressed token i's centre
    i·d + (l - 1) / 2: the angles ``NSAttention._compress`` rotates it by, from the same ops."""
    centres = torch.arange(num_cmp, device=device) * cmp_stride + (cmp_block - 1) / 2
    cos, sin = rope_angles(centres, rope_frequencies(head_dim, base, device))
    return cos[0, :, 0].contiguous(), sin[0, :, 0].contiguous()


def completing_block(params: NSAParams, position):
    """Compressed token i completes when position i·d + l - 1 is appended: -> (the first
    position of the block that appending ``position`` would complete, whether it does), for
    an int or a tensor of positions."""
    start = position - (params.cmp_block - 1)
    return start, (start >= 0) & (start % params.cmp_stride == 0)


def completes_compressed_token(config: AttentionConfig, position: int) -> bool:
    """Whether appending ``position`` completes a compressed token of a layer of ``config``;
    never for dense attention."""
    return config.kind == "nsa" and completing_block(config.nsa, position)[1]


def attention_layer(config: AttentionConfig) -> nn.Module:
    """The layer ``config.kind`` names."""
    return (NSAttention if config.kind == "nsa" else DenseAttention)(config)
