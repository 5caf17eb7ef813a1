"""A replica that dies, in the in-process ``Cluster`` (docs/CLUSTER.md, "Faults"), and
the ticket path of ``Cluster.migrate`` between replicas that are not both in process
(what the Ray transport uses), here over a proxy that hides the engine.

A dead replica (:class:`ReplicaDead` from any call) is buried: each request it held ends
once with that error in ``take_failures``, none is live anywhere or delivered twice, the
others run on to the single engine's tokens, and no later request is routed to it. With a
restart factory a fresh replica takes its slot, empty, and serves again, up to the
limit."""

from __future__ import annotations

from typing import Any

import pytest
from cluster_helpers import CONFIGS, final_tokens, replica

from refserve.cluster import Cluster, InProcessReplica, NoLiveReplica, ReplicaDead, Router
from refserve.engine.llm_engine import RequestOutput
from refserve.errors import InvalidArgument
from refserve.model.sampler import SamplingParams

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


class Proxy:
    """A replica behind a wall: every call forwarded to an in-process replica, which
    the cluster cannot see through (so migration takes the ticket path). ``die_at``:
    the step number from which every call raises :class:`ReplicaDead`."""

    def __init__(self, inner: InProcessReplica, name: int, die_at: int | None = None) -> None:
        self._inner, self._name, self._die_at, self._steps = inner, name, die_at, 0

    def _check(self) -> None:
        if self._die_at is not None and self._steps >= self._die_at:
            raise ReplicaDead(self._name, "killed by the test")

    def step(self) -> list[RequestOutput]:
        self._check()
        self._steps += 1
        return self._inner.step()

    def __getattr__(self, name: str) -> Any:
        if name not in ("block_size", "identity", "encode", "cache_snapshot"):
            self._check()
        return getattr(self._inner, name)


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 250 + 1 for j in range(9 + i)] for i in range(n)]


def _single(prompts: list[list[int]]) -> dict[str, tuple[int, ...]]:
    single = Cluster([replica(CONFIGS[0])])
    for i, p in enumerate(prompts):
        single.add_request(p, PARAMS, request_id=f"r{i}")
    outs: list[RequestOutput] = []
    while single.has_work:
        outs.extend(single.step())
    return final_tokens(outs)


def test_a_dead_replica_ends_its_requests_once_and_gets_no_more() -> None:
    prompts = _prompts(6)
    dying = Proxy(replica(CONFIGS[1]), 1, die_at=3)
    cluster = Cluster([replica(CONFIGS[0]), dying], Router("round_robin"))
    for i, p in enumerate(prompts):
        cluster.add_request(p, PARAMS, request_id=f"r{i}")
    on_1 = {rid for rid, r in cluster.owners.items() if r == 1}
    assert on_1 == {"r1", "r3", "r5"}
    outs: list[RequestOutput] = []
    failures: dict[str, ReplicaDead] = {}
    while cluster.has_work:
        outs.extend(cluster.step())
        for rid, err in cluster.take_failures().items():
            assert rid not in failures  # each once
            failures[rid] = err
        assert cluster.ownership_violations() == []
    assert set(failures) == on_1 and all(e.replica == 1 for e in failures.values())
    done = final_tokens(outs)
    assert not set(done) & set(failures)  # ended by the error, never also finished
    want = _single(prompts)
    assert done == {rid: want[rid] for rid in want if rid not in failures}
    assert set(cluster.dead) == {1} and cluster.metrics.requests_failed == 3
    for i in range(4):  # the router sees replica 0 only
        d = cluster.add_request(prompts[i], PARAMS, request_id=f"late{i}")
        assert d.replica == 0 and [f.replica for f in d.figures] == [0]
    with pytest.raises(ReplicaDead):
        cluster.migrate("late0", 1)


def test_a_replica_found_dead_at_routing_is_skipped() -> None:
    first = Proxy(replica(CONFIGS[0]), 0)
    cluster = Cluster([first, replica(CONFIGS[1])])
    first._die_at = 0  # dies after joining, before any request
    d = cluster.add_request([1, 2, 3, 4, 5], PARAMS, request_id="a")
    assert d.replica == 1 and set(cluster.dead) == {0} and cluster.take_failures() == {}
    only = Proxy(replica(CONFIGS[0]), 0)
    lone = Cluster([only])
    only._die_at = 0
    with pytest.raises(NoLiveReplica):
        lone.add_request([1, 2, 3], PARAMS, request_id="b")
    assert lone.owners == {}


