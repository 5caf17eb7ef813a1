"""The prefix index: full blocks by the key of their hash chain (PREFIX invariant).

One concept (docs/ARCHITECTURE.md, "Layers", KV memory): a full block's key is
``block_key(parent key, its token ids)``, chained from a namespace's root
(spec/hashing.py; :meth:`PrefixIndex.root_key`), so one key names a whole prefix. The
index maps a key to the block holding it and keeps, per block, what its key was
computed from; a lookup confirms every hit by that identity, so a stale or colliding
key can only cost a miss, never a wrong reuse. Only full blocks are indexed, and a
block loses its entry before it is reused for other tokens (PREFIX).

Every change to the index goes through :meth:`PrefixIndex._put` and
:meth:`PrefixIndex._drop` (and :meth:`PrefixIndex.clear`), each a run of entries with one
journal entry whose undo (``_unput`` / ``_undrop``) changes the index back and reports
nothing (ATOMIC): the one place to observe what the cache gains and loses, and where the
cache events of ref/kv/events.py are reported. Which
blocks are held, free or in a table is the pool's (ref/kv/pool.py); the index reads a
table (ref/kv/tables.py) through :class:`Chain`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from types import MappingProxyType
from typing import NamedTuple, Protocol

from refserve.errors import InvalidArgument
from refserve.kv.events import CacheEventLog
from refserve.kv.journal import Journal
from refserve.spec.arith import full_blocks, max_cacheable_tokens
from refserve.spec.hashing import (
    DEFAULT_NAMESPACE,
    Namespace,
    block_key,
    packed_block_key,
    packed_token_ids,
)
from refserve.spec.snapshot import CacheEntry

NOTHING_EVICTED: Mapping[bytes, int] = MappingProxyType({})
"""No key evicted by a later request of the step (see :meth:`PrefixIndex.cache_filled`)."""


@dataclass(frozen=True)
class PrefixHit:
    """Full blocks of a prompt found in the prefix cache (possibly none).

    ``num_skipped``: a sliding-window layer group's hit (ref/kv/groups.py) needs only
    the blocks its next query reads; the first ``num_skipped`` blocks of the prefix are
    not held (the table keeps their places as ``NULL_BLOCK``), ``block_ids`` are the
    blocks after them and ``keys`` the chain keys of the whole prefix."""

    root_key: bytes
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    block_size: int
    num_skipped: int = 0

    @property
    def num_tokens(self) -> int:
        return (self.num_skipped + len(self.block_ids)) * self.block_size


class Entry(NamedTuple):
    """A block's cache entry: the fields of :class:`refserve.spec.snapshot.CacheEntry`. A named
    tuple is made in a third of the frozen dataclass's time, once per block that fills
    with prefix caching on."""

    key: bytes
    block_id: int
    parent_key: bytes
    token_ids: tuple[int, ...]


_new_entry = tuple.__new__


class Chain(Protocol):
    """What the index reads of a block table, and extends: ``keys`` are the chain keys
    of its first full blocks, from ``root_key`` (a :class:`~refserve.kv.tables.BlockTable`)."""

    root_key: bytes
    keys: list[bytes]
    token_ids: list[int]
    block_table: list[int]


@dataclass(frozen=True)
class FilledBlocks:
    """The token ids of the blocks a decode step fills, one block per filling request,
    and all of them encoded at once for hashing (``refserve.spec.hashing.packed_token_ids``, 8
    bytes a token id): block ``j`` is the ``j``-th ``8 * block_size`` bytes of ``packed``."""

    blocks: Sequence[Sequence[int]]
    packed: bytes


def filled_blocks(
    filled: Sequence[Sequence[int]], num_filling: int, block_size: int
) -> FilledBlocks:
    """``filled`` checked (``num_filling`` blocks of ``block_size`` int64 token ids) and
    encoded in one call; an :class:`InvalidArgument` names what is wrong."""
    if len(filled) != num_filling:
        raise InvalidArgument(
            f"append_decodes: {len(filled)} filled blocks for {num_filling} filling requests"
        )
    try:
        packed = packed_token_ids(chain.from_iterable(filled))
    except (OverflowError, TypeError) as e:
        raise InvalidArgument(f"append_decodes: a filled block holds a bad token id ({e})") from e
    if len(packed) != 8 * block_size * len(filled):
        lengths = sorted({len(b) for b in filled} - {block_size})
        raise InvalidArgument(
            f"append_decodes: a filled block holds {lengths[0]} token ids, "
            f"not the block size {block_size}"
        )
    return FilledBlocks(filled, packed)


class PrefixIndex:
    """Cache entries of the full blocks of ``num_blocks`` blocks of ``block_size``."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        journal: Journal,
        events: CacheEventLog | None = None,
    ) -> None:
        self.block_size = block_size
        self._journal = journal
        self.events = events  # None: nobody subscribed, nothing is reported
        self._index: dict[bytes, int] = {}
        self._entry: list[Entry | None] = [None] * num_blocks
        # Blocks indexed inside the open transaction: their K/V is computed by the step
        # that reserved them, so a lookup in that same step must not serve them.
        self._fresh: set[int] = set()
        # Namespace.root_key() hashes on every call; nearly every request has the default.
        self._default_root = DEFAULT_NAMESPACE.root_key()

    # ------------------------------------------------------------------ queries
    def root_key(self, namespace: Namespace) -> bytes:
        """The root of ``namespace``'s chains: keys of two namespaces never meet."""
        return self._default_root if namespace is DEFAULT_NAMESPACE else namespace.root_key()

    def entries(self) -> list[CacheEntry]:
        """Every entry, by block id (for the pool's snapshot)."""
        found = [CacheEntry(*e) for b in self._index.values() if (e := self._entry[b]) is not None]
        return sorted(found, key=_block_id)

    def lookup(self, token_ids: Sequence[int], root_key: bytes) -> PrefixHit:
        """Longest chain of indexed full blocks matching ``token_ids``; never the last
        token (``refserve.spec.arith.max_cacheable_tokens``). Each hit is confirmed by identity
        (stored parent key and token ids). Blocks indexed by the open transaction are
        not served: the step that reserved them has not computed their K/V yet."""
        bs = self.block_size
        index, entries, fresh = self._index, self._entry, self._fresh
        blocks: list[int] = []
        keys: list[bytes] = []
        parent = root_key
        for i in range(full_blocks(max_cacheable_tokens(len(token_ids), bs), bs)):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = block_key(parent, tokens)
            b = index.get(key)
            if b is None or b in fresh:
                break
            entry = entries[b]
            if entry is None or entry.parent_key != parent or entry.token_ids != tokens:
                break
            blocks.append(b)
            keys.append(key)
            parent = key
        return PrefixHit(root_key, tuple(blocks), tuple(keys), bs)

    def served(self, key: bytes, parent_key: bytes, token_ids: tuple[int, ...]) -> int | None:
        """The block serving the full block ``key`` now, confirmed as :meth:`lookup`
        confirms a hit, or None: one block of a chain read past misses (a window
        group's lookup, ref/kv/groups.py)."""
        b = self._index.get(key)
        if b is None or b in self._fresh:
            return None
        entry = self._entry[b]
        ok = entry is not None and entry.parent_key == parent_key and entry.token_ids == token_ids
        return b if ok else None

    def check_hit(
        self, request_id: str, hit: PrefixHit, token_ids: Sequence[int], root_key: bytes
    ) -> None:
        """Refuse (:class:`InvalidArgument`) a hit that is not for ``token_ids`` in this
        index now: from another pool or namespace, covering the last token, stale (a
        block evicted since the lookup) or looked up for other token ids (PREFIX)."""
        bs = self.block_size
        if hit.block_size != bs or hit.root_key != root_key:
            raise InvalidArgument(
                f"allocate: prefix hit for {request_id!r} comes from another pool or namespace"
            )
        if hit.num_tokens > max_cacheable_tokens(max(len(token_ids), 1), bs):
            raise InvalidArgument(
                f"allocate: prefix hit for {request_id!r} covers {hit.num_tokens} tokens of "
                f"{len(token_ids)}; the last token must be recomputed"
            )
        # A window hit's skipped blocks: their keys are the caller's to check.
        skipped = hit.num_skipped
        parent = hit.keys[skipped - 1] if skipped else hit.root_key
        for i, (b, key) in enumerate(zip(hit.block_ids, hit.keys[skipped:], strict=True), skipped):
            if self._index.get(key) != b:
                raise InvalidArgument(
                    f"allocate: prefix hit for {request_id!r} is stale (block {b} was evicted)"
                )
            entry = self._entry[b]
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            if entry is None or entry.parent_key != parent or entry.token_ids != tokens:
                raise InvalidArgument(
                    f"allocate: prefix hit for {request_id!r} does not match its token ids "
                    f"at block {i} (block {b} holds {entry.token_ids if entry else None}, "
                    f"the request has {tokens})"
                )
            parent = key

    # ---------------------------------------------------------------- mutations
    def end_transaction(self) -> None:
        """The step's transaction closed: the blocks it indexed may be served, and its
        cache events are published (after a rollback there are none left)."""
        if self._fresh:
            self._fresh.clear()
        if self.events is not None:
            self.events.publish()

    def clear(self) -> int:
        """Drop every entry (a reset of the cache; the blocks stay where they are held);
        one cleared event, not one per entry. Returns how many entries were dropped."""
        block_ids = list(self._index.values())
        dropped = self._remove(block_ids)
        if dropped:
            self._journal.record(self._undrop, dropped)
        if self.events is not None:
            self.events.cleared()
        return len(dropped)

    def cache_full_blocks(self, table: Chain) -> None:
        """Key ``table``'s full blocks that have none yet (the keys join ``table.keys``)
        and index each whose key is free: two requests may compute the same new prefix
        in one step; the first one indexed wins and the other block stays private."""
        keys = table.keys
        first = len(keys)
        if first == full_blocks(len(table.token_ids), self.block_size):
            return  # no block filled since the last call (most calls)
        new: list[Entry] = []
        self._chain(table, new, NOTHING_EVICTED, 0)
        if len(keys) > first:
            self._journal.record(_truncate, keys, first)
        self._put(new)

    def cache_filled(
        self,
        tables: Sequence[Chain],
        filling: Sequence[int],
        evicted: Mapping[bytes, int],
        filled: FilledBlocks | None,
    ) -> None:
        """Index the block each of ``tables[i]`` (``i`` in ``filling``, ascending) just
        filled, as :meth:`cache_full_blocks` would table by table in that order, each
        after the pops of the requests before it: ``evicted`` holds each key the step's
        pops evicted with the place of the request that popped it, and a key evicted by
        a later request is still taken here. With the blocks' tokens given (``filled``)
        and every earlier block of a table keyed, its one new key is hashed from them.
        One journal entry for the keys, one for the index."""
        grown: list[tuple[list[bytes], int]] = []
        new: list[Entry] = []
        index, entries = self._index, self._entry
        packed = filled.packed if filled is not None else b""
        width = 8 * self.block_size  # bytes per block in packed
        for j, i in enumerate(filling):
            t = tables[i]
            keys = t.keys
            first = len(keys)
            grown.append((keys, first))
            if filled is None or first != len(t.block_table) - 1:
                self._chain(t, new, evicted, i)
                continue
            # _chain's loop for this one block, its tokens encoded with all the others'
            # (FilledBlocks): a method call and a struct pack per block were half of the
            # step's hashing cost.
            parent = keys[-1] if keys else t.root_key
            key = packed_block_key(parent, packed[j * width : (j + 1) * width])
            keys.append(key)
            b = t.block_table[first]
            if entries[b] is None and key not in index and evicted.get(key, -1) <= i:
                new.append(_new_entry(Entry, (key, b, parent, tuple(filled.blocks[j]))))
        if grown:
            self._journal.record(_truncate_each, grown)
        self._put(new)

    def forget(self, block_ids: Sequence[int]) -> list[Entry]:
        """Drop the entries of those of ``block_ids`` that have one (their K/V is about
        to change or can no longer be trusted); the entries dropped, in order."""
        if not self._index:  # nothing indexed (or caching off): nothing to look at
            return []
        entries = self._entry
        return self._drop([b for b in block_ids if entries[b] is not None])

    # ----------------------------------------------------------------- internals
    def _chain(
        self, table: Chain, new: list[Entry], evicted: Mapping[bytes, int], place: int
    ) -> None:
        """Hash ``table``'s full blocks that have no key yet (the keys join
        ``table.keys``) and append to ``new`` an entry for each whose key and block are
        free; a key ``evicted`` by a request after ``place`` counts as taken."""
        bs = self.block_size
        keys, token_ids, block_table = table.keys, table.token_ids, table.block_table
        index, entries = self._index, self._entry
        parent = keys[-1] if keys else table.root_key
        for i in range(len(keys), full_blocks(len(token_ids), bs)):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = block_key(parent, tokens)
            keys.append(key)
            b = block_table[i]
            if entries[b] is None and key not in index and evicted.get(key, -1) <= place:
                new.append(_new_entry(Entry, (key, b, parent, tokens)))
            parent = key

    def _put(self, new: list[Entry]) -> None:
        """Index ``new``, in order, each whose key is still free (an earlier one of
        ``new`` may hold it: the first wins), with one journal entry. One of the two
        changes the index knows, :meth:`_drop` the other."""
        if not new:
            return
        index, entries = self._index, self._entry
        put: list[int] = []
        for e in new:
            key, b, _, _ = e  # unpacked: a named field read costs a descriptor call
            if key not in index:
                index[key] = b
                entries[b] = e
                put.append(b)
        if self._journal.active:
            self._fresh.update(put)
            self._journal.record(self._unput, put)
        if self.events is not None:
            stored = set(put)
            self.events.stored([e for e in new if e[1] in stored and entries[e[1]] is e])

    def _drop(self, block_ids: list[int]) -> list[Entry]:
        """Drop the entries of ``block_ids`` (each has one), with one journal entry; the
        entries dropped, in order."""
        dropped = self._remove(block_ids)
        if dropped:
            self._journal.record(self._undrop, dropped)
            if self.events is not None:
                self.events.removed(dropped)
        return dropped

    def _unput(self, block_ids: list[int]) -> None:
        """Undo of :meth:`_put`: its entries leave again; nothing is reported (the
        step's pending events are taken back with it, ref/kv/events.py)."""
        self._remove(block_ids)

    def _undrop(self, dropped: list[Entry]) -> None:
        """Undo of :meth:`_drop` (and :meth:`clear`): the entries come back, unreported."""
        index, entries = self._index, self._entry
        for e in dropped:
            if e[0] not in index:
                index[e[0]] = e[1]
                entries[e[1]] = e

    def _remove(self, block_ids: list[int]) -> list[Entry]:
        index, entries = self._index, self._entry
        dropped: list[Entry] = []
        for b in block_ids:
            entry = entries[b]
            assert entry is not None, f"block {b} has no cache entry to drop"
            del index[entry[0]]  # its key (see _put)
            entries[b] = None
            dropped.append(entry)
        return dropped


def _truncate(items: list[bytes], n: int) -> None:
    del items[n:]


def _truncate_each(grown: list[tuple[list[bytes], int]]) -> None:
    for items, n in grown:
        del items[n:]


def _block_id(e: CacheEntry) -> int:
    return e.block_id
