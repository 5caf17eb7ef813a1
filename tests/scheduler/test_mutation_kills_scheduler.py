"""Checks that kill mutants of ``ref/core/scheduler.py`` which survived ``make mutation``.

See docs/MUTATION.md. Each test drives the scheduler through its public surface
(``add_request``/``schedule``/``commit``/``pause``/``resume``, the plan's fields, the
pool's queries) and states one behaviour exactly; the spec checkers run where a whole
step is taken. All are small and deterministic: mutmut runs them once per mutant.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any

import pytest

from ref.core.config import Admission, PolicyName, SchedulerConfig
from ref.core.cost import StepCost
from ref.core.plan import StepPlan
from ref.core.policy import DecodeFirst, TenantFair
from ref.core.request import FinishReason, Request, StopParams
from ref.core.scheduler import BadExecutorOutput, Scheduler, StepEvents, StepInProgress
from ref.core.swap import KVRetention
from ref.errors import (
    ExceedsCapacity,
    InvalidArgument,
    RefserveError,
    UnknownRequest,
)
from spec import check_pool
from spec.hashing import Namespace
from spec.snapshot import RequestStatus as S


def _req(
    rid: str,
    n: int,
    max_tokens: int = 8,
    *,
    base: int = 0,
    arrival_ms: float = 0.0,
    priority: int = 0,
    tenant: str = "default",
) -> Request:
    return Request(
        rid,
        [base + i + 1 for i in range(n)],
        StopParams(max_tokens, ignore_eos=True),
        arrival_ms=arrival_ms,
        priority=priority,
        tenant=tenant,
    )


def _sampled(plan: StepPlan, token: int = 7) -> dict[str, int]:
    return {rid: token for rid, s in zip(plan.request_ids, plan.samples, strict=True) if s}


def _step(sched: Scheduler, now: float = 0.0, token: int = 7) -> tuple[StepPlan, StepEvents]:
    plan = sched.schedule(now)
    events = sched.commit(plan, _sampled(plan, token), now)
    assert check_pool(sched.pool.snapshot()) == []
    return plan, events


def _entry(plan: StepPlan, rid: str) -> tuple[int, int, bool, bool, int]:
    """(start, n, samples, is_prefill, cached) of ``rid`` in the plan."""
    i = plan.request_ids.index(rid)
    return (
        plan.starts[i],
        plan.num_new_tokens[i],
        plan.samples[i],
        plan.is_prefill[i],
        plan.num_new_cached_tokens[i],
    )


def _decoding(cfg: SchedulerConfig, *reqs: Request) -> Scheduler:
    """A scheduler whose requests have all sampled their first token."""
    sched = Scheduler(cfg)
    for r in reqs:
        sched.add_request(r)
    for _ in range(20):
        if all(r.status is S.DECODING for r in reqs):
            return sched
        _step(sched)
    raise AssertionError("requests did not reach decode")


CFG = SchedulerConfig(
    max_num_batched_tokens=32, max_num_seqs=4, block_size=4, num_blocks=16, max_model_len=32
)


# ------------------------------------------------------------------ pause / resume
def test_pause_keeping_kv_holds_the_blocks_and_leaves_the_batch() -> None:
    sched = _decoding(CFG, _req("a", 6))
    a = sched.requests["a"]
    table, kv = sched.pool.block_table("a"), a.num_computed_tokens
    sched.pause("a")  # retention defaults to the device for a short wait
    assert a.status is S.WAITING_TOOL
    assert sched.paused == {"a": a} and sched.running == [] and sched.waiting == []
    assert sched.pool.block_table("a") == table and a.num_computed_tokens == kv
    plan, _ = _step(sched)
    assert plan.request_ids == ()  # a paused request is not scheduled


def test_pause_releasing_kv_frees_every_block() -> None:
    sched = _decoding(CFG, _req("a", 6))
    a = sched.requests["a"]
    sched.pause("a", KVRetention.DROP)
    assert not sched.pool.has_request("a")
    assert a.num_computed_tokens == 0
    assert sched.pool.num_free_blocks == CFG.num_blocks
    assert sched.paused == {"a": a} and a.status is S.WAITING_TOOL


def test_pause_refusals_name_the_operation() -> None:
    sched = Scheduler(CFG)
    sched.add_request(_req("a", 6))
    with pytest.raises(UnknownRequest) as unknown:
        sched.pause("x")
    assert str(unknown.value) == "pause: unknown request id 'x'"
    with pytest.raises(InvalidArgument) as waiting:
        sched.pause("a")
    assert str(waiting.value) == "pause: request 'a' must be decoding (it is waiting)"
    sched.schedule()  # now_ms defaults to 0
    with pytest.raises(StepInProgress) as again:
        sched.schedule(1.0)
    assert str(again.value) == (
        "schedule: a step is in progress (schedule without commit/rollback)"
    )
    with pytest.raises(StepInProgress) as mid:
        sched.pause("a")
    assert str(mid.value) == "pause: a step is in progress (schedule without commit/rollback)"
    with pytest.raises(StepInProgress, match=r"^resume: a step is in progress"):
        sched.resume("a", [1], StopParams(1))
    sched.rollback()
    plan = sched.schedule()
    sched.commit(plan, _sampled(plan), 5.0)
    assert sched.requests["a"].admitted_ms == 0.0  # the step started at the default 0


def test_resume_in_place_continues_as_an_incremental_prefill() -> None:
    sched = _decoding(CFG, _req("a", 6))
    a = sched.requests["a"]
    _step(sched, token=8)  # two outputs: [.., 7, 8]; KV holds all but the last
    kv = a.num_computed_tokens
    history = list(a.token_ids)
    assert kv == len(history) - 1
    sched.pause("a")
    stop = StopParams(2, ignore_eos=True)
    sched.resume("a", [0, 50, 51], stop)
    assert a.status is S.PREFILLING and sched.running == [a] and sched.paused == {}
    assert a.prompt_token_ids == [*history, 0, 50, 51]
    assert a.token_ids == a.prompt_token_ids and a.token_ids is not a.prompt_token_ids
    assert a.num_prompt_tokens == len(history) + 3 and a.num_output_tokens == 0
    assert a.stop is stop
    assert a.num_computed_tokens == kv  # the KV is kept
    plan, events = _step(sched, token=9)
    # Only the last output (no KV yet) and the three tool tokens are computed.
    assert _entry(plan, "a") == (kv, 4, True, True, 0)
    assert plan.admitted == ()
    assert events.new_tokens == {"a": 9}
    assert a.prompt_token_ids == [*history, 0, 50, 51]  # sampling did not touch the prompt
    assert a.output_token_ids == [9] and a.status is S.DECODING
    _, events = _step(sched, token=10)
    assert events.finished == ("a",) and a.finish_reason is FinishReason.LENGTH


def test_resume_without_a_running_slot_gives_the_blocks_back_and_waits_in_order() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=32, max_num_seqs=1, block_size=4, num_blocks=16, max_model_len=32
    )
    sched = _decoding(cfg, _req("a", 6))
    a = sched.requests["a"]
    sched.pause("a")  # KV retained
    sched.add_request(_req("b", 5, base=100))
    _step(sched)  # b takes the only running slot
    sched.add_request(_req("c", 5, base=200))
    assert [r.request_id for r in sched.running] == ["b"]
    sched.resume("a", [60], StopParams(1))
    assert a.status is S.WAITING
    assert not sched.pool.has_request("a") and a.num_computed_tokens == 0
    assert [r.request_id for r in sched.waiting] == ["a", "c"]  # a keeps its arrival place
    assert a.queued_step == sched.step_index


def test_resume_after_releasing_kv_waits_and_recomputes_from_the_cache() -> None:
    sched = _decoding(CFG, _req("a", 9))  # two full blocks get cached
    a = sched.requests["a"]
    sched.pause("a", KVRetention.DROP)
    sched.resume("a", [60, 61], StopParams(1))
    assert a.status is S.WAITING and sched.waiting == [a] and sched.running == []
    plan, _ = _step(sched)
    assert plan.admitted == ("a",)
    start, n, samples, prefill, cached = _entry(plan, "a")
    assert (start, cached) == (8, 8) and start + n == a.num_prompt_tokens == 12
    assert samples and prefill


def test_resume_refusals_leave_the_request_paused() -> None:
    sched = _decoding(CFG, _req("a", 6))
    a = sched.requests["a"]
    with pytest.raises(UnknownRequest) as not_paused:
        sched.resume("a", [1], StopParams(1))
    assert str(not_paused.value) == "resume (not waiting for a tool): unknown request id 'a'"
    sched.pause("a")
    before = sched.snapshot()
    for bad in ([], [-1], [1, True], [2.0]):
        with pytest.raises(InvalidArgument) as info:
            sched.resume("a", bad, StopParams(1))  # type: ignore[arg-type]
        assert str(info.value) == "resume: request 'a' needs tool token ids >= 0"
    # max_model_len 32: the turn must leave room for one output token.
    room = CFG.max_len - 1 - a.num_tokens
    with pytest.raises(InvalidArgument) as long:
        sched.resume("a", [5] * (room + 1), StopParams(1))
    assert str(long.value) == (
        f"resume: request 'a' would hold {a.num_tokens + room + 1} tokens; "
        f"the limit is {CFG.max_len - 1} before an output token"
    )
    assert sched.snapshot() == before and sched.paused == {"a": a}
    sched.resume("a", [5] * room, StopParams(1))  # exactly at the limit is fine
    assert a.num_tokens == CFG.max_len - 1 and a.status is S.PREFILLING


# ------------------------------------------------------------------ what the policy is told
class RecordingPolicy(DecodeFirst):
    """Decode-first, recording what each commit tells the policy."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[tuple[dict[str, int], set[str]]] = []

    def on_commit(self, prefill_tokens: Mapping[str, int], backlogged: Set[str]) -> None:
        self.told.append((dict(prefill_tokens), set(backlogged)))


