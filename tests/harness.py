"""The shared test harness: one request factory and one checked stepping loop.

Tests of the scheduler, the golden seeds and the swap code drive a real ``Scheduler``
either through ``EngineCore(check_invariants=True)`` on the simulator (``Stepper``), or
directly through ``schedule``/``commit`` (``commit_step``) when a test pins down what the
scheduler itself plans. Every step either way is checked: the engine core runs every
spec checker (docs/ARCHITECTURE.md, "Invariants"), ``commit_step`` runs ``check_pool``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ref.core.config import SchedulerConfig
from ref.core.cost import StepCost
from ref.core.engine_core import EngineCore, StepRecord
from ref.core.outcome import StepOutcome
from ref.core.plan import StepPlan
from ref.core.request import Request, StopParams
from ref.core.scheduler import Scheduler
from ref.sim.simulator import SimExecutor
from spec import check_pool
from spec.snapshot import RequestStatus

# The cost model of docs/ARCHITECTURE.md's worked examples: 2 ms a step, 0.5 ms a
# prefill token, 1 ms a decode.
COST = StepCost.parse("2+0.5P+D")

# How many steps a loop may take before a test calls it stuck: far above what any test
# here needs, so a hit means a scheduler that stopped making progress.
STEP_LIMIT = 500

# A small pool and budget that most direct scheduler tests share: room for four requests.
SMALL_CONFIG = SchedulerConfig(
    max_num_batched_tokens=32, max_num_seqs=4, block_size=4, num_blocks=16, max_model_len=32
)


def prompt_tokens(n: int, base: int = 0) -> list[int]:
    """``n`` distinct token ids ``base + 1 .. base + n`` (never token 0, the usual EOS)."""
    return [base + i + 1 for i in range(n)]


def make_request(
    rid: str,
    n: int,
    max_tokens: int = 8,
    *,
    base: int = 0,
    arrival_ms: float = 0.0,
    priority: int = 0,
    tenant: str = "default",
) -> Request:
    """A request with an ``n``-token prompt that decodes exactly ``max_tokens`` tokens."""
    return Request(
        rid,
        prompt_tokens(n, base),
        StopParams(max_tokens, ignore_eos=True),
        arrival_ms=arrival_ms,
        priority=priority,
        tenant=tenant,
    )


class Stepper:
    """A scheduler stepped one step at a time through the checked engine core.

    The simulator charges ``cost`` per step, plus the config's ``swap_cost`` for blocks
    moved between the pools unless ``charge_swaps`` is off.
    """

    def __init__(
        self, config: SchedulerConfig, cost: StepCost = COST, *, charge_swaps: bool = True
    ) -> None:
        self.sched = Scheduler(config)
        swap = config.swap_cost if charge_swaps else None
        executor = SimExecutor(cost, self.sched.requests, swap=swap, block_size=config.block_size)
        self.core = EngineCore(self.sched, executor, check_invariants=True)
        self.clock = 0.0
        self.records: list[StepRecord] = []
        self.added: list[Request] = []  # every request added, in order, finished or not

    @classmethod
    def of(cls, **config: Any) -> Stepper:
        """A stepper on ``SchedulerConfig(**config)`` at the default cost."""
        return cls(SchedulerConfig(**config))

    @property
    def plans(self) -> list[StepPlan]:
        return [rec.plan for rec in self.records]

    def add(self, *requests: Request) -> None:
        for r in requests:
            self.sched.add_request(r)
            self.added.append(r)

    def step(self) -> StepRecord:
        rec = self.core.step(self.clock)
        self.clock = rec.end_ms
        self.records.append(rec)
        return rec

    def step_tokens(self) -> dict[str, int]:
        """One step; the tokens it scheduled, by request id."""
        return dict(self.step().tokens)

    def until(self, cond: Callable[[], bool], limit: int = 50) -> None:
        for _ in range(limit):
            if cond():
                return
            self.step()
        if not cond():
            raise AssertionError(f"condition never reached in {limit} steps")

    def drain(self, limit: int = STEP_LIMIT) -> None:
        self.until(lambda: not self.sched.has_unfinished, limit)

    def decoding(self, *rids: str) -> None:
        """Step until every named request has sampled its first token."""
        reqs = self.sched.requests
        self.until(lambda: all(reqs[r].status is RequestStatus.DECODING for r in rids))


# ------------------------------------------------------- stepping without the engine core
def sampled_tokens(plan: StepPlan, token: int = 7) -> dict[str, int]:
    """``token`` for every request the plan samples: what an executor would return."""
    return {rid: token for rid, s in zip(plan.request_ids, plan.samples, strict=True) if s}


def reference_loop(sched: Scheduler) -> Scheduler:
    """``sched`` planning every decode one request at a time (the per-request path), for
    the differential test against the bulk path (docs/ARCHITECTURE.md, "The persistent
    batch"); returned for chaining."""
    sched.fast_decode = False
    return sched


def commit_step(sched: Scheduler, now: float = 0.0, token: int = 7) -> tuple[StepPlan, StepOutcome]:
    """Schedule one step and commit it as if every sampling request drew ``token``."""
    plan = sched.schedule(now)
    events = sched.commit(plan, sampled_tokens(plan, token), now)
    assert check_pool(sched.pool.snapshot()) == []
    return plan, events


def decoding_scheduler(config: SchedulerConfig, *reqs: Request) -> Scheduler:
    """A scheduler whose requests have all sampled their first token."""
    sched = Scheduler(config)
    for r in reqs:
        sched.add_request(r)
    for _ in range(20):
        if all(r.status is RequestStatus.DECODING for r in reqs):
            return sched
        commit_step(sched)
    raise AssertionError("requests did not reach decode")


def plan_entry(plan: StepPlan, rid: str) -> tuple[int, int, bool, bool, int]:
    """(start, n, samples, is_prefill, cached) of ``rid`` in the plan."""
    i = plan.request_ids.index(rid)
    return (
        plan.starts[i],
        plan.num_new_tokens[i],
        plan.samples[i],
        plan.is_prefill[i],
        plan.num_new_cached_tokens[i],
    )
