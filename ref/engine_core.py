"""One engine step, read aloud: schedule, execute, commit — with the spec checked after.

Shared by the simulator and the real model engine; only the executor differs. With
``check_invariants`` on, every step is turned into a spec.StepSnapshot (slot mapping taken
from the executor's real inputs) and every invariant is checked, TigerBeetle-style; a
failed execute is rolled back and checked for ATOMIC against the state before the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ref.errors import RefserveError
from ref.executor import Executor
from ref.inputs import ModelInputs, build_inputs, scheduled_requests
from ref.plan import StepPlan
from ref.scheduler import Scheduler, StepEvents
from spec import EngineSnapshot, StepSnapshot, Violation, check_step
from spec.arith import blocks_needed
from spec.atomic import check_atomic


class InvariantViolation(RefserveError):
    """The engine broke its own specification; the message lists every violation."""

    def __init__(self, step_index: int, violations: list[Violation]) -> None:
        lines = "\n  ".join(str(v) for v in violations)
        super().__init__(f"step {step_index}: {len(violations)} invariant violation(s):\n  {lines}")
        self.violations = violations


@dataclass(frozen=True)
class StepRecord:
    """What a step did, for tables, traces and metrics."""

    step_index: int
    start_ms: float
    end_ms: float
    tokens: tuple[tuple[str, int], ...]  # (request id, scheduled tokens) in plan order
    num_prefill_tokens: int
    num_decodes: int
    kv_blocks_used: int
    events: StepEvents
    plan: StepPlan


class EngineCore:
    def __init__(
        self, scheduler: Scheduler, executor: Executor, *, check_invariants: bool = False
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.check_invariants = check_invariants

    def step(self, now_ms: float) -> StepRecord:
        sched = self.scheduler
        before = sched.snapshot() if self.check_invariants else None
        plan = sched.schedule(now_ms)
        kv_blocks_used = sched.pool.num_used_blocks  # what the step's requests hold
        started = time.perf_counter()
        try:
            inputs = self._inputs(plan)
            output = self.executor.execute(plan, inputs)
            sched.validate_output(plan, output.sampled)
        except BaseException:
            written = self._written_blocks(plan)  # read while the reservation stands
            sched.rollback()
            if before is not None:
                violations = check_atomic(before, sched.snapshot())
                if violations:
                    raise InvariantViolation(plan.step_index, violations) from None
            # K/V memory is not transactional: the executor may have written some of these
            # blocks before it failed, including free cached blocks the step had evicted
            # and the rollback re-indexed. Their cache entries must not be trusted.
            sched.pool.forget_cached(written)
            raise
        duration = output.duration_ms
        if duration is None:
            duration = (time.perf_counter() - started) * 1e3
        end_ms = now_ms + duration
        events = sched.commit(plan, output.sampled, end_ms)
        if before is not None:
            assert inputs is not None
            self._check(plan, inputs, before)
        return StepRecord(
            step_index=plan.step_index,
            start_ms=now_ms,
            end_ms=end_ms,
            tokens=tuple(zip(plan.request_ids, plan.num_new_tokens, strict=True)),
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decodes=plan.num_decode_requests,
            kv_blocks_used=kv_blocks_used,
            events=events,
            plan=plan,
        )

    def _written_blocks(self, plan: StepPlan) -> set[int]:
        bs = self.scheduler.config.block_size
        tables = self.scheduler.pool.block_table_views(plan.request_ids)
        written: set[int] = set()
        for table, start, n in zip(tables, plan.starts, plan.num_new_tokens, strict=True):
            written.update(table[start // bs : blocks_needed(start + n, bs)])
        written.update(c.dst for c in plan.swap_in)  # restored before the forward
        return written

    def _inputs(self, plan: StepPlan) -> ModelInputs | None:
        if not (self.executor.needs_inputs or self.check_invariants):
            return None
        return build_inputs(plan, self.scheduler.requests, self.scheduler.pool)

    def _check(self, plan: StepPlan, inputs: ModelInputs, before: EngineSnapshot) -> None:
        sched = self.scheduler
        cfg = sched.config
        after = sched.snapshot(extra=sched.retired)
        scheduled = scheduled_requests(plan, inputs, cfg.block_size)
        step = StepSnapshot(
            step_index=plan.step_index,
            token_budget=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs,
            before=before,
            scheduled=scheduled,
            after=after,
            preempted=plan.preempted + plan.dropped,
            finished=tuple(r.request_id for r in sched.retired),
        )
        violations = check_step(step)
        if violations:
            raise InvariantViolation(plan.step_index, violations)