def test_the_policy_is_told_prefill_tokens_per_tenant_and_the_backlog() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=8, max_num_seqs=4, block_size=4, num_blocks=32, max_model_len=32
    )
    policy = RecordingPolicy()
    sched = Scheduler(cfg, policy)
    sched.add_request(_req("c", 3, 6, tenant="C"))
    _step(sched)
    assert policy.told[-1] == ({"C": 3}, set())
    sched.add_request(_req("a", 6, 1, base=100, tenant="A"))  # finishes in its first step
    sched.add_request(_req("b", 10, 2, base=200, tenant="B"))
    plan, events = _step(sched)
    assert plan.num_new_tokens == (1, 6, 1) and events.finished == ("a",)
    # c's decode is not a prefill grant; a, retired in this very step, still counts.
    assert policy.told[-1] == ({"A": 6, "B": 1}, {"B"})
    _step(sched)
    assert policy.told[-1] == ({"B": 7}, {"B"})
    _step(sched)
    assert policy.told[-1] == ({"B": 2}, set())
    _step(sched)
    assert policy.told[-1] == ({}, set())  # decodes only
    assert len(policy.told) == sched.step_index == 5


def test_a_waiting_tenant_is_backlogged_before_it_gets_any_tokens() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=8, max_num_seqs=1, block_size=4, num_blocks=32, max_model_len=32
    )
    policy = RecordingPolicy()
    sched = Scheduler(cfg, policy)
    sched.add_request(_req("a", 3, 4, tenant="A"))
    sched.add_request(_req("b", 3, 4, base=100, tenant="B"))  # no running slot for it
    _step(sched)
    assert policy.told[-1] == ({"A": 3}, {"B"})


