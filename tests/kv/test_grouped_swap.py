"""Swaps on a grouped pool (ref/kv/groups.py, ref/kv/host_pool.py): what a swap-out moves
and a swap-in restores, in every layer group.

A swap-out takes, in each group, only the blocks the request's next query reads
(``GroupedPool.held_blocks``, spec/groups.py ``held_places``): the full group's every
block, the window group's from the block holding ``window_start`` on. The host pool
keeps them in one table that records each block's group and place, checks that they are
exactly those places, and lists each group's table as the device pool's engine view
does. ``GroupedPool.restore`` builds every group's table back as if the request had
computed its tokens, all or nothing, and ``Restored`` makes admission count exactly
what the restore and the next tokens take.

Every state is checked through refserve.spec (check_groups, check_window_held on the
device; check_host with the layout on the host).
"""

from __future__ import annotations

import pytest

from refserve.errors import (
    DuplicateRequest,
    ExceedsCapacity,
    InvalidArgument,
    OutOfBlocks,
    UnknownRequest,
)
from refserve.kv.groups import GroupBlocks, GroupedPool, Restored
from refserve.kv.host_pool import HostPool
from refserve.kv.pool import BlockCopy
from refserve.spec import EngineSnapshot, PoolSnapshot, RequestSnapshot
from refserve.spec.atomic import check_atomic
from refserve.spec.groups import (
    NULL_BLOCK,
    GroupKind,
    KVGroup,
    check_groups,
    check_window_held,
    group_blocks,
    held_places,
    layout_blocks,
)
from refserve.spec.host import check_host
from refserve.spec.snapshot import RequestStatus

BS = 4
W = 6  # not a multiple of the block size: the window starts inside a block
FULL = KVGroup(GroupKind.FULL)
WIN = KVGroup(GroupKind.WINDOW, W)
GROUPS = (FULL, WIN)


