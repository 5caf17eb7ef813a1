"""The cluster: N engine replicas behind one router (docs/CLUSTER.md).

One concept per module: the typed errors (``errors``), the records the router reads
(``records``), the global prefix index fed by the replicas' cache events (``index``),
the replica interface and its in-process transport (``replica``), the Ray transport
(``ray_replica``: imported on demand, Ray is an optional extra), the routing policies
(``router``), the migration triggers the cluster and its simulator share (``triggers``),
the replica set's lifecycle (``supervisor``), the request -> replica map
(``ownership``), the in-process cluster that composes them (``cluster``) and its
record of prefill/decode roles and handoffs (``handoff``; the pure decisions are
``disagg``'s).
A layer above ``refserve.engine`` and below ``refserve.serve`` (docs/ARCHITECTURE.md, "Layers").

The names below are loaded on first use: importing one module of the package (the
router, the index) loads only what that module imports, not the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from refserve.cluster.cluster import Cluster as Cluster
    from refserve.cluster.errors import ClusterError as ClusterError
    from refserve.cluster.errors import EventGap as EventGap
    from refserve.cluster.errors import EventMismatch as EventMismatch
    from refserve.cluster.errors import NoLiveReplica as NoLiveReplica
    from refserve.cluster.errors import ReplicaDead as ReplicaDead
    from refserve.cluster.errors import ReplicaMismatch as ReplicaMismatch
    from refserve.cluster.errors import UnknownPolicy as UnknownPolicy
    from refserve.cluster.errors import UnknownReplica as UnknownReplica
    from refserve.cluster.index import CacheSnapshot as CacheSnapshot
    from refserve.cluster.index import GlobalPrefixIndex as GlobalPrefixIndex
    from refserve.cluster.migration import PolicyMigration as PolicyMigration
    from refserve.cluster.records import ClusterMetrics as ClusterMetrics
    from refserve.cluster.records import LoadFigures as LoadFigures
    from refserve.cluster.replica import InProcessReplica as InProcessReplica
    from refserve.cluster.replica import Replica as Replica
    from refserve.cluster.router import Router as Router
    from refserve.cluster.router import RoutingDecision as RoutingDecision
    from refserve.cluster.router import RoutingPolicy as RoutingPolicy
    from refserve.cluster.triggers import MigrationPolicy as MigrationPolicy

# Each public name -> the module that defines it.
_LAZY = {
    "Cluster": "cluster",
    "ClusterMetrics": "records",
    "PolicyMigration": "migration",
    "ClusterError": "errors",
    "EventGap": "errors",
    "EventMismatch": "errors",
    "NoLiveReplica": "errors",
    "ReplicaDead": "errors",
    "ReplicaMismatch": "errors",
    "UnknownPolicy": "errors",
    "UnknownReplica": "errors",
    "CacheSnapshot": "index",
    "GlobalPrefixIndex": "index",
    "LoadFigures": "records",
    "InProcessReplica": "replica",
    "Replica": "replica",
    "Router": "router",
    "RoutingDecision": "router",
    "RoutingPolicy": "router",
    "MigrationPolicy": "triggers",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'refserve.cluster' has no attribute {name!r}")
    return getattr(importlib.import_module(f"refserve.cluster.{module}"), name)
