"""One request's timeline as a record (docs/ARCHITECTURE.md, example 2f): queueing delay
(admitted - arrival), TTFT (first token - arrival), ITL (gaps between consecutive tokens),
TPOT (mean ITL), E2E (last token - arrival).

A record of the core, below both the engine (which reports it with each final output)
and the simulator (whose run figures, ref/sim/metrics.py, aggregate it): neither has to
import the other for it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from refserve.core.migration_cost import MigrationDecision
from refserve.core.mlfq import MlfqChoice
from refserve.core.request import Request


@dataclass(frozen=True)
class RequestMetrics:
    request_id: str
    arrival_ms: float
    admitted_ms: float | None
    token_times_ms: tuple[float, ...]
    finished_ms: float | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    tenant: str = "default"
    # Speculative decoding (docs/SPECULATIVE.md): drafts verified for this request, and
    # how many of them the target accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Migration (docs/MIGRATION.md): each move of this request, the rule's decision and
    # its inputs (transfer or recompute, KV tokens, destination hit, link, idle compute).
    migrations: tuple[MigrationDecision, ...] = ()
    # The skip-join MLFQ (docs/MLFQ.md): each time the policy displaced this request, the
    # choice (K/V to the host or recompute) and its inputs.
    displacements: tuple[MlfqChoice, ...] = ()

    @property
    def queue_ms(self) -> float | None:
        return None if self.admitted_ms is None else self.admitted_ms - self.arrival_ms

    @property
    def ttft_ms(self) -> float | None:
        return self.token_times_ms[0] - self.arrival_ms if self.token_times_ms else None

    @property
    def itl_ms(self) -> tuple[float, ...]:
        t = self.token_times_ms
        return tuple(b - a for a, b in itertools.pairwise(t))

    @property
    def tpot_ms(self) -> float | None:
        itl = self.itl_ms
        return sum(itl) / len(itl) if itl else None

    @property
    def e2e_ms(self) -> float | None:
        return self.token_times_ms[-1] - self.arrival_ms if self.token_times_ms else None

    @property
    def jct_ms(self) -> float | None:
        """Job completion time: arrival to finish (None while unfinished)."""
        return None if self.finished_ms is None else self.finished_ms - self.arrival_ms

    @classmethod
    def of(cls, r: Request) -> RequestMetrics:
        return cls(
            r.request_id,
            r.arrival_ms,
            r.admitted_ms,
            tuple(r.token_times_ms),
            r.finished_ms,
            None if r.finish_reason is None else str(r.finish_reason),
            r.num_prompt_tokens,
            r.num_output_tokens,
            r.num_cached_tokens,
            r.num_preemptions,
            r.tenant,
        )
