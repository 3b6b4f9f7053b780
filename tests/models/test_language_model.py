"""The language model: gradients everywhere, the old hang shape, presets."""


import pytest
import torch

from nsa.config_tree import replace_fields
from nsa.layers import AttentionConfig
from nsa.models import MODEL_PRESETS, LanguageModel, ModelConfig, model_preset
from nsa.ops import NSAParams

# The shape on which the earlier system hung in backward at >= 5 layers.
HANG_SHAPE = ModelConfig(
    vocab_size=256, max_seq_len=128,
    attention=AttentionConfig(dim=128, num_heads=8, num_kv_heads=2, head_dim_k=16, head_dim_v=16,
                              nsa=NSAParams(cmp_block=16, cmp_stride=8, sel_block=32,
                                            num_selected=8, window=64)),
)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
@pytest.mark.parametrize("kv_sharing", ["independent", "shared"])
def test_every_parameter_gets_a_nonzero_gradient(attention, kv_sharing):
    torch.manual_seed(0)
    config = replace_fields(model_preset("showcase"), attention=attention, kv_sharing=kv_sharing,
                     num_layers=2)
    model = LanguageModel(config)
    tokens = torch.randint(0, 256, (2, 65))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum()]
    assert not missing


@pytest.mark.parametrize("num_layers", [5, 12])
def test_old_hang_shape_forward_backward_completes(num_layers):
    torch.manual_seed(0)
    model = LanguageModel(replace_fields(HANG_SHAPE, num_layers=num_layers))
    tokens = torch.randint(0, 256, (1, 129))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


def test_logits_are_causal():
    torch.manual_seed(0)
    model = LanguageModel(replace_fields(model_preset("showcase"), num_layers=2)).double()
    tokens = torch.randint(0, 256, (1, 80))
    logits = model(tokens)
    changed = tokens.clone()
    changed[:, 50:] = (changed[:, 50:] + 1) % 256
    torch.testing.assert_close(model(changed)[:, :50], logits[:, :50], rtol=0, atol=1e-10)


def test_generate_appends_tokens():
    torch.manual_seed(0)
    model = LanguageModel(replace_fields(model_preset("showcase"), max_seq_len=16))
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), max_new_tokens=20, top_k=5)
    assert out.shape == (2, 23) and out.dtype == torch.long


def test_presets():
    m7c = MODEL_PRESETS["m7c-125m"]
    a, p = m7c.attention, m7c.attention.nsa
    assert (m7c.dim, m7c.num_layers, a.num_heads, a.num_kv_heads) == (768, 12, 12, 2)
    assert (p.cmp_block, p.cmp_stride, p.sel_block, p.num_selected, p.window) == (
        32, 16, 64, 16, 512)
    showcase = MODEL_PRESETS["showcase"]
    assert (showcase.dim, showcase.num_layers, showcase.attention.num_heads,
            showcase.max_seq_len) == (128, 1, 8, 128)
    with pytest.raises(ValueError, match="preset"):
        model_preset("huge")
    with pytest.raises(ValueError, match="attention"):
        model_preset("tiny", attention="linear")


def test_tokens_must_be_rank_two():
    model = LanguageModel(model_preset("showcase"))
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(5, dtype=torch.long))


def test_activation_checkpointing_recomputes_the_same_graph():
    """Per-block checkpointing recomputes the forward in backward (selection included): the
    gradients equal those of the plain model exactly."""
    config = replace_fields(
        ModelConfig(), vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim_k=8, head_dim_v=8, max_seq_len=40, cmp_block=4, cmp_stride=2, sel_block=8,
        num_selected=3, window=5)
    torch.manual_seed(0)
    model = LanguageModel(config)
    tokens, targets = torch.randint(0, 64, (2, 37)), torch.randint(0, 64, (2, 37))
    plain = torch.autograd.grad(model(tokens, targets), list(model.parameters()))
    model.checkpoint_blocks = True
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(tokens, targets)
    recomputed = torch.autograd.grad(loss, list(model.parameters()))
    assert len(saved) < 40  # block internals are not kept for backward
    for (name, _), a, b in zip(model.named_parameters(), recomputed, plain, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed-documents"])
@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_a_forward_computes_the_rope_angles_once_for_all_layers(attention, packed):
    """RoPE's cos/sin depend on the positions only: one set per forward (NSA: the tokens' and
    the compressed tokens' centres), not one per layer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCos(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountCos.calls += func.__name__.startswith("cos")
            return func(*args, **(kwargs or {}))

    model = LanguageModel(replace_fields(HANG_SHAPE, attention=attention, num_layers=3))
    tokens = torch.randint(0, 256, (1, 100))
    cu_seqlens = torch.tensor([0, 37, 100], dtype=torch.int32) if packed else None
    with torch.no_grad(), CountCos():
        model(tokens, cu_seqlens=cu_seqlens)
    assert CountCos.calls == (2 if attention == "nsa" else 1)


def test_fsdp_mixed_precision_leaves_the_shared_rope_angles_in_float32():
    """FSDP2's MixedPrecisionPolicy casts the floating tensors of a block's inputs to bf16
    (through tuples and dataclasses, with this function); the angles a model passes to its
    blocks must come through as they are."""
    from torch.distributed.utils import _apply_to_tensors

    model = LanguageModel(replace_fields(HANG_SHAPE, num_layers=1))
    angles = model.blocks[0].attn.position_angles(40, None, torch.device("cpu"))
    x = torch.randn(1, 40, 128)
    to_bf16 = lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t  # noqa: E731
    cast_x, _, cast_angles = _apply_to_tensors(to_bf16, (x, None, angles))
    assert cast_x.dtype == torch.bfloat16  # what the policy does to a block's activations
    assert cast_angles is angles
    assert {t.dtype for t in (*angles.tokens, *angles.compressed)} == {torch.float32}


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_the_cpu_model_trains_and_decodes_without_triton(attention, monkeypatch):
    """A CPU install has no Triton (torch's CPU wheel does not bring it; `make train` installs
    none): the model's forward, backward and decoding must import nothing of it."""
    import sys

    for name in [n for n in sys.modules if n == "triton" or n.startswith(("triton.",
                                                                          "nsa.ops.triton."))]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    monkeypatch.setitem(sys.modules, "triton", None)
    torch.manual_seed(0)
    model = LanguageModel(replace_fields(HANG_SHAPE, attention=attention, num_layers=2))
    tokens = torch.randint(0, 256, (2, 40))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert model.generate(tokens[:, :5], max_new_tokens=3).shape == (2, 8)
