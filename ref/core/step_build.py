"""What the planning of one step accumulates before it becomes a :class:`StepPlan`.

``SchedulerLoop.schedule`` starts one :class:`StepBuild` per step and its stages (decodes,
running prefills, admission; docs/ARCHITECTURE.md, "One step") fill it in turn: the
token budget left, the requests running and those already given tokens, the victims,
the finishes, and the block copies the executor applies before the forward. It lives
for one ``schedule()`` call; no request field changes while it is filled (ATOMIC).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refserve.core.plan import PlanBuilder, PlannedFinish, StepPlan
from refserve.core.request import Request
from refserve.kv import BlockCopy


@dataclass
class StepBuild:
    plan: PlanBuilder
    # The running requests as this step leaves them: victims removed, admissions added.
    running: list[Request]
    budget: int  # token budget left (TOKEN)
    reserve: int  # tokens decodes leave to a starving prefill
    finished: list[PlannedFinish]  # timed out, or can never fit (capacity)
    was_running: int = field(init=False)  # running requests when the step began
    # Running requests given tokens: the bulk decodes, then the others one by one.
    bulk_ids: list[str] = field(default_factory=list)
    scheduled: set[str] = field(default_factory=set)
    decoded: list[Request] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)  # copy-on-write
    # Swap traffic, in the order StepPlan documents.
    swap_out: list[BlockCopy] = field(default_factory=list)
    swap_in: list[BlockCopy] = field(default_factory=list)
    swapped_out: list[str] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # paused turns whose KV was released

    _bulk_set: set[str] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.was_running = len(self.running)

    def is_scheduled(self, request_id: str) -> bool:
        if request_id in self.scheduled:
            return True
        if self.bulk_ids and self._bulk_set is None:
            # Built only when a later stage asks (a victim search after bulk decodes).
            self._bulk_set = set(self.bulk_ids)
        return self._bulk_set is not None and request_id in self._bulk_set

    def build(self) -> StepPlan:
        return self.plan.build(
            self.preempted,
            self.admitted,
            self.finished,
            self.copies,
            self.swap_out,
            self.swap_in,
            self.swapped_out,
            self.swapped_in,
            self.dropped,
        )
