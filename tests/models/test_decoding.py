"""Decoding: prefill + one decode step per token equals one full forward, for mixed-length
batches, across compression-block boundaries, every G and both K/V sharing modes."""

import copy
from dataclasses import fields

import pytest
import torch

from nsa.config_tree import replace_fields
from nsa.models import LanguageModel, ModelConfig
from nsa.models.decoding import sample_token
from nsa.ops import NSAParams, nsa_select
from nsa.ops.decode import nsa_decode, tokens_read, visible_compressed

SMALL = dict(cmp_block=4, cmp_stride=2, sel_block=8, num_selected=3, window=5)
T = 41


def model_for(num_heads, num_kv_heads, attention="nsa", kv_sharing="independent",
              backend="torch", num_layers=2, **params):
    config = replace_fields(
        ModelConfig(), vocab_size=50, dim=32, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim_k=8, head_dim_v=6, max_seq_len=64, attention=attention,
        kv_sharing=kv_sharing, backend=backend, **{**SMALL, **params})
    torch.manual_seed(0)
    return LanguageModel(config).double().eval()


def decode_all(model, tokens, prompt_lengths, steps, decoder=None):
    """Prefill right-padded prompts, then ``steps`` decode steps (by ``decoder``, a model of
    the same weights, default ``model``) feeding each sequence its own next token. Returns
    {(b, position): logits} for every position a step produced."""
    B = tokens.shape[0]
    lengths = torch.tensor(prompt_lengths, device=tokens.device)
    cache = model.new_cache(B, T)
    logits = model.prefill(tokens[:, :max(prompt_lengths)], cache, lengths)
    produced = {(b, int(lengths[b]) - 1): logits[b] for b in range(B)}
    for _ in range(steps):
        pos = cache.lengths.clone()
        logits = (decoder or model).decode_step(tokens[torch.arange(B), pos], cache)
        produced.update({(b, int(pos[b])): logits[b] for b in range(B)})
    return produced


@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (8, 1)], ids=["G1", "G2", "G8"])
@pytest.mark.parametrize("kv_sharing", ["independent", "shared"])
def test_prefill_and_decode_equal_one_forward(heads, kv_sharing):
    model = model_for(*heads, kv_sharing=kv_sharing)
    tokens = torch.randint(0, 50, (3, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)  # [B, T, V]
        produced = decode_all(model, tokens, [1, 7, 13], steps=T - 13)
    assert len(produced) == 3 * (T - 13 + 1)
    for (b, position), logits in produced.items():
        torch.testing.assert_close(logits, full[b, position], rtol=1e-9, atol=1e-9,
                                   msg=f"sequence {b}, position {position}")


def test_skipping_the_compressed_update_changes_only_the_steps_that_complete_one():
    """decode_step(compress=False) leaves the cache and logits exactly as compress=True at
    every position where model.completes_compressed_token says no token completes, and
    leaves the compressed tokens behind where it says one does."""
    model = model_for(4, 2)
    tokens = torch.randint(0, 50, (2, T), generator=torch.Generator().manual_seed(3))
    completing = []
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, T)
        model.prefill(tokens[:, :3], cache)
        for position in range(3, T):
            skipped = copy.deepcopy(cache)
            logits_skipped = model.decode_step(tokens[:, position], skipped, compress=False)
            logits = model.decode_step(tokens[:, position], cache)
            torch.testing.assert_close(logits, full[:, position], rtol=1e-9, atol=1e-9)
            same = [torch.equal(getattr(a, f.name), getattr(b, f.name))
                    for a, b in zip(skipped.layers, cache.layers) for f in fields(a)
                    if getattr(a, f.name) is not None]
            if model.completes_compressed_token(position):
                completing.append(position)
                assert not all(same), position
            else:
                assert all(same) and torch.equal(logits_skipped, logits), position
    assert completing == list(range(3, T, 2))  # i·d + l - 1 with l = 4, d = 2


