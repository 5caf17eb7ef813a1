"""The transformers oracle of the engine tests: a small random-weight Llama.

The oracle is Hugging Face ``LlamaForCausalLM`` in fp32 (nobody here wrote it): the test
builds it from a config that exercises what matters (GQA 4:2, ``head_dim`` 24 while
hidden/heads is 16, ``rope_theta`` 5000, an untied head), fills it with refserve's seeded
random weights, saves it with ``save_pretrained`` to a temp dir and loads that dir with
refserve's loader. Nothing touches the network.

References are ``model.generate(do_sample=False)`` run per request, memoised for the
session so every scenario reuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from refserve.model.config import ModelConfig  # noqa: E402
from refserve.model.weights import random_state_dict  # noqa: E402

VOCAB = 320
BOS = 1
EOS = 2


@dataclass
class HFOracle:
    model: Any  # transformers.LlamaForCausalLM
    path: Path
    config: ModelConfig
    _cache: dict[tuple[tuple[int, ...], int], tuple[int, ...]]

    @torch.inference_mode()
    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> tuple[int, ...]:
        """``generate(do_sample=False)`` for one request: its new tokens (eos included)."""
        key = (tuple(prompt), max_new_tokens)
        if key not in self._cache:
            ids = torch.tensor([list(prompt)])
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=EOS,
                pad_token_id=0,
            )
            self._cache[key] = tuple(out[0, len(prompt) :].tolist())
        return self._cache[key]

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """fp32 logits ``[len, vocab]`` of a full forward over ``token_ids``."""
        out = self.model(torch.tensor([list(token_ids)]))
        logits: torch.Tensor = out.logits[0].float()
        return logits


def hf_llama_config(**overrides: object) -> Any:
    kwargs: dict[str, object] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        rope_theta=5000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=0,
        rms_norm_eps=1e-6,
    )
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


def build_hf_checkpoint(
    path: Path, hf_config: Any, model_cls: Callable[..., Any] | None = None, seed: int = 123
) -> Any:
    """A random-weight HF model (refserve's seeded weights) saved to ``path``; returns it."""
    cls = model_cls if model_cls is not None else transformers.LlamaForCausalLM
    model = cls(hf_config).eval()
    cfg = ModelConfig.from_hf(hf_config.to_dict())
    sd = random_state_dict(cfg, seed)
    if cfg.attention_bias:
        g = torch.Generator().manual_seed(seed + 1)
        for name in list(sd):
            if name.endswith("_proj.bias"):
                sd[name] = 0.1 * torch.randn(sd[name].shape, generator=g)
    result = model.load_state_dict(sd, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    # Only the tied head (absent from our names) may be missing.
    assert all(k == "lm_head.weight" for k in result.missing_keys), result.missing_keys
    model.save_pretrained(path)
    return model


def random_prompt(gen: torch.Generator, length: int) -> list[int]:
    """BOS then ``length - 1`` random non-special ids."""
    return [BOS, *torch.randint(3, VOCAB, (length - 1,), generator=gen).tolist()]
