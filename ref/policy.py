"""Scheduling policies: who waits first, who is preempted, when admission is open.

The scheduler asks the policy three questions and keeps the mechanics (budget, blocks,
chunking) to itself, so the QoS policies can replace this one without touching it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ref.config import PolicyName
from ref.request import Request


class Policy(Protocol):
    def waiting_order(self, waiting: Sequence[Request], step_index: int) -> list[Request]:
        """Waiting requests in the order admission should consider them."""
        ...

    def pick_victim(self, candidates: Sequence[Request]) -> Request | None:
        """The running request to preempt when another cannot get a block."""
        ...

    def admission_open(self, num_running: int) -> bool:
        """Whether waiting requests may join at this step boundary."""
        ...


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
        if not self.aging_steps:
            return r.priority
        return r.priority - (step_index - r.queued_step) // self.aging_steps

    def waiting_order(self, waiting: Sequence[Request], step_index: int) -> list[Request]:
        return sorted(waiting, key=lambda r: (self.effective_priority(r, step_index), r.seq))

    def pick_victim(self, candidates: Sequence[Request]) -> Request | None:
        if not candidates:
            return None
        return max(candidates, key=lambda r: (r.priority, r.seq))

    def admission_open(self, num_running: int) -> bool:
        return True


class Static(DecodeFirst):
    """Static batching: a batch is formed when the previous one has wholly finished.

    Only for comparison (seed 000: 7 rounds static vs 5 continuous).
    """

    def admission_open(self, num_running: int) -> bool:
        return num_running == 0


def make_policy(name: PolicyName, aging_steps: int = 0) -> Policy:
    return Static(aging_steps) if name is PolicyName.STATIC else DecodeFirst(aging_steps)
