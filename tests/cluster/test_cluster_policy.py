"""The in-process cluster's opt-in migration policy (ref/cluster/cluster.py, "Migration
policy"; the trigger rules are ref/cluster/triggers.py's, shared with the simulator):
under K/V pressure a replica moves its youngest running request to a peer with room
instead of preempting it, and a queued request moves to a peer with no queue; the moves
happen, are counted in ClusterMetrics, keep one owner per live request after every step
and every move (the cluster's own map and spec/cluster.py's OWNER over a snapshot), and
greedy outputs equal a single engine's; a long prompt is split mid-prefill to a peer
once; the policy is off by default and bad policies are typed errors."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from cluster_helpers import config, drive, final_tokens, replica

from refserve.cluster import Cluster, InProcessReplica, MigrationPolicy, Router
from refserve.cluster.triggers import MOVABLE
from refserve.core.config import SchedulerConfig
from refserve.core.migration_cost import KVMode
from refserve.engine import migration
from refserve.engine.llm_engine import LLMEngine, RequestOutput
from refserve.errors import InvalidArgument
from refserve.model.sampler import SamplingParams
from refserve.spec.cluster import ClusterSnapshot, Delivered, Node, check_owner
from refserve.spec.snapshot import RequestStatus

# Replica 0 is small (its pool fills: it would preempt; two seats: it queues), replica
# 1 roomy; round robin gives them the same requests, so replica 0 is the loaded one.
SMALL = config(4, 12, 8, max_num_seqs=4)
ROOMY = config(4, 64, 16, max_num_seqs=6)


def _workload(seed: int, num: int) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    return [
        (f"q{k}", [rng.randrange(1, 256) for _ in range(rng.randint(9, 16))], rng.randint(10, 16))
        for k in range(num)
    ]


def _reference(work: Sequence[tuple[str, list[int], int]]) -> dict[str, tuple[int, ...]]:
    engine = LLMEngine("tiny", scheduler_config=SchedulerConfig(num_blocks=128, block_size=16))
    results = engine.generate(
        [p for _, p, _ in work], [SamplingParams(max_tokens=m) for *_, m in work]
    )
    return {rid: r.outputs[0].token_ids for (rid, _, _), r in zip(work, results, strict=True)}


class _Checked(Cluster):
    """Checks both ownership rules after every move, the policy's included."""

    delivered: dict[str, Delivered]
    split: list[tuple[str, int]]  # (request, tokens computed on the source) per split

    def migrate(self, request_id: str, to: int, **kw: object) -> migration.MigrationReport:
        src = self.replicas[self.owner(request_id)]
        assert isinstance(src, InProcessReplica)
        sched = src.engine.scheduler
        moving = sched.requests[request_id]
        if kw.get("reason") == "pressure":  # the one its step would preempt: the youngest
            running = [r for r in sched.running if r.status in MOVABLE]
            assert moving.seq == max(r.seq for r in running)
        elif kw.get("reason") == "rebalance":  # queued, never started: the youngest
            assert moving.status is RequestStatus.WAITING
            waiting = [r for r in sched.requests.values() if r.status is RequestStatus.WAITING]
            assert moving.seq == max(r.seq for r in waiting)
        elif kw.get("reason") == "split":  # mid-prefill, at least half of it computed
            assert moving.status is RequestStatus.PREFILLING and not moving.num_output_tokens
            assert moving.num_prompt_tokens > moving.num_computed_tokens
            assert moving.num_computed_tokens * 2 >= moving.num_prompt_tokens
            self.split.append((request_id, moving.num_computed_tokens))
        report = super().migrate(request_id, to, **kw)  # type: ignore[arg-type]
        _check(self, f"move of {request_id!r} to {to}")
        return report


def _snapshot(c: _Checked) -> ClusterSnapshot:
    nodes = []
    for i, rep in enumerate(c.replicas):
        assert isinstance(rep, InProcessReplica)
        sched = rep.engine.scheduler
        ids = tuple((rid, tuple(r.token_ids)) for rid, r in sched.requests.items())
        nodes.append(Node(f"r{i}", sched.snapshot(), ids))
    return ClusterSnapshot(tuple(nodes), (), tuple(c.delivered.values()))


def _check(c: _Checked, what: str) -> None:
    assert c.ownership_violations() == [], what
    assert check_owner(_snapshot(c)) == [], what


def _run(
    work: Sequence[tuple[str, list[int], int]],
    policy: MigrationPolicy | None,
    configs: tuple[SchedulerConfig, SchedulerConfig] = (SMALL, ROOMY),
) -> tuple[_Checked, list[RequestOutput]]:
    c = _Checked([replica(cfg) for cfg in configs], Router("round_robin"), migration=policy)
    c.delivered, c.split = {}, []
    for rid, prompt, m in work:
        c.add_request(prompt, SamplingParams(max_tokens=m), request_id=rid)
        c.delivered[rid] = Delivered(rid)
    _check(c, "routing")
    outputs: list[RequestOutput] = []
    for i in range(2000):
        if not c.has_work:
            return c, outputs
        fresh = c.step()
        for o in fresh:
            c.delivered[o.request_id] = Delivered(o.request_id, o.token_ids, o.finished)
        outputs.extend(fresh)
        _check(c, f"step {i}")
    raise AssertionError("the cluster still has work after 2000 steps")


def _preemptions(c: Cluster) -> int:
    total = 0
    for rep in c.replicas:
        assert isinstance(rep, InProcessReplica)
        total += rep.engine.num_preemptions
    return total


