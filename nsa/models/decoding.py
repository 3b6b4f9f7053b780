"""Sampling: the one loop behind every way to generate text (``LanguageModel.generate``,
``nsa generate``, ``nsa sample``, the trainer's sample), with a KV cache and optionally a CUDA
graph per decode step.

The context rule. The model reads at most ``max_seq_len`` (S) tokens: it never sees a position
it was not trained on. A prompt longer than S is read from its last S tokens (left-truncated).
The KV cache holds S positions; when it is full, the last ``max(1, S // 2)`` tokens of the text
(the newest one included) are prefilled again, from position 0, into the same cache buffers and
decoding goes on. So every token is predicted from the S // 2 to S tokens before it, and text of
any length is generated at KV-cache speed: one prefill of S // 2 tokens every S // 2 tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from nsa.models.transformer import LanguageModel, ModelCache


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_sampling(*, max_new_tokens: int = 1, temperature: float = 1.0,
                   top_k: int | None = None, top_p: float | None = None,
                   names: Mapping[str, str] | None = None) -> None:
    """Raise ``ValueError`` naming the first bad setting: ``max_new_tokens`` an integer >= 1,
    ``temperature`` > 0 and finite, ``top_k`` None or an integer >= 1, ``top_p`` None or in
    (0, 1]. ``names`` renames arguments in the message to what the caller's user typed (CLI
    flags, config fields)."""
    names = names or {}

    def refuse(argument: str, rule: str, value) -> None:
        raise ValueError(f"{names.get(argument, argument)} must be {rule}, got {value!r}")

    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        refuse("max_new_tokens", "an integer >= 1", max_new_tokens)
    if not _is_real(temperature) or not math.isfinite(temperature) or temperature <= 0:
        refuse("temperature", "a finite number > 0 (top_k=1 samples greedily)", temperature)
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        refuse("top_k", "None or an integer >= 1", top_k)
    if top_p is not None and (not _is_real(top_p) or not 0 < top_p <= 1):
        refuse("top_p", "None or in (0, 1]", top_p)


def sample_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> [B] sampled ids: temperature, then top-k, then top-p (nucleus).
    ``top_k=1`` is greedy decoding. Bad settings raise ``ValueError`` (:func:`check_sampling`)."""
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature  # max 0: no overflow
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        outside = probs.cumsum(-1) - probs > top_p  # keeps the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)[:, 0]


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
    launch per step instead of hundreds of small ones. The cache's buffers (lengths included)
    are the graph's static memory, so it serves exactly the ``cache`` it was built for, and
    stays valid across prefills, which write into those same buffers. An NSA model gets a
    second graph without the compressed-token update, for the steps that complete none
    (``compress=False``)."""

    def __init__(self, model: LanguageModel, cache: ModelCache):
        if cache.lengths.device.type != "cuda":
            raise ValueError(f"a CUDA graph needs the model and cache on a CUDA device, not "
                             f"{cache.lengths.device}")
        self.tokens = torch.zeros_like(cache.lengths)
        lengths = cache.lengths.clone()
        variants = (True, False) if model.config.attention.kind == "nsa" else (True,)
        # The warm-up runs write keys/values at the current positions and advance the lengths;
        # restoring the lengths makes the next real step overwrite what they wrote.
        self.graphs = {compress: capture_cuda_graph(
            partial(model.decode_step, self.tokens, cache, compress),
            lambda: cache.lengths.copy_(lengths)) for compress in variants}

    def __call__(self, tokens: torch.Tensor, compress: bool = True) -> torch.Tensor:
        graph, logits = self.graphs.get(compress, self.graphs[True])
        self.tokens.copy_(tokens)
        graph.replay()
        return logits


def stream_tokens(model: LanguageModel, prompt: torch.Tensor, max_new_tokens: int, *,
                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  generator: torch.Generator | None = None,
                  cuda_graph: bool = False) -> Iterator[torch.Tensor]:
    """Yield ``max_new_tokens`` times [B] sampled token ids, one step at a time, after prompts
    [B, P] (B, P >= 1), by the module's context rule. The arguments are checked here, before
    any work (``ValueError`` naming the argument); ``top_k=1`` is greedy. ``cuda_graph``
    replays each decode step as a CUDA graph (a model on a CUDA device)."""
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                   top_p=top_p)
    if prompt.dim() != 2 or 0 in prompt.shape:
        raise ValueError(f"prompt must have shape [B, P] with B, P >= 1, got "
                         f"{tuple(prompt.shape)}")
    return _sample(model, prompt[:, -model.config.max_seq_len:], max_new_tokens, temperature,
                   top_k, top_p, generator, cuda_graph)


@torch.no_grad()
def _sample(model: LanguageModel, prompt: torch.Tensor, max_new_tokens: int,
            temperature: float, top_k: int | None, top_p: float | None,
            generator: torch.Generator | None, cuda_graph: bool) -> Iterator[torch.Tensor]:
    """The loop of :func:`stream_tokens`, for a prompt [B, P] already cut to P <= S."""
    B, P = prompt.shape
    S = model.config.max_seq_len
    cache = model.new_cache(B, min(S, P + max_new_tokens - 1))  # the last token is not fed
    # Captured on the empty cache: every prefill below rewrites the buffers the graph reads.
    step = GraphedDecodeStep(model, cache) if cuda_graph else partial(model.decode_step,
                                                                     cache=cache)
    cached = torch.zeros(B, cache.capacity, dtype=torch.long, device=prompt.device)  # [B, C]
    cached[:, :P] = prompt  # the token at each cache position
    logits = model.prefill(prompt, cache)
    position = P  # of the next token fed: cache.lengths, known on the host
    for i in range(max_new_tokens):
        token = sample_token(logits, temperature, top_k, top_p, generator)  # [B]
        yield token
        if i + 1 == max_new_tokens:
            break
        if position == cache.capacity:  # full (only when capacity == S): keep the newest S // 2
            keep = max(1, S // 2)
            cached[:, :keep] = torch.cat([cached[:, position - keep + 1:], token[:, None]], 1)
            logits = model.prefill(cached[:, :keep], cache)
            position = keep
        else:
            cached[:, position] = token
            logits = step(token, compress=model.completes_compressed_token(position))
            position += 1
