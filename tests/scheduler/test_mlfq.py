"""The skip-join multi-level feedback queue (``policy="mlfq"``, ref/core/mlfq.py) on the
simulator: where a request joins, demotion, promotion, displacement and its protection,
the proactive swap-outs and their recompute fallback.

Every run goes through ``EngineCore(check_invariants=True)`` (the ``Stepper``), and after
every step the policy's own rules (spec/mlfq.py) are read off its snapshot too.

The numbers: the settings' cost is ``2 + 0.5P + D`` ms, so with a base quantum of 4 ms
and growth 2 the quanta are 4, 8, then unbounded (three levels). A prompt of ``n``
tokens joins by its first chunk's ``2 + 0.5n`` ms: up to 4 tokens level 0, up to 12
level 1, longer the last level; a decode is 3 ms of service.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import Stepper, make_request

from refserve.core.config import PolicyName, SchedulerConfig
from refserve.core.loop import SchedulerLoop
from refserve.core.mlfq import SkipJoinMlfq
from refserve.core.mlfq_settings import MlfqSettings
from refserve.core.plan import StepPlan
from refserve.errors import InvalidArgument
from refserve.spec.mlfq import DisplacedRecord, check_mlfq
from refserve.spec.snapshot import RequestStatus

S = RequestStatus


def _config(*, settings: dict[str, Any] | None = None, **kw: Any) -> SchedulerConfig:
    knobs: dict[str, Any] = dict(num_queues=3, base_quantum_ms=4.0, starvation_steps=64)
    knobs.update(settings or {})
    base: dict[str, Any] = dict(
        max_num_batched_tokens=16,
        max_num_seqs=2,
        block_size=4,
        num_blocks=32,
        num_host_blocks=32,
        enable_prefix_caching=False,
        policy=PolicyName.MLFQ,
        mlfq=MlfqSettings(**knobs),
    )
    base.update(kw)
    return SchedulerConfig(**base)


class MlfqRun:
    """A checked stepper whose policy's rules are checked after every step too."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.st = Stepper(config)
        policy = self.st.sched.policy
        assert isinstance(policy, SkipJoinMlfq)
        self.policy = policy
        self.displaced: list[tuple[int, DisplacedRecord]] = []

    def add(self, rid: str, n: int, max_tokens: int, base: int) -> None:
        self.st.add(make_request(rid, n, max_tokens, base=base))

    def step(self) -> StepPlan:
        plan = self.st.step().plan
        sched = self.st.sched
        snap = self.policy.snapshot(sched.requests, sched.running, plan.step_index + 1)
        assert check_mlfq(snap) == [], check_mlfq(snap)
        self.displaced.extend((plan.step_index, d) for d in snap.displaced)
        return plan

    def level(self, rid: str) -> int:
        return self.policy.books[rid].level

    def status(self, rid: str) -> RequestStatus:
        return self.st.sched.requests[rid].status

    def drain(self, limit: int = 300) -> None:
        for _ in range(limit):
            if not self.st.sched.has_unfinished:
                return
            self.step()
        raise AssertionError(f"not finished in {limit} steps")

    def until_preempted(self, limit: int = 40) -> StepPlan:
        for _ in range(limit):
            plan = self.step()
            if plan.preempted:
                return plan
        raise AssertionError(f"no preemption in {limit} steps")


# ------------------------------------------------------------------ joining
@pytest.mark.parametrize("skip_join", [True, False])
def test_a_long_prompt_skips_to_a_lower_level_unless_skip_join_is_off(skip_join: bool) -> None:
    run = MlfqRun(_config(settings=dict(skip_join=skip_join), max_num_seqs=4))
    run.add("short", 4, 2, base=0)  # 4 ms: level 0
    run.add("mid", 12, 2, base=100)  # 8 ms: level 1
    run.add("long", 16, 2, base=200)  # 10 ms: past every bounded quantum
    joined = {rid: run.policy.books[rid].joined_level for rid in ("short", "mid", "long")}
    if skip_join:
        assert joined == {"short": 0, "mid": 1, "long": 2}
    else:
        assert joined == {"short": 0, "mid": 0, "long": 0}
    assert joined == {rid: run.level(rid) for rid in joined}
    # The join is priced on the first chunk, not the whole prompt: a budget of 4 tokens
    # makes every first chunk 4 ms.
    small = MlfqRun(_config(max_num_batched_tokens=4))
    small.add("long", 40, 2, base=0)
    assert small.level("long") == 0
    run.drain()


