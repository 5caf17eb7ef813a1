"""Drivers and checks shared by the engine-level migration tests (the protocol of
ref/engine/migration.py, docs/MIGRATION.md).

:func:`move` is one :func:`~refserve.engine.migration.migrate` with every check a move must
pass, made on the spot: the source holds nothing of the request any more (no group, no
scheduler request, no device or host block), both pools pass spec's pool checks (BLOCK,
CAP, POS, PREFIX), the destination holds the source's token ids, and after a transfer
its KV length is the source's and every K/V slot the destination did not have from its
own prefix cache reads back the source's bytes for that position (after a recompute: no
KV). :func:`drive` steps a set of engines, moving one request at the points a plan draws,
and records every output of every request in delivery order.

Every engine here runs on one torch thread (:func:`one_torch_thread`): torch's OpenMP
workers spin while they wait, and on the shared 2-core test machine a 1.6 ms step of the
tiny model took 60 ms with two threads.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from refserve.core import transit
from refserve.core.config import SchedulerConfig
from refserve.core.executor import StepOutput
from refserve.core.inputs import ModelInputs
from refserve.core.plan import StepPlan
from refserve.engine.llm_engine import LLMEngine, RequestOutput
from refserve.engine.migration import FaultHook, MigrationReport, migrate
from refserve.engine.ticket import MigrationTicket
from refserve.model.checkpoint import ModelSource
from refserve.spec.checks import check_pool
from refserve.spec.snapshot import RequestStatus


def one_torch_thread() -> Iterator[None]:
    """A fixture body: torch on one thread while a module runs (module doc)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Clock:
    """A clock that moves only when told: injected into engines (``clock=``) so that the
    times a run records are the same in every run that steps alike."""

    def __init__(self, start_ms: float = 0.0) -> None:
        self.t = start_ms

    def __call__(self) -> float:
        return self.t


def fixed_step_ms(engine: LLMEngine, ms: float) -> None:
    """Every step of ``engine`` takes ``ms`` (the executor reports it as a cost model
    would), so token times are ``clock at step start + ms``, not wall time."""
    execute = engine.executor.execute

    def timed(plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
        return replace(execute(plan, inputs), duration_ms=ms)

    engine.executor.execute = timed  # type: ignore[method-assign]


def make_engine(
    model: ModelSource = "tiny",
    *,
    block_size: int = 4,
    num_blocks: int = 64,
    budget: int = 5,
    clock: Callable[[], float] | None = None,
    dtype: torch.dtype = torch.float32,
    model_seed: int = 0,
    check: bool = True,
    **config: object,
) -> LLMEngine:
    """An engine with chunked prefill at a small token budget (a prompt takes several
    steps), ``check_invariants`` on: every spec invariant after every step."""
    cfg = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=True,
        **config,  # type: ignore[arg-type]
    )
    return LLMEngine(
        model,
        scheduler_config=cfg,
        check_invariants=check,
        clock=clock,
        dtype=dtype,
        model_seed=model_seed,
    )


@dataclass(frozen=True)
class How:
    """How one move carries the K/V: ``transfer`` (inline in the ticket, or streamed in
    chunks of ``chunk_blocks`` source blocks) or ``recompute``."""

    kv: str
    chunk_blocks: int | None = None

    def __str__(self) -> str:
        if self.kv == "recompute":
            return "recompute"
        return "inline" if self.chunk_blocks is None else f"stream{self.chunk_blocks}"


INLINE = How("transfer")
STREAM1 = How("transfer", 1)
STREAM2 = How("transfer", 2)
RECOMPUTE = How("recompute")
HOWS = (INLINE, STREAM1, STREAM2, RECOMPUTE)


@dataclass(frozen=True)
class SeenMigration:
    """One move as :func:`move` saw it, at the step boundary it happened."""

    request_id: str
    how: How
    status: RequestStatus  # the first live sample's, at export
    kv_length: int  # the source's KV length of that sample
    num_output_tokens: int
    ticket: MigrationTicket  # the export's probe (no K/V in it)
    report: MigrationReport


