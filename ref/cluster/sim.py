"""The cluster simulator: N cost-model replicas behind the real router, with migration
over a seeded link (docs/CLUSTER.md, "The cluster simulator").

Each replica is a :class:`~refserve.core.scheduler.Scheduler` with cache events on, stepped
by the single-engine simulator's executor (:class:`~refserve.sim.simulator.SimExecutor`,
the cost model ``a + b*P + c*D``) through an :class:`~refserve.core.engine_core.EngineCore`:
the code that runs one simulated engine. The replicas share one virtual clock; each is
busy until its current step ends. Routing is the cluster's own: every replica's cache
events feed one :class:`~refserve.cluster.index.GlobalPrefixIndex` after each of its steps,
and the :class:`~refserve.cluster.router.Router` chooses from the same
:class:`~refserve.cluster.records.LoadFigures` an in-process replica reports
(:func:`~refserve.cluster.replica.load_figures`).

Migration is the one driver's (``refserve.engine.migration.migrate``) with the
simulator's ends (ref/cluster/sim_migration.py): a replica's scheduler as the source,
the link towards the peer as the destination; priced by
:class:`~refserve.core.migration_cost.MigrationCost` (``AUTO``: transfer when the link
beats recompute on the destination's idle compute). The simulated K/V is a size taken at
export (the simulator has no K/V memory), so the source releases the request when it
departs and the request is in flight on the link, owned by it, until it lands:
:class:`LinkModel` times the transfer (latency + bytes / bandwidth + a seeded
exponential jitter). It lands at the destination's first step boundary after that; if
the destination has no room by then, it is staged without its K/V (a recompute, counted
as a fallback). The transfer's time is a gap between two of the request's tokens (a TBT
gap), recorded per move.

Every operation keeps one owner per live request (:meth:`ClusterSim.ownership_violations`:
each live request on exactly one replica or on the link, and the owner map says which;
and spec/cluster.py's OWNER over :meth:`ClusterSim.cluster_snapshot`); with
``check_ownership`` the simulator asserts both after every operation.

Prefill/decode roles (``roles``, ``deflection``; docs/DISAGG.md, ref/cluster/sim_pd.py):
every arrival is placed by ``disagg.place`` (the same router and index); after a prefill
replica's step, each request with its first token is handed off before that replica
steps again, with its K/V (``KVMode.TRANSFER``) through the one driver, to the decode
replica ``choose_decode`` picks, and travels on the link while the prefill replica steps
on; with no decode replica that has room it is kept and decodes where it is. A handoff
that lands on a replica without room waits on the link and tries again after that
replica's next steps (never a recompute, which would make the decode replica prefill a
request not deflected to it). With deflection, the decode replicas' schedulers run the
SLO-aware chunk rule (``tbt_slo_ms``, ``step_cost``). ``check_pd`` asserts the ROLES
rules of spec/pd.py after every operation (``first``, ``once``) and every decode
replica's step (``deflect``).

Triggers (:class:`MigrationPolicy`):

- ``pressure``: before a replica steps, if requests wait in its queue and its K/V is
  at least ``high_watermark`` used (it is about to preempt or stall), it moves its
  youngest running request (the one the scheduler would preempt) to the least-loaded
  peer with room for it;
- ``rebalance``: before a replica steps, if requests wait in its queue and a peer has
  none and a load lower by ``margin`` and caches at least as much of the request's
  prompt (the index says), it moves its youngest waiting request there (no K/V: only
  the latency travels);
- ``split_min_tokens``: a prompt at least this long, once half of it is computed and a
  peer has a load lower by ``margin``, moves mid-prefill with its K/V and continues
  there (a split at a token boundary).
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from refserve.cluster import triggers
from refserve.cluster.disagg import Deflection, Role, Roles
from refserve.cluster.index import GlobalPrefixIndex
from refserve.cluster.records import LoadFigures
from refserve.cluster.replica import load_figures
from refserve.cluster.router import Router, RoutingDecision
from refserve.cluster.sim_migration import (
    Landing,
    LinkDestination,
    ReplicaSource,
    SimTicket,
    land,
    try_land,
)
from refserve.cluster.sim_pd import PDRun, SimRoles
from refserve.cluster.triggers import MigrationPolicy
from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.engine_core import EngineCore
from refserve.core.migration_cost import KVMode, MigrationCost
from refserve.core.request import FinishReason, Request
from refserve.core.request_metrics import RequestMetrics
from refserve.core.scheduler import Scheduler
from refserve.engine.migration import migrate
from refserve.errors import InvalidArgument, RefserveError
from refserve.sim.noise import StepNoise
from refserve.sim.simulator import Session, SessionTurn, SimExecutor
from refserve.sim.workloads import Workload, to_requests
from refserve.spec.cluster import (
    ClusterSnapshot,
    Delivered,
    Node,
    Transit,
    TransitPhase,
    check_owner,
)
from refserve.spec.events import CacheEvent
from refserve.spec.pd import check_deflect, check_roles
from refserve.values import is_int

#: Llama-3-8B's K and V per token (32 layers x 8 KV heads x 128 dims x 2 x bf16), times
#: the compare experiment's default scale of 16 real tokens per simulated one.
DEFAULT_KV_BYTES_PER_TOKEN = 131072 * 16


@dataclass(frozen=True)
class LinkModel:
    """The link between replicas: ``latency_ms + bytes / (gb_per_s * 1e6)`` plus a
    jitter drawn exponential with mean ``jitter_ms`` (seeded by the simulator)."""

    gb_per_s: float = 25.0
    latency_ms: float = 0.5
    jitter_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.gb_per_s > 0:
            raise InvalidArgument(f"link gb_per_s must be > 0, got {self.gb_per_s!r}")
        if not (self.latency_ms >= 0 and self.jitter_ms >= 0):
            raise InvalidArgument("link latency_ms and jitter_ms must be >= 0")

    def transfer_ms(self, num_bytes: int, rng: random.Random) -> float:
        jitter = rng.expovariate(1.0 / self.jitter_ms) if self.jitter_ms else 0.0
        return self.latency_ms + num_bytes / (self.gb_per_s * 1e6) + jitter


@dataclass(frozen=True)
class SimMigration:
    """One migration: which request, from where to where, when it left and landed, how
    its K/V travelled, and the bytes and tokens moved."""

    request_id: str
    source: int
    destination: int
    reason: str  # pressure | rebalance | split | handoff
    depart_ms: float
    land_ms: float
    mode: KVMode
    kv_tokens: int
    moved_tokens: int
    num_bytes: int
    fallback: bool = False  # landed without room: staged without its K/V

    @property
    def transfer_ms(self) -> float:
        return self.land_ms - self.depart_ms


#: A move the triggers chose: the request, its destination, the trigger's name.
_Choice = tuple[Request, int, str]


@dataclass
class _Replica:
    sched: Scheduler
    core: EngineCore
    cost: StepCost
    executor: SimExecutor
    ready_ms: float = 0.0  # when its current step ends (and the loop's time after it)
    steps: int = 0
    busy_ms: float = 0.0


@dataclass
class _Job:
    session: Session
    next_turn: int = 0
    previous: Request | None = None


@dataclass(order=True)
class _Event:
    at_ms: float
    order: int
    kind: str = field(compare=False)  # "arrive" | "land"
    job: _Job | None = field(compare=False, default=None)
    transit: _Transit | None = field(compare=False, default=None)


@dataclass
class _Transit:
    ticket: SimTicket
    move: SimMigration


@dataclass(frozen=True)
class ClusterResult:
    """A run: every request's metrics (the final ones, on the replica that finished it),
    the routing decisions, the moves, and per-replica steps and busy time."""

    requests: tuple[RequestMetrics, ...]
    decisions: tuple[RoutingDecision, ...]
    moves: tuple[SimMigration, ...]
    makespan_ms: float
    steps: tuple[int, ...]
    busy_ms: tuple[float, ...]
    num_preemptions: int
    routed_hit_tokens: int  # prefix-hit tokens on the chosen replicas at routing
    rejected: tuple[str, ...] = ()  # requests the chosen replica refused
    pd: PDRun | None = None  # with roles: placements, handoffs, kept, deflected

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the replicas served from their prefix caches."""
        return sum(m.num_cached_tokens for m in self.requests)

    @property
    def bytes_moved(self) -> int:
        return sum(m.num_bytes for m in self.moves)


