"""Failed steps change no token: K/V memory is part of the step's
transaction (ref/core/executor.py, ref/model/executor.py; docs/ARCHITECTURE.md, "Atomic steps").

The executor fails on purpose at a drawn point of a drawn step (``ModelExecutor``'s
``fault_hook`` points, plus a sampled token the scheduler must reject): 15 % of steps,
50 % of those that preempt or swap, and always the forward of the first step that
preempts; the engine is stepped again, and the greedy outputs must equal a fault-free
run's and transformers' ``generate``, token for token, in every preemption mode, on a
workload that preempts, swaps, hits and evicts the prefix cache (asserted). Every
failed step is also checked directly: the device and host K/V after it equal the K/V
before it, bit for bit.

Why the memory must be restored: a step that preempts a victim hands the victim's freed
block to another request, whose forward writes there. If the step then fails, the
scheduler's rollback gives the block back to the victim, but without the executor's
rollback its K/V holds the other request's token at that position. In swap mode the
retry copies the damaged block to the host
(:func:`test_smallest_case_fails_without_kv_rollback`); in recompute mode a retry of the
same plan preempts the victim again, which hides the damage until the retry differs, e.g.
after an abort (:func:`test_victim_kept_after_a_failed_preemption_reads_its_own_kv`).
Both show the tokens then change, so the comparisons here can fail.
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch
from hf_oracle import HFOracle, random_prompt

from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.engine_core import KVStateLost
from refserve.core.executor import StepOutput
from refserve.core.executor_output import BadExecutorOutput
from refserve.core.inputs import ModelInputs
from refserve.core.plan import StepPlan
from refserve.core.swap import SwapCost
from refserve.engine.llm_engine import LLMEngine
from refserve.model.executor import FAULT_POINTS, ModelExecutor
from refserve.model.sampler import SamplingParams

BAD_OUTPUT = "bad_output"  # a sampled token validate_output rejects (after the forward)


class InjectedFault(Exception):
    """The executor fails on purpose."""


@dataclass
class Faults:
    """Draws a fault point per step and checks that each failed step left K/V untouched."""

    engine: LLMEngine
    rng: random.Random
    rate: float
    only: tuple[str, ...] = (*FAULT_POINTS, BAD_OUTPUT)
    # "random"; "first_preemption": one fault, in the first step that preempts; or
    # "never" (the test arms ``armed`` itself).
    when: str = "random"
    armed: str | None = None
    plan: StepPlan | None = None
    saved: list[torch.Tensor] = field(default_factory=list)
    fired: Counter[str] = field(default_factory=Counter)
    failed_plans: list[StepPlan] = field(default_factory=list)

    def memory(self) -> list[torch.Tensor]:
        e = self.engine
        return [*e.cache.key, *e.cache.value, *e.host_cache.key, *e.host_cache.value]

    def install(self) -> None:
        ex = self.engine.executor
        begin, execute = ex.begin, ex.execute

        def drawing_begin(plan: StepPlan, inputs: ModelInputs | None) -> None:
            self.plan = plan
            self.armed = None
            # Steps that move blocks between owners are where lost K/V would show: fail
            # them more often than the others.
            moves = plan.preempted or plan.swap_out or plan.swap_in
            rate = max(self.rate, 0.5) if moves else self.rate
            if self.when == "random" and self.rng.random() < rate:
                self.armed = self.rng.choice(self.only)
            forced = any(p.preempted for p in self.failed_plans)
            if self.when == "random" and plan.preempted and not forced:
                # However the draws fall, the forward of a step that hands a victim's
                # blocks to others fails at least once (the case of the module doc).
                self.armed = "after_forward"
            elif self.when == "first_preemption" and plan.preempted and not self.fired:
                self.armed = self.only[0]
            # The whole cache is a few KiB here: keep all of it to compare after a failure.
            self.saved = [t.clone() for t in self.memory()]
            begin(plan, inputs)

        def hook(point: str) -> None:
            if point == self.armed:
                self._fire(point)
                raise InjectedFault(point)

        def bad_execute(plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
            out = execute(plan, inputs)
            if self.armed == BAD_OUTPUT and out.sampled:
                self._fire(BAD_OUTPUT)
                first = next(iter(out.sampled))
                return StepOutput({**out.sampled, first: -1}, out.duration_ms)
            return out

        ex.begin = drawing_begin  # type: ignore[method-assign]
        ex.execute = bad_execute  # type: ignore[method-assign]
        ex.fault_hook = hook

    def _fire(self, point: str) -> None:
        self.armed = None
        self.fired[point] += 1
        assert self.plan is not None
        self.failed_plans.append(self.plan)

    def assert_restored(self) -> None:
        for before, now in zip(self.saved, self.memory(), strict=True):
            assert torch.equal(before, now), "a failed step left K/V changed"


@dataclass
class FaultRun:
    outputs: dict[str, tuple[int, ...]]
    failures: int
    preemptions: int
    swapped_out: int
    evictions: int
    prefix_hit_tokens: int


def drive(
    engine: LLMEngine,
    jobs: Sequence[tuple[str, list[int], int, int]],
    faults: Faults | None,
    *,
    check_restored: bool = True,
) -> FaultRun:
    """Run ``jobs`` (id, prompt, max_tokens, arrival attempt) to the end, stepping again
    after every failed step. Arrivals count attempts, failed ones included, so a retry
    may plan differently from the step that failed (new requests join it)."""
    pending = sorted(jobs, key=lambda j: j[3])
    outputs: dict[str, tuple[int, ...]] = {}
    failures = evictions = 0
    attempt = 0
    while pending or engine.has_unfinished:
        while pending and pending[0][3] <= attempt:
            rid, prompt, m, _ = pending.pop(0)
            engine.add_request(prompt, SamplingParams(max_tokens=m), request_id=rid)
        keys = {e.key for e in engine.scheduler.pool.snapshot().cache_entries}
        try:
            outs = engine.step()
        except (InjectedFault, BadExecutorOutput):
            failures += 1
            if faults is not None and check_restored:
                faults.assert_restored()
        else:
            for o in outs:
                if o.finished:
                    assert o.request_id not in outputs, "a final output came twice"
                    outputs[o.request_id] = o.token_ids
            if keys - {e.key for e in engine.scheduler.pool.snapshot().cache_entries}:
                evictions += 1
        attempt += 1
        assert attempt < 2000, "engine did not finish"
    pool = engine.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks
    return FaultRun(
        outputs,
        failures,
        engine.num_preemptions,
        sum(len(s.plan.swapped_out) for s in engine.steps),
        evictions,
        engine.num_prefix_hit_tokens,
    )


def _cfg(mode: str, num_blocks: int, num_host_blocks: int) -> SchedulerConfig:
    # "auto": 3 ms per copy direction against 0.5 ms per recomputed token, so longer
    # victims swap and shorter ones recompute (test_swap_and_tool_equivalence.py).
    cost = SwapCost(kv_bytes_per_token=768, latency_ms=3.0, iteration=StepCost(b=0.5))
    return SchedulerConfig(
        max_num_batched_tokens=16,
        block_size=4,
        num_blocks=num_blocks,
        max_model_len=128,
        preemption_mode=mode,  # type: ignore[arg-type]  # the str form is accepted
        num_host_blocks=0 if mode == "recompute" else num_host_blocks,
        swap_cost=cost if mode == "auto" else None,
    )


# ---------------------------------------------------------------- the smallest case
def _smallest(
    hf: HFOracle, point: str = "after_forward", *, check_restored: bool = True
) -> tuple[FaultRun, Faults, list[tuple[str, list[int], int, int]]]:
    """Block size 4, 6 blocks, two 8-token prompts, 12 greedy tokens each, swap: one
    fault at ``point`` of the step that preempts (it swaps out the victim and hands
    its block to the other request's forward)."""
    engine = LLMEngine(str(hf.path), scheduler_config=_cfg("swap", 6, 8), check_invariants=True)
    faults = Faults(engine, random.Random(0), 0.0, only=(point,), when="first_preemption")
    faults.install()
    g = torch.Generator().manual_seed(0)
    jobs = [(f"r{i}", random_prompt(g, 8), 12, 0) for i in range(2)]
    return drive(engine, jobs, faults, check_restored=check_restored), faults, jobs


@pytest.mark.parametrize("point", ["after_forward", "in_sampler", BAD_OUTPUT])
def test_smallest_case_matches_transformers(hf: HFOracle, point: str) -> None:
    run, faults, jobs = _smallest(hf, point)
    assert faults.fired[point] == 1 and run.failures == 1
    (failed,) = faults.failed_plans
    assert failed.preempted and failed.swap_out  # the victim's blocks were handed on
    for rid, prompt, m, _ in jobs:
        assert run.outputs[rid] == hf.greedy(prompt, m), rid


def test_smallest_case_fails_without_kv_rollback(
    hf: HFOracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: with the executor's rollback a no-op (K/V kept as the
    failed step left it; the scheduler still rolls back), the swapped-out victim carries
    the other request's K/V and its greedy tokens change."""
    monkeypatch.setattr(ModelExecutor, "rollback", lambda self: None)
    run, faults, jobs = _smallest(hf, "after_forward", check_restored=False)
    assert faults.fired["after_forward"] == 1
    assert any(run.outputs[rid] != hf.greedy(prompt, m) for rid, prompt, m, _ in jobs)


# ---------------------------------------------------------------- random faults
def _jobs(seed: int) -> list[tuple[str, list[int], int, int]]:
    """Seven requests, most sharing a 9-token prefix (prefix hits, cached blocks that
    preemption and growth evict), arriving over the first attempts."""
    g = torch.Generator().manual_seed(seed)
    shared = random_prompt(g, 9)
    jobs = []
    for i, arrive in enumerate((0, 0, 1, 2, 3, 5, 8)):
        n = int(torch.randint(2, 7, (1,), generator=g))
        if i % 3 == 2:
            prompt = random_prompt(g, 9 + n)
        else:
            prompt = shared + torch.randint(3, 320, (n,), generator=g).tolist()
        jobs.append((f"r{i}", prompt, int(torch.randint(8, 15, (1,), generator=g)), arrive))
    return jobs


@pytest.mark.parametrize(
    ("mode", "seed"), [("recompute", 1), ("swap", 1), ("swap", 2), ("auto", 1)]
)
def test_random_faults_match_a_fault_free_run(hf: HFOracle, mode: str, seed: int) -> None:
    jobs = _jobs(seed)
    cfg = _cfg(mode, 12, 24)
    clean = drive(LLMEngine(str(hf.path), scheduler_config=cfg, check_invariants=True), jobs, None)
    engine = LLMEngine(str(hf.path), scheduler_config=cfg, check_invariants=True)
    faults = Faults(engine, random.Random(seed), 0.25)
    faults.install()
    run = drive(engine, jobs, faults)
    assert run.outputs == clean.outputs
    for rid, prompt, m, _ in jobs:
        assert run.outputs[rid] == hf.greedy(prompt, m), rid
    # Not vacuous: faults at several points, in steps that preempted, and a workload
    # that preempts, swaps (swap and auto), hits and evicts the prefix cache.
    assert run.failures == sum(faults.fired.values()) >= 5
    assert len(faults.fired) >= 3
    assert any(p.preempted for p in faults.failed_plans)
    assert run.preemptions > 0 and run.evictions > 0 and run.prefix_hit_tokens > 0
    if mode != "recompute":
        assert run.swapped_out > 0
    if mode == "swap":  # every victim swaps while the host pool has room
        assert any(p.swap_out for p in faults.failed_plans)


# ---------------------------------------------------------------- recompute: a changed retry
@pytest.mark.parametrize("kv_rollback", [True, False])
def test_victim_kept_after_a_failed_preemption_reads_its_own_kv(
    hf: HFOracle, monkeypatch: pytest.MonkeyPatch, kv_rollback: bool
) -> None:
    """Recompute mode: a retry of the same plan preempts the same victim again, which
    hides damaged K/V. The retry differs when the world changed in between: here the
    request that received the victim's block is aborted after the failed step, so the
    victim is not preempted and decodes from the block the failed forward wrote into.
    With the executor's rollback it reads its own K/V (transformers' tokens); without
    it (``kv_rollback`` false) its tokens change, which shows the check can fail."""
    if not kv_rollback:
        monkeypatch.setattr(ModelExecutor, "rollback", lambda self: None)
    engine = LLMEngine(
        str(hf.path), scheduler_config=_cfg("recompute", 6, 0), check_invariants=True
    )
    faults = Faults(engine, random.Random(0), 0.0, only=("after_forward",), when="first_preemption")
    faults.install()
    g = torch.Generator().manual_seed(0)
    prompts = [random_prompt(g, 8) for _ in range(2)]
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=12), request_id=f"r{i}")
    finals: dict[str, tuple[int, ...]] = {}
    while not faults.fired:
        with contextlib.suppress(InjectedFault):
            engine.step()
    (failed,) = faults.failed_plans
    (victim,) = failed.preempted
    (taker,) = failed.request_ids
    if kv_rollback:
        faults.assert_restored()
    engine.abort(taker)
    for o in engine.iter_outputs():
        if o.finished:
            finals[o.request_id] = o.token_ids
    assert engine.num_preemptions == 0  # the retry did not preempt the victim
    want = hf.greedy(prompts[int(victim[1:])], 12)
    assert (finals[victim] == want) is kv_rollback


