"""Whether the Triton backend can run here; read once, at import."""

from __future__ import annotations

import importlib.util
import os

import torch

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the kernels' dtypes
TRITON_MISSING_REASON = "" if TRITON_AVAILABLE else "the triton package is not installed"

# Under TRITON_INTERPRET=1 Triton kernels run on CPU tensors (slowly): the CI tests use this.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Programmatic dependent launch between the decode step's kernels (sm90+); NSA_DECODE_PDL=0
# turns it off, to compare or to rule it out.
DECODE_PDL = os.environ.get("NSA_DECODE_PDL", "1") != "0"


def triton_takes(x: torch.Tensor) -> bool:
    """Whether the Triton kernels take x where a caller picks its kernels itself: a CUDA tensor
    of the kernels' dtypes, with Triton installed."""
    return x.is_cuda and TRITON_AVAILABLE and x.dtype in TRITON_DTYPES