class ClusterSim:
    """N simulated replicas, one router, one link (module doc)."""

    def __init__(
        self,
        num_replicas: int,
        config: SchedulerConfig,
        cost: StepCost,
        router: Router,
        *,
        migration: MigrationPolicy | None = None,
        link: LinkModel | None = None,
        kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN,
        seed: int = 0,
        check_ownership: bool = False,
        keep_decisions: bool = True,
        noise: StepNoise | None = None,
        roles: Roles | None = None,
        deflection: Deflection | None = None,
        check_pd: bool = False,
    ) -> None:
        if not is_int(num_replicas) or num_replicas < 1:
            raise InvalidArgument(f"num_replicas must be an int >= 1, got {num_replicas!r}")
        if roles is None and deflection is not None:
            raise InvalidArgument("deflection needs roles (a decode replica to deflect to)")
        self.pd = None if roles is None else SimRoles(roles, deflection, num_replicas)
        if self.pd is not None and (migration or MigrationPolicy()).enabled:
            raise InvalidArgument(
                "migration triggers and prefill/decode roles do not mix: a trigger would "
                "move requests across roles; the handoff is the roles' only move"
            )
        self.check_pd = check_pd
        config = dataclasses.replace(config, cache_events=True)
        self.cost = cost
        self.router = router
        self.migration = migration or MigrationPolicy()
        self.link = link or LinkModel()
        self.price = MigrationCost(
            kv_bytes_per_token,
            link_gb_per_s=self.link.gb_per_s,
            latency_ms=self.link.latency_ms,
            iteration=cost,
        )
        self.kv_bytes_per_token = kv_bytes_per_token
        self.check_ownership = check_ownership
        self.keep_decisions = keep_decisions
        self._rng = random.Random(f"link:{seed}")
        self.index = GlobalPrefixIndex()
        self.replicas: list[_Replica] = []
        for i in range(num_replicas):
            sched = Scheduler(config if self.pd is None else self.pd.config_for(i, config, cost))
            ex = SimExecutor(
                cost,
                sched.requests,
                block_size=config.block_size,
                noise=noise,
                noise_stream=f"replica:{i}",
            )
            self.replicas.append(_Replica(sched, EngineCore(sched, ex), cost, ex))
            self.index.add_replica(i, config.block_size)
        self.owner: dict[str, int] = {}  # live request -> replica; -1: on the link
        self._events: list[_Event] = []
        self._order = 0
        self._final: dict[str, Request] = {}  # live (or on the link): the request now
        self._done: dict[str, RequestMetrics] = {}  # finished or refused
        self._load_cache: dict[int, LoadFigures] = {}
        self.decisions: list[RoutingDecision] = []
        self.moves: list[SimMigration] = []
        self._in_transit: dict[str, _Transit] = {}  # on the link, by request id
        self._parked: dict[int, list[_Transit]] = {}  # handoffs waiting for room, by replica
        self._jobs: dict[str, _Job] = {}  # live request -> the session it is a turn of
        self._split: set[str] = set()  # requests split once already
        self._routed_hits = 0
        self.rejected: list[str] = []  # requests no replica took

    # ------------------------------------------------------------------ ownership
    def ownership_violations(self) -> list[str]:
        """Every live request on exactly one replica or on the link, as the owner map
        says (docs/CLUSTER.md, "Ownership"); empty when the rule holds."""
        out: list[str] = []
        seen: dict[str, int] = {}
        for i, rep in enumerate(self.replicas):
            for rid in rep.sched.requests:
                if rid in seen:
                    out.append(f"{rid!r} is live on replicas {seen[rid]} and {i}")
                seen[rid] = i
        for rid in self._in_transit:
            if rid in seen:
                out.append(f"{rid!r} is on the link and live on replica {seen[rid]}")
            seen[rid] = -1
        if seen != self.owner:
            extra = sorted(set(self.owner) ^ set(seen))[:3]
            wrong = sorted(r for r in set(seen) & set(self.owner) if seen[r] != self.owner[r])
            out.append(f"owner map disagrees: missing/extra {extra}, wrong owner {wrong[:3]}")
        return out

    def cluster_snapshot(self) -> ClusterSnapshot:
        """The cluster as spec/cluster.py sees it: replica ``i`` is the engine named
        ``r<i>``; a request on the link is a transit in phase RELEASED (the source let
        go of it, the destination commits when it lands); every live request's client
        has its outputs so far, not finished."""
        nodes = tuple(
            Node(
                f"r{i}",
                rep.sched.snapshot(),
                tuple((rid, tuple(r.token_ids)) for rid, r in rep.sched.requests.items()),
            )
            for i, rep in enumerate(self.replicas)
        )
        transits = tuple(
            Transit(
                request_id=rid,
                source=f"r{tr.move.source}",
                destination=f"r{tr.move.destination}",
                phase=TransitPhase.RELEASED,
                with_kv=tr.ticket.with_kv,
                request=tr.ticket.record,
                token_ids=tr.ticket.state.token_ids,
                kv_length=tr.ticket.state.num_computed_tokens,
            )
            for rid, tr in self._in_transit.items()
        )
        live = (self._final[rid] for rid in self.owner)
        delivered = tuple(
            Delivered(r.request_id, tuple(r.token_ids[r.num_prompt_tokens :])) for r in live
        )
        return ClusterSnapshot(nodes, transits, delivered)

    def _check(self, what: str) -> None:
        if self.check_ownership:
            bad = self.ownership_violations()
            assert not bad, f"after {what}: {bad}"
            spec_bad = check_owner(self.cluster_snapshot())
            assert not spec_bad, f"after {what}: {spec_bad}"
        if self.check_pd and self.pd is not None:
            pd_bad = check_roles(self.pd.snapshot([rep.sched.requests for rep in self.replicas]))
            assert not pd_bad, f"after {what}: {pd_bad}"

    # ------------------------------------------------------------------ running
    def run(self, workload: Workload, *, max_steps: int = 10_000_000) -> ClusterResult:
        """Replay ``workload`` (single requests by arrival time, sessions turn by turn:
        turn k+1 arrives its tool wait after turn k finished) to the end."""
        for tr in to_requests(workload.requests):
            self._push(tr.arrival_ms, "arrive", job=_Job(_single(tr)))
        for s in workload.sessions:
            if not s.turns:
                raise InvalidArgument(f"session {s.session_id!r} has no turns")
            self._push(s.start_ms, "arrive", job=_Job(s))
        first = self._events[0].at_ms if self._events else 0.0
        total_steps = 0
        while self._events or self.owner:
            busy = [(rep.ready_ms, i) for i, rep in enumerate(self.replicas) if rep.sched.requests]
            next_step = min(busy) if busy else None
            if self._events and (next_step is None or self._events[0].at_ms <= next_step[0]):
                self._handle(heapq.heappop(self._events))
                continue
            assert next_step is not None, "live requests but no replica holds one"
            t, i = next_step
            total_steps += 1
            if total_steps > max_steps:
                raise InvalidArgument(f"the cluster simulation ran past max_steps={max_steps}")
            self._step(i, t)
        return self._result(first)

    def _push(
        self,
        at_ms: float,
        kind: str,
        *,
        job: _Job | None = None,
        move: _Transit | None = None,
    ) -> None:
        heapq.heappush(self._events, _Event(at_ms, self._order, kind, job, move))
        self._order += 1

    def _handle(self, ev: _Event) -> None:
        if ev.kind == "arrive":
            assert ev.job is not None
            self._arrive(ev.job, ev.at_ms)
        else:
            assert ev.transit is not None
            self._land(ev.transit, ev.at_ms)

    def _loads(self) -> dict[int, LoadFigures]:
        """Every replica's figures; each is recomputed only after that replica changed
        (:meth:`_changed`), so a routing costs O(replicas), not O(live requests)."""
        cache = self._load_cache
        for i, rep in enumerate(self.replicas):
            if i not in cache:
                cache[i] = load_figures(rep.sched, rep.cost)
        return dict(cache)

    def _changed(self, i: int) -> None:
        self._load_cache.pop(i, None)

    def _arrive(self, job: _Job, at_ms: float) -> None:
        r = _next_request(job, at_ms)
        hits = self.index.longest_prefix(r.token_ids, r.namespace)
        placement = None
        if self.pd is not None:
            placement = self.pd.place(self.router, r, self._loads(), hits)
            decision, target = placement.routing, placement.replica
        else:
            decision = self.router.route(r.request_id, r.num_prompt_tokens, self._loads(), hits)
            target = decision.replica
        rep = self.replicas[target]
        try:
            rep.sched.add_request(r)
        except RefserveError:
            # Refused (too long for a replica's pool, bad params): nothing changed there;
            # it is kept as a request that never ran, and its session ends.
            self.rejected.append(r.request_id)
            self._done[r.request_id] = RequestMetrics.of(r)
            return
        self.router.accepted(decision)
        if self.keep_decisions:
            self.decisions.append(decision)
        if placement is not None:
            assert self.pd is not None
            self.pd.placed(placement, keep=self.keep_decisions)
        self._routed_hits += (placement or decision).prefix_hit_tokens
        self.owner[r.request_id] = target
        self._final[r.request_id] = r
        self._jobs[r.request_id] = job
        self._changed(target)
        rep.ready_ms = max(rep.ready_ms, at_ms)
        self._check(f"routing {r.request_id!r}")

    def _step(self, i: int, t: float) -> None:
        rep = self.replicas[i]
        if self.migration.enabled and len(self.replicas) > 1:
            self._maybe_migrate(i, t)
            if not rep.sched.requests:
                return
        pd = self.pd if self.check_pd else None
        record = rep.core.step(t)
        self._changed(i)
        rep.steps += 1
        rep.busy_ms += record.end_ms - t
        rep.ready_ms = record.end_ms + rep.executor.after_step_ms()
        self.index.apply(i, self._drain(rep))
        for rid in record.outcome.finished:
            del self.owner[rid]
            self._finished(rid, record.end_ms)
            # Kept as metrics only: a long run's memory is not every request's tokens.
            self._done[rid] = RequestMetrics.of(self._final.pop(rid))
        if pd is not None and pd.roles.of(i) is Role.DECODE:
            bad = check_deflect(pd.decode_step(i, record, rep.cost))
            assert not bad, f"step {record.step_index} of replica {i}: {bad}"
        self._check(f"step {record.step_index} of replica {i}")
        if self.pd is not None:
            self._hand_off(i, record.end_ms)
            for tr in self._parked.pop(i, []):
                self._land(tr, record.end_ms)

    def _drain(self, rep: _Replica) -> list[CacheEvent]:
        log = rep.sched.pool.cache_events
        assert log is not None, "the simulator builds its schedulers with cache events"
        return log.drain()

    def _finished(self, rid: str, at_ms: float) -> None:
        job = self._jobs.pop(rid)
        done = self._final[rid]
        s = job.session
        if job.next_turn < len(s.turns) and done.finish_reason in (
            FinishReason.LENGTH,
            FinishReason.STOP,
        ):
            self._push(at_ms + s.turns[job.next_turn].tool_wait_ms, "arrive", job=job)
        if self.pd is not None:
            self.pd.finished(rid)

    # ------------------------------------------------------------------ migration
    def _maybe_migrate(self, i: int, t: float) -> None:
        """At most one move off replica ``i`` before its step (module doc, "Triggers")."""
        pol = self.migration
        loads = self._loads()
        choice = None
        if loads[i].num_waiting and pol.pressure:
            choice = self._pressure_move(i, loads)
        if choice is None and loads[i].num_waiting and pol.rebalance:
            choice = self._rebalance_move(i, loads)
        if choice is None and pol.split_min_tokens is not None:
            choice = self._split_move(i, loads, pol.split_min_tokens)
        if choice is not None:
            r, dst, reason = choice
            if reason == "split":
                self._split.add(r.request_id)
            self._depart(i, dst, r, reason, t)

    def _pressure_move(self, i: int, loads: dict[int, LoadFigures]) -> _Choice | None:
        if not triggers.under_pressure(loads[i], self.migration):
            return None
        victim = triggers.pressure_victim(self.replicas[i].sched.running)
        if victim is None:
            return None
        dst = self._peer(i, loads, victim, need_room=True)
        return None if dst is None else (victim, dst, "pressure")

    def _rebalance_move(self, i: int, loads: dict[int, LoadFigures]) -> _Choice | None:
        r = triggers.rebalance_candidate(self.replicas[i].sched.requests.values())
        if r is None:
            return None
        dst = self._peer(i, loads, r, need_room=False, idle_queue=True)
        if dst is None:
            return None
        hits = self.index.longest_prefix(r.token_ids, r.namespace)
        return (r, dst, "rebalance") if triggers.rebalance_gains(hits, i, dst) else None

    def _split_move(self, i: int, loads: dict[int, LoadFigures], min_tokens: int) -> _Choice | None:
        for r in triggers.split_candidate(self.replicas[i].sched.running, min_tokens, self._split):
            dst = self._peer(i, loads, r, need_room=True)
            if dst is not None:
                return (r, dst, "split")
        return None

    def _peer(
        self,
        i: int,
        loads: dict[int, LoadFigures],
        r: Request,
        *,
        need_room: bool,
        idle_queue: bool = False,
    ) -> int | None:
        """``triggers.pick_peer`` over the simulated replicas' free blocks."""
        free = {j: rep.sched.pool.num_free_blocks for j, rep in enumerate(self.replicas)}
        return triggers.pick_peer(
            i,
            loads,
            r,
            self.migration,
            free_blocks=free,
            need_room=need_room,
            idle_queue=idle_queue,
        )

    def _hand_off(self, i: int, t: float) -> None:
        """After replica ``i``'s step, before it steps again: each request with its first
        token on a prefill replica leaves for the decode replica ``choose_decode`` picks,
        with its K/V, and travels while ``i`` steps on; with none that has room it stays
        (kept) and decodes here."""
        pd = self.pd
        assert pd is not None
        for r in pd.due(list(self.replicas[i].sched.requests.values())):
            d = pd.choose(r, i, self._loads())
            if d.replica is None:
                pd.keep(r.request_id)
                continue
            pd.departed(r, d, t)
            self._depart(i, d.replica, r, "handoff", t, kv=KVMode.TRANSFER)

    def _depart(
        self, src: int, dst: int, r: Request, reason: str, t: float, kv: KVMode | None = None
    ) -> None:
        """The one migration driver moves ``r`` off ``src`` onto the link towards ``dst``
        (ref/cluster/sim_migration.py): priced (``kv``: the policy's mode unless given),
        released on ``src``, in flight until it lands (module doc)."""
        rid = r.request_id
        source = ReplicaSource(self.replicas[src].sched, t, self.price)
        dest = LinkDestination(self.index, dst, _idle(self.replicas[dst]))
        migrate(source, dest, rid, kv=kv or self.migration.kv, cost=self.price)
        ticket = dest.committed()
        landing_ms = t + self.link.transfer_ms(ticket.kv_bytes, self._rng)
        move = SimMigration(
            rid,
            src,
            dst,
            reason,
            t,
            landing_ms,
            ticket.kv_mode,
            ticket.kv_tokens,
            ticket.moved_tokens,
            ticket.kv_bytes,
        )
        self._changed(src)
        self.index.apply(src, self._drain(self.replicas[src]))
        self.owner[rid] = -1
        self._in_transit[rid] = _Transit(ticket, move)
        self._check(f"departure of {rid!r}")
        self._push(landing_ms, "land", move=self._in_transit[rid])

    def _land(self, tr: _Transit, at_ms: float) -> None:
        """At the destination's boundary the request lands (``sim_migration.land``) and
        runs there."""
        move = tr.move
        rep = self.replicas[move.destination]
        rid = move.request_id
        if move.reason == "handoff":
            landing = self._land_handoff(tr, at_ms)
            if landing is None:
                return
        else:
            landing = land(rep.sched, tr.ticket)
            self.moves.append(dataclasses.replace(move, fallback=landing.fallback))
        self._changed(move.destination)
        self.index.apply(move.destination, self._drain(rep))
        del self._in_transit[rid]
        self.owner[rid] = move.destination
        self._final[rid] = landing.request
        rep.ready_ms = max(rep.ready_ms, at_ms)
        self._check(f"landing of {rid!r}")

    def _land_handoff(self, tr: _Transit, at_ms: float) -> Landing | None:
        """A handoff lands with its K/V or not at all: without room it stays on the link
        and tries again after the destination's next step (a wait, counted), never
        recomputing there (module doc)."""
        pd, move = self.pd, tr.move
        assert pd is not None
        dst = self.replicas[move.destination]
        landing = try_land(dst.sched, tr.ticket)
        if landing is None:
            assert dst.sched.requests, f"{move.request_id!r} does not fit an idle replica"
            pd.waited(move.request_id)
            self._parked.setdefault(move.destination, []).append(tr)
            return None
        pd.landed(move.request_id, at_ms, move.num_bytes)
        return landing

    # ------------------------------------------------------------------ result
    def _result(self, first_ms: float) -> ClusterResult:
        end = max((rep.ready_ms for rep in self.replicas), default=first_ms)
        left = [RequestMetrics.of(r) for r in self._final.values()]
        reqs = tuple(sorted([*self._done.values(), *left], key=_arrival_key))
        preemptions = sum(m.num_preemptions for m in reqs)
        return ClusterResult(
            reqs,
            tuple(self.decisions),
            tuple(self.moves),
            end - first_ms,
            tuple(rep.steps for rep in self.replicas),
            tuple(rep.busy_ms for rep in self.replicas),
            preemptions,
            self._routed_hits,
            tuple(self.rejected),
            None if self.pd is None else self.pd.result(),
        )


