"""The model's shape: what a Hugging Face Llama/Qwen2 ``config.json`` says, checked.

Only the options that change the math are kept; anything that would silently change it
and is not implemented here (rope scaling, sliding windows, other activations) is
rejected with :class:`UnsupportedModel` instead of being ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ref.errors import InvalidArgument, RefserveError

#: ``model_type`` values whose checkpoints this loader reads.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


class UnsupportedModel(RefserveError):
    """The checkpoint's config asks for something this model does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection bias (Qwen2)
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    # The first eos id; the others (Llama 3 lists several) are in ``extra_eos_token_ids``.
    eos_token_id: int | None = None
    extra_eos_token_ids: tuple[int, ...] = field(default=())
    model_type: str = "llama"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"model config: {name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise InvalidArgument(
                f"model config: head_dim must be even for RoPE, got {self.head_dim}"
            )
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise InvalidArgument("model config: rope_theta and rms_norm_eps must be positive")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        first = () if self.eos_token_id is None else (self.eos_token_id,)
        return first + self.extra_eos_token_ids

    @classmethod
    def from_hf(cls, cfg: Mapping[str, object]) -> ModelConfig:
        """Read a Hugging Face ``config.json`` (transformers 4.x or 5.x spelling)."""
        model_type = str(cfg.get("model_type", "llama"))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(
                f"model_type {model_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModel(f"hidden_act {act!r} is not supported (only silu)")
        if cfg.get("mlp_bias"):
            raise UnsupportedModel("mlp_bias=true is not supported")
        if cfg.get("use_sliding_window"):
            raise UnsupportedModel("use_sliding_window=true is not supported")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        theta: object = cfg.get("rope_theta", 10000.0)
        if isinstance(rope, Mapping):
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise UnsupportedModel(f"rope type {rope_type!r} is not supported (only default)")
            theta = rope.get("rope_theta", theta)
        hidden = _int(cfg, "hidden_size")
        heads = _int(cfg, "num_attention_heads")
        head_dim = cfg.get("head_dim")
        eos = cfg.get("eos_token_id")
        eos_ids: list[int] = []
        if isinstance(eos, int):
            eos_ids = [eos]
        elif isinstance(eos, list):
            eos_ids = [int(x) for x in eos]
        bos = cfg.get("bos_token_id")
        return cls(
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size"),
            num_layers=_int(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_int(cfg, "num_key_value_heads", heads),
            head_dim=int(head_dim) if isinstance(head_dim, int) else hidden // heads,
            rope_theta=float(theta) if isinstance(theta, int | float) else 10000.0,
            rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            max_position_embeddings=_int(cfg, "max_position_embeddings", 2048),
            bos_token_id=bos if isinstance(bos, int) else None,
            eos_token_id=eos_ids[0] if eos_ids else None,
            extra_eos_token_ids=tuple(eos_ids[1:]),
            model_type=model_type,
        )


def tiny_config() -> ModelConfig:
    """The embedded default: a 2-layer model over the byte tokenizer's 259 ids.

    GQA (4 query heads on 2 KV heads), an untied head; small enough that a CPU runs a
    step in about a millisecond.
    """
    from ref.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    return ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        model_type="llama",
    )


def _int(cfg: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnsupportedModel(f"config.json: {key} must be an int, got {value!r}")
    return value


def _float(cfg: Mapping[str, object], key: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UnsupportedModel(f"config.json: {key} must be a number, got {value!r}")
    return float(value)
