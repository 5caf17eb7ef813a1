"""Checks that kill mutants of ``ref/kv/`` which survived ``make mutation``.

See docs/MUTATION.md. Each test drives the block pool, free queue or journal through
their public methods and checks one behaviour exactly, with ``spec.check_pool`` where
a whole pool state results. All are small and deterministic: mutmut runs them once per
mutant.
"""

from __future__ import annotations

import itertools

import pytest

from ref.errors import ExceedsCapacity, InvalidArgument, OutOfBlocks
from ref.kv import BlockCopy, BlockPool
from ref.kv.free_queue import FreeQueue
from ref.kv.journal import Journal
from ref.kv.pool import Allocation
from spec import check_pool


# ------------------------------------------------------------------ free queue
def test_a_fresh_free_queue_holds_every_block_in_id_order() -> None:
    journal = Journal()
    fq = FreeQueue(4, journal)
    assert list(fq) == [0, 1, 2, 3] and len(fq) == 4
    assert all(b in fq for b in range(4))
    journal.begin()
    assert [fq.popleft() for _ in range(4)] == [0, 1, 2, 3]
    assert len(fq) == 0 and list(fq) == [] and not any(b in fq for b in range(4))
    journal.rollback()
    assert list(fq) == [0, 1, 2, 3] and len(fq) == 4


def test_an_empty_free_queue_is_empty() -> None:
    journal = Journal()
    fq = FreeQueue(0, journal)
    assert len(fq) == 0 and list(fq) == [] and fq.peek(3) == []


def test_free_queue_iteration_walks_each_block_once() -> None:
    journal = Journal()
    fq = FreeQueue(3, journal)
    journal.begin()
    fq.remove(1)
    journal.rollback()  # _relink puts 1 back between 0 and 2
    assert list(itertools.islice(iter(fq), 5)) == [0, 1, 2]
    fq.remove(2)
    fq.append(2)
    fq.append(fq.popleft())
    assert list(itertools.islice(iter(fq), 5)) == [1, 2, 0]


# ------------------------------------------------------------------ decode appends
def test_decode_appends_that_fit_need_no_free_block() -> None:
    pool = BlockPool(2, 4)
    pool.allocate("a", [1, 2, 3], 3)
    pool.allocate("b", [5, 6, 7], 3)
    assert pool.num_free_blocks == 0
    # Both last blocks have a free slot and are private: nothing to take from the queue.
    assert pool.append_decode_tokens(["a", "b"], [[1, 2, 3, 4], [5, 6, 7, 8]]) == []
    assert pool.num_stored("a") == pool.num_stored("b") == 4
    assert check_pool(pool.snapshot()) == []


def test_decode_append_into_a_shared_block_needs_a_free_block_for_its_copy() -> None:
    pool = BlockPool(1, 4)
    pool.allocate("a", [1, 2, 3], 3)
    pool.fork("a", "c")
    before = pool.snapshot()
    assert pool.append_decode_tokens(["a"], [[1, 2, 3, 4]]) is None  # copy-on-write, 0 free
    assert pool.snapshot() == before


def test_decode_append_copies_a_shared_block_with_exactly_one_free_block() -> None:
    pool = BlockPool(2, 4)
    pool.allocate("a", [1, 2, 3], 3)
    pool.fork("a", "c")
    assert pool.append_decode_tokens(["a"], [[1, 2, 3, 4]]) == [BlockCopy(0, 1)]
    assert pool.block_table("a") == (1,) and pool.block_table("c") == (0,)
    assert check_pool(pool.snapshot()) == []


# ------------------------------------------------------------------ rollback
def test_rollback_restores_a_block_swapped_by_copy_on_write() -> None:
    pool = BlockPool(4, 4)
    pool.allocate("a", [1, 2, 3], 3)
    pool.fork("a", "c")
    before = pool.snapshot()
    pool.begin()
    alloc = pool.allocate("a", [1, 2, 3, 4], 1)
    assert alloc.copies == (BlockCopy(0, 1),) and pool.block_table("a") == (1,)
    pool.rollback()
    assert pool.block_table("a") == (0,)
    assert pool.snapshot() == before
    assert check_pool(pool.snapshot()) == []


# ------------------------------------------------------------------ allocate
def test_allocate_reports_what_it_did() -> None:
    pool = BlockPool(6, 2)
    first = pool.allocate("a", [1, 2, 3, 4, 5], 3)
    assert first == Allocation("a", 0, 3, 0, (0, 1), ())
    more = pool.allocate("a", [1, 2, 3, 4, 5], 2)
    assert more == Allocation("a", 3, 2, 0, (2,), ())
    pool.free("a")  # blocks 0 and 1 stay cached; the free queue is 3, 4, 5, 2, 1, 0
    hit = pool.lookup([1, 2, 3, 4, 9, 9])
    assert hit.block_ids == (0, 1)
    shared = pool.allocate("b", [1, 2, 3, 4, 9, 9], 1, hit=hit)
    assert shared == Allocation("b", 4, 1, 4, (3,), ())
    pool.fork("b", "c")
    cow = pool.allocate("b", [1, 2, 3, 4, 9, 9], 1)
    assert cow.copies == (BlockCopy(3, 4),) and cow.new_block_ids == ()
    assert (cow.start_position, cow.num_new_tokens, cow.num_cached_tokens) == (5, 1, 0)
    assert check_pool(pool.snapshot()) == []


