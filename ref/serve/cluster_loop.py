"""The cluster behind the server: one thread per replica, and the router in front
(docs/CLUSTER.md, "Serving").

:class:`ClusterLoop` offers the app what :class:`~refserve.serve.loop.EngineLoop` offers it
(``submit``, ``abort``, ``shutdown``, the step ring, the tokenizer), over N replicas of
any transport (:class:`~refserve.cluster.replica.Replica`: in process or Ray actors). Each
replica has a :class:`ReplicaLoop`: a thread that owns the replica outright, as the
engine loop owns its engine. Every touch of it (adding, aborting, the migration calls)
is a command run between two of its steps, and it steps on its own, so a slow replica
delays only its own requests, never the others' (the "slow replica" fault). After each
step or command the thread publishes the replica's load figures and applies its new
cache events to the global prefix index, under the front's lock; the router reads those
and never calls a replica.

Routing (``submit``): under the lock, the index's cached prefix per live replica and
their last published load go to the :class:`~refserve.cluster.router.Router`; the request is
then added on the chosen replica's thread. Requests routed at the same moment see the
same figures (the load moves at the next publication): a documented approximation.

Faults: a replica that dies (:class:`~refserve.cluster.errors.ReplicaDead`, from a step, a
command, or the ping an idle one gets every :data:`HEALTH_CHECK_S`) leaves the index and
the router's sight. Each of its requests that has
delivered an output ends with that error, once (the client gets an OpenAI error: 503
``service_unavailable``, or an error event mid-stream; never restarted, so no token is
delivered twice); one that has delivered nothing yet is routed again among the live
replicas and added there, from its prompt (nothing to repeat). Then, if the loop has a
``restart`` factory and the replica has restarts left (``max_restarts`` each), its
thread builds a fresh replica in its place: it rejoins the index from its snapshot (an
empty cache: a resync, never a replay of the dead one's events) and the router sees it
again; a factory that fails uses up a restart too. With every replica dead the server
answers 503 and ``/health`` 503.

Migration (:meth:`ClusterLoop.migrate`) is the one driver's (ref/serve/cluster_migration.py):
the source's thread parks between two steps for the whole move; the driver exports the
ticket (the K/V inline), the destination's thread imports it and takes over the
request's output queue in the same command (the ack); then the source releases it. A
refusal or a failure before the import leaves the request where it was, running.

Roles (docs/DISAGG.md, "Serving"): with ``roles``, ``submit`` places a request with
ref/cluster/disagg.py (``place``: the router among the replicas that prefill, or a
deflection to a decode replica), and a prefill replica's thread, after each step and
before its next, hands off each request that sampled its first token: the same driver,
run from that thread itself (it is the source: nothing else touches its replica
meanwhile), to the decode replica ``choose_decode`` picks; a handoff that fails keeps
the request there. One move at a time, a migration or a handoff (``moving``); a thread
waiting for its turn runs its own commands meanwhile, since the move ahead of it may be
waiting on one of them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from refserve.cluster.disagg import Deflection, Placement, Roles
from refserve.cluster.errors import EventGap, EventMismatch, NoLiveReplica, ReplicaDead
from refserve.cluster.index import GlobalPrefixIndex
from refserve.cluster.pool_check import PoolReport
from refserve.cluster.records import LoadFigures
from refserve.cluster.replica import InProcessReplica, Replica
from refserve.cluster.router import Router, RoutingDecision
from refserve.core.config import SchedulerConfig
from refserve.core.migration_cost import KVMode
from refserve.core.transit import MigrationError
from refserve.engine.llm_engine import RequestOutput
from refserve.engine.migration import MigrationAborted, MigrationReport
from refserve.errors import InvalidArgument, UnknownRequest
from refserve.model.sampler import SamplingParams
from refserve.model.tokenizer import Tokenizer
from refserve.serve.cluster_migration import ParkedSource, hand_over, move
from refserve.serve.cluster_pd import HANDOFF_TIMEOUT_S, Due, Handoffs, KeptReason
from refserve.serve.loop import (
    IDLE_POLL_S,
    STEP_RING,
    EngineFailed,
    OutputSink,
    ServerDraining,
    StepTiming,
    Submission,
    command_for,
    stop_thread,
)
from refserve.serve.metrics import ClusterServeMetrics
from refserve.spec.events import CacheEvent
from refserve.spec.hashing import Namespace
from refserve.values import is_int

T = TypeVar("T")

#: Makes a fresh replica for a slot (its id), to replace a dead one (module doc, "Faults").
ReplicaFactory = Callable[[int], Replica]
#: An idle replica is pinged this often, so that its death is found (and it is replaced)
#: before a request is routed to it; a busy one's shows in its next step.
HEALTH_CHECK_S = 1.0

log = logging.getLogger("refserve.serve")


class ReplicaLoop:
    """One replica in a thread of its own (module doc)."""

    def __init__(self, index: int, replica: Replica, front: ClusterLoop) -> None:
        self.index = index
        self.replica = replica
        self.front = front
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.sinks: dict[str, OutputSink] = {}
        self._stop = threading.Event()
        self.dead: ReplicaDead | None = None
        self._pinged = time.monotonic()
        self.load: LoadFigures = replica.load()
        self.idle_fraction = replica.idle_fraction
        self._thread = threading.Thread(
            target=self._run, name=f"refserve-replica-{index}", daemon=True
        )

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        stop_thread(self._stop, self._thread)

    def run_sync(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on this replica's thread between two of its steps."""
        command, fut = command_for(fn, self._bury_if_dead)
        if self.dead is not None:
            fut.set_exception(self.dead)
        elif self._stop.is_set() or not self.alive:
            fut.set_exception(ServerDraining("the replica loop is stopped"))
        else:
            self._commands.put(command)
        return fut

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        prev_end: float | None = None
        try:
            while not self._stop.is_set():
                if self.dead is not None:
                    if not self._replace():
                        return
                    prev_end = None
                    continue
                block = not self.replica.has_work
                idled = self._run_commands(block=block)
                if idled:
                    prev_end = None
                    self._check_health()
                if self.dead is not None or not self.replica.has_work:
                    continue
                prev_end = self._one_step(prev_end)
        except BaseException as e:  # the loop itself broke: fail its requests loudly
            log.exception("replica loop %d failed", self.index)
            self._fail_all(EngineFailed(f"replica {self.index} loop failed: {e}"))
            raise

    def _run_commands(self, *, block: bool) -> bool:
        idled = False
        if block:
            idled = True
            try:
                self._commands.get(timeout=IDLE_POLL_S)()
            except queue.Empty:
                return True
            self._publish(())
        ran = False
        while self.dead is None:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            command()
            ran = True
        if ran:
            self._publish(())
        return idled

    def _one_step(self, prev_end: float | None) -> float:
        start = time.perf_counter()
        try:
            outputs = self.replica.step()
        except ReplicaDead as e:
            self._died(e)
            return time.perf_counter()
        except Exception as e:
            # As the engine loop: a failed step was rolled back; its requests end with the
            # reason and the replica goes on.
            log.exception("replica %d step failed", self.index)
            live = list(self.sinks)
            self._fail_all(EngineFailed(f"replica {self.index} step failed: {e}"))
            for rid in live:
                with contextlib.suppress(UnknownRequest, ReplicaDead):
                    self.replica.abort(rid)
            return time.perf_counter()
        end = time.perf_counter()
        prefill, decodes = _step_tokens(self.replica)
        self.front.timings.append(
            StepTiming(
                index=next(self.front.step_counter),
                start_s=start,
                end_s=end,
                num_prefill_tokens=prefill,
                num_decodes=decodes,
                num_outputs=len(outputs),
                gap_ms=None if prev_end is None else (start - prev_end) * 1e3,
            )
        )
        self._dispatch(outputs)
        self._publish(outputs)
        if self.front.handoffs.hands_off(self.index):
            self._hand_off(outputs)
        # The next gap counts from the step's end: handing its outputs over (and the
        # figures) is the loop's time between two steps, not the step's.
        return end

    def _hand_off(self, outputs: Sequence[RequestOutput]) -> None:
        """Each request of this prefill replica that sampled its first token in the step
        leaves it now, before the next step (module doc, "Roles")."""
        due = self.front.handoffs.due(outputs, self.sinks)
        for d in due:
            if self.dead is not None:  # its requests were ended with its death
                return
            self._hand_off_one(d)
        if due:
            self._publish(())

    def _hand_off_one(self, d: Due) -> None:
        front, pd = self.front, self.front.handoffs
        decision = pd.choose(d, self.index, front.live_loads())
        if decision.replica is None:
            pd.kept(d.request_id, KeptReason.NO_DECODE)
            return
        b = front.loops[decision.replica]
        source = ParkedSource(self)

        def adopted() -> None:  # on b's thread, with the import
            front.adopted(d.request_id, b.index)
            pd.taken(d.request_id)

        with self._moving():
            if self.dead is not None or d.request_id not in self.sinks:
                return  # ended, or moved away, while it waited for its turn
            try:
                report = hand_over(
                    source,
                    b,
                    d.request_id,
                    kv=KVMode.TRANSFER,
                    hit=functools.partial(front.prefix_hit, b.index),
                    adopted=adopted,
                    timeout_s=pd.timeout_s,
                )
            except (MigrationError, ReplicaDead, InvalidArgument, UnknownRequest) as e:
                log.warning("replica %d keeps %r: handoff failed: %s", self.index, d.request_id, e)
                pd.kept(d.request_id, KeptReason.FAILED)
            else:
                pd.handed_off(b.index, report.kv_bytes)
        if source.death is not None:  # this replica died in the move
            self._died(source.death)

    @contextlib.contextmanager
    def _moving(self) -> Iterator[None]:
        """The cluster's one move at a time, this thread's commands run while it waits:
        the move ahead of it may be waiting on one (an import here, a park)."""
        while not self.front.moving.acquire(timeout=IDLE_POLL_S):
            self._run_commands(block=False)
        try:
            yield
        finally:
            self.front.moving.release()

    def _publish(self, outputs: Sequence[RequestOutput]) -> None:
        """The replica's figures and new cache events to the front (module doc)."""
        if self.dead is not None:
            return
        try:
            self.load = load = self.replica.load()
            self.idle_fraction = self.replica.idle_fraction
            events = self.replica.drain_cache_events()
            self.front.apply_events(self, events)
        except ReplicaDead as e:
            self._died(e)
            return
        metrics = self.front.metrics
        if metrics is not None:
            kv = load.kv_blocks_used / max(1, load.kv_blocks_total)
            metrics.after_step(self.index, load.num_running, load.num_waiting, kv, outputs)

    def _dispatch(self, outputs: Sequence[RequestOutput]) -> None:
        for o in outputs:
            sink = self.sinks.get(o.request_id)
            if sink is None:
                continue
            sink.put(o)
            sink.delivered += 1
            if o.finished:
                sink.finished += 1
                if sink.finished >= sink.n:
                    del self.sinks[o.request_id]
                    self.front.request_ended(o.request_id)

    def _check_health(self) -> None:
        """Ping the idle replica every :data:`HEALTH_CHECK_S` (module doc, "Faults")."""
        now = time.monotonic()
        if now - self._pinged < HEALTH_CHECK_S:
            return
        self._pinged = now
        try:
            self.replica.ping()
        except ReplicaDead as e:
            self._died(e)

    def _replace(self) -> bool:
        """The dead replica replaced by a fresh one from the front's factory (module
        doc, "Faults"), tried while it has restarts left; True once it serves again."""
        while not self._stop.is_set():
            fresh = self.front.replacement(self.index)
            if fresh is None:
                return False
            if self._stop.is_set():
                return False
            try:
                self.load = fresh.load()
                self.idle_fraction = fresh.idle_fraction
                self.front.rejoin(self, fresh)
            except ReplicaDead as e:  # died again before it served: the next restart
                log.error("replica %d died while rejoining: %s", self.index, e)
                continue
            return True
        return False

    def _bury_if_dead(self, error: BaseException) -> None:
        # Buried before the caller sees the error: a caller that routes again skips it.
        if isinstance(error, ReplicaDead):
            self._died(error)

    def _died(self, error: ReplicaDead) -> None:
        if self.dead is not None:
            return
        log.error("replica %d died: %s", self.index, error)
        self.dead = error
        front = self.front
        front.replica_died(self)  # out of the router's sight before any reroute
        fresh = {rid: sink for rid, sink in self.sinks.items() if sink.delivered == 0}
        for rid in fresh:
            del self.sinks[rid]
        if front.metrics is not None:
            front.metrics.requests_failed(self.index, len(self.sinks))
        self._fail_all(error)
        for rid, sink in fresh.items():
            front.reroute(rid, sink, error, self.index)

    def _fail_all(self, error: BaseException) -> None:
        for rid, sink in list(self.sinks.items()):
            sink.put(error)
            self.front.request_ended(rid)
        self.sinks.clear()