def test_admission_reads_the_levels_before_arrival_order() -> None:
    # One seat: the long prompt arrived first but waits at level 2 behind the short one.
    run = MlfqRun(_config(max_num_seqs=1))
    run.add("long", 16, 2, base=0)
    run.add("short", 3, 2, base=100)
    assert run.step().request_ids == ("short",)
    run.drain()


# ------------------------------------------------------------------ demotion, promotion
def test_a_request_drops_a_level_each_time_it_uses_up_its_quantum() -> None:
    run = MlfqRun(_config())
    run.add("a", 2, 12, base=0)  # prefill 3 ms at level 0, then 3 ms per decode
    levels, served = [], []
    for _ in range(6):
        run.step()
        levels.append(run.level("a"))
        served.append(run.policy.books["a"].served_ms)
    # Level 0 (4 ms): 3 + 3 >= 4 after the first decode; level 1 (8 ms): three decodes.
    assert levels == [0, 1, 1, 1, 2, 2]
    assert served == [3.0, 0.0, 3.0, 6.0, 0.0, 3.0]
    assert run.policy.books["a"].num_demotions == 2
    # The last level's quantum is unbounded: no further demotion.
    run.drain()
    assert not run.st.sched.has_unfinished


def _one_seat(starvation_steps: int) -> MlfqRun:
    """Two levels, one seat: a (level 0) runs and drops to level 1 at its first decode;
    b (12 tokens, 8 ms: level 1) waits for the seat, never above a unless promoted."""
    run = MlfqRun(
        _config(settings=dict(num_queues=2, starvation_steps=starvation_steps), max_num_seqs=1)
    )
    run.add("a", 2, 30, base=0)
    run.add("b", 12, 4, base=100)
    return run


def test_a_request_waiting_below_level_0_is_promoted_after_the_starvation_bound() -> None:
    bound = 5
    run = _one_seat(bound)
    queued = run.st.sched.requests["b"].queued_step
    for _ in range(bound - 1):
        run.step()
        assert run.level("b") == 1 and run.status("b") is S.WAITING
    assert run.level("a") == 1 and run.policy.books["b"].num_promotions == 0
    run.step()  # the step that ends with b having waited the bound
    b = run.policy.books["b"]
    assert b.level == 0 and b.num_promotions == 1 and b.queued_step == queued
    # Now above the running request (past its protection): b takes its seat at once.
    plan = run.step()
    assert plan.preempted == ("a",) and "b" in plan.request_ids
    (step, record) = run.displaced[-1]
    assert step == plan.step_index
    assert (record.request_id, record.reason, record.for_request) == ("a", "seat", "b")
    run.drain()


def test_without_promotion_a_request_of_the_same_level_is_not_displaced() -> None:
    # The control of the test above: b waits at a's level until a finishes.
    run = _one_seat(1000)
    run.drain()
    assert run.policy.num_displaced == 0 and run.displaced == []
    plans = run.st.plans
    last_a = max(i for i, p in enumerate(plans) if "a" in p.request_ids)
    first_b = min(i for i, p in enumerate(plans) if "b" in p.request_ids)
    assert last_a == 30 - 1 and first_b == last_a + 1


# ------------------------------------------------------------------ displacement
def _long_then_short(**kw: Any) -> MlfqRun:
    """Two long requests fill both seats at level 1; a short one (level 0) arrives once
    they decode."""
    run = MlfqRun(_config(**kw))
    run.add("long1", 6, 24, base=0)
    run.add("long2", 7, 24, base=100)
    run.step()
    run.add("short", 2, 3, base=200)
    return run


def test_a_higher_waiting_request_displaces_the_lowest_running_one_for_a_seat() -> None:
    run = _long_then_short()
    plan = run.until_preempted()
    # The lowest running request: the same level for both, so the later arrival.
    assert plan.preempted == ("long2",) and "short" in plan.request_ids
    (_, record) = run.displaced[-1]
    assert (record.request_id, record.reason, record.for_request) == ("long2", "seat", "short")
    assert record.resumed_ms >= record.protected_ms == 8.0
    # Its K/V went to the host: it resumes without recomputing.
    assert plan.swapped_out == ("long2",) and run.status("long2") is S.SWAPPED
    assert run.st.sched.num_swapped_out_blocks == len(plan.swap_out) > 0
    run.drain()
    assert run.st.sched.num_swapped_in_blocks == run.st.sched.num_swapped_out_blocks
    assert run.policy.books == {}  # every finished request forgotten
    assert run.policy.num_displaced == 1 and run.policy.num_headroom_swaps == 0


