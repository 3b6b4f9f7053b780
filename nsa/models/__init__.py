"""Language models built from the NSA layers."""

from nsa.models.config import MODEL_PRESETS, ModelConfig, model_preset
from nsa.models.transformer import LanguageModel

__all__ = ["MODEL_PRESETS", "LanguageModel", "ModelConfig", "model_preset"]
