"""The iteration-level scheduler: one ``schedule()`` per step, one ``commit()`` after it.

Read aloud, a step is: decodes first, then running prefills, then admission of waiting
requests, under three separate limits (token budget, max_num_seqs, free KV blocks). When a
running request cannot get a block, the policy's victim is preempted by recompute. The
plan reserves blocks inside a pool transaction; ``commit`` applies the request changes
and closes it, ``rollback`` undoes the reservation (ATOMIC invariant): until commit, no
request field has changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ref.config import Admission, SchedulerConfig
from ref.errors import (
    DuplicateRequest,
    ExceedsCapacity,
    InvalidArgument,
    RefserveError,
    UnknownRequest,
)
from ref.kv import BlockCopy, BlockPool, PrefixHit
from ref.plan import CapacityFinish, ScheduledChunk, StepPlan
from ref.policy import Policy, make_policy
from ref.request import FinishReason, Request
from spec.arith import blocks_needed, chunk_size
from spec.snapshot import EngineSnapshot, RequestStatus

S = RequestStatus


class StepInProgress(RefserveError):
    """An operation that needs a step boundary was called between schedule and commit."""


class BadExecutorOutput(RefserveError):
    """The executor's output does not match the plan (a sampled token is missing, ...)."""


@dataclass(frozen=True)
class StepEvents:
    """What a commit changed, for metrics and streaming."""

    new_tokens: Mapping[str, int]
    finished: tuple[str, ...]
    preempted: tuple[str, ...]


