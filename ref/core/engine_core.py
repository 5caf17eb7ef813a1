"""One engine step, read aloud: schedule, execute, commit — with the spec checked after.

Shared by the simulator and the real model engine; only the executor differs. With
``check_invariants`` on, every step is turned into a spec.StepSnapshot (slot mapping taken
from the executor's real inputs) and every invariant is checked, TigerBeetle-style; a
failed execute is rolled back and checked for ATOMIC against the state before the step.

A step is one transaction over the scheduler's books and the executor's K/V memory
(ref/core/executor.py; docs/ARCHITECTURE.md, "Atomic steps"): ``executor.begin`` saves
what the step may write, and a failure anywhere before the scheduler commits runs
``executor.rollback`` and then ``scheduler.rollback``, so every block handed back to its
owner reads back its own K/V and the prefix cache keeps every entry. Only an executor
that declares it cannot restore (``transactional_kv`` false, or one without ``begin``)
costs the cache entries of the blocks the failed step could have written."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from refserve.core.executor import (
    NO_FORKS,
    NO_LOGPROBS,
    NO_VERIFIED,
    DrawnToken,
    Executor,
    KVTransaction,
    NoKVMemory,
    StepExecutor,
)
from refserve.core.executor_output import validate_output
from refserve.core.inputs import LayerGroupTables, ModelInputs, build_inputs, scheduled_requests
from refserve.core.loop import SchedulerLoop
from refserve.core.outcome import StepOutcome
from refserve.core.plan import StepPlan
from refserve.errors import RefserveError
from refserve.spec import EngineSnapshot, StepSnapshot, Violation, check_step
from refserve.spec.arith import blocks_needed, logical_block
from refserve.spec.atomic import check_atomic
from refserve.spec.groups import check_groups, check_window_held
from refserve.spec.host import check_host_groups
from refserve.spec.snapshot import PoolSnapshot


class KVStateLost(RefserveError):
    """A failed step's K/V could not be restored (``executor.rollback`` raised).

    The scheduler's books were rolled back, but the memory they describe may hold what
    the failed step wrote, so every later token could be computed from another request's
    K/V (ATOMIC, docs/ARCHITECTURE.md, "Atomic steps"). Nothing can repair that in place: the engine
    refuses further steps and must be rebuilt.
    """

    def __init__(self, step_index: int, cause: BaseException) -> None:
        super().__init__(
            f"step {step_index} failed and its K/V could not be restored ({cause!r}): the "
            "engine's K/V memory can no longer be trusted; rebuild the engine"
        )
        self.step_index = step_index


class InvariantViolation(RefserveError):
    """The engine broke its own specification; the message lists every violation."""

    def __init__(self, step_index: int, violations: list[Violation]) -> None:
        lines = "\n  ".join(str(v) for v in violations)
        super().__init__(f"step {step_index}: {len(violations)} invariant violation(s):\n  {lines}")
        self.violations = violations


@dataclass(frozen=True)
class StepRecord:
    """What a step did, for tables, traces and metrics, and what the engine reads after
    the commit: ``logprobs`` and ``fork_samples`` are the executor's
    (:class:`refserve.core.executor.StepOutput`), carried here rather than kept on the
    executor, so a step's results travel with the step (empty for the simulator)."""

    step_index: int
    start_ms: float
    end_ms: float
    tokens: tuple[tuple[str, int], ...]  # (request id, scheduled tokens) in plan order
    num_prefill_tokens: int
    num_decodes: int
    kv_blocks_used: int
    outcome: StepOutcome
    plan: StepPlan
    logprobs: Mapping[str, float] = field(default_factory=lambda: NO_LOGPROBS)
    fork_samples: Mapping[str, tuple[DrawnToken, ...]] = field(default_factory=lambda: NO_FORKS)
    # Speculative decoding: the logprob of each token a verification emitted, when asked.
    verified_logprobs: Mapping[str, tuple[float, ...]] = field(default_factory=lambda: NO_VERIFIED)