# ---------------------------------------------------------------- copy-on-write, fatal rollback
def test_fault_in_a_copy_on_write_step_restores_the_copied_block(hf: HFOracle) -> None:
    """An n = 2 request forks after its prompt; the first decode of the pair copies the
    shared partial block (``plan.copies``). A fault after that step's forward must put
    the copy's destination block back too."""
    cfg = SchedulerConfig(max_num_batched_tokens=16, block_size=4, num_blocks=16)
    engine = LLMEngine(str(hf.path), scheduler_config=cfg, check_invariants=True)
    faults = Faults(engine, random.Random(0), 0.0, only=("after_forward",), when="never")
    faults.install()
    ex = engine.executor
    begin = ex.begin

    def arm_on_copies(plan: StepPlan, inputs: ModelInputs | None) -> None:
        begin(plan, inputs)
        if plan.copies and not faults.fired:
            faults.armed = "after_forward"

    ex.begin = arm_on_copies  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(5)
    prompt = random_prompt(g, 10)
    engine.add_request(prompt, SamplingParams(max_tokens=6, n=2), request_id="pair")
    finals: dict[int, tuple[int, ...]] = {}
    while engine.has_unfinished:
        try:
            outs = engine.step()
        except InjectedFault:
            faults.assert_restored()
            continue
        finals.update({o.index: o.token_ids for o in outs if o.finished})
    (failed,) = faults.failed_plans
    assert failed.copies
    want = hf.greedy(prompt, 6)
    assert finals == {0: want, 1: want}


def test_a_rollback_that_raises_is_fatal(hf: HFOracle) -> None:
    """K/V that could not be restored is never stepped on: the step raises KVStateLost
    (chained to the rollback's error) and so does every later step."""
    engine = LLMEngine(str(hf.path), scheduler_config=_cfg("recompute", 12, 0))
    engine.add_request([1, 5, 6, 7], SamplingParams(max_tokens=4), request_id="a")
    engine.step()
    ex = engine.executor

    def fail(point: str) -> None:
        if point == "after_forward":
            raise InjectedFault(point)

    def broken_rollback() -> None:
        raise RuntimeError("device lost")

    ex.fault_hook = fail
    ex.rollback = broken_rollback  # type: ignore[method-assign]
    with pytest.raises(KVStateLost, match="rebuild the engine") as info:
        engine.step()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert engine.scheduler.pool.num_used_blocks > 0  # the books were rolled back, not lost
    ex.fault_hook = None
    with pytest.raises(KVStateLost):
        engine.step()
