"""The paged KV block pool: block tables, ref counts, prefix cache, fork, copy-on-write.

Invariants it maintains are checked from outside on :meth:`BlockPool.snapshot`
(spec.check_pool): BLOCK (ref counts equal holders, the free queue is exact), CAP, POS
(tables cover their KV length exactly) and PREFIX (hash chains, full blocks only, shared
blocks never written). Every mutating method validates first and mutates after, so a
bad argument raises a typed error with nothing changed; inside
:meth:`BlockPool.transaction` a later failure undoes the whole group.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ref.errors import (
    DuplicateRequest,
    ExceedsCapacity,
    InvalidArgument,
    OutOfBlocks,
    UnknownRequest,
)
from ref.kv.free_queue import FreeQueue
from ref.kv.journal import Journal
from spec.arith import blocks_needed, max_cacheable_tokens
from spec.hashing import DEFAULT_NAMESPACE, Namespace, block_key
from spec.snapshot import CacheEntry, PoolSnapshot, TableSnapshot


@dataclass(frozen=True)
class PrefixHit:
    """Full blocks of a prompt found in the prefix cache (possibly none)."""

    root_key: bytes
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.block_ids) * self.block_size


@dataclass(frozen=True)
class BlockCopy:
    """Copy-on-write: the executor copies K/V of block ``src`` into ``dst`` before writing."""

    src: int
    dst: int


@dataclass(frozen=True)
class Allocation:
    """What :meth:`BlockPool.allocate` did for one request."""

    request_id: str
    start_position: int
    num_new_tokens: int
    num_cached_tokens: int
    new_block_ids: tuple[int, ...]
    copies: tuple[BlockCopy, ...]


class _Table:
    """One request's block table and the token ids whose K/V its blocks hold."""

    __slots__ = ("block_table", "keys", "root_key", "token_ids")

    def __init__(self, root_key: bytes) -> None:
        self.root_key = root_key
        self.block_table: list[int] = []
        self.keys: list[bytes] = []  # chain keys of this table's full blocks, in order
        self.token_ids: list[int] = []

    @property
    def num_stored(self) -> int:
        return len(self.token_ids)


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots, shared by all requests."""

    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True
    ) -> None:
        _require_int(num_blocks, "num_blocks", minimum=1)
        _require_int(block_size, "block_size", minimum=1)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._journal = Journal()
        self._free = FreeQueue(num_blocks, self._journal)
        self._ref = [0] * num_blocks
        self._tables: dict[str, _Table] = {}
        # Prefix cache: key -> block, and per block what its key was computed from.
        self._index: dict[bytes, int] = {}
        self._entry: list[CacheEntry | None] = [None] * num_blocks
        # Blocks indexed inside the open transaction: their K/V is computed by the step
        # that reserved them, so a lookup in that same step must not serve them.
        self._fresh: set[int] = set()

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._table(request_id, "block_table").block_table)

    def block_table_view(self, request_id: str) -> Sequence[int]:
        """The live table (read-only by convention) for hot paths that cannot copy."""
        return self._table(request_id, "block_table_view").block_table

    def block_table_views(self, request_ids: Sequence[str]) -> list[Sequence[int]]:
        """Live tables of several requests at once (read-only by convention)."""
        tables = self._tables
        try:
            return [tables[rid].block_table for rid in request_ids]
        except KeyError as e:
            raise UnknownRequest(str(e.args[0]), "block_table_views") from None

    def num_stored(self, request_id: str) -> int:
        return self._table(request_id, "num_stored").num_stored

    def lookup(
        self, token_ids: Sequence[int], namespace: Namespace = DEFAULT_NAMESPACE
    ) -> PrefixHit:
        """Longest chain of cached full blocks matching ``token_ids``; never the last token.

        Each hit is confirmed by identity (stored parent key and token ids), not by the
        key alone, so a stale index entry can only cause a miss, never a wrong reuse.
        Blocks indexed by the open transaction are not served: the step that reserved
        them has not computed their K/V yet (two requests sharing a new prefix in one
        step each compute it; the second reuses it from the next step on).
        """
        if len(token_ids) < 1:
            raise InvalidArgument("lookup: token_ids is empty; a request needs at least one token")
        root = namespace.root_key()
        if not self.enable_prefix_caching:
            return PrefixHit(root, (), (), self.block_size)
        bs = self.block_size
        blocks: list[int] = []
        keys: list[bytes] = []
        parent = root
        for i in range(max_cacheable_tokens(len(token_ids), bs) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = block_key(parent, tokens)
            b = self._index.get(key)
            if b is None or b in self._fresh:
                break
            entry = self._entry[b]
            if entry is None or entry.parent_key != parent or entry.token_ids != tokens:
                break
            blocks.append(b)
            keys.append(key)
            parent = key
        return PrefixHit(root, tuple(blocks), tuple(keys), bs)

    def blocks_to_allocate(
        self, request_id: str, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> int:
        """Free blocks :meth:`allocate` would consume (new, copy-on-write, revived hits)."""
        table = self._tables.get(request_id)
        if table is None:
            held = len(hit.block_ids) if hit else 0
            start = hit.num_tokens if hit else 0
            revived = sum(1 for b in hit.block_ids if self._ref[b] == 0) if hit else 0
            return max(0, blocks_needed(start + num_new_tokens, self.block_size) - held) + revived
        start = table.num_stored
        fresh = max(
            0, blocks_needed(start + num_new_tokens, self.block_size) - len(table.block_table)
        )
        return fresh + (1 if self._needs_copy_on_write(table, num_new_tokens) else 0)

    def can_allocate(
        self, request_id: str, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> bool:
        return self.blocks_to_allocate(request_id, num_new_tokens, hit) <= len(self._free)

    # ---------------------------------------------------------------- mutations
    def begin(self) -> None:
        """Open a transaction spanning calls; :meth:`rollback` returns to this point."""
        self._journal.begin()

    def commit(self) -> None:
        """Close the transaction: blocks it indexed become visible to :meth:`lookup`."""
        self._journal.commit()
        self._fresh.clear()

    def rollback(self) -> None:
        self._journal.rollback()
        self._fresh.clear()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Group mutations: if the body raises, the pool returns to its state at entry."""
        outermost = not self._journal.active
        try:
            with self._journal.transaction():
                yield
        finally:
            if outermost:
                self._fresh.clear()

    def allocate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        hit: PrefixHit | None = None,
        namespace: Namespace = DEFAULT_NAMESPACE,
    ) -> Allocation:
        """Reserve slots for positions ``[num_stored, num_stored + num_new_tokens)``.

        ``token_ids`` are the request's known tokens (prompt then outputs); the slots'
        token ids are taken from it. A new request may bring a ``hit`` from
        :meth:`lookup`: its blocks gain a reference and KV length starts after them.
        All-or-nothing: raises :class:`OutOfBlocks` (try later) or
        :class:`ExceedsCapacity` (never fits) with the pool unchanged.
        """
        _require_int(num_new_tokens, "num_new_tokens", minimum=1)
        table = self._tables.get(request_id)
        if table is not None and hit is not None:
            raise InvalidArgument(
                f"allocate: request {request_id!r} already holds blocks; "
                "a prefix hit applies only to a new request"
            )
        if hit is not None:
            self._validate_hit(request_id, hit, token_ids, namespace)
        start = table.num_stored if table is not None else (hit.num_tokens if hit else 0)
        end = start + num_new_tokens
        if len(token_ids) < end:
            raise InvalidArgument(
                f"allocate: request {request_id!r} asks for positions up to {end} but only "
                f"{len(token_ids)} token ids are known"
            )
        total = blocks_needed(end, self.block_size)
        if total > self.num_blocks:
            raise ExceedsCapacity(request_id, total, self.num_blocks)
        needed = self.blocks_to_allocate(request_id, num_new_tokens, hit)
        if needed > len(self._free):
            raise OutOfBlocks(request_id, needed, len(self._free))

        with self.transaction():
            if table is None:
                table = self._table_from_hit(request_id, token_ids, hit, namespace)
            else:
                self._record_table_undo(table)
            copies: list[BlockCopy] = []
            if self._needs_copy_on_write(table, num_new_tokens):
                copies.append(self._copy_on_write(table))
            new_blocks = self._append_free_blocks(table, total - len(table.block_table))
            table.token_ids.extend(token_ids[start:end])
            if self.enable_prefix_caching:
                self._cache_full_blocks(table)
        return Allocation(
            request_id,
            start,
            num_new_tokens,
            hit.num_tokens if hit else 0,
            tuple(new_blocks),
            tuple(copies),
        )

    def append_decode_tokens(
        self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]]
    ) -> list[BlockCopy] | None:
        """The steady decode step: one more token for each request, in order.

        Equivalent to ``allocate(rid, tokens, 1)`` for each request in turn, but a request
        whose last block has room and is private is served by a list append with no
        per-request undo record. All-or-nothing: if the free blocks cannot cover every
        request that needs a fresh block or a copy-on-write, returns None and changes
        nothing (the caller then decides whom to preempt). Returns the copies to apply.
        """
        bs = self.block_size
        ref = self._ref
        try:
            tables = [self._tables[rid] for rid in request_ids]
        except KeyError as e:
            raise UnknownRequest(str(e.args[0]), "append_decode_tokens") from None
        needy = 0
        for t, src in zip(tables, token_ids, strict=True):
            n = len(t.token_ids)
            if len(src) <= n:
                raise InvalidArgument(
                    f"append_decode_tokens: a request has {len(src)} known tokens and "
                    f"{n} stored; there is no new token to append"
                )
            if n % bs == 0 or ref[t.block_table[-1]] > 1:
                needy += 1
        if needy > len(self._free):
            return None
        copies: list[BlockCopy] = []
        appended: list[_Table] = []
        with self.transaction():
            # Recorded first so it is undone last: the fast appends touch only their
            # own token lists, which nothing else in this call changes.
            self._journal.record(lambda: [t.token_ids.pop() for t in appended])
            caching = self.enable_prefix_caching
            for rid, t, src in zip(request_ids, tables, token_ids, strict=True):
                n = len(t.token_ids)
                if n % bs == 0 or ref[t.block_table[-1]] > 1:
                    copies.extend(self.allocate(rid, src, 1).copies)
                    continue
                t.token_ids.append(src[n])
                appended.append(t)
                if caching and (n + 1) % bs == 0:
                    # Indexing appends to t.keys: journal it, or a rollback leaves a key
                    # for a token that is gone and later blocks chain from it.
                    self._record_table_undo(t)
                    self._cache_full_blocks(t)
        return copies

    def fork(self, parent_id: str, child_id: str) -> None:
        """Share every block of ``parent_id`` with a new ``child_id`` (n > 1 sampling).

        No block is copied now; the first write into the shared partial last block by
        either side copies it (:meth:`allocate` returns the :class:`BlockCopy`).
        """
        parent = self._table(parent_id, "fork")
        if child_id in self._tables:
            raise DuplicateRequest(child_id, "fork")
        with self.transaction():
            child = self._new_table(child_id, parent.root_key)
            for b in parent.block_table:
                self._set_ref(b, self._ref[b] + 1)
            child.block_table.extend(parent.block_table)
            child.keys.extend(parent.keys)
            child.token_ids.extend(parent.token_ids)

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first (its private tail is evicted first).

        Cached blocks keep their index entry and stay reusable until evicted.
        """
        table = self._table(request_id, "free")
        with self.transaction():
            for b in reversed(table.block_table):
                self._set_ref(b, self._ref[b] - 1)
                if self._ref[b] == 0:
                    self._free.append(b)
            del self._tables[request_id]
            self._journal.record(lambda: self._tables.__setitem__(request_id, table))

    def forget_cached(self, block_ids: Iterable[int]) -> int:
        """Drop the cache entries of these blocks (their K/V can no longer be trusted).

        Used after an executor fault: the failed step may have overwritten blocks that the
        rollback put back in the index. Returns how many entries were dropped.
        """
        dropped = 0
        with self.transaction():
            for b in block_ids:
                if 0 <= b < self.num_blocks and self._entry[b] is not None:
                    self._uncache(b)
                    dropped += 1
        return dropped

    def evict(self, num_blocks: int) -> int:
        """Drop the cache entries of up to ``num_blocks`` least recently freed cached blocks."""
        _require_int(num_blocks, "num_blocks", minimum=0)
        victims = [b for b in self._free if self._entry[b] is not None][:num_blocks]
        with self.transaction():
            for b in victims:
                self._uncache(b)
        return len(victims)

    # ------------------------------------------------------------------ snapshot
    def snapshot(self) -> PoolSnapshot:
        return PoolSnapshot(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            ref_cnt=tuple(self._ref),
            free_queue=tuple(self._free),
            tables=tuple(
                TableSnapshot(
                    rid, tuple(t.block_table), t.num_stored, tuple(t.token_ids), t.root_key
                )
                for rid, t in sorted(self._tables.items())
            ),
            cache_entries=tuple(sorted(self._cache_entries(), key=_entry_order)),
        )

    # ----------------------------------------------------------------- internals
    def _cache_entries(self) -> list[CacheEntry]:
        return [e for b in self._index.values() if (e := self._entry[b]) is not None]

    def _table(self, request_id: str, what: str) -> _Table:
        table = self._tables.get(request_id)
        if table is None:
            raise UnknownRequest(request_id, what)
        return table

    def _table_from_hit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        hit: PrefixHit | None,
        namespace: Namespace,
    ) -> _Table:
        """A new request's table (part of :meth:`allocate`'s transaction): the hit's
        blocks, each gaining a reference, and their tokens; empty without a hit."""
        table = self._new_table(request_id, hit.root_key if hit else namespace.root_key())
        if hit is not None:
            for b, key in zip(hit.block_ids, hit.keys, strict=True):
                self._take(b)
                table.block_table.append(b)
                table.keys.append(key)
            table.token_ids.extend(token_ids[: hit.num_tokens])
        return table

    def _append_free_blocks(self, table: _Table, count: int) -> list[int]:
        """Move ``count`` free blocks (reference 1) onto the end of ``table``; the caller
        has checked there are that many (part of :meth:`allocate`'s transaction)."""
        new_blocks: list[int] = []
        for _ in range(count):
            b = self._pop_free()
            self._set_ref(b, 1)
            table.block_table.append(b)
            new_blocks.append(b)
        return new_blocks

    def _new_table(self, request_id: str, root_key: bytes) -> _Table:
        table = _Table(root_key)
        self._tables[request_id] = table
        self._journal.record(lambda: self._tables.pop(request_id))
        return table

    def _record_table_undo(self, table: _Table) -> None:
        # Tables only grow (plus a copy-on-write swap of the last block), so an undo
        # truncates back to the recorded lengths and restores the last entry.
        if not self._journal.active:
            return
        n_blocks, n_keys, n_tokens = len(table.block_table), len(table.keys), len(table.token_ids)
        last = table.block_table[-1] if table.block_table else None

        def undo() -> None:
            del table.block_table[n_blocks:]
            del table.keys[n_keys:]
            del table.token_ids[n_tokens:]
            if last is not None:
                table.block_table[-1] = last

        self._journal.record(undo)

    def _validate_hit(
        self, request_id: str, hit: PrefixHit, token_ids: Sequence[int], namespace: Namespace
    ) -> None:
        if hit.block_size != self.block_size or hit.root_key != namespace.root_key():
            raise InvalidArgument(
                f"allocate: prefix hit for {request_id!r} comes from another pool or namespace"
            )
        if hit.num_tokens > max_cacheable_tokens(max(len(token_ids), 1), self.block_size):
            raise InvalidArgument(
                f"allocate: prefix hit for {request_id!r} covers {hit.num_tokens} tokens of "
                f"{len(token_ids)}; the last token must be recomputed"
            )
        bs = self.block_size
        parent = hit.root_key
        for i, (b, key) in enumerate(zip(hit.block_ids, hit.keys, strict=True)):
            if self._index.get(key) != b:
                raise InvalidArgument(
                    f"allocate: prefix hit for {request_id!r} is stale (block {b} was evicted)"
                )
            # The hit must be for these token ids: a hit looked up for another prompt
            # would hand this request blocks holding other tokens.
            entry = self._entry[b]
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            if entry is None or entry.parent_key != parent or entry.token_ids != tokens:
                raise InvalidArgument(
                    f"allocate: prefix hit for {request_id!r} does not match its token ids "
                    f"at block {i} (block {b} holds {entry.token_ids if entry else None}, "
                    f"the request has {tokens})"
                )
            parent = key

    def _needs_copy_on_write(self, table: _Table, num_new_tokens: int) -> bool:
        partial = table.num_stored % self.block_size != 0
        return num_new_tokens > 0 and partial and self._ref[table.block_table[-1]] > 1

    def _copy_on_write(self, table: _Table) -> BlockCopy:
        src = table.block_table[-1]
        dst = self._pop_free()
        self._set_ref(dst, 1)
        self._set_ref(src, self._ref[src] - 1)
        table.block_table[-1] = dst
        return BlockCopy(src, dst)

    def _pop_free(self) -> int:
        b = self._free.popleft()
        if self._entry[b] is not None:
            self._uncache(b)  # evicted: its key must never point at the block's new tokens
        return b

    def _take(self, b: int) -> None:
        if self._ref[b] == 0:
            self._free.remove(b)
        self._set_ref(b, self._ref[b] + 1)

    def _set_ref(self, b: int, value: int) -> None:
        assert value >= 0, f"ref count of block {b} would go negative"
        old = self._ref[b]
        self._ref[b] = value
        self._journal.record(lambda: self._ref.__setitem__(b, old))

    def _cache_full_blocks(self, table: _Table) -> None:
        bs = self.block_size
        for i in range(len(table.keys), table.num_stored // bs):
            parent = table.keys[-1] if table.keys else table.root_key
            tokens = tuple(table.token_ids[i * bs : (i + 1) * bs])
            key = block_key(parent, tokens)
            table.keys.append(key)
            b = table.block_table[i]
            # Two requests may compute the same new prefix in one step; the first one
            # indexed wins and the other block simply stays private.
            if key not in self._index and self._entry[b] is None:
                self._cache(b, CacheEntry(key, b, parent, tokens))

    def _cache(self, b: int, entry: CacheEntry) -> None:
        self._index[entry.key] = b
        self._entry[b] = entry
        if self._journal.active:
            self._fresh.add(b)

        def undo() -> None:
            del self._index[entry.key]
            self._entry[b] = None

        self._journal.record(undo)

    def _uncache(self, b: int) -> None:
        entry = self._entry[b]
        assert entry is not None
        del self._index[entry.key]
        self._entry[b] = None

        def undo() -> None:
            self._index[entry.key] = b
            self._entry[b] = entry

        self._journal.record(undo)


def _entry_order(e: CacheEntry) -> int:
    return e.block_id


def _require_int(value: object, name: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise InvalidArgument(f"{name} must be >= {minimum}, got {value}")
