"""BlockPool, the spine: worked examples (docs/ARCHITECTURE.md), allocation and its
copy-on-write, prefix-cache behaviour, transactions, bad input. The attachments have
their own files: test_decode_runs.py, test_forks.py, test_truncation.py.

Every bad-input test asserts the typed exception from ``refserve.errors``, a message naming
the bad value, and that ``pool.snapshot()`` is unchanged (ATOMIC).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest
from kv_steps import assert_valid, stored, tokens

import refserve.kv.prefix_index as prefix_index_module
from refserve.errors import (
    DuplicateRequest,
    ExceedsCapacity,
    InvalidArgument,
    OutOfBlocks,
    RefserveError,
    UnknownRequest,
)
from refserve.kv import BlockCopy, BlockPool, DecodeRun, PrefixHit, fork
from refserve.kv.pool import Allocation
from refserve.spec import check_pool
from refserve.spec.atomic import check_atomic_pool
from refserve.spec.hashing import Namespace


# ----------------------------------------------------------------- golden seeds
def test_seed_000_two_requests_of_17_and_31_tokens() -> None:
    """Block 16, lengths 17 and 31: 4 blocks, 48 slots used, 16 empty."""
    pool = BlockPool(8, 16)
    pool.allocate("a", tokens(17), 17)
    pool.allocate("b", tokens(31, 100), 31)
    assert pool.num_used_blocks == 4
    assert [len(pool.block_table(r)) for r in ("a", "b")] == [2, 2]
    used_slots = stored(pool, "a") + stored(pool, "b")
    assert used_slots == 48
    assert pool.num_used_blocks * pool.block_size - used_slots == 16
    assert_valid(pool)


def test_seed_001_b_holds_2_3_4_4_blocks() -> None:
    """Block 4: B's prompt 12 in chunks 7, 5, then two decodes -> 2, 3, 4, 4 blocks."""
    pool = BlockPool(16, 4)
    b_tokens = [*tokens(12, 50), 900, 901]  # prompt 12 + sampled outputs
    held = []
    for chunk in (7, 5, 1, 1):
        pool.allocate("B", b_tokens, chunk)
        held.append(len(pool.block_table("B")))
        assert_valid(pool)
    assert stored(pool, "B") == 14
    assert held == [2, 3, 4, 4]


def test_seed_003_prefix_hit_only_gains_references() -> None:
    """10K prompt with a 6K cached prefix at block 16, 70 free blocks, chunk 1008.

    The 375 shared blocks only gain a reference; the prompt allocates 63 new blocks.
    """
    bs = 16
    prefix = tokens(6000, 10_000)
    decodes = {f"d{i}": tokens(20, 50_000 + 100 * i) for i in range(3)}
    pool = BlockPool(375 + 3 * 2 + 70, bs)
    pool.allocate("P0", prefix, 6000)
    for rid, toks in decodes.items():
        pool.allocate(rid, toks, 20)
    assert pool.num_free_blocks == 70
    before = pool.snapshot()
    prompt = prefix + tokens(4000, 90_000)

    for rid, toks in decodes.items():  # three decodes, one token each: no new block
        assert pool.allocate(rid, [*toks, 7], 1).new_block_ids == ()
    hit = pool.lookup(prompt)
    assert hit.num_tokens == 6000 and len(hit.block_ids) == 375
    assert hit.block_ids == pool.block_table("P0")
    alloc = pool.allocate("Q", prompt, 1008, hit=hit)

    after = pool.snapshot()
    assert alloc.num_cached_tokens == 6000
    assert alloc.start_position == 6000
    assert len(alloc.new_block_ids) == 63
    assert set(alloc.new_block_ids) <= set(before.free_queue)
    assert pool.num_free_blocks == 70 - 63
    assert pool.block_table("Q") == hit.block_ids + alloc.new_block_ids
    for b in hit.block_ids:
        assert (before.ref_cnt[b], after.ref_cnt[b]) == (1, 2)
    shared = set(hit.block_ids)
    # The shared blocks' cache entries are untouched.
    assert {e for e in before.cache_entries if e.block_id in shared} == {
        e for e in after.cache_entries if e.block_id in shared
    }
    assert stored(pool, "Q") == 6000 + 1008


