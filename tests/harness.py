"""The shared test harness: one request factory and one checked stepping loop.

Tests of the scheduler, the golden seeds and the swap code drive a real ``Scheduler``
either through ``EngineCore(check_invariants=True)`` on the simulator (``Stepper``), or
directly through ``schedule``/``commit`` (``commit_step``) when a test pins down what the
scheduler itself plans. Every step either way is checked: the engine core runs every
spec checker (docs/ARCHITECTURE.md, "Invariants"), ``commit_step`` runs ``check_pool``.

For migration (docs/MIGRATION.md) a ``Stepper(memory=True)`` keeps a fake K/V memory
(slot -> token id, device and host) written as a kernel would, ``MemoryLink`` carries it
between two of them for a ``PhasedMigration`` (tests/phased_migration.py), and ``cluster_snapshot``
turns named steppers and a move in flight into a ``refserve.spec.cluster.ClusterSnapshot``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.engine_core import EngineCore, StepRecord
from refserve.core.executor import StepOutput
from refserve.core.inputs import ModelInputs
from refserve.core.outcome import StepOutcome
from refserve.core.plan import StepPlan
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.core.transit import Arrival, Departure, KVPlace
from refserve.sim.simulator import SimExecutor
from refserve.spec import check_pool
from refserve.spec.cluster import ClusterSnapshot, Delivered
from refserve.spec.snapshot import RequestStatus
from tests.phased_migration import PhasedMigration, cluster_node

# The cost model of docs/ARCHITECTURE.md's worked examples: 2 ms a step, 0.5 ms a
# prefill token, 1 ms a decode.
COST = StepCost.parse("2+0.5P+D")

# How many steps a loop may take before a test calls it stuck: far above what any test
# here needs, so a hit means a scheduler that stopped making progress.
STEP_LIMIT = 500

# A small pool and budget that most direct scheduler tests share: room for four requests.
SMALL_CONFIG = SchedulerConfig(
    max_num_batched_tokens=32, max_num_seqs=4, block_size=4, num_blocks=16, max_model_len=32
)


def prompt_tokens(n: int, base: int = 0) -> list[int]:
    """``n`` distinct token ids ``base + 1 .. base + n`` (never token 0, the usual EOS)."""
    return [base + i + 1 for i in range(n)]


def make_request(
    rid: str,
    n: int,
    max_tokens: int = 8,
    *,
    base: int = 0,
    arrival_ms: float = 0.0,
    priority: int = 0,
    tenant: str = "default",
) -> Request:
    """A request with an ``n``-token prompt that decodes exactly ``max_tokens`` tokens."""
    return Request(
        rid,
        prompt_tokens(n, base),
        StopParams(max_tokens, ignore_eos=True),
        arrival_ms=arrival_ms,
        priority=priority,
        tenant=tenant,
    )


class Stepper:
    """A scheduler stepped one step at a time through the checked engine core.

    The simulator charges ``cost`` per step, plus the config's ``swap_cost`` for blocks
    moved between the pools unless ``charge_swaps`` is off.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cost: StepCost = COST,
        *,
        charge_swaps: bool = True,
        memory: bool = False,
    ) -> None:
        self.sched = Scheduler(config)
        swap = config.swap_cost if charge_swaps else None
        kind = MemorySimExecutor if memory else SimExecutor
        executor = kind(cost, self.sched.requests, swap=swap, block_size=config.block_size)
        self.executor = executor
        self.core = EngineCore(self.sched, executor, check_invariants=True)
        self.clock = 0.0
        self.records: list[StepRecord] = []
        self.added: list[Request] = []  # every request added, in order, finished or not

    @classmethod
    def of(cls, **config: Any) -> Stepper:
        """A stepper on ``SchedulerConfig(**config)`` at the default cost."""
        return cls(SchedulerConfig(**config))

    @property
    def memory(self) -> dict[int, int]:
        """The fake device K/V memory (``memory=True``)."""
        assert isinstance(self.executor, MemorySimExecutor), "a Stepper(memory=True)"
        return self.executor.memory

    @property
    def host_memory(self) -> dict[int, int]:
        assert isinstance(self.executor, MemorySimExecutor), "a Stepper(memory=True)"
        return self.executor.host_memory

    @property
    def plans(self) -> list[StepPlan]:
        return [rec.plan for rec in self.records]

    def add(self, *requests: Request) -> None:
        for r in requests:
            self.sched.add_request(r)
            self.added.append(r)

    def step(self) -> StepRecord:
        rec = self.core.step(self.clock)
        self.clock = rec.end_ms
        self.records.append(rec)
        return rec

    def step_tokens(self) -> dict[str, int]:
        """One step; the tokens it scheduled, by request id."""
        return dict(self.step().tokens)

    def until(self, cond: Callable[[], bool], limit: int = 50) -> None:
        for _ in range(limit):
            if cond():
                return
            self.step()
        if not cond():
            raise AssertionError(f"condition never reached in {limit} steps")

    def drain(self, limit: int = STEP_LIMIT) -> None:
        self.until(lambda: not self.sched.has_unfinished, limit)

    def decoding(self, *rids: str) -> None:
        """Step until every named request has sampled its first token."""
        reqs = self.sched.requests
        self.until(lambda: all(reqs[r].status is RequestStatus.DECODING for r in rids))


