"""The bulk decode step: one token for each of many requests in a few C-level passes.

docs/ARCHITECTURE.md, "The persistent batch". A :class:`DecodeRun` holds the block
tables of some requests, in order, looked up once; each :meth:`DecodeRun.append_decodes`
stores one more token per request exactly as ``BlockPool.allocate(rid, known, 1)`` for
each in turn would, with a constant number of journal entries: the tokens in one pass,
the step's fresh blocks off the free queue as one run, the filled blocks hashed and
indexed in one pass.

It is an attachment, not part of the pool (ref/kv/pool.py), because the pool is complete
without it: the per-request path (``allocate``) stores the same tokens, and the
differential tests (tests/kv/test_decode_runs.py, tests/scheduler/test_fast_path.py)
hold this path to that one. It uses the pool only through its public surface (the
tables, the allocator, the prefix index, the journal and the pool's transactions), and
the pool does not know it: deleting this module and its tests leaves the pool whole.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter

from refserve.errors import InvalidArgument
from refserve.kv.pool import BlockCopy, BlockPool
from refserve.kv.prefix_index import NOTHING_EVICTED, FilledBlocks, filled_blocks
from refserve.kv.tables import BlockTable
from refserve.spec.arith import block_offset, starts_block

__all__ = ["DecodeGrowth", "DecodeRun"]

_TOKEN_IDS = attrgetter("token_ids")
_BLOCK_TABLE = attrgetter("block_table")


@dataclass(frozen=True)
class DecodeGrowth:
    """What :meth:`DecodeRun.append_decodes` did to the tables that needed a block.

    ``tails[j]`` is the last block of request ``growing[j]``'s table afterwards (a fresh
    block, or the private copy of a shared one) and ``lengths[j]`` its block count; the
    caller, which keeps its own copy of the tables, writes them back (these changes are
    not reported by :meth:`BlockPool.take_changed`).
    """

    copies: list[BlockCopy]
    tails: list[int]
    lengths: list[int]


class DecodeRun:
    """The block tables of ``request_ids`` in ``pool``, in order, looked up once for any
    number of :meth:`append_decodes`.

    It holds table objects and their token lists, so it stays current until a table is
    added or freed, or anything else the pool reports to ``take_changed`` happens (a
    block added or copied by ``allocate``, a fork) or a rollback: then
    :meth:`is_current` says it is stale and ``append_decodes`` refuses it. The
    persistent batch keeps one for its whole running order, so the steady decode step
    looks no request up.
    """

    __slots__ = ("_epoch", "_pool", "_tables", "_token_lists", "request_ids")

    def __init__(self, pool: BlockPool, request_ids: Sequence[str]) -> None:
        self.request_ids = request_ids
        self._pool = pool
        self._tables = pool.tables.tables(request_ids, "decode_run")
        self._token_lists: list[list[int]] = list(map(_TOKEN_IDS, self._tables))
        self._epoch = pool.tables.epoch

    def __len__(self) -> int:
        return len(self._tables)

    def is_current(self) -> bool:
        """No table changed since this run was taken, other than by append_decodes."""
        return self._epoch == self._pool.tables.epoch

    def append_decodes(
        self,
        tokens: Sequence[int],
        growing: Sequence[int],
        filling: Sequence[int],
        filled: Sequence[Sequence[int]] | None = None,
    ) -> DecodeGrowth | None:
        """The steady decode step: one more token for each request of the run, exactly
        as ``allocate(rid, known, 1)`` for each in turn would store it.

        ``tokens[i]`` is the token of the run's request ``i`` at its KV length, ``growing``
        the indices whose token starts a block or lands in a shared last block,
        ``filling`` those whose token fills its block, and ``filled[j]`` (optional) the
        token ids of the block that ``filling[j]``'s token fills, hashed from there.
        Nothing is re-derived per request (only each growing table's fresh block is told
        from a copy-on-write): a wrong claim breaks POS/BLOCK/PREFIX on the next
        snapshot (the persistent batch that makes the claims is differential-tested
        against the per-request path). All-or-nothing: if the free blocks cannot cover
        every growing request, returns None with nothing changed (the caller decides whom
        to preempt). A stale run is refused.
        """
        pool = self._pool
        if self._epoch != pool.tables.epoch:
            raise InvalidArgument(
                "append_decodes: the decode run is stale (a table changed since "
                "decode_run); take a new one"
            )
        if len(tokens) != len(self._tables):
            raise InvalidArgument(
                f"append_decodes: {len(tokens)} tokens for {len(self._tables)} requests"
            )
        blocks = None if filled is None else filled_blocks(filled, len(filling), pool.block_size)
        if len(growing) > pool.num_free_blocks:
            return None
        outermost = not pool.in_transaction
        if outermost:
            pool.begin()
        try:
            copies = self._decode_step(tokens, growing, filling, blocks)
        except BaseException:
            if outermost:
                pool.rollback()
            raise
        if outermost:
            pool.commit()
        grown = [self._tables[i].block_table for i in growing]
        return DecodeGrowth(copies, [t[-1] for t in grown], list(map(len, grown)))

    def _decode_step(
        self,
        tokens: Sequence[int],
        growing: Sequence[int],
        filling: Sequence[int],
        filled: FilledBlocks | None,
    ) -> list[BlockCopy]:
        """:meth:`append_decodes`' changes, checked (an open transaction); the copies."""
        pool = self._pool
        tables, lists, bs = self._tables, self._token_lists, pool.block_size
        # Every growing token starts a block (none copies a shared one): the step's fresh
        # blocks come off the free queue as one run. (Read before the tokens go in: each
        # list's length is its token's position; map keeps the per-row calls at C level.)
        growing_lengths = map(len, [lists[i] for i in growing])
        fresh_only = all(map(starts_block, map(block_offset, growing_lengths, repeat(bs))))
        # Each table's token in one C-level pass, undone by one entry (recorded first,
        # so undone last: nothing below changes the token lists).
        _consume(map(list.append, lists, tokens))
        pool.journal.record(_pop_each, lists)
        fills = filling if pool.enable_prefix_caching else ()
        if not fresh_only:
            return self._grow_in_order(growing, fills)
        evicted = self._grow_run([tables[i] for i in growing], growing)
        if fills:
            pool.prefix_index.cache_filled(tables, fills, evicted, filled)
        return []

    def _grow_run(self, tables: list[BlockTable], order: Sequence[int]) -> Mapping[bytes, int]:
        """A fresh block for each of ``tables`` (each last block full; ``order[j]`` is
        ``tables[j]``'s place in the step's request order), as one run off the free
        queue: one journal entry for the run, one for the appends, one for the evictions.

        The per-request path pops in request order and indexes each filled block as it
        comes, so a pop that evicts key K *after* a request that fills a block with key
        K saw K still indexed. Returned: each evicted key with the place of the request
        whose pop evicted it, for :meth:`PrefixIndex.cache_filled` to replay that order."""
        if not tables:
            return NOTHING_EVICTED
        pool = self._pool
        blocks = pool.allocator.acquire(len(tables))
        dropped = pool.evict_reused(blocks)
        lists = list(map(_BLOCK_TABLE, tables))
        _consume(map(list.append, lists, blocks))
        pool.journal.record(_pop_each, lists)
        if not dropped:
            return NOTHING_EVICTED
        place = dict(zip(blocks, order, strict=True))
        return {e.key: place[e.block_id] for e in dropped}

    def _grow_in_order(self, growing: Sequence[int], fills: Sequence[int]) -> list[BlockCopy]:
        """The general case (some table copies a shared last block): request by request,
        as the per-request path takes them. A sibling earlier in the step may have
        copied away, and a growth may evict a cached free block whose key a later
        request's filled block then takes (or not)."""
        tables, prefix = self._tables, self._pool.prefix_index
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
                prefix.cache_full_blocks(t)
        return copies

    def _grow_one(self, table: BlockTable, stored: int) -> BlockCopy | None:
        """Room for the token at position ``stored`` of ``table`` (open transaction, a
        free block checked): a fresh block when the last one is full, else a private
        copy of the last block if it is still shared (a sibling earlier in the same step
        may have copied away). The caller is told the new tail (:class:`DecodeGrowth`)."""
        pool = self._pool
        blocks = table.block_table
        fresh = starts_block(block_offset(stored, pool.block_size))
        if not fresh and not pool.allocator.is_shared(blocks[-1]):
            return None  # its sibling copied away earlier in this step
        if not fresh:
            # Not reported to take_changed: the batch takes the new tail from DecodeGrowth.
            copy = pool.copy_on_write(table)
            pool.journal.record(blocks.__setitem__, -1, copy.src)
            return copy
        (b,) = pool.acquire(1)
        blocks.append(b)
        pool.journal.record(blocks.pop)
        return None


def _consume(calls: Iterator[object]) -> None:
    """Run a ``map`` of calls for their effect, at C speed (a deque that keeps nothing)."""
    deque(calls, maxlen=0)


def _pop_each(lists: list[list[int]]) -> None:
    # Undo of one append to each list: every later change to them is undone already.
    for items in lists:
        items.pop()
