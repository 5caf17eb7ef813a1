"""Preemption: which request gives its blocks back, and what becomes of it.

A victim that still fits the pool waits to run again; one that outgrew the pool
finishes with ``capacity`` (a resumed turn that outgrew it is rejected); the preemption
count matches the preemption events (docs/ARCHITECTURE.md, "Invariants": PROGRESS).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from harness import commit_step, decoding_scheduler, make_request, plan_entry, sampled_tokens

from refserve.core.config import SchedulerConfig
from refserve.core.outcome import StepOutcome
from refserve.core.policy import DecodeFirst
from refserve.core.request import FinishReason, Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.errors import ExceedsCapacity
from refserve.spec import check_pool
from refserve.spec.snapshot import RequestStatus as S


class _KeepsEveryone(DecodeFirst):
    """A policy that names no victim, ever (``Policy.pick_victim`` may return None)."""

    def pick_victim(self, candidates: Sequence[Request]) -> Request | None:
        return None


def _preempted_while_resumed(tool: list[int]) -> tuple[Scheduler, Request, StepOutcome]:
    """Blocks of 2, a 3-block pool. ``a`` (4 tokens cached in 2 blocks) pauses keeping its
    KV; ``b`` reuses both blocks and fills the pool. ``a`` resumes in place with ``tool``;
    ``b``'s next decode needs a fourth block, so it preempts ``a`` (which frees nothing,
    every block of ``a`` being shared) and then, alone, finishes with ``capacity``."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=2, num_blocks=3, max_model_len=64
    )
    sched = decoding_scheduler(cfg, make_request("a", 4, 9))
    a = sched.requests["a"]
    sched.pause("a")
    sched.add_request(make_request("b", 6, 9))
    plan, _ = commit_step(sched)
    assert plan_entry(plan, "b")[4] == 4 and sched.requests["b"].status is S.DECODING
    assert sched.pool.num_free_blocks == 0
    sched.resume("a", tool, StopParams(3))
    plan = sched.schedule(30.0)
    assert plan.preempted == ("a",) and plan.request_ids == ()
    assert [(f.request_id, f.reason) for f in plan.finished] == [("b", FinishReason.CAPACITY)]
    events = sched.commit(plan, sampled_tokens(plan), 31.0)
    assert check_pool(sched.pool.snapshot()) == []
    return sched, a, events


@pytest.mark.mutation_kill
def test_a_preempted_request_that_still_fits_the_pool_waits() -> None:
    sched, a, events = _preempted_while_resumed([8])  # 6 tokens: 3 blocks, the pool
    assert events.preempted == ("a",) and events.finished == ("b",)
    assert a.status is S.PREEMPTED and a.num_preemptions == 1 and a.num_computed_tokens == 0
    assert sched.waiting == [a] and sched.requests == {"a": a}


@pytest.mark.mutation_kill
def test_a_resumed_turn_that_outgrows_the_pool_is_rejected() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=2, num_blocks=3, max_model_len=64
    )
    sched = decoding_scheduler(cfg, make_request("a", 4, 9))
    sched.pause("a")
    with pytest.raises(ExceedsCapacity):
        sched.resume("a", [8, 9], StopParams(3))  # 7 tokens: 4 blocks of 2
    assert "a" in sched.paused


