"""NSAttention / DenseAttention: causality, every option, gradients, config errors."""

import pytest
import torch

from nsa.config_tree import replace_fields
from nsa.layers import AttentionConfig, Compressor, DenseAttention, NSAttention
from nsa.layers.attention import BRANCHES

SMALL = dict(cmp_block=4, cmp_stride=2, sel_block=8, num_selected=3, window=6)


def make_config(**overrides) -> AttentionConfig:
    """A small config; fields by name, the block parameters (``window``, ...) included."""
    base = dict(dim=32, num_heads=4, num_kv_heads=2, head_dim_k=8, head_dim_v=8, **SMALL)
    return replace_fields(AttentionConfig(), **{**base, **overrides})


def layer_id(value) -> str:
    return "-".join(f"{k}={v}" for k, v in value.items()) or "default"


LAYER_VARIANTS = [
    {},
    {"kv_sharing": "shared"},
    {"compressor": "mean"},
    {"force_branch": "cmp"},
    {"force_branch": "slc"},
    {"force_branch": "win"},
    {"num_heads": 2, "num_kv_heads": 2},  # G = 1
    {"num_heads": 6, "num_kv_heads": 2},  # G = 3
    {"num_heads": 8, "num_kv_heads": 1},  # G = 8
    {"head_dim_k": 12, "head_dim_v": 6},  # Dk != Dv
]