def test_generation_skips_the_compressed_update_exactly_where_none_completes():
    model = model_for(4, 2)
    prompt = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(4))
    decode_step, calls = model.decode_step, []

    def recorded(tokens, cache, compress=True):
        calls.append((int(cache.lengths[0]), compress))
        return decode_step(tokens, cache, compress)

    model.decode_step = recorded
    with torch.no_grad():
        generated = model.generate(prompt, 30, top_k=1)  # greedy
    del model.decode_step
    assert [position for position, _ in calls] == list(range(5, 34))
    assert all(compress == (position % 2 == 1) for position, compress in calls)  # l=4, d=2
    with torch.no_grad():
        cache = model.new_cache(2, 34)
        logits = model.prefill(prompt, cache)
        expected = [prompt]
        for step in range(30):
            expected.append(logits.argmax(-1, keepdim=True))
            if step < 29:  # the last token is not fed
                logits = model.decode_step(expected[-1][:, 0], cache)  # compress=True always
    assert torch.equal(generated, torch.cat(expected, 1))
    assert not model_for(4, 2, attention="dense").completes_compressed_token(3)


def test_dense_model_decodes_like_its_forward():
    model = model_for(4, 2, attention="dense")
    tokens = torch.randint(0, 50, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)
        produced = decode_all(model, tokens, [3, 10], steps=20)
    for (b, position), logits in produced.items():
        torch.testing.assert_close(logits, full[b, position], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_a_cache_keeps_the_fused_projection_its_steps_would_concatenate(attention):
    """The fused projection weight is made once with the cache (detached; each step would
    otherwise pad and concatenate the weights): steps with it equal steps that concatenate at
    every token, bit for bit, and they read the weights as they were when it was made."""
    model = model_for(4, 2, attention=attention)
    tokens = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([5, 9])

    def run(cache):
        logits = [model.prefill(tokens[:, :9], cache, lengths)]
        for _ in range(8):
            logits.append(model.decode_step(tokens[torch.arange(2), cache.lengths], cache))
        return torch.stack(logits)

    with torch.no_grad():
        kept = model.new_cache(2, 20)
        each_step = model.new_cache(2, 20)
        for layer, block in zip(kept.layers, model.blocks, strict=True):
            assert not layer.projection.requires_grad
            assert layer.projection.shape[1] == block.attn.q_proj.in_features
        for layer in each_step.layers:
            layer.projection = None
        assert torch.equal(run(kept), run(each_step))
        # A cache made while a weight was changed decodes differently after the weight is
        # restored: its steps read the weights it keeps.
        weight = model.blocks[0].attn.q_proj.weight
        restore = weight.clone()
        weight.add_(1.0)
        changed = model.new_cache(2, 20)
        weight.copy_(restore)
        assert not torch.equal(run(changed), run(kept))


def test_mean_compressor_and_no_forced_initial_block():
    model = model_for(4, 2, compressor="mean", num_init=0, num_local=1)
    tokens = torch.randint(0, 50, (1, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens)
        produced = decode_all(model, tokens, [5], steps=T - 5)
    for (b, position), logits in produced.items():
        torch.testing.assert_close(logits, full[b, position], rtol=1e-9, atol=1e-9)


def test_tokens_read_per_step_follow_the_spec():
    """The step attends to visible compressed + selected (<= t) + min(w, t + 1) tokens, and
    that is the spec's formula; check it against a count from the selection itself."""
    params = NSAParams(**SMALL)
    g = torch.Generator().manual_seed(4)
    B, S, H, G, D = 1, 60, 2, 2, 8
    C = (S - params.cmp_block) // params.cmp_stride + 1
    k, v = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, H, D, generator=g)
    k_cmp, v_cmp = torch.randn(B, C, H, D, generator=g), torch.randn(B, C, H, D, generator=g)
    for t in range(S):
        q = torch.randn(B, H * G, D, generator=g)
        pos = torch.tensor([t])
        _, read = nsa_decode(q, k, v, k_cmp, v_cmp, torch.rand(B, H * G, 3, generator=g), pos,
                             params, return_tokens_read=True)
        # The spec's count, from the blocks nsa_select picks for a query at t.
        qs = torch.zeros(1, t + 1, H * G, D)
        qs[0, t] = q[0]
        visible = int(visible_compressed(pos, params))
        blocks = nsa_select(qs, k_cmp[:, :visible], cmp_block=4, cmp_stride=2, sel_block=8,
                            num_selected=3, backend="torch")[0, t]  # [H, n]
        selected = [sum(min(8, t + 1 - 8 * j) for j in row.tolist() if j >= 0) for row in blocks]
        expected = torch.tensor([[visible + s + min(5, t + 1) for s in selected]])
        assert torch.equal(read, expected), t
        assert torch.equal(read, tokens_read(pos, params)[:, None].expand(B, H)), t


def test_sample_token_top_k_and_top_p():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).log_softmax(-1).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    assert set(sample_token(logits, top_k=2, generator=g).tolist()) == {2, 3}
    # probabilities ∝ e^0..e^3: 0.032, 0.087, 0.237, 0.644 — top_p 0.7 keeps {3, 2}
    assert set(sample_token(logits, top_p=0.7, generator=g).tolist()) == {2, 3}
    assert set(sample_token(logits, top_p=0.5, generator=g).tolist()) == {3}
    assert set(sample_token(logits, temperature=1e-9, generator=g).tolist()) == {3}


