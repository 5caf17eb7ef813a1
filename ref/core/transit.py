"""Migration at the scheduler: a request leaves one scheduler and enters another at a
step boundary, with its KV or without (docs/MIGRATION.md, "The protocol").

Three moves, in this order, each at a step boundary of its scheduler:

1. :func:`departure` (the source): a pure read of the request's state and of the slots
   that hold its KV (device or host). Nothing changes; the request keeps running on the
   source until step 3, so a failure anywhere before it leaves the source as it was.
2. :class:`Import` (the destination): ``stage`` reserves the destination's own blocks
   inside one pool transaction (its prefix hits are used: only the positions after the
   hit need K/V) and returns the slots to write; the request is not visible to the
   destination's scheduler yet. ``abort`` rolls the transaction back (nothing staged is
   left, not even a prefix-cache entry); ``commit`` makes the request runnable.
3. :func:`release` (the source, after the destination acknowledged): the request leaves
   the source; its blocks go back to the source's pool. Not a finish: it is not retired.

The scheduler refuses to step while an import is staged (``StepInProgress``): the
staged blocks belong to an open transaction.

:class:`Move` drives the three moves for one request between two schedulers, with the
K/V carried by a :class:`KVLink` (the executors' business) and the ack between the copy
and the release, phase by phase (refserve.spec.cluster.TransitPhase), so that each phase can be
observed and a fault injected at every point of :data:`MOVE_POINTS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Protocol

from refserve.core.capacity import require_fit
from refserve.core.request import Request, StopParams, check_room_for_output
from refserve.core.scheduler import Scheduler
from refserve.errors import DuplicateRequest, OutOfBlocks, RefserveError
from refserve.spec.arith import logical_block, slot_of
from refserve.spec.cluster import Node, Transit, TransitPhase
from refserve.spec.hashing import Namespace
from refserve.spec.snapshot import PoolSnapshot, RequestSnapshot, RequestStatus

S = RequestStatus


class MigrationError(RefserveError):
    """A migration that cannot proceed; the request stays where it was."""


class MigrationRefused(MigrationError):
    """The destination cannot take the request now (no running slot, too few blocks)."""


class KVPlace(StrEnum):
    """Where a request's KV is at a step boundary."""

    DEVICE = "device"
    HOST = "host"
    NONE = "none"


#: States that hold a running slot when imported with their KV.
_RUNNING = frozenset({S.PREFILLING, S.DECODING, S.SWAPPED})
#: Every live state a request can be exported in.
_LIVE = frozenset({S.WAITING, S.PREEMPTED, *_RUNNING, S.WAITING_TOOL})


@dataclass(frozen=True)
class RequestState:
    """One request as the scheduler knows it, detached from any scheduler: what another
    scheduler needs to continue it exactly. Times are on the source's clock.

    ``num_computed_tokens`` is the KV length on the source; the destination holds the
    same length after a transfer and 0 after a recompute import (KVLEN). The source's
    prefix hit does not travel: a hit is counted in its engine's blocks (PREFIX), so the
    destination counts its own (``_place``)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    stop: StopParams
    status: RequestStatus
    num_computed_tokens: int
    num_preemptions: int = 0
    priority: int = 0
    tenant: str = "default"
    namespace: Namespace = field(default_factory=Namespace)
    arrival_ms: float = 0.0
    admitted_ms: float | None = None
    token_times_ms: tuple[float, ...] = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def shifted(self, offset_ms: float) -> RequestState:
        """The same state with every time moved by ``offset_ms`` (onto another clock)."""
        return replace(
            self,
            arrival_ms=self.arrival_ms + offset_ms,
            admitted_ms=None if self.admitted_ms is None else self.admitted_ms + offset_ms,
            token_times_ms=tuple(t + offset_ms for t in self.token_times_ms),
        )

    @staticmethod
    def of(r: Request) -> RequestState:
        return RequestState(
            request_id=r.request_id,
            prompt_token_ids=tuple(r.prompt_token_ids),
            token_ids=tuple(r.token_ids),
            stop=r.stop,
            status=r.status,
            num_computed_tokens=r.num_computed_tokens,
            num_preemptions=r.num_preemptions,
            priority=r.priority,
            tenant=r.tenant,
            namespace=r.namespace,
            arrival_ms=r.arrival_ms,
            admitted_ms=r.admitted_ms,
            token_times_ms=tuple(r.token_times_ms),
        )


@dataclass(frozen=True)
class Departure:
    """What the source exports for one request: its state and where its KV is.

    ``slots[p]`` is the source slot (device or host memory, by ``kv_place``) holding
    position ``p``, for ``p`` in ``[0, num_computed_tokens)``; empty when the KV is
    nowhere (waiting, recompute-preempted, a tool wait that dropped it)."""

    state: RequestState
    kv_place: KVPlace
    slots: tuple[int, ...]

    @property
    def kv_length(self) -> int:
        return len(self.slots)


def export(sched: Scheduler, request_id: str) -> Departure:
    """The source's side of step 1 (module doc): a pure read, at a step boundary."""
    sched.require_boundary("export")
    r = sched.requests.get(request_id)
    if r is None:
        raise MigrationError(f"export: request {request_id!r} is not live on this engine")
    bs = sched.config.block_size
    n = r.num_computed_tokens
    state = RequestState.of(r)
    if n and sched.pool.has_request(request_id):
        table = sched.pool.block_table(request_id)
        return Departure(state, KVPlace.DEVICE, _slots(table, 0, n, bs))
    if n and sched.host.has_request(request_id):
        host = sched.host.table(request_id)
        assert host.num_stored == n, "a swapped request's host KV is its KV length"
        return Departure(state, KVPlace.HOST, _slots(host.block_ids, 0, n, bs))
    return Departure(replace(state, num_computed_tokens=0), KVPlace.NONE, ())


