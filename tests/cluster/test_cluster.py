"""The in-process cluster (ref/cluster/cluster.py; docs/CLUSTER.md, "The in-process
cluster"): greedy requests routed over three replicas that differ in block size, pool
and budget, and migrated between them at drawn step boundaries, produce a single
engine's tokens; every live request is owned by exactly one replica after every step
and every migration; the global index answers each replica's own lookup after every
step; prefix-aware routing gets more prefix hits than round robin on sessions sharing
prefixes (both measured here); aborts, a failed migration, a lost event and a failed
replica step keep the rules; bad input is a typed error that changes nothing."""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence

import pytest
from cluster_helpers import CONFIGS, config, drive, final_tokens, replica

from refserve.cluster import (
    Cluster,
    InProcessReplica,
    ReplicaMismatch,
    Router,
    UnknownPolicy,
    UnknownReplica,
)
from refserve.core.config import SchedulerConfig
from refserve.core.migration_cost import KVMode
from refserve.core.transit import InvalidMigrationArgument, MigrationError
from refserve.engine.llm_engine import InvalidPrompt, LLMEngine, RequestOutput
from refserve.engine.migration import MigrationAborted
from refserve.errors import DuplicateRequest, ExceedsCapacity, InvalidArgument, UnknownRequest
from refserve.model.sampler import InvalidSamplingParams, SamplingParams

POLICIES = ("round_robin", "least_loaded", "prefix_aware", "slo_aware")


