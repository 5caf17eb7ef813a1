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

Every adapter call goes through the instance's :class:`~refserve.conformance.probe.Probe`
(a time limit, any exception contained, every value it returns validated before a checker
reads it): a hang, a raise or a malformed record ends the run with a PROGRESS finding
naming the call, never a crash of the suite. ``NotSupported`` from any
call means the engine cannot run the workload (``not_supported``). The adapter's declared
:class:`~refserve.conformance.adapter.EngineProperties` set what is a convention: lookahead slots
(POS), eos handling (KVLEN), the free-queue order (BLOCK), the admission order (ORDER);
:mod:`refserve.conformance.conventions` checks those it declares. The tokens sampled, the
drafts and the copies' outcomes are the suite's model
(:mod:`refserve.conformance.sampling`).
What a run yields (findings, observed policy, trace) is :mod:`refserve.conformance.run_result`.
The entry points (one workload on fresh adapters, one or several instances) are
:mod:`refserve.conformance.runner`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from refserve.conformance import validate
from refserve.conformance.adapter import (
    PLACEHOLDER_DRAFT,
    CommitReport,
    EngineAdapter,
    EngineConfig,
    EngineProperties,
    Feature,
    Rejected,
    StepReport,
    TransferOutcome,
    properties_of,
)
from refserve.conformance.conventions import Conventions
from refserve.conformance.fake_kv import FakeKV, Slot
from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT, call, describe
from refserve.conformance.probe import Probe, RunStopped
from refserve.conformance.run_result import RunResult, step_trace
from refserve.conformance.sampling import COMPLETE, Choices, CopyOutcomes, TokenModel
from refserve.conformance.stops import StopRules
from refserve.conformance.workload import RequestPlan, Workload
from refserve.spec.atomic import check_atomic
from refserve.spec.checks import check_pool, check_step
from refserve.spec.progress import check_quiescent, check_starvation
from refserve.spec.snapshot import (
    EngineSnapshot,
    RequestStatus,
    StepSnapshot,
)
from refserve.spec.violation import Invariant

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


