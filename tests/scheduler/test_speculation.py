"""Speculative decoding in the scheduler (docs/SPECULATIVE.md, "Scheduling"): drafts
proposed for a decoding request are verified after its last token, within the limits;
the commit keeps the accepted drafts and the target's own token, and drops the K/V of
the rejected ones. The scheduler state machine draws all of it with every invariant
checked; these tests pin the individual rules and the refusals.
"""

from __future__ import annotations

import pytest

from refserve.core.config import SchedulerConfig
from refserve.core.executor_output import BadExecutorOutput, validate_output
from refserve.core.inputs import build_inputs
from refserve.core.outcome import Outcome
from refserve.core.request import FinishReason, Request, StopParams
from refserve.core.scheduler import Scheduler, StepInProgress
from refserve.errors import InvalidArgument, UnknownRequest
from refserve.spec.snapshot import RequestStatus

S = RequestStatus
PROMPT = [1, 2, 3, 4, 5]


def _decoding(
    k: int = 3, *, max_tokens: int = 10, stop: tuple[int, ...] = (), **cfg: int
) -> Scheduler:
    """A scheduler whose request "a" has prefilled 1..5 and sampled 6 (KV for 5)."""
    sched = Scheduler(
        SchedulerConfig(block_size=4, num_speculative_tokens=k, **cfg)  # type: ignore[arg-type]
    )
    sched.add_request(Request("a", list(PROMPT), StopParams(max_tokens, stop_token_ids=stop)))
    while sched.requests["a"].status is not S.DECODING:  # the prompt, chunk by chunk
        plan = sched.schedule()
        sched.commit(plan, {"a": 6} if plan.samples[0] else {})
    return sched


def test_a_verification_keeps_the_accepted_drafts_and_the_targets_token() -> None:
    sched = _decoding()
    free = sched.pool.num_free_blocks
    sched.propose("a", [7, 8, 9])
    plan = sched.schedule()
    assert (plan.starts, plan.num_new_tokens, plan.samples) == ((5,), (4,), (True,))
    assert plan.drafts == {"a": (7, 8, 9)}
    inputs = build_inputs(plan, sched.requests, sched.pool, sched.batch)
    assert inputs.input_ids.tolist() == [6, 7, 8, 9]
    assert inputs.positions.tolist() == [5, 6, 7, 8]
    assert sched.pool.num_free_blocks == free - 1  # a block for position 8
    events = sched.commit(plan, {"a": 42}, 1.0, accepted={"a": 1})
    r = sched.requests["a"]
    assert r.output_token_ids == [6, 7, 42]
    table = sched.pool.snapshot().table("a")
    assert table is not None and r.num_computed_tokens == 7 == table.num_stored
    assert len(sched.pool.block_table("a")) == 2  # the block of position 8 went back
    assert sched.pool.num_free_blocks == free
    assert dict(events.last_tokens())["a"] == 42
    assert events.verified == {"a": Outcome("a", (7, 42), num_drafts=3, num_accepted=1)}
    assert r.token_times_ms[-2:] == [1.0, 1.0]


def test_the_next_step_decodes_from_the_corrected_token() -> None:
    sched = _decoding()
    sched.propose("a", [7, 8, 9])
    sched.commit(sched.schedule(), {"a": 42}, accepted={"a": 0})
    plan = sched.schedule()  # no drafts: one token, at the first rejected position
    assert (plan.starts, plan.num_new_tokens, plan.drafts) == ((6,), (1,), {})
    inputs = build_inputs(plan, sched.requests, sched.pool, sched.batch)
    assert inputs.input_ids.tolist() == [42]


def test_drafts_are_cut_to_the_outputs_the_request_may_still_emit() -> None:
    sched = _decoding(max_tokens=3)  # one output so far: two more at most
    sched.propose("a", [7, 8, 9])
    assert sched.schedule().drafts == {"a": (7,)}


def test_no_draft_when_one_output_is_left() -> None:
    sched = _decoding(max_tokens=2)  # the next token is the last: nothing to verify
    sched.propose("a", [7])
    assert sched.schedule().drafts == {}


