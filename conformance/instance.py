"""Drive one workload through an adapter and check every invariant after every step.

Per step the runner builds a :class:`spec.StepSnapshot` from the adapter's snapshots and
report and runs :func:`refserve.spec.check_step`; after each abort it runs
:func:`refserve.spec.check_pool`; on a rejected request or a rolled-back step it runs
:func:`refserve.spec.atomic.check_atomic`; at quiescence
:func:`refserve.spec.progress.check_quiescent` (the leak check) and
:func:`refserve.spec.progress.check_starvation`. On top of the spec it keeps a fake KV memory
(a model check that catches sharing bugs, docs/CONFORMANCE.md; :mod:`refserve.conformance.fake_kv`):
each scheduled slot receives the token id at its position, and after each step every
request must read back exactly its own tokens through its block table. It samples every
token itself, so it knows when a request must stop (:mod:`refserve.conformance.stops`). An
exception out of the engine is a PROGRESS failure (it must not crash); so is a run that
does not quiesce within the workload's step limit.

Every adapter call goes through :func:`refserve.conformance.guard.call` (a time limit, any
exception contained) and every value it returns is validated (:mod:`refserve.conformance.validate`)
before a checker reads it: a hang, a raise or a malformed record ends the run with a
PROGRESS finding naming the call, never a crash of the suite. ``NotSupported`` from any
call means the engine cannot run the workload (``not_supported``). The adapter's declared
:class:`~refserve.conformance.adapter.EngineProperties` set what is a convention: lookahead slots
(POS), eos handling (KVLEN), the free-queue order (BLOCK), the admission order (ORDER).
What a run yields (findings, observed policy, trace) is :mod:`refserve.conformance.run_result`.
The entry points (one workload on fresh adapters, one or several instances) are
:mod:`refserve.conformance.runner`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from refserve.conformance import validate
from refserve.conformance.adapter import (
    PLACEHOLDER_DRAFT,
    AdmissionOrder,
    CommitReport,
    EngineAdapter,
    EngineConfig,
    EngineProperties,
    Feature,
    NotSupported,
    Rejected,
    StepOrder,
    StepReport,
    TransferOutcome,
    properties_of,
)
from refserve.conformance.fake_kv import FakeKV, Slot
from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT, AdapterCallError, call, describe
from refserve.conformance.run_result import Finding, RunResult, step_trace
from refserve.conformance.stops import StopRules
from refserve.conformance.workload import RequestPlan, Workload, drawn_outcome, next_token
from refserve.spec.atomic import check_atomic
from refserve.spec.checks import check_pool, check_step
from refserve.spec.order import (
    check_admission_order,
    check_decode_first,
    check_prefill_first,
    check_strict_admission_order,
)
from refserve.spec.prefix import check_same_step_hits
from refserve.spec.progress import check_quiescent, check_starvation
from refserve.spec.snapshot import (
    EngineSnapshot,
    RequestStatus,
    ScheduledRequest,
    StepSnapshot,
    TransferKind,
)
from refserve.spec.violation import Invariant, Violation, violation

T = TypeVar("T")

COMPLETE = TransferOutcome.COMPLETE
MAX_TRANSFER_DELAYS = 2
"""Steps in a row a seed may delay one copy group; it then completes (or fails), so a
drawn run quiesces."""


class _Stop(Exception):
    """Ends a run early: the finding (or the not-supported reason) is already recorded."""


STALL_STEPS = 3
"""Consecutive steps that change nothing, with no arrival or abort ahead, that end a run."""

STEP_INVARIANTS = (
    Invariant.TOKEN,
    Invariant.BLOCK,
    Invariant.KVLEN,
    Invariant.POS,
    Invariant.CAP,
    Invariant.PREFIX,
    Invariant.PROGRESS,
)


@dataclass
class _Sampled:
    """What the suite's model answers to one step report: the token sampled per request,
    the drafts accepted per verified request, and the tokens each request gains."""

    sampled: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    gained: dict[str, list[int]] = field(default_factory=dict)


class _Run:
    """One engine instance under a workload. Alone it is the whole run (:meth:`run`);
    in a migration workload (:mod:`refserve.conformance.migration`) each instance is one, built
    with ``config`` (its own limits), ``shared`` (the first instance, whose result,
    tokens and plans every instance shares: a request's tokens move with it) and
    ``label`` (its name in findings: ``step on B``)."""

    def __init__(
        self,
        adapter: EngineAdapter,
        workload: Workload,
        props: EngineProperties,
        call_timeout: float,
        *,
        config: EngineConfig | None = None,
        shared: _Run | None = None,
        label: str = "",
    ) -> None:
        self.a = adapter
        self.w = workload
        self.cfg = workload.config if config is None else config
        self.props = props
        self.timeout = call_timeout
        self.label = label
        self.res: RunResult = RunResult(workload) if shared is None else shared.res
        self.rank: dict[str, tuple[int, ...]] = {}  # place in the declared admission order
        self.unchanged = 0  # consecutive steps that scheduled, retired and changed nothing
        self.tokens: dict[str, list[int]] = {} if shared is None else shared.tokens
        self.plans: dict[str, RequestPlan] = (
            {r.request_id: r for r in workload.requests} if shared is None else shared.plans
        )
        self.live: set[str] = set()
        self.latest: EngineSnapshot | None = None
        """The last snapshot taken (a migration run's cluster snapshot reads it)."""
        self.last_gained: dict[str, list[int]] = {}
        """The tokens each request gained in the last step."""
        self.memory = FakeKV({rid: r.domain for rid, r in self.plans.items() if r.domain})
        self.stops = StopRules(props, self.cfg.eos_token_id)
        self.steps: list[StepSnapshot] = []
        self.prefill_steps: dict[str, int] = defaultdict(int)
        self.transfer_delays: dict[tuple[str, str], int] = {}
        """Consecutive steps each copy group (request, kind) was drawn a delay."""
        self.transfer_used: list[tuple[int, str, str, str]] = []
        """Every outcome named to the adapter (a replay's ``transfer_outcomes``)."""

    @property
    def kv(self) -> dict[int, Slot]:
        """The device's fake KV memory (slot -> value; the explorer's key reads it)."""
        return self.memory.device

    @property
    def host_kv(self) -> dict[int, Slot]:
        """The host swap pool's fake KV memory."""
        return self.memory.host

    # ------------------------------------------------------------------ helpers
    def where(self, phase: str) -> str:
        """``phase``, with the instance named in a run of several (``step on B``)."""
        return f"{phase} on {self.label}" if self.label else phase

    def fail(
        self,
        inv: Invariant,
        step: int,
        phase: str,
        subject: str,
        msg: str,
        expected: object = "",
        seen: object = "",
    ) -> None:
        f = Finding(violation(inv, subject, msg, expected, seen), step, self.where(phase))
        self.res.findings.append(f)

    def not_quiesced(self, step: int, limit: int, live: Iterable[str]) -> None:
        """PROGRESS: requests still live after the run's step limit."""
        self.fail(
            Invariant.PROGRESS,
            step,
            "step",
            "run",
            f"did not quiesce within {limit} steps",
            "quiescence",
            f"{sorted(live)} still live",
        )

    def events_ahead(self, pending: list[RequestPlan]) -> bool:
        """Whether an arrival or an abort is still to come (either can unstick a stall)."""
        return bool(pending) or any(self.plans[rid].abort_at is not None for rid in self.live)

    def record(self, vs: list[Violation], step: int, phase: str) -> None:
        self.res.findings.extend(Finding(v, step, self.where(phase)) for v in vs)

    def call(
        self,
        step: int,
        phase: str,
        what: str,
        fn: Callable[[], T],
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> T:
        """One guarded adapter call: a fault becomes a PROGRESS finding naming the call
        and ends the run; ``NotSupported`` ends it as not supported."""
        try:
            return call(what, fn, self.timeout, (NotSupported, *passthrough))
        except NotSupported as e:
            self.res.not_supported = f"{what}: {e}"
            raise _Stop from None
        except AdapterCallError as e:
            self.fail(Invariant.PROGRESS, step, phase, "engine", str(e))
            raise _Stop from None

    def malformed(self, step: int, phase: str, what: str, problems: list[str]) -> None:
        """A record the adapter returned does not have the protocol's shape."""
        if not problems:
            return
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        self.fail(
            Invariant.PROGRESS,
            step,
            phase,
            "adapter",
            f"{what} returned a malformed record: {problems[0]}{more}",
        )
        raise _Stop

    def snapshot(self, step: int, phase: str) -> EngineSnapshot:
        snap = self.call(step, phase, "snapshot()", self.a.snapshot)
        self.malformed(step, phase, "snapshot()", validate.check_engine_snapshot(snap))
        self.latest = snap
        return snap

    def checked(self, step: int, phase: str, fn: Callable[[], list[Violation]]) -> None:
        """Run a checker; a checker failing on the adapter's data is a finding too (data
        that passed validation but breaks an assumption no engine should break)."""
        try:
            vs = fn()
        except Exception as e:
            self.fail(
                Invariant.PROGRESS,
                step,
                phase,
                "adapter",
                f"the checkers could not read the adapter's records: {describe(e)}",
            )
            raise _Stop from None
        self.record(vs, step, phase)

    # ------------------------------------------------------------------ the run
    def run(self) -> RunResult:
        try:
            self.drive()
        except _Stop:
            pass
        except Exception as e:  # the suite's own bookkeeping tripped on the adapter's data
            self.fail(
                Invariant.PROGRESS,
                self.res.observed.steps,
                "step",
                "adapter",
                f"the suite could not follow the adapter's records: {describe(e)}",
            )
        return self.res

    def configure(self) -> None:
        """Configure the engine, then read its declared properties again: a convention
        may follow from the configuration (an engine that keeps the blocks of rejected
        drafts holds up to its draft count of slots ahead), so the ones checked are
        those of the engine as configured."""
        self.call(-1, "configure", "configure()", lambda: self.a.configure(self.cfg))
        props = self.call(-1, "configure", "properties", lambda: properties_of(self.a))
        self.props = props
        self.stops = StopRules(props, self.cfg.eos_token_id)

    def drive(self) -> None:
        self.configure()
        self.res.checked.update(STEP_INVARIANTS)
        if (
            self.props.admission_order is not AdmissionOrder.UNSPECIFIED
            or self.props.step_order is not StepOrder.UNSPECIFIED
        ):
            self.res.checked.add(Invariant.ORDER)
        pending = sorted(self.w.requests, key=lambda r: r.arrival)
        limit = self.w.step_limit
        boundary = 0
        step = 0
        i = 0
        while True:
            i = self.arrive(pending, i, boundary, step)
            boundary += 1
            if not self.live and not self.copies_in_flight():
                if i >= len(pending):
                    break
                continue  # idle until the next arrival
            if step >= limit:
                self.not_quiesced(step, limit, self.live)
                return
            if step in self.w.rollback_at:
                self.rollback(step)
            self.step(step)
            step += 1
            if self.stalled(pending[i:], step):
                return
        self.quiesce(step)

    def arrive(self, pending: list[RequestPlan], i: int, boundary: int, step: int) -> int:
        """Add the requests arrived by ``boundary`` (``pending[i:]`` in arrival order)
        and abort those due; the index of the next request still to arrive."""
        while i < len(pending) and pending[i].arrival <= boundary:
            self.add(pending[i], step)
            i += 1
        self.abort_due(boundary, step)
        return i

    def abort_due(self, boundary: int, step: int) -> None:
        """Abort the live requests whose ``abort_at`` has come, in id order."""
        for rid in sorted(self.live):
            p = self.plans[rid]
            if p.abort_at is not None and p.abort_at <= boundary:
                self.abort(rid, step)

    def join(self, rid: str) -> None:
        """``rid`` joins this instance (an arrival or an import): it is live here and
        takes the next place in the declared admission order, as the engine's queue
        can only know when it joined."""
        n = len(self.rank)
        if self.props.admission_order.by_priority:
            self.rank[rid] = (self.plans[rid].priority, n)
        else:
            self.rank[rid] = (n,)
        self.live.add(rid)

    def stalled(self, pending: list[RequestPlan], step: int) -> bool:
        """PROGRESS: whether the run ends stalled (:data:`STALL_STEPS` unchanged steps
        and nothing ahead that could unstick it), reported once."""
        if self.unchanged < STALL_STEPS or self.events_ahead(pending):
            return False
        # Nothing the suite will still do can unstick it: running on to the step
        # limit would only repeat the same finding, thousands of steps long.
        if not any(f.invariant is Invariant.PROGRESS for f in self.res.findings):
            self.fail(
                Invariant.PROGRESS,
                step,
                "step",
                "run",
                f"stalled: {STALL_STEPS} steps in a row changed nothing",
                "progress",
                f"{sorted(self.live)} still live",
            )
        return True

    def add(self, r: RequestPlan, step: int) -> None:
        before = self.snapshot(step, "add")
        spec = r.spec(self.cfg.eos_token_id)
        try:
            self.call(
                step,
                "add",
                f"add_request({r.request_id!r})",
                lambda: self.a.add_request(spec),
                (Rejected,),
            )
        except Rejected as e:
            self.res.observed.rejected += 1
            self.res.checked.add(Invariant.ATOMIC)
            after = self.snapshot(step, "add")
            self.checked(step, "add", lambda: check_atomic(before, after))
            self.res.trace.append({"boundary": step, "rejected": r.request_id, "reason": str(e)})
            return
        self.tokens[r.request_id] = list(r.prompt)
        self.join(r.request_id)
        self.res.trace.append({"boundary": step, "added": r.request_id})

    def abort(self, rid: str, step: int) -> None:
        self.call(step, "abort", f"abort({rid!r})", lambda: self.a.abort(rid))
        self.live.discard(rid)
        snap = self.snapshot(step, "abort")
        self.checked(step, "abort", lambda: check_pool(snap.pool, self.props.lookahead_slots))
        if snap.pool.table(rid) is not None:
            self.fail(
                Invariant.PROGRESS,
                step,
                "abort",
                f"request {rid}",
                "still holds blocks after abort",
            )
        r = snap.request(rid)
        if r is not None and r.status is not RequestStatus.ABORTED:
            self.fail(Invariant.PROGRESS, step, "abort", f"request {rid}", f"is {r.status}")
        self.res.trace.append({"boundary": step, "aborted": rid, **self.engine_label()})

    def rollback(self, step: int) -> None:
        before = self.snapshot(step, "rollback")
        plan = self.call(step, "rollback", "schedule()", self.a.schedule)
        self.malformed(step, "rollback", "schedule()", validate.check_step_report(plan))
        self.call(step, "rollback", "rollback()", self.a.rollback)
        self.res.checked.add(Invariant.ATOMIC)
        # Requests retired by the previous step are reported only until the next schedule
        # begins (adapter contract), so only live requests are compared.
        after = self.snapshot(step, "rollback")
        self.checked(step, "rollback", lambda: check_atomic(_live(before), _live(after)))
        self.res.trace.append({"boundary": step, "rolled_back": True, **self.engine_label()})

    def step(self, step: int) -> None:
        before = self.snapshot(step, "step")
        proposals = self.propose(before, step) if self.cfg.num_speculative_tokens else {}
        outcomes = self.decide_transfers(before, step) if self.chooses_transfers else {}
        plan = self.call(step, "step", "schedule()", self.a.schedule)
        self.malformed(step, "step", "schedule()", validate.check_step_report(plan))
        if self.props.placeholder_drafts:
            proposals = with_placeholders(plan, proposals)
        out = self.sample(plan, proposals, step)
        sampled, accepted = out.sampled, out.accepted
        done = self.call(
            step,
            "step",
            "commit()",
            lambda: self.a.commit(sampled, accepted) if accepted else self.a.commit(sampled),  # type: ignore[call-arg]
        )
        self.malformed(step, "step", "commit()", validate.check_commit_report(done))
        after = self.snapshot(step, "step")
        idle = not plan.scheduled and not plan.preempted and not plan.finished
        self.unchanged = self.unchanged + 1 if idle and not done.finished and after == before else 0
        finished = tuple(
            dict.fromkeys([*(f for f, _ in plan.finished), *(f for f, _ in done.finished)])
        )
        snap = StepSnapshot(
            step_index=step,
            token_budget=self.cfg.max_num_batched_tokens,
            max_num_seqs=self.cfg.max_num_seqs,
            before=before,
            scheduled=plan.scheduled,
            after=after,
            preempted=plan.preempted,
            finished=finished,
            num_speculative_tokens=self.cfg.num_speculative_tokens,
        )
        self.checked(
            step,
            "step",
            lambda: check_step(snap, self.props.lookahead_slots, self.props.same_step_prefix_hits),
        )
        self.check_order(snap, step)
        self.check_promises(snap, step)
        self.steps.append(snap)
        if self.props.free_queue_order:
            self.check_free_order(snap, step)
        bs = self.cfg.block_size
        self.record(self.memory.write(plan, self.tokens, proposals, bs), step, "step")
        self.memory.poison_rejected(plan, accepted, self.tokens)
        for rid, toks in out.gained.items():
            self.tokens[rid].extend(toks)
        self.last_gained = out.gained
        self.check_stops(plan, done, sampled, after, step)
        self.record(self.memory.read_back(after, self.tokens), step, "step")
        self.record(self.memory.read_back_host(after, self.tokens), step, "step")
        self.observe(before, plan)
        self.trace_step(step_trace(step, before, plan, done, sampled), accepted, outcomes)

    def trace_step(
        self,
        entry: dict[str, Any],
        accepted: Mapping[str, int],
        outcomes: Mapping[tuple[str, str], TransferOutcome],
    ) -> None:
        """The step's trace entry, with the drafts accepted and the copies' outcomes
        other than completion, when there are any."""
        self.res.trace.append({**entry, **self.engine_label()})
        if accepted:
            self.res.trace[-1]["accepted"] = dict(accepted)
        odd = {f"{rid} {kind}": str(o) for (rid, kind), o in outcomes.items() if o != COMPLETE}
        if odd:
            self.res.trace[-1]["transfers"] = odd

    def engine_label(self) -> dict[str, str]:
        """The trace's ``engine`` key in a run of several instances (none alone)."""
        return {"engine": self.label} if self.label else {}

    def sample(
        self, plan: StepReport, proposals: Mapping[str, tuple[int, ...]], step: int
    ) -> _Sampled:
        """The suite's model: a token for every entry that samples (TOKEN: only for a
        request it knows), its drafts verified first when it carries some."""
        out = _Sampled()
        for s in plan.scheduled:
            if not s.samples:
                continue
            toks = self.tokens.get(s.request_id)
            if toks is None:
                self.fail(
                    Invariant.TOKEN, step, "step", f"request {s.request_id}", "unknown id scheduled"
                )
                continue
            if s.num_draft_tokens:
                self.verify(s, proposals, out.sampled, out.accepted, out.gained, step)
            else:
                out.sampled[s.request_id] = self.choose(s.request_id, toks)
                out.gained[s.request_id] = [out.sampled[s.request_id]]
        return out

    def check_order(self, snap: StepSnapshot, step: int) -> None:
        """ORDER: the declared admission order and the declared step order (decode-first
        or prefill-first), when the adapter declares them."""
        if self.props.step_order is StepOrder.DECODE_FIRST:
            self.checked(step, "step", lambda: check_decode_first(snap))
        elif self.props.step_order is StepOrder.PREFILL_FIRST:
            self.checked(
                step,
                "step",
                lambda: check_prefill_first(snap, self.rank, self.props.lookahead_slots),
            )
        declared = self.props.admission_order
        if declared.strict:
            # Head-of-line blocking promises more than the lax order: a strict engine
            # that lets a small request pass a large head breaks its promise although
            # the lax rule allows it (spec/order.py).
            self.checked(
                step,
                "step",
                lambda: check_strict_admission_order(snap, self.rank, str(declared)),
            )
        elif declared is not AdmissionOrder.UNSPECIFIED:
            self.checked(
                step,
                "step",
                lambda: check_admission_order(
                    snap, self.rank, self.props.lookahead_slots, str(declared)
                ),
            )

    def check_promises(self, snap: StepSnapshot, step: int) -> None:
        """A declared convention the engine says it follows, held as a promise: PREFIX
        lets an engine share a block another request fills in the same step; this holds
        it to taking such hits where it declared it does (PREFIX rule
        ``declared-same-step-hits``; docs/CONFORMANCE.md, "Declarations are promises").
        Promised only with prefix caching on: without it no engine hits at all."""
        if self.props.same_step_prefix_hits and self.cfg.enable_prefix_caching:
            self.checked(step, "step", lambda: check_same_step_hits(snap))

    def check_free_order(self, snap: StepSnapshot, step: int) -> None:
        """Free blocks are handed out in the order the snapshot's free queue states.

        Known bug elsewhere: the free-list reuse order changing silently (which blocks a
        prefix cache keeps longest). Blocks revived by a cache hit may come from anywhere
        in the queue; every other block that was free before the step and is held during
        or after it must come from the head of the queue, in order.
        """
        before = snap.before.pool
        bs = before.block_size
        hits: set[int] = set()
        for s in snap.scheduled:
            hits.update(s.block_table[: s.num_new_cached_tokens // bs])
        hits.update(_load_hits(snap))
        queue = [b for b in before.free_queue if b not in hits]
        in_queue = set(queue)
        taken: set[int] = set()
        for t in snap.after.pool.tables:
            taken.update(b for b in t.block_table if b in in_queue)
        for s in snap.scheduled:
            taken.update(b for b in s.block_table if b in in_queue)
        head = queue[: len(taken)]
        if set(head) != taken:
            self.fail(
                Invariant.BLOCK,
                step,
                "step",
                "free queue",
                "new blocks were not taken from the head of the free queue in order",
                head,
                sorted(taken),
            )

    def propose(self, before: EngineSnapshot, step: int) -> dict[str, tuple[int, ...]]:
        """Drafts for every decoding request (feature ``speculative_decoding``): the
        suite's own next tokens up to a point it chooses by the step, then tokens it will
        not sample, so it decides how many a verification accepts; never past a stop."""
        k = self.cfg.num_speculative_tokens
        out: dict[str, tuple[int, ...]] = {}
        for r in before.requests:
            rid = r.request_id
            if r.status is not RequestStatus.DECODING or rid not in self.tokens:
                continue
            truth = self.truth(rid, k + 1)
            n = min(k, len(truth) - 1)  # the token at a stop is the target's own
            if n < 1:
                continue
            right = self.right_drafts(rid, n, step)
            drafts = (*truth[:right], *(t ^ 1 for t in truth[right:n]))  # t ^ 1 != t
            propose = self.a.propose  # type: ignore[attr-defined]  # feature-gated method
            self.call(step, "step", f"propose({rid!r})", lambda: propose(rid, drafts))  # noqa: B023
            out[rid] = drafts
        return out

    def copies_in_flight(self) -> bool:
        """Whether the last snapshot shows copies in flight: the engine is not quiescent
        until they land (an aborted request's blocks belong to its load until then), so
        the run steps on with nothing live."""
        return self.latest is not None and bool(self.latest.pool.transfers)

    @property
    def chooses_transfers(self) -> bool:
        """Whether the suite decides the copies in flight (feature ``transfer_faults``)."""
        return bool(self.w.transfer_outcomes) or self.w.transfer_seed is not None

    def decide_transfers(
        self, before: EngineSnapshot, step: int
    ) -> dict[tuple[str, str], TransferOutcome]:
        """An outcome for each copy group (request, kind) in flight at the boundary,
        named to the adapter before the step."""
        groups = dict.fromkeys((x.request_id, str(x.kind)) for x in before.pool.transfers)
        outcomes = {g: self.transfer_outcome(g[0], g[1], step) for g in groups}
        for g in list(self.transfer_delays):
            if outcomes.get(g) is not TransferOutcome.DELAY:
                del self.transfer_delays[g]
        for g, o in outcomes.items():
            if o is TransferOutcome.DELAY:
                self.transfer_delays[g] = self.transfer_delays.get(g, 0) + 1
            self.transfer_used.append((step, g[0], g[1], str(o)))
        hook = self.a.transfer_outcomes  # type: ignore[attr-defined]  # feature-gated method
        self.call(step, "step", "transfer_outcomes()", lambda: hook(dict(outcomes)))
        return outcomes

    def transfer_outcome(self, rid: str, kind: str, step: int) -> TransferOutcome:
        """The workload's choice for ``rid``'s copies of ``kind`` at ``step`` if it made
        one, else its seed's draw (a copy drawn :data:`MAX_TRANSFER_DELAYS` delays in a
        row completes), else completion."""
        for at, who, k, what in self.w.transfer_outcomes:
            if (at, who, k) == (step, rid, kind):
                return TransferOutcome(what)
        seed = self.w.transfer_seed
        if seed is None:
            return COMPLETE
        drawn = drawn_outcome(seed, step, rid, kind)
        if drawn is TransferOutcome.DELAY and (
            self.transfer_delays.get((rid, kind), 0) >= MAX_TRANSFER_DELAYS
        ):
            return COMPLETE
        return drawn

    def right_drafts(self, rid: str, n: int, step: int) -> int:
        """How many of the ``n`` drafts proposed to ``rid`` at ``step`` are right: the
        workload's choice if it made one, else one rotating with the step and length."""
        for at, who, right in self.w.drafts_right:
            if at == step and who == rid:
                return min(right, n)
        return (step + len(self.tokens[rid])) % (n + 1)

    def truth(self, rid: str, n: int) -> list[int]:
        """The next ``n`` tokens the suite samples for ``rid``, cut after a stop."""
        p = self.plans[rid]
        toks = list(self.tokens[rid])
        out: list[int] = []
        while len(out) < n:
            t = self.choose(rid, toks)
            toks.append(t)
            out.append(t)
            eos = self.props.eos and t == self.cfg.eos_token_id
            if (
                eos
                or len(toks) - len(p.prompt) >= p.max_tokens
                or len(toks) >= self.cfg.max_model_len
            ):
                break
        return out

    def verify(
        self,
        s: ScheduledRequest,
        proposals: Mapping[str, tuple[int, ...]],
        sampled: dict[str, int],
        accepted: dict[str, int],
        gained: dict[str, list[int]],
        step: int,
    ) -> None:
        """The suite's verification of ``s``'s drafts: the leading drafts equal to its
        own tokens are accepted, then its next token is the one sampled."""
        rid, d = s.request_id, s.num_draft_tokens
        drafts = proposals.get(rid, ())[:d]
        if len(drafts) != d:
            self.fail(
                Invariant.TOKEN,
                step,
                "step",
                f"request {rid}",
                "verifies more drafts than the suite proposed",
                f"<= {len(drafts)}",
                d,
            )
            raise _Stop
        truth = self.truth(rid, d + 1)
        a = 0
        while a < d and drafts[a] == truth[a]:
            a += 1
        accepted[rid] = a
        sampled[rid] = truth[a]
        gained[rid] = truth[: a + 1]

    def choose(self, rid: str, toks: list[int]) -> int:
        p = self.plans[rid]
        n_out = len(toks) - len(p.prompt) + 1
        forced = p.stop_at is not None and n_out == p.stop_at
        # Sampled whether the engine handles eos or not: with eos=False the request must
        # keep running (conformance/stops.py, rule declared-eos).
        if forced and self.cfg.eos_token_id is not None:
            return self.cfg.eos_token_id
        return next_token(toks)

    def check_stops(
        self,
        plan: StepReport,
        done: CommitReport,
        sampled: Mapping[str, int],
        after: EngineSnapshot,
        step: int,
    ) -> None:
        """KVLEN: a request stops exactly when a stop says so; PROGRESS: a finished
        request holds no block."""
        reasons = dict(plan.finished) | dict(done.finished)
        vs = self.stops.violations(sampled, reasons, after, self.tokens, self.plans)
        self.record(vs, step, "step")
        for rid, reason in reasons.items():
            self.live.discard(rid)
            self.res.observed.finish_reasons[reason] = (
                self.res.observed.finish_reasons.get(reason, 0) + 1
            )
            if after.pool.table(rid) is not None:
                self.fail(
                    Invariant.PROGRESS, step, "step", f"request {rid}", "finished but holds blocks"
                )

    def observe(self, before: EngineSnapshot, plan: StepReport) -> None:
        """Policy behaviour of one step (never a violation): mixed batches, decodes
        paused for a prefill, chunked prompts, preemptions, cache hits."""
        o = self.res.observed
        o.steps += 1
        o.preemptions += len(plan.preempted)
        rounds = tuple((s.request_id, s.num_new_tokens) for s in plan.scheduled)
        o.rounds.append(rounds)
        decoding = {r.request_id for r in before.requests if r.status is RequestStatus.DECODING}
        ids = {s.request_id for s in plan.scheduled}
        has_decode = bool(ids & decoding)
        has_prefill = bool(ids - decoding)
        if has_decode and has_prefill:
            o.mixed_steps += 1
        if has_prefill and decoding - ids - set(plan.preempted):
            o.decodes_paused_for_prefill += 1
        for s in plan.scheduled:
            o.cached_tokens += s.num_new_cached_tokens
            if s.request_id not in decoding:
                self.prefill_steps[s.request_id] += 1
                if self.prefill_steps[s.request_id] == 2:
                    o.chunked_prompts += 1
                if s.samples:
                    self.prefill_steps[s.request_id] = 0

    def quiesce(self, step: int) -> None:
        snap = self.snapshot(step, "quiescence")
        self.checked(step, "quiescence", lambda: check_quiescent(snap.pool))
        self.checked(step, "quiescence", lambda: check_pool(snap.pool, self.props.lookahead_slots))
        unfinished: object = self.call(
            step, "quiescence", "has_unfinished()", self.a.has_unfinished
        )
        if not isinstance(unfinished, bool):
            self.malformed(
                step,
                "quiescence",
                "has_unfinished()",
                [f"has_unfinished(): expected a bool, got {type(unfinished).__name__}"],
            )
        if unfinished:
            self.fail(
                Invariant.PROGRESS,
                step,
                "quiescence",
                "engine",
                "every request finished or was aborted, but the engine still has unfinished "
                "work (a retired request left in a queue)",
            )
        live = [r.request_id for r in snap.requests if not r.status.is_done]
        if live and unfinished:
            self.fail(
                Invariant.PROGRESS,
                step,
                "quiescence",
                "engine",
                f"holds live requests {live} after every request finished or was aborted",
            )
        elif live:
            self.fail(
                Invariant.PROGRESS,
                step,
                "quiescence",
                "engine",
                f"reports no unfinished work but holds live requests {live}",
            )
        self.checked(
            step, "quiescence", lambda: check_starvation(self.steps, self.w.starvation_bound)
        )


def with_placeholders(
    plan: StepReport, proposals: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """The drafts each entry verifies (declared ``placeholder_drafts``): those proposed,
    then a :data:`PLACEHOLDER_DRAFT` for each one the engine added, which no verification
    accepts (the suite never samples it)."""
    out = dict(proposals)
    for s in plan.scheduled:
        have = proposals.get(s.request_id, ())
        if s.num_draft_tokens > len(have):
            out[s.request_id] = (*have, *(PLACEHOLDER_DRAFT,) * (s.num_draft_tokens - len(have)))
    return out


def _live(snap: EngineSnapshot) -> EngineSnapshot:
    return EngineSnapshot(tuple(r for r in snap.requests if not r.status.is_done), snap.pool)


def adapter_traits(
    adapter: EngineAdapter, call_timeout: float = DEFAULT_CALL_TIMEOUT
) -> tuple[frozenset[Feature], EngineProperties]:
    """The adapter's features and declared properties, read through the guard.

    Raises :class:`AdapterCallError` when either cannot be read or has the wrong type:
    without them no workload can be run, so the caller reports the scenario (or the run).
    """

    def read() -> tuple[frozenset[Feature], EngineProperties]:
        feats = adapter.features
        if not isinstance(feats, (frozenset, set)) or not all(
            isinstance(f, (Feature, str)) for f in feats
        ):
            raise TypeError(f"features must be a frozenset of Feature, got {feats!r}")
        return frozenset(Feature(f) for f in feats), properties_of(adapter)

    return call("features/properties", read, call_timeout)


def _load_hits(snap: StepSnapshot) -> set[int]:
    """The prefix hit of each load the step started: the blocks its holder took that
    the load does not write (a hit may come from anywhere in the free queue)."""
    started = {(x.request_id, x.kind) for x in snap.before.pool.transfers}
    out: set[int] = set()
    for x in snap.after.pool.transfers:
        if x.kind is not TransferKind.LOAD or (x.request_id, x.kind) in started:
            continue
        table = snap.after.pool.table(x.holder or x.request_id)
        if table is not None:
            out.update(b for b in table.block_table if b not in x.blocks)
    return out
