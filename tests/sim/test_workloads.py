"""Workload generators (example 3's traces) and the closed-loop / session replay modes."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.request import Request
from refserve.core.scheduler import Scheduler
from refserve.errors import InvalidArgument
from refserve.sim.simulator import SimResult, simulate, simulate_closed_loop, simulate_sessions
from refserve.sim.trace import load_trace
from refserve.sim.workloads import (
    Workload,
    agent_sessions,
    arrival_times_ms,
    long_prompt,
    long_prompt_records,
    merge_records,
    scaled,
    short_chat,
    short_chat_records,
    to_requests,
    write_trace,
)

COST = StepCost.parse("2+0.5P+D")
CONFIG = SchedulerConfig(max_num_batched_tokens=256, block_size=16, num_blocks=2048)


def max_in_flight(result: SimResult) -> int:
    """Most requests between arrival and finish at any instant (half-open intervals)."""
    events: list[tuple[float, int]] = []
    for r in result.requests:
        assert r.finished_ms is not None
        events += [(r.arrival_ms, 1), (r.finished_ms, -1)]
    events.sort(key=lambda e: (e[0], e[1]))  # a finish before an arrival at the same time
    return max(itertools.accumulate(d for _, d in events), default=0)


# ------------------------------------------------------------------ generators
def test_arrivals_are_deterministic_and_have_the_right_mean_rate() -> None:
    a = arrival_times_ms(2000, 10.0, seed=3)
    assert a == arrival_times_ms(2000, 10.0, seed=3)
    assert a != arrival_times_ms(2000, 10.0, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(a))
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert statistics.mean(gaps) == pytest.approx(100.0, rel=0.1)  # 10 req/s


def test_lower_burstiness_means_more_variable_gaps() -> None:
    def cv2(burstiness: float) -> float:
        a = arrival_times_ms(4000, 10.0, seed=1, burstiness=burstiness)
        gaps = [y - x for x, y in itertools.pairwise(a)]
        return statistics.pvariance(gaps) / statistics.mean(gaps) ** 2

    # Gamma(shape k): squared coefficient of variation 1/k; Poisson (k=1) has 1.
    assert cv2(1.0) == pytest.approx(1.0, rel=0.15)
    assert cv2(0.25) == pytest.approx(4.0, rel=0.3)
    assert cv2(4.0) == pytest.approx(0.25, rel=0.2)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(InvalidArgument):
        arrival_times_ms(3, 0.0)
    with pytest.raises(InvalidArgument):
        arrival_times_ms(3, 1.0, burstiness=0.0)
    with pytest.raises(InvalidArgument):
        scaled(10, 0)
    with pytest.raises(InvalidArgument):
        agent_sessions(2, 1.0, turns=(3, 2))


def test_seed003_lengths_and_scale() -> None:
    chat = short_chat(300, 5.0, seed=1)
    assert 900 < statistics.mean(len(t.prompt_token_ids) for t in chat) < 1150
    assert 110 < statistics.mean(t.output_len for t in chat) < 145
    long = long_prompt(20, 1.0, seed=1, scale=16)
    assert all(3072 <= len(t.prompt_token_ids) <= 5120 for t in long)  # 64K / 16 +- 25 %
    assert all(6 <= t.output_len <= 10 for t in long)
    assert short_chat(5, 5.0, seed=2) == short_chat(5, 5.0, seed=2)


def test_agent_sessions_shape() -> None:
    sessions = agent_sessions(6, 0.5, seed=2, scale=64)
    assert sessions == agent_sessions(6, 0.5, seed=2, scale=64)
    prefix = 81920 // 64
    heads = {s.turns[0].new_token_ids[:prefix] for s in sessions}
    assert len(heads) == 1  # one agent: one shared ~80K prefix
    for s in sessions:
        assert 3 <= len(s.turns) <= 6
        assert s.turns[0].tool_wait_ms == 0.0
        for turn in s.turns[1:]:
            assert 100.0 <= turn.tool_wait_ms <= 10_000.0
            assert 12 <= len(turn.new_token_ids) <= 20  # ~1K / 64
        assert len(s.turns[0].new_token_ids) > prefix


def test_jsonl_round_trip(tmp_path: Path) -> None:
    records = merge_records(
        short_chat_records(8, 4.0, seed=1, scale=32, system_prompt_len=256),
        long_prompt_records(2, 0.5, seed=2, scale=64),
    )
    path = write_trace(tmp_path / "mixed.jsonl", records)
    loaded = load_trace(path)
    assert [t.id for t in loaded] == [r["id"] for r in records]
    chat = [t for t in loaded if t.id.startswith("chat")]
    assert len({t.prompt_token_ids[:8] for t in chat}) == 1  # the shared system prompt
    # Exact token ids round-trip too.
    exact = long_prompt(3, 1.0, seed=5, scale=64)
    assert load_trace(write_trace(tmp_path / "exact.jsonl", exact)) == exact


# ------------------------------------------------------------------ replay modes
def test_closed_loop_keeps_in_flight_at_most_concurrency() -> None:
    trace = short_chat(40, 1000.0, seed=3, scale=16)
    for concurrency in (1, 3, 8):
        result = simulate_closed_loop(
            Scheduler(CONFIG), to_requests(trace), COST, concurrency=concurrency
        )
        assert len(result.requests) == 40
        assert all(r.finish_reason is not None for r in result.requests)
        assert max_in_flight(result) == concurrency
        # Each later release happens exactly when an earlier request finished.
        finishes = {r.finished_ms for r in result.requests}
        assert all(r.arrival_ms == 0.0 or r.arrival_ms in finishes for r in result.requests)


def test_closed_loop_with_concurrency_one_serves_requests_back_to_back() -> None:
    trace = short_chat(5, 1.0, seed=4, scale=32)
    result = simulate_closed_loop(Scheduler(CONFIG), to_requests(trace), COST, concurrency=1)
    for a, b in itertools.pairwise(result.requests):
        assert b.arrival_ms == a.finished_ms


def test_closed_loop_rejects_zero_concurrency() -> None:
    with pytest.raises(InvalidArgument):
        simulate_closed_loop(Scheduler(CONFIG), [], COST, concurrency=0)


def test_open_loop_workload_matches_simulate() -> None:
    trace = short_chat(12, 20.0, seed=6, scale=32)
    a = Workload("chat", tuple(trace)).run(Scheduler(CONFIG), COST)
    b = simulate(Scheduler(CONFIG), to_requests(trace), COST)
    assert [r.token_times_ms for r in a.requests] == [r.token_times_ms for r in b.requests]


def _by_session(result: SimResult) -> dict[str, list[Request]]:
    out: dict[str, list[Request]] = {}
    for r in result.requests:
        out.setdefault(r.request_id.split("/")[0], []).append(r)
    for turns in out.values():
        turns.sort(key=lambda r: int(r.request_id.rsplit("/t", 1)[1]))
    return out


def test_session_turns_never_overlap_and_wait_for_the_tool() -> None:
    sessions = agent_sessions(5, 2.0, seed=7, scale=64)
    result = simulate_sessions(Scheduler(CONFIG), sessions, COST, check_invariants=True)
    by_session = _by_session(result)
    assert len(result.requests) == sum(len(s.turns) for s in sessions)
    for s in sessions:
        turns = by_session[s.session_id]
        assert turns[0].arrival_ms == s.start_ms
        for k, (prev, cur) in enumerate(itertools.pairwise(turns), start=1):
            assert prev.finished_ms is not None
            assert cur.arrival_ms == pytest.approx(prev.finished_ms + s.turns[k].tool_wait_ms)
            assert cur.token_times_ms[0] > prev.finished_ms
            # The next prompt is the previous prompt + its outputs + the turn's new tokens.
            assert cur.prompt_token_ids == [*prev.token_ids, *s.turns[k].new_token_ids]


def test_prefix_cache_hits_grow_across_turns() -> None:
    sessions = agent_sessions(3, 0.2, seed=8, scale=64, turns=(4, 4))
    result = simulate_sessions(Scheduler(CONFIG), sessions, COST)
    for turns in _by_session(result).values():
        cached = [r.num_cached_tokens for r in turns]
        assert all(c > 0 for c in cached[1:])
        assert all(a <= b for a, b in itertools.pairwise(cached[1:]))
        assert cached[-1] > cached[1]  # three turns append more than a block
        # Almost all of a later turn's prompt is found in the cache.
        assert cached[-1] >= turns[-1].num_prompt_tokens - 2 * 16 - 40
    off = SchedulerConfig(
        max_num_batched_tokens=256, block_size=16, num_blocks=2048, enable_prefix_caching=False
    )
    cold = simulate_sessions(Scheduler(off), sessions, COST)
    assert all(r.num_cached_tokens == 0 for r in cold.requests)
    assert cold.makespan_ms > result.makespan_ms


def test_sessions_in_closed_loop_bound_active_sessions() -> None:
    sessions = agent_sessions(6, 100.0, seed=9, scale=64, tool_wait_s=(0.1, 0.2))
    result = simulate_sessions(Scheduler(CONFIG), sessions, COST, concurrency=2)
    spans = [(turns[0].arrival_ms, turns[-1].finished_ms) for turns in _by_session(result).values()]
    assert len(spans) == 6
    for t, _ in spans:  # at each session start, at most 2 sessions are active
        assert sum(1 for a, b in spans if b is not None and a <= t < b) <= 2


def test_workload_mixes_requests_and_sessions() -> None:
    w = Workload(
        "mix",
        tuple(short_chat(4, 10.0, seed=1, scale=64)),
        tuple(agent_sessions(2, 1.0, seed=1, scale=64, turns=(2, 2))),
    )
    assert w.num_requests == 8
    result = w.run(Scheduler(CONFIG), COST)
    ids = {r.request_id for r in result.requests}
    assert len(ids) == 8 and {t.id for t in w.requests} <= ids
    assert w.max_len >= max(r.num_tokens for r in result.requests)


# ------------------------------------------------------------------ heavy-tailed outputs
def test_heavy_tail_trace_is_deterministic_and_heavy_tailed() -> None:
    from refserve.sim.workloads import HEAVY_OUTPUT_MAX, heavy_tail_records

    recs = heavy_tail_records(4000, 20.0, seed=5)
    assert recs == heavy_tail_records(4000, 20.0, seed=5)
    assert recs != heavy_tail_records(4000, 20.0, seed=6)
    outs = sorted(int(str(r["output_len"])) for r in recs)
    median, p99 = outs[len(outs) // 2], outs[int(0.99 * len(outs))]
    # Most requests are short, a few very long: the 99th percentile is tens of medians,
    # and the top 5 % of requests hold a large share of all output tokens.
    assert 40 <= median <= 200
    assert p99 > 20 * median
    top = outs[int(0.95 * len(outs)) :]
    assert sum(top) > 0.3 * sum(outs)
    assert max(outs) <= HEAVY_OUTPUT_MAX
    # Prompts stay moderate: 512 +- 50 %.
    prompts = [int(str(r["prompt_len"])) for r in recs]
    assert min(prompts) >= 256 and max(prompts) <= 768
    gaps = [
        float(str(b["arrival_ms"])) - float(str(a["arrival_ms"]))
        for a, b in itertools.pairwise(recs)
    ]
    assert statistics.mean(gaps) == pytest.approx(50.0, rel=0.1)  # 20 req/s
    # Scaled lengths are at least one token.
    small = heavy_tail_records(200, 20.0, seed=5, scale=64.0)
    assert min(int(str(r["output_len"])) for r in small) >= 1


@pytest.mark.parametrize(
    "kwargs",
    [{"alpha": 0.0}, {"alpha": float("inf")}, {"output_min": 0}, {"output_min": 9, "output_max": 8},
     {"prompt_len": 0}, {"spread": 1.0}],
)  # fmt: skip
def test_heavy_tail_trace_rejects_bad_parameters(kwargs: dict[str, float]) -> None:
    from refserve.sim.workloads import heavy_tail_records

    with pytest.raises(InvalidArgument):
        heavy_tail_records(4, 1.0, **kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------ the constrained server
def test_heavy_tight_is_the_heavy_trace_on_a_smaller_server() -> None:
    from refserve.report.sweep import BASE_CONFIG
    from refserve.report.workload_specs import TRACES, ServerLimits

    by_name = {t.name: t for t in TRACES}
    heavy, tight = by_name["heavy"], by_name["heavy-tight"]
    # The same requests at a rate: only the server differs.
    assert tight.build(24.0, 50, 16.0, 3) == heavy.build(24.0, 50, 16.0, 3)
    assert heavy.server is None and heavy.config(BASE_CONFIG) is BASE_CONFIG
    assert tight.server is not None
    cfg = tight.config(BASE_CONFIG)
    assert cfg.max_num_seqs == tight.server.max_num_seqs < BASE_CONFIG.max_num_seqs
    assert cfg.num_blocks == tight.server.num_blocks < BASE_CONFIG.num_blocks
    assert cfg.max_num_batched_tokens == BASE_CONFIG.max_num_batched_tokens
    # The longest request the trace can draw at the default scale (the output cap, the
    # prompt at +50 %) fits in the small pool: none can finish for lack of memory.
    from refserve.report.sweep import DEFAULT_SCALE
    from refserve.sim.workloads import HEAVY_OUTPUT_MAX, HEAVY_PROMPT_LEN

    longest = scaled(HEAVY_PROMPT_LEN, DEFAULT_SCALE) * 3 // 2 + scaled(
        HEAVY_OUTPUT_MAX, DEFAULT_SCALE
    )
    assert -(-longest // cfg.block_size) <= cfg.num_blocks
    for bad in ({"max_num_seqs": 0, "num_blocks": 8}, {"max_num_seqs": 4, "num_blocks": True}):
        with pytest.raises(InvalidArgument, match="ServerLimits"):
            ServerLimits(**bad)  # type: ignore[arg-type]