def kv_rows(engine: LLMEngine, data: bytes, n: int) -> torch.Tensor:
    """A chunk's bytes as ``[2 * layers, n, bytes per token per layer]`` (token-major)."""
    layers = len(engine.cache.key)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(2 * layers, n, -1)


def cache_state(engine: LLMEngine) -> list[torch.Tensor]:
    """Copies of every device and host K/V tensor of ``engine``."""
    caches = (engine.cache, engine.host_cache)
    return [t.clone() for c in caches for t in (*c.key, *c.value)]


def assert_cache_equal(engine: LLMEngine, before: Sequence[torch.Tensor]) -> None:
    now = cache_state(engine)
    assert len(now) == len(before)
    for i, (a, b) in enumerate(zip(now, before, strict=True)):
        assert torch.equal(a, b), f"K/V tensor {i} changed"


def assert_pool_sound(engine: LLMEngine, what: str) -> None:
    """spec's pool checks (BLOCK, CAP, POS, PREFIX) on the engine's device pool."""
    bad = check_pool(engine.scheduler.pool.snapshot())
    assert not bad, f"{what}: {bad}"


def assert_holds_nothing_of(engine: LLMEngine, rid: str, seq_ids: Sequence[str]) -> None:
    sched = engine.scheduler
    assert not engine.books.has_request(rid), f"{rid!r} still has a group on the source"
    for sid in seq_ids:
        assert sid not in sched.requests, f"{sid!r} still in the source's scheduler"
        assert not sched.pool.has_request(sid), f"{sid!r} still holds source blocks"
        assert not sched.host.has_request(sid), f"{sid!r} still holds source host blocks"


def move(
    src: LLMEngine,
    dst: LLMEngine,
    rid: str,
    how: How,
    *,
    fault: FaultHook | None = None,
) -> SeenMigration:
    """Migrate ``rid`` from ``src`` to ``dst`` and check the move (module doc)."""
    probe = src.export_request(rid, kv=how.kv, inline=False)  # a pure read
    before: dict[str, tuple[int, int, bytes]] = {}
    for s in probe.sequences:
        n = s.state.num_computed_tokens
        data = src.read_kv(s.seq_id, 0, n).data if n else b""
        hit = dst.prefix_hit_tokens(s.state.token_ids[:n], s.state) if n else 0
        before[s.seq_id] = (n, hit, data)
    report = migrate(src, dst, rid, kv=how.kv, chunk_blocks=how.chunk_blocks, fault=fault)
    assert report.decision.mode.value == how.kv
    seq_ids = [s.seq_id for s in probe.sequences]
    assert_holds_nothing_of(src, rid, seq_ids)
    assert_pool_sound(src, "source pool after the move")
    assert_pool_sound(dst, "destination pool after the move")
    for s in probe.sequences:
        n, hit, data = before[s.seq_id]
        d = transit.export(dst.scheduler, s.seq_id)
        assert d.state.token_ids == s.state.token_ids, f"{s.seq_id}: token ids changed"
        if how.kv == "recompute" or not n:
            assert d.kv_length == 0, f"{s.seq_id}: KV without a transfer"
            continue
        assert d.kv_length == n, f"{s.seq_id}: KV length {d.kv_length} != source {n}"
        if hit < n:
            got = kv_rows(dst, dst.read_kv(s.seq_id, hit, n).data, n - hit)
            want = kv_rows(src, data, n)[:, hit:]
            assert torch.equal(got, want), f"{s.seq_id}: K/V of [{hit}, {n}) differs"
    first = probe.sequences[0]
    return SeenMigration(
        rid,
        how,
        first.state.status,
        first.state.num_computed_tokens,
        first.state.num_output_tokens,
        probe,
        report,
    )


