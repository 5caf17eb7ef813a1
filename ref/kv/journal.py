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
from types import FunctionType, MethodType
from typing import Any

Undo = Callable[..., object]


class Journal:
    """Undo entries are records, ``(fn, args)``: a module-level function, a bound method
    or a builtin, and its arguments (rollback calls ``fn(*args)``), never a closure or a
    lambda. A closure built per change costs an allocation a record does not, and hides
    what it captured; :meth:`record` refuses one (an assertion; docs/ARCHITECTURE.md,
    "The persistent batch"). The check is written inline, not as a helper called from
    the assertion: a call per entry costs a function or method record about 100 ns more
    (measured: 376 against 476 ns a record), and the step records hundreds."""

    def __init__(self) -> None:
        self._undo: list[tuple[Undo, tuple[Any, ...]]] | None = None
        # A plain attribute, not a property: hot paths read it once per call, and a
        # property read costs as much as the pool work of a block.
        self.active = False

    def record(self, undo: Undo, *args: Any) -> None:
        if self._undo is not None:
            # Nested functions and lambdas are named "<locals>" / "<lambda>" in their
            # qualified name; a closure is always nested. Builtins pass the type test.
            fn = undo.__func__ if type(undo) is MethodType else undo
            # A decorated function is judged by what it wraps (functools.wraps): mutation
            # testing replaces each method by such a wrapper (docs/MUTATION.md).
            fn = getattr(fn, "__wrapped__", fn)
            assert type(fn) is not FunctionType or (
                fn.__closure__ is None and "<" not in fn.__qualname__
            ), f"undo entry {fn!r} is a closure or a lambda, not a record"
            self._undo.append((undo, args))

    def begin(self) -> None:
        """Open a transaction that spans calls (the scheduler's step: plan ... commit)."""
        assert self._undo is None, "a transaction is already open"
        self._undo = []
        self.active = True

    def commit(self) -> None:
        assert self._undo is not None, "commit without an open transaction"
        self._undo = None
        self.active = False

    def rollback(self) -> None:
        """Undo every mutation recorded since :meth:`begin`, newest first."""
        assert self._undo is not None, "rollback without an open transaction"
        undo, self._undo = self._undo, None
        self.active = False
        for fn, args in reversed(undo):
            fn(*args)

    @property
    def num_entries(self) -> int:
        """Entries recorded in the open transaction (0 when none is open)."""
        return 0 if self._undo is None else len(self._undo)

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
