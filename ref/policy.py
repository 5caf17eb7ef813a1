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
    def waiting_order(self, waiting: Sequence[Request]) -> list[Request]:
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

    def waiting_order(self, waiting: Sequence[Request]) -> list[Request]:
        return sorted(waiting, key=lambda r: (r.priority, r.seq))

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


def make_policy(name: PolicyName) -> Policy:
    return Static() if name is PolicyName.STATIC else DecodeFirst()
