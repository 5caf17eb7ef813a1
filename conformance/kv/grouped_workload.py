"""The grouped KV level's records: a workload (a :class:`GroupedKVConfig` and the plain
KV level's op list, without forks and key namespaces: the grouped protocol has neither)
and a fixed scenario. Findings are the plain level's :class:`KVFinding`.

A workload as JSON::

    {"grouped_kv_config": {"num_blocks": 12, "block_size": 4,
                           "groups": [{"kind": "full"}, {"kind": "window", "window": 5}],
                           "enable_prefix_caching": true},
     "ops": [{"op": "new", "rid": "r1", "prompt": [1, 2, 3], "n": 3}, ...]}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from refserve.conformance.kv.groups import GroupedKVConfig
from refserve.conformance.kv.protocol import KVFeature
from refserve.conformance.kv.workload import NAMESPACE_FIELDS, KVWorkload
from refserve.spec.groups import GroupKind, KVGroup
from refserve.values import is_int

GROUPED_OPS = ("new", "grow", "free")
"""The ops a grouped workload holds (the plain level's, less ``fork``)."""


@dataclass(frozen=True)
class GroupedWorkload:
    """A grouped KV configuration and the op list run on it."""

    config: GroupedKVConfig
    ops: tuple[Mapping[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "grouped_kv_config": {
                "num_blocks": c.num_blocks,
                "block_size": c.block_size,
                "groups": [group_json(g) for g in c.groups],
                "enable_prefix_caching": c.enable_prefix_caching,
            },
            "ops": [dict(o) for o in self.ops],
        }

    @staticmethod
    def from_json(d: Mapping[str, Any] | str) -> GroupedWorkload:
        """Parse and validate (``ValueError`` naming what is wrong)."""
        if isinstance(d, str):
            d = json.loads(d)
        if not isinstance(d, Mapping):
            raise ValueError(f"a grouped KV workload is a JSON object, got {type(d).__name__}")
        c = d.get("grouped_kv_config")
        if not isinstance(c, Mapping):
            raise ValueError("a grouped KV workload needs a 'grouped_kv_config' object")
        raw_groups = c.get("groups")
        if not isinstance(raw_groups, list) or not raw_groups:
            raise ValueError("'groups' must be a non-empty list of {kind, window} objects")
        plain = KVWorkload.from_json(
            {
                "kv_config": {
                    "num_blocks": c.get("num_blocks"),
                    "block_size": c.get("block_size"),
                },
                "ops": d.get("ops", []),
            }
        )
        for i, o in enumerate(plain.ops):
            if o["op"] not in GROUPED_OPS:
                raise ValueError(f"op {i}: {o['op']!r} is not a grouped op {GROUPED_OPS}")
            if any(k in o for k in NAMESPACE_FIELDS):
                raise ValueError(f"op {i}: the grouped protocol has no key namespaces")
        config = GroupedKVConfig(
            plain.config.num_blocks,
            plain.config.block_size,
            tuple(parse_group(g, i) for i, g in enumerate(raw_groups)),
            bool(c.get("enable_prefix_caching", True)),
        )
        return GroupedWorkload(config, plain.ops)


def group_json(g: KVGroup) -> dict[str, Any]:
    if g.kind is GroupKind.FULL:
        return {"kind": str(g.kind)}
    return {"kind": str(g.kind), "window": g.window}


def parse_group(g: object, i: int) -> KVGroup:
    if not isinstance(g, Mapping):
        raise ValueError(f"groups[{i}] is not an object")
    kind, window = g.get("kind"), g.get("window", 0)
    if kind not in tuple(str(k) for k in GroupKind):
        raise ValueError(f"groups[{i}].kind must be one of {[str(k) for k in GroupKind]}")
    if not is_int(window):
        raise ValueError(f"groups[{i}].window must be an int, got {window!r}")
    try:
        return KVGroup(GroupKind(kind), window)
    except ValueError as e:
        raise ValueError(f"groups[{i}]: {e}") from None


def layout(*windows: int) -> tuple[KVGroup, ...]:
    """One full group, then a window group per ``windows`` entry."""
    return (KVGroup(GroupKind.FULL), *(KVGroup(GroupKind.WINDOW, w) for w in windows))


@dataclass(frozen=True)
class GroupedScenario:
    """A fixed grouped workload; ``needs``: the features without which it is
    not_supported."""

    name: str
    description: str
    workload: GroupedWorkload
    needs: frozenset[KVFeature] = frozenset()