# ------------------------------------------------------------------------ migration
class MemorySimExecutor(SimExecutor):
    """The simulator with a fake K/V memory (slot -> token id, device and host): each
    step applies the plan's swap-outs, swap-ins and copies, then writes every scheduled
    token at its slot, in the order a kernel would (ref/core/plan.py). Its steps must
    not fail: nothing here is journaled."""

    needs_inputs = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.memory: dict[int, int] = {}
        self.host_memory: dict[int, int] = {}

    def execute(self, plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
        assert inputs is not None
        bs = self.block_size
        for mems, copies in (
            ((self.memory, self.host_memory), plan.swap_out),
            ((self.host_memory, self.memory), plan.swap_in),
            ((self.memory, self.memory), plan.copies),
        ):
            for cp in copies:
                for off in range(bs):
                    copy_slot(mems[0], cp.src * bs + off, mems[1], cp.dst * bs + off)
        ids = inputs.input_ids.tolist()
        for slot, tok in zip(inputs.slot_mapping.tolist(), ids, strict=True):
            self.memory[slot] = tok
        return super().execute(plan, inputs)


def copy_slot(src: dict[int, int], a: int, dst: dict[int, int], b: int) -> None:
    """``dst[b] = src[a]``; an unwritten slot stays unwritten."""
    if a in src:
        dst[b] = src[a]
    else:
        dst.pop(b, None)


class HasMemory(Protocol):
    """An engine with fake K/V memories: a ``Stepper(memory=True)``, or a state
    machine's books."""

    @property
    def memory(self) -> dict[int, int]: ...

    @property
    def host_memory(self) -> dict[int, int]: ...


class Boom(Exception):
    """A fault injected on purpose."""


class MemoryLink:
    """A move's K/V link (``tests/phased_migration.py ``KVLink````) between two fake memories: each
    position's token id from the source's slot (device or host) to the destination's,
    every overwritten slot saved first so ``undo`` restores it. ``fail_after``: raise
    :class:`Boom` once that many slots are written (a fault inside a chunk)."""

    def __init__(self, src: HasMemory, dst: HasMemory) -> None:
        self.src, self.dst = src, dst
        self.saved: dict[int, int | None] = {}
        self.fail_after: int | None = None
        self.written = 0

    def copy(self, departure: Departure, arrival: Arrival, start: int, end: int) -> None:
        host = departure.kv_place is KVPlace.HOST
        src = self.src.host_memory if host else self.src.memory
        for p in range(start, end):
            if self.fail_after is not None and self.written >= self.fail_after:
                self.fail_after = None
                raise Boom(f"the link fails after {self.written} slots")
            slot = arrival.slots[p - arrival.num_hit_tokens]
            self.saved.setdefault(slot, self.dst.memory.get(slot))
            copy_slot(src, departure.slots[p], self.dst.memory, slot)
            self.written += 1

    def undo(self) -> None:
        for slot, tok in self.saved.items():
            if tok is None:
                self.dst.memory.pop(slot, None)
            else:
                self.dst.memory[slot] = tok
        self.saved = {}


def cluster_snapshot(
    engines: Mapping[str, Stepper],
    move: tuple[PhasedMigration, str, str] | None = None,
    finished: Mapping[str, tuple[int, ...]] | None = None,
    since: ClusterSnapshot | None = None,
) -> ClusterSnapshot:
    """The steppers as a cluster (spec/cluster.py), by name, with ``move`` (the move,
    its source's name, its destination's) in flight. A live request's client has
    received its outputs so far (what a correct engine delivers); ``finished`` are the
    outputs of the requests that ended; a client of ``since`` that no engine serves any
    more keeps what it had (a client does not forget its stream)."""
    nodes = tuple(
        cluster_node(name, s.sched, s.memory, s.host_memory) for name, s in engines.items()
    )
    transits = () if move is None or move[0].phase is None else (move[0].transit(*move[1:]),)
    delivered = {} if since is None else {d.request_id: d for d in since.delivered}
    delivered |= {
        rid: Delivered(rid, tuple(r.output_token_ids))
        for s in engines.values()
        for rid, r in s.sched.requests.items()
    }
    if move is not None and move[0].phase is not None and move[0].departure is not None:
        state = move[0].departure.state
        outputs = state.token_ids[state.num_prompt_tokens :]
        delivered[state.request_id] = Delivered(state.request_id, outputs)
    for rid, toks in (finished or {}).items():
        delivered[rid] = Delivered(rid, toks, done=True)
    return ClusterSnapshot(nodes, transits, tuple(delivered[k] for k in sorted(delivered)))


# ------------------------------------------------------- stepping without the engine core
def sampled_tokens(plan: StepPlan, token: int = 7) -> dict[str, int]:
    """``token`` for every request the plan samples: what an executor would return."""
    return {rid: token for rid, s in zip(plan.request_ids, plan.samples, strict=True) if s}


def reference_loop(sched: Scheduler) -> Scheduler:
    """``sched`` planning every decode one request at a time (the per-request path), for
    the differential test against the bulk path (docs/ARCHITECTURE.md, "The persistent
    batch"); returned for chaining."""
    sched.fast_decode = False
    return sched


def commit_step(sched: Scheduler, now: float = 0.0, token: int = 7) -> tuple[StepPlan, StepOutcome]:
    """Schedule one step and commit it as if every sampling request drew ``token``."""
    plan = sched.schedule(now)
    events = sched.commit(plan, sampled_tokens(plan, token), now)
    assert check_pool(sched.pool.snapshot()) == []
    return plan, events


def decoding_scheduler(config: SchedulerConfig, *reqs: Request) -> Scheduler:
    """A scheduler whose requests have all sampled their first token."""
    sched = Scheduler(config)
    for r in reqs:
        sched.add_request(r)
    for _ in range(20):
        if all(r.status is RequestStatus.DECODING for r in reqs):
            return sched
        commit_step(sched)
    raise AssertionError("requests did not reach decode")


def plan_entry(plan: StepPlan, rid: str) -> tuple[int, int, bool, bool, int]:
    """(start, n, samples, is_prefill, cached) of ``rid`` in the plan."""
    i = plan.request_ids.index(rid)
    return (
        plan.starts[i],
        plan.num_new_tokens[i],
        plan.samples[i],
        plan.is_prefill[i],
        plan.num_new_cached_tokens[i],
    )
