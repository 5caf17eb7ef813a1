"""The breadth-first core both explorers share: the engine's
(:mod:`refserve.conformance.explore.explorer`) and the block manager's
(:mod:`refserve.conformance.explore.kv`).

It holds the frontier (states in the order they were reached), the visited states (each
known once, by its canonical key), the scope's limits (a depth, a number of states) and
the way back to every state (its parent and the edge taken: an engine event or a KV op),
so the path it returns is a shortest one. What a state is, how it is reached again (a
replay or a copy), which edges it enables and what a finding is stay with each explorer:
the core never calls an engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from refserve.conformance.explore.key import Key
from refserve.conformance.explore.result import STRATEGIES

Edge = TypeVar("Edge")
EdgeIn = TypeVar("EdgeIn", contravariant=True)
"""An edge: what leads from a state to the next (an engine event, a KV op)."""
Info = TypeVar("Info")
"""What an explorer keeps per state besides its key."""
Sess = TypeVar("Sess")
"""A session in one state, kept for the strategy ``copy``."""
Fnd = TypeVar("Fnd")
"""A finding."""
Shows = TypeVar("Shows")
"""What shows a finding again: a path, a workload."""


class Replaying(Protocol[EdgeIn]):
    """A session a path can be replayed on."""

    @property
    def dead(self) -> bool: ...

    def apply(self, edge: EdgeIn, /) -> Sequence[object]: ...

    def key(self) -> Key: ...


class Unreachable(Exception):
    """Replaying an explored state's path did not reach it again: ``finding`` is the
    first the replay raised (None when it raised none), else ``message`` says why."""

    def __init__(self, finding: object | None, message: str) -> None:
        super().__init__(message)
        self.finding = finding
        self.message = message


@dataclass(frozen=True)
class Node(Generic[Edge, Info]):
    """One state: how it was first reached (breadth first, by a shortest path)."""

    parent: int
    """-1 for a root."""
    edge: Edge | None
    """The edge from the parent (None for a root)."""
    depth: int
    key: Key
    info: Info


class BreadthFirst(Generic[Edge, Info, Sess]):
    """The states of one exploration, reached breadth first."""

    def __init__(self, strategy: str, max_states: int, max_depth: int) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.keep_sessions = strategy == "copy"
        self.max_states = max_states
        self.max_depth = max_depth
        """0: no depth limit."""
        self.nodes: list[Node[Edge, Info]] = []
        self.index: dict[Key, int] = {}
        self.sessions: dict[int, Sess] = {}
        """With ``copy``: the session of each queued state (dropped once it is expanded)."""
        self.frontier: deque[int] = deque()
        self.deepest = 0
        self.cut: set[int] = set()
        """States a limit left unexpanded: at the depth limit, or still queued when the
        state limit was reached."""
        self.capped = False
        """The state limit was reached."""

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, nid: int) -> Node[Edge, Info]:
        return self.nodes[nid]

    def __iter__(self) -> Iterator[Node[Edge, Info]]:
        return iter(self.nodes)

    def visit(self, parent: int, edge: Edge | None, key: Key, info: Info, session: Sess) -> int:
        """The state ``key``: a known one's id, or a new state queued (with ``session``
        under ``copy``) one deeper than ``parent``."""
        nid = self.index.get(key)
        if nid is not None:
            return nid
        nid = len(self.nodes)
        depth = self.nodes[parent].depth + 1 if parent >= 0 else 0
        self.index[key] = nid
        self.nodes.append(Node(parent, edge, depth, key, info))
        self.deepest = max(self.deepest, depth)
        if self.keep_sessions:
            self.sessions[nid] = session
        self.frontier.append(nid)
        return nid

    def path(self, nid: int, last: Edge | None = None) -> tuple[Edge, ...]:
        """The edges from ``nid``'s root to ``nid`` (then ``last``, when given)."""
        out: list[Edge] = [] if last is None else [last]
        while (n := self.nodes[nid]).parent >= 0:
            assert n.edge is not None
            out.append(n.edge)
            nid = n.parent
        return tuple(reversed(out))

    def replay(self, nid: int, session: Replaying[Edge], edges: str, engine: str) -> None:
        """Replay ``nid``'s path on ``session`` (fresh from its root) and check it reaches
        ``nid``'s key again (a deterministic engine does); :class:`Unreachable` if not.
        ``edges`` and ``engine`` name them in the message (``events``, ``engine``)."""
        for edge in self.path(nid):
            found = session.apply(edge)
            if found or session.dead:
                raise Unreachable(found[0] if found else None, "replaying an explored path failed")
        if session.key() != self.nodes[nid].key:
            raise Unreachable(
                None,
                f"nondeterministic: replaying the same {edges} on a fresh {engine} reached "
                f"a different state (the explorer needs a deterministic {engine})",
            )

    def search(self, expand: Callable[[int], None], stop: Callable[[], bool]) -> bool:
        """Expand the queued states in the order they were reached until none is left,
        ``stop()`` says so or a limit is reached; whether every state was expanded."""
        while self.frontier:
            if stop():
                return False
            nid = self.frontier.popleft()
            if self.max_depth and self.nodes[nid].depth >= self.max_depth:
                self.cut.add(nid)
                self.sessions.pop(nid, None)
                continue
            if len(self.nodes) >= self.max_states:
                self.capped = True
                self.cut.add(nid)
                self.cut.update(self.frontier)
                return False
            expand(nid)
            self.sessions.pop(nid, None)
        return not self.cut


class FirstFound(Generic[Fnd, Shows]):
    """The first finding of each signature with what shows it: found breadth first,
    what shows it is a shortest path."""

    def __init__(self) -> None:
        self.by_signature: dict[str, tuple[Fnd, Shows]] = {}

    def __bool__(self) -> bool:
        return bool(self.by_signature)

    def record(self, signature: str, finding: Fnd, shows: Callable[[], Shows]) -> None:
        """Keep ``finding`` if its signature is new (``shows`` is called only then)."""
        if signature not in self.by_signature:
            self.by_signature[signature] = (finding, shows())

    def values(self) -> Iterator[tuple[Fnd, Shows]]:
        return iter(self.by_signature.values())


__all__ = ["BreadthFirst", "FirstFound", "Node", "Replaying", "Unreachable"]
