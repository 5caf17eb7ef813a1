"""The executor interface: the only part that differs between simulation and a model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ref.inputs import ModelInputs
from ref.plan import StepPlan


@dataclass(frozen=True)
class StepOutput:
    """Sampled token per sampling request; ``duration_ms`` from a cost model, or None
    when the engine should measure wall time."""

    sampled: Mapping[str, int]
    duration_ms: float | None = None


class Executor(Protocol):
    #: Whether :meth:`execute` reads the flattened :class:`ModelInputs`.
    needs_inputs: bool

    def execute(self, plan: StepPlan, inputs: ModelInputs | None) -> StepOutput: ...
