"""Packed documents (cu_seqlens): each document of a packed row is computed as if alone, in the
forward and the backward, and malformed offsets raise ValueError."""

import pytest
import torch

from nsa.config_tree import replace_fields
from nsa.layers import AttentionConfig, Compressor, DenseAttention, NSAttention
from nsa.layers.documents import pack_documents
from nsa.ops import NSAParams

# A document shorter than the compressed block (5 < l = 8 with the Triton case, and 1), one of
# a single token, one with several compressed tokens and selection blocks (17: at t >= 16 a
# query has 3 candidate blocks, more than n = 2, so top-n selection runs) and one in between.
LENGTHS = [5, 1, 17, 9]
SMALL = dict(cmp_block=4, cmp_stride=2, sel_block=8, num_selected=2, num_init=1, num_local=1,
             window=6)


def make_config(**overrides) -> AttentionConfig:
    base = dict(dim=32, num_heads=4, num_kv_heads=2, head_dim_k=8, head_dim_v=8, **SMALL)
    return replace_fields(AttentionConfig(), **{**base, **overrides})


def offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed_and_alone(layer, lengths, alone_layer=None):
    """(output, gradients w.r.t. (x, *parameters)) of the packed row, and of every document run
    alone (outputs concatenated, gradients summed over documents), by ``alone_layer`` (a copy
    of ``layer``) if given."""
    torch.manual_seed(0)
    device = next(layer.parameters()).device
    x = torch.randn(1, sum(lengths), layer.config.dim).to(device).requires_grad_()
    grad_out = torch.randn(1, sum(lengths), layer.config.dim).to(device)

    def run(module, out):
        inputs = [x, *module.parameters()]
        return out.detach(), torch.autograd.grad((out * grad_out).sum(), inputs, allow_unused=True)

    alone_layer = alone_layer or layer
    packed = run(layer, layer(x, offsets(lengths).to(device)))
    alone = run(alone_layer, torch.cat([alone_layer(doc) for doc in x.split(lengths, dim=1)], 1))
    return packed, alone


def assert_same(packed, alone, atol=1e-5):
    (out, grads), (ref, ref_grads) = packed, alone
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=atol)
    for g, r in zip(grads, ref_grads, strict=True):
        if r is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("overrides, lengths", [
    ({}, LENGTHS),
    ({"compressor": "mean", "kv_sharing": "shared"}, LENGTHS),
    ({}, [2, 0, 1, 3]),  # no compressed token at all, and an empty document
], ids=["mlp-independent", "mean-shared", "no-compressed-token"])
def test_nsa_layer_packed_equals_each_document_alone(overrides, lengths):
    layer = NSAttention(make_config(backend="torch", **overrides))
    assert_same(*packed_and_alone(layer, lengths))


def test_nsa_layer_packed_equals_each_document_alone_triton():
    """The Triton kernels read the layer's packed compressed tokens as the PyTorch backend does:
    the packed row on Triton (compiled on a GPU; interpreted on the CPU, so tiny: one KV head,
    documents of 5, 1 and 12 tokens with l = 8) equals each document alone on PyTorch."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = make_config(backend="triton", num_heads=2, num_kv_heads=1,
                         nsa=NSAParams(cmp_block=8, cmp_stride=4, sel_block=8, num_selected=2,
                                       num_local=1, window=4))
    layer = NSAttention(config).to(device)
    reference = NSAttention(replace_fields(config, backend="torch")).to(device)
    reference.load_state_dict(layer.state_dict())
    assert_same(*packed_and_alone(layer, [5, 1, 12], alone_layer=reference))


def test_dense_layer_packed_equals_each_document_alone():
    layer = DenseAttention(make_config(kind="dense"))
    assert_same(*packed_and_alone(layer, LENGTHS))


def test_packed_documents_restart_positions_and_compressed_tokens():
    p = NSAParams(**SMALL)
    docs = pack_documents(offsets(LENGTHS), 1, sum(LENGTHS), torch.device("cpu"), p)
    assert docs.positions.tolist() == [t for n in LENGTHS for t in range(n)]
    assert docs.max_length == 17
    # Compressed tokens per document: 5 -> 1, 1 -> 0, 17 -> 7, 9 -> 3 (never across a boundary).
    assert docs.cmp_index.tolist() == [0, *range(7), *range(3)]
    assert docs.cmp_first.tolist() == [0, *range(6, 20, 2), *range(23, 29, 2)]
    mask = docs.attention_mask()
    assert mask[5, 4] == mask[4, 5] == mask[6, 5] == 0 and mask[6, 6] and mask[22, 6]


def test_compressor_blocks_from_given_starts_match_the_strided_ones():
    comp = Compressor(head_dim=5, block=4, stride=2)
    x = torch.randn(2, 11, 3, 5)
    torch.testing.assert_close(comp(x, torch.arange(4) * 2), comp(x))


@pytest.mark.parametrize("cu, batch, message", [
    ([0, 5, 9], 1, "end at T=10"),
    ([1, 5, 10], 1, "start at 0"),
    ([0, 6, 5, 10], 1, "non-decreasing"),
    ([0, 10], 2, "batch size 1"),
    ([10], 1, r"shape \[N\+1\]"),
    ([[0, 10]], 1, r"shape \[N\+1\]"),
    (torch.tensor([0, 10]), 1, "int32"),
    ([0.0, 10.0], 1, "int32"),
    ([0, 10], 1, "torch.Tensor"),
    (torch.tensor([0, 10], dtype=torch.int32, device="meta"), 1, "is on meta"),
], ids=["end", "start", "decreasing", "batch", "rank0", "rank2", "int64", "float", "list",
        "device"])
@pytest.mark.parametrize("kind", ["nsa", "dense"])
def test_malformed_cu_seqlens_raise_value_error(cu, batch, message, kind):
    layer = (NSAttention if kind == "nsa" else DenseAttention)(make_config(kind=kind))
    if isinstance(cu, list) and message != "torch.Tensor":
        dtype = torch.float32 if message == "int32" else torch.int32
        cu = torch.tensor(cu, dtype=dtype)
    with pytest.raises(ValueError, match=f"cu_seqlens.*{message}|{message}.*cu_seqlens"):
        layer(torch.randn(batch, 10, 32), cu)


def test_documents_packed_for_another_layout_are_refused():
    layer = NSAttention(make_config())
    x = torch.randn(1, 10, 32)
    other = pack_documents(offsets([4, 6]), 1, 10, x.device, NSAParams(cmp_block=8, cmp_stride=4))
    with pytest.raises(ValueError, match="cmp_block, cmp_stride"):
        layer(x, other)
    with pytest.raises(ValueError, match=r"\[1, 10\]"):
        layer(torch.randn(1, 9, 32), pack_documents(offsets([4, 6]), 1, 10, x.device,
                                                    layer.config.nsa))
