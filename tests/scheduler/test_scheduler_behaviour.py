"""Targeted scheduler scenarios: docs/ARCHITECTURE.md, "Known bugs elsewhere" and example 2.

Every step runs through ``EngineCore(check_invariants=True)`` (directly or via
``refserve.sim.simulator.simulate``), so each scenario is also checked against every spec invariant;
the assertions here state the behaviour the scenario is about. The abort and finish time
stamps are pinned on ``harness.commit_step`` (schedule and commit, ``check_pool`` after).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from harness import COST, SMALL_CONFIG, STEP_LIMIT, Stepper, decoding_scheduler, make_request

from refserve.core.config import Admission, PolicyName, SchedulerConfig
from refserve.core.engine_core import EngineCore, StepRecord
from refserve.core.request import FinishReason, Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.sim.simulator import SimExecutor, simulate
from refserve.spec.arith import blocks_needed
from refserve.spec.progress import check_quiescent
from refserve.spec.snapshot import RequestStatus as S


class Run(Stepper):
    """The harness stepper, adding requests by id with explicit prompts (EOS not ignored),
    whose drain also checks that nothing is left held (check_quiescent)."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config, COST)
        self.all: dict[str, Request] = {}

    def submit(self, rid: str, prompt: list[int], max_tokens: int = 4, **kw: object) -> Request:
        r = Request(rid, list(prompt), StopParams(max_tokens=max_tokens), **kw)  # type: ignore[arg-type]
        self.add(r)
        self.all[rid] = r
        return r

    def status(self, rid: str) -> S:
        return self.all[rid].status

    def drain(self, limit: int = STEP_LIMIT) -> None:
        super().drain(limit)
        assert check_quiescent(self.sched.pool.snapshot()) == []

    def chunk(self, rec: StepRecord, rid: str):  # type: ignore[no-untyped-def]
        return next(c for c in rec.plan.chunks if c.request_id == rid)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 1 for i in range(n)]


# ------------------------------------------------------------ abort + leaks
def _preempting_run() -> Run:
    """Two decoders in a 6-block pool (block 1): the newer one gets preempted."""
    run = Run(
        SchedulerConfig(
            max_num_batched_tokens=8,
            max_num_seqs=4,
            block_size=1,
            num_blocks=6,
            enable_prefix_caching=False,
        )
    )
    run.submit("old", [1, 2], max_tokens=10)
    run.submit("new", [3, 4], max_tokens=10)
    return run


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_in_every_state_then_no_leak(state: str) -> None:
    if state == "preempted":
        run = _preempting_run()
        while run.status("new") is not S.PREEMPTED:
            run.step()
            assert len(run.records) < 20
        victim = "new"
    else:
        run = Run(
            SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=2, block_size=2, num_blocks=16)
        )
        run.submit("a", _prompt(3), max_tokens=6)
        run.submit("b", _prompt(9, 1), max_tokens=6)
        run.submit("c", _prompt(5, 2), max_tokens=6)
        run.step()  # a: 3 tokens (decoding next), b: 1 token (prefilling), c waits
        victim = {"waiting": "c", "prefilling": "b", "decoding": "a"}[state]
    assert run.status(victim).value == state
    pool = run.sched.pool
    others = {t.request_id: t for t in pool.snapshot().tables if t.request_id != victim}
    run.sched.abort(victim)
    snap = pool.snapshot()
    assert run.status(victim) is S.ABORTED and run.all[victim].finish_reason == "abort"
    assert snap.table(victim) is None
    # Everyone else's tables are untouched; the used blocks are exactly theirs.
    assert {t.request_id: t for t in snap.tables} == others
    assert pool.num_used_blocks == len({b for t in others.values() for b in t.block_table})
    run.drain()
    assert all(r.is_done for r in run.all.values())


def test_abort_of_a_request_sharing_cached_blocks_keeps_the_sharers_blocks() -> None:
    run = Run(SchedulerConfig(max_num_batched_tokens=64, block_size=4, num_blocks=16))
    shared = _prompt(8)
    run.submit("first", [*shared, 1], max_tokens=8)
    run.step()
    run.submit("second", [*shared, 2], max_tokens=8)
    rec = run.step()
    assert run.chunk(rec, "second").num_new_cached_tokens == 8
    pool = run.sched.pool
    first_table = pool.block_table("first")
    assert pool.block_table("second")[:2] == first_table[:2]
    run.sched.abort("second")
    assert pool.block_table("first") == first_table
    assert all(pool.snapshot().ref_cnt[b] == 1 for b in first_table)
    run.drain()


