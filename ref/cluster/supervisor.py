"""The cluster's replica slots over their life: which are live, a death, a restart
(docs/CLUSTER.md, "Faults").

A replica that is gone (:class:`~refserve.cluster.errors.ReplicaDead`, raised by any call
to it) is buried: its slot is marked dead, the owner hears of it (``on_death``: the
cluster ends the requests it held), it leaves the global index, so the router no longer
sees it. With a ``restart`` factory a buried replica is replaced at once by a fresh one
in its slot, at most ``max_restarts`` times a slot (a failed try counts): the fresh one
joins the index from its own snapshot (an empty cache: a resync, nothing of the dead
one's replayed). The supervisor also keeps the index fed with the live replicas' cache
events (:meth:`ReplicaSupervisor.sync_index`), since joining and leaving are its.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from refserve.cluster.errors import EventGap, EventMismatch, ReplicaDead, ReplicaMismatch
from refserve.cluster.index import GlobalPrefixIndex
from refserve.cluster.records import ClusterMetrics, LoadFigures
from refserve.cluster.replica import Replica
from refserve.engine.ticket import ModelIdentity
from refserve.errors import InvalidArgument
from refserve.values import is_int

log = logging.getLogger("refserve.cluster")

#: Makes a fresh replica for a slot (its id), to replace a dead one.
ReplicaFactory = Callable[[int], Replica]


def check_replicas(
    replicas: Sequence[Replica], restart: object, max_restarts: object
) -> list[Replica]:
    """Replicas of one model, and a restart factory and limit the cluster can use."""
    reps = list(replicas)
    if not reps:
        raise InvalidArgument("Cluster: needs at least one replica")
    if restart is not None and not callable(restart):
        raise InvalidArgument(f"Cluster: restart must make a replica for a slot, got {restart!r}")
    if not is_int(max_restarts) or max_restarts < 0:
        raise InvalidArgument(f"Cluster: max_restarts must be an int >= 0, got {max_restarts!r}")
    if max_restarts and restart is None:
        raise InvalidArgument("Cluster: max_restarts > 0 needs a restart factory")
    for i, rep in enumerate(reps):
        if not isinstance(rep, Replica):
            raise InvalidArgument(f"Cluster: replica {i} is a {type(rep).__name__}, not a Replica")
    model = reps[0].identity
    for i, rep in enumerate(reps[1:], start=1):
        if rep.identity != model:
            raise ReplicaMismatch(
                f"Cluster: replica {i} runs {rep.identity}, replica 0 runs {model}"
            )
    return reps


def _check_replacement(fresh: object, model: ModelIdentity) -> Replica:
    """A replacement is a replica of the cluster's model."""
    if not isinstance(fresh, Replica):
        raise InvalidArgument(f"Cluster: the restart factory made a {type(fresh).__name__}")
    if fresh.identity != model:
        raise ReplicaMismatch(f"Cluster: the restarted replica runs {fresh.identity}, not {model}")
    return fresh


class ReplicaSupervisor:
    """The replica slots, their deaths and restarts, and the index's view of them
    (module doc). ``replicas`` were checked (:func:`check_replicas`); they join
    ``index`` here. ``on_death(slot, error)`` runs at each burial, before the slot leaves
    the index; ``accept(slot, fresh)`` may refuse a replacement (raise) before it joins."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        index: GlobalPrefixIndex,
        metrics: ClusterMetrics,
        *,
        on_death: Callable[[int, ReplicaDead], None],
        accept: Callable[[int, Replica], None],
        restart: ReplicaFactory | None = None,
        max_restarts: int = 0,
    ) -> None:
        self.replicas: tuple[Replica, ...] = tuple(replicas)
        self.model = self.replicas[0].identity
        self.index = index
        self.metrics = metrics
        self.dead: dict[int, ReplicaDead] = {}  # slot -> what killed its replica
        self.max_restarts = max_restarts
        self.restarts: list[int] = [0] * len(self.replicas)  # per slot: replacements tried
        self._restart = restart
        self._on_death = on_death
        self._accept = accept
        for i, rep in enumerate(self.replicas):
            index.add_replica(i, rep.block_size, rep.cache_snapshot())
            rep.drain_cache_events()  # reflected in the snapshot

    def live(self) -> list[tuple[int, Replica]]:
        """The live slots and their replicas, in slot order."""
        return [(r, rep) for r, rep in enumerate(self.replicas) if r not in self.dead]

    def has_work(self, r: int, rep: Replica) -> bool:
        """Replica ``r`` can make progress; False (and buried) if it is gone."""
        try:
            return rep.has_work
        except ReplicaDead as e:
            self.bury(r, e)
            return False

    def request_ids(self) -> list[tuple[int, tuple[str, ...]]]:
        """Each live replica with the requests live on it; one found gone is buried."""
        out = []
        for r, rep in self.live():
            try:
                out.append((r, rep.request_ids()))
            except ReplicaDead as e:
                self.bury(r, e)
        return out

    def loads(self) -> dict[int, LoadFigures]:
        """Each live replica's load figures; one found gone is buried."""
        out = {}
        for r, rep in self.live():
            try:
                out[r] = rep.load()
            except ReplicaDead as e:
                self.bury(r, e)
        return out

    def bury(self, r: int, error: ReplicaDead) -> None:
        """Replica ``r`` is gone (module doc): the owner hears of it, it leaves the index
        and the router's sight, and a fresh one takes its slot if it has restarts left."""
        if r in self.dead:
            return
        self.dead[r] = error
        self.metrics.replicas_dead += 1
        self._on_death(r, error)
        if r in self.index.replicas:
            self.index.remove_replica(r)
        self._replace(r)

    def _replace(self, r: int) -> None:
        """A fresh replica from the factory in dead slot ``r``, tried while the slot has
        restarts left (a failed try counts)."""
        while self._restart is not None and self.restarts[r] < self.max_restarts:
            self.restarts[r] += 1
            try:
                fresh = _check_replacement(self._restart(r), self.model)
                self._accept(r, fresh)
                snapshot = fresh.cache_snapshot()
                fresh.drain_cache_events()  # reflected in the snapshot
            except Exception:  # died before it joined, or never made: the next try
                log.exception("replica %d: restart %d failed", r, self.restarts[r])
                continue
            self.index.add_replica(r, fresh.block_size, snapshot)
            reps = list(self.replicas)
            reps[r] = fresh
            self.replicas = tuple(reps)
            del self.dead[r]
            self.metrics.replicas_restarted += 1
            return

    def sync_index(self) -> None:
        """Apply every live replica's new cache events; resync one from its snapshot when
        its stream has a gap or does not apply (ref/cluster/index.py, "Gaps")."""
        for r, rep in self.live():
            try:
                events = rep.drain_cache_events()
                try:
                    self.index.apply(r, events)
                except (EventGap, EventMismatch):
                    self.index.resync(r, rep.cache_snapshot())
                    self.metrics.index_resyncs += 1
            except ReplicaDead as e:
                self.bury(r, e)
