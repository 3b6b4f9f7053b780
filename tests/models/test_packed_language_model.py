"""The language model on packed documents (cu_seqlens): each document's logits and gradients
are those it gets alone."""

import pytest
import torch

from nsa.config_tree import replace_fields
from nsa.models import LanguageModel, ModelConfig

LENGTHS = [5, 1, 17, 9]  # 32 tokens packed, more than max_seq_len; no document is longer
CONFIG = replace_fields(ModelConfig(), num_layers=2, max_seq_len=20, dim=32, num_heads=4,
                        num_kv_heads=2, head_dim_k=8, head_dim_v=8, cmp_block=4, cmp_stride=2,
                        sel_block=8, num_selected=2, num_local=1, window=6, backend="torch")


def offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("kind, checkpoint_blocks", [("nsa", False), ("nsa", True),
                                                     ("dense", False)],
                         ids=["nsa", "nsa-checkpointed", "dense"])
def test_packed_documents_equal_each_document_alone(kind, checkpoint_blocks):
    torch.manual_seed(0)
    model = LanguageModel(replace_fields(CONFIG, kind=kind))
    model.checkpoint_blocks = checkpoint_blocks
    tokens = torch.randint(0, 256, (1, sum(LENGTHS)))
    grad_logits = torch.randn(1, sum(LENGTHS), 256)
    params = list(model.parameters())

    def run(logits):
        return logits.detach(), torch.autograd.grad((logits * grad_logits).sum(), params)

    logits, grads = run(model(tokens, cu_seqlens=offsets(LENGTHS)))
    ref, ref_grads = run(torch.cat([model(doc) for doc in tokens.split(LENGTHS, dim=1)], dim=1))
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_packed_loss_is_the_mean_over_every_token():
    torch.manual_seed(0)
    model = LanguageModel(CONFIG)
    tokens = torch.randint(0, 256, (1, sum(LENGTHS) + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    logits = model(x, cu_seqlens=offsets(LENGTHS))
    expected = torch.nn.functional.cross_entropy(logits[0], y[0])
    torch.testing.assert_close(model(x, y, cu_seqlens=offsets(LENGTHS)), expected)


def test_documents_longer_than_max_seq_len_and_bad_offsets_raise():
    model = LanguageModel(CONFIG)
    tokens = torch.randint(0, 256, (1, 32))
    with pytest.raises(ValueError, match="document of cu_seqlens: 21 positions"):
        model(tokens, cu_seqlens=offsets([11, 21]))
    with pytest.raises(ValueError, match="cu_seqlens must end at T=32"):
        model(tokens, cu_seqlens=offsets([11, 20]))
    with pytest.raises(ValueError, match="cu_seqlens needs batch size 1"):
        model(tokens.view(2, 16), cu_seqlens=offsets([8, 8]))
