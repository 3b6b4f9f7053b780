from unittest import mock

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import nsa.layers.attention
from nsa.config_tree import replace_fields
from nsa.layers.attention import NSAttention
from nsa.layers.projection import fused_columns
from nsa.models import LanguageModel
from nsa.models.config import ModelConfig, model_preset
from nsa.ops import nsa_select
from nsa.ops.params import compressed_length
from nsa.train.flops import (
    A100_BF16,
    HOPPER_SXM_BF16,
    attention_flops_breakdown,
    attention_flops_per_token,
    compressor_flops,
    flops_metrics,
    matmul_params,
    model_flops_per_token,
    peak_flops,
    peak_flops_for_name,
)

# Small NSA shapes; seq_len is not a multiple of any block, and it passes n * l'.
SMALL = dict(dim=32, num_heads=4, num_kv_heads=2, head_dim_k=8, head_dim_v=4, cmp_block=8,
             cmp_stride=4, sel_block=8, num_selected=3, window=10)


def test_dense_attention_by_hand():
    config = replace_fields(
        ModelConfig(), kind="dense", num_heads=2, num_kv_heads=1, head_dim_k=4, head_dim_v=4)
    # positions 0..3 see 1, 2, 3, 4 keys: 2.5 on average; 2 heads, 2 * (4 + 4) per key.
    assert attention_flops_breakdown(config, 4) == {"dense": 2 * 2 * 8 * 2.5}
    assert attention_flops_per_token(config, 4) == 80.0


def brute_force_keys(config: ModelConfig, seq_len: int) -> dict[str, int]:
    """Keys read by all query heads over all positions, counted one by one; the selected
    blocks come from ``nsa_select`` on random scores."""
    c, p = config.attention, config.attention.nsa
    group = c.num_heads // c.num_kv_heads
    num_compressed = compressed_length(seq_len, p.cmp_block, p.cmp_stride)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq_len, c.num_heads, c.head_dim_k, generator=generator)
    k_cmp = torch.randn(1, num_compressed, c.num_kv_heads, c.head_dim_k, generator=generator)
    blocks = nsa_select(q, k_cmp, cmp_block=p.cmp_block, cmp_stride=p.cmp_stride,
                        sel_block=p.sel_block, num_selected=p.num_selected,
                        num_init=p.num_init, num_local=p.num_local, backend="torch")[0]
    counts = {"cmp": 0, "slc": 0, "win": 0}
    for t in range(seq_len):
        for h in range(c.num_heads):
            counts["cmp"] += sum(i * p.cmp_stride + p.cmp_block - 1 <= t
                                 for i in range(num_compressed))
            counts["slc"] += sum(j * p.sel_block + s <= t for j in blocks[t, h // group].tolist()
                                 if j >= 0 for s in range(p.sel_block))
            counts["win"] += sum(max(0, t - p.window + 1) <= s for s in range(t + 1))
    return counts


@pytest.mark.parametrize("overrides", [
    {},
    dict(num_init=0, num_local=1, num_selected=2, compressor="mean"),
    dict(sel_block=4, cmp_block=4, cmp_stride=2, window=1, compressor_hidden=5),
])
@pytest.mark.parametrize("seq_len", [5, 43])
def test_nsa_branches_match_a_count_per_position(overrides, seq_len):
    config = replace_fields(ModelConfig(), **{**SMALL, **overrides})
    breakdown = attention_flops_breakdown(config, seq_len)
    per_key = 2 * (config.attention.head_dim_k + config.attention.head_dim_v)
    for branch, keys in brute_force_keys(config, seq_len).items():
        assert breakdown[branch] == pytest.approx(per_key * keys / seq_len, rel=1e-12), branch


def test_selected_keys_are_a_lower_bound_without_a_forced_local_block():
    config = replace_fields(ModelConfig(), **{**SMALL, "num_local": 0, "num_selected": 2})
    counted = attention_flops_breakdown(config, 43)["slc"]
    a = config.attention
    exact = 2 * (a.head_dim_k + a.head_dim_v) * brute_force_keys(config, 43)["slc"] / 43
    assert counted <= exact


def compressor_extra_flops(config: ModelConfig) -> int:
    """FLOPs one layer's compressors run beyond the model's count (one MLP per compressed
    token) for one sequence: the position embedding's product (the first layer's bias, once per
    call) and the chunked product's c - 1 extra chunks per head (Compressor)."""
    a, p = config.attention, config.attention.nsa
    extra_chunks = p.cmp_block // p.cmp_stride - 1
    total = 0
    for head_dim in (a.head_dim_k, a.head_dim_v):
        hidden = a.compressor_hidden or 2 * head_dim
        total += 2 * (a.num_kv_heads * extra_chunks + 1) * p.cmp_block * head_dim * hidden
    return total


def test_compressor_flops_match_torch_flop_counter():
    config = replace_fields(ModelConfig(), **SMALL, compressor_hidden=24, num_layers=2)
    seq_len = 43
    model = LanguageModel(config)
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, seq_len, dtype=torch.long))
    counts = counter.get_flop_counts()
    measured = sum(sum(counts[f"LanguageModel.blocks.{i}.attn.compress_{kv}"].values())
                   for i in range(2) for kv in "kv")
    per_token = attention_flops_breakdown(config, seq_len)["compressor"]
    per_layer = per_token * seq_len + compressor_extra_flops(config)
    assert measured == pytest.approx(config.num_layers * per_layer, rel=1e-12)
    assert compressor_flops(replace_fields(config, compressor="mean")) == 0


