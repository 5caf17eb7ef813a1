"""The executor interface: the only part that differs between simulation and a model.

A step is one transaction over two kinds of state (docs/ARCHITECTURE.md, "Atomic steps"): the
scheduler's books, which the pool's undo journal restores, and the executor's K/V memory,
which the executor journals itself. :class:`refserve.core.engine_core.EngineCore` calls
``begin(plan, inputs)`` before ``execute`` and then exactly one of ``commit()`` (the step
committed) or ``rollback()`` (it failed anywhere between ``begin`` and the scheduler's
commit). After ``rollback`` every slot and block the step could have written holds what
it held before ``begin``, so the blocks that the scheduler's rollback hands back to their
owners (a victim's block, a free cached block the step had evicted) read back their own
K/V again: ATOMIC extends from the snapshot to the memory it describes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from refserve.core.inputs import ModelInputs
from refserve.core.plan import StepPlan


@dataclass(frozen=True)
class DrawnToken:
    """One token the sampler drew, with its logprob: ``None`` when the sequence did not
    ask for logprobs, NaN when its row of logits could not be sampled (then ``token`` is
    a placeholder the engine never shows; ref/model/sampler.py)."""

    token: int
    logprob: float | None


#: The empty ``logprobs`` / ``fork_samples`` of a step that drew none: read-only, so one
#: instance serves every step (a long replay keeps a record per step).
NO_LOGPROBS: Mapping[str, float] = MappingProxyType({})
NO_FORKS: Mapping[str, tuple[DrawnToken, ...]] = MappingProxyType({})
NO_ACCEPTED: Mapping[str, int] = MappingProxyType({})
NO_VERIFIED: Mapping[str, tuple[float, ...]] = MappingProxyType({})


@dataclass(frozen=True)
class StepOutput:
    """Everything one ``execute`` produced (docs/ARCHITECTURE.md, "One step", stage 3).

    ``sampled``: the token per sampling request, what the scheduler commits.
    ``duration_ms``: from a cost model, or None when the engine should measure wall time.
    ``logprobs``: per sampling request that asked for them, or whose row could not be
    sampled (NaN). ``fork_samples``: per ``n > 1`` request drawing its first token, the
    first tokens of its samples 1..n-1 in sample order, drawn from the same logits; the
    engine forks them off after the commit. An executor without a model (the simulator)
    leaves both empty.
    """

    sampled: Mapping[str, int]
    duration_ms: float | None = None
    logprobs: Mapping[str, float] = field(default_factory=lambda: NO_LOGPROBS)
    fork_samples: Mapping[str, tuple[DrawnToken, ...]] = field(default_factory=lambda: NO_FORKS)
    #: Speculative decoding: per request that verified drafts, how many were accepted
    #: (its ``sampled`` token is the target's own, after them: docs/SPECULATIVE.md),
    #: and, when it asked for logprobs, one per emitted token (``logprobs`` has the last).
    accepted: Mapping[str, int] = field(default_factory=lambda: NO_ACCEPTED)
    verified_logprobs: Mapping[str, tuple[float, ...]] = field(default_factory=lambda: NO_VERIFIED)


class StepExecutor(Protocol):
    """What any executor does: run a plan. One that implements no more than this is
    treated as non-transactional (see :class:`Executor`)."""

    #: Whether :meth:`execute` reads the flattened :class:`ModelInputs`.
    needs_inputs: bool

    def execute(self, plan: StepPlan, inputs: ModelInputs | None) -> StepOutput: ...


@runtime_checkable
class KVTransaction(Protocol):
    """The executor's side of the step transaction (module doc)."""

    #: True when :meth:`rollback` restores every K/V slot and block the step could have
    #: written. False keeps the fallback for memory that cannot be restored: EngineCore
    #: drops the prefix-cache entries of every block the failed step could have written,
    #: since their K/V can no longer be trusted (and the retry recomputes them).
    transactional_kv: bool

    def begin(self, plan: StepPlan, inputs: ModelInputs | None) -> None:
        """Save what this step may overwrite, before anything is written.

        Called once per step, after the inputs are built and before ``execute``."""
        ...

    def rollback(self) -> None:
        """Put back everything saved by :meth:`begin` and forget it.

        Raising here is fatal to the engine (``refserve.core.engine_core.KVStateLost``): the
        scheduler's books would describe K/V that is no longer there."""
        ...

    def commit(self) -> None:
        """The step committed: drop what :meth:`begin` saved."""
        ...


class Executor(StepExecutor, KVTransaction, Protocol):
    """An executor whose memory joins the step's transaction (module doc)."""


class NoKVMemory:
    """Mixin for an executor that keeps no K/V (the simulator, scripted tests): there is
    nothing to save or restore, so its steps are trivially transactional."""

    transactional_kv = True

    def begin(self, plan: StepPlan, inputs: ModelInputs | None) -> None:
        pass

    def rollback(self) -> None:
        pass

    def commit(self) -> None:
        pass