def _arrival_key(r: RequestMetrics) -> tuple[float, str]:
    return (r.arrival_ms, r.request_id)


def _idle(rep: _Replica) -> float:
    """The destination's spare compute for a recompute: the share of its token budget
    its queue does not already claim (1.0 when idle)."""
    f = load_figures(rep.sched, rep.cost)
    budget = f.token_budget
    return max(0.0, min(1.0, 1.0 - (f.prefill_backlog_tokens + f.num_decoding) / budget))


def _single(r: Request) -> Session:
    """A single request as a one-turn session named by its id."""
    turn = SessionTurn(tuple(r.prompt_token_ids), r.stop.max_tokens)
    return Session(r.request_id, r.arrival_ms, (turn,), r.priority, r.tenant, turn_ids=False)


def _next_request(job: _Job, at_ms: float) -> Request:
    k = job.next_turn
    r = job.session.turn_request(k, job.previous, at_ms)
    job.next_turn = k + 1
    job.previous = r
    return r


def simulate_cluster(
    workload: Workload,
    num_replicas: int,
    config: SchedulerConfig,
    cost: StepCost,
    policy: str,
    *,
    migration: MigrationPolicy | None = None,
    link: LinkModel | None = None,
    seed: int = 0,
    check_ownership: bool = False,
    keep_decisions: bool = True,
    noise: StepNoise | None = None,
    roles: Roles | None = None,
    deflection: Deflection | None = None,
    check_pd: bool = False,
) -> ClusterResult:
    """One run: ``workload`` on ``num_replicas`` replicas routed by ``policy``
    (``keep_decisions=False``: the routing records are not kept, only their hit sum;
    ``noise``: each replica's step times scatter, ref/sim/noise.py; ``roles`` and
    ``deflection``: prefill/decode disaggregation, docs/DISAGG.md)."""
    sim = ClusterSim(
        num_replicas,
        config,
        cost,
        Router(policy),
        migration=migration,
        link=link,
        seed=seed,
        check_ownership=check_ownership,
        keep_decisions=keep_decisions,
        noise=noise,
        roles=roles,
        deflection=deflection,
        check_pd=check_pd,
    )
    return sim.run(workload)


def all_finished(result: ClusterResult) -> bool:
    return all(m.finished_ms is not None for m in result.requests)


__all__: Sequence[str] = (
    "ClusterResult",
    "ClusterSim",
    "LinkModel",
    "MigrationPolicy",
    "SimMigration",
    "all_finished",
    "simulate_cluster",
)
