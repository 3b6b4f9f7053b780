"""fused_linear (one product for several linear layers) computes what the layers compute, with
the same gradients for the input and every weight and bias, in views aligned on 16 bytes."""

import pytest
import torch
from torch import nn

from nsa.layers.attention import FUSED_ALIGN, fused_linear


@pytest.mark.parametrize("biases", [(False, False, True), (True, False, True), (False,)])
def test_fused_linear_equals_the_layers(biases):
    torch.manual_seed(0)
    layers = [nn.Linear(12, width, bias=bias) for width, bias in zip((8, 20, 6), biases)]
    x = torch.randn(2, 5, 12, requires_grad=True)
    outputs = fused_linear(x, *layers)
    for out, layer in zip(outputs, layers, strict=True):
        if layer.bias is None:  # a view of the product: it starts and strides on 16 bytes
            assert out.storage_offset() % FUSED_ALIGN == 0
            assert out.stride(-2) % FUSED_ALIGN == 0
    expected = [layer(x) for layer in layers]
    for out, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(out, want)
    grads = [torch.randn_like(out) for out in outputs]
    params = [x] + [p for layer in layers for p in layer.parameters()]
    fused = torch.autograd.grad(outputs, params, grads)
    separate = torch.autograd.grad(expected, params, grads)
    for a, b in zip(fused, separate, strict=True):
        torch.testing.assert_close(a, b)