CUDA = torch.cuda.is_available()


def gpu_model():
    """A two-layer NSA model on the GPU whose blocks and window fit 200-token tests."""
    config = replace_fields(
        ModelConfig(), vocab_size=50, dim=64, num_layers=2, num_heads=8, num_kv_heads=2,
        head_dim_k=32, head_dim_v=32, max_seq_len=256, cmp_block=16, cmp_stride=8, sel_block=32,
        num_selected=4, window=48)
    torch.manual_seed(0)
    return LanguageModel(config).cuda().eval()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_gpu_decode_with_triton_prefill_and_cuda_graph(autocast):
    """On the GPU: prefill with the Triton kernels, decode eagerly and as a CUDA graph; both
    equal the (Triton) full forward, in float32 and, as the trainer samples, with float32
    weights under bf16 autocast (bf16 queries and cache); ``generate`` runs in both."""
    from nsa.models.decoding import GraphedDecodeStep

    model = gpu_model()
    tokens = torch.randint(0, 50, (2, 200), device="cuda")
    tolerance = 5e-2 if autocast else 1e-3
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        full = model(tokens).float()
        for graph in (False, True):
            cache = model.new_cache(2, 200)
            assert cache.layers[0].k.dtype == (torch.bfloat16 if autocast else torch.float32)
            model.prefill(tokens[:, :60], cache, torch.tensor([37, 60], device="cuda"))
            step = GraphedDecodeStep(model, cache) if graph else (
                lambda t, c=cache: model.decode_step(t, c))
            for _ in range(120):
                pos = cache.lengths.clone()
                logits = step(tokens[torch.arange(2, device="cuda"), pos]).float()
                for b in range(2):
                    torch.testing.assert_close(logits[b], full[b, pos[b]], rtol=tolerance,
                                               atol=tolerance)
        generated = model.generate(tokens[:, :20], 30, top_k=5)
    assert generated.shape == (2, 50) and bool((generated < 50).all())


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_graphs_with_and_without_the_compressed_update_equal_the_forward():
    """The graphed step's two graphs (an NSA model's steps that complete a compressed token,
    and the others, without the update) replayed as the sampling loop picks them."""
    from nsa.models.decoding import GraphedDecodeStep

    model = gpu_model()
    tokens = torch.randint(0, 50, (2, 160), device="cuda")
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, 160)
        step = GraphedDecodeStep(model, cache)
        assert set(step.graphs) == {True, False}
        model.prefill(tokens[:, :21], cache)
        for position in range(21, 160):
            compress = model.completes_compressed_token(position)
            logits = step(tokens[:, position], compress=compress)
            torch.testing.assert_close(logits, full[:, position], rtol=1e-3, atol=1e-3,
                                       msg=f"position {position}, compress={compress}")


