"""BlockPool: worked examples (docs/ARCHITECTURE.md), prefix-cache behaviour, bad input.

Every bad-input test asserts the typed exception from ``ref.errors``, a message naming
the bad value, and that ``pool.snapshot()`` is unchanged (ATOMIC).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

import ref.kv.pool as pool_module
from ref.errors import (
    DuplicateRequest,
    ExceedsCapacity,
    InvalidArgument,
    OutOfBlocks,
    RefserveError,
    UnknownRequest,
)
from ref.kv import BlockCopy, BlockPool, PrefixHit
from spec import check_pool
from spec.atomic import check_atomic_pool
from spec.hashing import Namespace


def tokens(n: int, base: int = 0) -> list[int]:
    return list(range(base, base + n))


def assert_valid(pool: BlockPool) -> None:
    assert check_pool(pool.snapshot()) == []


# ----------------------------------------------------------------- golden seeds
def test_seed_000_two_requests_of_17_and_31_tokens() -> None:
    """Block 16, lengths 17 and 31: 4 blocks, 48 slots used, 16 empty."""
    pool = BlockPool(8, 16)
    pool.allocate("a", tokens(17), 17)
    pool.allocate("b", tokens(31, 100), 31)
    assert pool.num_used_blocks == 4
    assert [len(pool.block_table(r)) for r in ("a", "b")] == [2, 2]
    used_slots = pool.num_stored("a") + pool.num_stored("b")
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
    assert pool.num_stored("B") == 14
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
    assert pool.num_stored("Q") == 6000 + 1008


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
    assert pool.evict(2) == 2  # least recently freed cached blocks: 0 then 3
    assert [e.block_id for e in pool.snapshot().cache_entries] == [2]
    assert pool.evict(5) == 1
    assert pool.evict(5) == 0
    assert_valid(pool)


def test_free_releases_in_reverse_order() -> None:
    pool = BlockPool(6, 2)
    pool.allocate("a", tokens(5), 5)
    assert pool.block_table("a") == (0, 1, 2)
    pool.free("a")
    assert pool.snapshot().free_queue == (3, 4, 5, 2, 1, 0)


def test_free_keeps_blocks_shared_with_a_fork() -> None:
    pool = BlockPool(6, 2)
    pool.allocate("a", tokens(3), 3)
    pool.fork("a", "b")
    pool.free("a")
    assert pool.snapshot().ref_cnt[:2] == (1, 1)
    assert pool.snapshot().free_queue == (2, 3, 4, 5)
    pool.free("b")
    assert pool.snapshot().free_queue == (2, 3, 4, 5, 1, 0)


def test_identity_check_on_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a hash that collides on everything, a lookup must still miss on other tokens."""

    def colliding(parent: bytes, token_ids: Sequence[int]) -> bytes:
        return b"collision" * 4

    monkeypatch.setattr(pool_module, "block_key", colliding)
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


def test_fork_and_copy_on_write() -> None:
    pool = BlockPool(6, 4)
    parent_tokens = tokens(6)
    pool.allocate("p", parent_tokens, 6)  # blocks 0 (full), 1 (2 of 4)
    pool.fork("p", "c")
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
    pool.fork("p", "c")
    alloc = pool.allocate("c", [*tokens(8), 5], 1)
    assert alloc.copies == ()
    assert alloc.new_block_ids == (2,)
    assert_valid(pool)


def test_copy_on_write_counts_against_free_blocks() -> None:
    pool = BlockPool(2, 4)
    pool.allocate("p", tokens(6), 6)
    pool.fork("p", "c")
    assert pool.blocks_to_allocate("c", 1) == 1
    pool2 = BlockPool(3, 4)
    pool2.allocate("p", tokens(6), 6)
    pool2.allocate("x", [1], 1)
    pool2.fork("p", "c")
    before = pool2.snapshot()
    with pytest.raises(OutOfBlocks, match="needs 1 free KV blocks, 0 are free"):
        pool2.allocate("c", [*tokens(6), 1], 1)
    assert pool2.snapshot() == before


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


def test_prefix_caching_off() -> None:
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    pool.allocate("a", tokens(5), 5)
    assert pool.snapshot().cache_entries == ()
    assert pool.lookup(tokens(5)).block_ids == ()
    assert pool.evict(4) == 0


