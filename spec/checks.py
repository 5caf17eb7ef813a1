"""Run every applicable invariant on a pool or a step."""

from __future__ import annotations

from spec.block import check_block
from spec.cap import check_cap, check_cap_step
from spec.host import check_host
from spec.kvlen import check_kvlen
from spec.pos import check_pos, check_pos_pool
from spec.prefix import check_prefix, check_prefix_step
from spec.progress import check_preempted_released, check_progress
from spec.snapshot import PoolSnapshot, StepSnapshot
from spec.token import check_token
from spec.violation import Violation


def check_pool(pool: PoolSnapshot, lookahead: int = 0) -> list[Violation]:
    """BLOCK, CAP, POS (table coverage, ``lookahead`` slots allowed) and PREFIX on a pool."""
    return [
        *check_block(pool),
        *check_cap(pool),
        *check_pos_pool(pool, lookahead),
        *check_prefix(pool),
    ]


def check_step(
    step: StepSnapshot, lookahead: int = 0, same_step_hits: bool = False
) -> list[Violation]:
    """Every step-level invariant plus :func:`check_pool` and :func:`spec.host.check_host`
    on the state after the step. ``lookahead`` and ``same_step_hits`` are declared
    conventions (:func:`spec.pos.check_pos_pool`, :func:`spec.prefix.check_prefix_step`)."""
    return [
        *check_token(step),
        *check_kvlen(step),
        *check_pos(step),
        *check_cap_step(step),
        *check_prefix_step(step, same_step_hits),
        *check_progress(step, lookahead),
        *check_preempted_released(step),
        *check_pool(step.after.pool, lookahead),
        *check_host(step.after, lookahead),
    ]
