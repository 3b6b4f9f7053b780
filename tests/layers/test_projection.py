"""A layer's fused projection (nsa/layers/projection.py): split_heads of the product of
fused_weight computes what the separate layers compute, with the same gradients for the input
and every weight, in groups aligned on 16 bytes; split_heads equals views of the product and
RoPE of the groups it rotates, forward and backward, with the PyTorch rotation and with the
Triton kernel (in its interpreter without a GPU), including a group read both rotated and not
(the gradients add) and columns no group reads (zero gradient); layouts and products that do
not fit are refused."""

from unittest import mock

import pytest
import torch
from torch import nn

import nsa.layers.projection
from nsa.config_tree import replace_fields
from nsa.layers.attention import attention_layer
from nsa.layers.projection import (
    FUSED_ALIGN,
    ROW_ALIGN,
    Heads,
    HeadsLayout,
    fused_columns,
    fused_product,
    split_heads,
)
from nsa.layers.rope import rope_angles, rope_frequencies, rotate_torch
from nsa.models import model_preset
from nsa.ops.triton_support import TRITON_AVAILABLE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_split_heads_of_the_fused_product_equals_the_layers():
    torch.manual_seed(0)
    layers = [nn.Linear(12, 8, bias=False), nn.Linear(12, 20, bias=False), nn.Linear(12, 6)]
    x = torch.randn(2, 5, 12, requires_grad=True)
    starts = fused_columns(*layers)
    # Layer 0 as 2 heads of 4, layer 1 as 2 heads of 10, layer 2 as 3 heads of 2.
    layout = HeadsLayout((Heads(starts[0], 2, 4, 4), Heads(starts[1], 2, 10, 10),
                          Heads(starts[2], 3, 2, 2)), starts[-1])
    # Each layer's rows padded to FUSED_ALIGN, the last's further to a width of ROW_ALIGN.
    assert starts == [0, 8, 32, ROW_ALIGN]
    heads = split_heads(fused_product(x, layers), layout)
    outputs = [heads[0].flatten(2), heads[1].flatten(2), heads[2].flatten(2) + layers[2].bias]
    for group, head in zip(layout.groups, heads, strict=True):
        assert head.storage_offset() % FUSED_ALIGN == 0 and head.stride(1) % FUSED_ALIGN == 0
        assert group.start % FUSED_ALIGN == 0
    expected = [layer(x) for layer in layers]
    for out, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(out, want)
    grads = [torch.randn_like(out) for out in outputs]
    params = [x] + [p for layer in layers for p in layer.parameters()]
    fused = torch.autograd.grad(outputs, params, grads)
    separate = torch.autograd.grad(expected, params, grads)
    for a, b in zip(fused, separate, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("preset", ["tiny", "m7c-125m"])
@pytest.mark.parametrize("kind", ["nsa", "dense"])
def test_a_layers_product_rows_start_on_a_line(preset, kind):
    """The attention layers' fused product is ROW_ALIGN wide (m7c-125m's NSA layer: 768 + 768 +
    36 gate columns, padded to 1600), so each token's row starts on a 128-byte line in bf16."""
    layer = attention_layer(replace_fields(model_preset(preset), attention=kind).attention)
    layers = layer._fused_layers()
    starts = fused_columns(*layers)
    assert starts[-1] % ROW_ALIGN == 0
    assert all(start % FUSED_ALIGN == 0 for start in starts)
    padding = starts[-1] - sum(x.out_features for x in layers)
    assert 0 <= padding < ROW_ALIGN + len(layers) * FUSED_ALIGN
    if preset == "m7c-125m":
        assert starts[-1] == (1600 if kind == "nsa" else 1024)


# Columns of a product of width 48: queries (3 heads of 4, rotated), keys and values interleaved
# per head (2 heads, Dk = 4, Dv = 6), the keys read rotated and as they are, a group of 2
# columns, one head of 4 read as it is (the kernel copies its gradient with the rotations');
# columns 32-33 and 40-47 read by none.
LAYOUT = HeadsLayout((Heads(0, 3, 4, 4, rotate=True), Heads(12, 2, 10, 4),
                      Heads(16, 2, 10, 6), Heads(12, 2, 10, 4, rotate=True),
                      Heads(34, 1, 2, 2), Heads(36, 1, 4, 4)), 48)


def reference(y, layout, cos, sin):
    """split_heads by autograd through views and rotate_torch."""
    return [rotate_torch(g.of(y), cos, sin) if g.rotate else g.of(y) for g in layout.groups]


KERNELS = [False] + ([True] if TRITON_AVAILABLE else [])


@pytest.mark.parametrize("kernel", KERNELS, ids=["torch", "triton"][:len(KERNELS)])
@pytest.mark.parametrize("B_angles", [1, 2], ids=["shared-angles", "per-sequence"])
def test_split_heads_equals_views_and_rotations(kernel, B_angles):
    g = torch.Generator().manual_seed(0)
    B, T = 2, 7
    y = torch.randn(B, T, LAYOUT.width, generator=g).to(DEVICE)
    cos, sin = rope_angles((torch.rand(B_angles, T, generator=g) * 50).to(DEVICE),
                           rope_frequencies(4, 10000.0, DEVICE))
    grads = [torch.randn(B, T, group.heads, group.dim, generator=g).to(DEVICE)
             for group in LAYOUT.groups]

    def run(split):
        leaf = y.clone().requires_grad_()
        outs = split(leaf)
        return outs, torch.autograd.grad(outs, leaf, grads)[0], leaf

    with mock.patch.object(nsa.layers.projection, "_use_kernel", lambda y: kernel):
        outs, grad, leaf = run(lambda leaf: split_heads(leaf, LAYOUT, cos, sin))
    refs, ref_grad, _ = run(lambda leaf: reference(leaf, LAYOUT, cos, sin))
    for out, ref, group in zip(outs, refs, LAYOUT.groups, strict=True):
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
        if not group.rotate:  # a view of the product
            assert out.untyped_storage().data_ptr() == leaf.untyped_storage().data_ptr()
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)
    assert grad[..., 32:34].abs().sum() == 0 and grad[..., 40:].abs().sum() == 0


