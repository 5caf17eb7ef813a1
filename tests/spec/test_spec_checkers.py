"""Every spec checker is shown to fail.

Each test starts from a valid snapshot (a real ``BlockPool`` after some operations, or a
``StepSnapshot`` built from one), checks that it reports nothing, corrupts exactly one
thing and asserts the invariant id, the subject and an informative message.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from refserve.kv import BlockPool, fork
from refserve.spec import (
    EngineSnapshot,
    Invariant,
    PoolSnapshot,
    RequestSnapshot,
    RequestStatus,
    ScheduledRequest,
    StepSnapshot,
    TableSnapshot,
    Violation,
    check_pool,
    check_step,
)
from refserve.spec.arith import slot_of
from refserve.spec.atomic import check_atomic, check_atomic_pool
from refserve.spec.cap import check_cap_step
from refserve.spec.hashing import Namespace, block_key
from refserve.spec.order import (
    check_admission_order,
    check_decode_first,
    check_strict_admission_order,
)
from refserve.spec.prefix import check_prefix_step
from refserve.spec.progress import check_quiescent, check_starvation

BS = 4
A6 = (10, 11, 12, 13, 14, 15)
B9 = (20, 21, 22, 23, 24, 25, 26, 27, 28)
X4 = (30, 31, 32, 33)
Y12 = (40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51)


def find(vs: list[Violation], inv: Invariant, subject: str, fragment: str) -> Violation:
    """The violation of ``inv`` about ``subject`` whose message contains ``fragment``."""
    hits = [v for v in vs if v.invariant is inv and v.subject == subject and fragment in v.message]
    assert hits, f"no [{inv}] {subject!r} ~ {fragment!r} among {[str(v) for v in vs]}"
    v = hits[0]
    assert str(v).startswith(f"[{inv}] {subject}: {v.message}")
    return v


def expect(v: Violation, expected: object, seen: object) -> None:
    assert (v.expected, v.seen) == (str(expected), str(seen))
    assert f"(expected {expected}, seen {seen})" in str(v)


# --------------------------------------------------------------------- pool level
@dataclass
class PoolCase:
    pool: BlockPool
    snap: PoolSnapshot


@pytest.fixture
def base() -> PoolCase:
    """a: 6 tokens (blocks 0, 1), forked into c; b: 9 tokens (2, 3, 4); x freed (block 5)."""
    pool = BlockPool(8, BS)
    pool.allocate("a", A6, 6)
    fork(pool, "a", "c")
    pool.allocate("b", B9, 9)
    pool.allocate("x", X4, 4)
    pool.free("x")
    snap = pool.snapshot()
    assert snap.ref_cnt == (2, 2, 1, 1, 1, 0, 0, 0)
    assert snap.free_queue == (6, 7, 5)
    assert [e.block_id for e in snap.cache_entries] == [0, 2, 3, 5]
    assert check_pool(snap) == []
    return PoolCase(pool, snap)


def with_table(snap: PoolSnapshot, rid: str, **changes: object) -> PoolSnapshot:
    tables = tuple(
        replace(t, **changes) if t.request_id == rid else t  # type: ignore[arg-type]
        for t in snap.tables
    )
    return replace(snap, tables=tables)


def set_ref(snap: PoolSnapshot, block: int, value: int) -> PoolSnapshot:
    ref = list(snap.ref_cnt)
    ref[block] = value
    return replace(snap, ref_cnt=tuple(ref))


def test_block_twice_in_free_queue(base: PoolCase) -> None:
    bad = replace(base.snap, free_queue=(*base.snap.free_queue, 6))
    vs = check_pool(bad)
    v = find(vs, Invariant.BLOCK, "block 6", "appears more than once in the free queue")
    expect(v, 1, 2)
    assert vs == [v]


def test_wrong_ref_count(base: PoolCase) -> None:
    vs = check_pool(set_ref(base.snap, 2, 2))
    v = find(vs, Invariant.BLOCK, "block 2", "ref_cnt differs from block tables holding it")
    expect(v, 1, 2)
    assert vs == [v]


def test_negative_ref_count(base: PoolCase) -> None:
    vs = check_pool(set_ref(base.snap, 6, -1))
    expect(find(vs, Invariant.BLOCK, "block 6", "negative ref count"), ">= 0", -1)


def test_referenced_block_in_free_queue(base: PoolCase) -> None:
    vs = check_pool(replace(base.snap, free_queue=(*base.snap.free_queue, 2)))
    v = find(vs, Invariant.BLOCK, "block 2", "referenced block is in the free queue")
    expect(v, "not free", "ref_cnt 1")
    expect(find(vs, Invariant.BLOCK, "pool", "used + free != num_blocks"), 8, "5 + 4")
    assert {x.invariant for x in vs} == {Invariant.BLOCK}


def test_stated_free_count_must_equal_the_free_blocks(base: PoolCase) -> None:
    free = len(base.snap.free_queue)
    assert check_pool(replace(base.snap, stated_free=free)) == []
    vs = check_pool(replace(base.snap, stated_free=free + 1))
    v = find(
        vs,
        Invariant.BLOCK,
        "pool",
        "the manager's own count of free and evictable blocks differs from the blocks",
    )
    expect(v, free, free + 1)
    assert vs == [v]


def test_leaked_block(base: PoolCase) -> None:
    vs = check_pool(replace(base.snap, free_queue=(6, 5)))
    v = find(vs, Invariant.BLOCK, "block 7", "neither free nor referenced (leaked)")
    expect(v, "in free queue", "absent")
    expect(find(vs, Invariant.BLOCK, "pool", "used + free != num_blocks"), 8, "5 + 2")
    assert len(vs) == 2


def test_block_id_out_of_range(base: PoolCase) -> None:
    vs = check_pool(replace(base.snap, free_queue=(*base.snap.free_queue, 8)))
    find(vs, Invariant.BLOCK, "block 8", "free queue holds an id out of range")
    vs = check_pool(with_table(base.snap, "b", block_table=(2, 3, 9)))
    expect(find(vs, Invariant.BLOCK, "request b", "block id out of range"), "0..7", 9)


def test_ref_cnt_length(base: PoolCase) -> None:
    vs = check_pool(replace(base.snap, ref_cnt=base.snap.ref_cnt[:-1]))
    expect(find(vs, Invariant.BLOCK, "pool", "ref_cnt length differs from num_blocks"), 8, 7)


def test_table_holding_one_block_twice(base: PoolCase) -> None:
    # b's table (2, 3, 3): ref counts and free queue adjusted so only the duplicate is wrong.
    bad = with_table(base.snap, "b", block_table=(2, 3, 3))
    bad = set_ref(set_ref(bad, 3, 2), 4, 0)
    bad = replace(bad, free_queue=(*bad.free_queue, 4))
    vs = check_pool(bad)
    expect(find(vs, Invariant.BLOCK, "block 3", "held twice by request b"), 1, 2)
    assert [v for v in vs if v.invariant is Invariant.BLOCK] == vs[:1]


def test_cache_entry_pointing_at_reused_block(base: PoolCase) -> None:
    # y's 12 tokens take blocks 6, 7 and 5: x's cached block 5 is reused (its entry dropped).
    stale = next(e for e in base.snap.cache_entries if e.block_id == 5)
    base.pool.allocate("y", Y12, 12)
    snap = base.pool.snapshot()
    assert base.pool.block_table("y") == (6, 7, 5)
    assert check_pool(snap) == []
    assert stale not in snap.cache_entries
    entries = tuple(stale if e.block_id == 5 else e for e in snap.cache_entries)
    vs = check_pool(replace(snap, cache_entries=entries))
    v = find(
        vs,
        Invariant.PREFIX,
        "block 5 (request y, logical 2)",
        "cache entry points at a block now holding other tokens",
    )
    expect(v, X4, Y12[8:12])
    assert vs == [v]


def test_cache_key_not_matching_hash(base: PoolCase) -> None:
    entries = tuple(
        replace(e, key=b"\x00" * 32) if e.block_id == 5 else e for e in base.snap.cache_entries
    )
    vs = check_pool(replace(base.snap, cache_entries=entries))
    v = find(
        vs, Invariant.PREFIX, "block 5", "cache key is not the hash of parent key and token ids"
    )
    assert vs == [v]


def test_cache_key_of_held_block_not_matching_chain(base: PoolCase) -> None:
    # A self-consistent entry (key == hash(parent, tokens)) under the wrong parent.
    e3 = next(e for e in base.snap.cache_entries if e.block_id == 3)
    forged = replace(e3, parent_key=b"\x01" * 32, key=block_key(b"\x01" * 32, e3.token_ids))
    entries = tuple(forged if e.block_id == 3 else e for e in base.snap.cache_entries)
    vs = check_pool(replace(base.snap, cache_entries=entries))
    v = find(
        vs,
        Invariant.PREFIX,
        "block 3 (request b, logical 1)",
        "block reused under a different chain prefix or namespace",
    )
    assert vs == [v]


def test_two_entries_one_key_and_one_block_two_keys(base: PoolCase) -> None:
    e0 = base.snap.cache_entries[0]
    vs = check_pool(replace(base.snap, cache_entries=(*base.snap.cache_entries, e0)))
    find(vs, Invariant.PREFIX, "block 0", "two cache entries share one key")
    find(vs, Invariant.PREFIX, "block 0", "block indexed under two keys")


def test_non_full_cached_block(base: PoolCase) -> None:
    a_table = base.snap.table("a")
    assert a_table is not None
    e0 = next(e for e in base.snap.cache_entries if e.block_id == 0)
    tail = A6[4:]
    partial = replace(
        e0, key=block_key(e0.key, tail), block_id=1, parent_key=e0.key, token_ids=tail
    )
    vs = check_pool(replace(base.snap, cache_entries=(*base.snap.cache_entries, partial)))
    expect(find(vs, Invariant.PREFIX, "block 1", "only full blocks may be cached"), BS, 2)
    v = find(
        vs,
        Invariant.PREFIX,
        "block 1 (request a, logical 1)",
        "cached block is not full in a table holding it",
    )
    expect(v, 8, 6)


def test_shared_block_with_different_prefixes_missing_copy_on_write(base: PoolCase) -> None:
    # a and c share partial block 1; both wrote position 6 into it without copying.
    bad = with_table(base.snap, "a", num_stored=7, token_ids=(*A6, 98))
    bad = with_table(bad, "c", num_stored=7, token_ids=(*A6, 99))
    vs = check_pool(bad)
    v = find(
        vs,
        Invariant.PREFIX,
        "block 1 (requests a, c)",
        "block shared by requests whose prefixes differ",
    )
    expect(v, (*A6, 98), (*A6, 99))
    assert vs == [v]


def test_copy_on_write_keeps_the_same_state_valid(base: PoolCase) -> None:
    # The real pool does the same writes correctly: copy-on-write, nothing reported.
    base.pool.allocate("a", (*A6, 98), 1)
    base.pool.allocate("c", (*A6, 99), 1)
    assert check_pool(base.pool.snapshot()) == []


def test_namespace_mismatch(base: PoolCase) -> None:
    bad = with_table(base.snap, "c", root_key=Namespace(adapter="lora-x").root_key())
    vs = check_pool(bad)
    find(vs, Invariant.PREFIX, "block 0 (requests a, c)", "block shared across namespaces")
    find(vs, Invariant.PREFIX, "block 1 (requests a, c)", "block shared across namespaces")
    find(
        vs,
        Invariant.PREFIX,
        "block 0 (request c, logical 0)",
        "block reused under a different chain prefix or namespace",
    )
    assert {v.invariant for v in vs} == {Invariant.PREFIX}


def test_shared_block_at_different_logical_indices(base: PoolCase) -> None:
    # c's table lists a's blocks in the other order.
    vs = check_pool(with_table(base.snap, "c", block_table=(1, 0)))
    expect(
        find(vs, Invariant.PREFIX, "block 1 (requests a, c)", "shared block at different logical"),
        1,
        0,
    )


def test_table_not_covering_num_stored(base: PoolCase) -> None:
    bad = with_table(base.snap, "b", block_table=(2, 3))
    bad = replace(set_ref(bad, 4, 0), free_queue=(*bad.free_queue, 4))
    vs = check_pool(bad)
    v = find(vs, Invariant.POS, "request b", "block table does not cover the KV length exactly")
    expect(v, 3, 2)
    assert vs == [v]


def test_token_ids_differ_from_num_stored(base: PoolCase) -> None:
    vs = check_pool(with_table(base.snap, "b", token_ids=B9[:8]))
    expect(find(vs, Invariant.POS, "request b", "stored token ids differ from num_stored"), 9, 8)


def test_cap_blocks_in_use_exceed_pool(base: PoolCase) -> None:
    vs = check_pool(replace(base.snap, num_blocks=4))
    expect(find(vs, Invariant.CAP, "pool", "blocks in use exceed num_blocks"), "<= 4", 5)
    find(vs, Invariant.BLOCK, "pool", "ref_cnt length differs from num_blocks")


def test_cap_table_longer_than_pool() -> None:
    snap = PoolSnapshot(
        num_blocks=1,
        block_size=1,
        ref_cnt=(2,),
        free_queue=(),
        tables=(TableSnapshot("r", (0, 0), 2, (1, 1)),),
    )
    vs = check_pool(snap)
    expect(find(vs, Invariant.CAP, "request r", "block table longer than the pool"), "<= 1", 2)


def test_quiescence_with_a_held_block(base: PoolCase) -> None:
    pool = BlockPool(4, BS)
    pool.allocate("a", A6, 6)
    pool.allocate("b", B9[:3], 3)
    pool.free("b")
    vs = check_quiescent(pool.snapshot())
    expect(find(vs, Invariant.PROGRESS, "request a", "holds a block table at quiescence"), 0, 2)
    expect(find(vs, Invariant.PROGRESS, "block 0", "still referenced at quiescence"), 0, 1)
    assert len(vs) == 3
    pool.free("a")
    assert check_quiescent(pool.snapshot()) == []


# --------------------------------------------------------------------- step level
def req(
    rid: str,
    status: RequestStatus,
    prompt: int,
    outputs: int,
    computed: int,
    **kw: int,
) -> RequestSnapshot:
    return RequestSnapshot(rid, status, prompt, outputs, computed, max_tokens=16, **kw)


PA = (1, 2, 3, 4, 5)  # A: prompt 5, decoding
PB = tuple(range(100, 112))  # B: prompt 12, mid-prefill
PC = (200, 201, 202)  # C: prompt 3, waiting
PD = (300, 301)  # D: prompt 2 + 2 outputs, decoding, preempted this step
A_KNOWN = (*PA, 6, 7)
D_KNOWN = (*PD, 302, 303)


def scheduled(
    pool: BlockPool, rid: str, start: int, n: int, samples: bool, cached: int = 0
) -> ScheduledRequest:
    table = pool.block_table(rid)
    positions = tuple(range(start, start + n))
    slots = tuple(slot_of(table[p // BS], p, BS) for p in positions)
    return ScheduledRequest(rid, n, positions, slots, table, samples, cached)


@pytest.fixture
def step() -> StepSnapshot:
    """Example 1 round 2 shape: budget 8, 3 seqs, block 4; A:1 B:5 C:2, D preempted."""
    pool = BlockPool(12, BS)
    pool.allocate("A", A_KNOWN, 5)
    pool.allocate("B", PB, 7)
    pool.allocate("D", D_KNOWN, 3)
    before = EngineSnapshot(
        (
            req("A", RequestStatus.DECODING, 5, 1, 5),
            req("B", RequestStatus.PREFILLING, 12, 0, 7),
            req("C", RequestStatus.WAITING, 3, 0, 0),
            req("D", RequestStatus.DECODING, 2, 2, 3),
        ),
        pool.snapshot(),
    )
    pool.free("D")
    pool.allocate("A", A_KNOWN, 1)
    pool.allocate("B", PB, 5)
    pool.allocate("C", PC, 2)
    after = EngineSnapshot(
        (
            req("A", RequestStatus.DECODING, 5, 2, 6),
            req("B", RequestStatus.DECODING, 12, 1, 12),
            req("C", RequestStatus.PREFILLING, 3, 0, 2),
            req("D", RequestStatus.PREEMPTED, 2, 2, 0),
        ),
        pool.snapshot(),
    )
    s = StepSnapshot(
        step_index=1,
        token_budget=8,
        max_num_seqs=3,
        before=before,
        scheduled=(
            scheduled(pool, "A", 5, 1, True),
            scheduled(pool, "B", 7, 5, True),
            scheduled(pool, "C", 0, 2, False),
        ),
        after=after,
        preempted=("D",),
    )
    assert check_step(s) == []
    return s


def with_after(s: StepSnapshot, rid: str, **changes: object) -> StepSnapshot:
    reqs = tuple(
        replace(r, **changes) if r.request_id == rid else r  # type: ignore[arg-type]
        for r in s.after.requests
    )
    return replace(s, after=replace(s.after, requests=reqs))


def with_sched(s: StepSnapshot, rid: str, **changes: object) -> StepSnapshot:
    plan = tuple(
        replace(x, **changes) if x.request_id == rid else x  # type: ignore[arg-type]
        for x in s.scheduled
    )
    return replace(s, scheduled=plan)


def sched(s: StepSnapshot, rid: str) -> ScheduledRequest:
    return next(x for x in s.scheduled if x.request_id == rid)


def test_token_budget_exceeded(step: StepSnapshot) -> None:
    vs = check_step(replace(step, token_budget=7))
    v = find(vs, Invariant.TOKEN, "step", "scheduled tokens exceed the token budget")
    expect(v, "<= 7", 8)
    assert vs == [v]


def test_max_num_seqs_exceeded(step: StepSnapshot) -> None:
    vs = check_step(replace(step, max_num_seqs=2))
    v = find(vs, Invariant.TOKEN, "step", "scheduled requests exceed max_num_seqs")
    expect(v, "<= 2", 3)
    assert vs == [v]


def test_scheduled_twice_and_with_no_tokens(step: StepSnapshot) -> None:
    c = sched(step, "C")
    vs = check_step(replace(step, scheduled=(*step.scheduled, c)))
    expect(find(vs, Invariant.TOKEN, "request C", "scheduled twice in one step"), 1, 2)
    vs = check_step(with_sched(step, "C", num_new_tokens=0))
    expect(find(vs, Invariant.TOKEN, "request C", "scheduled with no tokens"), ">= 1", 0)


def test_scheduled_and_preempted(step: StepSnapshot) -> None:
    vs = check_step(replace(step, preempted=("D", "C")))
    find(vs, Invariant.TOKEN, "request C", "both scheduled and preempted in one step")


def test_num_computed_advancing_by_wrong_amount(step: StepSnapshot) -> None:
    vs = check_step(with_after(step, "C", num_computed_tokens=3))
    v = find(
        vs, Invariant.TOKEN, "request C", "num_computed_tokens did not advance by the scheduled"
    )
    expect(v, 2, 3)
    # A request left out of the plan must not move at all.
    unplanned = replace(step, scheduled=tuple(x for x in step.scheduled if x.request_id != "A"))
    vs = check_step(unplanned)
    expect(find(vs, Invariant.TOKEN, "request A", "did not advance by the scheduled count"), 5, 6)
    expect(find(vs, Invariant.KVLEN, "request A", "sampled without being scheduled"), 1, 2)


def test_num_computed_exceeds_num_tokens(step: StepSnapshot) -> None:
    vs = check_step(with_after(step, "A", num_computed_tokens=8))
    v = find(vs, Invariant.TOKEN, "request A", "num_computed_tokens exceeds num_tokens")
    expect(v, "<= 7", 8)
    expect(find(vs, Invariant.KVLEN, "request A", "KV length exceeds known tokens"), "<= 7", 8)


def test_recompute_preemption_not_resetting(step: StepSnapshot) -> None:
    vs = check_step(with_after(step, "D", num_computed_tokens=3))
    v = find(
        vs, Invariant.TOKEN, "request D", "recompute preemption must reset num_computed_tokens"
    )
    expect(v, 0, 3)
    expect(find(vs, Invariant.KVLEN, "request D", "preempted request holds KV"), 0, 3)


def test_sampling_when_chunk_does_not_reach_num_tokens(step: StepSnapshot) -> None:
    vs = check_step(with_sched(step, "C", samples=True))
    v = find(
        vs,
        Invariant.KVLEN,
        "request C",
        "samples flag disagrees with whether the chunk reaches num_tokens",
    )
    expect(v, False, True)
    assert vs == [v]


def test_sampled_count_moves_wrongly(step: StepSnapshot) -> None:
    vs = check_step(with_after(step, "C", num_output_tokens=1))
    expect(find(vs, Invariant.KVLEN, "request C", "sampled count changed by other than one"), 0, 1)
    vs = check_step(with_after(step, "D", num_output_tokens=3))
    expect(find(vs, Invariant.KVLEN, "request D", "sampled without being scheduled"), 2, 3)


def test_decode_request_with_wrong_kv_length(step: StepSnapshot) -> None:
    # A claims decoding with KV for 5 of its 7 tokens (the step's token was not counted).
    vs = check_step(with_after(step, "A", num_computed_tokens=5))
    v = find(
        vs,
        Invariant.KVLEN,
        "request A",
        "decoding request must have KV for all but the last sampled token",
    )
    expect(v, 6, 5)


def test_prefilling_request_with_nothing_left(step: StepSnapshot) -> None:
    vs = check_step(with_after(step, "C", num_computed_tokens=3))
    v = find(vs, Invariant.KVLEN, "request C", "prefilling request has no token left to compute")
    expect(v, "< 3", 3)


def test_outputs_exceed_max_tokens(step: StepSnapshot) -> None:
    vs = check_step(with_after(step, "A", max_tokens=1))
    v = find(vs, Invariant.KVLEN, "request A", "outputs exceed max_tokens")
    expect(v, "<= 1", 2)
    assert vs == [v]
    vs = check_step(with_after(step, "A", max_model_len=6))
    expect(find(vs, Invariant.KVLEN, "request A", "num_tokens exceeds max_model_len"), "<= 6", 7)


def test_positions_not_contiguous(step: StepSnapshot) -> None:
    c = sched(step, "C")
    shifted = tuple(p + 1 for p in c.positions)
    slots = tuple(slot_of(c.block_table[p // BS], p, BS) for p in shifted)
    vs = check_step(with_sched(step, "C", positions=shifted, slot_mapping=slots))
    v = find(
        vs,
        Invariant.POS,
        "request C",
        "positions are not contiguous with the KV already computed",
    )
    expect(v, "[0..1] (2)", "[1..2] (2)")
    assert vs == [v]


def test_wrong_slot_mapping(step: StepSnapshot) -> None:
    b = sched(step, "B")
    slots = list(b.slot_mapping)
    slots[2] += 1  # position 9 -> the next slot of the same block
    vs = check_step(with_sched(step, "B", slot_mapping=tuple(slots)))
    v = find(vs, Invariant.POS, "request B", "slot of position 9 breaks the block-table formula")
    expect(v, b.slot_mapping[2], b.slot_mapping[2] + 1)
    assert vs == [v]


def test_slot_mapping_length_and_position_beyond_table(step: StepSnapshot) -> None:
    b = sched(step, "B")
    vs = check_step(with_sched(step, "B", slot_mapping=b.slot_mapping[:-1]))
    expect(find(vs, Invariant.POS, "request B", "slot mapping length differs"), 5, 4)
    vs = check_step(with_sched(step, "B", block_table=b.block_table[:2]))
    expect(find(vs, Invariant.POS, "request B", "position 8 lies beyond the block table"), "< 8", 8)


def test_pool_kv_length_differs_from_num_computed(step: StepSnapshot) -> None:
    vs = check_step(with_after(step, "C", num_computed_tokens=1, status=RequestStatus.PREFILLING))
    expect(
        find(vs, Invariant.POS, "request C", "pool KV length differs from num_computed_tokens"),
        1,
        2,
    )


def test_running_request_whose_blocks_were_freed(step: StepSnapshot) -> None:
    # Replay the fixture's operations, then the engine wrongly releases A's blocks while
    # A keeps decoding with KV it no longer has. Only POS can see it.
    pool = BlockPool(12, BS)
    pool.allocate("A", A_KNOWN, 5)
    pool.allocate("B", PB, 7)
    pool.allocate("D", D_KNOWN, 3)
    pool.free("D")
    pool.allocate("A", A_KNOWN, 1)
    pool.allocate("B", PB, 5)
    pool.allocate("C", PC, 2)
    assert pool.snapshot() == step.after.pool
    pool.free("A")
    vs = check_step(replace(step, after=replace(step.after, pool=pool.snapshot())))
    v = find(vs, Invariant.POS, "request A", "running request has KV but no block table")
    expect(v, "2 blocks", "no table")
    assert vs == [v]


def test_plan_writing_into_a_block_it_does_not_hold(step: StepSnapshot) -> None:
    a_block = step.after.pool.table("A")
    assert a_block is not None
    foreign = slot_of(a_block.block_table[0], 0, BS)
    c = sched(step, "C")
    vs = check_cap_step(with_sched(step, "C", slot_mapping=(foreign, c.slot_mapping[1])))
    v = find(vs, Invariant.CAP, "request C", "position 0 writes slot")
    assert "in a block the request does not hold" in v.message
    assert v.seen == str(a_block.block_table[0])


def test_plan_writing_into_a_cached_block(step: StepSnapshot) -> None:
    # B's plan maps position 7 to its first block, which was full and cached before.
    b = sched(step, "B")
    cached = b.block_table[0]
    assert cached in {e.block_id for e in step.before.pool.cache_entries}
    table = (cached, cached, *b.block_table[2:])
    slots = tuple(slot_of(table[p // BS], p, BS) for p in b.positions)
    vs = check_step(with_sched(step, "B", block_table=table, slot_mapping=slots))
    v = find(
        vs, Invariant.PREFIX, "request B", f"writes into block {cached} that was already cached"
    )
    assert vs == [v]


def test_writing_an_evicted_cached_block_is_allowed() -> None:
    """Regression: a free cached block popped (evicted) and rewritten was reported."""
    pool = BlockPool(2, BS)
    pool.allocate("X", [1, 2, 3, 4], 4)
    pool.free("X")  # block 0: free, still cached
    waiting = req("C", RequestStatus.WAITING, 5, 0, 0)
    before = EngineSnapshot((waiting,), pool.snapshot())
    pool.allocate("C", [5, 6, 7, 8, 9], 5)  # pops 1 then 0, evicting 0's entry
    assert pool.block_table("C") == (1, 0)
    plan = scheduled(pool, "C", 0, 5, True)
    after = EngineSnapshot((req("C", RequestStatus.DECODING, 5, 1, 5),), pool.snapshot())
    assert check_step(StepSnapshot(0, 8, 4, before, (plan,), after)) == []


def test_recomputing_the_last_token_into_a_cached_block() -> None:
    """Block-aligned prompt fully cached by a running Q: R takes both blocks as a hit but
    recomputes the last block into the cached, shared one (the known bug elsewhere)."""
    prompt = (1, 2, 3, 4, 5, 6, 7, 8)
    pool = BlockPool(6, BS)
    pool.allocate("Q", (*prompt, 9), 9)  # Q computed both blocks of the prompt: cached
    q = req("Q", RequestStatus.DECODING, 8, 2, 9)
    before = EngineSnapshot((q, req("R", RequestStatus.WAITING, 8, 0, 0)), pool.snapshot())
    full = pool.lookup((*prompt, 9))  # a lookup that ignores the last-token rule
    assert len(full.block_ids) == 2
    table = TableSnapshot("R", full.block_ids, 8, prompt, full.root_key)
    after_pool = replace(
        before.pool,
        ref_cnt=tuple(
            rc + (1 if b in full.block_ids else 0) for b, rc in enumerate(before.pool.ref_cnt)
        ),
        tables=(*before.pool.tables, table),
    )
    positions = (4, 5, 6, 7)
    plan = ScheduledRequest(
        "R",
        4,
        positions,
        tuple(slot_of(full.block_ids[1], p, BS) for p in positions),
        full.block_ids,
        True,
        num_new_cached_tokens=4,
    )
    after = EngineSnapshot(
        (q, req("R", RequestStatus.DECODING, 8, 1, 8, num_cached_tokens=4)), after_pool
    )
    vs = check_step(StepSnapshot(0, 8, 4, before, (plan,), after))
    b = full.block_ids[1]
    shared = find(vs, Invariant.PREFIX, "request R", f"writes into block {b} shared by several")
    assert vs == [shared]  # the first bad write is reported once per request
    # The same write with Q gone after the step (it finished and released the block) but
    # R having held the block before the step: still rewriting computed, cached KV.
    before_r = EngineSnapshot(
        (req("R", RequestStatus.PREFILLING, 8, 0, 8),),
        replace(pool.snapshot(), tables=(replace(pool.snapshot().tables[0], request_id="R"),)),
    )
    after_r = EngineSnapshot(
        (req("R", RequestStatus.DECODING, 8, 1, 8, num_cached_tokens=4),),
        replace(before_r.pool, tables=(replace(before_r.pool.tables[0], num_stored=9),)),
    )
    vs = check_prefix_step(StepSnapshot(0, 8, 4, before_r, (plan,), after_r))
    v = find(vs, Invariant.PREFIX, "request R", f"writes into block {b} that was already cached")
    expect(v, "an evicted block", "still held by R")


def test_writing_an_evicted_block_with_the_same_tokens_is_allowed() -> None:
    """A free cached block evicted and rewritten with identical tokens is re-indexed
    under its old key; nobody read it, so this is no violation."""
    pool = BlockPool(1, 1)
    pool.allocate("r1", (0,), 1)
    pool.free("r1")
    before_pool = pool.snapshot()
    assert before_pool.cache_entries
    before = EngineSnapshot((req("r2", RequestStatus.WAITING, 1, 0, 0),), before_pool)
    pool.allocate("r2", (0,), 1)  # pops block 0, evicts its entry, re-indexes it
    after = EngineSnapshot((req("r2", RequestStatus.DECODING, 1, 1, 1),), pool.snapshot())
    assert after.pool.cache_entries == before_pool.cache_entries
    plan = ScheduledRequest("r2", 1, (0,), (0,), (0,), True)
    assert check_prefix_step(StepSnapshot(0, 8, 4, before, (plan,), after)) == []


def fork_step(copy_on_write: bool) -> StepSnapshot:
    """P (6 prompt tokens + 1 sampled) forked into Q; Q decodes position 6 this step."""
    prompt = (1, 2, 3, 4, 5, 6)
    pool = BlockPool(6, BS)
    pool.allocate("P", (*prompt, 7), 6)
    fork(pool, "P", "Q")
    before = EngineSnapshot(
        (
            req("P", RequestStatus.DECODING, 6, 1, 6),
            req("Q", RequestStatus.DECODING, 6, 1, 6),
        ),
        pool.snapshot(),
    )
    if copy_on_write:
        alloc = pool.allocate("Q", (*prompt, 8), 1)
        assert len(alloc.copies) == 1
        after_pool = pool.snapshot()
    else:  # a buggy engine writes the shared partial block in place
        after_pool = with_table(before.pool, "Q", num_stored=7, token_ids=(*prompt, 8))
    table = next(t for t in after_pool.tables if t.request_id == "Q").block_table
    plan = ScheduledRequest("Q", 1, (6,), (slot_of(table[1], 6, BS),), table, True)
    after = EngineSnapshot(
        (
            req("P", RequestStatus.DECODING, 6, 1, 6),
            req("Q", RequestStatus.DECODING, 6, 2, 7),
        ),
        after_pool,
    )
    return StepSnapshot(2, 8, 4, before, (plan,), after)


def test_plan_writing_into_a_shared_block() -> None:
    assert check_step(fork_step(copy_on_write=True)) == []
    s = fork_step(copy_on_write=False)
    shared = s.scheduled[0].block_table[1]
    vs = check_step(s)
    v = find(vs, Invariant.PREFIX, "request Q", f"writes into block {shared} shared by several")
    expect(v, "ref_cnt 1 (copy-on-write)", 2)
    assert vs == [v]


def test_cache_hit_covering_the_last_token(step: StepSnapshot) -> None:
    vs = check_step(with_after(step, "C", num_cached_tokens=4))
    v = find(vs, Invariant.PREFIX, "request C", "cache hit covers the last known token")
    expect(v, "<= 0", 4)
    assert vs == [v]


def test_cache_hit_not_whole_blocks(step: StepSnapshot) -> None:
    vs = check_step(with_sched(step, "C", num_new_cached_tokens=1))
    v = find(vs, Invariant.PREFIX, "request C", "cache hit is not a whole number of blocks")
    expect(v, f"multiple of {BS}", 1)


def test_runnable_work_with_nothing_scheduled(step: StepSnapshot) -> None:
    stalled = replace(step, scheduled=(), preempted=(), after=step.before)
    vs = check_step(stalled)
    v = find(
        vs, Invariant.PROGRESS, "step", "runnable work but nothing scheduled, finished or aborted"
    )
    expect(v, ">= 1 token", "0 tokens for 4 runnable requests")
    assert vs == [v]
    # The message names the oldest stuck request and what the step offered it.
    assert "decoding request A got nothing (blocks: needs 0 for its next token" in v.message
    assert "budget: 8 tokens unused; seqs: 3 of 3 running; policy" in v.message
    assert check_step(replace(stalled, finished=("A",))) == []
    # A preemption alone is not progress (the docstring's rule).
    assert find(
        check_step(replace(stalled, preempted=("D",))), Invariant.PROGRESS, "step", "runnable"
    )


def test_admitting_a_request_into_a_load_is_progress() -> None:
    """A KV connector's asynchronous load: the step schedules no token, but the waiting
    request's K/V is now arriving; staying waiting instead is a stall."""
    pool = BlockPool(8, BS).snapshot()
    before = EngineSnapshot((req("W", RequestStatus.WAITING, 8, 0, 0),), pool)
    loading = EngineSnapshot((req("W", RequestStatus.LOADING, 8, 0, 0),), pool)
    assert check_step(StepSnapshot(0, 8, 4, before, (), loading)) == []
    v = find(
        check_step(StepSnapshot(0, 8, 4, before, (), before)),
        Invariant.PROGRESS,
        "step",
        "waiting request W got nothing",
    )
    assert v.seen == "0 tokens for 1 runnable requests"
    # While it loads it is not runnable: a step that waits on the load is not a stall.
    assert check_step(StepSnapshot(1, 8, 4, loading, (), loading)) == []


