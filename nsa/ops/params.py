"""Parameters of the NSA op and the checks every backend runs before touching a tensor.

Everything here follows ``NSA_SPEC.md``: invalid shapes, dtypes, devices or parameters raise a
``ValueError`` that names the argument and the rule, before any kernel is launched.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "torch", "triton")
MAX_INT = 2**31 - 1  # block parameters are int32 scalars in the kernels
LOG2E = 1.4426950408889634  # the kernels' softmax is base 2: exp(x) = exp2(x · log2(e))


@dataclass(frozen=True)
class NSAParams:
    """Block sizes and counts of one NSA op (paper defaults)."""

    cmp_block: int = 32  # l: tokens summarised by one compressed token
    cmp_stride: int = 16  # d: distance between consecutive compressed tokens
    sel_block: int = 64  # l': size of a selection block
    num_selected: int = 16  # n: selected blocks per query and KV group, forced ones included
    window: int = 512  # w: sliding-window length
    num_init: int = 1  # leading blocks always selected
    num_local: int = 2  # most recent blocks always selected

    def __post_init__(self) -> None:
        for name in ("cmp_block", "cmp_stride", "sel_block", "num_selected", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_INT:
                raise ValueError(f"{name} must be a positive int <= 2**31 - 1, got {value!r}")
        for name in ("num_init", "num_local"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT:
                raise ValueError(f"{name} must be a non-negative int <= 2**31 - 1, got {value!r}")
        if self.cmp_block % self.cmp_stride:
            raise ValueError(
                f"cmp_stride ({self.cmp_stride}) must divide cmp_block ({self.cmp_block})"
            )
        if self.sel_block % self.cmp_stride:
            raise ValueError(
                f"cmp_stride ({self.cmp_stride}) must divide sel_block ({self.sel_block})"
            )
        if self.num_selected < self.num_init + self.num_local:
            raise ValueError(
                f"num_selected ({self.num_selected}) must be >= num_init + num_local "
                f"({self.num_init} + {self.num_local})"
            )

    def compressed_length(self, seq_len: int) -> int:
        return compressed_length(seq_len, self.cmp_block, self.cmp_stride)

    def within(self, length: int) -> NSAParams:
        """The same op on sequences of at most ``length`` tokens, with the sizes that drive
        allocations (n, l', l) no larger than ``length`` asks for (NSA_SPEC.md): a block
        longer than the sequence is one block, whatever its length (cut to the multiple of d
        that covers the sequence); a compressed token longer than it is never visible (cut to
        the first multiple of d past it); and n past the ⌈length / l'⌉ blocks selects every
        candidate, so the forced ones no longer matter."""
        d = self.cmp_stride
        sel_block = min(self.sel_block, d * max(1, -(-length // d)))
        cmp_block = min(self.cmp_block, d * (length // d + 1))
        num_blocks = max(1, -(-length // sel_block))
        if self.num_selected <= num_blocks:
            return replace(self, sel_block=sel_block, cmp_block=cmp_block)
        return replace(self, sel_block=sel_block, cmp_block=cmp_block, num_selected=num_blocks,
                       num_init=0, num_local=0)


def compressed_length(seq_len: int, cmp_block: int, cmp_stride: int) -> int:
    """Tc: number of compressed tokens of a sequence of ``seq_len`` tokens."""
    if seq_len < cmp_block:
        return 0
    return (seq_len - cmp_block) // cmp_stride + 1


def compressed_lengths(lengths: torch.Tensor, cmp_block: int, cmp_stride: int) -> torch.Tensor:
    """Tc of each sequence length in ``lengths`` (int64 tensor)."""
    return torch.where(
        lengths >= cmp_block,
        (lengths - cmp_block).div(cmp_stride, rounding_mode="floor") + 1,
        torch.zeros_like(lengths),
    )


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _check_tensor(name: str, x, rank: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be floating point {FLOAT_DTYPES}, got {x.dtype}")


def _check_same(ref_name: str, ref: torch.Tensor, name: str, x: torch.Tensor) -> None:
    if x.dtype != ref.dtype:
        raise ValueError(f"{name} has dtype {x.dtype} but {ref_name} has {ref.dtype}")
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}")


def _check_dims(name: str, x: torch.Tensor, expected: tuple) -> None:
    """``expected`` holds an int per dim, or None where any size is fine."""
    for got, want in zip(x.shape, expected):
        if want is not None and got != want:
            shape = tuple("*" if w is None else w for w in expected)
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")


def check_cu_seqlens(cu_seqlens, batch: int, seq_len: int, device: torch.device) -> None:
    """Structure always; values too when ``cu_seqlens`` lives on the CPU (no device sync)."""
    if cu_seqlens is None:
        return
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must have shape [N+1] with N >= 1, got {tuple(cu_seqlens.shape)}"
        )
    if batch != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (sequences packed along T), got B={batch}")
    if cu_seqlens.device.type not in ("cpu", device.type):
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}")
    if cu_seqlens.device.type == "cpu":
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        if int(cu_seqlens[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {int(cu_seqlens[0])}")
        if bool((lengths < 0).any()):
            raise ValueError("cu_seqlens must be non-decreasing")
        if int(cu_seqlens[-1]) != seq_len:
            raise ValueError(
                f"cu_seqlens must end at T={seq_len} (the packed length), got {int(cu_seqlens[-1])}"
            )


def expected_compressed_length(params: NSAParams, seq_len: int, cu_seqlens) -> int | None:
    """Total Tc for a dense batch or a packed one; None when it cannot be known without a sync."""
    if cu_seqlens is None:
        return params.compressed_length(seq_len)
    if cu_seqlens.device.type != "cpu":
        return None
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return int(compressed_lengths(lengths, params.cmp_block, params.cmp_stride).sum())


def _check_query(HQ: int, H: int, kv_name: str, Dk: int) -> None:
    """q: HQ = G·H heads with G, H >= 1 (H from ``kv_name``), and a positive head dim."""
    if H < 1 or HQ < 1 or HQ % H:
        raise ValueError(f"q has HQ={HQ} heads, which must be a positive multiple of the "
                         f"H={H} heads of {kv_name}")
    if Dk < 1:
        raise ValueError(f"q must have a positive head dim Dk, got {Dk}")


def check_select_inputs(q, k_cmp, params: NSAParams, cu_seqlens) -> None:
    _check_tensor("q", q, 4)
    _check_tensor("k_cmp", k_cmp, 4)
    _check_same("q", q, "k_cmp", k_cmp)
    B, T, HQ, Dk = q.shape
    H = k_cmp.shape[2]
    _check_query(HQ, H, "k_cmp", Dk)
    check_cu_seqlens(cu_seqlens, B, T, q.device)
    Tc = expected_compressed_length(params, T, cu_seqlens)
    _check_dims("k_cmp", k_cmp, (B, Tc, H, Dk))


def check_attention_inputs(q, k, v, k_cmp, v_cmp, gates, k_win, v_win, params, cu_seqlens):
    """Validate every tensor of ``nsa_attention``."""
    _check_tensor("q", q, 4)
    for name, x in (("k", k), ("v", v), ("k_cmp", k_cmp), ("v_cmp", v_cmp), ("gates", gates)):
        _check_tensor(name, x, 4)
        _check_same("q", q, name, x)
    for name, x in (("k_win", k_win), ("v_win", v_win)):
        if x is not None:
            _check_tensor(name, x, 4)
            _check_same("q", q, name, x)
    B, T, HQ, Dk = q.shape
    H, Dv = k.shape[2], v.shape[3]
    _check_query(HQ, H, "k", Dk)
    if Dv < 1:
        raise ValueError(f"v must have a positive head dim Dv, got {Dv}")
    _check_dims("k", k, (B, T, H, Dk))
    _check_dims("v", v, (B, T, H, None))
    _check_dims("gates", gates, (B, T, HQ, 3))
    if k_win is not None:
        _check_dims("k_win", k_win, (B, T, H, Dk))
    if v_win is not None:
        _check_dims("v_win", v_win, (B, T, H, Dv))
    check_cu_seqlens(cu_seqlens, B, T, q.device)
    Tc = expected_compressed_length(params, T, cu_seqlens)
    _check_dims("k_cmp", k_cmp, (B, Tc, H, Dk))
    _check_dims("v_cmp", v_cmp, (B, k_cmp.shape[1], H, Dv))