@pytest.mark.parametrize("kv", [KVMode.AUTO, KVMode.TRANSFER, KVMode.RECOMPUTE])
def test_pressure_moves_instead_of_preempting(kv: KVMode) -> None:
    work = _workload(1, 8)
    ref = _reference(work)
    base, base_out = _run(work, None)
    assert base.metrics.migrations == 0 and base.moves == type(base.moves)()
    assert _preemptions(base) > 0, "the workload must put replica 0 under pressure"
    assert final_tokens(base_out) == ref
    c, out = _run(work, MigrationPolicy(pressure=True, kv=kv))
    m = c.metrics
    assert m.migrations_by_reason["pressure"] > 0
    assert m.migrations == sum(m.migrations_by_reason.values()) == len(c.moves)
    assert all(mv.reason == "pressure" and mv.source == 0 and mv.destination == 1 for mv in c.moves)
    if kv is not KVMode.AUTO:
        assert {mv.mode for mv in c.moves} == {kv}
    if kv is KVMode.TRANSFER:
        assert m.migration_bytes > 0
    assert _preemptions(c) < _preemptions(base)
    assert final_tokens(out) == ref


def test_rebalance_moves_queued_requests_to_an_idle_peer() -> None:
    work = _workload(2, 8)
    ref = _reference(work)
    c, out = _run(work, MigrationPolicy(rebalance=True))
    m = c.metrics
    assert m.migrations_by_reason["rebalance"] > 0
    assert m.migrations == m.migrations_by_reason["rebalance"] == len(c.moves)
    # A queued request has no K/V: only the request travels.
    assert m.migration_bytes == 0
    assert all(mv.source == 0 and mv.destination == 1 for mv in c.moves)
    assert final_tokens(out) == ref


@pytest.mark.parametrize("cached", [True, False])
def test_rebalance_keeps_a_request_where_its_prefix_is_cached(cached: bool) -> None:
    """Queued requests whose prompt the source caches, and the peer does not, stay
    (moving would recompute the prefix); with an uncached prompt the same ones move."""
    rng = random.Random(3)
    shared = [rng.randrange(1, 256) for _ in range(12)]
    other = [rng.randrange(1, 256) for _ in range(12)]
    c = Cluster([replica(SMALL), replica(ROOMY)])  # the policy would move "warm" too
    rep0 = c.replicas[0]
    assert isinstance(rep0, InProcessReplica)

    def place(rid: str, prompt: list[int], m: int) -> None:
        # Straight onto replica 0, past the router (the test wants it loaded).
        rep0.add_request(prompt, SamplingParams(max_tokens=m), rid)
        c._owner[rid] = 0

    place("warm", [*shared, 7], 2)
    drive(c)
    assert c.index.longest_prefix([*shared, 9]) == {0: 12, 1: 0}
    c.migration = MigrationPolicy(rebalance=True)
    head = shared if cached else other
    for k in range(6):  # four run, two queue
        place(f"s{k}", [*head, 10 + k], 3)
    assert c.ownership_violations() == []
    drive(c)  # checks ownership after every step
    if cached:
        assert c.metrics.migrations == 0 and len(c.moves) == 0
    else:
        assert c.metrics.migrations_by_reason["rebalance"] == len(c.moves) > 0


def test_both_triggers_keep_the_rules() -> None:
    work = _workload(4, 10)
    ref = _reference(work)
    c, out = _run(work, MigrationPolicy(pressure=True, rebalance=True))
    assert c.metrics.migrations == len(c.moves) > 0
    assert final_tokens(out) == ref


@pytest.mark.parametrize("kv", [KVMode.TRANSFER, KVMode.RECOMPUTE])
def test_split_moves_a_long_prompt_mid_prefill_once(kv: KVMode) -> None:
    """Replica 0 prefills 8 tokens a step, so a 40-token prompt it is given is split
    half-way (its K/V sent, or recomputed) to replica 1, which finishes it; short
    prompts stay; outputs equal one engine's."""
    rng = random.Random(5)
    work = [
        (f"q{k}", [rng.randrange(1, 256) for _ in range(40 if k % 2 == 0 else 9)], 6)
        for k in range(4)
    ]
    ref = _reference(work)
    slow, wide = config(4, 64, 8, max_num_seqs=4), config(4, 64, 48, max_num_seqs=4)
    base, base_out = _run(work, None, (slow, wide))
    assert base.metrics.migrations == 0 and final_tokens(base_out) == ref
    c, out = _run(work, MigrationPolicy(split_min_tokens=32, kv=kv), (slow, wide))
    # Round robin puts q0 and q2 (the long ones) on replica 0; a split needs a peer
    # whose load is the policy's margin below, so not both need move, but each at most once.
    split = [rid for rid, _ in c.split]
    assert split and set(split) <= {"q0", "q2"} and len(set(split)) == len(split)
    assert all(20 <= done < 40 for _, done in c.split)
    assert c.metrics.migrations == c.metrics.migrations_by_reason["split"] == len(c.moves)
    assert len(c.moves) == len(split)
    assert all(mv.source == 0 and mv.destination == 1 and mv.mode is kv for mv in c.moves)
    assert (c.metrics.migration_bytes > 0) is (kv is KVMode.TRANSFER)
    assert final_tokens(out) == ref
    assert not c._split  # the policy remembers live requests only: all finished


def test_bad_policies_are_typed_errors() -> None:
    reps = [replica(SMALL), replica(ROOMY)]
    with pytest.raises(InvalidArgument, match="split_min_tokens"):
        MigrationPolicy(split_min_tokens=0)
    with pytest.raises(InvalidArgument, match="MigrationPolicy"):
        Cluster(reps, migration="pressure")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="high_watermark"):
        MigrationPolicy(pressure=True, high_watermark=1.5)
    with pytest.raises(InvalidArgument, match="margin"):
        MigrationPolicy(rebalance=True, margin=-0.1)
