"""Run every applicable invariant on a pool, a step or a cluster step.

The checkers are listed once, as data (:data:`POOL_CHECKS`, :data:`STEP_CHECKS`,
:data:`CLUSTER_CHECKS`), so what reports "checked against N invariant checks" counts the
list that actually runs.
"""

from __future__ import annotations

from collections.abc import Callable

from refserve.spec.block import check_block
from refserve.spec.cap import check_cap, check_cap_step
from refserve.spec.cluster import (
    ClusterStep,
    check_conserve,
    check_kv_copy,
    check_leak,
    check_moved,
    check_owner,
)
from refserve.spec.handoff import check_handoff
from refserve.spec.host import check_host
from refserve.spec.kvlen import check_kvlen
from refserve.spec.pos import check_pos, check_pos_pool
from refserve.spec.prefix import check_prefix, check_prefix_step
from refserve.spec.progress import check_preempted_released, check_progress
from refserve.spec.snapshot import PoolSnapshot, StepSnapshot
from refserve.spec.token import check_token
from refserve.spec.transfer import check_in_flight_step
from refserve.spec.violation import Violation

#: A pool checker, given the pool and the declared ``lookahead``.
PoolCheck = Callable[[PoolSnapshot, int], list[Violation]]
#: A step checker, given the step, ``lookahead`` and ``same_step_hits``.
StepCheck = Callable[[StepSnapshot, int, bool], list[Violation]]
#: A migration rule (spec/cluster.py), given two consecutive cluster snapshots.
ClusterCheck = Callable[[ClusterStep], list[Violation]]

#: BLOCK, CAP, POS (table coverage, ``lookahead`` slots allowed) and PREFIX, in the order
#: :func:`check_pool` runs them. Each takes the same arguments, whether it reads them or not,
#: so one loop runs them all.
POOL_CHECKS: tuple[PoolCheck, ...] = (
    lambda pool, lookahead: check_block(pool),
    lambda pool, lookahead: check_cap(pool),
    check_pos_pool,
    lambda pool, lookahead: check_prefix(pool),
)


def _on_pool_after(check: PoolCheck) -> StepCheck:
    return lambda step, lookahead, same_step_hits: check(step.after.pool, lookahead)


#: Everything :func:`check_step` runs, in order: the step-level invariants, every pool
#: check on the state after the step, and the host pool's (:func:`refserve.spec.host.check_host`).
STEP_CHECKS: tuple[StepCheck, ...] = (
    lambda step, lookahead, same_step_hits: check_token(step),
    lambda step, lookahead, same_step_hits: check_kvlen(step),
    lambda step, lookahead, same_step_hits: check_pos(step),
    lambda step, lookahead, same_step_hits: check_cap_step(step),
    lambda step, lookahead, same_step_hits: check_prefix_step(step, same_step_hits),
    lambda step, lookahead, same_step_hits: check_progress(step, lookahead),
    lambda step, lookahead, same_step_hits: check_preempted_released(step),
    lambda step, lookahead, same_step_hits: check_in_flight_step(step),
    *(_on_pool_after(check) for check in POOL_CHECKS),
    lambda step, lookahead, same_step_hits: check_host(step.after, lookahead),
)


def check_pool(pool: PoolSnapshot, lookahead: int = 0) -> list[Violation]:
    """Every check of :data:`POOL_CHECKS` on a pool."""
    return [v for check in POOL_CHECKS for v in check(pool, lookahead)]


def check_step(
    step: StepSnapshot, lookahead: int = 0, same_step_hits: bool = False
) -> list[Violation]:
    """Every check of :data:`STEP_CHECKS` on a step. ``lookahead`` and ``same_step_hits``
    are declared conventions (:func:`refserve.spec.pos.check_pos_pool`,
    :func:`refserve.spec.prefix.check_prefix_step`)."""
    return [v for check in STEP_CHECKS for v in check(step, lookahead, same_step_hits)]


#: The migration rules (docs/MIGRATION.md, "The rules") in the order
#: :func:`check_cluster` runs them: OWNER and KVCOPY on the later snapshot, CONSERVE, MOVED
#: and LEAK on the pair (MOVED with its rule ``handoff``, spec/handoff.py, on the later one).
CLUSTER_CHECKS: tuple[ClusterCheck, ...] = (
    lambda step: check_owner(step.after),
    check_conserve,
    lambda step: [*check_moved(step), *check_handoff(step.after)],  # rule handoff
    lambda step: check_kv_copy(step.after),
    check_leak,
)


def check_cluster(step: ClusterStep) -> list[Violation]:
    """Every check of :data:`CLUSTER_CHECKS` on two consecutive cluster snapshots."""
    return [v for check in CLUSTER_CHECKS for v in check(step)]
