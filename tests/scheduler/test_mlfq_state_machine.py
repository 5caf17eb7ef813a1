"""Hypothesis state machine: the skip-join MLFQ scheduler under random arrivals, aborts
and failing steps, with its own rules and every K/V rule checked after each step.

Each step goes through ``EngineCore(check_invariants=True)`` (TOKEN, BLOCK, KVLEN, POS,
CAP, PREFIX, PROGRESS and the host pool's rules after every step, ATOMIC after a failed
one), over a fake K/V memory on the device and the host (``MemorySimExecutor``): after
every step each live table, prefix-cache entry and host table must read back the tokens
it claims, so a displacement's swap-out and its swap-in at readmission are checked for
what they moved, not only for their books. On top, spec/mlfq.py's three rules
(starvation bound, no thrash, the queues' conservation) on the policy's snapshot.

A step may fail before the executor writes anything: the scheduler, the pools, the fake
memories and the policy's books must then be exactly as before, and the next step runs.

Configs are drawn per example: tiny device pools (so displacement for blocks and the
spine's own preemptions both happen), host pools of 0 (every displacement recomputes)
to 16 blocks, 1 to 4 levels, quanta from one decode step, starvation bounds from 1 step,
skip-join and proactive swap on or off. Rare paths are labelled with ``event()``.

The two planted bugs at the end (a policy whose promotion never fires, one whose
protection is off) are found by this same machine.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from refserve.core.config import PolicyName, SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.engine_core import EngineCore
from refserve.core.executor import StepOutput
from refserve.core.inputs import ModelInputs
from refserve.core.mlfq import SkipJoinMlfq
from refserve.core.mlfq_settings import MlfqSettings
from refserve.core.plan import StepPlan
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.errors import ExceedsCapacity
from refserve.spec.mlfq import check_mlfq
from tests.harness import MemorySimExecutor
from tests.scheduler.scripted_kv import Boom, kv_readback_errors

COST = StepCost(a=1.0, b=0.5, c=1.0)
MAX_LIVE = 8


class _FailingExecutor(MemorySimExecutor):
    """Fails before writing anything when told to (nothing to restore then)."""

    fail_next = False

    def execute(self, plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
        if self.fail_next:
            self.fail_next = False
            raise Boom("the step fails before any write")
        return super().execute(plan, inputs)


class MlfqMachine(RuleBasedStateMachine):
    # The policy class the machine builds: the planted-bug tests swap in a broken one.
    policy_class: type[SkipJoinMlfq] = SkipJoinMlfq

    def __init__(self) -> None:
        super().__init__()
        self.next_id = 0
        self.clock = 0.0
        self.violations: list[str] = []

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        d = data.draw
        settings_ = MlfqSettings(
            num_queues=d(st.integers(1, 4), label="num_queues"),
            base_quantum_ms=d(st.sampled_from([2.0, 4.0, 8.0]), label="base_quantum_ms"),
            quantum_growth=d(st.sampled_from([1.0, 2.0, 4.0]), label="growth"),
            starvation_steps=d(st.integers(1, 12), label="starvation_steps"),
            skip_join=d(st.booleans(), label="skip_join"),
            proactive_swap=d(st.booleans(), label="proactive_swap"),
            cost=COST,
        )
        bs = d(st.integers(1, 4), label="block_size")
        self.config = SchedulerConfig(
            max_num_batched_tokens=d(st.integers(4, 16), label="budget"),
            max_num_seqs=d(st.integers(1, 4), label="max_num_seqs"),
            block_size=bs,
            num_blocks=d(st.integers(4, 12), label="num_blocks"),
            max_model_len=32,
            enable_prefix_caching=d(st.booleans(), label="prefix_caching"),
            policy=PolicyName.MLFQ,
            num_host_blocks=d(st.sampled_from([0, 2, 6, 16]), label="num_host_blocks"),
            mlfq=settings_,
        )
        self.sched = Scheduler(self.config, self.policy_class(self.config))
        self.policy = self.sched.policy
        assert isinstance(self.policy, SkipJoinMlfq)
        self.executor = _FailingExecutor(COST, self.sched.requests, block_size=bs)
        self.core = EngineCore(self.sched, self.executor, check_invariants=True)

    # ------------------------------------------------------------------ rules
    @rule(
        prompt_len=st.integers(1, 14),
        max_tokens=st.integers(1, 12),
        alphabet=st.integers(1, 3),
    )
    def add(self, prompt_len: int, max_tokens: int, alphabet: int) -> None:
        if len(self.sched.requests) >= MAX_LIVE:
            event("the live cap holds back an arrival")
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = [1 + (i % alphabet) for i in range(prompt_len)]
        r = Request(rid, prompt, StopParams(max_tokens, ignore_eos=True), arrival_ms=self.clock)
        try:
            self.sched.add_request(r)
        except ExceedsCapacity:
            event("a request that can never fit is refused")

    @precondition(lambda self: hasattr(self, "sched") and self.sched.has_unfinished)
    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        for _ in range(n):
            if not self.sched.has_unfinished:
                return
            self._one_step()

    @precondition(lambda self: hasattr(self, "sched") and self.sched.has_unfinished)
    @rule()
    def failing_step(self) -> None:
        before = self.sched.snapshot()
        books = copy.deepcopy(self.policy.books)
        memory, host = dict(self.executor.memory), dict(self.executor.host_memory)
        index = self.sched.step_index
        self.executor.fail_next = True
        with pytest.raises(Boom):
            self.core.step(self.clock)
        assert self.sched.snapshot() == before
        assert self.policy.books == books, "a rolled-back step changed the policy's books"
        assert (self.executor.memory, self.executor.host_memory) == (memory, host)
        assert self.sched.step_index == index
        event("a step failed and was rolled back")

    @precondition(lambda self: hasattr(self, "sched") and bool(self.sched.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)), label="abort")
        self.sched.abort(rid, self.clock)

    def _one_step(self) -> None:
        rec = self.core.step(self.clock)
        self.clock = rec.end_ms
        plan = rec.plan
        if plan.preempted:
            event("a preemption")
        if self.policy.last_displaced:
            for reason in {d.reason for d in self.policy.last_displaced}:
                event(f"displaced for {reason}")
        if plan.swapped_in:
            event("a displaced request swapped back in")
        if any(b.num_promotions for b in self.policy.books.values()):
            event("a promotion")
        if any(b.num_demotions for b in self.policy.books.values()):
            event("a demotion")

    # ------------------------------------------------------------------ invariants
    @invariant()
    def rules_hold(self) -> None:
        if not hasattr(self, "sched"):
            return
        snap = self.policy.snapshot(self.sched.requests, self.sched.running, self.sched.step_index)
        bad = check_mlfq(snap)
        assert not bad, "\n".join(map(str, bad))
        engine = self.sched.snapshot()
        # Without a host pool nothing is on the host: an empty one reads back nothing.
        host = engine.host or dataclasses.replace(engine.pool, tables=(), cache_entries=())
        tokens = {rid: r.token_ids for rid, r in self.sched.requests.items()}
        errors = kv_readback_errors(
            engine.pool,
            host,
            self.executor.memory,
            self.executor.host_memory,
            lambda rid: tokens[rid],
        )
        assert not errors, "\n".join(errors)

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        limit = 2_000
        while self.sched.has_unfinished and limit:
            self._one_step()
            self.rules_hold()
            limit -= 1
        assert not self.sched.has_unfinished, "the drain did not finish"


MlfqMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_mlfq_state_machine = MlfqMachine.TestCase


# ---------------------------------------------------------------------- planted bugs
class _NoPromotion(SkipJoinMlfq):
    """The planted starvation: promotion never fires."""

    def _promote(self, now_step: int) -> None:
        return None


class _NoProtection(SkipJoinMlfq):
    """The planted thrash: a request that just joined is displaceable at once."""

    def _protected(self, r: Request) -> bool:
        return False


@pytest.mark.parametrize(
    ("broken", "rule"), [(_NoPromotion, "mlfq-starvation"), (_NoProtection, "mlfq-no-thrash")]
)
def test_the_machine_finds_the_planted_bug(broken: type[SkipJoinMlfq], rule: str) -> None:
    class Broken(MlfqMachine):
        policy_class = broken

    Broken.TestCase.settings = settings(
        max_examples=200,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        database=None,
        derandomize=True,
        report_multiple_bugs=False,
    )
    with pytest.raises((AssertionError, Flaky)) as found:
        Broken.TestCase().runTest()
    assert rule in str(found.value), str(found.value)[-2000:]
