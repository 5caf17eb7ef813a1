"""What ``LLMEngine(model, tokenizer=...)`` names, loaded: the network and its tokenizer.

:func:`load_model` turns the engine's ``model`` and ``tokenizer`` arguments into one
:class:`LoadedModel`, so the engine builds its scheduler, cache and executor around a
model without knowing where it came from (docs/ARCHITECTURE.md, "Layers": the model
side owns weights and tokenizers).

``model`` is one of:

- ``"tiny"``: :func:`~refserve.model.config.tiny_config` with seeded random weights (the
  tests' model; ``seed`` picks the weights);
- :data:`TINY_TRAINED`: the embedded trained checkpoint (``ref/model/tiny/``), read like
  any other directory;
- a local Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``);
- a ``(ModelConfig, LlamaWeights)`` pair built in memory.

``tokenizer`` is one of: ``None`` (the checkpoint directory's ``tokenizer.json`` if it
has one, else the byte tokenizer), ``"byte"``, a path to a ``tokenizer.json`` or its
directory, or a :class:`~refserve.model.tokenizer.Tokenizer` used as given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from refserve.model.attention import make_backend
from refserve.model.config import ModelConfig, tiny_config
from refserve.model.llama import LlamaModel
from refserve.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from refserve.model.weights import LlamaWeights, load_checkpoint, random_weights

__all__ = ["TINY_TRAINED", "LoadedModel", "ModelSource", "TokenizerSource", "load_model"]

#: The name of the embedded trained checkpoint (``ref/model/tiny/``); ``"tiny"`` is the
#: seeded random-weight model the tests use.
TINY_TRAINED = "tiny-trained"

ModelSource = str | Path | tuple[ModelConfig, LlamaWeights]
"""The ``model`` argument of :func:`load_model` (module doc)."""
TokenizerSource = Tokenizer | str | Path | None
"""The ``tokenizer`` argument of :func:`load_model` (module doc)."""


@dataclass(frozen=True)
class LoadedModel:
    """The network built from a checkpoint, with its tokenizer and the directory it came
    from (None when built in memory: ``"tiny"`` or a config and weights)."""

    model: LlamaModel
    tokenizer: Tokenizer
    directory: Path | None

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def load_model(
    model: ModelSource = "tiny",
    *,
    tokenizer: TokenizerSource = None,
    attention_backend: str = "torch",
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> LoadedModel:
    """The network ``model`` names on ``attention_backend``, its weights in ``dtype`` on
    ``device``, with the tokenizer ``tokenizer`` selects (module doc). A bad name raises
    the loader's typed error (``InvalidArgument`` for a backend, ``WeightError`` for a
    checkpoint, ``TokenizerError`` for a tokenizer file)."""
    backend = make_backend(attention_backend)  # the cheapest refusal first
    cfg, weights, directory = _read(model, dtype=dtype, device=device, seed=seed)
    return LoadedModel(
        LlamaModel(cfg, weights, backend), _tokenizer(tokenizer, cfg, directory), directory
    )


def _read(
    model: ModelSource, *, dtype: torch.dtype, device: str, seed: int
) -> tuple[ModelConfig, LlamaWeights, Path | None]:
    if isinstance(model, tuple):
        return model[0], model[1], None
    if str(model) == "tiny":
        cfg = tiny_config()
        return cfg, random_weights(cfg, seed, dtype=dtype, device=device), None
    if str(model) == TINY_TRAINED:
        # The shipped checkpoint, read like any other (the byte tokenizer: no tokenizer.json).
        from refserve.model.tiny import TRAINED_DIR

        cfg, weights = load_checkpoint(TRAINED_DIR, dtype=dtype, device=device)
        return cfg, weights, TRAINED_DIR
    cfg, weights = load_checkpoint(model, dtype=dtype, device=device)
    return cfg, weights, Path(model)


def _tokenizer(source: TokenizerSource, cfg: ModelConfig, directory: Path | None) -> Tokenizer:
    # HFTokenizer reads no special ids from the file: bos and eos are the model config's.
    if source is None:
        if directory is not None and (directory / "tokenizer.json").is_file():
            return HFTokenizer(
                directory, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id
            )
        return ByteTokenizer()
    if isinstance(source, str | Path):
        if str(source) == "byte":
            return ByteTokenizer()
        return HFTokenizer(source, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
    return source
