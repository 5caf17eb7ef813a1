"""The worked examples, reproduced exactly (docs/ARCHITECTURE.md, "Worked examples").

Test names keep the examples' historical ``seedNNN`` prefix: ``seed000`` is example 0,
``seed001`` example 1, ``seed002`` examples 2 to 2g, ``seed003`` example 3.

Every run goes through EngineCore with ``check_invariants=True``, so each golden step is
also checked against the whole specification.
"""

from __future__ import annotations

import math
import random

import pytest
from harness import COST, Stepper, make_request

from refserve.core.config import Admission, PolicyName, SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.request import Request, StopParams
from refserve.core.request_metrics import RequestMetrics
from refserve.core.scheduler import Scheduler
from refserve.sim.metrics import RunMetrics, littles_law_l
from refserve.sim.simulator import simulate
from refserve.sim.trace import load_trace


# ------------------------------------------------------------- example 0
def test_seed000_static_batching_takes_7_rounds_continuous_5() -> None:
    rounds = {}
    for policy in (PolicyName.STATIC, PolicyName.DECODE_FIRST):
        cfg = SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=2, block_size=16, num_blocks=16, policy=policy
        )
        trace = [t.to_request() for t in load_trace("seed000_decode")]
        result = simulate(Scheduler(cfg), trace, StepCost(1, 0, 0), check_invariants=True)
        rounds[policy] = [tuple(rid for rid, _ in s.tokens) for s in result.steps]
    assert rounds[PolicyName.STATIC] == [
        ("A", "B"),
        ("A", "B"),
        ("B",),
        ("B",),
        ("B",),
        ("C",),
        ("C",),
    ]
    assert rounds[PolicyName.DECODE_FIRST] == [
        ("A", "B"),
        ("A", "B"),
        ("B", "C"),
        ("B", "C"),
        ("B",),
    ]


# ------------------------------------------------------------- example 1
def test_seed001_round_by_round() -> None:
    """Budget 8, 3 seqs, block 4: r1 A:1 B:7; r2 A:1 B:5 C:2; r3 B:1 C:1; r4 B:1 C:1."""
    st = Stepper(
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=3, block_size=4, num_blocks=32),
        StepCost(1, 0, 0),
    )
    st.add(make_request("A", 1, 3))
    st.step()  # A's one-token prompt: it is decoding when the example's round 1 starts
    st.add(make_request("B", 12, 4, base=100))
    rounds, b_blocks = [], []
    for i in range(4):
        if i == 1:
            st.add(make_request("C", 3, 2, base=200))  # C arrives before round 2
        rec = st.step()
        rounds.append(rec.tokens)
        b_blocks.append(
            len(st.sched.pool.block_table("B")) if st.sched.pool.has_request("B") else None
        )
        if i == 1:
            assert rec.outcome.finished == ("A",)  # A ends after round 2
    assert rounds == [
        (("A", 1), ("B", 7)),
        (("A", 1), ("B", 5), ("C", 2)),
        (("B", 1), ("C", 1)),
        (("B", 1), ("C", 1)),
    ]
    # B holds 2, 3, 4, 4 blocks after r1..r4 (7, 12, 13, 14 tokens of KV).
    assert b_blocks == [2, 3, 4, 4]


def test_seed001_b_block_table_grows_in_place() -> None:
    """Example 1: earlier blocks stay where they are; growth only appends."""
    st = Stepper(
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=3, block_size=4, num_blocks=32),
        StepCost(1, 0, 0),
    )
    st.add(make_request("B", 12, 4))
    tables = []
    for _ in range(3):
        st.step()
        tables.append(st.sched.pool.block_table("B"))
    assert [len(t) for t in tables] == [2, 3, 4]
    assert tables[1][:2] == tables[0] and tables[2][:3] == tables[1]


# ------------------------------------------------------- examples 2 to 2g
def test_seed002_worked_example() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=8, block_size=4, num_blocks=64)
    trace = [t.to_request() for t in load_trace("seed002")]
    result = simulate(Scheduler(cfg), trace, COST, check_invariants=True)
    m = {r.request_id: RequestMetrics.of(r) for r in result.requests}
    assert {k: v.ttft_ms for k, v in m.items()} == {"A": 8.0, "B": 6.0, "C": 10.5}
    assert m["A"].itl_ms == (5.0, 3.5) and m["B"].itl_ms == (5.0,) and m["C"].itl_ms == (3.0,)
    assert result.makespan_ms == 19.5
    run = RunMetrics.of(list(m.values()), result.makespan_ms)
    assert round(run.output_tokens_per_s, 2) == 358.97
    assert run.output_tokens == 7 and run.input_tokens == 11