def test_progress_message_tells_a_full_pool_from_a_policy_stall() -> None:
    full = PoolSnapshot(1, BS, (1,), (), (TableSnapshot("R", (0,), 4, (1, 2, 3, 4)),))
    reqs = (req("W", RequestStatus.WAITING, 3, 0, 0), req("R", RequestStatus.DECODING, 4, 1, 4))
    stalled = StepSnapshot(0, 8, 4, EngineSnapshot(reqs, full), (), EngineSnapshot(reqs, full))
    v = find(check_step(stalled), Invariant.PROGRESS, "step", "decoding request R got nothing")
    assert "needs 1 for its next token, 0 free" in v.message and "policy" not in v.message


def test_progress_message_tells_a_prompt_over_the_budget_from_a_policy_stall() -> None:
    """An engine that cannot chunk never schedules a prompt longer than the budget: the
    message says so, not that every limit had room."""
    pool = BlockPool(8, BS).snapshot()

    def stall(prompt: int, budget: int, status: RequestStatus = RequestStatus.WAITING) -> str:
        reqs = (req("W", status, prompt, 0, 0),)
        snap = EngineSnapshot(reqs, pool)
        s = StepSnapshot(0, budget, 4, snap, (), snap)
        return find(check_step(s), Invariant.PROGRESS, "step", "request W got nothing").message

    long = stall(prompt=12, budget=8)
    assert "budget: 8 tokens unused, fewer than the 12 it has to compute" in long
    assert long.endswith(
        "unchunked: its tokens exceed the per-step token budget, so an engine that cannot "
        "chunk can never schedule it)"
    )
    assert "policy" not in long
    assert stall(prompt=12, budget=8, status=RequestStatus.PREEMPTED) == long.replace(
        "waiting", "preempted"
    )
    # A prompt that fits the budget stalls by policy.
    fits = stall(prompt=8, budget=8)
    assert fits.endswith(
        "budget: 8 tokens unused; seqs: 0 of 4 running; policy: every limit had room)"
    )