def test_drafts_are_cut_to_the_model_length() -> None:
    # max_model_len 8: "a" holds 6 tokens, so at most 2 more, the last the target's own.
    sched = _decoding(max_model_len=8)
    sched.propose("a", [7, 8, 9])
    assert sched.schedule().drafts == {"a": (7,)}


def test_drafts_that_fit_in_the_blocks_held_need_no_free_block() -> None:
    # Two blocks of 4, both held by "a" (KV 5): positions 5..7 fit in its second block.
    sched = _decoding(num_blocks=2)
    assert sched.pool.num_free_blocks == 0
    sched.propose("a", [7, 8])
    assert sched.schedule().drafts == {"a": (7, 8)}


def test_token_zero_is_a_valid_draft() -> None:
    sched = _decoding()
    sched.propose("a", [0])
    assert sched.schedule().drafts == {"a": (0,)}


def _two_decoding(num_blocks: int) -> Scheduler:
    """ "a" (KV 5 of blocks of 4) and "b" (KV 4: its next token starts a block)."""
    sched = _decoding(num_blocks=num_blocks)
    sched.add_request(Request("b", [1, 1, 1, 1], StopParams(10)))
    sched.commit(sched.schedule(), {"a": 7, "b": 2})
    return sched


def test_drafts_take_free_blocks_that_leave_one_per_later_decode() -> None:
    sched = _two_decoding(num_blocks=5)  # two free: a's drafts take one, b's decode one
    sched.propose("a", [8, 9, 10])
    assert sched.schedule().drafts == {"a": (8, 9, 10)}


def test_the_last_decode_may_take_the_last_free_block_for_its_drafts() -> None:
    sched = _two_decoding(num_blocks=4)  # one free; "b" decodes last in the step
    sched.propose("b", [3, 4, 5])
    assert sched.schedule().drafts == {"b": (3, 4, 5)}


def test_drafts_are_cut_to_the_token_budget() -> None:
    sched = _decoding(max_num_batched_tokens=3)
    sched.propose("a", [7, 8, 9])
    plan = sched.schedule()
    assert plan.drafts == {"a": (7, 8)} and plan.num_new_tokens == (3,)


@pytest.mark.mutation_kill
def test_drafts_leave_the_prefill_reserve_to_a_starving_prompt() -> None:
    # A budget of 4 with 2 reserved for the waiting prompt: the decode and one draft
    # take the other 2, and the prompt gets its reserve.
    sched = _decoding(
        max_num_batched_tokens=4, prefill_reserve_tokens=2, prefill_reserve_after_steps=0
    )
    sched.add_request(Request("p", [1, 2, 3], StopParams(2)))
    sched.propose("a", [7, 8, 9])
    plan = sched.schedule()
    assert plan.drafts == {"a": (7,)}
    assert plan.request_ids == ("a", "p") and plan.num_new_tokens == (2, 2)


def test_drafts_never_take_the_block_a_later_decode_needs() -> None:
    # Blocks of 4: "a" stores 5 and "b" stores 4 (its next token starts a block). Free
    # blocks: 4 - 2 - 1 = 1, which b's decode needs; a's drafts would need it too.
    sched = _decoding(num_blocks=4)
    sched.add_request(Request("b", [1, 1, 1, 1], StopParams(10)))
    sched.commit(sched.schedule(), {"a": 7, "b": 2})
    assert sched.pool.num_free_blocks == 1
    sched.propose("a", [8, 9, 10])
    plan = sched.schedule()
    assert plan.drafts == {} and plan.num_new_tokens == (1, 1) and not plan.preempted


def test_a_stop_among_the_accepted_drafts_ends_the_request_there() -> None:
    sched = _decoding(stop=(8,))
    sched.propose("a", [7, 8, 9])
    events = sched.commit(sched.schedule(), {"a": 42}, 5.0, accepted={"a": 3})
    assert events.finished == ("a",) and events.verified["a"].tokens == (7, 8)
    # The finished verification still reports its drafts and how many were accepted.
    assert events.verified["a"] == Outcome(
        "a", (7, 8), FinishReason.STOP, blocks_freed=2, num_drafts=3, num_accepted=3
    )
    r = sched.retired[0]
    assert r.output_token_ids == [6, 7, 8] and r.finish_reason is FinishReason.STOP
    assert r.finished_ms == 5.0
    # Its blocks are free, and no cache entry covers a position past the stop.
    assert sched.pool.num_used_blocks == 0
    assert all(len(e.token_ids) == 4 for e in sched.pool.snapshot().cache_entries)
    assert sched.pool.lookup([*PROMPT, 6, 7, 8, 9, 42]).num_tokens == 4