def test_tenant_fair_credit_follows_the_granted_prefill_tokens() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=8,
        max_num_seqs=4,
        block_size=4,
        num_blocks=32,
        max_model_len=32,
        policy=PolicyName.TENANT_FAIR,
        tenant_quantum_tokens=4,
    )
    sched = Scheduler(cfg)
    assert isinstance(sched.policy, TenantFair)
    sched.add_request(_req("a", 12, 2, tenant="A"))
    _step(sched)  # A gets 8 prefill tokens and still has 4 to go
    assert sched.policy.credit == {"A": 4 - 8}
    assert sched.policy.served == {"A": 8}


# ------------------------------------------------------------------ SLO-aware prefill cap
def _slo_chunk(
    model: StepCost, now: float, *, reserve: int = 0, prompt: int = 60, fast: bool = True
) -> int:
    """Prefill tokens admitted next to one decode whose last token came at t = 0."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=4,
        block_size=4,
        num_blocks=64,
        max_model_len=128,
        tbt_slo_ms=20.0,
        step_cost=model,
        prefill_reserve_tokens=reserve,
        prefill_reserve_after_steps=0,
    )
    sched = Scheduler(cfg, fast_decode=fast)
    sched.add_request(_req("d", 3, 50))
    _step(sched, 0.0)  # d: 3 tokens computed, first token at t = 0
    sched.add_request(_req("p", prompt, 2, base=100))
    plan = sched.schedule(now)
    assert _entry(plan, "d")[:2] == (3, 1)
    return _entry(plan, "p")[1] if "p" in plan.request_ids else 0


@pytest.mark.parametrize("fast", [True, False])
def test_prefill_cap_is_the_slack_left_by_the_decodes(fast: bool) -> None:
    # P <= (last + slo - now - a - c*D - e*K) / b with D = 1 decode reading K = 3 + 1.
    assert _slo_chunk(StepCost(2.0, 0.5, 1.0), 4.0, fast=fast) == 26  # (20 - 4 - 2 - 1) / 0.5
    assert _slo_chunk(StepCost(2.0, 0.5, 1.0, 0.5), 4.0, fast=fast) == 22  # 0.5 * 4 ms reads
    assert _slo_chunk(StepCost(2.0, 0.5, 1.0, 0.5), 4.25, fast=fast) == 21  # 21.5 rounds down
    assert _slo_chunk(StepCost(2.0, 0.5, 1.0), 0.0, prompt=20) == 20  # the whole prompt fits


def test_prefill_cap_is_zero_without_slack_unless_reserved() -> None:
    assert _slo_chunk(StepCost(2.0, 0.5, 1.0), 17.0) == 0  # spare exactly 0
    assert _slo_chunk(StepCost(2.0, 0.5, 1.0), 16.0) == 2  # spare 1 ms
    assert _slo_chunk(StepCost(2.0, 0.5, 1.0), 16.5) == 1  # spare 0.5 ms
    assert _slo_chunk(StepCost(2.0, 0.5, 1.0), 30.0) == 0  # the deadline has passed
    assert _slo_chunk(StepCost(2.0, 0.5, 1.0), 30.0, reserve=5) == 5
    assert _slo_chunk(StepCost(2.0, 0.5, 1.0), 4.0, reserve=5) == 26


def test_prefill_cap_follows_the_tightest_decode() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=4,
        block_size=4,
        num_blocks=64,
        max_model_len=128,
        tbt_slo_ms=20.0,
        step_cost=StepCost(2.0, 0.5, 1.0),
    )
    sched = Scheduler(cfg)
    sched.add_request(_req("d1", 3, 50))
    _step(sched, 0.0)  # d1's first token at t = 0
    sched.add_request(_req("d2", 3, 50, base=50))
    _step(sched, 2.0)  # d1 decodes and d2 samples its first token at t = 2
    assert [r.token_times_ms for r in sched.running] == [[0.0, 2.0], [2.0]]
    sched.add_request(_req("p", 60, 2, base=100))
    plan = sched.schedule(4.0)
    # Tightest deadline: 2 + 20; two decodes: (22 - 4 - 2 - 2) / 0.5 = 28.
    assert _entry(plan, "p")[1] == 28
    sched.rollback()


def test_without_an_slo_the_prefill_takes_the_whole_budget() -> None:
    sched = Scheduler(CFG)
    sched.add_request(_req("d", 3, 50))
    _step(sched, 0.0)
    sched.add_request(_req("p", 31, 1, base=100))
    plan = sched.schedule(100.0)
    assert _entry(plan, "p")[1] == 31  # all the budget (32) the decode leaves
    sched.rollback()


# ------------------------------------------------------------------ queue timeout
def test_queue_timeout_is_strictly_after_the_limit_and_skips_admission() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_blocks=32, queue_timeout_ms=10
    )
    sched = Scheduler(cfg)
    sched.add_request(_req("w", 5, 2, arrival_ms=1.0))
    sched.add_request(_req("v", 5, 2, base=50, arrival_ms=2.0))
    plan = sched.schedule(11.0)  # w waited exactly 10 ms: not yet timed out
    assert plan.finished == () and plan.admitted == ("w", "v")
    sched.rollback()
    plan = sched.schedule(11.5)  # w is past the limit, v is not
    assert [(f.request_id, f.reason) for f in plan.finished] == [("w", FinishReason.TIMEOUT)]
    assert plan.admitted == ("v",) and plan.request_ids == ("v",)  # w is not admitted
    events = sched.commit(plan, _sampled(plan), 12.0)
    assert events.finished == ("w",)
    w = sched.retired[-1]
    assert w.request_id == "w" and w.status is S.FINISHED
    assert w.finish_reason is FinishReason.TIMEOUT and w.finished_ms == 12.0
    assert sched.num_timeouts == 1 and sched.waiting == [] and "w" not in sched.requests
    sched.add_request(_req("u", 5, 2, base=90, arrival_ms=2.0))
    plan, events = _step(sched, 20.0)
    assert events.finished == ("v", "u")  # v's second token, then u's timeout
    assert sched.num_timeouts == 2


def test_queue_timeout_spares_a_request_that_was_admitted_before() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_blocks=32, queue_timeout_ms=10
    )
    sched = _decoding(cfg, _req("a", 5, 8))
    a = sched.requests["a"]
    sched.pause("a", KVRetention.DROP)
    sched.resume("a", [9], StopParams(2))  # waits again, with admitted_ms set
    assert a.status is S.WAITING and a.admitted_ms == 0.0
    plan, _ = _step(sched, 50.0)
    assert plan.finished == () and plan.admitted == ("a",)
    assert sched.num_timeouts == 0
    assert a.admitted_ms == 0.0  # the first admission time is kept


# ------------------------------------------------------------------ add_request
def _refusal(sched: Scheduler, r: Request) -> str:
    with pytest.raises(RefserveError) as info:
        sched.add_request(r)
    return f"{type(info.value).__name__}: {info.value}"


def test_add_request_refusals_are_exact_and_count_only_capacity_and_queue() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16,
        max_num_seqs=2,
        block_size=4,
        num_blocks=4,
        max_model_len=20,
        max_waiting=2,
    )
    sched = Scheduler(cfg)
    used = Request("x", [1, 2])
    used.token_ids.append(3)  # a sampled token: not fresh
    assert _refusal(sched, used) == (
        "InvalidArgument: add_request: request 'x' is not fresh (status waiting)"
    )
    assert _refusal(sched, Request("", [1])) == (
        "InvalidArgument: add_request: request id must be a non-empty str, got ''"
    )
    assert _refusal(sched, Request("x", [])) == (
        "InvalidArgument: add_request: request 'x' has an empty prompt"
    )
    assert _refusal(sched, Request("x", [0, -2])) == (
        "InvalidArgument: add_request: request 'x' has a bad token id -2"
    )
    assert _refusal(sched, Request("x", [1] * 20)) == (
        "InvalidArgument: add_request: request 'x' prompt has 20 tokens; max_model_len is 20, "
        "leaving no room for an output token"
    )
    assert sched.num_rejected == 0  # malformed input is not an admission-control rejection
    assert _refusal(sched, Request("x", [1] * 17)) == (
        "ExceedsCapacity: request 'x' needs 5 KV blocks but the pool has only 4"
    )
    assert sched.num_rejected == 1
    sched.add_request(Request("a", [1] * 16))  # 4 blocks of 4: exactly the pool
    sched.add_request(Request("b", [0]))
    assert _refusal(sched, Request("c", [1])) == (
        "QueueFull: add_request: request 'c' rejected: 2 requests already wait"
    )
    assert sched.num_rejected == 2
    assert _refusal(sched, Request("a", [1])) == (
        "DuplicateRequest: add_request: request id 'a' is already in use"
    )
    assert _refusal(sched, Request("y", [1] * 19)).startswith("ExceedsCapacity: request 'y'")
    assert sched.num_rejected == 3
    sched.schedule(0.0)
    assert _refusal(sched, Request("z", [1])) == (
        "StepInProgress: add_request: a step is in progress (schedule without commit/rollback)"
    )
    sched.rollback()
    assert [r.request_id for r in sched.waiting] == ["a", "b"]
    assert [r.seq for r in sched.waiting] == [0, 1]


def test_without_chunked_prefill_the_budget_caps_the_prompt_by_name() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=8, block_size=4, num_blocks=8, enable_chunked_prefill=False
    )
    sched = Scheduler(cfg)
    assert _refusal(sched, Request("x", [1] * 8)) == (
        "InvalidArgument: add_request: request 'x' prompt has 8 tokens; without chunked "
        "prefill the token budget 8 caps the length, leaving no room for an output token"
    )
    sched.add_request(Request("y", [1] * 7))
    assert sched.waiting[0].request_id == "y"


def test_add_request_stamps_arrival_order_and_queue_step() -> None:
    sched = _decoding(CFG, _req("a", 3))
    assert sched.step_index == 1
    b, c = _req("b", 3, base=10), _req("c", 3, base=20)
    sched.add_request(b)
    sched.add_request(c)
    assert (b.seq, c.seq) == (1, 2) and b.queued_step == c.queued_step == 1
    assert sched.requests["b"] is b and sched.waiting == [b, c]


# ------------------------------------------------------------------ commit
def test_commit_stamps_times_from_the_right_clock() -> None:
    sched = Scheduler(CFG)
    sched.add_request(_req("a", 5, 2))
    plan = sched.schedule(5.0)
    assert plan.admitted == ("a",) and plan.step_index == 0
    events = sched.commit(plan, {"a": 11}, 9.0)
    a = sched.requests["a"]
    assert a.admitted_ms == 5.0  # the step's start
    assert a.token_times_ms == [9.0]  # the step's end
    assert events == StepEvents({"a": 11}, (), ())
    assert sched.step_index == 1 and sched.running == [a]
    _, events = _step(sched, 20.0, token=12)
    assert events.finished == ("a",) and events.new_tokens == {"a": 12}
    assert a.admitted_ms == 5.0 and a.token_times_ms == [9.0, 20.0] and a.finished_ms == 20.0
    assert a.output_token_ids == [11, 12] and a.finish_reason is FinishReason.LENGTH
    assert sched.running == [] and "a" not in sched.requests and sched.retired == [a]


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
    sched = Scheduler(CFG)
    sched.add_request(Request("a", [1, 2, 3], stop))
    _, events = _step(sched, token=7)
    a = sched.retired[-1] if finishes else sched.requests["a"]
    assert events.finished == (("a",) if finishes else ())
    assert a.finish_reason is (FinishReason.STOP if finishes else None)
    assert a.status is (S.FINISHED if finishes else S.DECODING)
    assert sched.pool.has_request("a") is not finishes


def test_commit_stops_at_max_model_len_and_max_tokens_exactly() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_blocks=16, max_model_len=8
    )
    sched = Scheduler(cfg)
    sched.add_request(_req("long", 5, 50))  # max_model_len stops it at 8 tokens
    sched.add_request(_req("short", 2, 3, base=10))  # max_tokens stops it at 3 outputs
    reqs = dict(sched.requests)
    done: dict[str, int] = {}
    for _ in range(5):
        _, events = _step(sched)
        for rid in events.finished:
            done[rid] = sched.step_index
    assert done == {"long": 3, "short": 3}
    assert [(r.num_tokens, r.finish_reason) for r in reqs.values()] == [
        (8, FinishReason.LENGTH),
        (5, FinishReason.LENGTH),
    ]


def test_a_prefill_chunk_that_does_not_sample_keeps_prefilling() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=4, max_num_seqs=4, block_size=4, num_blocks=16, max_model_len=32
    )
    sched = Scheduler(cfg)
    sched.add_request(_req("a", 10, 2))
    plan, events = _step(sched)
    a = sched.requests["a"]
    assert _entry(plan, "a") == (0, 4, False, True, 0)
    assert a.status is S.PREFILLING and a.num_computed_tokens == 4 and a.num_tokens == 10
    assert events.new_tokens == {} and a.token_times_ms == []
    plan, _ = _step(sched)
    assert _entry(plan, "a") == (4, 4, False, True, 0) and a.status is S.PREFILLING
    plan, events = _step(sched)
    assert _entry(plan, "a") == (8, 2, True, True, 0) and a.status is S.DECODING
    assert a.num_computed_tokens == 10 and events.new_tokens == {"a": 7}


def test_commit_records_the_cached_prefix_of_an_admission() -> None:
    sched = Scheduler(CFG)
    sched.add_request(_req("a", 9, 1))
    _step(sched)  # a finishes; its two full blocks stay cached
    sched.add_request(_req("b", 10, 2))  # same first 9 tokens
    plan, _ = _step(sched)
    b = sched.requests["b"]
    assert _entry(plan, "b") == (8, 2, True, True, 8)
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 10
    _step(sched)
    assert b.num_cached_tokens == 8  # a decode does not reset it


def test_commit_refuses_a_plan_that_is_not_pending() -> None:
    sched = Scheduler(CFG)
    sched.add_request(_req("a", 3))
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


# ------------------------------------------------------------------ prefill reserve
@pytest.mark.parametrize("fast_decode", [True, False])
def test_the_prefill_reserve_starts_after_the_configured_wait(fast_decode: bool) -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=4,
        max_num_seqs=8,
        block_size=4,
        num_blocks=32,
        max_model_len=64,
        prefill_reserve_tokens=2,
        prefill_reserve_after_steps=2,
    )
    sched = Scheduler(cfg, fast_decode=fast_decode)  # bulk path or per-request loop
    for i in range(4):
        sched.add_request(_req(f"d{i}", 1, 50, base=10 * i))
    _step(sched)  # four one-token prompts fill the budget and start decoding
    sched.add_request(_req("p", 9, 2, base=100))  # queued at step 1
    grants: list[tuple[str, ...]] = []
    for _ in range(7):
        plan, _ = _step(sched)
        grants.append(
            tuple(f"{r}:{n}" for r, n in zip(plan.request_ids, plan.num_new_tokens, strict=True))
        )
    decodes4 = ("d0:1", "d1:1", "d2:1", "d3:1")
    # p starves for two steps, then the reserve gives it 2 tokens; each grant restarts
    # the count.
    assert grants == [
        decodes4,
        decodes4,
        ("d0:1", "d1:1", "p:2"),
        decodes4,
        ("d0:1", "d1:1", "p:2"),
        decodes4,
        ("d0:1", "d1:1", "p:2"),
    ]


@pytest.mark.parametrize("fast_decode", [True, False])
def test_no_reserve_is_held_back_when_no_prompt_waits(fast_decode: bool) -> None:
    """With nothing left to prefill, the reserve must not shrink the decodes' budget."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=4,
        max_num_seqs=8,
        block_size=4,
        num_blocks=32,
        max_model_len=64,
        prefill_reserve_tokens=2,
        prefill_reserve_after_steps=0,
    )
    sched = Scheduler(cfg, fast_decode=fast_decode)
    for i in range(4):
        sched.add_request(_req(f"d{i}", 1, 50, base=10 * i))
    _step(sched)  # four one-token prompts: no prefill work is left after this step
    for _ in range(3):
        plan, _ = _step(sched)
        assert plan.request_ids == ("d0", "d1", "d2", "d3")


