"""Cache events and the replay rule (EVENTS; ref/kv/events.py publishes them).

A subscriber that starts from a pool's cache entries and applies its published events
in order must hold exactly the pool's cache entries afterwards: every change reported
once, in order, with consecutive sequence numbers, and nothing reported for a step that
rolled back. :func:`check_events` is that rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from refserve.spec.snapshot import CacheEntry, PoolSnapshot
from refserve.spec.violation import Invariant, Violation, violation


@dataclass(frozen=True)
class BlockStored:
    """Block ``block_id`` now holds the full block keyed ``key`` (PREFIX: the key is
    ``block_key(parent_key, token_ids)``)."""

    key: bytes
    parent_key: bytes
    token_ids: tuple[int, ...]
    block_id: int


@dataclass(frozen=True)
class BlockRemoved:
    """The entry ``key`` (held by ``block_id``) left the cache: evicted or forgotten."""

    key: bytes
    block_id: int


@dataclass(frozen=True)
class CacheCleared:
    """Every entry left the cache at once."""


CacheChange = BlockStored | BlockRemoved | CacheCleared


@dataclass(frozen=True)
class CacheEvent:
    """A published change and its place in the stream (0, 1, 2, ... without gaps)."""

    seq: int
    change: CacheChange


def replay(
    entries: Iterable[CacheEntry], events: Sequence[CacheEvent], first_seq: int
) -> tuple[dict[bytes, CacheEntry], list[Violation]]:
    """Apply ``events`` to ``entries``; the entries by key, and what could not apply: a
    sequence gap, a key stored twice, a removal of a key not held (or by another block)."""
    held = {e.key: e for e in entries}
    out: list[Violation] = []
    expected = first_seq
    for ev in events:
        if ev.seq != expected:
            out.append(violation(Invariant.EVENTS, "stream", "sequence gap", expected, ev.seq))
        expected = ev.seq + 1
        c = ev.change
        if isinstance(c, BlockStored):
            if c.key in held:
                out.append(_bad(ev, "stores a key the cache already holds"))
            held[c.key] = CacheEntry(c.key, c.block_id, c.parent_key, c.token_ids)
        elif isinstance(c, BlockRemoved):
            entry = held.pop(c.key, None)
            if entry is None or entry.block_id != c.block_id:
                out.append(_bad(ev, "removes an entry the cache does not hold"))
        else:
            held.clear()
    return held, out


def check_events(
    before: Iterable[CacheEntry], events: Sequence[CacheEvent], first_seq: int, after: PoolSnapshot
) -> list[Violation]:
    """EVENTS: ``before`` (the pool's entries when event ``first_seq`` was next) with the
    events applied equals ``after``'s cache entries."""
    held, out = replay(before, events, first_seq)
    mine = {e.key: e for e in after.cache_entries}
    for key in sorted(held.keys() | mine.keys()):
        if held.get(key) != mine.get(key):
            out.append(
                violation(
                    Invariant.EVENTS,
                    f"key {key.hex()[:12]}",
                    "replayed cache entry differs from the pool's",
                    mine.get(key),
                    held.get(key),
                )
            )
    return out


def _bad(ev: CacheEvent, message: str) -> Violation:
    return violation(Invariant.EVENTS, f"event {ev.seq}", message, "", ev.change)