def test_bad_proposals_are_refused_and_change_nothing() -> None:
    sched = _decoding(k=2)
    sched.add_request(Request("w", [1], StopParams(4)))  # waiting, not decoding
    before = sched.snapshot()
    for rid, drafts, error, match in [
        ("ghost", [1], UnknownRequest, "propose: unknown request id 'ghost'"),
        ("a", [1, 2, 3], InvalidArgument, "3 drafts for 'a'; num_speculative_tokens is 2"),
        ("w", [1], InvalidArgument, "'w' is not running in decode"),
        ("a", [-1], InvalidArgument, "bad draft token -1"),
        ("a", [True], InvalidArgument, "bad draft token True"),
    ]:
        with pytest.raises(error, match=match):
            sched.propose(rid, drafts)  # type: ignore[arg-type]
    assert sched.snapshot() == before and sched.schedule().drafts == {}
    with pytest.raises(StepInProgress, match=r"^propose: a step is in progress"):
        sched.propose("a", [1])
    off = _decoding(k=0)
    with pytest.raises(InvalidArgument, match="num_speculative_tokens is 0"):
        off.propose("a", [7])


@pytest.mark.parametrize(
    "accepted",
    [None, {}, {"a": 4}, {"a": -1}, {"a": True}, {"a": 1, "b": 0}],
    ids=["none", "missing", "too many", "negative", "bool", "not verifying"],
)
def test_a_bad_accepted_count_is_refused_before_anything_changes(
    accepted: dict[str, int] | None,
) -> None:
    sched = _decoding()
    sched.propose("a", [7, 8, 9])
    before = sched.snapshot()
    plan = sched.schedule()
    with pytest.raises(BadExecutorOutput, match="accepted count"):
        validate_output(plan, {"a": 42}, accepted)
    with pytest.raises(BadExecutorOutput, match="accepted count"):
        sched.commit(plan, {"a": 42}, accepted=accepted)
    sched.rollback()
    assert sched.snapshot() == before
    plan = sched.schedule()  # the drafts survive the failed step
    assert plan.drafts == {"a": (7, 8, 9)}
    validate_output(plan, {"a": 42}, {"a": 2})  # a good count passes
    sched.commit(plan, {"a": 42}, accepted={"a": 2})
    assert sched.requests["a"].output_token_ids == [6, 7, 8, 42]


@pytest.mark.mutation_kill
def test_drafts_for_a_running_prefill_are_refused() -> None:
    # Running is not enough: only a decoding request verifies drafts after its last token.
    sched = _decoding(max_num_batched_tokens=8)
    sched.add_request(Request("p", list(range(1, 13)), StopParams(4)))
    sched.commit(sched.schedule(), {"a": 7})  # "p" is admitted with a first chunk
    assert "p" in sched.batch and sched.requests["p"].status is S.PREFILLING
    with pytest.raises(InvalidArgument, match="'p' is not running in decode"):
        sched.propose("p", [1])
    assert sched.schedule().drafts == {}


def test_drafts_hold_for_one_step() -> None:
    sched = _decoding()
    sched.propose("a", [7])
    sched.commit(sched.schedule(), {"a": 7}, accepted={"a": 1})
    assert sched.schedule().drafts == {}


def test_an_empty_proposal_withdraws_the_drafts() -> None:
    sched = _decoding()
    sched.propose("a", [7])
    sched.propose("a", [])
    assert sched.schedule().drafts == {}


def test_abort_and_pause_drop_the_drafts() -> None:
    sched = _decoding()
    sched.add_request(Request("b", [1, 1], StopParams(10)))
    sched.commit(sched.schedule(), {"a": 7, "b": 2})
    sched.propose("a", [8])
    sched.propose("b", [3])
    sched.abort("a")
    sched.pause("b", "device")
    plan = sched.schedule()
    assert plan.drafts == {} and plan.request_ids == ()