def tokens(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def valid(pool: GroupedPool, rid: str = "", before: int = 0) -> None:
    s = pool.grouped_snapshot()
    found = check_groups(s) + (check_window_held(s, rid, before) if rid else [])
    assert found == [], found


def swapped(host: HostPool, rid: str, kv: int) -> list[str]:
    """spec/host.py on the host pool with ``rid`` swapped at ``kv`` tokens: every rule
    broken (by name), the layout's included."""
    device = PoolSnapshot(1, BS, (0,), (0,), ())
    engine = EngineSnapshot(
        (RequestSnapshot(rid, RequestStatus.SWAPPED, kv, 1, kv, 8),), device, host.snapshot()
    )
    return [f"{v.rule or v.invariant}: {v}" for v in check_host(engine, groups=GROUPS)]


# ------------------------------------------------------------------ what a swap-out moves
def test_held_blocks_are_the_places_the_next_query_reads() -> None:
    """After computing 13 tokens in one chunk the window table still holds blocks 0 and
    1 (released only before the next allocation); the query at 13 reads from position 8,
    so only blocks 2 and 3 of the window group are needed, with all 4 of the full group."""
    pool = GroupedPool(16, BS, GROUPS)
    pool.allocate("a", tokens(20), 13)
    full, window = pool.block_tables("a")
    assert NULL_BLOCK not in window  # nothing released yet
    held = pool.held_blocks("a")
    assert held == (GroupBlocks(0, 0, full), GroupBlocks(1, 2, window[2:]))
    assert [len(h.block_ids) for h in held] == [group_blocks(g, 13, 0, BS) for g in GROUPS]
    # After a decode step the window released block 0 and 1; the query at 14 reads from
    # 9, still blocks 2 and 3.
    pool.allocate("a", tokens(20), 1)
    assert pool.held_blocks("a")[1] == GroupBlocks(1, 2, pool.block_tables("a")[1][2:])
    with pytest.raises(UnknownRequest):
        pool.held_blocks("nobody")


@pytest.mark.parametrize("num_stored", [1, 4, 5, 8, 9, 12, 13, 16, 17])
def test_held_places_count_what_the_layout_counts(num_stored: int) -> None:
    for g in (FULL, WIN, KVGroup(GroupKind.WINDOW, 1), KVGroup(GroupKind.COMPRESSED, ratio=2)):
        assert len(held_places(g, num_stored, BS)) == group_blocks(g, num_stored, 0, BS)


# ------------------------------------------------------------------ the host pool
def test_the_host_keeps_every_groups_blocks_in_one_table() -> None:
    pool = GroupedPool(16, BS, GROUPS)
    pool.allocate("a", tokens(20), 13)
    held = pool.held_blocks("a")
    host = HostPool(8, BS, GROUPS)
    assert host.blocks_for(13) == 6 == layout_blocks(GROUPS, 13, 0, BS)
    copies = host.swap_out_groups("a", held, 13, tokens(20))
    t = host.table("a")
    assert t.block_ids == tuple(range(6)) and t.num_stored == 13
    assert t.token_ids == tuple(tokens(13))
    assert t.groups == (GroupBlocks(0, 0, (0, 1, 2, 3)), GroupBlocks(1, 2, (4, 5)))
    device = [b for h in held for b in h.block_ids]
    assert copies == tuple(BlockCopy(d, h) for d, h in zip(device, range(6), strict=True))
    # The snapshot lists each group's table at the device's places, as spec reads them.
    snap = host.snapshot()
    assert snap.null_entries
    assert [(x.request_id, x.block_table) for x in snap.tables] == [
        ("a", (0, 1, 2, 3)),
        ("a@group1", (NULL_BLOCK, NULL_BLOCK, 4, 5)),
    ]
    assert swapped(host, "a", 13) == []
    grouped = host.grouped_snapshot()
    assert check_groups(grouped) == [] and check_window_held(grouped, "a", 13) == []
    assert host.release("a") == t and host.num_free_blocks == 8


def test_the_host_refuses_blocks_other_than_the_next_querys() -> None:
    """A window group's blocks one short, or one too many, or a group left out: a typed
    error naming the request and the places, nothing taken."""
    pool = GroupedPool(16, BS, GROUPS)
    pool.allocate("a", tokens(20), 13)
    full, window = pool.held_blocks("a")
    host = HostPool(8, BS, GROUPS)
    before = host.snapshot()
    short = GroupBlocks(1, 2, window.block_ids[:-1])
    long = GroupBlocks(1, 1, (pool.block_tables("a")[1][1], *window.block_ids))
    for bad in ((full, short), (full, long), (full,), (window, full)):
        with pytest.raises(InvalidArgument, match="swap_out: request 'a'"):
            host.swap_out_groups("a", bad, 13, tokens(20))
        assert host.snapshot() == before
    with pytest.raises(InvalidArgument, match=r"its next query at 13 reads places 2\.\.3"):
        host.swap_out_groups("a", (full, short), 13, tokens(20))
    with pytest.raises(InvalidArgument, match="token ids"):
        host.swap_out_groups("a", (full, window), 13, tokens(12))
    with pytest.raises(InvalidArgument, match="swap_out_groups"):
        host.swap_out("a", full.block_ids, 13, tokens(20))  # one table of a grouped pool
    with pytest.raises(InvalidArgument, match="no layer groups"):
        HostPool(8, BS).swap_out_groups("a", (full, window), 13, tokens(20))
    with pytest.raises(OutOfBlocks):
        HostPool(5, BS, GROUPS).swap_out_groups("a", (full, window), 13, tokens(20))
    host.swap_out_groups("a", (full, window), 13, tokens(20))
    with pytest.raises(DuplicateRequest):
        host.swap_out_groups("a", (full, window), 13, tokens(20))


def test_a_grouped_swap_out_rolls_back_exactly() -> None:
    pool = GroupedPool(16, BS, GROUPS)
    pool.allocate("a", tokens(20), 13)
    pool.allocate("b", tokens(20, 300), 6)
    host = HostPool(12, BS, GROUPS)
    host.swap_out_groups("b", pool.held_blocks("b"), 6, tokens(20, 300))
    before = host.snapshot()
    host.begin()
    host.release("b")
    host.swap_out_groups("a", pool.held_blocks("a"), 13, tokens(20))
    host.rollback()
    assert host.snapshot() == before

    def engine(snap: PoolSnapshot) -> EngineSnapshot:
        return EngineSnapshot((), PoolSnapshot(1, BS, (0,), (0,), ()), snap)

    assert check_atomic(engine(before), engine(host.snapshot())) == []


# ------------------------------------------------------------------ restore
def test_restore_builds_every_group_as_if_computed() -> None:
    """13 tokens back: 4 full blocks, and the window group's blocks 2 and 3 with places
    0 and 1 null; the next allocation releases nothing and grows both groups."""
    pool = GroupedPool(16, BS, GROUPS)
    known = tokens(20)
    done = pool.restore("b", known, 13)
    full, window = pool.block_tables("b")
    assert done == (GroupBlocks(0, 0, full), GroupBlocks(1, 2, window[2:]))
    assert len(full) == 4 and window[:2] == (NULL_BLOCK, NULL_BLOCK)
    assert NULL_BLOCK not in window[2:]
    assert pool.num_used_blocks == layout_blocks(GROUPS, 13, 0, BS) == 6
    valid(pool, "b", 13)
    assert pool.held_blocks("b") == done  # what a swap-out of it would move
    # Its full blocks are cached, as a computed request's are (each group's own keys).
    cached = {e.block_id for e in pool.grouped_snapshot().pool.cache_entries}
    assert set(full[:3]) | {window[2]} <= cached
    free = pool.num_free_blocks
    pool.allocate("b", known, 4)  # positions 13..16: block 4 in both groups
    assert pool.num_free_blocks == free - 2
    valid(pool, "b", 13)


def test_restore_is_all_or_nothing() -> None:
    pool = GroupedPool(8, BS, GROUPS)
    pool.allocate("a", tokens(20), 4)  # 2 blocks taken: 6 free
    before = pool.grouped_snapshot()
    with pytest.raises(OutOfBlocks):
        pool.restore("b", tokens(20), 17)  # 5 full + 3 window blocks
    with pytest.raises(ExceedsCapacity):
        pool.restore("b", tokens(40), 33)  # 9 full blocks alone
    with pytest.raises(DuplicateRequest):
        pool.restore("a", tokens(20), 4)
    with pytest.raises(InvalidArgument, match="token ids"):
        pool.restore("b", tokens(3), 4)
    with pytest.raises(InvalidArgument, match="num_stored"):
        pool.restore("b", tokens(3), 0)
    assert pool.grouped_snapshot() == before
    # Inside a transaction its changes join it, and a rollback undoes them.
    pool.begin()
    pool.restore("b", tokens(20), 9)
    assert pool.has_request("b")
    pool.rollback()
    assert pool.grouped_snapshot() == before


def test_a_restored_request_is_counted_as_what_restore_and_the_next_tokens_take() -> None:
    """Admission's count of a swap-in (``Restored``): the blocks every group holds at its
    KV length, then its next tokens', no more; allocate takes no ``Restored``."""
    for stored, n in ((13, 1), (13, 4), (8, 5), (1, 12), (12, 1)):
        pool = GroupedPool(16, BS, GROUPS)
        restored = Restored.of(stored, BS)
        assert restored.num_tokens == stored
        counted = pool.blocks_to_allocate("b", n, restored)
        assert counted == layout_blocks(GROUPS, stored, n, BS)
        pool.restore("b", tokens(30), stored)
        pool.allocate("b", tokens(30), n)
        assert pool.num_used_blocks == counted, (stored, n)
    pool = GroupedPool(6, BS, GROUPS)
    assert pool.can_allocate("b", 1, Restored.of(13, BS))  # 4 full and 2 window blocks
    assert not pool.can_allocate("b", 4, Restored.of(13, BS))  # 5 and 3
    pool.restore("b", tokens(30), 12)
    with pytest.raises(InvalidArgument, match="already holds blocks"):
        pool.blocks_to_allocate("b", 1, Restored.of(12, BS))
    with pytest.raises(InvalidArgument, match=r"GroupedPool\.restore"):
        GroupedPool(16, BS, GROUPS).allocate("c", tokens(30), 1, hit=Restored.of(4, BS))
