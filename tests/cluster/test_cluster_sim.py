"""The cluster simulator (ref/cluster/sim.py; docs/CLUSTER.md, "The cluster simulator"):
prefix-aware routing against round robin on agent sessions, migration keeping one owner
per live request (the simulator's own map and spec/cluster.py's OWNER, asserted after
every operation) and finishing every request, the link's time as a TBT gap, and
determinism."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from refserve.cluster.router import Router
from refserve.cluster.sim import ClusterSim, LinkModel, MigrationPolicy, simulate_cluster
from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.errors import InvalidArgument
from refserve.sim.metrics import percentile
from refserve.sim.workloads import Workload, agent_sessions, long_prompt, short_chat
from refserve.spec.cluster import check_owner
from refserve.spec.violation import Invariant

COST = StepCost()
CONFIG = SchedulerConfig(
    max_num_batched_tokens=128, max_num_seqs=64, block_size=16, num_blocks=1024
)


def _agent(n: int = 12) -> Workload:
    sessions = agent_sessions(n, 2.0, seed=3, scale=16.0, num_prefixes=2, tool_wait_s=(0.1, 1.0))
    return Workload("agent", sessions=tuple(sessions))


def _pressure() -> Workload:
    # Long prompts on small pools: replicas fill, queue, and migrate.
    return Workload("long", tuple(long_prompt(10, 2.0, seed=1, scale=64.0)))


def test_prefix_aware_beats_round_robin_on_agent_sessions() -> None:
    w = _agent()
    rr = simulate_cluster(w, 4, CONFIG, COST, "round_robin")
    pa = simulate_cluster(w, 4, CONFIG, COST, "prefix_aware")
    assert len(rr.requests) == len(pa.requests) == w.num_requests
    assert pa.cached_tokens > rr.cached_tokens
    assert pa.routed_hit_tokens > rr.routed_hit_tokens

    def p50_ttft(res: object) -> float:
        ttfts = [m.ttft_ms for m in res.requests if m.ttft_ms is not None]  # type: ignore[attr-defined]
        value = percentile(ttfts, 50)
        assert value is not None
        return value

    assert p50_ttft(pa) < p50_ttft(rr)


MIGRATING = MigrationPolicy(pressure=True, rebalance=True, split_min_tokens=256)


@pytest.mark.parametrize("policy", ["round_robin", "prefix_aware"])
def test_migration_keeps_one_owner_and_finishes_every_request(policy: str) -> None:
    small = dataclasses.replace(CONFIG, num_blocks=96)
    w = Workload(
        "mixed", (*long_prompt(8, 3.0, seed=1, scale=64.0), *short_chat(30, 20.0, scale=16.0))
    )
    w = Workload("mixed", tuple(sorted(w.requests, key=lambda t: t.arrival_ms)))
    res = simulate_cluster(w, 3, small, COST, policy, migration=MIGRATING, check_ownership=True)
    assert res.moves, "the workload is sized to make the replicas migrate"
    assert {m.reason for m in res.moves} >= {"split"}
    by_id = {t.id: t for t in w.requests}
    for m in res.requests:
        assert m.finish_reason == "length", m.request_id
        assert m.num_output_tokens == by_id[m.request_id].output_len
    # A move's transfer time shows as a gap in its request's tokens (none before the
    # first token: then it adds to the TTFT).
    metrics = {m.request_id: m for m in res.requests}
    for mv in res.moves:
        times = metrics[mv.request_id].token_times_ms
        after = [t for t in times if t >= mv.land_ms]
        before = [t for t in times if t <= mv.depart_ms]
        assert len(before) + len(after) == len(times), "no token while on the link"
        if before and after:
            assert after[0] - before[-1] >= mv.transfer_ms


def test_ownership_checker_sees_a_corrupted_owner_map() -> None:
    sim = ClusterSim(2, CONFIG, COST, Router("round_robin"), check_ownership=True)
    w = Workload("chat", tuple(short_chat(4, 100.0, scale=16.0)))
    sim._arrive(sim_job(w), 0.0)
    assert sim.ownership_violations() == []
    rid = next(iter(sim.owner))
    sim.owner[rid] = 1 - sim.owner[rid]
    assert any("wrong owner" in v for v in sim.ownership_violations())
    sim.owner[rid] = 1 - sim.owner[rid]
    # Live on two replicas at once.
    assert check_owner(sim.cluster_snapshot()) == []
    r = sim.replicas[sim.owner[rid]].sched.requests[rid]
    sim.replicas[1 - sim.owner[rid]].sched.requests[rid] = r
    assert any("live on replicas" in v for v in sim.ownership_violations())
    # spec/cluster.py's OWNER sees it too (the snapshot lists it on both engines).
    assert [v.invariant for v in check_owner(sim.cluster_snapshot())] == [Invariant.OWNER]


def sim_job(w: Workload) -> object:
    from refserve.cluster import sim as cs
    from refserve.sim.workloads import to_requests

    return cs._Job(cs._single(to_requests(w.requests)[0]))


def test_same_seed_same_result_and_jitter_is_seeded() -> None:
    small = dataclasses.replace(CONFIG, num_blocks=96)
    w = _pressure()
    link = LinkModel(gb_per_s=1.0, latency_ms=1.0, jitter_ms=20.0)

    def run(seed: int) -> tuple[object, ...]:
        res = simulate_cluster(
            w, 3, small, COST, "prefix_aware", migration=MIGRATING, link=link, seed=seed
        )
        return (res.requests, res.moves, res.makespan_ms)

    a = run(0)
    assert a == run(0)
    assert a[1], "moves to time"
    assert a != run(1), "the jitter is drawn from the seed"


def test_link_time_is_latency_plus_bytes_over_bandwidth() -> None:
    import random

    link = LinkModel(gb_per_s=2.0, latency_ms=0.5)
    assert link.transfer_ms(4_000_000, random.Random(0)) == pytest.approx(2.5)
    with pytest.raises(InvalidArgument, match="gb_per_s"):
        LinkModel(gb_per_s=0.0)
    with pytest.raises(InvalidArgument, match="num_replicas"):
        ClusterSim(0, CONFIG, COST, Router())


def test_a_move_that_forgets_the_release_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted bug: the source keeps the request after it departs (no release), so it is
    live on the source while on the link; the ownership check stops the run."""
    from refserve.cluster.sim_migration import ReplicaSource

    monkeypatch.setattr(ReplicaSource, "release_request", lambda self, rid: None)
    small = dataclasses.replace(CONFIG, num_blocks=96)
    with pytest.raises(AssertionError, match="on the link and live on replica"):
        simulate_cluster(_pressure(), 3, small, COST, "round_robin", migration=MIGRATING,
                         check_ownership=True)  # fmt: skip


def test_every_simulated_move_goes_through_the_one_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator prices and hands off each move with ``engine.migration.migrate`` (its
    ends are ref/cluster/sim_migration.py): one driver call per move, each reporting the
    decision and bytes the move records."""
    from refserve.cluster import sim as cluster_sim
    from refserve.engine.migration import MigrationReport, migrate

    reports: list[MigrationReport] = []

    def spy(*args: Any, **kwargs: Any) -> MigrationReport:
        reports.append(migrate(*args, **kwargs))
        return reports[-1]

    monkeypatch.setattr(cluster_sim, "migrate", spy)
    small = dataclasses.replace(CONFIG, num_blocks=96)
    res = simulate_cluster(_pressure(), 3, small, COST, "round_robin", migration=MIGRATING,
                           check_ownership=True)  # fmt: skip
    assert res.moves
    reported = sorted((r.request_id, r.decision.mode, r.kv_bytes) for r in reports)
    assert reported == sorted((m.request_id, m.mode, m.num_bytes) for m in res.moves)
