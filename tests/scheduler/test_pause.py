"""Tool waits: ``Scheduler.pause`` and ``Scheduler.resume`` (agent sessions).

A paused turn keeps its KV on the device, moves it to the host pool, or drops it, as its
``KVRetention`` says; a resume continues in place as an incremental prefill when a slot
is free, otherwise it waits in arrival order. Paused KV never blocks running work: it is
reclaimed before a running request is preempted (docs/ARCHITECTURE.md, "Invariants").
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from harness import (
    SMALL_CONFIG,
    Stepper,
    commit_step,
    decoding_scheduler,
    make_request,
    plan_entry,
    sampled_tokens,
)

from refserve.core.config import SchedulerConfig
from refserve.core.request import FinishReason, StopParams
from refserve.core.scheduler import Scheduler, StepInProgress
from refserve.core.swap import KVRetention, RetentionPolicy
from refserve.errors import ExceedsCapacity, InvalidArgument, UnknownRequest
from refserve.spec import EngineSnapshot, PoolSnapshot, RequestSnapshot
from refserve.spec.progress import check_quiescent
from refserve.spec.snapshot import RequestStatus as S


# ------------------------------------------------------------------ pause / resume
@pytest.mark.mutation_kill
def test_pause_keeping_kv_holds_the_blocks_and_leaves_the_batch() -> None:
    sched = decoding_scheduler(SMALL_CONFIG, make_request("a", 6))
    a = sched.requests["a"]
    table, kv = sched.pool.block_table("a"), a.num_computed_tokens
    sched.pause("a")  # retention defaults to the device for a short wait
    assert a.status is S.WAITING_TOOL
    assert sched.paused == {"a": a} and sched.running == [] and sched.waiting == []
    assert sched.pool.block_table("a") == table and a.num_computed_tokens == kv
    plan, _ = commit_step(sched)
    assert plan.request_ids == ()  # a paused request is not scheduled


@pytest.mark.mutation_kill
def test_pause_releasing_kv_frees_every_block() -> None:
    sched = decoding_scheduler(SMALL_CONFIG, make_request("a", 6))
    a = sched.requests["a"]
    sched.pause("a", KVRetention.DROP)
    assert not sched.pool.has_request("a")
    assert a.num_computed_tokens == 0
    assert sched.pool.num_free_blocks == SMALL_CONFIG.num_blocks
    assert sched.paused == {"a": a} and a.status is S.WAITING_TOOL


@pytest.mark.mutation_kill
def test_pause_refusals_name_the_operation() -> None:
    sched = Scheduler(SMALL_CONFIG)
    sched.add_request(make_request("a", 6))
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
    sched.commit(plan, sampled_tokens(plan), 5.0)
    assert sched.requests["a"].admitted_ms == 0.0  # the step started at the default 0


@pytest.mark.mutation_kill
def test_resume_in_place_continues_as_an_incremental_prefill() -> None:
    sched = decoding_scheduler(SMALL_CONFIG, make_request("a", 6))
    a = sched.requests["a"]
    commit_step(sched, token=8)  # two outputs: [.., 7, 8]; KV holds all but the last
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
    plan, events = commit_step(sched, token=9)
    # Only the last output (no KV yet) and the three tool tokens are computed.
    assert plan_entry(plan, "a") == (kv, 4, True, True, 0)
    assert plan.admitted == ()
    assert dict(events.last_tokens()) == {"a": 9}
    assert a.prompt_token_ids == [*history, 0, 50, 51]  # sampling did not touch the prompt
    assert a.output_token_ids == [9] and a.status is S.DECODING
    _, events = commit_step(sched, token=10)
    assert events.finished == ("a",) and a.finish_reason is FinishReason.LENGTH


@pytest.mark.mutation_kill
def test_resume_without_a_running_slot_gives_the_blocks_back_and_waits_in_order() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=32, max_num_seqs=1, block_size=4, num_blocks=16, max_model_len=32
    )
    sched = decoding_scheduler(cfg, make_request("a", 6))
    a = sched.requests["a"]
    sched.pause("a")  # KV retained
    sched.add_request(make_request("b", 5, base=100))
    commit_step(sched)  # b takes the only running slot
    sched.add_request(make_request("c", 5, base=200))
    assert [r.request_id for r in sched.running] == ["b"]
    sched.resume("a", [60], StopParams(1))
    assert a.status is S.WAITING
    assert not sched.pool.has_request("a") and a.num_computed_tokens == 0
    assert [r.request_id for r in sched.waiting] == ["a", "c"]  # a keeps its arrival place
    assert a.queued_step == sched.step_index


@pytest.mark.mutation_kill
def test_resume_after_releasing_kv_waits_and_recomputes_from_the_cache() -> None:
    sched = decoding_scheduler(SMALL_CONFIG, make_request("a", 9))  # two full blocks get cached
    a = sched.requests["a"]
    sched.pause("a", KVRetention.DROP)
    sched.resume("a", [60, 61], StopParams(1))
    assert a.status is S.WAITING and sched.waiting == [a] and sched.running == []
    plan, _ = commit_step(sched)
    assert plan.admitted == ("a",)
    start, n, samples, prefill, cached = plan_entry(plan, "a")
    assert (start, cached) == (8, 8) and start + n == a.num_prompt_tokens == 12
    assert samples and prefill


@pytest.mark.mutation_kill
def test_resume_refusals_leave_the_request_paused() -> None:
    sched = decoding_scheduler(SMALL_CONFIG, make_request("a", 6))
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
    room = SMALL_CONFIG.max_len - 1 - a.num_tokens
    with pytest.raises(InvalidArgument) as long:
        sched.resume("a", [5] * (room + 1), StopParams(1))
    assert str(long.value) == (
        f"resume: request 'a' would hold {a.num_tokens + room + 1} tokens; "
        f"the limit is {SMALL_CONFIG.max_len - 1} before an output token"
    )
    assert sched.snapshot() == before and sched.paused == {"a": a}
    sched.resume("a", [5] * room, StopParams(1))  # exactly at the limit is fine
    assert a.num_tokens == SMALL_CONFIG.max_len - 1 and a.status is S.PREFILLING


@pytest.mark.mutation_kill
def test_pause_without_a_wait_keeps_kv_on_the_device_below_the_first_threshold() -> None:
    run = Stepper.of(num_blocks=32, block_size=4, retention=RetentionPolicy(1.0, 10.0))
    run.add(make_request("a", 5))
    run.decoding("a")
    assert run.sched.pause("a") is KVRetention.DEVICE  # 0 ms < 1 ms


@pytest.mark.mutation_kill
def test_pause_names_the_allowed_retentions() -> None:
    run = Stepper.of(num_blocks=32, block_size=4)
    run.add(make_request("a", 5))
    run.decoding("a")
    with pytest.raises(InvalidArgument) as e:
        run.sched.pause("a", "fridge")
    assert str(e.value) == "pause: retention must be one of device, host, drop, got 'fridge'"


@pytest.mark.mutation_kill
def test_resume_names_the_blocks_a_turn_that_never_fits_needs() -> None:
    run = Stepper.of(num_blocks=3, block_size=2)
    run.add(make_request("a", 3))
    run.decoding("a")
    run.sched.pause("a", KVRetention.DEVICE)
    with pytest.raises(ExceedsCapacity) as e:
        run.sched.resume("a", [9, 9, 9], StopParams(2))  # 4 + 3 tokens: 4 blocks
    assert str(e.value) == "request 'a' needs 4 KV blocks but the pool has only 3"


@pytest.mark.mutation_kill
def test_static_resumes_in_place_when_no_batch_runs() -> None:
    run = Stepper.of(num_blocks=32, block_size=4, policy="static")
    run.add(make_request("a", 5))
    run.decoding("a")
    run.sched.pause("a", KVRetention.DEVICE)
    run.sched.resume("a", [9], StopParams(2, ignore_eos=True))
    assert run.sched.requests["a"].status is S.PREFILLING
    assert run.sched.requests["a"] in run.sched.running
    run.drain()


@pytest.mark.mutation_kill
def test_resume_in_place_respects_the_tenant_cap() -> None:
    run = Stepper.of(num_blocks=32, block_size=4, policy="tenant-fair", tenant_max_running=1)
    run.add(make_request("a", 5, tenant="A"), make_request("b", 5, base=50, tenant="B"))
    run.decoding("a", "b")
    run.sched.pause("a", KVRetention.DEVICE)
    run.add(make_request("c", 3, base=90, tenant="A"))
    run.until(lambda: run.sched.requests["c"].status is S.DECODING)
    run.sched.resume("a", [9], StopParams(2, ignore_eos=True))
    a = run.sched.requests["a"]
    assert a.status is S.WAITING and a not in run.sched.running  # A already runs c
    run.sched.pause("b", KVRetention.DEVICE)
    run.sched.resume("b", [9], StopParams(2, ignore_eos=True))
    assert run.sched.requests["b"].status is S.PREFILLING  # B is under its cap
    run.drain()


def test_resume_in_place_respects_the_policy() -> None:
    """A static batch in flight admits nobody, so a resumed turn waits (and recomputes)."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=64, max_num_seqs=4, block_size=4, num_blocks=64, policy="static"
    )
    st_ = Stepper(cfg)
    st_.sched.add_request(make_request("agent", 6, 8))
    st_.sched.add_request(make_request("other", 5, 12, base=500))
    st_.step()
    st_.step()
    st_.sched.pause("agent", KVRetention.DEVICE)
    st_.sched.resume("agent", [900], StopParams(2, ignore_eos=True))
    agent = st_.sched.requests["agent"]
    assert agent.status is S.WAITING and agent not in st_.sched.running
    assert not st_.sched.pool.has_request("agent") and agent.num_computed_tokens == 0
    st_.drain()
    # Under decode-first the same resume continues in place.
    st_ = Stepper(replace(cfg, policy="decode-first"))
    st_.sched.add_request(make_request("agent", 6, 8))
    st_.sched.add_request(make_request("other", 5, 12, base=500))
    st_.step()
    st_.step()
    st_.sched.pause("agent", KVRetention.DEVICE)
    st_.sched.resume("agent", [900], StopParams(2, ignore_eos=True))
    assert st_.sched.requests["agent"].status is S.PREFILLING
    st_.drain()


