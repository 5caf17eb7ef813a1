"""One replica of the cluster behind one interface, whatever carries the calls
(docs/CLUSTER.md, "Replicas").

:class:`Replica` is what the router and the cluster need of an engine: add a request,
step, abort, the outputs, the load figures the policies compare
(:class:`~refserve.cluster.records.LoadFigures`),
its cost model, its cache events (and a snapshot to resync from), and the three calls of
a migration (export a ticket, import one, release the source). Everything that crosses
it is a plain record (token ids, :class:`~refserve.model.sampler.SamplingParams`,
:class:`~refserve.engine.llm_engine.RequestOutput`, :class:`LoadFigures`, the
``refserve.spec.events`` records, :class:`~refserve.engine.ticket.MigrationTicket`, whose bytes
encoding is stable), so a transport to an engine in another process (Ray actors: not
built yet) implements the same protocol. :class:`InProcessReplica`, the default, calls
an :class:`LLMEngine` in this process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from refserve.cluster.index import CacheSnapshot
from refserve.cluster.pool_check import PoolReport, pool_report
from refserve.cluster.records import LoadFigures
from refserve.core.cost import StepCost
from refserve.core.migration_cost import KVMode
from refserve.core.scheduler import Scheduler
from refserve.engine import migration
from refserve.engine.llm_engine import LLMEngine, RequestOutput
from refserve.engine.ticket import MigrationTicket, ModelIdentity
from refserve.errors import InvalidArgument
from refserve.model.sampler import SamplingParams
from refserve.spec.events import CacheEvent
from refserve.spec.snapshot import RequestStatus

_QUEUED = frozenset({RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED})


@runtime_checkable
class Replica(Protocol):
    """An engine replica as the cluster drives it (module doc)."""

    @property
    def block_size(self) -> int: ...

    @property
    def identity(self) -> ModelIdentity:
        """The model it runs (replicas of one cluster must agree)."""
        ...

    def encode(self, text: str) -> list[int]:
        """The prompt's token ids as the engine's tokenizer makes them."""
        ...

    def add_request(
        self, token_ids: Sequence[int], params: SamplingParams, request_id: str
    ) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    @property
    def has_work(self) -> bool:
        """A step can make progress (runnable requests, or outputs held)."""
        ...

    def request_ids(self) -> tuple[str, ...]:
        """The requests live on this replica."""
        ...

    def ping(self) -> None:
        """Reach the engine and come back: raises ``ReplicaDead`` if it is gone (how an
        idle replica's death is found; a busy one's shows in its next step)."""
        ...

    def load(self) -> LoadFigures: ...

    def prefix_hit_tokens(self, token_ids: Sequence[int]) -> int:
        """The replica's own prefix-cache lookup (what the global index predicts)."""
        ...

    def drain_cache_events(self) -> list[CacheEvent]:
        """The cache events published since the last call, in order."""
        ...

    def cache_snapshot(self) -> CacheSnapshot:
        """The cache entries now, and the number of the next event (to resync from)."""
        ...

    @property
    def idle_fraction(self) -> float: ...

    def export_request(
        self, request_id: str, *, kv: KVMode | str, hit_tokens: int, idle: float
    ) -> MigrationTicket: ...

    def import_request(self, ticket: MigrationTicket) -> list[str]: ...

    def release_request(self, request_id: str) -> None: ...

    def pool_report(self) -> PoolReport:
        """The engine's pools held to the spec, between two steps
        (ref/cluster/pool_check.py: ``/debug/pools``, a soak's leak check)."""
        ...


def load_figures(sched: Scheduler, cost: StepCost) -> LoadFigures:
    """A scheduler's :class:`LoadFigures` at a step boundary (what a replica reports;
    the cluster simulator, ref/cluster/sim.py, reads its schedulers through this too)."""
    config = sched.config
    waiting = decoding = paused = backlog = 0
    for r in sched.requests.values():
        status = r.status
        if status is RequestStatus.DECODING:
            decoding += 1
        elif status is RequestStatus.WAITING_TOOL:
            paused += 1
        else:
            backlog += r.num_tokens - r.num_computed_tokens
            waiting += status in _QUEUED
    return LoadFigures(
        num_waiting=waiting,
        num_running=len(sched.running),
        num_decoding=decoding,
        num_paused=paused,
        prefill_backlog_tokens=backlog,
        kv_blocks_used=sched.pool.num_used_blocks,
        kv_blocks_total=config.num_blocks,
        max_num_seqs=config.max_num_seqs,
        token_budget=config.max_num_batched_tokens,
        block_size=config.block_size,
        cost=cost,
    )


class InProcessReplica:
    """A :class:`Replica` over an :class:`LLMEngine` in this process (the default).

    The engine must publish its cache events (``SchedulerConfig(cache_events=True)``).
    Its cost model is ``cost``, else the scheduler's ``step_cost``, else
    :class:`StepCost`'s defaults (``2 + 0.5P + D``).
    """

    def __init__(self, engine: LLMEngine, *, cost: StepCost | None = None) -> None:
        if not isinstance(engine, LLMEngine):
            raise InvalidArgument(
                f"InProcessReplica needs an LLMEngine, got {type(engine).__name__}"
            )
        config = engine.scheduler.config
        if not config.cache_events:
            raise InvalidArgument(
                "InProcessReplica: the engine publishes no cache events; build it with "
                "SchedulerConfig(cache_events=True)"
            )
        if cost is not None and not isinstance(cost, StepCost):
            raise InvalidArgument(f"cost must be a StepCost, got {type(cost).__name__}")
        self.engine = engine
        self.cost = cost or config.step_cost or StepCost()

    @property
    def block_size(self) -> int:
        return self.engine.scheduler.config.block_size

    @property
    def identity(self) -> ModelIdentity:
        return migration.model_identity(self.engine)

    def encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special_tokens=True)

    def add_request(
        self, token_ids: Sequence[int], params: SamplingParams, request_id: str
    ) -> None:
        self.engine.add_request(list(token_ids), params, request_id=request_id)

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.engine.has_runnable

    def request_ids(self) -> tuple[str, ...]:
        return self.engine.request_ids

    def ping(self) -> None:
        """In this process: alive as long as the caller is."""

    def load(self) -> LoadFigures:
        return load_figures(self.engine.scheduler, self.cost)

    def prefix_hit_tokens(self, token_ids: Sequence[int]) -> int:
        return self.engine.prefix_hit_tokens(token_ids)

    def drain_cache_events(self) -> list[CacheEvent]:
        return self.engine.cache_events()

    def cache_snapshot(self) -> CacheSnapshot:
        pool = self.engine.scheduler.pool
        log = pool.cache_events
        assert log is not None  # checked at construction
        entries = tuple((e.key, e.block_id) for e in pool.snapshot().cache_entries)
        return CacheSnapshot(log.next_seq, entries)

    @property
    def idle_fraction(self) -> float:
        return self.engine.idle_fraction

    def export_request(
        self, request_id: str, *, kv: KVMode | str, hit_tokens: int, idle: float
    ) -> MigrationTicket:
        return self.engine.export_request(request_id, kv=kv, hit_tokens=hit_tokens, idle=idle)

    def import_request(self, ticket: MigrationTicket) -> list[str]:
        return self.engine.import_request(ticket)

    def release_request(self, request_id: str) -> None:
        self.engine.release_request(request_id)

    def pool_report(self) -> PoolReport:
        return pool_report(self.engine)