@pytest.mark.parametrize("overrides", LAYER_VARIANTS, ids=layer_id)
@pytest.mark.parametrize("T", [1, 3, 19, 40])
def test_layer_is_causal(overrides, T):
    torch.manual_seed(0)
    layer = NSAttention(make_config(**overrides)).double()
    x = torch.randn(2, T, 32, dtype=torch.float64)
    out = layer(x)
    assert out.shape == x.shape and torch.isfinite(out).all()
    for t in sorted({0, T // 2, T - 2}):
        if t < 0:
            continue
        changed = x.clone()
        changed[:, t + 1:] = torch.randn_like(changed[:, t + 1:]) * 3
        out2 = layer(changed)
        torch.testing.assert_close(out2[:, : t + 1], out[:, : t + 1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("kv_sharing", ["independent", "shared"])
@pytest.mark.parametrize("compressor", ["mlp", "mean"])
def test_every_layer_parameter_gets_a_gradient(kv_sharing, compressor):
    torch.manual_seed(0)
    layer = NSAttention(make_config(kv_sharing=kv_sharing, compressor=compressor))
    layer(torch.randn(2, 40, 32)).square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_layer_trains_under_cpu_bf16_autocast():
    """The PyTorch backend's backward under bf16 autocast (its value product ran in bf16, so
    the output gradient comes in bf16 while the saved probabilities and values do not): the
    gradients agree with float32's to bf16 precision."""
    torch.manual_seed(0)
    layer = NSAttention(make_config(backend="torch"))
    x = torch.randn(2, 40, 32)
    grads = []
    for enabled in (False, True):
        layer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            out = layer(x)
        out.float().square().sum().backward()
        grads.append({name: p.grad.clone() for name, p in layer.named_parameters()})
    for name, exact in grads[0].items():
        torch.testing.assert_close(grads[1][name], exact, rtol=0.1,
                                   atol=0.05 * exact.abs().max().item())


@pytest.mark.parametrize("branch", BRANCHES)
def test_a_forced_branch_leaves_no_parameter_without_a_gradient(branch):
    """The window-only ablation trains under DDP too: every parameter, the unused gates'
    included, must get a gradient (zero where the branch is off), or the ranks wait forever."""
    torch.manual_seed(0)
    layer = NSAttention(make_config(force_branch=branch))
    layer(torch.randn(2, 40, 32)).square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None, name
    assert not layer.gate_proj.weight.grad.any()  # forced: the gates do not move


def test_dense_layer_matches_explicit_causal_attention():
    torch.manual_seed(0)
    config = make_config()
    layer = DenseAttention(config).double()
    x = torch.randn(1, 9, 32, dtype=torch.float64)
    out = layer(x)
    changed = x.clone()
    changed[:, 5:] += 1
    torch.testing.assert_close(layer(changed)[:, :5], out[:, :5], rtol=0, atol=1e-12)


def test_window_only_layer_with_large_window_equals_dense_attention():
    """Window branch with w >= T is causal attention: the NSA layer then equals the dense one."""
    torch.manual_seed(0)
    config = make_config(force_branch="win", kv_sharing="shared", window=64)
    nsa_layer = NSAttention(config).double()
    dense = DenseAttention(config).double()
    dense.q_proj.load_state_dict(nsa_layer.q_proj.state_dict())
    dense.kv_proj.load_state_dict(nsa_layer.kv_proj.state_dict())
    dense.o_proj.load_state_dict(nsa_layer.o_proj.state_dict())
    x = torch.randn(2, 37, 32, dtype=torch.float64)
    torch.testing.assert_close(nsa_layer(x), dense(x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["mlp", "mean"])
@pytest.mark.parametrize("T", [3, 4, 11])
def test_compressor_shapes_and_blocks(kind, T):
    comp = Compressor(head_dim=5, block=4, stride=2, kind=kind)
    x = torch.randn(2, T, 3, 5)
    out = comp(x)
    expected = 0 if T < 4 else (T - 4) // 2 + 1
    assert out.shape == (2, expected, 3, 5)
    if kind == "mean" and expected > 1:
        torch.testing.assert_close(out[:, 1], x[:, 2:6].mean(dim=1))


@pytest.mark.parametrize("block, stride, T", [
    (32, 16, 100),  # the paper's: two chunks of 16 per block
    (4, 2, 11), (6, 2, 23),  # two and three chunks per block
    (5, 5, 17),  # blocks that do not overlap: one chunk each
    (8, 1, 30),  # one-token chunks
    (4, 2, 4), (4, 2, 3),  # one block; none
])
def test_mlp_compressor_is_the_mlp_of_each_block_plus_its_position_embedding(block, stride, T):
    """The definition, float64, values and gradients: the forward takes the embedding in the
    bias and the product from chunks of stride tokens, never building the blocks."""
    torch.manual_seed(0)
    comp = Compressor(head_dim=5, block=block, stride=stride).double()
    x = torch.randn(2, T, 3, 5, dtype=torch.float64, requires_grad=True)
    Tc = 0 if T < block else (T - block) // stride + 1
    got = comp(x)
    assert got.shape == (2, Tc, 3, 5)
    if Tc:
        blocks = torch.stack([x[:, i * stride:i * stride + block] for i in range(Tc)], dim=1)
        want = comp.mlp((blocks.transpose(2, 3) + comp.position).flatten(-2))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        inputs = [x, *comp.parameters()]
        for g, w in zip(torch.autograd.grad(got.square().sum(), inputs),
                        torch.autograd.grad(want.square().sum(), inputs)):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_compressor_stride_must_divide_its_block():
    with pytest.raises(ValueError, match=r"stride \(3\) must divide block \(8\)"):
        Compressor(head_dim=5, block=8, stride=3)


@pytest.mark.parametrize(
    "overrides, name",
    [
        ({"num_heads": 6, "num_kv_heads": 4}, "num_heads"),
        ({"head_dim_k": 7}, "head_dim_k"),
        ({"kv_sharing": "both"}, "kv_sharing"),
        ({"compressor": "max"}, "compressor"),
        ({"force_branch": "all"}, "force_branch"),
        ({"backend": "cuda"}, "backend"),
        ({"cmp_stride": 3}, "cmp_stride"),
        ({"num_selected": 2, "num_init": 1, "num_local": 2}, "num_selected"),
        ({"window": 0}, "window"),
    ],
)
def test_bad_config_raises_value_error(overrides, name):
    with pytest.raises(ValueError, match=name):
        make_config(**overrides)
