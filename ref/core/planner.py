"""Planning one step (stage 1 of "One step" in docs/ARCHITECTURE.md): which requests run,
how many tokens each, which blocks they get, the preemptions and the swap copies.

Read aloud: queue timeouts, paused KV bound for the host, decodes first (all at once when
nobody needs preempting, else one by one), then running prefills, then admission of
waiting requests, under three separate limits (token budget, max_num_seqs, free KV
blocks). When a running request cannot get a block, the policy's victim is preempted.
Everything a step's planning collects goes into one :class:`StepDraft`. Blocks are
reserved inside the pool transaction the scheduler opened; no request field changes
here (ATOMIC): ``Scheduler.commit`` applies the plan.
"""

from __future__ import annotations

from collections.abc import Mapping

from refserve.core.batch import PersistentBatch
from refserve.core.capacity import admission_blocks
from refserve.core.config import SchedulerConfig
from refserve.core.draft import StepDraft
from refserve.core.plan import PlanBuilder, PlannedFinish, StepPlan
from refserve.core.policy import Policy
from refserve.core.prefill import chunk, prefill_cap
from refserve.core.request import FinishReason, Request
from refserve.core.suspend import Suspension
from refserve.core.waiting import WaitingQueue
from refserve.kv import BlockPool, PrefixHit
from refserve.spec.snapshot import RequestStatus

S = RequestStatus