class Scheduler:
    def __init__(self, config: SchedulerConfig, policy: Policy | None = None) -> None:
        self.config = config
        self.policy = policy if policy is not None else make_policy(config.policy)
        self.pool = BlockPool(
            config.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}  # live: not finished, not aborted
        self.waiting: list[Request] = []  # arrival order (seq); preempted ones keep theirs
        self.running: list[Request] = []  # admission order
        self.step_index = 0
        self._seq = 0
        self._pending: StepPlan | None = None
        self._pending_hits: dict[str, PrefixHit] = {}
        self._waiting_since: dict[str, int] = {}
        self.retired: list[Request] = []  # finished or aborted since the last commit

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
        max_len = self.config.max_model_len
        if request.num_prompt_tokens >= max_len:
            raise InvalidArgument(
                f"add_request: request {rid!r} prompt has {request.num_prompt_tokens} tokens; "
                f"max_model_len is {max_len}, leaving no room for an output token"
            )
        need = blocks_needed(request.num_prompt_tokens, self.config.block_size)
        if need > self.config.num_blocks:
            raise ExceedsCapacity(rid, need, self.config.num_blocks)
        request.seq = self._seq
        self._seq += 1
        self.requests[rid] = request
        self.waiting.append(request)
        self._waiting_since[rid] = self.step_index

    def abort(self, request_id: str, now_ms: float = 0.0) -> None:
        """Abort in any live state; every block the request held returns to the pool."""
        self._require_boundary("abort")
        r = self.requests.get(request_id)
        if r is None:
            raise UnknownRequest(request_id, "abort")
        if self.pool.has_request(request_id):
            self.pool.free(request_id)
        if r in self.running:
            self.running.remove(r)
        else:
            self.waiting.remove(r)
        self._retire(r, S.ABORTED, FinishReason.ABORT, now_ms)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the step
    def schedule(self, now_ms: float = 0.0) -> StepPlan:
        """Plan one step and reserve its KV blocks (undone by :meth:`rollback`)."""
        self._require_boundary("schedule")
        self.retired = []
        self.pool.begin()
        try:
            plan = self._plan()
        except BaseException:
            self.pool.rollback()
            self._pending_hits.clear()
            raise
        self._pending = plan
        self._plan_start_ms = now_ms
        return plan

    def rollback(self) -> None:
        """Undo the pending plan's reservations: the state is exactly as before schedule."""
        assert self._pending is not None, "rollback without a pending plan"
        self.pool.rollback()
        self._pending = None
        self._pending_hits.clear()

    def commit(self, plan: StepPlan, sampled: Mapping[str, int], now_ms: float = 0.0) -> StepEvents:
        """Apply a step's results: counters, sampled tokens, stops, preemptions, admissions."""
        assert plan is self._pending, "commit of a plan that is not pending"
        self.validate_output(plan, sampled)
        by_id = self.requests
        for rid in plan.preempted:
            r = by_id[rid]
            self.running.remove(r)
            r.transition(S.PREEMPTED)
            r.num_computed_tokens = 0
            r.num_preemptions += 1
            self._requeue(r)
        for rid in plan.admitted:
            r = by_id[rid]
            self.waiting.remove(r)
            self.running.append(r)
            self._waiting_since.pop(rid, None)
            if r.admitted_ms is None:
                r.admitted_ms = self._plan_start_ms
        new_tokens: dict[str, int] = {}
        finished: list[str] = []
        for c in plan.chunks:
            r = by_id[c.request_id]
            if c.num_new_cached_tokens:
                r.num_cached_tokens = c.num_new_cached_tokens
            r.num_computed_tokens = c.start + c.num_new_tokens
            if not c.samples:
                r.transition(S.PREFILLING)
                continue
            token = sampled[c.request_id]
            r.token_ids.append(token)
            r.token_times_ms.append(now_ms)
            new_tokens[c.request_id] = token
            reason = self._stop_reason(r, token)
            if reason is None:
                r.transition(S.DECODING)
            else:
                self.pool.free(r.request_id)
                self.running.remove(r)
                self._retire(r, S.FINISHED, reason, now_ms)
                finished.append(r.request_id)
        for cf in plan.finished:
            r = by_id[cf.request_id]
            if r in self.running:
                self.running.remove(r)
            else:
                self.waiting.remove(r)
            self._retire(r, S.FINISHED, cf.reason, now_ms)
            finished.append(r.request_id)
        self.pool.commit()
        self._pending = None
        self._pending_hits.clear()
        self.step_index += 1
        return StepEvents(new_tokens, tuple(finished), plan.preempted)

    # ------------------------------------------------------------------ planning
    def _plan(self) -> StepPlan:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        reserve = cfg.prefill_reserve_tokens if self._prefill_starving() else 0
        running = list(self.running)
        chunks: list[ScheduledChunk] = []
        scheduled: set[str] = set()
        preempted: list[str] = []
        finished: list[CapacityFinish] = []
        copies: list[BlockCopy] = []
        was_running = len(self.running)

        # Decodes first, then running prefills, each in admission order.
        for decode_phase in (True, False):
            for r in list(running):
                if r.request_id in scheduled or r not in running:
                    continue
                is_decode = r.status is S.DECODING
                if is_decode != decode_phase:
                    continue
                avail = budget - reserve if is_decode else budget
                remaining = r.num_tokens - r.num_computed_tokens
                n = 1 if is_decode else self._chunk(r, remaining, avail, r.num_computed_tokens)
                if n < 1 or avail < n:
                    continue
                if not self._make_room(r, n, running, scheduled, preempted):
                    if not scheduled and len(running) == 1:
                        # Alone, and still cannot grow: it never will in this pool.
                        self.pool.free(r.request_id)
                        running.remove(r)
                        finished.append(CapacityFinish(r.request_id, FinishReason.CAPACITY))
                    continue
                alloc = self.pool.allocate(r.request_id, r.token_ids, n, namespace=r.namespace)
                copies.extend(alloc.copies)
                chunks.append(
                    ScheduledChunk(
                        r.request_id,
                        alloc.start_position,
                        n,
                        alloc.start_position + n == r.num_tokens,
                        not is_decode,
                    )
                )
                scheduled.add(r.request_id)
                budget -= n

        admitted = self._admit(running, chunks, scheduled, budget, was_running, copies)
        return StepPlan(
            self.step_index,
            tuple(chunks),
            tuple(preempted),
            tuple(admitted),
            tuple(finished),
            tuple(copies),
        )

    def _admit(
        self,
        running: list[Request],
        chunks: list[ScheduledChunk],
        scheduled: set[str],
        budget: int,
        was_running: int,
        copies: list[BlockCopy],
    ) -> list[str]:
        cfg = self.config
        admitted: list[str] = []
        if not self.policy.admission_open(was_running):
            return admitted
        for r in self.policy.waiting_order(self.waiting):
            if len(running) >= cfg.max_num_seqs or budget < 1:
                break
            hit = self.pool.lookup(r.token_ids, r.namespace) if cfg.enable_prefix_caching else None
            cached = hit.num_tokens if hit else 0
            n = self._chunk(r, r.num_tokens - cached, budget, cached)
            if n < 1:
                break
            if running or chunks:
                ok = (
                    self._admission_blocks(r, n, hit)
                    <= self.pool.num_free_blocks - cfg.watermark_blocks
                )
            else:
                # Nothing else runs: the watermark and the whole-request rules protect
                # running requests' growth, and waiving them here guarantees progress.
                ok = self.pool.can_allocate(r.request_id, n, hit)
            if not ok:
                break  # FCFS: later arrivals do not overtake the head of the queue
            alloc = self.pool.allocate(r.request_id, r.token_ids, n, hit=hit, namespace=r.namespace)
            copies.extend(alloc.copies)
            chunks.append(
                ScheduledChunk(
                    r.request_id,
                    alloc.start_position,
                    n,
                    alloc.start_position + n == r.num_tokens,
                    True,
                    cached,
                )
            )
            scheduled.add(r.request_id)
            running.append(r)
            admitted.append(r.request_id)
            budget -= n
        return admitted

    def _chunk(self, r: Request, remaining: int, avail: int, num_computed: int) -> int:
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
            total = min(r.num_prompt_tokens + r.stop.max_tokens, cfg.max_model_len)
        held = len(hit.block_ids) if hit else 0
        fresh_first = max(0, blocks_needed(held * cfg.block_size + n, cfg.block_size) - held)
        revived = first - fresh_first  # cached blocks that leave the free queue on a hit
        return max(first, blocks_needed(total, cfg.block_size) - held + revived)

    def _make_room(
        self, r: Request, n: int, running: list[Request], scheduled: set[str], preempted: list[str]
    ) -> bool:
        """Preempt victims until ``r`` can get blocks for ``n`` tokens; False if impossible.

        Victims are running requests not yet scheduled in this step, chosen by the policy.
        Those preempted before failing stay preempted: their blocks are already free.
        """
        while not self.pool.can_allocate(r.request_id, n):
            candidates = [v for v in running if v is not r and v.request_id not in scheduled]
            victim = self.policy.pick_victim(candidates)
            if victim is None:
                return False
            self.pool.free(victim.request_id)
            running.remove(victim)
            preempted.append(victim.request_id)
        return True

    def _prefill_starving(self) -> bool:
        cfg = self.config
        if not cfg.prefill_reserve_tokens:
            return False
        return any(
            self.step_index - s >= cfg.prefill_reserve_after_steps
            for s in self._waiting_since.values()
        )

    # ------------------------------------------------------------------ helpers
    def _stop_reason(self, r: Request, token: int) -> FinishReason | None:
        stop = r.stop
        if not stop.ignore_eos and stop.eos_token_id is not None and token == stop.eos_token_id:
            return FinishReason.STOP
        if token in stop.stop_token_ids:
            return FinishReason.STOP
        if r.num_output_tokens >= stop.max_tokens or r.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def validate_output(self, plan: StepPlan, sampled: Mapping[str, int]) -> None:
        """Raise :class:`BadExecutorOutput` unless every sampling request got a token."""
        for c in plan.chunks:
            if not c.samples:
                continue
            token = sampled.get(c.request_id)
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise BadExecutorOutput(
                    f"step {plan.step_index}: executor gave {token!r} as the sampled token of "
                    f"request {c.request_id!r}; expected a non-negative int"
                )

    def _requeue(self, r: Request) -> None:
        # Keep arrival order so a preempted request is not overtaken by later arrivals.
        i = 0
        while i < len(self.waiting) and self.waiting[i].seq < r.seq:
            i += 1
        self.waiting.insert(i, r)
        self._waiting_since[r.request_id] = self.step_index

    def _retire(
        self, r: Request, status: RequestStatus, reason: FinishReason, now_ms: float
    ) -> None:
        r.transition(status)
        r.finish_reason = reason
        r.finished_ms = now_ms
        del self.requests[r.request_id]
        self._waiting_since.pop(r.request_id, None)
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
            tuple(r.snapshot(self.config.max_model_len) for r in live), self.pool.snapshot()
        )