def test_preempted_request_keeping_its_blocks(step: StepSnapshot) -> None:
    pool = step.after.pool
    kept = TableSnapshot("D", (9,), 0, ())
    ref = list(pool.ref_cnt)
    ref[9] = 1
    bad = replace(
        pool,
        tables=(*pool.tables, kept),
        ref_cnt=tuple(ref),
        free_queue=tuple(b for b in pool.free_queue if b != 9),
    )
    vs = check_step(replace(step, after=replace(step.after, pool=bad)))
    v = find(vs, Invariant.BLOCK, "request D", "preempted but still holds device blocks")
    expect(v, 0, 1)


def test_lookahead_slots_widen_the_table_rule(base: PoolCase) -> None:
    """A table may hold the blocks of ``lookahead`` slots ahead of its KV, no more."""
    ahead = with_table(base.snap, "b", block_table=(2, 3, 4, 6))  # 9 tokens, 4 blocks
    ahead = set_ref(replace(ahead, free_queue=(7, 5)), 6, 1)
    assert check_pool(ahead, lookahead=4) == []
    assert check_pool(ahead, lookahead=3) != []
    v = find(check_pool(ahead), Invariant.POS, "request b", "does not cover the KV length exactly")
    expect(v, 3, 4)
    v = find(check_pool(ahead, lookahead=1), Invariant.POS, "request b", "KV length plus 1 slots")
    expect(v, 3, 4)
    short = with_table(base.snap, "b", block_table=(2, 3))
    short = replace(set_ref(short, 4, 0), free_queue=(*short.free_queue, 4))
    v = find(check_pool(short, lookahead=4), Invariant.POS, "request b", "plus 4 slots")
    expect(v, "3..4", 2)