class EngineCore:
    def __init__(
        self,
        scheduler: SchedulerLoop,
        executor: Executor | StepExecutor,
        *,
        check_invariants: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.check_invariants = check_invariants
        self._kv_of: object = None  # the executor self._kv was made for
        self._kv: KVTransaction = _Untracked()
        self._lost: KVStateLost | None = None

    def step(self, now_ms: float) -> StepRecord:
        if self._lost is not None:
            raise self._lost
        sched = self.scheduler
        kv = self._transaction()
        before = sched.snapshot() if self.check_invariants else None
        plan = sched.schedule(now_ms)
        kv_blocks_used = sched.pool.num_used_blocks  # what the step's requests hold
        started = time.perf_counter()
        try:
            inputs = self._inputs(plan)
            kv.begin(plan, inputs)
            output = self.executor.execute(plan, inputs)
            validate_output(plan, output.sampled, output.accepted)
            duration = output.duration_ms
            if duration is None:
                duration = (time.perf_counter() - started) * 1e3
            end_ms = now_ms + duration
            outcome = sched.commit(plan, output.sampled, end_ms, output.accepted)
        except BaseException:
            if sched.step_index != plan.step_index:
                # The scheduler committed before the error (its last lines): the books
                # describe the step's K/V, so keep it.
                kv.commit()
                raise
            self._roll_back(plan, before)
            raise
        kv.commit()
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
            outcome=outcome,
            plan=plan,
            logprobs=output.logprobs,
            fork_samples=output.fork_samples,
            verified_logprobs=output.verified_logprobs,
        )

    def _transaction(self) -> KVTransaction:
        """The executor's side of the step transaction; an executor without begin/
        rollback/commit gets no-ops and the non-transactional fallback (module doc).
        Looked up again when ``executor`` was replaced (tests swap it between steps)."""
        ex = self.executor
        if ex is not self._kv_of:
            self._kv_of = ex
            self._kv = ex if isinstance(ex, KVTransaction) else _Untracked()
        return self._kv

    def _roll_back(self, plan: StepPlan, before: EngineSnapshot | None) -> None:
        """Undo the failed step: K/V memory first, then the books (ATOMIC)."""
        sched = self.scheduler
        kv = self._kv
        # Without restorable memory, the blocks the step could have written must be read
        # while its reservation stands; after the rollback they are someone's again.
        written = None if kv.transactional_kv else self._written_blocks(plan)
        try:
            kv.rollback()
        except BaseException as e:
            sched.rollback()
            self._lost = KVStateLost(plan.step_index, e)
            raise self._lost from e
        sched.rollback()
        if before is not None:
            violations = check_atomic(before, sched.snapshot())
            if violations:
                raise InvariantViolation(plan.step_index, violations) from None
        if written is not None:
            # The failed step may have overwritten some of these blocks, including free
            # cached blocks it had evicted and the rollback re-indexed.
            sched.pool.forget_cached(written)

    def _written_blocks(self, plan: StepPlan) -> set[int]:
        bs = self.scheduler.config.block_size
        tables = self.scheduler.pool.block_table_views(plan.request_ids)
        written: set[int] = set()
        for table, start, n in zip(tables, plan.starts, plan.num_new_tokens, strict=True):
            written.update(table[logical_block(start, bs) : blocks_needed(start + n, bs)])
        written.update(c.dst for c in plan.swap_in)  # restored before the forward
        return written

    def _inputs(self, plan: StepPlan) -> ModelInputs | None:
        if not (self.executor.needs_inputs or self.check_invariants):
            return None
        sched = self.scheduler
        return build_inputs(plan, sched.requests, sched.pool, sched.decodes, sched.layer_groups)

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
            num_speculative_tokens=cfg.num_speculative_tokens,
        )
        violations = check_step(step)
        if sched.layer_groups is not None:
            violations += _group_violations(plan, sched.layer_groups, after.host)
        if violations:
            raise InvariantViolation(plan.step_index, violations)


def _group_violations(
    plan: StepPlan, pool: LayerGroupTables, host: PoolSnapshot | None
) -> list[Violation]:
    """A grouped pool's own rules after the step (spec/groups.py): the groups' books
    agree, every request the step ran holds, in each window group, the blocks its
    next query reads and none wholly before them, and so does each swapped one's host
    table (spec/host.py)."""
    snap = pool.grouped_snapshot()
    found = check_groups(snap) + (check_host_groups(snap.groups, host) if host else [])
    for c in plan.chunks:
        if pool.has_request(c.request_id):
            found += check_window_held(snap, c.request_id, c.start, c.num_new_cached_tokens)
    return found


class _Untracked(NoKVMemory):
    """The transaction side of an executor without one: the same no-ops, but its memory,
    if any, is not restored, so a failed step costs the cache entries of the blocks it
    could write."""

    transactional_kv = False
