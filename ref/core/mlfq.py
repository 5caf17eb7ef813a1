"""Skip-join multi-level feedback queue: preemption at token boundaries by attained service.

Two things set LLM serving apart from the textbook MLFQ: nobody knows how many tokens a
request will generate (so no shortest-job-first), and a preempted request's state, its
K/V, is large. The policy answers the first with levels of growing quanta and the
second by moving the K/V of those it sets aside to the host pool.

- **Levels.** ``num_queues`` queues, level 0 the highest. Level ``i`` has a quantum of
  ``base_quantum_ms * quantum_growth**i`` ms of service; the last level's is unbounded.
  A request's service is priced by the settings' cost model on its own tokens of each
  step it runs in: ``a + b*P`` for a prefill chunk of ``P`` tokens, ``a + c`` for a
  decode (``+ b`` per draft verified).
- **Skip-join.** A new request joins the highest level whose quantum covers its first
  chunk's predicted time, so a long prompt does not first push every short request
  aside at level 0 only to be demoted after one step (``skip_join=False``: everyone
  joins at level 0, the classic MLFQ, for the ablation).
- **Demotion.** A request that used up its level's quantum drops one level at the end of
  that step; its service in the new level starts at 0.
- **Promotion (the starvation bound).** A request that has waited ``starvation_steps``
  steps since it was last queued, in a level below 0, goes to level 0 at the end of a
  step. Within a level the order is arrival order (seq), so a promoted request is
  behind only the finitely many level-0 requests that arrived before it.
- **Order and displacement.** Admission reads the waiting queue level by level, arrival
  order within one. At the start of each step, while the first waiting request is at a
  higher level than some running request and lacks a seat or the blocks of its first
  chunk, the lowest running request (lowest level, then latest arrival) is preempted
  (:meth:`SkipJoinMlfq.displace`). A request that has just (re)joined the batch is not
  displaced until it has been served its quantum (no thrash; at the last level, whose
  quantum is unbounded, the one above it: else a request there, a long prompt's place,
  would hold its seat to the end); a request short of a block
  still preempts through the spine, the policy picking the victim the same way.
- **Proactive K/V movement** (``proactive_swap``). A displaced request is expected back,
  so its K/V goes to the host pool when the pool has room (else it recomputes, the
  fallback; with ``proactive_swap=False`` it is preempted by the preemption mode, like
  any victim); and when the running requests' own next tokens would need more blocks than
  are free, the lowest running request moves to the host at the start of the step
  (``headroom``), before the planner meets the shortage and has to drop a victim. The
  blocks set aside for the waiting heads count against a running request only when
  they are for a higher level than its own: two requests of one level never take turns
  through a headroom swap either (the conformance suite's ``level-preemption`` rule).
  Swapped requests come back through admission at their turn, their copy-in run before
  the step's forward.

The policy owns its books (:class:`MlfqBooks`, a record per request) and changes them
only when a step commits (:meth:`SkipJoinMlfq.on_step`): planning reads them, so a
rolled-back plan leaves them as they were. :meth:`SkipJoinMlfq.snapshot` freezes them
for the rules in spec/mlfq.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass

from refserve.core.config import SchedulerConfig
from refserve.core.mlfq_settings import MlfqSettings
from refserve.core.plan import StepPlan
from refserve.core.policy import Displacement, Room
from refserve.core.prefill import chunk
from refserve.core.request import Request
from refserve.core.waiting import WaitingQueue
from refserve.spec.arith import block_offset, blocks_needed, starts_block
from refserve.spec.groups import layout_blocks
from refserve.spec.mlfq import DisplacedRecord, MlfqSnapshot, QueuedRecord, RunningRecord
from refserve.spec.snapshot import RequestStatus


@dataclass(frozen=True)
class MlfqChoice:
    """One displacement as the request's metrics report it: the choice (its K/V to the
    host, or dropped to recompute) and its inputs: why, for whom, the request's level and
    K/V tokens at the step's start, and the host pool's free blocks then."""

    request_id: str
    step_index: int
    reason: str  # seat, blocks or headroom
    for_request: str | None
    level: int
    kv_tokens: int
    host_free_blocks: int
    to_host: bool


@dataclass
class MlfqBooks:
    """One request's place in the queues."""

    level: int
    joined_level: int  # where it entered (the skip-join's choice), for its metrics
    served_ms: float = 0.0  # service at this level
    resumed_ms: float = 0.0  # service since it last joined the running batch
    protected_ms: float = 0.0  # its quantum when it last joined: displaced only after
    queued_step: int | None = None  # the step it was last queued at; None while running
    num_demotions: int = 0
    num_promotions: int = 0
    num_displaced: int = 0


