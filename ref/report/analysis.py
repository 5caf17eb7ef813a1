"""What one run's numbers mean (docs/ARCHITECTURE.md, example 3): which engine limit bound
its steps, how fairly its tenants were served, and where a policy's goodput bends as the
rate rises (the knee) and why.

A :class:`PointResult` is one run (a trace at one rate under one policy) reduced to the
figures the report prints; the knee functions read a policy's sweep of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from refserve.core.config import SchedulerConfig
from refserve.core.engine_core import StepRecord
from refserve.core.request_metrics import RequestMetrics
from refserve.report.policies import Slo
from refserve.sim.metrics import jain_index

# A step counts as KV-bound when it preempted or ran with at least this share of the
# pool in use: admission stalls on free blocks before the pool is literally full.
KV_FULL = 0.95
# The binding limit must hold in at least this share of steps to be named as a knee's
# cause; below it no limit saturated and the SLO failed on step time alone.
BOUND_FLOOR = 0.2
NO_LIMIT = "none: step time"


@dataclass(frozen=True)
class LimitFractions:
    """Share of a run's steps spent at each engine limit (0 to 1 each).

    ``token_budget``: the step computed the whole token budget; ``max_seqs``: it ran
    ``max_num_seqs`` requests; ``kv_blocks``: it preempted or had ``KV_FULL`` of the pool
    in use; ``swap``: it moved KV over the host link.
    """

    token_budget: float = 0.0
    max_seqs: float = 0.0
    kv_blocks: float = 0.0
    swap: float = 0.0

    def cause(self, floor: float = BOUND_FLOOR) -> str:
        """The limit that bound most often, or :data:`NO_LIMIT` when none reached ``floor``.

        Ties go to the scarcer resource first (KV, swap, sequences, then the budget):
        a step at the budget that also preempted was stopped by memory.
        """
        named = (
            ("KV blocks", self.kv_blocks),
            ("swap bandwidth", self.swap),
            ("max sequences", self.max_seqs),
            ("token budget", self.token_budget),
        )
        name, share = max(named, key=lambda x: x[1])
        return name if share >= floor else NO_LIMIT


def limit_fractions(steps: Sequence[StepRecord], config: SchedulerConfig) -> LimitFractions:
    """Measure :class:`LimitFractions` from a run's step records."""
    if not steps:
        return LimitFractions()
    n = len(steps)
    kv_full = KV_FULL * config.num_blocks
    return LimitFractions(
        token_budget=sum(
            1 for s in steps if sum(t for _, t in s.tokens) >= config.max_num_batched_tokens
        )
        / n,
        max_seqs=sum(1 for s in steps if len(s.tokens) >= config.max_num_seqs) / n,
        kv_blocks=sum(1 for s in steps if s.plan.preempted or s.kv_blocks_used >= kv_full) / n,
        swap=sum(1 for s in steps if s.plan.swap_out or s.plan.swap_in) / n,
    )


def tenant_fairness(reqs: Sequence[RequestMetrics], slo: Slo) -> float | None:
    """Jain's index over per-tenant SLO attainment (each tenant's goodput normalized by
    its own offered requests); None with fewer than two tenants."""
    tenants: dict[str, list[bool]] = {}
    for m in reqs:
        tenants.setdefault(m.tenant, []).append(slo.met(m))
    if len(tenants) < 2:
        return None
    return jain_index([sum(v) / len(v) for v in tenants.values()])


@dataclass(frozen=True)
class PointResult:
    trace: str
    policy: str
    rate: float
    offered_rps: float
    num_requests: int
    num_finished: int
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    ttft_p99_ms: float | None
    tbt_p99_ms: float | None
    output_tokens_per_s: float
    slo_attainment: float
    goodput_rps: float
    goodput_tokens_per_s: float
    rejected: int
    preemptions: int
    cached_tokens: int
    prefix_hit_rate: float
    makespan_ms: float
    num_steps: int
    wall_s: float
    num_tenants: int = 1
    fairness: float | None = None  # Jain's index over tenants' SLO attainment
    rejection_rate: float = 0.0  # did not finish normally / requests
    capacity_rate: float = 0.0  # finished "capacity" (could never fit: an OOM) / requests
    limits: LimitFractions = LimitFractions()
    # Shares of requests that missed each SLO (a request may miss both): when no engine
    # limit bound, these say whether queueing (TTFT) or long steps (TBT) broke the SLO.
    ttft_miss_rate: float = 0.0
    tbt_miss_rate: float = 0.0
    # Job completion time (arrival to finish) of the requests that finished.
    jct_p50_ms: float | None = None
    jct_p95_ms: float | None = None
    # The MLFQ policy's own moves (None: not an mlfq policy): requests it displaced, of
    # them those moved out for the running requests' headroom.
    displaced: int | None = None
    headroom_swaps: int | None = None
    # Host-link traffic: requests whose K/V went to the host, blocks each way, and the
    # bytes moved both ways (0 without a host pool).
    swapped_out: int = 0
    swap_blocks_out: int = 0
    swap_blocks_in: int = 0
    swap_bytes: int = 0

    def cause(self) -> str:
        """The limit that bound in this run; failing that, the SLO missed most."""
        cause = self.limits.cause()
        if cause != NO_LIMIT or self.ttft_miss_rate == self.tbt_miss_rate == 0:
            return cause
        return (
            f"{NO_LIMIT} (TBT)"
            if self.tbt_miss_rate >= self.ttft_miss_rate
            else (f"{NO_LIMIT} (TTFT)")
        )


def knee_point(points: Sequence[PointResult], threshold: float) -> PointResult | None:
    """The run at the first swept rate whose goodput / offered falls below ``threshold``."""
    for p in sorted(points, key=lambda p: p.rate):
        if p.slo_attainment < threshold:
            return p
    return None


def knee_rate(points: Sequence[PointResult], threshold: float) -> float | None:
    """The first swept rate whose goodput / offered falls below ``threshold``."""
    p = knee_point(points, threshold)
    return None if p is None else p.rate


def knee_cause(points: Sequence[PointResult], threshold: float) -> str | None:
    """The limit that bound at the knee (None: no knee in the sweep)."""
    p = knee_point(points, threshold)
    return None if p is None else p.cause()