def waiting_step(i: int, scheduled_ids: tuple[str, ...]) -> StepSnapshot:
    pool = BlockPool(2, BS).snapshot()
    reqs = (req("W", RequestStatus.WAITING, 3, 0, 0), req("R", RequestStatus.DECODING, 1, 1, 0))
    plan = tuple(ScheduledRequest(r, 1, (0,), (0,), (0,), False) for r in scheduled_ids)
    return StepSnapshot(i, 8, 4, EngineSnapshot(reqs, pool), plan, EngineSnapshot(reqs, pool))


def test_starvation_past_the_bound() -> None:
    fair = [waiting_step(0, ("R",)), waiting_step(1, ("R",)), waiting_step(2, ("W",))]
    assert check_starvation(fair, bound=2) == []
    starving = [waiting_step(i, ("R",)) for i in range(5)]
    vs = check_starvation(starving, bound=2)
    v = find(vs, Invariant.PROGRESS, "request W", "starved up to step 2")
    expect(v, "<= 2 steps", 3)
    assert vs == [v]  # reported once


def test_atomic_ref_count_changed(base: PoolCase) -> None:
    with pytest.raises(Exception, match="needs"):
        base.pool.allocate("b", (*B9, *range(40)), 40)
    after = base.pool.snapshot()
    assert check_atomic_pool(base.snap, after) == []
    vs = check_atomic_pool(base.snap, set_ref(after, 6, 1))
    v = find(vs, Invariant.ATOMIC, "pool", "ref_cnt changed by a failed operation")
    assert v.expected == repr(base.snap.ref_cnt)
    assert v.seen == repr((2, 2, 1, 1, 1, 0, 1, 0))
    assert vs == [v]


