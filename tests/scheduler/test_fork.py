"""Forks (``Scheduler.fork``, parallel sampling) and ``Scheduler.finish``.

A child shares its parent's blocks and state when there is room, waits as preempted in
the parent's place when there is not, and finishes with ``capacity`` when it can never
fit (docs/ARCHITECTURE.md, "Invariants": PREFIX, REFCOUNT). Scheduler-level only; the
engine's n > 1 sampling is tested in tests/engine.
"""

from __future__ import annotations

import pytest
from harness import SMALL_CONFIG, commit_step, decoding_scheduler, make_request

from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.engine_core import EngineCore
from refserve.core.request import FinishReason, Request, StopParams
from refserve.core.scheduler import Scheduler, StepInProgress
from refserve.core.swap import KVRetention
from refserve.errors import DuplicateRequest, InvalidArgument, UnknownRequest
from refserve.sim.simulator import SimExecutor
from refserve.spec import check_pool
from refserve.spec.hashing import Namespace
from refserve.spec.snapshot import RequestStatus as S

PARENT_CFG = SchedulerConfig(
    max_num_batched_tokens=16, max_num_seqs=2, block_size=2, num_blocks=8, max_model_len=16
)


def _decoding_parent(cfg: SchedulerConfig = PARENT_CFG) -> tuple[Scheduler, EngineCore, Request]:
    """A scheduler whose request ``p`` (5-token prompt) has just sampled its first token."""
    sched = Scheduler(cfg)
    core = EngineCore(sched, SimExecutor(StepCost(), sched.requests), check_invariants=True)
    parent = Request("p", [5, 6, 7, 8, 9], StopParams(max_tokens=4), arrival_ms=3.0, priority=2)
    sched.add_request(parent)
    core.step(10.0)
    assert parent.status is S.DECODING and parent.num_output_tokens == 1
    return sched, core, parent


@pytest.mark.mutation_kill
def test_fork_with_room_shares_the_parents_blocks_and_state() -> None:
    sched, core, parent = _decoding_parent()
    stop = StopParams(max_tokens=3)
    child = sched.fork("p", "c", 77, stop)
    assert child.request_id == "c"
    assert child.status is S.DECODING
    assert child.prompt_token_ids == parent.prompt_token_ids
    assert child.token_ids == [*parent.prompt_token_ids, 77]
    assert child.stop is stop
    assert child.arrival_ms == parent.arrival_ms == 3.0
    assert child.priority == parent.priority == 2
    assert child.tenant == parent.tenant and child.namespace == parent.namespace
    assert child.seq == parent.seq
    assert child.admitted_ms == parent.admitted_ms
    assert child.token_times_ms == parent.token_times_ms
    assert child.token_times_ms is not parent.token_times_ms
    assert child.num_computed_tokens == parent.num_computed_tokens
    assert child.num_cached_tokens == parent.num_cached_tokens
    assert sched.requests["c"] is child
    assert sched.running == [parent, child]
    assert sched.pool.block_table("c") == sched.pool.block_table("p")
    assert check_pool(sched.pool.snapshot()) == []
    while sched.has_unfinished:
        core.step(20.0)
    assert parent.num_output_tokens == 4 and child.num_output_tokens == 3
    assert sched.pool.num_free_blocks == PARENT_CFG.num_blocks


@pytest.mark.mutation_kill
def test_fork_without_room_waits_as_preempted_in_arrival_order() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=1, block_size=2, num_blocks=8, max_model_len=16
    )
    sched, core, parent = _decoding_parent(cfg)
    later = Request("z", [1, 2, 3], StopParams(max_tokens=2))
    sched.add_request(later)
    child = sched.fork("p", "c", 77, StopParams(max_tokens=2))
    assert child.status is S.PREEMPTED
    assert sched.running == [parent]
    assert sched.waiting == [child, later]  # the sibling keeps the parent's place
    assert not sched.pool.has_request("c")
    assert child.num_computed_tokens == 0
    while sched.has_unfinished:
        core.step(20.0)
    assert child.status is S.FINISHED and child.num_output_tokens == 2
    assert child.token_ids[:6] == [5, 6, 7, 8, 9, 77]


@pytest.mark.mutation_kill
def test_fork_that_can_never_fit_is_finished_with_capacity() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=1, block_size=1, num_blocks=5, max_model_len=16
    )
    sched, _, parent = _decoding_parent(cfg)
    child = sched.fork("p", "c", 77, StopParams(max_tokens=2))
    assert child.status is S.FINISHED
    assert child.finish_reason is FinishReason.CAPACITY
    assert "c" not in sched.requests and sched.retired[-1] is child
    assert child not in sched.waiting and sched.running == [parent]


@pytest.mark.mutation_kill
def test_fork_fits_exactly_when_blocks_equal_the_pool() -> None:
    # 6 tokens in blocks of 2 need 3 of 3 blocks: not "never fits", so it waits.
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=1, block_size=2, num_blocks=3, max_model_len=16
    )
    sched, _, _ = _decoding_parent(cfg)
    child = sched.fork("p", "c", 77, StopParams(max_tokens=2))
    assert child.status is S.PREEMPTED and sched.waiting == [child]