@dataclass(frozen=True)
class Arrival:
    """A request staged on the destination (module doc, step 2): ``slots`` are the
    destination slots of positions ``[num_hit_tokens, kv_length)``, the K/V that must
    travel; positions before ``num_hit_tokens`` are the destination's own prefix hit."""

    state: RequestState
    kv_length: int
    num_hit_tokens: int
    slots: tuple[int, ...]


class Import:
    """The destination's side of a migration (module doc, step 2): stage one or more
    requests (the live samples of one ``n > 1`` request move together), then ``commit``
    or ``abort`` them all."""

    def __init__(self, sched: Scheduler) -> None:
        sched.require_boundary("import")
        self._sched = sched
        self.arrivals: list[Arrival] = []
        self._open = True
        # The scheduler refuses every other change while this transaction is open.
        sched.pool.begin()

    def stage(self, state: RequestState, *, with_kv: bool) -> Arrival:
        """Reserve blocks for ``state`` (its KV length when ``with_kv``, else none: the
        destination recomputes). Raises a typed error with nothing staged for this
        request: :class:`DuplicateRequest`, :class:`MigrationError` (not live, bad
        tokens, too long), :class:`MigrationRefused` (no running slot, too few blocks)."""
        assert self._open, "stage after commit or abort"
        sched = self._sched
        _check_state(sched, state)
        rid = state.request_id
        if rid in sched.requests or any(a.state.request_id == rid for a in self.arrivals):
            raise DuplicateRequest(rid, "import")
        n = state.num_computed_tokens if with_kv else 0
        if n and state.status is not S.WAITING_TOOL:
            running = len(sched.running) + sum(
                a.kv_length > 0 and a.state.status is not S.WAITING_TOOL for a in self.arrivals
            )
            if running >= sched.config.max_num_seqs:
                raise MigrationRefused(
                    f"import: request {rid!r} needs a running slot; all "
                    f"{sched.config.max_num_seqs} are taken"
                )
        if not n:
            arrival = Arrival(replace(state, num_computed_tokens=0), 0, 0, ())
            self.arrivals.append(arrival)
            return arrival
        pool = sched.pool
        hit = pool.lookup(state.token_ids[:n], state.namespace)
        try:
            pool.allocate(
                rid, state.token_ids, n - hit.num_tokens, hit=hit, namespace=state.namespace
            )
        except OutOfBlocks as e:
            raise MigrationRefused(f"import: {e}") from e
        table = pool.block_table(rid)
        bs = sched.config.block_size
        arrival = Arrival(state, n, hit.num_tokens, _slots(table, hit.num_tokens, n, bs))
        self.arrivals.append(arrival)
        return arrival

    def abort(self) -> None:
        """Undo every stage: the destination is exactly as before (ATOMIC)."""
        assert self._open, "abort after commit or abort"
        self._open = False
        self._sched.pool.rollback()

    def commit(self, offset_ms: float = 0.0) -> list[Request]:
        """Make every staged request runnable (or paused, for a tool wait); their K/V
        must be written by now. ``offset_ms`` moves their times onto this scheduler's
        clock. Cannot fail: every check ran in :meth:`stage`."""
        assert self._open, "commit after commit or abort"
        self._open = False
        sched = self._sched
        sched.pool.commit()
        return [_place(sched, a, offset_ms) for a in self.arrivals]


def begin_import(sched: Scheduler) -> Import:
    """The destination's side of step 2: stage migrated requests (:class:`Import`)."""
    return Import(sched)