def test_atomic_table_and_queue_changed(base: PoolCase) -> None:
    changed = with_table(base.snap, "b", num_stored=8, token_ids=B9[:8])
    vs = check_atomic_pool(base.snap, changed)
    v = find(vs, Invariant.ATOMIC, "request b", "block table changed by a failed operation")
    assert "num_stored=9" in v.expected and "num_stored=8" in v.seen
    vs = check_atomic_pool(base.snap, replace(base.snap, free_queue=(7, 6, 5)))
    find(vs, Invariant.ATOMIC, "pool", "free_queue changed by a failed operation")


def test_atomic_request_changed(step: StepSnapshot) -> None:
    assert check_atomic(step.before, step.before) == []
    after = replace(
        step.before,
        requests=tuple(
            replace(r, num_computed_tokens=9) if r.request_id == "B" else r
            for r in step.before.requests
        ),
    )
    vs = check_atomic(step.before, after)
    v = find(vs, Invariant.ATOMIC, "request B", "request changed by a failed operation")
    assert "num_computed_tokens=7" in v.expected and "num_computed_tokens=9" in v.seen
    assert vs == [v]
    lost = replace(step.before, requests=step.before.requests[:-1])
    v = find(
        check_atomic(step.before, lost),
        Invariant.ATOMIC,
        "request D",
        "request changed by a failed operation",
    )
    assert v.seen == "None"


