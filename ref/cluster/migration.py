"""The cluster's side of migration: a replica reached by whole tickets (another
process, e.g. a Ray actor) as a source or destination of the one migration driver
(ref/engine/migration.py, ``migrate``), and the record of a move the cluster's policy
made (docs/CLUSTER.md, "Migration").

In-process replicas hand the driver their engines. A replica in another process takes
a ticket with its K/V inline and imports it in one call: the driver's ack is that import
(from there the destination owns the request), nothing is streamed, and the release of
the source comes after it, as the driver orders every move. A source found dead at the
release does not undo the move (it rolls forward: the destination holds the request);
the error is kept for the cluster, which buries the replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from refserve.cluster.errors import ReplicaDead
from refserve.cluster.replica import Replica
from refserve.core.migration_cost import KVMode, MigrationCost, MigrationDecision
from refserve.core.transit import MigrationError, RequestState
from refserve.engine.migration import FaultHook
from refserve.engine.ticket import KVChunk, MigrationTicket
from refserve.errors import InvalidArgument


def check_by_ticket(
    a: Replica,
    b: Replica,
    chunk_blocks: int | None,
    fault: FaultHook | None,
    cost: MigrationCost | None,
) -> None:
    """What a move by whole tickets cannot do (ref/cluster/migration.py): stream its
    K/V, call a fault hook inside another process, or price with a custom rule."""
    if chunk_blocks is not None or fault is not None:
        raise InvalidArgument(
            "migrate: chunk_blocks and fault are the in-process protocol's; a move "
            f"{type(a).__name__} -> {type(b).__name__} goes by ticket (K/V inline)"
        )
    if cost is not None:
        raise InvalidArgument("migrate: a custom cost rule needs in-process replicas")


@dataclass(frozen=True)
class PolicyMigration:
    """One migration the cluster's policy made (ref/cluster/cluster.py, "Migration
    policy")."""

    request_id: str
    source: int
    destination: int
    reason: str  # pressure | rebalance | split
    mode: KVMode  # how its K/V travelled (the cost rule's pick under kv="auto")


class TicketSource:
    """A replica as the driver's source, by whole tickets (module doc)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.release_error: ReplicaDead | None = None  # the replica died at the release
        self._clock_ms = 0.0

    def export_request(
        self,
        request_id: str,
        *,
        kv: KVMode | str = KVMode.AUTO,
        inline: bool = True,
        cost: MigrationCost | None = None,
        hit_tokens: int = 0,
        idle: float = 1.0,
    ) -> MigrationTicket:
        if cost is not None or not inline:
            raise MigrationError(
                "export: a replica in another process sends its K/V inline, priced by its own rule"
            )
        ticket = self.replica.export_request(request_id, kv=kv, hit_tokens=hit_tokens, idle=idle)
        self._clock_ms = ticket.clock_ms
        return ticket

    def export_state(self, request_id: str) -> RequestState:
        ticket = self.replica.export_request(
            request_id, kv=KVMode.RECOMPUTE, hit_tokens=0, idle=1.0
        )
        return ticket.sequences[0].state

    def read_kv(self, seq_id: str, start: int, end: int) -> KVChunk:
        raise MigrationError(f"read_kv of {seq_id!r}: a replica in another process streams none")

    def source_changed(self, ticket: MigrationTicket) -> bool:
        # The cluster steps its replicas between its own calls, never during one: a
        # replica it drives a move off cannot step or abort the request meanwhile.
        return False

    def release_request(self, request_id: str) -> None:
        try:
            self.replica.release_request(request_id)
        except ReplicaDead as e:  # the request lives on the destination: roll forward
            self.release_error = e

    def now_ms(self) -> float:
        # Another process's clock is not read: the move's transit is not timed (the
        # ticket's import counts none), so "now" is the export's clock.
        return self._clock_ms


class TicketDestination:
    """A replica as the driver's destination, by whole tickets (module doc)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    @property
    def idle_fraction(self) -> float:
        return self.replica.idle_fraction

    def prefix_hit_tokens(self, token_ids: Sequence[int], state: object = None) -> int:
        return self.replica.prefix_hit_tokens(token_ids)

    def stage_import(self, ticket: MigrationTicket, *, transit_ms: float = 0.0) -> TicketImport:
        return TicketImport(self.replica, ticket)


class TicketImport:
    """A whole ticket staged for a replica in another process: nothing is reserved
    there until the ack, which imports it (module doc)."""

    def __init__(self, replica: Replica, ticket: MigrationTicket) -> None:
        self.replica = replica
        self.ticket = ticket
        self.needed: dict[str, tuple[int, int]] = {}  # every position travels inline
        self.done = False
        self.imported: list[str] | None = None  # the sample ids, once imported (the ack)

    @property
    def decision(self) -> MigrationDecision:
        return self.ticket.decisions[-1]

    def write(self, chunk: KVChunk) -> None:
        raise MigrationError(f"a chunk of {chunk.seq_id!r}: the ticket carries its K/V inline")

    def ack(self) -> None:
        self.imported = self.replica.import_request(self.ticket)

    def abort(self) -> None:
        if self.imported is not None:
            raise MigrationError(
                f"abort of {self.ticket.request_id!r}: imported by another process already"
            )
        self.done = True

    def commit(self, transit_ms: float | None = None) -> list[str]:
        assert self.imported is not None and not self.done, "commit needs the ack, once"
        self.done = True
        return self.imported