# ------------------------------------------------------------------ allocate and decode appends
@pytest.mark.mutation_kill
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
    fork(pool, "b", "c")
    cow = pool.allocate("b", [1, 2, 3, 4, 9, 9], 1)
    assert cow.copies == (BlockCopy(3, 4),) and cow.new_block_ids == ()
    assert (cow.start_position, cow.num_new_tokens, cow.num_cached_tokens) == (5, 1, 0)
    assert check_pool(pool.snapshot()) == []


@pytest.mark.mutation_kill
def test_a_new_pool_reports_no_changed_table_and_publishes_no_events() -> None:
    """A new pool has no table for the persistent batch to rewrite, and cache events are
    published only when asked for (``cache_events=True``; docs/MUTATION.md)."""
    pool = BlockPool(4, 2)
    assert pool.take_changed() == (set(), False)
    assert pool.cache_events is None
    assert BlockPool(4, 2, cache_events=True).cache_events is not None


@pytest.mark.mutation_kill
def test_a_one_off_allocation_takes_any_sequence_and_reports_its_table() -> None:
    """The one-off path (caching off, a new request, no transaction) stores the tokens of
    any sequence, not only a list or a tuple, and tells the batch its table changed; so
    does the general path."""
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    pool.allocate("a", range(10, 15), 3)
    assert pool.snapshot().tables[0].token_ids == (10, 11, 12)
    assert pool.take_changed() == ({"a"}, False)
    assert pool.take_changed() == (set(), False)  # both reset by the call
    assert check_pool(pool.snapshot()) == []
    more = pool.allocate("a", [10, 11, 12, 13, 14], 2)  # an existing table grows, not anew
    assert (more.start_position, stored(pool, "a")) == (3, 5)
    assert check_pool(pool.snapshot()) == []
    assert pool.take_changed() == ({"a"}, False)  # the one-off table knows its request
    cached = BlockPool(4, 2)  # the general path takes any sequence too
    cached.allocate("a", range(10, 15), 3)
    assert cached.snapshot().tables[0].token_ids == (10, 11, 12)


@pytest.mark.mutation_kill
def test_a_free_that_fails_inside_a_transaction_is_left_to_its_opener() -> None:
    """A free that fails inside an open transaction (here on a reference count
    corrupted on purpose) undoes nothing itself: the opener's rollback undoes the whole
    transaction, the earlier allocation in it included."""
    pool = BlockPool(6, 2, enable_prefix_caching=False)
    pool.allocate("a", [1, 2, 3], 3)
    pool.allocate("b", [4], 1)
    before = pool.snapshot()
    pool.begin()
    pool.allocate("b", [4, 5, 6], 2)
    first = pool.block_table("a")[0]
    pool._blocks._ref[first] = 0  # released last (tail first): its count would go negative
    with pytest.raises(AssertionError, match="would go negative"):
        pool.free("a")
    pool._blocks._ref[first] = 1
    pool.rollback()
    assert pool.snapshot() == before


@pytest.mark.mutation_kill
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


@pytest.mark.mutation_kill
def test_no_new_tokens_need_no_blocks() -> None:
    pool = BlockPool(4, 2)
    pool.allocate("a", [1, 2, 3], 3)
    fork(pool, "a", "c")  # a's last block is partial and shared
    assert pool.blocks_to_allocate("a", 0) == 0
    assert pool.blocks_to_allocate("new", 0) == 0
    assert pool.blocks_to_allocate("a", 1) == 1  # the copy-on-write


# ------------------------------------------------------------- prefix caching
def test_last_prompt_token_never_served_from_cache() -> None:
    pool = BlockPool(8, 4)
    pool.allocate("a", tokens(9), 9)  # blocks of tokens 0..3 and 4..7 are cached
    aligned = tokens(8)
    hit = pool.lookup(aligned)
    assert hit.num_tokens == (len(aligned) - 1) // 4 * 4 == 4
    assert len(pool.lookup(tokens(9)).block_ids) == 2
    assert pool.lookup(tokens(4)).block_ids == ()  # one block prompt: nothing cached
    alloc = pool.allocate("b", aligned, 4, hit=hit)
    assert alloc.start_position == 4 and len(alloc.new_block_ids) == 1
    assert_valid(pool)


