"""GroupedPool (ref/kv/groups.py): one table per request per layer group over one shared
pool. Window freeing at its boundary, hits complete in every group (and the shorter one
taken once a window block is evicted), one transaction over every group, typed errors,
and the grouped conformance suite on its adapter with zero findings.

Every check of a state goes through ``refserve.spec.groups`` (check_groups,
check_window_held) on the pool's snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from refserve.conformance.adapters.ref_kv import make_grouped
from refserve.conformance.kv.grouped_suite import grouped_scenario_names, run_grouped_kv_suite
from refserve.errors import ExceedsCapacity, InvalidArgument, OutOfBlocks, UnknownRequest
from refserve.kv import PrefixHit
from refserve.kv.groups import GroupedHit, GroupedPool
from refserve.kv.pool import BlockPool
from refserve.spec.groups import (
    NULL_BLOCK,
    GroupKind,
    KVGroup,
    check_groups,
    check_window_held,
)

BS = 4
W = 6  # not a multiple of the block size: the window starts inside a block
FULL = KVGroup(GroupKind.FULL)
WIN = KVGroup(GroupKind.WINDOW, W)


def tokens(n: int, base: int = 0) -> list[int]:
    return list(range(base, base + n))


def valid(pool: GroupedPool, rid: str = "", before: int = 0, cached: int = 0) -> None:
    s = pool.grouped_snapshot()
    found = check_groups(s) + (check_window_held(s, rid, before, cached) if rid else [])
    assert found == [], found


def window_table(pool: GroupedPool, rid: str) -> tuple[int, ...]:
    return pool.block_tables(rid)[1]


# ------------------------------------------------------------------ window freeing
def test_window_blocks_leave_exactly_when_wholly_before_the_window() -> None:
    """W = 6, blocks of 4: the query at L reads from L - 5; a block goes back only once
    every position in it is before that (block 0 at L = 9, block 1 at L = 13)."""
    pool = GroupedPool(16, BS, (FULL, WIN))
    known = tokens(20)
    pool.allocate("a", known, 8)
    valid(pool, "a", 0)
    freed_at: dict[int, int] = {}
    for length in range(8, 16):
        free = pool.num_free_blocks
        pool.allocate("a", known, 1)  # from L = length
        valid(pool, "a", length)
        table = window_table(pool, "a")
        for i, b in enumerate(table):
            if b == NULL_BLOCK and i not in freed_at:
                freed_at[i] = length
        new_block = 1 if length % BS == 0 else 0  # each group starts a block
        released = sum(1 for at in freed_at.values() if at == length)
        assert pool.num_free_blocks == free - 2 * new_block + released
    # window_start(9, 6) = 4: block 0 (positions 0..3) wholly before; block 1 at L = 13.
    assert freed_at == {0: 9, 1: 13}
    assert pool.block_tables("a")[0].count(NULL_BLOCK) == 0  # the full group keeps all
    pool.free("a")
    valid(pool)
    assert pool.num_free_blocks == 16


def test_free_skips_a_window_tables_null_places() -> None:
    pool = GroupedPool(8, BS, (FULL, WIN))
    pool.allocate("a", tokens(12), 8)
    pool.allocate("a", tokens(12), 4)  # L = 8: window_start 3, block 0 stays
    pool.allocate("a", tokens(13), 1)  # L = 12: window_start 7, block 0 leaves
    assert window_table(pool, "a")[0] == NULL_BLOCK
    pool.free("a")
    snap = pool.grouped_snapshot()
    assert snap.tables == () and sorted(snap.pool.free_queue) == list(range(8))
    assert set(snap.pool.ref_cnt) == {0}


def test_num_table_blocks_counts_every_groups_held_blocks_what_a_free_returns() -> None:
    """What a preemption frees (the mlfq policy reads it): the full group's 4 blocks and
    the window group's blocks 1 to 3 (block 0 released), not one table's 4."""
    pool = GroupedPool(8, BS, (FULL, WIN))
    pool.allocate("a", tokens(13), 12)
    pool.allocate("a", tokens(13), 1)  # L = 12: window_start 7, block 0 leaves
    assert pool.num_table_blocks("a") == 4 + 3 == 8 - pool.num_free_blocks
    assert [BlockPool.num_table_blocks(p, "a") for p in pool.pools] == [4, 3]
    pool.free("a")
    assert pool.num_table_blocks("a") == 0 and pool.num_free_blocks == 8


# ---------------------------------------------------------------------- hits
def test_a_hit_takes_every_full_block_and_only_the_window_blocks_read() -> None:
    pool = GroupedPool(16, BS, (FULL, WIN))
    prompt = tokens(20)
    pool.allocate("a", prompt, 20)
    pool.free("a")  # every block cached, all in the free queue
    known = [*prompt, 99]
    hit = pool.lookup(known, max_tokens=20)
    assert hit.num_tokens == 20
    full, win = hit.hits
    assert len(full.block_ids) == 5 and full.num_skipped == 0
    # The query at 20 reads from 15: block 3 on; blocks 0..2 are skipped.
    assert win.num_skipped == 3 and len(win.block_ids) == 2
    a = pool.allocate("b", known, 1, hit=hit)
    assert a.num_cached_tokens == 20
    valid(pool, "b", 20, 20)
    assert window_table(pool, "b")[:3] == (NULL_BLOCK,) * 3
    assert window_table(pool, "b")[3:5] == win.block_ids
    assert pool.block_tables("b")[0][:5] == full.block_ids
    # Groups never share keys: the window group's blocks are not the full group's.
    assert not set(full.block_ids) & set(win.block_ids)


def test_a_hit_missing_a_window_block_is_refused_and_a_shorter_one_taken() -> None:
    """The full group still caches the prefix; the window group lost a block its query
    at 12 reads. The hit looked up before is stale (refused, nothing changed); a new
    lookup gives the longest prefix complete in every group."""
    pool = GroupedPool(12, BS, (FULL, WIN))
    known = tokens(24)
    pool.allocate("a", known, 20)
    pool.allocate("a", known, 4)  # L = 20: window blocks 0..2 leave (cached, free)
    assert window_table(pool, "a")[:3] == (NULL_BLOCK,) * 3
    released = pool.grouped_snapshot().pool.free_queue
    other = [*known[:12], 500]
    before = pool.lookup(other)
    assert before.num_tokens == 12  # full blocks 0..2 (held by a), window blocks 1, 2
    # A new request takes the two oldest free blocks, the window group's released blocks
    # 2 and 1 (released last first): their entries go; freeing it leaves them evicted.
    pool.allocate("c", [1000], 1)
    assert set(released) - set(pool.grouped_snapshot().pool.free_queue) == set(released[:2])
    pool.free("c")
    snap = pool.grouped_snapshot()
    with pytest.raises(InvalidArgument, match="stale"):
        pool.allocate("b", other, 1, hit=before)
    assert pool.grouped_snapshot() == snap
    after = pool.lookup(other)
    assert after.num_tokens == 4, after  # window block 0 still cached: the query at 4 reads it
    for g, h in enumerate(after.hits):
        assert h.num_tokens == after.num_tokens, g
    pool.allocate("b", other, 1, hit=after)
    valid(pool, "b", after.num_tokens, after.num_tokens)


def test_no_group_evicts_another_groups_hit() -> None:
    """The free queue after a's free: the full group's blocks, then the window group's.
    The full group, served first, takes its hit out of the queue and then a new block
    from the head: the window group's hit block, were it not held already."""
    pool = GroupedPool(6, BS, (FULL, KVGroup(GroupKind.WINDOW, 2)))
    pool.allocate("a", tokens(12), 12)
    pool.free("a")
    known = [*tokens(12), 99]
    hit = pool.lookup(known)
    assert hit.num_tokens == 12 and hit.hits[1].num_skipped == 2  # the query at 12 reads 11
    a = pool.allocate("b", known, 1, hit=hit)  # 3 + 1 revived, 1 + 1 new: all 6 blocks
    assert a.num_cached_tokens == 12 and pool.num_free_blocks == 0
    assert window_table(pool, "b")[2] == hit.hits[1].block_ids[0]
    valid(pool, "b", 12, 12)


