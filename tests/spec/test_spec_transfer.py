"""BLOCK, rule ``in-flight``: the blocks of a copy to or from another store belong to the
copy until it lands (spec/transfer.py), each checker shown failing on a corrupted state;
and the steps around a copy: a load's tokens are no cache hit, waiting on one's own
transfer is no stall."""

from __future__ import annotations

from dataclasses import replace

from refserve.conformance.validate import check_pool_snapshot
from refserve.spec.checks import check_step
from refserve.spec.pos import check_pos_pool
from refserve.spec.snapshot import (
    CacheEntry,
    EngineSnapshot,
    PoolSnapshot,
    RequestSnapshot,
    RequestStatus,
    ScheduledRequest,
    StepSnapshot,
    TableSnapshot,
    Transfer,
    TransferKind,
)
from refserve.spec.transfer import check_in_flight, check_in_flight_step
from refserve.spec.violation import Invariant, Violation

BS = 4
W = RequestStatus.WAITING


def _req(rid: str, status: RequestStatus, computed: int = 0, prompt: int = 8) -> RequestSnapshot:
    return RequestSnapshot(rid, status, prompt, 0, computed, max_tokens=4)


def _pool(tables: tuple[TableSnapshot, ...], transfers: tuple[Transfer, ...]) -> PoolSnapshot:
    held: dict[int, int] = {}
    for t in tables:
        for b in t.block_table:
            held[b] = held.get(b, 0) + 1
    ref = tuple(held.get(b, 0) for b in range(6))
    free = tuple(b for b in range(6) if not ref[b])
    return PoolSnapshot(6, BS, ref, free, tables, transfers=transfers)


LOAD = Transfer("L", TransferKind.LOAD, (1, 2), "L@load")
HOLDER = TableSnapshot("L@load", (0, 1, 2), 12, tuple(range(12)))


def _only(vs: list[Violation], message: str) -> Violation:
    assert [v.message for v in vs] == [message], vs
    assert vs[0].invariant is Invariant.BLOCK and vs[0].rule == "in-flight"
    return vs[0]


def test_a_load_holds_its_blocks_until_it_lands() -> None:
    live = frozenset({"L", "X"})
    assert check_in_flight(_pool((HOLDER,), (LOAD,)), live) == []
    freed = _pool((TableSnapshot("L@load", (0, 1), 8, tuple(range(8))),), (LOAD,))
    v = _only(check_in_flight(freed, live), "freed while its load is in flight")
    assert v.subject == "block 2 (load of request L)"
    shared = _pool((HOLDER, TableSnapshot("X", (2,), 4, (9, 9, 9, 9))), (LOAD,))
    v = _only(check_in_flight(shared, live), "held by another request while its load is in flight")
    assert (v.expected, v.seen) == ("L@load", "X")
    # A store's blocks may be free (an engine may free at once and flush before reuse).
    store = Transfer("S", TransferKind.STORE, (3,))
    assert check_in_flight(_pool((HOLDER,), (LOAD, store)), live) == []


def _writing_step(before_x: tuple[Transfer, ...], after_x: tuple[Transfer, ...]) -> StepSnapshot:
    table = TableSnapshot("X", (3,), 0, ())
    before = EngineSnapshot((_req("X", W, prompt=4),), _pool((table,), before_x))
    after_table = TableSnapshot("X", (3,), 4, (9, 9, 9, 9))
    after = EngineSnapshot(
        (_req("X", RequestStatus.DECODING, 4, prompt=4),), _pool((after_table,), after_x)
    )
    s = ScheduledRequest("X", 4, (0, 1, 2, 3), (12, 13, 14, 15), (3,), True)
    return StepSnapshot(0, 8, 4, before, (s,), after)


def test_no_write_into_a_block_whose_copy_stays_in_flight() -> None:
    store = (Transfer("S", TransferKind.STORE, (3,)),)
    v = _only(
        check_in_flight_step(_writing_step(store, store)),
        "writes into block 3 while its store for request S is in flight",
    )
    assert v.subject == "request X"
    # The store completed in the step (flushed before the write, as an executor orders it).
    assert check_in_flight_step(_writing_step(store, ())) == []


def test_a_loads_tokens_count_like_a_hit_and_are_no_cache_hit() -> None:
    """A block-aligned prompt loaded whole, one token stepped back for a logit: 7 loaded
    tokens and 1 computed is no partial-block cache hit."""
    landed = (TableSnapshot("L@load", (1, 2), 8, tuple(range(8))),)
    before = EngineSnapshot((_req("L", W),), _pool(landed, ()))
    own = (TableSnapshot("L", (1, 2), 8, tuple(range(8))),)
    after = EngineSnapshot(
        (RequestSnapshot("L", RequestStatus.DECODING, 8, 1, 8, max_tokens=4),), _pool(own, ())
    )
    s = ScheduledRequest("L", 1, (7,), (2 * BS + 3,), (1, 2), True, num_new_loaded_tokens=7)
    step = StepSnapshot(0, 8, 4, before, (s,), after)
    assert check_step(step) == []
    as_hit = replace(s, num_new_cached_tokens=7, num_new_loaded_tokens=0)
    vs = check_step(replace(step, scheduled=(as_hit,)))
    assert any("not a whole number of blocks" in v.message for v in vs)
    # Counted like a hit: forgetting it breaks the positions and the KV length.
    vs = check_step(replace(step, scheduled=(replace(s, num_new_loaded_tokens=0),)))
    assert {v.invariant for v in vs} >= {Invariant.POS, Invariant.TOKEN}