def _workload(seed: int, num_requests: int) -> list[tuple[str, list[int], int]]:
    """(id, prompt, max_tokens): prompts on four shared prefixes of 6 to 21 tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 256) for _ in range(rng.randint(6, 21))] for _ in range(4)]
    out = []
    for k in range(num_requests):
        tail = [rng.randrange(1, 256) for _ in range(rng.randint(1, 7))]
        out.append((f"q{k}", [*rng.choice(prefixes), *tail], rng.randint(1, 9)))
    return out


def _reference(work: Sequence[tuple[str, list[int], int]]) -> dict[str, tuple[int, ...]]:
    """Each request alone on one engine (greedy)."""
    engine = LLMEngine("tiny", scheduler_config=SchedulerConfig(num_blocks=64, block_size=16))
    results = engine.generate(
        [p for _, p, _ in work], [SamplingParams(max_tokens=m) for *_, m in work]
    )
    return {rid: r.outputs[0].token_ids for (rid, _, _), r in zip(work, results, strict=True)}


def _cluster(policy: str) -> Cluster:
    return Cluster([replica(c) for c in CONFIGS], Router(policy))


def _check_index(cluster: Cluster, prompts: Sequence[Sequence[int]]) -> None:
    for p in prompts:
        hits = cluster.index.longest_prefix(p)
        assert hits == {r: rep.prefix_hit_tokens(p) for r, rep in enumerate(cluster.replicas)}


@pytest.mark.parametrize("migrate", [False, True], ids=["routed", "migrated"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_cluster_produces_a_single_engines_tokens(policy: str, migrate: bool) -> None:
    work = _workload(seed=POLICIES.index(policy), num_requests=10)
    want = _reference(work)
    cluster = _cluster(policy)
    rng = random.Random(7)
    pending = list(work)
    moved = 0

    def between_steps(i: int) -> None:
        nonlocal moved
        _check_index(cluster, [p for _, p, _ in work])
        for _ in range(rng.randint(0, 2)):  # arrivals spread over the run
            if pending:
                rid, prompt, m = pending.pop(0)
                cluster.add_request(prompt, SamplingParams(max_tokens=m), request_id=rid)
        owners = cluster.owners
        if migrate and owners and rng.random() < 0.4:
            rid = rng.choice(sorted(owners))
            to = rng.choice([r for r in range(3) if r != owners[rid]])
            how = rng.choice(
                [(KVMode.TRANSFER, None), (KVMode.TRANSFER, 1), (KVMode.RECOMPUTE, None)]
            )
            try:
                cluster.migrate(rid, to, kv=how[0], chunk_blocks=how[1])
            except MigrationError:  # the destination has no room now: it stays put
                assert cluster.owner(rid) == owners[rid]
            else:
                assert cluster.owner(rid) == to
                moved += 1

    rid, prompt, m = pending.pop(0)
    cluster.add_request(prompt, SamplingParams(max_tokens=m), request_id=rid)
    outputs = drive(cluster, each_step=between_steps)
    while pending:  # the run ended before every arrival: the rest, then drive again
        rid, prompt, m = pending.pop(0)
        cluster.add_request(prompt, SamplingParams(max_tokens=m), request_id=rid)
        outputs += drive(cluster, each_step=between_steps)
    assert final_tokens(outputs) == want
    assert cluster.owners == {} and cluster.ownership_violations() == []
    m = cluster.metrics
    assert m.decisions_by_policy == {policy: len(work)}
    assert sum(m.routed_by_replica.values()) == len(work)
    assert m.migrations == moved and (moved > 0) == migrate
    if migrate:
        assert m.migration_bytes > 0  # some moves transferred K/V


def _sessions(policy: str) -> tuple[int, int]:
    """Four sessions of five turns each on three replicas, a turn of every session per
    wave (sent together, then run to completion). Returns the prefix-hit tokens at
    routing and those the replicas used."""
    rng = random.Random(11)
    prefixes = [[rng.randrange(1, 256) for _ in range(24)] for _ in range(4)]
    cluster = Cluster.in_process(3, scheduler_config=config(4, 64, 16), router=Router(policy))
    for wave in range(5):
        for s, prefix in enumerate(prefixes):
            turn = [*prefix, *(rng.randrange(1, 256) for _ in range(3))]
            cluster.add_request(turn, SamplingParams(max_tokens=2), request_id=f"s{s}-{wave}")
        drive(cluster)
    used = 0
    for rep in cluster.replicas:
        assert isinstance(rep, InProcessReplica)
        used += rep.engine.num_prefix_hit_tokens
    return cluster.metrics.prefix_hit_tokens_at_routing, used


def test_prefix_aware_routing_gets_more_prefix_hits_than_round_robin() -> None:
    rr_routed, rr_used = _sessions("round_robin")
    pa_routed, pa_used = _sessions("prefix_aware")
    assert pa_routed > rr_routed
    assert pa_used > rr_used
    # What the router saw at routing is what the replicas then reused.
    assert (rr_routed, pa_routed) == (rr_used, pa_used)


def test_an_abort_ends_ownership_and_its_output_comes_once() -> None:
    cluster = _cluster("round_robin")
    for k in range(3):
        cluster.add_request(
            [5, 6, 7, 8, 9, k + 1], SamplingParams(max_tokens=6), request_id=f"a{k}"
        )
    outputs = cluster.step()
    cluster.abort("a1")
    assert "a1" not in cluster.owners and cluster.ownership_violations() == []
    with pytest.raises(UnknownRequest):
        cluster.abort("a1")
    outputs += drive(cluster)
    finals = [o for o in outputs if o.finished]
    assert sorted(o.request_id for o in finals) == ["a0", "a1", "a2"]
    assert next(o for o in finals if o.request_id == "a1").finish_reason == "abort"


def test_a_failed_migration_leaves_the_request_where_it_was() -> None:
    work = _workload(seed=5, num_requests=3)
    want = _reference(work)
    cluster = _cluster("least_loaded")
    for rid, prompt, m in work:
        cluster.add_request(prompt, SamplingParams(max_tokens=m), request_id=rid)
    cluster.step()
    rid = "q0"
    src = cluster.owner(rid)

    def fault(point: str) -> None:
        if point == "mid_stream":
            raise RuntimeError("link down")

    with pytest.raises(MigrationAborted):
        cluster.migrate(rid, (src + 1) % 3, kv="transfer", chunk_blocks=1, fault=fault)
    assert cluster.owner(rid) == src and cluster.ownership_violations() == []
    assert (cluster.metrics.migrations, cluster.metrics.migrations_aborted) == (0, 1)
    assert final_tokens(drive(cluster)) == want


def test_a_gap_in_a_replicas_events_resyncs_the_index(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = _cluster("round_robin")
    rep = cluster.replicas[0]
    assert isinstance(rep, InProcessReplica)
    real = rep.drain_cache_events
    lost: list[object] = []

    def lossy() -> list[object]:  # one batch lost on the way
        lost.extend(real())
        monkeypatch.setattr(rep, "drain_cache_events", real)
        return []

    prompt = list(range(1, 14))
    cluster.add_request(prompt, SamplingParams(max_tokens=12), request_id="g")
    monkeypatch.setattr(rep, "drain_cache_events", lossy)
    cluster.step()  # a chunk of the prompt: its blocks' events are the lost ones
    assert lost and cluster.metrics.index_resyncs == 0
    outputs = drive(cluster)  # later blocks are stored: their events start past a gap
    assert cluster.metrics.index_resyncs == 1
    pool = rep.engine.scheduler.pool.snapshot()
    assert cluster.index.entries(0) == {e.key: e.block_id for e in pool.cache_entries}
    _check_index(cluster, [prompt, [*prompt, *final_tokens(outputs)["g"]]])


class Boom(Exception):
    pass


def test_a_failed_replica_step_holds_the_other_replicas_outputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Short prompts: one prefill step each, then every step decodes on every replica.
    work = [(f"f{k}", [7, 8, 9, k + 1], 6) for k in range(4)]
    want = _reference(work)
    cluster = _cluster("round_robin")
    for rid, prompt, m in work:
        cluster.add_request(prompt, SamplingParams(max_tokens=m), request_id=rid)
    first, failing = cluster.replicas[0], cluster.replicas[1]
    assert isinstance(first, InProcessReplica) and isinstance(failing, InProcessReplica)

    def once(point: str) -> None:
        if point == "after_forward":
            failing.engine.executor.fault_hook = None
            raise Boom(point)

    outputs = cluster.step() + cluster.step()
    real_step = first.step
    held: list[RequestOutput] = []

    def spy() -> list[RequestOutput]:
        out = real_step()
        held.extend(out)
        return out

    monkeypatch.setattr(first, "step", spy)
    failing.engine.executor.fault_hook = once
    with pytest.raises(Boom):
        cluster.step()  # replica 0 stepped; its outputs are held
    assert held and all(o.new_token_ids for o in held)
    assert cluster.ownership_violations() == []
    outputs += drive(cluster)
    assert final_tokens(outputs) == want
    streamed: dict[str, list[int]] = {}
    for o in outputs:  # every token delivered once, in order
        streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert {rid: tuple(t) for rid, t in streamed.items()} == want


def _state(cluster: Cluster) -> tuple[object, ...]:
    return (
        cluster.owners,
        copy.deepcopy(cluster.metrics),
        len(cluster.decisions),
        cluster.router._last,
        [rep.request_ids() for rep in cluster.replicas],
    )


def test_bad_requests_are_typed_errors_that_change_nothing() -> None:
    cluster = _cluster("round_robin")
    cluster.add_request([1, 2, 3], request_id="x")
    before = _state(cluster)
    altered = SamplingParams(max_tokens=2)
    object.__setattr__(altered, "temperature", -1.0)  # the replica checks it again
    bad: list[tuple[object, dict[str, object], type[Exception]]] = [
        ([4, 5], {"request_id": "x"}, DuplicateRequest),
        ([4, 5], {"request_id": "y#1"}, InvalidArgument),
        ([4, 5], {"request_id": ""}, InvalidArgument),
        ([4, 5], {"request_id": 3}, InvalidArgument),
        ([], {}, InvalidPrompt),
        ("", {}, InvalidPrompt),
        (b"ab", {}, InvalidPrompt),
        (7, {}, InvalidPrompt),
        ([1, 259], {}, InvalidPrompt),
        ([1, -1], {}, InvalidPrompt),
        ([1, True], {}, InvalidPrompt),
        ([1, 2.0], {}, InvalidPrompt),
        ([1] * 300, {}, ExceedsCapacity),  # routed, then refused by the replica
        ([4, 5], {"params": altered}, InvalidSamplingParams),
    ]
    for prompt, kw, error in bad:
        with pytest.raises(error):
            cluster.add_request(prompt, **kw)  # type: ignore[arg-type]
        assert _state(cluster) == before, (prompt, kw)
    for rid, to, error in [
        ("nope", 1, UnknownRequest),
        ("x", 3, UnknownReplica),
        ("x", -1, UnknownReplica),
        ("x", True, UnknownReplica),
        ("x", 0, InvalidArgument),  # already there
    ]:
        with pytest.raises(error):
            cluster.migrate(rid, to)  # type: ignore[arg-type]
        assert _state(cluster) == before
    with pytest.raises(UnknownRequest):
        cluster.owner("nope")
    assert final_tokens(drive(cluster)).keys() == {"x"}


def test_a_cluster_is_built_only_from_matching_replicas() -> None:
    with pytest.raises(InvalidArgument, match="at least one replica"):
        Cluster([])
    with pytest.raises(InvalidArgument, match="not a Replica"):
        Cluster([object()])  # type: ignore[list-item]
    with pytest.raises(ReplicaMismatch, match="replica 1 runs"):
        Cluster([replica(CONFIGS[0]), replica(CONFIGS[0], model_seed=1)])
    with pytest.raises(InvalidArgument, match="cache_events=True"):
        InProcessReplica(LLMEngine("tiny"))
    with pytest.raises(InvalidArgument, match="router must be a Router"):
        Cluster([replica(CONFIGS[0])], "prefix_aware")  # type: ignore[arg-type]
    with pytest.raises(UnknownPolicy):
        Cluster.in_process(2, router=Router("fastest"))
    for n in (0, True, 1.5):
        with pytest.raises(InvalidArgument, match="num_replicas"):
            Cluster.in_process(n)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="2 replicas but 3 scheduler configs"):
        Cluster.in_process(2, scheduler_config=CONFIGS)
    # An engine that served before it joined: the index starts from its snapshot.
    rep = replica(CONFIGS[0])
    rep.engine.generate([list(range(1, 14))], SamplingParams(max_tokens=2))
    cluster = Cluster([rep, replica(CONFIGS[1])])
    assert cluster.index.longest_prefix(list(range(1, 15))) == {0: 12, 1: 0}


class _Remote:
    """Stands for a replica behind another transport: the protocol, delegated."""

    def __init__(self, inner: InProcessReplica) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def test_migration_to_another_transport_goes_by_ticket() -> None:
    """Not both in process: the move goes by ticket (the K/V inline; the Ray transport's
    path, tests/cluster/test_cluster_faults.py checks its tokens); the in-process
    protocol's streaming and fault hooks are refused there, changing nothing."""
    cluster = Cluster([replica(CONFIGS[0]), _Remote(replica(CONFIGS[1]))])  # type: ignore[list-item]
    cluster.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=4), request_id="m")
    cluster.step()
    with pytest.raises(InvalidArgument, match="goes by ticket"):
        cluster.migrate("m", 1, chunk_blocks=1)
    assert cluster.owner("m") == 0 and cluster.metrics.migrations_aborted == 0
    report = cluster.migrate("m", 1, kv="transfer")
    assert cluster.owner("m") == 1 and report.kv_bytes > 0 and cluster.metrics.migrations == 1
    assert final_tokens(drive(cluster)).keys() == {"m"}


def test_bad_migration_arguments_are_refused_on_both_paths() -> None:
    """One check of the driver's arguments (``MigrationArgs.check``) on the in-process
    path and the by-ticket one: a typed error naming the argument, nothing moved, no
    migration counted as aborted."""
    cluster = Cluster([replica(CONFIGS[0]), replica(CONFIGS[1]), _Remote(replica(CONFIGS[2]))])  # type: ignore[list-item]
    cluster.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=4), request_id="m")
    cluster.step()
    src = cluster.owner("m")
    for to in (r for r in range(3) if r != src):
        for kw, argument in (
            ({"chunk_blocks": 0, "kv": "recompute"}, "chunk_blocks"),
            ({"kv": "x"}, "kv"),
        ):
            with pytest.raises(InvalidMigrationArgument) as err:
                cluster.migrate("m", to, **kw)  # type: ignore[arg-type]
            assert err.value.argument == argument
    assert cluster.owner("m") == src and cluster.metrics.migrations_aborted == 0