@pytest.mark.mutation_kill
def test_abort_and_finish_stamp_the_given_time_defaulting_to_zero() -> None:
    sched = decoding_scheduler(
        SMALL_CONFIG,
        make_request("a", 3),
        make_request("b", 3, base=10),
        make_request("c", 3, base=20),
    )
    a, b, c = (sched.requests[x] for x in "abc")
    sched.abort("a")
    sched.finish("b", FinishReason.STOP)
    sched.abort("c", 3.5)
    assert (a.finished_ms, b.finished_ms, c.finished_ms) == (0.0, 0.0, 3.5)
    assert (a.status, b.status, c.status) == (S.ABORTED, S.FINISHED, S.ABORTED)
    assert (a.finish_reason, b.finish_reason) == (FinishReason.ABORT, FinishReason.STOP)
    assert sched.retired == [a, b, c] and sched.requests == {}
    assert sched.pool.num_free_blocks == SMALL_CONFIG.num_blocks


@pytest.mark.mutation_kill
def test_abort_before_the_first_step_retires_the_request() -> None:
    sched = Scheduler(SMALL_CONFIG)
    a = make_request("a", 3)
    sched.add_request(a)
    sched.abort("a", 1.5)
    assert sched.retired == [a] and sched.waiting == [] and sched.requests == {}
    assert a.status is S.ABORTED and a.finished_ms == 1.5


# ----------------------------------------------------------- prefix cache
def _cached_then_same(prompt: list[int], block_size: int = 4) -> tuple[Run, StepRecord]:
    run = Run(SchedulerConfig(max_num_batched_tokens=64, block_size=block_size, num_blocks=32))
    run.submit("warm", prompt, max_tokens=1)
    run.drain()
    run.submit("again", prompt, max_tokens=3)
    return run, run.step()


def test_fully_cached_prompt_still_schedules_its_last_token() -> None:
    run, rec = _cached_then_same(_prompt(9))  # 2 full blocks + 1 token, all cached
    c = run.chunk(rec, "again")
    assert (c.num_new_cached_tokens, c.start, c.num_new_tokens) == (8, 8, 1)
    assert c.samples and run.all["again"].num_output_tokens == 1  # a logit existed
    assert run.all["again"].num_cached_tokens == 8
    run.drain()


def test_block_aligned_cached_prompt_recomputes_its_last_block() -> None:
    prompt = _prompt(8)  # exactly two blocks of 4, both cached by "warm"
    run, rec = _cached_then_same(prompt)
    c = run.chunk(rec, "again")
    assert (c.num_new_cached_tokens, c.start, c.num_new_tokens) == (4, 4, 4)
    assert c.samples
    # The recomputed last block is a private block, not the cached copy.
    table = run.sched.pool.block_table("again")
    entries = {e.block_id: e.token_ids for e in run.sched.pool.snapshot().cache_entries}
    assert entries[table[0]] == tuple(prompt[:4])
    assert run.sched.pool.snapshot().ref_cnt[table[1]] == 1
    run.drain()


@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_prompt_shorter_than_a_block_or_one_token(block_size: int) -> None:
    for n in (1, block_size):
        run, rec = _cached_then_same(_prompt(n), block_size)
        c = run.chunk(rec, "again")
        assert c.num_new_tokens >= 1 and c.start + c.num_new_tokens == n and c.samples
        run.drain()


def test_two_requests_sharing_a_new_prefix_in_the_same_step() -> None:
    """Neither may reuse a block the other only writes in this very step (its K/V does
    not exist yet); each computes its own, and a later request hits the cached one."""
    run = Run(SchedulerConfig(max_num_batched_tokens=64, block_size=4, num_blocks=32))
    shared = _prompt(8)
    run.submit("a", [*shared, 1, 1], max_tokens=2)
    run.submit("b", [*shared, 2, 2], max_tokens=2)
    rec = run.step()
    ca, cb = run.chunk(rec, "a"), run.chunk(rec, "b")
    assert ca.num_new_cached_tokens == cb.num_new_cached_tokens == 0
    assert (ca.num_new_tokens, cb.num_new_tokens) == (10, 10)
    ta, tb = run.sched.pool.block_table("a"), run.sched.pool.block_table("b")
    assert not set(ta) & set(tb)
    run.drain()
    run.submit("c", [*shared, 3], max_tokens=1)
    assert run.chunk(run.step(), "c").num_new_cached_tokens == 8
    run.drain()