def test_autocast_decode_with_triton_kernels():
    """Float32 weights under half-precision autocast, the Triton kernels: the cache follows
    the compute dtype, and a decode step meeting a cache of another dtype (a float32 cache,
    half queries) computes its products in the cache's dtype. bf16 on the GPU; fp16 on the
    CPU, where the Triton interpreter computes bf16 wrongly (fp16 and fp32 exactly) and where
    the forward and prefill compared against run on the PyTorch backend (the interpreted Triton
    forward takes minutes; tests/ops covers it), the decode steps on Triton; ``generate``
    (a 4-token prompt) runs on Triton throughout."""
    pytest.importorskip("triton")
    device = "cuda" if CUDA else "cpu"
    half = torch.bfloat16 if CUDA else torch.float16
    model = model_for(4, 2, backend="triton").float().to(device)
    prefiller = model if CUDA else model_for(4, 2).float()
    tokens = torch.randint(0, 50, (2, 24), device=device)
    with torch.no_grad(), torch.autocast(device, half):
        full = prefiller(tokens).float()
        for dtype in (None, torch.float32):
            cache = model.new_cache(2, 24, dtype=dtype)
            assert cache.layers[0].k.dtype == (dtype or half)
            prefiller.prefill(tokens[:, :16], cache)
            for pos in range(16, 24):
                logits = model.decode_step(tokens[:, pos], cache).float()
                torch.testing.assert_close(logits, full[:, pos], rtol=5e-2, atol=5e-2)
        assert model.generate(tokens[:, :4], 6).shape == (2, 10)  # all on Triton


def test_block_scores_from_equals_the_overlap_matrix():
    from nsa.ops.decode import block_scores_from
    from nsa.ops.torch_backend import block_overlap

    for params in (NSAParams(**SMALL), NSAParams(cmp_block=8, cmp_stride=2, sel_block=4,
                                                 num_selected=3, window=5)):
        p = torch.rand(2, 3, 17, dtype=torch.float64)
        NB = 11
        dense = p @ block_overlap(torch.arange(17), NB, params, torch.float64)
        torch.testing.assert_close(block_scores_from(p, NB, params), dense)


@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (8, 1)], ids=["G1", "G2", "G8"])
@pytest.mark.parametrize("kv_sharing", ["independent", "shared"])
def test_triton_decode_steps_equal_the_forward(heads, kv_sharing):
    """Prefill, then decode steps on the Triton kernels (the interpreter on the CPU), equal the
    forward in float32: prompts of 1, 20 and 35 tokens decoded to the cache's last position,
    so the steps see no compressed token yet, block boundaries and capacity - 1 (the forward
    and prefill on the PyTorch backend: the same weights, the same cache)."""
    pytest.importorskip("triton")
    device = "cuda" if CUDA else "cpu"
    model = model_for(*heads, kv_sharing=kv_sharing, num_layers=1).float().to(device)
    decoder = model_for(*heads, kv_sharing=kv_sharing, num_layers=1,
                        backend="triton").float().to(device)
    tokens = torch.randint(0, 50, (3, T), generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():
        full = model(tokens)  # [B, T, V]
        produced = decode_all(model, tokens, [1, 20, 35], steps=T - 35, decoder=decoder)
    assert max(position for _, position in produced) == T - 1
    for (b, position), logits in produced.items():
        torch.testing.assert_close(logits, full[b, position], rtol=1e-4, atol=1e-4,
                                   msg=f"sequence {b}, position {position}")
