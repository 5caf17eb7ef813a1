"""Model weights: seeded random ones for the embedded tiny model, or a local checkpoint.

:func:`load_checkpoint` reads a Hugging Face Llama/Qwen2-style directory
(``config.json`` + ``*.safetensors``, sharded or not) from local disk only. Every tensor
the model needs is checked by name and shape; a missing, misshapen or unexpected one
raises a :class:`WeightError` subclass that names it, and so does a tensor holding NaN or
an infinity (after conversion to the run's dtype), which would otherwise load and
generate garbage. ``config.json`` is read strictly: UTF-8, at most 16 MiB, no duplicate
keys, every field of the type it should have (:meth:`ModelConfig.from_hf`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from refserve.errors import InvalidArgument, RefserveError
from refserve.files import loads_json, read_text_file, shown
from refserve.model.config import ModelConfig, UnsupportedModel

#: The largest ``config.json`` read (real ones are a few KiB).
MAX_CONFIG_BYTES = 16 << 20


class WeightError(RefserveError):
    """The weights do not fit the model."""


class WeightMissing(WeightError):
    def __init__(self, name: str, where: str) -> None:
        super().__init__(f"{where}: tensor {name!r} is missing")
        self.name = name


class WeightMismatch(WeightError):
    def __init__(
        self, name: str, expected: tuple[int, ...], got: tuple[int, ...], where: str
    ) -> None:
        super().__init__(
            f"{where}: tensor {name!r} has shape {list(got)}, the config implies {list(expected)}"
        )
        self.name = name
        self.expected = expected
        self.got = got


class WeightNotFinite(WeightError):
    def __init__(self, name: str, dtype: torch.dtype, where: str) -> None:
        super().__init__(
            f"{where}: tensor {name!r} holds NaN or infinite values (as {str(dtype)[6:]}); "
            "refusing to run a model on it"
        )
        self.name = name


class ConfigFileError(WeightError, InvalidArgument):
    """``config.json`` cannot be read: not UTF-8, not JSON, too large, nested too deeply."""


class WeightUnexpected(WeightError):
    def __init__(self, names: list[str], where: str) -> None:
        shown = ", ".join(repr(n) for n in names[:5])
        more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
        super().__init__(f"{where}: unexpected tensor(s) {shown}{more}")
        self.names = names


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    q_proj: torch.Tensor  # [Hq*D, H]
    k_proj: torch.Tensor  # [Hkv*D, H]
    v_proj: torch.Tensor  # [Hkv*D, H]
    o_proj: torch.Tensor  # [H, Hq*D]
    post_norm: torch.Tensor  # [H]
    gate_proj: torch.Tensor  # [I, H]
    up_proj: torch.Tensor  # [I, H]
    down_proj: torch.Tensor  # [H, I]
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None


@dataclass(frozen=True)
class LlamaWeights:
    embed: torch.Tensor  # [V, H]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]; the same tensor as ``embed`` when tied


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes the config implies."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if cfg.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def weights_from_state_dict(
    cfg: ModelConfig,
    tensors: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    where: str = "state dict",
) -> LlamaWeights:
    """Check names and shapes against the config, then build :class:`LlamaWeights`."""
    shapes = expected_shapes(cfg)
    for name, shape in shapes.items():
        t = tensors.get(name)
        if t is None:
            raise WeightMissing(name, where)
        if tuple(t.shape) != shape:
            raise WeightMismatch(name, shape, tuple(t.shape), where)
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = sorted(
        n
        for n in tensors
        if n not in shapes and n not in ignorable and not n.endswith("rotary_emb.inv_freq")
    )
    if unexpected:
        raise WeightUnexpected(unexpected, where)
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        t = tensors["lm_head.weight"]
        if tuple(t.shape) != shapes["model.embed_tokens.weight"]:
            raise WeightMismatch(
                "lm_head.weight", shapes["model.embed_tokens.weight"], tuple(t.shape), where
            )

    def get(name: str) -> torch.Tensor:
        # Convert on the host and check there: a NaN would otherwise load silently and
        # every logit after it be NaN, and a float32 value past float16's range becomes
        # inf only after conversion. One pass over the weights, before they move.
        t = tensors[name].to(dtype=dtype)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise WeightNotFinite(name, dtype, where)
        return t.to(device=device).contiguous()

    def opt(name: str) -> torch.Tensor | None:
        return get(name) if cfg.attention_bias else None

    layers = []
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                q_proj=get(p + "self_attn.q_proj.weight"),
                k_proj=get(p + "self_attn.k_proj.weight"),
                v_proj=get(p + "self_attn.v_proj.weight"),
                o_proj=get(p + "self_attn.o_proj.weight"),
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_proj=get(p + "mlp.gate_proj.weight"),
                up_proj=get(p + "mlp.up_proj.weight"),
                down_proj=get(p + "mlp.down_proj.weight"),
                q_bias=opt(p + "self_attn.q_proj.bias"),
                k_bias=opt(p + "self_attn.k_proj.bias"),
                v_bias=opt(p + "self_attn.v_proj.bias"),
            )
        )
    embed = get("model.embed_tokens.weight")
    return LlamaWeights(
        embed=embed,
        layers=tuple(layers),
        norm=get("model.norm.weight"),
        lm_head=embed if cfg.tie_word_embeddings else get("lm_head.weight"),
    )


def random_state_dict(
    cfg: ModelConfig, seed: int = 0, *, std: float = 0.1, head_std: float = 0.3
) -> dict[str, torch.Tensor]:
    """Seeded random weights in Hugging Face naming (same seed, same tensors, any machine).

    Projections are N(0, std), an untied head N(0, head_std), embeddings N(0, 1), norms
    1 + N(0, 0.1): larger than a training init so that logits are spread out and greedy
    choices are not near-ties.
    """
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=g)
        elif name == "lm_head.weight":
            t = head_std * torch.randn(shape, generator=g)
        else:
            t = std * torch.randn(shape, generator=g)
        out[name] = t
    return out


def random_weights(
    cfg: ModelConfig,
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LlamaWeights:
    return weights_from_state_dict(
        cfg, random_state_dict(cfg, seed), dtype=dtype, device=device, where=f"random(seed={seed})"
    )


def load_checkpoint(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[ModelConfig, LlamaWeights]:
    """Load ``config.json`` and every ``*.safetensors`` file of a local directory."""
    d = Path(path)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise WeightError(f"{d}: no config.json (a local Hugging Face checkpoint directory)")
    text = read_text_file(cfg_path, "model config", MAX_CONFIG_BYTES, ConfigFileError)
    raw = loads_json(text, shown(cfg_path), ConfigFileError)
    if not isinstance(raw, dict):
        raise WeightError(f"{shown(cfg_path)}: expected a JSON object")
    try:
        cfg = ModelConfig.from_hf(raw)
    except (UnsupportedModel, InvalidArgument) as e:
        # Same type (callers catch UnsupportedModel), the message naming the whole path.
        text = str(e).removeprefix("config.json: ").removeprefix("model config: ")
        raise type(e)(f"{shown(cfg_path)}: {text}") from None
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{d}: no *.safetensors files")
    try:
        from safetensors.torch import load_file
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise WeightError("loading a checkpoint needs the 'safetensors' package") from e
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except Exception as e:
            raise WeightError(f"{f}: cannot read safetensors: {e}") from e
        for name, t in part.items():
            if name in tensors:
                raise WeightError(f"{d}: tensor {name!r} appears in more than one file")
            tensors[name] = t
    return cfg, weights_from_state_dict(cfg, tensors, dtype=dtype, device=device, where=str(d))