@pytest.mark.parametrize(
    ("budget", "prompt_done", "old_tokens"), [(14, 10.0, [10.0]), (6, 18.0, [6.0, 12.0, 18.0])]
)
def test_seed002_budget_14_vs_6(budget: int, prompt_done: float, old_tokens: list[float]) -> None:
    st = Stepper(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, block_size=4, num_blocks=64)
    )
    st.add(make_request("D1", 1, 20), make_request("D2", 1, 20, base=50))
    st.step()  # both prompts: now two decodes are running
    t0 = st.clock
    x = make_request("X", 12, 2, arrival_ms=t0, base=100)
    st.add(x)
    while not x.token_times_ms:
        st.step()
    assert x.token_times_ms[0] - t0 == prompt_done
    d1 = st.sched.requests["D1"]
    assert [t - t0 for t in d1.token_times_ms[1:]] == old_tokens


def test_seed002_p7_d5_exercise() -> None:
    """Budget 12, 5 decodes, A needs 10 prefill, B waits: A gets 7, B 0; 10.5 ms."""
    st = Stepper(
        SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=16, block_size=4, num_blocks=64)
    )
    st.add(*[make_request(f"D{i}", 1, 20, base=10 * i) for i in range(5)])
    st.step()
    st.add(make_request("A", 10, 2, base=100), make_request("B", 4, 2, base=200))
    rec = st.step()
    assert dict(rec.tokens) == {"D0": 1, "D1": 1, "D2": 1, "D3": 1, "D4": 1, "A": 7}
    assert (rec.num_prefill_tokens, rec.num_decodes) == (7, 5)
    assert rec.end_ms - rec.start_ms == 10.5


