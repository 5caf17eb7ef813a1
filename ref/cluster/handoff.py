"""The in-process cluster's side of prefill/decode roles (docs/DISAGG.md, "In the
cluster"): what :class:`~refserve.cluster.cluster.Cluster` records and decides about each
request's role, so the cluster itself only places, steps and moves.

:class:`RoleLedger` keeps, for every live request: the :class:`Placement` that put it on
its replica, its phase in the :class:`HandoffBook`, the output tokens of its turn seen in
the outputs (so how many its holder sampled: the count when it arrived there is kept),
and its handoffs. After a prefill replica's step, :meth:`RoleLedger.due` names the
requests it must give up; :meth:`RoleLedger.hand_off` picks the decode replica
(:func:`choose_decode`) and moves the request through the cluster's ``move`` (its
migration); a move that fails, or no decode replica with room, keeps the request where
it is. :meth:`RoleLedger.snapshot` is the rules' view (spec/pd.py, ``PDSnapshot``), and
:meth:`RoleLedger.read_steps` turns an in-process decode replica's step records into
``DecodeStep`` records for rule ``deflect``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from refserve.cluster.disagg import (
    Deflection,
    HandoffBook,
    HandoffDecision,
    Placement,
    Role,
    Roles,
    choose_decode,
    decode_step,
)
from refserve.cluster.errors import ReplicaDead
from refserve.cluster.records import ClusterMetrics, LoadFigures
from refserve.cluster.replica import InProcessReplica, Replica
from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.transit import MigrationError
from refserve.engine.intake import FORK_SEPARATOR
from refserve.engine.llm_engine import LLMEngine
from refserve.engine.outputs import RequestOutput
from refserve.errors import InvalidArgument
from refserve.spec.pd import (
    DecodeStep,
    Handoff,
    PDRequest,
    PDSnapshot,
    RoleName,
)

#: Records kept for inspection (placements, decode steps), newest last.
KEPT = 4096

#: Moves a live request to a replica (the cluster's migration, K/V transferred).
Move = Callable[[str, int], None]


def role_arguments(
    roles: object, deflection: object, replicas: Sequence[Replica]
) -> tuple[Roles | None, Deflection | None]:
    """Roles for these replicas, and a deflection only with them; with a deflection,
    every in-process decode replica bounds its chunks by the deflection's TBT SLO."""
    if roles is not None and not isinstance(roles, Roles):
        raise InvalidArgument(f"Cluster: roles must be Roles, got {type(roles).__name__}")
    if deflection is not None and not isinstance(deflection, Deflection):
        raise InvalidArgument(
            f"Cluster: deflection must be a Deflection, got {type(deflection).__name__}"
        )
    if roles is None:
        if deflection is not None:
            raise InvalidArgument("Cluster: a deflection needs roles (a decode replica)")
        return None, None
    if len(roles) != len(replicas):
        raise InvalidArgument(
            f"Cluster: roles {roles.text} name {len(roles)} replicas, the cluster has "
            f"{len(replicas)}"
        )
    for slot, rep in enumerate(replicas):
        check_decode_replica(roles, deflection, slot, rep)
    return roles, deflection


def check_decode_replica(
    roles: Roles, deflection: Deflection | None, slot: int, replica: Replica
) -> None:
    """An in-process decode replica under deflection runs the SLO-aware chunk rule with
    at most the deflection's TBT SLO, so a deflected prefill's chunks beside its decodes
    stay within the bound that rule ``deflect`` checks (a Ray replica's config is its
    actor's, not read here)."""
    if deflection is None or roles.of(slot) is not Role.DECODE:
        return
    if not isinstance(replica, InProcessReplica):
        return
    cfg = replica.engine.scheduler.config
    if cfg.tbt_slo_ms is None or cfg.tbt_slo_ms > deflection.tbt_slo_ms:
        raise InvalidArgument(
            f"Cluster: decode replica {slot} has tbt_slo_ms={cfg.tbt_slo_ms}; with a deflection "
            f"its scheduler must bound deflected chunks beside its decodes: build it with "
            f"SchedulerConfig(tbt_slo_ms<={deflection.tbt_slo_ms:g}, step_cost=...) "
            "(Cluster.in_process does)"
        )


def decode_config(config: SchedulerConfig, deflection: Deflection) -> SchedulerConfig:
    """A decode replica's configuration under ``deflection``: the caller's, with the
    deflection's TBT SLO and the default cost model where it set none."""
    if config.tbt_slo_ms is not None:
        return config
    cost = config.step_cost or StepCost()
    return replace(config, tbt_slo_ms=deflection.tbt_slo_ms, step_cost=cost)


@dataclass(frozen=True)
class HandoffAttempt:
    """One handoff tried: the decision (its ``replica`` None: no decode replica had
    room), whether the request moved (False: kept where it was), and the output tokens
    of its turn it had then."""

    decision: HandoffDecision
    moved: bool
    tokens: int


def _parent(request_id: str) -> str:
    return request_id.split(FORK_SEPARATOR, 1)[0]


@dataclass
class _StepCursor:
    """How far one decode slot's engine records were read, and what it preempted."""

    engine: LLMEngine
    read: int = 0
    preempted: set[str] = field(default_factory=set)


