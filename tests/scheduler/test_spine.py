"""The spine runs alone (docs/ARCHITECTURE.md, "The core and what attaches to it").

``SchedulerLoop`` with no attachment plugged in (its null suspension manager, no proposal
source, no decode strategy) must schedule exactly what the assembled ``Scheduler`` does
on a workload none of the attachments is asked for: preemption by recompute, no drafts,
no forks, no tool waits. The assembled one takes its bulk decode path where it can, so
this also holds the spine's per-request path to the bulk one (as the differential test
does), from the other side: every attachment is additive.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refserve.core.config import SchedulerConfig
from refserve.core.hooks import NoProposals, NoSuspension
from refserve.core.loop import SchedulerLoop
from refserve.core.request import RequestStatus
from refserve.core.scheduler import Scheduler
from refserve.spec import check_pool
from tests.harness import make_request, sampled_tokens

Arrival = tuple[int, int, int]  # step, prompt length, max tokens


@st.composite
def workloads(draw: st.DrawFn) -> tuple[SchedulerConfig, list[Arrival]]:
    block_size = draw(st.sampled_from([1, 2, 4]))
    cfg = SchedulerConfig(
        block_size=block_size,
        num_blocks=draw(st.integers(6, 24)),
        max_num_batched_tokens=draw(st.integers(4, 24)),
        max_num_seqs=draw(st.integers(1, 6)),
        enable_prefix_caching=draw(st.booleans()),
    )
    arrivals = draw(
        st.lists(
            st.tuples(st.integers(0, 10), st.integers(1, 12), st.integers(1, 10)),
            min_size=1,
            max_size=8,
        )
    )
    return cfg, arrivals


@settings(max_examples=60, deadline=None)
@given(workloads())
def test_the_bare_loop_schedules_what_the_assembled_scheduler_does(
    work: tuple[SchedulerConfig, list[Arrival]],
) -> None:
    cfg, arrivals = work
    bare, full = SchedulerLoop(cfg), Scheduler(cfg)
    for step in range(120):
        for i, (at, n, max_tokens) in enumerate(arrivals):
            if at == step and n < cfg.num_blocks * cfg.block_size:
                for s in (bare, full):
                    s.add_request(make_request(f"r{i}", n, max_tokens, base=10 * i))
        if step > 10 and not full.has_unfinished:
            break
        now = float(step)
        plan, same = bare.schedule(now), full.schedule(now)
        assert plan == same, f"step {step}: plans differ"
        tokens = sampled_tokens(plan, token=3)
        bare.commit(plan, tokens, now)
        full.commit(same, tokens, now)
        assert bare.snapshot() == full.snapshot(), f"step {step}: states differ"
        assert check_pool(bare.pool.snapshot()) == []
    assert not bare.has_unfinished


def test_the_bare_loop_has_the_null_attachments() -> None:
    sched = SchedulerLoop(SchedulerConfig(num_blocks=8, block_size=4))
    assert isinstance(sched.suspension, NoSuspension)
    assert isinstance(sched.proposals, NoProposals)
    assert sched.decodes is None


def test_a_bare_victim_is_preempted_to_recompute() -> None:
    """With the null suspension manager a victim's blocks are dropped (never swapped)."""
    cfg = SchedulerConfig(num_blocks=4, block_size=2, max_num_batched_tokens=16)
    sched = SchedulerLoop(cfg)
    for i in range(2):
        sched.add_request(make_request(f"r{i}", 3, 8, base=10 * i))
    seen: set[RequestStatus] = set()
    for step in range(40):
        if not sched.has_unfinished:
            break
        plan = sched.schedule(float(step))
        sched.commit(plan, sampled_tokens(plan), float(step))
        seen |= {r.status for r in sched.requests.values()}
    assert RequestStatus.PREEMPTED in seen and RequestStatus.SWAPPED not in seen
    assert not sched.has_unfinished


def test_the_bare_loop_refuses_a_migrated_tool_wait() -> None:
    """A request in a state only an attachment keeps cannot join the bare loop."""
    sched = SchedulerLoop(SchedulerConfig(num_blocks=8, block_size=4))
    r = make_request("r", 3)
    r.status = RequestStatus.WAITING_TOOL
    with pytest.raises(AssertionError, match="no suspension manager"):
        sched.join(r)
