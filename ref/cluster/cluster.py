"""The in-process cluster: N replicas behind one router (docs/CLUSTER.md, "The
in-process cluster").

:meth:`Cluster.add_request` routes: the replicas' cache events published so far are
applied to the global index (ref/cluster/index.py), the index gives every replica's
cached prefix of the prompt, the router (ref/cluster/router.py) compares those with the
replicas' load figures, and the request goes to the replica it chose. :meth:`Cluster.step`
steps every replica that has work and returns their outputs, in replica order.
:meth:`Cluster.migrate` moves a live request to another replica with the engines'
migration protocol (ref/engine/migration.py, ``migrate``: the source unchanged by a
failure before the ack).

Ownership. The cluster maps each live request to the one replica that holds it; after
every operation the map equals the replicas' own live requests, each on exactly one
(:meth:`Cluster.ownership_violations` is that rule). A request leaves the map when it is
aborted, and when the step that finished it returns its final output.

Faults. If a replica's step raises, the outputs the replicas before it produced in that
call are held and delivered first by the next :meth:`Cluster.step` that returns (each
once), as a single engine holds its outputs (ref/engine/llm_engine.py, "Faults"). A
replica that is gone (:class:`~refserve.cluster.errors.ReplicaDead`, raised by any call to
it: its Ray actor died) is buried instead: every request it held ends with that error,
once, in :meth:`Cluster.take_failures` (never restarted, so never duplicated: the
documented choice, docs/CLUSTER.md "Faults"), it leaves the index, and the router does
not see it; the other replicas go on. With a ``restart`` factory, a buried replica is
replaced at once by a fresh one in its slot, at most ``max_restarts`` times a slot: the
fresh one joins the index from its own snapshot (an empty cache: a resync, nothing of
the dead one's replayed) and the router sees it again.

Migration policy. With a :class:`~refserve.cluster.triggers.MigrationPolicy` (opt-in; off by
default) the cluster also moves requests by itself, before a replica steps, with the
simulator's trigger rules (ref/cluster/triggers.py, shared): ``pressure`` moves the
youngest running request off a replica whose K/V is at the high watermark with a queue
(instead of the preemption its step would make), ``rebalance`` moves its youngest
waiting request to a peer with no queue that caches as much of its prompt, and
``split_min_tokens`` moves a long prompt, half prefilled, with its K/V to a less-loaded
peer that finishes the prefill (a split at a token boundary, once a request). Each goes
through :meth:`Cluster.migrate` (``kv`` the policy's: ``auto`` lets the cost rule pick
transfer or recompute); a refusal leaves the request where it was and is counted.

Roles. With :class:`~refserve.cluster.disagg.Roles` (prefill/decode disaggregation,
docs/DISAGG.md) a request is placed by ``disagg.place`` (the router among the replicas
that prefill; with a :class:`~refserve.cluster.disagg.Deflection`, a decode replica when
the prefill side would miss its TTFT SLO), and right after the step of a prefill replica
that sampled its first token it is handed off, its K/V transferred by
:meth:`Cluster.migrate`, to the decode replica ``choose_decode`` picks; a handoff that
fails keeps it there. The records and decisions are ref/cluster/handoff.py's
(:class:`~refserve.cluster.handoff.RoleLedger`); :meth:`Cluster.pd_snapshot` is the view
the rules of spec/pd.py check.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from refserve.cluster import disagg, triggers
from refserve.cluster.disagg import Deflection, Role, Roles
from refserve.cluster.errors import (
    NoLiveReplica,
    ReplicaDead,
    UnknownReplica,
)
from refserve.cluster.handoff import RoleLedger, check_decode_replica, decode_config, role_arguments
from refserve.cluster.index import GlobalPrefixIndex
from refserve.cluster.migration import (
    PolicyMigration,
    TicketDestination,
    TicketSource,
    check_by_ticket,
)
from refserve.cluster.ownership import Ownership
from refserve.cluster.records import ClusterMetrics, LoadFigures
from refserve.cluster.replica import InProcessReplica, Replica
from refserve.cluster.router import Router, RoutingDecision
from refserve.cluster.supervisor import ReplicaFactory, ReplicaSupervisor, check_replicas
from refserve.cluster.triggers import MigrationPolicy
from refserve.core.config import SchedulerConfig
from refserve.core.migration_cost import KVMode, MigrationCost
from refserve.core.scheduler import Scheduler
from refserve.core.transit import MigrationArgs, MigrationError
from refserve.engine import intake, migration
from refserve.engine.llm_engine import (
    FORK_SEPARATOR,
    LLMEngine,
    Prompt,
    RequestOutput,
)
from refserve.engine.migration import MigrationAborted
from refserve.engine.ticket import MigrationTicket
from refserve.errors import InvalidArgument
from refserve.model.sampler import SamplingParams
from refserve.spec.pd import DecodeStep, PDSnapshot
from refserve.values import is_int


def _check_policy(migration: MigrationPolicy, reps: Sequence[Replica]) -> None:
    """A policy the cluster can run (module doc, "Migration policy")."""
    if not isinstance(migration, MigrationPolicy):
        raise InvalidArgument(
            f"Cluster: migration must be a MigrationPolicy, got {type(migration).__name__}"
        )
    if migration.enabled and not all(isinstance(r, InProcessReplica) for r in reps):
        raise InvalidArgument(
            "Cluster: a migration policy reads the replicas' schedulers; it needs "
            "in-process replicas"
        )


def _configs(
    num_replicas: int, scheduler_config: SchedulerConfig | Sequence[SchedulerConfig] | None
) -> list[SchedulerConfig]:
    """One scheduler configuration per replica: ``scheduler_config`` for all, or one each."""
    if not is_int(num_replicas) or num_replicas < 1:
        raise InvalidArgument(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    if scheduler_config is None or isinstance(scheduler_config, SchedulerConfig):
        return [scheduler_config or SchedulerConfig()] * num_replicas
    configs = list(scheduler_config)
    if len(configs) != num_replicas:
        raise InvalidArgument(f"{num_replicas} replicas but {len(configs)} scheduler configs")
    return configs


#: Routing decisions kept for inspection (:attr:`Cluster.decisions`), newest last.
DECISIONS_KEPT = 4096


class Cluster:
    """N replicas of one model behind a :class:`Router` (module doc)."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        router: Router | None = None,
        *,
        migration: MigrationPolicy | None = None,
        restart: ReplicaFactory | None = None,
        max_restarts: int = 0,
        roles: Roles | None = None,
        deflection: Deflection | None = None,
    ) -> None:
        reps = check_replicas(replicas, restart, max_restarts)
        if router is not None and not isinstance(router, Router):
            raise InvalidArgument(f"Cluster: router must be a Router, got {type(router).__name__}")
        if migration is not None:
            _check_policy(migration, reps)
        roles, deflection = role_arguments(roles, deflection, reps)
        if roles is not None and migration is not None and migration.enabled:
            raise InvalidArgument(
                "Cluster: a migration policy would move requests across roles; with roles "
                "requests move only by their handoff"
            )
        # With roles (module doc, "Roles"): placements, phases, handoffs, decode steps.
        self.pd = None if roles is None else RoleLedger(roles, deflection)
        self.migration = migration or MigrationPolicy()
        self.moves: deque[PolicyMigration] = deque(maxlen=DECISIONS_KEPT)
        self.router = router or Router()
        self.index = GlobalPrefixIndex()
        self.metrics = ClusterMetrics()
        self.decisions: deque[RoutingDecision] = deque(maxlen=DECISIONS_KEPT)
        self._owner = Ownership()
        self._held: list[RequestOutput] = []
        self._failures: dict[str, ReplicaDead] = {}
        self._split: set[str] = set()  # requests a split policy tried to move once
        self.supervisor = ReplicaSupervisor(
            reps,
            self.index,
            self.metrics,
            on_death=self._on_death,
            accept=self._accept,
            restart=restart,
            max_restarts=max_restarts,
        )
        self._next_id = 0
        self._vocab_size = reps[0].identity.vocab_size

    @classmethod
    def in_process(
        cls,
        num_replicas: int,
        *,
        model: str = "tiny",
        scheduler_config: SchedulerConfig | Sequence[SchedulerConfig] | None = None,
        router: Router | None = None,
        check_invariants: bool = False,
        migration: MigrationPolicy | None = None,
        roles: Roles | None = None,
        deflection: Deflection | None = None,
    ) -> Cluster:
        """``num_replicas`` engines of ``model`` in this process, each publishing its
        cache events; ``scheduler_config`` one for all or one per replica. With a
        ``deflection``, a decode slot's config gets its TBT SLO and a cost model where it
        has none (ref/cluster/handoff.py, ``decode_config``)."""
        replicas: list[Replica] = []
        for slot, c in enumerate(_configs(num_replicas, scheduler_config)):
            cfg = replace(c, cache_events=True)
            decode = isinstance(roles, Roles) and roles.roles[slot : slot + 1] == (Role.DECODE,)
            if decode and isinstance(deflection, Deflection):
                cfg = decode_config(cfg, deflection)
            engine = LLMEngine(model, scheduler_config=cfg, check_invariants=check_invariants)
            replicas.append(InProcessReplica(engine))
        return cls(replicas, router, migration=migration, roles=roles, deflection=deflection)

    # ------------------------------------------------------------------ requests
    @property
    def replicas(self) -> tuple[Replica, ...]:
        """The replica in each slot (a restarted slot's is the fresh one)."""
        return self.supervisor.replicas

    @property
    def dead(self) -> dict[int, ReplicaDead]:
        """The dead slots, each with what killed its replica (module doc, "Faults")."""
        return self.supervisor.dead

    @property
    def has_work(self) -> bool:
        """A :meth:`step` can make progress on some replica, or outputs are held."""
        return bool(self._held) or any(self.supervisor.has_work(r, rep) for r, rep in self._live())

    def owner(self, request_id: str) -> int:
        """The replica holding the live request ``request_id``."""
        return self._owner.owner(request_id)

    @property
    def owners(self) -> dict[str, int]:
        """A copy of the ownership map: live request -> replica."""
        return self._owner.copy()

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> RoutingDecision:
        """Route a request and queue it on the chosen replica; the decision says where.
        Bad input raises a typed error (the replica's own, e.g. ``InvalidSamplingParams``
        or ``ExceedsCapacity``) and changes nothing: not the router, not the metrics.
        With roles the router chooses among the replicas that prefill, and a deflected
        request's decision names the decode replica it went to (the whole
        :class:`~refserve.cluster.disagg.Placement` is ``pd.placements[-1]``)."""
        rid = self._new_id(request_id)
        ids = self._token_ids(prompt)
        while True:  # a replica found dead here is buried and the request routed again
            self._sync_index()
            live = self._live()
            if not live:
                raise NoLiveReplica(f"add_request {rid!r}: every replica is dead")
            r = -1
            try:
                loads = {}
                for r, rep in live:
                    loads[r] = rep.load()
                hits = self.index.longest_prefix(ids)
                roles = self.pd.roles if self.pd else Roles.colocated(len(self.replicas))
                deflection = self.pd.deflection if self.pd else None
                placement = disagg.place(self.router, rid, len(ids), loads, hits, roles, deflection)
                r = placement.replica
                self.replicas[r].add_request(ids, params or SamplingParams(), rid)
            except ReplicaDead as e:
                self._bury(r, e)
                continue
            break
        decision = placement.routing
        if placement.deflected:  # the prefill replica the router chose did not take it
            decision = replace(decision, replica=r, prefix_hit_tokens=placement.prefix_hit_tokens)
        else:
            self.router.accepted(decision)
        self._owner[rid] = decision.replica
        self.decisions.append(decision)
        if self.pd is not None:
            self.pd.placed(placement, len(ids), self.metrics)
        d = decision
        self.metrics.routed(d.policy.value, d.replica, len(ids), d.prefix_hit_tokens)
        return decision

    def abort(self, request_id: str) -> None:
        """Abort a live request on its replica; its final outputs come with the next step."""
        r = self.owner(request_id)
        try:
            self.replicas[r].abort(request_id)
        except ReplicaDead as e:  # it ends with the error instead (take_failures)
            self._bury(r, e)
            return
        self._forget(request_id)

    def take_failures(self) -> dict[str, ReplicaDead]:
        """The requests that ended because their replica died, since the last call, with
        the error (module doc, "Faults"): each request once, none of them live anywhere."""
        out, self._failures = self._failures, {}
        return out

    def step(self) -> list[RequestOutput]:
        """Step every replica that has work; the held outputs, then theirs in replica
        order (module doc, "Faults")."""
        outputs, self._held = self._held, []
        try:
            for r, rep in self._live():
                if r in self.dead or self.replicas[r] is not rep:  # buried by a handoff
                    continue
                try:
                    if not rep.has_work:
                        continue
                    if self.migration.enabled and not self._maybe_migrate(r):
                        continue  # its last runnable request moved away
                    fresh = rep.step()
                    if self.pd is not None:  # before the finished leave its records
                        self.pd.read_steps(r, rep)
                    self._retire(r, rep, fresh)
                except ReplicaDead as e:
                    self._bury(r, e)
                    continue
                outputs.extend(fresh)
                if self.pd is not None:
                    self._after_role_step(r, fresh)
        except BaseException:
            self._held = outputs
            raise
        self._sync_index()
        return outputs

    # ------------------------------------------------------------------ migration
    def migrate(
        self,
        request_id: str,
        to: int,
        *,
        kv: KVMode | str = KVMode.AUTO,
        chunk_blocks: int | None = None,
        cost: MigrationCost | None = None,
        fault: migration.FaultHook | None = None,
        reason: str = "asked",
    ) -> migration.MigrationReport:
        """Move a live request to replica ``to`` (``refserve.engine.migration.migrate``;
        ``kv``, ``chunk_blocks``, ``cost`` and ``fault`` are its). A failure before the
        ack raises ``MigrationAborted`` with the request where it was; a destination
        without room refuses (``MigrationRefused``), the request where it was too.
        Between replicas that are not both in process (Ray) the move goes by whole
        tickets (ref/cluster/migration.py): ``chunk_blocks``, ``fault`` and ``cost`` are
        the in-process protocol's and must be None there. ``reason`` labels the move in
        ``metrics.migrations_by_reason`` (the policy's moves say theirs)."""
        MigrationArgs.check(kv, chunk_blocks, cost, fault)
        src = self.owner(request_id)
        if not is_int(to) or not 0 <= to < len(self.replicas):
            raise UnknownReplica(to, f"migrate of {request_id!r}")
        if to == src:
            raise InvalidArgument(f"migrate: request {request_id!r} is already on replica {to}")
        if to in self.dead:
            raise self.dead[to]
        a, b = self.replicas[src], self.replicas[to]
        source: migration.MigrationSource[MigrationTicket]
        dest: migration.MigrationDestination[MigrationTicket]
        if isinstance(a, InProcessReplica) and isinstance(b, InProcessReplica):
            source, dest = a.engine, b.engine
        else:
            check_by_ticket(a, b, chunk_blocks, fault, cost)
            source, dest = TicketSource(a), TicketDestination(b)
        try:
            report = migration.migrate(
                source, dest, request_id, kv=kv, chunk_blocks=chunk_blocks, cost=cost, fault=fault
            )
        except MigrationError as e:  # aborted or refused: the request stayed where it was
            self.metrics.migrations_aborted += 1
            dead = e.cause if isinstance(e, MigrationAborted) else None
            if isinstance(dead, ReplicaDead):
                for r in (src, to):
                    if dead.replica == r:
                        self._bury(r, dead)
                raise dead from e
            raise
        self._owner[request_id] = to
        if self.pd is not None:
            self.pd.moved(request_id)
        if isinstance(source, TicketSource) and source.release_error is not None:
            self._bury(src, source.release_error)  # the move rolled forward (it is on `to`)
        m = self.metrics
        m.migrations += 1
        m.migrations_by_reason[reason] += 1
        m.migration_bytes += report.kv_bytes
        m.migration_ms += report.elapsed_ms
        return report

    def _maybe_migrate(self, i: int) -> bool:
        """At most one policy move off replica ``i`` before its step (module doc,
        "Migration policy"; the rules are ref/cluster/triggers.py's, the simulator's).
        True when replica ``i`` still has work after it."""
        if len(self._live()) < 2:
            return True
        self._policy_move(i)
        return self.replicas[i].has_work

    def _policy_move(self, i: int) -> None:
        pol = self.migration
        engines: dict[int, LLMEngine] = {}
        for r, rep in self._live():
            assert isinstance(rep, InProcessReplica)  # checked at construction
            engines[r] = rep.engine
        loads = {r: self.replicas[r].load() for r in engines}
        free = {r: e.scheduler.pool.num_free_blocks for r, e in engines.items()}
        choice = self._choose(i, engines[i].scheduler, loads, free)
        if choice is None:
            return
        rid, dst, reason = choice
        # A sample of an n > 1 request moves as its parent does (the engine's unit).
        parent = rid.split(FORK_SEPARATOR, 1)[0]
        if parent not in self._owner:
            return
        if reason == "split":  # tried once, moved or refused: never again
            self._split.add(rid)
        try:
            report = self.migrate(parent, dst, kv=pol.kv, reason=reason)
        except MigrationError:  # refused or aborted: it stays, counted in the metrics
            return
        self.moves.append(PolicyMigration(parent, i, dst, reason, report.decision.mode))
        self._sync_index()

    def _choose(
        self, i: int, sched: Scheduler, loads: dict[int, LoadFigures], free: dict[int, int]
    ) -> tuple[str, int, str] | None:
        """The policy's move off replica ``i``, its triggers tried in order (pressure,
        rebalance, split): (request, destination, reason), or None."""
        pol = self.migration
        choice: tuple[str, int, str] | None = None
        if pol.pressure and triggers.under_pressure(loads[i], pol):
            choice = self._pressure_choice(i, sched, loads, free)
        if choice is None and pol.rebalance and loads[i].num_waiting:
            choice = self._rebalance_choice(i, sched, loads, free)
        if choice is None and pol.split_min_tokens is not None:
            choice = self._split_choice(i, sched, loads, free, pol.split_min_tokens)
        return choice

    def _pressure_choice(
        self, i: int, sched: Scheduler, loads: dict[int, LoadFigures], free: dict[int, int]
    ) -> tuple[str, int, str] | None:
        victim = triggers.pressure_victim(sched.running)
        if victim is None:
            return None
        dst = triggers.pick_peer(i, loads, victim, self.migration, free_blocks=free, need_room=True)
        return None if dst is None else (victim.request_id, dst, "pressure")

    def _rebalance_choice(
        self, i: int, sched: Scheduler, loads: dict[int, LoadFigures], free: dict[int, int]
    ) -> tuple[str, int, str] | None:
        cand = triggers.rebalance_candidate(sched.requests.values())
        if cand is None:
            return None
        dst = triggers.pick_peer(
            i, loads, cand, self.migration, free_blocks=free, need_room=False, idle_queue=True
        )
        if dst is None:
            return None
        self._sync_index()
        hits = self.index.longest_prefix(cand.token_ids, cand.namespace)
        if not triggers.rebalance_gains(hits, i, dst):
            return None
        return (cand.request_id, dst, "rebalance")

    def _split_choice(
        self,
        i: int,
        sched: Scheduler,
        loads: dict[int, LoadFigures],
        free: dict[int, int],
        min_tokens: int,
    ) -> tuple[str, int, str] | None:
        for r in triggers.split_candidate(sched.running, min_tokens, self._split):
            dst = triggers.pick_peer(i, loads, r, self.migration, free_blocks=free, need_room=True)
            if dst is not None:
                return (r.request_id, dst, "split")
        return None

    # ------------------------------------------------------------------ roles
    def _after_role_step(self, r: int, fresh: Sequence[RequestOutput]) -> None:
        """After replica ``r`` stepped, with roles (module doc, "Roles"): its outputs
        counted, and every request of a prefill replica that has its first token handed
        off before that replica steps again."""
        assert self.pd is not None
        self.pd.saw(fresh)
        if self.pd.roles.of(r) is not Role.PREFILL:
            return
        for rid in self.pd.due(self._owner.held_by(r)):
            loads = self.supervisor.loads()
            if r in loads and self._owner.get(rid) == r:  # else it ended: r found dead
                self.pd.hand_off(rid, r, loads, self._hand_off_to, self.metrics)

    def _hand_off_to(self, request_id: str, to: int) -> None:
        """One handoff's move: the request (an ``n > 1`` one with all its samples) and
        its K/V to decode replica ``to``. A dead side is buried by :meth:`migrate`."""
        self.migrate(request_id, to, kv=KVMode.TRANSFER, reason="handoff")
        self._sync_index()

    def pd_snapshot(self) -> PDSnapshot:
        """Every live request as the rules of spec/pd.py read it (``check_roles``); empty
        without roles."""
        return PDSnapshot(()) if self.pd is None else self.pd.snapshot(self._owner.copy())

    def take_decode_steps(self) -> list[DecodeStep]:
        """The in-process decode replicas' steps since the last call, for rule
        ``deflect`` (``check_deflect``); empty without roles."""
        return [] if self.pd is None else self.pd.take_decode_steps()

    # ------------------------------------------------------------------ the rule
    def ownership_violations(self) -> list[str]:
        """The ownership rule (module doc; ref/cluster/ownership.py): every request live
        on a replica is live on that one alone and mapped to it, and the map holds
        nothing else. Empty when it holds."""
        return self._owner.violations(self.supervisor.request_ids())

    # ------------------------------------------------------------------ internals
    def _live(self) -> list[tuple[int, Replica]]:
        return self.supervisor.live()

    def _bury(self, r: int, error: ReplicaDead) -> None:
        self.supervisor.bury(r, error)

    def _on_death(self, r: int, error: ReplicaDead) -> None:
        """Replica ``r`` died: every request it held ends with ``error``, once
        (:meth:`take_failures`; module doc, "Faults")."""
        for rid in self._owner.held_by(r):
            self._forget(rid)
            self._failures[rid] = error
            self.metrics.requests_failed += 1

    def _accept(self, slot: int, fresh: Replica) -> None:
        """A replacement the migration policy can drive (it reads schedulers), and, with
        roles, one that can take its slot's role (the slot keeps it)."""
        if self.migration.enabled:
            _check_policy(self.migration, [fresh])
        if self.pd is not None:
            check_decode_replica(self.pd.roles, self.pd.deflection, slot, fresh)

    def _retire(self, r: int, rep: Replica, fresh: Sequence[RequestOutput]) -> None:
        """Requests whose final output ``fresh`` carries and that replica ``r`` no longer
        holds leave the ownership map (an ``n > 1`` one when its last sample ends)."""
        done = {o.request_id for o in fresh if o.finished}
        if not done:
            return
        live = set(rep.request_ids())
        for rid in done - live:
            if self._owner.get(rid) == r:
                self._forget(rid)

    def _forget(self, request_id: str) -> None:
        """``request_id`` ended: it leaves the ownership map, and the split policy's memory
        of it and its samples (so that memory holds live requests only)."""
        self._owner.forget(request_id)
        if self.pd is not None:
            self.pd.forget(request_id)
        if self._split:
            self._split = {s for s in self._split if s.split(FORK_SEPARATOR, 1)[0] != request_id}

    def _sync_index(self) -> None:
        self.supervisor.sync_index()

    def _new_id(self, request_id: str | None) -> str:
        def draw() -> str:
            self._next_id += 1
            return f"req-{self._next_id - 1}"

        return intake.check_request_id(request_id, lambda rid: rid in self._owner, draw)

    def _token_ids(self, prompt: Prompt) -> list[int]:
        """The prompt as token ids, checked before it is hashed and routed (the replica
        checks it again: the same rules, ``InvalidPrompt``)."""
        return intake.prompt_token_ids(prompt, self._vocab_size, self.replicas[0].encode)