@pytest.mark.mutation_kill
def test_a_preempted_request_that_outgrew_the_pool_finishes_with_capacity() -> None:
    """A fork of a parent whose prompt fills the pool shares every block; the parent's
    next decode needs a fourth block, so it preempts the child, whose 7 tokens can never
    fit again (capacity), and then, alone, finishes with capacity itself."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=2, num_blocks=3, max_model_len=64
    )
    sched = decoding_scheduler(cfg, make_request("p", 6, 9))
    child = sched.fork("p", "c", 5, StopParams(9))
    assert sched.pool.block_table("c") == sched.pool.block_table("p")
    plan = sched.schedule(30.0)
    assert plan.preempted == ("c",) and plan.request_ids == ()
    assert [(f.request_id, f.reason) for f in plan.finished] == [("p", FinishReason.CAPACITY)]
    events = sched.commit(plan, sampled_tokens(plan), 31.0)
    assert events.preempted == ("c",) and events.finished == ("c", "p")
    assert child.status is S.FINISHED and child.finish_reason is FinishReason.CAPACITY
    assert child.finished_ms == 31.0 and child.num_preemptions == 1
    assert sched.waiting == [] and sched.requests == {}
    assert [r.request_id for r in sched.retired] == ["c", "p"]
    assert check_pool(sched.pool.snapshot()) == [] and sched.pool.num_used_blocks == 0


@pytest.mark.mutation_kill
def test_the_preemption_count_matches_the_preemption_events() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=5, max_num_seqs=6, block_size=2, num_blocks=8, max_model_len=64
    )
    sched = Scheduler(cfg)
    reqs = [make_request(f"r{i}", 3 + i % 4, 6 + i % 5, base=(i % 3) * 50) for i in range(10)]
    for r in reqs:
        sched.add_request(r)
    seen = dict.fromkeys((r.request_id for r in reqs), 0)
    for _ in range(400):
        if not sched.has_unfinished:
            break
        _, events = commit_step(sched)
        for rid in events.preempted:
            seen[rid] += 1
    assert not sched.has_unfinished
    assert {r.request_id: r.num_preemptions for r in reqs} == seen
    assert max(seen.values()) >= 2  # some request was preempted more than once


@pytest.mark.mutation_kill
def test_every_victim_of_a_step_that_outgrew_the_pool_finishes_with_capacity() -> None:
    """Two forks share every block of a parent that fills the pool; the parent's next
    decode preempts both, and neither can ever fit again: each one finishes with
    capacity, not only the first (then the parent, alone, finishes too)."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=2, num_blocks=3, max_model_len=64
    )
    sched = decoding_scheduler(cfg, make_request("p", 6, 9))
    c1 = sched.fork("p", "c1", 5, StopParams(9))
    c2 = sched.fork("p", "c2", 4, StopParams(9))
    plan = sched.schedule(30.0)
    assert sorted(plan.preempted) == ["c1", "c2"]
    events = sched.commit(plan, sampled_tokens(plan), 31.0)
    assert sorted(events.finished) == ["c1", "c2", "p"]
    assert all(c.finish_reason is FinishReason.CAPACITY for c in (c1, c2))
    assert sched.requests == {} and sched.waiting == [] and not sched.running


@pytest.mark.mutation_kill
def test_a_request_that_may_not_preempt_the_others_waits_for_a_block() -> None:
    """Capacity ends a request only when it cannot grow even alone. Two requests fill a
    4-block pool and both need a block; the policy preempts no one, so neither is
    placed, and neither is finished or preempted: they wait."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=2, num_blocks=4, max_model_len=64
    )
    sched = Scheduler(cfg, _KeepsEveryone())
    for rid, base in (("a", 0), ("b", 10)):
        sched.add_request(make_request(rid, 3, 9, base=base))
    commit_step(sched)  # prefill: 2 blocks each, the pool is full
    commit_step(sched)  # position 3: room in each last block
    plan, events = commit_step(sched)  # position 4: both need a block
    assert plan.request_ids == () and plan.preempted == () and plan.finished == ()
    assert events.finished == () and sched.pool.num_free_blocks == 0
    assert [r.status for r in sched.running] == [S.DECODING, S.DECODING]


@pytest.mark.mutation_kill
def test_the_decodes_after_a_victim_still_run() -> None:
    """The victim need not be last in running order: ``b`` (the least important) was
    admitted before ``c``. When ``a``'s growth preempts ``b``, ``c`` still decodes."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=2, num_blocks=6, max_model_len=64
    )
    sched = Scheduler(cfg)
    sched.add_request(make_request("a", 3, 9))
    sched.add_request(make_request("b", 3, 9, base=10, priority=5))
    commit_step(sched)  # a and b prefill: 2 blocks each
    sched.add_request(make_request("c", 3, 9, base=20))
    commit_step(sched)  # c prefills into the last 2 blocks; a and b at position 3
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]
    plan, _ = commit_step(sched)  # a and b need a block, c has room
    assert plan.preempted == ("b",) and plan.request_ids == ("a", "c")