# ------------------------------------------------------------------ tool waits on the host
def _agent(host_blocks: int = 16) -> Stepper:
    cfg = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=4,
        block_size=4,
        num_blocks=64,
        num_host_blocks=host_blocks,
        retention=RetentionPolicy(device_max_wait_ms=100.0, host_max_wait_ms=10_000.0),
    )
    st_ = Stepper(cfg)
    st_.sched.add_request(make_request("agent", 18, 3))
    st_.sched.add_request(make_request("other", 5, 12, base=500))
    while st_.sched.requests["agent"].num_output_tokens < 2:
        st_.step()
    return st_


def test_tool_wait_on_the_host_moves_kv_out_then_swaps_it_back_in() -> None:
    st_ = _agent()
    agent = st_.sched.requests["agent"]
    kv = agent.num_computed_tokens
    used = st_.sched.pool.num_used_blocks
    assert st_.sched.pause("agent", expected_wait_ms=500.0) is KVRetention.HOST
    assert st_.sched.pool.has_request("agent")  # moves with the next step
    st_.step()
    plan = st_.plans[-1]
    assert plan.swapped_out == ("agent",) and plan.preempted == ()
    assert not st_.sched.pool.has_request("agent")
    assert st_.sched.pool.num_used_blocks < used
    assert st_.sched.host.table("agent").num_stored == kv == agent.num_computed_tokens
    assert agent.status is S.WAITING_TOOL
    st_.sched.resume("agent", [900, 901, 902], StopParams(2, ignore_eos=True))
    assert agent.status is S.SWAPPED
    tokens = st_.step_tokens()
    plan = st_.plans[-1]
    assert plan.swapped_in == ("agent",)
    assert tokens["agent"] == 1 + 3  # last sampled token (no KV yet) + tool tokens
    assert agent.num_computed_tokens == kv + 4
    st_.drain()
    assert check_quiescent(st_.sched.host.snapshot()) == []