# ------------------------------------------------------------------ abort / finish / fork
def test_abort_and_finish_stamp_the_given_time_defaulting_to_zero() -> None:
    sched = _decoding(CFG, _req("a", 3), _req("b", 3, base=10), _req("c", 3, base=20))
    a, b, c = (sched.requests[x] for x in "abc")
    sched.abort("a")
    sched.finish("b", FinishReason.STOP)
    sched.abort("c", 3.5)
    assert (a.finished_ms, b.finished_ms, c.finished_ms) == (0.0, 0.0, 3.5)
    assert (a.status, b.status, c.status) == (S.ABORTED, S.FINISHED, S.ABORTED)
    assert (a.finish_reason, b.finish_reason) == (FinishReason.ABORT, FinishReason.STOP)
    assert sched.retired == [a, b, c] and sched.requests == {}
    assert sched.pool.num_free_blocks == CFG.num_blocks


def test_a_fork_keeps_the_parents_tenant_and_namespace() -> None:
    ns = Namespace(model="m", adapter="lora-1")
    parent = Request("p", [1, 2, 3], StopParams(4), tenant="T", namespace=ns)
    sched = _decoding(CFG, parent)
    child = sched.fork("p", "c", 9, StopParams(2))
    assert child.tenant == "T" and child.namespace == ns
    assert sched.pool.block_table("c") == sched.pool.block_table("p")


