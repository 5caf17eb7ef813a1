"""Checks that kill mutants of ``ref/scheduler.py`` which survived ``make mutation``.

See docs/MUTATION.md. Each test drives the scheduler through its public surface
(``add_request``/``schedule``/``commit``/``pause``/``resume``, the plan's fields, the
pool's queries) and states one behaviour exactly; the spec checkers run where a whole
step is taken. All are small and deterministic: mutmut runs them once per mutant.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

import pytest

from ref.config import PolicyName, SchedulerConfig
from ref.cost_model import CostModel
from ref.errors import (
    InvalidArgument,
    UnknownRequest,
)
from ref.plan import StepPlan
from ref.policy import DecodeFirst, TenantFair
from ref.request import FinishReason, Request, StopParams
from ref.scheduler import Scheduler, StepEvents, StepInProgress
from spec import check_pool
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
    sched.pause("a")  # retain_kv defaults to True
    assert a.status is S.WAITING_TOOL
    assert sched.paused == {"a": a} and sched.running == [] and sched.waiting == []
    assert sched.pool.block_table("a") == table and a.num_computed_tokens == kv
    plan, _ = _step(sched)
    assert plan.request_ids == ()  # a paused request is not scheduled


def test_pause_releasing_kv_frees_every_block() -> None:
    sched = _decoding(CFG, _req("a", 6))
    a = sched.requests["a"]
    sched.pause("a", retain_kv=False)
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
    sched.schedule(0.0)
    with pytest.raises(StepInProgress) as mid:
        sched.pause("a")
    assert str(mid.value) == "pause: a step is in progress (schedule without commit/rollback)"
    with pytest.raises(StepInProgress, match=r"^resume: a step is in progress"):
        sched.resume("a", [1], StopParams(1))
    sched.rollback()


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
    sched.pause("a", retain_kv=False)
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
def _slo_chunk(model: CostModel, now: float, *, reserve: int = 0, prompt: int = 60) -> int:
    """Prefill tokens admitted next to one decode whose last token came at t = 0."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=4,
        block_size=4,
        num_blocks=64,
        max_model_len=128,
        tbt_slo_ms=20.0,
        iteration_model=model,
        prefill_reserve_tokens=reserve,
        prefill_reserve_after_steps=0,
    )
    sched = Scheduler(cfg)
    sched.add_request(_req("d", 3, 50))
    _step(sched, 0.0)  # d: 3 tokens computed, first token at t = 0
    sched.add_request(_req("p", prompt, 2, base=100))
    plan = sched.schedule(now)
    assert _entry(plan, "d")[:2] == (3, 1)
    return _entry(plan, "p")[1] if "p" in plan.request_ids else 0


def test_prefill_cap_is_the_slack_left_by_the_decodes() -> None:
    # P <= (last + slo - now - a - c*D - e*K) / b with D = 1 decode reading K = 3 + 1.
    assert _slo_chunk(CostModel(2.0, 0.5, 1.0), 4.0) == 26  # (20 - 4 - 2 - 1) / 0.5
    assert _slo_chunk(CostModel(2.0, 0.5, 1.0, 0.5), 4.0) == 22  # minus 0.5 * 4 ms of reads
    assert _slo_chunk(CostModel(2.0, 0.5, 1.0, 0.5), 4.25) == 21  # 21.5 rounds down
    assert _slo_chunk(CostModel(2.0, 0.5, 1.0), 0.0, prompt=20) == 20  # the whole prompt fits


def test_prefill_cap_is_zero_without_slack_unless_reserved() -> None:
    assert _slo_chunk(CostModel(2.0, 0.5, 1.0), 17.0) == 0  # spare exactly 0
    assert _slo_chunk(CostModel(2.0, 0.5, 1.0), 30.0) == 0  # the deadline has passed
    assert _slo_chunk(CostModel(2.0, 0.5, 1.0), 30.0, reserve=5) == 5
    assert _slo_chunk(CostModel(2.0, 0.5, 1.0), 4.0, reserve=5) == 26


def test_prefill_cap_follows_the_tightest_decode() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=4,
        block_size=4,
        num_blocks=64,
        max_model_len=128,
        tbt_slo_ms=20.0,
        iteration_model=CostModel(2.0, 0.5, 1.0),
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


def test_queue_timeout_spares_a_request_that_was_admitted_before() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_blocks=32, queue_timeout_ms=10
    )
    sched = _decoding(cfg, _req("a", 5, 8))
    a = sched.requests["a"]
    sched.pause("a", retain_kv=False)
    sched.resume("a", [9], StopParams(2))  # waits again, with admitted_ms set
    assert a.status is S.WAITING and a.admitted_ms == 0.0
    plan, _ = _step(sched, 50.0)
    assert plan.finished == () and plan.admitted == ("a",)
    assert sched.num_timeouts == 0
    assert a.admitted_ms == 0.0  # the first admission time is kept