def test_tool_answer_before_the_move_keeps_kv_on_the_device() -> None:
    st_ = _agent()
    st_.sched.pause("agent", KVRetention.HOST)
    st_.sched.resume("agent", [900], StopParams(1, ignore_eos=True))
    tokens = st_.step_tokens()
    assert st_.plans[-1].swapped_out == ()
    assert tokens["agent"] == 2
    st_.drain()


def test_long_tool_wait_drops_kv_and_short_keeps_it() -> None:
    st_ = _agent()
    assert st_.sched.pause("agent", expected_wait_ms=50_000.0) is KVRetention.DROP
    assert not st_.sched.pool.has_request("agent")
    assert st_.sched.requests["agent"].num_computed_tokens == 0
    st_ = _agent()
    assert st_.sched.pause("agent", expected_wait_ms=10.0) is KVRetention.DEVICE
    assert st_.sched.pool.has_request("agent")


def test_pause_rejects_bad_retention_with_nothing_changed() -> None:
    st_ = _agent(host_blocks=0)
    before = st_.sched.snapshot()
    with pytest.raises(InvalidArgument, match="num_host_blocks is 0"):
        st_.sched.pause("agent", KVRetention.HOST)
    with pytest.raises(InvalidArgument, match="retention must be one of"):
        st_.sched.pause("agent", "fridge")
    with pytest.raises(InvalidArgument, match="expected_wait_ms"):
        st_.sched.pause("agent", expected_wait_ms="soon")  # type: ignore[arg-type]
    assert st_.sched.snapshot() == before
    assert st_.sched.requests["agent"].status is S.DECODING
    # With no host pool the policy never picks the host.
    assert st_.sched.pause("agent", expected_wait_ms=500.0) is KVRetention.DROP


