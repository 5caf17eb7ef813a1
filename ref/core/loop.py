"""The reference loop of the scheduler: one ``schedule()`` per step, one ``commit()`` after it.

Read aloud, a step is: decodes first, then running prefills, then admission of waiting
requests, under three separate limits (token budget, max_num_seqs, free KV blocks). When a
running request cannot get a block, the policy's victim is preempted by recompute. The
plan reserves blocks inside a pool transaction; ``commit`` applies the request changes
and closes it, ``rollback`` undoes the reservation (ATOMIC invariant): until commit, no
request field has changed.

This module keeps the books (requests, queue, running list) and applies a plan; the
parts it delegates each have a module: the planning of a step (ref/core/planner.py,
filling one ref/core/step_build.py ``StepBuild``), the block rules of CAP
(ref/core/capacity.py) and the prefill reserve, SLO cap and chunking
(ref/core/prefill.py). It is the spine: swap and tool waits, speculative drafts, forks,
the bulk decode path and migration attach at the named points of ref/core/hooks.py, and
ref/core/scheduler.py builds the scheduler with all of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from refserve.core.batch import PersistentBatch
from refserve.core.capacity import never_fits, require_fit
from refserve.core.config import SchedulerConfig
from refserve.core.executor_output import Sampled, SplitTokens, checked_accepted, split_output
from refserve.core.hooks import (
    CommittedDecodes,
    DecodeStrategy,
    NoProposals,
    NoSuspension,
    ProposalSource,
    SuspensionManager,
)
from refserve.core.inputs import LayerGroupTables
from refserve.core.outcome import Outcome, StepOutcome
from refserve.core.plan import StepPlan
from refserve.core.planner import Planner
from refserve.core.policy import Policy, make_policy
from refserve.core.prefill import PrefillBacklog
from refserve.core.request import (
    FinishReason,
    Request,
    check_new_request,
    finish_reason,
)
from refserve.errors import (
    DuplicateRequest,
    ExceedsCapacity,
    QueueFull,
    RefserveError,
    UnknownRequest,
)
from refserve.kv import BlockPool
from refserve.spec.snapshot import EngineSnapshot, RequestStatus

#: Why a scheduler refuses a change (``require_boundary``): a step, or a staged import.
_BUSY = (
    "a step is in progress (schedule without commit/rollback)",
    "a migration import is staged (commit or abort it)",
)


class StepInProgress(RefserveError):
    """An operation that needs a step boundary was called between schedule and commit."""


class SchedulerLoop:
    fast_decode = True
    """Use the decode strategy, when one is plugged in. Only the test harness turns it
    off (tests/harness.py ``reference_loop``), for the differential test of the bulk
    path against the per-request one (docs/ARCHITECTURE.md, "The persistent batch")."""

    def __init__(
        self,
        config: SchedulerConfig,
        policy: Policy | None = None,
        *,
        batch: PersistentBatch | None = None,
        pool: BlockPool | None = None,
    ) -> None:
        self.config = config
        self.policy = policy or make_policy(config)
        if pool is None:
            pool = BlockPool(config.num_blocks, config.block_size, **config.pool_options)
        self.pool = pool
        self.requests: dict[str, Request] = {}  # live: not finished, not aborted
        # Admission order (the policy's), kept incrementally: a step reads only the head
        # it admits from (ref/core/waiting.py). Preempted requests keep their arrival place.
        self._queue = self.policy.waiting_queue(track_arrivals=config.queue_timeout_ms is not None)
        # The running requests, in admission order, with their per-step state in arrays
        # (ref/core/batch.py); a decode strategy may bring its own (ref/core/bulk.py).
        self._batch = PersistentBatch(config.block_size, config.max_len) if batch is None else batch
        # The named points (ref/core/hooks.py), null until an attachment plugs in.
        self.suspension: SuspensionManager = NoSuspension(self.pool)
        self.proposals: ProposalSource = NoProposals()
        self.decodes: DecodeStrategy | None = None
        # The pool's layer groups when it keeps several (the step's inputs and checks
        # read every group's tables); None: one table per request.
        self.layer_groups: LayerGroupTables | None = None
        self._planner = Planner(
            config,
            self.policy,
            self.pool,
            self._queue,
            self.suspension,
            self.proposals,
        )
        self.step_index = 0
        self._seq = 0
        self._pending: StepPlan | None = None
        self._plan_start_ms = 0.0
        # Prefill work left, for the reserve that bounds starvation (ref/core/prefill.py).
        self._backlog = PrefillBacklog()
        self.retired: list[Request] = []  # finished or aborted since the last commit
        # Admission control counters (rejected at add_request; timed out while waiting).
        self.num_rejected = 0
        self.num_timeouts = 0

    def plug(
        self,
        suspension: SuspensionManager | None = None,
        proposals: ProposalSource | None = None,
        decodes: DecodeStrategy | None = None,
        layer_groups: LayerGroupTables | None = None,
    ) -> None:
        """Plug attachments in at the named points (ref/core/scheduler.py does, once,
        before the first request)."""
        if suspension is not None:
            self.suspension = self._planner.suspension = suspension
        if proposals is not None:
            self.proposals = self._planner.proposals = proposals
        if decodes is not None:
            self.decodes = decodes
        if layer_groups is not None:
            self.layer_groups = layer_groups

    @property
    def running(self) -> list[Request]:
        """The running requests in admission order (read-only: the batch keeps it)."""
        return self._batch.requests

    @property
    def batch(self) -> PersistentBatch:
        return self._batch

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a request. Bad input raises a typed error and queues nothing."""
        self.require_boundary("add_request")
        check_new_request(request, self.config.max_len, self.config.max_model_len)
        rid = request.request_id
        if rid in self.requests:
            raise DuplicateRequest(rid, "add_request")
        try:
            require_fit(self.config, rid, request.num_prompt_tokens)
        except ExceedsCapacity:
            self.num_rejected += 1
            raise
        limit = self.config.max_waiting
        if limit is not None and len(self._queue) >= limit:
            self.num_rejected += 1
            raise QueueFull(f"add_request: request {rid!r} rejected: {limit} requests already wait")
        request.seq = self._seq
        request.queued_step = self.step_index
        self._seq += 1
        self.requests[rid] = request
        self._queue.add(request)
        self._backlog.mark(request, self.step_index)

    def abort(self, request_id: str, now_ms: float = 0.0) -> None:
        """Abort in any live state; every block the request held returns to the pool."""
        self._end(request_id, RequestStatus.ABORTED, FinishReason.ABORT, now_ms, "abort")

    def finish(self, request_id: str, reason: FinishReason, now_ms: float = 0.0) -> None:
        """Finish a live request from outside the scheduler at a step boundary (e.g. the
        detokenizer matched a stop string): like abort, but recorded as finished."""
        self._end(request_id, RequestStatus.FINISHED, reason, now_ms, "finish")

    def join(self, r: Request) -> None:
        """``r`` (a migrated request, already checked) joins this scheduler where its
        status says: the tool wait, the running batch (it holds KV: its blocks are
        already in the pool), or the waiting queue. It arrives now: the next place in
        arrival order. The caller checks the step boundary."""
        r.seq = self._seq
        r.queued_step = self.step_index
        self._seq += 1
        self.requests[r.request_id] = r
        if r.status is RequestStatus.WAITING_TOOL:
            self.suspension.hold(r)
        elif r.num_computed_tokens:
            self._batch.append(r, self.pool)
        else:
            self._queue.add(r)
        self._backlog.mark(r, self.step_index)

    def leave(self, request_id: str) -> Request:
        """The request leaves this scheduler at a step boundary (a migration's source
        releasing it): every block it held goes back to the pools and it leaves the
        batch, the queue or the tool wait. Not a finish: it is not retired."""
        self.require_boundary("leave")
        r = self.requests.get(request_id)
        if r is None:
            raise UnknownRequest(request_id, "leave")
        self._unplace(r)
        del self.requests[request_id]
        self._backlog.clear(r)
        self.policy.forget(request_id)
        return r

    @property
    def waiting(self) -> list[Request]:
        """The waiting requests in arrival order (seq), preempted ones in their arrival
        place. A copy, O(n log n): for inspection, never used by a step."""
        return list(self._queue)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the step
    def schedule(self, now_ms: float = 0.0) -> StepPlan:
        """Plan one step and reserve its KV blocks (undone by :meth:`rollback`)."""
        self.require_boundary("schedule")
        self.retired = []
        self._plan_start_ms = now_ms
        self.pool.begin()
        self.suspension.begin()
        try:
            reserve = self._backlog.reserve(self.config, self.step_index)
            plan = self._planner.plan(
                self.step_index,
                list(self.running),
                reserve,
                now_ms,
                decodes=self.decodes if self.fast_decode else None,
            )
        except BaseException:
            self.pool.rollback()
            self.suspension.rollback()
            raise
        self._pending = plan
        return plan

    def rollback(self) -> None:
        """Undo the pending plan's reservations: the state is exactly as before schedule."""
        assert self._pending is not None, "rollback without a pending plan"
        self.pool.rollback()
        self.suspension.rollback()
        self._pending = None

    def commit(
        self,
        plan: StepPlan,
        sampled: Sampled,
        now_ms: float = 0.0,
        accepted: Mapping[str, int] | None = None,
    ) -> StepOutcome:
        """Apply a step's results: counters, sampled tokens, stops, preemptions, admissions.

        ``sampled``: the token of each sampling request, by request id, or as an int
        array (numpy or torch) in the plan's order of sampling entries (what
        ``ModelInputs.sample_request_ids`` lists); for a request that verified drafts,
        the target's own token after the accepted ones. ``accepted``: how many of its
        drafts each such request had accepted (docs/SPECULATIVE.md). In phases, each a
        method returning the outcomes it made (ref/core/outcome.py): the victims leave,
        the admitted join, the bulk decodes advance, the other entries advance and
        sample, the planned finishes retire; then the books close.
        """
        assert plan is self._pending, "commit of a plan that is not pending"
        tokens = split_output(plan, sampled)
        counts = checked_accepted(plan, accepted)
        preempted = self._commit_preempted(plan, now_ms)
        self._commit_admitted(plan)
        bulk = self._commit_bulk(plan, tokens, now_ms)
        entries = self._commit_entries(plan, tokens.rest, counts, now_ms)
        finishes = self._commit_finishes(plan, now_ms)
        outcome = StepOutcome(
            bulk.request_ids, bulk.tokens, (*preempted, *bulk.outcomes, *entries, *finishes)
        )
        self._close(plan, outcome)
        return outcome

    def _close(self, plan: StepPlan, outcome: StepOutcome) -> None:
        """The books after a commit: who left the running set, the suspension manager's
        books, the step's transaction closed (the pool's and the manager's), the step
        counted, the policy told."""
        if outcome.outcomes:
            left = {o.request_id for o in outcome.outcomes if o.preempted or o.finish is not None}
            if left:
                self._batch.remove_many(left)
        self.suspension.commit(plan)
        self.pool.commit()
        self.suspension.close()
        self._pending = None
        self.proposals.clear()  # drafts hold for one step
        self.step_index += 1
        self._tell_policy(plan)

    def _commit_preempted(self, plan: StepPlan, now_ms: float) -> list[Outcome]:
        """Victims wait again in their arrival place: preempted to recompute unless the
        suspension manager kept their KV, and finished if their tokens can never fit
        again (capacity)."""
        outcomes: list[Outcome] = []
        for rid in plan.preempted:
            r = self.requests[rid]
            r.num_preemptions += 1
            if not self.suspension.kept(r, plan):
                r.transition(RequestStatus.PREEMPTED)
                r.num_computed_tokens = 0
                if never_fits(self.config, r.num_tokens):
                    # Its known tokens outgrew the pool: recomputing them can never fit.
                    self.retire(r, RequestStatus.FINISHED, FinishReason.CAPACITY, now_ms)
                    outcomes.append(Outcome(rid, finish=FinishReason.CAPACITY, preempted=True))
                    continue
            self.requeue(r)
            outcomes.append(Outcome(rid, preempted=True))
        return outcomes

    def _commit_admitted(self, plan: StepPlan) -> None:
        for rid in plan.admitted:
            r = self.requests[rid]
            self._queue.remove(r)
            self._batch.append(r, self.pool)
            if r.admitted_ms is None:
                r.admitted_ms = self._plan_start_ms

    def _commit_bulk(self, plan: StepPlan, tokens: SplitTokens, now_ms: float) -> CommittedDecodes:
        """The decodes the decode strategy planned (none without one)."""
        if plan.decode_rows is None or self.decodes is None:
            return CommittedDecodes((), tokens.bulk, [])

        def finish(r: Request, token: int, reason: FinishReason) -> Outcome:
            return self._finish_decoded(r, (token,), reason, now_ms)

        return self.decodes.commit_decodes(plan, tokens.bulk, now_ms, finish)

    def _commit_entries(
        self,
        plan: StepPlan,
        tokens: Mapping[str, int],
        accepted: Mapping[str, int],
        now_ms: float,
    ) -> list[Outcome]:
        """The plan's entries after the bulk decodes (prefill chunks, the per-request
        decode path, verifications), one by one: each advances its KV length (KVLEN),
        and a sampling one keeps its token and stops by :func:`finish_reason`. Their
        batch rows are reloaded after."""
        outcomes: list[Outcome] = []
        k = 0 if plan.decode_rows is None else len(plan.decode_rows.slots)
        by_id = self.requests
        for rid, start, n, samples, cached in zip(
            plan.request_ids[k:],
            plan.starts[k:],
            plan.num_new_tokens[k:],
            plan.samples[k:],
            plan.num_new_cached_tokens[k:],
            strict=True,
        ):
            r = by_id[rid]
            if cached:
                r.num_cached_tokens = cached
            r.num_computed_tokens = start + n
            if not samples:
                r.transition(RequestStatus.PREFILLING)
                self._backlog.mark(r, self.step_index)
                outcomes.append(Outcome(rid))
            elif rid in plan.drafts:
                drafts = plan.drafts[rid]
                outcomes.append(
                    self._commit_verified(r, drafts, accepted[rid], tokens[rid], now_ms)
                )
            else:
                outcomes.append(self._commit_token(r, tokens[rid], now_ms))
        for rid in plan.request_ids[k:]:
            live = by_id.get(rid)  # finished ones leave the batch in _close
            if live is not None and rid in self._batch:
                self._batch.reload(live, self.pool)
        return outcomes

    def _commit_token(self, r: Request, token: int, now_ms: float) -> Outcome:
        """One sampled token kept, then the stop and length rules."""
        r.token_ids.append(token)
        r.token_times_ms.append(now_ms)
        reason = finish_reason(r, token, self.config.max_len)
        if reason is not None:
            return self._finish_decoded(r, (token,), reason, now_ms)
        if r.status is not RequestStatus.DECODING:
            r.transition(RequestStatus.DECODING)
            self._backlog.clear(r)
        return Outcome(r.request_id, (token,))

    def _commit_verified(
        self, r: Request, drafts: tuple[int, ...], accepted: int, token: int, now_ms: float
    ) -> Outcome:
        """A verification (the proposal source's): the tokens it keeps, then a finish."""
        kept, reason = self.proposals.keep(r, drafts, accepted, token, now_ms)
        if reason is not None:
            done = self._finish_decoded(r, kept, reason, now_ms)
            return done._replace(num_drafts=len(drafts), num_accepted=accepted)
        return Outcome(r.request_id, kept, num_drafts=len(drafts), num_accepted=accepted)

    def _finish_decoded(
        self, r: Request, kept: tuple[int, ...], reason: FinishReason, now_ms: float
    ) -> Outcome:
        """``r`` finished on a token it kept: its blocks go back to the pool."""
        freed = len(self.pool.block_table_view(r.request_id))
        self.pool.free(r.request_id)
        self.retire(r, RequestStatus.FINISHED, reason, now_ms)
        return Outcome(r.request_id, kept, reason, freed)

    def _commit_finishes(self, plan: StepPlan, now_ms: float) -> list[Outcome]:
        """The plan's finishes without computing: timed out in the queue, or capacity."""
        outcomes: list[Outcome] = []
        for planned in plan.finished:
            r = self.requests[planned.request_id]
            if r in self._queue:  # timed out while waiting
                self._queue.remove(r)
            self.retire(r, RequestStatus.FINISHED, planned.reason, now_ms)
            outcomes.append(Outcome(planned.request_id, finish=planned.reason))
            if planned.reason is FinishReason.TIMEOUT:
                self.num_timeouts += 1
        return outcomes

    def _tell_policy(self, plan: StepPlan) -> None:
        granted: dict[str, int] = {}
        # The steady decode step has no prefill entries: skip the per-entry walk.
        if any(plan.is_prefill):
            for rid, n, is_prefill in zip(
                plan.request_ids, plan.num_new_tokens, plan.is_prefill, strict=True
            ):
                if is_prefill:
                    tenant = self._tenant_of(rid)
                    granted[tenant] = granted.get(tenant, 0) + n
        # A live view, valid for the call: O(1) however many requests are backlogged.
        self.policy.on_commit(granted, self._backlog.tenants)
        self.policy.on_step(plan, plan.step_index)

    def _tenant_of(self, request_id: str) -> str:
        r = self.requests.get(request_id) or next(
            x for x in self.retired if x.request_id == request_id
        )
        return r.tenant

    # ------------------------------------------------------------------ helpers
    def requeue(self, r: Request) -> None:
        """``r`` (live, holding no device KV) waits again in its arrival place."""
        # The queue keeps arrival order (seq), so a preempted request is not overtaken
        # by later arrivals; aging counts from now.
        r.queued_step = self.step_index
        self._queue.add(r)
        self._backlog.mark(r, self.step_index)

    def _end(
        self, request_id: str, status: RequestStatus, reason: FinishReason, now_ms: float, what: str
    ) -> None:
        self.require_boundary(what)
        r = self.requests.get(request_id)
        if r is None:
            raise UnknownRequest(request_id, what)
        self._unplace(r)
        self.retire(r, status, reason, now_ms)

    def _unplace(self, r: Request) -> None:
        """``r`` gives back every block it holds and leaves the batch, the queue or the
        suspension manager, whichever holds it (still in ``requests``): the first half of an end,
        and all of a migrated request's leaving (:meth:`leave`)."""
        request_id = r.request_id
        if self.pool.has_request(request_id):
            self.pool.free(request_id)
        was_aside = self.suspension.forget(request_id)
        if request_id in self._batch:
            self._batch.remove(r)
        elif not was_aside:
            self._queue.remove(r)

    def enter_batch(self, r: Request, *, prefilling: bool) -> None:
        """``r`` (live, its blocks in the pool) joins the running batch at a step
        boundary; ``prefilling``: it has prefill work left (the backlog counts it)."""
        self._batch.append(r, self.pool)
        if prefilling:
            self._backlog.mark(r, self.step_index)

    @property
    def plan_start_ms(self) -> float:
        """The clock of the last ``schedule`` call."""
        return self._plan_start_ms

    def retire(
        self, r: Request, status: RequestStatus, reason: FinishReason, now_ms: float
    ) -> None:
        """``r`` ends (finished or aborted): it leaves ``requests`` for ``retired``."""
        r.transition(status)
        r.finish_reason = reason
        r.finished_ms = now_ms
        del self.requests[r.request_id]
        self._backlog.clear(r)
        self.policy.forget(r.request_id)
        self.retired.append(r)

    def require_boundary(self, what: str) -> None:
        """Raise :class:`StepInProgress` unless this is a step boundary: the pool's
        transaction is open from schedule to commit/rollback, and while a migration is
        staged here (ref/core/transit.py); no other change may join it."""
        if self.pool.in_transaction:
            raise StepInProgress(f"{what}: {_BUSY[self._pending is None]}")

    # ------------------------------------------------------------------ snapshots
    def snapshot(self, extra: Iterable[Request] = ()) -> EngineSnapshot:
        live = sorted([*self.requests.values(), *extra], key=lambda r: r.request_id)
        return EngineSnapshot(
            tuple(r.snapshot(self.config.max_len) for r in live),
            self.pool.snapshot(),
            self.suspension.snapshot(),
        )
