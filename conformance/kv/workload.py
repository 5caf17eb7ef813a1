"""The KV level's records: a workload (a configuration and a plain-data op list, the
format of :mod:`refserve.conformance.kv.machine`), a fixed scenario, and a finding."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from refserve.conformance.kv.protocol import KVConfig, KVFeature
from refserve.conformance.report import signature_of
from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace
from refserve.spec.violation import Invariant, Violation
from refserve.values import is_int


@dataclass(frozen=True)
class KVFinding:
    """A violation and where: ``step`` is the op index (-1: configure, ``len(ops)``: the
    drain), ``op`` the op kind (``new``, ``grow``, ``fork``, ``free``, ``drain``...)."""

    violation: Violation
    step: int
    op: str
    timed_out: bool = False
    """An adapter call ran past the time limit (such a finding is not shrunk)."""

    @property
    def invariant(self) -> Invariant:
        return self.violation.invariant

    @property
    def signature(self) -> str:
        """What makes two findings the same bug (:func:`refserve.conformance.report.signature_of`):
        invariant, first word of the subject (``request``, ``block``, ``pool``,
        ``adapter``...), message with its numbers blanked."""
        v = self.violation
        return signature_of(v.invariant, v.subject, v.message)

    def to_json(self) -> dict[str, Any]:
        v = self.violation
        return {
            "invariant": str(v.invariant),
            "step": self.step,
            "op": self.op,
            "subject": v.subject,
            "message": v.message,
            "expected": v.expected,
            "seen": v.seen,
        }

    def __str__(self) -> str:
        return f"op {self.step} ({self.op}): {self.violation}"


@dataclass(frozen=True)
class KVWorkload:
    """A KV configuration and the op list run on it (module docstring for the op format)."""

    config: KVConfig
    ops: tuple[Mapping[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "kv_config": {
                "num_blocks": c.num_blocks,
                "block_size": c.block_size,
                "enable_prefix_caching": c.enable_prefix_caching,
            },
            "ops": [_op_json(o) for o in self.ops],
        }

    @staticmethod
    def from_json(d: Mapping[str, Any] | str) -> KVWorkload:
        """Parse and validate (``ValueError`` on a malformed workload)."""
        if isinstance(d, str):
            d = json.loads(d)
        if not isinstance(d, Mapping):
            raise ValueError(f"a KV workload is a JSON object, got {type(d).__name__}")
        c = d.get("kv_config")
        if not isinstance(c, Mapping):
            raise ValueError("a KV workload needs a 'kv_config' object")
        config = KVConfig(
            _pos_int(c.get("num_blocks"), "num_blocks"),
            _pos_int(c.get("block_size"), "block_size"),
            bool(c.get("enable_prefix_caching", True)),
        )
        ops = d.get("ops", [])
        if not isinstance(ops, list):
            raise ValueError("'ops' must be a list")
        return KVWorkload(config, tuple(_parse_op(o, i) for i, o in enumerate(ops)))


def _pos_int(x: object, what: str) -> int:
    if not is_int(x) or x < 1:
        raise ValueError(f"{what} must be an int >= 1, got {x!r}")
    return x


def _parse_namespace(o: Mapping[str, Any], i: int) -> dict[str, str]:
    """A ``new`` op's namespace fields that are set (each a string)."""
    out: dict[str, str] = {}
    for key in NAMESPACE_FIELDS:
        v = o.get(key, "")
        if not isinstance(v, str):
            raise ValueError(f"op {i}: {key} must be a string")
        if v:
            out[key] = v
    return out


def _parse_op(o: object, i: int) -> dict[str, Any]:
    if not isinstance(o, Mapping):
        raise ValueError(f"op {i} is not an object")
    kind = o.get("op")
    spec: dict[str, tuple[str, ...]] = {
        "new": ("rid", "prompt", "n"),
        "grow": ("rid", "append", "n"),
        "fork": ("parent", "child"),
        "free": ("rid",),
    }
    if kind not in spec:
        raise ValueError(f"op {i}: unknown op {kind!r} (one of {sorted(spec)})")
    out: dict[str, Any] = {"op": kind}
    if kind == "new":
        out.update(_parse_namespace(o, i))
    for key in spec[kind]:
        v = o.get(key)
        if key in ("rid", "parent", "child"):
            if not isinstance(v, str):
                raise ValueError(f"op {i}: {key} must be a string")
        elif key == "n":
            v = _pos_int(v, f"op {i}: n")
        elif not isinstance(v, list) or any(not is_int(t) for t in v):
            raise ValueError(f"op {i}: {key} must be a list of ints")
        out[key] = list(v) if isinstance(v, list) else v
    return out


NAMESPACE_FIELDS = ("lora", "cache_salt")
"""The optional fields of a ``new`` op naming its key namespace (feature ``key_domains``):
the LoRA adapter and the cache salt; absent or ``""``: none."""


def namespace_of(op: Mapping[str, Any]) -> Namespace:
    """The key namespace a ``new`` op names (:data:`DEFAULT_NAMESPACE` when none)."""
    lora, salt = str(op.get("lora", "")), str(op.get("cache_salt", ""))
    if not (lora or salt):
        return DEFAULT_NAMESPACE
    return Namespace(adapter=lora, cache_salt=salt)


def domain_of(namespace: Namespace) -> str:
    """A namespace as findings name it."""
    if not (namespace.adapter or namespace.cache_salt):
        return "the default domain"
    return f"lora={namespace.adapter!r} salt={namespace.cache_salt!r}"


def _op_json(o: Mapping[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, list | tuple) else v for k, v in o.items()}


@dataclass(frozen=True)
class KVScenario:
    """A fixed KV workload; ``needs`` are the features without which it is not_supported."""

    name: str
    description: str
    workload: KVWorkload
    needs: frozenset[KVFeature] = frozenset()
    targets: tuple[str, ...] = ()
