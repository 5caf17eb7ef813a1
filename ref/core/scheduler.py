"""The iteration-level scheduler: one ``schedule()`` per step, one ``commit()`` after it.

Read aloud, a step is: decodes first, then running prefills, then admission of waiting
requests, under three separate limits (token budget, max_num_seqs, free KV blocks). When a
running request cannot get a block, the policy's victim is preempted by recompute. The
plan reserves blocks inside a pool transaction; ``commit`` applies the request changes
and closes it, ``rollback`` undoes the reservation (ATOMIC invariant): until commit, no
request field has changed.

Preemption by swap (``preemption_mode``) copies the victim's KV to the host pool instead
of dropping it (ref/core/swap.py has the rule); a swapped request waits in its arrival place
and is admitted later by a swap-in that restores its blocks before its next tokens run.
The host pool joins the step's transaction.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ref.core.config import Admission, SchedulerConfig
from ref.core.plan import PlanBuilder, PlannedFinish, StepPlan
from ref.core.policy import Policy, make_policy
from ref.core.request import FinishReason, Request, StopParams
from ref.core.swap import KVRetention, PreemptionMode
from ref.errors import (
    DuplicateRequest,
    ExceedsCapacity,
    InvalidArgument,
    QueueFull,
    RefserveError,
    UnknownRequest,
)
from ref.kv import BlockCopy, BlockPool, PrefixHit
from ref.kv.host_pool import HostPool
from spec.arith import blocks_needed, chunk_size
from spec.snapshot import EngineSnapshot, RequestStatus

S = RequestStatus


class StepInProgress(RefserveError):
    """An operation that needs a step boundary was called between schedule and commit."""


class BadExecutorOutput(RefserveError):
    """The executor's output does not match the plan (a sampled token is missing, ...)."""


@dataclass
class _StepSwaps:
    """The swap traffic a plan collects (see StepPlan for the order the executor uses)."""

    out: list[BlockCopy] = field(default_factory=list)
    in_: list[BlockCopy] = field(default_factory=list)
    swapped_out: list[str] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # paused turns whose KV was released


