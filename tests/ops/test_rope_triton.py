"""The Triton RoPE kernel (nsa/ops/triton/rope.py), which rotates up to three tensors a launch
(more take several), equals the PyTorch rotation of each, forward and backward: strided views of
one projection as the layer passes them, heads that differ per tensor, angles per sequence or
shared, a head dim whose half is not a power of two, an output left out of the loss; the inverse
undoes it, rope_into writes into strided views (copying the tensors it is told not to rotate),
the ops pass opcheck, and NSAttention rotates its queries and keys in one launch forward and,
with its unrotated keys and values copied, one per three tensors backward. ``rotate_many``
refuses tensors that disagree. On a machine without CUDA it runs in Triton's interpreter."""

from unittest import mock

import pytest
import torch

import nsa.layers.projection
from nsa.config_tree import replace_fields
from nsa.layers import AttentionConfig, NSAttention
from nsa.layers.rope import rope_angles, rope_frequencies, rotate_many, rotate_torch

pytest.importorskip("triton")

import nsa.ops.triton.rope  # noqa: E402
from nsa.ops.triton.rope import rope_into, rope_into_op, rope_op, rope_triton_many  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
HEADS = (3, 1, 2, 2, 1)  # heads of the tensors; more than ROPE_MAX_TENSORS: two launches


