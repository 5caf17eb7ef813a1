"""Scheduling policies: who waits first, who is preempted, when admission is open.

The scheduler asks the policy three questions and keeps the mechanics (budget, blocks,
chunking) to itself, so the QoS policies can replace this one without touching it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import NamedTuple, Protocol

from refserve.core.config import PolicyName, SchedulerConfig
from refserve.core.plan import StepPlan
from refserve.core.request import Request
from refserve.core.waiting import WaitingQueue, WaitingReader
from refserve.errors import InvalidArgument


class Room(NamedTuple):
    """What a step starts with, for a policy that preempts for waiting work: free
    device blocks, free running seats (``max_num_seqs`` less the running), free host
    blocks (0: no host pool), the token budget, and the blocks a running request's
    tables hold now, by request id (``BlockPool.num_table_blocks``: over every layer
    group on a grouped pool, what preempting it frees less the blocks others share)."""

    free_blocks: int
    free_seats: int
    free_host_blocks: int
    budget: int
    table_blocks: Callable[[str], int]


class Displacement(NamedTuple):
    """A running request a policy preempts at the start of a step, and why: ``seat`` or
    ``blocks`` for ``for_request``, the waiting request it ranks higher; ``headroom``
    when the running requests' own next tokens would run short of blocks. ``park``: its
    K/V goes to the host whenever the host pool can hold it (the policy expects it back
    soon); else it is preempted like any victim, by the preemption mode."""

    request: Request
    reason: str
    for_request: str | None
    park: bool = True


class Policy(Protocol):
    def waiting_queue(self, *, track_arrivals: bool) -> WaitingQueue:
        """An empty queue that keeps requests in the order :meth:`waiting_order` reads
        them (the scheduler's waiting queue; ``track_arrivals`` for queue timeouts)."""
        ...

    def waiting_order(self, waiting: Iterable[Request], step_index: int) -> Iterable[Request]:
        """Waiting requests in the order admission should consider them.

        Given the scheduler's :class:`WaitingQueue` the order is read lazily from it
        (admission stops at the first request that does not fit, so a step never sorts
        the whole queue); given any other collection it is sorted, the reference the
        queue must agree with.
        """
        ...

    def pick_victim(self, candidates: Sequence[Request]) -> Request | None:
        """The running request to preempt when another cannot get a block."""
        ...

    def admission_open(self, num_running: int) -> bool:
        """Whether waiting requests may join at this step boundary."""
        ...

    def may_admit(self, request: Request, running: Sequence[Request]) -> bool:
        """Whether this waiting request may join now (e.g. its tenant is under its cap)."""
        ...

    def on_commit(self, prefill_tokens: Mapping[str, int], backlogged: Set[str]) -> None:
        """Told after each committed step: prefill tokens granted per tenant, and the
        tenants that still have prefill work queued or running."""
        ...

    def displace(
        self, running: Sequence[Request], room: Room, step_index: int
    ) -> Sequence[Displacement]:
        """At the start of a step, the running requests to preempt for waiting work the
        policy ranks above them (none: only a request short of a block preempts). Must
        change nothing: the plan may be rolled back."""
        ...

    def on_step(self, plan: StepPlan, step_index: int) -> None:
        """Told each committed plan (``step_index``: the step it was)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request left the scheduler (finished, aborted or migrated away)."""
        ...


def aged_priority(priority: int, queued_step: int, step_index: int, aging_steps: int) -> int:
    """``priority`` improved by one level per ``aging_steps`` steps waited since
    ``queued_step`` (0: no aging): :meth:`DecodeFirst.effective_priority`, the bound on
    starvation of PROGRESS (docs/ARCHITECTURE.md, "Verification practice").

    The contract: aging only ever improves a priority, by exactly the whole number of
    ``aging_steps`` periods waited; and it equals the waiting queue's split of the same
    value into a term fixed at queueing time and one shared by every request of a phase
    (``queued_step % aging_steps``; ref/core/waiting.py, "Aging without re-sorting"), which
    is what lets the queue keep each phase's order without re-sorting.

    pre: aging_steps >= 0
    pre: 0 <= queued_step <= step_index
    post: __return__ <= priority
    post: aging_steps > 0 or __return__ == priority
    post: aging_steps == 0 or (priority - __return__) * aging_steps <= step_index - queued_step < (priority - __return__ + 1) * aging_steps
    post: aging_steps == 0 or __return__ == (priority + queued_step // aging_steps) - (step_index - queued_step % aging_steps) // aging_steps
    """  # noqa: E501 (CrossHair reads one condition per line)
    if not aging_steps:
        return priority
    return priority - (step_index - queued_step) // aging_steps


class DecodeFirst:
    """Decode first, then prefill in arrival order; preempt the least important request.

    The victim is the one with the lowest priority (largest ``priority`` value), then the
    most recently arrived: it has done the least work and recomputing it costs the least.
    A preempted request keeps its arrival order, so it is not overtaken by later arrivals.
    """

    def __init__(self, aging_steps: int = 0) -> None:
        self.aging_steps = aging_steps

    def effective_priority(self, r: Request, step_index: int) -> int:
        """Priority improved by one level per ``aging_steps`` steps of waiting.

        Ordering bound: with priorities in ``[lo, hi]``, a request is ordered ahead of
        every request queued more than ``(hi - lo + 1) * aging_steps`` steps after it
        (both age at the same rate, so the gap in waiting time is what the priority gap
        has to overcome). Only the finitely many requests queued within that window can
        overtake it, so under any arrival pattern it cannot wait forever.
        """
        return aged_priority(r.priority, r.queued_step, step_index, self.aging_steps)

    def waiting_queue(self, *, track_arrivals: bool) -> WaitingQueue:
        return WaitingQueue(self.aging_steps, track_arrivals=track_arrivals)

    def waiting_order(self, waiting: Iterable[Request], step_index: int) -> Iterable[Request]:
        if isinstance(waiting, WaitingQueue):
            return waiting.ordered(step_index)
        return sorted(waiting, key=lambda r: (self.effective_priority(r, step_index), r.seq))

    def pick_victim(self, candidates: Sequence[Request]) -> Request | None:
        if not candidates:
            return None
        return max(candidates, key=lambda r: (r.priority, r.seq))

    def admission_open(self, num_running: int) -> bool:
        return True

    def may_admit(self, request: Request, running: Sequence[Request]) -> bool:
        return True

    def on_commit(self, prefill_tokens: Mapping[str, int], backlogged: Set[str]) -> None:
        return None

    def displace(
        self, running: Sequence[Request], room: Room, step_index: int
    ) -> Sequence[Displacement]:
        return ()

    def on_step(self, plan: StepPlan, step_index: int) -> None:
        return None

    def forget(self, request_id: str) -> None:
        return None


class Static(DecodeFirst):
    """Static batching: a batch is formed when the previous one has wholly finished.

    Only for comparison (docs/ARCHITECTURE.md, example 0: 7 rounds static vs 5 continuous).
    """

    def admission_open(self, num_running: int) -> bool:
        return num_running == 0


class TenantFair(DecodeFirst):
    """Deficit round robin over prefill tokens between tenants (per-tenant fairness).

    After every step each backlogged tenant earns ``weight * quantum`` tokens of credit
    and pays for the prefill tokens it was granted; a tenant with nothing queued drops to
    zero credit (it cannot bank credit while idle), and credit is clipped at four quanta
    either way so a long burst cannot lock others out. Admission takes tenants in order of
    credit (arrival order within a tenant, aging applied), and skips a tenant already at
    ``max_running`` running requests. Over a long backlog each tenant's share of prefill
    tokens approaches its share of the weights.
    """

    def __init__(
        self,
        weights: Mapping[str, float],
        quantum: int,
        max_running: int | None = None,
        aging_steps: int = 0,
    ) -> None:
        super().__init__(aging_steps)
        self.weights = dict(weights)
        self.quantum = quantum
        self.max_running = max_running
        self.credit: dict[str, float] = {}
        self.served: dict[str, int] = {}  # prefill tokens granted per tenant, for reports
        self._reader: WaitingReader | None = None  # the admission pass in progress

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def waiting_queue(self, *, track_arrivals: bool) -> WaitingQueue:
        return WaitingQueue(self.aging_steps, by_tenant=True, track_arrivals=track_arrivals)

    def waiting_order(self, waiting: Iterable[Request], step_index: int) -> Iterable[Request]:
        if isinstance(waiting, WaitingQueue):
            self._reader = waiting.ordered(step_index, self._tenant_rank)
            return self._reader
        self._reader = None
        return sorted(waiting, key=lambda r: self._key(r, step_index))

    def _tenant_rank(self, tenant: str) -> float:
        return -self.credit.get(tenant, 0.0)

    def _key(self, r: Request, step_index: int) -> tuple[float, int, int]:
        return (self._tenant_rank(r.tenant), self.effective_priority(r, step_index), r.seq)

    def may_admit(self, request: Request, running: Sequence[Request]) -> bool:
        if self.max_running is None:
            return True
        if sum(1 for r in running if r.tenant == request.tenant) < self.max_running:
            return True
        # Admission only adds to ``running``, so the tenant stays at its cap for the rest
        # of the pass: its other waiting requests are not read (else a capped tenant's
        # backlog would be walked, and refused, request by request every step).
        if self._reader is not None:
            self._reader.skip_tenant(request.tenant)
        return False

    def on_commit(self, prefill_tokens: Mapping[str, int], backlogged: Set[str]) -> None:
        for tenant, n in prefill_tokens.items():
            self.served[tenant] = self.served.get(tenant, 0) + n
        for tenant in set(self.credit) | set(backlogged) | set(prefill_tokens):
            if tenant not in backlogged:
                self.credit.pop(tenant, None)
                continue
            limit = 4 * self.quantum * self.weight(tenant)
            earned = self.credit.get(tenant, 0.0) + self.weight(tenant) * self.quantum
            credit = earned - prefill_tokens.get(tenant, 0)
            self.credit[tenant] = max(-limit, min(limit, credit))


def make_policy(config: SchedulerConfig) -> Policy:
    aging = config.aging_steps
    if config.policy is PolicyName.MLFQ:
        # An attachment (ref/core/mlfq.py): the spine's loop alone cannot run it.
        raise InvalidArgument("policy 'mlfq' is an attachment: build a Scheduler, not the loop")
    if config.policy is PolicyName.STATIC:
        return Static(aging)
    if config.policy is PolicyName.TENANT_FAIR:
        return TenantFair(
            dict(config.tenant_weights),
            config.tenant_quantum_tokens,
            config.tenant_max_running,
            aging,
        )
    return DecodeFirst(aging)