def test_waiting_on_ones_own_transfer_is_no_stall() -> None:
    snap = EngineSnapshot((_req("W", W),), _pool((), ()))
    idle = StepSnapshot(0, 8, 4, snap, (), snap)
    assert any(v.invariant is Invariant.PROGRESS for v in check_step(idle))
    store = (Transfer("S", TransferKind.STORE, (3,)),)
    busy = replace(snap, pool=replace(snap.pool, transfers=store))
    assert check_step(StepSnapshot(0, 8, 4, busy, (), snap)) == []


def _failed_step(after_pool: PoolSnapshot, status: RequestStatus = W) -> StepSnapshot:
    """A step in which L's load of blocks 1 and 2 failed (the boundary after it)."""
    before = EngineSnapshot((_req("L", RequestStatus.LOADING),), _pool((HOLDER,), (LOAD,)))
    after = EngineSnapshot((_req("L", status),), after_pool)
    return StepSnapshot(0, 8, 4, before, (), after)


def test_a_failed_load_ends_its_transfer_and_serves_nothing() -> None:
    # Recompute: the holder keeps its local hit (block 0) and counts nothing after it.
    kept = TableSnapshot("L@load", (0, 1, 2), 4, tuple(range(4)))
    ok = replace(_pool((kept,), ()), failed_transfers=(LOAD,))
    assert check_in_flight_step(_failed_step(ok)) == []
    # Fail: the request finished, its blocks free.
    gone = replace(_pool((), ()), failed_transfers=(LOAD,))
    assert check_in_flight_step(_failed_step(gone, RequestStatus.FINISHED)) == []
    # Still listed in flight.
    v = _only(
        check_in_flight_step(_failed_step(replace(ok, transfers=(LOAD,)))),
        "still in flight after it failed",
    )
    assert v.subject == "load of request L"
    # Its blocks counted as holding K/V (the holder kept the loaded prefix).
    counted = replace(_pool((HOLDER,), ()), failed_transfers=(LOAD,))
    v = _only(
        check_in_flight_step(_failed_step(counted)),
        "counted as holding K/V by table L@load after its load failed",
    )
    assert v.subject == "block 1 (load of request L)"
    # Its blocks in the cache index.
    entry = CacheEntry(b"k", 2, b"", (8, 9, 10, 11))
    indexed = replace(ok, cache_entries=(entry,))
    v = _only(
        check_in_flight_step(_failed_step(indexed)), "in the cache index after its load failed"
    )
    assert v.subject == "block 2 (load of request L)"
    # Left loading with nothing in flight.
    _only(
        check_in_flight_step(_failed_step(ok, RequestStatus.LOADING)),
        "still loading after its load failed, with no load in flight",
    )


def test_a_failed_store_ends_its_transfer() -> None:
    store = Transfer("S", TransferKind.STORE, (3,))
    ok = replace(_pool((), ()), failed_transfers=(store,))
    assert check_in_flight_step(_failed_step(ok, RequestStatus.FINISHED)) == []
    v = _only(
        check_in_flight_step(_failed_step(replace(ok, transfers=(store,)), RequestStatus.FINISHED)),
        "still in flight after it failed",
    )
    assert v.subject == "store of request S"


def test_a_holder_may_keep_a_failed_loads_blocks_for_the_recompute() -> None:
    """vLLM keeps the blocks of a failed load with the request that recomputes into them:
    past its KV length, but reserved, as slots ahead are; any other excess is not."""
    kept = TableSnapshot("L@load", (0, 1, 2), 4, tuple(range(4)))
    listed = replace(_pool((kept,), ()), failed_transfers=(LOAD,))
    assert check_pos_pool(listed) == []
    assert check_in_flight_step(_failed_step(listed)) == []
    unlisted = _pool((kept,), ())
    (v,) = check_pos_pool(unlisted)
    assert v.message == "block table does not cover the KV length exactly"
    # Only the failed load's own blocks are excused.
    extra = TableSnapshot("L@load", (0, 1, 2, 3), 4, tuple(range(4)))
    (v,) = check_pos_pool(replace(_pool((extra,), ()), failed_transfers=(LOAD,)))
    assert (v.expected, v.seen) == ("1..3", "4")


def test_a_malformed_failed_copy_is_reported_by_the_validator() -> None:
    ok = replace(_pool((HOLDER,), ()), failed_transfers=(LOAD,))
    assert check_pool_snapshot(ok) == []
    bad = replace(ok, failed_transfers=(Transfer("L", "load", (1,)),))  # type: ignore[arg-type]
    assert check_pool_snapshot(bad) == ["pool.failed_transfers[0].kind: not a TransferKind: 'load'"]
