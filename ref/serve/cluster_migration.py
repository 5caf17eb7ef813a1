"""Migration between two replica threads of the served cluster, by the one driver
(ref/engine/migration.py, ``migrate``; docs/CLUSTER.md, "Serving").

Each replica is owned by its thread (ref/serve/cluster_loop.py), and a request moves
between two of its steps. The source's thread is parked, between two steps, for the
whole move: the driver reads and releases the source replica from the caller's thread
while nothing else touches it, so the request cannot step meanwhile. The destination
keeps running; its import is one command on its thread, which also hands it the
request's output queue (before its next step: no output is missed). The replicas go by
whole tickets (:class:`~refserve.cluster.migration.TicketSource`), as any pair that may
be in two processes: the K/V inline, the ack being the import.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from refserve.cluster.errors import ReplicaDead
from refserve.cluster.migration import TicketDestination, TicketImport, TicketSource
from refserve.cluster.replica import Replica
from refserve.core.migration_cost import KVMode, MigrationCost
from refserve.core.transit import MigrationError, RequestState
from refserve.engine.migration import MigrationReport, migrate
from refserve.engine.ticket import MigrationTicket
from refserve.serve.loop import OutputSink
from refserve.spec.hashing import Namespace

T = TypeVar("T")


class ReplicaThread(Protocol):
    """What a move uses of a replica's thread (ref/serve/cluster_loop.py's
    ``ReplicaLoop``): its slot, its replica, the output queues of its requests, its last
    published idle compute, and a command run between two of its steps."""

    index: int
    replica: Replica
    sinks: dict[str, OutputSink]
    idle_fraction: float

    def run_sync(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]: ...


#: How many of the tokens the destination replica caches under a namespace (the front's
#: prefix index, under its lock).
PrefixHit = Callable[[Sequence[int], Namespace], int]

#: How often the caller looks whether the source's thread parked or failed.
_PARK_POLL_S = 0.01


def move(
    a: ReplicaThread,
    b: ReplicaThread,
    request_id: str,
    *,
    kv: KVMode | str,
    hit: PrefixHit,
    adopted: Callable[[], None],
    timeout_s: float,
) -> MigrationReport:
    """Move ``request_id`` from ``a``'s replica to ``b``'s (module doc). ``adopted`` runs
    on ``b``'s thread right after the import (the front's owner map). A replica that
    does not reach a step boundary, or import, within ``timeout_s`` fails the move
    with the request where it was."""
    parked, resume = threading.Event(), threading.Event()
    source = ParkedSource(a)

    def hold() -> None:
        parked.set()
        resume.wait()
        if source.death is not None:  # it died during the move: its loop buries it
            raise source.death

    held = a.run_sync(hold)
    try:
        deadline = time.monotonic() + timeout_s
        while not parked.wait(_PARK_POLL_S):
            if held.done():
                held.result()  # the replica died, or its loop stopped: raised here
            if time.monotonic() > deadline:
                raise MigrationError(
                    f"migrate: replica {a.index} reached no step boundary in {timeout_s} s"
                )
        return hand_over(
            source, b, request_id, kv=kv, hit=hit, adopted=adopted, timeout_s=timeout_s
        )
    finally:
        resume.set()


def hand_over(
    source: ParkedSource,
    b: ReplicaThread,
    request_id: str,
    *,
    kv: KVMode | str,
    hit: PrefixHit,
    adopted: Callable[[], None],
    timeout_s: float,
) -> MigrationReport:
    """The move itself, by the driver, while nothing else touches the source replica:
    from the caller's thread with the source's parked (:func:`move`), or from the
    source's own thread between two of its steps (a prefill replica's handoff,
    docs/DISAGG.md, "Serving"). A death of the source seen meanwhile is left in
    ``source.death`` for its loop to bury."""
    dest = LoopDestination(b, source, hit, adopted, timeout_s)
    return migrate(source, dest, request_id, kv=kv)


class ParkedSource(TicketSource):
    """The source replica while its thread is parked (module doc), or while its own
    thread runs the move (:func:`hand_over`); it also hands the request's output queue
    over: found at the export, dropped here at the release."""

    def __init__(self, loop: ReplicaThread) -> None:
        super().__init__(loop.replica)
        self.loop = loop
        self.sink: OutputSink | None = None
        self.death: ReplicaDead | None = None  # seen by a call to it during the move

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except ReplicaDead as e:
            self.death = e
            raise

    def export_state(self, request_id: str) -> RequestState:
        return self._call(lambda: super(ParkedSource, self).export_state(request_id))

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
        ticket = self._call(
            lambda: super(ParkedSource, self).export_request(
                request_id, kv=kv, inline=inline, cost=cost, hit_tokens=hit_tokens, idle=idle
            )
        )
        self.sink = self.loop.sinks.get(request_id)
        if self.sink is None:
            raise MigrationError(
                f"migrate: {request_id!r} has no output queue on replica {self.loop.index}"
            )
        return ticket

    def release_request(self, request_id: str) -> None:
        # The destination holds the queue now: it leaves this replica first, so that a
        # source dying in the release fails only its own requests.
        self.loop.sinks.pop(request_id, None)
        super().release_request(request_id)
        self.death = self.death or self.release_error


class LoopDestination(TicketDestination):
    """The destination replica, reached through its thread: its figures are the ones
    its loop published, its prefix hit the front's index (``hit``); never a call into
    the replica from this thread."""

    def __init__(
        self,
        loop: ReplicaThread,
        source: ParkedSource,
        hit: PrefixHit,
        adopted: Callable[[], None],
        timeout_s: float,
    ) -> None:
        super().__init__(loop.replica)
        self.loop = loop
        self.source = source
        self.hit = hit
        self.adopted = adopted
        self.timeout_s = timeout_s

    @property
    def idle_fraction(self) -> float:
        return self.loop.idle_fraction

    def prefix_hit_tokens(self, token_ids: Sequence[int], state: object = None) -> int:
        if not token_ids:
            return 0
        ns = state.namespace if isinstance(state, RequestState) else Namespace()
        return self.hit(token_ids, ns)

    def stage_import(self, ticket: MigrationTicket, *, transit_ms: float = 0.0) -> LoopImport:
        return LoopImport(self, ticket)


class LoopImport(TicketImport):
    """A whole ticket for a replica thread: the ack is one command there that imports
    it, takes the output queue and tells the front. An ack that times out cancels the
    command unless it already ran (then the move goes on: the destination owns it)."""

    def __init__(self, dest: LoopDestination, ticket: MigrationTicket) -> None:
        super().__init__(dest.replica, ticket)
        self.dest = dest
        self._lock = threading.Lock()
        self._cancelled = False
        self._taken: list[str] | None = None

    def ack(self) -> None:
        dest = self.dest
        fut = dest.loop.run_sync(self._take)
        try:
            fut.result(timeout=dest.timeout_s)
        except concurrent.futures.TimeoutError:
            with self._lock:
                if self._taken is None:
                    self._cancelled = True
                    raise MigrationError(
                        f"migrate: replica {dest.loop.index} did not import "
                        f"{self.ticket.request_id!r} in {dest.timeout_s} s"
                    ) from None
        self.imported = self._taken

    def _take(self) -> None:
        """On the destination's thread, between two of its steps."""
        with self._lock:
            if self._cancelled:
                return
            ids = self.dest.replica.import_request(self.ticket)
            sink = self.dest.source.sink
            assert sink is not None, "the export found the output queue"
            self.dest.loop.sinks[self.ticket.request_id] = sink
            self.dest.adopted()
            self._taken = ids
