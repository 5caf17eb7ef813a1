"""An undo log that makes a group of pool mutations all-or-nothing (ATOMIC invariant).

The scheduler reserves blocks before the executor runs; if the executor raises, the step
must leave no trace. Rather than copying the pool each step (O(num_blocks)), every
mutation records how to undo itself while a transaction is open, and rollback replays
those in reverse. Reverse order matters: the free queue's "dancing links" removal can be
undone in O(1) only when later changes are undone first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

Undo = Callable[[], object]


class Journal:
    def __init__(self) -> None:
        self._undo: list[Undo] | None = None

    @property
    def active(self) -> bool:
        return self._undo is not None

    def record(self, undo: Undo) -> None:
        if self._undo is not None:
            self._undo.append(undo)

    def begin(self) -> None:
        """Open a transaction that spans calls (the scheduler's step: plan ... commit)."""
        assert self._undo is None, "a transaction is already open"
        self._undo = []

    def commit(self) -> None:
        assert self._undo is not None, "commit without an open transaction"
        self._undo = None

    def rollback(self) -> None:
        """Undo every mutation recorded since :meth:`begin`, newest first."""
        assert self._undo is not None, "rollback without an open transaction"
        undo, self._undo = self._undo, None
        for fn in reversed(undo):
            fn()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Undo every recorded mutation if the body raises; nested use joins the outer one."""
        if self._undo is not None:
            yield
            return
        self.begin()
        try:
            yield
        except BaseException:
            self.rollback()
            raise
        self.commit()