class ClusterLoop:
    """The replicas' loops and the router in front (module doc). ``tokenizer``,
    ``max_model_len`` and ``scheduler_config`` are what the app shows and checks (the
    replicas run one model; the first replica's configuration is shown). ``restart``
    makes a fresh replica for a slot, to replace a dead one, at most ``max_restarts``
    times per slot (module doc, "Faults"; 0, the default: a dead replica stays dead).
    ``roles`` (default: every replica colocated) and ``deflection`` disaggregate prefill
    and decode (module doc, "Roles"); a prefill replica waits ``handoff_timeout_s`` for a
    decode replica's import."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        router: Router,
        *,
        tokenizer: Tokenizer,
        max_model_len: int,
        scheduler_config: SchedulerConfig,
        metrics: ClusterServeMetrics | None = None,
        torch_threads: int | None = None,
        restart: ReplicaFactory | None = None,
        max_restarts: int = 0,
        roles: Roles | None = None,
        deflection: Deflection | None = None,
        handoff_timeout_s: float = HANDOFF_TIMEOUT_S,
    ) -> None:
        reps = list(replicas)
        if not reps:
            raise InvalidArgument("ClusterLoop: needs at least one replica")
        if restart is not None and not callable(restart):
            raise InvalidArgument(
                f"ClusterLoop: restart must make a replica for a slot, got {restart!r}"
            )
        if not is_int(max_restarts) or max_restarts < 0:
            raise InvalidArgument(
                f"ClusterLoop: max_restarts must be an int >= 0, got {max_restarts!r}"
            )
        if max_restarts and restart is None:
            raise InvalidArgument(
                "ClusterLoop: max_restarts > 0 needs a restart factory to make the replicas"
            )
        identity = reps[0].identity
        for i, rep in enumerate(reps):
            if rep.identity != identity:
                raise InvalidArgument(f"ClusterLoop: replica {i} runs another model")
        self.handoffs = Handoffs(
            roles, deflection, len(reps), metrics=metrics, timeout_s=handoff_timeout_s
        )
        self.router = router
        self.identity = identity
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.scheduler_config = scheduler_config
        self.metrics = metrics
        self.torch_threads = torch_threads
        self.timings: deque[StepTiming] = deque(maxlen=STEP_RING)
        self.step_counter = itertools.count()
        self._lock = threading.Lock()
        self.moving = threading.Lock()  # one move at a time: a migration or a handoff
        self.index = GlobalPrefixIndex()
        self._owner: dict[str, int] = {}
        self._prompts: dict[str, list[int]] = {}
        self._params: dict[str, SamplingParams] = {}  # to add a request again (a reroute)
        self._restart = restart
        self.max_restarts = max_restarts
        self.restarts: list[int] = [0] * len(reps)  # per replica: replacements tried
        self.decisions: deque[RoutingDecision] = deque(maxlen=4096)
        self._admitting = True
        self._started = False
        self._threads_before: int | None = None
        self.loops: list[ReplicaLoop] = []
        for i, rep in enumerate(reps):
            self.index.add_replica(i, rep.block_size, rep.cache_snapshot())
            rep.drain_cache_events()  # reflected in the snapshot
            self.loops.append(ReplicaLoop(i, rep, self))
            if metrics is not None:
                metrics.replica_up(i, True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.torch_threads is not None:  # process-wide: put back at shutdown
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(self.torch_threads)
        for lp in self.loops:
            lp.start()
        self._started = True

    @property
    def alive(self) -> bool:
        """Some replica serves (``/health``)."""
        return any(lp.alive and lp.dead is None for lp in self.loops)

    @property
    def num_in_flight(self) -> int:
        return sum(len(lp.sinks) for lp in self.loops)

    def owners(self) -> dict[str, int]:
        """A copy of the map: request in flight -> its replica."""
        with self._lock:
            return dict(self._owner)

    def stop_admitting(self) -> None:
        self._admitting = False

    def shutdown(self, timeout_s: float) -> None:
        """Drain every replica: stop admitting, let in-flight requests finish for up to
        ``timeout_s``, abort the rest, stop the threads."""
        self.stop_admitting()
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight and self.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        pending = []
        for lp in self.loops:
            if lp.alive and lp.dead is None:
                rids = list(lp.sinks)
                pending.append(lp.run_sync(functools.partial(_abort_each, lp, rids)))
        for fut in pending:
            with contextlib.suppress(Exception):
                fut.result(timeout=5.0)
        end = time.monotonic() + 2.0
        while self.num_in_flight and self.alive and time.monotonic() < end:
            time.sleep(0.01)
        for lp in self.loops:
            lp.stop()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    # ------------------------------------------------------------------ requests
    async def submit(
        self, prompt: Sequence[int], params: SamplingParams, request_id: str
    ) -> Submission:
        """Route the request and add it on the chosen replica's thread; its typed error
        if the replica refuses it (nothing else changes)."""
        if not self._admitting:
            raise ServerDraining("the server is shutting down")
        ids = list(prompt)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        sink = OutputSink(loop, q, params.n)
        while True:  # a replica found dead here: routed again among the others
            placement = self._route(request_id, ids)
            lp = self.loops[placement.replica]
            try:
                added = await asyncio.wrap_future(
                    lp.run_sync(self._adder(lp, request_id, ids, params, sink))
                )
            except ReplicaDead:
                continue
            except BaseException:
                self.handoffs.forget(request_id)
                raise
            break
        self._count_routed(placement)
        return Submission(request_id, q, params.n, added)

    def _count_routed(self, placement: Placement) -> None:
        if self.metrics is None:
            return
        routing = placement.routing
        self.metrics.routed(
            routing.policy.value,
            placement.replica,
            routing.num_prompt_tokens,
            placement.prefix_hit_tokens,
        )
        if placement.deflected:
            self.metrics.deflected(placement.replica)

    def _adder(
        self,
        lp: ReplicaLoop,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        sink: OutputSink,
    ) -> Callable[[], float]:
        """The command that adds a routed request on ``lp``'s thread (its result: when)."""

        def add() -> float:
            if not self._admitting:
                raise ServerDraining("the server is shutting down")
            lp.replica.add_request(ids, params, request_id)
            lp.sinks[request_id] = sink  # before any step: no output can be missed
            with self._lock:
                self._owner[request_id] = lp.index
                self._prompts[request_id] = ids
                self._params[request_id] = params
            return time.perf_counter()

        return add

    def _route(self, request_id: str, ids: list[int]) -> Placement:
        """Where the request goes (the router's choice among the replicas that prefill,
        or a deflection), booked before it is added there."""
        with self._lock:
            live = self._live_loads()
            if not live:
                raise NoLiveReplica("every replica of the cluster is dead")
            hits = {r: h for r, h in self.index.longest_prefix(ids).items() if r in live}
            placement = self.handoffs.place(self.router, request_id, ids, live, hits)
            # At routing, not after the add: concurrent submits must see the cursor move.
            self.router.accepted(placement.routing)
            self.decisions.append(placement.routing)
            self.handoffs.placed(placement, len(ids))
            return placement

    def _live_loads(self) -> dict[int, LoadFigures]:
        return {lp.index: lp.load for lp in self.loops if lp.dead is None and lp.alive}

    def live_loads(self) -> dict[int, LoadFigures]:
        """The live replicas' last published load figures."""
        with self._lock:
            return self._live_loads()

    def abort(self, request_id: str, *, follow: int = 2) -> None:
        """Abort a request if it is still live (a client went away); non-blocking. If it
        migrated away while the abort waited on its old replica's thread, the abort
        follows it to the new one (up to ``follow`` times)."""
        with self._lock:
            r = self._owner.get(request_id)
        if r is None:
            return
        lp = self.loops[r]

        def abort() -> None:
            try:
                lp.replica.abort(request_id)
            except UnknownRequest:
                with self._lock:
                    now = self._owner.get(request_id)
                if now is not None and now != lp.index and follow > 0:
                    self.abort(request_id, follow=follow - 1)

        lp.run_sync(abort)  # a dead or stopped replica: the future holds the error

    # ------------------------------------------------------------------ checks and faults
    def pool_reports(self, timeout_s: float = 30.0) -> list[ReplicaPools]:
        """Each replica's pools held to the spec, read on its own thread between two
        steps (``/debug/pools``); a dead or stopped replica has no report."""
        pending: list[tuple[ReplicaLoop, concurrent.futures.Future[PoolReport] | None]] = []
        for lp in self.loops:
            live = lp.alive and lp.dead is None
            # The replica read on its thread, not here: a restart may replace it meanwhile.
            read = functools.partial(_pool_report, lp)
            pending.append((lp, lp.run_sync(read) if live else None))
        out = []
        for lp, fut in pending:
            report = None
            if fut is not None:
                with contextlib.suppress(ReplicaDead, ServerDraining):
                    report = fut.result(timeout=timeout_s)
            out.append(ReplicaPools(lp.index, report is not None, self.restarts[lp.index], report))
        return out

    def kill_replica(self, replica: int) -> None:
        """Kill replica ``replica`` as a crash would (a soak's fault; ``/debug/replicas/
        {i}/kill`` with ``--fault-endpoints``): a Ray actor is killed, an in-process
        engine dropped; its thread finds it dead between two steps and handles it as any
        death (module doc, "Faults"), a restart included. Non-blocking."""
        if not is_int(replica):
            raise InvalidArgument(f"kill_replica: no replica {replica!r}")
        if not 0 <= replica < len(self.loops):
            raise InvalidArgument(f"kill_replica: no replica {replica} (of {len(self.loops)})")
        lp = self.loops[replica]

        def crash() -> None:
            kill = getattr(lp.replica, "kill", None)  # a Ray actor: killed for real
            if callable(kill):
                kill()
            raise ReplicaDead(replica, "killed on request (a fault injected)")

        lp.run_sync(crash)  # the future holds the error; _bury_if_dead has buried it

    # ------------------------------------------------------------------ migration
    def migrate(
        self, request_id: str, to: int, *, kv: KVMode | str = KVMode.AUTO, timeout_s: float = 30.0
    ) -> MigrationReport:
        """Move a request in flight to replica ``to`` (module doc); blocking, from any
        thread but a replica's. One migration at a time."""
        with self.moving:
            with self._lock:
                src = self._owner.get(request_id)
            if src is None:
                raise UnknownRequest(request_id, "migrate")
            if not is_int(to) or not 0 <= to < len(self.loops):
                raise InvalidArgument(f"migrate: no replica {to!r}")
            if to == src:
                raise InvalidArgument(f"migrate: {request_id!r} is already on replica {to}")
            a, b = self.loops[src], self.loops[to]
            if b.dead is not None:
                raise b.dead
            t0 = time.perf_counter()
            try:
                report = move(
                    a,
                    b,
                    request_id,
                    kv=kv,
                    hit=functools.partial(self.prefix_hit, b.index),
                    adopted=functools.partial(self.adopted, request_id, b.index),
                    timeout_s=timeout_s,
                )
            except (MigrationError, ReplicaDead, InvalidArgument) as e:
                if self.metrics is not None:
                    self.metrics.migrated(False)
                if isinstance(e, MigrationAborted) and isinstance(e.cause, ReplicaDead):
                    raise e.cause from e
                raise
            elapsed = time.perf_counter() - t0
            if self.metrics is not None:
                self.metrics.migrated(True, report.kv_bytes, elapsed)
            return replace(report, elapsed_ms=elapsed * 1e3)

    def prefix_hit(self, replica: int, token_ids: Sequence[int], namespace: Namespace) -> int:
        """The tokens ``replica`` caches of ``token_ids`` (the index, under the lock)."""
        with self._lock:
            return self.index.longest_prefix(token_ids, namespace).get(replica, 0)

    def adopted(self, request_id: str, replica: int) -> None:
        """``replica`` owns ``request_id`` now (a move's import)."""
        with self._lock:
            self._owner[request_id] = replica

    # ------------------------------------------------------------------ from the threads
    # What a replica's loop tells the front (its cache events, an end, a death, a
    # restart): the front's state changes only through these, under its lock.
    def apply_events(self, lp: ReplicaLoop, events: Sequence[CacheEvent]) -> None:
        """``lp``'s new cache events into the index; a resync from its snapshot when they
        do not apply (a gap, a mismatch)."""
        with self._lock:
            try:
                self.index.apply(lp.index, events)
            except (EventGap, EventMismatch):
                self.index.resync(lp.index, lp.replica.cache_snapshot())

    def request_ended(self, request_id: str) -> None:
        """``request_id`` ended (finished, failed or moved off a dead replica's books)."""
        with self._lock:
            self._owner.pop(request_id, None)
            self._prompts.pop(request_id, None)
            self._params.pop(request_id, None)
        self.handoffs.forget(request_id)

    def replica_died(self, lp: ReplicaLoop) -> None:
        """``lp``'s replica died: out of the index, so the router no longer sees it."""
        with self._lock:
            if lp.index in self.index.replicas:
                self.index.remove_replica(lp.index)
        if self.metrics is not None:
            self.metrics.replica_died(lp.index)

    def reroute(self, request_id: str, sink: OutputSink, error: ReplicaDead, dead: int) -> None:
        """A request of the dead replica ``dead`` that delivered nothing: routed again
        among the live replicas and added there (module doc, "Faults"). Where it cannot
        go (no live replica, a refusal, a drain) it ends with ``error``, once; it never
        runs twice (it went with the dead replica's engine)."""
        with self._lock:
            ids = self._prompts.get(request_id)
            params = self._params.get(request_id)

        def fail() -> None:
            self._end(request_id, sink, error)
            if self.metrics is not None:
                self.metrics.requests_failed(dead, 1)

        if ids is None or params is None or not self._admitting:
            fail()
            return
        try:
            placement = self._route(request_id, ids)
        except NoLiveReplica:
            fail()
            return
        lp = self.loops[placement.replica]
        with self._lock:  # an abort from now on queues behind the add there
            self._owner[request_id] = lp.index

        def added(f: concurrent.futures.Future[float]) -> None:
            if f.exception() is not None:  # refused there, or that one died too
                fail()
            elif self.metrics is not None:
                self.metrics.request_restarted(dead)
                self._count_routed(placement)

        lp.run_sync(self._adder(lp, request_id, ids, params, sink)).add_done_callback(added)

    def _end(self, request_id: str, sink: OutputSink, error: BaseException) -> None:
        sink.put(error)
        self.request_ended(request_id)

    def replacement(self, replica: int) -> Replica | None:
        """A fresh replica for slot ``replica`` from the factory, while it has restarts
        left (each try counts, a failed one too); None once it has none."""
        while self._restart is not None and self.restarts[replica] < self.max_restarts:
            self.restarts[replica] += 1
            try:
                fresh = self._restart(replica)
                if not isinstance(fresh, Replica) or fresh.identity != self.identity:
                    raise InvalidArgument(f"the factory made {fresh!r}, not a replica of the model")
            except Exception:  # logged; the next try, if any, is another restart
                log.exception("replica %d: restart %d failed", replica, self.restarts[replica])
                continue
            return fresh
        return None

    def rejoin(self, lp: ReplicaLoop, fresh: Replica) -> None:
        """``fresh`` serves in ``lp``'s slot: in the index from its snapshot (its cache
        as it is, empty), then in the router's sight."""
        snapshot = fresh.cache_snapshot()
        fresh.drain_cache_events()  # reflected in the snapshot
        with self._lock:
            self.index.add_replica(lp.index, fresh.block_size, snapshot)
            lp.replica = fresh
            lp.dead = None
        log.warning(
            "replica %d restarted (%d of %d)", lp.index, self.restarts[lp.index], self.max_restarts
        )
        if self.metrics is not None:
            self.metrics.replica_restarted(lp.index)