def test_lru_eviction_order() -> None:
    pool = BlockPool(4, 2)
    pool.allocate("r1", tokens(4), 4)  # blocks 0, 1
    pool.allocate("r2", tokens(4, 10), 4)  # blocks 2, 3
    pool.free("r1")
    pool.free("r2")
    assert pool.snapshot().free_queue == (1, 0, 3, 2)
    # A new block comes from the head: r1's tail (block 1) is evicted first.
    pool.allocate("r3", [7, 7], 1)
    assert pool.block_table("r3") == (1,)
    assert len(pool.lookup([*tokens(4), 9]).block_ids) == 1  # chain now breaks at block 1
    assert [e.block_id for e in pool.snapshot().cache_entries] == [0, 2, 3]
    pool.allocate("r4", [8, 8, 8], 3)  # the least recently freed cached blocks: 0 then 3
    assert pool.block_table("r4") == (0, 3)
    entries = pool.snapshot().cache_entries
    assert [(e.block_id, e.token_ids) for e in entries] == [(0, (8, 8)), (2, (10, 11))]
    assert_valid(pool)


def test_free_releases_in_reverse_order() -> None:
    pool = BlockPool(6, 2)
    pool.allocate("a", tokens(5), 5)
    assert pool.block_table("a") == (0, 1, 2)
    pool.free("a")
    assert pool.snapshot().free_queue == (3, 4, 5, 2, 1, 0)


