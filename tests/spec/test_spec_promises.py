"""The checkers of declared conventions kept (docs/CONFORMANCE.md, "Declarations are
promises") fail on a corrupted state and pass on correct ones of either choice."""

from __future__ import annotations

from dataclasses import replace

from refserve.kv import BlockPool
from refserve.spec import EngineSnapshot, Invariant, RequestStatus, StepSnapshot, check_step
from refserve.spec.order import check_decode_first, check_prefill_first
from refserve.spec.prefix import DECLARED_SAME_STEP_HITS, check_same_step_hits
from tests.spec.test_spec_checkers import BS, expect, find, req, same_step_hit, scheduled

A_TOKS = (1, 2, 3, 4, 5, 6)
B_TOKS = (1, 2, 3, 4, 9)


# ------------------------------------------------------------ same-step prefix hits
def both_admitted(*, b_hits: bool, b_rewrites: bool = False) -> StepSnapshot:
    """A (6 tokens) and B (5, the same first block) admitted in one step. ``b_hits``: B
    takes A's block 0 as a hit; else it computes its own. ``b_rewrites``: B holds A's
    block 0 but computes its positions again, writing into it."""
    pool = BlockPool(6, BS)
    before = EngineSnapshot(
        (req("A", RequestStatus.WAITING, 6, 0, 0), req("B", RequestStatus.WAITING, 5, 0, 0)),
        pool.snapshot(),
    )
    pool.allocate("A", A_TOKS, 6)
    if b_hits or b_rewrites:
        pool.allocate("B", B_TOKS, 1, hit=pool.lookup(B_TOKS))
    else:
        pool.allocate("B", B_TOKS, 5)
    cached = 4 if b_hits and not b_rewrites else 0
    b_plan = scheduled(pool, "B", cached, 5 - cached, True, cached=cached)
    after = EngineSnapshot(
        (
            req("A", RequestStatus.DECODING, 6, 1, 6),
            req("B", RequestStatus.DECODING, 5, 1, 5, num_cached_tokens=cached),
        ),
        pool.snapshot(),
    )
    return StepSnapshot(0, 16, 4, before, (scheduled(pool, "A", 0, 6, True), b_plan), after)


def test_a_same_step_hit_taken_keeps_the_promise() -> None:
    assert check_same_step_hits(both_admitted(b_hits=True)) == []
    assert check_same_step_hits(same_step_hit(b_held_before=False)) == []


def test_a_prefix_computed_twice_in_one_step_breaks_the_promise() -> None:
    s = both_admitted(b_hits=False)
    assert check_step(s) == []  # a correct step for an engine that does not declare it
    vs = check_same_step_hits(s)
    v = find(vs, Invariant.PREFIX, "requests A, B", "logical block 0 of one prefix in two blocks")
    a0, b0 = s.after.pool.tables[0].block_table[0], s.after.pool.tables[1].block_table[0]
    expect(v, f"one block ({a0})", f"blocks {a0} and {b0}")
    assert v.rule == DECLARED_SAME_STEP_HITS and vs == [v]


def test_a_hit_block_computed_again_breaks_the_promise() -> None:
    s = both_admitted(b_hits=True, b_rewrites=True)
    shared = s.scheduled[0].block_table[0]
    assert check_step(s, same_step_hits=True) == []  # PREFIX lets the writers share it
    vs = check_same_step_hits(s)
    v = find(vs, Invariant.PREFIX, f"block {shared}", "written by 2 requests in one step (A, B)")
    expect(v, "1 writer", 2)
    assert v.rule == DECLARED_SAME_STEP_HITS and vs == [v]


def test_only_blocks_a_hit_of_both_may_cover_are_judged() -> None:
    """A's 8-token prompt ends on a block boundary, so a hit of A stops at block 0 (its
    last token is computed): planned first, B fills block 1 that A may not take, and A
    computes its own. Two blocks for block 1 are then correct."""
    a_toks, b_toks = (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 5, 6, 7, 8, 9)
    pool = BlockPool(8, BS)
    before = EngineSnapshot(
        (req("A", RequestStatus.WAITING, 8, 0, 0), req("B", RequestStatus.WAITING, 9, 0, 0)),
        pool.snapshot(),
    )
    pool.allocate("B", b_toks, 9)
    hit = pool.lookup(a_toks)
    assert hit.num_tokens == 4
    pool.allocate("A", a_toks, 4, hit=hit)
    after = EngineSnapshot(
        (
            req("A", RequestStatus.DECODING, 8, 1, 8, num_cached_tokens=4),
            req("B", RequestStatus.DECODING, 9, 1, 9),
        ),
        pool.snapshot(),
    )
    plans = (scheduled(pool, "B", 0, 9, True), scheduled(pool, "A", 4, 4, True, cached=4))
    s = StepSnapshot(0, 32, 4, before, plans, after)
    assert pool.block_table("A")[1] != pool.block_table("B")[1]
    assert check_same_step_hits(s) == []


