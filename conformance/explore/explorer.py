"""Breadth-first exploration of every state of an engine up to a scope.

Each state is reached first by a shortest event path (BFS) and deduplicated on its
canonical key (:mod:`refserve.conformance.explore.key`). A state's session is obtained in one of
two ways:

* ``replay`` (stateless model checking, any adapter): a fresh adapter replays the
  state's path; adapters need not clone themselves. Replaying checks determinism too:
  the same path must reach the same key.
* ``copy``: the parent's session (adapter, engine and books) is deep-copied, for
  engines that copy cleanly (refserve's own adapters); same graph, less time.

Every transition runs the runner's checks; a transition with a finding is recorded as a
counterexample (the first, shortest one of each signature) and not expanded. Once the
graph is complete, liveness is checked on it (:mod:`refserve.conformance.explore.liveness`).
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from refserve.conformance.adapter import AdapterFactory, EngineProperties, Feature
from refserve.conformance.explore.counterexample import (
    Counterexample,
    record,
    step_table,
    to_workload,
)
from refserve.conformance.explore.key import Key
from refserve.conformance.explore.liveness import Liveness, check_liveness
from refserve.conformance.explore.result import STRATEGIES, Exploration
from refserve.conformance.explore.scope import Scope
from refserve.conformance.explore.session import Event, Fault, Session, Step, step_variants
from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT, AdapterCallError, describe
from refserve.conformance.instance import _Stop, adapter_traits
from refserve.conformance.run_result import Finding
from refserve.conformance.runner import build
from refserve.conformance.shrink import signature
from refserve.conformance.workload import Workload
from refserve.spec.violation import Invariant, violation


@dataclass
class _Node:
    parent: int
    event: Event | None
    depth: int
    key: Key
    live: bool


@dataclass
class ExploreResult(Exploration):
    """What one exploration covered and found (the JSON keys of :meth:`to_json`)."""

    scope: Scope | None = None
    faults: int = 0
    """Executor faults tried (one per state with live requests, when supported)."""
    counterexamples: list[Counterexample] = field(default_factory=list)
    liveness: Liveness | None = None

    @property
    def num_counterexamples(self) -> int:
        return len(self.counterexamples)

    def to_json(self) -> dict[str, Any]:
        assert self.scope is not None
        lv = self.liveness
        return {
            **self.figures_json(),
            "scope": self.scope.name,
            "scope_description": self.scope.describe(),
            "faults": self.faults,
            "liveness": None
            if lv is None
            else {
                "checked": lv.checked,
                "livelock": bool(lv.cycle),
                "longest_drain": lv.longest_drain,
            },
            "counterexamples": [c.to_json() for c in self.counterexamples],
        }

    def summary(self) -> str:
        assert self.scope is not None
        lv = self.liveness
        live = (
            "liveness not checked"
            if lv is None
            else "livelock found"
            if lv.cycle
            else f"every request finishes within {lv.longest_drain} steps"
            + ("" if lv.checked else " (explored part only)")
        )
        moves = f"{self.transitions} transitions ({self.faults} faults)"
        return (
            f"{self.engine}, scope {self.scope.name} ({self.scope.describe()}): "
            f"{self.figures(moves)}; {live}"
        )


class _Explorer:
    def __init__(
        self,
        factory: AdapterFactory,
        scope: Scope,
        strategy: str,
        timeout: float,
        first_only: bool,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.factory = factory
        self.scope = scope
        self.strategy = strategy
        self.timeout = timeout
        self.first_only = first_only
        self.nodes: list[_Node] = []
        self.index: dict[Key, int] = {}
        self.sessions: dict[int, Session] = {}
        self.queue: deque[int] = deque()
        self.steps: dict[int, set[int]] = {}
        self.unknown: set[int] = set()
        """Nodes whose step outcomes were not all explored (a failing or cut step)."""
        self.found: dict[str, tuple[Finding, tuple[Event, ...]]] = {}
        self.features: frozenset[Feature] = frozenset()
        self.props = EngineProperties()
        self.res = ExploreResult(strategy=strategy, scope=scope)

    # ------------------------------------------------------------------ sessions
    def fresh(self) -> Session:
        adapter = build(self.factory, self.timeout)
        s = Session(adapter, self.scope, self.props, self.timeout)
        found = s.start(self.features)
        if found:
            raise _Failed(found[0])
        return s

    def path(self, nid: int) -> tuple[Event, ...]:
        out: list[Event] = []
        while nid > 0:
            n = self.nodes[nid]
            assert n.event is not None
            out.append(n.event)
            nid = n.parent
        return tuple(reversed(out))

    def at(self, nid: int) -> Session:
        """A new session in state ``nid``: with ``copy`` a copy of the stored one, with
        ``replay`` the state's path replayed on a fresh adapter (checking determinism)."""
        if self.strategy == "copy":
            try:
                return copy.deepcopy(self.sessions[nid])
            except Exception as e:  # a lock, a generator, a native handle in the engine
                raise _NotCopyable(describe(e)) from None
        s = self.fresh()
        for ev in self.path(nid):
            found = s.apply(ev)
            if found or s.dead:
                raise _Failed(found[0] if found else _finding("replaying an explored path failed"))
        try:
            same = s.key() == self.nodes[nid].key
        except _Stop:
            raise _Failed(s.findings[-1]) from None
        if not same:
            raise _Failed(
                _finding(
                    "nondeterministic: replaying the same events on a fresh engine reached "
                    "a different state (the explorer needs a deterministic engine)"
                )
            )
        return s

    # ------------------------------------------------------------------ search
    def run(self) -> ExploreResult:
        start = time.perf_counter()
        try:
            self.begin()
        except AdapterCallError as e:
            self.found.setdefault("setup", (_finding(str(e), "setup"), ()))
        except _NotCopyable as e:
            self.res.not_supported = (
                f"the adapter cannot be deep-copied ({e}): explore it with strategy replay"
            )
        if not self.res.not_supported:
            self.finish()
        self.res.seconds = time.perf_counter() - start
        return self.res

    def begin(self) -> None:
        res = self.res
        adapter = build(self.factory, self.timeout)
        self.features, self.props = adapter_traits(adapter, self.timeout)
        res.engine = str(getattr(adapter, "name", "?"))
        missing = self.scope.needs() - self.features
        if missing:
            res.not_supported = "engine lacks " + ", ".join(sorted(missing))
            return
        root = Session(adapter, self.scope, self.props, self.timeout)
        found = root.start(self.features)
        if root.run.res.not_supported:
            res.not_supported = root.run.res.not_supported
        elif found:
            self.found[signature(found[0])] = (found[0], ())
        else:
            self.search(root)

    def add_node(self, parent: int, ev: Event | None, depth: int, s: Session) -> int | None:
        """The node of ``s``'s state (a new one is queued); None if the key is unreadable."""
        try:
            k = s.key()
        except _Stop:
            self.record_finding(s.findings[-1:], parent, ev)
            return None
        nid = self.index.get(k)
        if nid is not None:
            return nid
        nid = len(self.nodes)
        self.index[k] = nid
        self.nodes.append(_Node(parent, ev, depth, k, bool(s.live())))
        self.res.depth = max(self.res.depth, depth)
        if self.strategy == "copy":
            self.sessions[nid] = s
        self.queue.append(nid)
        return nid

    def search(self, root: Session) -> None:
        scope, res = self.scope, self.res
        first = self.add_node(-1, None, 0, root)
        assert first == 0
        queue = self.queue
        res.exhausted = True
        while queue:
            if self.first_only and self.found:
                res.exhausted = False
                return
            nid = queue.popleft()
            node = self.nodes[nid]
            if scope.max_depth and node.depth >= scope.max_depth:
                res.exhausted = False
                self.unknown.add(nid)
                self.sessions.pop(nid, None)
                continue
            if len(self.nodes) >= scope.max_states:
                res.exhausted = False
                self.unknown.update(queue)
                self.unknown.add(nid)
                return
            try:
                self.expand(nid)
            except _Failed as e:
                self.record_finding([e.finding], nid, None)
                self.unknown.add(nid)
            self.sessions.pop(nid, None)

    def expand(self, nid: int) -> None:
        parent = self.sessions[nid] if self.strategy == "copy" else self.at(nid)
        pending: list[Event] = parent.enabled()
        depth = self.nodes[nid].depth + 1
        for ev in pending:
            child = self.at(nid)
            found = child.apply(ev)
            self.res.transitions += 1
            self.cover(parent, child)
            if isinstance(ev, Fault):
                self.res.faults += 1
            if found:
                self.record_finding(found, nid, ev)
                if isinstance(ev, Step):
                    self.unknown.add(nid)
                continue
            if child.dead:
                if isinstance(ev, Step):
                    self.unknown.add(nid)
                continue
            pending.extend(self.variants(ev, child))
            if isinstance(ev, Fault):
                continue  # ATOMIC held: the state is the one before (a self-loop)
            cid = self.add_node(nid, ev, depth, child)
            if cid is not None and isinstance(ev, Step):
                self.steps.setdefault(nid, set()).add(cid)

    def variants(self, ev: Event, child: Session) -> Iterator[Step]:
        """After the ordinary step, the other outcomes of that step (its samplers' eos,
        its drafts right or not, its copies' outcomes) as events of their own."""
        if not isinstance(ev, Step) or ev.eos or ev.right or ev.transfers:
            return iter(())
        samplers = child.last_sampled if self.props.eos else ()
        return step_variants(samplers, child.last_proposed, child.last_offered)

    def cover(self, parent: Session, child: Session) -> None:
        if child.dead:
            return
        a, b = parent.run.res.observed, child.run.res.observed
        cov = self.res.coverage
        for name, before, after in (
            ("preemption", a.preemptions, b.preemptions),
            ("prefix hit", a.cached_tokens, b.cached_tokens),
            ("chunked prompt", a.chunked_prompts, b.chunked_prompts),
            ("rejected", a.rejected, b.rejected),
            *(
                (f"finish {why}", a.finish_reasons.get(why, 0), n)
                for why, n in b.finish_reasons.items()
            ),
        ):
            if after > before:
                cov[name] = cov.get(name, 0) + 1
        for accepted, verified in child.last_accepted.values():
            what = "drafts all accepted" if accepted >= verified else "drafts rejected"
            cov[what] = cov.get(what, 0) + 1

    def record_finding(self, found: list[Finding], nid: int, ev: Event | None) -> None:
        if not found:
            return
        sig = signature(found[0])
        if sig not in self.found:
            path = self.path(nid) + ((ev,) if ev is not None else ())
            self.found[sig] = (found[0], path)

    # ------------------------------------------------------------------ results
    def finish(self) -> None:
        res = self.res
        res.states = len(self.nodes)
        for n in self.nodes:
            for status in {r[1] for r in n.key[3]}:  # type: ignore[index]  # request_key
                res.coverage[f"state {status}"] = res.coverage.get(f"state {status}", 0) + 1
        for f, path in self.found.values():
            res.counterexamples.append(self.counterexample(f, path, "safety"))
        if not self.nodes:
            return
        live = {i for i, n in enumerate(self.nodes) if n.live and i not in self.unknown}
        lv = check_liveness(self.steps, live, res.exhausted and not self.unknown)
        res.liveness = lv
        if lv.cycle:
            entry, loop = lv.cycle[0], lv.cycle
            path = self.path(entry)
            cycle = tuple(self._edge_event(a, b) for a, b in pairwise(loop))
            steps = len(cycle)
            f = Finding(
                violation(
                    Invariant.PROGRESS,
                    "engine",
                    f"livelock: stepping alone returns to the same state after {steps} "
                    "step(s) without finishing any request",
                    "every request finishes",
                    f"a cycle of {steps} step(s)",
                ),
                -1,
                "liveness",
            )
            res.counterexamples.append(self.counterexample(f, path, "liveness", cycle))

    def _edge_event(self, a: int, b: int) -> Event:
        n = self.nodes[b]
        if n.parent == a and n.event is not None:
            return n.event
        return Step()  # a cycle's steps sample nothing, so they are ordinary steps

    def counterexample(
        self, f: Finding, path: tuple[Event, ...], kind: str, cycle: tuple[Event, ...] = ()
    ) -> Counterexample:
        note = f"explorer {kind} counterexample: {f}"
        try:
            s = record(self.factory, self.scope, path + cycle, self.timeout)
            w = to_workload(s, note)
            table = step_table(s, path + cycle)
        except AdapterCallError as e:
            w = Workload(self.scope.config(), (), note=note)
            table = f"(the path could not be replayed: {e})"
        return Counterexample(f, path, w, kind, cycle, table)


class _NotCopyable(Exception):
    """``copy.deepcopy`` failed on a session (strategy ``copy`` on an adapter that
    cannot be copied)."""


class _Failed(Exception):
    def __init__(self, finding: Finding) -> None:
        super().__init__(str(finding))
        self.finding = finding


def _finding(message: str, phase: str = "explore") -> Finding:
    return Finding(violation(Invariant.PROGRESS, "engine", message), -1, phase)


def explore(
    factory: AdapterFactory,
    scope: Scope,
    *,
    strategy: str = "replay",
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    first_only: bool = False,
) -> ExploreResult:
    """Explore every state of ``scope`` on engines made by ``factory``; never raises for
    engine bugs (each is a counterexample)."""
    return _Explorer(factory, scope, strategy, call_timeout, first_only).run()