@dataclass(frozen=True)
class ReplicaPools:
    """One replica slot in :meth:`ClusterLoop.pool_reports`: its pools' report, None
    when it is dead or stopped; ``restarts``, the replacements tried for the slot."""

    replica: int
    alive: bool
    restarts: int
    report: PoolReport | None


def _step_tokens(replica: Replica) -> tuple[int, int]:
    """The prefill tokens and decodes of the replica's last step, for the step ring
    (``/debug/steps``, what ``bench-serve --fit`` reads); the in-process engine's record
    is dropped once read (a server runs for days), a Ray actor drops its own."""
    if isinstance(replica, InProcessReplica):
        records = replica.engine.steps
        last = (records[-1].num_prefill_tokens, records[-1].num_decodes) if records else (0, 0)
        records.clear()
        return last
    figures = getattr(replica, "step_tokens", None)
    if isinstance(figures, tuple) and len(figures) == 2:
        return int(figures[0]), int(figures[1])
    return 0, 0


def _pool_report(lp: ReplicaLoop) -> PoolReport:
    return lp.replica.pool_report()


def _abort_each(lp: ReplicaLoop, request_ids: Sequence[str]) -> None:
    for rid in request_ids:
        with contextlib.suppress(UnknownRequest):
            lp.replica.abort(rid)