class InstanceRun:
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
        shared: InstanceRun | None = None,
        label: str = "",
        choices: Choices | None = None,
    ) -> None:
        self.w = workload
        self.cfg = workload.config if config is None else config
        self.props = props
        self.res: RunResult = RunResult(workload) if shared is None else shared.res
        self.probe = Probe(adapter, self.res, call_timeout, label)
        self.choices = Choices(workload, self.cfg.eos_token_id) if choices is None else choices
        """Who decides the world outside the engine: the workload, or the explorer."""
        self.model = TokenModel(
            self.probe,
            self.choices,
            self.cfg,
            props,
            {} if shared is None else shared.tokens,
            {r.request_id: r for r in workload.requests} if shared is None else shared.plans,
        )
        self.copies = CopyOutcomes(self.probe, self.choices)
        self.conventions = Conventions(self.probe, self.cfg, props)
        self.unchanged = 0  # consecutive steps that scheduled, retired and changed nothing
        self.live: set[str] = set()
        self.last_gained: dict[str, list[int]] = {}
        """The tokens each request gained in the last step."""
        self.memory = FakeKV({rid: r.domain for rid, r in self.plans.items() if r.domain})
        self.stops = StopRules(props, self.cfg.eos_token_id)
        self.steps: list[StepSnapshot] = []
        self.prefill_steps: dict[str, int] = defaultdict(int)

    @property
    def tokens(self) -> dict[str, list[int]]:
        """Every request's tokens (shared by the instances of a run)."""
        return self.model.tokens

    @property
    def plans(self) -> dict[str, RequestPlan]:
        """Every request's plan (shared by the instances of a run)."""
        return self.model.plans

    @property
    def kv(self) -> dict[int, Slot]:
        """The device's fake KV memory (slot -> value; the explorer's key reads it)."""
        return self.memory.device

    @property
    def host_kv(self) -> dict[int, Slot]:
        """The host swap pool's fake KV memory."""
        return self.memory.host

    def events_ahead(self, pending: list[RequestPlan]) -> bool:
        """Whether an arrival or an abort is still to come (either can unstick a stall)."""
        return bool(pending) or any(self.plans[rid].abort_at is not None for rid in self.live)

    # ------------------------------------------------------------------ the run
    def run(self) -> RunResult:
        try:
            self.drive()
        except RunStopped:
            pass
        except Exception as e:  # the suite's own bookkeeping tripped on the adapter's data
            self.probe.fail(
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
        a = self.probe.a
        self.probe.call(-1, "configure", "configure()", lambda: a.configure(self.cfg))
        props = self.probe.call(-1, "configure", "properties", lambda: properties_of(a))
        self.props = self.model.props = self.conventions.props = props
        self.stops = StopRules(props, self.cfg.eos_token_id)

    def drive(self) -> None:
        self.configure()
        self.res.checked.update(STEP_INVARIANTS)
        if self.conventions.declared:
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
                self.probe.not_quiesced(step, limit, self.live)
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
        self.conventions.join(rid, self.plans[rid].priority)
        self.live.add(rid)

    def stalled(self, pending: list[RequestPlan], step: int) -> bool:
        """PROGRESS: whether the run ends stalled (:data:`STALL_STEPS` unchanged steps
        and nothing ahead that could unstick it), reported once."""
        if self.unchanged < STALL_STEPS or self.events_ahead(pending):
            return False
        # Nothing the suite will still do can unstick it: running on to the step
        # limit would only repeat the same finding, thousands of steps long.
        if not any(f.invariant is Invariant.PROGRESS for f in self.res.findings):
            self.probe.fail(
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
        before = self.probe.snapshot(step, "add")
        spec = r.spec(self.cfg.eos_token_id)
        try:
            self.probe.call(
                step,
                "add",
                f"add_request({r.request_id!r})",
                lambda: self.probe.a.add_request(spec),
                (Rejected,),
            )
        except Rejected as e:
            self.res.observed.rejected += 1
            self.res.checked.add(Invariant.ATOMIC)
            after = self.probe.snapshot(step, "add")
            self.probe.checked(step, "add", lambda: check_atomic(before, after))
            self.res.trace.append({"boundary": step, "rejected": r.request_id, "reason": str(e)})
            return
        self.tokens[r.request_id] = list(r.prompt)
        self.join(r.request_id)
        self.res.trace.append({"boundary": step, "added": r.request_id})

    def abort(self, rid: str, step: int) -> None:
        self.probe.call(step, "abort", f"abort({rid!r})", lambda: self.probe.a.abort(rid))
        self.live.discard(rid)
        snap = self.probe.snapshot(step, "abort")
        self.probe.checked(step, "abort", lambda: check_pool(snap.pool, self.props.lookahead_slots))
        if snap.pool.table(rid) is not None:
            self.probe.fail(
                Invariant.PROGRESS,
                step,
                "abort",
                f"request {rid}",
                "still holds blocks after abort",
            )
        r = snap.request(rid)
        if r is not None and r.status is not RequestStatus.ABORTED:
            self.probe.fail(Invariant.PROGRESS, step, "abort", f"request {rid}", f"is {r.status}")
        self.res.trace.append({"boundary": step, "aborted": rid, **self.probe.engine_label()})

    def rollback(self, step: int) -> None:
        before = self.probe.snapshot(step, "rollback")
        plan = self.probe.call(step, "rollback", "schedule()", self.probe.a.schedule)
        self.probe.malformed(step, "rollback", "schedule()", validate.check_step_report(plan))
        self.probe.call(step, "rollback", "rollback()", self.probe.a.rollback)
        self.res.checked.add(Invariant.ATOMIC)
        # Requests retired by the previous step are reported only until the next schedule
        # begins (adapter contract), so only live requests are compared.
        after = self.probe.snapshot(step, "rollback")
        self.probe.checked(step, "rollback", lambda: check_atomic(_live(before), _live(after)))
        self.res.trace.append({"boundary": step, "rolled_back": True, **self.probe.engine_label()})

    def step(self, step: int) -> None:
        a = self.probe.a
        before = self.probe.snapshot(step, "step")
        levels = self.conventions.read_levels(before, step)
        proposals = self.model.propose(before, step) if self.cfg.num_speculative_tokens else {}
        outcomes = self.copies.decide(before, step) if self.choices.chooses_transfers else {}
        plan = self.probe.call(step, "step", "schedule()", a.schedule)
        self.probe.malformed(step, "step", "schedule()", validate.check_step_report(plan))
        if self.props.placeholder_drafts:
            proposals = with_placeholders(plan, proposals)
        out = self.model.sample(plan, proposals, step)
        sampled, accepted = out.sampled, out.accepted
        done = self.probe.call(
            step,
            "step",
            "commit()",
            lambda: a.commit(sampled, accepted) if accepted else a.commit(sampled),  # type: ignore[call-arg]
        )
        self.probe.malformed(step, "step", "commit()", validate.check_commit_report(done))
        after = self.probe.snapshot(step, "step")
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
        self.probe.checked(
            step,
            "step",
            lambda: check_step(snap, self.props.lookahead_slots, self.props.same_step_prefix_hits),
        )
        self.conventions.check(snap, step, levels)
        self.steps.append(snap)
        bs = self.cfg.block_size
        self.probe.record(self.memory.write(plan, self.tokens, proposals, bs), step, "step")
        self.memory.poison_rejected(plan, accepted, self.tokens)
        for rid, toks in out.gained.items():
            self.tokens[rid].extend(toks)
        self.last_gained = out.gained
        self.check_stops(plan, done, sampled, after, step)
        self.probe.record(self.memory.read_back(after, self.tokens), step, "step")
        self.probe.record(self.memory.read_back_host(after, self.tokens), step, "step")
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
        self.res.trace.append({**entry, **self.probe.engine_label()})
        if accepted:
            self.res.trace[-1]["accepted"] = dict(accepted)
        odd = {f"{rid} {kind}": str(o) for (rid, kind), o in outcomes.items() if o != COMPLETE}
        if odd:
            self.res.trace[-1]["transfers"] = odd

    def copies_in_flight(self) -> bool:
        """Whether the last snapshot shows copies in flight: the engine is not quiescent
        until they land (an aborted request's blocks belong to its load until then), so
        the run steps on with nothing live."""
        return self.probe.latest is not None and bool(self.probe.latest.pool.transfers)

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
        self.probe.record(vs, step, "step")
        for rid, reason in reasons.items():
            self.live.discard(rid)
            self.res.observed.finish_reasons[reason] = (
                self.res.observed.finish_reasons.get(reason, 0) + 1
            )
            if after.pool.table(rid) is not None:
                self.probe.fail(
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
        snap = self.probe.snapshot(step, "quiescence")
        self.probe.checked(step, "quiescence", lambda: check_quiescent(snap.pool))
        slots = self.props.lookahead_slots
        self.probe.checked(step, "quiescence", lambda: check_pool(snap.pool, slots))
        unfinished: object = self.probe.call(
            step, "quiescence", "has_unfinished()", self.probe.a.has_unfinished
        )
        if not isinstance(unfinished, bool):
            self.probe.malformed(
                step,
                "quiescence",
                "has_unfinished()",
                [f"has_unfinished(): expected a bool, got {type(unfinished).__name__}"],
            )
        if unfinished:
            self.probe.fail(
                Invariant.PROGRESS,
                step,
                "quiescence",
                "engine",
                "every request finished or was aborted, but the engine still has unfinished "
                "work (a retired request left in a queue)",
            )
        live = [r.request_id for r in snap.requests if not r.status.is_done]
        if live and unfinished:
            self.probe.fail(
                Invariant.PROGRESS,
                step,
                "quiescence",
                "engine",
                f"holds live requests {live} after every request finished or was aborted",
            )
        elif live:
            self.probe.fail(
                Invariant.PROGRESS,
                step,
                "quiescence",
                "engine",
                f"reports no unfinished work but holds live requests {live}",
            )
        self.probe.checked(
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
