"""A pool driven by decode runs equals one driven request by request
(ref/kv/decode_runs.py, ``DecodeRun``; docs/ARCHITECTURE.md, "The persistent batch").

A decode run is looked up once and kept across steps while the pool says it is current;
each ``append_decodes`` takes the step's fresh blocks as one run off the free queue and
indexes the filled blocks in one pass. Two pools take the same random operations:
admissions with prefix hits, decode steps (some rolled back), single tokens through
``allocate``, frees, forks and a second run over the same tables; one decodes through
``DecodeRun``/``append_decodes`` with the claims the persistent batch makes, the other
request by request through ``allocate(rid, known, 1)`` (``kv_steps.decode_each``). After
every operation their snapshots are equal and ``refserve.spec.check_pool`` reports nothing,
whether or not the caller hands over the tokens of the blocks that fill (``filled``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_steps import assert_valid, decode_copies, decode_each, decode_step, stored

from refserve.errors import ExceedsCapacity, InvalidArgument, OutOfBlocks, UnknownRequest
from refserve.kv import BlockCopy, BlockPool, DecodeRun, fork
from refserve.spec import check_pool

TOKENS = st.integers(min_value=0, max_value=2)  # few ids: prefix hits are common


class _Pair:
    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.ref = BlockPool(num_blocks, block_size, enable_prefix_caching=caching)
        self.bulk = BlockPool(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs = block_size
        self.known: dict[str, list[int]] = {}  # each request's tokens; the last is unstored
        self.run: DecodeRun | None = None
        self.spare: DecodeRun | None = None  # a second run over the same tables
        self.next_id = 0

    def check(self) -> None:
        snap = self.bulk.snapshot()
        assert snap == self.ref.snapshot()
        assert check_pool(snap) == []

    def admit(self, prompt: list[int], sampled: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        outcomes = []
        for pool in (self.ref, self.bulk):
            hit = pool.lookup(prompt) if pool.enable_prefix_caching else None
            try:
                pool.allocate(rid, prompt, len(prompt) - (hit.num_tokens if hit else 0), hit=hit)
                outcomes.append(True)
            except (OutOfBlocks, ExceedsCapacity):
                outcomes.append(False)
        assert outcomes[0] == outcomes[1]
        if outcomes[0]:
            self.known[rid] = [*prompt, sampled]

    def decode(self, sampled: list[int], rolled_back: bool, claim_filled: bool) -> None:
        ids = list(self.known)
        if not ids:
            return
        stored = [len(self.known[rid]) - 1 for rid in ids]
        tokens = [self.known[rid][n] for rid, n in zip(ids, stored, strict=True)]
        bs = self.bs
        needy = [
            i
            for i, (rid, n) in enumerate(zip(ids, stored, strict=True))
            if n % bs == 0 or self.bulk.ref_count(self.bulk.block_table(rid)[-1]) > 1
        ]
        filling = [i for i, n in enumerate(stored) if (n + 1) % bs == 0]
        filled = (
            [self.known[ids[i]][stored[i] + 1 - bs : stored[i] + 1] for i in filling]
            if claim_filled
            else None
        )
        if self.spare is not None and self.spare.is_current():
            self.run, self.spare = self.spare, self.run  # a second run over the same tables
        if self.run is None or not self.run.is_current():
            self.run = DecodeRun(self.bulk, ids)
        if rolled_back:
            self.ref.begin()
            self.bulk.begin()
        copies = decode_each(self.ref, {rid: self.known[rid] for rid in ids})
        growth = self.run.append_decodes(tokens, needy, filling, filled)
        assert (growth is None) == (copies is None)
        if growth is not None:
            assert growth.copies == copies
        if rolled_back:
            self.ref.rollback()
            self.bulk.rollback()
        elif growth is not None:
            for j, rid in enumerate(ids):  # more requests than drawn tokens: reuse them
                self.known[rid].append(sampled[j % len(sampled)])

    def take_spare_run(self) -> None:
        if self.known:
            self.spare = DecodeRun(self.bulk, list(self.known))

    def extend(self, pick: int, sampled: int) -> None:
        """One token through ``allocate``, as the reference decode loop stores it."""
        if self.known:
            rid = list(self.known)[pick % len(self.known)]
            outcomes = []
            for pool in (self.ref, self.bulk):
                try:
                    pool.allocate(rid, self.known[rid], 1)
                    outcomes.append(True)
                except (OutOfBlocks, ExceedsCapacity):
                    outcomes.append(False)
            assert outcomes[0] == outcomes[1]
            if outcomes[0]:
                self.known[rid].append(sampled)

    def free(self, pick: int) -> None:
        if self.known:
            rid = list(self.known)[pick % len(self.known)]
            self.ref.free(rid)
            self.bulk.free(rid)
            del self.known[rid]

    def fork(self, pick: int) -> None:
        if self.known:
            parent = list(self.known)[pick % len(self.known)]
            child = f"r{self.next_id}"
            self.next_id += 1
            fork(self.ref, parent, child)
            fork(self.bulk, parent, child)
            self.known[child] = list(self.known[parent])


SAMPLED = st.lists(TOKENS, min_size=8, max_size=8)
KEPT = st.tuples(st.just(False), st.booleans())  # (rolled back, claim the filled blocks)
OPS = st.one_of(
    st.tuples(st.just("admit"), st.lists(TOKENS, min_size=1, max_size=9), TOKENS),
    st.tuples(st.just("decode"), SAMPLED, st.tuples(st.booleans(), st.booleans())),
    st.tuples(st.just("decode"), SAMPLED, KEPT),
    st.tuples(st.just("decode"), SAMPLED, KEPT),
    st.tuples(st.just("decode"), SAMPLED, KEPT),
    st.tuples(st.just("decode"), SAMPLED, st.tuples(st.just(True), st.booleans())),
    st.tuples(st.just("extend"), st.integers(0, 7), TOKENS),
    st.tuples(st.just("spare"), st.none(), st.none()),
    st.tuples(st.just("free"), st.integers(0, 7), st.none()),
    st.tuples(st.just("fork"), st.integers(0, 7), st.none()),
)


@settings(max_examples=150)
@given(
    num_blocks=st.integers(3, 24),
    block_size=st.sampled_from([1, 2, 4]),
    caching=st.booleans(),
    ops=st.lists(OPS, max_size=80),
)
def test_a_pool_decoding_by_runs_equals_one_decoding_request_by_request(
    num_blocks: int, block_size: int, caching: bool, ops: list[tuple[str, object, object]]
) -> None:
    pair = _Pair(num_blocks, block_size, caching)
    for op, a, b in ops:
        if op == "admit":
            assert isinstance(a, list) and isinstance(b, int)
            pair.admit(a, b)
        elif op == "decode":
            assert isinstance(a, list) and isinstance(b, tuple)
            pair.decode(a, *b)
        elif op == "free":
            assert isinstance(a, int)
            pair.free(a)
        elif op == "fork":
            assert isinstance(a, int)
            pair.fork(a)
        elif op == "extend":
            assert isinstance(a, int) and isinstance(b, int)
            pair.extend(a, b)
        else:
            assert op == "spare"
            pair.take_spare_run()
        pair.check()


def test_a_run_kept_for_forty_steps_stores_each_token_at_once() -> None:
    """Forty steps of one request on one run, block 4, caching on: after every step the
    snapshot holds every token and its filled blocks hashed right, and the run stays
    current (a step's own growth is reported through DecodeGrowth, not take_changed)."""
    pool = BlockPool(16, 4, enable_prefix_caching=True)
    pool.allocate("a", [7], 1)
    run = DecodeRun(pool, ["a"])
    known = [7]
    for step in range(40):
        position = len(known)
        known.append(step % 3)
        needy = [0] if position % 4 == 0 else []
        filling = [0] if (position + 1) % 4 == 0 else []
        filled = [known[-4:]] if filling else None
        growth = run.append_decodes([known[-1]], needy, filling, filled)
        assert growth is not None and growth.lengths == ([position // 4 + 1] if needy else [])
        snap = pool.snapshot()
        assert snap.tables[0].token_ids == tuple(known) and check_pool(snap) == []
        assert run.is_current()
    assert len(pool.snapshot().cache_entries) == 41 // 4


def _two_decoding() -> tuple[BlockPool, DecodeRun]:
    """ "a" and "b" (block 4, caching on), each after two decode steps on one run."""
    pool = BlockPool(16, 4, enable_prefix_caching=True)
    pool.allocate("a", [1, 2], 2)
    pool.allocate("b", [5], 1)
    run = DecodeRun(pool, ["a", "b"])
    assert run.append_decodes([3, 6], [], []) is not None
    assert run.append_decodes([4, 7], [], [0]) is not None  # "a" fills block 0
    return pool, run


def test_two_runs_over_the_same_tables_append_to_the_same_lists() -> None:
    pool, first = _two_decoding()
    second = DecodeRun(pool, ["a", "b"])
    # "a" starts block 1, "b" fills block 0.
    assert second.append_decodes([9, 8], [0], [1]) is not None
    assert [t.token_ids for t in pool.snapshot().tables] == [(1, 2, 3, 4, 9), (5, 6, 7, 8)]
    assert first.is_current() and second.is_current()
    assert first.append_decodes([5, 0], [1], []) is not None  # "b" starts block 1
    snap = pool.snapshot()
    assert [t.token_ids for t in snap.tables] == [(1, 2, 3, 4, 9, 5), (5, 6, 7, 8, 0)]
    assert len(snap.cache_entries) == 2 and check_pool(snap) == []


def test_a_rollback_undoes_the_steps_inside_it_and_keeps_the_earlier_ones() -> None:
    pool, run = _two_decoding()
    before = pool.snapshot()
    pool.begin()
    assert run.append_decodes([9, 8], [0], [1]) is not None  # "b" fills block 0
    assert run.append_decodes([1, 1], [1], []) is not None  # "b" starts block 1
    inside = pool.snapshot()
    assert stored(pool, "a") == 6 and len(inside.cache_entries) == 2
    assert check_pool(inside) == []
    pool.rollback()
    assert pool.snapshot() == before
    assert not run.is_current()  # a rollback may shrink any table
    again = DecodeRun(pool, ["a", "b"])
    assert again.append_decodes([0, 1], [0], []) is not None
    assert [t.token_ids for t in pool.snapshot().tables] == [(1, 2, 3, 4, 0), (5, 6, 7, 1)]
    assert check_pool(pool.snapshot()) == []


def test_a_copy_on_write_step_equals_the_request_by_request_path() -> None:
    """The general growth path: after a fork, "a" and its child share a partial block
    and both write it in one step; the first copies it, the second then holds it alone,
    and the block each fills is hashed from its own tokens."""
    pools = [BlockPool(16, 4, enable_prefix_caching=True) for _ in range(2)]
    for pool in pools:
        pool.allocate("a", [1, 2], 2)
    bulk, ref = pools
    assert DecodeRun(bulk, ["a"]).append_decodes([3], [], []) is not None
    assert decode_each(ref, {"a": [1, 2, 3]}) == []
    for pool in pools:
        fork(pool, "a", "c")
    run = DecodeRun(bulk, ["a", "c"])
    bulk.begin()
    growth = run.append_decodes([4, 5], [0, 1], [0, 1])
    assert growth is not None
    inside = bulk.snapshot()
    bulk.commit()
    copies = decode_each(ref, {"a": [1, 2, 3, 4], "c": [1, 2, 3, 5]})
    assert copies is not None and len(copies) == 1 and growth.copies == copies
    assert inside == bulk.snapshot() == ref.snapshot()
    assert len(inside.cache_entries) == 2 and check_pool(inside) == []


def test_allocate_after_decode_steps_stores_the_next_position() -> None:
    """After two steps "a" stores 4 tokens (block 0 full): one more token needs a fresh
    block, and ``allocate`` stores it at position 4, as for a pool decoding request by
    request."""
    pool, _ = _two_decoding()
    assert pool.blocks_to_allocate("a", 1) == 1 and pool.can_allocate("a", 1)
    alloc = pool.allocate("a", [1, 2, 3, 4, 9], 1)
    assert alloc.start_position == 4 and len(alloc.new_block_ids) == 1
    assert [t.token_ids for t in pool.snapshot().tables] == [(1, 2, 3, 4, 9), (5, 6, 7)]
    assert check_pool(pool.snapshot()) == []


def test_a_decode_step_after_the_cache_was_forgotten_fills_and_grows() -> None:
    """With prefix caching on but nothing indexed (an executor fault made the pool forget
    its cache), a step in which one request starts a block and another fills one still
    indexes the filled block, as request by request."""
    pools = [BlockPool(16, 4, enable_prefix_caching=True) for _ in range(2)]
    for pool in pools:
        pool.allocate("a", [1, 2, 3, 4], 4)  # block 0 full: indexed
        pool.allocate("b", [5, 6, 7], 3)
        assert pool.forget_cached(range(16)) == 1
    bulk, ref = pools
    run = DecodeRun(bulk, ["a", "b"])
    assert run.append_decodes([9, 8], [0], [1]) is not None
    assert decode_each(ref, {"a": [1, 2, 3, 4, 9], "b": [5, 6, 7, 8]}) == []
    snap = bulk.snapshot()
    assert snap == ref.snapshot() and len(snap.cache_entries) == 1
    assert check_pool(snap) == []


def test_the_tokens_of_a_filled_block_are_the_callers_claim() -> None:
    """``filled`` is trusted like ``needy`` and ``filling``: a wrong claim is cached as
    given, and the next snapshot's PREFIX check names the block; a count that does not
    match ``filling``, a block of another length or a token id outside int64 is refused
    before anything changes."""
    pool = BlockPool(8, 4, enable_prefix_caching=True)
    pool.allocate("a", [5, 6, 7], 3)
    run = DecodeRun(pool, ["a"])
    before = pool.snapshot()
    with pytest.raises(InvalidArgument, match="2 filled blocks for 1 filling"):
        run.append_decodes([8], [], [0], [[5, 6, 7, 8], [5, 6, 7, 8]])
    assert pool.snapshot() == before
    with pytest.raises(InvalidArgument, match="a filled block holds 3 token ids, not the block"):
        run.append_decodes([8], [], [0], [[6, 7, 8]])
    with pytest.raises(InvalidArgument, match="a filled block holds a bad token id"):
        run.append_decodes([8], [], [0], [[5, 6, 7, 2**63]])
    assert pool.snapshot() == before
    assert run.append_decodes([8], [], [0], [[5, 6, 7, 9]]) is not None
    violations = check_pool(pool.snapshot())
    assert [v.invariant.name for v in violations] == ["PREFIX"]
    assert "cache entry points at a block now holding other tokens" in str(violations[0])


# ------------------------------------------------ single runs, worked by hand
@pytest.mark.mutation_kill
def test_a_decode_run_is_stale_after_a_one_off_allocation_or_a_free() -> None:
    """Each table added or freed outside a step, caching off, makes an earlier decode run
    stale and is reported to ``take_changed`` by its request id."""
    pool = BlockPool(8, 2, enable_prefix_caching=False)
    pool.allocate("a", [1, 2, 3], 3)
    run = DecodeRun(pool, ["a"])
    pool.take_changed()
    pool.allocate("b", [4, 5], 2)
    assert not run.is_current()
    assert pool.take_changed() == ({"b"}, False)
    run = DecodeRun(pool, ["a"])
    pool.free("b")
    assert not run.is_current()
    assert pool.take_changed() == ({"b"}, False)
    pool.allocate("c", [6, 7], 2)  # a free then an allocation: never back to the run's epoch
    assert not run.is_current()


@pytest.mark.mutation_kill
def test_a_copy_on_write_leaves_the_other_holders_their_references() -> None:
    """Three requests share a partial last block; the one that writes gets a private
    copy and the shared block keeps the other two references."""
    pool = BlockPool(8, 4, enable_prefix_caching=False)
    pool.allocate("a", [1, 2, 3, 4, 5], 5)
    fork(pool, "a", "b")
    fork(pool, "a", "c")
    shared = pool.block_table("a")[-1]
    assert decode_copies(pool, {"a": [1, 2, 3, 4, 5, 6]}) == [
        BlockCopy(shared, pool.block_table("a")[-1])
    ]
    assert pool.ref_count(shared) == 2
    assert check_pool(pool.snapshot()) == []


@pytest.mark.mutation_kill
def test_decode_appends_that_fit_need_no_free_block() -> None:
    pool = BlockPool(2, 4)
    pool.allocate("a", [1, 2, 3], 3)
    pool.allocate("b", [5, 6, 7], 3)
    assert pool.num_free_blocks == 0
    # Both last blocks have a free slot and are private: nothing to take from the queue.
    assert decode_copies(pool, {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}) == []
    assert stored(pool, "a") == stored(pool, "b") == 4
    assert check_pool(pool.snapshot()) == []


@pytest.mark.mutation_kill
def test_decode_appends_count_every_request_that_needs_a_block() -> None:
    pool = BlockPool(3, 2)
    pool.allocate("a", [1, 2], 2)
    pool.allocate("b", [3, 4], 2)
    before = pool.snapshot()
    # Both last blocks are full: two fresh blocks needed, one is free.
    assert decode_copies(pool, {"a": [1, 2, 5], "b": [3, 4, 6]}) is None
    assert pool.snapshot() == before


@pytest.mark.mutation_kill
@pytest.mark.parametrize("caching", [True, False])
def test_a_block_filled_by_a_decode_append_is_cached_at_once(caching: bool) -> None:
    pool = BlockPool(4, 4, enable_prefix_caching=caching)
    pool.allocate("a", [1, 2, 3], 3)
    assert decode_copies(pool, {"a": [1, 2, 3, 4]}) == []
    entries = pool.snapshot().cache_entries
    assert [(e.block_id, e.token_ids) for e in entries] == ([(0, (1, 2, 3, 4))] if caching else [])
    assert pool.lookup([1, 2, 3, 4, 9]).block_ids == ((0,) if caching else ())
    pool.begin()
    assert decode_copies(pool, {"a": [1, 2, 3, 4, 5]}) == []  # a fresh block 1
    assert decode_copies(pool, {"a": [1, 2, 3, 4, 5, 6]}) == []  # into block 1
    assert stored(pool, "a") == 6 and pool.block_table("a") == (0, 1)
    pool.rollback()
    assert stored(pool, "a") == 4 and pool.block_table("a") == (0,)
    assert pool.snapshot().cache_entries == entries
    assert check_pool(pool.snapshot()) == []


@pytest.mark.mutation_kill
def test_decode_append_into_a_shared_block_needs_a_free_block_for_its_copy() -> None:
    pool = BlockPool(1, 4)
    pool.allocate("a", [1, 2, 3], 3)
    fork(pool, "a", "c")
    before = pool.snapshot()
    assert decode_copies(pool, {"a": [1, 2, 3, 4]}) is None  # copy-on-write, 0 free
    assert pool.snapshot() == before


@pytest.mark.mutation_kill
def test_decode_append_copies_a_shared_block_with_exactly_one_free_block() -> None:
    pool = BlockPool(2, 4)
    pool.allocate("a", [1, 2, 3], 3)
    fork(pool, "a", "c")
    assert decode_copies(pool, {"a": [1, 2, 3, 4]}) == [BlockCopy(0, 1)]
    assert pool.block_table("a") == (1,) and pool.block_table("c") == (0,)
    assert check_pool(pool.snapshot()) == []


@pytest.mark.mutation_kill
def test_a_bad_decode_step_is_refused_before_its_blocks_are_counted() -> None:
    # A full pool, and "a" needs a fresh block: a token count or a filled block that
    # does not match must be reported (InvalidArgument) before the "not enough blocks"
    # answer (None).
    pool = BlockPool(1, 2)
    pool.allocate("a", [1, 2], 2)
    before = pool.snapshot()
    run = DecodeRun(pool, ["a"])
    with pytest.raises(InvalidArgument, match="2 tokens for 1 requests"):
        run.append_decodes([3, 4], [0], [])
    with pytest.raises(InvalidArgument, match="1 filled blocks for 0 filling"):
        run.append_decodes([3], [0], [], [[2, 3]])
    assert run.append_decodes([3], [0], []) is None
    assert pool.snapshot() == before


def test_rollback_of_fast_decode_restores_chain_keys() -> None:
    """Regression: undoing a decode step left the key of a rolled-back full block.

    Later blocks then chained from it, so a lookup for the rolled-back tokens could be
    served a block computed after other tokens.
    """
    pool = BlockPool(4, 2)
    pool.allocate("r", [1], 1)
    before = pool.snapshot()
    pool.begin()
    assert decode_copies(pool, {"r": [1, 2]}) == []  # fills block 0 and caches it
    pool.rollback()
    assert pool.snapshot() == before
    pool.allocate("r", [1, 3, 4, 5], 3)  # other tokens this time
    assert_valid(pool)
    pool.allocate("s", [1, 2, 7], 3)  # indexes the key of (1, 2)
    assert pool.lookup([1, 2, 4, 5, 9]).block_ids == pool.block_table("s")[:1]
    assert_valid(pool)


def test_append_decodes_refuses_an_unknown_request_a_token_count_mismatch_and_a_stale_run() -> None:
    pool = BlockPool(8, 4)
    pool.allocate("a", [1, 2], 2)
    before = pool.snapshot()
    with pytest.raises(UnknownRequest, match=r"^decode_run: unknown request id 'ghost'$"):
        DecodeRun(pool, ["a", "ghost"])
    assert pool.snapshot() == before
    stale = DecodeRun(pool, ["a"])
    pool.allocate("b", [5], 1)  # a table added: the run taken before is stale
    with_b = pool.snapshot()
    assert not stale.is_current()
    with pytest.raises(
        InvalidArgument,
        match=r"^append_decodes: the decode run is stale \(a table changed since decode_run\); "
        r"take a new one$",
    ):
        stale.append_decodes([3], [], [])
    run = DecodeRun(pool, ["a", "b"])
    assert run.is_current()
    with pytest.raises(InvalidArgument, match=r"^append_decodes: 1 tokens for 2 requests$"):
        run.append_decodes([3], [], [])
    assert pool.snapshot() == with_b
    growth = run.append_decodes([3, 6], [], [])  # each appends into its own block
    assert growth is not None and growth.tails == [] and run.is_current()
    assert [t.token_ids for t in pool.snapshot().tables] == [(1, 2, 3), (5, 6)]


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p.allocate("a", [1, 2, 3, 4, 5], 3),  # a second block
        lambda p: p.free("a"),
        lambda p: fork(p, "a", "c"),
        lambda p: p.allocate("c", [9], 1),
        lambda p: (p.begin(), p.allocate("c", [9], 1), p.rollback()),
        lambda p: (p.begin(), p.allocate("a", [1, 2, 3, 4, 5], 3), p.rollback()),
        lambda p: (p.begin(), p.free("b"), p.rollback()),
    ],
    ids=["grow", "free", "fork", "add", "rollback", "rolled-back-grow", "rolled-back-free"],
)
def test_a_table_added_freed_forked_or_grown_or_a_rollback_makes_a_run_stale(
    change: Callable[[BlockPool], object],
) -> None:
    """A run holds table objects and their token lists: after a table is freed or
    replaced (or a rollback, which may have done either) it must not be appended to.
    Any change the pool reports to take_changed also ends it, conservatively."""
    pool = BlockPool(8, 4)
    pool.allocate("a", [1, 2], 2)
    pool.allocate("b", [5], 1)
    run = DecodeRun(pool, ["a", "b"])
    change(pool)
    assert not run.is_current()


@pytest.mark.mutation_kill
def test_a_decode_step_outside_a_step_that_cannot_hash_its_filled_block_changes_nothing() -> None:
    """``append_decodes`` called outside a step opens its own transaction: "a"'s token
    fills its block, which is hashed (from the token lists: no ``filled``) after the
    tokens went in and "b"'s fresh block came off the queue; a token id outside int64
    fails there, and the rollback leaves the pool as it was (all-or-nothing)."""
    pool = BlockPool(8, 4, enable_prefix_caching=True)
    pool.allocate("a", [5, 6, 7], 3)
    pool.allocate("b", [1, 2, 3, 4], 4)
    run = DecodeRun(pool, ["a", "b"])
    before = pool.snapshot()
    with pytest.raises(Exception, match=r"argument out of range|format requires"):
        run.append_decodes([2**63, 9], [1], [0])
    assert pool.snapshot() == before
    assert check_pool(pool.snapshot()) == []


def _evicting_decode_pool() -> BlockPool:
    """Block 2, caching on: "x" holds [1, 2, 3] (a hit on block 0, key K1) and fills
    its second block with (3, 4) at its next decode, key K2; "y" holds [9, 9] and needs
    a fresh block at its next decode. The one free block is the freed "old"'s block
    indexed as K2, so y's pop evicts the very key x's fill computes."""
    pool = BlockPool(4, 2, enable_prefix_caching=True)
    pool.allocate("old", [1, 2, 3, 4], 4)  # blocks 0 (K1) and 1 (K2), both indexed
    hit = pool.lookup([1, 2, 3])
    assert pool.allocate("x", [1, 2, 3], 1, hit=hit).num_cached_tokens == 2  # block 0 shared
    pool.allocate("y", [9, 9], 2)
    pool.free("old")  # block 1 (K2) is the only free block, still indexed
    assert pool.num_free_blocks == 1
    return pool


@pytest.mark.parametrize("order", [("x", "y"), ("y", "x")], ids=["fill-first", "pop-first"])
def test_a_decode_run_replays_the_order_of_pops_and_fills(order: tuple[str, str]) -> None:
    """The bulk decode takes its fresh blocks off the free queue as one run, before any
    filled block is indexed; the per-request path alternates in request order. When a
    pop evicts the key that another request's fill computes, only the order decides:
    fill first, the key is still taken (x's block stays private, then the key is gone);
    pop first, x's block takes the key. The run must end exactly as the loop does."""
    known = {"x": [1, 2, 3, 4], "y": [9, 9, 9]}
    bulk, loop = _evicting_decode_pool(), _evicting_decode_pool()
    growth = decode_step(bulk, {r: known[r] for r in order}, claim_filled=False)
    assert growth is not None and growth.copies == []
    for rid in order:
        loop.allocate(rid, known[rid], 1)
    assert bulk.snapshot() == loop.snapshot()
    assert_valid(bulk)
    indexed = {e.block_id for e in bulk.snapshot().cache_entries}
    x_block = bulk.block_table("x")[1]
    assert (x_block in indexed) == (order == ("y", "x"))


@pytest.mark.mutation_kill
@pytest.mark.parametrize("order", [("x", "y"), ("y", "x")], ids=["fill-first", "pop-first"])
def test_a_claimed_fill_replays_the_order_of_pops_and_fills(order: tuple[str, str]) -> None:
    """The same two orders with the filled block's tokens claimed (``filled``, as the
    persistent batch passes them): the inline hashing of a claimed block keeps a key that
    a later request's pop evicts taken, exactly as the loop does."""
    known = {"x": [1, 2, 3, 4], "y": [9, 9, 9]}
    bulk, loop = _evicting_decode_pool(), _evicting_decode_pool()
    run = DecodeRun(bulk, list(order))
    x, y = order.index("x"), order.index("y")
    tokens = [known[r][-1] for r in order]
    assert run.append_decodes(tokens, [y], [x], [[3, 4]]) is not None
    for rid in order:
        loop.allocate(rid, known[rid], 1)
    assert bulk.snapshot() == loop.snapshot()
    indexed = {e.block_id for e in bulk.snapshot().cache_entries}
    assert (bulk.block_table("x")[1] in indexed) == (order == ("y", "x"))


@pytest.mark.mutation_kill
def test_a_claimed_fill_takes_the_key_its_own_pop_evicted() -> None:
    """Blocks of one token: a decode both needs a block and fills it. "a"'s pop evicts
    the cached block keyed as (5, 6), the very key its own filled block computes; the
    pop comes first, so a's new block takes the key, as request by request."""

    def build() -> BlockPool:
        pool = BlockPool(3, 1, enable_prefix_caching=True)
        pool.allocate("a", [5], 1)  # block 0, K5
        pool.allocate("old", [5, 6], 2)  # block 1 private (K5 is taken), block 2 K56
        pool.free("old")  # block 2 (K56, still indexed) heads the free queue
        return pool

    bulk, loop = build(), build()
    assert DecodeRun(bulk, ["a"]).append_decodes([6], [0], [0], [[6]]) is not None
    loop.allocate("a", [5, 6], 1)
    assert bulk.snapshot() == loop.snapshot()
    assert bulk.block_table("a")[1] in {e.block_id for e in bulk.snapshot().cache_entries}


@pytest.mark.mutation_kill
def test_a_claimed_fill_after_an_earlier_pop_takes_the_key_it_evicted() -> None:
    """As above with a third request first and the filled blocks' tokens claimed
    (``filled``, as the persistent batch passes them): "y" (second) pops the block
    indexed as K2, then "x" (third) fills a block with key K2. In request order the
    key is free again when x fills, so x's block takes it."""

    def build() -> BlockPool:
        pool = BlockPool(5, 2, enable_prefix_caching=True)
        pool.allocate("old", [1, 2, 3, 4], 4)  # blocks 0 (K1) and 1 (K2)
        pool.allocate("x", [1, 2, 3], 1, hit=pool.lookup([1, 2, 3]))
        pool.allocate("y", [9, 9], 2)
        pool.allocate("z", [7], 1)
        pool.free("old")  # block 1 (K2) is the only free block, still indexed
        return pool

    known = {"z": [7, 7], "y": [9, 9, 9], "x": [1, 2, 3, 4]}
    bulk, loop = build(), build()
    run = DecodeRun(bulk, ["z", "y", "x"])
    assert run.append_decodes([7, 9, 4], [1], [0, 2], [[7, 7], [3, 4]]) is not None
    for rid in ("z", "y", "x"):
        loop.allocate(rid, known[rid], 1)
    assert bulk.snapshot() == loop.snapshot()
    assert_valid(bulk)
    indexed = {e.block_id for e in bulk.snapshot().cache_entries}
    assert bulk.block_table("x")[1] in indexed


def test_a_decode_step_with_a_copy_on_write_and_a_fill_rolls_back_exactly() -> None:
    """A shared last block sends the step request by request (copy-on-write); a block
    that fills in the same step is indexed there. The rollback restores the pool, and
    the next steps chain their keys from the right blocks."""
    pool = BlockPool(8, 2)
    pool.allocate("a", [1, 2, 3], 3)  # block 1 holds token 3, partial
    fork(pool, "a", "b")  # block 1 shared
    pool.allocate("c", [5], 1)
    before = pool.snapshot()
    pool.begin()
    copies = decode_copies(pool, {"a": [1, 2, 3, 4], "c": [5, 6]})
    assert copies is not None and len(copies) == 1  # a copies block 1; c fills its block
    assert len(pool.snapshot().cache_entries) == 3  # (1, 2), a's (3, 4), c's (5, 6)
    pool.rollback()
    assert pool.snapshot() == before
    assert_valid(pool)
    assert decode_copies(pool, {"a": [1, 2, 3, 9], "c": [5, 8]}) is not None
    assert_valid(pool)
    assert pool.lookup([1, 2, 3, 9, 0]).num_tokens == 4  # a's chain: (1, 2) then (3, 9)
    assert pool.lookup([5, 8, 0]).num_tokens == 2


def test_a_decode_run_lets_a_request_take_the_key_its_own_pop_evicted() -> None:
    """Block 1: x's next token needs a fresh block and fills it. The block it pops is
    the freed "old"'s block indexed under the very key x's block then computes. The loop
    pops before it fills (its own growth first), so the key is free again and x's block
    takes it; the run must do the same."""

    def build() -> BlockPool:
        pool = BlockPool(3, 1, enable_prefix_caching=True)
        pool.allocate("old", [1, 2], 2)  # blocks 0 (key of (1)), 1 (key of (1, 2))
        pool.allocate("x", [1], 1)  # block 2; its key is taken by block 0
        pool.free("old")  # the queue: block 1 then block 0, both still indexed
        return pool

    bulk, loop = build(), build()
    growth = decode_step(bulk, {"x": [1, 2]}, claim_filled=False)
    assert growth is not None and growth.copies == []
    loop.allocate("x", [1, 2], 1)
    assert bulk.snapshot() == loop.snapshot()
    assert bulk.block_table("x") == (2, 1)
    assert bulk.lookup([1, 2, 3]).block_ids == (0, 1)  # x's new block holds the key now


@pytest.mark.mutation_kill
def test_a_run_stays_stale_whatever_rollbacks_follow() -> None:
    """Staleness is for good: after a table of the run is freed, no later rollback (of
    another step) may make the run look current again."""
    pool = BlockPool(8, 4)
    pool.allocate("a", [1, 2], 2)
    pool.begin()
    pool.rollback()  # nothing to undo; the run below is taken after a rollback
    run = DecodeRun(pool, ["a"])
    pool.free("a")
    for _ in range(pool.tables.epoch + 2):  # past any epoch the run could be mistaken for
        pool.begin()
        pool.rollback()
        assert not run.is_current()