# --------------------------------------------------------------------- ORDER
def overtaking_step(x_prompt: int, budget: int = 8) -> StepSnapshot:
    """X (waiting, first in order) is passed over; Y (later) is admitted with 3 tokens."""
    pool = BlockPool(8, BS)
    before = EngineSnapshot(
        (
            req("X", RequestStatus.WAITING, x_prompt, 0, 0),
            req("Y", RequestStatus.WAITING, 3, 0, 0),
        ),
        pool.snapshot(),
    )
    pool.allocate("Y", PC, 3)
    after = EngineSnapshot(
        (
            req("X", RequestStatus.WAITING, x_prompt, 0, 0),
            req("Y", RequestStatus.DECODING, 3, 1, 3),
        ),
        pool.snapshot(),
    )
    return StepSnapshot(0, budget, 4, before, (scheduled(pool, "Y", 0, 3, True),), after)


def test_admission_order_passed_over_while_fitting() -> None:
    keys = {"X": (0,), "Y": (1,)}
    s = overtaking_step(x_prompt=3)
    assert check_step(s) == []  # no rule is broken: order is a declared policy
    vs = check_admission_order(s, keys, order="fcfs")
    v = find(vs, Invariant.ORDER, "request X", "passed over for Y, later in fcfs order")
    assert "needs 1 blocks and 3 tokens; Y took 1 blocks and 3 tokens, 5 tokens unused" in (
        v.message
    )
    expect(v, "admitted before Y", "still waiting")
    # Y first in the declared order: nothing passed over.
    assert check_admission_order(s, {"X": (1,), "Y": (0,)}) == []
    # Priority order: (priority, rank).
    assert check_admission_order(s, {"X": (1, 0), "Y": (0, 1)}, order="priority") == []
    assert check_admission_order(s, {"X": (0, 0), "Y": (0, 1)}, order="priority") != []


