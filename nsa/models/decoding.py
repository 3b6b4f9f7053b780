"""Token-by-token generation with a KV cache, optionally replaying a CUDA graph per step."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from nsa.models.transformer import LanguageModel, ModelCache, sample_token


def capture_cuda_graph(fn, reset=lambda: None):
    """Record ``fn()`` in a CUDA graph -> (graph, fn's output, whose memory every replay
    rewrites). ``fn`` is run twice first on a side stream, as capture requires; ``reset()``
    after each of those runs undoes any state they changed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
            reset()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()  # recorded, not run: no state to reset
    return graph, output


class GraphedDecodeStep:
    """``model.decode_step`` captured once in a CUDA graph and replayed for every token: one
    launch per step instead of hundreds of small ones. The cache's buffers are the graph's
    static memory, so it serves exactly the ``cache`` it was built for."""

    def __init__(self, model: LanguageModel, cache: ModelCache):
        self.tokens = torch.zeros_like(cache.lengths)
        lengths = cache.lengths.clone()
        # The warm-up runs write keys/values at the current positions and advance the lengths;
        # restoring the lengths makes the next real step overwrite what they wrote.
        self.graph, self.logits = capture_cuda_graph(
            lambda: model.decode_step(self.tokens, cache), lambda: cache.lengths.copy_(lengths))

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits


@torch.no_grad()
def stream_tokens(model: LanguageModel, prompt: torch.Tensor, max_new_tokens: int, *,
                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  generator: torch.Generator | None = None,
                  cuda_graph: bool = False) -> Iterator[torch.Tensor]:
    """Yield [B] sampled token ids, one decode step at a time, after prompts [B, P]."""
    B, P = prompt.shape
    capacity = P + max_new_tokens
    if capacity > model.config.max_seq_len:
        raise ValueError(f"prompt ({P}) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's max_seq_len ({model.config.max_seq_len})")
    cache = model.new_cache(B, capacity)
    logits = model.prefill(prompt, cache)
    step = GraphedDecodeStep(model, cache) if cuda_graph else (
        lambda tokens: model.decode_step(tokens, cache))
    for i in range(max_new_tokens):
        token = sample_token(logits, temperature, top_k, top_p, generator)
        yield token
        if i + 1 < max_new_tokens:
            logits = step(token)