def test_identity_check_on_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a hash that collides on everything, a lookup must still miss on other tokens."""

    def colliding(parent: bytes, token_ids: Sequence[int]) -> bytes:
        return b"collision" * 4

    monkeypatch.setattr(prefix_index_module, "block_key", colliding)
    pool = BlockPool(4, 2)
    pool.allocate("a", [1, 2, 3], 3)
    assert [e.token_ids for e in pool.snapshot().cache_entries] == [(1, 2)]
    assert pool.lookup([9, 9, 9]).block_ids == ()  # same key, other tokens: a miss
    assert pool.lookup([1, 2, 9]).block_ids == (0,)


def test_namespaces_isolate() -> None:
    pool = BlockPool(8, 2)
    lora = Namespace(adapter="lora-1")
    salted = Namespace(cache_salt="user-42")
    pool.allocate("a", tokens(5), 5, namespace=lora)
    assert pool.lookup(tokens(5)).block_ids == ()
    assert pool.lookup(tokens(5), salted).block_ids == ()
    assert pool.lookup(tokens(5), Namespace(model="other", adapter="lora-1")).block_ids == ()
    hit = pool.lookup(tokens(5), lora)
    assert hit.block_ids == (0, 1)
    with pytest.raises(InvalidArgument, match="another pool or namespace"):
        pool.allocate("b", tokens(5), 1, hit=hit)  # namespace defaults to the other one
    pool.allocate("b", tokens(5), 1, hit=hit, namespace=lora)
    assert pool.block_table("b")[:2] == (0, 1)
    assert_valid(pool)


def test_two_requests_sharing_a_new_prefix_in_one_step() -> None:
    pool = BlockPool(8, 2)
    prompt = tokens(5)
    hits = [pool.lookup(prompt), pool.lookup(prompt)]  # both planned before either runs
    assert all(h.block_ids == () for h in hits)
    pool.allocate("a", prompt, 5, hit=hits[0])
    pool.allocate("b", prompt, 5, hit=hits[1])
    snap = pool.snapshot()
    # The first one indexed wins; b's identical blocks stay private and unindexed.
    assert [e.block_id for e in snap.cache_entries] == [0, 1]
    assert pool.block_table("b") == (3, 4, 5)
    assert check_pool(snap) == []
    pool.free("a")
    assert pool.lookup(prompt).block_ids == (0, 1)
    assert_valid(pool)


@pytest.mark.mutation_kill
def test_blocks_indexed_inside_a_step_are_served_from_the_next_one() -> None:
    """The step that reserves a block computes its K/V, so a lookup in that same step
    (the transaction still open) must not serve it; after the commit it is a hit, and
    after a rollback it was never indexed."""
    prompt = tokens(5)
    for end in ("commit", "rollback"):
        pool = BlockPool(8, 2)
        pool.begin()
        pool.allocate("a", prompt, 5)
        assert len(pool.snapshot().cache_entries) == 2  # indexed, not yet served
        assert pool.lookup(prompt).block_ids == ()
        getattr(pool, end)()
        assert pool.lookup(prompt).block_ids == ((0, 1) if end == "commit" else ())
        assert_valid(pool)


def test_hash_entry_never_left_pointing_at_a_reused_block() -> None:
    pool = BlockPool(2, 2)
    pool.allocate("a", [1, 2, 3, 4], 4)
    pool.free("a")  # blocks 1, 0 free and still cached
    assert pool.lookup([1, 2, 3, 4, 5]).block_ids == (0, 1)
    pool.allocate("b", [5, 6, 7, 8], 4)  # reuses both blocks
    snap = pool.snapshot()
    assert pool.lookup([1, 2, 3, 4, 5]).block_ids == ()
    assert {e.token_ids for e in snap.cache_entries} == {(5, 6), (7, 8)}
    assert check_pool(snap) == []


def test_revived_cached_block_leaves_the_free_queue() -> None:
    pool = BlockPool(4, 2)
    pool.allocate("a", tokens(5), 5)
    pool.free("a")
    hit = pool.lookup(tokens(5))
    assert pool.blocks_to_allocate("b", 1, hit) == 3  # 2 revived + 1 new
    pool.allocate("b", tokens(5), 1, hit=hit)
    snap = pool.snapshot()
    assert snap.ref_cnt == (1, 1, 0, 1)
    assert snap.free_queue == (2,)
    assert_valid(pool)


@pytest.mark.mutation_kill
def test_can_allocate_counts_the_revived_blocks_of_a_hit() -> None:
    pool = BlockPool(4, 2)
    pool.allocate("a", [1, 2, 3, 4, 5], 5)  # blocks 0, 1 cached, 2 partial
    pool.free("a")  # all free again, 0 and 1 still cached
    pool.allocate("c", [7], 1)  # takes block 3: three free blocks left
    prompt = [1, 2, 3, 4, 9, 9, 9]
    hit = pool.lookup(prompt)
    assert hit.block_ids == (0, 1)
    # Two fresh blocks plus the two free cached blocks the hit revives: 4 > 3.
    assert pool.blocks_to_allocate("b", 3, hit) == 4
    assert pool.can_allocate("b", 3, hit) is False
    assert pool.can_allocate("b", 3) is True  # without the hit only 2 blocks


def test_prefix_caching_off() -> None:
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    pool.allocate("a", tokens(5), 5)
    assert pool.snapshot().cache_entries == ()
    assert pool.lookup(tokens(5)).block_ids == ()
    assert pool.forget_cached(range(4)) == 0


@pytest.mark.mutation_kill
def test_forget_cached_counts_only_cached_in_range_blocks() -> None:
    pool = BlockPool(4, 2)
    pool.allocate("a", [1, 2, 3, 4, 5], 5)  # blocks 0, 1 full and cached; 2 partial
    assert len(pool.snapshot().cache_entries) == 2
    assert pool.forget_cached([]) == 0
    assert pool.forget_cached([2, 4, -1, 99]) == 0  # uncached or out of range
    assert pool.forget_cached([0, 1, 4]) == 2  # 4 == num_blocks is out of range
    assert pool.forget_cached([0]) == 0  # already gone
    assert pool.snapshot().cache_entries == ()
    assert check_pool(pool.snapshot()) == []


def test_transaction_rollback_restores_free_queue_order() -> None:
    """Regression: undoing "pop block b" after "append block b" restored b out of place."""
    pool = BlockPool(5, 1)
    pool.allocate("r", tokens(3), 3)
    before = pool.snapshot()
    assert before.free_queue == (3, 4)
    pool.begin()
    pool.allocate("r", tokens(4), 1)  # pops block 3
    pool.free("r")  # appends 3, 2, 1, 0
    pool.rollback()  # an executor fault
    assert pool.snapshot() == before
    assert check_atomic_pool(before, pool.snapshot()) == []
    pool.allocate("s", [1, 2], 2)
    assert pool.block_table("s") == (3, 4)


@pytest.mark.mutation_kill
def test_rollback_restores_a_block_swapped_by_copy_on_write() -> None:
    pool = BlockPool(4, 4)
    pool.allocate("a", [1, 2, 3], 3)
    fork(pool, "a", "c")
    before = pool.snapshot()
    pool.begin()
    alloc = pool.allocate("a", [1, 2, 3, 4], 1)
    assert alloc.copies == (BlockCopy(0, 1),) and pool.block_table("a") == (1,)
    pool.rollback()
    assert pool.block_table("a") == (0,)
    assert pool.snapshot() == before
    assert check_pool(pool.snapshot()) == []


def test_a_committed_transaction_keeps_what_it_did() -> None:
    pool = BlockPool(4, 2)
    pool.begin()
    pool.allocate("a", tokens(3), 3)
    fork(pool, "a", "b")
    pool.commit()
    assert pool.has_request("a") and pool.has_request("b")
    pool.begin()
    assert pool.allocate("b", tokens(4), 1).copies == (BlockCopy(1, 2),)
    pool.free("a")
    pool.rollback()
    assert pool.block_table("a") == pool.block_table("b") == (0, 1)
    assert_valid(pool)


@pytest.mark.mutation_kill
def test_free_inside_a_rolled_back_transaction_restores_the_table() -> None:
    pool = BlockPool(4, 2)
    pool.allocate("a", [1, 2, 3], 3)
    before = pool.snapshot()
    pool.begin()
    pool.free("a")
    assert not pool.has_request("a")
    pool.rollback()
    assert pool.has_request("a")
    assert pool.snapshot() == before


# -------------------------------------------------------------------- bad input
@pytest.fixture
def pool() -> Iterator[BlockPool]:
    p = BlockPool(4, 2)
    p.allocate("a", tokens(3), 3)
    p.allocate("b", tokens(2, 10), 2)
    p.free("b")
    yield p
    assert_valid(p)


def refused(
    pool: BlockPool, error: type[RefserveError], fragments: Sequence[str], op: Callable[[], object]
) -> None:
    """``op`` raises ``error`` naming every fragment, and the pool is unchanged."""
    before = pool.snapshot()
    with pytest.raises(error) as info:
        op()
    message = str(info.value)
    for f in fragments:
        assert f in message, f"{f!r} not in {message!r}"
    assert pool.snapshot() == before
    assert check_atomic_pool(before, pool.snapshot()) == []


@pytest.mark.parametrize(
    ("count", "fragment"),
    [
        (0, "got 0"),
        (-3, "got -3"),
        (True, "bool True"),
        (False, "bool False"),
        (2.0, "float 2.0"),
        ("2", "str '2'"),
        (None, "NoneType None"),
    ],
)
def test_bad_token_counts(pool: BlockPool, count: object, fragment: str) -> None:
    refused(
        pool,
        InvalidArgument,
        ["num_new_tokens", fragment],
        lambda: pool.allocate("a", tokens(8), count),  # type: ignore[arg-type]
    )
    refused(
        pool,
        InvalidArgument,
        ["num_new_tokens", fragment],
        lambda: pool.allocate("new", tokens(8), count),  # type: ignore[arg-type]
    )


def test_free_unknown_or_already_freed(pool: BlockPool) -> None:
    refused(pool, UnknownRequest, ["free", "'ghost'"], lambda: pool.free("ghost"))
    refused(pool, UnknownRequest, ["free", "'b'"], lambda: pool.free("b"))


def test_fork_missing_or_onto_existing(pool: BlockPool) -> None:
    refused(pool, UnknownRequest, ["fork", "'ghost'"], lambda: fork(pool, "ghost", "c"))
    refused(pool, UnknownRequest, ["fork", "'b'"], lambda: fork(pool, "b", "c"))  # freed
    pool.allocate("c", [1], 1)
    refused(pool, DuplicateRequest, ["fork", "'c'", "already in use"], lambda: fork(pool, "a", "c"))
    refused(pool, DuplicateRequest, ["'a'"], lambda: fork(pool, "a", "a"))


def test_queries_on_unknown_request(pool: BlockPool) -> None:
    refused(pool, UnknownRequest, ["'ghost'"], lambda: pool.block_table("ghost"))


@pytest.mark.mutation_kill
def test_block_table_view_is_the_live_table() -> None:
    pool = BlockPool(4, 2)
    pool.allocate("a", [1, 2, 3], 3)
    view = pool.block_table_view("a")
    assert list(view) == [0, 1]
    pool.allocate("a", [1, 2, 3, 4, 5], 2)
    assert list(view) == [0, 1, 2]  # live: sees the growth without a new call
    with pytest.raises(UnknownRequest, match=r"^block_table_view: unknown request id 'x'$"):
        pool.block_table_view("x")


@pytest.mark.mutation_kill
def test_pool_unknown_request_messages_name_the_operation() -> None:
    pool = BlockPool(4, 2)
    pool.allocate("a", [1, 2, 3], 3)
    cases: dict[str, Callable[[], object]] = {
        "block_table": lambda: pool.block_table("x"),
        "free": lambda: pool.free("x"),
        "decode_run": lambda: DecodeRun(pool, ["a", "x"]),
        "block_table_views": lambda: pool.block_table_views(["a", "x"]),
        "fork": lambda: fork(pool, "x", "c"),
    }
    for what, call in cases.items():
        with pytest.raises(UnknownRequest) as info:
            call()
        assert str(info.value) == f"{what}: unknown request id 'x'"
    with pytest.raises(DuplicateRequest) as dup:
        fork(pool, "a", "a")
    assert str(dup.value) == "fork: request id 'a' is already in use"
    views = pool.block_table_views(["a", "a"])
    assert [list(v) for v in views] == [[0, 1], [0, 1]]


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "fragment"),
    [
        (0, 4, "num_blocks must be >= 1, got 0"),
        (-1, 4, "num_blocks must be >= 1, got -1"),
        (4, 0, "block_size must be >= 1, got 0"),
        (4, -2, "block_size must be >= 1, got -2"),
        (True, 4, "num_blocks must be an int, got bool True"),
        (4, 2.0, "block_size must be an int, got float 2.0"),
    ],
)
def test_bad_pool_shape(num_blocks: object, block_size: object, fragment: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        BlockPool(num_blocks, block_size)  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_allocation_beyond_capacity(pool: BlockPool) -> None:
    # 4 blocks of 2: 9 tokens need 5 blocks, which no amount of freeing provides.
    refused(
        pool,
        ExceedsCapacity,
        ["'new'", "needs 5 KV blocks", "only 4"],
        lambda: pool.allocate("new", tokens(9), 9),
    )
    refused(
        pool,
        ExceedsCapacity,
        ["'a'", "needs 5 KV blocks"],
        lambda: pool.allocate("a", tokens(9), 6),
    )
    err = ExceedsCapacity("x", 5, 4)
    assert (err.needed, err.num_blocks, err.request_id) == (5, 4, "x")


def test_allocation_beyond_free_blocks(pool: BlockPool) -> None:
    # a holds 2 blocks; 2 free. A new 6-token request needs 3.
    refused(
        pool,
        OutOfBlocks,
        ["'new'", "needs 3 free KV blocks, 2 are free"],
        lambda: pool.allocate("new", tokens(6), 6),
    )
    # A fork of a shares its partial last block: growing it to 4 blocks needs 2 new
    # blocks plus the copy-on-write of the shared one.
    fork(pool, "a", "c")
    refused(
        pool,
        OutOfBlocks,
        ["'c'", "needs 3 free KV blocks, 2 are free"],
        lambda: pool.allocate("c", tokens(8), 5),
    )
    assert not pool.can_allocate("new", 6)
    assert pool.can_allocate("new", 4)


@pytest.mark.mutation_kill
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


def test_stale_prefix_hit(pool: BlockPool) -> None:
    prompt = [*tokens(2, 10), 99]
    hit = pool.lookup(prompt)  # b's freed, still cached block
    assert len(hit.block_ids) == 1
    assert pool.forget_cached(hit.block_ids) == 1
    refused(
        pool,
        InvalidArgument,
        ["'new'", "stale", f"block {hit.block_ids[0]}"],
        lambda: pool.allocate("new", prompt, 1, hit=hit),
    )


def test_stale_prefix_hit_after_block_reuse() -> None:
    pool = BlockPool(2, 2)
    pool.allocate("a", [1, 2, 3], 3)
    pool.free("a")
    hit = pool.lookup([1, 2, 3])
    assert hit.block_ids == (0,)
    pool.allocate("x", [5, 6, 7, 8], 4)  # takes both blocks, re-indexing block 0
    pool.free("x")
    refused(pool, InvalidArgument, ["stale"], lambda: pool.allocate("new", [1, 2, 3], 1, hit=hit))


def test_hit_given_to_an_existing_request(pool: BlockPool) -> None:
    hit = pool.lookup([*tokens(2, 10), 5])
    refused(
        pool,
        InvalidArgument,
        ["'a'", "already holds blocks"],
        lambda: pool.allocate("a", tokens(4), 1, hit=hit),
    )


@pytest.mark.mutation_kill
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
    assert stored(pool, "a") == 3


def test_hit_for_other_token_ids(pool: BlockPool) -> None:
    """Regression: a hit looked up for one prompt was accepted for another."""
    hit = pool.lookup([*tokens(2, 10), 5])
    assert len(hit.block_ids) == 1
    refused(
        pool,
        InvalidArgument,
        ["'new'", "does not match its token ids", "(10, 11)", "(7, 7)"],
        lambda: pool.allocate("new", [7, 7, 5], 1, hit=hit),
    )


def test_hit_covering_the_last_token(pool: BlockPool) -> None:
    real = pool.lookup([*tokens(2, 10), 5])
    forged = PrefixHit(real.root_key, real.block_ids, real.keys, real.block_size)
    refused(
        pool,
        InvalidArgument,
        ["'new'", "covers 2 tokens of 2", "last token"],
        lambda: pool.allocate("new", tokens(2, 10), 1, hit=forged),
    )


def _three_cached_blocks() -> tuple[BlockPool, PrefixHit]:
    """Block size 1, 3 blocks all held by "a" and cached ([5], [5, 6], [5, 6, 7])."""
    pool = BlockPool(3, 1)
    pool.allocate("a", [5, 6, 7], 3)
    hit = pool.lookup([5, 6, 7, 8])
    assert hit.block_ids == (0, 1, 2)
    return pool, hit


@pytest.mark.mutation_kill
def test_a_hit_must_leave_the_last_token_to_recompute() -> None:
    pool, hit = _three_cached_blocks()
    one = PrefixHit(hit.root_key, hit.block_ids[:1], hit.keys[:1], 1)
    with pytest.raises(InvalidArgument, match="covers 1 tokens of 1; the last token must be"):
        pool.allocate("b", [5], 1, hit=one)


@pytest.mark.mutation_kill
def test_a_hit_with_more_blocks_than_keys_is_refused() -> None:
    pool, hit = _three_cached_blocks()
    bad = PrefixHit(hit.root_key, hit.block_ids[:2], hit.keys[:1], 1)
    before = pool.snapshot()
    with pytest.raises(ValueError, match="zip"):
        pool.allocate("b", [5, 6, 7, 8], 1, hit=bad)
    assert pool.snapshot() == before


@pytest.mark.mutation_kill
def test_a_hit_must_chain_from_the_root() -> None:
    # Block 1 holds token 6 computed after token 5: a hit that starts at it (from the
    # root) has the right key and tokens for that block but the wrong parent.
    pool, hit = _three_cached_blocks()
    bad = PrefixHit(hit.root_key, hit.block_ids[1:2], hit.keys[1:2], 1)
    with pytest.raises(InvalidArgument, match="does not match its token ids at block 0"):
        pool.allocate("b", [6, 9], 1, hit=bad)
    assert not pool.has_request("b")


def test_hit_from_another_pool(pool: BlockPool) -> None:
    other = BlockPool(4, 4)
    other.allocate("z", tokens(5), 5)
    hit = other.lookup(tokens(5))
    refused(
        pool,
        InvalidArgument,
        ["'new'", "another pool or namespace"],
        lambda: pool.allocate("new", tokens(5), 1, hit=hit),
    )


def test_too_few_token_ids(pool: BlockPool) -> None:
    refused(
        pool,
        InvalidArgument,
        ["'a'", "positions up to 5", "only 4 token ids"],
        lambda: pool.allocate("a", tokens(4), 2),
    )
    refused(
        pool,
        InvalidArgument,
        ["'new'", "positions up to 3", "only 2 token ids"],
        lambda: pool.allocate("new", tokens(2), 3),
    )


def test_empty_lookup(pool: BlockPool) -> None:
    refused(pool, InvalidArgument, ["token_ids is empty"], lambda: pool.lookup([]))


@pytest.mark.mutation_kill
def test_lookup_of_nothing_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgument) as info:
        BlockPool(2, 1).lookup([])
    assert str(info.value) == "lookup: token_ids is empty; a request needs at least one token"


def _round_trip(pool: BlockPool, tag: str, k: int, bs: int) -> Allocation:
    tokens = [(len(tag) * 7919 + ord(tag[-1]) * 131 + i) % 30_000 for i in range(k * bs)]
    alloc = pool.allocate(tag, tokens, len(tokens))
    pool.free(tag)
    return alloc


@pytest.mark.parametrize("caching", [False, True])
def test_allocate_and_free_outside_and_inside_a_transaction_agree(caching: bool) -> None:
    """The unjournaled allocate/free outside a transaction (no undo records) leaves the
    pool exactly as the journaled one inside a committed transaction does."""
    outside = BlockPool(40, 4, enable_prefix_caching=caching)
    inside = BlockPool(40, 4, enable_prefix_caching=caching)
    outside.allocate("held", list(range(-1, -11, -1)), 10)
    inside.allocate("held", list(range(-1, -11, -1)), 10)
    for i, k in enumerate([3, 8, 1, 30, 5]):
        a = _round_trip(outside, f"r{i}", k, 4)
        inside.begin()
        b = _round_trip(inside, f"r{i}", k, 4)
        inside.commit()
        assert a == b and len(a.new_block_ids) == k
        assert outside.snapshot() == inside.snapshot()
    check_pool(outside.snapshot())


@pytest.mark.parametrize("caching", [False, True])
def test_a_rolled_back_step_of_runs_restores_the_pool_exactly(caching: bool) -> None:
    pool = BlockPool(64, 4, enable_prefix_caching=caching)
    pool.allocate("a", list(range(100, 130)), 30)
    fork(pool, "a", "b")
    _round_trip(pool, "warm", 20, 4)  # with caching: cached free blocks, evicted on pop
    before = pool.snapshot()
    pool.begin()
    pool.allocate("c", list(range(200, 240)), 40)
    alloc = pool.allocate("b", [*range(100, 130), 1, 2, 3], 3)
    assert len(alloc.copies) == 1  # the shared partial tail is copied
    pool.free("a")  # shared with b: those blocks only lose a reference
    pool.free("c")
    _round_trip(pool, "d", 30, 4)
    pool.rollback()
    assert pool.snapshot() == before
    check_pool(pool.snapshot())


def test_a_run_of_blocks_costs_a_constant_number_of_undo_records() -> None:
    """Compact journal: allocating or freeing K blocks records O(1) entries, not O(K)."""
    counts = []
    for k in (2, 32):
        pool = BlockPool(64, 4, enable_prefix_caching=False)
        pool.begin()
        pool.allocate("r", list(range(k * 4)), k * 4)
        allocated = pool.journal.num_entries
        pool.free("r")
        counts.append((allocated, pool.journal.num_entries))
        pool.rollback()
        assert pool.num_free_blocks == 64
    assert counts[0] == counts[1]


def test_the_unjournaled_allocate_still_raises_typed_errors_with_nothing_changed() -> None:
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    pool.allocate("h", [9, 9, 9, 9], 4)
    before = pool.snapshot()
    with pytest.raises(OutOfBlocks):
        pool.allocate("a", list(range(6)), 6)  # 3 blocks, 2 free
    with pytest.raises(ExceedsCapacity):
        pool.allocate("a", list(range(10)), 10)  # 5 blocks of 4
    with pytest.raises(InvalidArgument):
        pool.allocate("a", [1, 2], 3)
    with pytest.raises(InvalidArgument):
        pool.allocate("a", [1, 2], True)
    with pytest.raises(InvalidArgument):
        pool.allocate("a", [1, 2], 0)
    assert pool.snapshot() == before and not pool.has_request("a")
    alloc = pool.allocate("a", (5, 6, 7), 3)  # a tuple of token ids works as a list
    assert alloc == Allocation("a", 0, 3, 0, (2, 3), ())
    assert pool.snapshot().tables[0].token_ids == (5, 6, 7)


def test_a_token_that_cannot_be_hashed_leaves_a_caching_pool_unchanged() -> None:
    """With prefix caching, allocate hashes the blocks it fills after changing the table;
    a token id outside int64 fails there, and the pool's own transaction undoes it."""
    pool = BlockPool(8, 4, enable_prefix_caching=True)
    pool.allocate("a", [1, 2, 3, 4, 5], 5)
    before = pool.snapshot()
    with pytest.raises(Exception, match=r"argument out of range|format requires"):
        pool.allocate("b", [7, 7, 7, 2**64], 4)
    assert pool.snapshot() == before and not pool.has_request("b")


@pytest.mark.mutation_kill
def test_clearing_the_cache_forgets_every_prefix_and_keeps_the_held_blocks() -> None:
    pool = BlockPool(8, 4)
    pool.allocate("a", tokens(8), 8)  # two full blocks, indexed, held
    pool.allocate("b", tokens(8, 100), 8)
    pool.free("b")  # its blocks stay indexed, free
    held = pool.block_table("a")
    pool.begin()
    assert pool.clear_cache() == 4
    pool.rollback()  # the clear is undone with its transaction
    assert pool.lookup(tokens(9, 100)).num_tokens == 8
    assert pool.clear_cache() == 4
    assert pool.lookup(tokens(9)).num_tokens == 0 and pool.lookup(tokens(9, 100)).num_tokens == 0
    assert pool.block_table("a") == held and pool.num_free_blocks == 6
    assert pool.snapshot().cache_entries == ()
    assert pool.clear_cache() == 0
    assert_valid(pool)
