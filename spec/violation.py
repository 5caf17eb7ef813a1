"""The one record every checker returns: which invariant, about what, expected vs seen."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Invariant(StrEnum):
    """Invariant ids (docs/CONFORMANCE.md); the conformance report keys results by these.

    ORDER is the one policy check: it applies only to an engine that declares its
    admission order (spec/order.py). OWNER, CONSERVE, MOVED, KVCOPY and LEAK are the
    migration rules (:data:`CLUSTER_INVARIANTS`, spec/cluster.py, docs/MIGRATION.md): they
    are checked over several engines, never on one engine's steps.
    """

    TOKEN = "TOKEN"
    BLOCK = "BLOCK"
    KVLEN = "KVLEN"
    POS = "POS"
    CAP = "CAP"
    PREFIX = "PREFIX"
    PROGRESS = "PROGRESS"
    ATOMIC = "ATOMIC"
    ORDER = "ORDER"
    EVENTS = "EVENTS"  # replaying the cache events gives the pool's index (spec/events.py)
    OWNER = "OWNER"
    CONSERVE = "CONSERVE"
    MOVED = "MOVED"
    KVCOPY = "KVCOPY"
    LEAK = "LEAK"
    ROLES = "ROLES"  # prefill/decode roles (spec/pd.py): checked on a disaggregated cluster


#: The ids of the migration rules, checked on a cluster of engines (spec/cluster.py).
CLUSTER_INVARIANTS = frozenset(
    {Invariant.OWNER, Invariant.CONSERVE, Invariant.MOVED, Invariant.KVCOPY, Invariant.LEAK}
)
#: The rules of prefill/decode roles (spec/pd.py), checked on a disaggregated cluster only.
ROLE_INVARIANTS = frozenset({Invariant.ROLES})
#: The ids checked on one engine (docs/CONFORMANCE.md, "Rules").
ENGINE_INVARIANTS = tuple(
    i for i in Invariant if i not in CLUSTER_INVARIANTS and i not in ROLE_INVARIANTS
)


@dataclass(frozen=True)
class Violation:
    """One broken invariant.

    ``subject`` names the request or block involved (``"request r3"``, ``"block 7"``,
    ``"step"``); ``expected`` and ``seen`` are short renderings of the two values that
    disagree, so a report can be read without the code open.
    """

    invariant: Invariant
    subject: str
    message: str
    expected: str = ""
    seen: str = ""
    rule: str = ""
    """The named rule within the invariant that was broken, for the rules that have one
    (``key-domains``, ``stated-free``, ...; docs/CONFORMANCE.md, "Rules"); ``""`` for
    the invariant's original checks."""

    def __str__(self) -> str:
        detail = (
            f" (expected {self.expected}, seen {self.seen})" if self.expected or self.seen else ""
        )
        return f"[{self.invariant}] {self.subject}: {self.message}{detail}"


def violation(
    invariant: Invariant,
    subject: str,
    message: str,
    expected: object = "",
    seen: object = "",
    *,
    rule: str = "",
) -> Violation:
    """Build a :class:`Violation`, rendering expected/seen values with ``repr`` of ints."""
    return Violation(invariant, subject, message, str(expected), str(seen), rule)