def test_a_fork_that_can_never_fit_finishes_at_the_last_step_start() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=1, block_size=1, num_blocks=5, max_model_len=16
    )
    sched = Scheduler(cfg)
    sched.add_request(_req("p", 5, 4))
    _step(sched, 10.0)  # the child would hold 5 + 1 tokens: 6 blocks of 1, the pool has 5
    child = sched.fork("p", "c", 9, StopParams(2))
    assert child.finish_reason is FinishReason.CAPACITY and child.finished_ms == 10.0


def test_a_resumed_turn_counts_for_the_prefill_reserve() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=4,
        max_num_seqs=8,
        block_size=4,
        num_blocks=32,
        max_model_len=64,
        prefill_reserve_tokens=2,
        prefill_reserve_after_steps=1,
    )
    sched = Scheduler(cfg)
    for i in range(4):
        sched.add_request(_req(f"d{i}", 1, 50, base=10 * i))
    _step(sched)
    sched.pause("d0")
    sched.resume("d0", [5, 6, 7], StopParams(1))  # 1 + 3 tokens to prefill, in place
    plan, _ = _step(sched)  # not starving yet: the three decodes come first
    assert plan.request_ids == ("d1", "d2", "d3", "d0")
    assert plan.num_new_tokens == (1, 1, 1, 1)
    plan, _ = _step(sched)  # waited a step since its last grant: the reserve applies
    assert plan.request_ids == ("d1", "d2", "d0") and plan.num_new_tokens == (1, 1, 2)