def test_no_hit_with_prefix_caching_off() -> None:
    pool = GroupedPool(16, BS, (FULL, WIN), enable_prefix_caching=False)
    pool.allocate("a", tokens(12), 12)
    pool.free("a")
    hit = pool.lookup([*tokens(12), 7])
    assert hit.num_tokens == 0 and all(h.num_tokens == 0 for h in hit.hits)


# --------------------------------------------------------------- all or nothing
def test_an_allocation_that_does_not_fit_changes_no_group() -> None:
    pool = GroupedPool(8, BS, (FULL, WIN))
    pool.allocate("a", tokens(12), 12)  # 3 + 3 blocks
    pool.allocate("b", [7], 1)  # 1 + 1: the pool is full
    snap = pool.grouped_snapshot()
    # a at L = 12: the window releases block 0 (1 block) but both groups need a new one.
    with pytest.raises(OutOfBlocks) as e:
        pool.allocate("a", tokens(13), 1)
    assert e.value.needed == 2 and e.value.free == 1
    assert pool.grouped_snapshot() == snap  # the window release did not happen either
    with pytest.raises(ExceedsCapacity):
        pool.allocate("z", tokens(20), 20)  # 5 + 5 blocks at once, never
    assert pool.grouped_snapshot() == snap


def test_a_fault_in_one_group_undoes_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = GroupedPool(16, BS, (FULL, WIN))
    pool.allocate("a", tokens(12), 12)
    snap = pool.grouped_snapshot()

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("group 1 fails")

    monkeypatch.setattr(pool.pools[1], "allocate", boom)
    with pytest.raises(RuntimeError, match="group 1 fails"):
        pool.allocate("a", tokens(16), 4)  # group 1 released block 0, group 0 grew
    assert pool.grouped_snapshot() == snap
    monkeypatch.undo()
    pool.allocate("a", tokens(16), 4)
    valid(pool, "a", 12)


