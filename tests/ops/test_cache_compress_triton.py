"""The Triton compressed-token update of a decode step (nsa/ops/triton/cache_compress.py)
writes the compressed caches as the PyTorch form (``NSAttention._append_compressed`` off CUDA)
does: both compressors, Dk != Dv with Dv / 2 not a power of two, a hidden width that is not a
power of two, the MLP's first product in one slice or several (summed in one step or
several), sequences that complete a token at the first and the last slot and sequences
that complete none (their rows keep what they held). On a machine without CUDA it runs in
Triton's interpreter (float32 and float16 exactly; bfloat16 on the GPU)."""

import copy

import pytest
import torch

from nsa.layers.attention import AttentionConfig, NSAttention, compressed_rope_table
from nsa.layers.cache import NSACache
from nsa.ops.params import NSAParams

pytest.importorskip("triton")

from nsa.ops.triton import cache_compress  # noqa: E402
from nsa.ops.triton.cache_compress import compress_step_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
PARAMS = NSAParams(cmp_block=4, cmp_stride=2, sel_block=8, num_selected=3, window=5)
B, H, DK, DV, NUM_CMP = 4, 2, 8, 6, 10
POSITIONS = [3, 6, 21, 12]  # complete token 0; none; token 9 (the last slot); none


def layer_and_cache(compressor, dtype):
    config = AttentionConfig(dim=16, num_heads=4, num_kv_heads=H, head_dim_k=DK,
                             head_dim_v=DV, nsa=PARAMS, compressor=compressor,
                             compressor_hidden=10 if compressor == "mlp" else None)
    torch.manual_seed(0)
    layer = NSAttention(config).to(DEVICE, dtype)
    g = torch.Generator().manual_seed(1)
    make = lambda n, d: torch.randn(B, n, H, d, generator=g).to(DEVICE, dtype)  # noqa: E731
    cache = NSACache(k=make(1, DK), v=make(1, DV), k_win=None, v_win=None,
                     src_k=make(PARAMS.cmp_block, DK), src_v=make(PARAMS.cmp_block, DV),
                     k_cmp=make(NUM_CMP, DK), v_cmp=make(NUM_CMP, DV))
    return layer, cache


# (compressor, inputs per program of the MLP's first product, FIRST_PRODUCT_TILE): the
# defaults; slices of 16 inputs (l·Dk = 32: two; l·Dv = 24: two, the second half empty);
# slices of 8 summed two at a time by the finishing kernel (Dv: three, the second step one
# short).
CASES = [("mlp", None, None), ("mlp", 16, None), ("mlp", 8, 32), ("mean", None, None)]


@pytest.mark.parametrize("compressor,inputs,tile", CASES,
                         ids=["mlp", "mlp-16-inputs", "mlp-8-inputs-summed-two-at-a-time",
                              "mean"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_compressed_update_equals_the_pytorch_form(compressor, inputs, tile, dtype,
                                                          monkeypatch):
    if tile is not None:
        monkeypatch.setattr(cache_compress, "FIRST_PRODUCT_TILE", tile)
    layer, cache = layer_and_cache(compressor, dtype)
    pos = torch.tensor(POSITIONS, device=DEVICE)
    k_cmp, v_cmp = cache.k_cmp.clone(), cache.v_cmp.clone()
    # The PyTorch form: the layer on CPU tensors (on CUDA it would take the kernel).
    reference = copy.deepcopy(layer).cpu()
    want = NSACache(**{n: None if t is None else t.cpu().clone() for n, t in vars(cache).items()})
    with torch.no_grad():
        rope = compressed_rope_table(NUM_CMP, PARAMS.cmp_block, PARAMS.cmp_stride, DK,
                                     layer.config.rope_base, torch.device(DEVICE))
        compress_step_triton(cache.src_k, pos, layer.compress_k, k_cmp, dtype, rope,
                             inputs_per_program=inputs)
        compress_step_triton(cache.src_v, pos, layer.compress_v, v_cmp, dtype,
                             inputs_per_program=inputs)
        reference._append_compressed(want, pos.cpu())
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    written = torch.zeros(B, NUM_CMP, dtype=torch.bool)
    written[0, 0] = written[2, 9] = True
    for name, got, expected, old in (("k_cmp", k_cmp, want.k_cmp, cache.k_cmp),
                                     ("v_cmp", v_cmp, want.v_cmp, cache.v_cmp)):
        got, expected, old = got.cpu().float(), expected.float(), old.cpu().float()
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol, msg=name)
        assert torch.equal(got[~written], old[~written]), f"{name}: a row not completed changed"
        assert not torch.equal(got[written], old[written]), f"{name}: nothing written"


def test_inputs_per_program_must_be_a_power_of_two():
    layer, cache = layer_and_cache("mlp", torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        compress_step_triton(cache.src_k, torch.tensor(POSITIONS, device=DEVICE),
                             layer.compress_k, cache.k_cmp, torch.float32,
                             inputs_per_program=12)
