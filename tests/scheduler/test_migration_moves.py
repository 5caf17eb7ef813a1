"""A moved request's prefix-cache count is the destination's own (ref/core/transit.py).

Found by the cluster state machine (tests/scheduler/test_migration_state_machine.py): a
request that hit 5 tokens of a block-size-1 cache kept that count when it moved to an
engine of block size 4, where 5 cached tokens are not whole blocks and cover its last
known token, and the destination's next step broke PREFIX (``num_cached_tokens`` above
``max_cacheable_tokens`` of its block size). The count a request carries is the hit of
the engine it runs on: the destination's prefix hit on a transfer, 0 on a recompute
until its admission there finds one.
"""

from __future__ import annotations

import pytest

from refserve.core.config import SchedulerConfig
from refserve.core.request import Request, StopParams
from refserve.spec.arith import max_cacheable_tokens
from refserve.spec.hashing import Namespace
from tests.harness import MemoryLink, Stepper
from tests.phased_migration import PhasedMigration

PROMPT = [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("with_kv", [False, True], ids=["recompute", "transfer"])
def test_a_hit_counted_in_the_source_block_size_does_not_travel(with_kv: bool) -> None:
    small = Stepper(
        SchedulerConfig(max_num_batched_tokens=16, block_size=1, num_blocks=16), memory=True
    )
    big = Stepper(
        SchedulerConfig(max_num_batched_tokens=16, block_size=4, num_blocks=8), memory=True
    )
    small.add(Request("p", list(PROMPT), StopParams(1, ignore_eos=True)))
    small.drain()  # PROMPT's blocks stay cached on the source
    r = Request("r", list(PROMPT), StopParams(4, ignore_eos=True))
    small.add(r)
    small.step()
    assert r.num_cached_tokens == 5 > max_cacheable_tokens(len(PROMPT) + 2, 4)
    big.add(Request("q", [1, 2, 3, 4, 9], StopParams(1, ignore_eos=True)))
    big.drain()  # the destination caches PROMPT's first block
    move = PhasedMigration(
        small.sched, big.sched, "r", with_kv=with_kv, link=MemoryLink(small, big)
    )
    (moved,) = move.run()
    assert move.arrival is not None
    assert moved.num_cached_tokens == move.arrival.num_hit_tokens == (4 if with_kv else 0)
    big.drain()  # every step checked (EngineCore): PREFIX held
    assert moved.is_done and moved.num_cached_tokens == 4  # recompute: its own hit


@pytest.mark.parametrize("with_kv", [False, True], ids=["recompute", "transfer"])
def test_who_the_request_is_travels_with_it(with_kv: bool) -> None:
    """Priority, tenant, cache namespace, the stop rule, arrival and token times: the
    destination's request is the source's in every field the scheduler reads (QoS, the
    cache's namespace, the finish rule, the metrics)."""
    cfg = SchedulerConfig(max_num_batched_tokens=16, block_size=2, num_blocks=16)
    src, dst = Stepper(cfg, memory=True), Stepper(cfg, memory=True)
    ns = Namespace(model="m", cache_salt="tenant-a")
    stop = StopParams(5, stop_token_ids=(99,), eos_token_id=98)
    r = Request("r", list(PROMPT), stop, arrival_ms=3.0, priority=2, tenant="a", namespace=ns)
    src.add(r)
    src.step()
    src.step()
    (moved,) = PhasedMigration(
        src.sched, dst.sched, "r", with_kv=with_kv, link=MemoryLink(src, dst)
    ).run()
    assert (moved.priority, moved.tenant, moved.namespace, moved.stop) == (2, "a", ns, stop)
    assert (moved.arrival_ms, moved.admitted_ms) == (r.arrival_ms, r.admitted_ms)
    assert moved.token_times_ms == r.token_times_ms and moved.token_ids == r.token_ids
    assert moved.num_preemptions == r.num_preemptions
    dst.drain()