@pytest.mark.mutation_kill
def test_a_requeued_parent_goes_ahead_of_its_waiting_fork() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=1, block_size=4, num_blocks=32, max_model_len=64
    )
    sched = decoding_scheduler(cfg, make_request("p", 3))
    child = sched.fork("p", "c", 9, StopParams(2))
    assert sched.waiting == [child] and child.seq == sched.requests["p"].seq
    sched.pause("p", KVRetention.DROP)
    sched.resume("p", [1], StopParams(2))
    assert [r.request_id for r in sched.waiting] == ["p", "c"]


@pytest.mark.mutation_kill
def test_a_fork_keeps_the_parents_tenant_and_namespace() -> None:
    ns = Namespace(model="m", adapter="lora-1")
    parent = Request("p", [1, 2, 3], StopParams(4), tenant="T", namespace=ns)
    sched = decoding_scheduler(SMALL_CONFIG, parent)
    child = sched.fork("p", "c", 9, StopParams(2))
    assert child.tenant == "T" and child.namespace == ns
    assert sched.pool.block_table("c") == sched.pool.block_table("p")


@pytest.mark.mutation_kill
def test_a_fork_that_can_never_fit_finishes_at_the_last_step_start() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=1, block_size=1, num_blocks=5, max_model_len=16
    )
    sched = Scheduler(cfg)
    sched.add_request(make_request("p", 5, 4))
    commit_step(sched, 10.0)  # the child would hold 5 + 1 tokens: 6 blocks of 1, the pool has 5
    child = sched.fork("p", "c", 9, StopParams(2))
    assert child.finish_reason is FinishReason.CAPACITY and child.finished_ms == 10.0


@pytest.mark.mutation_kill
def test_fork_refusals() -> None:
    sched, _, parent = _decoding_parent()
    stop = StopParams(max_tokens=2)
    with pytest.raises(UnknownRequest, match=r"^fork: unknown request id 'ghost'$"):
        sched.fork("ghost", "c", 1, stop)
    with pytest.raises(DuplicateRequest, match=r"^fork: request id 'p' is already in use$"):
        sched.fork("p", "p", 1, stop)
    for bad in (-1, True, 1.0):
        with pytest.raises(InvalidArgument, match=r"^fork: bad first token .* for 'c'$"):
            sched.fork("p", "c", bad, stop)  # type: ignore[arg-type]
    # A child its first token already finishes would sample past its stop (KVLEN).
    for done, first in ((StopParams(max_tokens=1), 1), (StopParams(2, stop_token_ids=(7,)), 7)):
        with pytest.raises(InvalidArgument, match=r"^fork: child 'c' is finished by its first"):
            sched.fork("p", "c", first, done)
    assert "c" not in sched.requests
    sched.fork("p", "c", 0, stop)  # token 0 is fine
    assert sched.requests["c"].token_ids[-1] == 0
    # A parent that is not decoding, or has sampled more than one token.
    waiting = Request("w", [1, 2, 3], stop)
    sched.add_request(waiting)
    with pytest.raises(InvalidArgument, match=r"^fork: parent 'w' must be decoding"):
        sched.fork("w", "d", 1, stop)
    core = EngineCore(sched, SimExecutor(StepCost(), sched.requests), check_invariants=True)
    core.step(11.0)
    assert parent.num_output_tokens == 2
    with pytest.raises(InvalidArgument, match=r"\(status decoding, 2 sampled\)$"):
        sched.fork("p", "d", 1, stop)
    assert "d" not in sched.requests


@pytest.mark.mutation_kill
def test_finish_retires_a_running_request_with_the_given_reason() -> None:
    sched, _, parent = _decoding_parent()
    sched.finish("p", FinishReason.STOP, 42.5)
    assert parent.status is S.FINISHED
    assert parent.finish_reason is FinishReason.STOP
    assert parent.finished_ms == 42.5
    assert "p" not in sched.requests and parent not in sched.running
    assert sched.retired[-1] is parent
    assert not sched.pool.has_request("p")
    assert sched.pool.num_free_blocks == PARENT_CFG.num_blocks
    with pytest.raises(UnknownRequest, match=r"^finish: unknown request id 'p'$"):
        sched.finish("p", FinishReason.STOP)


@pytest.mark.mutation_kill
def test_finish_and_fork_refuse_mid_step() -> None:
    sched, _, _ = _decoding_parent()
    sched.schedule(0.0)
    with pytest.raises(StepInProgress, match=r"^finish: a step is in progress"):
        sched.finish("p", FinishReason.STOP)
    with pytest.raises(StepInProgress, match=r"^fork: a step is in progress"):
        sched.fork("p", "c", 1, StopParams(max_tokens=4))
    sched.rollback()
    assert sched.requests["p"].status is S.DECODING
