"""``Scheduler.schedule`` then ``commit``: what a committed step records and when it stops.

Commit stamps times from the step's clock, stops a request on a stop token, EOS,
``max_tokens`` or ``max_model_len`` exactly, and refuses a plan that is not the pending
one; a plan that fails validation leaves nothing reserved (ATOMIC, docs/ARCHITECTURE.md
"One step").
"""

from __future__ import annotations

import pytest
from harness import SMALL_CONFIG, commit_step, make_request, plan_entry

from refserve.core.config import SchedulerConfig
from refserve.core.executor_output import BadExecutorOutput
from refserve.core.outcome import Outcome
from refserve.core.policy import DecodeFirst
from refserve.core.request import FinishReason, Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.spec.snapshot import RequestStatus as S


@pytest.mark.mutation_kill
def test_commit_stamps_times_from_the_right_clock() -> None:
    sched = Scheduler(SMALL_CONFIG)
    sched.add_request(make_request("a", 5, 2))
    plan = sched.schedule(5.0)
    assert plan.admitted == ("a",) and plan.step_index == 0
    events = sched.commit(plan, {"a": 11}, 9.0)
    a = sched.requests["a"]
    assert a.admitted_ms == 5.0  # the step's start
    assert a.token_times_ms == [9.0]  # the step's end
    assert (
        dict(events.last_tokens()) == {"a": 11} and events.finished == () and events.preempted == ()
    )
    assert sched.step_index == 1 and sched.running == [a]
    _, events = commit_step(sched, 20.0, token=12)
    assert events.finished == ("a",) and dict(events.last_tokens()) == {"a": 12}
    assert a.admitted_ms == 5.0 and a.token_times_ms == [9.0, 20.0] and a.finished_ms == 20.0
    assert a.output_token_ids == [11, 12] and a.finish_reason is FinishReason.LENGTH
    assert sched.running == [] and "a" not in sched.requests and sched.retired == [a]


@pytest.mark.mutation_kill
@pytest.mark.parametrize(
    ("stop", "finishes"),
    [
        (StopParams(9, stop_token_ids=(3, 7)), True),
        (StopParams(9, eos_token_id=7), True),
        (StopParams(9, eos_token_id=7, ignore_eos=True), False),
        (StopParams(9, stop_token_ids=(8,), eos_token_id=6), False),
    ],
)
def test_commit_stops_on_a_stop_token_or_eos(stop: StopParams, finishes: bool) -> None:
    sched = Scheduler(SMALL_CONFIG)
    sched.add_request(Request("a", [1, 2, 3], stop))
    _, events = commit_step(sched, 3.0, token=7)
    a = sched.retired[-1] if finishes else sched.requests["a"]
    assert events.finished == (("a",) if finishes else ())
    assert a.finished_ms == (3.0 if finishes else None)  # a first token's finish, stamped
    assert a.finish_reason is (FinishReason.STOP if finishes else None)
    assert a.status is (S.FINISHED if finishes else S.DECODING)
    assert sched.pool.has_request("a") is not finishes


@pytest.mark.mutation_kill
def test_commit_stops_at_max_model_len_and_max_tokens_exactly() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_blocks=16, max_model_len=8
    )
    sched = Scheduler(cfg)
    sched.add_request(make_request("long", 5, 50))  # max_model_len stops it at 8 tokens
    sched.add_request(make_request("short", 2, 3, base=10))  # max_tokens stops it at 3 outputs
    reqs = dict(sched.requests)
    done: dict[str, int] = {}
    for _ in range(5):
        _, events = commit_step(sched)
        for rid in events.finished:
            done[rid] = sched.step_index
    assert done == {"long": 3, "short": 3}
    assert [(r.num_tokens, r.finish_reason) for r in reqs.values()] == [
        (8, FinishReason.LENGTH),
        (5, FinishReason.LENGTH),
    ]


@pytest.mark.mutation_kill
def test_a_prefill_chunk_that_does_not_sample_keeps_prefilling() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=4, max_num_seqs=4, block_size=4, num_blocks=16, max_model_len=32
    )
    sched = Scheduler(cfg)
    sched.add_request(make_request("a", 10, 2))
    plan, events = commit_step(sched)
    a = sched.requests["a"]
    assert plan_entry(plan, "a") == (0, 4, False, True, 0)
    assert a.status is S.PREFILLING and a.num_computed_tokens == 4 and a.num_tokens == 10
    assert dict(events.last_tokens()) == {} and a.token_times_ms == []
    assert events.outcomes == (Outcome("a"),)  # the chunk is reported, with nothing kept
    plan, _ = commit_step(sched)
    assert plan_entry(plan, "a") == (4, 4, False, True, 0) and a.status is S.PREFILLING
    plan, events = commit_step(sched)
    assert plan_entry(plan, "a") == (8, 2, True, True, 0) and a.status is S.DECODING
    assert a.num_computed_tokens == 10 and dict(events.last_tokens()) == {"a": 7}


@pytest.mark.mutation_kill
def test_commit_records_the_cached_prefix_of_an_admission() -> None:
    sched = Scheduler(SMALL_CONFIG)
    sched.add_request(make_request("a", 9, 1))
    commit_step(sched)  # a finishes; its two full blocks stay cached
    sched.add_request(make_request("b", 10, 2))  # same first 9 tokens
    plan, _ = commit_step(sched)
    b = sched.requests["b"]
    assert plan_entry(plan, "b") == (8, 2, True, True, 8)
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 10
    commit_step(sched)
    assert b.num_cached_tokens == 8  # a decode does not reset it


