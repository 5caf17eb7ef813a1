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

from refserve.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig  # noqa: E402
from refserve.model.weights import load_checkpoint, random_state_dict  # noqa: E402

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


# ------------------------------------------------------------------- the hybrid oracle
@dataclass(frozen=True)
class Mix:
    """A hybrid sliding-window model's layers: their kinds and the sliding layers' window."""

    name: str
    layer_types: tuple[str, ...]
    window: int


_S, _F = SLIDING_ATTENTION, FULL_ATTENTION

#: Sliding:full 1:1 with a window that is a multiple of the block size 4, and 5:1 with one
#: that is not (the ``hybrid`` fixture of conftest.py runs a test on each).
MIXES = {
    "1:1": Mix("1:1", (_S, _F, _S, _F), 8),
    "5:1": Mix("5:1", (_S, _S, _S, _S, _S, _F), 13),
}


def qwen2_config(mix: Mix) -> Any:
    """transformers' Qwen2 (q/k/v biases) with ``mix``'s per-layer ``layer_types``."""
    return transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(mix.layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=0,
        use_sliding_window=True,
        sliding_window=mix.window,
        layer_types=list(mix.layer_types),
        attn_implementation="eager",
    )


def build_hybrid_oracle(path: Path, mix: Mix) -> HFOracle:
    """A seeded random-weight Qwen2 of ``mix`` saved to ``path``, read back by refserve's
    loader (which must see the same layers and window)."""
    model = build_hf_checkpoint(path, qwen2_config(mix), transformers.Qwen2ForCausalLM, seed=31)
    cfg, _ = load_checkpoint(path)
    assert cfg.layer_types == mix.layer_types and cfg.sliding_window == mix.window
    return HFOracle(model, path, cfg, {})
