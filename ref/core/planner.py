"""Planning one step (stage 1 of "One step" in docs/ARCHITECTURE.md): which requests run,
how many tokens each, which blocks they get, and the preemptions.

Read aloud: queue timeouts, decodes first (one by one, in admission order), then running
prefills, then admission of waiting requests, under three separate limits (token budget,
max_num_seqs, free KV blocks). When a running request cannot get a block, the policy's
victim is preempted. Everything a step's planning collects goes into one
:class:`StepBuild`. Blocks are reserved inside the pool transaction the loop opened; no
request field changes here (ATOMIC): ``SchedulerLoop.commit`` applies the plan.

The attachments are asked at named points (ref/core/hooks.py): the suspension manager
at the start of a step, before a preemption, for a victim and for a waiting request it
holds; the proposal source for a decode's drafts; a decode strategy, when one is
plugged in, for every decode at once.
"""

from __future__ import annotations

from refserve.core.capacity import admission_blocks
from refserve.core.config import SchedulerConfig
from refserve.core.hooks import DecodeStrategy, ProposalSource, SuspensionManager
from refserve.core.plan import PlanBuilder, PlannedFinish, StepPlan
from refserve.core.policy import Policy, Room
from refserve.core.prefill import chunk, prefill_cap
from refserve.core.request import FinishReason, Request
from refserve.core.step_build import StepBuild
from refserve.core.waiting import WaitingQueue
from refserve.kv import BlockPool, PrefixHit
from refserve.spec.snapshot import RequestStatus


