"""The free-block queue: LRU order, O(1) pop, append and removal from the middle.

A doubly linked list over block ids in two int arrays, with sentinels. Blocks freed
later go to the tail; allocation pops the head, so a cached block that was freed long ago
is evicted first. A cache hit on a free block removes it from the middle in O(1). Removal
leaves the removed node's own links intact (Knuth's "dancing links"), so an undo that
runs in reverse order can relink it exactly where it was.
"""

from __future__ import annotations

from collections.abc import Iterator

from ref.kv.journal import Journal


class FreeQueue:
    def __init__(self, num_blocks: int, journal: Journal) -> None:
        self._head = num_blocks
        self._tail = num_blocks + 1
        self._prev = [0] * (num_blocks + 2)
        self._next = [0] * (num_blocks + 2)
        self._in = [False] * num_blocks
        self._len = 0
        self._journal = journal
        self._next[self._head] = self._tail
        self._prev[self._tail] = self._head
        for b in range(num_blocks):
            self._link_before_tail(b)

    def __len__(self) -> int:
        return self._len

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

    def remove(self, block_id: int) -> None:
        assert self._in[block_id], f"block {block_id} is not in the free queue"
        p, n = self._prev[block_id], self._next[block_id]
        self._next[p] = n
        self._prev[n] = p
        self._in[block_id] = False
        self._len -= 1
        self._journal.record(lambda: self._relink(block_id))

    def append(self, block_id: int) -> None:
        assert not self._in[block_id], f"block {block_id} is already in the free queue"
        # Linking overwrites the block's own links, which an earlier remove() of the same
        # block still needs for its undo; keep them so the undo can put them back.
        links = (self._prev[block_id], self._next[block_id])
        self._link_before_tail(block_id)
        self._journal.record(lambda: self._unlink_tail(block_id, links))

    def _link_before_tail(self, b: int) -> None:
        last = self._prev[self._tail]
        self._prev[b], self._next[b] = last, self._tail
        self._next[last] = b
        self._prev[self._tail] = b
        self._in[b] = True
        self._len += 1

    def _relink(self, b: int) -> None:
        # Undo of remove: b's own links still name its old neighbours.
        self._next[self._prev[b]] = b
        self._prev[self._next[b]] = b
        self._in[b] = True
        self._len += 1

    def _unlink_tail(self, b: int, links: tuple[int, int]) -> None:
        # Undo of append: restore b's own links too (see append).
        assert self._prev[self._tail] == b
        p = self._prev[b]
        self._next[p] = self._tail
        self._prev[self._tail] = p
        self._prev[b], self._next[b] = links
        self._in[b] = False
        self._len -= 1
