"""The exhaustive KV explorer (refserve.conformance.explore.kv).

refserve's pool exhausts the small KV scope with no counterexample, and so do the indie
block manager and a correct manager with other design choices; every planted block
manager bug (the indie engine's three KV-level ones, kv_broken_adapters') is caught,
its counterexample replays to the same finding signature through replay_kv, and it is
no longer than the one the Hypothesis KV machine shrinks to.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import time
from typing import Any

import indie_adapter as I
import kv_broken_adapters as K
import pytest

from refserve.conformance.adapters.ref_kv import make_kv
from refserve.conformance.explore import KV_SCOPES, KVExploreResult, KVScope, explore_kv
from refserve.conformance.explore.kv import kv_key
from refserve.conformance.kv.machine import (
    GENERATED_NAME,
    KVWorkload,
    replay_kv,
    run_kv_suite,
)
from refserve.conformance.kv.protocol import KVAdapterFactory, KVConfig
from refserve.conformance.kv.run import KVRun

SMALL = KV_SCOPES["small"]
TINY = KV_SCOPES["tiny"]


def _replays(factory: KVAdapterFactory, r: KVExploreResult) -> None:
    """Every counterexample is a KV workload that replay_kv runs to its own signature."""
    for c in r.counterexamples:
        text = json.dumps(c.workload.to_json())
        assert KVWorkload.from_json(text) == c.workload
        again = {f.signature for f in replay_kv(factory, text, call_timeout=0.5)}
        assert c.signature in again, (c.signature, again, text)


# ------------------------------------------------------------------ correct managers
def test_ref_kv_exhausts_the_small_scope_with_no_counterexample() -> None:
    r = explore_kv(make_kv, SMALL, strategy="copy")
    assert r.ok and r.exhausted, r.summary()
    assert r.states > 1000 and r.transitions > r.states and r.depth >= 6
    # The scope reaches the manager's rare paths, each in many transitions.
    for what in (
        "forks_partial_block",
        "cow_copies",
        "cache_hits",
        "revived_hits",
        "evictions",
        "no_space",
    ):
        assert r.coverage.get(what, 0) > 10, (what, r.coverage)
    d = json.loads(json.dumps(r.to_json()))
    assert d["exhausted"] and d["counterexamples"] == [] and d["states"] == r.states
    assert "exhausted" in r.summary() and "all invariants hold" in r.summary()


@pytest.mark.parametrize(
    "factory",
    [I.make_kv, K.tiny_lifo, K.tiny_no_caching, K.tiny_fifo_eager_no_index],
    ids=["indie", "lifo-lazy-eviction", "no-prefix-caching", "fifo-eager-eviction-no-index"],
)
def test_correct_managers_with_other_design_choices_pass(factory: KVAdapterFactory) -> None:
    r = explore_kv(factory, TINY, strategy="copy")
    assert r.ok and r.exhausted, r.summary()


def test_replay_reaches_the_same_graph_as_copy() -> None:
    """Stateless replay (a fresh manager per state) builds the copy strategy's graph, and
    checks on every state that the same ops reach the same key."""
    a = explore_kv(I.make_kv, TINY, strategy="replay")
    b = explore_kv(I.make_kv, TINY, strategy="copy")
    assert a.ok and a.exhausted, a.summary()
    assert (a.states, a.transitions, a.depth) == (b.states, b.transitions, b.depth)
    assert a.coverage == b.coverage


# -------------------------------------------------------------------- planted bugs
BUGS: list[tuple[Any, ...]] = [
    # (id, factory, invariant, message words, shortest op list[, BFS depth if longer])
    ("indie-cow-skipped", I.make_kv_cow_skipped, "PREFIX", "shared by several requests", 3),
    ("indie-fork-no-incref", I.make_kv_fork_no_incref, "BLOCK", "ref_cnt differs", 2),
    (
        "indie-stale-prefix-entry",
        I.make_kv_stale_prefix_entry,
        "PREFIX",
        "prefixes differ|another request's token|different logical indices",
        4,
    ),
    ("copies-not-reported", K.NoCopiesKV, "BLOCK", "never received this KV", 3),
    ("fork-without-incref", K.fork_no_incref, "BLOCK", "ref_cnt differs", 2),
    # new, fork, free: the drain after the workload's ops does the free.
    ("double-free", K.double_free, "BLOCK", "referenced block is in the free queue", 2, 3),
    (
        "stale-cache-entry",
        K.StaleCacheKV,
        "PREFIX",
        "cache entry points at a block|reused under a different chain|cached block",
        3,
    ),
    ("refuses-with-room", K.RefusesWithRoomKV, "CAP", r"refused \(NoSpace\) while the pool", 1),
    ("table-wrong-length", K.reserve_ahead, "POS", "does not cover the KV length", 1),
    ("no-copy-on-write", K.no_cow, "PREFIX", "shared by several requests", 3),
    ("dirty-refusal", K.dirty_refusal, "ATOMIC", "changed by a failed operation", 1),
    ("hit-covers-last-token", K.greedy_hit, "PREFIX", "cache hit covers the last known token", 2),
    ("snapshot-raises", K.SnapshotRaisesKV, "PROGRESS", r"snapshot\(\) raised RuntimeError", 1),
    ("snapshot-garbage", K.GarbageSnapshotKV, "PROGRESS", r"ref_cnt\[0\] is str", 1),
    ("snapshot-none", K.NoneSnapshotKV, "PROGRESS", "None, not a PoolSnapshot", 1),
    ("checker-chokes", K.HugeTokenSnapshotKV, "PROGRESS", "cannot read the adapter's snapshot", 1),
    ("bad-features", K.BadFeaturesKV, "PROGRESS", "'teleport' is not a valid KVFeature", 0),
]


# The Hypothesis machine's shrunk workloads, compared where its search is cheap (well
# under a second at 40 examples).
COMPARED = {"indie-cow-skipped", "indie-fork-no-incref", "indie-stale-prefix-entry", "double-free"}


def _hypothesis_lengths(factory: KVAdapterFactory, invariant: str, words: str) -> list[int]:
    pairs = run_kv_suite(factory, "x", max_examples=40, names=[GENERATED_NAME])
    return [
        len(f.workload["ops"])
        for rs, _ in pairs
        for res in rs
        if res.invariant == invariant
        for f in res.failures
        if re.search(words, f.message)
    ]


@pytest.mark.parametrize(
    ("name", "factory", "invariant", "words", "length", "depth"),
    [(*b, b[4]) if len(b) == 5 else b for b in BUGS],
    ids=[b[0] for b in BUGS],
)
def test_planted_bug_is_caught_with_a_shortest_replayable_counterexample(
    name: str, factory: KVAdapterFactory, invariant: str, words: str, length: int, depth: int
) -> None:
    # Cut at the bug's own depth: BFS finds it there, in a fraction of a second.
    r = explore_kv(factory, dataclasses.replace(SMALL, max_depth=max(1, depth)), strategy="copy")
    hits = [
        c
        for c in r.counterexamples
        if c.finding.invariant == invariant and re.search(words, c.finding.violation.message)
    ]
    assert hits, r.summary() + "".join(f"\n{c.signature}" for c in r.counterexamples)
    # BFS: no shorter op list shows it (the lengths are the true minima, worked by hand).
    ours = min(len(c.workload.ops) for c in hits)
    assert ours == length
    assert not r.ok and "counterexample" in r.summary()
    _replays(factory, r)
    json.dumps(r.to_json())
    if name in COMPARED:
        theirs = _hypothesis_lengths(factory, invariant, words)
        assert theirs and ours <= min(theirs), (ours, theirs)


@pytest.mark.parametrize("bug", ["cow_skipped", "fork_no_incref", "stale_prefix_entry"])
def test_indie_kv_bugs_are_found_by_the_default_replay_strategy(bug: str) -> None:
    factory = getattr(I, f"make_kv_{bug}")
    r = explore_kv(factory, SMALL, first_only=True)
    assert len(r.counterexamples) == 1 and not r.exhausted, r.summary()
    _replays(factory, r)


# ---------------------------------------------------------------- faults of the adapter
def test_a_hanging_manager_stops_the_exploration_after_one_timeout() -> None:
    t0 = time.monotonic()
    r = explore_kv(K.HangingKV, SMALL, call_timeout=0.5)
    assert time.monotonic() - t0 < 3
    assert not r.exhausted and "timed out" in r.stopped
    [c] = r.counterexamples
    assert c.finding.timed_out and "did not return within 0.5 s" in c.finding.violation.message


def test_a_manager_refusing_every_pool_is_not_supported() -> None:
    r = explore_kv(K.RefusesConfigKV, SMALL)
    assert r.not_supported.count("only runs on a GPU") == 3 and not r.ok
    assert r.states == 0 and not r.counterexamples and "not supported" in r.summary()


class _FlakyKV(K.TinyKV):
    """Caches on every other instance: deterministic per manager, not across managers."""

    made = itertools.count()

    def __init__(self) -> None:
        super().__init__(caching=next(self.made) % 2 == 0)


def test_replay_reports_a_nondeterministic_manager() -> None:
    r = explore_kv(_FlakyKV, TINY, strategy="replay")
    assert any("nondeterministic" in c.finding.violation.message for c in r.counterexamples)


# ------------------------------------------------------------------ key and scope
def _run(ops: list[dict[str, Any]]) -> KVRun:
    run = KVRun(make_kv, KVConfig(3, 2), 5.0)
    assert run.start()
    for op in ops:
        run.apply(op)
    assert not run.findings
    return run


def test_key_renames_requests_and_blocks_but_keeps_tokens() -> None:
    def ops(a: str, b: str, tail: int) -> list[dict[str, Any]]:
        return [
            {"op": "new", "rid": a, "prompt": [2, 3, 4], "n": 3},
            {"op": "new", "rid": b, "prompt": [5, tail], "n": 2},
        ]

    assert kv_key(_run(ops("r0", "r1", 6))) == kv_key(_run(ops("zz", "aa", 6)))
    assert kv_key(_run(ops("r0", "r1", 6))) != kv_key(_run(ops("r0", "r1", 7)))
    # Arrival order is kept: the same two requests added the other way round differ.
    swapped = [*ops("r0", "r1", 6)[1:], *ops("r0", "r1", 6)[:1]]
    assert kv_key(_run(ops("r0", "r1", 6))) != kv_key(_run(swapped))


def test_scope_rejects_impossible_bounds() -> None:
    with pytest.raises(ValueError, match="max_len"):
        KVScope("x", 2, 3, ((2, 3, 4),), max_requests=1, max_len=2)
    with pytest.raises(ValueError, match="catalogue"):
        KVScope("x", 2, 3, (), max_requests=1, max_len=2)
    with pytest.raises(ValueError, match="min_blocks"):
        KVScope("x", 2, 3, ((2,),), max_requests=1, max_len=2, min_blocks=4)
    with pytest.raises(ValueError, match="strategy"):
        explore_kv(make_kv, TINY, strategy="fork")
    assert [c.num_blocks for c in SMALL.configs()] == [1, 2, 3]
    assert SMALL.sizes(5) == [1, 2, 3, 5] and SMALL.sizes(2) == [1, 2] and SMALL.sizes(0) == []
