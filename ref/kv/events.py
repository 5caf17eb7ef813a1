"""Cache events: what the prefix cache gains and loses, published in order
(docs/ARCHITECTURE.md, "Cache events"; the records and the replay rule are
spec/events.py).

A router that routes by prefix hits must know each replica's cache before it routes;
it cannot ask every replica per request, so it subscribes to their changes. The pool's
prefix index (ref/kv/prefix_index.py) reports every change it makes through its two
mutations, ``_put`` (a block stored under its key) and ``_drop`` (an entry removed), and a
clear; this log turns them into numbered records.

Inside a transaction (a step) the records wait, and a rollback takes them back with the
rest of the step (each batch of pending records has its undo entry in the pool's
journal): a rolled-back step publishes nothing. When the transaction closes they are
published with consecutive sequence numbers from 0, so a subscriber can tell a gap.

The namespace is in the keys: a chain starts from its namespace's root key
(``refserve.spec.hashing.Namespace.root_key``), so a stored block whose ``parent_key`` is a root
begins a prefix of that namespace, and a subscriber that hashes a prompt from the same
root finds exactly the keys the replica holds.
"""

from __future__ import annotations

from collections.abc import Iterable

from refserve.kv.journal import Journal
from refserve.spec.events import BlockRemoved, BlockStored, CacheChange, CacheCleared, CacheEvent

#: An index entry as the prefix index keeps it: key, block id, parent key, token ids.
EntryFields = tuple[bytes, int, bytes, tuple[int, ...]]


class CacheEventLog:
    """Pending and published cache events (module doc)."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        self._pending: list[CacheChange] = []
        self._published: list[CacheEvent] = []
        self.next_seq = 0

    def stored(self, entries: Iterable[EntryFields]) -> None:
        self._add([BlockStored(e[0], e[2], e[3], e[1]) for e in entries])

    def removed(self, entries: Iterable[EntryFields]) -> None:
        self._add([BlockRemoved(e[0], e[1]) for e in entries])

    def cleared(self) -> None:
        self._add([CacheCleared()])

    def publish(self) -> None:
        """The transaction closed: every pending change is published, numbered."""
        first = self.next_seq
        self._published.extend(
            CacheEvent(first + i, change) for i, change in enumerate(self._pending)
        )
        self.next_seq = first + len(self._pending)
        self._pending = []

    def drain(self) -> list[CacheEvent]:
        """The events published since the last drain, in order."""
        out, self._published = self._published, []
        return out

    def _add(self, changes: list[CacheChange]) -> None:
        if not changes:
            return
        if self._journal.active:
            self._journal.record(self._take_back, len(self._pending))
            self._pending.extend(changes)
        else:
            self._pending.extend(changes)
            self.publish()

    def _take_back(self, mark: int) -> None:
        # Undo of _add inside a transaction: the step's changes go with the step.
        del self._pending[mark:]