@dataclass(frozen=True)
class _Reserved:
    """Blocks the displacement pass set aside for a waiting head at ``level``."""

    level: int
    blocks: int


class SkipJoinMlfq:
    """The policy object of ``policy="mlfq"`` (ref/core/policy.py's ``Policy``)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.settings: MlfqSettings = config.mlfq
        self.books: dict[str, MlfqBooks] = {}
        self._queue: WaitingQueue | None = None
        # The displacements of the plan in progress: become history only if it commits.
        self._pending: list[Displacement] = []
        self._last: tuple[DisplacedRecord, ...] = ()
        self._last_choices: tuple[MlfqChoice, ...] = ()
        # What each pending displacement saw at the step's start: K/V tokens and level,
        # and the host pool's free blocks (the commit resets a recomputed victim's K/V).
        self._seen: dict[str, tuple[int, int]] = {}
        self._seen_host = 0
        # Waiting requests below level 0, in the order they were queued (so in order
        # of ``queued_step``): promotion reads only the head of it.
        self._below_top: dict[str, Request] = {}
        self.num_displaced = 0
        self.num_headroom_swaps = 0

    # ------------------------------------------------------------------ levels
    def quantum_ms(self, level: int) -> float:
        return self.settings.quantum_ms(level)

    def join_level(self, r: Request) -> int:
        """The skip-join: the highest level whose quantum covers the first chunk."""
        if not self.settings.skip_join:
            return 0
        cfg = self.config
        first = chunk(
            cfg, max(r.num_tokens - r.num_computed_tokens, 1), cfg.max_num_batched_tokens, 0
        )
        first_ms = self.settings.cost.step_ms(max(first, 1), 0)
        last = self.settings.num_queues - 1
        for level in range(last):
            if first_ms <= self.quantum_ms(level):
                return level
        return last  # its quantum is unbounded

    def books_of(self, r: Request) -> MlfqBooks:
        b = self.books.get(r.request_id)
        if b is None:
            level = self.join_level(r)
            b = self.books[r.request_id] = MlfqBooks(level, level)
        return b

    def level_of(self, r: Request) -> int:
        return self.books_of(r).level

    def _group(self, r: Request) -> str:
        # Called when ``r`` is queued: the books learn the step it waits from.
        b = self.books_of(r)
        b.queued_step = r.queued_step
        self._below_top.pop(r.request_id, None)
        if b.level > 0:
            self._below_top[r.request_id] = r
        return f"{b.level:02d}"

    # ------------------------------------------------------------------ the Policy protocol
    def waiting_queue(self, *, track_arrivals: bool) -> WaitingQueue:
        queue = WaitingQueue(0, track_arrivals=track_arrivals, group=self._group)
        self._queue = queue
        return queue

    def waiting_order(self, waiting: Iterable[Request], step_index: int) -> Iterable[Request]:
        if isinstance(waiting, WaitingQueue):
            return waiting.ordered(step_index, float)
        return sorted(waiting, key=lambda r: (self.level_of(r), r.priority, r.seq))

    def pick_victim(self, candidates: Sequence[Request]) -> Request | None:
        """The lowest request: lowest level, then not protected, then latest arrival."""
        if not candidates:
            return None
        return max(candidates, key=lambda r: (self.level_of(r), not self._protected(r), r.seq))

    def admission_open(self, num_running: int) -> bool:
        return True

    def may_admit(self, request: Request, running: Sequence[Request]) -> bool:
        return True

    def on_commit(self, prefill_tokens: Mapping[str, int], backlogged: Set[str]) -> None:
        return None

    def _protected(self, r: Request) -> bool:
        b = self.books_of(r)
        return b.resumed_ms < b.protected_ms

    def displace(
        self, running: Sequence[Request], room: Room, step_index: int
    ) -> Sequence[Displacement]:
        """Seats and blocks for the waiting requests of higher levels, then headroom for
        the running ones (the module doc); reads only, the plan may be rolled back."""
        self._pending = []
        self._seen = {r.request_id: (r.num_computed_tokens, self.level_of(r)) for r in running}
        self._seen_host = room.free_host_blocks
        if self._queue is None or not running:
            return self._pending
        # Lowest first: the order victims are taken in.
        lowest = sorted(
            (r for r in running if not self._protected(r)),
            key=lambda r: (self.level_of(r), r.seq),
            reverse=True,
        )
        free_blocks, reserved = self._for_waiting(lowest, room, step_index)
        if self.settings.proactive_swap and room.free_host_blocks:
            self._for_headroom(lowest, running, free_blocks, reserved, room)
        return self._pending

    def _for_waiting(
        self, lowest: list[Request], room: Room, step_index: int
    ) -> tuple[int, list[_Reserved]]:
        """Displace for the waiting heads in order (taking from ``lowest``) until one
        cannot be made to fit; the free blocks left to the running requests, and the
        blocks set aside for each head that fitted."""
        assert self._queue is not None
        free_blocks, free_seats = room.free_blocks, room.free_seats
        reserved: list[_Reserved] = []
        for head in self.waiting_order(self._queue, step_index):
            need = self._first_chunk_blocks(head, room.budget)
            level = self.level_of(head)
            taken: list[Displacement] = []
            seats, blocks = free_seats, free_blocks
            while (seats < 1 or blocks < need) and lowest[len(taken) :]:
                victim = lowest[len(taken)]
                if self.level_of(victim) <= level:
                    break
                reason = "seat" if seats < 1 else "blocks"
                taken.append(
                    Displacement(victim, reason, head.request_id, self.settings.proactive_swap)
                )
                seats += 1
                blocks += self._frees(victim, room)
            if seats < 1 or blocks < need:
                # Nobody overtakes the head, so victims that would not make it fit would
                # be preempted for nothing: none are taken.
                break
            self._pending.extend(taken)
            del lowest[: len(taken)]
            free_seats, free_blocks = seats - 1, blocks - need
            reserved.append(_Reserved(level, need))
        return free_blocks, reserved

    def _for_headroom(
        self,
        lowest: list[Request],
        running: Sequence[Request],
        free_blocks: int,
        reserved: Sequence[_Reserved],
        room: Room,
    ) -> None:
        """Proactive swap-out: while the running decodes' next tokens need more blocks
        than are free, the lowest running request whose K/V the host can take goes.

        The blocks set aside for a waiting head count against a victim only when the
        head is at a strictly higher level: a running request never makes room for a
        waiting one of its own level or below, or two requests of one level would take
        turns (one out for the other's reservation, then back in at its expense)."""
        host = room.free_host_blocks
        needed = self._next_step_blocks(running, room) - free_blocks
        freed = 0
        for victim in lowest:
            level = self.level_of(victim)
            # Lowest first: a higher victim discounts no fewer reservations and the
            # blocks freed only grow, so once one is not short no later one is.
            short = needed - freed - sum(x.blocks for x in reserved if x.level >= level)
            if short <= 0:
                return
            to_host = self._kv_blocks(victim.num_computed_tokens)
            if not to_host or to_host > host:
                continue
            self._pending.append(Displacement(victim, "headroom", None))
            host -= to_host
            # A displaced decode also no longer needs its own next block.
            freed += self._frees(victim, room) + self._next_need(victim, room)

    # ------------------------------------------------------------------ block counts
    # On a grouped pool (a hybrid model's layer groups) every count is spec/groups.py's
    # ``layout_blocks`` over the groups, or the pool's own figure, never one table's:
    # each group keeps a table of its own, so one table's count misses the others'.
    def _kv_blocks(self, num_stored: int, num_new: int = 0) -> int:
        """The blocks a request holds with ``num_stored`` tokens stored while it computes
        ``num_new`` more. With ``num_new`` 0: what a swap of it moves and the host keeps
        (``HostPool.blocks_for``, which ``can_hold`` reads); from a swap, or from
        nothing, with ``num_new``: what admission's allocation of them takes."""
        cfg = self.config
        if cfg.grouped:
            return layout_blocks(cfg.kv_groups, num_stored, num_new, cfg.block_size)
        return blocks_needed(num_stored + num_new, cfg.block_size)

    def _frees(self, victim: Request, room: Room) -> int:
        """The device blocks preempting running ``victim`` frees: on a grouped pool what
        its tables hold now (a window table may still hold blocks before its window,
        released only at its next allocation, and a free returns them too)."""
        if self.config.grouped:
            return room.table_blocks(victim.request_id)
        return blocks_needed(victim.num_computed_tokens, self.config.block_size)

    def _first_chunk_blocks(self, r: Request, budget: int) -> int:
        cfg = self.config
        stored = r.num_computed_tokens if r.status is RequestStatus.SWAPPED else 0
        n = chunk(cfg, max(r.num_tokens - stored, 1), max(budget, 1), stored)
        return self._kv_blocks(stored, max(n, 1))

    def _next_step_blocks(self, running: Sequence[Request], room: Room) -> int:
        """Blocks the running decodes' next tokens open (:meth:`_next_need` of each)."""
        return sum(self._next_need(r, room) for r in running)

    def _next_need(self, r: Request, room: Room) -> int:
        """The blocks running ``r``'s next token opens: one when it decodes into a
        block's start; 0 when it does not decode.

        On a grouped pool: its ``layout_blocks`` for the next token less what its tables
        hold now, and no less than 0. A window release returns blocks only at the
        releasing request's own allocation, which may come after another decode's, so
        one decode's release is not counted as room for the rest."""
        cfg = self.config
        if r.status is not RequestStatus.DECODING:
            return 0
        if cfg.grouped:
            held = room.table_blocks(r.request_id)
            return max(0, self._kv_blocks(r.num_computed_tokens, 1) - held)
        return 1 if starts_block(block_offset(r.num_computed_tokens, cfg.block_size)) else 0

    # ------------------------------------------------------------------ at commit
    def on_step(self, plan: StepPlan, step_index: int) -> None:
        """The books catch up with a committed plan: the displaced, the (re)joined, each
        scheduled request's service and demotion, then the promotions."""
        preempted = set(plan.preempted)
        displaced = [d for d in self._pending if d.request.request_id in preempted]
        self._pending = []
        records = []
        choices = []
        to_host = set(plan.swapped_out)
        for d in displaced:
            rid = d.request.request_id
            b = self.books_of(d.request)
            records.append(
                DisplacedRecord(rid, d.reason, d.for_request, b.resumed_ms, b.protected_ms)
            )
            kv_tokens, level = self._seen[rid]
            choices.append(
                MlfqChoice(
                    rid,
                    step_index,
                    d.reason,
                    d.for_request,
                    level,
                    kv_tokens,
                    self._seen_host,
                    rid in to_host,
                )
            )
            b.num_displaced += 1
            self.num_displaced += 1
            self.num_headroom_swaps += d.reason == "headroom"
        self._last = tuple(records)
        self._last_choices = tuple(choices)
        for rid in plan.admitted:
            self._below_top.pop(rid, None)
            joined = self.books.get(rid)
            if joined is not None:
                joined.queued_step = None
                joined.resumed_ms = 0.0
                joined.protected_ms = self.settings.protection_ms(joined.level)
        cost = self.settings.cost
        last = self.settings.num_queues - 1
        for rid, n, is_prefill in zip(
            plan.request_ids, plan.num_new_tokens, plan.is_prefill, strict=True
        ):
            served = self.books.get(rid)
            if served is None:
                continue
            b = served
            ms = cost.step_ms(n, 0) if is_prefill else cost.step_ms(n - 1, 1)
            b.served_ms += ms
            if not is_prefill:
                # Protection counts decoding only: a (re)joined request's prefill, or its
                # recompute, is the price of joining, not the quantum it was let in for.
                b.resumed_ms += ms
            if b.served_ms >= self.quantum_ms(b.level) and b.level < last:
                b.level += 1
                b.served_ms = 0.0
                b.num_demotions += 1
        self._promote(step_index + 1)

    def _promote(self, now_step: int) -> None:
        """Waiting requests below level 0 that have waited the bound go to level 0."""
        queue = self._queue
        if queue is None:
            return
        bound = self.settings.starvation_steps
        starved: list[Request] = []
        for r in self._below_top.values():
            queued = self.books_of(r).queued_step
            if queued is None or now_step - queued < bound:
                break  # queued in step order: everyone after it waited less
            starved.append(r)
        for r in starved:
            b = self.books_of(r)
            b.level = 0
            b.served_ms = 0.0
            b.num_promotions += 1
            queue.remove(r)
            queue.add(r)  # re-keyed at level 0, its waiting time kept (queued_step)

    def forget(self, request_id: str) -> None:
        self.books.pop(request_id, None)
        self._below_top.pop(request_id, None)

    @property
    def last_displaced(self) -> tuple[DisplacedRecord, ...]:
        """The displacements of the last committed step."""
        return self._last

    @property
    def last_choices(self) -> tuple[MlfqChoice, ...]:
        """The last committed step's displacements, with where each one's K/V went."""
        return self._last_choices

    # ------------------------------------------------------------------ the spec's view
    def snapshot(
        self, requests: Mapping[str, Request], running: Sequence[Request], step_index: int
    ) -> MlfqSnapshot:
        """The queues as spec/mlfq.py reads them: every runnable live request, where it
        is, and the displacements of the last committed step."""
        queue = self._queue
        waiting = list(queue) if queue is not None else []
        return MlfqSnapshot(
            step_index=step_index,
            starvation_steps=self.settings.starvation_steps,
            num_queues=self.settings.num_queues,
            runnable=tuple(sorted(rid for rid, r in requests.items() if r.status.is_runnable)),
            running=tuple(RunningRecord(r.request_id, self.level_of(r)) for r in running),
            queued=tuple(
                QueuedRecord(
                    r.request_id,
                    self.level_of(r),
                    step_index - r.queued_step,
                )
                for r in waiting
            ),
            displaced=self._last,
        )
