"""The loop's transfer point (ref/core/hooks.py ``TransferPoint``): what a migration may do
to a scheduler, ``require_boundary``, ``join`` and ``leave``, at a step boundary."""

from __future__ import annotations

import pytest

from refserve.core.config import SchedulerConfig
from refserve.core.hooks import TransferPoint
from refserve.core.loop import SchedulerLoop, StepInProgress
from refserve.core.request import RequestStatus
from refserve.core.scheduler import Scheduler
from refserve.errors import UnknownRequest
from tests.harness import commit_step, decoding_scheduler, make_request

CFG = SchedulerConfig(num_blocks=16, block_size=4, max_num_batched_tokens=64)


def test_leave_returns_every_block_and_forgets_the_request() -> None:
    sched = decoding_scheduler(CFG, make_request("a", 5), make_request("b", 6, base=50))
    free = sched.pool.num_free_blocks
    held = len(sched.pool.block_table_view("a"))
    r = sched.leave("a")
    assert r.request_id == "a" and r.status is RequestStatus.DECODING  # not retired
    assert "a" not in sched.requests and [x.request_id for x in sched.running] == ["b"]
    assert sched.pool.num_free_blocks == free + held and sched.retired == []
    commit_step(sched)  # the loop steps on without it


def test_leave_of_an_unknown_request_is_a_typed_error() -> None:
    sched = SchedulerLoop(CFG)
    with pytest.raises(UnknownRequest, match="leave"):
        sched.leave("nobody")


def test_leave_and_require_boundary_refuse_inside_a_step() -> None:
    sched = decoding_scheduler(CFG, make_request("a", 5))
    plan = sched.schedule()
    with pytest.raises(StepInProgress, match="leave: a step is in progress"):
        sched.leave("a")
    with pytest.raises(StepInProgress, match="export: a step is in progress"):
        sched.require_boundary("export")
    sched.rollback()
    del plan
    sched.require_boundary("export")  # a boundary again


@pytest.mark.parametrize(
    ("status", "kv", "place"),
    [
        (RequestStatus.WAITING, False, "waiting"),
        (RequestStatus.DECODING, True, "running"),
        (RequestStatus.WAITING_TOOL, False, "paused"),
    ],
)
def test_join_places_a_request_where_its_status_says(
    status: RequestStatus, kv: bool, place: str
) -> None:
    sched = Scheduler(CFG)
    sched.add_request(make_request("first", 3, base=90))
    r = make_request("m", 5)
    if kv:  # its K/V arrived: its blocks are the pool's already
        sched.pool.allocate("m", r.token_ids, 5)
        r.num_computed_tokens = 5
        r.token_ids.append(7)
    r.status = status
    sched.join(r)
    assert sched.requests["m"] is r and r.seq == 1 and r.queued_step == sched.step_index
    where = {
        "waiting": [x.request_id for x in sched.waiting],
        "running": [x.request_id for x in sched.running],
        "paused": list(sched.paused),
    }
    assert "m" in where[place]
    assert sum("m" in ids for ids in where.values()) == 1


def test_the_scheduler_is_a_transfer_point() -> None:
    point: TransferPoint = Scheduler(CFG)
    assert point.requests == {}