def angles(B_angles, T, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    positions = torch.rand(B_angles, T, generator=g) * 100  # fractional positions too
    return rope_angles(positions.to(DEVICE), rope_frequencies(D, 10000.0, DEVICE))


def projection(B, T, heads, D, dtype, seed=1):
    """A base tensor [B, T, sum(heads) + 1, D + 4] and a function of a leaf of it -> its
    strided views [B, T, heads_k, D] (as the layer's q, k_slc, k_win of one projection)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, T, sum(heads) + 1, D + 4, generator=g).to(DEVICE, dtype)
    starts = [1 + sum(heads[:k]) for k in range(len(heads))]  # head 0 is never read

    def views(leaf):
        return [leaf[:, :, s:s + h, 2:2 + D] for s, h in zip(starts, heads)]

    return base, views


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B_angles", [1, 2], ids=["shared-angles", "per-sequence"])
@pytest.mark.parametrize("D", [16, 10])
@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_triton_rope_equals_torch_forward_and_backward(count, D, B_angles, dtype):
    B, T, heads = 2, 7, HEADS[:count]
    base, views = projection(B, T, heads, D, dtype)
    cos, sin = angles(B_angles, T, D)
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(B, T, h, D, generator=g).to(DEVICE, dtype) for h in heads]

    def run(rotate):
        leaf = base.clone().requires_grad_()
        outs = rotate(views(leaf))
        (leaf_grad,) = torch.autograd.grad(outs, leaf, grads)
        return outs, leaf_grad

    outs, leaf_grad = run(lambda xs: rope_triton_many(xs, cos, sin))
    refs, ref_grad = run(lambda xs: [rotate_torch(x, cos, sin) for x in xs])
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    assert len(outs) == count
    for out, ref, h in zip(outs, refs, heads):
        assert out.dtype == dtype and out.shape == (B, T, h, D) and out.is_contiguous()
        torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(leaf_grad, ref_grad, **tol)
    assert leaf_grad[:, :, 0].abs().sum() == 0  # the head no view reads gets no gradient


def test_an_output_left_out_of_the_loss_leaves_the_others_grads_right():
    B, T, D = 2, 5, 16
    base, views = projection(B, T, HEADS, D, torch.float32)
    cos, sin = angles(2, T, D)

    def grad_of(rotate):
        leaf = base.clone().requires_grad_()
        outs = rotate(views(leaf))
        loss = outs[0].square().sum() + (outs[2] * torch.arange(D, device=DEVICE)).sum()
        return torch.autograd.grad(loss, leaf)[0]  # outs[1]'s gradient: zeros

    grad = grad_of(lambda xs: rope_triton_many(xs, cos, sin))
    ref = grad_of(lambda xs: [rotate_torch(x, cos, sin) for x in xs])
    torch.testing.assert_close(grad, ref, rtol=0, atol=1e-5)
    assert grad[:, :, 1 + HEADS[0]:1 + HEADS[0] + HEADS[1]].abs().sum() == 0


def test_inverse_rope_undoes_rope():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(1, 5, h, 8, generator=g).to(DEVICE) for h in HEADS]
    cos, sin = angles(1, 5, 8)
    back = rope_op(rope_op(xs, cos, sin, False), cos, sin, True)
    for x, x_back in zip(xs, back):
        torch.testing.assert_close(x_back, x, rtol=1e-5, atol=1e-5)


def test_rope_op_passes_opcheck():
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(2, 3, h, 8, generator=g).to(DEVICE) for h in (2, 1)]
    cos, sin = angles(2, 3, 8)
    torch.library.opcheck(rope_op, (xs, cos, sin, False))


@pytest.mark.parametrize("rotate", [(True,) * 5, (False, True, False, False, True)],
                         ids=["all-rotated", "some-copied"])
def test_rope_into_writes_the_rotations_into_strided_views(rotate):
    B, T, D = 2, 5, 8
    base, views = projection(B, T, HEADS, D, torch.float32)
    cos, sin = angles(2, T, D)
    target = torch.zeros(B, T, sum(HEADS) + 3, D + 2, device=DEVICE)
    starts = [3 + sum(HEADS[:k]) for k in range(len(HEADS))]
    outs = [target[:, :, s:s + h, 1:1 + D] for s, h in zip(starts, HEADS, strict=True)]
    rope_into(views(base), outs, cos, sin, True, list(rotate))
    for out, x, rotated in zip(outs, views(base), rotate, strict=True):
        if rotated:
            torch.testing.assert_close(out, rotate_torch(x, cos, -sin), rtol=0, atol=1e-6)
        else:
            assert out.equal(x)
    assert target[:, :, :3].abs().sum() == 0 and target[..., 0].abs().sum() == 0
    with pytest.raises(ValueError, match="must match"):
        rope_into(views(base)[:1], [torch.zeros(B, T, 3, D, dtype=torch.float64,
                                                device=DEVICE)], cos, sin, False, [True])
    with pytest.raises(ValueError, match="rotate flags"):
        rope_into(views(base), outs, cos, sin, False, [True])


def test_rope_into_op_passes_opcheck():
    g = torch.Generator().manual_seed(6)
    xs = [torch.randn(2, 3, h, 8, generator=g).to(DEVICE) for h in (2, 1)]
    outs = [torch.empty(2, 3, h, 8, device=DEVICE) for h in (2, 1)]
    torch.library.opcheck(rope_into_op, (xs, outs, *angles(2, 3, 8), True, [True, False]))


@pytest.mark.parametrize("kv_sharing", ["independent", "shared"])
def test_layer_rotates_its_queries_and_keys_in_one_launch(kv_sharing):
    """NSAttention through the kernel (one launch forward: q, k_slc and k_win, or q and the
    shared k; backward, their inverse rotations and copies of the keys and values read as they
    are, three tensors a launch) equals the layer through PyTorch, output and parameter
    gradients."""
    config = replace_fields(AttentionConfig(), dim=32, num_heads=4, num_kv_heads=2,
                            head_dim_k=8, head_dim_v=8, cmp_block=4, cmp_stride=2,
                            sel_block=8, num_selected=3, window=6, kv_sharing=kv_sharing)
    torch.manual_seed(0)
    layer = NSAttention(config).to(DEVICE)
    x = torch.randn(2, 11, 32, device=DEVICE)
    launches = []

    def launch(xs, outs, cos, sin, inverse, rotate):
        if xs[0].shape[1] == x.shape[1]:  # the tokens' rotation, not the compressed keys'
            launches.append(([t.shape[2] for t in xs], inverse, rotate))
        return real_launch(xs, outs, cos, sin, inverse, rotate)

    def run(kernel):
        layer.zero_grad()
        with mock.patch.object(nsa.layers.projection, "_use_kernel", lambda y: kernel):
            out = layer(x)
            out.square().sum().backward()
        return out, [p.grad.clone() for p in layer.parameters()]

    real_launch = nsa.ops.triton.rope._launch
    with mock.patch.object(nsa.ops.triton.rope, "_launch", launch):
        out, grads = run(True)
    if kv_sharing == "independent":  # q, then each K/V set's keys and values
        forward = ([4, 2, 2], False, [True] * 3)
        backward = ([4, 2, 2, 2, 2, 2, 2], True, [True, False, False, True, False, True, False])
    else:  # the shared keys read as they are add to their rotation's gradient: not copied
        forward = ([4, 2], False, [True] * 2)
        backward = ([4, 2, 2], True, [True, False, True])
    assert launches == [forward, backward]
    ref, ref_grads = run(False)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-5)


def test_rotate_many_rotates_each_tensor():
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 4, h, 8, generator=g).to(DEVICE) for h in HEADS]
    cos, sin = angles(2, 4, 8)
    for out, x in zip(rotate_many(xs, cos, sin), xs, strict=True):
        torch.testing.assert_close(out, rotate_torch(x, cos, sin), rtol=0, atol=1e-6)


def test_rotate_many_needs_a_tensor():
    with pytest.raises(ValueError, match="at least one"):
        rotate_many([], *angles(1, 4, 8))


# A tensor unlike x [2, 4, 2, 8] float32 in one of B, T, D, dtype, device (heads may differ).
UNLIKE = {"B": dict(shape=(1, 4, 2, 8)), "T": dict(shape=(2, 3, 2, 8)),
          "D": dict(shape=(2, 4, 2, 6)), "dtype": dict(dtype=torch.float64),
          "device": dict(device="meta")}


@pytest.mark.parametrize("field", UNLIKE)
def test_rotate_many_refuses_tensors_that_disagree(field):
    like = dict(shape=(2, 4, 3, 8), dtype=torch.float32, device=DEVICE) | UNLIKE[field]
    x = torch.zeros(2, 4, 2, 8, device=DEVICE)
    other = torch.zeros(like["shape"], dtype=like["dtype"], device=like["device"])
    with pytest.raises(ValueError, match="must agree"):
        rotate_many([x, torch.zeros_like(x), other], *angles(1, 4, 8))
