"""The cost-model simulator: a virtual clock and an executor that samples fake tokens.

The scheduler and engine core are the same ones that drive the real model; only this
executor differs. Requests that arrive during a step join at the next step boundary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ref.cost_model import CostModel
from ref.engine_core import EngineCore, StepRecord
from ref.executor import StepOutput
from ref.inputs import ModelInputs
from ref.plan import StepPlan
from ref.request import Request
from ref.scheduler import Scheduler

VOCAB = 32000


def fake_token(request_seq: int, position: int) -> int:
    """A deterministic token id; the same request and position always give the same one."""
    return (request_seq * 1_000_003 + position * 7_919 + 17) % VOCAB


class SimExecutor:
    needs_inputs = False

    def __init__(self, cost: CostModel, requests: Mapping[str, Request]) -> None:
        self.cost = cost
        self._requests = requests

    def execute(self, plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
        reqs = self._requests
        sampled = {
            rid: fake_token(reqs[rid].seq, len(reqs[rid].token_ids))
            for rid, samples in zip(plan.request_ids, plan.samples, strict=True)
            if samples
        }
        kv_read = 0
        if self.cost.e:
            kv_read = sum(
                s + n
                for s, n, p in zip(plan.starts, plan.num_new_tokens, plan.is_prefill, strict=True)
                if not p
            )
        ms = self.cost.step_ms(plan.num_prefill_tokens, plan.num_decode_requests, kv_read)
        return StepOutput(sampled, ms)


@dataclass(frozen=True)
class SimResult:
    requests: tuple[Request, ...]  # every request, in arrival order, with its timeline
    steps: tuple[StepRecord, ...]
    makespan_ms: float


def simulate(
    scheduler: Scheduler,
    arrivals: Iterable[Request],
    cost: CostModel,
    *,
    check_invariants: bool = False,
    max_steps: int = 1_000_000,
) -> SimResult:
    """Run every request to completion on a virtual clock; return timelines and steps."""
    pending = sorted(arrivals, key=lambda r: r.arrival_ms)
    everyone = list(pending)
    core = EngineCore(
        scheduler, SimExecutor(cost, scheduler.requests), check_invariants=check_invariants
    )
    clock = 0.0
    steps: list[StepRecord] = []
    i = 0
    while i < len(pending) or scheduler.has_unfinished:
        while i < len(pending) and pending[i].arrival_ms <= clock:
            scheduler.add_request(pending[i])
            i += 1
        if not scheduler.has_unfinished:
            clock = pending[i].arrival_ms  # idle until the next arrival
            continue
        if len(steps) >= max_steps:
            raise RuntimeError(f"simulation did not finish within {max_steps} steps")
        record = core.step(clock)
        steps.append(record)
        clock = record.end_ms
    start = min((r.arrival_ms for r in everyone), default=0.0)
    return SimResult(tuple(everyone), tuple(steps), clock - start)