class Planner:
    def __init__(
        self,
        config: SchedulerConfig,
        policy: Policy,
        pool: BlockPool,
        queue: WaitingQueue,
        suspension: SuspensionManager,
        proposals: ProposalSource,
    ) -> None:
        self.config = config
        self.policy = policy
        self.pool = pool
        self.suspension = suspension
        self.proposals = proposals
        self._queue = queue  # the loop's: planning reads it, commit changes it

    def plan(
        self,
        step_index: int,
        running: list[Request],
        reserve: int,
        now_ms: float,
        *,
        decodes: DecodeStrategy | None = None,
    ) -> StepPlan:
        """The plan of step ``step_index``; ``running`` is a copy of the running list,
        ``reserve`` the tokens decodes leave to a starving prefill, ``decodes`` a faster
        path for the decodes (tried first)."""
        cfg = self.config
        step = StepBuild(
            PlanBuilder(step_index),
            running,
            cfg.max_num_batched_tokens,
            reserve,
            self._timed_out(now_ms),
        )
        self.suspension.move_to_host(step)
        self._displace(step)
        # Drafts are verified one request at a time: a strategy plans one token each.
        drafting = self.proposals.any()
        # A displacement took requests out of the batch the strategy mirrors.
        strategy = None if drafting or step.preempted else decodes
        bulk = strategy is not None and strategy.plan_decodes(step)
        if not bulk:
            self._decode_each(step, drafting=drafting)
        cap = prefill_cap(cfg, step.decoded, now_ms, reserve)
        # Every running request decoding: no running prefill to walk.
        only_decodes = bulk and strategy is not None and strategy.all_decoding()
        prefill_left = cap if only_decodes else self._prefill_running(step, cap)
        step.budget = min(step.budget, prefill_left)  # admission is prefill too
        self._admit(step)
        return step.build()

    def _displace(self, step: StepBuild) -> None:
        """Running requests the policy sets aside for waiting work it ranks higher
        (a preemptive policy's; the others name none), before anything is planned."""
        if not step.running:
            return
        room = Room(
            self.pool.num_free_blocks,
            self.config.max_num_seqs - len(step.running),
            self.suspension.host_room(),
            step.budget,
            self.pool.num_table_blocks,
        )
        for d in self.policy.displace(step.running, room, step.plan.step_index):
            if d.park:
                self.suspension.park(d.request, step)
            else:
                self.suspension.evict(d.request, step)
            step.running.remove(d.request)
            step.preempted.append(d.request.request_id)

    def _decode_each(self, step: StepBuild, *, drafting: bool) -> None:
        """The reference decode path: in admission order, preempting as needed."""
        decoding = [r for r in step.running if r.status is RequestStatus.DECODING]
        for i, r in enumerate(decoding):
            if r.request_id in step.preempted or step.budget - step.reserve < 1:
                continue
            drafts = (
                self.proposals.drafts_for(r, step.budget - step.reserve, len(decoding) - i - 1)
                if drafting
                else ()
            )
            if self._place(step, r, 1, is_prefill=False, drafts=drafts):
                step.decoded.append(r)

    def _prefill_running(self, step: StepBuild, cap: int) -> int:
        """Running prefills in admission order, at most ``cap`` tokens; the cap left."""
        for r in list(step.running):
            if r.status is RequestStatus.DECODING or r.request_id in step.preempted:
                continue
            computed = r.num_computed_tokens
            n = chunk(self.config, r.num_tokens - computed, min(step.budget, cap), computed)
            if n >= 1 and self._place(step, r, n, is_prefill=True):
                cap -= n
        return cap

    def _place(
        self,
        step: StepBuild,
        r: Request,
        n: int,
        *,
        is_prefill: bool,
        drafts: tuple[int, ...] = (),
    ) -> bool:
        """Reserve blocks for ``n`` tokens of running ``r`` and its ``drafts`` after them,
        preempting victims if needed; False if it cannot grow now. Alone and still
        unable, it never will in this pool: the plan finishes it (capacity)."""
        rid = r.request_id
        total = n + len(drafts)
        if not self._make_room(step, r, total):
            # Alone: every other running request is a victim by now, and a request
            # given tokens is never one, so nothing else is scheduled either.
            if len(step.running) == 1:
                self.pool.free(rid)
                step.running.remove(r)
                step.finished.append(PlannedFinish(rid, FinishReason.CAPACITY))
            return False
        tokens = [*r.token_ids, *drafts] if drafts else r.token_ids
        alloc = self.pool.allocate(rid, tokens, total, namespace=r.namespace)
        step.copies.extend(alloc.copies)
        start = alloc.start_position
        step.plan.add(rid, start, total, start + n == r.num_tokens, is_prefill, drafts=drafts)
        step.scheduled.add(rid)
        step.budget -= total
        return True

    def _timed_out(self, now_ms: float) -> list[PlannedFinish]:
        """Requests still waiting for their first admission past the queue timeout."""
        timeout = self.config.queue_timeout_ms
        if timeout is None:
            return []
        return [
            PlannedFinish(r.request_id, FinishReason.TIMEOUT)
            for r in self._queue.overdue(now_ms, timeout)
        ]

    def _admit(self, step: StepBuild) -> None:
        """Waiting requests in the policy's order while the sequence limit, the budget
        and the free blocks allow; FCFS: later arrivals do not overtake the head of the
        queue when it does not fit."""
        if not self._queue or not self.policy.admission_open(step.was_running):
            return
        timed_out = {f.request_id for f in step.finished}
        for r in self.policy.waiting_order(self._queue, step.plan.step_index):
            if r.request_id in timed_out or not self.policy.may_admit(r, step.running):
                continue
            if len(step.running) >= self.config.max_num_seqs or step.budget < 1:
                break
            if not self._admit_one(step, r):
                break
            step.running.append(r)
            step.admitted.append(r.request_id)

    def _admit_one(self, step: StepBuild, r: Request) -> bool:
        """Schedule the first tokens of waiting ``r`` (from its prefix-cache hit, or
        from the KV the suspension manager kept); False, nothing reserved, if they do
        not fit now."""
        cfg = self.config
        held = self.suspension.readmit(r, step, lambda n, h: self._admission_fits(step, r, n, h))
        if held is not None:  # its KV was kept aside: the manager brings it back
            return held
        hit = self.pool.lookup(r.token_ids, r.namespace) if cfg.enable_prefix_caching else None
        cached = hit.num_tokens if hit else 0
        n = chunk(cfg, r.num_tokens - cached, step.budget, cached)
        if n < 1 or not self._admission_fits(step, r, n, hit):
            return False
        alloc = self.pool.allocate(r.request_id, r.token_ids, n, hit=hit, namespace=r.namespace)
        step.copies.extend(alloc.copies)
        start = alloc.start_position
        step.plan.add(r.request_id, start, n, start + n == r.num_tokens, True, cached)
        step.budget -= n
        return True

    def _admission_fits(self, step: StepBuild, r: Request, n: int, hit: PrefixHit | None) -> bool:
        """The admission-fit check (CAP, example 2e): with anything else in the step, the
        blocks ``admission_blocks`` asks must be free above the watermark."""
        if step.running:  # (every request in the plan is running)
            free = self.pool.num_free_blocks - self.config.watermark_blocks
            return admission_blocks(self.config, self.pool, r, n, hit) <= free
        return self._fits_alone(r.request_id, n, hit, step)

    def _fits_alone(self, request_id: str, n: int, hit: PrefixHit | None, step: StepBuild) -> bool:
        """Admission when nothing else runs: the watermark and the whole-request rules
        protect running requests' growth, and waiving them here guarantees progress, as
        does reclaiming idle KV (the suspension manager's) when the request still does not fit."""
        while not self.pool.can_allocate(request_id, n, hit):
            if not self.suspension.reclaim(step):
                return False
        return True

    def _make_room(self, step: StepBuild, r: Request, n: int) -> bool:
        """Preempt victims until ``r`` can get blocks for ``n`` tokens; False if impossible.

        Victims are running requests not yet scheduled in this step, chosen by the policy,
        each swapped out or dropped for recompute (``SuspensionManager.evict``). Those preempted
        before failing stay preempted: their blocks are already free.
        """
        while not self.pool.can_allocate(r.request_id, n):
            if self.suspension.reclaim(step):
                continue  # idle KV goes before running work is preempted
            candidates = [
                v for v in step.running if v is not r and not step.is_scheduled(v.request_id)
            ]
            victim = self.policy.pick_victim(candidates)
            if victim is None:
                return False
            self.suspension.evict(victim, step)
            step.running.remove(victim)
            step.preempted.append(victim.request_id)
        return True
