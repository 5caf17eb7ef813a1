"""Truncation (ref/kv/truncation.py): the K/V of rejected draft tokens given back, undone
exactly by a rollback; on a grouped pool, in every layer group at once.
"""

from __future__ import annotations

import pytest
from kv_steps import stored

from refserve.errors import InvalidArgument, UnknownRequest
from refserve.kv import BlockPool, truncate
from refserve.kv.groups import GroupedPool
from refserve.spec.groups import (
    NULL_BLOCK,
    GroupKind,
    KVGroup,
    check_groups,
    check_window_held,
)


@pytest.mark.mutation_kill
def test_a_table_truncated_to_nothing_grows_again_inside_a_step() -> None:
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    pool.allocate("a", [1, 2, 3], 3)
    assert truncate(pool, "a", 0) == [0, 1]  # every block held only rejected positions
    before = pool.snapshot()
    pool.begin()
    pool.allocate("a", [1, 2, 3], 2)
    assert stored(pool, "a") == 2
    pool.rollback()
    assert pool.snapshot() == before and before.tables[0].block_table == ()


@pytest.mark.mutation_kill
def test_a_partial_truncation_is_undone_exactly_by_a_rollback() -> None:
    # A verification's rejected drafts dropped, then the step fails: the table gets its
    # tokens, keys and blocks back, and the cache its entries (docs/SPECULATIVE.md).
    pool = BlockPool(8, 4)
    pool.allocate("a", list(range(1, 11)), 10)
    before = pool.snapshot()
    third = pool.block_table("a")[2]
    pool.begin()
    assert truncate(pool, "a", 5) == [third]  # positions 8..9 only: returned
    assert stored(pool, "a") == 5 and len(pool.block_table("a")) == 2
    pool.rollback()
    assert pool.snapshot() == before
    with pytest.raises(UnknownRequest, match=r"^truncate: unknown request id 'ghost'$"):
        truncate(pool, "ghost", 0)
    with pytest.raises(InvalidArgument, match=r"^num_stored must be >= 0, got -1$"):
        truncate(pool, "a", -1)


# ------------------------------------------------------------------ a grouped pool
FULL = KVGroup(GroupKind.FULL)
WIN = KVGroup(GroupKind.WINDOW, 6)  # the query at L reads from L - 5
COMP = KVGroup(GroupKind.COMPRESSED, ratio=2)  # 8 tokens a block


def _verifying(pool: GroupedPool) -> tuple[tuple[int, ...], ...]:
    """``a`` computes 9 tokens, then verifies its last one and 7 drafts (positions 9 to
    16); that allocation at 9 releases the window group's block 0 (positions 0..3,
    wholly before position 4). Every group's table before any cut."""
    known = list(range(1, 18))
    pool.allocate("a", known, 9)
    pool.allocate("a", known, 8)
    tables = pool.block_tables("a")
    assert [len(t) for t in tables] == [5, 5, 3] and tables[1][0] == NULL_BLOCK
    return tables


def _valid(pool: GroupedPool, before: int) -> None:
    s = pool.grouped_snapshot()
    assert check_groups(s) + check_window_held(s, "a", before) == []


def test_a_grouped_truncation_cuts_every_group_in_its_own_block_size() -> None:
    """Kept 12 tokens (the verified token and 2 drafts): the full and window groups keep
    3 blocks of 4, the compressed group 2 of 8; every block past them goes back, every
    block holding a rejected position loses its cache entry, the window's released
    place stays null, and a rollback restores every group exactly."""
    pool = GroupedPool(24, 4, (FULL, WIN, COMP))
    full, win, comp = _verifying(pool)
    before = pool.grouped_snapshot()
    cached = {e.block_id for e in before.pool.cache_entries}
    assert {full[2], win[2]} <= cached  # positions 8..11, filled by the drafts
    free = pool.num_free_blocks
    pool.begin()
    assert truncate(pool, "a", 12) == [*full[3:], *win[3:], *comp[2:]]
    assert pool.block_tables("a") == (full[:3], win[:3], comp[:2])
    assert pool.num_free_blocks == free + 5
    _valid(pool, 9)
    # Position 11 is kept and position 12 rejected: block 2 (8..11) keeps its entry.
    assert {e.block_id for e in pool.grouped_snapshot().pool.cache_entries} == cached - {
        *full[3:],
        *win[3:],
    }
    pool.rollback()
    assert pool.grouped_snapshot() == before
    # Kept 10 (the verified token and one draft): block 2 holds rejected position 11.
    truncate(pool, "a", 10)
    assert not {full[2], win[2]} & {e.block_id for e in pool.grouped_snapshot().pool.cache_entries}
    _valid(pool, 9)


def test_a_grouped_truncation_into_a_released_window_place_is_refused() -> None:
    """Kept 4: the query at 4 reads from position 0, in the window's released block 0.
    A verification never asks it (it keeps at least one token past the KV it started
    from); asked, it is a typed error naming the group and the place, nothing cut."""
    pool = GroupedPool(24, 4, (FULL, WIN, COMP))
    _verifying(pool)
    before = pool.grouped_snapshot()
    with pytest.raises(InvalidArgument, match=r"window group 1 released logical block 0"):
        truncate(pool, "a", 4)
    assert pool.grouped_snapshot() == before
    with pytest.raises(InvalidArgument, match="stores 17 tokens; it cannot keep 18"):
        truncate(pool, "a", 18)
    assert truncate(pool, "a", 17) == [] and pool.grouped_snapshot() == before