def release(sched: Scheduler, request_id: str) -> None:
    """The source's side of step 3: the request leaves this scheduler, every block it
    held back to the pools, its drafts dropped; not finished, not retired."""
    sched.require_boundary("release")
    if request_id not in sched.requests:
        raise MigrationError(f"release: request {request_id!r} is not live on this engine")
    sched.leave(request_id)


def _check_state(sched: Scheduler, state: RequestState) -> None:
    rid = state.request_id
    if state.status not in _LIVE:
        raise MigrationError(f"import: request {rid!r} is {state.status}; only live requests move")
    if (
        not state.prompt_token_ids
        or state.token_ids[: state.num_prompt_tokens] != state.prompt_token_ids
    ):
        raise MigrationError(f"import: request {rid!r}: its token ids do not start with its prompt")
    for t in state.token_ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise MigrationError(f"import: request {rid!r} has a bad token id {t!r}")
    if not 0 <= state.num_computed_tokens < len(state.token_ids):
        raise MigrationError(
            f"import: request {rid!r} claims a KV length of {state.num_computed_tokens} for "
            f"{len(state.token_ids)} tokens"
        )
    cfg = sched.config
    try:
        check_room_for_output(
            len(state.token_ids),
            cfg.max_len,
            subject=f"import: request {rid!r} has",
            limit=f"this engine's length limit is {cfg.max_len}",
        )
        require_fit(cfg, rid, len(state.token_ids))
    except RefserveError as e:
        raise MigrationError(str(e)) from e


def _place(sched: Scheduler, a: Arrival, offset_ms: float) -> Request:
    """A staged request as a live one of the destination (module doc, ``commit``)."""
    s = a.state.shifted(offset_ms)
    r = Request(
        s.request_id,
        list(s.prompt_token_ids),
        s.stop,
        arrival_ms=s.arrival_ms,
        priority=s.priority,
        tenant=s.tenant,
        namespace=s.namespace,
    )
    r.token_ids = list(s.token_ids)
    r.num_computed_tokens = a.kv_length
    # The hit is this engine's (PREFIX judges it in this engine's blocks): the source's
    # count, in its own block size, can exceed what a hit may cover here. A recompute
    # import starts at 0; its admission here records the hit it gets.
    r.num_cached_tokens = a.num_hit_tokens
    r.num_preemptions = s.num_preemptions
    r.admitted_ms = s.admitted_ms
    r.token_times_ms = list(s.token_times_ms)
    r.status = _status_on_arrival(s, a.kv_length)
    sched.join(r)
    return r


def _status_on_arrival(s: RequestState, kv_length: int) -> RequestStatus:
    """With its KV a request runs on (decoding when only its last token is pending);
    without, it waits: fresh if it has no output yet, else like a recompute preemption.
    A tool wait stays one, with or without its KV."""
    if s.status is S.WAITING_TOOL:
        return S.WAITING_TOOL
    if kv_length:
        decoding = s.num_output_tokens > 0 and kv_length == len(s.token_ids) - 1
        return S.DECODING if decoding else S.PREFILLING
    return S.PREEMPTED if s.num_output_tokens else S.WAITING


def _slots(table: tuple[int, ...] | list[int], start: int, end: int, bs: int) -> tuple[int, ...]:
    return tuple(slot_of(table[logical_block(p, bs)], p, bs) for p in range(start, end))


# ---------------------------------------------------------------------------- a move
#: Where :meth:`Move.run` calls its fault hook, in protocol order: the points of the
#: engine's driver (ref/engine/migration.py), ``mid_stream`` after each chunk copied.
MOVE_POINTS = ("before_export", "after_stage", "mid_stream", "before_ack", "after_ack")


class MoveAborted(MigrationError):
    """A move failed before the ack: the request runs on the source as before and the
    destination is as it was (ATOMIC, docs/MIGRATION.md)."""

    def __init__(self, request_id: str, point: str, cause: BaseException) -> None:
        super().__init__(f"move of {request_id!r} aborted at {point}: {cause!r}")
        self.request_id = request_id
        self.point = point
        self.cause = cause


class KVLink(Protocol):
    """Carries K/V from the source's slots to the destination's (real K/V in
    ref/engine/migration.py; a fake memory in the tests)."""

    def copy(self, departure: Departure, arrival: Arrival, start: int, end: int) -> None:
        """Write positions ``[start, end)``, inside ``[arrival.num_hit_tokens,
        arrival.kv_length)``: ``departure.slots[p]`` to ``arrival.slots[p - hit]``."""

    def undo(self) -> None:
        """Put back every destination slot :meth:`copy` wrote (the move aborted)."""


