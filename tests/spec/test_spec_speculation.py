"""The spec's rules for a step that verifies draft tokens (docs/SPECULATIVE.md), each
shown to fail.

One valid step is built from real ``BlockPool`` tables: request A (prompt 1..5, one
output 6, KV for 5 tokens) verifies the drafts 7, 8, 9 behind its last token. The
target accepts 7 and corrects 8 to 42: A gains two tokens (7, 42), its KV covers
positions 0..6 (the correction at 7 has no K/V yet), and the block that held only the
rejected positions 8 is returned. Each test corrupts one thing of it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from refserve.kv import BlockPool
from refserve.spec import (
    EngineSnapshot,
    Invariant,
    RequestSnapshot,
    RequestStatus,
    ScheduledRequest,
    StepSnapshot,
    Violation,
    check_step,
)
from refserve.spec.arith import slot_of

BS = 4
KNOWN = (1, 2, 3, 4, 5, 6)  # prompt 1..5, then the last sampled token 6
DRAFTS = (7, 8, 9)
ACCEPTED = (7, 42)  # the first draft, then the target's correction of the second


def _find(vs: list[Violation], inv: Invariant, fragment: str) -> Violation:
    hits = [v for v in vs if v.invariant is inv and fragment in v.message]
    assert hits, f"no [{inv}] ~ {fragment!r} among {[str(v) for v in vs]}"
    return hits[0]


def _decoding(outputs: int, computed: int) -> RequestSnapshot:
    return RequestSnapshot("A", RequestStatus.DECODING, 5, outputs, computed, max_tokens=16)


@pytest.fixture
def verify_step() -> StepSnapshot:
    pool = BlockPool(8, BS)
    pool.allocate("A", KNOWN, 5)
    before = EngineSnapshot((_decoding(1, 5),), pool.snapshot())
    pool.allocate("A", KNOWN + DRAFTS, 4)  # the lookahead slots: positions 5..8
    table = pool.block_table("A")
    positions = (5, 6, 7, 8)
    plan = ScheduledRequest(
        "A",
        4,
        positions,
        tuple(slot_of(table[p // BS], p, BS) for p in positions),
        table,
        samples=True,
        num_draft_tokens=3,
    )
    # After the commit: KV for 1..5, 6, 7 (seven positions, two blocks); the third
    # block held only rejected positions and went back to the free queue.
    kept = BlockPool(8, BS)
    kept.allocate("A", (*KNOWN, 7), 7)
    after = EngineSnapshot((_decoding(3, 7),), kept.snapshot())
    step = StepSnapshot(0, 8, 4, before, (plan,), after, num_speculative_tokens=3)
    assert check_step(step) == []
    return step


def _after(step: StepSnapshot, **changes: int) -> StepSnapshot:
    r = replace(step.after.requests[0], **changes)  # type: ignore[arg-type]
    return replace(step, after=replace(step.after, requests=(r,)))


def _plan(step: StepSnapshot, **changes: object) -> StepSnapshot:
    return replace(step, scheduled=(replace(step.scheduled[0], **changes),))  # type: ignore[arg-type]


def test_every_acceptance_count_from_none_to_all_is_valid(verify_step: StepSnapshot) -> None:
    for accepted in range(len(DRAFTS) + 1):
        kv = 6 + accepted  # positions 0..5 plus the accepted drafts
        kept = BlockPool(8, BS)
        kept.allocate("A", (*KNOWN, *DRAFTS[:accepted]), kv)
        step = _after(verify_step, num_output_tokens=2 + accepted, num_computed_tokens=kv)
        step = replace(step, after=replace(step.after, pool=kept.snapshot()))
        assert check_step(step) == [], accepted


def test_kv_counting_the_slot_of_the_correction_breaks_token_and_kvlen(
    verify_step: StepSnapshot,
) -> None:
    # The classic bug: the correction's position holds the rejected draft's K/V.
    vs = check_step(_after(verify_step, num_computed_tokens=8))
    v = _find(vs, Invariant.TOKEN, "less the 2 rejected drafts")
    assert (v.expected, v.seen) == ("7", "8")
    v = _find(vs, Invariant.KVLEN, "KV for all but the last sampled token")
    assert (v.expected, v.seen) == ("7", "8")


def test_kv_not_rolled_back_by_the_rejected_drafts(verify_step: StepSnapshot) -> None:
    vs = check_step(_after(verify_step, num_computed_tokens=9))
    v = _find(vs, Invariant.TOKEN, "rejected drafts")
    assert (v.expected, v.seen) == ("7", "9")


@pytest.mark.parametrize("gained", [0, 5])
def test_a_verification_emits_one_to_drafts_plus_one_tokens(
    verify_step: StepSnapshot, gained: int
) -> None:
    vs = check_step(_after(verify_step, num_output_tokens=1 + gained))
    v = _find(vs, Invariant.KVLEN, "a step verifying 3 drafts must emit 1 to 4 tokens")
    assert (v.expected, v.seen) == ("1..4", str(gained))


def test_drafts_after_a_chunk_that_stops_short_of_the_known_tokens(
    verify_step: StepSnapshot,
) -> None:
    # The chunk's first token would be position 4: the last token 6 is never input.
    before = replace(verify_step.before.requests[0], num_computed_tokens=4)
    step = replace(verify_step, before=replace(verify_step.before, requests=(before,)))
    vs = check_step(_plan(step, positions=(4, 5, 6, 7)))
    v = _find(vs, Invariant.KVLEN, "draft tokens verified after a chunk that does not reach")
    assert (v.expected, v.seen) == ("6", "5")


def test_draft_tokens_must_leave_the_last_sampled_token(verify_step: StepSnapshot) -> None:
    vs = check_step(_plan(verify_step, num_draft_tokens=4))
    v = _find(vs, Invariant.TOKEN, "draft tokens must leave the last sampled token")
    assert (v.expected, v.seen) == ("0..3", "4")


def test_more_drafts_than_declared(verify_step: StepSnapshot) -> None:
    vs = check_step(replace(verify_step, num_speculative_tokens=2))
    v = _find(vs, Invariant.TOKEN, "more draft tokens than num_speculative_tokens")
    assert (v.expected, v.seen) == ("<= 2", "3")


def test_the_budget_counts_verification_tokens(verify_step: StepSnapshot) -> None:
    vs = check_step(replace(verify_step, token_budget=3))
    v = _find(vs, Invariant.TOKEN, "scheduled tokens exceed the token budget")
    assert (v.expected, v.seen) == ("<= 3", "4")


def test_a_block_holding_only_rejected_positions_is_not_kept(verify_step: StepSnapshot) -> None:
    # The table keeps its lookahead block after the commit (refserve returns it).
    kept = BlockPool(8, BS)
    kept.allocate("A", (*KNOWN, *DRAFTS), 9)
    table = replace(kept.snapshot().tables[0], num_stored=7, token_ids=(*KNOWN, 7))
    pool = replace(kept.snapshot(), tables=(table,))
    vs = check_step(replace(verify_step, after=replace(verify_step.after, pool=pool)))
    v = _find(vs, Invariant.POS, "block table does not cover the KV length exactly")
    assert (v.expected, v.seen) == ("2", "3")


def test_a_rejected_draft_may_not_have_written_into_another_requests_block(
    verify_step: StepSnapshot,
) -> None:
    # B took the returned block in the same step: the draft's slot was never A's alone.
    kept = BlockPool(8, BS)
    kept.allocate("A", (*KNOWN, 7), 7)
    kept.allocate("B", (50, 51), 2)  # gets block 2, where A's position 8 was written
    pool = kept.snapshot()
    vs = check_step(replace(verify_step, after=replace(verify_step.after, pool=pool)))
    v = _find(vs, Invariant.CAP, "position 8 writes slot 8 in a block the request does not hold")
    assert (v.expected, v.seen) == ("one of [0, 1]", "2")