@dataclass(frozen=True)
class StepEvents:
    """What a commit changed, for metrics and streaming."""

    new_tokens: Mapping[str, int]
    finished: tuple[str, ...]
    preempted: tuple[str, ...]


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, policy: Policy | None = None, *, fast_decode: bool = True
    ) -> None:
        self.config = config
        self.policy = policy or make_policy(config)
        # The bulk decode path; False forces the per-request reference loop (the
        # differential test runs both and requires identical plans).
        self.fast_decode = fast_decode
        self.pool = BlockPool(
            config.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.host = HostPool(config.num_host_blocks, config.block_size)
        self.requests: dict[str, Request] = {}  # live: not finished, not aborted
        # Admission order (the policy's), kept incrementally: a step reads only the head
        # it admits from (ref/core/waiting.py). Preempted requests keep their arrival place.
        self._queue = self.policy.waiting_queue(track_arrivals=config.queue_timeout_ms is not None)
        self.running: list[Request] = []  # admission order
        self.paused: dict[str, Request] = {}  # WAITING_TOOL: agent turns waiting for a tool
        # Paused turns whose KV the next step moves to the host pool (pause order).
        self._to_host: list[str] = []
        self.step_index = 0
        self._seq = 0
        self._pending: StepPlan | None = None
        self._plan_start_ms = 0.0
        # Requests with prefill work left -> the last step in which they got any tokens
        # (or were queued). Drives the prefill reserve that bounds starvation. Kept in
        # order of that step (each update moves the entry to the end), so the longest
        # waiting one is the first; _backlog counts them per tenant for the policy.
        self._prefill_since: OrderedDict[str, int] = OrderedDict()
        self._backlog: Counter[str] = Counter()
        self.retired: list[Request] = []  # finished or aborted since the last commit
        # Admission control counters (rejected at add_request; timed out while waiting).
        self.num_rejected = 0
        self.num_timeouts = 0
        # Swap traffic, in blocks (bytes = blocks x the KV bytes of one block).
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a request. Bad input raises a typed error and queues nothing."""
        self._require_boundary("add_request")
        rid = request.request_id
        if not isinstance(rid, str) or not rid:
            raise InvalidArgument(f"add_request: request id must be a non-empty str, got {rid!r}")
        if rid in self.requests:
            raise DuplicateRequest(rid, "add_request")
        if (
            request.status is not S.WAITING
            or request.num_computed_tokens
            or request.num_output_tokens
        ):
            raise InvalidArgument(
                f"add_request: request {rid!r} is not fresh (status {request.status})"
            )
        if request.num_prompt_tokens < 1:
            raise InvalidArgument(f"add_request: request {rid!r} has an empty prompt")
        for t in request.prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidArgument(f"add_request: request {rid!r} has a bad token id {t!r}")
        max_len = self.config.max_len
        if request.num_prompt_tokens >= max_len:
            what = (
                f"max_model_len is {max_len}"
                if max_len == self.config.max_model_len
                else f"without chunked prefill the token budget {max_len} caps the length"
            )
            raise InvalidArgument(
                f"add_request: request {rid!r} prompt has {request.num_prompt_tokens} tokens; "
                f"{what}, leaving no room for an output token"
            )
        need = blocks_needed(request.num_prompt_tokens, self.config.block_size)
        if need > self.config.num_blocks:
            self.num_rejected += 1
            raise ExceedsCapacity(rid, need, self.config.num_blocks)
        limit = self.config.max_waiting
        if limit is not None and len(self._queue) >= limit:
            self.num_rejected += 1
            raise QueueFull(f"add_request: request {rid!r} rejected: {limit} requests already wait")
        request.seq = self._seq
        request.queued_step = self.step_index
        self._seq += 1
        self.requests[rid] = request
        self._queue.add(request)
        self._mark_prefill(request)

    def abort(self, request_id: str, now_ms: float = 0.0) -> None:
        """Abort in any live state; every block the request held returns to the pool."""
        self._end(request_id, S.ABORTED, FinishReason.ABORT, now_ms, "abort")

    def finish(self, request_id: str, reason: FinishReason, now_ms: float = 0.0) -> None:
        """Finish a live request from outside the scheduler at a step boundary (e.g. the
        detokenizer matched a stop string): like abort, but recorded as finished."""
        self._end(request_id, S.FINISHED, reason, now_ms, "finish")

    def fork(self, parent_id: str, child_id: str, first_token: int, stop: StopParams) -> Request:
        """n > 1 sampling: a sibling of a parent that has just sampled its first token.

        The child has the parent's prompt and its own first token (drawn from the same
        logits). While ``max_num_seqs`` leaves room it shares every KV block of the parent
        (copy-on-write on the first write to the shared partial block) and enters in
        decode, exactly the parent's state. Otherwise it waits in the state of a
        recompute-preempted request and is admitted later like one, the prompt's full
        blocks coming from the prefix cache.
        """
        self._require_boundary("fork")
        parent = self.requests.get(parent_id)
        if parent is None:
            raise UnknownRequest(parent_id, "fork")
        if child_id in self.requests:
            raise DuplicateRequest(child_id, "fork")
        if parent.status is not S.DECODING or parent.num_output_tokens != 1:
            raise InvalidArgument(
                f"fork: parent {parent_id!r} must be decoding with exactly one sampled token "
                f"(status {parent.status}, {parent.num_output_tokens} sampled)"
            )
        if type(first_token) is not int or first_token < 0:
            raise InvalidArgument(f"fork: bad first token {first_token!r} for {child_id!r}")
        child = Request(
            child_id,
            list(parent.prompt_token_ids),
            stop,
            arrival_ms=parent.arrival_ms,
            priority=parent.priority,
            tenant=parent.tenant,
            namespace=parent.namespace,
        )
        child.token_ids.append(first_token)
        child.seq = parent.seq  # siblings keep the parent's place in arrival order
        child.admitted_ms = parent.admitted_ms
        child.token_times_ms = list(parent.token_times_ms)
        child.transition(S.DECODING)
        self.requests[child_id] = child
        if len(self.running) < self.config.max_num_seqs:
            self.pool.fork(parent_id, child_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            self.running.append(child)
        elif blocks_needed(child.num_tokens, self.config.block_size) > self.config.num_blocks:
            # Waiting means recomputing all its tokens later, and they can never fit.
            child.transition(S.PREEMPTED)
            self._retire(child, S.FINISHED, FinishReason.CAPACITY, self._plan_start_ms)
        else:
            child.transition(S.PREEMPTED)
            self._requeue(child)
        return child

    def pause(
        self,
        request_id: str,
        retention: KVRetention | str | None = None,
        *,
        expected_wait_ms: float = 0.0,
    ) -> KVRetention:
        """An agent turn stops for a tool call (WAITING_TOOL) at a step boundary.

        Retention (ref/core/swap.py): ``device`` keeps the request's blocks (short waits:
        resuming computes only the new tokens); ``host`` moves its KV to the host pool in
        the next step (the device blocks serve others meanwhile; kept on the device if
        the host pool is full by then); ``drop`` releases its blocks now (long waits: the
        resumed turn recomputes, its full blocks coming back from the prefix cache unless
        evicted meanwhile). ``None`` lets ``config.retention`` choose from
        ``expected_wait_ms``. Returns the retention applied.
        """
        self._require_boundary("pause")
        r = self.requests.get(request_id)
        if r is None:
            raise UnknownRequest(request_id, "pause")
        if r.status is not S.DECODING:
            raise InvalidArgument(
                f"pause: request {request_id!r} must be decoding (it is {r.status})"
            )
        if retention is None:
            if isinstance(expected_wait_ms, bool) or not isinstance(expected_wait_ms, int | float):
                raise InvalidArgument(
                    f"pause: expected_wait_ms must be a number, got {expected_wait_ms!r}"
                )
            kind = self.config.retention.choose(
                expected_wait_ms, host_available=self.host.can_hold(r.num_computed_tokens)
            )
        else:
            try:
                kind = KVRetention(retention)
            except ValueError:
                allowed = ", ".join(m.value for m in KVRetention)
                raise InvalidArgument(
                    f"pause: retention must be one of {allowed}, got {retention!r}"
                ) from None
        if kind is KVRetention.HOST and not self.host.num_blocks:
            raise InvalidArgument(
                f"pause: request {request_id!r} cannot wait on the host: num_host_blocks is 0"
            )
        if kind is KVRetention.DROP:
            self.pool.free(request_id)
            r.num_computed_tokens = 0
        elif kind is KVRetention.HOST:
            self._to_host.append(request_id)
        self.running.remove(r)
        r.transition(S.WAITING_TOOL)
        self.paused[request_id] = r
        return kind

    def resume(self, request_id: str, tool_token_ids: Sequence[int], stop: StopParams) -> None:
        """The tool answered: the conversation so far plus ``tool_token_ids`` becomes the
        prompt of the request's next turn (an incremental prefill), sampled under ``stop``.

        With its KV on the device and a running slot free (that the policy would admit it
        to: a static batch in flight, or its tenant at its cap, says no), the turn
        continues in place;
        with its KV on the host it queues as SWAPPED (admission swaps it in); otherwise
        it queues in its arrival place and recomputes through the prefix cache.
        """
        self._require_boundary("resume")
        r = self.paused.get(request_id)
        if r is None:
            raise UnknownRequest(request_id, "resume (not waiting for a tool)")
        tool = list(tool_token_ids)
        if not tool or any(type(t) is not int or t < 0 for t in tool):
            raise InvalidArgument(f"resume: request {request_id!r} needs tool token ids >= 0")
        if r.num_tokens + len(tool) >= self.config.max_len:
            raise InvalidArgument(
                f"resume: request {request_id!r} would hold {r.num_tokens + len(tool)} tokens; "
                f"the limit is {self.config.max_len - 1} before an output token"
            )
        need = blocks_needed(r.num_tokens + len(tool), self.config.block_size)
        if need > self.config.num_blocks:
            raise ExceedsCapacity(request_id, need, self.config.num_blocks)
        del self.paused[request_id]
        if request_id in self._to_host:  # the tool answered before the KV moved
            self._to_host.remove(request_id)
        r.prompt_token_ids = [*r.token_ids, *tool]
        r.token_ids = list(r.prompt_token_ids)
        r.num_prompt_tokens = len(r.token_ids)
        r.stop = stop
        in_place = (
            len(self.running) < self.config.max_num_seqs
            and self.policy.admission_open(len(self.running))
            and self.policy.may_admit(r, self.running)
        )
        if self.pool.has_request(request_id) and in_place:
            r.transition(S.PREFILLING)
            self.running.append(r)
            self._mark_prefill(r)
            return
        if self.pool.has_request(request_id):  # it may not run now: give the blocks back
            self.pool.free(request_id)
            r.num_computed_tokens = 0
        r.transition(S.SWAPPED if self.host.has_request(request_id) else S.WAITING)
        self._requeue(r)

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
        self._require_boundary("schedule")
        self.retired = []
        self._plan_start_ms = now_ms
        self.pool.begin()
        self.host.begin()
        try:
            plan = self._plan(now_ms)
        except BaseException:
            self.pool.rollback()
            self.host.rollback()
            raise
        self._pending = plan
        return plan

    def rollback(self) -> None:
        """Undo the pending plan's reservations: the state is exactly as before schedule."""
        assert self._pending is not None, "rollback without a pending plan"
        self.pool.rollback()
        self.host.rollback()
        self._pending = None

    def commit(self, plan: StepPlan, sampled: Mapping[str, int], now_ms: float = 0.0) -> StepEvents:
        """Apply a step's results: counters, sampled tokens, stops, preemptions, admissions."""
        assert plan is self._pending, "commit of a plan that is not pending"
        self.validate_output(plan, sampled)
        by_id = self.requests
        gone: set[str] = set()
        finished: list[str] = []
        swapped = set(plan.swapped_out)
        for rid in plan.preempted:
            r = by_id[rid]
            r.num_preemptions += 1
            gone.add(rid)
            if rid in swapped:  # its KV waits on the host; num_computed_tokens stays
                r.transition(S.SWAPPED)
                self._requeue(r)
                continue
            r.transition(S.PREEMPTED)
            r.num_computed_tokens = 0
            if blocks_needed(r.num_tokens, self.config.block_size) > self.config.num_blocks:
                # Its known tokens outgrew the pool: recomputing them can never fit.
                self._retire(r, S.FINISHED, FinishReason.CAPACITY, now_ms)
                finished.append(rid)
            else:
                self._requeue(r)
        if plan.admitted:
            for rid in plan.admitted:
                r = by_id[rid]
                self._queue.remove(r)
                self.running.append(r)
                if r.admitted_ms is None:
                    r.admitted_ms = self._plan_start_ms
        new_tokens: dict[str, int] = {}
        max_len = self.config.max_len
        for rid, start, n, samples, cached in zip(
            plan.request_ids,
            plan.starts,
            plan.num_new_tokens,
            plan.samples,
            plan.num_new_cached_tokens,
            strict=True,
        ):
            r = by_id[rid]
            if cached:
                r.num_cached_tokens = cached
            r.num_computed_tokens = start + n
            if not samples:
                r.transition(S.PREFILLING)
                self._mark_prefill(r)
                continue
            token = sampled[rid]
            tokens = r.token_ids
            tokens.append(token)
            r.token_times_ms.append(now_ms)
            new_tokens[rid] = token
            stop = r.stop
            if stop.is_stop(token):
                reason: FinishReason | None = FinishReason.STOP
            elif len(tokens) - r.num_prompt_tokens >= stop.max_tokens or len(tokens) >= max_len:
                reason = FinishReason.LENGTH
            else:
                reason = None
            if reason is not None:
                self.pool.free(rid)
                gone.add(rid)
                self._retire(r, S.FINISHED, reason, now_ms)
                finished.append(rid)
            elif r.status is not S.DECODING:
                r.transition(S.DECODING)
                self._clear_prefill(r)
        for cf in plan.finished:
            r = by_id[cf.request_id]
            gone.add(cf.request_id)
            if r in self._queue:  # timed out while waiting
                self._queue.remove(r)
            self._retire(r, S.FINISHED, cf.reason, now_ms)
            finished.append(cf.request_id)
            if cf.reason is FinishReason.TIMEOUT:
                self.num_timeouts += 1
        if gone:
            self.running = [r for r in self.running if r.request_id not in gone]
        if plan.swapped_out:  # paused turns whose KV moved to the host in this step
            self._to_host = [rid for rid in self._to_host if rid not in swapped]
        for rid in plan.dropped:
            by_id[rid].num_computed_tokens = 0
            if rid in self._to_host:
                self._to_host.remove(rid)
        self.num_swapped_out_blocks += len(plan.swap_out)
        self.num_swapped_in_blocks += len(plan.swap_in)
        self.pool.commit()
        self.host.commit()
        self._pending = None
        self.step_index += 1
        self._tell_policy(plan)
        return StepEvents(new_tokens, tuple(finished), plan.preempted)

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
        self.policy.on_commit(granted, self._backlog.keys())

    def _tenant_of(self, request_id: str) -> str:
        r = self.requests.get(request_id)
        if r is not None:
            return r.tenant
        return next(x.tenant for x in self.retired if x.request_id == request_id)

    # ------------------------------------------------------------------ planning
    def _plan(self, now_ms: float) -> StepPlan:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        reserve = cfg.prefill_reserve_tokens if self._prefill_starving() else 0
        plan = PlanBuilder(self.step_index)
        running = list(self.running)
        scheduled: set[str] = set()
        preempted: list[str] = []
        finished = self._timed_out(now_ms)
        copies: list[BlockCopy] = []
        swaps = _StepSwaps()
        self._move_paused_to_host(swaps)
        was_running = len(running)
        decoded: list[Request] = []
        prefill_left = budget

        # Decodes first, in admission order; then running prefills; then admission.
        decoders = [r for r in running if r.status is S.DECODING][: max(0, budget - reserve)]
        fast = (
            self.pool.append_decode_tokens(
                [r.request_id for r in decoders], [r.token_ids for r in decoders]
            )
            if self.fast_decode and decoders
            else None
        )
        if fast is not None:
            # Nobody needed preempting: exactly what the per-request loop below would do.
            copies.extend(fast)
            plan.add_decodes(
                [r.request_id for r in decoders], [r.num_computed_tokens for r in decoders]
            )
            scheduled.update(r.request_id for r in decoders)
            decoded = decoders
            budget -= len(decoders)
            phases: tuple[bool, ...] = (False,)
        else:
            phases = (True, False)
        for decode_phase in phases:
            if not decode_phase:
                prefill_left = self._prefill_cap(decoded, now_ms, reserve)
            for r in list(running):
                if r.request_id in scheduled or r.request_id in preempted:
                    continue
                is_decode = r.status is S.DECODING
                if is_decode != decode_phase:
                    continue
                avail = budget - reserve if is_decode else min(budget, prefill_left)
                remaining = r.num_tokens - r.num_computed_tokens
                n = 1 if is_decode else self._chunk(remaining, avail, r.num_computed_tokens)
                if n < 1 or avail < n:
                    continue
                if not self._make_room(r, n, running, scheduled, preempted, swaps):
                    if not scheduled and len(running) == 1:
                        # Alone, and still cannot grow: it never will in this pool.
                        self.pool.free(r.request_id)
                        running.remove(r)
                        finished.append(PlannedFinish(r.request_id, FinishReason.CAPACITY))
                    continue
                alloc = self.pool.allocate(r.request_id, r.token_ids, n, namespace=r.namespace)
                copies.extend(alloc.copies)
                start = alloc.start_position
                plan.add(r.request_id, start, n, start + n == r.num_tokens, not is_decode)
                scheduled.add(r.request_id)
                budget -= n
                if is_decode:
                    decoded.append(r)
                else:
                    prefill_left -= n

        timed_out = {f.request_id for f in finished}
        admit_budget = min(budget, prefill_left)
        admitted = self._admit(running, plan, admit_budget, was_running, copies, timed_out, swaps)
        return plan.build(
            preempted,
            admitted,
            finished,
            copies,
            swaps.out,
            swaps.in_,
            swaps.swapped_out,
            swaps.swapped_in,
            swaps.dropped,
        )

    def _prefill_cap(self, decoded: Sequence[Request], now_ms: float, reserve: int) -> int:
        """Prefill tokens this step may take so the tightest decode meets its TBT SLO.

        Example 3 of docs/ARCHITECTURE.md: with the decodes placed, the step's predicted time
        ``a + b*P + c*D (+ e*K)`` must end before the earliest next-token deadline
        (last token time + ``tbt_slo_ms``), so ``P <= (slack - a - c*D - e*K) / b``. A
        prefill starving past the reserve threshold still gets its reserved share.
        """
        cfg = self.config
        model = cfg.step_cost
        if cfg.tbt_slo_ms is None or model is None or not decoded:
            return cfg.max_num_batched_tokens
        last = min(r.token_times_ms[-1] if r.token_times_ms else now_ms for r in decoded)
        slack = last + cfg.tbt_slo_ms - now_ms
        kv_read = sum(r.num_computed_tokens + 1 for r in decoded) if model.e else 0
        spare = slack - model.step_ms(0, len(decoded), kv_read)
        return max(reserve, math.floor(spare / model.b) if spare > 0 else 0)

    def _timed_out(self, now_ms: float) -> list[PlannedFinish]:
        """Requests still waiting for their first admission past the queue timeout."""
        timeout = self.config.queue_timeout_ms
        if timeout is None:
            return []
        return [
            PlannedFinish(r.request_id, FinishReason.TIMEOUT)
            for r in self._queue.overdue(now_ms, timeout)
        ]

    def _admit(
        self,
        running: list[Request],
        plan: PlanBuilder,
        budget: int,
        was_running: int,
        copies: list[BlockCopy],
        skip: set[str],
        swaps: _StepSwaps,
    ) -> list[str]:
        cfg = self.config
        admitted: list[str] = []
        if not self._queue or not self.policy.admission_open(was_running):
            return admitted
        for r in self.policy.waiting_order(self._queue, self.step_index):
            if r.request_id in skip or not self.policy.may_admit(r, running):
                continue
            if len(running) >= cfg.max_num_seqs or budget < 1:
                break
            if r.status is S.SWAPPED:
                n = self._swap_in(r, running, plan, budget, swaps)
                if not n:
                    break  # FCFS, as below
                running.append(r)
                admitted.append(r.request_id)
                budget -= n
                continue
            hit = self.pool.lookup(r.token_ids, r.namespace) if cfg.enable_prefix_caching else None
            cached = hit.num_tokens if hit else 0
            n = self._chunk(r.num_tokens - cached, budget, cached)
            if n < 1:
                break
            if running or plan.request_ids:
                free = self.pool.num_free_blocks - cfg.watermark_blocks
                ok = self._admission_blocks(r, n, hit) <= free
            else:
                ok = self._fits_alone(r.request_id, n, hit, swaps)
            if not ok:
                break  # FCFS: later arrivals do not overtake the head of the queue
            alloc = self.pool.allocate(r.request_id, r.token_ids, n, hit=hit, namespace=r.namespace)
            copies.extend(alloc.copies)
            start = alloc.start_position
            plan.add(r.request_id, start, n, start + n == r.num_tokens, True, cached)
            running.append(r)
            admitted.append(r.request_id)
            budget -= n
        return admitted

    def _swap_in(
        self,
        r: Request,
        running: list[Request],
        plan: PlanBuilder,
        budget: int,
        swaps: _StepSwaps,
    ) -> int:
        """Admit a swapped request: restore its KV from the host and schedule its next
        tokens in the same step (the swap-in copies run before the forward). Returns
        the tokens scheduled, 0 if it does not fit now (nothing reserved then)."""
        rid = r.request_id
        stored = r.num_computed_tokens
        remaining = r.num_tokens - stored
        n = self._chunk(remaining, budget, stored)
        if n < 1:
            return 0
        if running or plan.request_ids:
            free = self.pool.num_free_blocks - self.config.watermark_blocks
            ok = self._admission_blocks(r, stored + n, None) <= free
        else:
            ok = self._fits_alone(rid, stored + n, None, swaps)
        if not ok:
            return 0
        self.pool.allocate(rid, r.token_ids, stored, namespace=r.namespace)
        host = self.host.release(rid)
        device = self.pool.block_table_view(rid)
        swaps.in_.extend(BlockCopy(h, d) for h, d in zip(host.block_ids, device, strict=True))
        swaps.swapped_in.append(rid)
        alloc = self.pool.allocate(rid, r.token_ids, n, namespace=r.namespace)
        assert not alloc.copies, "a swapped-in request shares no block"
        # A swapped decode has one token left (the last sampled one); anything longer
        # is a resumed agent turn's incremental prefill.
        plan.add(rid, stored, n, stored + n == r.num_tokens, remaining > 1)
        return n

    def _move_paused_to_host(self, swaps: _StepSwaps) -> None:
        """Paused turns retained on the host leave the device at the start of a step,
        so this step can already use their blocks (the swap-out copies run first)."""
        for rid in self._to_host:
            r = self.paused[rid]
            if self.host.can_hold(r.num_computed_tokens):
                self._swap_out(r, swaps)
            # else: the host pool is full; the KV stays on the device and the move is
            # retried next step.

    def _fits_alone(
        self, request_id: str, n: int, hit: PrefixHit | None, swaps: _StepSwaps
    ) -> bool:
        """Admission when nothing else runs: the watermark and the whole-request rules
        protect running requests' growth, and waiving them here guarantees progress, as
        does reclaiming paused turns' KV when the request still does not fit."""
        while not self.pool.can_allocate(request_id, n, hit):
            if not self._reclaim_paused(swaps):
                return False
        return True

    def _reclaim_paused(self, swaps: _StepSwaps) -> bool:
        """Free the device blocks of one paused turn (the longest paused): to the host
        if it has room, else dropped. False if no paused turn holds device blocks.

        A tool wait never blocks progress: paused KV is reclaimed before a running
        request is preempted, and before admission stalls with nothing running.
        """
        for rid, r in self.paused.items():
            if not self.pool.has_request(rid):
                continue  # its KV is on the host already, or was dropped
            if r.num_computed_tokens and self.host.can_hold(r.num_computed_tokens):
                self._swap_out(r, swaps)
            else:
                self.pool.free(rid)
                swaps.dropped.append(rid)
            return True
        return False

    def _should_swap(self, victim: Request) -> bool:
        """Recompute or swap a preemption victim (ref/core/swap.py documents the rule)."""
        cfg = self.config
        stored = victim.num_computed_tokens
        if cfg.preemption_mode is PreemptionMode.RECOMPUTE or not stored:
            return False
        if blocks_needed(victim.num_tokens, cfg.block_size) > cfg.num_blocks:
            return False  # it can never run again here: commit finishes it (capacity)
        if not self.host.can_hold(stored):
            return False
        if cfg.preemption_mode is PreemptionMode.AUTO:
            assert cfg.swap_cost is not None
            return cfg.swap_cost.prefers_swap(stored)
        return True

    def _swap_out(self, r: Request, swaps: _StepSwaps) -> None:
        rid = r.request_id
        device = self.pool.block_table_view(rid)
        swaps.out.extend(self.host.swap_out(rid, device, r.num_computed_tokens, r.token_ids))
        swaps.swapped_out.append(rid)
        self.pool.free(rid)

    def _chunk(self, remaining: int, avail: int, num_computed: int) -> int:
        if not self.config.enable_chunked_prefill:
            return remaining if remaining <= avail else 0
        return chunk_size(
            remaining,
            avail,
            self.config.block_size,
            self.config.align_chunks_to_blocks,
            num_computed,
        )

    def _admission_blocks(self, r: Request, n: int, hit: PrefixHit | None) -> int:
        """Free blocks a waiting request must find before it is admitted (CAP)."""
        cfg = self.config
        first = self.pool.blocks_to_allocate(r.request_id, n, hit)
        if cfg.admission is Admission.FIRST_CHUNK:
            return first
        if cfg.admission is Admission.PROMPT:
            total = r.num_tokens
        else:
            total = min(r.num_prompt_tokens + r.stop.max_tokens, cfg.max_len)
        held = len(hit.block_ids) if hit else 0
        fresh_first = max(0, blocks_needed(held * cfg.block_size + n, cfg.block_size) - held)
        revived = first - fresh_first  # cached blocks that leave the free queue on a hit
        return max(first, blocks_needed(total, cfg.block_size) - held + revived)

    def _make_room(
        self,
        r: Request,
        n: int,
        running: list[Request],
        scheduled: set[str],
        preempted: list[str],
        swaps: _StepSwaps,
    ) -> bool:
        """Preempt victims until ``r`` can get blocks for ``n`` tokens; False if impossible.

        Victims are running requests not yet scheduled in this step, chosen by the policy,
        each swapped out or dropped for recompute (:meth:`_should_swap`). Those preempted
        before failing stay preempted: their blocks are already free.
        """
        while not self.pool.can_allocate(r.request_id, n):
            if self._reclaim_paused(swaps):
                continue  # idle KV goes before running work is preempted
            candidates = [v for v in running if v is not r and v.request_id not in scheduled]
            victim = self.policy.pick_victim(candidates)
            if victim is None:
                return False
            if self._should_swap(victim):
                self._swap_out(victim, swaps)
            else:
                self.pool.free(victim.request_id)
            running.remove(victim)
            preempted.append(victim.request_id)
        return True

    def _prefill_starving(self) -> bool:
        cfg = self.config
        if not cfg.prefill_reserve_tokens:
            return False
        if not self._prefill_since:
            return False
        longest = next(iter(self._prefill_since.values()))  # the smallest: kept in order
        return self.step_index - longest >= cfg.prefill_reserve_after_steps

    # ------------------------------------------------------------------ helpers
    def validate_output(self, plan: StepPlan, sampled: Mapping[str, int]) -> None:
        """Raise :class:`BadExecutorOutput` unless every sampling request got a token."""
        get = sampled.get
        for rid, samples in zip(plan.request_ids, plan.samples, strict=True):
            if not samples:
                continue
            token = get(rid)
            if type(token) is not int or token < 0:  # bool is excluded on purpose
                raise BadExecutorOutput(
                    f"step {plan.step_index}: executor gave {token!r} as the sampled token of "
                    f"request {rid!r}; expected a non-negative int"
                )

    def _requeue(self, r: Request) -> None:
        # The queue keeps arrival order (seq), so a preempted request is not overtaken
        # by later arrivals; aging counts from now.
        r.queued_step = self.step_index
        self._queue.add(r)
        self._mark_prefill(r)

    def _mark_prefill(self, r: Request) -> None:
        """``r`` has prefill work left and got tokens (or was queued) in this step."""
        rid = r.request_id
        if rid not in self._prefill_since:
            self._backlog[r.tenant] += 1
        self._prefill_since[rid] = self.step_index
        self._prefill_since.move_to_end(rid)  # steps only grow: the order stays sorted

    def _clear_prefill(self, r: Request) -> None:
        if self._prefill_since.pop(r.request_id, None) is not None:
            self._backlog[r.tenant] -= 1
            assert self._backlog[r.tenant] >= 0, "a tenant counted as it was marked"
            if not self._backlog[r.tenant]:
                del self._backlog[r.tenant]

    def _end(
        self, request_id: str, status: RequestStatus, reason: FinishReason, now_ms: float, what: str
    ) -> None:
        self._require_boundary(what)
        r = self.requests.get(request_id)
        if r is None:
            raise UnknownRequest(request_id, what)
        if self.pool.has_request(request_id):
            self.pool.free(request_id)
        if self.host.has_request(request_id):
            self.host.release(request_id)
        if request_id in self._to_host:
            self._to_host.remove(request_id)
        if r in self.running:
            self.running.remove(r)
        elif request_id in self.paused:
            del self.paused[request_id]
        else:
            self._queue.remove(r)
        self._retire(r, status, reason, now_ms)

    def _retire(
        self, r: Request, status: RequestStatus, reason: FinishReason, now_ms: float
    ) -> None:
        r.transition(status)
        r.finish_reason = reason
        r.finished_ms = now_ms
        del self.requests[r.request_id]
        self._clear_prefill(r)
        self.retired.append(r)

    def _require_boundary(self, what: str) -> None:
        if self._pending is not None:
            raise StepInProgress(
                f"{what}: a step is in progress (schedule without commit/rollback)"
            )

    # ------------------------------------------------------------------ snapshots
    def snapshot(self, extra: Iterable[Request] = ()) -> EngineSnapshot:
        live = sorted([*self.requests.values(), *extra], key=lambda r: r.request_id)
        return EngineSnapshot(
            tuple(r.snapshot(self.config.max_len) for r in live),
            self.pool.snapshot(),
            self.host.snapshot() if self.host.num_blocks else None,
        )