def test_allocate_takes_exactly_the_free_blocks_and_the_whole_pool() -> None:
    pool = BlockPool(2, 4)
    assert pool.allocate("a", list(range(8)), 8).new_block_ids == (0, 1)  # all of it
    assert pool.num_free_blocks == 0
    pool.free("a")
    pool.allocate("b", [1, 2, 3], 3)
    pool.allocate("c", [4, 5, 6], 3)
    # A full pool: appending into a last block with room needs no free block.
    assert pool.allocate("b", [1, 2, 3, 4], 1).new_block_ids == ()
    assert check_pool(pool.snapshot()) == []


def test_allocate_refusals_name_the_request_and_the_counts() -> None:
    pool = BlockPool(2, 4)
    with pytest.raises(ExceedsCapacity) as never:
        pool.allocate("big", list(range(9)), 9)
    assert str(never.value) == "request 'big' needs 3 KV blocks but the pool has only 2"
    assert (never.value.request_id, never.value.needed, never.value.num_blocks) == ("big", 3, 2)
    pool.allocate("a", [1, 2, 3, 4], 4)
    with pytest.raises(OutOfBlocks) as later:
        pool.allocate("b", list(range(8)), 8)
    assert str(later.value) == "request 'b' needs 2 free KV blocks, 1 are free"
    assert (later.value.request_id, later.value.needed, later.value.free) == ("b", 2, 1)
    assert not pool.has_request("b") and check_pool(pool.snapshot()) == []


def test_decode_appends_count_every_request_that_needs_a_block() -> None:
    pool = BlockPool(3, 2)
    pool.allocate("a", [1, 2], 2)
    pool.allocate("b", [3, 4], 2)
    before = pool.snapshot()
    # Both last blocks are full: two fresh blocks needed, one is free.
    assert pool.append_decode_tokens(["a", "b"], [[1, 2, 5], [3, 4, 6]]) is None
    assert pool.snapshot() == before


@pytest.mark.parametrize("caching", [True, False])
def test_a_block_filled_by_a_decode_append_is_cached_at_once(caching: bool) -> None:
    pool = BlockPool(4, 4, enable_prefix_caching=caching)
    pool.allocate("a", [1, 2, 3], 3)
    assert pool.append_decode_tokens(["a"], [[1, 2, 3, 4]]) == []
    entries = pool.snapshot().cache_entries
    assert [(e.block_id, e.token_ids) for e in entries] == ([(0, (1, 2, 3, 4))] if caching else [])
    assert pool.lookup([1, 2, 3, 4, 9]).block_ids == ((0,) if caching else ())
    pool.begin()
    pool.append_decode_tokens(["a"], [[1, 2, 3, 4, 5]])  # a fresh block 1 (allocate)
    pool.append_decode_tokens(["a"], [[1, 2, 3, 4, 5, 6]])  # the fast list append
    assert pool.num_stored("a") == 6 and pool.block_table("a") == (0, 1)
    pool.rollback()
    assert pool.num_stored("a") == 4 and pool.block_table("a") == (0,)
    assert pool.snapshot().cache_entries == entries
    assert check_pool(pool.snapshot()) == []


def test_allocate_argument_refusals_are_exact() -> None:
    pool = BlockPool(4, 2)
    with pytest.raises(InvalidArgument) as zero:
        pool.allocate("a", [1, 2], 0)
    assert str(zero.value) == "num_new_tokens must be >= 1, got 0"
    pool.allocate("a", [1, 2, 3], 3)
    hit = pool.lookup([1, 2, 3])
    with pytest.raises(InvalidArgument) as again:
        pool.allocate("a", [1, 2, 3, 4], 1, hit=hit)
    assert str(again.value) == (
        "allocate: request 'a' already holds blocks; a prefix hit applies only to a new request"
    )
    assert pool.num_stored("a") == 3


def test_no_new_tokens_need_no_blocks() -> None:
    pool = BlockPool(4, 2)
    pool.allocate("a", [1, 2, 3], 3)
    pool.fork("a", "c")  # a's last block is partial and shared
    assert pool.blocks_to_allocate("a", 0) == 0
    assert pool.blocks_to_allocate("new", 0) == 0
    assert pool.blocks_to_allocate("a", 1) == 1  # the copy-on-write


def test_a_removed_block_is_not_in_the_free_queue() -> None:
    fq = FreeQueue(3, Journal())
    fq.remove(1)
    assert fq.__contains__(1) is False and fq.__contains__(0) is True
    assert list(fq) == [0, 2] and len(fq) == 2
