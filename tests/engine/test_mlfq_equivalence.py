"""The skip-join multi-level feedback queue (``policy="mlfq"``) on the real model: greedy
outputs token for token those of transformers' ``generate`` run alone, while the policy
demotes, promotes and displaces requests, their K/V going to the host and back (or,
without proactive swap, recomputed).

Every engine runs with ``check_invariants=True``, and the policy's own rules
(spec/mlfq.py) are read off its snapshot after every step. Each scenario also asserts
that what it is about happened: an equivalence that held because nothing was ever
displaced would prove nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch
from hf_oracle import HFOracle, random_prompt

from refserve.core.config import PolicyName, SchedulerConfig
from refserve.core.mlfq import SkipJoinMlfq
from refserve.core.mlfq_settings import MlfqSettings
from refserve.engine.llm_engine import LLMEngine, RequestOutput
from refserve.model.sampler import SamplingParams
from refserve.spec.mlfq import check_mlfq


@dataclass(frozen=True)
class Job:
    rid: str
    prompt_len: int
    max_tokens: int
    arrive_step: int


@dataclass
class MlfqRun:
    engine: LLMEngine
    policy: SkipJoinMlfq
    prompts: dict[str, list[int]]
    finals: dict[str, RequestOutput] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)  # of every displacement, in order
    # Per request, read off the policy's books while it lives (they go when it finishes).
    joined: dict[str, int] = field(default_factory=dict)
    demotions: dict[str, int] = field(default_factory=dict)
    promotions: dict[str, int] = field(default_factory=dict)


# Long prompts first (they skip-join levels 1 and 2), then short ones (level 0) that
# arrive while the long ones decode and find the seats taken.
JOBS = (
    Job("long0", 18, 14, 0),
    Job("long1", 11, 16, 0),
    Job("long2", 20, 10, 1),
    Job("short0", 3, 6, 4),
    Job("short1", 2, 9, 6),
    Job("mid0", 9, 8, 7),
    Job("short2", 4, 5, 10),
    Job("short3", 3, 7, 13),
)


def _config(*, proactive_swap: bool) -> SchedulerConfig:
    # Quanta of 4 and 8 ms, then unbounded; three seats and 12 blocks of 4 tokens for
    # eight requests of up to 34 tokens: displacement for seats, for blocks, and (with
    # proactive swap) for the running requests' headroom.
    return SchedulerConfig(
        max_num_batched_tokens=16,
        max_num_seqs=3,
        block_size=4,
        num_blocks=12,
        num_host_blocks=64,
        policy=PolicyName.MLFQ,
        mlfq=MlfqSettings(
            num_queues=3,
            base_quantum_ms=4.0,
            starvation_steps=12,
            proactive_swap=proactive_swap,
        ),
    )


def run_jobs(hf: HFOracle, cfg: SchedulerConfig, jobs: Sequence[Job]) -> MlfqRun:
    engine = LLMEngine(str(hf.path), scheduler_config=cfg, check_invariants=True)
    policy = engine.scheduler.policy
    assert isinstance(policy, SkipJoinMlfq)
    g = torch.Generator().manual_seed(21)
    run = MlfqRun(engine, policy, {j.rid: random_prompt(g, j.prompt_len) for j in jobs})
    pending = sorted(jobs, key=lambda j: j.arrive_step)
    step = 0
    while pending or engine.has_unfinished:
        while pending and pending[0].arrive_step <= step:
            j = pending.pop(0)
            engine.add_request(
                run.prompts[j.rid], SamplingParams(max_tokens=j.max_tokens), request_id=j.rid
            )
        for out in engine.step():
            if out.finished:
                run.finals[out.request_id] = out
        sched = engine.scheduler
        snap = policy.snapshot(sched.requests, sched.running, engine.steps[-1].step_index + 1)
        assert check_mlfq(snap) == [], check_mlfq(snap)
        run.reasons.extend(d.reason for d in snap.displaced)
        for rid, b in policy.books.items():
            run.joined[rid] = b.joined_level
            run.demotions[rid] = b.num_demotions
            run.promotions[rid] = b.num_promotions
        step += 1
        assert step < 1000, "engine did not finish"
    pool, host = engine.scheduler.pool, engine.scheduler.host
    assert pool.num_free_blocks == pool.num_blocks
    assert host.num_free_blocks == host.num_blocks
    return run


def assert_matches_hf(hf: HFOracle, run: MlfqRun, jobs: Sequence[Job]) -> None:
    for j in jobs:
        want = hf.greedy(run.prompts[j.rid], j.max_tokens)
        got = run.finals[j.rid].token_ids
        assert got == want, f"{j.rid}: {got} != HF {want}"


@pytest.mark.parametrize("proactive_swap", [True, False], ids=["swap", "recompute"])
def test_mlfq_outputs_match_transformers(hf: HFOracle, proactive_swap: bool) -> None:
    run = run_jobs(hf, _config(proactive_swap=proactive_swap), JOBS)
    assert_matches_hf(hf, run, JOBS)
    policy, engine = run.policy, run.engine
    steps = engine.steps
    preempted = [rid for s in steps for rid in s.plan.preempted]
    swapped_out = [rid for s in steps for rid in s.plan.swapped_out]
    swapped_in = [rid for s in steps for rid in s.plan.swapped_in]
    # The skip-join spread the arrivals over the levels; quanta ran out; requests waited
    # past the starvation bound; requests were displaced for the seats and blocks of
    # higher ones.
    assert set(run.joined.values()) == {0, 1, 2}
    assert sum(run.demotions.values()) >= 8
    assert sum(run.promotions.values()) >= 2
    assert policy.num_displaced == len(run.reasons) >= 6
    assert {"seat", "blocks"} <= set(run.reasons)
    assert sum(run.finals[j.rid].metrics.num_preemptions for j in JOBS) == len(preempted)
    assert len(preempted) >= policy.num_displaced
    # Each displacement is in its request's metrics, with the choice and its inputs.
    choices = [c for j in JOBS for c in run.finals[j.rid].metrics.displacements]
    assert len(choices) == policy.num_displaced
    assert all(c.kv_tokens > 0 and c.host_free_blocks > 0 for c in choices)
    assert {c.to_host for c in choices} == {proactive_swap}
    preemptions = {(rid, s.step_index) for s in steps for rid in s.plan.preempted}
    assert {(c.request_id, c.step_index) for c in choices} <= preemptions
    sched = engine.scheduler
    if proactive_swap:
        # Displaced K/V went to the host and came back: the outputs depend on the copies.
        assert "headroom" in run.reasons and policy.num_headroom_swaps >= 1
        assert sched.num_swapped_out_blocks > 0
        assert sched.num_swapped_in_blocks == sched.num_swapped_out_blocks
        assert sorted(swapped_out) == sorted(swapped_in)
        assert len(swapped_out) >= policy.num_displaced
    else:
        # Every victim recomputed, though the host pool had room for all of them.
        assert sched.num_swapped_out_blocks == 0 and not swapped_out
        assert policy.num_headroom_swaps == 0 and "headroom" not in run.reasons
