"""Forks (ref/kv/forks.py): a child shares every block of its parent, and the first
write into the shared partial last block copies it (the pool's copy-on-write).
"""

from __future__ import annotations

import pytest
from kv_steps import assert_valid, tokens

from refserve.errors import OutOfBlocks
from refserve.kv import BlockCopy, BlockPool, fork


def test_free_keeps_blocks_shared_with_a_fork() -> None:
    pool = BlockPool(6, 2)
    pool.allocate("a", tokens(3), 3)
    fork(pool, "a", "b")
    pool.free("a")
    assert pool.snapshot().ref_cnt[:2] == (1, 1)
    assert pool.snapshot().free_queue == (2, 3, 4, 5)
    pool.free("b")
    assert pool.snapshot().free_queue == (2, 3, 4, 5, 1, 0)


def test_fork_and_copy_on_write() -> None:
    pool = BlockPool(6, 4)
    parent_tokens = tokens(6)
    pool.allocate("p", parent_tokens, 6)  # blocks 0 (full), 1 (2 of 4)
    fork(pool, "p", "c")
    assert pool.block_table("c") == (0, 1)
    assert pool.snapshot().ref_cnt[:2] == (2, 2)
    alloc = pool.allocate("c", [*parent_tokens, 100], 1)
    assert alloc.copies == (BlockCopy(src=1, dst=2),)
    assert alloc.new_block_ids == ()
    assert pool.block_table("p") == (0, 1)  # the parent's blocks are untouched
    assert pool.block_table("c") == (0, 2)
    snap = pool.snapshot()
    assert snap.ref_cnt[:3] == (2, 1, 1)
    p_table = snap.table("p")
    assert p_table is not None and p_table.token_ids == tuple(parent_tokens)
    # The parent now owns its partial block alone: it writes without a copy.
    assert pool.allocate("p", [*parent_tokens, 200], 1).copies == ()
    assert_valid(pool)


def test_fork_of_a_full_last_block_needs_no_copy() -> None:
    pool = BlockPool(6, 4)
    pool.allocate("p", tokens(8), 8)
    fork(pool, "p", "c")
    alloc = pool.allocate("c", [*tokens(8), 5], 1)
    assert alloc.copies == ()
    assert alloc.new_block_ids == (2,)
    assert_valid(pool)


def test_copy_on_write_counts_against_free_blocks() -> None:
    pool = BlockPool(2, 4)
    pool.allocate("p", tokens(6), 6)
    fork(pool, "p", "c")
    assert pool.blocks_to_allocate("c", 1) == 1
    pool2 = BlockPool(3, 4)
    pool2.allocate("p", tokens(6), 6)
    pool2.allocate("x", [1], 1)
    fork(pool2, "p", "c")
    before = pool2.snapshot()
    with pytest.raises(OutOfBlocks, match="needs 1 free KV blocks, 0 are free"):
        pool2.allocate("c", [*tokens(6), 1], 1)
    assert pool2.snapshot() == before