def test_declared_decode_first_admits_nobody_past_a_decode() -> None:
    s = overtaking_step(x_prompt=3)
    assert check_decode_first(s) == []  # X waits: a decode-first engine may admit Y
    x_decoding = replace(
        s,
        before=replace(
            s.before,
            requests=tuple(
                replace(
                    r, status=RequestStatus.DECODING, num_output_tokens=1, num_computed_tokens=3
                )
                if r.request_id == "X"
                else r
                for r in s.before.requests
            ),
        ),
    )
    vs = check_decode_first(x_decoding)
    v = find(vs, Invariant.ORDER, "request X", "decoding request got no token while request Y")
    expect(v, ">= 1 token", "0 tokens")
    assert v.rule == "declared-step-order" and vs == [v]
    # Preempted in the step, or retired: not passed over.
    assert check_decode_first(replace(x_decoding, preempted=("X",))) == []
    assert check_decode_first(replace(x_decoding, finished=("X",))) == []
    # Y already running (a chunk of its prompt, not an admission): the engine's business.
    running_y = replace(
        x_decoding,
        before=replace(
            x_decoding.before,
            requests=tuple(
                replace(r, status=RequestStatus.PREFILLING) if r.request_id == "Y" else r
                for r in x_decoding.before.requests
            ),
        ),
    )
    assert check_decode_first(running_y) == []


def test_admission_order_allows_skipping_what_does_not_fit() -> None:
    keys = {"X": (0,), "Y": (1,)}
    # X needs 2 blocks where Y took 1: an engine may let Y in first.
    assert check_admission_order(overtaking_step(x_prompt=5, budget=16), keys) == []
    # X's whole prompt exceeds Y's tokens plus the unused budget (3 + 0).
    assert check_admission_order(overtaking_step(x_prompt=4, budget=3), keys) == []
    # One lookahead slot makes X's 4-token prompt need a second block.
    assert check_admission_order(overtaking_step(x_prompt=4), keys) != []
    assert check_admission_order(overtaking_step(x_prompt=4), keys, lookahead=1) == []