MoveHook = Callable[[str], None]
Observer = Callable[["Move"], None]


class Move:
    """One request moving from ``src`` to ``dst`` (module doc): :meth:`export`,
    :meth:`stage`, :meth:`copy` per chunk, :meth:`ack`, :meth:`release`, :meth:`commit`,
    or :meth:`abort` at any point before the ack. :meth:`run` does it all in that order.

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
        if chunk_blocks is not None and (
            isinstance(chunk_blocks, bool) or not isinstance(chunk_blocks, int) or chunk_blocks < 1
        ):
            raise MigrationError(f"chunk_blocks must be an int >= 1 or None, got {chunk_blocks!r}")
        if src is dst:
            raise MigrationError(f"move of {request_id!r}: source and destination are one engine")
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
        d = export(self.src, self.request_id)
        self.departure = d
        self.request = self.src.requests[self.request_id].snapshot(self.src.config.max_len)
        self.pool_before = self.dst.pool.snapshot()
        self.phase = TransitPhase.EXPORTED
        return d

    def stage(self) -> Arrival:
        assert self.phase is TransitPhase.EXPORTED and self.departure is not None
        imp = begin_import(self.dst)
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
        """Positions ``[start, end)``, in order: each range starts where the last ended."""
        a, d = self.arrival, self.departure
        assert self.phase is TransitPhase.STAGED and a is not None and d is not None
        if start != self._next or not start < end <= a.kv_length:
            raise MigrationError(
                f"move of {self.request_id!r}: copy of [{start}, {end}) out of order; "
                f"positions [{a.num_hit_tokens}, {self._next}) of [{a.num_hit_tokens}, "
                f"{a.kv_length}) are written"
            )
        self._require_unchanged()
        self._copied = True
        self.link.copy(d, a, start, end)
        self._next = end

    def ack(self) -> None:
        """Every needed slot is written: from here the destination owns the request."""
        a = self.arrival
        assert self.phase is TransitPhase.STAGED and a is not None
        if self._next != a.kv_length:
            raise MigrationError(
                f"move of {self.request_id!r}: ack with K/V of [{self._next}, {a.kv_length}) "
                "still missing"
            )
        self._require_unchanged()
        self.phase = TransitPhase.ACKED

    def release(self) -> None:
        assert self.phase is TransitPhase.ACKED, "the source releases only after the ack"
        release(self.src, self.request_id)
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
        fault: MoveHook | None = None,
        observe: Observer | None = None,
        offset_ms: float = 0.0,
    ) -> list[Request]:
        """Every phase in order. ``observe(self)`` after each phase and chunk;
        ``fault(point)`` at each of :data:`MOVE_POINTS`. A :class:`MigrationError` (the
        destination refused, the source changed meanwhile) is raised as it is, anything
        else before the ack as :class:`MoveAborted`, both with the move aborted; a fault
        after the ack is rolled forward and named in :attr:`fault`. An exception of
        ``observe`` (a broken rule, in a test) aborts the move before the ack and is
        raised as it is."""
        hook = fault or _no_fault
        watch = observe or _no_observer
        failed: list[BaseException] = []

        def see(m: Move) -> None:
            try:
                watch(m)
            except BaseException as e:
                failed.append(e)
                raise

        point = "before_export"
        try:
            hook(point)
            self.export()
            see(self)
            self.stage()
            see(self)
            point = "after_stage"
            hook(point)
            point = "mid_stream"
            for start, end in self.chunks():
                self.copy(start, end)
                see(self)
                hook(point)
            point = "before_ack"
            hook(point)
            self.ack()
        except BaseException as e:
            if self.phase is not None:
                self.abort()
            if failed or isinstance(e, MigrationError):
                raise
            raise MoveAborted(self.request_id, point, e) from e
        see(self)
        try:
            hook("after_ack")
        except Exception:  # the destination owns it now: roll forward
            self.fault = "after_ack"
        self.release()
        see(self)
        return self.commit(offset_ms)

    # ------------------------------------------------------------------ the records
    def transit(self, source: str, destination: str) -> Transit:
        """The move as spec/cluster.py sees it, the engines named ``source`` and
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
        """The source still holds the request as exported (an abort or a step there
        meanwhile cancels the move: the export would lose or repeat tokens)."""
        if self.request_id not in self.src.requests or (
            export(self.src, self.request_id) != self.departure
        ):
            raise MigrationError(
                f"move of {self.request_id!r}: it changed on the source during the transfer"
            )


def _no_fault(point: str) -> None:
    pass


def _no_observer(move: Move) -> None:
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
