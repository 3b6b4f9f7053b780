"""Training FLOPs per token, counted from the work NSA does, and model FLOPs utilisation (MFU).

Only matrix multiplications count (2 FLOPs per multiply-add); norms, activations, RoPE,
softmax and the gated sum are left out, as is usual for MFU. A training step costs three times
the forward: the backward multiplies by the transposed weights (input gradient) and by the
inputs (weight gradient). Work that an implementation repeats instead of storing (the
attention backward recomputing its scores, the Triton selection pass recomputing the
compressed scores) is not the model's work and is not counted: MFU measures useful work.

Per token, for a sequence of ``seq_len`` tokens:

* ``2 * matmul_params(model)``: every linear layer applied once per token (projections, MLP,
  the output head, tied to the embedding or not). The embedding lookup is no matmul.
* per layer, :func:`attention_flops_breakdown`: the attention scores and weighted sums, and
  for NSA the compressor MLPs, which run once per compressed token rather than per token.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from nsa.layers.compressor import Compressor
from nsa.models.config import ModelConfig

# Dense bf16 tensor-core peaks (no sparsity) from NVIDIA's datasheets, in FLOP/s.
HOPPER_SXM_BF16 = 989.4e12  # H100 SXM, H200 (same compute, more memory)
A100_BF16 = 312e12


def matmul_params(model: nn.Module) -> int:
    """Weights multiplied once per token: those of every ``nn.Linear`` outside a compressor.

    A tied output head is an ``nn.Linear`` sharing the embedding's weight: it counts here (as
    the vocabulary projection), the embedding lookup does not. Compressor MLPs run per
    compressed token: :func:`attention_flops_breakdown` counts them. Biases are left out.
    """
    in_compressors = {id(m) for c in model.modules() if isinstance(c, Compressor)
                      for m in c.modules()}
    return sum(m.weight.numel() for m in model.modules()
               if isinstance(m, nn.Linear) and id(m) not in in_compressors)


def attention_flops_breakdown(config: ModelConfig, seq_len: int) -> dict[str, float]:
    """Forward matmul FLOPs per token of one attention layer, by part, averaged over the
    positions ``t = 0 … seq_len-1`` of a sequence (each part sums over all query heads).

    A query head attending to ``k`` keys costs ``2 * (Dk + Dv) * k`` (scores and weighted sum).
    Dense attention, ``{"dense"}``: ``k = t + 1`` (causal). NSA (``NSA_SPEC.md``):

    * ``"cmp"``: the compressed tokens visible at ``t``, those with ``i*d + l - 1 <= t``.
    * ``"slc"``: the keys ``<= t`` in the selected blocks: all ``t + 1`` while there are at most
      ``n`` candidate blocks, else ``(n - 1) * l'`` keys of full blocks plus the
      ``t mod l' + 1`` of the current block. Exact when ``num_local >= 1`` (the current block is
      forced); with ``num_local = 0`` the selection decides, and this is the lower bound.
    * ``"win"``: ``min(w, t + 1)`` keys.
    * ``"compressor"``: the MLP compressors of keys and values (``compressor="mlp"``), one
      ``l * D -> hidden -> D`` MLP per compressed token and KV head; 0 for ``"mean"``.

    Selection scores come from the compressed branch's probabilities (paper Eq. 8): 0 FLOPs.
    Mapping them onto selection blocks takes a few additions per visible compressed token
    (each overlaps at most ``l / l' + 1`` blocks); the PyTorch backend does it as a dense
    matmul with the overlap matrix, which is not counted either.
    ``force_branch`` changes nothing: all three branches are still computed.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    a, p = config.attention, config.attention.nsa
    per_key = 2 * (a.head_dim_k + a.head_dim_v) * a.num_heads
    t = np.arange(seq_len, dtype=np.int64)
    if a.kind == "dense":
        return {"dense": per_key * float(np.mean(t + 1))}
    block, stride = p.cmp_block, p.cmp_stride
    sel, n = p.sel_block, p.num_selected
    visible = np.where(t >= block - 1, (t - block + 1) // stride + 1, 0)
    selected = np.where(t // sel < n, t + 1, (n - 1) * sel + t % sel + 1)
    window = np.minimum(p.window, t + 1)
    num_compressed = 0 if seq_len < block else (seq_len - block) // stride + 1
    return {
        "compressor": compressor_flops(config) * num_compressed / seq_len,
        "cmp": per_key * float(np.mean(visible)),
        "slc": per_key * float(np.mean(selected)),
        "win": per_key * float(np.mean(window)),
    }


def compressor_flops(config: ModelConfig) -> int:
    """Forward FLOPs to make one compressed key and value for every KV head: the model's
    count. The layer runs a little more per call (Compressor: the position embedding's product
    once, and c - 1 extra chunks of the chunked product per sequence and KV head)."""
    a = config.attention
    if a.compressor != "mlp":
        return 0
    total = 0
    for head_dim in (a.head_dim_k, a.head_dim_v):
        hidden = a.compressor_hidden or 2 * head_dim  # as Compressor builds it
        total += 2 * (a.nsa.cmp_block * head_dim * hidden + hidden * head_dim)
    return total * a.num_kv_heads


def attention_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Forward matmul FLOPs per token of one attention layer: the parts of
    :func:`attention_flops_breakdown` summed."""
    return sum(attention_flops_breakdown(config, seq_len).values())


def model_flops_per_token(config: ModelConfig, seq_len: int, num_params_matmul: int) -> float:
    """Training (forward + backward) FLOPs per token of sequences of ``seq_len`` tokens.

    ``6 * num_params_matmul + 3 * num_layers * attention_flops_per_token``, with
    ``num_params_matmul = matmul_params(model)``. Dense attention counts the causal half of the
    score matrix, where PaLM-style MFU counts all of it.
    """
    attention = attention_flops_per_token(config, seq_len)
    return 6 * num_params_matmul + 3 * config.num_layers * attention


def peak_flops_for_name(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU by its CUDA name; None when it is not known here.

    H100 PCIe and NVL have lower clocks than the SXM part and get None, not its peak.
    """
    name = device_name.upper()
    if "H200" in name:
        return HOPPER_SXM_BF16
    if "H100" in name:
        return None if "PCIE" in name or "NVL" in name else HOPPER_SXM_BF16
    if "A100" in name:
        return A100_BF16
    return None


def peak_flops(device: torch.device | str) -> float | None:
    """Dense bf16 peak FLOP/s of one ``device``: None on the CPU or for an unknown GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device))


def flops_metrics(tokens_per_s: float, flops_per_token: float,
                  peak: float | None) -> dict[str, float]:
    """``{"tflops_per_s", "mfu"}`` for a metrics record; no ``"mfu"`` when ``peak`` is None.

    ``peak`` is the peak of all devices that produced ``tokens_per_s`` together (one device's
    :func:`peak_flops` times their number when the rate counts every rank's tokens).
    """
    achieved = tokens_per_s * flops_per_token
    record = {"tflops_per_s": achieved / 1e12}
    if peak is not None:
        record["mfu"] = achieved / peak
    return record