def test_rollback_undoes_every_group_and_commit_keeps_them() -> None:
    pool = GroupedPool(16, BS, (FULL, WIN, KVGroup(GroupKind.WINDOW, 3)))
    pool.allocate("a", tokens(16), 12)
    snap = pool.grouped_snapshot()
    pool.begin()
    pool.allocate("a", tokens(16), 4)
    pool.allocate("b", tokens(8, 100), 8)
    pool.free("a")
    assert pool.in_transaction
    pool.rollback()
    assert not pool.in_transaction and pool.grouped_snapshot() == snap
    pool.begin()
    pool.allocate("a", tokens(16), 4)
    pool.commit()
    valid(pool, "a", 12)
    assert pool.grouped_snapshot() != snap


# ----------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("groups", "match"),
    [
        ((), "at least one layer group"),
        (("full",), r"groups\[0\] must be a KVGroup"),
    ],
)
def test_a_bad_layout_is_named(groups: Sequence[KVGroup], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        GroupedPool(8, BS, groups)


def test_a_window_below_one_is_named() -> None:
    bad = KVGroup(GroupKind.WINDOW, 2)
    object.__setattr__(bad, "window", 0)  # past KVGroup's own check
    with pytest.raises(InvalidArgument, match=r"groups\[1\]: a window group needs a window >= 1"):
        GroupedPool(8, BS, (FULL, bad))


def test_bad_calls_are_named_and_change_nothing() -> None:
    pool = GroupedPool(8, BS, (FULL, WIN))
    pool.allocate("a", tokens(8), 8)
    snap = pool.grouped_snapshot()
    with pytest.raises(UnknownRequest, match="'nobody'"):
        pool.free("nobody")
    with pytest.raises(InvalidArgument, match="num_new_tokens must be >= 1, got 0"):
        pool.allocate("a", tokens(8), 0)
    with pytest.raises(InvalidArgument, match="num_new_tokens must be an int"):
        pool.allocate("a", tokens(9), True)
    with pytest.raises(InvalidArgument, match="up to 9 but only 8"):
        pool.allocate("a", tokens(8), 1)
    hit = pool.lookup(tokens(9))
    with pytest.raises(InvalidArgument, match="already holds blocks"):
        pool.allocate("a", tokens(9), 1, hit=hit)
    with pytest.raises(InvalidArgument, match="has 1 groups, the pool 2"):
        pool.allocate("b", tokens(9), 1, hit=GroupedHit.of(hit.hits[:1]))
    lopsided = GroupedHit.of((hit.hits[0], PrefixHit(hit.hits[1].root_key, (), (), BS)))
    with pytest.raises(InvalidArgument, match="different lengths"):
        pool.allocate("b", tokens(9), 1, hit=lopsided)
    assert pool.grouped_snapshot() == snap


def test_a_hit_may_skip_only_what_its_group_does_not_read() -> None:
    pool = GroupedPool(16, BS, (FULL, WIN))
    pool.allocate("a", tokens(12), 12)
    pool.free("a")
    known = tokens(13)
    hit = pool.lookup(known)
    full, win = hit.hits
    assert hit.num_tokens == 12 and win.num_skipped == 1  # the query at 12 reads from 7
    skipping = PrefixHit(full.root_key, full.block_ids[1:], full.keys, BS, 1)
    with pytest.raises(InvalidArgument, match="skips 1 blocks in group 0"):
        pool.allocate("b", known, 1, hit=GroupedHit.of((skipping, win)))
    too_far = PrefixHit(win.root_key, win.block_ids[1:], win.keys, BS, 2)
    with pytest.raises(InvalidArgument, match="skips 2 blocks in group 1"):
        pool.allocate("b", known, 1, hit=GroupedHit.of((full, too_far)))
    forged = PrefixHit(win.root_key, win.block_ids, (b"x" * 32, *win.keys[1:]), BS, 1)
    with pytest.raises(InvalidArgument, match="group 1's skipped blocks"):
        pool.allocate("b", known, 1, hit=GroupedHit.of((full, forged)))
    assert not pool.has_request("b")
    pool.allocate("b", known, 1, hit=hit)
    valid(pool, "b", 12, 12)


# -------------------------------------------------------------- the grouped suite
def test_the_grouped_suite_finds_nothing() -> None:
    pairs = run_grouped_kv_suite(make_grouped, "ref_kv:make_grouped", max_examples=60)
    failures = [(r.invariant, f.rule, f.message) for rs, _ in pairs for r in rs for f in r.failures]
    assert failures == []
    assert [info.name for _, info in pairs] == grouped_scenario_names()
    coverage = pairs[-1][1].observed["coverage"]
    assert coverage["cache_hits"] >= 5 and coverage["no_space"] >= 5
    assert coverage["evictions"] >= 5 and coverage["window_released"] >= 5


# ------------------------------------------------------------------ compressed groups
COMP = KVGroup(GroupKind.COMPRESSED, ratio=3)


def test_a_compressed_group_holds_a_block_per_ratio_times_the_tokens() -> None:
    """Ratio 3, blocks of 4: one compressed block covers 12 tokens; the full group's
    table grows a block every 4. Both grow in one allocation, every rule holding."""
    pool = GroupedPool(32, BS, (FULL, COMP, WIN))
    stored = 0
    for end in (5, 12, 13, 25):
        pool.allocate("b", tokens(end), end - stored)
        full, comp, _ = pool.block_tables("b")
        assert len(full) == -(-end // BS) and len(comp) == -(-end // (BS * 3))
        valid(pool, "b", stored)
        stored = end
    window = sum(b != NULL_BLOCK for b in pool.block_tables("b")[2])
    assert pool.num_used_blocks == 7 + 3 + window  # 25 tokens: 7 full blocks, 3 compressed


def test_a_layout_with_a_compressed_group_takes_no_prefix_hit() -> None:
    """The one index keys blocks of ``block_size`` tokens; a compressed group's blocks
    are not indexed, so no hit is ever complete in it."""
    pool = GroupedPool(32, BS, (FULL, COMP))
    pool.allocate("a", tokens(20), 20)
    pool.free("a")
    hit = pool.lookup(tokens(21))
    assert hit.num_tokens == 0 and all(h.num_tokens == 0 for h in hit.hits)
    plain = GroupedPool(32, BS, (FULL, WIN))
    plain.allocate("a", tokens(20), 20)
    plain.free("a")
    assert plain.lookup(tokens(21)).num_tokens == 20  # the same prompt without it


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: KVGroup(GroupKind.COMPRESSED), "needs a ratio >= 2"),
        (lambda: KVGroup(GroupKind.COMPRESSED, ratio=1), "needs a ratio >= 2"),
        (lambda: KVGroup(GroupKind.FULL, ratio=2), "only a compressed group has a ratio"),
        (lambda: KVGroup(GroupKind.COMPRESSED, window=4, ratio=2), "has no window"),
    ],
)
def test_a_bad_compressed_group_is_named(make: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()  # type: ignore[operator]


def test_the_first_group_must_be_full_attention() -> None:
    with pytest.raises(InvalidArgument, match=r"groups\[0\] must be a full group"):
        GroupedPool(8, BS, (COMP, FULL))


# ------------------------------------------------------------------ keys per group
def test_the_first_groups_keys_are_the_plain_pools_and_no_salt_reaches_another_group() -> None:
    """Group 0's chain roots are the request's own namespace's (a router that reads cache
    events computes those); a later group's root is one no request's namespace has, so
    no cache salt can make one group's K/V serve another's layers."""
    from refserve.kv import BlockPool
    from refserve.kv.groups import group_namespace
    from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace

    salted = Namespace(cache_salt="s")
    assert group_namespace(salted, 0) == salted
    grouped, plain = GroupedPool(16, BS, (FULL, WIN)), BlockPool(16, BS)
    grouped.allocate("a", tokens(8), 8, namespace=salted)
    plain.allocate("a", tokens(8), 8, namespace=salted)
    assert plain.lookup(tokens(9), salted).keys == grouped.lookup(tokens(9), salted).hits[0].keys
    later = group_namespace(DEFAULT_NAMESPACE, 1).root_key()
    lookalikes = ("layer-group 1", "1", "0:|group:1", "\x00layer-group 1")
    for salt in lookalikes:
        for model in ("default", "default\x00"):
            assert Namespace(model, "", salt).root_key() != later
    assert group_namespace(DEFAULT_NAMESPACE, 2).root_key() != later


def test_cache_events_carry_every_groups_blocks_under_its_own_root() -> None:
    """One event log for the one index: every group's cached blocks are published, each
    chain from its group's root, so a router hashing a prompt from the request's own
    root finds the first group's keys; a window block released and then reused by
    another request is published as removed."""
    from refserve.kv.groups import group_namespace
    from refserve.spec.events import BlockRemoved, BlockStored
    from refserve.spec.hashing import DEFAULT_NAMESPACE

    pool = GroupedPool(7, BS, (FULL, WIN), cache_events=True)
    log = pool.cache_events
    assert log is not None
    pool.allocate("a", tokens(9), 9)  # 3 blocks in each group, 1 block free
    stored = [e.change for e in log.drain() if isinstance(e.change, BlockStored)]
    roots = [group_namespace(DEFAULT_NAMESPACE, g).root_key() for g in (0, 1)]
    assert [c.parent_key for c in stored if c.parent_key in roots] == roots
    assert len(stored) == 4  # the two full blocks of each group
    pool.allocate("a", tokens(10), 1)  # L = 9 reads from 4: window block 0 goes back
    assert window_table(pool, "a")[0] == NULL_BLOCK and log.drain() == []
    pool.allocate("b", tokens(4, 100), 4)  # two blocks: the free one and the released one
    removed = [e.change for e in log.drain() if isinstance(e.change, BlockRemoved)]
    first_window_block = next(c for c in stored if c.parent_key == roots[1])
    assert [c.key for c in removed] == [first_window_block.key]


# ------------------------------------------------------------------ edges the mutants showed
def test_a_hit_plus_its_chunk_past_the_pool_is_exceeds_capacity_not_out_of_blocks() -> None:
    """The capacity refusal counts from the hit's end: a hit of 16 tokens and 16 more hold
    8 full and 6 window blocks, more than the 8 of the pool, however many are free.
    Counted from 0 they would seem to fit and the refusal would say "try later"."""
    pool = GroupedPool(8, BS, (FULL, WIN))
    pool.allocate("a", tokens(16), 16)
    pool.free("a")
    known = tokens(32)
    hit = pool.lookup(known, max_tokens=16)
    assert hit.num_tokens == 16
    with pytest.raises(ExceedsCapacity) as e:
        pool.allocate("b", known, 16, hit=hit)
    assert (e.value.needed, e.value.num_blocks) == (14, 8)
    assert not pool.has_request("b")


def test_bad_calls_name_their_argument() -> None:
    pool = GroupedPool(8, BS, (FULL, WIN))
    with pytest.raises(UnknownRequest, match="free"):
        pool.free("nobody")
    with pytest.raises(InvalidArgument, match="max_tokens"):
        pool.lookup(tokens(4), max_tokens=-1)
    pool.allocate("a", tokens(8), 8)
    pool.free("a")
    hit = pool.lookup(tokens(9))
    with pytest.raises(InvalidArgument, match="has 1 groups, the pool 2"):
        pool.blocks_to_allocate("b", 1, GroupedHit.of(hit.hits[:1]))
    assert pool.blocks_to_allocate("b", 1, hit) == 6  # per group: 2 revived, 1 new


def test_a_full_group_with_a_window_is_named() -> None:
    bad = KVGroup(GroupKind.FULL)
    object.__setattr__(bad, "window", 3)  # past KVGroup's own check
    with pytest.raises(InvalidArgument, match=r"groups\[1\]: a full group has no window, got 3"):
        GroupedPool(8, BS, (FULL, bad))