@dataclass
class Trace:
    """Every output of every request, in delivery order over all engines, and the moves."""

    outputs: list[RequestOutput] = field(default_factory=list)
    moves: list[SeenMigration] = field(default_factory=list)
    owner: int = 0

    def of(self, rid: str, index: int | None = None) -> list[RequestOutput]:
        return [
            o for o in self.outputs if o.request_id == rid and (index is None or o.index == index)
        ]

    def finals(self, rid: str) -> dict[int, RequestOutput]:
        """The final output of each sample; each sample must have exactly one."""
        out: dict[int, RequestOutput] = {}
        for o in self.of(rid):
            if o.finished:
                assert o.index not in out, f"{rid}[{o.index}] finished twice"
                out[o.index] = o
        return out


#: Decides, at the boundary before tick ``k``, whether (and how) to move the request.
Plan = Callable[[int], How | None]


def random_plan(seed: int, hows: Sequence[How], p: float = 0.5, always: Sequence[int] = ()) -> Plan:
    """Migrate with probability ``p`` at each boundary (and at the ticks ``always``), each
    move drawn from ``hows``; seeded, so a failure replays."""
    rng = random.Random(seed)

    def plan(tick: int) -> How | None:
        hit = rng.random() < p
        how = rng.choice(list(hows))
        return how if hit or tick in always else None

    return plan


def step_all(engines: Sequence[LLMEngine], trace: Trace) -> None:
    for e in engines:
        if e.has_unfinished:
            trace.outputs.extend(e.step())


def drive(
    engines: Sequence[LLMEngine],
    rid: str,
    plan: Plan,
    *,
    trace: Trace | None = None,
    tick: Callable[[], None] | None = None,
    max_ticks: int = 400,
) -> Trace:
    """Step every engine until all are done; before each tick, if ``plan`` says so and
    ``rid`` is live on its owner, :func:`move` it to the next engine (round robin).
    ``tick`` runs after each tick (a clock moving on)."""
    tr = trace if trace is not None else Trace()
    for k in range(max_ticks):
        if not any(e.has_unfinished for e in engines):
            return tr
        how = plan(k)
        src = engines[tr.owner]
        if how is not None and len(engines) > 1 and src.books.has_request(rid):
            nxt = (tr.owner + 1) % len(engines)
            tr.moves.append(move(src, engines[nxt], rid, how))
            tr.owner = nxt
        step_all(engines, tr)
        if tick is not None:
            tick()
    raise AssertionError(f"the engines did not finish in {max_ticks} ticks")


def stream_view(outs: Sequence[RequestOutput]) -> list[tuple[object, ...]]:
    """What a client sees of each output (everything but the metrics)."""
    return [
        (
            o.index,
            o.new_text,
            o.new_token_ids,
            o.new_logprobs,
            o.text,
            o.token_ids,
            o.logprobs,
            o.finished,
            o.finish_reason,
            o.stop_reason,
            o.turn,
        )
        for o in outs
    ]


def assert_delivered_once(outs: Sequence[RequestOutput], num_samples: int = 1) -> None:
    """Per sample and turn: the deltas concatenate to the final text and token ids (each
    token delivered exactly once), and there is exactly one final output per sample."""
    finals = [o for o in outs if o.finished]
    assert sorted(o.index for o in finals) == list(range(num_samples)), "one final per sample"
    for i in range(num_samples):
        mine = [o for o in outs if o.index == i]
        for turn in sorted({o.turn for o in mine}):
            turn_outs = [o for o in mine if o.turn == turn]
            last = turn_outs[-1]
            assert "".join(o.new_text for o in turn_outs) == last.text, f"[{i}] text"
            assert tuple(t for o in turn_outs for t in o.new_token_ids) == last.token_ids
            if last.logprobs is not None:
                lps = [x for o in turn_outs for x in (o.new_logprobs or ())]
                assert tuple(lps) == last.logprobs, f"[{i}] logprobs"
