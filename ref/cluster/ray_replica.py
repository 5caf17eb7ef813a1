"""The Ray transport: one engine per Ray actor behind the :class:`Replica` protocol
(docs/CLUSTER.md, "Transports").

Ray is an optional extra (``pip install -e '.[cluster]'``, pinned; ``make cluster-deps``)
and is imported only when a Ray replica is made, so the default in-process path needs
none of it.

What crosses the process boundary is plain records, never an engine object: token ids,
:class:`~refserve.model.sampler.SamplingParams`, :class:`~refserve.engine.llm_engine.RequestOutput`,
:class:`ReplicaReport` (the load figures, the new cache events, the live request ids),
a migration ticket as its stable bytes (``MigrationTicket.to_bytes``, the K/V inline), and
an error as :class:`ErrorRecord` (its class name, ``args`` and attributes), rebuilt here
as the same typed error. Every call that changes the engine answers the replica's report
with its result, so reading the load, the live ids or the new events costs no round trip:
:class:`RayReplica` answers them from the last report, which is exact because the actor
changes only through calls made by this handle.

Faults: a call to an actor that died (killed, its process gone) raises
:class:`~refserve.cluster.errors.ReplicaDead`, then and on every later call; the cluster ends
that replica's requests with it (ref/cluster/cluster.py, "Faults"). So does a call the
actor does not answer within ``call_timeout_s`` (a hung replica): the actor is killed
first, so a late answer cannot change anything after its requests have ended.
"""

from __future__ import annotations

import importlib
import ipaddress
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from refserve.cluster.errors import ClusterError, ReplicaDead
from refserve.cluster.index import CacheSnapshot
from refserve.cluster.pool_check import PoolReport
from refserve.cluster.records import LoadFigures
from refserve.cluster.replica import InProcessReplica
from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.migration_cost import KVMode
from refserve.engine.llm_engine import LLMEngine, RequestOutput
from refserve.engine.ticket import MigrationTicket, ModelIdentity
from refserve.errors import InvalidArgument
from refserve.model.sampler import SamplingParams
from refserve.spec.events import CacheEvent
from refserve.values import is_int, is_number

T = TypeVar("T")

#: The CPUs a local Ray instance started here is given (the actors reserve none: see
#: :func:`start_ray`).
RAY_NUM_CPUS = 2
#: How long a call waits for its actor's answer before the replica counts as dead
#: (a step of a real model on a CPU can take seconds; none of the tiny model's, one).
CALL_TIMEOUT_S = 120.0
#: Ray's switch for a node that is no cluster member: "0" makes its node address the
#: loopback one (what Ray does on macOS and Windows), and every service Ray starts for it
#: (GCS, raylet, object manager, the agents, each worker's and the driver's gRPC server,
#: the autoscaler's metrics) binds that address. Ray reads it once, at its import: see
#: :func:`_ray`. On Linux Ray otherwise takes the machine's external address, even from
#: ``_node_ip_address="127.0.0.1"`` (it resolves a loopback address to the external one),
#: and binds its gRPC servers to every interface.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: The repository root: Ray's worker processes import ``ref`` from here, the same code
#: as the driver (an installed copy elsewhere would be another version).
_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True)
class ReplicaReport:
    """The replica's state after a call: what :class:`RayReplica` answers locally;
    ``step_tokens`` are the prefill tokens and decodes of the actor's last step."""

    load: LoadFigures
    has_work: bool
    request_ids: tuple[str, ...]
    idle_fraction: float
    events: tuple[CacheEvent, ...]
    step_tokens: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class ErrorRecord:
    """A typed error raised in the actor, as a plain record: rebuilt on this side as the
    same class (:meth:`rebuild`), with its message and attributes."""

    module: str
    name: str
    args: tuple[Any, ...]
    attrs: dict[str, Any]

    @staticmethod
    def of(e: BaseException) -> ErrorRecord:
        cls = type(e)
        attrs = {k: v for k, v in vars(e).items() if not k.startswith("_")}
        return ErrorRecord(cls.__module__, cls.__qualname__, tuple(e.args), attrs)

    def rebuild(self) -> BaseException:
        """The error as raised, if its class is the project's (``refserve``) or a
        builtin; else a :class:`ClusterError` naming it (no arbitrary import)."""
        top = self.module.split(".")[0]
        cls: object = None
        if top in ("refserve", "builtins"):
            cls = getattr(importlib.import_module(self.module), self.name, None)
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            return ClusterError(f"{self.module}.{self.name}: {self.args}")
        err = cls.__new__(cls)
        Exception.__init__(err, *self.args)
        err.__dict__.update(self.attrs)
        return err


