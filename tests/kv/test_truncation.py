"""Truncation (ref/kv/truncation.py): the K/V of rejected draft tokens given back, undone
exactly by a rollback.
"""

from __future__ import annotations

import pytest
from kv_steps import stored

from refserve.errors import InvalidArgument, UnknownRequest
from refserve.kv import BlockPool, truncate


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
