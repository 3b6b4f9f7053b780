"""``NSAConfig``: the Hugging Face config of an nsa model, derived from :class:`ModelConfig`.

Its fields are the model config tree's, as ``dataclasses.asdict`` writes it (``vocab_size``,
``num_layers``, ..., ``attention`` with its ``nsa`` block parameters as nested objects),
validated by building the :class:`ModelConfig` they describe (``NSAConfig(window=256)`` names
a field inside the tree as ``key=value`` overrides do); the standard Hugging Face names
(``hidden_size``, ``num_hidden_layers``, ``max_position_embeddings``, ...) read them. ``train``
holds the settings of the run the model came from (tokenizer, sample prompt), when exported by
``nsa export --hf``.
"""

from __future__ import annotations

import dataclasses

from transformers import PreTrainedConfig

from nsa.config_tree import field_paths, is_section, replace_fields
from nsa.models.config import ModelConfig

MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
# Fields inside the tree, which NSAConfig(window=256, kind="dense") also takes by name.
LEAF_NAMES = {path[-1] for path, hint in field_paths(ModelConfig).items()
              if len(path) > 1 and not is_section(hint)}


class NSAConfig(PreTrainedConfig):
    model_type = "nsa"
    attribute_map = {
        "num_hidden_layers": "num_layers",
        "max_position_embeddings": "max_seq_len",
        "tie_word_embeddings": "tie_embeddings",
    }

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    train: dict | None = None  # nsa.train.TrainConfig of the run, as a dict

    def __post_init__(self, **kwargs):
        for alias, name in self.attribute_map.items():  # num_hidden_layers=4: num_layers=4
            if alias in kwargs:
                kwargs[name] = kwargs.pop(alias)
        tree = {name: kwargs.pop(name) for name in MODEL_FIELDS if name in kwargs}
        leaves = {key: kwargs.pop(key) for key in list(kwargs) if key in LEAF_NAMES}
        # validated here, once; the defaults fill what is left out
        model = replace_fields(ModelConfig.from_dict(tree), **leaves)
        super().__post_init__(**kwargs, **dataclasses.asdict(model))

    @classmethod
    def from_model_config(cls, model: ModelConfig, **kwargs) -> NSAConfig:
        """The Hugging Face config of ``model`` (``kwargs``: token ids, ``train``, ...)."""
        return cls(**dataclasses.asdict(model), **kwargs)

    @property
    def model_config(self) -> ModelConfig:
        """The :class:`ModelConfig` these fields describe."""
        return ModelConfig.from_dict({name: getattr(self, name) for name in MODEL_FIELDS})

    @property
    def hidden_size(self) -> int:
        return self.attention["dim"]

    @property
    def num_attention_heads(self) -> int:
        return self.attention["num_heads"]

    @property
    def num_key_value_heads(self) -> int:
        return self.attention["num_kv_heads"]
