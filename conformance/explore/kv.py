"""Exhaustive exploration of a block manager alone, through the KV adapter protocol.

The engine-level explorer (:mod:`refserve.conformance.explore.explorer`) reaches a block manager
only through its engine's scheduler, which may never fork, never write into a shared
partial block, never bring a freed prefix back. This module enumerates the KV protocol
(:mod:`refserve.conformance.kv.protocol`) itself, breadth first, from a freshly configured
manager: in every reachable state it applies every op the scope allows

* ``new``: a request from the scope's catalogue (prompts sharing prefixes, so cache hits
  happen) with every useful ``num_new_tokens`` (1 up to a block and one token, and all
  of the prompt);
* ``grow``: a live request learns no token (the rest of a chunked prompt) or one sampled
  token from the scope's alphabet, and asks for every useful ``num_new_tokens``;
* ``fork`` (feature ``fork``) into a fresh request, and ``free``;

each op checked by the KV level's own driver (:class:`refserve.conformance.kv.run.KVRun`:
BLOCK, CAP, POS, PREFIX, KVLEN after every op, the fake KV memory read back, ATOMIC and
CAP on a refusal, PROGRESS on a quiescent pool), so a finding here is a finding of
``refserve conformance --kv-adapter``. A state with no live request is the end of a
*drain*: its quiescence check is the machine's drain check, so every state's drain is
explored too, in every free order.

States are deduplicated on a canonical key (:func:`kv_key`); the first path that reaches
a state is a shortest one, so each counterexample is the shortest op list (BFS) that
shows its finding signature, written in the KV replay format (``{"kv_config": ...,
"ops": [...]}``) that :func:`refserve.conformance.kv.machine.replay_kv` and ``refserve
conformance --kv-adapter X --replay file.json`` read. docs/CONFORMANCE.md, "The block
manager alone: `--kv-adapter`" and "Exhaustive exploration".
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from refserve.conformance.explore.bfs import BreadthFirst, FirstFound, Unreachable
from refserve.conformance.explore.key import Key, pool_key, rename
from refserve.conformance.explore.result import Exploration
from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT
from refserve.conformance.kv.protocol import KVAdapterFactory, KVConfig, KVFeature
from refserve.conformance.kv.run import KVRun, find_signature, replay_workload
from refserve.conformance.kv.workload import KVFinding, KVWorkload
from refserve.spec.violation import Invariant, violation

Op = Mapping[str, Any]
"""One op in the KV workload format (refserve.conformance.kv.machine's module docstring)."""


@dataclass(frozen=True)
class KVScope:
    """The bound of one KV exploration.

    ``catalogue`` holds the prompts a ``new`` may start (each as often as the scope
    allows); ``max_requests`` caps the requests one path starts (news and forks alike),
    ``max_live`` those live at once; ``max_len`` caps the tokens a request may know (its
    prompt plus the sampled tokens its grows append, each one of ``alphabet``).
    ``max_n`` is the largest ``num_new_tokens`` tried besides "everything not stored
    yet" (0: a block and one token, so that one allocation may fill a block and open
    the next). No cap on a path's ops is needed: requests, their tokens and the pool are
    bounded, so the graph of distinct states is finite and deduplication exhausts it;
    ``max_depth`` (0: none) and ``max_states`` cut a run that is too big (reported as
    not exhausted, never as a pass of the whole scope).
    """

    name: str
    block_size: int
    num_blocks: int
    catalogue: tuple[tuple[int, ...], ...]
    max_requests: int
    max_len: int
    max_live: int = 2
    alphabet: tuple[int, ...] = (0, 1)
    max_n: int = 0
    min_blocks: int = 0
    """Explore every pool from ``min_blocks`` to ``num_blocks`` blocks (0: only
    ``num_blocks``): many bugs show soonest in the smallest pool that holds them."""
    enable_prefix_caching: bool = True
    max_depth: int = 0
    max_states: int = 200_000

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "num_blocks",
            "max_requests",
            "max_len",
            "max_live",
            "max_states",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.catalogue or any(not p for p in self.catalogue):
            raise ValueError("the catalogue must hold at least one non-empty prompt")
        if any(len(p) > self.max_len for p in self.catalogue):
            raise ValueError(f"every prompt must fit in max_len {self.max_len}")
        if self.max_n < 0 or self.max_depth < 0:
            raise ValueError("max_n and max_depth must be >= 0")
        if not 0 <= self.min_blocks <= self.num_blocks:
            raise ValueError(f"min_blocks must be in 0..{self.num_blocks}, got {self.min_blocks}")

    @property
    def chunk(self) -> int:
        return self.max_n or self.block_size + 1

    def configs(self) -> list[KVConfig]:
        """The pools explored, smallest first (BFS then prefers a small pool's path)."""
        low = self.min_blocks or self.num_blocks
        return [
            KVConfig(nb, self.block_size, self.enable_prefix_caching)
            for nb in range(low, self.num_blocks + 1)
        ]

    def sizes(self, rem: int) -> list[int]:
        """The ``num_new_tokens`` tried for ``rem`` tokens not stored yet: 1 up to
        :attr:`chunk`, and all of them (the machine's favourite: the uncacheable tail
        of a prompt is among these as long as it is at most a block)."""
        return sorted({*range(1, min(rem, self.chunk) + 1), rem}) if rem > 0 else []

    def describe(self) -> str:
        prompts = " ".join("".join(map(str, p)) for p in self.catalogue)
        low = self.min_blocks or self.num_blocks
        pools = f"{low}..{self.num_blocks}" if low < self.num_blocks else str(low)
        return (
            f"{pools} blocks of {self.block_size} tokens, prompts {prompts}, "
            f"{self.max_requests} requests ({self.max_live} live at once) of at most "
            f"{self.max_len} tokens (appends "
            f"from {list(self.alphabet)}), allocations of 1..{self.chunk} or all tokens, "
            f"prefix caching {'on' if self.enable_prefix_caching else 'off'}"
            + (f", depth <= {self.max_depth}" if self.max_depth else "")
        )


# Prompts share a leading block (cache hits, on live and on freed blocks); (2, 3) is one
# block exactly (a hit must spare its last token); (5, 6, 7) takes the blocks a freed
# prefix sits in (eviction, stale entries); pools of 1 and 2 blocks refuse early
# (NoSpace: ATOMIC, CAP). ``small`` reaches copy-on-write through a fork in the middle
# of a prompt or after (2, 3) plus one sampled token; ``medium`` lets every prompt decode
# (a fork of a full 3-token prompt writes into its shared partial block). One sampled
# token value: the prompts already make blocks differ, and a second value multiplies
# the states about fivefold (medium: 43,000 states, 150 s on one core).
KV_SCOPES: dict[str, KVScope] = {
    "tiny": KVScope(
        "tiny",
        block_size=2,
        num_blocks=3,
        min_blocks=1,
        catalogue=((2, 3), (2, 3, 4)),
        max_requests=2,
        max_len=3,
        alphabet=(0,),
    ),
    "small": KVScope(
        "small",
        block_size=2,
        num_blocks=3,
        min_blocks=1,
        catalogue=((2, 3), (2, 3, 4), (5, 6, 7)),
        max_requests=3,
        max_len=3,
        alphabet=(0,),
    ),
    "medium": KVScope(
        "medium",
        block_size=2,
        num_blocks=3,
        min_blocks=1,
        catalogue=((2, 3), (2, 3, 4), (5, 6, 7)),
        max_requests=3,
        max_len=4,
        alphabet=(0,),
    ),
}


# ---------------------------------------------------------------------------- a session
class _Session:
    """A KV run at the end of one op path: the machine's driver plus the next fresh id."""

    def __init__(self, run: KVRun, scope: KVScope) -> None:
        self.run = run
        self.scope = scope
        self.next_id = 0
        """Requests started along the path (the budget ``max_requests`` caps). A freed
        id is never reused: it may still mean something to a broken manager."""

    @property
    def findings(self) -> list[KVFinding]:
        return self.run.findings

    @property
    def dead(self) -> bool:
        return self.run.dead

    def clone(self) -> _Session:
        s = _Session(self.run.clone(), self.scope)
        s.next_id = self.next_id
        return s

    def fresh_id(self) -> str:
        return f"r{self.next_id}"

    def enabled(self) -> list[dict[str, Any]]:
        """Every op the scope allows now, in a fixed order (news, then per live request
        in arrival order: grows, fork, free)."""
        run, scope = self.run, self.scope
        if run.dead:
            return []
        live = list(run.stored)
        room = len(live) < scope.max_live and self.next_id < scope.max_requests
        out: list[dict[str, Any]] = []
        if room:
            for prompt in scope.catalogue:
                out += [
                    {"op": "new", "rid": self.fresh_id(), "prompt": list(prompt), "n": n}
                    for n in scope.sizes(len(prompt))
                ]
        for rid in live:
            known = len(run.known[rid])
            rem = known - run.stored[rid]
            out += [{"op": "grow", "rid": rid, "append": [], "n": n} for n in scope.sizes(rem)]
            if known < scope.max_len:
                out += [
                    {"op": "grow", "rid": rid, "append": [t], "n": n}
                    for t in scope.alphabet
                    for n in scope.sizes(rem + 1)
                ]
            if room and KVFeature.FORK in run.features:
                out.append({"op": "fork", "parent": rid, "child": self.fresh_id()})
            out.append({"op": "free", "rid": rid})
        return out

    def apply(self, op: Op) -> list[KVFinding]:
        """One op with every check of the KV level; its new findings."""
        run = self.run
        mark = len(run.findings)
        run.apply(op)
        if op["op"] in ("new", "fork") and self.fresh_id() in run.stored:
            # A refused new leaves its id unused: the next one may take it, so a refusal
            # is a self-loop of the graph, not a new state.
            self.next_id += 1
        if not run.dead and not run.stored:
            # Nothing live: the machine's drain has nothing to free and checks PROGRESS
            # (quiescence) exactly as replay_kv does after this op list.
            run.drain()
        # The trace is a report of the whole path, not state: copies stay small.
        run.trace.clear()
        return run.findings[mark:]

    def key(self) -> Key:
        return (self.run.config.num_blocks, self.next_id, kv_key(self.run))


def kv_key(run: KVRun) -> Key:
    """The canonical key of a KV state: two states with the same key have the same
    futures under the explored ops (docs/CONFORMANCE.md, "Exhaustive exploration").

    It is :func:`refserve.conformance.explore.key.pool_key` (live requests ranked by arrival,
    blocks renamed by first use, the free queue in hand-out order with the blocks no
    table or cache entry names left anonymous, the fake memory of every named block)
    plus the suite's books of each live request (known tokens, KV length, cache hit),
    plus, for a manager that does not show its cache index (no ``cache_index``), the
    fake memory of every free block in hand-out order: its hidden index can only hit
    blocks whose tokens the memory shows, so states that differ there stay apart. Two
    such states whose hidden indexes differ while every block's memory agrees are
    merged: the approximation this level makes (an adapter's ``explore_key()`` adds
    what its snapshot hides, request ids renamed as in the snapshot).
    """
    snap = run.snap
    assert snap is not None, "a key before the first snapshot"
    rank = {rid: i for i, rid in enumerate(run.stored)}  # insertion order: arrival
    books = tuple(
        (tuple(run.known[rid]), run.stored[rid], run.cached.get(rid, 0)) for rid in run.stored
    )
    bs = snap.block_size
    hidden = None
    if KVFeature.CACHE_INDEX not in run.features:
        hidden = tuple(
            tuple(run.kv.slots.get(b * bs + off) for off in range(bs)) for b in snap.free_queue
        )
    extra = getattr(run.adapter, "explore_key", None)
    return (
        books,
        pool_key(snap, rank, run.kv.slots, True),
        hidden,
        rename(extra(), rank) if callable(extra) else None,
    )


# ---------------------------------------------------------------------------- results
@dataclass(frozen=True)
class KVCounterexample:
    """The shortest op path (BFS) to one finding signature, as a replayable workload."""

    finding: KVFinding
    workload: KVWorkload

    @property
    def signature(self) -> str:
        return self.finding.signature

    def to_json(self) -> dict[str, Any]:
        return {
            "signature": self.signature,
            "finding": self.finding.to_json(),
            "ops": len(self.workload.ops),
            "workload": self.workload.to_json(),
        }


@dataclass
class KVExploreResult(Exploration):
    """What one KV exploration covered and found (the JSON keys of :meth:`to_json`).

    ``coverage`` counts the transitions that exercised each path of the manager (the
    machine's coverage names: cow_copies, cache_hits, revived_hits, evictions,
    no_space, forks...)."""

    scope: KVScope | None = None
    counterexamples: list[KVCounterexample] = field(default_factory=list)
    stopped: str = ""
    """Why the run ended before the scope was exhausted (other than a cap)."""

    @property
    def num_counterexamples(self) -> int:
        return len(self.counterexamples)

    def to_json(self) -> dict[str, Any]:
        assert self.scope is not None
        return {
            **self.figures_json(),
            "scope": self.scope.name,
            "scope_description": self.scope.describe(),
            "stopped": self.stopped,
            "counterexamples": [c.to_json() for c in self.counterexamples],
        }

    def summary(self) -> str:
        assert self.scope is not None
        return (
            f"{self.engine}, KV scope {self.scope.name} ({self.scope.describe()}): "
            f"{self.figures(f'{self.transitions} transitions')}"
            + (f"; stopped: {self.stopped}" if self.stopped else "")
        )


# ---------------------------------------------------------------------------- the search
class _KVExplorer:
    def __init__(
        self,
        factory: KVAdapterFactory,
        scope: KVScope,
        strategy: str,
        timeout: float,
        first_only: bool,
    ) -> None:
        self.graph: BreadthFirst[Op, KVConfig, _Session] = BreadthFirst(
            strategy, scope.max_states, scope.max_depth
        )
        """The states reached, with a root per pool size; each one's info: its root's
        configuration."""
        self.factory = factory
        self.scope = scope
        self.strategy = strategy
        self.timeout = timeout
        self.first_only = first_only
        self.found: FirstFound[KVFinding, KVWorkload] = FirstFound()
        self.res = KVExploreResult(strategy=strategy, scope=scope)

    # ------------------------------------------------------------------ sessions
    def fresh(self, config: KVConfig) -> _Session:
        run = KVRun(self.factory, config, self.timeout)
        run.start()
        return _Session(run, self.scope)

    def at(self, nid: int) -> _Session:
        """A session in state ``nid`` that the caller may change."""
        if self.strategy == "copy":
            return self.graph.sessions[nid].clone()
        s = self.fresh(self.graph[nid].info)
        if s.run.dead:
            first = s.findings[0] if s.findings else None
            raise Unreachable(first, "a fresh manager refused its pool")
        self.graph.replay(nid, s, "ops", "manager")
        return s

    # ------------------------------------------------------------------ search
    def run(self) -> KVExploreResult:
        start = time.perf_counter()
        res = self.res
        try:
            refused: list[str] = []
            for config in self.scope.configs():
                root = self.fresh(config)
                run = root.run
                if run.adapter is not None and res.engine == "?":
                    res.engine = str(getattr(run.adapter, "name", "?"))
                if run.not_supported:
                    refused.append(f"{config.num_blocks} blocks: {run.not_supported}")
                elif run.findings:
                    self.record(run.findings, partial(KVWorkload, config))
                else:
                    self.add(-1, None, root)
            if refused and not len(self.graph) and not self.found:
                res.not_supported = "; ".join(refused)
            elif len(self.graph):
                self.search()
        finally:
            res.seconds = time.perf_counter() - start
        res.states = len(self.graph)
        res.depth = self.graph.deepest
        for f, w in self.found.values():
            if not f.timed_out:
                f, w = self.trim(f, w)
            res.counterexamples.append(KVCounterexample(f, w))
        res.seconds = time.perf_counter() - start
        return res

    def add(self, parent: int, op: Op | None, s: _Session) -> None:
        self.graph.visit(parent, op, s.key(), s.run.config, s)

    def search(self) -> None:
        res = self.res
        res.exhausted = self.graph.search(
            self.expand_or_record,
            lambda: (self.first_only and bool(self.found)) or bool(res.stopped),
        )
        if self.graph.capped:
            res.stopped = f"state cap {self.scope.max_states} reached"
        if res.stopped or (self.first_only and self.found):
            res.exhausted = False  # states left in the queue, or ops left untried

    def expand_or_record(self, nid: int) -> None:
        try:
            self.expand(nid)
        except Unreachable as e:
            found = e.finding if isinstance(e.finding, KVFinding) else _finding(e.message)
            self.record([found], lambda: self.workload(nid))

    def expand(self, nid: int) -> None:
        parent = self.graph.sessions[nid] if self.strategy == "copy" else self.at(nid)
        ops = parent.enabled()
        before = Counter(parent.run.coverage)
        for i, op in enumerate(ops):
            # The parent itself takes the last op: one copy or replay fewer per state.
            child = parent if i == len(ops) - 1 else self.at(nid)
            found = child.apply(op)
            self.res.transitions += 1
            self.cover(before, child.run.coverage)
            if found:
                self.record(found, partial(self.workload, nid, op))
                if any(f.timed_out for f in found):
                    # Every further call into a hanging manager costs a whole time limit.
                    self.res.stopped = f"an adapter call timed out: {found[0].violation.message}"
                    return
                if self.first_only:
                    return
                continue
            self.add(nid, op, child)

    def workload(self, nid: int, op: Op | None = None) -> KVWorkload:
        return KVWorkload(self.graph[nid].info, self.graph.path(nid, op))

    def cover(self, before: Counter[str], after: Counter[str]) -> None:
        cov = self.res.coverage
        for name, n in after.items():
            if n > before.get(name, 0):
                cov[name] = cov.get(name, 0) + 1

    def record(self, found: list[KVFinding], w: Callable[[], KVWorkload]) -> None:
        """The first finding of each signature with its path (BFS: a shortest one)."""
        f = found[0]  # later findings of the same op are collateral damage
        self.found.record(f.signature, f, w)

    def trim(self, f: KVFinding, w: KVWorkload) -> tuple[KVFinding, KVWorkload]:
        """Drop trailing frees that the replay's drain does anyway (it frees every live
        request, in id order), as long as the replay still shows the signature: the
        workload format's op count is what the Hypothesis machine's shrinker minimises."""
        while w.ops and w.ops[-1]["op"] == "free":
            shorter = replace(w, ops=w.ops[:-1])
            again = find_signature(
                replay_workload(self.factory, shorter, self.timeout), f.signature
            )
            if again is None:
                break
            f, w = again, shorter
        return f, w


def _finding(message: str) -> KVFinding:
    return KVFinding(violation(Invariant.PROGRESS, "adapter", message), -1, "explore")


def explore_kv(
    factory: KVAdapterFactory,
    scope: KVScope,
    *,
    strategy: str = "replay",
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    first_only: bool = False,
) -> KVExploreResult:
    """Explore every KV state of ``scope`` on managers made by ``factory``, breadth first;
    never raises for manager bugs (each distinct finding signature is a counterexample
    whose workload :func:`refserve.conformance.kv.machine.replay_kv` replays to it).

    ``strategy``: ``replay`` builds each state's manager afresh and replays its op path
    (any adapter; checks determinism: the same ops reach the same key); ``copy``
    deep-copies the parent's run, adapter included (managers that copy cleanly; the
    same graph in less time). ``first_only`` stops at the first finding.
    """
    return _KVExplorer(factory, scope, strategy, call_timeout, first_only).run()


__all__ = [
    "KV_SCOPES",
    "KVCounterexample",
    "KVExploreResult",
    "KVScope",
    "explore_kv",
    "kv_key",
]
