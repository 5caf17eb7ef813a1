"""One path of an exploration: an engine driven event by event, checked after each one.

A :class:`Session` is the conformance runner (:mod:`refserve.conformance.runner`) cut into single
events. The runner drives a whole workload; here every add, abort, step and fault is one
call of :meth:`Session.apply`, with the same guarded adapter calls, the same fake KV
memory and the same checkers as a conformance run, so a finding of the explorer is a
finding of the suite, and a path replays as an ordinary workload
(:mod:`refserve.conformance.explore.counterexample`).

Events at one step boundary come in the runner's order: adds, then aborts, then the step
(a fault is the runner's ``rollback_at``: a step scheduled and undone just before the
real one). Once an abort has been made at a boundary, the next add waits for the next
boundary, so that every path is a workload the runner replays exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import combinations, product

from refserve.conformance.adapter import (
    EngineAdapter,
    EngineProperties,
    Feature,
    TransferOutcome,
)
from refserve.conformance.explore.key import Key, pool_key, rename, request_key
from refserve.conformance.explore.scope import Scope
from refserve.conformance.guard import describe
from refserve.conformance.instance import InstanceRun
from refserve.conformance.probe import RunStopped
from refserve.conformance.run_result import Finding
from refserve.conformance.sampling import Choices
from refserve.conformance.workload import EOS, RequestPlan, Workload, next_token
from refserve.spec.violation import Invariant, violation


@dataclass(frozen=True)
class Add:
    """Submit catalogue entry ``entry`` (each entry at most once per path)."""

    entry: int

    def __str__(self) -> str:
        return f"add #{self.entry}"


@dataclass(frozen=True)
class Abort:
    request_id: str

    def __str__(self) -> str:
        return f"abort {self.request_id}"


@dataclass(frozen=True)
class Step:
    """One engine step; the requests in ``eos`` sample eos, every other sampler does not.

    With speculative decoding, ``right`` lists (request, n) for requests whose drafts
    are right only up to n (every other proposer's drafts are all right), so each
    accepted count is an outcome of its own."""

    eos: tuple[str, ...] = ()
    right: tuple[tuple[str, int], ...] = ()
    transfers: tuple[tuple[str, str, str], ...] = ()
    """(request, kind, outcome) for copy groups in flight that do not complete in the
    step (feature ``transfer_faults``; every other one completes)."""

    def __str__(self) -> str:
        parts = []
        if self.eos:
            parts.append(f"eos: {', '.join(self.eos)}")
        if self.right:
            parts.append("drafts right: " + ", ".join(f"{r} {n}" for r, n in self.right))
        if self.transfers:
            parts.append(", ".join(f"{r} {k} {o}" for r, k, o in self.transfers))
        return f"step ({'; '.join(parts)})" if parts else "step"


@dataclass(frozen=True)
class Fault:
    """The executor fails: a step is scheduled and rolled back (ATOMIC)."""

    def __str__(self) -> str:
        return "fault"


Event = Add | Abort | Step | Fault


def step_variants(
    sampled: tuple[str, ...],
    proposed: Mapping[str, int],
    offered: Mapping[tuple[str, str], tuple[str, ...]] | None = None,
) -> Iterator[Step]:
    """Every step outcome besides the ordinary one (no eos, every draft right, every copy
    in flight completes): each set of samplers that sample eos, with each choice of how
    many drafts are right, with each outcome of each copy group ``offered`` (its
    outcomes other than completion)."""
    eos_sets = [g for n in range(len(sampled) + 1) for g in combinations(sampled, n)]
    rights = _right_counts(proposed)
    moves = _copy_outcomes(offered or {})
    for eos in eos_sets:
        for right in rights:
            for move in moves:
                if eos or right or move:
                    yield Step(eos, right, move)


def _right_counts(proposed: Mapping[str, int]) -> list[tuple[tuple[str, int], ...]]:
    """Each choice of how many of each request's drafts are right, as (request, count)
    for those not all right."""
    proposers = sorted(proposed)
    counts = product(*(range(proposed[r] + 1) for r in proposers))
    return [
        tuple((r, n) for r, n in zip(proposers, c, strict=True) if n < proposed[r]) for c in counts
    ]


def _copy_outcomes(
    offered: Mapping[tuple[str, str], tuple[str, ...]],
) -> list[tuple[tuple[str, str, str], ...]]:
    """Each choice of outcome per copy group in flight, as (request, kind, outcome) for
    those that do not complete."""
    groups = sorted(offered)
    choices = product(*((str(COMPLETE), *offered[g]) for g in groups))
    return [
        tuple((r, k, o) for (r, k), o in zip(groups, c, strict=True) if o != COMPLETE)
        for c in choices
    ]


COMPLETE = TransferOutcome.COMPLETE


class ExplorerChoices(Choices):
    """The outside world's choices made by the explorer's event, not by the workload:
    which requests sample eos, how many drafts are right, how each copy group ends."""

    def __init__(self, workload: Workload, eos_token_id: int | None) -> None:
        super().__init__(workload, eos_token_id)
        self.eos_now: frozenset[str] = frozenset()
        self.right_now: dict[str, int] = {}
        self.proposed: dict[str, int] = {}
        """The drafts proposed to each request in the last step, by count."""
        self.right_used: list[tuple[int, str, int]] = []
        self.transfers_on = False
        """The explorer decides the copies in flight (feature ``transfer_faults``)."""
        self.transfers_now: dict[tuple[str, str], TransferOutcome] = {}
        self.offered: dict[tuple[str, str], int] = {}
        """The copy groups in flight at the last step, with the delays each had had."""

    @property
    def chooses_transfers(self) -> bool:
        return self.transfers_on

    def transfer_outcome(self, rid: str, kind: str, step: int, delays: int) -> TransferOutcome:
        self.offered[(rid, kind)] = delays
        return self.transfers_now.get((rid, kind), COMPLETE)

    def token(self, plan: RequestPlan, toks: list[int], eos_declared: bool) -> int:
        if plan.request_id in self.eos_now and eos_declared:
            return EOS
        return next_token(toks)

    def right_drafts(self, rid: str, n: int, step: int, known: int) -> int:
        right = min(self.right_now.get(rid, n), n)
        self.proposed[rid] = n
        self.right_used.append((step, rid, right))
        return right


class Session:
    """An engine at the end of one path, with the books the checks need."""

    def __init__(
        self, adapter: EngineAdapter, scope: Scope, props: EngineProperties, timeout: float
    ) -> None:
        self.scope = scope
        workload = Workload(scope.config(), ())
        self.choices = ExplorerChoices(workload, workload.config.eos_token_id)
        self.run = InstanceRun(adapter, workload, props, timeout, choices=self.choices)
        self.features: frozenset[Feature] = frozenset()
        self.boundary = 0
        self.steps = 0
        self.aborting = False
        """An abort was made at this boundary: adds wait for the next one."""
        self.entries: dict[str, int] = {}
        """Catalogue entry of every request added so far (live or not), by id."""
        self.last_sampled: tuple[str, ...] = ()
        self.last_proposed: dict[str, int] = {}
        self.last_offered: dict[tuple[str, str], tuple[str, ...]] = {}
        """The outcomes other than completion each copy group in flight at the last
        step could have had."""
        self.last_accepted: dict[str, tuple[int, int]] = {}
        self.dead = False
        """A call failed or the engine could not take the scope: nothing follows."""
        self.last_abort = ""
        """The last id aborted at this boundary: the runner aborts in sorted id order."""
        self.record = False
        """Keep the runner's trace and the books a replayable workload needs."""
        self.stops: dict[str, int] = {}
        """With ``record``: the output number at which each request sampled eos."""
        self.aborts: dict[str, int] = {}
        self.rollbacks: list[int] = []

    @property
    def findings(self) -> list[Finding]:
        return self.run.res.findings

    def start(self, features: frozenset[Feature]) -> list[Finding]:
        self.features = features
        self.choices.transfers_on = (
            self.scope.transfer_faults and Feature.TRANSFER_FAULTS in features
        )
        return self._guarded(self.run.configure)

    def live(self) -> list[str]:
        """Live request ids in arrival order (the canonical order of the key)."""
        return [rid for rid in self.entries if rid in self.run.live]

    def enabled(self) -> list[Event]:
        """Every event the explorer may apply now (a step's eos outcomes come from the
        ordinary step's samplers and proposers: :func:`step_variants`)."""
        if self.dead:
            return []
        live = self.live()
        out: list[Event] = []
        used = set(self.entries.values())
        if len(self.entries) < self.scope.max_requests and not (self.aborting and live):
            out += [Add(i) for i in range(len(self.scope.catalogue)) if i not in used]
        if Feature.ABORT in self.features:
            last = self.last_abort if self.aborting else ""
            out += [Abort(rid) for rid in sorted(live) if rid > last]
        return out + self._steps(live)

    def _steps(self, live: list[str]) -> list[Event]:
        """A step, and a fault, when anything is live; a step that drains the copies in
        flight when nothing is."""
        if live:
            if self.scope.faults and Feature.ROLLBACK in self.features:
                return [Step(), Fault()]
            return [Step()]
        if self.entries and self.run.copies_in_flight():
            return [Step()]  # nothing live, copies in flight: the engine drains them
        return []

    def apply(self, ev: Event) -> list[Finding]:
        """Apply one event with every check of the runner; returns its new findings."""
        assert not self.dead, "an event after a failed call"
        if isinstance(ev, Add):
            return self._guarded(lambda: self._add(ev.entry))
        if isinstance(ev, Abort):
            return self._guarded(lambda: self._abort(ev.request_id))
        if isinstance(ev, Fault):
            if self.record:
                self.rollbacks.append(self.steps)
            return self._guarded(lambda: self.run.rollback(self.steps))
        return self._guarded(lambda: self._step(ev))

    def _add(self, entry: int) -> None:
        if self.aborting:  # nothing live after the aborts: the runner idles one boundary
            self.boundary += 1
            self.aborting = False
        t = self.scope.catalogue[entry]
        rid = f"r{len(self.entries)}"
        self.entries[rid] = entry
        # An engine without priorities gets them all equal (its workloads never mix them).
        prio = t.priority if Feature.PRIORITIES in self.features else 0
        plan = RequestPlan(rid, t.prompt, t.max_tokens, arrival=self.boundary, priority=prio)
        self.run.plans[rid] = plan
        self.run.add(plan, self.steps)
        self._after()

    def _abort(self, rid: str) -> None:
        if self.record:
            self.aborts[rid] = self.boundary
        self.run.abort(rid, self.steps)
        self.aborting = True
        self.last_abort = rid
        self._after()

    def _step(self, ev: Step) -> None:
        run, choices = self.run, self.choices
        choices.eos_now = frozenset(ev.eos)
        choices.right_now = dict(ev.right)
        choices.proposed = {}
        choices.transfers_now = {(r, k): TransferOutcome(o) for r, k, o in ev.transfers}
        choices.offered = {}
        if self.record:
            for rid in ev.eos:
                self.stops[rid] = len(run.tokens[rid]) - len(run.plans[rid].prompt) + 1
        run.step(self.steps)
        last = run.res.trace[-1] if run.res.trace else {}
        self.last_sampled = tuple(last.get("sampled", {})) if "step" in last else ()
        self.last_proposed = dict(choices.proposed)
        bound = self.scope.transfer_delays
        self.last_offered = {
            g: (str(TransferOutcome.DELAY), str(TransferOutcome.FAIL))
            if delays < bound
            else (str(TransferOutcome.FAIL),)
            for g, delays in choices.offered.items()
        }
        # (accepted, verified) per verification: coverage of every accepted count.
        verified = {c["id"]: c["drafts"] for c in last.get("scheduled", ())}
        self.last_accepted = {
            rid: (a, verified.get(rid, 0)) for rid, a in last.get("accepted", {}).items()
        }
        self.steps += 1
        self.boundary += 1
        self.aborting = False
        self._after()

    def _after(self) -> None:
        run = self.run
        if not self.record:
            self.choices.right_used.clear()
            run.copies.used.clear()
            # Path-long histories are the runner's reports, not state: a state's checks
            # read only the step in hand, and a copied session stays small.
            run.res.trace.clear()
            run.steps.clear()
        if not run.live and self.entries and not run.copies_in_flight():
            run.quiesce(self.steps)

    def key(self) -> Key:
        """The canonical key of the state (:mod:`refserve.conformance.explore.key`); raises
        ``RunStopped`` when the snapshot cannot be read (the finding is recorded)."""
        run = self.run
        snap = run.probe.snapshot(self.steps, "explore")
        live = self.live()
        rank = {rid: i for i, rid in enumerate(live)}
        books = tuple((self.entries[rid], tuple(run.tokens[rid])) for rid in live)
        device = pool_key(snap.pool, rank, run.kv, run.props.free_queue_order)
        host = None if snap.host is None else pool_key(snap.host, rank, run.host_kv, True)
        explore_key = getattr(run.probe.a, "explore_key", None)
        extra = rename(explore_key(), rank) if callable(explore_key) else None
        # Copies in flight, and how long the explorer has held each back (the bound on
        # its delays): the pool's key leaves them out.
        copies = rename(
            (
                tuple((x.request_id, str(x.kind), len(x.blocks)) for x in snap.pool.transfers),
                tuple(sorted(run.copies.delays.items())),
            ),
            rank,
        )
        # At a boundary with aborts made, adds wait and only later ids may be aborted.
        phase = tuple(rank[r] for r in live if r > self.last_abort) if self.aborting else None
        return (
            phase if live else None,
            frozenset(self.entries.values()),
            books,
            request_key(snap, rank),
            device,
            host,
            extra,
            copies,
        )

    def _guarded(self, fn: Callable[[], None]) -> list[Finding]:
        mark = len(self.findings)
        try:
            fn()
        except RunStopped:
            self.dead = True
        except Exception as e:  # the runner's books tripped on the adapter's data
            self.findings.append(
                Finding(
                    violation(
                        Invariant.PROGRESS,
                        "adapter",
                        f"the suite could not follow the adapter's records: {describe(e)}",
                    ),
                    self.steps,
                )
            )
            self.dead = True
        if self.run.res.not_supported:
            self.dead = True
        return self.findings[mark:]


__all__ = ["Abort", "Add", "Event", "Fault", "Session", "Step", "step_variants"]
