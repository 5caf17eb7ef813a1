"""The cluster's typed errors (docs/CLUSTER.md). Each names what was wrong; none leaves
the index, the router or the cluster changed."""

from __future__ import annotations

from refserve.errors import InvalidArgument, RefserveError


class ClusterError(RefserveError):
    """Base of the errors the cluster layer raises on purpose."""


class UnknownReplica(ClusterError, InvalidArgument, LookupError):
    """An operation named a replica id the index, router or cluster does not have."""

    def __init__(self, replica: object, what: str) -> None:
        super().__init__(f"{what}: unknown replica {replica!r}")
        self.replica = replica


class EventGap(ClusterError):
    """A replica's cache events skip a sequence number: some were lost, so the index can
    no longer tell what the replica holds. The index is unchanged; resync it from the
    replica's snapshot (:meth:`GlobalPrefixIndex.resync`; docs/CLUSTER.md, "Gaps")."""

    def __init__(self, replica: int, expected: int, got: int) -> None:
        super().__init__(
            f"cache events of replica {replica}: expected event {expected}, got {got} "
            f"({got - expected} missing); resync from the replica's snapshot"
        )
        self.replica = replica
        self.expected = expected
        self.got = got


class EventMismatch(ClusterError):
    """A cache event does not apply to what the index holds for its replica (a key
    stored twice, a removal of a key not held or held by another block): the stream
    and the index disagree. The index is unchanged."""

    def __init__(self, replica: int, seq: int, message: str) -> None:
        super().__init__(f"cache event {seq} of replica {replica}: {message}")
        self.replica = replica
        self.seq = seq


class ReplicaMismatch(ClusterError, InvalidArgument):
    """Replicas of one cluster must run the same model: a request may land on any of
    them, and a migrated one continues on another."""


class UnknownPolicy(ClusterError, InvalidArgument):
    """A routing policy name the router does not have; the message lists those it has."""


class ReplicaDead(ClusterError):
    """A replica is gone (its Ray actor died, its process was killed): no call to it can
    succeed again. The requests it held end with this error, each once; the router no
    longer routes to it (docs/CLUSTER.md, "Faults")."""

    def __init__(self, replica: object, cause: str) -> None:
        super().__init__(f"replica {replica} is dead: {cause}")
        self.replica = replica
        self.cause = cause


class NoLiveReplica(ClusterError):
    """Every replica of the cluster is dead: there is nowhere to route a request."""
