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

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_steps import decode_each, stored

from refserve.errors import ExceedsCapacity, InvalidArgument, OutOfBlocks
from refserve.kv import BlockPool, DecodeRun
from refserve.kv.forks import fork
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