@pytest.mark.parametrize("kv", ["transfer", "recompute", "auto"])
def test_migration_by_ticket_keeps_the_tokens(kv: str) -> None:
    prompts = _prompts(3)
    a, b = Proxy(replica(CONFIGS[0]), 0), Proxy(replica(CONFIGS[2]), 1)
    cluster = Cluster([a, b], Router("least_loaded"))
    for i, p in enumerate(prompts):
        cluster.add_request(p, PARAMS, request_id=f"r{i}")
    outs: list[RequestOutput] = []
    reports = []
    for step in range(300):
        if not cluster.has_work:
            break
        if step in (2, 5):  # mid-prefill or early decode, then back
            rid = "r0"
            reports.append(cluster.migrate(rid, 1 - cluster.owner(rid), kv=kv))
            assert cluster.ownership_violations() == []
        outs.extend(cluster.step())
        assert cluster.ownership_violations() == []
    assert final_tokens(outs) == _single(prompts)
    assert cluster.metrics.migrations == 2
    assert cluster.metrics.migration_bytes == sum(r.kv_bytes for r in reports)
    if kv == "transfer":
        assert all(r.kv_bytes > 0 for r in reports)
    if kv == "recompute":
        assert all(r.kv_bytes == 0 for r in reports)


def test_a_dead_replica_is_replaced_and_serves_again() -> None:
    """With a restart factory (``max_restarts=1``) the dead replica's requests still end
    once with the error, but a fresh replica takes its slot at once: in the index from
    its own empty cache (nothing of the dead one's), served by the router, giving the
    single engine's tokens; dead again past the limit, the slot stays dead."""
    prompts = _prompts(6)
    made: list[Proxy] = []

    def restart(slot: int) -> Proxy:
        made.append(Proxy(replica(CONFIGS[1]), slot))
        return made[-1]

    dying = Proxy(replica(CONFIGS[1]), 1, die_at=3)
    cluster = Cluster(
        [replica(CONFIGS[0]), dying], Router("round_robin"), restart=restart, max_restarts=1
    )
    for i, p in enumerate(prompts):
        cluster.add_request(p, PARAMS, request_id=f"r{i}")
    outs: list[RequestOutput] = []
    failures: dict[str, ReplicaDead] = {}
    cached_before = None
    while cluster.has_work:
        outs.extend(cluster.step())
        if cached_before is None:  # r1 prefilled on replica 1: its first block cached
            cached_before = cluster.index.longest_prefix(prompts[1]).get(1)
        for rid, err in cluster.take_failures().items():
            assert rid not in failures
            failures[rid] = err
        assert cluster.ownership_violations() == []
    assert set(failures) == {"r1", "r3", "r5"} and cached_before == 8
    want = _single(prompts)
    assert final_tokens(outs) == {rid: want[rid] for rid in ("r0", "r2", "r4")}
    assert cluster.dead == {} and cluster.replicas[1] is made[0]
    m = cluster.metrics
    assert (m.replicas_dead, m.replicas_restarted, m.requests_failed) == (1, 1, 3)
    assert cluster.index.longest_prefix(prompts[1]).get(1) == 0  # a resync, not a replay
    late = [cluster.add_request(prompts[i], PARAMS, request_id=f"late{i}") for i in range(4)]
    assert [d.replica for d in late] == [0, 1, 0, 1]  # the fresh one is routed to
    done: list[RequestOutput] = []
    while cluster.has_work:
        done.extend(cluster.step())
        assert cluster.ownership_violations() == []
    assert final_tokens(done) == {f"late{i}": want[f"r{i}"] for i in range(4)}
    made[0]._die_at = 0  # past its limit: buried for good, its request routed to 0
    d = cluster.add_request(prompts[0], PARAMS, request_id="last")
    assert d.replica == 0 and set(cluster.dead) == {1} and len(made) == 1
    assert (m.replicas_dead, m.replicas_restarted) == (2, 1)


def test_bad_restart_settings_are_typed_errors() -> None:
    reps = [replica(CONFIGS[0])]
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(InvalidArgument, match="max_restarts"):
            Cluster(reps, restart=lambda _: replica(CONFIGS[0]), max_restarts=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="needs a restart factory"):
        Cluster(reps, max_restarts=1)
    with pytest.raises(InvalidArgument, match="restart must"):
        Cluster(reps, restart=7, max_restarts=1)  # type: ignore[arg-type]
