"""The global prefix index (ref/cluster/index.py; docs/CLUSTER.md, "The global prefix
index"): fed by the replicas' cache events it holds exactly what a replay of each
replica's events gives (spec/events.py ``replay``), which is the replica's own pool, and
its ``longest_prefix`` equals each replica's own lookup (``LLMEngine.prefix_hit_tokens``)
for drawn prompts; a batch of events applies all or nothing (a gap: ``EventGap``, an
event that does not apply: ``EventMismatch``), and a resync replaces a replica's books.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from cluster_helpers import config, replica
from hypothesis import given, settings
from hypothesis import strategies as st

from refserve.cluster import (
    CacheSnapshot,
    EventGap,
    EventMismatch,
    GlobalPrefixIndex,
    InProcessReplica,
    UnknownReplica,
)
from refserve.errors import InvalidArgument
from refserve.model.sampler import SamplingParams
from refserve.spec.events import BlockRemoved, BlockStored, CacheCleared, CacheEvent, replay
from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace, chain_keys

ROOT = DEFAULT_NAMESPACE.root_key()
# Pools small enough that blocks are evicted (and requests preempted) on the way.
SMALL = (config(4, 16, 8), config(8, 10, 11))
TOKENS = list(range(1, 10))  # 9 tokens: four full blocks of 2, two of 4


def _stored(seq: int, tokens: Sequence[int], bs: int, i: int, block: int) -> CacheEvent:
    """Event ``seq``: block ``i`` (of size ``bs``) of ``tokens`` stored in ``block``."""
    keys = [ROOT, *chain_keys(ROOT, tokens, bs, i + 1)]
    change = BlockStored(keys[i + 1], keys[i], tuple(tokens[i * bs : (i + 1) * bs]), block)
    return CacheEvent(seq, change)


def _key(tokens: Sequence[int], bs: int, i: int) -> bytes:
    return chain_keys(ROOT, tokens, bs, i + 1)[i]


def _index() -> GlobalPrefixIndex:
    """Replica 0 (blocks of 2) holds three blocks of TOKENS, replica 1 (blocks of 2)
    the first, replica 2 (blocks of 4) the first two of its own size."""
    index = GlobalPrefixIndex()
    index.add_replica(0, 2)
    index.add_replica(1, 2)
    index.add_replica(2, 4)
    index.apply(0, [_stored(i, TOKENS, 2, i, 10 + i) for i in range(3)])
    index.apply(1, [_stored(0, TOKENS, 2, 0, 7)])
    index.apply(2, [_stored(i, TOKENS, 4, i, i) for i in range(2)])
    return index


def _state(index: GlobalPrefixIndex) -> list[tuple[dict[bytes, int], int]]:
    return [(index.entries(r), index.next_seq(r)) for r in index.replicas]


def test_longest_prefix_walks_each_replicas_chain_by_its_block_size() -> None:
    index = _index()
    assert index.longest_prefix(TOKENS) == {0: 6, 1: 2, 2: 8}
    # The last token is never served: 8 tokens cap blocks of 2 at 6 and of 4 at 4.
    assert index.longest_prefix(TOKENS[:8]) == {0: 6, 1: 2, 2: 4}
    assert index.longest_prefix([1, 2, 99, 4, 5]) == {0: 2, 1: 2, 2: 0}
    assert index.longest_prefix([]) == {0: 0, 1: 0, 2: 0}
    # Another namespace's chain starts from another root: nothing is shared.
    assert index.longest_prefix(TOKENS, Namespace(cache_salt="x")) == {0: 0, 1: 0, 2: 0}
    assert index.holders(_key(TOKENS, 2, 0)) == {0, 1}
    assert index.num_keys == 5 and index.num_entries == 6


def test_removals_and_clears_take_keys_away() -> None:
    index = _index()
    index.apply(0, [CacheEvent(3, BlockRemoved(_key(TOKENS, 2, 1), 11))])
    assert index.longest_prefix(TOKENS)[0] == 2  # the chain breaks at its second block
    index.apply(1, [CacheEvent(1, CacheCleared()), _stored(2, TOKENS, 2, 0, 3)])
    assert index.entries(1) == {_key(TOKENS, 2, 0): 3}
    index.apply(2, [CacheEvent(2, CacheCleared())])
    assert index.entries(2) == {} and index.longest_prefix(TOKENS)[2] == 0
    assert index.holders(_key(TOKENS, 4, 0)) == frozenset()
    index.remove_replica(0)
    assert index.longest_prefix(TOKENS) == {1: 2, 2: 0}
    assert index.holders(_key(TOKENS, 2, 2)) == frozenset() and index.num_keys == 1


def test_a_gap_raises_and_changes_nothing() -> None:
    index = _index()
    before = _state(index)
    # Event 3 is applicable but 5 skips 4: the whole batch is refused.
    batch = [CacheEvent(3, BlockRemoved(_key(TOKENS, 2, 2), 12)), _stored(5, TOKENS, 2, 3, 13)]
    with pytest.raises(EventGap) as err:
        index.apply(0, batch)
    assert (err.value.replica, err.value.expected, err.value.got) == (0, 4, 5)
    assert _state(index) == before


@pytest.mark.parametrize(
    "bad",
    [
        _stored(3, TOKENS, 2, 0, 10),  # a key the replica holds, stored again
        CacheEvent(3, BlockRemoved(_key(TOKENS, 2, 3), 13)),  # a key it does not hold
        CacheEvent(3, BlockRemoved(_key(TOKENS, 2, 1), 99)),  # held by another block
    ],
)
def test_an_event_that_does_not_apply_raises_and_changes_nothing(bad: CacheEvent) -> None:
    index = _index()
    before = _state(index)
    fine = CacheEvent(bad.seq, BlockRemoved(_key(TOKENS, 2, 2), 12))
    with pytest.raises(EventMismatch, match=f"cache event {bad.seq + 1} of replica 0"):
        index.apply(0, [fine, CacheEvent(bad.seq + 1, bad.change)])
    assert _state(index) == before


def test_events_already_reflected_are_skipped_and_a_resync_replaces() -> None:
    index = _index()
    before = _state(index)
    index.apply(0, [_stored(i, TOKENS, 2, i, 10 + i) for i in range(3)])  # delivered twice
    assert _state(index) == before
    index.resync(0, CacheSnapshot(40, ((_key(TOKENS, 2, 0), 5),)))
    assert index.entries(0) == {_key(TOKENS, 2, 0): 5} and index.next_seq(0) == 40
    assert index.holders(_key(TOKENS, 2, 1)) == frozenset()
    index.apply(0, [_stored(39, TOKENS, 2, 1, 6), _stored(40, TOKENS, 2, 1, 6)])
    assert index.longest_prefix(TOKENS)[0] == 4 and index.next_seq(0) == 41


def test_bad_input_is_a_typed_error() -> None:
    index = _index()
    before = _state(index)
    for bad_id in (-1, True, "0", 1 << 16):
        with pytest.raises(InvalidArgument, match="replica ids"):
            index.add_replica(bad_id, 4)
    with pytest.raises(InvalidArgument, match="already"):
        index.add_replica(0, 2)
    with pytest.raises(InvalidArgument, match="block_size"):
        index.add_replica(5, 0)
    for call in (
        lambda: index.apply(9, []),
        lambda: index.resync(9, CacheSnapshot(0, ())),
        lambda: index.entries(9),
        lambda: index.remove_replica(9),
    ):
        with pytest.raises(UnknownReplica, match="unknown replica 9"):
            call()
    with pytest.raises(InvalidArgument, match="appears twice"):
        index.resync(0, CacheSnapshot(0, ((b"k", 1), (b"k", 2))))
    with pytest.raises(InvalidArgument, match="next_seq"):
        index.resync(0, CacheSnapshot(-1, ()))
    with pytest.raises(InvalidArgument, match="int64"):
        index.longest_prefix([1, 1 << 70])
    assert _state(index) == before


# ---------------------------------------------------------------------------- engines
def _check_against(
    index: GlobalPrefixIndex,
    replicas: Sequence[InProcessReplica],
    logs: list[list[CacheEvent]],
    probes: Sequence[Sequence[int]],
) -> None:
    """Drain each replica's events into ``index`` and ``logs``; the index must equal the
    replay of the whole log and the pool, and answer each probe as the pool does."""
    for r, rep in enumerate(replicas):
        events = rep.drain_cache_events()
        index.apply(r, events)
        logs[r].extend(events)
        held, problems = replay((), logs[r], 0)
        assert problems == []
        assert index.entries(r) == {k: e.block_id for k, e in held.items()}
        pool = rep.engine.scheduler.pool.snapshot()
        assert index.entries(r) == {e.key: e.block_id for e in pool.cache_entries}
    for p in probes:
        hits = index.longest_prefix(p)
        assert hits == {r: rep.prefix_hit_tokens(p) for r, rep in enumerate(replicas)}, p


def _run(seed: int, num_requests: int, clear_at: int | None) -> tuple[int, int]:
    """Requests on sessions sharing prefixes, on two replicas of different block sizes;
    checked after every step. Returns (blocks removed, hits seen on probes)."""
    rng = random.Random(seed)
    replicas = [replica(c) for c in SMALL]
    index = GlobalPrefixIndex()
    for r, rep in enumerate(replicas):
        index.add_replica(r, rep.block_size)
    logs: list[list[CacheEvent]] = [[], []]
    prefixes = [[rng.randrange(1, 250) for _ in range(rng.randint(9, 20))] for _ in range(3)]
    prompts: list[list[int]] = []
    step = 0
    for k in range(num_requests):
        p = [*rng.choice(prefixes), *(rng.randrange(1, 250) for _ in range(rng.randint(1, 6)))]
        prompts.append(p)
        replicas[k % 2].engine.add_request(p, SamplingParams(max_tokens=rng.randint(1, 6)))
        for _ in range(rng.randint(0, 3)):
            for rep in replicas:
                rep.step()
            step += 1
            if step == clear_at:
                replicas[0].engine.scheduler.pool.clear_cache()
            probe = rng.choice(prompts)
            _check_against(index, replicas, logs, [probe, probe[: rng.randint(1, len(probe))]])
    while any(rep.has_work for rep in replicas):
        for rep in replicas:
            rep.step()
        _check_against(index, replicas, logs, prompts)
    removed = sum(isinstance(e.change, BlockRemoved) for log in logs for e in log)
    hits = sum(v for p in prompts for v in index.longest_prefix(p).values())
    return removed, hits


def test_the_index_follows_two_engines_through_evictions_and_a_clear() -> None:
    removed, hits = _run(seed=3, num_requests=14, clear_at=6)
    # The run exercised what the index must follow: evictions and hits.
    assert removed > 0 and hits > 0


@settings(max_examples=20)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 8), clear_at=st.none() | st.integers(0, 8))
def test_the_index_follows_drawn_workloads(seed: int, n: int, clear_at: int | None) -> None:
    _run(seed, n, clear_at)