def _starvation_run(reserve: int) -> int | None:
    """Budget 8, always 8 decodes: the step at which a waiting prompt first computes."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=8,
        max_num_seqs=16,
        block_size=4,
        num_blocks=256,
        prefill_reserve_tokens=reserve,
        prefill_reserve_after_steps=4,
    )
    st = Stepper(cfg)
    st.add(*[make_request(f"D{i}", 1, 10_000, base=10 * i) for i in range(8)])
    st.step()
    st.add(make_request("X", 6, 2, base=500))
    for i in range(60):
        rec = st.step()
        if "X" in dict(rec.tokens):
            return i
    return None


def test_seed002_decode_first_starves_prefill() -> None:
    assert _starvation_run(reserve=0) is None


def test_seed002_prefill_reserve_admits_starving_prompt() -> None:
    first = _starvation_run(reserve=2)
    assert first is not None and first <= 4


def _admission_example(**kw: object) -> bool:
    """1000 blocks of 16, 900 used, a 1600-token prompt (100 blocks): admitted?"""
    cfg = SchedulerConfig(
        max_num_batched_tokens=16384,
        max_num_seqs=8,
        block_size=16,
        num_blocks=1000,
        enable_prefix_caching=False,
        **kw,
    )  # type: ignore[arg-type]
    st = Stepper(cfg)
    st.add(make_request("R", 14399, 1000))  # 900 blocks; its next decode fits in block 900
    st.step()
    assert st.sched.pool.num_used_blocks == 900
    st.add(make_request("X", 1600, 8, base=20000))
    rec = st.step()
    return "X" in dict(rec.tokens)


def test_seed002_admission_needs_growth_headroom() -> None:
    assert _admission_example() is True  # first-chunk admission: 100 needed, 100 free
    assert _admission_example(watermark_blocks=10) is False
    assert _admission_example(admission=Admission.SEQUENCE) is False


def test_seed002_four_latencies() -> None:
    """Arrives 10, admitted 30, tokens at 70, 90, 125, 150 ms."""
    m = RequestMetrics("r", 10.0, 30.0, (70.0, 90.0, 125.0, 150.0), 150.0, "length", 5, 4, 0, 0)
    assert m.queue_ms == 20 and m.ttft_ms == 60 and m.e2e_ms == 140
    assert m.itl_ms == (20.0, 35.0, 25.0)
    assert m.tpot_ms is not None and round(m.tpot_ms, 2) == 26.67


def test_seed002_littles_law() -> None:
    assert littles_law_l(16.0, 0.75) == 12.0
    # On the simulator's own timeline: integrate N(t) over step boundaries and compare
    # with arrival rate x mean time in system.
    rng = random.Random(2)
    t, reqs = 0.0, []
    for i in range(120):
        t += rng.expovariate(1 / 40.0)
        reqs.append(
            make_request(
                f"r{i}",
                rng.randint(4, 40),
                rng.randint(1, 12),
                arrival_ms=round(t, 3),
                base=100 * i,
            )
        )
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, block_size=4, num_blocks=256)
    result = simulate(Scheduler(cfg), reqs, COST, check_invariants=False)
    events = sorted(
        [(r.arrival_ms, 1) for r in result.requests]
        + [(r.token_times_ms[-1], -1) for r in result.requests]
    )
    area, n, prev = 0.0, 0, events[0][0]
    for when, delta in events:
        area += n * (when - prev)
        n, prev = n + delta, when
    duration = result.makespan_ms
    metrics = [RequestMetrics.of(r) for r in result.requests]
    run = RunMetrics.of(metrics, duration)
    lam = len(metrics) / duration
    mean_w = sum(m.e2e_ms or 0.0 for m in metrics) / len(metrics)
    assert math.isclose(area / duration, littles_law_l(lam, mean_w), rel_tol=1e-9)
    assert math.isclose(run.mean_in_system, area / duration, rel_tol=1e-9)


# ------------------------------------------------------------- example 3
def test_seed003_prefix_hit_and_block_aligned_chunk() -> None:
    """Budget 1024, 3 decodes, a 10K prompt with a 6K prefix hit, 70 free blocks.

    The decodes need no new block this step, so 1021 tokens are left; aligned to blocks
    the chunk is 1008 tokens (63 blocks), which fits the 70 free blocks.
    """
    prefix = [7 + (i % 1000) for i in range(6000)]
    cfg = SchedulerConfig(
        max_num_batched_tokens=1024,
        max_num_seqs=8,
        block_size=16,
        num_blocks=577 + 70,
        align_chunks_to_blocks=True,
    )
    st = Stepper(cfg)
    s = Request("S", [*prefix, 99_999], StopParams(max_tokens=50, ignore_eos=True))  # 376 blocks
    # d1 holds 200 blocks so the pool (647) can hold X's whole 625-block prompt at all.
    st.add(s, make_request("d1", 3199, 50, base=40_000), make_request("d2", 1, 50, base=50_000))
    while any(r.num_output_tokens == 0 for r in st.sched.requests.values()):
        st.step()
    assert st.sched.pool.num_free_blocks == 70
    shared = st.sched.pool.block_table("S")[:375]
    x = Request(
        "X",
        [*prefix, *[60_000 + i for i in range(4000)]],
        StopParams(max_tokens=4, ignore_eos=True),
    )
    st.add(x)
    rec = st.step()
    tokens = dict(rec.tokens)
    assert (tokens["S"], tokens["d1"], tokens["d2"]) == (1, 1, 1)
    assert tokens["X"] == 1008  # 1021 left, cut to a block boundary: 63 blocks
    chunk = next(c for c in rec.plan.chunks if c.request_id == "X")
    assert (chunk.start, chunk.num_new_cached_tokens) == (6000, 6000)
    table = st.sched.pool.block_table("X")
    assert table[:375] == shared and len(table) == 375 + 63
    ref = st.sched.pool.snapshot().ref_cnt
    assert all(ref[b] == 2 for b in shared)  # the 6K shared blocks only gained references
    assert st.sched.pool.num_free_blocks == 70 - 63


def test_cli_simulate_prints_seed002_numbers(
    capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    from pathlib import Path

    from refserve.cli.main import main

    out_json = Path(str(tmp_path)) / "run.json"
    code = main(
        [
            "simulate",
            "seed002",
            "--max-num-batched-tokens",
            "4",
            "--block-size",
            "4",
            "--num-blocks",
            "64",
            "--cost",
            "2+0.5P+D",
            "--check",
            "--json",
            str(out_json),
        ]
    )
    text = capsys.readouterr().out
    assert code == 0
    assert "makespan 19.50 ms" in text and "output 358.97 tok/s" in text
    lines = {
        ln.split()[0]: ln for ln in text.splitlines() if ln.strip().startswith(("A ", "B ", "C "))
    }
    assert "8.00" in lines["A"] and "[5, 3.5]" in lines["A"]
    assert "6.00" in lines["B"] and "10.50" in lines["C"]
    import json

    data = json.loads(out_json.read_text())
    assert [r["ttft_ms"] for r in data["requests"]] == [8.0, 6.0, 10.5]
    assert data["iterations"][2]["scheduled"] == [
        {"id": "A", "tokens": 1},
        {"id": "B", "tokens": 1},
        {"id": "C", "tokens": 2},
    ]