def test_a_protected_request_is_not_displaced_until_served_its_quantum() -> None:
    # long joined level 1 (8 ms of protection); its prefill is not counted, each decode
    # 3 ms: it keeps its seat for three decodes after the short request arrives.
    run = MlfqRun(_config(max_num_seqs=1))
    run.add("long", 10, 24, base=0)
    run.step()  # its prefill
    run.add("short", 2, 3, base=100)
    resumed = []
    while not (plan := run.step()).preempted:
        assert "long" in plan.request_ids and run.status("short") is S.WAITING
        resumed.append(run.policy.books["long"].resumed_ms)
        assert len(resumed) < 10, "never displaced"
    assert resumed == [3.0, 6.0, 9.0]
    (_, record) = run.displaced[-1]
    assert record.request_id == "long" and record.protected_ms == 8.0
    assert record.resumed_ms == 9.0
    run.drain()


def test_a_request_that_joined_the_last_level_is_displaced_after_a_finite_protection() -> None:
    # Two levels: the long prompt joins level 1, the last, whose quantum is unbounded. It
    # is protected for the quantum above (4 ms: two decodes), not for ever.
    run = MlfqRun(_config(settings=dict(num_queues=2), max_num_seqs=1))
    run.add("long", 10, 24, base=0)
    run.step()
    assert run.level("long") == 1
    run.add("short", 2, 3, base=100)
    plan = run.until_preempted()
    assert plan.preempted == ("long",) and "short" in plan.request_ids
    (_, record) = run.displaced[-1]
    assert record.protected_ms == 4.0 and record.resumed_ms == 6.0
    run.drain()


# ------------------------------------------------------------------ proactive swap
def _headroom(**kw: Any) -> MlfqRun:
    """Two 7-token prompts decoding in a 6-block pool: at 12 stored tokens each both
    open a block, and none is free."""
    run = MlfqRun(_config(num_blocks=6, max_num_seqs=4, **kw))
    run.add("a", 7, 10, base=0)
    run.add("b", 7, 10, base=100)
    return run


def test_headroom_swap_out_before_the_running_requests_run_short_of_blocks() -> None:
    run = _headroom()
    plan = run.until_preempted()
    assert plan.preempted == ("b",) and plan.swapped_out == ("b",)
    (_, record) = run.displaced[-1]
    assert (record.request_id, record.reason, record.for_request) == ("b", "headroom", None)
    assert run.policy.num_headroom_swaps == 1
    # a still got its token in that step: the swap-out made room before the planner met
    # the shortage.
    assert "a" in plan.request_ids
    run.drain()
    assert run.st.sched.num_swapped_in_blocks == run.st.sched.num_swapped_out_blocks > 0


def test_a_headroom_victim_stops_counting_its_own_next_block() -> None:
    """Two 2-token prompts decoding in a 2-block pool: at 4 stored tokens each opens a
    block and none is free (2 short). Swapping the lower one out frees its block and
    takes away its own need, so that one victim is enough: counting its own need as
    still there swapped both out, and the step had runnable work but scheduled none."""
    run = MlfqRun(_config(num_blocks=2, max_num_seqs=4))
    run.add("a", 2, 6, base=0)
    run.add("b", 2, 6, base=100)
    plan = run.until_preempted()
    assert plan.preempted == ("b",) and plan.swapped_out == ("b",)
    assert "a" in plan.request_ids
    assert run.policy.num_headroom_swaps == 1
    run.drain()


def test_without_proactive_swap_the_shortage_preempts_through_the_spine() -> None:
    run = _headroom(settings=dict(proactive_swap=False))
    plan = run.until_preempted()
    assert plan.preempted == ("b",) and plan.swapped_out == ()  # recompute, the mode
    assert run.displaced == [] and run.policy.num_headroom_swaps == 0
    run.drain()
    assert run.st.sched.num_swapped_out_blocks == 0


