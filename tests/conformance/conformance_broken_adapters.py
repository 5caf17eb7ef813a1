"""Deliberately broken adapters: refserve's adapter with one corruption each.

Each one breaks exactly one thing an engine could get wrong, so a test can assert that
the suite reports it under the right invariant. They are importable as
``conformance_broken_adapters:double_free``
(with ``tests/conformance`` on ``sys.path``) for the CLI and the pytest plugin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from refserve.conformance.adapter import CommitReport, MigrationExport, StepReport
from refserve.conformance.adapters.ref import RefAdapter
from refserve.core import transit
from refserve.spec.snapshot import CacheEntry, EngineSnapshot, PoolSnapshot, RequestSnapshot


class DoubleFree(RefAdapter):
    """The free queue lists a block twice once anything has been freed."""

    def snapshot(self) -> EngineSnapshot:
        s = super().snapshot()
        q = s.pool.free_queue
        if q and any(rc == 0 for rc in s.pool.ref_cnt) and s.pool.tables:
            pool = dataclasses.replace(s.pool, free_queue=(*q, q[-1]))
            return dataclasses.replace(s, pool=pool)
        return s


class SkippedPosition(RefAdapter):
    """Every decode reports position + 1 (a position is skipped)."""

    def schedule(self) -> StepReport:
        rep = super().schedule()
        out = []
        for s in rep.scheduled:
            if s.num_new_tokens == 1 and s.positions[0] > 0:
                s = dataclasses.replace(s, positions=(s.positions[0] + 1,))
            out.append(s)
        return dataclasses.replace(rep, scheduled=tuple(out))


class WrongSlot(RefAdapter):
    """Slots are shifted by one block (K/V written into someone else's block)."""

    def schedule(self) -> StepReport:
        rep = super().schedule()
        bs = self.sched.config.block_size
        out = [
            dataclasses.replace(s, slot_mapping=tuple(x + bs for x in s.slot_mapping))
            for s in rep.scheduled
        ]
        return dataclasses.replace(rep, scheduled=tuple(out))


class OverBudget(RefAdapter):
    """Reports one token more than scheduled for the first request of every step."""

    def schedule(self) -> StepReport:
        rep = super().schedule()
        if not rep.scheduled:
            return rep
        s = rep.scheduled[0]
        s = dataclasses.replace(
            s, num_new_tokens=s.num_new_tokens + self.sched.config.max_num_batched_tokens
        )
        return dataclasses.replace(rep, scheduled=(s, *rep.scheduled[1:]))


class EarlySample(RefAdapter):
    """Claims every prefill chunk samples (a logit from the middle of a prompt)."""

    def schedule(self) -> StepReport:
        rep = super().schedule()
        out = [dataclasses.replace(s, samples=True) for s in rep.scheduled]
        self._claimed = {s.request_id for s in out} - {
            s.request_id for s in rep.scheduled if s.samples
        }
        return dataclasses.replace(rep, scheduled=tuple(out))

    def commit(self, sampled: Mapping[str, int]) -> CommitReport:
        return super().commit({k: v for k, v in sampled.items() if k not in self._claimed})


class Leak(RefAdapter):
    """A finished request's last block keeps a reference forever."""

    def snapshot(self) -> EngineSnapshot:
        s = super().snapshot()
        if s.pool.tables or not s.pool.free_queue:
            return s
        b = s.pool.free_queue[0]
        ref = list(s.pool.ref_cnt)
        ref[b] = 1
        pool = dataclasses.replace(s.pool, ref_cnt=tuple(ref), free_queue=s.pool.free_queue[1:])
        return dataclasses.replace(s, pool=pool)


class StaleCacheEntry(RefAdapter):
    """The cache index claims every held full block holds other tokens."""

    def snapshot(self) -> EngineSnapshot:
        s = super().snapshot()
        entries = tuple(
            dataclasses.replace(e, token_ids=tuple(t + 1 for t in e.token_ids))
            for e in s.pool.cache_entries
        )
        return dataclasses.replace(s, pool=dataclasses.replace(s.pool, cache_entries=entries))


class LossyRollback(RefAdapter):
    """Rollback forgets to undo the plan: the reservation leaks into the next state."""

    def rollback(self) -> None:
        plan = self._plan
        if plan is not None and plan.chunks:
            self.sched.commit(plan, {c.request_id: 5 for c in plan.chunks if c.samples})
            self._plan = None
            return
        super().rollback()


class FrozenCounter(RefAdapter):
    """num_computed_tokens is reported one short after a prefill chunk."""

    def snapshot(self) -> EngineSnapshot:
        s = super().snapshot()
        reqs = tuple(
            dataclasses.replace(r, num_computed_tokens=r.num_computed_tokens - 1)
            if r.status == "prefilling" and r.num_computed_tokens > 0
            else r
            for r in s.requests
        )
        return dataclasses.replace(s, requests=reqs)


class SwapOutLost(RefAdapter):
    """Preempts by swap, but the swap-out copies land one host block off."""

    def __init__(self) -> None:
        super().__init__(preemption_mode="swap", num_host_blocks="pool")

    def schedule(self) -> StepReport:
        rep = super().schedule()
        n = self.sched.config.num_host_blocks
        lost = tuple((dev, (host + 1) % n) for dev, host in rep.swap_out)
        return dataclasses.replace(rep, swap_out=lost)


def _unused(x: PoolSnapshot | RequestSnapshot | CacheEntry) -> None:  # pragma: no cover
    """Keeps the spec types imported for readers of the corruptions above."""


BROKEN = {
    "DoubleFree": (DoubleFree, "BLOCK"),
    "SkippedPosition": (SkippedPosition, "POS"),
    "WrongSlot": (WrongSlot, "POS"),
    "OverBudget": (OverBudget, "TOKEN"),
    "EarlySample": (EarlySample, "KVLEN"),
    "Leak": (Leak, "PROGRESS"),
    "StaleCacheEntry": (StaleCacheEntry, "PREFIX"),
    "LossyRollback": (LossyRollback, "ATOMIC"),
    "FrozenCounter": (FrozenCounter, "TOKEN"),
    "SwapOutLost": (SwapOutLost, "BLOCK"),
}


def double_free() -> DoubleFree:
    return DoubleFree()


class StaleExportAfterPreemption(RefAdapter):
    """Migration: the export sends the slot list a request had before its last
    preemption (remembered, not re-read), for the positions it covers: after the request
    recomputed its KV into other blocks, the list names blocks it no longer holds."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, tuple[int, ...]] = {}  # slots at the last step boundary
        self._stale: dict[str, tuple[int, ...]] = {}  # slots from before a preemption

    def schedule(self) -> StepReport:
        rep = super().schedule()
        for rid in rep.preempted:
            if self._last.get(rid):
                self._stale[rid] = self._last[rid]
        return rep

    def commit(
        self, sampled: Mapping[str, int], accepted: Mapping[str, int] | None = None
    ) -> CommitReport:
        out = super().commit(sampled, accepted)
        self._last = {rid: transit.export(self.sched, rid).slots for rid in self.sched.requests}
        return out

    def export_request(self, request_id: str) -> MigrationExport:
        e = super().export_request(request_id)
        old = self._stale.get(request_id, ())
        if not old or not e.kv_slots:
            return e
        n = len(e.kv_slots)
        return dataclasses.replace(e, kv_slots=old[:n] + e.kv_slots[len(old) :])


def stale_export_after_preemption() -> StaleExportAfterPreemption:
    return StaleExportAfterPreemption()
