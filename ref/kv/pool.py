"""The paged KV block pool: block tables, ref counts, prefix cache, fork, copy-on-write.

Invariants it maintains are checked from outside on :meth:`BlockPool.snapshot`
(spec.check_pool): BLOCK (ref counts equal holders, the free queue is exact), CAP, POS
(tables cover their KV length exactly) and PREFIX (hash chains, full blocks only, shared
blocks never written). Every mutating method validates first and mutates after, so a
bad argument raises a typed error with nothing changed; inside
:meth:`BlockPool.transaction` a later failure undoes the whole group.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter
from types import MappingProxyType
from typing import NamedTuple

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
from spec.hashing import (
    DEFAULT_NAMESPACE,
    Namespace,
    block_key,
    packed_block_key,
    packed_token_ids,
)
from spec.snapshot import CacheEntry, PoolSnapshot, TableSnapshot

_NOTHING_EVICTED: Mapping[bytes, int] = MappingProxyType({})
"""No key evicted in this step (every caller but :meth:`BlockPool._fill_run`)."""

_MAX_PENDING_STEPS = 16
"""Decode steps a :class:`DecodeRun` holds before its tokens are written into its tables:
bounds its memory, and writes each table's tokens a block's worth at a time (block 16)."""


class _Entry(NamedTuple):
    """A prefix-cache entry as the pool keeps it: the fields of
    :class:`spec.snapshot.CacheEntry`, which :meth:`BlockPool.snapshot` builds from it.
    A named tuple is made in a third of the frozen dataclass's time, once per block that
    fills with prefix caching on."""

    key: bytes
    block_id: int
    parent_key: bytes
    token_ids: tuple[int, ...]


_new_tuple = tuple.__new__


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
class DecodeGrowth:
    """What :meth:`BlockPool.append_decodes` did to the tables that needed a block.

    ``tails[j]`` is the last block of request ``needy[j]``'s table afterwards (a fresh
    block, or the private copy of a shared one) and ``lengths[j]`` its block count; the
    caller, which keeps its own copy of the tables, writes them back (these changes are
    not reported by :meth:`BlockPool.take_changed`).
    """

    copies: list[BlockCopy]
    tails: list[int]
    lengths: list[int]


@dataclass(frozen=True)
class _FilledBlocks:
    """The token ids of the blocks a decode step fills (``filled`` of
    :meth:`BlockPool.append_decodes`), and all of them encoded at once for hashing
    (``spec.hashing.packed_token_ids``, 8 bytes per token id): block ``j`` is the
    ``j``-th ``8 * block_size`` bytes of ``packed``."""

    blocks: Sequence[Sequence[int]]
    packed: bytes


@dataclass(frozen=True)
class Allocation:
    """What :meth:`BlockPool.allocate` did for one request."""

    request_id: str
    start_position: int
    num_new_tokens: int
    num_cached_tokens: int
    new_block_ids: tuple[int, ...]
    copies: tuple[BlockCopy, ...]


class DecodeRun:
    """The block tables of some requests, in order, looked up once
    (:meth:`BlockPool.decode_run`) for any number of :meth:`BlockPool.append_decodes`.

    It holds table objects, so it stays current until a table is added or freed, or
    anything else the pool reports to ``take_changed`` happens (a block added or
    copied by ``allocate``, a fork) or a rollback: then :meth:`BlockPool.is_current`
    says it is stale and ``append_decodes`` refuses it. The persistent batch keeps one
    for its whole running order, so the steady decode step looks no request up.

    Each ``append_decodes`` adds one token to every table of the run, so the run keeps
    the step's tokens as one tuple (``_steps``) instead of appending to each table's
    token list: the steady step touches no table that needs no block. Every table of
    the run then holds ``len(_steps)`` tokens beyond its list. The pool writes them in
    (``BlockPool._settle``, one pass per table) before anything reads a table's tokens
    (``allocate``, a fork, another run, ``num_stored``), every
    :data:`_MAX_PENDING_STEPS` steps, and before a step that copies a shared block;
    a snapshot reads them where they are.
    """

    __slots__ = ("_epoch", "_steps", "_tables", "_token_lists", "request_ids")

    def __init__(self, request_ids: Sequence[str], tables: list[_Table], epoch: int) -> None:
        self.request_ids = request_ids
        self._tables = tables
        self._token_lists = list(map(_TOKEN_IDS, tables))
        self._steps: list[tuple[int, ...]] = []
        self._epoch = epoch

    def __len__(self) -> int:
        return len(self._tables)


class _Table:
    """One request's block table and the token ids whose K/V its blocks hold."""

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
        # Namespace.root_key() hashes on every call; nearly every request has the default.
        self._default_root = DEFAULT_NAMESPACE.root_key()
        self._free = FreeQueue(num_blocks, self._journal)
        self._ref = [0] * num_blocks
        self._tables: dict[str, _Table] = {}
        # Prefix cache: key -> block, and per block what its key was computed from.
        self._index: dict[bytes, int] = {}
        self._entry: list[_Entry | None] = [None] * num_blocks
        # Blocks indexed inside the open transaction: their K/V is computed by the step
        # that reserved them, so a lookup in that same step must not serve them.
        self._fresh: set[int] = set()
        # Requests whose block table changed (or whose last block's sharing did) since
        # the last take_changed(): the persistent batch (ref/core/batch.py) rewrites only
        # their rows. A rollback may shrink any table, so it marks every table changed.
        self._changed: set[str] = set()
        # Bumped by every change reported to take_changed and by every rollback: a
        # DecodeRun taken at an older epoch may hold a table that is gone or replaced.
        self._epoch = 0
        self._all_changed = False
        # The run whose tables hold tokens not yet in their lists (DecodeRun), if any.
        self._pending: DecodeRun | None = None

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
        table = self._table(request_id, "num_stored")
        self._settle()
        return table.num_stored

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
        root = self._root_key(namespace)
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
        if table is not None and self._pending is not None:
            self._settle()  # its KV length may be held by a decode run
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
    def transaction(self) -> Iterator[None]:
        """Group mutations: if the body raises, the pool returns to its state at entry."""
        outermost = not self._journal.active
        try:
            with self._journal.transaction():
                yield
        except BaseException:
            self._mark_all_changed()  # the undo may have shrunk any table
            raise
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
        if table is not None and self._pending is not None:
            self._settle()  # its tokens may be held by a decode run
        start, total, new_tokens = self._check_allocate(
            request_id, table, token_ids, num_new_tokens, hit, namespace
        )
        # Outside a transaction with prefix caching off nothing below can fail (the new
        # tokens are already taken, the counts checked), so no undo is recorded; with
        # caching a token id can fail hashing, so a transaction is opened: an explicit
        # one, as the generator-based `with self.transaction()` alone cost more than a
        # small allocation's pool work. Inside a transaction the changes join it.
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
                self._cache_full_blocks(table)
        except BaseException:
            self._abort(opened)
            raise
        if opened:  # self.commit(), inlined (hot)
            journal.commit()
            if self._fresh:
                self._fresh.clear()
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
            self._validate_hit(request_id, hit, token_ids, namespace)
        start = table.num_stored if table is not None else (hit.num_tokens if hit else 0)
        end = start + num_new_tokens
        if len(token_ids) < end:
            raise InvalidArgument(
                f"allocate: request {request_id!r} asks for positions up to {end} but only "
                f"{len(token_ids)} token ids are known"
            )
        total = -(-end // self.block_size)  # spec.arith.blocks_needed, inlined (hot)
        if total > self.num_blocks:
            raise ExceedsCapacity(request_id, total, self.num_blocks)
        needed = self.blocks_to_allocate(request_id, num_new_tokens, hit)
        if needed > len(self._free):
            raise OutOfBlocks(request_id, needed, len(self._free))
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
        total = -(-num_new_tokens // self.block_size)  # spec.arith.blocks_needed
        free = self._free
        if total > free.num_free:  # also covers total > num_blocks
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
        # Caching is off: nothing is indexed, so the popped blocks have no entry to evict.
        table.block_table = blocks = free.acquire_n(total, self._ref)
        return _allocation(request_id, 0, num_new_tokens, 0, blocks, ())

    def append_decode_tokens(
        self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]]
    ) -> list[BlockCopy] | None:
        """The steady decode step: one more token for each request, in order.

        Equivalent to ``allocate(rid, tokens, 1)`` for each request in turn; ``token_ids``
        are the requests' known tokens. All-or-nothing: if the free blocks cannot cover
        every request that needs a fresh block or a copy-on-write, returns None and
        changes nothing (the caller then decides whom to preempt). Returns the copies to
        apply. :meth:`append_decodes` is the same step for a caller that already knows
        which requests need a block (the persistent batch).
        """
        bs = self.block_size
        ref = self._ref
        try:
            tables = [self._tables[rid] for rid in request_ids]
        except KeyError as e:
            raise UnknownRequest(str(e.args[0]), "append_decode_tokens") from None
        self._settle()
        tokens: list[int] = []
        needy: list[int] = []
        filling: list[int] = []
        for i, (t, src) in enumerate(zip(tables, token_ids, strict=True)):
            n = len(t.token_ids)
            if len(src) <= n:
                raise InvalidArgument(
                    f"append_decode_tokens: a request has {len(src)} known tokens and "
                    f"{n} stored; there is no new token to append"
                )
            tokens.append(src[n])
            if n % bs == 0 or ref[t.block_table[-1]] > 1:
                needy.append(i)
            if (n + 1) % bs == 0:
                filling.append(i)
        growth = self._append_decodes(tables, list(map(_TOKEN_IDS, tables)), tokens, needy, filling)
        if growth is None:
            return None
        for i in needy:
            self._mark_changed(tables[i])
        return growth.copies

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
        needy: Sequence[int],
        filling: Sequence[int],
        filled: Sequence[Sequence[int]] | None = None,
    ) -> DecodeGrowth | None:
        """:meth:`append_decode_tokens` for a caller that knows each request's state:
        ``tokens[i]`` is the token of ``run``'s request ``i`` at its KV length, ``needy``
        the indices whose token starts a block or lands in a shared last block,
        ``filling`` those whose token fills its block, and ``filled[j]`` (optional) the
        token ids of the block that ``filling[j]``'s token fills, so that hashing it
        reads no held tokens. Nothing is re-derived per request (only each needy
        table's fresh block is told from a copy-on-write): a wrong claim breaks
        POS/BLOCK/PREFIX on the next snapshot (the persistent batch that makes the
        claims is differential-tested against the per-request path). A stale ``run`` is
        refused.
        """
        if run._epoch != self._epoch:
            raise InvalidArgument(
                "append_decodes: the decode run is stale (a table changed since "
                "decode_run); take a new one"
            )
        if len(tokens) != len(run):
            raise InvalidArgument(f"append_decodes: {len(tokens)} tokens for {len(run)} requests")
        blocks = None if filled is None else self._filled_blocks(filled, filling)
        if self._pending is not run:
            self._settle()  # another run's tokens go in first
        return self._append_decodes(run._tables, run, tokens, needy, filling, blocks)

    def _filled_blocks(
        self, filled: Sequence[Sequence[int]], filling: Sequence[int]
    ) -> _FilledBlocks:
        """``filled`` checked (one block of int64 token ids per filling request) and
        encoded in one call: hashing then takes a slice per block, not a pack."""
        if len(filled) != len(filling):
            raise InvalidArgument(
                f"append_decodes: {len(filled)} filled blocks for {len(filling)} filling requests"
            )
        try:
            packed = packed_token_ids(chain.from_iterable(filled))
        except (OverflowError, TypeError) as e:
            raise InvalidArgument(
                f"append_decodes: a filled block holds a bad token id ({e})"
            ) from e
        width = 8 * self.block_size
        if len(packed) != width * len(filled):
            lengths = sorted({len(b) for b in filled} - {self.block_size})
            raise InvalidArgument(
                f"append_decodes: a filled block holds {lengths[0]} token ids, "
                f"not the block size {self.block_size}"
            )
        return _FilledBlocks(filled, packed)

    def _append_decodes(
        self,
        tables: list[_Table],
        into: DecodeRun | list[list[int]],
        tokens: Sequence[int],
        needy: Sequence[int],
        filling: Sequence[int],
        filled: _FilledBlocks | None = None,
    ) -> DecodeGrowth | None:
        """One token for each table: held by the run ``into`` (whose tables hold no
        other run's token), or appended to the tables' token lists ``into``."""
        if len(needy) > len(self._free):
            return None
        copies: list[BlockCopy] = []
        journal = self._journal
        outermost = not journal.active
        if outermost:
            journal.begin()
        try:
            # Recorded first, so undone last: the tokens join only the token lists or
            # the run's steps, which nothing below changes but a settle (undone first).
            steps = self._add_tokens(into, tokens)
            fills = filling if self.enable_prefix_caching else ()
            bs = self.block_size
            behind = len(steps)  # tokens each table holds beyond its list (this one too)
            if all((len(tables[i].token_ids) + behind - 1) % bs == 0 for i in needy):
                evicted = self._grow_run([tables[i] for i in needy], needy)
                if fills:
                    self._fill_run(tables, fills, evicted, steps, filled)
            else:
                self._settle()  # the general case reads every table's tokens
                copies = self._grow_in_order(tables, needy, fills)
            if isinstance(into, DecodeRun) and len(into._steps) >= _MAX_PENDING_STEPS:
                self._settle()
        except BaseException:
            if outermost:
                journal.rollback()
                self._mark_all_changed()
            raise
        if outermost:
            journal.commit()
            self._fresh.clear()
        grown = [tables[i].block_table for i in needy]
        return DecodeGrowth(copies, [t[-1] for t in grown], list(map(len, grown)))

    def _add_tokens(
        self, into: DecodeRun | list[list[int]], tokens: Sequence[int]
    ) -> list[tuple[int, ...]]:
        """The step's tokens, held by the run ``into`` or appended to the token lists
        ``into``, with one undo entry; the run's held steps (none for lists)."""
        if isinstance(into, DecodeRun):
            into._steps.append(tuple(tokens))
            self._journal.record(into._steps.pop)
            self._pending = into
            return into._steps
        _consume(map(list.append, into, tokens))
        self._journal.record(_pop_each, into)
        return []

    def _grow_run(self, tables: list[_Table], order: Sequence[int]) -> dict[bytes, int]:
        """A fresh block for each of ``tables`` (each last block full; ``order[j]`` is
        ``tables[j]``'s place in the step's request order), as one run off the free
        queue: one journal entry for the run, one for the appends, one for the evictions.

        The per-request path pops in request order and indexes each filled block as it
        comes, so a pop that evicts key K *after* a request that fills a block with key
        K saw K still indexed. Returned: each evicted key with the place of the request
        whose pop evicted it, for :meth:`_fill_run` to replay that order exactly."""
        if not tables:
            return {}
        blocks = self._free.acquire_n(len(tables), self._ref)
        evicted: dict[bytes, int] = {}
        if self._index:  # caching on and something indexed: the popped lose their entries
            entries = self._entry
            cached = [j for j, b in enumerate(blocks) if entries[b] is not None]
            dropped = self._uncache_run([blocks[j] for j in cached])
            evicted = {e.key: order[j] for j, e in zip(cached, dropped, strict=True)}
        lists = list(map(_BLOCK_TABLE, tables))
        _consume(map(list.append, lists, blocks))
        self._journal.record(_pop_each, lists)
        return evicted

    def _fill_run(
        self,
        tables: list[_Table],
        filling: Sequence[int],
        evicted: dict[bytes, int],
        steps: Sequence[tuple[int, ...]],
        filled: _FilledBlocks | None,
    ) -> None:
        """Index the block each of ``tables[i]`` (``i`` in ``filling``, ascending) just
        filled, as :meth:`_cache_full_blocks` would one by one in request order after
        the pops of the requests before it (``evicted``, from :meth:`_grow_run`); each
        table holds ``steps``' tokens beyond its list (:class:`DecodeRun`). With the
        blocks' tokens given (``filled``) and every earlier block of a table keyed, its
        one new key is hashed from them: the held tokens of a row lie one per step
        tuple, a cache miss each. One journal entry for the keys, one for the index."""
        grown: list[tuple[list[bytes], int]] = []
        indexed: list[int] = []
        index, entries = self._index, self._entry
        packed = filled.packed if filled is not None else b""
        width = 8 * self.block_size  # bytes per block in packed
        for j, i in enumerate(filling):
            t = tables[i]
            keys = t.keys
            first = len(keys)
            grown.append((keys, first))
            if filled is None or first != len(t.block_table) - 1:
                self._index_new_blocks(t, indexed, evicted, i, [step[i] for step in steps])
                continue
            # _index_new_blocks' loop for this one block, inline, its tokens encoded with
            # all the others' (_FilledBlocks): a method call and a struct pack per block
            # were half of the step's hashing cost.
            parent = keys[-1] if keys else t.root_key
            tokens = tuple(filled.blocks[j])
            key = packed_block_key(parent, packed[j * width : (j + 1) * width])
            keys.append(key)
            b = t.block_table[first]
            if entries[b] is None and key not in index and evicted.get(key, -1) <= i:
                index[key] = b
                entries[b] = _new_tuple(_Entry, (key, b, parent, tokens))
                indexed.append(b)
        self._journal.record(_truncate_each, grown)  # filling is never empty here
        if indexed:
            self._fresh.update(indexed)
            self._journal.record(self._unindex_run, indexed)

    def _grow_in_order(
        self, tables: list[_Table], needy: Sequence[int], fills: Sequence[int]
    ) -> list[BlockCopy]:
        """The general case (some table copies a shared last block): request by request,
        as the per-request path takes them. A sibling earlier in the step may have
        copied away, and a growth may evict a cached free block whose key a later
        request's filled block then takes (or not)."""
        copies: list[BlockCopy] = []
        grows = set(needy)
        fill_set = set(fills)
        for i in sorted(grows | fill_set):
            t = tables[i]
            if i in grows:
                copy = self._grow_one(t, len(t.token_ids) - 1)
                if copy is not None:
                    copies.append(copy)
            if i in fill_set:
                self._journal.record(_truncate, t.keys, len(t.keys))  # indexing appends keys
                self._cache_full_blocks(t)
        return copies

    def _grow_one(self, table: _Table, stored: int) -> BlockCopy | None:
        """Room for the token at position ``stored`` of ``table`` (open transaction, a
        free block checked):
        a fresh block when the last one is full, else a private copy of the last block
        if it is still shared (a sibling earlier in the same step may have copied away).
        Only the block list and two reference counts change, each undone by one compact
        entry; the caller is told the new tail (:class:`DecodeGrowth`)."""
        blocks = table.block_table
        ref = self._ref
        partial = stored % self.block_size
        if partial and ref[blocks[-1]] == 1:
            return None  # its sibling copied away earlier in this step
        b = self._pop_free()
        ref[b] = 1
        record = self._journal.record
        if not partial:
            blocks.append(b)
            record(_undo_append_block, ref, blocks, b)
            return None
        src = blocks[-1]
        ref[src] -= 1
        blocks[-1] = b
        record(_undo_copy_on_write, ref, blocks, src, b)
        return BlockCopy(src, b)

    def ref_count(self, block_id: int) -> int:
        """How many tables hold ``block_id``."""
        return self._ref[block_id]

    def fork(self, parent_id: str, child_id: str) -> None:
        """Share every block of ``parent_id`` with a new ``child_id`` (n > 1 sampling).

        No block is copied now; the first write into the shared partial last block by
        either side copies it (:meth:`allocate` returns the :class:`BlockCopy`).
        """
        parent = self._table(parent_id, "fork")
        if child_id in self._tables:
            raise DuplicateRequest(child_id, "fork")
        self._settle()
        with self.transaction():
            child = self._new_table(child_id, parent.root_key)
            self._mark_changed(parent)  # its last block is shared now
            for b in parent.block_table:
                self._set_ref(b, self._ref[b] + 1)
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
        # Tail first (reversed), one run; release_n either completes or fails with
        # everything put back, and nothing after it can fail, so outside a transaction
        # no undo is recorded.
        if not self._journal.active:
            self._free.release_n(table.block_table[::-1], self._ref)
            del self._tables[request_id]
            return
        try:
            self._free.release_n(table.block_table[::-1], self._ref)
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
        self._settle()
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
        keep_blocks, keep_keys = -(-num_stored // bs), num_stored // bs
        blocks = table.block_table
        with self.transaction():
            entries = self._entry
            self._uncache_run([b for b in blocks[keep_keys:] if entries[b] is not None])
            tails = (table.token_ids[num_stored:], table.keys[keep_keys:], blocks[keep_blocks:])
            del table.token_ids[num_stored:], table.keys[keep_keys:], blocks[keep_blocks:]
            self._journal.record(_untruncate, table, tails)
            self._mark_changed(table)
            self._free.release_n(tails[2][::-1], self._ref)
        return tails[2]

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
        """The pool as spec sees it. A decode run's pending tokens are read where they
        are, not written in: a checked run steps exactly as an unchecked one."""
        held: dict[int, int] = {}  # id of a table of the pending run -> its place there
        steps: list[tuple[int, ...]] = []
        if self._pending is not None:
            steps = self._pending._steps
            held = {id(t): i for i, t in enumerate(self._pending._tables)}
        tables = []
        for rid, t in sorted(self._tables.items()):
            i = held.get(id(t))
            tokens = (*t.token_ids, *(() if i is None else (step[i] for step in steps)))
            tables.append(TableSnapshot(rid, tuple(t.block_table), len(tokens), tokens, t.root_key))
        return PoolSnapshot(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            ref_cnt=tuple(self._ref),
            free_queue=tuple(self._free),
            tables=tuple(tables),
            cache_entries=tuple(sorted(self._cache_entries(), key=_entry_order)),
        )

    # ----------------------------------------------------------------- internals
    def _settle(self) -> None:
        """Write the pending decode run's tokens into its tables' lists (one pass per
        table; :class:`DecodeRun`), with one undo record."""
        run = self._pending
        if run is None:
            return
        self._pending = None
        steps = run._steps
        if not steps:
            return
        run._steps = []
        lists = run._token_lists
        if len(steps) == 1:
            _consume(map(list.append, lists, steps[0]))
        else:
            _consume(map(list.extend, lists, zip(*steps, strict=True)))
        self._journal.record(self._unsettle, run, steps)

    def _unsettle(self, run: DecodeRun, steps: list[tuple[int, ...]]) -> None:
        # Undo of _settle: each list grew by exactly len(steps) tokens, and every later
        # change to it is undone already.
        _consume(map(_drop_last, run._token_lists, repeat(len(steps))))
        run._steps = steps
        self._pending = run

    def _cache_entries(self) -> list[CacheEntry]:
        return [CacheEntry(*e) for b in self._index.values() if (e := self._entry[b]) is not None]

    def _root_key(self, namespace: Namespace) -> bytes:
        return self._default_root if namespace is DEFAULT_NAMESPACE else namespace.root_key()

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
        table = self._new_table(request_id, hit.root_key if hit else self._root_key(namespace))
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
        if not count:
            return []
        self._mark_changed(table)
        new_blocks = self._free.acquire_n(count, self._ref)
        self._evict_reused(new_blocks)
        table.block_table.extend(new_blocks)
        return new_blocks

    def _new_table(self, request_id: str, root_key: bytes) -> _Table:
        table = _Table(request_id, root_key)
        self._tables[request_id] = table
        self._mark_changed(table)
        if self._journal.active:
            self._journal.record(self._tables.pop, request_id)
        return table

    def _record_table_undo(self, table: _Table) -> None:
        # Tables only grow (plus a copy-on-write swap of the last block), so an undo
        # truncates back to the recorded lengths and restores the last entry.
        if not self._journal.active:
            return
        n_blocks, n_keys, n_tokens = len(table.block_table), len(table.keys), len(table.token_ids)
        last = table.block_table[-1] if table.block_table else None
        self._journal.record(_truncate_table, table, n_blocks, n_keys, n_tokens, last)

    def _validate_hit(
        self, request_id: str, hit: PrefixHit, token_ids: Sequence[int], namespace: Namespace
    ) -> None:
        if hit.block_size != self.block_size or hit.root_key != self._root_key(namespace):
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
        self._mark_changed(table)
        return BlockCopy(src, dst)

    def _pop_free(self) -> int:
        b = self._free.popleft()
        self._evict_reused((b,))
        return b

    def _evict_reused(self, blocks: Sequence[int]) -> None:
        """Blocks taken from the free queue for new tokens lose their cache entries: a
        key must never point at a block's new tokens (PREFIX)."""
        if self._index:  # no entry at all (caching off): nothing to evict
            entries = self._entry
            self._uncache_run([b for b in blocks if entries[b] is not None])

    def _take(self, b: int) -> None:
        if self._ref[b] == 0:
            self._free.remove(b)
        self._set_ref(b, self._ref[b] + 1)

    def _set_ref(self, b: int, value: int) -> None:
        assert value >= 0, f"ref count of block {b} would go negative"
        old = self._ref[b]
        self._ref[b] = value
        self._journal.record(self._ref.__setitem__, b, old)

    def _cache_full_blocks(self, table: _Table) -> None:
        """Index the table's full blocks not indexed yet (their keys join ``table.keys``)."""
        indexed: list[int] = []
        self._index_new_blocks(table, indexed)
        if indexed and self._journal.active:
            self._fresh.update(indexed)
            self._journal.record(self._unindex_run, indexed)

    def _index_new_blocks(
        self,
        table: _Table,
        indexed: list[int],
        evicted: Mapping[bytes, int] = _NOTHING_EVICTED,
        place: int = 0,
        pending: Sequence[int] = (),
    ) -> None:
        """Hash the table's full blocks that have no key yet (the keys join
        ``table.keys``) and index each whose key is free, appending it to ``indexed``.
        The table holds ``pending`` tokens beyond its list (:class:`DecodeRun`). A key is taken
        if it is indexed, or if ``evicted`` holds it with a place after ``place``:
        :meth:`_fill_run` replays a step in which that later request's pop evicts it
        only after this fill."""
        bs = self.block_size
        keys, token_ids, block_table = table.keys, table.token_ids, table.block_table
        n = len(token_ids)
        index, entries = self._index, self._entry
        parent = keys[-1] if keys else table.root_key
        first = len(keys)
        for i in range(first, (n + len(pending)) // bs):
            lo, hi = i * bs, (i + 1) * bs
            if hi <= n:
                tokens = tuple(token_ids[lo:hi])
            else:
                tokens = tuple(token_ids[lo:] + list(pending[max(lo - n, 0) : hi - n]))
            key = block_key(parent, tokens)
            keys.append(key)
            b = block_table[i]
            # Two requests may compute the same new prefix in one step; the first one
            # indexed wins and the other block simply stays private.
            taken = key in index or evicted.get(key, -1) > place
            if not taken and entries[b] is None:
                index[key] = b
                entries[b] = _new_tuple(_Entry, (key, b, parent, tokens))
                indexed.append(b)
            parent = key

    def _unindex_run(self, blocks: list[int]) -> None:
        # Undo of _cache_full_blocks: the blocks' entries are the ones it made.
        index, entries = self._index, self._entry
        for b in blocks:
            entry = entries[b]
            assert entry is not None
            del index[entry.key]
            entries[b] = None

    def _uncache_run(self, blocks: list[int]) -> list[_Entry]:
        """Drop the cache entries of ``blocks`` (each has one), with one undo record;
        the entries dropped, in order."""
        if not blocks:
            return []
        index, entries = self._index, self._entry
        dropped: list[_Entry] = []
        for b in blocks:
            entry = entries[b]
            assert entry is not None
            del index[entry.key]
            entries[b] = None
            dropped.append(entry)
        self._journal.record(self._reindex_run, dropped)
        return dropped

    def _reindex_run(self, dropped: list[_Entry]) -> None:
        # Undo of _uncache_run.
        index, entries = self._index, self._entry
        for entry in dropped:
            index[entry.key] = entry.block_id
            entries[entry.block_id] = entry

    def _uncache(self, b: int) -> None:
        entry = self._entry[b]
        assert entry is not None
        del self._index[entry.key]
        self._entry[b] = None
        self._journal.record(self._reindex, b, entry)

    def _reindex(self, b: int, entry: _Entry) -> None:
        # Undo of _uncache.
        self._index[entry.key] = b
        self._entry[b] = entry


_TOKEN_IDS = attrgetter("token_ids")
_BLOCK_TABLE = attrgetter("block_table")


def _truncate(items: list[int] | list[bytes], n: int) -> None:
    del items[n:]


def _undo_append_block(ref: list[int], blocks: list[int], b: int) -> None:
    blocks.pop()
    ref[b] = 0


def _undo_copy_on_write(ref: list[int], blocks: list[int], src: int, b: int) -> None:
    blocks[-1] = src
    ref[src] += 1
    ref[b] = 0


def _consume(calls: Iterator[object]) -> None:
    """Run a ``map`` of calls for their effect, at C speed (a deque that keeps nothing)."""
    deque(calls, maxlen=0)


def _drop_last(items: list[int], count: int) -> None:
    del items[len(items) - count :]


def _pop_each(lists: list[list[int]]) -> None:
    for items in lists:
        items.pop()


def _truncate_each(grown: list[tuple[list[bytes], int]]) -> None:
    for items, n in grown:
        del items[n:]


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


def _truncate_table(
    table: _Table, n_blocks: int, n_keys: int, n_tokens: int, last: int | None
) -> None:
    # Undo of growth (see _record_table_undo).
    del table.block_table[n_blocks:]
    del table.keys[n_keys:]
    del table.token_ids[n_tokens:]
    if last is not None:
        table.block_table[-1] = last


def _untruncate(table: _Table, tails: tuple[list[int], list[bytes], list[int]]) -> None:
    # Undo of truncate: every later change to the table is undone already.
    tokens, keys, blocks = tails
    table.token_ids += tokens
    table.keys += keys
    table.block_table += blocks


def _entry_order(e: CacheEntry) -> int:
    return e.block_id


def _require_int(value: object, name: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise InvalidArgument(f"{name} must be >= {minimum}, got {value}")
