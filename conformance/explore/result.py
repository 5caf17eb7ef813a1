"""What an exploration covered, shared by the engine-level and the KV-level explorer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STRATEGIES = ("replay", "copy")
"""How a state is reached: its path replayed on a fresh adapter, or its parent copied."""


@dataclass
class Exploration:
    """The figures of one run (docs/CONFORMANCE.md, "Exhaustive exploration")."""

    engine: str = "?"
    strategy: str = "replay"
    states: int = 0
    """Distinct canonical states reached."""
    transitions: int = 0
    """Events applied, each with every check."""
    depth: int = 0
    """The longest shortest path: events from the fresh engine to the farthest state."""
    exhausted: bool = False
    """Every reachable state of the scope was expanded (no cap hit, no early stop)."""
    seconds: float = 0.0
    not_supported: str = ""
    coverage: dict[str, int] = field(default_factory=dict)
    """How many transitions (or states) exercised each path: evidence that the scope
    reaches what it is meant to."""

    @property
    def num_counterexamples(self) -> int:
        raise NotImplementedError

    @property
    def ok(self) -> bool:
        return not self.num_counterexamples and not self.not_supported

    def figures_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "strategy": self.strategy,
            "states": self.states,
            "transitions": self.transitions,
            "depth": self.depth,
            "exhausted": self.exhausted,
            "seconds": round(self.seconds, 3),
            "not_supported": self.not_supported,
            "coverage": dict(sorted(self.coverage.items())),
        }

    def figures(self, transitions: str) -> str:
        """``N states, M transitions..., depth D, exhausted, S s; verdict``."""
        verdict = (
            f"not supported: {self.not_supported}"
            if self.not_supported
            else f"{self.num_counterexamples} counterexample(s)"
            if self.num_counterexamples
            else "all invariants hold"
        )
        return (
            f"{self.states} states, {transitions}, depth {self.depth}, "
            f"{'exhausted' if self.exhausted else 'NOT exhausted'}, {self.seconds:.1f} s; "
            f"{verdict}"
        )
