"""Block allocation: reference counts and the free queue, journaled (BLOCK, ATOMIC).

One concept (docs/ARCHITECTURE.md, "Layers", KV memory): which blocks are held and by
how many tables. A block is in the free queue exactly when its count is 0 (BLOCK), in
LRU order (ref/kv/free_queue.py), so the block freed longest ago is reused first. What
a block holds, its table and its cache entry are not known here: the pool
(ref/kv/pool.py) composes this with the block tables and the prefix index
(ref/kv/prefix_index.py). Every change records its undo in the journal the three share
(ref/kv/journal.py), so a rolled-back step leaves no trace (ATOMIC); a run of blocks
costs one entry, not one per block.
"""

from __future__ import annotations

from collections.abc import Sequence

from refserve.kv.free_queue import FreeQueue
from refserve.kv.journal import Journal


class BlockAllocator:
    """``num_blocks`` blocks, each free (count 0, queued) or held by ``count`` tables."""

    def __init__(self, num_blocks: int, journal: Journal) -> None:
        assert num_blocks >= 1, f"an allocator needs a block, got {num_blocks}"
        self.num_blocks = num_blocks
        self._journal = journal
        self._ref = [0] * num_blocks
        self._free = FreeQueue(num_blocks, journal)

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return self._free.num_free

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_shared(self, block_id: int) -> bool:
        """Held by more than one table: a write into it copies it first (PREFIX)."""
        return self._ref[block_id] > 1

    def num_revived(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` are free: :meth:`hold` takes them out of the queue."""
        ref = self._ref
        return sum(1 for b in block_ids if ref[b] == 0)

    def ref_counts(self) -> tuple[int, ...]:
        return tuple(self._ref)

    def free_queue(self) -> tuple[int, ...]:
        return tuple(self._free)

    # ---------------------------------------------------------------- mutations
    def acquire(self, count: int) -> list[int]:
        """The ``count`` blocks at the head of the free queue, each now held once; the
        caller has checked there are that many (``FreeQueue.acquire_n`` asserts it; one
        journal entry)."""
        return self._free.acquire_n(count, self._ref)

    def hold(self, block_id: int) -> None:
        """One more table holds ``block_id`` (a prefix hit); a free block leaves the queue
        from wherever it is, its cache entry kept."""
        old = self._ref[block_id]
        if old == 0:
            self._free.remove(block_id)
        self._ref[block_id] = old + 1
        self._journal.record(self._ref.__setitem__, block_id, old)

    def share(self, block_ids: Sequence[int]) -> None:
        """One more table holds each of ``block_ids``, all held already (a fork); one
        journal entry."""
        ref = self._ref
        for b in block_ids:
            assert ref[b] >= 1, f"block {b} is free; only a held block is shared"
            ref[b] += 1
        self._journal.record(_add_each, ref, tuple(block_ids), -1)

    def unshare(self, block_id: int) -> None:
        """One table fewer holds ``block_id``, still held by another (the source of a
        copy-on-write)."""
        old = self._ref[block_id]
        assert old > 1, f"block {block_id} is held {old} times; unshare needs a sharer"
        self._ref[block_id] = old - 1
        self._journal.record(self._ref.__setitem__, block_id, old)

    def release(self, block_ids: Sequence[int]) -> None:
        """One table fewer holds each of ``block_ids`` (distinct), in order; those no
        table holds any more join the free queue's tail in that order. Either all of it
        happens or, on a count that would go negative, nothing (an AssertionError)."""
        self._free.release_n(block_ids, self._ref)


def _add_each(ref: list[int], block_ids: Sequence[int], delta: int) -> None:
    # Undo of share: every later change to these counts is undone already.
    for b in block_ids:
        ref[b] += delta