class EngineActor:
    """One :class:`LLMEngine` inside a Ray actor (module doc). Made by :func:`ray_replicas`
    through ``ray.remote``; each method answers plain records."""

    def __init__(
        self,
        model: str,
        scheduler_config: SchedulerConfig,
        engine_kwargs: dict[str, Any],
        torch_threads: int | None,
    ) -> None:
        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)
        cfg = replace(scheduler_config, cache_events=True)
        engine = LLMEngine(model, scheduler_config=cfg, **engine_kwargs)
        self._rep = InProcessReplica(engine)

    def _report(self) -> ReplicaReport:
        rep = self._rep
        # The engine keeps every StepRecord for in-process callers; an actor runs for days.
        records = rep.engine.steps
        last = (records[-1].num_prefill_tokens, records[-1].num_decodes) if records else (0, 0)
        records.clear()
        return ReplicaReport(
            rep.load(),
            rep.has_work,
            rep.request_ids(),
            rep.idle_fraction,
            tuple(rep.drain_cache_events()),
            last,
        )

    def _call(self, fn: Callable[[], T]) -> tuple[T | None, ErrorRecord | None, ReplicaReport]:
        try:
            out: T | None = fn()
            err = None
        except Exception as e:  # a typed refusal: travels as a record, raised on the driver
            out, err = None, ErrorRecord.of(e)
        return out, err, self._report()

    def describe(self) -> dict[str, Any]:
        e = self._rep.engine
        return {
            "identity": self._rep.identity,
            "config": e.scheduler.config,
            "max_model_len": e.max_model_len,
            "pid": os.getpid(),
        }

    def report(self) -> tuple[None, None, ReplicaReport]:
        return None, None, self._report()

    def encode(self, text: str) -> list[int]:
        return self._rep.encode(text)

    def add_request(
        self, token_ids: list[int], params: SamplingParams, request_id: str
    ) -> tuple[None, ErrorRecord | None, ReplicaReport]:
        return self._call(lambda: self._rep.add_request(token_ids, params, request_id))

    def step(self) -> tuple[list[RequestOutput] | None, ErrorRecord | None, ReplicaReport]:
        return self._call(self._rep.step)

    def abort(self, request_id: str) -> tuple[None, ErrorRecord | None, ReplicaReport]:
        return self._call(lambda: self._rep.abort(request_id))

    def prefix_hit_tokens(self, token_ids: list[int]) -> int:
        return self._rep.prefix_hit_tokens(token_ids)

    def cache_snapshot(self) -> CacheSnapshot:
        return self._rep.cache_snapshot()

    def export_request(
        self, request_id: str, kv: str, hit_tokens: int, idle: float
    ) -> tuple[bytes | None, ErrorRecord | None, ReplicaReport]:
        def export() -> bytes:
            ticket = self._rep.export_request(request_id, kv=kv, hit_tokens=hit_tokens, idle=idle)
            return ticket.to_bytes()

        return self._call(export)

    def import_request(
        self, blob: bytes
    ) -> tuple[list[str] | None, ErrorRecord | None, ReplicaReport]:
        return self._call(lambda: self._rep.import_request(MigrationTicket.from_bytes(blob)))

    def release_request(self, request_id: str) -> tuple[None, ErrorRecord | None, ReplicaReport]:
        return self._call(lambda: self._rep.release_request(request_id))

    def pool_report(self) -> PoolReport:
        return self._rep.pool_report()


def _ray() -> Any:
    """Ray, imported with its loopback switch set (:data:`LOOPBACK_ENV`) unless someone
    imported it before (then :func:`start_ray` refuses to start it)."""
    if "ray" not in sys.modules:
        os.environ[LOOPBACK_ENV] = "0"
    try:
        import ray
    except ImportError:
        raise ClusterError(
            "the Ray transport needs Ray: pip install -e '.[cluster]' (or make cluster-deps)"
        ) from None
    return ray


