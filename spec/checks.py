"""Run every applicable invariant on a pool or a step."""

from __future__ import annotations

from spec.block import check_block
from spec.cap import check_cap, check_cap_step
from spec.host import check_host
from spec.kvlen import check_kvlen
from spec.pos import check_pos, check_pos_pool
from spec.prefix import check_prefix, check_prefix_step
from spec.progress import check_progress
from spec.snapshot import PoolSnapshot, StepSnapshot
from spec.token import check_token
from spec.violation import Violation


def check_pool(pool: PoolSnapshot) -> list[Violation]:
    """BLOCK, CAP, POS (table coverage) and PREFIX on a pool snapshot."""
    return [*check_block(pool), *check_cap(pool), *check_pos_pool(pool), *check_prefix(pool)]


def check_step(step: StepSnapshot) -> list[Violation]:
    """Every step-level invariant plus :func:`check_pool` and :func:`spec.host.check_host`
    on the state after the step."""
    return [
        *check_token(step),
        *check_kvlen(step),
        *check_pos(step),
        *check_cap_step(step),
        *check_prefix_step(step),
        *check_progress(step),
        *check_pool(step.after.pool),
        *check_host(step.after),
    ]
