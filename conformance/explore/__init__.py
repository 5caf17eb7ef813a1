"""Exhaustive exploration: every reachable state of an engine up to a bounded scope.

The suite's other searches sample; this package enumerates. From a fresh engine it applies
every enabled event (add a request from a small catalogue, abort a live one, step with
every sampled outcome, an executor fault) in every reachable state, breadth first, checks
every invariant on every transition, deduplicates states on a canonical key that factors
out request and block renaming, and then checks liveness on the explored graph: from
every state, stepping alone finishes every request. docs/CONFORMANCE.md, "Exhaustive
exploration", says what is covered and what is not.
"""

from refserve.conformance.explore.explorer import ExploreResult, explore
from refserve.conformance.explore.kv import (
    KV_SCOPES,
    KVCounterexample,
    KVExploreResult,
    KVScope,
    explore_kv,
)
from refserve.conformance.explore.scope import (
    SCOPES,
    RequestTemplate,
    Scope,
    ScopeError,
    user_scope,
)
from refserve.conformance.explore.sweep import SweepResult, explore_sweep

__all__ = [
    "KV_SCOPES",
    "SCOPES",
    "ExploreResult",
    "KVCounterexample",
    "KVExploreResult",
    "KVScope",
    "RequestTemplate",
    "Scope",
    "ScopeError",
    "SweepResult",
    "explore",
    "explore_kv",
    "explore_sweep",
    "user_scope",
]
