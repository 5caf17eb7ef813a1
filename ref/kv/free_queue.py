"""The free-block queue: LRU order, O(1) pop, append and removal from the middle.

A doubly linked list over block ids in two int arrays, with sentinels. Blocks freed
later go to the tail; allocation pops the head, so a cached block that was freed long ago
is evicted first. A cache hit on a free block removes it from the middle in O(1). Removal
leaves the removed node's own links intact (Knuth's "dancing links"), so an undo that
runs in reverse order can relink it exactly where it was. The run operations
(``acquire_n`` / ``release_n``, which also set the pool's reference counts) move many
blocks in one loop with one journal entry: per block, a Python call and an undo record
cost more than the linking itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from refserve.kv.journal import Journal


class FreeQueue:
    def __init__(self, num_blocks: int, journal: Journal) -> None:
        self._head = num_blocks
        self._tail = num_blocks + 1
        self._prev = [0] * (num_blocks + 2)
        self._next = [0] * (num_blocks + 2)
        self._in = [False] * num_blocks
        self.num_free = 0  # read-only outside this class; len() of it, without the call
        self._journal = journal
        self._next[self._head] = self._tail
        self._prev[self._tail] = self._head
        for b in range(num_blocks):
            self._link_before_tail(b)

    def __len__(self) -> int:
        return self.num_free

    def __contains__(self, block_id: int) -> bool:
        return self._in[block_id]

    def __iter__(self) -> Iterator[int]:
        b = self._next[self._head]
        while b != self._tail:
            yield b
            b = self._next[b]

    def popleft(self) -> int:
        b = self._next[self._head]
        assert b != self._tail, "popleft on an empty free queue"
        self.remove(b)
        return b

    def acquire_n(self, k: int, counts: list[int]) -> list[int]:
        """The first ``k`` blocks, unlinked as one run, with ``counts[b]`` set to 1 for
        each (the pool's reference counts, 0 for every queued block) in the same loop;
        one journal entry undoes both. The run's inner links are left as they are (only
        the head and the block after the run are relinked), so the undo reattaches the
        whole run by its two ends."""
        assert 0 <= k <= self.num_free, f"acquire_n({k}) on a free queue of {self.num_free}"
        if k == 0:
            return []
        nxt, inn = self._next, self._in
        out = [0] * k
        b = nxt[self._head]
        for i in range(k):
            out[i] = b
            inn[b] = False
            counts[b] = 1
            b = nxt[b]
        nxt[self._head] = b
        self._prev[b] = self._head
        self.num_free -= k
        if self._journal.active:
            self._journal.record(self._unacquire_n, out[0], out[-1], k, counts)
        return out

    def _unacquire_n(self, first: int, last: int, k: int, counts: list[int]) -> None:
        # Undo of acquire_n: the counts back to 0, then the run relinked.
        nxt = self._next
        b = first
        for _ in range(k):
            counts[b] = 0
            b = nxt[b]
        self._relink_run(first, last, k)

    def remove(self, block_id: int) -> None:
        assert self._in[block_id], f"block {block_id} is not in the free queue"
        p, n = self._prev[block_id], self._next[block_id]
        self._next[p] = n
        self._prev[n] = p
        self._in[block_id] = False
        self.num_free -= 1
        self._journal.record(self._relink, block_id)

    def append(self, block_id: int) -> None:
        assert not self._in[block_id], f"block {block_id} is already in the free queue"
        # Linking overwrites the block's own links, which an earlier remove() of the same
        # block still needs for its undo; keep them so the undo can put them back.
        links = (self._prev[block_id], self._next[block_id])
        self._link_before_tail(block_id)
        self._journal.record(self._unlink_tail, block_id, links)

    def release_n(self, blocks: Sequence[int], counts: list[int]) -> None:
        """Drop one from ``counts[b]`` for each of ``blocks`` (distinct), in order, and link
        those that reach zero before the tail as one run: freeing a block table.

        One loop and one journal entry for both (``counts`` are the pool's reference
        counts; a separate pass for each cost half as much again). A count that would go
        negative, or a block reaching zero that is already queued, fails with the counts
        and the queue unchanged.
        """
        if not blocks:
            return
        prev, nxt, inn = self._prev, self._next, self._in
        saved = {b: (prev[b], nxt[b]) for b in blocks} if self._journal.active else None
        anchor = last = prev[self._tail]
        kept = 0  # still referenced (the rare case: counted there, not per linked block)
        for b in blocks:
            c = counts[b]
            if c != 1 or inn[b]:  # one test for the rare cases: a shared block, or a bad one
                if c > 1:
                    counts[b] = c - 1
                    kept += 1
                    continue
                self._abort_release(blocks, b, counts, anchor, last, saved)
                if c < 1:
                    raise AssertionError(f"ref count of block {b} would go negative")
                raise AssertionError(f"block {b} is already in the free queue")
            counts[b] = 0
            inn[b] = True
            prev[b] = last
            nxt[last] = b
            last = b
        nxt[last] = self._tail
        prev[self._tail] = last
        self.num_free += len(blocks) - kept
        if saved is not None:
            self._journal.record(self._unrelease_n, anchor, tuple(blocks), counts, saved)

    def _abort_release(
        self,
        blocks: Sequence[int],
        failed: int,
        counts: list[int],
        anchor: int,
        last: int,
        saved: dict[int, tuple[int, int]] | None,
    ) -> None:
        # release_n failed at ``failed`` (its count untouched): give back the counts taken
        # before it and cut off the run linked so far.
        for b in blocks[: list(blocks).index(failed)]:
            counts[b] += 1
        self._cut_partial_run(anchor, last, saved)  # num_free is not counted yet

    def _unrelease_n(
        self,
        anchor: int,
        blocks: tuple[int, ...],
        counts: list[int],
        saved: dict[int, tuple[int, int]],
    ) -> None:
        # Undo of release_n: the run it linked is everything after ``anchor``.
        self.num_free -= self._cut_partial_run(anchor, self._prev[self._tail], saved)
        self._prev[self._tail] = anchor
        for b in blocks:
            counts[b] += 1

    def _cut_partial_run(
        self, anchor: int, last: int, saved: dict[int, tuple[int, int]] | None
    ) -> int:
        """Unlink the blocks after ``anchor`` up to ``last`` (``anchor``'s next was the
        tail before they were linked), giving each its ``saved`` links; how many."""
        prev, nxt, inn = self._prev, self._next, self._in
        run: list[int] = []
        b = anchor
        while b != last:
            b = nxt[b]
            run.append(b)
        nxt[anchor] = self._tail
        for b in run:
            inn[b] = False
            if saved is not None:
                prev[b], nxt[b] = saved[b]
        return len(run)

    def _link_before_tail(self, b: int) -> None:
        last = self._prev[self._tail]
        self._prev[b], self._next[b] = last, self._tail
        self._next[last] = b
        self._prev[self._tail] = b
        self._in[b] = True
        self.num_free += 1

    def _relink(self, b: int) -> None:
        # Undo of remove: b's own links still name its old neighbours.
        self._next[self._prev[b]] = b
        self._prev[self._next[b]] = b
        self._in[b] = True
        self.num_free += 1

    def _relink_run(self, first: int, last: int, k: int) -> None:
        # The run's first and last blocks still name their old neighbours (the head and
        # the block after the run), and its inner links are as acquire_n left them, so
        # the run is found again by walking from ``first``.
        nxt, inn = self._next, self._in
        nxt[self._prev[first]] = first
        self._prev[nxt[last]] = last
        b = first
        for _ in range(k):
            inn[b] = True
            b = nxt[b]
        self.num_free += k

    def _unlink_tail(self, b: int, links: tuple[int, int]) -> None:
        # Undo of append: restore b's own links too (see append).
        assert self._prev[self._tail] == b
        p = self._prev[b]
        self._next[p] = self._tail
        self._prev[self._tail] = p
        self._prev[b], self._next[b] = links
        self._in[b] = False
        self.num_free -= 1
