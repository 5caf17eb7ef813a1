"""The model's shape: what a Hugging Face Llama/Qwen2 ``config.json`` says, checked.

Only the options that change the math are kept; anything that would silently change it
and is not implemented here (rope scaling, other activations) is rejected with
:class:`UnsupportedModel` instead of being ignored.

Hybrid models: each layer is ``full_attention`` (every earlier token) or
``sliding_attention`` (a query at position ``p`` sees the keys at positions
``p - sliding_window < k <= p``: ``sliding_window`` keys, itself included), as
transformers' Qwen2 reads ``layer_types``, ``use_sliding_window``, ``sliding_window`` and
``max_window_layers``.

The KV layout follows from the layers (:func:`kv_groups`): one full-attention group for a
dense model, a full group and a window group of ``sliding_window`` for a hybrid one, the
layout a grouped KV pool (``SchedulerConfig.kv_groups``) keeps one block table per
request for; :func:`layer_groups` says which group each layer reads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from refserve.errors import InvalidArgument, RefserveError
from refserve.spec.groups import GroupKind, KVGroup
from refserve.values import is_int, is_number

#: ``model_type`` values whose checkpoints this loader reads.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
#: The per-layer attention kinds (``layer_types`` entries) this model implements.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
#: The largest size field (vocab, hidden, heads, layers, positions) a config may give.
MAX_DIM = (1 << 31) - 1
MAX_FLOAT = 1e300


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
    # The window of the ``sliding_attention`` layers (None: the model has none).
    sliding_window: int | None = None
    # One kind per layer (``LAYER_TYPES``); empty means every layer is full attention
    # (so ``dataclasses.replace(cfg, num_layers=...)`` of a plain model stays valid).
    layer_types: tuple[str, ...] = field(default=())

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
            if not is_int(value) or value < 1:
                raise InvalidArgument(f"model config: {name} must be a positive int, got {value!r}")
            if value > MAX_DIM:
                raise InvalidArgument(f"model config: {name} is {value}; at most {MAX_DIM}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise InvalidArgument(
                f"model config: head_dim must be even for RoPE, got {self.head_dim}"
            )
        # ``not x > 0`` refuses NaN too; inf is refused by name.
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise InvalidArgument(
                    f"model config: {name} must be a finite number > 0, got {value!r}"
                )
        # A bos id outside the vocabulary would be prepended to every prompt and index past
        # the embedding table; an eos id outside it could never be sampled.
        bos = () if self.bos_token_id is None else (self.bos_token_id,)
        named_ids = [("bos_token_id", t) for t in bos]
        named_ids += [("eos_token_id", t) for t in self.eos_token_ids]
        for name, t in named_ids:
            if not is_int(t) or not 0 <= t < self.vocab_size:
                raise InvalidArgument(
                    f"model config: {name} {t!r} is outside the vocabulary [0, {self.vocab_size})"
                )

        self._check_layers()

    def _check_layers(self) -> None:
        w = self.sliding_window
        if w is not None and (not is_int(w) or not 1 <= w <= MAX_DIM):
            raise InvalidArgument(
                f"model config: sliding_window must be an int in [1, {MAX_DIM}] or None, got {w!r}"
            )
        if not isinstance(self.layer_types, tuple):
            raise InvalidArgument(
                f"model config: layer_types must be a tuple of strings, got {self.layer_types!r}"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise InvalidArgument(
                f"model config: layer_types has {len(self.layer_types)} entries for "
                f"{self.num_layers} layers (num_layers); one per layer"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise InvalidArgument(
                    f"model config: layer_types[{i}] is {_show(kind)}; "
                    f"supported kinds: {', '.join(LAYER_TYPES)}"
                )
            if kind == SLIDING_ATTENTION and w is None:
                raise InvalidArgument(
                    f"model config: layer_types[{i}] is {SLIDING_ATTENTION} but there is no "
                    "sliding_window (in config.json: use_sliding_window is false or "
                    "sliding_window is null)"
                )

    @property
    def attention_kinds(self) -> tuple[str, ...]:
        """The kind of every layer (``layer_types``, or all full when it is empty)."""
        return self.layer_types or (FULL_ATTENTION,) * self.num_layers

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, None for a full-attention layer."""
        return self.sliding_window if self.attention_kinds[layer] == SLIDING_ATTENTION else None

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer attends through a sliding window."""
        return SLIDING_ATTENTION in self.layer_types

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        first = () if self.eos_token_id is None else (self.eos_token_id,)
        return first + self.extra_eos_token_ids

    @classmethod
    def from_hf(cls, cfg: Mapping[str, object]) -> ModelConfig:
        """Read a Hugging Face ``config.json`` (transformers 4.x or 5.x spelling).

        Strict: a field of the wrong JSON type is an error naming it, never a silent
        default (the string ``"false"`` is not a boolean, a string ``rope_theta`` is not
        10000); ``null`` means "not set" for optional fields.
        """
        model_type = _supported_model_type(cfg)
        theta = _rope_theta(cfg)
        hidden = _int(cfg, "hidden_size")
        heads = _int(cfg, "num_attention_heads")
        if heads < 1:
            raise UnsupportedModel(
                f"config.json: num_attention_heads must be a positive int, got {heads}"
            )
        head_dim = _head_dim(cfg, hidden, heads)
        eos_ids = _eos_ids(cfg)
        bos = _int(cfg, "bos_token_id") if cfg.get("bos_token_id") is not None else None
        num_layers = _int(cfg, "num_hidden_layers")
        window, layer_types = _layers(cfg, model_type, num_layers)
        return cls(
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=_int(cfg, "num_key_value_heads", heads),
            head_dim=head_dim,
            rope_theta=theta,
            rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6),
            tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False),
            attention_bias=_bool(cfg, "attention_bias", model_type == "qwen2"),
            max_position_embeddings=_int(cfg, "max_position_embeddings", 2048),
            bos_token_id=bos,
            eos_token_id=eos_ids[0] if eos_ids else None,
            extra_eos_token_ids=tuple(eos_ids[1:]),
            model_type=model_type,
            sliding_window=window,
            layer_types=layer_types,
        )


def kv_groups(cfg: ModelConfig) -> tuple[KVGroup, ...]:
    """The model's KV layer groups (spec/groups.py): ``(FULL,)`` for a dense model,
    ``(FULL, WINDOW(sliding_window))`` for a hybrid one. Group 0 is always the full
    group, the table the scheduler reads (a grouped pool's rule), even when every layer
    slides: then no layer reads it, and it costs memory but never a wrong token."""
    full = KVGroup(GroupKind.FULL)
    if not cfg.is_hybrid:
        return (full,)
    assert cfg.sliding_window is not None, "ModelConfig refuses sliding layers without a window"
    return (full, KVGroup(GroupKind.WINDOW, cfg.sliding_window))


def describe_layout(groups: Sequence[KVGroup]) -> str:
    """A KV layout as messages name it: ``(full, window 8)``."""
    return (
        "(" + ", ".join(g.kind.value + (f" {g.window}" if g.window else "") for g in groups) + ")"
    )


def layer_groups(cfg: ModelConfig) -> tuple[int, ...]:
    """The group of :func:`kv_groups` each layer reads and writes: 0 for full attention,
    1 (the window group) for a sliding layer."""
    return tuple(0 if cfg.layer_window(i) is None else 1 for i in range(cfg.num_layers))


def _layers(
    cfg: Mapping[str, object], model_type: str, num_layers: int
) -> tuple[int | None, tuple[str, ...]]:
    """``(sliding_window, layer_types)`` as transformers' Qwen2Config reads them: the
    window only under ``use_sliding_window``; ``layer_types`` as given, else sliding from
    layer ``max_window_layers`` on when there is a window. The kinds and their count are
    checked by :class:`ModelConfig` (``InvalidArgument``)."""
    use_window = _bool(cfg, "use_sliding_window", False)
    if model_type != "qwen2":
        # transformers' Llama has no sliding layers: a window there would be ignored.
        if use_window:
            raise UnsupportedModel(f"use_sliding_window=true is not supported for {model_type}")
        return None, ()
    window: int | None = None
    if use_window and cfg.get("sliding_window") is not None:
        window = _int(cfg, "sliding_window")
    raw = cfg.get("layer_types")
    if raw is None:
        first = _int(cfg, "max_window_layers", 28)
        kinds = [
            SLIDING_ATTENTION if window is not None and i >= first else FULL_ATTENTION
            for i in range(max(num_layers, 0))
        ]
        return window, _hybrid_only(kinds, num_layers)
    if not isinstance(raw, list) or not all(isinstance(k, str) for k in raw):
        raise UnsupportedModel(
            f"config.json: layer_types must be a list of strings, got {_show(raw)}"
        )
    return window, _hybrid_only(raw, num_layers)


def _hybrid_only(kinds: list[str], num_layers: int) -> tuple[str, ...]:
    """``kinds``, or ``()`` (every layer full, the plain model's spelling) when that is
    all they say; a list of the wrong length is kept, for ModelConfig to refuse."""
    plain = len(kinds) == num_layers and all(k == FULL_ATTENTION for k in kinds)
    return () if plain else tuple(kinds)


def _supported_model_type(cfg: Mapping[str, object]) -> str:
    """The model type, refused (with the features this network lacks) unless supported."""
    model_type = _str(cfg, "model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    act = _str(cfg, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (only silu)")
    if _bool(cfg, "mlp_bias", False):
        raise UnsupportedModel("mlp_bias=true is not supported")
    return model_type


def _rope_theta(cfg: Mapping[str, object]) -> float:
    """``rope_theta``, overridden by ``rope_parameters`` (5.x) or ``rope_scaling`` (4.x);
    any rope type but the default is refused."""
    theta = _float(cfg, "rope_theta", 10000.0)
    for key in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(key)
        if rope is None:
            continue
        if not isinstance(rope, Mapping):
            raise UnsupportedModel(
                f"config.json: {key} must be an object or null, got {_show(rope)}"
            )
        if not rope:
            continue
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedModel(
                f"{key}: rope type {_show(rope_type)} is not supported (only default)"
            )
        theta = _float(rope, "rope_theta", theta, where=f"config.json: {key}.")
    return theta


def _head_dim(cfg: Mapping[str, object], hidden: int, heads: int) -> int:
    """``head_dim`` when given, else ``hidden_size / num_attention_heads`` when whole."""
    if cfg.get("head_dim") is not None:
        return _int(cfg, "head_dim")
    if hidden % heads == 0:
        return hidden // heads
    raise UnsupportedModel(
        f"config.json: no head_dim, and hidden_size {hidden} is not a multiple of "
        f"num_attention_heads {heads}"
    )


def _eos_ids(cfg: Mapping[str, object]) -> list[int]:
    """``eos_token_id``: an int, a list of ints, or null (none)."""
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        if not all(is_int(x) for x in eos):
            raise UnsupportedModel(
                f"config.json: eos_token_id must be an int or a list of ints, got {_show(eos)}"
            )
        return list(eos)
    if eos is not None:
        return [_int(cfg, "eos_token_id")]
    return []


def tiny_config() -> ModelConfig:
    """The embedded default: a 2-layer model over the byte tokenizer's 259 ids.

    GQA (4 query heads on 2 KV heads), an untied head; small enough that a CPU runs a
    step in about a millisecond.
    """
    from refserve.model.tokenizer import ByteTokenizer

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


def _show(value: object) -> str:
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 160 else "a huge int"
    return text if len(text) <= 60 else text[:57] + "..."


def _int(cfg: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = cfg.get(key)
    if value is None and default is not None:  # absent or null: not set
        return default
    if not is_int(value):
        raise UnsupportedModel(f"config.json: {key} must be an int, got {_show(value)}")
    return value


def _float(
    cfg: Mapping[str, object], key: str, default: float, *, where: str = "config.json: "
) -> float:
    value = cfg.get(key)
    if value is None:
        return default
    # An int too large for a float would overflow float(); NaN and Infinity (which Python's
    # JSON reader accepts) fail the finiteness check.
    if not is_number(value) or not -MAX_FLOAT <= value <= MAX_FLOAT:
        raise UnsupportedModel(f"{where}{key} must be a finite number, got {_show(value)}")
    return float(value)


def _bool(cfg: Mapping[str, object], key: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):  # "false" is truthy: reading it as a bool flips it
        raise UnsupportedModel(f"config.json: {key} must be true or false, got {_show(value)}")
    return value


def _str(cfg: Mapping[str, object], key: str, default: str) -> str:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise UnsupportedModel(f"config.json: {key} must be a string, got {_show(value)}")
    return value
