"""The named points where attachments plug into the spine (docs/ARCHITECTURE.md, "The
core and what attaches to it").

The spine (the reference loop: ``loop.py``, ``planner.py`` and the modules they read)
knows each attachment only as one of these small protocols, and carries a null one of
each that does what the loop does without the attachment: a scheduler built from the
spine alone never swaps, never waits for a tool, verifies no drafts and plans every
decode one by one. ``scheduler.py`` (not spine) builds the scheduler with every
attachment plugged in.

- :class:`SuspensionManager`: KV that leaves the device (swapped preemption victims,
  tool waits), asked by the planner at its four points and by the loop at commit;
- :class:`ProposalSource`: speculative drafts, asked by the planner for a decode's
  drafts and by the commit for what a verification keeps;
- :class:`DecodeStrategy`: a faster way to plan and commit the steady decodes, held to
  the per-request path of the loop by the differential test;
- :class:`TransferPoint`: what a migration may do to a scheduler, at a step boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from refserve.core.batch import Ints
from refserve.core.inputs import ModelInputs
from refserve.core.outcome import Outcome
from refserve.core.plan import StepPlan
from refserve.core.request import FinishReason, Request
from refserve.core.step_build import StepBuild
from refserve.kv import BlockPool, PrefixHit
from refserve.spec.snapshot import PoolSnapshot

Fits = Callable[[int, PrefixHit | None], bool]


class SuspensionManager(Protocol):
    """Where KV goes when it leaves the device, and how it comes back."""

    def move_to_host(self, step: StepBuild) -> None:
        """At the start of a step: KV already bound for the host leaves the device."""

    def reclaim(self, step: StepBuild) -> bool:
        """Free the device blocks of one idle request before running work is preempted;
        False if there is none."""

    def evict(self, victim: Request, step: StepBuild) -> None:
        """Free a preemption victim's device blocks (the spine drops them)."""

    def park(self, victim: Request, step: StepBuild) -> None:
        """Free the device blocks of a victim the policy expects back soon: its KV goes
        to the host when the host pool can hold it, else it is dropped (recompute)."""

    def host_room(self) -> int:
        """Free blocks of the host pool (0: there is none)."""

    def readmit(self, r: Request, step: StepBuild, fits: Fits) -> bool | None:
        """Admission of a waiting ``r`` whose KV this manager holds: True if its next
        tokens were scheduled, False if they do not fit now (``fits(n, hit)``: the blocks
        for ``n`` tokens after ``hit`` are free), None if ``r`` is not one of its own."""

    def kept(self, r: Request, plan: StepPlan) -> bool:
        """At commit, for a preemption victim: True if this manager kept its KV (and
        moved ``r`` to its state); False leaves ``r`` to the spine's recompute."""

    def hold(self, r: Request) -> None:
        """A request arriving in a state this manager keeps (a migrated tool wait)."""

    def forget(self, request_id: str) -> bool:
        """The request leaves the scheduler; True if this manager held it aside (it was
        in neither the running batch nor the waiting queue)."""

    def commit(self, plan: StepPlan) -> None:
        """The manager's books catch up with a committed plan."""

    def begin(self) -> None:
        """The step's transaction opens: the manager's own pool (the host's) joins it."""

    def rollback(self) -> None:
        """The step's transaction is undone."""

    def close(self) -> None:
        """The step's transaction is committed."""

    def snapshot(self) -> PoolSnapshot | None:
        """The manager's pool for the invariant checks (None: it has none)."""


class ProposalSource(Protocol):
    """Speculative drafts for the decodes of the next step."""

    def any(self) -> bool:
        """True if some request has drafts for this step."""

    def drafts_for(self, r: Request, budget_left: int, later: int) -> tuple[int, ...]:
        """The drafts ``r`` verifies this step (empty: none), within ``budget_left``
        tokens and leaving a block to each of the ``later`` decodes."""

    def keep(
        self, r: Request, drafts: tuple[int, ...], accepted: int, token: int, now_ms: float
    ) -> tuple[tuple[int, ...], FinishReason | None]:
        """What a verification keeps: the tokens ``r`` gains, and why it finished."""

    def clear(self) -> None:
        """Drafts hold for one step."""


class CommittedDecodes(NamedTuple):
    """What a decode strategy committed: the requests that run on with their tokens,
    and the outcomes of those that finished."""

    request_ids: Sequence[str]
    tokens: Ints
    outcomes: list[Outcome]


class DecodeStrategy(Protocol):
    """A faster path for the step's decodes, exact to the loop's per-request one."""

    def plan_decodes(self, step: StepBuild) -> bool:
        """Plan every running decode at once; False (nothing planned) when it cannot,
        and the loop plans them one by one."""

    def all_decoding(self) -> bool:
        """After :meth:`plan_decodes` planned: no running request has prefill left."""

    def inputs(self, plan: StepPlan) -> ModelInputs | None:
        """The executor's inputs of a step of these decodes only (None for another)."""

    def commit_decodes(
        self,
        plan: StepPlan,
        tokens: Ints,
        now_ms: float,
        finish: Callable[[Request, int, FinishReason], Outcome],
    ) -> CommittedDecodes:
        """Apply the decodes :meth:`plan_decodes` planned (``finish`` ends one)."""


class TransferPoint(Protocol):
    """What a migration may do to a scheduler (ref/core/transit.py)."""

    requests: dict[str, Request]
    pool: BlockPool

    def require_boundary(self, what: str) -> None: ...

    def join(self, r: Request) -> None: ...

    def leave(self, request_id: str) -> Request: ...


class NoSuspension:
    """The spine's manager: a victim's KV is dropped (it recomputes), nothing waits aside."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def move_to_host(self, step: StepBuild) -> None:
        return None

    def reclaim(self, step: StepBuild) -> bool:
        return False

    def evict(self, victim: Request, step: StepBuild) -> None:
        self.pool.free(victim.request_id)

    def park(self, victim: Request, step: StepBuild) -> None:
        self.pool.free(victim.request_id)

    def host_room(self) -> int:
        return 0

    def readmit(self, r: Request, step: StepBuild, fits: Fits) -> bool | None:
        return None

    def kept(self, r: Request, plan: StepPlan) -> bool:
        return False

    def hold(self, r: Request) -> None:
        raise AssertionError(f"{r.request_id!r} is {r.status}: no suspension manager holds it")

    def forget(self, request_id: str) -> bool:
        return False

    def commit(self, plan: StepPlan) -> None:
        return None

    def begin(self) -> None:
        return None

    def rollback(self) -> None:
        return None

    def close(self) -> None:
        return None

    def snapshot(self) -> PoolSnapshot | None:
        return None


class NoProposals:
    """The spine's source: no drafts, so no verification."""

    def any(self) -> bool:
        return False

    def drafts_for(self, r: Request, budget_left: int, later: int) -> tuple[int, ...]:
        return ()

    def keep(
        self, r: Request, drafts: tuple[int, ...], accepted: int, token: int, now_ms: float
    ) -> tuple[tuple[int, ...], FinishReason | None]:
        raise AssertionError(f"{r.request_id!r}: a verification without a proposal source")

    def clear(self) -> None:
        return None
