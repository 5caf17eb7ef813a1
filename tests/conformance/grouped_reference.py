"""Grouped KV managers for the grouped suite's own tests: two correct designs and
planted bugs.

:class:`GroupedRef` is a small, plain, correct grouped manager (conformance/kv/groups.py):
one shared pool with reference counts and an LRU free queue (a freed block keeps its
cache entry until it is handed out again), a prefix cache per group (keys chained per
group), and a hit taken only when complete in every group: a full group's blocks for
the whole prefix, a window group's for the blocks its next query reads. With
``eager=True`` (feature ``window_eager_free``) every allocation releases the request's
window blocks wholly before its window; with ``eager=False`` they stay until the pool
runs dry, when the manager takes back every request's out-of-window blocks. Both must
pass the suite with zero findings.

``bug`` plants one fault (eager design), each caught by the rule that names it:

- ``window_early``: a grow releases the blocks before ``window_start + 1``, one token
  too many (window-early);
- ``hit_missing_window``: the hit check skips the first block a window group reads,
  and a hit is taken without it (prefix-complete);
- ``free_shared``: freeing a request puts its window blocks back in the free queue
  even while another request still holds them (BLOCK);
- ``full_drops``: the full group is trimmed as if it were a window (full-null).

``release_on_refusal`` is vLLM's order (a refused grow has already released the
blocks past the window): correct too. Importable as ``grouped_reference:make`` (and
``make_lazy``, ``make_release_on_refusal``) with ``tests/conformance``
on ``sys.path``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from refserve.conformance.kv.groups import GroupedAllocation, GroupedKVConfig
from refserve.conformance.kv.protocol import KVFeature, NoSpace
from refserve.spec.arith import blocks_needed
from refserve.spec.groups import (
    NULL_BLOCK,
    GroupedSnapshot,
    GroupKind,
    GroupTable,
    KVGroup,
    window_start,
)
from refserve.spec.hashing import chain_keys
from refserve.spec.snapshot import CacheEntry, PoolSnapshot, TableSnapshot

BUGS = ("window_early", "hit_missing_window", "free_shared", "full_drops")


class GroupedRef:
    """A correct grouped manager (unless ``bug`` is one of :data:`BUGS`)."""

    name = "grouped-ref"

    def __init__(
        self, *, eager: bool = True, bug: str = "", release_on_refusal: bool = False
    ) -> None:
        assert bug in ("", *BUGS), bug
        self.eager = eager
        # vLLM's order: a grow releases the blocks past the window before it checks for
        # room, so a refused grow has released them too (the suite allows exactly that).
        self.release_on_refusal = release_on_refusal
        self.bug = bug
        self.configure(GroupedKVConfig(1, 1, (KVGroup(GroupKind.FULL),)))

    @property
    def features(self) -> frozenset[KVFeature]:
        f = {KVFeature.PREFIX_CACHING, KVFeature.PREFIX_CACHING_OPTIONAL}
        if self.eager:
            f.add(KVFeature.WINDOW_EAGER_FREE)
        return frozenset(f)

    def configure(self, config: GroupedKVConfig) -> None:
        self.config = config
        self.bs = config.block_size
        self.ref = [0] * config.num_blocks
        self.free_queue = list(range(config.num_blocks))
        self.cache: dict[bytes, int] = {}
        self.entries: dict[int, CacheEntry] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.stored: dict[str, int] = {}

    # ------------------------------------------------------------------ helpers
    def _first_read(self, group: KVGroup, num_tokens: int) -> int:
        """The first logical block the query at ``num_tokens`` reads in ``group``."""
        if group.kind is GroupKind.FULL:
            return 0
        return window_start(num_tokens, group.window) // self.bs

    def _keys(self, g: int, tokens: Sequence[int], k: int) -> list[bytes]:
        return chain_keys(f"group-{g}".encode(), tokens, self.bs, k)

    def _take(self, b: int) -> int:
        if self.ref[b] == 0:
            self.free_queue.remove(b)
        self.ref[b] += 1
        return b

    def _fresh(self) -> int:
        if not self.free_queue:
            raise NoSpace
        b = self.free_queue.pop(0)
        gone = self.entries.pop(b, None)
        if gone is not None:
            del self.cache[gone.key]
        self.ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free_queue.append(b)

    def release_past_window(self, rid: str, num_tokens: int, *, grow: bool) -> None:
        """Release ``rid``'s window blocks wholly before the window at ``num_tokens``."""
        smallest = min((g.window for g in self.config.groups if g.window), default=0)
        for g, group in enumerate(self.config.groups):
            lo = self._first_read(group, num_tokens)
            if self.bug == "window_early" and grow and group.kind is GroupKind.WINDOW:
                lo = (window_start(num_tokens, group.window) + 1) // self.bs
            if self.bug == "full_drops" and group.kind is GroupKind.FULL and smallest:
                lo = window_start(num_tokens, smallest) // self.bs
            row = self.tables[rid][g]
            for i in range(min(lo, len(row))):
                if row[i] != NULL_BLOCK:
                    self._release(row[i])
                    row[i] = NULL_BLOCK

    def _reclaim(self) -> None:
        """Lazy design, out of room: every request's out-of-window blocks go back."""
        for rid in sorted(self.tables):
            self.release_past_window(rid, self.stored[rid], grow=False)

    # ------------------------------------------------------------------ the protocol
    def _hit(self, tokens: Sequence[int], n: int) -> int:
        """The longest prefix, whole blocks, cached in every group where it is read."""
        if not self.config.enable_prefix_caching:
            return 0
        for k in range((len(tokens) - n) // self.bs, 0, -1):
            h = k * self.bs
            complete = True
            for g, group in enumerate(self.config.groups):
                keys = self._keys(g, tokens, k)
                lo = self._first_read(group, h)
                if self.bug == "hit_missing_window" and group.kind is GroupKind.WINDOW:
                    lo += 1
                complete = complete and all(keys[i] in self.cache for i in range(lo, k))
            if complete:
                return h
        return 0

    def _place(self, rid: str, tokens: list[int], n: int, hit: int) -> GroupedAllocation:
        grow = rid in self.tables
        if not grow:
            k = hit // self.bs
            self.tables[rid] = []
            for g, group in enumerate(self.config.groups):
                keys = self._keys(g, tokens, k)
                lo = self._first_read(group, hit)
                row = [NULL_BLOCK] * lo
                for i in range(lo, k):
                    b = self.cache.get(keys[i])
                    row.append(NULL_BLOCK if b is None else self._take(b))
                self.tables[rid].append(row)
            self.stored[rid] = hit
        self.tokens[rid] = tokens
        start = self.stored[rid]
        if self.eager:
            self.release_past_window(rid, start, grow=grow)
        end = blocks_needed(start + n, self.bs)
        for row in self.tables[rid]:
            while len(row) < end:
                try:
                    row.append(self._fresh())
                except NoSpace:
                    if self.eager:
                        raise
                    self._reclaim()
                    row.append(self._fresh())
        self.stored[rid] = start + n
        self._index(rid)
        return GroupedAllocation(tuple(tuple(r) for r in self.tables[rid]), hit)

    def _index(self, rid: str) -> None:
        """Cache every full block of ``rid`` not cached yet, per group."""
        tokens, k = self.tokens[rid], self.stored[rid] // self.bs
        for g, row in enumerate(self.tables[rid]):
            keys = self._keys(g, tokens, k)
            for i in range(k):
                b = row[i]
                if b == NULL_BLOCK or b in self.entries or keys[i] in self.cache:
                    continue
                parent = keys[i - 1] if i else f"group-{g}".encode()
                chunk = tuple(tokens[i * self.bs : (i + 1) * self.bs])
                self.entries[b] = CacheEntry(keys[i], b, parent, chunk)
                self.cache[keys[i]] = b

    def allocate(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens: int
    ) -> GroupedAllocation:
        tokens = list(token_ids)
        hit = self._hit(tokens, num_new_tokens) if request_id not in self.tables else 0
        for h in dict.fromkeys((hit, 0)):  # a hit it cannot afford: try without it
            saved = self._save()
            try:
                return self._place(request_id, tokens, num_new_tokens, h)
            except NoSpace:
                self._restore(saved)
        if self.release_on_refusal and request_id in self.tables:
            self.release_past_window(request_id, self.stored[request_id], grow=True)
        raise NoSpace

    def free(self, request_id: str) -> None:
        for g, row in enumerate(self.tables.pop(request_id)):
            window = self.config.groups[g].kind is GroupKind.WINDOW
            for b in row:
                if b == NULL_BLOCK:
                    continue
                if self.bug == "free_shared" and window and self.ref[b] > 1:
                    self.ref[b] -= 1
                    self.free_queue.append(b)
                else:
                    self._release(b)
        del self.tokens[request_id], self.stored[request_id]

    def snapshot(self) -> GroupedSnapshot:
        c = self.config
        pool = PoolSnapshot(
            c.num_blocks,
            c.block_size,
            tuple(self.ref),
            tuple(self.free_queue),
            (),
            tuple(self.entries[b] for b in sorted(self.entries)),
        )
        tables = tuple(
            GroupTable(
                g,
                TableSnapshot(
                    rid, tuple(row), self.stored[rid], tuple(self.tokens[rid][: self.stored[rid]])
                ),
            )
            for rid in sorted(self.tables)
            for g, row in enumerate(self.tables[rid])
        )
        return GroupedSnapshot(c.groups, pool, tables)

    # ------------------------------------------------------------------ transactions
    def _save(self) -> dict[str, Any]:
        keys = ("ref", "free_queue", "cache", "entries", "tables", "tokens", "stored")
        return {k: copy.deepcopy(getattr(self, k)) for k in keys}

    def _restore(self, saved: dict[str, Any]) -> None:
        for k, v in saved.items():
            setattr(self, k, v)


def make() -> GroupedRef:
    return GroupedRef()


def make_lazy() -> GroupedRef:
    return GroupedRef(eager=False)


def make_release_on_refusal() -> GroupedRef:
    return GroupedRef(release_on_refusal=True)


def make_window_early() -> GroupedRef:
    return GroupedRef(bug="window_early")


def make_hit_missing_window() -> GroupedRef:
    return GroupedRef(bug="hit_missing_window")


def make_free_shared() -> GroupedRef:
    return GroupedRef(bug="free_shared")


def make_full_drops() -> GroupedRef:
    return GroupedRef(bug="full_drops")


def make_broken_factory() -> GroupedRef:
    raise RuntimeError("no such engine build here")
