"""The settings of the skip-join multi-level feedback queue (ref/core/mlfq.py), kept apart
from the policy so that the configuration, which validates every setting in one place,
can hold them without importing the policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from refserve.core.cost import StepCost
from refserve.errors import InvalidArgument
from refserve.values import is_int, is_number


@dataclass(frozen=True)
class MlfqSettings:
    """The knobs of the skip-join multi-level feedback queue (ref/core/mlfq.py).

    ``num_queues`` levels, level 0 the highest; level ``i``'s quantum is
    ``base_quantum_ms * quantum_growth**i`` ms of service (the last level's is unbounded),
    service priced by ``cost`` (a request's own tokens of each step it runs in). A new
    request joins the highest level whose quantum covers its first chunk's predicted time
    (the skip-join; ``skip_join=False`` joins everyone at level 0); one that used up its
    quantum drops a level; one that waited ``starvation_steps`` steps in a lower level is
    promoted to level 0. ``proactive_swap``: a request the policy displaces keeps its K/V
    on the host when the host pool has room (else it recomputes), and the running
    requests of the lowest levels go to the host before the next step runs short of
    blocks; off, a displaced request is preempted by the preemption mode like any other
    victim (recompute by default).
    """

    num_queues: int = 4
    base_quantum_ms: float = 8.0
    quantum_growth: float = 2.0
    starvation_steps: int = 256
    skip_join: bool = True
    proactive_swap: bool = True
    cost: StepCost = field(default_factory=StepCost)

    def __post_init__(self) -> None:
        if not is_int(self.num_queues) or not 1 <= self.num_queues <= 16:
            raise InvalidArgument(
                f"mlfq num_queues must be an int in [1, 16], got {self.num_queues!r}"
            )
        if not is_number(self.base_quantum_ms) or not 0 < self.base_quantum_ms <= 1e6:
            raise InvalidArgument(
                f"mlfq base_quantum_ms must be a number in (0, 1e6], got {self.base_quantum_ms!r}"
            )
        if not is_number(self.quantum_growth) or not 1 <= self.quantum_growth <= 16:
            raise InvalidArgument(
                f"mlfq quantum_growth must be a number in [1, 16], got {self.quantum_growth!r}"
            )
        if not is_int(self.starvation_steps) or self.starvation_steps < 1:
            raise InvalidArgument(
                f"mlfq starvation_steps must be a positive int, got {self.starvation_steps!r}"
            )
        for name in ("skip_join", "proactive_swap"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"mlfq {name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.cost, StepCost):
            raise InvalidArgument(f"mlfq cost must be a StepCost, got {self.cost!r}")

    def quantum_ms(self, level: int) -> float:
        """Level ``level``'s quantum; the last level's is unbounded."""
        if level >= self.num_queues - 1:
            return float("inf")
        return float(self.base_quantum_ms * self.quantum_growth**level)

    def protection_ms(self, level: int) -> float:
        """The decode service a request that joined the running batch at ``level`` is
        guaranteed before it may be displaced: its level's quantum, the last level's
        (unbounded) counted as the one above it, so a request there is protected for a
        finite time and not to its end."""
        top = max(self.num_queues - 2, 0)
        return float(self.base_quantum_ms * self.quantum_growth ** min(level, top))
