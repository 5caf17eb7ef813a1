"""A migration between two schedulers, phase by phase, for the tests of the protocol's
rules (spec/cluster.py): :class:`PhasedMigration` drives ref/core/transit.py's three
moves (export, stage and commit, release) with the K/V carried by a :class:`KVLink` (a
fake memory in tests/harness.py; the protocol's functions are called through the
module, so that a test can plant a bug in them), so that every phase can be observed as a cluster
snapshot and a fault injected at every :class:`~refserve.core.transit.MigrationFault`.

It follows the engines' driver (ref/engine/migration.py, ``migrate``) in the order of
its phases, its fault points and its meaning of "the source changed"
(:func:`~refserve.core.transit.source_changed`); it carries K/V between fake memories
instead of caches, and exposes each phase to the test.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from refserve.core import transit
from refserve.core.request import Request
from refserve.core.scheduler import Scheduler
from refserve.core.transit import (
    Arrival,
    Departure,
    Import,
    KVPlace,
    MigrationArgs,
    MigrationError,
    MigrationFault,
    source_changed,
)
from refserve.spec.cluster import Node, Transit, TransitPhase
from refserve.spec.snapshot import PoolSnapshot, RequestSnapshot


class PhasedMigrationAborted(MigrationError):
    """A migration failed before the ack: the request runs on the source as before and
    the destination is as it was (ATOMIC, docs/MIGRATION.md)."""

    def __init__(self, request_id: str, point: str, cause: BaseException) -> None:
        super().__init__(f"migration of {request_id!r} aborted at {point}: {cause!r}")
        self.request_id = request_id
        self.point = point
        self.cause = cause


class KVLink(Protocol):
    """Carries K/V from the source's slots to the destination's."""

    def copy(self, departure: Departure, arrival: Arrival, start: int, end: int) -> None:
        """Write positions ``[start, end)``, inside ``[arrival.num_hit_tokens,
        arrival.kv_length)``: ``departure.slots[p]`` to ``arrival.slots[p - hit]``."""

    def undo(self) -> None:
        """Put back every destination slot :meth:`copy` wrote (the migration aborted)."""


FaultHook = Callable[[str], None]
Observer = Callable[["PhasedMigration"], None]


class PhasedMigration:
    """One request migrating from ``src`` to ``dst``: :meth:`export`, :meth:`stage`,
    :meth:`copy` per chunk, :meth:`ack`, :meth:`release`, :meth:`commit`, or
    :meth:`abort` at any point before the ack. :meth:`run` does it all in that order.

    ``with_kv``: transfer the K/V (only what the destination's prefix hit lacks) or let
    the destination recompute it. ``chunk_blocks``: copy that many source blocks at a
    time (None: all at once). ``phase`` is None before the export and after the end."""

    def __init__(
        self,
        src: Scheduler,
        dst: Scheduler,
        request_id: str,
        *,
        with_kv: bool,
        link: KVLink,
        chunk_blocks: int | None = None,
    ) -> None:
        MigrationArgs.check(chunk_blocks=chunk_blocks)
        if src is dst:
            raise MigrationError(
                f"migration of {request_id!r}: source and destination are one engine"
            )
        self.src, self.dst, self.request_id = src, dst, request_id
        self.with_kv, self.link, self.chunk_blocks = with_kv, link, chunk_blocks
        self.phase: TransitPhase | None = None
        self.departure: Departure | None = None
        self.arrival: Arrival | None = None
        self.request: RequestSnapshot | None = None  # the source's record at the export
        self.pool_before: PoolSnapshot | None = None  # the destination's, before the stage
        self.staged_blocks: tuple[int, ...] = ()
        self.fault: str | None = None  # a fault after the ack, rolled forward
        self._import: Import | None = None
        self._copied = False
        self._next = 0  # the first position not copied yet

    # ------------------------------------------------------------------ the phases
    def export(self) -> Departure:
        assert self.phase is None and self.departure is None, "export once, first"
        d = transit.export(self.src, self.request_id)
        self.departure = d
        self.request = self.src.requests[self.request_id].snapshot(self.src.config.max_len)
        self.pool_before = self.dst.pool.snapshot()
        self.phase = TransitPhase.EXPORTED
        return d

    def stage(self) -> Arrival:
        assert self.phase is TransitPhase.EXPORTED and self.departure is not None
        imp = transit.begin_import(self.dst)
        try:
            a = imp.stage(self.departure.state, with_kv=self.with_kv)
        except BaseException:
            imp.abort()
            raise
        self._import, self.arrival = imp, a
        self._next = a.num_hit_tokens
        if a.kv_length:
            self.staged_blocks = self.dst.pool.block_table(self.request_id)
        self.phase = TransitPhase.STAGED
        return a

    def chunks(self) -> list[tuple[int, int]]:
        """The position ranges :meth:`copy` is given, in order."""
        a = self.arrival
        assert a is not None
        lo, hi = a.num_hit_tokens, a.kv_length
        size = (
            hi - lo if self.chunk_blocks is None else self.chunk_blocks * self.src.config.block_size
        )
        return [(s, min(s + size, hi)) for s in range(lo, hi, max(size, 1))]

    def copy(self, start: int, end: int) -> None:
        """Positions ``[start, end)``, in order: each range starts where the last ended,
        read where the source holds them now (as the engine's ``read_kv`` reads)."""
        a, d = self.arrival, self.departure
        assert self.phase is TransitPhase.STAGED and a is not None and d is not None
        if start != self._next or not start < end <= a.kv_length:
            raise MigrationError(
                f"migration of {self.request_id!r}: copy of [{start}, {end}) out of order; "
                f"positions [{a.num_hit_tokens}, {self._next}) of [{a.num_hit_tokens}, "
                f"{a.kv_length}) are written"
            )
        self._require_unchanged()
        now = transit.export(self.src, self.request_id)
        if end > now.kv_length:
            raise MigrationError(
                f"migration of {self.request_id!r}: the source holds K/V for positions "
                f"[0, {now.kv_length}); asked [{start}, {end})"
            )
        self._copied = True
        self.link.copy(now, a, start, end)
        self._next = end

    def ack(self) -> None:
        """Every needed slot is written: from here the destination owns the request."""
        a = self.arrival
        assert self.phase is TransitPhase.STAGED and a is not None
        if self._next != a.kv_length:
            raise MigrationError(
                f"migration of {self.request_id!r}: ack with K/V of [{self._next}, "
                f"{a.kv_length}) still missing"
            )
        self._require_unchanged()
        self.phase = TransitPhase.ACKED

    def release(self) -> None:
        assert self.phase is TransitPhase.ACKED, "the source releases only after the ack"
        transit.release(self.src, self.request_id)
        self.phase = TransitPhase.RELEASED

    def commit(self, offset_ms: float = 0.0) -> list[Request]:
        assert self.phase is TransitPhase.RELEASED and self._import is not None
        reqs = self._import.commit(offset_ms)
        self.phase = None
        return reqs

    def abort(self) -> None:
        """Before the ack: every slot written put back, every staged block returned."""
        assert self.phase in (TransitPhase.EXPORTED, TransitPhase.STAGED), "abort after the ack"
        if self._copied:
            self.link.undo()
        if self._import is not None:
            self._import.abort()
        self.phase = None

    # ------------------------------------------------------------------ the driver
    def run(
        self,
        *,
        fault: FaultHook | None = None,
        observe: Observer | None = None,
        offset_ms: float = 0.0,
    ) -> list[Request]:
        """Every phase in order. ``observe(self)`` after each phase and chunk;
        ``fault(point)`` at each :class:`MigrationFault`. A :class:`MigrationError` (the
        destination refused, the source changed meanwhile) is raised as it is, anything
        else before the ack as :class:`PhasedMigrationAborted`, both with the migration
        aborted; a fault after the ack is rolled forward and named in :attr:`fault`. An
        exception of ``observe`` (a broken rule) aborts before the ack and is raised as
        it is."""
        hook = fault or _no_fault
        watch = observe or _no_observer
        failed: list[BaseException] = []

        def see(m: PhasedMigration) -> None:
            try:
                watch(m)
            except BaseException as e:
                failed.append(e)
                raise

        point: str = MigrationFault.BEFORE_EXPORT
        try:
            hook(point)
            self.export()
            see(self)
            self.stage()
            see(self)
            point = MigrationFault.AFTER_STAGE
            hook(point)
            point = MigrationFault.MID_STREAM
            for start, end in self.chunks():
                self.copy(start, end)
                see(self)
                hook(point)
            point = MigrationFault.BEFORE_ACK
            hook(point)
            self.ack()
        except BaseException as e:
            if self.phase is not None:
                self.abort()
            if failed or isinstance(e, MigrationError):
                raise
            raise PhasedMigrationAborted(self.request_id, point, e) from e
        see(self)
        try:
            hook(MigrationFault.AFTER_ACK)
        except Exception:  # the destination owns it now: roll forward
            self.fault = MigrationFault.AFTER_ACK
        self.release()
        see(self)
        return self.commit(offset_ms)

    # ------------------------------------------------------------------ the records
    def transit(self, source: str, destination: str) -> Transit:
        """The migration as spec/cluster.py sees it, the engines named ``source`` and
        ``destination``."""
        d, r = self.departure, self.request
        assert self.phase is not None and d is not None and r is not None
        a = self.arrival
        return Transit(
            request_id=self.request_id,
            source=source,
            destination=destination,
            phase=self.phase,
            with_kv=self.with_kv,
            request=r,
            token_ids=d.state.token_ids,
            kv_length=d.kv_length,
            num_hit_tokens=0 if a is None else a.num_hit_tokens,
            staged_blocks=self.staged_blocks,
            pool_before=self.pool_before,
            sent_slots=d.slots,
            sent_on_host=d.kv_place is KVPlace.HOST,
            received_slots=None if a is None else a.slots,
        )

    def _require_unchanged(self) -> None:
        """The source still holds the request as exported (:func:`source_changed`)."""
        assert self.departure is not None
        if source_changed(self.src, self.departure.state):
            raise MigrationError(
                f"migration of {self.request_id!r}: it changed on the source during the transfer"
            )


def _no_fault(point: str) -> None:
    pass


def _no_observer(migration: PhasedMigration) -> None:
    pass


def cluster_node(
    name: str,
    sched: Scheduler,
    memory: Mapping[int, int] | None = None,
    host_memory: Mapping[int, int] | None = None,
) -> Node:
    """One scheduler as a node of a cluster snapshot (spec/cluster.py): its snapshot, its
    live requests' token ids and, when given, its fake K/V memories."""
    return Node(
        name,
        sched.snapshot(),
        tuple((rid, tuple(r.token_ids)) for rid, r in sorted(sched.requests.items())),
        None if memory is None else tuple(sorted(memory.items())),
        None if host_memory is None else tuple(sorted(host_memory.items())),
    )
