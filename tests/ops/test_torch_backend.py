"""Properties of the PyTorch backend itself: chunking, linear memory, no host sync."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nsa import compressed_length, nsa_attention
from nsa.ops.params import NSAParams
from nsa.ops.torch_backend import nsa_attention_torch, nsa_select_torch

PARAMS = NSAParams(cmp_block=8, cmp_stride=4, sel_block=16, num_selected=4, window=24)


def random_inputs(B, T, HQ, H, Dk, Dv, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    Tc = compressed_length(T, PARAMS.cmp_block, PARAMS.cmp_stride)
    shapes = [(B, T, HQ, Dk), (B, T, H, Dk), (B, T, H, Dv), (B, Tc, H, Dk), (B, Tc, H, Dv)]
    tensors = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    gates = torch.rand(B, T, HQ, 3, generator=g, dtype=dtype)
    return [t.to(device) for t in (*tensors, gates)]


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("chunk", [1, 7, 16, 50])
def test_query_chunking_does_not_change_the_result(chunk, varlen):
    q, k, v, kc, vc, g = random_inputs(1 if varlen else 2, 83, 4, 2, 8, 6)
    cu = None
    if varlen:  # lengths 30, 1, 52: 6 + 0 + 12 compressed tokens
        cu = torch.tensor([0, 30, 31, 83], dtype=torch.int32)
        kc, vc = kc[:, :18], vc[:, :18]
    inputs = [t.requires_grad_() for t in (q, k, v, kc, vc, g)]
    scale = 8**-0.5
    whole = nsa_attention_torch(*inputs, k, v, PARAMS, scale, cu, chunk_size=1000)
    grads = torch.autograd.grad(whole.square().sum(), inputs)
    chunked = nsa_attention_torch(*inputs, k, v, PARAMS, scale, cu, chunk_size=chunk)
    chunked_grads = torch.autograd.grad(chunked.square().sum(), inputs)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)
    for a, b in zip(chunked_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(nsa_select_torch(q, kc, PARAMS, scale, cu, chunk_size=chunk),
                               nsa_select_torch(q, kc, PARAMS, scale, cu, chunk_size=1000))


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_grows_quadratically_in_T():
    """With a fixed query chunk, no intermediate (forward or backward) holds T x T scores."""
    T, chunk = 1024, 32
    q, k, v, kc, vc, g = random_inputs(1, T, 1, 1, 4, 4, dtype=torch.float32)
    inputs = [t.requires_grad_() for t in (q, k, v, kc, vc, g)]
    with LargestTensor() as mode:
        out = nsa_attention_torch(*inputs, k, v, PARAMS, 0.5, chunk_size=chunk)
        out.sum().backward()
    assert mode.largest <= chunk * T * 2, mode.largest
    assert mode.largest < T * T // 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_no_host_sync_on_cuda(varlen):
    B = 1 if varlen else 2
    q, k, v, kc, vc, g = random_inputs(B, 300, 4, 2, 16, 16, dtype=torch.bfloat16, device="cuda")
    cu = None
    if varlen:  # lengths 100 and 200: 24 + 49 compressed tokens
        cu = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
        kc, vc = kc[:, :73], vc[:, :73]
    inputs = [t.requires_grad_() for t in (q, k, v, kc, vc, g)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = nsa_attention(*inputs, cmp_block=8, cmp_stride=4, sel_block=16, num_selected=4,
                            window=24, cu_seqlens=cu, backend="torch")
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
