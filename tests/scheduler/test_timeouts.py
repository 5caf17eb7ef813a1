"""Queue timeouts: a request that waits longer than ``queue_timeout_ms`` is rejected.

The limit is strict (a request exactly at it still runs), it is checked before
admission, and a request admitted once is never timed out again.
"""

from __future__ import annotations

import pytest
from harness import COST, commit_step, decoding_scheduler, make_request, sampled_tokens

from refserve.core.config import SchedulerConfig
from refserve.core.request import FinishReason, StopParams
from refserve.core.scheduler import Scheduler
from refserve.core.swap import KVRetention
from refserve.sim.simulator import simulate
from refserve.spec.snapshot import RequestStatus as S


@pytest.mark.mutation_kill
def test_queue_timeout_is_strictly_after_the_limit_and_skips_admission() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_blocks=32, queue_timeout_ms=10
    )
    sched = Scheduler(cfg)
    sched.add_request(make_request("w", 5, 2, arrival_ms=1.0))
    sched.add_request(make_request("v", 5, 2, base=50, arrival_ms=2.0))
    plan = sched.schedule(11.0)  # w waited exactly 10 ms: not yet timed out
    assert plan.finished == () and plan.admitted == ("w", "v")
    sched.rollback()
    plan = sched.schedule(11.5)  # w is past the limit, v is not
    assert [(f.request_id, f.reason) for f in plan.finished] == [("w", FinishReason.TIMEOUT)]
    assert plan.admitted == ("v",) and plan.request_ids == ("v",)  # w is not admitted
    events = sched.commit(plan, sampled_tokens(plan), 12.0)
    assert events.finished == ("w",)
    w = sched.retired[-1]
    assert w.request_id == "w" and w.status is S.FINISHED
    assert w.finish_reason is FinishReason.TIMEOUT and w.finished_ms == 12.0
    assert sched.num_timeouts == 1 and sched.waiting == [] and "w" not in sched.requests
    sched.add_request(make_request("u", 5, 2, base=90, arrival_ms=2.0))
    plan, events = commit_step(sched, 20.0)
    assert events.finished == ("v", "u")  # v's second token, then u's timeout
    assert sched.num_timeouts == 2


@pytest.mark.mutation_kill
def test_queue_timeout_spares_a_request_that_was_admitted_before() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_blocks=32, queue_timeout_ms=10
    )
    sched = decoding_scheduler(cfg, make_request("a", 5, 8))
    a = sched.requests["a"]
    sched.pause("a", KVRetention.DROP)
    sched.resume("a", [9], StopParams(2))  # waits again, with admitted_ms set
    assert a.status is S.WAITING and a.admitted_ms == 0.0
    plan, _ = commit_step(sched, 50.0)
    assert plan.finished == () and plan.admitted == ("a",)
    assert sched.num_timeouts == 0
    assert a.admitted_ms == 0.0  # the first admission time is kept


def test_queue_timeout_reason_is_recorded() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=4, max_num_seqs=1, block_size=4, num_blocks=16, queue_timeout_ms=10.0
    )
    sched = Scheduler(cfg)
    reqs = [make_request("long", 4, 12), make_request("patient", 2, 2, base=50)]
    simulate(sched, reqs, COST, check_invariants=True)
    assert reqs[0].finish_reason is FinishReason.LENGTH
    assert reqs[1].finish_reason is FinishReason.TIMEOUT and reqs[1].num_output_tokens == 0
    assert reqs[1].finished_ms is not None and reqs[1].finished_ms - reqs[1].arrival_ms > 10.0
    assert sched.num_timeouts == 1 and sched.pool.num_used_blocks == 0
