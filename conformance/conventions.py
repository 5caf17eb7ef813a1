"""The conventions an adapter declares and the run holds it to, step by step: its
admission order and step order, or its preemptive multi-level queue (ORDER), the
same-step prefix hits it promises (PREFIX), the order of its free queue (BLOCK). Each
request's place in the declared admission order is kept here: the engine's queue can
only know when the request joined it.
"""

from __future__ import annotations

from collections.abc import Mapping

from refserve.conformance import validate
from refserve.conformance.adapter import (
    LEVELS_METHOD,
    AdmissionOrder,
    EngineConfig,
    EngineProperties,
    StepOrder,
)
from refserve.conformance.probe import Probe
from refserve.spec.order import (
    check_admission_order,
    check_decode_first,
    check_level_admission,
    check_level_preemption,
    check_prefill_first,
    check_strict_admission_order,
)
from refserve.spec.prefix import check_same_step_hits
from refserve.spec.snapshot import EngineSnapshot, StepSnapshot, TransferKind
from refserve.spec.violation import Invariant


class Conventions:
    """One instance's declared conventions, checked on each step."""

    def __init__(self, probe: Probe, cfg: EngineConfig, props: EngineProperties) -> None:
        self.probe = probe
        self.cfg = cfg
        self.props = props
        """The engine's declared properties (read again once it is configured)."""
        self.rank: dict[str, tuple[int, ...]] = {}
        """Each request's place in the declared admission order."""

    @property
    def declared(self) -> bool:
        """Whether an order is declared (ORDER is checked)."""
        return (
            self.props.admission_order is not AdmissionOrder.UNSPECIFIED
            or self.props.step_order is not StepOrder.UNSPECIFIED
            or self.props.multi_level is not None
        )

    def join(self, rid: str, priority: int) -> None:
        """``rid`` takes the next place in the declared admission order (within its
        level, for a declared multi-level queue)."""
        n = len(self.rank)
        ml = self.props.multi_level
        by_priority = ml.by_priority if ml is not None else self.props.admission_order.by_priority
        self.rank[rid] = (priority, n) if by_priority else (n,)

    def read_levels(self, before: EngineSnapshot, step: int) -> Mapping[str, int] | None:
        """Every live request's level at the boundary ``before`` was taken at, read from
        the adapter's ``levels()`` (a declared multi-level queue; None otherwise): the
        levels the next step is planned with. A missing method or a malformed answer is
        a PROGRESS finding that ends the run, as for any adapter call."""
        ml = self.props.multi_level
        if ml is None:
            return None
        a = self.probe.a
        what = f"{LEVELS_METHOD}()"
        levels = self.probe.call(step, "step", what, lambda: getattr(a, LEVELS_METHOD)())
        live = [r.request_id for r in before.requests if not r.status.is_done]
        self.probe.malformed(
            step, "step", what, validate.check_levels(levels, live, ml.num_levels, what)
        )
        return dict(levels)

    def check(self, snap: StepSnapshot, step: int, levels: Mapping[str, int] | None = None) -> None:
        self.check_order(snap, step, levels)
        self.check_promises(snap, step)
        if self.props.free_queue_order:
            self.check_free_order(snap, step)

    def check_order(
        self, snap: StepSnapshot, step: int, levels: Mapping[str, int] | None = None
    ) -> None:
        """ORDER: the declared admission order and the declared step order (decode-first
        or prefill-first), or the declared multi-level queue (with the ``levels`` read
        before the step), when the adapter declares them."""
        checked, props = self.probe.checked, self.props
        if props.multi_level is not None and levels is not None:
            # Declared instead of an admission and a step order (EngineProperties
            # refuses both together), so FCFS and decode-first are never checked here:
            # the discipline reorders by level and preempts for a higher one by design.
            lv = levels
            checked(
                step,
                "step",
                lambda: check_level_admission(snap, lv, self.rank, props.lookahead_slots),
            )
            checked(step, "step", lambda: check_level_preemption(snap, lv, props.lookahead_slots))
        if props.step_order is StepOrder.DECODE_FIRST:
            checked(step, "step", lambda: check_decode_first(snap))
        elif props.step_order is StepOrder.PREFILL_FIRST:
            checked(
                step,
                "step",
                lambda: check_prefill_first(snap, self.rank, props.lookahead_slots),
            )
        declared = props.admission_order
        if declared.strict:
            # Head-of-line blocking promises more than the lax order: a strict engine
            # that lets a small request pass a large head breaks its promise although
            # the lax rule allows it (spec/order.py).
            checked(
                step,
                "step",
                lambda: check_strict_admission_order(snap, self.rank, str(declared)),
            )
        elif declared is not AdmissionOrder.UNSPECIFIED:
            checked(
                step,
                "step",
                lambda: check_admission_order(
                    snap, self.rank, props.lookahead_slots, str(declared)
                ),
            )

    def check_promises(self, snap: StepSnapshot, step: int) -> None:
        """A declared convention the engine says it follows, held as a promise: PREFIX
        lets an engine share a block another request fills in the same step; this holds
        it to taking such hits where it declared it does (PREFIX rule
        ``declared-same-step-hits``; docs/CONFORMANCE.md, "Declarations are promises").
        Promised only with prefix caching on: without it no engine hits at all."""
        if self.props.same_step_prefix_hits and self.cfg.enable_prefix_caching:
            self.probe.checked(step, "step", lambda: check_same_step_hits(snap))

    def check_free_order(self, snap: StepSnapshot, step: int) -> None:
        """Free blocks are handed out in the order the snapshot's free queue states.

        Known bug elsewhere: the free-list reuse order changing silently (which blocks a
        prefix cache keeps longest). Blocks revived by a cache hit may come from anywhere
        in the queue; every other block that was free before the step and is held during
        or after it must come from the head of the queue, in order.
        """
        before = snap.before.pool
        bs = before.block_size
        hits: set[int] = set()
        for s in snap.scheduled:
            hits.update(s.block_table[: s.num_new_cached_tokens // bs])
        hits.update(_load_hits(snap))
        queue = [b for b in before.free_queue if b not in hits]
        in_queue = set(queue)
        taken: set[int] = set()
        for t in snap.after.pool.tables:
            taken.update(b for b in t.block_table if b in in_queue)
        for s in snap.scheduled:
            taken.update(b for b in s.block_table if b in in_queue)
        head = queue[: len(taken)]
        if set(head) != taken:
            self.probe.fail(
                Invariant.BLOCK,
                step,
                "step",
                "free queue",
                "new blocks were not taken from the head of the free queue in order",
                head,
                sorted(taken),
            )


def _load_hits(snap: StepSnapshot) -> set[int]:
    """The prefix hit of each load the step started: the blocks its holder took that
    the load does not write (a hit may come from anywhere in the free queue)."""
    started = {(x.request_id, x.kind) for x in snap.before.pool.transfers}
    out: set[int] = set()
    for x in snap.after.pool.transfers:
        if x.kind is not TransferKind.LOAD or (x.request_id, x.kind) in started:
            continue
        table = snap.after.pool.table(x.holder or x.request_id)
        if table is not None:
            out.update(b for b in table.block_table if b not in x.blocks)
    return out


__all__ = ["Conventions"]