def test_no_hit_on_a_block_a_running_prefill_completes_in_the_same_step() -> None:
    run = Run(SchedulerConfig(max_num_batched_tokens=6, block_size=4, num_blocks=32))
    shared = _prompt(8)
    run.submit("a", [*shared, 1], max_tokens=2)
    run.step()  # a: positions 0..5 (block 0 full and cached, block 1 partial)
    run.submit("b", [*shared, 2], max_tokens=2)
    rec = run.step()  # a completes block 1 in this step; b is admitted in this step
    assert run.chunk(rec, "a").start == 6
    cb = run.chunk(rec, "b")
    assert cb.num_new_cached_tokens == 4  # block 0 only: block 1 is written right now
    run.drain()


def test_no_hit_on_a_block_a_decode_completes_in_the_same_step() -> None:
    run = Run(SchedulerConfig(max_num_batched_tokens=64, block_size=4, num_blocks=32))
    a = run.submit("a", _prompt(7), max_tokens=6)
    run.step()  # a: prompt (7) computed, one token sampled; block 1 completes next step
    known = list(a.token_ids)  # 8 tokens: 2 full blocks once the decode writes position 7
    run.submit("b", [*known, 5], max_tokens=2)
    rec = run.step()
    assert run.chunk(rec, "a").start == 7
    assert run.chunk(rec, "b").num_new_cached_tokens == 4
    run.drain()


# ------------------------------------------------------------- preemption
def test_preemption_storm_never_overcounts() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=5,
        max_num_seqs=6,
        block_size=2,
        num_blocks=8,
        enable_prefix_caching=True,
    )
    run = Run(cfg)
    for i in range(10):
        run.submit(f"r{i}", _prompt(3 + i % 4, i % 3), max_tokens=6 + i % 5)
    for _ in range(600):
        if not run.sched.has_unfinished:
            break
        run.step()
        for r in run.sched.requests.values():
            assert 0 <= r.num_computed_tokens <= r.num_tokens
            if r.status in (S.WAITING, S.PREEMPTED):
                assert r.num_computed_tokens == 0
    run.drain()
    preemptions = sum(r.num_preemptions for r in run.all.values())
    assert preemptions >= 5, preemptions
    for r in run.all.values():
        assert r.finish_reason in ("length", "capacity")
        assert r.num_output_tokens <= r.stop.max_tokens


def test_preempted_request_keeps_its_place_ahead_of_later_arrivals() -> None:
    run = _preempting_run()
    while run.status("new") is not S.PREEMPTED:
        run.step()
    run.submit("later", [5, 6], max_tokens=2)
    assert [r.request_id for r in run.sched.waiting] == ["new", "later"]
    admitted = [rid for rec in run.records for rid in rec.plan.admitted]
    run.drain()
    admitted = [rid for rec in run.records for rid in rec.plan.admitted][len(admitted) :]
    assert admitted.index("new") < admitted.index("later")


def test_preempted_request_keeps_its_place_under_equal_priority_but_not_over_better() -> None:
    run = Run(
        SchedulerConfig(
            max_num_batched_tokens=8,
            max_num_seqs=4,
            block_size=1,
            num_blocks=6,
            enable_prefix_caching=False,
        )
    )
    run.submit("old", [1, 2], max_tokens=10, priority=1)
    run.submit("new", [3, 4], max_tokens=10, priority=1)
    while run.status("new") is not S.PREEMPTED:
        run.step()
    run.submit("same", [5], max_tokens=1, priority=1)
    run.submit("urgent", [6], max_tokens=1, priority=0)
    order = [
        r.request_id
        for r in run.sched.policy.waiting_order(run.sched.waiting, run.sched.step_index)
    ]
    assert order == ["urgent", "new", "same"]
    run.drain()


