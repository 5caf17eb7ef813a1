"""Reading what a KV adapter returns: a snapshot or an Allocation (plain or grouped)
duck-typed into plain ints, bytes and tuples, or :class:`Malformed` naming the field
that is not (PROGRESS: a malformed answer is a finding, never a crash of the suite)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import cast

from refserve.conformance.kv.groups import GroupedAllocation
from refserve.conformance.kv.protocol import KVFeature
from refserve.spec.groups import GroupedSnapshot, GroupKind, GroupTable, KVGroup
from refserve.spec.snapshot import CacheEntry, PoolSnapshot, TableSnapshot
from refserve.values import is_int


class Malformed(Exception):
    """The adapter returned something not shaped as the protocol says."""


def _kind(x: object) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _int(x: object, what: str) -> int:
    if not is_int(x):
        raise Malformed(f"{what} is {_kind(x)}, not an int")
    return int(x)


def _ints(x: object, what: str) -> tuple[int, ...]:
    if not isinstance(x, tuple | list):
        raise Malformed(f"{what} is {_kind(x)}, not a tuple of ints")
    return tuple(_int(v, f"{what}[{i}]") for i, v in enumerate(x))


def _bytes(x: object, what: str) -> bytes:
    if not isinstance(x, bytes):
        raise Malformed(f"{what} is {_kind(x)}, not bytes")
    return x


def _seq(x: object, what: str) -> tuple[object, ...]:
    if not isinstance(x, tuple | list):
        raise Malformed(f"{what} is {_kind(x)}, not a tuple")
    return tuple(x)


def _attr(obj: object, name: str, what: str) -> object:
    if not hasattr(obj, name):
        raise Malformed(f"{what} ({type(obj).__name__}) has no {name!r}")
    return cast(object, getattr(obj, name))


def normalize_snapshot(raw: object) -> PoolSnapshot:
    """A plain :class:`PoolSnapshot` of ints, bytes and tuples from whatever the adapter
    returned (duck-typed), or :class:`Malformed` saying which field is wrong."""
    if raw is None:
        raise Malformed("None, not a PoolSnapshot")
    tables = [
        _table(t, f"tables[{i}]")
        for i, t in enumerate(_seq(_attr(raw, "tables", "snapshot"), "tables"))
    ]
    entries: list[CacheEntry] = []
    raw_entries = getattr(raw, "cache_entries", ())
    for i, e in enumerate(_seq(raw_entries, "cache_entries")):
        w = f"cache_entries[{i}]"
        entries.append(
            CacheEntry(
                _bytes(_attr(e, "key", w), f"{w}.key"),
                _int(_attr(e, "block_id", w), f"{w}.block_id"),
                _bytes(_attr(e, "parent_key", w), f"{w}.parent_key"),
                _ints(_attr(e, "token_ids", w), f"{w}.token_ids"),
            )
        )
    return PoolSnapshot(
        num_blocks=_int(_attr(raw, "num_blocks", "snapshot"), "num_blocks"),
        block_size=_int(_attr(raw, "block_size", "snapshot"), "block_size"),
        ref_cnt=_ints(_attr(raw, "ref_cnt", "snapshot"), "ref_cnt"),
        free_queue=_ints(_attr(raw, "free_queue", "snapshot"), "free_queue"),
        tables=tuple(tables),
        cache_entries=tuple(entries),
        stated_free=_stated_free(raw),
    )


def _table(t: object, w: str) -> TableSnapshot:
    rid = _attr(t, "request_id", w)
    if not isinstance(rid, str):
        raise Malformed(f"{w}.request_id is {_kind(rid)}, not a str")
    return TableSnapshot(
        rid,
        _ints(_attr(t, "block_table", w), f"{w}.block_table"),
        _int(_attr(t, "num_stored", w), f"{w}.num_stored"),
        _ints(_attr(t, "token_ids", w), f"{w}.token_ids"),
        _bytes(_attr(t, "root_key", w), f"{w}.root_key"),
    )


def normalize_grouped_snapshot(raw: object) -> GroupedSnapshot:
    """A plain :class:`GroupedSnapshot` from whatever a grouped adapter returned
    (duck-typed), or :class:`Malformed` saying which field is wrong."""
    if raw is None:
        raise Malformed("None, not a GroupedSnapshot")
    groups: list[KVGroup] = []
    for i, g in enumerate(_seq(_attr(raw, "groups", "snapshot"), "groups")):
        kind, window = _attr(g, "kind", f"groups[{i}]"), _attr(g, "window", f"groups[{i}]")
        try:
            groups.append(KVGroup(GroupKind(str(kind)), _int(window, f"groups[{i}].window")))
        except ValueError as e:
            raise Malformed(f"groups[{i}] is not a KVGroup: {e}") from None
    tables: list[GroupTable] = []
    for i, t in enumerate(_seq(_attr(raw, "tables", "snapshot"), "tables")):
        w = f"tables[{i}]"
        group = _int(_attr(t, "group", w), f"{w}.group")
        tables.append(GroupTable(group, _table(_attr(t, "table", w), f"{w}.table")))
    pool = normalize_snapshot(_attr(raw, "pool", "snapshot"))
    return GroupedSnapshot(tuple(groups), pool, tuple(tables))


def normalize_grouped_allocation(raw: object) -> GroupedAllocation:
    """The GroupedAllocation the adapter returned, or :class:`Malformed` naming the field."""
    if raw is None:
        raise Malformed("None, not a GroupedAllocation")
    tables = _seq(_attr(raw, "block_tables", "GroupedAllocation"), "block_tables")
    hit = _int(_attr(raw, "num_cached_tokens", "GroupedAllocation"), "num_cached_tokens")
    return GroupedAllocation(
        tuple(_ints(t, f"block_tables[{i}]") for i, t in enumerate(tables)), hit
    )


def _stated_free(raw: object) -> int | None:
    value = getattr(raw, "stated_free", None)
    return None if value is None else _int(value, "stated_free")


@dataclass(frozen=True)
class Granted:
    """A normalized :class:`~refserve.conformance.kv.protocol.Allocation`: the request's table
    after the call, the tokens served from the cache, the (src, dst) copies to do."""

    block_table: tuple[int, ...]
    num_cached_tokens: int
    copies: tuple[tuple[int, int], ...]


def normalize_allocation(raw: object) -> Granted:
    """The Allocation the adapter returned, or :class:`Malformed` naming the field."""
    if raw is None:
        raise Malformed("None, not an Allocation")
    table = _ints(_attr(raw, "block_table", "Allocation"), "block_table")
    hit = _int(_attr(raw, "num_cached_tokens", "Allocation"), "num_cached_tokens")
    copies: list[tuple[int, int]] = []
    for i, c in enumerate(_seq(_attr(raw, "copies", "Allocation"), "copies")):
        pair = _ints(c, f"copies[{i}]")
        if len(pair) != 2:
            raise Malformed(f"copies[{i}] is not a (src, dst) pair")
        copies.append((pair[0], pair[1]))
    return Granted(table, hit, tuple(copies))


def as_features(raw: object) -> frozenset[KVFeature]:
    """The adapter's ``features`` as KVFeature values (``TypeError``/``ValueError`` if not)."""
    if not isinstance(raw, set | frozenset | list | tuple):
        raise TypeError(f"features is {_kind(raw)}, not a set of KVFeature")
    out: set[KVFeature] = set()
    for f in raw:
        if not isinstance(f, str):
            raise TypeError(f"feature {_kind(f)} is not a KVFeature")
        out.add(KVFeature(f))
    return frozenset(out)


def canonical(s: PoolSnapshot) -> PoolSnapshot:
    """The snapshot with the manager's design-choice orders removed (free-queue order,
    cache-entry order), so ATOMIC compares what a failed call may not change."""
    return replace(
        s,
        free_queue=tuple(sorted(s.free_queue)),
        tables=tuple(sorted(s.tables, key=lambda t: t.request_id)),
        cache_entries=tuple(sorted(s.cache_entries, key=lambda e: (e.block_id, e.key))),
    )


def short(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
