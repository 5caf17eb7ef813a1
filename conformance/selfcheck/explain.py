"""How the self-check says what it found, line by line (docs/ADAPTERS.md, "The
self-check")."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from refserve.conformance.guard import AdapterCallError, call, describe
from refserve.conformance.selfcheck.protocol import WalkStopped, hint

T = TypeVar("T")


class Report:
    """The self-check's words: ``ok``, ``note`` and ``FAIL`` lines, indented under the
    step they belong to, and the guarded adapter calls that explain a raise or a hang
    instead of ending the check."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.lines: list[str] = []
        self.problems: list[str] = []
        self.indent = ""
        self.step_failed = False
        self.malformed_seen: set[str] = set()
        self.where = ""  # the step a problem belongs to, for the verdict ("step 2: ")

    # ------------------------------------------------------------------ output
    def ok(self, msg: str) -> None:
        self.lines.append(f"{self.indent}ok: {msg}")

    def note(self, msg: str) -> None:
        self.lines.append(f"{self.indent}note: {msg}")

    def fail(self, msg: str) -> None:
        self.lines.append(f"{self.indent}FAIL: {msg}")
        self.problems.append(f"{self.where}{msg}")
        self.step_failed = True

    def failed_since(self, mark: int) -> bool:
        return len(self.problems) > mark

    # ------------------------------------------------------------------ guarded calls
    def call(self, what: str, fn: Callable[[], T]) -> T:
        """One adapter call through the guard; a raise or a hang is explained, then the
        check stops (the adapter's state is unknown after it)."""
        try:
            return call(what, fn, self.timeout)
        except AdapterCallError as e:
            self.fail(f"{e}{hint(e, what)}")
            raise WalkStopped from None

    def shape(self, what: str, problems: list[str]) -> None:
        """Structural problems of a returned record, each explained once (the same
        malformed field in every snapshot is one problem, not one per step)."""
        for p in problems:
            if p in self.malformed_seen:
                continue
            self.malformed_seen.add(p)
            self.lines.append(f"{self.indent}FAIL: {what} returned a malformed record: {p}")
            self.problems.append(f"{self.where}{what}: {p}")

    def plan_shape(self, what: str, problems: list[str]) -> None:
        """A malformed step or commit report ends the check, as it ends a scenario of the
        suite: the tokens to sample and the step's effects cannot be read from it. (A
        malformed snapshot does not: later snapshots still say useful things.)"""
        self.shape(what, problems)
        if problems:
            self.note(f"stopped: the suite ends a scenario at a malformed {what} record too")
            raise WalkStopped

    def safely(self, what: str, fn: Callable[[], None]) -> None:
        """Run one group of semantic checks; a record too malformed to read is already
        explained by :meth:`shape`, so a failure here only notes what was skipped."""
        try:
            fn()
        except WalkStopped:
            raise
        except Exception as e:
            self.note(f"could not check {what}: {describe(e)} (see the malformed fields above)")
            self.step_failed = True