class RoleLedger:
    """Every live request's role record in a cluster with roles (module doc)."""

    def __init__(self, roles: Roles, deflection: Deflection | None) -> None:
        self.roles = roles
        self.deflection = deflection
        self.book = HandoffBook(roles)
        self.placements: deque[Placement] = deque(maxlen=KEPT)
        self.attempts: deque[HandoffAttempt] = deque(maxlen=KEPT)
        self._prompt: dict[str, int] = {}  # request -> prompt tokens (its K/V at handoff)
        self._tokens: dict[str, int] = {}  # request -> output tokens of its turn, seen
        self._arrived: dict[str, int] = {}  # request -> its tokens when its holder got it
        self._handoffs: dict[str, list[Handoff]] = {}
        self._cursors: dict[int, _StepCursor] = {}
        self._decode_steps: deque[DecodeStep] = deque(maxlen=KEPT)

    # ------------------------------------------------------------------ requests
    def placed(self, placement: Placement, num_prompt_tokens: int, m: ClusterMetrics) -> None:
        rid = placement.request_id
        self.placements.append(placement)
        self.book.placed(rid, placement)
        self._prompt[rid] = num_prompt_tokens
        self._tokens[rid] = self._arrived[rid] = 0
        self._handoffs[rid] = []
        m.deflections += placement.deflected

    def saw(self, outputs: Iterable[RequestOutput]) -> None:
        """Output tokens of each request's turn (an ``n > 1`` one: its longest sample)."""
        for o in outputs:
            if o.request_id in self._tokens:
                self._tokens[o.request_id] = max(self._tokens[o.request_id], len(o.token_ids))

    def moved(self, request_id: str) -> None:
        """It changed holder: what it samples from here is the new holder's."""
        if request_id in self._tokens:
            self._arrived[request_id] = self._tokens[request_id]

    def forget(self, request_id: str) -> None:
        self.book.forget(request_id)
        for d in (self._prompt, self._tokens, self._arrived, self._handoffs):
            d.pop(request_id, None)
        for cur in self._cursors.values():
            cur.preempted = {s for s in cur.preempted if _parent(s) != request_id}

    # ------------------------------------------------------------------ handoff
    def due(self, held: Iterable[str]) -> list[str]:
        """Of a prefill replica's requests, those to hand off now (first token sampled)."""
        return [rid for rid in held if self.book.due(rid, self._tokens.get(rid, 0))]

    def hand_off(
        self,
        request_id: str,
        source: int,
        loads: Mapping[int, LoadFigures],
        move: Move,
        m: ClusterMetrics,
    ) -> bool:
        """Move ``request_id`` off prefill replica ``source`` to the decode replica
        :func:`choose_decode` picks; True when it moved. A second handoff of the turn is
        refused (``InvalidArgument``) before anything moves; no decode replica with room,
        a refused or aborted move, or a destination found dead keeps it on ``source``."""
        self.book.check_handoff(request_id)
        decision = choose_decode(request_id, source, self._prompt[request_id], loads, self.roles)
        to = decision.replica
        tokens = self._tokens[request_id]
        if to is not None:
            try:
                move(request_id, to)
            except (MigrationError, ReplicaDead):  # it stayed where it was (or died there)
                pass
            else:
                self.book.handed_off(request_id)
                # The cluster has no resume: a request's one turn starts at its first
                # output token, so the tokens of the turn are all it has.
                h = Handoff(self._name(source), self._name(to), tokens)
                self._handoffs[request_id].append(h)
                self.attempts.append(HandoffAttempt(decision, True, tokens))
                m.handoffs += 1
                return True
        self.attempts.append(HandoffAttempt(decision, False, tokens))
        if request_id in self._tokens:  # not ended with its source's death meanwhile
            self.book.kept(request_id)
            m.handoffs_kept += 1
        return False

    def _name(self, slot: int) -> RoleName:
        return RoleName(self.roles.of(slot).value)

    # ------------------------------------------------------------------ the rules' view
    def snapshot(self, owners: Mapping[str, int]) -> PDSnapshot:
        """Each live request as spec/pd.py's rules read it."""
        out = []
        for rid, r in sorted(owners.items()):
            if rid not in self._tokens:
                continue
            out.append(
                PDRequest(
                    rid,
                    str(r),
                    self._name(r),
                    self._tokens[rid] - self._arrived[rid],
                    deflected=self.book.is_deflected(rid),
                    kept=self.book.is_kept(rid),
                    handoffs=tuple(self._handoffs[rid]),
                )
            )
        return PDSnapshot(tuple(out))

    def read_steps(self, slot: int, replica: Replica) -> None:
        """The step records a decode replica's engine made since the last read, as
        ``DecodeStep`` records (in-process replicas only: a Ray actor's stay there)."""
        if self.roles.of(slot) is not Role.DECODE or not isinstance(replica, InProcessReplica):
            return
        engine = replica.engine
        cur = self._cursors.get(slot)
        if cur is None or cur.engine is not engine:  # a restarted slot: a fresh engine
            cur = self._cursors[slot] = _StepCursor(engine)
        records = engine.steps[cur.read :]
        cur.read += len(records)
        config = engine.scheduler.config
        cost = config.step_cost or StepCost()

        def deflected(sample_id: str) -> bool:
            return self.book.is_deflected(_parent(sample_id))

        for rec in records:
            step = decode_step(
                str(slot), rec.plan, cost, config.tbt_slo_ms, deflected, cur.preempted
            )
            self._decode_steps.append(step)
            cur.preempted.update(rec.plan.preempted)

    def take_decode_steps(self) -> list[DecodeStep]:
        """The decode steps recorded since the last call, oldest first."""
        out = list(self._decode_steps)
        self._decode_steps.clear()
        return out