# ------------------------------------------------------------------ admission headroom
def _admits_beside_a_decode(
    admission: Admission,
    num_blocks: int,
    *,
    budget: int = 16,
    caching: bool = True,
    cached_prefix: bool = False,
    prompt: int = 10,
    watermark: int = 0,
) -> bool:
    """Whether ``x`` (``prompt`` tokens, max_tokens 6) is admitted next to a running
    one-block decode; with ``cached_prefix`` its first 8 tokens are cached and free."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        block_size=4,
        num_blocks=num_blocks,
        max_model_len=64,
        admission=admission,
        enable_prefix_caching=caching,
        watermark_blocks=watermark,
    )
    sched = Scheduler(cfg)
    sched.add_request(Request("r0", [500], StopParams(3, ignore_eos=True)))
    if cached_prefix:
        sched.add_request(_req("c", 8, 1))  # finishes at once; its 2 full blocks stay cached
    plan, _ = _step(sched)
    assert sched.requests["r0"].status is S.DECODING and sched.pool.num_used_blocks == 1
    sched.add_request(_req("x", prompt, 6))
    plan, _ = _step(sched)
    assert plan.request_ids[0] == "r0"
    if cached_prefix and plan.admitted:
        assert _entry(plan, "x")[4] == 8
    return plan.admitted == ("x",)


@pytest.mark.parametrize(
    ("admission", "kw", "blocks"),
    [
        # The whole sequence, 10 + 6 tokens: 4 blocks, counting the 2 cached free blocks
        # the hit takes back out of the free queue.
        (Admission.SEQUENCE, {"cached_prefix": True}, 4),
        (Admission.SEQUENCE, {"caching": False}, 4),
        # The whole prompt (12 tokens, 3 blocks) although only a 4-token chunk fits.
        (Admission.PROMPT, {"budget": 5, "prompt": 12}, 3),
        (Admission.FIRST_CHUNK, {"budget": 5, "prompt": 4}, 1),
        (Admission.FIRST_CHUNK, {"cached_prefix": True}, 3),
        # The watermark keeps 2 blocks back for the running decode's growth.
        (Admission.FIRST_CHUNK, {"budget": 5, "prompt": 4, "watermark": 2}, 3),
    ],
)
def test_admission_needs_exactly_its_headroom_in_free_blocks(
    admission: Admission, kw: dict[str, Any], blocks: int
) -> None:
    # The decode holds one block; the rest of the pool is free.
    assert _admits_beside_a_decode(admission, blocks + 1, **kw)
    assert not _admits_beside_a_decode(admission, blocks, **kw)


# ------------------------------------------------------------------ requeue order
def test_a_requeued_turn_waits_in_arrival_order() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16,
        max_num_seqs=1,
        block_size=4,
        num_blocks=32,
        max_model_len=64,
        prefill_reserve_tokens=1,
    )
    sched = _decoding(cfg, _req("a", 3))
    for i, rid in enumerate("bcd"):
        sched.add_request(_req(rid, 3, base=10 * (i + 1)))
    sched.pause("a", KVRetention.DROP)
    _step(sched)  # b takes the free running slot
    assert [r.request_id for r in sched.running] == ["b"]
    sched.resume("a", [1], StopParams(2))
    assert [r.request_id for r in sched.waiting] == ["a", "c", "d"]
    sched.pause("b", KVRetention.DROP)
    sched.resume("b", [1], StopParams(2))
    assert [r.request_id for r in sched.waiting] == ["a", "b", "c", "d"]
    assert [r.seq for r in sched.waiting] == [0, 1, 2, 3]
    plan, _ = _step(sched)
    assert plan.admitted == ("a",)


def test_a_requeued_parent_goes_ahead_of_its_waiting_fork() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=1, block_size=4, num_blocks=32, max_model_len=64
    )
    sched = _decoding(cfg, _req("p", 3))
    child = sched.fork("p", "c", 9, StopParams(2))
    assert sched.waiting == [child] and child.seq == sched.requests["p"].seq
    sched.pause("p", KVRetention.DROP)
    sched.resume("p", [1], StopParams(2))
    assert [r.request_id for r in sched.waiting] == ["p", "c"]


# ------------------------------------------------------------------ admission
def test_admission_shares_the_budget_in_order_down_to_the_last_token() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=8, max_num_seqs=8, block_size=4, num_blocks=32, max_model_len=64
    )
    sched = Scheduler(cfg)
    for i, rid in enumerate("abcd"):
        sched.add_request(_req(rid, 3, 4, base=10 * i))
    plan, _ = _step(sched)
    assert plan.admitted == ("a", "b", "c") and plan.num_new_tokens == (3, 3, 2)
    plan, _ = _step(sched)  # 2 decodes + c's last token: 5 left for d
    assert plan.request_ids == ("a", "b", "c", "d") and plan.num_new_tokens == (1, 1, 1, 3)
    sched2 = _decoding(cfg, *(_req(f"r{i}", 1, 9, base=10 * i) for i in range(7)))
    sched2.add_request(_req("x", 1, 2, base=99))
    plan, _ = _step(sched2)  # seven decodes leave exactly one token
    assert plan.admitted == ("x",) and _entry(plan, "x") == (0, 1, True, True, 0)


def _lone_admission(num_blocks: int) -> StepPlan:
    """``x`` hits 2 cached free blocks while a paused request holds 2 and nothing runs."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_blocks=num_blocks
    )
    sched = Scheduler(cfg)
    sched.add_request(_req("a", 5, 4, base=100))
    sched.add_request(_req("c", 8, 1))
    _step(sched)
    sched.pause("a")  # keeps its 2 blocks; c's 2 blocks are free and cached
    sched.add_request(_req("x", 10, 2))
    plan, _ = _step(sched)
    return plan


