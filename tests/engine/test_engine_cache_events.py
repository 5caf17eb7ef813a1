"""An engine's cache events (``LLMEngine.cache_events``; ref/kv/events.py): each step's
prefix-cache changes, published when the step commits, replay to the engine's index
(EVENTS, spec/events.py); a failed step publishes nothing."""

from __future__ import annotations

import pytest

from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import LLMEngine, SamplingParams
from refserve.errors import InvalidArgument
from refserve.spec.events import BlockStored, check_events
from refserve.spec.snapshot import CacheEntry

CFG = SchedulerConfig(num_blocks=12, block_size=4, max_num_batched_tokens=8, cache_events=True)
PROMPT = list(range(1, 14))  # 13 tokens: three full blocks of 4


class Boom(Exception):
    pass


def _fail_after_forward(point: str) -> None:
    if point == "after_forward":
        raise Boom(point)


def test_events_replay_to_the_engine_index_step_by_step() -> None:
    engine = LLMEngine("tiny", scheduler_config=CFG)
    engine.add_request(PROMPT, SamplingParams(max_tokens=6), request_id="a")
    engine.add_request([*PROMPT[:9], 40, 41], SamplingParams(max_tokens=3), request_id="b")
    replica: tuple[CacheEntry, ...] = ()
    seq = stored = 0
    while engine.has_unfinished:
        engine.step()
        events = engine.cache_events()
        after = engine.scheduler.pool.snapshot()
        assert check_events(replica, events, seq, after) == []
        replica, seq = after.cache_entries, seq + len(events)
        stored += sum(isinstance(e.change, BlockStored) for e in events)
    assert stored >= 3  # the prompt's full blocks, at least


def test_a_failed_step_publishes_nothing() -> None:
    engine = LLMEngine("tiny", scheduler_config=CFG)
    engine.add_request(PROMPT, SamplingParams(max_tokens=4), request_id="a")
    engine.executor.fault_hook = _fail_after_forward
    with pytest.raises(Boom):
        engine.step()  # the step reserved and indexed blocks, then rolled back
    assert engine.cache_events() == []
    engine.executor.fault_hook = None
    engine.step()
    events = engine.cache_events()
    assert events and events[0].seq == 0
    assert check_events((), events, 0, engine.scheduler.pool.snapshot()) == []


def test_an_engine_without_events_says_so() -> None:
    engine = LLMEngine("tiny")
    with pytest.raises(InvalidArgument, match=r"SchedulerConfig\(cache_events=True\)"):
        engine.cache_events()
