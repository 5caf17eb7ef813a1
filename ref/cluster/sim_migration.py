"""The cluster simulator's two ends of the one migration driver
(ref/engine/migration.py, ``migrate``), and the landing at the far end of its link.

A simulated replica has no K/V memory: what travels is the request's state and the
size of its K/V. So the driver's destination is the link towards replica ``j``
(:class:`LinkDestination`): its ack means the link holds the request, the source
releases it, and the commit puts it in flight. It lands later, at the destination's
first step boundary after the link's time (:func:`land`); a destination with no room by
then stages it without its K/V, a recompute counted as a fallback (a prefill/decode
handoff instead waits on the link for room: :func:`try_land`). The order of every
move is the driver's: export (a pure read), price, stage, ack, release, commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from refserve.cluster.index import GlobalPrefixIndex
from refserve.core import transit
from refserve.core.migration_cost import KVMode, MigrationCost, MigrationDecision
from refserve.core.request import Request
from refserve.core.scheduler import Scheduler
from refserve.core.transit import MigrationError, RequestState
from refserve.engine.ticket import KVChunk
from refserve.spec.hashing import Namespace
from refserve.spec.snapshot import RequestSnapshot


@dataclass(frozen=True)
class SimTicket:
    """A request leaving a simulated replica: its state, the rule's decision and the
    size of the K/V that travels (``moved_tokens``: the K/V tokens the destination's
    prefix cache lacks, 0 for a recompute). ``record`` is the source's record of it at
    the export, which spec/cluster.py reads while it is on the link."""

    request_id: str
    state: RequestState
    decision: MigrationDecision
    kv_tokens: int
    moved_tokens: int
    kv_bytes: int
    block_size: int
    clock_ms: float
    record: RequestSnapshot

    @property
    def kv_mode(self) -> KVMode:
        return self.decision.mode

    @property
    def with_kv(self) -> bool:
        return self.kv_tokens > 0 and self.kv_mode is KVMode.TRANSFER

    @property
    def num_chunks(self) -> int:
        return 1 if self.kv_bytes else 0


class ReplicaSource:
    """A simulated replica's scheduler as the driver's source, at ``clock_ms``."""

    def __init__(self, sched: Scheduler, clock_ms: float, cost: MigrationCost) -> None:
        self.sched = sched
        self.clock_ms = clock_ms
        self.cost = cost

    def export_state(self, request_id: str) -> RequestState:
        return transit.export(self.sched, request_id).state

    def export_request(
        self,
        request_id: str,
        *,
        kv: KVMode | str = KVMode.AUTO,
        inline: bool = True,
        cost: MigrationCost | None = None,
        hit_tokens: int = 0,
        idle: float = 1.0,
    ) -> SimTicket:
        if not inline:
            raise MigrationError("export: a simulated replica's K/V travels whole, not streamed")
        dep = transit.export(self.sched, request_id)
        kv_tokens = dep.kv_length
        hit = min(kv_tokens, hit_tokens)
        decision = (cost or self.cost).decide(kv, kv_tokens, hit, idle)
        moved = kv_tokens - hit if kv_tokens and decision.mode is KVMode.TRANSFER else 0
        record = self.sched.requests[request_id].snapshot(self.sched.config.max_len)
        return SimTicket(
            request_id,
            dep.state,
            decision,
            kv_tokens,
            moved,
            moved * self.cost.kv_bytes_per_token,
            self.sched.config.block_size,
            self.clock_ms,
            record,
        )

    def read_kv(self, seq_id: str, start: int, end: int) -> KVChunk:
        raise MigrationError(f"read_kv of {seq_id!r}: a simulated replica holds no K/V bytes")

    def source_changed(self, ticket: SimTicket) -> bool:
        return transit.source_changed(self.sched, ticket.state)

    def release_request(self, request_id: str) -> None:
        transit.release(self.sched, request_id)

    def now_ms(self) -> float:
        return self.clock_ms


class LinkDestination:
    """The link towards simulated replica ``replica`` as the driver's destination: the
    prefix hit and idle compute are that replica's, the commit puts the request in
    flight (module doc); :meth:`committed` is what left."""

    def __init__(self, index: GlobalPrefixIndex, replica: int, idle: float) -> None:
        self.index = index
        self.replica = replica
        self.idle = idle
        self.staged: LinkImport | None = None

    @property
    def idle_fraction(self) -> float:
        return self.idle

    def prefix_hit_tokens(self, token_ids: Sequence[int], state: object = None) -> int:
        if not token_ids:
            return 0
        ns = state.namespace if isinstance(state, RequestState) else Namespace()
        return self.index.longest_prefix(token_ids, ns)[self.replica]

    def stage_import(self, ticket: SimTicket, *, transit_ms: float = 0.0) -> LinkImport:
        self.staged = LinkImport(ticket)
        return self.staged

    def committed(self) -> SimTicket:
        """The ticket the driver committed onto the link."""
        staged = self.staged
        assert staged is not None and staged.acked and staged.done, "no move was committed"
        return staged.ticket


class LinkImport:
    """A request staged onto the link: nothing is reserved on the destination until it
    lands, and every position travels with the ticket (nothing is streamed)."""

    def __init__(self, ticket: SimTicket) -> None:
        self.ticket = ticket
        self.needed: dict[str, tuple[int, int]] = {}
        self.acked = False
        self.done = False

    @property
    def decision(self) -> MigrationDecision:
        return self.ticket.decision

    def write(self, chunk: KVChunk) -> None:
        raise MigrationError(f"a chunk of {chunk.seq_id!r}: the simulated K/V travels whole")

    def ack(self) -> None:
        self.acked = True

    def abort(self) -> None:
        assert not self.done, "abort after commit or abort"
        self.done = True

    def commit(self, transit_ms: float | None = None) -> list[str]:
        assert self.acked and not self.done, "commit needs the ack, once"
        self.done = True
        return [self.ticket.request_id]


@dataclass(frozen=True)
class Landing:
    """A request landed on its destination: the request now, and whether it came
    without its K/V because the destination had no room (a fallback)."""

    request: Request
    fallback: bool


def land(sched: Scheduler, ticket: SimTicket) -> Landing:
    """The end of the link: stage ``ticket`` on ``sched`` with its K/V (without it, if
    there is no room now) and commit; the request is runnable there."""
    imp = transit.begin_import(sched)
    fallback = False
    try:
        imp.stage(ticket.state, with_kv=ticket.with_kv)
    except transit.MigrationRefused:
        imp.abort()
        imp = transit.begin_import(sched)
        imp.stage(ticket.state, with_kv=False)
        fallback = True
    (arrived,) = imp.commit(0.0)
    return Landing(arrived, fallback)


def try_land(sched: Scheduler, ticket: SimTicket) -> Landing | None:
    """A landing that never recomputes: stage ``ticket`` with its K/V and commit, or, with
    no room on ``sched`` now, leave it on the link (None) to try again at a later
    boundary. A prefill/decode handoff lands this way: a recompute would have a decode
    replica prefill a request that was not deflected to it (docs/DISAGG.md)."""
    imp = transit.begin_import(sched)
    try:
        imp.stage(ticket.state, with_kv=ticket.with_kv)
    except transit.MigrationRefused:
        imp.abort()
        return None
    (arrived,) = imp.commit(0.0)
    return Landing(arrived, False)
