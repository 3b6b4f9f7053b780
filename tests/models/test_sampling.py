"""The one sampling loop: its context rule against a naive reference (a full forward over the
tokens the rule says the model reads), one set of cache buffers across re-prefills (what a
CUDA graph of the decode step needs), and every argument checked with a clear ValueError."""

import dataclasses
import math

import pytest
import torch

import nsa.models.decoding as decoding
from nsa.config_tree import replace_fields
from nsa.models import LanguageModel, ModelConfig
from nsa.models.decoding import check_sampling, sample_token, stream_tokens

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: threads only wait
V = 50


def small_model(max_seq_len: int, attention: str = "nsa") -> LanguageModel:
    """Weights of std 1, not the training init's 0.02: then the next token depends on the
    context (which tokens, at which positions), so a loop reading another window than the
    rule's samples other tokens."""
    config = replace_fields(
        ModelConfig(), vocab_size=V, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim_k=8, head_dim_v=6, max_seq_len=max_seq_len, attention=attention, backend="torch",
        cmp_block=4, cmp_stride=2, sel_block=8, num_selected=3, window=5)
    torch.manual_seed(0)
    model = LanguageModel(config).double().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    return model


def reference_generate(model, prompt, max_new_tokens, sample):
    """The context rule, naively: each token from a full forward over the tokens the model
    reads: the prompt's last S; once that window would pass S tokens, the newest S // 2."""
    S = model.config.max_seq_len
    text, start = prompt, max(0, prompt.shape[1] - S)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            if text.shape[1] - start > S:
                start = text.shape[1] - max(1, S // 2)
            token = sample(model(text[:, start:])[:, -1])  # [B]
            text = torch.cat([text, token[:, None]], dim=1)
    return text[:, prompt.shape[1]:]


SAMPLINGS = {"greedy": dict(top_k=1), "seeded": dict(temperature=0.9, top_p=0.95)}


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("attention", ["nsa", "dense"])
@pytest.mark.parametrize("S,P,N", [(16, 3, 50), (16, 16, 40), (16, 40, 30), (9, 5, 30),
                                   (16, 5, 4)],
                         ids=["S16-P3-N50", "S16-P16-N40", "S16-P40-N30", "S9-P5-N30",
                              "S16-P5-N4"])
def test_generation_follows_the_context_rule(S, P, N, attention, sampling):
    """Past max_seq_len, with prompts shorter than, as long as and longer than it: token for
    token the naive rule (greedy, and seeded sampling with the same generator)."""
    model = small_model(S, attention)
    prompt = torch.randint(0, V, (2, P), generator=torch.Generator().manual_seed(P))
    kwargs = SAMPLINGS[sampling]
    out = model.generate(prompt, N, generator=torch.Generator().manual_seed(7), **kwargs)
    assert out.shape == (2, P + N) and torch.equal(out[:, :P], prompt)
    g = torch.Generator().manual_seed(7)
    expected = reference_generate(model, prompt, N,
                                  lambda logits: sample_token(logits, generator=g, **kwargs))
    assert torch.equal(out[:, P:], expected)


def test_a_model_of_one_position_generates():
    model = small_model(1, "dense")
    prompt = torch.tensor([[1, 2, 3]])
    out = model.generate(prompt, 6, top_k=1)
    assert torch.equal(out[:, 3:], reference_generate(model, prompt, 6,
                                                       lambda logits: logits.argmax(-1)))


def cache_buffers(cache) -> list[torch.Tensor]:
    layers = [getattr(layer, f.name) for layer in cache.layers
              for f in dataclasses.fields(layer)]
    return [cache.lengths, *(t for t in layers if t is not None)]


def test_the_decode_step_serves_one_cache_across_prefills(monkeypatch):
    """The loop builds its decode step (a CUDA graph with cuda_graph=True) once, and every
    prefill, re-prefills included, writes into the buffers that step was built on: a stand-in
    that, like a captured graph, only knows those buffers generates the right tokens."""
    built = []

    class BufferBoundStep:
        def __init__(self, model, cache):
            self.model, self.cache = model, cache
            self.buffers = [t.data_ptr() for t in cache_buffers(cache)]
            self.calls = 0
            built.append(self)

        def __call__(self, tokens, compress=True):
            assert [t.data_ptr() for t in cache_buffers(self.cache)] == self.buffers
            self.calls += 1
            return self.model.decode_step(tokens, self.cache, compress)

    monkeypatch.setattr(decoding, "GraphedDecodeStep", BufferBoundStep)
    model = small_model(16)
    prompt = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(3))
    tokens = torch.stack(list(stream_tokens(model, prompt, 60, top_k=1, cuda_graph=True)), 1)
    expected = reference_generate(model, prompt, 60, lambda logits: logits.argmax(-1))
    assert torch.equal(tokens, expected)
    assert len(built) == 1
    # 59 tokens fed: 6 decode steps fill the cache (positions 10-15); of the other 53, every
    # 9th is a re-prefill of the newest 8 tokens and the rest decode steps (positions 8-15).
    assert built[0].calls == 6 + 53 - 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_generation_equals_eager_past_max_seq_len():
    config = replace_fields(
        ModelConfig(), vocab_size=V, dim=64, num_layers=2, num_heads=8, num_kv_heads=2,
        head_dim_k=32, head_dim_v=32, max_seq_len=64, cmp_block=16, cmp_stride=8, sel_block=32,
        num_selected=3, window=24)
    torch.manual_seed(0)
    model = LanguageModel(config).cuda().eval()
    prompt = torch.randint(0, V, (2, 40), device="cuda")
    runs = [torch.stack(list(stream_tokens(model, prompt, 150, top_k=1, cuda_graph=graph)), 1)
            for graph in (False, True)]
    assert torch.equal(runs[0], runs[1])


