"""The paged KV block pool: the spine of ``ref/kv``.

docs/ARCHITECTURE.md, "Layers" (KV memory) and "The persistent batch". The pool composes
four parts, one concept each: :class:`~refserve.kv.allocator.BlockAllocator` (reference
counts, the free queue), :class:`~refserve.kv.prefix_index.PrefixIndex` (hash chains,
lookup, cached full blocks), :class:`~refserve.kv.tables.BlockTables` (each request's
block table and what changed) and one :class:`~refserve.kv.journal.Journal` shared by
the three, so a transaction spans them. Here they meet: lookup, allocate (with the
copy-on-write that keeps a shared block unwritten), free, the transactions, snapshot.

The features are attachments in modules of their own that use the pool through its
public surface (its parts, :meth:`BlockPool.atomic`, :meth:`BlockPool.acquire`) and are
unknown to it: the bulk decode step (``decode_runs.py``), n > 1 forks (``forks.py``),
dropping rejected drafts (``truncation.py``), the host pool for swaps (``host_pool.py``)
and the cache events the prefix index reports (``events.py``, switched on here).

A hybrid model's layer groups (``groups.py``) are pools made by
:meth:`BlockPool.sharing`: one allocator, prefix index and journal, tables of their
own. A sliding-window group's table keeps ``NULL_BLOCK`` in the places of the blocks
before its window (always its first ones): a hit may skip them
(``PrefixHit.num_skipped``), and :meth:`BlockPool.free` and the capacity check pass them
over. A plain pool never has one.

Invariants are checked from outside on :meth:`BlockPool.snapshot` (refserve.spec.check_pool):
BLOCK (ref counts equal holders, the free queue is exact), CAP, POS (tables cover
their KV length exactly) and PREFIX (hash chains, full blocks only, shared blocks
never written). Every mutating method validates first and mutates after, so a bad
argument raises a typed error with nothing changed; between :meth:`BlockPool.begin`
and :meth:`BlockPool.rollback` every change is undone (ATOMIC).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from copy import copy
from dataclasses import dataclass

from refserve.errors import ExceedsCapacity, InvalidArgument, OutOfBlocks, UnknownRequest
from refserve.kv.allocator import BlockAllocator
from refserve.kv.events import CacheEventLog
from refserve.kv.journal import Journal
from refserve.kv.prefix_index import Entry, PrefixHit, PrefixIndex
from refserve.kv.tables import BlockTable, BlockTables
from refserve.spec.arith import (
    block_offset,
    blocks_needed,
    new_blocks_needed,
    starts_block,
)
from refserve.spec.groups import NULL_BLOCK
from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace
from refserve.spec.snapshot import PoolSnapshot, TableSnapshot
from refserve.values import is_int

__all__ = ["Allocation", "BlockCopy", "BlockPool", "PrefixHit", "require_int"]


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


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots, shared by all requests."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        cache_events: bool = False,
    ) -> None:
        require_int(num_blocks, "num_blocks", minimum=1)
        require_int(block_size, "block_size", minimum=1)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._journal = Journal()
        self._blocks = BlockAllocator(num_blocks, self._journal)
        # Cache events (ref/kv/events.py) for a router that routes by prefix hits.
        events = CacheEventLog(self._journal) if cache_events else None
        self._prefix = PrefixIndex(num_blocks, block_size, self._journal, events)
        self._tables = BlockTables(self._journal)

    def sharing(self, tokens_per_block: int | None = None) -> BlockPool:
        """A pool with tables of its own over this one's allocator, prefix index and
        journal (a hybrid model's layer groups, ref/kv/groups.py): a block reused by one
        loses its cache entry for all (PREFIX), one transaction spans all (ATOMIC).

        ``tokens_per_block`` other than ``block_size`` (a compressed group's blocks) makes
        a pool that caches nothing: the one index keys blocks of ``block_size`` tokens."""
        pool = copy(self)  # the same parts and settings
        pool.__class__ = BlockPool  # a plain pool, whatever this one's class
        pool._tables = BlockTables(self._journal)
        if tokens_per_block is not None and tokens_per_block != self.block_size:
            require_int(tokens_per_block, "tokens_per_block", minimum=1)
            pool.block_size = tokens_per_block
            pool.enable_prefix_caching = False
        return pool

    # ------------------------------------------------- the parts, for attachments
    @property
    def journal(self) -> Journal:
        """The undo journal every part records into (an attachment's changes too)."""
        return self._journal

    @property
    def allocator(self) -> BlockAllocator:
        return self._blocks

    @property
    def prefix_index(self) -> PrefixIndex:
        return self._prefix

    @property
    def tables(self) -> BlockTables:
        return self._tables

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self._blocks.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._blocks.num_free

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._tables.table(request_id, "block_table").block_table)

    def block_table_view(self, request_id: str) -> Sequence[int]:
        """The live table (read-only by convention) for hot paths that cannot copy."""
        return self._tables.table(request_id, "block_table_view").block_table

    def block_table_views(self, request_ids: Sequence[str]) -> list[Sequence[int]]:
        """Live tables of several requests at once (read-only by convention)."""
        return self._tables.block_tables(request_ids, "block_table_views")

    def num_table_blocks(self, request_id: str) -> int:
        """The blocks the request's table holds now (0 without one; a released window
        place, ``NULL_BLOCK``, is none): what freeing it returns, less the blocks
        another table shares."""
        table = self._tables.get(request_id)
        return 0 if table is None else sum(1 for b in table.block_table if b != NULL_BLOCK)

    def ref_count(self, block_id: int) -> int:
        """How many tables hold ``block_id``."""
        return self._blocks.ref_count(block_id)

    def lookup(
        self, token_ids: Sequence[int], namespace: Namespace = DEFAULT_NAMESPACE
    ) -> PrefixHit:
        """Longest chain of cached full blocks matching ``token_ids``, never the last
        token (:meth:`PrefixIndex.lookup`; none with prefix caching off). Two requests
        sharing a new prefix in one step each compute it; the second reuses it from the
        next step on."""
        if len(token_ids) < 1:
            raise InvalidArgument("lookup: token_ids is empty; a request needs at least one token")
        root = self._prefix.root_key(namespace)
        if not self.enable_prefix_caching:
            return PrefixHit(root, (), (), self.block_size)
        return self._prefix.lookup(token_ids, root)

    def blocks_to_allocate(
        self, request_id: str, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> int:
        """Free blocks :meth:`allocate` would consume (new, copy-on-write, revived hits)."""
        bs = self.block_size
        table = self._tables.get(request_id)
        if table is None:
            if hit is None:
                return blocks_needed(num_new_tokens, bs)
            held = hit.num_skipped + len(hit.block_ids)
            fresh = new_blocks_needed(hit.num_tokens, num_new_tokens, held, bs)
            return fresh + self._blocks.num_revived(hit.block_ids)
        fresh = new_blocks_needed(table.num_stored, num_new_tokens, len(table.block_table), bs)
        return fresh + (1 if self._needs_copy_on_write(table, num_new_tokens) else 0)

    def can_allocate(
        self, request_id: str, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> bool:
        return self.blocks_to_allocate(request_id, num_new_tokens, hit) <= self._blocks.num_free

    # ------------------------------------------------------------ transactions
    @property
    def in_transaction(self) -> bool:
        """A transaction opened by :meth:`begin` is open (a step, a staged migration)."""
        return self._journal.active

    def begin(self) -> None:
        """Open a transaction spanning calls; :meth:`rollback` returns to this point."""
        self._journal.begin()

    def commit(self) -> None:
        """Close the transaction: blocks it indexed become visible to :meth:`lookup`."""
        self._journal.commit()
        self._prefix.end_transaction()

    def rollback(self) -> None:
        self._journal.rollback()
        self._prefix.end_transaction()
        self._tables.mark_all_changed()

    def take_changed(self) -> tuple[set[str], bool]:
        """Requests whose block table changed since the last call, and whether every
        table may have (after a rollback); both are reset (:meth:`BlockTables.take_changed`)."""
        return self._tables.take_changed()

    def _abort(self, outermost: bool) -> None:
        """The body raised: an outermost transaction is undone; a joined one is left to
        its opener. Either way the undo may shrink any table."""
        if outermost:
            self.rollback()
        self._tables.mark_all_changed()

    @contextmanager
    def atomic(self) -> Iterator[None]:
        """One call's mutations, all or nothing (ATOMIC): inside a step they join its
        transaction, outside one they are undone if the body raises. What an attachment
        changes in here records its undo in :attr:`journal`."""
        outermost = not self._journal.active
        try:
            with self._journal.transaction():
                yield
        except BaseException:
            self._tables.mark_all_changed()  # the undo may have shrunk any table
            raise
        finally:
            if outermost:
                self._prefix.end_transaction()

    # ---------------------------------------------------------------- allocate
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
        table = self._tables.get(request_id)
        if (
            table is None
            and hit is None
            and not self.enable_prefix_caching
            and not self._journal.active
        ):
            fast = self._allocate_new(request_id, token_ids, num_new_tokens, namespace)
            if fast is not None:
                return fast
        return self._allocate(request_id, table, token_ids, num_new_tokens, hit, namespace)

    def _allocate(
        self,
        request_id: str,
        table: BlockTable | None,
        token_ids: Sequence[int],
        num_new_tokens: int,
        hit: PrefixHit | None,
        namespace: Namespace,
    ) -> Allocation:
        """:meth:`allocate`, the general case."""
        start, total, new_tokens = self._check_allocate(
            request_id, table, token_ids, num_new_tokens, hit, namespace
        )
        # Outside a transaction with prefix caching off nothing below can fail (the new
        # tokens are already taken, the counts checked), so no undo is recorded; with
        # caching a token id can fail hashing, so a transaction is opened: an explicit
        # one, as the generator-based `with self.atomic()` alone cost more than a small
        # allocation's pool work. Inside a transaction the changes join it.
        journal = self._journal
        opened = not journal.active and self.enable_prefix_caching
        if opened:
            journal.begin()
        try:
            copies: tuple[BlockCopy, ...] = ()
            if table is None:
                # A hit covers full blocks only, so a new table never needs a copy.
                table = self._table_from_hit(request_id, token_ids, hit, namespace)
            else:
                self._tables.record_growth(table)
                if self._needs_copy_on_write(table, num_new_tokens):
                    copies = (self.copy_on_write(table),)
                    self._tables.mark_changed(request_id)
            new_blocks = self._append_free_blocks(table, total - len(table.block_table))
            table.token_ids += new_tokens
            if self.enable_prefix_caching:
                self._prefix.cache_full_blocks(table)
        except BaseException:
            self._abort(opened)
            raise
        if opened:  # self.commit(), inlined (hot)
            journal.commit()
            self._prefix.end_transaction()
        return _allocation(
            request_id, start, num_new_tokens, hit.num_tokens if hit else 0, new_blocks, copies
        )

    def _check_allocate(
        self,
        request_id: str,
        table: BlockTable | None,
        token_ids: Sequence[int],
        num_new_tokens: int,
        hit: PrefixHit | None,
        namespace: Namespace,
    ) -> tuple[int, int, list[int] | tuple[int, ...]]:
        """:meth:`allocate`'s validation: the first position, the table's block count
        after it and the new token ids, or a typed error with nothing changed. The token
        ids are taken here so that adding them to the table later cannot fail."""
        require_int(num_new_tokens, "num_new_tokens", minimum=1)
        if hit is not None:
            if table is not None:
                raise InvalidArgument(
                    f"allocate: request {request_id!r} already holds blocks; "
                    "a prefix hit applies only to a new request"
                )
            self._prefix.check_hit(request_id, hit, token_ids, self._prefix.root_key(namespace))
        start = table.num_stored if table is not None else (hit.num_tokens if hit else 0)
        end = start + num_new_tokens
        if len(token_ids) < end:
            raise InvalidArgument(
                f"allocate: request {request_id!r} asks for positions up to {end} but only "
                f"{len(token_ids)} token ids are known"
            )
        total = blocks_needed(end, self.block_size)
        if total > self.num_blocks and total - _num_null(table, hit) > self.num_blocks:
            raise ExceedsCapacity(request_id, total - _num_null(table, hit), self.num_blocks)
        # This pool's own count: a subclass's (ref/kv/groups.py) spans its groups.
        needed = BlockPool.blocks_to_allocate(self, request_id, num_new_tokens, hit)
        if needed > self._blocks.num_free:
            raise OutOfBlocks(request_id, needed, self._blocks.num_free)
        return start, total, _taken(token_ids, start, end)

    def _allocate_new(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens: int, namespace: Namespace
    ) -> Allocation | None:
        """:meth:`allocate` of a new request without a hit, prefix caching off, outside
        a step's transaction (a one-off allocation: a KV manager used on its own, the
        conformance suite's KV adapter); None when a check fails, for :meth:`allocate`
        to raise its typed error. The scheduler never takes it: its allocations join the
        step's transaction.

        Everything that can fail comes before the first change (the token ids are taken
        first, and there is no hashing), so there is nothing to undo and no undo record.
        """
        if type(num_new_tokens) is not int or not 1 <= num_new_tokens <= len(token_ids):
            return None
        total = blocks_needed(num_new_tokens, self.block_size)
        if total > self._blocks.num_free:  # also covers total > num_blocks
            return None
        new = token_ids if num_new_tokens == len(token_ids) else token_ids[:num_new_tokens]
        table = BlockTable(request_id, self._prefix.root_key(namespace))
        table.token_ids += new  # any sequence; nothing is changed yet if this fails
        self._tables.add_unjournaled(table)
        # Caching is off: nothing is indexed, so the acquired blocks have no entry to drop.
        table.block_table = blocks = self._blocks.acquire(total)
        return _allocation(request_id, 0, num_new_tokens, 0, blocks, ())

    def _table_from_hit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        hit: PrefixHit | None,
        namespace: Namespace,
    ) -> BlockTable:
        """A new request's table (part of :meth:`allocate`'s transaction): the hit's
        blocks, each gaining a reference, and their tokens; empty without a hit."""
        root = hit.root_key if hit else self._prefix.root_key(namespace)
        table = self._tables.add(request_id, root)
        if hit is not None:
            for b in hit.block_ids:
                self._blocks.hold(b)
            if hit.num_skipped:  # a window group's blocks before its window
                table.block_table.extend([NULL_BLOCK] * hit.num_skipped)
            table.block_table.extend(hit.block_ids)
            table.keys.extend(hit.keys)
            table.token_ids.extend(token_ids[: hit.num_tokens])
        return table

    def _needs_copy_on_write(self, table: BlockTable, num_new_tokens: int) -> bool:
        # Sharing first: it is rare, so the offset is seldom computed (a table holds a
        # block exactly when it stores a token, POS).
        blocks = table.block_table
        return (
            num_new_tokens > 0
            and bool(blocks)
            and self._blocks.is_shared(blocks[-1])
            and not starts_block(block_offset(table.num_stored, self.block_size))
        )

    def copy_on_write(self, table: BlockTable) -> BlockCopy:
        """A private copy of ``table``'s shared last block, about to be written (PREFIX:
        a shared block is never written, whoever shares it). The caller has checked a
        free block, records the undo of the table's last entry and reports the change
        (or not: a decode run's growth is told to its caller)."""
        src = table.block_table[-1]
        (dst,) = self.acquire(1)
        self._blocks.unshare(src)
        table.block_table[-1] = dst
        return BlockCopy(src, dst)

    def _append_free_blocks(self, table: BlockTable, count: int) -> list[int]:
        """Move ``count`` free blocks (reference 1) onto the end of ``table``; the caller
        has checked there are that many (part of :meth:`allocate`'s transaction)."""
        if not count:
            return []
        self._tables.mark_changed(table.request_id)
        new_blocks = self.acquire(count)
        table.block_table.extend(new_blocks)
        return new_blocks

    def acquire(self, count: int) -> list[int]:
        """``count`` free blocks, each now held once, without cache entries; the caller
        has checked there are that many."""
        blocks = self._blocks.acquire(count)
        self.evict_reused(blocks)
        return blocks

    def evict_reused(self, blocks: Sequence[int]) -> list[Entry]:
        """Blocks taken from the free queue for new tokens lose their cache entries: a
        key must never point at a block's new tokens (PREFIX). The entries dropped."""
        return self._prefix.forget(blocks)

    # -------------------------------------------------------------------- free
    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first (its private tail is evicted first).

        Cached blocks keep their index entry and stay reusable until evicted.
        """
        tables = self._tables
        table = tables.get(request_id)
        if table is None:
            raise UnknownRequest(request_id, "free")
        blocks = table.block_table
        if blocks and blocks[0] < 0:  # a window table's null places (NULL_BLOCK) hold none
            blocks = blocks[_num_null(table, None) :]
        # Tail first (reversed), one run; release either completes or fails with
        # everything put back (nothing changed, nothing to report), and nothing after it
        # can fail, so outside a transaction no undo is recorded.
        if not self._journal.active:
            self._blocks.release(blocks[::-1])
            tables.remove(request_id)
            return
        try:
            self._blocks.release(blocks[::-1])
            tables.remove(request_id)
        except BaseException:
            self._abort(False)  # the opener's rollback undoes this call
            raise

    # ------------------------------------------------------------------- cache
    @property
    def cache_events(self) -> CacheEventLog | None:
        """The published cache events (``cache_events=True``), else None."""
        return self._prefix.events

    def clear_cache(self) -> int:
        """Drop every prefix-cache entry (blocks held by tables stay held); one
        ``CacheCleared`` event. Returns how many entries were dropped."""
        with self.atomic():
            return self._prefix.clear()

    def forget_cached(self, block_ids: Iterable[int]) -> int:
        """Drop the cache entries of these blocks (their K/V can no longer be trusted).

        Used after an executor fault: the failed step may have overwritten blocks that the
        rollback put back in the index. Returns how many entries were dropped.
        """
        in_range = [b for b in dict.fromkeys(block_ids) if 0 <= b < self.num_blocks]
        with self.atomic():
            return len(self._prefix.forget(in_range))

    # ---------------------------------------------------------------- snapshot
    def snapshot(self) -> PoolSnapshot:
        """The pool as spec sees it (refserve.spec.check_pool: BLOCK, CAP, POS, PREFIX)."""
        tables = tuple(
            TableSnapshot(rid, tuple(t.block_table), t.num_stored, tuple(t.token_ids), t.root_key)
            for rid, t in self._tables.by_request()
        )
        return PoolSnapshot(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            ref_cnt=self._blocks.ref_counts(),
            free_queue=self._blocks.free_queue(),
            tables=tables,
            cache_entries=tuple(self._prefix.entries()),
        )


def _num_null(table: BlockTable | None, hit: PrefixHit | None) -> int:
    """A window table's null places (always its first ones), or a hit's skipped blocks."""
    if table is None:
        return hit.num_skipped if hit is not None else 0
    # The null places come first: a binary search, not a walk over a long table.
    return bisect_left(table.block_table, True, key=_is_held)


def _is_held(block_id: int) -> bool:
    return block_id != NULL_BLOCK


def _taken(token_ids: Sequence[int], start: int, end: int) -> list[int] | tuple[int, ...]:
    """The token ids ``[start, end)`` as a list or tuple, which a table's list can then be
    extended by without any failure (the whole of a list is not copied here)."""
    new = token_ids if start == 0 and end == len(token_ids) else token_ids[start:end]
    return new if type(new) is list or isinstance(new, tuple) else list(new)


def _allocation(
    request_id: str,
    start: int,
    num_new_tokens: int,
    num_cached: int,
    new_blocks: list[int],
    copies: tuple[BlockCopy, ...],
) -> Allocation:
    # The frozen dataclass's generated __init__ sets each field through
    # object.__setattr__, half of a small allocate's fixed cost; filling the instance
    # dict directly gives the same object.
    a = object.__new__(Allocation)
    d = a.__dict__
    d["request_id"] = request_id
    d["start_position"] = start
    d["num_new_tokens"] = num_new_tokens
    d["num_cached_tokens"] = num_cached
    d["new_block_ids"] = tuple(new_blocks)
    d["copies"] = copies
    return a


def require_int(value: object, name: str, *, minimum: int) -> None:
    """An int (not a bool) >= ``minimum``, else :class:`InvalidArgument` naming ``name``:
    the pool's argument check, shared by its attachments."""
    if not is_int(value):
        raise InvalidArgument(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise InvalidArgument(f"{name} must be >= {minimum}, got {value}")