def test_a_displaced_request_recomputes_when_the_host_cannot_hold_it() -> None:
    run = _long_then_short(num_host_blocks=1)  # long2 holds 3 blocks by then
    plan = run.until_preempted()
    assert plan.preempted == ("long2",) and plan.swapped_out == ()
    long2 = run.st.sched.requests["long2"]
    assert long2.status is S.PREEMPTED and long2.num_computed_tokens == 0
    run.drain()
    assert run.st.sched.num_swapped_out_blocks == 0


def test_without_proactive_swap_a_displaced_request_recomputes_despite_host_room() -> None:
    run = _long_then_short(settings=dict(proactive_swap=False))
    plan = run.until_preempted()
    assert plan.preempted == ("long2",) and plan.swapped_out == ()
    assert run.status("long2") is S.PREEMPTED
    assert run.st.sched.host.num_free_blocks == run.st.sched.host.num_blocks
    run.drain()
    assert run.st.sched.num_swapped_out_blocks == 0


# ------------------------------------------------------------------ the settings
BAD_SETTINGS: list[tuple[str, object]] = [
    ("num_queues", 0),
    ("num_queues", 17),
    ("num_queues", -1),
    ("num_queues", 2.0),
    ("num_queues", True),
    ("num_queues", "3"),
    ("base_quantum_ms", 0),
    ("base_quantum_ms", -1.0),
    ("base_quantum_ms", float("nan")),
    ("base_quantum_ms", float("inf")),
    ("base_quantum_ms", 2e6),
    ("base_quantum_ms", True),
    ("base_quantum_ms", "8"),
    ("quantum_growth", 0.5),
    ("quantum_growth", 0),
    ("quantum_growth", 17),
    ("quantum_growth", float("nan")),
    ("quantum_growth", float("inf")),
    ("quantum_growth", None),
    ("starvation_steps", 0),
    ("starvation_steps", -5),
    ("starvation_steps", 1.5),
    ("starvation_steps", False),
    ("starvation_steps", "256"),
    ("skip_join", 1),
    ("skip_join", "yes"),
    ("skip_join", None),
    ("proactive_swap", 0),
    ("proactive_swap", "no"),
    ("cost", "2+0.5P+D"),
    ("cost", None),
]


@pytest.mark.parametrize(("name", "value"), BAD_SETTINGS, ids=lambda x: repr(x))
def test_a_bad_knob_is_a_typed_error_naming_it(name: str, value: object) -> None:
    with pytest.raises(InvalidArgument, match=f"mlfq {name} must be"):
        MlfqSettings(**{name: value})  # type: ignore[arg-type]  # deliberately bad


def test_the_settings_must_be_mlfq_settings() -> None:
    with pytest.raises(InvalidArgument, match="mlfq must be MlfqSettings"):
        SchedulerConfig(policy=PolicyName.MLFQ, mlfq={"num_queues": 2})  # type: ignore[arg-type]


def test_the_edges_of_each_range_are_accepted_and_give_the_quanta() -> None:
    low = MlfqSettings(num_queues=1, base_quantum_ms=1e-9, quantum_growth=1, starvation_steps=1)
    assert low.quantum_ms(0) == float("inf")  # one level: the last, unbounded
    assert low.protection_ms(0) == 1e-9  # ... yet its protection is finite
    high = MlfqSettings(num_queues=16, base_quantum_ms=1e6, quantum_growth=16)
    assert high.quantum_ms(14) == 1e6 * 16**14 and high.quantum_ms(15) == float("inf")
    assert high.protection_ms(15) == high.quantum_ms(14) == high.protection_ms(14)
    default = MlfqSettings()
    assert [default.quantum_ms(i) for i in range(4)] == [8.0, 16.0, 32.0, float("inf")]
    assert [default.protection_ms(i) for i in range(4)] == [8.0, 16.0, 32.0, 32.0]


# ------------------------------------------------------------------ the spine alone
def test_the_loop_alone_refuses_the_mlfq_policy() -> None:
    with pytest.raises(InvalidArgument, match="mlfq"):
        SchedulerLoop(_config())


