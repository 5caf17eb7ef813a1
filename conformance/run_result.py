"""What running one workload yields (docs/CONFORMANCE.md): its findings, where each
happened, the policy behaviour it showed (never a violation), and its replayable trace."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from refserve.conformance.adapter import CommitReport, StepReport
from refserve.conformance.workload import Workload
from refserve.spec.snapshot import EngineSnapshot
from refserve.spec.violation import Invariant, Violation


@dataclass(frozen=True)
class Finding:
    """A violation with where it happened: ``step`` is the engine step (-1: at quiescence),
    ``phase`` one of ``step``, ``add``, ``abort``, ``rollback``, ``quiescence``."""

    violation: Violation
    step: int
    phase: str = "step"

    @property
    def invariant(self) -> Invariant:
        return self.violation.invariant

    def to_json(self) -> dict[str, Any]:
        v = self.violation
        return {
            "invariant": str(v.invariant),
            "step": self.step,
            "phase": self.phase,
            "subject": v.subject,
            "message": v.message,
            "expected": v.expected,
            "seen": v.seen,
            **({"rule": v.rule} if v.rule else {}),
        }

    def __str__(self) -> str:
        return f"step {self.step} ({self.phase}): {self.violation}"


@dataclass
class Observed:
    """Policy behaviour seen in a run (reported separately from violations)."""

    steps: int = 0
    mixed_steps: int = 0
    """Steps scheduling both a prefill chunk and a decode."""
    decodes_paused_for_prefill: int = 0
    """Steps that ran a prefill while a decoding request got nothing (prefill-first)."""
    chunked_prompts: int = 0
    """Prompts computed over more than one step."""
    preemptions: int = 0
    cached_tokens: int = 0
    rejected: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    rounds: list[tuple[tuple[str, int], ...]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "mixed_steps": self.mixed_steps,
            "decodes_paused_for_prefill": self.decodes_paused_for_prefill,
            "chunked_prompts": self.chunked_prompts,
            "preemptions": self.preemptions,
            "cached_tokens": self.cached_tokens,
            "rejected": self.rejected,
            "finish_reasons": dict(sorted(self.finish_reasons.items())),
        }


@dataclass
class RunResult:
    workload: Workload
    findings: list[Finding] = field(default_factory=list)
    trace: list[dict[str, Any]] = field(default_factory=list)
    observed: Observed = field(default_factory=Observed)
    checked: set[Invariant] = field(default_factory=set)
    not_supported: str = ""
    """Non-empty when the engine cannot run the workload at all (the reason)."""

    @property
    def ok(self) -> bool:
        return not self.findings

    def first(self) -> Finding | None:
        return self.findings[0] if self.findings else None


def _span(positions: tuple[int, ...]) -> list[int]:
    """Positions as [first, last] (they should be contiguous; the check says if not)."""
    if not positions:
        return []
    if positions == tuple(range(positions[0], positions[-1] + 1)):
        return [positions[0], positions[-1]]
    return list(positions)


def step_trace(
    step: int,
    before: EngineSnapshot,
    plan: StepReport,
    done: CommitReport,
    sampled: Mapping[str, int],
) -> dict[str, Any]:
    """One step's entry of the trace: what was scheduled, sampled, preempted, finished."""
    return {
        "step": step,
        "scheduled": [
            {
                "id": s.request_id,
                "n": s.num_new_tokens,
                "positions": _span(s.positions),
                "slots": list(s.slot_mapping),
                "block_table": list(s.block_table),
                "samples": s.samples,
                "cached": s.num_new_cached_tokens,
                "drafts": s.num_draft_tokens,
            }
            for s in plan.scheduled
        ],
        "sampled": dict(sampled),
        "preempted": list(plan.preempted),
        "finished": [[r, why] for r, why in (*plan.finished, *done.finished)],
        "free_blocks": len(before.pool.free_queue),
    }