def test_host_move_waits_while_the_host_pool_is_full() -> None:
    st_ = _agent(host_blocks=2)  # the agent's 20 tokens need 5 host blocks
    st_.sched.pause("agent", KVRetention.HOST)
    st_.step()
    assert st_.plans[-1].swapped_out == ()
    assert st_.sched.pool.has_request("agent")
    st_.sched.abort("agent")
    assert not st_.sched.pool.has_request("agent")
    st_.drain()


def test_aborting_a_paused_host_request_frees_the_host_pool() -> None:
    st_ = _agent()
    st_.sched.pause("agent", KVRetention.HOST)
    st_.step()
    assert st_.sched.host.num_used_blocks > 0
    st_.sched.abort("agent")
    assert st_.sched.host.num_used_blocks == 0
    st_.drain()


@pytest.mark.mutation_kill
def test_a_pending_host_move_that_is_dropped_leaves_the_queue() -> None:
    run = Stepper.of(
        max_num_batched_tokens=32,
        max_num_seqs=4,
        block_size=2,
        num_blocks=5,
        enable_prefix_caching=False,
        num_host_blocks=1,
    )
    run.add(make_request("p", 3, 9), make_request("g", 2, 20, base=40))
    run.decoding("p", "g")
    run.sched.pause("p", KVRetention.HOST)  # 3 tokens: 2 host blocks, only 1 exists
    run.until(lambda: bool(run.plans[-1].dropped))
    assert run.plans[-1].dropped == ("p",)
    run.step()  # a later step must not try to move it again
    run.sched.resume("p", [9], StopParams(2, ignore_eos=True))
    run.drain()


@pytest.mark.mutation_kill
def test_a_pending_host_move_happens_once_the_host_has_room() -> None:
    run = Stepper.of(
        max_num_batched_tokens=32,
        max_num_seqs=4,
        block_size=2,
        num_blocks=16,
        num_host_blocks=2,
    )
    run.add(
        make_request("x", 3, 9), make_request("y", 3, 9, base=40), make_request("o", 2, 30, base=80)
    )
    run.decoding("x", "y", "o")
    run.sched.pause("x", KVRetention.HOST)
    run.sched.pause("y", KVRetention.HOST)
    assert run.step().plan.swapped_out == ("x",)  # the host holds one of them
    assert run.step().plan.swapped_out == ()
    run.sched.abort("x")
    assert run.step().plan.swapped_out == ("y",)
    run.sched.abort("y")
    run.drain()