def test_transaction_rollback_restores_free_queue_order() -> None:
    """Regression: undoing "pop block b" after "append block b" restored b out of place."""
    pool = BlockPool(5, 1)
    pool.allocate("r", tokens(3), 3)
    before = pool.snapshot()
    assert before.free_queue == (3, 4)
    with pytest.raises(RuntimeError), pool.transaction():
        pool.allocate("r", tokens(4), 1)  # pops block 3
        pool.free("r")  # appends 3, 2, 1, 0
        raise RuntimeError("executor fault")
    assert pool.snapshot() == before
    assert check_atomic_pool(before, pool.snapshot()) == []
    pool.allocate("s", [1, 2], 2)
    assert pool.block_table("s") == (3, 4)


def test_transaction_commits_when_the_body_succeeds() -> None:
    pool = BlockPool(4, 2)
    with pool.transaction():
        pool.allocate("a", tokens(3), 3)
        pool.fork("a", "b")
    assert pool.has_request("a") and pool.has_request("b")
    with pytest.raises(KeyError), pool.transaction():
        assert pool.allocate("b", tokens(4), 1).copies == (BlockCopy(1, 2),)
        pool.free("a")
        raise KeyError("fault")
    assert pool.block_table("a") == pool.block_table("b") == (0, 1)
    assert_valid(pool)


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


def test_bad_evict_count(pool: BlockPool) -> None:
    refused(pool, InvalidArgument, ["num_blocks", "got -1"], lambda: pool.evict(-1))
    refused(pool, InvalidArgument, ["bool True"], lambda: pool.evict(True))


def test_free_unknown_or_already_freed(pool: BlockPool) -> None:
    refused(pool, UnknownRequest, ["free", "'ghost'"], lambda: pool.free("ghost"))
    refused(pool, UnknownRequest, ["free", "'b'"], lambda: pool.free("b"))


def test_fork_missing_or_onto_existing(pool: BlockPool) -> None:
    refused(pool, UnknownRequest, ["fork", "'ghost'"], lambda: pool.fork("ghost", "c"))
    refused(pool, UnknownRequest, ["fork", "'b'"], lambda: pool.fork("b", "c"))  # freed
    pool.allocate("c", [1], 1)
    refused(pool, DuplicateRequest, ["fork", "'c'", "already in use"], lambda: pool.fork("a", "c"))
    refused(pool, DuplicateRequest, ["'a'"], lambda: pool.fork("a", "a"))


def test_queries_on_unknown_request(pool: BlockPool) -> None:
    refused(pool, UnknownRequest, ["'ghost'"], lambda: pool.block_table("ghost"))
    refused(pool, UnknownRequest, ["'ghost'"], lambda: pool.num_stored("ghost"))


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
    pool.fork("a", "c")
    refused(
        pool,
        OutOfBlocks,
        ["'c'", "needs 3 free KV blocks, 2 are free"],
        lambda: pool.allocate("c", tokens(8), 5),
    )
    assert not pool.can_allocate("new", 6)
    assert pool.can_allocate("new", 4)


def test_stale_prefix_hit(pool: BlockPool) -> None:
    prompt = [*tokens(2, 10), 99]
    hit = pool.lookup(prompt)  # b's freed, still cached block
    assert len(hit.block_ids) == 1
    assert pool.evict(4) >= 1
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


def test_rollback_of_fast_decode_restores_chain_keys() -> None:
    """Regression: undoing append_decode_tokens left the key of a rolled-back full block.

    Later blocks then chained from it, so a lookup for the rolled-back tokens could be
    served a block computed after other tokens.
    """
    pool = BlockPool(4, 2)
    pool.allocate("r", [1], 1)
    before = pool.snapshot()
    pool.begin()
    assert pool.append_decode_tokens(["r"], [[1, 2]]) == []  # fills block 0 and caches it
    pool.rollback()
    assert pool.snapshot() == before
    pool.allocate("r", [1, 3, 4, 5], 3)  # other tokens this time
    assert_valid(pool)
    pool.allocate("s", [1, 2, 7], 3)  # indexes the key of (1, 2)
    assert pool.lookup([1, 2, 4, 5, 9]).block_ids == pool.block_table("s")[:1]
    assert_valid(pool)
