"""Training: configuration and presets, byte data, checkpoints and the training loop."""

from nsa.train.config import TRAIN_PRESETS, RunConfig, TrainConfig, build_config
from nsa.train.trainer import TrainResult, sample_checkpoint, train

__all__ = [
    "TRAIN_PRESETS", "RunConfig", "TrainConfig", "TrainResult", "build_config",
    "sample_checkpoint", "train",
]
