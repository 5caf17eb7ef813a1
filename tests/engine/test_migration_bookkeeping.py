"""What an engine reports about itself around a migration (docs/MIGRATION.md).

- ``LLMEngine.idle_fraction``, the destination's spare compute the cost rule divides a
  recompute by ("The cost rule"): an engine whose requests have all left (finished, or
  migrated away) is fully idle, whatever its last step used, so a request that moves back
  to the engine it came from does not have its recompute priced as on a saturated one.
- A moved request's ``num_cached_tokens`` counts hits in the destination's prefix cache
  (PREFIX judges it by the destination's block size): the source's count, carried over,
  broke PREFIX on a destination with larger blocks.
"""

from __future__ import annotations

from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import LLMEngine, RequestOutput
from refserve.engine.migration import migrate
from refserve.model.sampler import SamplingParams

PROMPT = list(range(3, 17))  # 14 tokens: 12 cacheable in 4-token blocks

BUDGET = 4


def _engine(block_size: int, budget: int = BUDGET) -> LLMEngine:
    cfg = SchedulerConfig(
        num_blocks=32, block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=4
    )
    return LLMEngine("tiny", scheduler_config=cfg, check_invariants=True)


def test_a_busy_engine_is_not_idle_and_an_emptied_one_is() -> None:
    a, b = _engine(4), _engine(8)
    assert a.idle_fraction == 1.0  # no step yet
    a.add_request(list(range(3, 13)), SamplingParams(max_tokens=4), request_id="r")
    a.step()  # a prefill chunk of the whole budget
    assert a.idle_fraction == 0.0
    there = migrate(a, b, "r", kv="recompute")
    assert there.decision.idle == 1.0  # b had never stepped
    # a's last step used its whole budget, but the request has left: a is idle now.
    assert not a.has_unfinished and a.idle_fraction == 1.0
    b.step()
    assert b.idle_fraction == 0.0  # b recomputes with its whole budget
    back = migrate(b, a, "r", kv="auto")
    assert back.decision.idle == 1.0
    # On an idle engine a recompute costs the iteration model's b = 0.5 ms per token
    # a's prefix cache does not already hold.
    d = back.decision
    assert d.kv_tokens > d.hit_tokens and d.recompute_ms == 0.5 * (d.kv_tokens - d.hit_tokens)


def test_a_moved_request_counts_the_destinations_prefix_hits() -> None:
    sp = SamplingParams(max_tokens=6)
    (want,) = _engine(4, 64).generate([PROMPT], sp)
    a, b = _engine(4, 64), _engine(8, 64)
    a.generate([PROMPT], sp)  # leaves the prompt's three full 4-token blocks cached on a
    a.add_request(PROMPT, sp, request_id="r")
    a.step()  # admitted with a 12-token hit, the last 2 prompt tokens computed
    assert a.scheduler.requests["r"].num_cached_tokens == 12
    there = migrate(a, b, "r", kv="transfer")
    assert there.decision.hit_tokens == 0  # b's own cache is cold
    # b checks every step: a count of 12 would break PREFIX (8-token blocks cache at most
    # 8 of the 16 tokens it has after that step).
    b.step()
    assert b.scheduler.requests["r"].num_cached_tokens == 0
    got: dict[int, RequestOutput] = {}
    while b.has_unfinished:
        got.update((o.index, o) for o in b.step() if o.finished)
    assert got[0].token_ids == want.outputs[0].token_ids
    # Into a warm cache: the count is a's own hit (the prompt's full blocks, cached above).
    b2 = _engine(8, 64)
    b2.add_request(PROMPT, sp, request_id="s")
    b2.step()
    back = migrate(b2, a, "s", kv="transfer")
    assert back.decision.hit_tokens == a.scheduler.requests["s"].num_cached_tokens > 0