def test_requests_of_other_key_domains_or_running_before_are_not_judged() -> None:
    s = both_admitted(b_hits=False)
    other = tuple(
        replace(t, root_key=b"salt") if t.request_id == "B" else t for t in s.after.pool.tables
    )
    salted = replace(s, after=replace(s.after, pool=replace(s.after.pool, tables=other)))
    assert check_same_step_hits(salted) == []
    # B was prefilling before the step (blocks of its own, from an earlier step).
    running = replace(
        s,
        before=replace(
            s.before,
            requests=(s.before.requests[0], req("B", RequestStatus.PREFILLING, 5, 0, 0)),
            pool=replace(s.before.pool, tables=(s.after.pool.tables[1],)),
        ),
    )
    assert check_same_step_hits(running) == []


# ------------------------------------------------------------ prefill-first step order
def decode_past_waiting(w_prompt: int, *, blocks: int = 6, budget: int = 8) -> StepSnapshot:
    """D decodes one token; W (``w_prompt`` tokens, never run) waits through the step."""
    pool = BlockPool(blocks, BS)
    pool.allocate("D", (1, 2, 3, 4), 3)
    before = EngineSnapshot(
        (
            req("D", RequestStatus.DECODING, 3, 1, 3),
            req("W", RequestStatus.WAITING, w_prompt, 0, 0),
        ),
        pool.snapshot(),
    )
    pool.allocate("D", (1, 2, 3, 4), 1)
    after = EngineSnapshot(
        (
            req("D", RequestStatus.DECODING, 3, 2, 4),
            req("W", RequestStatus.WAITING, w_prompt, 0, 0),
        ),
        pool.snapshot(),
    )
    return StepSnapshot(3, budget, 4, before, (scheduled(pool, "D", 3, 1, True),), after)


KEYS = {"D": (0,), "W": (1,)}


def test_declared_prefill_first_serves_no_decode_past_a_waiting_request_that_fitted() -> None:
    s = decode_past_waiting(w_prompt=5)
    assert check_step(s) == []
    assert check_decode_first(s) == []
    vs = check_prefill_first(s, KEYS)
    v = find(
        vs, Invariant.ORDER, "request W", "waiting request passed over while decoding request D"
    )
    assert "needs 2 blocks and 5 tokens; 5 blocks and 8 tokens were left" in v.message
    expect(v, "admitted", "still waiting")
    assert v.rule == "declared-step-order" and vs == [v]
    # The declared lookahead counts: with 2 blocks free, 5 slots fit and 9 do not.
    tight = decode_past_waiting(w_prompt=5, blocks=3)
    assert check_prefill_first(tight, KEYS) != []
    assert check_prefill_first(tight, KEYS, lookahead=4) == []


def test_declared_prefill_first_may_decode_when_the_waiting_request_did_not_fit() -> None:
    assert check_prefill_first(decode_past_waiting(w_prompt=9), KEYS) == []  # 9 > budget 8
    assert check_prefill_first(decode_past_waiting(w_prompt=5, blocks=2), KEYS) == []  # 1 free
    s = decode_past_waiting(w_prompt=5)
    assert check_prefill_first(replace(s, max_num_seqs=1), KEYS) == []  # no sequence slot
    assert check_prefill_first(s, {"D": (0,)}) == []  # W not in the declared order
    # A step that preempted, or a victim waiting ahead: the queue's head is not known.
    assert check_prefill_first(replace(s, preempted=("X",)), KEYS) == []
    victim = req("V", RequestStatus.PREEMPTED, 2, 1, 0)
    queued = replace(s, before=replace(s.before, requests=(*s.before.requests, victim)))
    assert check_prefill_first(queued, KEYS) == []
