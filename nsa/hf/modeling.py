"""``NSAForCausalLM``: a Hugging Face ``PreTrainedModel`` around :class:`LanguageModel`.

The module holds our model as ``self.model`` (weights ``model.embed.weight``, ...), no second
copy of its code. ``forward`` returns the logits (and the loss for ``labels``) of whole
sequences; ``generate`` is our sampling loop (:func:`nsa.models.decoding.stream_tokens`: one
prefill into the static KV cache, then one decode step per token, replayed as a CUDA graph on
a GPU) behind Hugging Face's arguments, so greedy decoding gives our tokens. What that loop
cannot do (beam search, penalties, left-padded batches, ...) raises ``ValueError`` naming the
argument, never a silently different result.

``save_pretrained`` writes, beside the weights, ``manifest.json`` (size and CRC-32 of the
weight files); ``from_pretrained`` checks it and refuses weights that are missing, unexpected
or of another shape (``ModelFileError``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from nsa.hf.configuration import NSAConfig
from nsa.layers.rope import RotaryFrequencies, rope_frequencies
from nsa.models.decoding import stream_tokens
from nsa.models.transformer import LanguageModel
from nsa.train.checkpoint import (
    MANIFEST,
    CheckpointCorrupted,
    ModelFileError,
    verify_checkpoint,
    write_manifest,
)

# generate() arguments our loop implements; any other generation setting must keep its default.
GENERATE_SETTINGS = {"max_length", "max_new_tokens", "do_sample", "temperature", "top_k",
                     "top_p", "eos_token_id", "pad_token_id", "bos_token_id", "use_cache"}


class NSAForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NSAConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.head.weight": "model.embed.weight"}

    def __init__(self, config: NSAConfig):
        super().__init__(config)
        self.model = LanguageModel(config.model_config)
        self.post_init()

    def _init_weights(self, module) -> None:
        """LanguageModel initialises its weights when built; what is left to compute is RoPE's
        non-persistent frequencies, which loading on the meta device leaves empty."""
        if isinstance(module, RotaryFrequencies):
            with torch.no_grad():
                module.inv_freq.copy_(rope_frequencies(module.head_dim, module.base))

    def get_input_embeddings(self):
        return self.model.embed

    def get_output_embeddings(self):
        return self.model.head

    # Logits ------------------------------------------------------------------------------

    def forward(self, input_ids: torch.LongTensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                past_key_values=None, use_cache: bool | None = None,
                return_dict: bool | None = None, **kwargs) -> CausalLMOutputWithPast:
        """Logits [B, T, vocab] of whole sequences (at most max_seq_len tokens), and with
        ``labels`` the mean cross-entropy of each next token (-100: not counted). Batches may
        be right-padded (``attention_mask`` ones then zeros: causal attention never reads the
        padding); left padding, ``past_key_values`` and other inputs raise ``ValueError``."""
        unsupported = {k: v for k, v in kwargs.items() if v is not None and v is not False}
        if past_key_values is not None:
            unsupported["past_key_values"] = "..."
        if unsupported:
            raise ValueError(f"NSAForCausalLM.forward does not take {', '.join(unsupported)}: it "
                             f"reads input_ids (and attention_mask, labels); generate() keeps "
                             f"NSA's own KV cache")
        if input_ids is None:
            raise ValueError("NSAForCausalLM.forward needs input_ids")
        if attention_mask is not None:
            check_right_padded(attention_mask, input_ids.shape)
        logits = self.model(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1),
                                   labels[:, 1:].flatten().to(logits.device), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    # Generation --------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, inputs: torch.LongTensor | None = None,
                 generation_config: GenerationConfig | None = None, stopping_criteria=None,
                 streamer=None, **kwargs) -> torch.LongTensor:
        """Hugging Face's ``generate`` for prompts [B, P] of equal length: greedy
        (``do_sample=False``, the default) or sampling with ``temperature``, ``top_k`` and
        ``top_p``; ``max_new_tokens`` or ``max_length``; stops a sequence at ``eos_token_id``
        (padding it with ``pad_token_id``) or when ``stopping_criteria`` say so, and all of
        them when all are done. Returns [B, P + new tokens]. Runs our sampling loop (static KV
        cache, CUDA graphs on a GPU); past max_seq_len it follows our context rule."""
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        attention_mask = kwargs.pop("attention_mask", None)
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError("generate needs input_ids of shape [B, P] with B, P >= 1, got "
                             f"{getattr(input_ids, 'shape', input_ids)!r}")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("generate: attention_mask has padding; NSA's KV cache decodes "
                             "prompts of equal length only: generate each prompt on its own "
                             "(batch size 1) or batch prompts of the same length")
        config = copy.deepcopy(generation_config or self.generation_config)
        unused = {k: v for k, v in config.update(**kwargs).items() if v is not None}
        if unused:
            raise ValueError(f"generate does not take {', '.join(sorted(unused))}")
        check_generation_config(config)
        B, P = input_ids.shape
        max_new = (config.max_new_tokens if config.max_new_tokens is not None
                   else (config.max_length or 20) - P)
        if max_new < 1:
            raise ValueError(f"generate: nothing to generate (max_length {config.max_length} "
                             f"for a prompt of {P} tokens): set max_new_tokens")
        if config.do_sample:
            temperature = 1.0 if config.temperature is None else config.temperature
            top_k = 50 if config.top_k is None else (config.top_k or None)  # HF: 50; 0 = off
            top_p = None if config.top_p in (None, 1.0) else config.top_p
            sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        else:
            sampling = dict(top_k=1)
        eos = config.eos_token_id
        eos = None if eos is None else torch.tensor(eos, device=input_ids.device).reshape(-1)
        pad = config.pad_token_id if config.pad_token_id is not None else (
            None if eos is None else eos[0])

        out = input_ids.new_empty(B, P + max_new)  # [B, P + N]
        out[:, :P] = input_ids
        unfinished = torch.ones(B, dtype=torch.bool, device=input_ids.device)
        length = P
        if streamer is not None:
            streamer.put(input_ids.cpu())
        for token in stream_tokens(self.model, input_ids, max_new, **sampling,
                                   cuda_graph=input_ids.device.type == "cuda"):
            if eos is not None:  # finished sequences continue with padding
                token = torch.where(unfinished, token, pad)
            out[:, length] = token
            length += 1
            if streamer is not None:
                streamer.put(token.cpu())
            if eos is not None:
                unfinished &= ~torch.isin(token, eos)
            if stopping_criteria is not None:
                unfinished &= ~stopping_criteria(out[:, :length], None)
            if (eos is not None or stopping_criteria is not None) and not unfinished.any():
                break
        if streamer is not None:
            streamer.end()
        return out[:, :length]

    # Files -------------------------------------------------------------------------------

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """Hugging Face's save_pretrained, then the weights' manifest."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if not kwargs.get("is_main_process", True):
            return
        directory = Path(save_directory)
        weights = sorted(p.name for p in directory.iterdir()
                         if p.name.endswith((".safetensors", ".safetensors.index.json")))
        write_manifest(directory, weights)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Hugging Face's from_pretrained; a local directory's weights are checked against its
        manifest first, and weights that do not fit the model are refused
        (``ModelFileError``), not initialised at random."""
        path = Path(str(pretrained_model_name_or_path))
        if (path / MANIFEST).is_file():
            try:
                verify_checkpoint(path)
            except CheckpointCorrupted as error:
                raise ModelFileError(f"refusing to load {path}: {error}") from None
        want_info = kwargs.pop("output_loading_info", False)
        try:
            model, info = super().from_pretrained(pretrained_model_name_or_path, *args,
                                                  output_loading_info=True, **kwargs)
        except (OSError, RuntimeError, SafetensorError) as error:  # a file safetensors refuses
            if not path.is_dir():
                raise
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ModelFileError(f"{path}: cannot read its weights ({reason[:300]})") from None
        problems = {k: sorted(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys",
                                                           "mismatched_keys")}
        problems = {k: v for k, v in problems.items() if v}
        if problems:
            detail = "; ".join(f"{k}: {', '.join(map(str, v[:5]))}" for k, v in problems.items())
            raise ModelFileError(f"{path}: its weights do not fit its config ({detail})")
        return (model, info) if want_info else model


def check_right_padded(attention_mask: torch.Tensor, shape: torch.Size) -> None:
    """``ValueError`` unless ``attention_mask`` [B, T] is every row's ones then zeros."""
    mask = attention_mask.bool()
    if mask.shape != shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids "
                         f"{tuple(shape)}")
    if not bool(mask[:, 0].all() and (mask[:, 1:] <= mask[:, :-1]).all()):
        raise ValueError("attention_mask: only right padding is supported (each row's ones, "
                         "then zeros); pad on the right (tokenizer.padding_side = 'right')")


def check_generation_config(config: GenerationConfig) -> None:
    """``ValueError`` naming the first setting our loop does not implement that is set to
    something other than Hugging Face's default (beam search, penalties, extra outputs...)."""
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    for name, value in config.to_dict().items():
        if name in GENERATE_SETTINGS or name.startswith("_") or name == "transformers_version":
            continue
        if value not in (None, False) and value != defaults.get(name):
            raise ValueError(f"generate does not support {name}={value!r}: NSA's cache loop "
                             f"runs greedy decoding or sampling (temperature, top_k, top_p)")
