"""What a step produced travels with the step, and every caller loop is one drive loop.

The executor returns everything it drew in its ``StepOutput`` (tokens, logprobs, the
first tokens of ``n > 1`` samples) and ``EngineCore.step`` carries it to the engine in the
``StepRecord``; nothing is read back from the executor afterwards (ref/model/executor.py).
"""

from __future__ import annotations

import pytest

from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import EngineStalled, LLMEngine
from refserve.model.sampler import SamplingParams


def _engine() -> LLMEngine:
    cfg = SchedulerConfig(max_num_batched_tokens=16, block_size=4, num_blocks=64, max_model_len=128)
    return LLMEngine("tiny", scheduler_config=cfg, check_invariants=True)


def test_the_step_record_carries_logprobs_and_fork_samples() -> None:
    engine = _engine()
    params = SamplingParams(max_tokens=3, n=3, logprobs=True, temperature=1.0, seed=7)
    engine.add_request([256, 10, 20], params, request_id="x")
    outs = {o.index: o for o in engine.step()}  # the whole prompt: every first token
    first = engine.steps[-1]
    assert set(first.logprobs) == {"x"}
    forks = first.fork_samples["x"]
    assert set(first.fork_samples) == {"x"} and len(forks) == 2
    assert outs[0].token_ids == (dict(first.outcome.last_tokens())["x"],)
    assert outs[0].logprobs == (first.logprobs["x"],)
    for i, drawn in enumerate(forks, start=1):
        assert outs[i].token_ids == (drawn.token,)
        assert outs[i].logprobs == (drawn.logprob,)
    engine.step()  # a decode of all three: logprobs for each, nothing more to fork
    second = engine.steps[-1]
    assert dict(second.fork_samples) == {}
    assert set(second.logprobs) == {"x", "x#1", "x#2"}


def test_a_simulator_step_draws_no_logprobs_or_forks() -> None:
    from refserve.core.cost import StepCost
    from refserve.core.engine_core import EngineCore
    from refserve.core.request import Request, StopParams
    from refserve.core.scheduler import Scheduler
    from refserve.sim.simulator import SimExecutor

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, block_size=4, num_blocks=8))
    sched.add_request(Request("a", [1, 2, 3], StopParams(max_tokens=2)))
    core = EngineCore(sched, SimExecutor(StepCost(1.0, 0.0, 0.0), sched.requests))
    record = core.step(0.0)
    assert set(dict(record.outcome.last_tokens())) == {"a"}
    assert dict(record.logprobs) == {} and dict(record.fork_samples) == {}


def test_a_drive_loop_that_gets_no_output_raises_engine_stalled() -> None:
    engine = _engine()
    engine.add_request("lost", SamplingParams(max_tokens=4), request_id="lost")
    # Aborted in the scheduler behind the engine's back: the engine's request stays
    # unfinished while no step can ever produce an output for it.
    engine.scheduler.abort("lost")
    with pytest.raises(EngineStalled, match="iter_outputs: 5 steps in a row produced no output"):
        list(engine.iter_outputs(max_idle_steps=5))
