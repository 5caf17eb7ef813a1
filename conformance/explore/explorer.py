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
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from refserve.conformance.adapter import AdapterFactory, EngineProperties, Feature
from refserve.conformance.explore.bfs import BreadthFirst, FirstFound, Unreachable
from refserve.conformance.explore.counterexample import (
    Counterexample,
    record,
    step_table,
    to_workload,
)
from refserve.conformance.explore.liveness import Liveness, check_liveness
from refserve.conformance.explore.result import Exploration
from refserve.conformance.explore.scope import Scope
from refserve.conformance.explore.session import Event, Fault, Session, Step, step_variants
from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT, AdapterCallError, describe
from refserve.conformance.instance import adapter_traits
from refserve.conformance.probe import RunStopped
from refserve.conformance.run_result import Finding
from refserve.conformance.runner import build
from refserve.conformance.shrink import signature
from refserve.conformance.workload import Workload
from refserve.spec.violation import Invariant, violation


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
        self.graph: BreadthFirst[Event, bool, Session] = BreadthFirst(
            strategy, scope.max_states, scope.max_depth
        )
        """The states reached; each one's info: whether it has live requests."""
        self.factory = factory
        self.scope = scope
        self.strategy = strategy
        self.timeout = timeout
        self.first_only = first_only
        self.steps: dict[int, set[int]] = {}
        self.unknown: set[int] = set()
        """Nodes whose step outcomes were not all explored (a failing step; the graph's
        cut adds those a limit left)."""
        self.found: FirstFound[Finding, tuple[Event, ...]] = FirstFound()
        self.features: frozenset[Feature] = frozenset()
        self.props = EngineProperties()
        self.res = ExploreResult(strategy=strategy, scope=scope)

    # ------------------------------------------------------------------ sessions
    def fresh(self) -> Session:
        adapter = build(self.factory, self.timeout)
        s = Session(adapter, self.scope, self.props, self.timeout)
        found = s.start(self.features)
        if found:
            raise Unreachable(found[0], "")
        return s

    def at(self, nid: int) -> Session:
        """A new session in state ``nid``: with ``copy`` a copy of the stored one, with
        ``replay`` the state's path replayed on a fresh adapter (checking determinism)."""
        if self.strategy == "copy":
            try:
                return copy.deepcopy(self.graph.sessions[nid])
            except Exception as e:  # a lock, a generator, a native handle in the engine
                raise _NotCopyable(describe(e)) from None
        s = self.fresh()
        try:
            self.graph.replay(nid, s, "events", "engine")
        except RunStopped:  # the key's snapshot could not be read
            raise Unreachable(s.findings[-1], "") from None
        return s

    # ------------------------------------------------------------------ search
    def run(self) -> ExploreResult:
        start = time.perf_counter()
        try:
            self.begin()
        except AdapterCallError as e:
            self.found.record("setup", _finding(str(e), "setup"), tuple)
        except _NotCopyable as e:
            self.res.not_supported = (
                f"the adapter cannot be deep-copied ({e}): explore it with strategy replay"
            )
        self.res.depth = self.graph.deepest
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
            self.found.record(signature(found[0]), found[0], tuple)
        else:
            self.search(root)

    def add_node(self, parent: int, ev: Event | None, s: Session) -> int | None:
        """The node of ``s``'s state (a new one is queued); None if the key is unreadable."""
        try:
            k = s.key()
        except RunStopped:
            self.record_finding(s.findings[-1:], parent, ev)
            return None
        return self.graph.visit(parent, ev, k, bool(s.live()), s)

    def search(self, root: Session) -> None:
        first = self.add_node(-1, None, root)
        assert first == 0
        self.res.exhausted = self.graph.search(
            self.expand_or_record, lambda: self.first_only and bool(self.found)
        )

    def expand_or_record(self, nid: int) -> None:
        try:
            self.expand(nid)
        except Unreachable as e:
            found = e.finding if isinstance(e.finding, Finding) else _finding(e.message)
            self.record_finding([found], nid, None)
            self.unknown.add(nid)

    def expand(self, nid: int) -> None:
        parent = self.graph.sessions[nid] if self.strategy == "copy" else self.at(nid)
        pending: list[Event] = parent.enabled()
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
            cid = self.add_node(nid, ev, child)
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
        self.found.record(signature(found[0]), found[0], lambda: self.graph.path(nid, ev))

    # ------------------------------------------------------------------ results
    def finish(self) -> None:
        res = self.res
        res.states = len(self.graph)
        for n in self.graph:
            for status in {r[1] for r in n.key[3]}:  # type: ignore[index]  # request_key
                res.coverage[f"state {status}"] = res.coverage.get(f"state {status}", 0) + 1
        for f, path in self.found.values():
            res.counterexamples.append(self.counterexample(f, path, "safety"))
        if not len(self.graph):
            return
        unknown = self.unknown | self.graph.cut
        live = {i for i, n in enumerate(self.graph) if n.info and i not in unknown}
        lv = check_liveness(self.steps, live, res.exhausted and not unknown)
        res.liveness = lv
        if lv.cycle:
            entry, loop = lv.cycle[0], lv.cycle
            path = self.graph.path(entry)
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
        n = self.graph[b]
        if n.parent == a and n.edge is not None:
            return n.edge
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
