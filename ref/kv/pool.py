"""The paged KV block pool: block tables over the allocator and the prefix index.

docs/ARCHITECTURE.md, "Layers" (KV memory) and "The persistent batch". A request's
table lists its blocks and the token ids whose K/V they hold. The pool composes the
three parts of ``ref/kv``: :class:`~refserve.kv.allocator.BlockAllocator` (reference
counts, free queue), :class:`~refserve.kv.prefix_index.PrefixIndex` (hash chain, lookup,
cached full blocks) and the tables here, through allocate, the bulk decode step, fork
and copy-on-write, free, truncate and snapshot. One journal (ref/kv/journal.py) is
shared by all three, so a transaction spans them.

Invariants are checked from outside on :meth:`BlockPool.snapshot` (refserve.spec.check_pool):
BLOCK (ref counts equal holders, the free queue is exact), CAP, POS (tables cover
their KV length exactly) and PREFIX (hash chains, full blocks only, shared blocks
never written). Every mutating method validates first and mutates after, so a bad
argument raises a typed error with nothing changed; between :meth:`BlockPool.begin`
and :meth:`BlockPool.rollback` every change is undone (ATOMIC).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter

from refserve.errors import (
    DuplicateRequest,
    ExceedsCapacity,
    InvalidArgument,
    OutOfBlocks,
    UnknownRequest,
)
from refserve.kv.allocator import BlockAllocator
from refserve.kv.events import CacheEventLog
from refserve.kv.journal import Journal
from refserve.kv.prefix_index import (
    NOTHING_EVICTED,
    Entry,
    FilledBlocks,
    PrefixHit,
    PrefixIndex,
    filled_blocks,
)
from refserve.spec.arith import (
    block_offset,
    blocks_needed,
    full_blocks,
    new_blocks_needed,
    starts_block,
)
from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace
from refserve.spec.snapshot import PoolSnapshot, TableSnapshot

__all__ = ["Allocation", "BlockCopy", "BlockPool", "DecodeGrowth", "DecodeRun", "PrefixHit"]


@dataclass(frozen=True)
class BlockCopy:
    """Copy-on-write: the executor copies K/V of block ``src`` into ``dst`` before writing."""

    src: int
    dst: int


@dataclass(frozen=True)
class DecodeGrowth:
    """What :meth:`BlockPool.append_decodes` did to the tables that needed a block.

    ``tails[j]`` is the last block of request ``growing[j]``'s table afterwards (a fresh
    block, or the private copy of a shared one) and ``lengths[j]`` its block count; the
    caller, which keeps its own copy of the tables, writes them back (these changes are
    not reported by :meth:`BlockPool.take_changed`).
    """

    copies: list[BlockCopy]
    tails: list[int]
    lengths: list[int]


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
    """One request's block table and the token ids whose K/V its blocks hold (the
    :class:`~refserve.kv.prefix_index.Chain` the index reads)."""

    __slots__ = ("block_table", "keys", "request_id", "root_key", "token_ids")

    def __init__(self, request_id: str, root_key: bytes) -> None:
        self.request_id = request_id
        self.root_key = root_key
        self.block_table: list[int] = []
        self.keys: list[bytes] = []  # chain keys of this table's full blocks, in order
        self.token_ids: list[int] = []

    @property
    def num_stored(self) -> int:
        return len(self.token_ids)


_TOKEN_IDS = attrgetter("token_ids")
_BLOCK_TABLE = attrgetter("block_table")


class DecodeRun:
    """The block tables of some requests, in order, looked up once
    (:meth:`BlockPool.decode_run`) for any number of :meth:`BlockPool.append_decodes`.

    It holds table objects and their token lists, so it stays current until a table is
    added or freed, or anything else the pool reports to ``take_changed`` happens (a
    block added or copied by ``allocate``, a fork) or a rollback: then
    :meth:`BlockPool.is_current` says it is stale and ``append_decodes`` refuses it. The
    persistent batch keeps one for its whole running order, so the steady decode step
    looks no request up.
    """

    __slots__ = ("_epoch", "_tables", "_token_lists", "request_ids")

    def __init__(self, request_ids: Sequence[str], tables: list[_Table], epoch: int) -> None:
        self.request_ids = request_ids
        self._tables = tables
        self._token_lists: list[list[int]] = list(map(_TOKEN_IDS, tables))
        self._epoch = epoch

    def __len__(self) -> int:
        return len(self._tables)


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
        _require_int(num_blocks, "num_blocks", minimum=1)
        _require_int(block_size, "block_size", minimum=1)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._journal = Journal()
        self._blocks = BlockAllocator(num_blocks, self._journal)
        # Cache events (ref/kv/events.py) for a router that routes by prefix hits.
        events = CacheEventLog(self._journal) if cache_events else None
        self._prefix = PrefixIndex(num_blocks, block_size, self._journal, events)
        # Namespace.root_key() hashes on every call; nearly every request has the default.
        self._default_root = DEFAULT_NAMESPACE.root_key()
        self._tables: dict[str, _Table] = {}
        # Requests whose block table changed (or whose last block's sharing did) since
        # the last take_changed(): the persistent batch (ref/core/batch.py) rewrites only
        # their rows. A rollback may shrink any table, so it marks every table changed.
        self._changed: set[str] = set()
        self._all_changed = False
        # Bumped by every change reported to take_changed and by every rollback: a
        # DecodeRun taken at an older epoch may hold a table that is gone or replaced.
        self._epoch = 0

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
        root = self._root_key(namespace)
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
            held = len(hit.block_ids)
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
        self._mark_all_changed()

    def take_changed(self) -> tuple[set[str], bool]:
        """Requests whose block table changed since the last call, and whether every
        table may have (after a rollback); both are reset."""
        changed, everything = self._changed, self._all_changed
        self._changed = set()
        self._all_changed = False
        return changed, everything

    def _mark_changed(self, table: _Table) -> None:
        self._changed.add(table.request_id)
        self._epoch += 1

    def _mark_all_changed(self) -> None:
        self._all_changed = True
        self._epoch += 1

    def _abort(self, outermost: bool) -> None:
        """The body raised: an outermost transaction is undone; a joined one is left to
        its opener. Either way the undo may shrink any table."""
        if outermost:
            self.rollback()
        self._mark_all_changed()

    @contextmanager
    def _atomic(self) -> Iterator[None]:
        """One call's mutations, all or nothing (ATOMIC): inside a step they join its
        transaction, outside one they are undone if the body raises."""
        outermost = not self._journal.active
        try:
            with self._journal.transaction():
                yield
        except BaseException:
            self._mark_all_changed()  # the undo may have shrunk any table
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
        table: _Table | None,
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
        # one, as the generator-based `with self._atomic()` alone cost more than a small
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
                self._record_table_undo(table)
                if self._needs_copy_on_write(table, num_new_tokens):
                    copies = (self._copy_on_write(table),)
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
        table: _Table | None,
        token_ids: Sequence[int],
        num_new_tokens: int,
        hit: PrefixHit | None,
        namespace: Namespace,
    ) -> tuple[int, int, list[int] | tuple[int, ...]]:
        """:meth:`allocate`'s validation: the first position, the table's block count
        after it and the new token ids, or a typed error with nothing changed. The token
        ids are taken here so that adding them to the table later cannot fail."""
        _require_int(num_new_tokens, "num_new_tokens", minimum=1)
        if hit is not None:
            if table is not None:
                raise InvalidArgument(
                    f"allocate: request {request_id!r} already holds blocks; "
                    "a prefix hit applies only to a new request"
                )
            self._prefix.check_hit(request_id, hit, token_ids, self._root_key(namespace))
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
        table = _Table(
            request_id,
            self._default_root if namespace is DEFAULT_NAMESPACE else namespace.root_key(),
        )
        table.token_ids += new  # any sequence; nothing is changed yet if this fails
        self._tables[request_id] = table
        self._changed.add(request_id)  # _mark_changed, inlined (hot)
        self._epoch += 1
        # Caching is off: nothing is indexed, so the acquired blocks have no entry to drop.
        table.block_table = blocks = self._blocks.acquire(total)
        return _allocation(request_id, 0, num_new_tokens, 0, blocks, ())

    # ---------------------------------------------------------- the decode step
    def decode_run(self, request_ids: Sequence[str]) -> DecodeRun:
        """These requests' tables, in order, for :meth:`append_decodes` (see
        :class:`DecodeRun`)."""
        try:
            tables = list(map(self._tables.__getitem__, request_ids))
        except KeyError as e:
            raise UnknownRequest(str(e.args[0]), "decode_run") from None
        return DecodeRun(request_ids, tables, self._epoch)

    def is_current(self, run: DecodeRun) -> bool:
        """No table changed since ``run`` was taken, other than by append_decodes."""
        return run._epoch == self._epoch

    def append_decodes(
        self,
        run: DecodeRun,
        tokens: Sequence[int],
        growing: Sequence[int],
        filling: Sequence[int],
        filled: Sequence[Sequence[int]] | None = None,
    ) -> DecodeGrowth | None:
        """The steady decode step: one more token for each request of ``run``, exactly
        as ``allocate(rid, known, 1)`` for each in turn would store it.

        ``tokens[i]`` is the token of ``run``'s request ``i`` at its KV length, ``growing``
        the indices whose token starts a block or lands in a shared last block,
        ``filling`` those whose token fills its block, and ``filled[j]`` (optional) the
        token ids of the block that ``filling[j]``'s token fills, hashed from there.
        Nothing is re-derived per request (only each growing table's fresh block is told
        from a copy-on-write): a wrong claim breaks POS/BLOCK/PREFIX on the next
        snapshot (the persistent batch that makes the claims is differential-tested
        against the per-request path). All-or-nothing: if the free blocks cannot cover
        every growing request, returns None with nothing changed (the caller decides whom
        to preempt). A stale ``run`` is refused.
        """
        if run._epoch != self._epoch:
            raise InvalidArgument(
                "append_decodes: the decode run is stale (a table changed since "
                "decode_run); take a new one"
            )
        if len(tokens) != len(run):
            raise InvalidArgument(f"append_decodes: {len(tokens)} tokens for {len(run)} requests")
        blocks = None if filled is None else filled_blocks(filled, len(filling), self.block_size)
        if len(growing) > self._blocks.num_free:
            return None
        journal = self._journal
        outermost = not journal.active
        if outermost:
            journal.begin()
        try:
            copies = self._decode_step(run, tokens, growing, filling, blocks)
        except BaseException:
            if outermost:
                journal.rollback()
                self._mark_all_changed()
            raise
        if outermost:
            journal.commit()
            self._prefix.end_transaction()
        grown = [run._tables[i].block_table for i in growing]
        return DecodeGrowth(copies, [t[-1] for t in grown], list(map(len, grown)))

    def _decode_step(
        self,
        run: DecodeRun,
        tokens: Sequence[int],
        growing: Sequence[int],
        filling: Sequence[int],
        filled: FilledBlocks | None,
    ) -> list[BlockCopy]:
        """:meth:`append_decodes`' changes, checked (an open transaction); the copies."""
        tables, lists, bs = run._tables, run._token_lists, self.block_size
        # Every growing token starts a block (none copies a shared one): the step's fresh
        # blocks come off the free queue as one run. (Read before the tokens go in: each
        # list's length is its token's position; map keeps the per-row calls at C level.)
        growing_lengths = map(len, [lists[i] for i in growing])
        fresh_only = all(map(starts_block, map(block_offset, growing_lengths, repeat(bs))))
        # Each table's token in one C-level pass, undone by one entry (recorded first,
        # so undone last: nothing below changes the token lists).
        _consume(map(list.append, lists, tokens))
        self._journal.record(_pop_each, lists)
        fills = filling if self.enable_prefix_caching else ()
        if not fresh_only:
            return self._grow_in_order(tables, growing, fills)
        evicted = self._grow_run([tables[i] for i in growing], growing)
        if fills:
            self._prefix.cache_filled(tables, fills, evicted, filled)
        return []

    def _grow_run(self, tables: list[_Table], order: Sequence[int]) -> Mapping[bytes, int]:
        """A fresh block for each of ``tables`` (each last block full; ``order[j]`` is
        ``tables[j]``'s place in the step's request order), as one run off the free
        queue: one journal entry for the run, one for the appends, one for the evictions.

        The per-request path pops in request order and indexes each filled block as it
        comes, so a pop that evicts key K *after* a request that fills a block with key
        K saw K still indexed. Returned: each evicted key with the place of the request
        whose pop evicted it, for :meth:`PrefixIndex.cache_filled` to replay that order."""
        if not tables:
            return NOTHING_EVICTED
        blocks = self._blocks.acquire(len(tables))
        dropped = self._evict_reused(blocks)
        lists = list(map(_BLOCK_TABLE, tables))
        _consume(map(list.append, lists, blocks))
        self._journal.record(_pop_each, lists)
        if not dropped:
            return NOTHING_EVICTED
        place = dict(zip(blocks, order, strict=True))
        return {e.key: place[e.block_id] for e in dropped}

    def _grow_in_order(
        self, tables: list[_Table], growing: Sequence[int], fills: Sequence[int]
    ) -> list[BlockCopy]:
        """The general case (some table copies a shared last block): request by request,
        as the per-request path takes them. A sibling earlier in the step may have
        copied away, and a growth may evict a cached free block whose key a later
        request's filled block then takes (or not)."""
        copies: list[BlockCopy] = []
        grows = set(growing)
        fill_set = set(fills)
        for i in sorted(grows | fill_set):
            t = tables[i]
            if i in grows:
                copy = self._grow_one(t, len(t.token_ids) - 1)
                if copy is not None:
                    copies.append(copy)
            if i in fill_set:
                self._prefix.cache_full_blocks(t)
        return copies

    def _grow_one(self, table: _Table, stored: int) -> BlockCopy | None:
        """Room for the token at position ``stored`` of ``table`` (open transaction, a
        free block checked): a fresh block when the last one is full, else a private
        copy of the last block if it is still shared (a sibling earlier in the same step
        may have copied away). The caller is told the new tail (:class:`DecodeGrowth`)."""
        blocks = table.block_table
        fresh = starts_block(block_offset(stored, self.block_size))
        if not fresh and not self._blocks.is_shared(blocks[-1]):
            return None  # its sibling copied away earlier in this step
        (b,) = self._acquire(1)
        if fresh:
            blocks.append(b)
            self._journal.record(blocks.pop)
            return None
        src = blocks[-1]
        self._blocks.unshare(src)
        blocks[-1] = b
        self._journal.record(blocks.__setitem__, -1, src)
        return BlockCopy(src, b)

    # ------------------------------------------------------- fork, free, truncate
    def fork(self, parent_id: str, child_id: str) -> None:
        """Share every block of ``parent_id`` with a new ``child_id`` (n > 1 sampling).

        No block is copied now; the first write into the shared partial last block by
        either side copies it (:meth:`allocate` returns the :class:`BlockCopy`).
        """
        parent = self._table(parent_id, "fork")
        if child_id in self._tables:
            raise DuplicateRequest(child_id, "fork")
        with self._atomic():
            child = self._new_table(child_id, parent.root_key)
            self._mark_changed(parent)  # its last block is shared now
            self._blocks.share(parent.block_table)
            child.block_table.extend(parent.block_table)
            child.keys.extend(parent.keys)
            child.token_ids.extend(parent.token_ids)

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first (its private tail is evicted first).

        Cached blocks keep their index entry and stay reusable until evicted.
        """
        table = self._tables.get(request_id)
        if table is None:
            raise UnknownRequest(request_id, "free")
        self._changed.add(request_id)  # _mark_changed, inlined (hot)
        self._epoch += 1
        # Tail first (reversed), one run; release either completes or fails with
        # everything put back, and nothing after it can fail, so outside a transaction
        # no undo is recorded.
        if not self._journal.active:
            self._blocks.release(table.block_table[::-1])
            del self._tables[request_id]
            return
        try:
            self._blocks.release(table.block_table[::-1])
            del self._tables[request_id]
            self._journal.record(self._tables.__setitem__, request_id, table)
        except BaseException:
            self._abort(False)  # the opener's rollback undoes this call
            raise

    def truncate(self, request_id: str, num_stored: int) -> list[int]:
        """Keep the K/V of positions ``[0, num_stored)`` only: a verification rejected the
        draft tokens after them (docs/SPECULATIVE.md, "Rejected drafts").

        The blocks past the kept positions hold only rejected ones and go back to the
        free queue (tail first, as :meth:`free`); they are returned. Every block that
        holds a rejected position loses its cache entry: the kept block is overwritten
        from ``num_stored`` on by the next step, and the returned ones would chain from
        it. Inside a step the changes join its transaction.
        """
        table = self._table(request_id, "truncate")
        stored = table.num_stored
        _require_int(num_stored, "num_stored", minimum=0)
        if num_stored > stored:
            raise InvalidArgument(
                f"truncate: request {request_id!r} stores {stored} tokens; "
                f"it cannot keep {num_stored}"
            )
        if num_stored == stored:
            return []
        bs = self.block_size
        keep_blocks, keep_keys = blocks_needed(num_stored, bs), full_blocks(num_stored, bs)
        blocks = table.block_table
        with self._atomic():
            self._prefix.forget(blocks[keep_keys:])
            tails = (table.token_ids[num_stored:], table.keys[keep_keys:], blocks[keep_blocks:])
            del table.token_ids[num_stored:], table.keys[keep_keys:], blocks[keep_blocks:]
            self._journal.record(_untruncate, table, tails)
            self._mark_changed(table)
            self._blocks.release(tails[2][::-1])
        return tails[2]

    @property
    def cache_events(self) -> CacheEventLog | None:
        """The published cache events (``cache_events=True``), else None."""
        return self._prefix.events

    def clear_cache(self) -> int:
        """Drop every prefix-cache entry (blocks held by tables stay held); one
        ``CacheCleared`` event. Returns how many entries were dropped."""
        with self._atomic():
            return self._prefix.clear()

    def forget_cached(self, block_ids: Iterable[int]) -> int:
        """Drop the cache entries of these blocks (their K/V can no longer be trusted).

        Used after an executor fault: the failed step may have overwritten blocks that the
        rollback put back in the index. Returns how many entries were dropped.
        """
        in_range = [b for b in dict.fromkeys(block_ids) if 0 <= b < self.num_blocks]
        with self._atomic():
            return len(self._prefix.forget(in_range))

    # ------------------------------------------------------------------ snapshot
    def snapshot(self) -> PoolSnapshot:
        """The pool as spec sees it (refserve.spec.check_pool: BLOCK, CAP, POS, PREFIX)."""
        tables = tuple(
            TableSnapshot(rid, tuple(t.block_table), t.num_stored, tuple(t.token_ids), t.root_key)
            for rid, t in sorted(self._tables.items())
        )
        return PoolSnapshot(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            ref_cnt=self._blocks.ref_counts(),
            free_queue=self._blocks.free_queue(),
            tables=tables,
            cache_entries=tuple(self._prefix.entries()),
        )

    # ----------------------------------------------------------------- internals
    def _root_key(self, namespace: Namespace) -> bytes:
        return self._default_root if namespace is DEFAULT_NAMESPACE else namespace.root_key()

    def _table(self, request_id: str, what: str) -> _Table:
        table = self._tables.get(request_id)
        if table is None:
            raise UnknownRequest(request_id, what)
        return table

    def _new_table(self, request_id: str, root_key: bytes) -> _Table:
        table = _Table(request_id, root_key)
        self._tables[request_id] = table
        self._mark_changed(table)
        self._journal.record(self._tables.pop, request_id)
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
        table = self._new_table(request_id, hit.root_key if hit else self._root_key(namespace))
        if hit is not None:
            for b in hit.block_ids:
                self._blocks.hold(b)
            table.block_table.extend(hit.block_ids)
            table.keys.extend(hit.keys)
            table.token_ids.extend(token_ids[: hit.num_tokens])
        return table

    def _record_table_undo(self, table: _Table) -> None:
        # Tables only grow (plus a copy-on-write swap of the last block), so an undo
        # truncates back to the recorded lengths and restores the last entry. (Chain
        # keys are the index's to undo: PrefixIndex.cache_full_blocks.)
        if not self._journal.active:
            return
        last = table.block_table[-1] if table.block_table else None
        self._journal.record(
            _truncate_table, table, len(table.block_table), len(table.token_ids), last
        )

    def _needs_copy_on_write(self, table: _Table, num_new_tokens: int) -> bool:
        # Sharing first: it is rare, so the offset is seldom computed (a table holds a
        # block exactly when it stores a token, POS).
        blocks = table.block_table
        return (
            num_new_tokens > 0
            and bool(blocks)
            and self._blocks.is_shared(blocks[-1])
            and not starts_block(block_offset(table.num_stored, self.block_size))
        )

    def _copy_on_write(self, table: _Table) -> BlockCopy:
        # The table's last entry is restored by _record_table_undo's record.
        src = table.block_table[-1]
        (dst,) = self._acquire(1)
        self._blocks.unshare(src)
        table.block_table[-1] = dst
        self._mark_changed(table)
        return BlockCopy(src, dst)

    def _append_free_blocks(self, table: _Table, count: int) -> list[int]:
        """Move ``count`` free blocks (reference 1) onto the end of ``table``; the caller
        has checked there are that many (part of :meth:`allocate`'s transaction)."""
        if not count:
            return []
        self._mark_changed(table)
        new_blocks = self._acquire(count)
        table.block_table.extend(new_blocks)
        return new_blocks

    def _acquire(self, count: int) -> list[int]:
        """``count`` free blocks, each now held once, without cache entries."""
        blocks = self._blocks.acquire(count)
        self._evict_reused(blocks)
        return blocks

    def _evict_reused(self, blocks: Sequence[int]) -> list[Entry]:
        """Blocks taken from the free queue for new tokens lose their cache entries: a
        key must never point at a block's new tokens (PREFIX). The entries dropped."""
        return self._prefix.forget(blocks)


def _consume(calls: Iterator[object]) -> None:
    """Run a ``map`` of calls for their effect, at C speed (a deque that keeps nothing)."""
    deque(calls, maxlen=0)


def _pop_each(lists: list[list[int]]) -> None:
    # Undo of one append to each list: every later change to them is undone already.
    for items in lists:
        items.pop()


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


def _truncate_table(table: _Table, n_blocks: int, n_tokens: int, last: int | None) -> None:
    # Undo of growth (see _record_table_undo).
    del table.block_table[n_blocks:]
    del table.token_ids[n_tokens:]
    if last is not None:
        table.block_table[-1] = last


def _untruncate(table: _Table, tails: tuple[list[int], list[bytes], list[int]]) -> None:
    # Undo of truncate: every later change to the table is undone already.
    tokens, keys, blocks = tails
    table.token_ids += tokens
    table.keys += keys
    table.block_table += blocks


def _require_int(value: object, name: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise InvalidArgument(f"{name} must be >= {minimum}, got {value}")
