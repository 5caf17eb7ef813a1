"""The scheduler with layer groups (``SchedulerConfig.kv_groups``): a bad layout, or one
combined with what does not carry every group's tables yet, is a typed error naming it
(a host pool for swaps is not, nor the mlfq policy, nor are speculative drafts:
each counts or carries every group's blocks); a draft leaves each later decode one
block in every group; a grouped allocation that fails inside a running step changes
no group, and a failed step rolls every group back.
"""

from __future__ import annotations

from typing import Any

import pytest

from refserve.cli.main import main
from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.engine_core import EngineCore
from refserve.core.executor import StepOutput
from refserve.core.inputs import ModelInputs
from refserve.core.plan import StepPlan
from refserve.core.request import FinishReason, Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.core.speculation import Proposals
from refserve.errors import ExceedsCapacity, InvalidArgument, OutOfBlocks
from refserve.kv import BlockPool
from refserve.kv.groups import GroupedPool
from refserve.sim.simulator import SimExecutor, SimSpeculation
from refserve.spec.groups import NULL_BLOCK, GroupKind, KVGroup, check_groups, layout_blocks

FULL = KVGroup(GroupKind.FULL)
WIN = KVGroup(GroupKind.WINDOW, 6)
BS = 4


# ------------------------------------------------------------------- bad config
@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"kv_groups": [FULL, WIN]}, r"kv_groups must be a tuple of KVGroup, got \[KVGroup"),
        ({"kv_groups": (FULL, "window")}, r"kv_groups must be a tuple of KVGroup, got .*'window'"),
        ({"kv_groups": (WIN, FULL)}, r"kv_groups\[0\] must be a full attention group, got .*6"),
        ({"kv_groups": (WIN,)}, r"kv_groups\[0\] must be a full attention group"),
    ],
)
def test_a_bad_layout_is_named(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        SchedulerConfig(block_size=BS, **fields)


def test_a_grouped_layout_takes_a_host_pool_for_swaps(capsys: pytest.CaptureFixture[str]) -> None:
    """Swaps and tool waits on the host carry every group's blocks (ref/kv/host_pool.py),
    so a grouped layout with a host pool is accepted, in a config and on the CLI."""
    cfg = SchedulerConfig(
        block_size=BS, kv_groups=(FULL, WIN), num_host_blocks=4, preemption_mode="swap"
    )
    sched = Scheduler(cfg)
    assert isinstance(sched.pool, GroupedPool) and sched.host.groups == (FULL, WIN)
    # A request of 9 tokens holds 3 full blocks and, reading from position 4 with a
    # window of 6, the window group's blocks 1 and 2: 5 host blocks, more than 4.
    assert sched.host.blocks_for(9) == 5 and not sched.host.can_hold(9)
    assert sched.host.blocks_for(8) == 4 and sched.host.can_hold(8)
    argv = ["simulate", "seed002", "--kv-groups", "full,window:6", "--num-host-blocks", "8"]
    assert main([*argv, "--preemption-mode", "swap", "--num-blocks", "6", "--check"]) == 0
    assert "3/3 requests finished" in capsys.readouterr().out


def test_a_grouped_layout_takes_the_mlfq_policy(capsys: pytest.CaptureFixture[str]) -> None:
    """The multi-level queue counts its displacements' blocks over every group
    (ref/core/mlfq.py), so a grouped layout runs it, in a config and on the CLI."""
    cfg = SchedulerConfig(block_size=BS, kv_groups=(FULL, WIN), policy="mlfq")
    assert isinstance(Scheduler(cfg).pool, GroupedPool)
    argv = ["simulate", "seed002", "--kv-groups", "full,window:6", "--policy", "mlfq"]
    assert main([*argv, "--num-host-blocks", "8", "--num-blocks", "6", "--check"]) == 0
    assert "3/3 requests finished" in capsys.readouterr().out


def _two_decodes(per_decode: int | None = None) -> StepPlan:
    """a (3 tokens of KV, decoding at position 3 inside its first block) proposes one
    draft, at position 4: a new block in each group, 2 of the 3 free. b, decoding after
    it at position 4, needs 2 as well. The plan of that step (``per_decode``: the
    blocks the draft rule leaves each later decode, if not the pool's own count)."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=16,
        max_num_seqs=2,
        block_size=BS,
        num_blocks=7,
        max_model_len=32,
        kv_groups=(FULL, WIN),
        num_speculative_tokens=2,
    )
    sched = Scheduler(cfg)
    # The simulator's verification (every draft rejected); its own proposals withdrawn.
    executor = SimExecutor(
        StepCost(), sched.requests, speculation=SimSpeculation(0.0), scheduler=sched
    )
    core = EngineCore(sched, executor, check_invariants=True)
    sched.add_request(Request("a", [1, 2, 3], StopParams(8, ignore_eos=True)))
    sched.add_request(Request("b", [5, 6, 7, 8], StopParams(8, ignore_eos=True)))
    core.step(0.0)  # both prompts: 4 of the 7 blocks
    assert sched.pool.num_free_blocks == 3
    proposals = sched.proposals
    assert isinstance(proposals, Proposals) and proposals.per_decode == 2
    if per_decode is not None:
        proposals.per_decode = per_decode
    sched.propose("a", [9])
    sched.propose("b", [])
    return core.step(1.0).plan


def test_a_draft_leaves_each_later_decode_a_block_in_every_group() -> None:
    """On a grouped pool a decode may take a block in each group: a's draft would leave
    1 free block for b's 2, so it is dropped, and both decode. Counting one block per
    later decode (the plain pool's rule), a verifies its draft and b, finding no room
    and no victim (a request given tokens is never one), waits out the step."""
    plan = _two_decodes()
    assert (plan.drafts, plan.request_ids, plan.preempted) == ({}, ("a", "b"), ())
    plain_rule = _two_decodes(per_decode=1)
    assert (plain_rule.drafts, plain_rule.request_ids) == ({"a": (9,)}, ("a",))


def test_one_full_group_is_the_plain_pool_and_keeps_every_feature() -> None:
    cfg = SchedulerConfig(
        block_size=BS, kv_groups=(FULL,), num_host_blocks=4, num_speculative_tokens=2
    )
    assert not cfg.grouped
    assert type(Scheduler(cfg).pool) is BlockPool
    grouped = Scheduler(SchedulerConfig(block_size=BS, kv_groups=(FULL, WIN, FULL)))
    assert isinstance(grouped.pool, GroupedPool) and grouped.pool.groups == (FULL, WIN, FULL)


# ------------------------------------------------------------ failures in a step
class Boom(Exception):
    """The step fails on purpose."""


class ProbingExecutor(SimExecutor):
    """The simulator; while a step runs (its allocations made, its transaction open),
    ``probe`` may try allocations of its own and ask the step to fail."""

    def __init__(self, sched: Scheduler) -> None:
        super().__init__(StepCost(), sched.requests, block_size=sched.config.block_size)
        self.probe: Any = None

    def execute(self, plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
        if self.probe is not None and self.probe(plan):
            raise Boom("the step fails after a refused allocation")
        return super().execute(plan, inputs)


def test_a_refused_allocation_in_a_step_changes_no_group_and_the_step_rolls_back() -> None:
    """Mid-step, request a could release a window block before its next allocation; an
    allocation too big for the free blocks (OutOfBlocks), or for the pool
    (ExceedsCapacity), must leave every group as the step left it, that window block
    included. The step then fails, and every group is as before it."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=16,
        max_num_seqs=2,
        block_size=BS,
        num_blocks=14,
        max_model_len=40,
        kv_groups=(FULL, WIN),
    )
    sched = Scheduler(cfg)
    pool = sched.pool
    assert isinstance(pool, GroupedPool)
    executor = ProbingExecutor(sched)
    core = EngineCore(sched, executor, check_invariants=True)
    a = Request("a", list(range(1, 13)), StopParams(12, ignore_eos=True))
    b = Request("b", list(range(50, 58)), StopParams(12, ignore_eos=True))
    sched.add_request(a)
    sched.add_request(b)
    tried: list[int] = []

    def probe(plan: StepPlan) -> bool:
        table = pool.grouped_snapshot().table("a", 0)
        if table is None:
            return False
        stored = table.num_stored  # after this step's allocation
        window_table = pool.block_tables("a")[1]
        first = pool.first_read_block(1, stored)
        if not any(b != NULL_BLOCK for b in window_table[:first]):
            return False  # nothing a's next allocation would release: not yet
        n = next(
            n
            for n in range(1, 64)
            if not pool.can_allocate("a", n)
            or layout_blocks(cfg.kv_groups, stored, n, BS) > cfg.num_blocks
        )
        assert layout_blocks(cfg.kv_groups, stored, n, BS) <= cfg.num_blocks, "no room, not never"
        known = [*a.token_ids, *range(900, 900 + 64)]
        during = pool.grouped_snapshot()
        with pytest.raises(OutOfBlocks):
            pool.allocate("a", known, n)
        assert pool.grouped_snapshot() == during and pool.in_transaction
        with pytest.raises(ExceedsCapacity):
            pool.allocate("a", known, 60)
        assert pool.grouped_snapshot() == during and pool.in_transaction
        tried.append(stored)
        return True

    executor.probe = probe
    clock = 0.0
    for _ in range(40):
        before, grouped_before = sched.snapshot(), pool.grouped_snapshot()
        index = sched.step_index
        try:
            clock = core.step(clock).end_ms
        except Boom:
            assert sched.snapshot() == before and pool.grouped_snapshot() == grouped_before
            assert sched.step_index == index and not pool.in_transaction
            break
        assert check_groups(pool.grouped_snapshot()) == []
    assert tried, "the scenario never reached a pending window release"
    executor.probe = None
    while sched.has_unfinished:
        clock = core.step(clock).end_ms
        assert check_groups(pool.grouped_snapshot()) == []
    assert a.finish_reason is FinishReason.LENGTH and b.finish_reason is FinishReason.LENGTH
    assert pool.num_free_blocks == cfg.num_blocks