def queue_step(admit: tuple[str, ...], head: RequestStatus = RequestStatus.WAITING) -> StepSnapshot:
    """X (first in order, prompt 5), Y and Z (prompt 3 each) wait; the step admits
    ``admit`` (each a whole prompt) and no one else. ``head`` is X's status before."""
    prompts = {"X": 5, "Y": 3, "Z": 3}
    pool = BlockPool(8, BS)
    before = EngineSnapshot(
        tuple(
            req(r, head if r == "X" else RequestStatus.WAITING, n, 0, 0) for r, n in prompts.items()
        ),
        pool.snapshot(),
    )
    for r in admit:
        pool.allocate(r, tuple(range(10 * len(r), 10 * len(r) + prompts[r])), prompts[r])
    after = EngineSnapshot(
        tuple(
            req(r, RequestStatus.DECODING, n, 1, n)
            if r in admit
            else req(r, head if r == "X" else RequestStatus.WAITING, n, 0, 0)
            for r, n in prompts.items()
        ),
        pool.snapshot(),
    )
    sched = tuple(scheduled(pool, r, 0, prompts[r], True) for r in admit)
    return StepSnapshot(0, 16, 4, before, sched, after)


FIFO = {"X": (0,), "Y": (1,), "Z": (2,)}


def test_strict_admission_order_a_later_request_admitted_past_a_waiting_head() -> None:
    # The lax rule allows it: X (2 blocks) never fitted in what Y took (1 block).
    s = overtaking_step(x_prompt=5, budget=16)
    keys = {"X": (0,), "Y": (1,)}
    assert check_admission_order(s, keys) == []
    vs = check_strict_admission_order(s, keys)
    v = find(vs, Invariant.ORDER, "request X", "passed over for Y, later in fcfs_strict order")
    assert "head-of-line blocking" in v.message
    expect(v, "Y waits behind it", "Y admitted")
    assert vs == [v]
    # Two requests behind the head, both admitted: one finding, naming the first.
    vs = check_strict_admission_order(queue_step(("Y", "Z")), FIFO, "priority_strict")
    v = find(
        vs, Invariant.ORDER, "request X", "passed over for Y and 1 more, later in priority_strict"
    )
    assert vs == [v]
    # A head and a request behind it both blocked while the last one is admitted.
    vs = check_strict_admission_order(queue_step(("Z",)), FIFO)
    assert [v.subject for v in vs] == ["request X", "request Y"]


def test_strict_admission_order_holds_on_head_of_line_steps() -> None:
    assert check_strict_admission_order(queue_step(()), FIFO) == []  # nobody admitted
    assert check_strict_admission_order(queue_step(("X",)), FIFO) == []  # the head only
    assert check_strict_admission_order(queue_step(("X", "Y")), FIFO) == []
    assert check_strict_admission_order(queue_step(("X", "Y", "Z")), FIFO) == []
    # Priority order puts Z first: Z overtakes nobody, and nobody overtakes Y.
    keys = {"X": (1, 0), "Y": (1, 1), "Z": (0, 2)}
    assert check_strict_admission_order(queue_step(("Z",)), keys) == []
    assert check_strict_admission_order(queue_step(("Y",)), keys) != []
    # Requests without a key are not judged.
    assert check_strict_admission_order(queue_step(("Y",)), {"Y": (1,), "Z": (2,)}) == []


def test_strict_admission_order_leaves_out_preempted_and_retired_heads() -> None:
    # A preempted head re-enters the queue by a separate convention (front or place).
    s = queue_step(("Y",), head=RequestStatus.PREEMPTED)
    assert check_strict_admission_order(s, FIFO) == []
    # A head retired while the step was planned (capacity) waits no more.
    s = replace(queue_step(("Y",)), finished=("X",))
    assert check_strict_admission_order(s, FIFO) == []
    # A waiting head with KV already computed has run before: it is not judged.
    s = queue_step(("Y",))
    before = replace(
        s.before,
        requests=tuple(
            replace(r, num_computed_tokens=2) if r.request_id == "X" else r
            for r in s.before.requests
        ),
    )
    assert check_strict_admission_order(replace(s, before=before), FIFO) == []


# ------------------------------------------------- same-step prefix hits (a convention)
def same_step_hit(b_held_before: bool) -> StepSnapshot:
    """A's 6-token prompt fills block 0 in this step; B (same first 4 tokens) takes it as
    a cache hit in the same step. With ``b_held_before`` B already held block 0."""
    a_toks, b_toks = (1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 9)
    pool = BlockPool(6, BS)
    if b_held_before:
        pool.allocate("B", b_toks, 4)
        held = EngineSnapshot(
            (req("A", RequestStatus.WAITING, 6, 0, 0), req("B", RequestStatus.PREFILLING, 5, 0, 4)),
            pool.snapshot(),
        )
        fork(pool, "B", "A")  # an engine that hands A a block B already reads
        pool.allocate("A", a_toks, 2)
        pool.allocate("B", b_toks, 1)
        a_plan = scheduled(pool, "A", 0, 6, True)
        b_plan = scheduled(pool, "B", 4, 1, True)
        before = held
    else:
        before = EngineSnapshot(
            (req("A", RequestStatus.WAITING, 6, 0, 0), req("B", RequestStatus.WAITING, 5, 0, 0)),
            pool.snapshot(),
        )
        pool.allocate("A", a_toks, 6)
        hit = pool.lookup(b_toks)
        assert hit.num_tokens == 4
        pool.allocate("B", b_toks, 1, hit=hit)
        a_plan = scheduled(pool, "A", 0, 6, True)
        b_plan = scheduled(pool, "B", 4, 1, True, cached=4)
    after = EngineSnapshot(
        (
            req("A", RequestStatus.DECODING, 6, 1, 6),
            req("B", RequestStatus.DECODING, 5, 1, 5, num_cached_tokens=0 if b_held_before else 4),
        ),
        pool.snapshot(),
    )
    return StepSnapshot(0, 16, 4, before, (a_plan, b_plan), after)


def test_same_step_prefix_hit_is_a_declared_convention() -> None:
    s = same_step_hit(b_held_before=False)
    v = find(check_step(s), Invariant.PREFIX, "request A", "writes into block 0 shared by several")
    expect(v, "ref_cnt 1 (copy-on-write)", 2)
    assert check_step(s, same_step_hits=True) == []
    # A holder from an earlier step reads the K/V the write changes: still a violation.
    held = same_step_hit(b_held_before=True)
    assert find(
        check_step(held, same_step_hits=True), Invariant.PREFIX, "request A", "shared by several"
    )


def test_full_prompt_cache_hit_is_judged_before_the_sample(step: StepSnapshot) -> None:
    """After the step the request knows one more token, which would hide a hit covering
    its whole prompt: the scheduled hit is judged against the tokens known before."""
    vs = check_prefix_step(with_sched(step, "C", num_new_cached_tokens=3))
    v = find(vs, Invariant.PREFIX, "request C", "cache hit covers the last known token")
    expect(v, "<= 0", 3)