def start_ray(num_cpus: int = RAY_NUM_CPUS) -> bool:
    """A local Ray instance on this machine, unless one is running; True if started here
    (the caller then stops it with :func:`stop_ray`). No dashboard; every process it
    starts listens on the loopback address only (:data:`LOOPBACK_ENV`; docs/CLUSTER.md,
    "Transports"), else :class:`ClusterError` before anything starts; the workers import
    this repository's ``ref``."""
    ray = _ray()
    if ray.is_initialized():
        return False
    if os.environ.get(LOOPBACK_ENV) != "0":
        raise ClusterError(
            f"start_ray: Ray was imported before refserve could set {LOOPBACK_ENV}=0, so "
            "its services would listen on every interface; set it in the environment "
            "(or import refserve.cluster.ray_replica's start_ray before Ray)"
        )
    path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    node = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node).is_loopback:  # the switch was not honoured
        ray.shutdown()
        raise ClusterError(f"start_ray: Ray took the node address {node}, not loopback")
    return True


def stop_ray() -> None:
    """Shut the local Ray instance down (every actor with it)."""
    ray = _ray()
    if ray.is_initialized():
        ray.shutdown()


class RayReplica:
    """A :class:`~refserve.cluster.replica.Replica` whose engine runs in a Ray actor (module
    doc). Make them with :func:`ray_replicas`; ``replica`` is its id in error messages."""

    def __init__(
        self,
        handle: Any,
        replica: int,
        *,
        cost: StepCost | None = None,
        call_timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        _check_timeout(call_timeout_s)
        self._ray = _ray()
        self.handle = handle
        self.replica = replica
        self.call_timeout_s = float(call_timeout_s)
        self._dead: ReplicaDead | None = None
        info = self._get(handle.describe.remote())
        self._identity: ModelIdentity = info["identity"]
        self.config: SchedulerConfig = info["config"]
        self.max_model_len: int = info["max_model_len"]
        self.pid: int = info["pid"]
        self.cost = cost or self.config.step_cost or StepCost()
        self._events: list[CacheEvent] = []
        self._report: ReplicaReport | None = None
        self._answer(handle.report.remote())

    # ------------------------------------------------------------------ transport
    def _get(self, ref: Any) -> Any:
        if self._dead is not None:
            raise self._dead
        ray = self._ray
        try:
            return ray.get(ref, timeout=self.call_timeout_s)
        except ray.exceptions.RayActorError as e:
            self._dead = ReplicaDead(self.replica, f"{type(e).__name__}: {e}".splitlines()[0])
            raise self._dead from None
        except ray.exceptions.GetTimeoutError:
            ray.kill(self.handle, no_restart=True)
            cause = f"no answer within {self.call_timeout_s:g} s (the actor was killed)"
            self._dead = ReplicaDead(self.replica, cause)
            raise self._dead from None

    def _answer(self, ref: Any) -> Any:
        out, err, report = self._get(ref)
        self._report = report
        self._events.extend(report.events)
        if err is not None:
            raise err.rebuild()
        return out

    def _last(self) -> ReplicaReport:
        assert self._report is not None  # fetched at construction
        return self._report

    @property
    def dead(self) -> bool:
        return self._dead is not None

    @property
    def step_tokens(self) -> tuple[int, int]:
        """The prefill tokens and decodes of the actor's last step (zeros before one)."""
        return self._last().step_tokens

    def kill(self) -> None:
        """Kill the actor (as a crash would: no restart)."""
        self._ray.kill(self.handle, no_restart=True)

    # ------------------------------------------------------------------ Replica
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def identity(self) -> ModelIdentity:
        return self._identity

    def encode(self, text: str) -> list[int]:
        return list(self._get(self.handle.encode.remote(text)))

    def add_request(
        self, token_ids: Sequence[int], params: SamplingParams, request_id: str
    ) -> None:
        self._answer(self.handle.add_request.remote(list(token_ids), params, request_id))

    def step(self) -> list[RequestOutput]:
        out: list[RequestOutput] = self._answer(self.handle.step.remote())
        return out

    def abort(self, request_id: str) -> None:
        self._answer(self.handle.abort.remote(request_id))

    @property
    def has_work(self) -> bool:
        return self._last().has_work

    def request_ids(self) -> tuple[str, ...]:
        return self._last().request_ids

    def ping(self) -> None:
        """A round trip to the actor (its report, refreshed): ``ReplicaDead`` if it died."""
        self._answer(self.handle.report.remote())

    def load(self) -> LoadFigures:
        return replace(self._last().load, cost=self.cost)

    def prefix_hit_tokens(self, token_ids: Sequence[int]) -> int:
        hit: int = self._get(self.handle.prefix_hit_tokens.remote(list(token_ids)))
        return hit

    def drain_cache_events(self) -> list[CacheEvent]:
        out, self._events = self._events, []
        return out

    def cache_snapshot(self) -> CacheSnapshot:
        snap: CacheSnapshot = self._get(self.handle.cache_snapshot.remote())
        return snap

    @property
    def idle_fraction(self) -> float:
        return self._last().idle_fraction

    def export_request(
        self, request_id: str, *, kv: KVMode | str, hit_tokens: int, idle: float
    ) -> MigrationTicket:
        mode = kv.value if isinstance(kv, KVMode) else kv
        blob = self._answer(self.handle.export_request.remote(request_id, mode, hit_tokens, idle))
        return MigrationTicket.from_bytes(blob)

    def import_request(self, ticket: MigrationTicket) -> list[str]:
        if not isinstance(ticket, MigrationTicket):
            raise InvalidArgument(f"import_request: a MigrationTicket, got {type(ticket).__name__}")
        ids: list[str] = self._answer(self.handle.import_request.remote(ticket.to_bytes()))
        return ids

    def release_request(self, request_id: str) -> None:
        self._answer(self.handle.release_request.remote(request_id))

    def pool_report(self) -> PoolReport:
        """The actor's pools held to the spec (``rss_bytes``: the actor's process)."""
        report: PoolReport = self._get(self.handle.pool_report.remote())
        return report


def ray_replicas(
    num_replicas: int,
    *,
    model: str = "tiny",
    scheduler_config: SchedulerConfig | None = None,
    torch_threads: int | None = 1,
    call_timeout_s: float = CALL_TIMEOUT_S,
    first_id: int = 0,
    **engine_kwargs: Any,
) -> list[RayReplica]:
    """``num_replicas`` Ray actors, each with one engine of ``model`` (Ray must be
    running: :func:`start_ray`). The actors reserve no CPU (``num_cpus=0``): on a small
    machine the engines share its cores instead of waiting for a free one, each on
    ``torch_threads`` threads. A replica whose actor leaves a call unanswered for
    ``call_timeout_s`` is dead (module doc, "Faults"). The replicas are numbered from
    ``first_id`` (a replacement takes its dead predecessor's number). ``engine_kwargs``
    go to each ``LLMEngine`` (plain values: they are pickled to the actors)."""
    if not is_int(num_replicas) or num_replicas < 1:
        raise InvalidArgument(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    if not is_int(first_id) or first_id < 0:
        raise InvalidArgument(f"first_id must be an int >= 0, got {first_id!r}")
    _check_timeout(call_timeout_s)
    ray = _ray()
    if not ray.is_initialized():
        raise ClusterError("ray_replicas: Ray is not running (start_ray() first)")
    actor = ray.remote(num_cpus=0, max_restarts=0)(EngineActor)
    cfg = scheduler_config or SchedulerConfig()
    handles = [
        actor.remote(str(model), cfg, engine_kwargs, torch_threads) for _ in range(num_replicas)
    ]
    return [
        RayReplica(h, i, call_timeout_s=call_timeout_s)
        for i, h in enumerate(handles, start=first_id)
    ]


def _check_timeout(call_timeout_s: object) -> None:
    if not is_number(call_timeout_s):
        raise InvalidArgument(f"call_timeout_s must be a number > 0, got {call_timeout_s!r}")
    if not 0 < call_timeout_s < math.inf:
        raise InvalidArgument(f"call_timeout_s must be finite and > 0, got {call_timeout_s!r}")
