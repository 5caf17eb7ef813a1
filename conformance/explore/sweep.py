"""The boundary sweep: one scope explored at every budget and pool size on the edge of
what its requests need (docs/CONFORMANCE.md, "Your own scope and the boundary sweep").

A named scope fixes one budget and one pool, and a check that is off by one at a
boundary passes every exhaustive run of a scope that never sits on that boundary. The
sweep explores the scope again at each (budget, pool size) one below, at and one above a
request's need (:func:`refserve.conformance.explore.scope.sweep`), keeping the first
counterexample of each point, and reports every point's figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from refserve.conformance.adapter import AdapterFactory, Feature
from refserve.conformance.explore.explorer import ExploreResult, explore
from refserve.conformance.explore.scope import Scope, boundaries, sweep
from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT, AdapterCallError
from refserve.conformance.instance import adapter_traits
from refserve.conformance.runner import build


@dataclass
class SweepResult:
    """Every point of one sweep (the JSON keys of :meth:`to_json`)."""

    engine: str
    scope: Scope
    chunked: bool
    points: list[ExploreResult] = field(default_factory=list)

    @property
    def not_supported(self) -> str:
        """Why nothing was explored, when no point was supported."""
        reasons = {p.not_supported for p in self.points}
        if not self.points or all(reasons):
            return "no point of the sweep is supported: " + "; ".join(sorted(reasons))
        return ""

    @property
    def failing(self) -> list[ExploreResult]:
        return [p for p in self.points if p.counterexamples]

    def lines(self) -> list[str]:
        """One line per point: its limits and its figures."""
        out = []
        for p in self.points:
            assert p.scope is not None
            out.append(f"  {p.scope.name}: {p.figures(f'{p.transitions} transitions')}")
        return out

    def summary(self) -> str:
        edges = boundaries(self.scope)
        explored = [p for p in self.points if not p.not_supported]
        return (
            f"{self.engine}, boundary sweep of scope {self.scope.name} "
            f"(budgets {','.join(map(str, edges.budgets))} x blocks "
            f"{','.join(map(str, edges.pools))}"
            + ("" if self.chunked else "; unchunked: each budget keeps the requests that fit")
            + f"): {len(self.points)} points, {len(explored)} explored, "
            f"{sum(p.exhausted for p in explored)} exhausted, "
            f"{sum(p.states for p in explored)} states; "
            + (
                f"counterexamples at {len(self.failing)} point(s)"
                if self.failing
                else "all invariants hold at every point"
            )
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "refserve-explore-sweep",
            "engine": self.engine,
            "scope": self.scope.name,
            "scope_description": self.scope.describe(),
            "chunked": self.chunked,
            "points": [p.to_json() for p in self.points],
        }


def _chunks(factory: AdapterFactory, call_timeout: float) -> bool:
    """Whether the engine chunks prompts; an adapter whose features cannot be read is
    swept as if it did (each point then reports the adapter's fault itself)."""
    try:
        features, _ = adapter_traits(build(factory, call_timeout), call_timeout)
    except AdapterCallError:
        return True
    return Feature.CHUNKED_PREFILL in features


def explore_sweep(
    factory: AdapterFactory,
    scope: Scope,
    *,
    strategy: str = "replay",
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
) -> SweepResult:
    """Explore ``scope`` at every point of its boundary sweep (first counterexample of
    each point only); never raises for engine bugs."""
    chunked = _chunks(factory, call_timeout)
    res = SweepResult("?", scope, chunked)
    for point in sweep(scope, chunked=chunked):
        found = explore(
            factory, point, strategy=strategy, call_timeout=call_timeout, first_only=True
        )
        res.engine = found.engine if found.engine != "?" else res.engine
        res.points.append(found)
    return res
