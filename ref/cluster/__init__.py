"""The cluster: N engine replicas behind one router (docs/CLUSTER.md).

One concept per module: the typed errors (``errors``), the global prefix index fed by
the replicas' cache events (``index``), the replica interface and its in-process
transport (``replica``), the Ray transport (``ray_replica``: imported on demand, Ray
is an optional extra), the routing policies (``router``), the migration triggers the
cluster and its simulator share (``triggers``) and the in-process cluster
that drives them (``cluster``).
A layer above ``refserve.engine`` and below ``refserve.serve`` (docs/ARCHITECTURE.md, "Layers").
"""

from refserve.cluster.cluster import Cluster, ClusterMetrics
from refserve.cluster.errors import (
    ClusterError,
    EventGap,
    EventMismatch,
    NoLiveReplica,
    ReplicaDead,
    ReplicaMismatch,
    UnknownPolicy,
    UnknownReplica,
)
from refserve.cluster.index import CacheSnapshot, GlobalPrefixIndex
from refserve.cluster.migration import PolicyMigration
from refserve.cluster.replica import InProcessReplica, LoadFigures, Replica
from refserve.cluster.router import Router, RoutingDecision, RoutingPolicy
from refserve.cluster.triggers import MigrationPolicy

__all__ = [
    "CacheSnapshot",
    "Cluster",
    "ClusterError",
    "ClusterMetrics",
    "EventGap",
    "EventMismatch",
    "GlobalPrefixIndex",
    "InProcessReplica",
    "LoadFigures",
    "MigrationPolicy",
    "NoLiveReplica",
    "PolicyMigration",
    "Replica",
    "ReplicaDead",
    "ReplicaMismatch",
    "Router",
    "RoutingDecision",
    "RoutingPolicy",
    "UnknownPolicy",
    "UnknownReplica",
]
