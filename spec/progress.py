"""PROGRESS: runnable work always moves, nobody starves past the bound, nothing leaks.

Why it matters: seed 002's starvation example (budget 8, always 8 decodes waiting) shows
decode-first scheduling can starve prefill forever unless aging or a reserved share
admits it. Known bugs elsewhere: a fully cached prompt that schedules zero tokens and
spins; a single running request that cannot grow and has no victim; a preempted request
that never runs again; blocks still referenced after every request has finished.
"""

from __future__ import annotations

from collections.abc import Sequence

from spec.snapshot import PoolSnapshot, StepSnapshot
from spec.violation import Invariant, Violation, violation

G = Invariant.PROGRESS


def check_progress(step: StepSnapshot) -> list[Violation]:
    """A step with runnable work schedules a token or retires/preempts someone."""
    runnable = [r for r in step.before.requests if r.status.is_runnable]
    if not runnable or step.scheduled:
        return []
    if step.finished or step.aborted:
        return []  # e.g. a lone request finished with reason capacity: that is progress
    return [
        violation(
            G,
            "step",
            "runnable work but nothing scheduled, finished or aborted",
            ">= 1 token",
            f"0 tokens for {len(runnable)} runnable requests",
        )
    ]


def check_quiescent(pool: PoolSnapshot) -> list[Violation]:
    """After all requests finish or abort, no table remains and every ref count is 0."""
    out: list[Violation] = []
    for t in pool.tables:
        out.append(
            violation(
                G,
                f"request {t.request_id}",
                "holds a block table at quiescence",
                0,
                len(t.block_table),
            )
        )
    for b, rc in enumerate(pool.ref_cnt):
        if rc != 0:
            out.append(violation(G, f"block {b}", "still referenced at quiescence", 0, rc))
    return out


def check_starvation(steps: Sequence[StepSnapshot], bound: int) -> list[Violation]:
    """No request is runnable yet unscheduled for more than ``bound`` consecutive steps."""
    out: list[Violation] = []
    waited: dict[str, int] = {}
    reported: set[str] = set()
    for step in steps:
        scheduled = {s.request_id for s in step.scheduled}
        for r in step.before.requests:
            if not r.status.is_runnable or r.request_id in scheduled:
                waited[r.request_id] = 0
                continue
            waited[r.request_id] = waited.get(r.request_id, 0) + 1
            if waited[r.request_id] > bound and r.request_id not in reported:
                reported.add(r.request_id)
                out.append(
                    violation(
                        G,
                        f"request {r.request_id}",
                        f"starved up to step {step.step_index}",
                        f"<= {bound} steps",
                        waited[r.request_id],
                    )
                )
    return out