def test_matmul_params_count_every_linear_outside_the_compressors():
    config = replace_fields(ModelConfig(), **SMALL, vocab_size=100, mlp_hidden=48)
    c = config.attention
    kv_width = 3 * c.num_kv_heads * (c.head_dim_k + c.head_dim_v)
    per_layer = (c.dim * c.num_heads * c.head_dim_k + c.dim * kv_width + c.dim * c.num_heads * 3
                 + c.num_heads * c.head_dim_v * c.dim + 3 * c.dim * 48)
    expected = config.num_layers * per_layer + config.vocab_size * c.dim
    assert matmul_params(LanguageModel(config)) == expected
    assert matmul_params(LanguageModel(replace_fields(config, tie_embeddings=False))) == expected


def test_linear_flops_match_torch_flop_counter():
    config = model_preset("tiny")
    seq_len = 40
    model = LanguageModel(config)
    # The attention op stubbed out (no products): every product left is a linear one, an mm or
    # addmm (the q, K/V and gate projections one fused mm per layer).
    def no_attention(q, k, v, *args, **kwargs):
        return q.new_zeros(*q.shape[:-1], v.shape[-1])

    with mock.patch.object(nsa.layers.attention, "nsa_attention", no_attention), \
            FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, seq_len, dtype=torch.long))
    model_counts = counter.get_flop_counts()["LanguageModel"]
    assert set(model_counts) == {torch.ops.aten.mm, torch.ops.aten.addmm}
    linear = model_counts[torch.ops.aten.mm] + model_counts[torch.ops.aten.addmm]
    compressors = config.num_layers * (attention_flops_breakdown(config, seq_len)["compressor"]
                                       + compressor_extra_flops(config) / seq_len)
    # fused_weight's zero rows (fused_columns' width past the layers' rows): multiplied all the
    # same
    padding = sum(2 * attention.config.dim
                  * (fused_columns(*layers)[-1] - sum(layer.out_features for layer in layers))
                  for attention in model.modules() if isinstance(attention, NSAttention)
                  for layers in [attention._fused_layers()])
    assert padding > 0  # tiny's 3 x 4 gates: the count above is exercised
    assert linear == pytest.approx((2 * matmul_params(model) + compressors + padding) * seq_len,
                                   rel=1e-12)


def test_nsa_reads_fewer_keys_than_dense_only_at_long_sequences():
    nsa = model_preset("m7c-125m")
    dense = replace_fields(nsa, attention="dense")
    short, long = 512, 65536
    assert attention_flops_per_token(nsa, short) > attention_flops_per_token(dense, short)
    # 64k: about 2k compressed tokens + 1k selected + 512 window keys against 32k on average.
    assert attention_flops_per_token(nsa, long) < attention_flops_per_token(dense, long) / 8


def test_model_flops_are_six_per_parameter_when_attention_is_negligible():
    config = replace_fields(
        ModelConfig(), attention="dense", vocab_size=1024, dim=64, num_layers=1, num_heads=1,
        num_kv_heads=1)
    model = LanguageModel(config)
    flops = model_flops_per_token(config, 1, matmul_params(model))
    assert flops == pytest.approx(6 * model.num_parameters(), rel=0.01)
    assert flops == 6 * matmul_params(model) + 3 * attention_flops_per_token(config, 1)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", HOPPER_SXM_BF16),
    ("NVIDIA H100 80GB HBM3", HOPPER_SXM_BF16),
    ("NVIDIA A100-SXM4-80GB", A100_BF16),
    ("NVIDIA H100 PCIe", None),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_flops_by_name(name, peak):
    assert peak_flops_for_name(name) == peak


def test_no_peak_on_the_cpu():
    assert peak_flops("cpu") is None


def test_flops_metrics():
    assert flops_metrics(1000.0, 2e9, peak=4e12) == {"tflops_per_s": 2.0, "mfu": 0.5}
    assert flops_metrics(1000.0, 2e9, peak=None) == {"tflops_per_s": 2.0}


def test_seq_len_must_be_positive():
    with pytest.raises(ValueError):
        attention_flops_breakdown(ModelConfig(), 0)
