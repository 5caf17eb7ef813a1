"""The real model: a Llama-architecture decoder over the paged KV cache.

- :mod:`ref.model.config`: :class:`ModelConfig` (from a Hugging Face ``config.json``, or the
  built-in tiny one);
- :mod:`ref.model.weights`: seeded random weights and the local checkpoint loader;
- :mod:`ref.model.attention`: the attention backends (``torch`` and ``triton``);
- :mod:`ref.model.llama`: the forward pass over one step's flattened tokens;
- :mod:`ref.model.tiny`: the embedded trained checkpoint ``"tiny-trained"`` and its corpus,
  written by :mod:`ref.model.train_tiny` (``make train-tiny``).
"""

from ref.model.config import ModelConfig, UnsupportedModel, tiny_config
from ref.model.weights import (
    LlamaWeights,
    WeightError,
    WeightMismatch,
    WeightMissing,
    WeightUnexpected,
    load_checkpoint,
    random_weights,
)

__all__ = [
    "LlamaWeights",
    "ModelConfig",
    "UnsupportedModel",
    "WeightError",
    "WeightMismatch",
    "WeightMissing",
    "WeightUnexpected",
    "load_checkpoint",
    "random_weights",
    "tiny_config",
]