# ------------------------------------------------------------------ paused KV never blocks
def _paused_holder(host_blocks: int) -> Stepper:
    """A 6-block pool (block 4): "p" pauses holding 3 blocks, "g" decodes and grows."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=32,
        max_num_seqs=4,
        block_size=4,
        num_blocks=6,
        enable_prefix_caching=False,
        num_host_blocks=host_blocks,
    )
    st_ = Stepper(cfg)
    st_.sched.add_request(make_request("p", 10, 5))
    st_.sched.add_request(make_request("g", 7, 12, base=100))
    while st_.sched.requests["p"].num_output_tokens < 1:
        st_.step()
    st_.sched.pause("p", KVRetention.DEVICE)
    return st_


@pytest.mark.parametrize("host_blocks", [0, 8])
def test_paused_kv_is_reclaimed_before_a_running_request_is_preempted(host_blocks: int) -> None:
    st_ = _paused_holder(host_blocks)
    p = st_.sched.requests["p"]
    kv = p.num_computed_tokens
    for _ in range(20):
        st_.step()
        plan = st_.plans[-1]
        if plan.swapped_out or plan.dropped:
            break
    else:
        raise AssertionError("the paused KV was never reclaimed")
    assert plan.preempted == ()
    assert not st_.sched.pool.has_request("p") and p.status is S.WAITING_TOOL
    if host_blocks:
        assert plan.swapped_out == ("p",) and p.num_computed_tokens == kv
    else:
        assert plan.dropped == ("p",) and p.num_computed_tokens == 0
    st_.sched.resume("p", [7, 8], StopParams(2, ignore_eos=True))
    st_.drain()
    assert st_.sched.pool.num_used_blocks == 0 and st_.sched.host.num_used_blocks == 0


def test_paused_kv_is_reclaimed_when_admission_would_stall() -> None:
    st_ = _paused_holder(0)
    st_.sched.abort("g")
    # 5 free blocks; a 22-token prompt needs 6 with nothing running: the paused KV goes.
    st_.sched.add_request(make_request("w", 22, 2, base=300))
    tokens = st_.step_tokens()
    assert tokens.get("w", 0) > 0
    assert st_.plans[-1].dropped == ("p",)
    st_.sched.abort("p")
    st_.drain()


@pytest.mark.mutation_kill
def test_reclaim_skips_a_paused_turn_already_on_the_host() -> None:
    run = Stepper.of(
        max_num_batched_tokens=32,
        max_num_seqs=4,
        block_size=2,
        num_blocks=6,
        enable_prefix_caching=False,
        num_host_blocks=2,
    )
    run.add(
        make_request("h", 3, 9), make_request("d", 3, 9, base=40), make_request("g", 2, 12, base=80)
    )
    run.decoding("h", "d", "g")
    run.sched.pause("h", KVRetention.HOST)
    run.step()
    assert run.sched.host.has_request("h")
    run.sched.pause("d", KVRetention.DEVICE)  # the host is full: reclaim drops it
    run.until(lambda: bool(run.plans[-1].dropped))
    plan = run.plans[-1]
    assert plan.dropped == ("d",) and plan.preempted == ()
    run.sched.abort("h")
    run.sched.abort("d")
    run.drain()


@pytest.mark.mutation_kill
def test_room_for_a_prefill_chunk_may_take_two_paused_turns() -> None:
    run = Stepper.of(
        max_num_batched_tokens=4,
        max_num_seqs=4,
        block_size=2,
        num_blocks=4,
        enable_prefix_caching=False,
    )
    run.add(make_request("p1", 1, 9), make_request("p2", 1, 9, base=40))
    run.decoding("p1", "p2")
    run.sched.pause("p1", KVRetention.DEVICE)
    run.sched.pause("p2", KVRetention.DEVICE)
    run.add(make_request("r", 8, 2, base=80))
    run.step()  # r's first chunk: 4 tokens, the 2 free blocks
    plan = run.step().plan  # its second chunk needs 2 blocks: both paused turns give theirs
    assert set(plan.dropped) == {"p1", "p2"} and "r" in plan.request_ids
    run.sched.abort("p1")
    run.sched.abort("p2")
    run.drain()


def test_resume_rejects_a_turn_that_can_never_fit_with_nothing_changed() -> None:
    st_ = _paused_holder(0)
    before = st_.sched.snapshot()
    with pytest.raises(ExceedsCapacity):
        st_.sched.resume("p", [1] * 20, StopParams(2))
    assert st_.sched.snapshot() == before and "p" in st_.sched.paused
    st_.sched.resume("p", [1], StopParams(2, ignore_eos=True))
    st_.drain()


def test_token_check_on_a_reclaimed_paused_turn() -> None:
    from refserve.spec import StepSnapshot
    from refserve.spec.token import check_token

    device = PoolSnapshot(4, 2, (0, 0, 0, 0), (0, 1, 2, 3), ())
    paused = RequestSnapshot("p", S.WAITING_TOOL, 3, 1, 3, 4)

    def step(after_kv: int, preempted: tuple[str, ...]) -> StepSnapshot:
        after = replace(paused, num_computed_tokens=after_kv)
        return StepSnapshot(
            0,
            8,
            4,
            EngineSnapshot((paused,), device),
            (),
            EngineSnapshot((after,), device),
            preempted=preempted,
        )

    assert check_token(step(0, ("p",))) == []  # dropped, and said so
    assert check_token(step(3, ())) == []  # untouched
    assert any("did not advance" in str(v) for v in check_token(step(0, ())))
    assert any("must reset" in str(v) for v in check_token(step(1, ("p",))))


# ------------------------------------------------------------------ agent sessions
def _session(retention: KVRetention) -> tuple[Stepper, dict[str, int], int]:
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, block_size=4, num_blocks=64)
    st_ = Stepper(cfg)
    st_.sched.add_request(make_request("agent", 18, 3))
    st_.sched.add_request(make_request("other", 5, 12, base=500))
    while st_.sched.requests["agent"].num_output_tokens < 2:
        st_.step()
    agent = st_.sched.requests["agent"]
    kv_before = agent.num_computed_tokens
    assert st_.sched.pause("agent", retention) is retention
    assert agent.status.value == "waiting_tool"
    for _ in range(3):  # the tool runs while the other request keeps decoding
        assert "agent" not in st_.step_tokens()
    st_.sched.resume("agent", [900, 901, 902, 903, 904], StopParams(2, ignore_eos=True))
    return st_, st_.step_tokens(), kv_before


def test_tool_pause_with_retained_kv_resumes_as_an_incremental_prefill() -> None:
    st_, tokens, kv_before = _session(KVRetention.DEVICE)
    # Only the last sampled token (it had no KV yet) and the 5 tool tokens are computed.
    assert tokens["agent"] == 1 + 5
    assert st_.sched.requests["agent"].num_computed_tokens == kv_before + 6
    while st_.sched.has_unfinished:
        st_.step()
    assert st_.sched.pool.num_used_blocks == 0


def test_tool_pause_that_drops_kv_recomputes_through_the_prefix_cache() -> None:
    st_, tokens, kv_before = _session(KVRetention.DROP)
    agent = st_.sched.requests["agent"]
    assert agent.num_cached_tokens > 0 and agent.num_cached_tokens % 4 == 0
    assert tokens["agent"] == agent.num_prompt_tokens - agent.num_cached_tokens
    assert agent.num_cached_tokens <= kv_before
    while st_.sched.has_unfinished:
        st_.step()


def test_pause_and_resume_reject_bad_input_and_abort_frees_a_paused_request() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2, block_size=4, num_blocks=32)
    st_ = Stepper(cfg)
    st_.sched.add_request(make_request("a", 10, 5))
    with pytest.raises(InvalidArgument, match="must be decoding"):
        st_.sched.pause("a")
    while st_.sched.requests["a"].num_output_tokens == 0:
        st_.step()
    with pytest.raises(UnknownRequest):
        st_.sched.resume("a", [1], StopParams(1))
    st_.sched.pause("a")
    before = st_.sched.snapshot()
    with pytest.raises(InvalidArgument, match="tool token ids"):
        st_.sched.resume("a", [], StopParams(1))
    assert st_.sched.snapshot() == before
    st_.sched.abort("a")
    assert st_.sched.pool.num_used_blocks == 0 and not st_.sched.paused
