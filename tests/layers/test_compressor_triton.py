"""The Triton MLP compressor (nsa/ops/triton/compressor.py) equals the PyTorch form of
``Compressor`` forward and backward (every parameter's gradient and the input's): strided
inputs as the layer passes them, head dims and hidden widths that are not powers of two,
T not a multiple of the stride, T equal to the block, one chunk per block (d = l) and four,
more rows than one program's; its gradients are deterministic and the same under activation
checkpointing, its ops pass opcheck, and a CUDA layer's compressors take it. On a machine
without CUDA it runs in Triton's interpreter (float32 exactly, float16 within its rounding;
bfloat16 on the GPU)."""

from unittest import mock

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from nsa.layers.compressor import Compressor, compress_all

pytest.importorskip("triton")

from nsa.ops.triton import compressor as triton_compressor  # noqa: E402
from nsa.ops.triton.compressor import (  # noqa: E402
    compress_backward_op,
    compress_op,
    compress_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (B, T, H, D, block, stride, hidden)
SHAPES = [
    (2, 37, 3, 10, 8, 4, 12),  # odd T, D and hidden; two chunks a block
    (1, 16, 1, 16, 16, 16, 32),  # T = block: one compressed token; one chunk a block
    (2, 90, 2, 8, 8, 2, 16),  # four chunks a block; 42 compressed tokens (ROWS patched to 16)
]


def compressor_and_input(B, T, H, D, block, stride, hidden, dtype, seed=0):
    """A Compressor with non-zero biases and position embedding, and x [B, T, H, D] as a
    strided view of a wider leaf (the layer's K/V sets are views of one projection)."""
    torch.manual_seed(seed)
    module = Compressor(D, block, stride, "mlp", hidden)
    with torch.no_grad():
        module.position.normal_()
        for layer in (module.mlp[0], module.mlp[2]):
            layer.bias.normal_()
    module = module.to(DEVICE, dtype)
    base = torch.randn(B, T, H + 1, D + 3, device=DEVICE).to(dtype)
    return module, base


def run(module, base, H, D, form):
    """(output, gradients of the base and every parameter) of ``form`` on x = base's view."""
    module.zero_grad(set_to_none=True)
    leaf = base.clone().requires_grad_()
    x = leaf[:, :, 1:1 + H, 1:1 + D]
    out = form(module, x)
    g = torch.Generator().manual_seed(3)
    out.backward(torch.randn(out.shape, generator=g).to(out.device, out.dtype))
    # Copies: moving the module to another device later moves its gradients in place.
    return [t.detach().clone() for t in [out, leaf.grad, *(p.grad for p in module.parameters())]]


def triton_form(module, x):
    return compress_triton([x], [module.weights()], module.block, module.stride,
                           module.mlp[0].weight.dtype)[0]


def torch_form(module, x):
    return module.forward(x.cpu()).to(x.device) if x.is_cuda else module(x)


@pytest.fixture
def small_rows(monkeypatch):
    """Programs of 16 rows, so that small shapes take several (and the last one partial)."""
    monkeypatch.setattr(triton_compressor, "ROWS", dict.fromkeys(triton_compressor.ROWS, 16))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_compressor_equals_torch_float32(shape, small_rows):
    B, T, H, D, block, stride, hidden = shape
    module, base = compressor_and_input(*shape, torch.float32)
    expected = run(module.cpu(), base.cpu(), H, D, torch_form)
    got = run(module.to(DEVICE), base, H, D, triton_form)
    names = ["out", "x"] + [n for n, _ in module.named_parameters()]
    for name, a, b in zip(names, got, expected):
        assert a.dtype == b.dtype, name
        # Sums in other orders (float32), and cancellation (the position's gradient sums
        # the hidden units' of b1 times W1): within 1e-5 of each tensor's scale.
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5 * b.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda"
                                                     else []), ids=str)
def test_triton_compressor_half_precision_within_rounding(dtype, small_rows):
    """In 16 bits against the float64 PyTorch form: within the dtype's rounding of the
    operands, dh and the output (relative to each tensor's scale)."""
    shape = SHAPES[0]
    B, T, H, D, block, stride, hidden = shape
    module, base = compressor_and_input(*shape, dtype)
    expected = run(module.double().cpu(), base.double().cpu(), H, D, torch_form)
    module, base = compressor_and_input(*shape, dtype)
    got = run(module, base, H, D, triton_form)
    tolerance = 3e-2 if dtype == torch.bfloat16 else 4e-3
    for a, b in zip(got, expected):
        assert torch.isfinite(a).all()
        scale = b.abs().max().item()
        assert (a.cpu().double() - b).abs().max().item() <= tolerance * scale