@pytest.mark.mutation_kill
def test_commit_refuses_a_plan_that_is_not_pending() -> None:
    sched = Scheduler(SMALL_CONFIG)
    sched.add_request(make_request("a", 3))
    plan = sched.schedule(0.0)
    sched.rollback()
    with pytest.raises(AssertionError) as stale:
        sched.commit(plan, {"a": 1})
    assert str(stale.value).splitlines()[0] == "commit of a plan that is not pending"
    with pytest.raises(AssertionError) as twice:
        sched.rollback()
    assert str(twice.value).splitlines()[0] == "rollback without a pending plan"
    plan = sched.schedule(0.0)
    for bad in ({}, {"a": -1}, {"a": True}):
        with pytest.raises(BadExecutorOutput) as info:
            sched.commit(plan, bad)
        assert str(info.value) == (
            f"step 0: executor gave {bad.get('a')!r} as the sampled token of request 'a'; "
            "expected a non-negative int"
        )
    sched.commit(plan, {"a": 0})  # now_ms defaults to 0
    assert sched.requests["a"].output_token_ids == [0]
    assert sched.requests["a"].token_times_ms == [0.0]
    with pytest.raises(AssertionError) as committed:  # a commit leaves nothing pending
        sched.rollback()
    assert str(committed.value).splitlines()[0] == "rollback without a pending plan"


@pytest.mark.mutation_kill
def test_every_sampling_entry_needs_a_token_even_after_a_chunk() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=8,
        max_num_seqs=4,
        block_size=4,
        num_blocks=32,
        max_model_len=64,
        align_chunks_to_blocks=True,
    )
    sched = Scheduler(cfg)
    sched.add_request(make_request("a", 4, 2))
    sched.add_request(make_request("b", 2, 2, base=50))
    commit_step(sched)
    sched.add_request(make_request("c", 12, 2, base=100))
    sched.add_request(make_request("d", 1, 2, base=200))
    plan = sched.schedule(0.0)
    # Two decodes, c's block-aligned first chunk (no sample), then d's one token.
    assert plan.request_ids == ("a", "b", "c", "d")
    assert plan.num_new_tokens == (1, 1, 4, 1) and plan.samples == (True, True, False, True)
    with pytest.raises(BadExecutorOutput, match=r"request 'd'; expected a non-negative int$"):
        sched.commit(plan, {"a": 1, "b": 1})
    sched.commit(plan, {"a": 1, "b": 1, "d": 2})
    assert sched.requests["d"].output_token_ids == [2]


class FailingPolicy(DecodeFirst):
    """Decode-first whose admission order raises once ``fail`` is set."""

    fail = False

    def waiting_order(self, waiting: list[Request], step_index: int) -> list[Request]:  # type: ignore[override]
        if self.fail:
            raise RuntimeError("policy failed")
        return super().waiting_order(waiting, step_index)


@pytest.mark.mutation_kill
def test_a_failing_plan_leaves_no_reservation_behind() -> None:
    policy = FailingPolicy()
    sched = Scheduler(SMALL_CONFIG, policy)
    sched.add_request(make_request("a", 6, 4))
    commit_step(sched)
    sched.add_request(make_request("b", 6, 4, base=50))
    before = sched.snapshot()
    policy.fail = True
    with pytest.raises(RuntimeError, match="policy failed"):
        sched.schedule(1.0)  # a's decode was reserved before admission failed
    assert sched.snapshot() == before
    policy.fail = False
    plan, _ = commit_step(sched, 2.0)  # no step is left pending or half-reserved
    assert plan.request_ids == ("a", "b")


@pytest.mark.mutation_kill
def test_the_new_tokens_of_a_step_hold_the_bulk_decodes_and_the_other_entries() -> None:
    """A step with bulk decodes and an admission reports every sampled token: the
    decodes (kept as an array) then the admitted request, by id and in plan order."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_blocks=16, max_model_len=32
    )
    sched = Scheduler(cfg)
    sched.add_request(make_request("a", 3, 4))
    sched.add_request(make_request("b", 3, 4))
    commit_step(sched)
    sched.add_request(make_request("c", 2, 4))
    plan = sched.schedule()
    assert plan.decode_rows is not None and plan.admitted == ("c",)  # the bulk path ran
    events = sched.commit(plan, {"a": 7, "b": 8, "c": 9})
    new = dict(events.last_tokens())
    assert len(new) == 3 and list(new) == ["a", "b", "c"]
    assert list(events.last_tokens()) == [("a", 7), ("b", 8), ("c", 9)]
    assert (new["b"], new["c"]) == (8, 9)


@pytest.mark.mutation_kill
def test_a_bad_sampled_token_is_named_among_good_ones() -> None:
    """The refusal names the first bad token, not a good one beside it: 0 and 2**63 - 1
    are the bounds of a good token, 2**63 the first past it."""
    sched = Scheduler(SMALL_CONFIG)
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, 2, 2, base=10 * i))
    plan = sched.schedule(0.0)
    assert plan.request_ids == ("a", "b", "c") and all(plan.samples)
    for good, bad, expected in (
        ({"a": 0, "b": 500}, -1, "expected a non-negative int"),
        ({"a": 2**63 - 1, "b": 1}, 2**63, "expected a non-negative int below 2**63"),
    ):
        with pytest.raises(BadExecutorOutput) as info:
            sched.commit(plan, {**good, "c": bad})
        assert str(info.value) == (
            f"step 0: executor gave {bad!r} as the sampled token of request 'c'; {expected}"
        )
    sched.commit(plan, {"a": 0, "b": 2**63 - 1, "c": 5})
    assert sched.requests["b"].output_token_ids == [2**63 - 1]