def test_a_lone_admission_counts_the_cached_blocks_its_hit_revives() -> None:
    # x needs its 2 cached blocks back plus 1 fresh block for tokens 8 and 9: with 4
    # blocks only reclaiming the paused request's KV makes room, with 5 it fits as is.
    plan = _lone_admission(4)
    assert plan.dropped == ("a",) and plan.admitted == ("x",)
    plan = _lone_admission(5)
    assert plan.dropped == () and plan.admitted == ("x",)
    assert _entry(plan, "x") == (8, 2, True, True, 8)


def test_without_prefix_caching_nothing_is_cached_or_reused() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16,
        max_num_seqs=4,
        block_size=4,
        num_blocks=16,
        enable_prefix_caching=False,
    )
    sched = Scheduler(cfg)
    sched.add_request(_req("a", 9, 1))
    _step(sched)
    assert sched.pool.snapshot().cache_entries == ()
    sched.add_request(_req("b", 9, 1))
    plan, _ = _step(sched)
    assert _entry(plan, "b") == (0, 9, True, True, 0)


def test_abort_before_the_first_step_retires_the_request() -> None:
    sched = Scheduler(CFG)
    a = _req("a", 3)
    sched.add_request(a)
    sched.abort("a", 1.5)
    assert sched.retired == [a] and sched.waiting == [] and sched.requests == {}
    assert a.status is S.ABORTED and a.finished_ms == 1.5


def test_running_prefills_and_admissions_share_one_slo_prefill_cap() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=4,
        block_size=4,
        num_blocks=64,
        max_model_len=128,
        tbt_slo_ms=20.0,
        step_cost=StepCost(2.0, 0.5, 1.0),
    )
    sched = Scheduler(cfg)
    sched.add_request(_req("d", 3, 50))
    _step(sched, 0.0)
    sched.add_request(_req("q", 40, 2, base=100))
    plan, _ = _step(sched, 4.0)  # cap (20 - 4 - 2 - 1) / 0.5 = 26
    assert plan.request_ids == ("d", "q") and plan.num_new_tokens == (1, 26)
    sched.add_request(_req("x", 20, 2, base=200))
    plan, _ = _step(sched, 8.5)  # d's token at 4: cap (24 - 8.5 - 3) / 0.5 = 25
    assert plan.request_ids == ("d", "q", "x") and plan.num_new_tokens == (1, 14, 11)


# ------------------------------------------------------------------ preemption in commit
def _preempted_while_resumed(tool: list[int]) -> tuple[Scheduler, Request, StepEvents]:
    """Blocks of 2, a 3-block pool. ``a`` (4 tokens cached in 2 blocks) pauses keeping its
    KV; ``b`` reuses both blocks and fills the pool. ``a`` resumes in place with ``tool``;
    ``b``'s next decode needs a fourth block, so it preempts ``a`` (which frees nothing,
    every block of ``a`` being shared) and then, alone, finishes with ``capacity``."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=2, num_blocks=3, max_model_len=64
    )
    sched = _decoding(cfg, _req("a", 4, 9))
    a = sched.requests["a"]
    sched.pause("a")
    sched.add_request(_req("b", 6, 9))
    plan, _ = _step(sched)
    assert _entry(plan, "b")[4] == 4 and sched.requests["b"].status is S.DECODING
    assert sched.pool.num_free_blocks == 0
    sched.resume("a", tool, StopParams(3))
    plan = sched.schedule(30.0)
    assert plan.preempted == ("a",) and plan.request_ids == ()
    assert [(f.request_id, f.reason) for f in plan.finished] == [("b", FinishReason.CAPACITY)]
    events = sched.commit(plan, _sampled(plan), 31.0)
    assert check_pool(sched.pool.snapshot()) == []
    return sched, a, events


def test_a_preempted_request_that_still_fits_the_pool_waits() -> None:
    sched, a, events = _preempted_while_resumed([8])  # 6 tokens: 3 blocks, the pool
    assert events.preempted == ("a",) and events.finished == ("b",)
    assert a.status is S.PREEMPTED and a.num_preemptions == 1 and a.num_computed_tokens == 0
    assert sched.waiting == [a] and sched.requests == {"a": a}


def test_a_resumed_turn_that_outgrows_the_pool_is_rejected() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=2, num_blocks=3, max_model_len=64
    )
    sched = _decoding(cfg, _req("a", 4, 9))
    sched.pause("a")
    with pytest.raises(ExceedsCapacity):
        sched.resume("a", [8, 9], StopParams(3))  # 7 tokens: 4 blocks of 2
    assert "a" in sched.paused


def test_a_preempted_request_that_outgrew_the_pool_finishes_with_capacity() -> None:
    """A fork of a parent whose prompt fills the pool shares every block; the parent's
    next decode needs a fourth block, so it preempts the child, whose 7 tokens can never
    fit again (capacity), and then, alone, finishes with capacity itself."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=2, num_blocks=3, max_model_len=64
    )
    sched = _decoding(cfg, _req("p", 6, 9))
    child = sched.fork("p", "c", 5, StopParams(9))
    assert sched.pool.block_table("c") == sched.pool.block_table("p")
    plan = sched.schedule(30.0)
    assert plan.preempted == ("c",) and plan.request_ids == ()
    assert [(f.request_id, f.reason) for f in plan.finished] == [("p", FinishReason.CAPACITY)]
    events = sched.commit(plan, _sampled(plan), 31.0)
    assert events.preempted == ("c",) and events.finished == ("c", "p")
    assert child.status is S.FINISHED and child.finish_reason is FinishReason.CAPACITY
    assert child.finished_ms == 31.0 and child.num_preemptions == 1
    assert sched.waiting == [] and sched.requests == {}
    assert [r.request_id for r in sched.retired] == ["c", "p"]
    assert check_pool(sched.pool.snapshot()) == [] and sched.pool.num_used_blocks == 0