def test_an_output_left_out_of_the_loss_gets_no_gradient():
    y = torch.randn(1, 3, LAYOUT.width, requires_grad=True)
    cos, sin = rope_angles(torch.arange(3.0), rope_frequencies(4, 10000.0))
    outs = split_heads(y, LAYOUT, cos, sin)
    (grad,) = torch.autograd.grad(outs[4].sum(), y)
    assert grad[..., 34:36].eq(1).all()
    assert grad[..., :34].abs().sum() == 0 and grad[..., 36:].abs().sum() == 0


@pytest.mark.parametrize("groups, match", [
    ((), "at least one"),
    ((Heads(0, 2, 4, 4), Heads(30, 2, 8, 4)), "does not fit"),
    ((Heads(0, 2, 2, 4),), "does not fit"),  # a stride below the head dim
    ((Heads(0, 2, 4, 4), Heads(2, 1, 4, 4)), "partly overlaps"),
    ((Heads(0, 2, 4, 4, rotate=True), Heads(0, 2, 4, 4, rotate=True)), "two rotated"),
])
def test_heads_layout_refuses_groups_that_do_not_fit(groups, match):
    with pytest.raises(ValueError, match=match):
        HeadsLayout(groups, 40)


def test_split_heads_refuses_a_product_of_another_width_and_missing_angles():
    with pytest.raises(ValueError, match="takes y"):
        split_heads(torch.zeros(1, 3, 39), LAYOUT, *rope_angles(torch.arange(3.0),
                                                               rope_frequencies(4, 1e4)))
    with pytest.raises(ValueError, match="needs cos and sin"):
        split_heads(torch.zeros(1, 3, 48), LAYOUT)