def test_sample_token_top_k_one_is_greedy_and_small_temperatures_do_not_overflow():
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(0)) * 30
    assert torch.equal(sample_token(logits, top_k=1), logits.argmax(-1))
    assert torch.equal(sample_token(logits, temperature=1e-30), logits.argmax(-1))


BAD_SAMPLING = [
    ("max_new_tokens", 0), ("max_new_tokens", -4), ("max_new_tokens", 2.5),
    ("temperature", 0.0), ("temperature", -1.0), ("temperature", math.nan),
    ("temperature", math.inf), ("top_k", 0), ("top_k", -3), ("top_p", 0.0), ("top_p", 1.5),
    ("top_p", math.nan), ("top_p", -0.1),
]


@pytest.mark.parametrize("name,value", BAD_SAMPLING, ids=[f"{n}={v}" for n, v in BAD_SAMPLING])
def test_generate_refuses_bad_settings(name, value):
    model = small_model(16)
    settings = {"max_new_tokens": 5, name: value}
    with pytest.raises(ValueError, match=f"^{name} must be"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), **settings)
    with pytest.raises(ValueError, match=f"^{name} must be"):  # at the call, before any work
        stream_tokens(model, torch.zeros(1, 3, dtype=torch.long), **settings)
    if name != "max_new_tokens":
        with pytest.raises(ValueError, match=f"^{name} must be"):
            sample_token(torch.zeros(2, V), **{name: value})


def test_check_sampling_names_the_caller_s_flags():
    with pytest.raises(ValueError, match="^--max-tokens must be an integer >= 1, got -4"):
        check_sampling(max_new_tokens=-4, names={"max_new_tokens": "--max-tokens"})


@pytest.mark.parametrize("shape", [(1, 0), (0, 3), (3,)], ids=["P0", "B0", "1d"])
def test_generate_refuses_empty_or_misshapen_prompts(shape):
    with pytest.raises(ValueError, match="^prompt must have shape"):
        small_model(16).generate(torch.zeros(shape, dtype=torch.long), 5)


@pytest.mark.parametrize("batch,capacity,message", [
    (1, 0, "capacity must be"), (1, -2, "capacity must be"), (0, 8, "batch must be"),
    (1, 17, "capacity: 17 positions, more than the model's max_seq_len"),
])
def test_new_cache_refuses_bad_sizes(batch, capacity, message):
    with pytest.raises(ValueError, match=message):
        small_model(16).new_cache(batch, capacity)


def test_prefill_refuses_bad_prompts_and_lengths():
    model = small_model(16)
    cache = model.new_cache(2, 8)
    tokens = torch.zeros(2, 6, dtype=torch.long)
    cases = [
        (torch.zeros(2, 0, dtype=torch.long), None, "tokens must have shape"),
        (torch.zeros(3, 6, dtype=torch.long), None, "tokens hold 3 sequences, the cache 2"),
        (torch.zeros(2, 9, dtype=torch.long), None, "exceeds the cache capacity 8"),
        (torch.zeros(2, 17, dtype=torch.long), None, "more than the model's max_seq_len"),
        (tokens, torch.tensor([0, 6]), "lengths must be"),
        (tokens, torch.tensor([3, 7]), "lengths must be"),
        (tokens, torch.tensor([3]), "lengths must be"),
        (tokens, torch.tensor([3.0, 6.0]), "lengths must be"),
    ]
    for prompt, lengths, message in cases:
        with pytest.raises(ValueError, match=message):
            model.prefill(prompt, cache, lengths)
    model.prefill(tokens, cache, torch.tensor([1, 6]))  # in [1, P]: fine


def test_forward_refuses_more_than_max_seq_len():
    model = small_model(16)
    assert model(torch.zeros(1, 16, dtype=torch.long)).shape == (1, 16, V)
    with pytest.raises(ValueError, match=r"tokens: 17 positions, more than the model's "
                                         r"max_seq_len \(16\).*max_seq_len="):
        model(torch.zeros(1, 17, dtype=torch.long))
