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

The one driver of these moves is ref/engine/migration.py's ``migrate`` (the engine,
the clusters, the simulator and the CLI call it); it calls its fault hook at each
point of :class:`MigrationFault`, and cancels a move when the source changed
(:func:`source_changed`: the one meaning of the phrase, docs/MIGRATION.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from refserve.core.capacity import require_fit
from refserve.core.migration_cost import KVMode, MigrationCost
from refserve.core.request import Request, StopParams, check_room_for_output
from refserve.core.scheduler import Scheduler
from refserve.errors import DuplicateRequest, InvalidArgument, OutOfBlocks, RefserveError
from refserve.kv.groups import GroupBlocks, GroupedPool
from refserve.spec.arith import logical_block, slot_of
from refserve.spec.groups import GroupKind
from refserve.spec.hashing import Namespace
from refserve.spec.snapshot import RequestStatus
from refserve.values import is_int


class MigrationError(RefserveError):
    """A migration that cannot proceed; the request stays where it was."""


class MigrationRefused(MigrationError):
    """The destination cannot take the request now (no running slot, too few blocks)."""


class MigrationFault(StrEnum):
    """Where a migration driver calls its fault hook, in protocol order
    (docs/MIGRATION.md, "Faults"): before the export, after the destination staged,
    after each chunk of K/V streamed, before the ack, after the ack. A fault at any but
    the last aborts the move with the source as it was; after the ack it rolls forward."""

    BEFORE_EXPORT = "before_export"
    AFTER_STAGE = "after_stage"
    MID_STREAM = "mid_stream"
    BEFORE_ACK = "before_ack"
    AFTER_ACK = "after_ack"


#: Every migration fault point, in protocol order.
MIGRATION_FAULT_POINTS = tuple(MigrationFault)


class InvalidMigrationArgument(MigrationError, InvalidArgument):
    """An argument of a migration that no move can take; ``argument`` names it. Raised
    before anything is read or staged."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


@dataclass(frozen=True)
class MigrationArgs:
    """A migration driver's arguments, checked (:meth:`check`): how the K/V travels
    (``kv``), in chunks of how many source blocks (``chunk_blocks``; None: at once),
    the rule that prices it (``cost``; None: the source's) and the fault hook."""

    kv: KVMode
    chunk_blocks: int | None
    cost: MigrationCost | None
    fault: Callable[[str], None] | None

    @staticmethod
    def check(
        kv: KVMode | str = KVMode.AUTO,
        chunk_blocks: int | None = None,
        cost: MigrationCost | None = None,
        fault: Callable[[str], None] | None = None,
    ) -> MigrationArgs:
        """The one validation of a driver's arguments, whatever path the move takes (a
        ``chunk_blocks`` of 0 is refused with a recompute too): a bad one raises
        :class:`InvalidMigrationArgument` naming it."""
        try:
            mode = KVMode(kv)
        except ValueError:
            modes = ", ".join(m.value for m in KVMode)
            raise InvalidMigrationArgument("kv", f"kv must be one of {modes}, got {kv!r}") from None
        if chunk_blocks is not None and (not is_int(chunk_blocks) or chunk_blocks < 1):
            raise InvalidMigrationArgument(
                "chunk_blocks", f"chunk_blocks must be an int >= 1 or None, got {chunk_blocks!r}"
            )
        if cost is not None and not isinstance(cost, MigrationCost):
            raise InvalidMigrationArgument(
                "cost", f"cost must be a MigrationCost or None, got {type(cost).__name__}"
            )
        if fault is not None and not callable(fault):
            raise InvalidMigrationArgument(
                "fault", f"fault must be a callable or None, got {fault!r}"
            )
        return MigrationArgs(mode, chunk_blocks, cost, fault)


class KVPlace(StrEnum):
    """Where a request's KV is at a step boundary."""

    DEVICE = "device"
    HOST = "host"
    NONE = "none"


#: States that hold a running slot when imported with their KV.
_RUNNING = frozenset({RequestStatus.PREFILLING, RequestStatus.DECODING, RequestStatus.SWAPPED})
#: Every live state a request can be exported in.
_LIVE = frozenset(
    {RequestStatus.WAITING, RequestStatus.PREEMPTED, *_RUNNING, RequestStatus.WAITING_TOOL}
)


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
class GroupSlots:
    """Where one layer group of a grouped pool holds a request's K/V: ``slots[i]`` holds
    position ``start + i``, up to its KV length. A window group's ``start`` is the first
    position of its first held place (spec/groups.py ``held_places``): it holds nothing
    before it."""

    group: int
    start: int
    slots: tuple[int, ...]


@dataclass(frozen=True)
class Departure:
    """What the source exports for one request: its state and where its KV is.

    ``slots[p]`` is the source slot (device or host memory, by ``kv_place``) holding
    position ``p``, for ``p`` in ``[0, num_computed_tokens)``; empty when the KV is
    nowhere (waiting, recompute-preempted, a tool wait that dropped it). On a grouped
    pool ``slots`` is the first (full) group's and ``groups`` every group's."""

    state: RequestState
    kv_place: KVPlace
    slots: tuple[int, ...]
    groups: tuple[GroupSlots, ...] = ()

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
    pool = sched.pool
    if n and pool.has_request(request_id):
        if isinstance(pool, GroupedPool):
            return _grouped(state, KVPlace.DEVICE, pool.held_blocks(request_id), n, bs)
        table = pool.block_table(request_id)
        return Departure(state, KVPlace.DEVICE, _slots(table, 0, n, bs))
    if n and sched.host.has_request(request_id):
        host = sched.host.table(request_id)
        assert host.num_stored == n, "a swapped request's host KV is its KV length"
        if host.groups:
            return _grouped(state, KVPlace.HOST, host.groups, n, bs)
        return Departure(state, KVPlace.HOST, _slots(host.block_ids, 0, n, bs))
    return Departure(replace(state, num_computed_tokens=0), KVPlace.NONE, ())


def _grouped(
    state: RequestState, place: KVPlace, held: Sequence[GroupBlocks], n: int, bs: int
) -> Departure:
    """A grouped pool's departure: each group's slots of the places it holds."""
    groups = tuple(
        GroupSlots(g.group, g.first * bs, _slots(g.block_ids, g.first * bs, n, bs, g.first))
        for g in held
    )
    assert groups[0].start == 0, "the first group is a full one: it holds every position"
    return Departure(state, place, groups[0].slots, groups)


@dataclass(frozen=True)
class Arrival:
    """A request staged on the destination (module doc, step 2): ``slots`` are the
    destination slots of positions ``[num_hit_tokens, kv_length)``, the K/V that must
    travel; positions before ``num_hit_tokens`` are the destination's own prefix hit.
    On a grouped pool ``groups`` gives every group's slots (``slots`` is the first's):
    a window group's from its first held place on."""

    state: RequestState
    kv_length: int
    num_hit_tokens: int
    slots: tuple[int, ...]
    groups: tuple[GroupSlots, ...] = ()


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
        if n and state.status is not RequestStatus.WAITING_TOOL:
            running = len(sched.running) + sum(
                a.kv_length > 0 and a.state.status is not RequestStatus.WAITING_TOOL
                for a in self.arrivals
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
        if isinstance(pool, GroupedPool):
            arrival = _restore(pool, state, n)
            self.arrivals.append(arrival)
            return arrival
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


def _restore(pool: GroupedPool, state: RequestState, n: int) -> Arrival:
    """A grouped import: every group's table as if the request had computed its ``n``
    positions here (``GroupedPool.restore``: a window group's places before its window
    null), each held place a fresh block the migrated K/V fills. No prefix hit is taken:
    a hit's window group would hold places the source no longer has K/V for."""
    rid = state.request_id
    if any(g.kind is GroupKind.COMPRESSED for g in pool.groups):
        raise MigrationRefused(
            f"import: request {rid!r} brings K/V, and a compressed group's K/V does not "
            "migrate (its entries are not positions)"
        )
    try:
        held = pool.restore(rid, state.token_ids, n, namespace=state.namespace)
    except OutOfBlocks as e:
        raise MigrationRefused(f"import: {e}") from e
    bs = pool.block_size
    departure = _grouped(state, KVPlace.DEVICE, held, n, bs)
    return Arrival(state, n, 0, departure.slots, departure.groups)


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


def source_changed(sched: Scheduler, state: RequestState) -> bool:
    """Whether the request exported as ``state`` changed on the source ``sched`` since:
    it is no longer live there, or it holds another number of tokens, or it is in
    another status (it stepped, was preempted, swapped, paused, finished or aborted).
    The one meaning of "the source changed" (docs/MIGRATION.md, "The source changed"):
    a move that finds it is cancelled, since carrying the exported state would lose or
    repeat tokens. A prefill chunk computed meanwhile is not a change: the exported
    tokens, and the K/V of the exported length, are still the request's."""
    r = sched.requests.get(state.request_id)
    return r is None or r.num_tokens != len(state.token_ids) or r.status is not state.status


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
        if not is_int(t) or t < 0:
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
    if s.status is RequestStatus.WAITING_TOOL:
        return RequestStatus.WAITING_TOOL
    if kv_length:
        decoding = s.num_output_tokens > 0 and kv_length == len(s.token_ids) - 1
        return RequestStatus.DECODING if decoding else RequestStatus.PREFILLING
    return RequestStatus.PREEMPTED if s.num_output_tokens else RequestStatus.WAITING


def _slots(table: Sequence[int], start: int, end: int, bs: int, first: int = 0) -> tuple[int, ...]:
    """The slots of positions ``[start, end)`` in ``table``, whose entry ``i`` is place
    ``first + i``."""
    return tuple(slot_of(table[logical_block(p, bs) - first], p, bs) for p in range(start, end))
