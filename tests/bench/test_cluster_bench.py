"""The cluster at scale (docs/CLUSTER.md, "Scale"): the router's
decision cost per request at 8, 64 and 1,024 replicas, the global prefix index's memory
per cached block, and the cluster simulator at 64 replicas x 100k requests with a flat
per-request cost. ``make bench`` runs them (``make test`` skips benchmarks); the 100k
run takes a few minutes: ``python -m pytest tests/bench/test_cluster_bench.py
--benchmark-only -k simulator -s``.
"""

from __future__ import annotations

import dataclasses
import random
import time
import tracemalloc

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from refserve.cluster.index import GlobalPrefixIndex
from refserve.cluster.records import LoadFigures
from refserve.cluster.router import Router
from refserve.cluster.sim import simulate_cluster
from refserve.core.cost import StepCost
from refserve.report.cluster_experiment import BASE, TRACES, ClusterSlo
from refserve.spec.events import BlockStored, CacheEvent
from refserve.spec.hashing import DEFAULT_NAMESPACE, block_key

BLOCK = 16


def _loads(n: int, rng: random.Random) -> dict[int, LoadFigures]:
    return {
        r: LoadFigures(
            num_waiting=rng.randrange(8),
            num_running=rng.randrange(64),
            num_decoding=rng.randrange(32),
            num_paused=0,
            prefill_backlog_tokens=rng.randrange(4096),
            kv_blocks_used=rng.randrange(1024),
            kv_blocks_total=1024,
            max_num_seqs=64,
            token_budget=128,
            block_size=BLOCK,
            cost=StepCost(),
        )
        for r in range(n)
    }


def _chain(tokens: list[int]) -> list[tuple[bytes, bytes, tuple[int, ...]]]:
    """(key, parent key, token ids) of each full block of ``tokens``."""
    out = []
    parent = DEFAULT_NAMESPACE.root_key()
    for i in range(len(tokens) // BLOCK):
        ids = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
        key = block_key(parent, ids)
        out.append((key, parent, ids))
        parent = key
    return out


def _indexed(n: int, prompts: list[list[int]], rng: random.Random) -> GlobalPrefixIndex:
    """An index over ``n`` replicas, each prompt's blocks cached on a few of them."""
    index = GlobalPrefixIndex()
    for r in range(n):
        index.add_replica(r, BLOCK)
    held: dict[int, list[CacheEvent]] = {r: [] for r in range(n)}
    for p in prompts:
        for r in rng.sample(range(n), min(n, 3)):
            for key, parent, ids in _chain(p):
                seq = len(held[r])
                held[r].append(CacheEvent(seq, BlockStored(key, parent, ids, seq)))
    for r, events in held.items():
        index.apply(r, events)
    return index


@pytest.mark.parametrize("replicas", [8, 64, 1024])
def test_router_decision_cost(benchmark: BenchmarkFixture, replicas: int) -> None:
    """One routing decision as the cluster makes it: the index lookup of a 512-token
    prompt (32 blocks) over every replica, then prefix_aware over their figures."""
    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(512)] for _ in range(16)]
    index = _indexed(replicas, prompts, rng)
    loads = _loads(replicas, rng)
    router = Router("prefix_aware")

    def decide() -> int:
        prompt = prompts[rng.randrange(len(prompts))]
        hits = index.longest_prefix(prompt)
        return router.route("r", len(prompt), loads, hits).replica

    chosen = benchmark(decide)
    assert 0 <= chosen < replicas
    benchmark.extra_info["replicas"] = replicas


def test_index_memory_per_cached_block(benchmark: BenchmarkFixture) -> None:
    """tracemalloc: what the index keeps after applying 20,000 blocks' events and
    dropping the events (the key object, its holders mask entry and the replica's key
    -> block id entry), per cached block; and per extra replica holding the same key."""

    def measure() -> tuple[float, float]:
        n = 20_000
        rng = random.Random(1)
        tokens = [rng.randrange(32000) for _ in range(n * BLOCK)]
        index = GlobalPrefixIndex()
        index.add_replica(0, BLOCK)
        index.add_replica(1, BLOCK)
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        events = [
            CacheEvent(i, BlockStored(k, p, ids, 1000 + i))
            for i, (k, p, ids) in enumerate(_chain(tokens))
        ]
        index.apply(0, events)
        del events
        one = tracemalloc.get_traced_memory()[0]
        # The second replica's events name the same keys (equal bytes, other objects).
        again = [
            CacheEvent(i, BlockStored(k, p, ids, 1000 + i))
            for i, (k, p, ids) in enumerate(_chain(tokens))
        ]
        index.apply(1, again)
        del again
        two = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        return (one - base) / n, (two - one) / n

    per_block, per_extra = benchmark.pedantic(measure, rounds=1, iterations=1)
    print(f"\nindex: {per_block:.0f} B per cached block, {per_extra:.0f} B per extra holder")
    benchmark.extra_info["bytes per cached block"] = round(per_block)
    benchmark.extra_info["bytes per extra holder"] = round(per_extra)
    assert 0 < per_extra < per_block < 1024


def _sim_us_per_request(n: int, replicas: int = 64) -> tuple[float, float]:
    """CPU us per request and CPU s of the chat trace, ``n`` requests at one replica's
    rate each on ``replicas`` replicas, routed prefix_aware."""
    spec = next(t for t in TRACES if t.name == "chat")
    w = spec.build(spec.rate * replicas, n, 0)
    config = dataclasses.replace(BASE, max_num_batched_tokens=ClusterSlo.of(StepCost()).budget)
    started = time.process_time()
    res = simulate_cluster(w, replicas, config, StepCost(), "prefix_aware", keep_decisions=False)
    cpu = time.process_time() - started
    assert len(res.requests) == n and all(m.finished_ms is not None for m in res.requests)
    return cpu / n * 1e6, cpu


def test_simulator_64_replicas_100k_requests_flat(benchmark: BenchmarkFixture) -> None:
    """64 replicas, the chat trace at one replica's load each: CPU per request at 10k
    and 100k requests within 1.5x of each other."""

    def run() -> dict[int, tuple[float, float]]:
        return {n: _sim_us_per_request(n) for n in (10_000, 100_000)}

    rows = benchmark.pedantic(run, rounds=1, iterations=1)
    for n, (us, cpu) in rows.items():
        print(f"\n64 replicas x {n:,} requests: {us:.0f} us/request CPU ({cpu:.0f} s)")
        benchmark.extra_info[f"{n} us/request CPU"] = round(us)
    spread = rows[100_000][0] / rows[10_000][0]
    benchmark.extra_info["spread"] = round(spread, 2)
    assert spread <= 1.5, f"per-request cost grew {spread:.2f}x from 10k to 100k"