def test_triton_compressor_gradients_are_deterministic(small_rows):
    shape = SHAPES[2]
    module, base = compressor_and_input(*shape, torch.float32)
    first = run(module, base, shape[2], shape[3], triton_form)
    second = run(module, base, shape[2], shape[3], triton_form)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_triton_compressor_under_activation_checkpointing(small_rows):
    """Recomputed in the backward (non-reentrant checkpointing, as the trainer's
    activation_checkpointing), it gives the gradients of the plain run: its backward unpacks
    each saved tensor once."""
    shape = SHAPES[0]
    module, base = compressor_and_input(*shape, torch.float32)
    plain = run(module, base, shape[2], shape[3], triton_form)
    checkpointed = run(module, base, shape[2], shape[3],
                       lambda m, x: checkpoint(triton_form, m, x, use_reentrant=False))
    for a, b in zip(checkpointed, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_triton_compressor_ops_pass_opcheck(small_rows):
    B, T, H, D, block, stride, hidden = SHAPES[0]
    module, base = compressor_and_input(*SHAPES[0], torch.float32)
    xs = [base[:, :, :H, :D], base[:, :, 1:, 2:2 + D]]
    weights = [w.detach() for w in module.weights()] * 2
    torch.library.opcheck(compress_op, (xs, weights, block, stride),
                          test_utils=("test_schema", "test_faketensor"))
    out, pre = compress_op(xs, weights, block, stride)
    kept = [w for k, w in enumerate(weights) if k % 5 in (0, 1, 3)]
    torch.library.opcheck(compress_backward_op,
                          (list(torch.randn_like(out).unbind(0)), xs, pre, kept, block, stride),
                          test_utils=("test_schema", "test_faketensor"))


def test_two_compressors_in_one_launch_equal_each_alone(small_rows):
    """compress_all with a layer's two compressors (other weights, inputs at other columns of
    one projection) takes them in one Triton call, and each output and gradient equals its
    compressor's own PyTorch form."""
    B, T, H, D, block, stride, hidden = SHAPES[0]
    keys, base = compressor_and_input(*SHAPES[0], torch.float32, seed=0)
    values, _ = compressor_and_input(*SHAPES[0], torch.float32, seed=1)
    calls = []
    original = triton_compressor.compress

    def counting(*args):
        calls.append(len(args[0]))
        return original(*args)

    def run_both(form):
        for m in (keys, values):
            m.zero_grad(set_to_none=True)
        leaf = base.clone().requires_grad_()
        xs = [leaf[:, :, :H, :D], leaf[:, :, 1:1 + H, 2:2 + D]]
        outs = form(xs)
        g = torch.Generator().manual_seed(3)
        sum((o * torch.randn(o.shape, generator=g).to(o.device, o.dtype)).sum()
            for o in outs).backward()
        return [o.detach().clone() for o in outs] + [leaf.grad.clone()] + [
            p.grad.clone() for m in (keys, values) for p in m.parameters()]

    expected = run_both(lambda xs: [keys.cpu()(xs[0].cpu()), values.cpu()(xs[1].cpu())]
                        if DEVICE == "cuda" else [keys(xs[0]), values(xs[1])])
    keys.to(DEVICE), values.to(DEVICE)
    with mock.patch.object(triton_compressor, "compress", counting):
        got = run_both(lambda xs: compress_triton(xs, [keys.weights(), values.weights()],
                                                  block, stride, torch.float32))
    assert calls == [2]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-4, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("dims, kinds, batches", [
    ((8, 8), ("mlp", "mlp"), [2]),  # a layer's pair: one launch
    ((8, 8, 8), ("mlp", "mlp", "mlp"), [2, 1]),  # at most two slots a launch
    ((8, 6), ("mlp", "mlp"), [1, 1]),  # head dims differ: each alone
    ((8, 8), ("mlp", "mean"), [1]),  # the mean compressor never takes the kernels
])
def test_compress_all_batches_compressors_of_one_shape(dims, kinds, batches):
    """compress_all gives each compressor its own output, and hands the Triton kernels two
    compressors at a time only where their shapes agree (the kernels' eligibility forced on,
    so that the grouping is tested on any machine)."""
    torch.manual_seed(0)
    modules = [Compressor(D, 8, 4, kind).to(DEVICE) for D, kind in zip(dims, kinds)]
    xs = [torch.randn(2, 20, 2, D, device=DEVICE) for D in dims]
    expected = [m(x) for m, x in zip(modules, xs)]  # on a CPU: the PyTorch form
    calls = []
    original = triton_compressor.compress_triton

    def counting(xs, *args):
        calls.append(len(xs))
        return original(xs, *args)

    def eligible(self, x, first):
        return torch.float32 if self.kind == "mlp" else None

    with (mock.patch.object(Compressor, "triton_dtype", eligible),
          mock.patch.object(triton_compressor, "compress_triton", counting)):
        got = compress_all(modules, xs)
    assert calls == batches
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_compute_dtype_is_autocasts_then_the_weights():
    """The one rule the training kernels and the decode step's update both follow: the MLP
    computes in autocast's dtype where autocast is on for the input's device, else in its
    weights'; the mean compressor in the input's."""
    mlp, mean = Compressor(8, 8, 4, "mlp").to(torch.bfloat16), Compressor(8, 8, 4, "mean")
    x = torch.randn(1, 8, 1, 8, dtype=torch.float16)
    assert (mlp.compute_dtype(x), mean.compute_dtype(x)) == (torch.bfloat16, torch.float16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mlp.float().compute_dtype(x.float()) == torch.bfloat16
        assert mean.compute_dtype(x) == torch.float16
    with torch.autocast("cuda", dtype=torch.float16):  # another device's autocast: the weights'
        assert mlp.compute_dtype(x.float()) == torch.float32


@pytest.mark.skipif(DEVICE != "cuda", reason="the layer takes the Triton form on CUDA only")
def test_cuda_compressor_takes_triton_form_under_autocast():
    """On CUDA under bf16 autocast the module's forward is the Triton form (one autograd node
    of compress_triton) and agrees with the PyTorch form in float64."""
    shape = (2, 130, 2, 64, 32, 16, 128)  # m7c-125m's compressor
    B, T, H, D, block, stride, hidden = shape
    module, base = compressor_and_input(*shape, torch.float32)
    x = base[:, :, :H, :D]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = module(x)
    assert out.dtype == torch.bfloat16
    assert type(out.grad_fn).__name__ == "_CompressFunctionBackward"
    expected = module.double().cpu()(x.double().cpu())
    scale = expected.abs().max().item()
    assert (out.double().cpu() - expected).abs().max().item() <= 3e-2 * scale