class Planner:
    def __init__(
        self,
        config: SchedulerConfig,
        policy: Policy,
        pool: BlockPool,
        suspension: Suspension,
        queue: WaitingQueue,
        batch: PersistentBatch,
    ) -> None:
        self.config = config
        self.batch = batch  # the running requests' arrays, for the bulk decode path
        self.policy = policy
        self.pool = pool
        self._suspend = suspension
        self._queue = queue  # the scheduler's: planning reads it, commit changes it

    def plan(
        self,
        step_index: int,
        running: list[Request],
        reserve: int,
        now_ms: float,
        *,
        fast: bool,
        proposals: Mapping[str, tuple[int, ...]] | None = None,
    ) -> StepPlan:
        """The plan of step ``step_index``; ``running`` is a copy of the running list,
        ``reserve`` the tokens decodes leave to a starving prefill, ``fast`` allows the
        bulk decode path, ``proposals`` are the draft tokens proposed for decodes."""
        cfg = self.config
        draft = StepDraft(
            PlanBuilder(step_index),
            running,
            cfg.max_num_batched_tokens,
            reserve,
            self._timed_out(now_ms),
        )
        if proposals:
            draft.proposals = proposals
        self._suspend.move_to_host(draft)
        # Drafts are verified one request at a time: the bulk path plans one token each.
        bulk = fast and not draft.proposals and self._decode_bulk(draft)
        if not bulk:
            self._decode_each(draft)
        cap = prefill_cap(cfg, draft.decoded, now_ms, reserve)
        # Every running request decoding: no running prefill to walk.
        prefill_left = (
            cap if bulk and self.batch.all_decoding() else self._prefill_running(draft, cap)
        )
        draft.budget = min(draft.budget, prefill_left)  # admission is prefill too
        self._admit(draft)
        return draft.build()

    def _decode_bulk(self, draft: StepDraft) -> bool:
        """Every running decode in one pool call, when nobody needs preempting: exactly
        what :meth:`_decode_each` would plan. False (nothing planned) otherwise.

        The persistent batch (ref/core/batch.py) knows each request's KV length, last
        token and block state, so only the requests that need a block enter Python."""
        batch = self.batch
        assert len(draft.running) == len(batch), "the batch mirrors the running list"
        batch.sync_tables(self.pool)
        rows = batch.decode_rows(draft.budget - draft.reserve)
        if rows is None:
            return False
        slots = rows.slots
        caching = self.pool.enable_prefix_caching
        fills = batch.fills_block(rows) if caching else []
        filled = batch.filled_blocks(rows, fills) if caching else None
        growing = batch.needs_block(rows, self.pool)
        tokens = batch.last_token[rows.at].tolist()
        run = batch.decode_run(rows, self.pool)
        growth = run.append_decodes(tokens, growing, fills, filled)
        if growth is None:
            return False
        batch.grew(rows, growing, growth)
        draft.copies.extend(growth.copies)
        draft.plan.add_decodes(rows, rows.positions.tolist())
        draft.bulk_ids = rows.request_ids
        draft.decoded = rows.requests
        draft.budget -= len(slots)
        return True

    def _decode_each(self, draft: StepDraft) -> None:
        """The reference decode path: in admission order, preempting as needed."""
        decoding = [r for r in draft.running if r.status is S.DECODING]
        for i, r in enumerate(decoding):
            if r.request_id in draft.preempted or draft.budget - draft.reserve < 1:
                continue
            drafts = self._drafts(draft, r, len(decoding) - i - 1) if draft.proposals else ()
            if self._place(draft, r, 1, is_prefill=False, drafts=drafts):
                draft.decoded.append(r)

    def _drafts(self, draft: StepDraft, r: Request, later: int) -> tuple[int, ...]:
        """The drafts ``r`` verifies this step: its proposal cut to what it may still
        emit (a verification emits up to one token more than its drafts) and to the
        budget left, and dropped unless the free blocks cover their slots and still one
        block for each of the ``later`` decodes: a draft never costs a decode its place
        (docs/SPECULATIVE.md, "Scheduling")."""
        drafts = draft.proposals.get(r.request_id, ())
        room = min(r.stop.max_tokens - r.num_output_tokens, self.config.max_len - r.num_tokens)
        cut = draft_count(len(drafts), room, draft.budget - draft.reserve)
        if not cut:
            return ()
        need = self.pool.blocks_to_allocate(r.request_id, 1 + cut)
        return drafts[:cut] if need + later <= self.pool.num_free_blocks else ()

    def _prefill_running(self, draft: StepDraft, cap: int) -> int:
        """Running prefills in admission order, at most ``cap`` tokens; the cap left."""
        for r in list(draft.running):
            if r.status is S.DECODING or r.request_id in draft.preempted:
                continue
            computed = r.num_computed_tokens
            n = chunk(self.config, r.num_tokens - computed, min(draft.budget, cap), computed)
            if n >= 1 and self._place(draft, r, n, is_prefill=True):
                cap -= n
        return cap

    def _place(
        self,
        draft: StepDraft,
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
        if not self._make_room(draft, r, total):
            # Alone: every other running request is a victim by now, and a request
            # given tokens is never one, so nothing else is scheduled either.
            if len(draft.running) == 1:
                self.pool.free(rid)
                draft.running.remove(r)
                draft.finished.append(PlannedFinish(rid, FinishReason.CAPACITY))
            return False
        tokens = [*r.token_ids, *drafts] if drafts else r.token_ids
        alloc = self.pool.allocate(rid, tokens, total, namespace=r.namespace)
        draft.copies.extend(alloc.copies)
        start = alloc.start_position
        draft.plan.add(rid, start, total, start + n == r.num_tokens, is_prefill, drafts=drafts)
        draft.scheduled.add(rid)
        draft.budget -= total
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

    def _admit(self, draft: StepDraft) -> None:
        """Waiting requests in the policy's order while the sequence limit, the budget
        and the free blocks allow; FCFS: later arrivals do not overtake the head of the
        queue when it does not fit."""
        if not self._queue or not self.policy.admission_open(draft.was_running):
            return
        timed_out = {f.request_id for f in draft.finished}
        for r in self.policy.waiting_order(self._queue, draft.plan.step_index):
            if r.request_id in timed_out or not self.policy.may_admit(r, draft.running):
                continue
            if len(draft.running) >= self.config.max_num_seqs or draft.budget < 1:
                break
            if not self._admit_one(draft, r):
                break
            draft.running.append(r)
            draft.admitted.append(r.request_id)

    def _admit_one(self, draft: StepDraft, r: Request) -> bool:
        """Schedule the first tokens of waiting ``r`` (a swapped one is swapped in, any
        other starts from its prefix-cache hit); False, nothing reserved, if they do not
        fit now."""
        cfg = self.config
        if r.status is S.SWAPPED:
            stored = r.num_computed_tokens
            n = chunk(cfg, r.num_tokens - stored, draft.budget, stored)
            if n < 1 or not self._admission_fits(draft, r, stored + n, None):
                return False
            self._suspend.swap_in(r, n, draft)
        else:
            hit = self.pool.lookup(r.token_ids, r.namespace) if cfg.enable_prefix_caching else None
            cached = hit.num_tokens if hit else 0
            n = chunk(cfg, r.num_tokens - cached, draft.budget, cached)
            if n < 1 or not self._admission_fits(draft, r, n, hit):
                return False
            alloc = self.pool.allocate(r.request_id, r.token_ids, n, hit=hit, namespace=r.namespace)
            draft.copies.extend(alloc.copies)
            start = alloc.start_position
            draft.plan.add(r.request_id, start, n, start + n == r.num_tokens, True, cached)
        draft.budget -= n
        return True

    def _admission_fits(self, draft: StepDraft, r: Request, n: int, hit: PrefixHit | None) -> bool:
        """The admission-fit check (CAP, example 2e): with anything else in the step, the
        blocks ``admission_blocks`` asks must be free above the watermark."""
        if draft.running:  # (every request in the plan is running)
            free = self.pool.num_free_blocks - self.config.watermark_blocks
            return admission_blocks(self.config, self.pool, r, n, hit) <= free
        return self._fits_alone(r.request_id, n, hit, draft)

    def _fits_alone(self, request_id: str, n: int, hit: PrefixHit | None, draft: StepDraft) -> bool:
        """Admission when nothing else runs: the watermark and the whole-request rules
        protect running requests' growth, and waiving them here guarantees progress, as
        does reclaiming paused turns' KV when the request still does not fit."""
        while not self.pool.can_allocate(request_id, n, hit):
            if not self._suspend.reclaim(draft):
                return False
        return True

    def _make_room(self, draft: StepDraft, r: Request, n: int) -> bool:
        """Preempt victims until ``r`` can get blocks for ``n`` tokens; False if impossible.

        Victims are running requests not yet scheduled in this step, chosen by the policy,
        each swapped out or dropped for recompute (``Suspension.evict``). Those preempted
        before failing stay preempted: their blocks are already free.
        """
        while not self.pool.can_allocate(r.request_id, n):
            if self._suspend.reclaim(draft):
                continue  # idle KV goes before running work is preempted
            candidates = [
                v for v in draft.running if v is not r and not draft.is_scheduled(v.request_id)
            ]
            victim = self.policy.pick_victim(candidates)
            if victim is None:
                return False
            self._suspend.evict(victim, draft)
            draft.running.remove(victim)
            draft.preempted.append(victim.request_id)
        return True


def draft_count(num_proposed: int, room: int, budget_left: int) -> int:
    """Drafts a decode may verify this step: ``num_proposed`` cut so the verification
    (its drafts plus the bonus token, docs/SPECULATIVE.md "Scheduling") stays within the
    ``room`` tokens the request may still emit (KVLEN: outputs never exceed
    ``max_tokens`` / ``max_model_len``) and the ``budget_left`` tokens of the step's
    budget (TOKEN); docs/ARCHITECTURE.md, "Verification practice".

    The contract: never more drafts than proposed; any kept fit both limits with their
    bonus token; and the cut is the largest such (one more draft would break a limit).

    pre: num_proposed >= 0
    post: 0 <= __return__ <= num_proposed
    post: __return__ == 0 or (__return__ + 1 <= room and __return__ + 1 <= budget_left)
    post: __return__ == num_proposed or __return__ + 2 > room or __return__ + 2 > budget_left
    """
    return max(min(num_proposed, room - 1, budget_left - 1), 0)
