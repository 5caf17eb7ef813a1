"""The bulk decode path equals the per-request reference loop (differential test).

Two schedulers, one with ``fast_decode`` and one without, get the same workload; every
plan and every snapshot must be identical, under memory pressure (preemption falls back
to the reference loop), prefix sharing and forks' copy-on-write alike.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ref.core.config import SchedulerConfig
from ref.core.request import Request, StopParams
from ref.core.scheduler import Scheduler
from ref.sim.simulator import fake_token


@st.composite
def workloads(draw: st.DrawFn) -> tuple[SchedulerConfig, list[tuple[int, list[int], int]]]:
    block_size = draw(st.integers(1, 5))
    cfg = SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(1, 24)),
        max_num_seqs=draw(st.integers(1, 8)),
        block_size=block_size,
        num_blocks=draw(st.integers(4, 24)),
        enable_prefix_caching=draw(st.booleans()),
        prefill_reserve_tokens=0,
    )
    reqs = []
    for _ in range(draw(st.integers(1, 10))):
        arrival_step = draw(st.integers(0, 12))
        prompt = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3 * block_size + 2))
        reqs.append((arrival_step, prompt, draw(st.integers(1, 12))))
    return cfg, reqs


@settings(max_examples=150)
@given(workloads())
def test_fast_decode_path_matches_reference_loop(
    work: tuple[SchedulerConfig, list[tuple[int, list[int], int]]],
) -> None:
    cfg, reqs = work
    fast, slow = Scheduler(cfg, fast_decode=True), Scheduler(cfg, fast_decode=False)
    bulk = fast.pool.append_decode_tokens

    def counted(*args: object) -> object:
        out = bulk(*args)  # type: ignore[arg-type]
        event("bulk decode path" if out is not None else "fell back to the reference loop")
        return out

    fast.pool.append_decode_tokens = counted  # type: ignore[assignment, method-assign]
    for step in range(200):
        for s in (fast, slow):
            for i, (arrival, prompt, max_tokens) in enumerate(reqs):
                if arrival == step and (cfg.num_blocks * cfg.block_size) >= len(prompt):
                    s.add_request(
                        Request(
                            f"r{i}",
                            list(prompt),
                            StopParams(max_tokens=max_tokens, ignore_eos=True),
                        )
                    )
        if not fast.has_unfinished and step > 12:
            break
        pf, ps = fast.schedule(), slow.schedule()
        assert pf == ps, f"step {step}: plans differ"
        assert fast.pool.snapshot() == slow.pool.snapshot()
        sampled = {
            rid: fake_token(fast.requests[rid].seq, fast.requests[rid].num_tokens) % 3 + 1
            for rid, smp in zip(pf.request_ids, pf.samples, strict=True)
            if smp
        }
        fast.commit(pf, sampled)
        slow.commit(ps, sampled)
        assert fast.snapshot() == slow.snapshot()
    assert not fast.has_unfinished


@pytest.mark.mutation_kill
def test_steady_decodes_take_the_bulk_path() -> None:
    """With room for everyone, each step's decodes go through one bulk pool call that
    covers every decoding request: the fast path is taken, not silently skipped (the
    differential test above cannot tell a skipped fast path from a taken one)."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=4, num_blocks=64)
    s = Scheduler(cfg, fast_decode=True)
    bulk = s.pool.append_decode_tokens
    calls: list[tuple[list[str], bool]] = []

    def spy(ids: list[str], tokens: list[list[int]]) -> object:
        out = bulk(ids, tokens)
        calls.append((list(ids), out is not None))
        return out

    s.pool.append_decode_tokens = spy  # type: ignore[assignment, method-assign]
    for i in range(4):
        s.add_request(Request(f"r{i}", [1, 2, 3], StopParams(max_tokens=6, ignore_eos=True)))
    decode_steps = 0
    while s.has_unfinished:
        decoding = sorted(r.request_id for r in s.running if r.num_output_tokens > 0)
        before = len(calls)
        plan = s.schedule()
        if decoding:
            decode_steps += 1
            assert len(calls) == before + 1, "a decode step skipped the bulk path"
            assert sorted(calls[-1][0]) == decoding and calls[-1][1]
        s.commit(
            plan, {rid: 1 for rid, smp in zip(plan.request_ids, plan.samples, strict=True) if smp}
        )
    assert decode_steps == 5