def test_victim_is_the_lowest_priority_then_the_latest() -> None:
    run = Run(
        SchedulerConfig(
            max_num_batched_tokens=8,
            max_num_seqs=4,
            block_size=1,
            num_blocks=9,
            enable_prefix_caching=False,
        )
    )
    run.submit("p0_early", [1, 2], max_tokens=20, priority=0)
    run.submit("p1", [3, 4], max_tokens=20, priority=1)
    run.submit("p0_late", [5, 6], max_tokens=20, priority=0)
    first = None
    for _ in range(20):
        rec = run.step()
        if rec.plan.preempted:
            first = rec.plan.preempted[0]
            break
    assert first == "p1"
    run.drain()


def test_lone_request_that_cannot_grow_finishes_with_capacity() -> None:
    run = Run(SchedulerConfig(max_num_batched_tokens=8, block_size=2, num_blocks=2))
    r = run.submit("big", [1, 2, 3], max_tokens=10)
    run.drain(limit=10)  # no spin: 2 steps of work, then the capacity finish
    assert r.finish_reason == FinishReason.CAPACITY
    # It filled the pool (4 slots of KV) and sampled one more token it has no room for.
    assert (r.num_computed_tokens, r.num_tokens, r.num_output_tokens) == (4, 5, 2)
    assert len(run.records) <= 3
    assert run.records[-1].outcome.finished == ("big",)


def test_capacity_finish_only_when_no_victim_exists() -> None:
    """With a victim available the grower preempts it instead of finishing."""
    run = Run(
        SchedulerConfig(
            max_num_batched_tokens=8, block_size=2, num_blocks=4, enable_prefix_caching=False
        )
    )
    run.submit("a", [1, 2, 3], max_tokens=10)
    run.submit("b", [4, 5, 6], max_tokens=10)
    run.drain(limit=60)
    preempted = [rid for rec in run.records for rid in rec.plan.preempted]
    assert preempted and preempted[0] == "b"
    reasons = {rid: r.finish_reason for rid, r in run.all.items()}
    assert reasons == {"a": "capacity", "b": "capacity"}  # each alone eventually fills 8 slots


# ------------------------------------------------- starvation and admission
def _starvation_run(reserve: int) -> tuple[Run, int]:
    cfg = SchedulerConfig(
        max_num_batched_tokens=8,
        max_num_seqs=16,
        block_size=16,
        num_blocks=256,
        prefill_reserve_tokens=reserve,
        prefill_reserve_after_steps=4,
    )
    run = Run(cfg)
    for i in range(8):
        run.submit(f"d{i}", [i + 1], max_tokens=10_000)
    run.step()  # 8 one-token prompts: all decoding from now on
    assert all(run.status(f"d{i}") is S.DECODING for i in range(8))
    run.submit("p", _prompt(4), max_tokens=2)
    arrived = len(run.records)
    for _ in range(40):
        run.step()
        if run.status("p") is not S.WAITING:
            break
    return run, arrived


def test_decode_first_starves_a_prefill_without_reserve() -> None:
    run, _ = _starvation_run(reserve=0)
    assert run.status("p") is S.WAITING  # 40 steps of 8 decodes: never a spare token
    assert all(rec.plan.num_scheduled_tokens == 8 for rec in run.records[1:])


def test_prefill_reserve_admits_the_starving_prefill() -> None:
    run, arrived = _starvation_run(reserve=4)
    admitted_at = next(i for i, rec in enumerate(run.records) if "p" in rec.plan.admitted)
    assert admitted_at - arrived <= 4 + 1
    rec = run.records[admitted_at]
    assert rec.plan.num_decode_requests == 4 and rec.plan.num_prefill_tokens == 4