def test_the_preemption_count_matches_the_preemption_events() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=5, max_num_seqs=6, block_size=2, num_blocks=8, max_model_len=64
    )
    sched = Scheduler(cfg)
    reqs = [_req(f"r{i}", 3 + i % 4, 6 + i % 5, base=(i % 3) * 50) for i in range(10)]
    for r in reqs:
        sched.add_request(r)
    seen = dict.fromkeys((r.request_id for r in reqs), 0)
    for _ in range(400):
        if not sched.has_unfinished:
            break
        _, events = _step(sched)
        for rid in events.preempted:
            seen[rid] += 1
    assert not sched.has_unfinished
    assert {r.request_id: r.num_preemptions for r in reqs} == seen
    assert max(seen.values()) >= 2  # some request was preempted more than once


# ------------------------------------------------------------------ schedule / validate
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
    sched.add_request(_req("a", 4, 2))
    sched.add_request(_req("b", 2, 2, base=50))
    _step(sched)
    sched.add_request(_req("c", 12, 2, base=100))
    sched.add_request(_req("d", 1, 2, base=200))
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


def test_a_failing_plan_leaves_no_reservation_behind() -> None:
    policy = FailingPolicy()
    sched = Scheduler(CFG, policy)
    sched.add_request(_req("a", 6, 4))
    _step(sched)
    sched.add_request(_req("b", 6, 4, base=50))
    before = sched.snapshot()
    policy.fail = True
    with pytest.raises(RuntimeError, match="policy failed"):
        sched.schedule(1.0)  # a's decode was reserved before admission failed
    assert sched.snapshot() == before
    policy.fail = False
    plan, _ = _step(sched, 2.0)  # no step is left pending or half-reserved
    assert plan.request_ids == ("a", "b")


def test_a_prefill_that_does_not_fit_lets_a_later_one_run() -> None:
    # Without chunked prefill a resumed turn must fit whole: a (4 tokens to go) does not
    # fit the 3 tokens five decodes leave, but b (2 to go) behind it does.
    cfg = SchedulerConfig(
        max_num_batched_tokens=8,
        max_num_seqs=8,
        block_size=4,
        num_blocks=32,
        enable_chunked_prefill=False,
    )
    sched = _decoding(cfg, *(_req(rid, 1, 6, base=10 * i) for i, rid in enumerate("abcdefg")))
    sched.pause("a")
    sched.pause("b")
    sched.resume("a", [1, 2, 3], StopParams(1))
    sched.resume("b", [1], StopParams(1))
    plan, _ = _step(sched)
    assert plan.request_ids == ("c", "d", "e", "f", "g", "b")
    assert _entry(plan, "b") == (1, 2, True, True, 0)


@pytest.mark.parametrize(("prompt", "admitted"), [(2, True), (3, False)])
def test_without_chunked_prefill_a_prompt_is_admitted_only_whole(
    prompt: int, admitted: bool
) -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=8,
        max_num_seqs=8,
        block_size=4,
        num_blocks=32,
        enable_chunked_prefill=False,
    )
    sched = _decoding(cfg, *(_req(f"d{i}", 1, 6, base=10 * i) for i in range(6)))
    sched.add_request(_req("x", prompt, 2, base=100))
    plan, _ = _step(sched)  # six decodes leave 2 tokens
    assert plan.admitted == (("x",) if admitted else ())
    assert plan.num_scheduled_tokens == 6 + (prompt if admitted else 0)


def test_a_requeued_turn_goes_behind_every_earlier_arrival() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=1, block_size=4, num_blocks=32, max_model_len=64
    )
    sched = _decoding(cfg, _req("x", 3))
    sched.add_request(_req("y", 3, base=10))
    sched.add_request(_req("z", 3, base=20))
    sched.add_request(_req("w", 3, base=30, priority=-1))  # more important: admitted first
    sched.abort("x")
    _step(sched)
    assert [r.request_id for r in sched.running] == ["w"]
    sched.pause("w", KVRetention.DROP)
    sched.resume("w", [1], StopParams(2))
    assert [r.request_id for r in sched.waiting] == ["y", "z", "w"]