# ------------------------------------------------------------------ edges
def test_a_request_is_demoted_in_the_step_its_service_reaches_the_quantum_exactly() -> None:
    # Quantum 6 ms: the prefill (3 ms) and one decode (3 ms) reach it exactly.
    run = MlfqRun(_config(settings=dict(base_quantum_ms=6.0)))
    run.add("a", 2, 6, base=0)
    run.step()
    assert run.level("a") == 0 and run.policy.books["a"].served_ms == 3.0
    run.step()
    assert run.level("a") == 1 and run.policy.books["a"].served_ms == 0.0
    run.drain()


def test_promotion_counts_the_wait_from_the_step_the_request_was_queued() -> None:
    bound = 4
    run = MlfqRun(_config(settings=dict(num_queues=2, starvation_steps=bound), max_num_seqs=1))
    run.add("a", 2, 30, base=0)
    for _ in range(3):
        run.step()
    run.add("b", 12, 4, base=100)  # level 1, queued at step 3
    queued = run.st.sched.requests["b"].queued_step
    assert queued == 3
    for _ in range(bound - 1):
        run.step()
        assert run.level("b") == 1
    run.step()
    assert run.level("b") == 0 and run.policy.books["b"].num_promotions == 1
    run.drain()


def test_each_displacement_is_reported_with_its_choice_and_inputs() -> None:
    run = _long_then_short()
    plan = run.until_preempted()
    (choice,) = run.policy.last_choices
    assert (choice.request_id, choice.reason, choice.for_request) == ("long2", "seat", "short")
    assert choice.step_index == plan.step_index and choice.to_host
    assert (choice.kv_tokens, choice.host_free_blocks, choice.level) == (10, 32, 2)
    run.drain()


def test_a_waiting_request_short_of_blocks_displaces_for_blocks() -> None:
    # Seats to spare, blocks not: long (16 tokens: 10 ms, the last level) holds 5 of the
    # 6 blocks once its protection is spent; tiny (5 tokens: 4.5 ms, level 1) needs 2.
    run = MlfqRun(_config(max_num_seqs=3, num_blocks=6))
    run.add("long", 16, 12, base=0)
    for _ in range(4):
        run.step()
    run.add("tiny", 5, 2, base=100)
    plan = run.until_preempted()
    assert plan.preempted == ("long",) and "tiny" in plan.request_ids
    (_, record) = run.displaced[-1]
    assert (record.request_id, record.reason, record.for_request) == ("long", "blocks", "tiny")
    run.drain()


def test_protection_ends_when_the_decoded_service_reaches_the_quantum_exactly() -> None:
    # Level 1's quantum is 6 ms here: two decodes (3 ms each) reach it exactly, and the
    # request is displaced at the next boundary, not one decode later.
    run = MlfqRun(_config(settings=dict(base_quantum_ms=3.0), max_num_seqs=1))
    run.add("long", 8, 24, base=0)  # 6 ms: level 1 (quantum 6), protected for 6 ms
    run.step()
    assert run.policy.books["long"].joined_level == 1
    run.add("short", 1, 3, base=100)  # 2.5 ms: level 0
    run.until_preempted()
    (_, record) = run.displaced[-1]
    assert (record.protected_ms, record.resumed_ms) == (6.0, 6.0)
    run.drain()


def test_the_order_of_a_plain_collection_is_the_queues() -> None:
    # Levels 2, 1 and 0 arrived in that order: any collection sorts by level, then
    # arrival, which is the order the queue gives admission (one seat: short first).
    run = MlfqRun(_config(max_num_seqs=1))
    run.add("long", 16, 2, base=0)
    run.add("mid", 12, 2, base=100)
    run.add("short", 3, 2, base=200)
    waiting = list(reversed(run.st.sched.waiting))
    assert [r.request_id for r in run.policy.waiting_order(waiting, 0)] == [
        "short",
        "mid",
        "long",
    ]
    assert run.step().request_ids == ("short",)
    run.drain()


def test_a_request_still_waiting_past_the_queue_timeout_times_out() -> None:
    # One seat: b (16 tokens, the last level) waits behind a (it never ranks above a,
    # which sinks to b's level at most) past the timeout: the level-split queue keeps
    # the arrivals the timeout reads.
    run = MlfqRun(_config(max_num_seqs=1, queue_timeout_ms=20.0))
    run.add("a", 2, 40, base=0)
    run.add("b", 16, 2, base=100)
    run.drain()
    assert run.st.sched.num_timeouts == 1