def _seed002_admission(**cfg_kw: object) -> tuple[Run, str]:
    """Example 2e: 1000 blocks of 16, 900 in use, a 1600-token prompt needs 100 blocks."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=16_384,
        max_num_seqs=16,
        block_size=16,
        num_blocks=1000,
        enable_prefix_caching=False,
        **cfg_kw,
    )  # type: ignore[arg-type]
    run = Run(cfg)
    for i in range(9):  # 9 x 1590-token prompts: 100 blocks each, 900 in use
        run.submit(f"occ{i}", _prompt(1590, i), max_tokens=5)
    run.step()
    assert run.sched.pool.num_used_blocks == 900
    run.submit("new", _prompt(1600, 42), max_tokens=16)
    assert blocks_needed(1600, 16) == 100
    rec = run.step()
    return run, "new" if "new" in rec.plan.admitted else ""


def test_seed002_first_chunk_admits_the_1600_token_prompt() -> None:
    run, admitted = _seed002_admission(admission=Admission.FIRST_CHUNK)
    assert admitted == "new" and run.sched.pool.num_free_blocks == 0
    run.drain()


@pytest.mark.parametrize(
    "kw",
    [
        {"admission": Admission.SEQUENCE},  # 1600 + 16 outputs -> 101 blocks > 100 free
        {"admission": Admission.FIRST_CHUNK, "watermark_blocks": 10},  # 100 > 100 - 10
        {"admission": Admission.PROMPT, "watermark_blocks": 1},
    ],
    ids=["sequence", "first_chunk+watermark", "prompt+watermark"],
)
def test_seed002_headroom_defers_the_1600_token_prompt(kw: dict[str, object]) -> None:
    run, admitted = _seed002_admission(**kw)
    assert admitted == "" and run.status("new") is S.WAITING
    run.drain()
    assert run.all["new"].finish_reason == "length"
    assert sum(r.num_preemptions for r in run.all.values()) == 0


def test_first_chunk_thrashes_where_sequence_admission_does_not() -> None:
    """Admit-fill-preempt: first-chunk admission lets growth preempt; sequence never."""

    def preemptions(admission: Admission) -> int:
        cfg = SchedulerConfig(
            max_num_batched_tokens=4,
            max_num_seqs=4,
            block_size=2,
            num_blocks=8,
            enable_prefix_caching=False,
            admission=admission,
        )
        reqs = [Request(f"r{i}", _prompt(4, i), StopParams(max_tokens=8)) for i in range(4)]
        res = simulate(Scheduler(cfg), reqs, COST, check_invariants=True, max_steps=500)
        assert all(r.finish_reason == "length" for r in res.requests)
        return sum(r.num_preemptions for r in res.requests)

    assert preemptions(Admission.FIRST_CHUNK) > 0
    assert preemptions(Admission.SEQUENCE) == 0


def test_static_policy_never_admits_while_a_batch_runs() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16,
        max_num_seqs=3,
        block_size=4,
        num_blocks=64,
        policy=PolicyName.STATIC,
    )
    reqs = [
        Request(
            f"r{i}",
            _prompt(3 + i, i),
            StopParams(max_tokens=2 + (i * 3) % 5),
            arrival_ms=float(i * 3),
        )
        for i in range(8)
    ]
    res = simulate(Scheduler(cfg), reqs, COST, check_invariants=True)
    running: set[str] = set()
    batches = 0
    for rec in res.steps:
        if rec.plan.admitted:
            assert not running, (
                f"step {rec.step_index} admitted {rec.plan.admitted} during {running}"
            )
            batches += 1
        running |= set(rec.plan.admitted)
        running -= set(rec.outcome.finished) | set(rec.plan.preempted)
    assert batches >= 3
    assert all(r.finish_reason == "length" for r in res.requests)


# --------------------------------------------------- free-list determinism
_DETERMINISM = """
import json, sys
sys.path[:0] = [{tests!r}, {harness!r}]
from test_scheduler_behaviour import block_table_history
print(json.dumps(block_table_history()))
"""


def block_table_history() -> list[object]:
    """Every step's block tables, free queue and cache entries for a fixed workload with
    aborts, preemption, prefix hits and evictions (string ids hash differently per
    process, so any set/dict-order dependence shows up across PYTHONHASHSEED values)."""
    cfg = SchedulerConfig(max_num_batched_tokens=6, max_num_seqs=4, block_size=2, num_blocks=10)
    run = Run(cfg)
    out: list[object] = []
    shared = _prompt(4)
    for i in range(8):
        run.submit(f"req-{i}-{'x' * i}", [*shared[: i % 5], *_prompt(2 + i % 3, i)], max_tokens=5)
    for k in range(200):
        if not run.sched.has_unfinished:
            break
        if k == 3:
            run.sched.abort("req-2-xx")
        run.step()
        snap = run.sched.pool.snapshot()
        out.append(
            [
                [(t.request_id, list(t.block_table)) for t in snap.tables],
                list(snap.free_queue),
                sorted((e.block_id, e.key.hex()) for e in snap.cache_entries),
            ]
        )
    run.drain()
    return out


def test_free_list_reuse_order_is_deterministic() -> None:
    first, second = block_table_history(), block_table_history()
    assert first == second
    # The run really reuses freed blocks (free queue order matters).
    assert any(r[1] != sorted(r[1]) for r in first)
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    here = Path(__file__).parent
    code = _DETERMINISM.format(tests=str(here), harness=str(here.parent))
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    assert json.loads(out.stdout) == json.loads(json.dumps(first))


def test_same_workload_twice_gives_identical_block_tables_via_simulate() -> None:
    def tables() -> list[tuple[object, ...]]:
        cfg = SchedulerConfig(max_num_batched_tokens=5, max_num_seqs=3, block_size=2, num_blocks=9)
        sched = Scheduler(cfg)
        reqs = [
            Request(
                f"r{i}", _prompt(3 + i % 4, i % 2), StopParams(max_tokens=4), arrival_ms=float(i)
            )
            for i in range(7)
        ]
        res = simulate(sched, reqs, COST, check_invariants=True)
        return [(s.tokens, s.kv_blocks_used, s.plan.copies) for s in res.steps] + [
            tuple(sched.pool.snapshot().free_queue)
        ]

    assert tables() == tables()


def test_config_replace_keeps_validation() -> None:
    # dataclasses.replace re-runs __post_init__: a derived config cannot dodge checks.
    with pytest.raises(ValueError):
        replace(SchedulerConfig(), max_num_batched_tokens=0)


# ------------------------------------------------- eviction and executor faults
def test_reusing_an_evicted_cached_block_is_not_a_prefix_violation() -> None:
    run = Run(
        SchedulerConfig(
            max_num_batched_tokens=1, block_size=1, num_blocks=1, max_num_seqs=1, max_model_len=2
        )
    )
    run.submit("r1", [0], max_tokens=1)
    run.step()  # r1 caches block 0 ([0]) and finishes: block 0 is free and cached
    run.submit("r2", [0], max_tokens=1)  # no hit (last token is recomputed): evicts block 0
    run.step()


class _WritesThenFails(SimExecutor):
    """An executor that writes K/V (fake memory) and then fails, as a GPU step can.

    It cannot restore what it wrote, and says so: EngineCore's fallback for such an
    executor (drop the cache entries of every block the failed step could write) is
    what this test checks (ref/core/executor.py, ``transactional_kv``)."""

    needs_inputs = True
    transactional_kv = False

    def __init__(self, *a: object) -> None:
        super().__init__(*a)  # type: ignore[arg-type]
        self.memory: dict[int, int] = {}
        self.fail = False

    def execute(self, plan, inputs):  # type: ignore[no-untyped-def]
        for slot, tok in zip(inputs.slot_mapping.tolist(), inputs.input_ids.tolist(), strict=True):
            self.memory[slot] = tok
        if self.fail:
            self.fail = False
            raise RuntimeError("device fault after the K/V writes")
        return super().execute(plan, inputs)


def test_executor_fault_after_kv_writes_does_not_poison_the_prefix_cache() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=16, block_size=2, num_blocks=4)
    sched = Scheduler(cfg)
    ex = _WritesThenFails(COST, sched.requests)
    core = EngineCore(sched, ex, check_invariants=True)
    sched.add_request(Request("a", [1, 2, 3], StopParams(max_tokens=1)))
    core.step(0.0)  # a caches block [1, 2] and finishes
    cached = {e.block_id: e.token_ids for e in sched.pool.snapshot().cache_entries}
    sched.add_request(Request("b", [7, 8, 9, 9, 9, 9, 9], StopParams(max_tokens=1)))
    ex.fail = True
    with pytest.raises(RuntimeError):
        core.step(0.0)  # b took every block (evicting [1, 2]), wrote, then failed
    sched.abort("b")
    for b, tokens in cached.items():
        if any(e.block_id == b for e in sched.pool.snapshot().cache_entries):
            got = tuple(ex.memory.get(b * 2 + i) for i in range(2))
            assert got == tokens, f"cache says block {b} holds {tokens}, memory has {got}"
