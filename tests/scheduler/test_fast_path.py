"""The bulk decode path equals the per-request reference loop (differential test;
docs/ARCHITECTURE.md, "The persistent batch", listed in "Claims the tests check").

Two schedulers, one on the bulk path (the persistent batch, ref/core/batch.py) and one
on the per-request path (tests/harness.py ``reference_loop``), get the same workload;
every plan, every executor input and every snapshot must be identical, under memory
pressure (preemption falls back to the reference loop), prefix sharing, forks' copy-on-
write, aborts and rollbacks alike; and the inputs the batch builds equal those built
from the requests and the pool's tables."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from refserve.core.batch import DecodeRows, Ints
from refserve.core.bulk import BulkBatch
from refserve.core.config import SchedulerConfig
from refserve.core.inputs import ModelInputs, build_inputs
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.kv import BlockPool, DecodeRun
from refserve.sim.simulator import fake_token
from refserve.spec.snapshot import RequestStatus
from tests.harness import reference_loop


@st.composite
def workloads(
    draw: st.DrawFn,
) -> tuple[SchedulerConfig, list[tuple[int, list[int], int]], int]:
    block_size = draw(st.integers(1, 5))
    cfg = SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(1, 24)),
        max_num_seqs=draw(st.integers(1, 8)),
        block_size=block_size,
        num_blocks=draw(st.integers(4, 24)),
        enable_prefix_caching=draw(st.booleans()),
        prefill_reserve_tokens=0,
        num_speculative_tokens=draw(st.sampled_from([0, 0, 3])),
    )
    reqs = []
    for _ in range(draw(st.integers(1, 10))):
        arrival_step = draw(st.integers(0, 12))
        prompt = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3 * block_size + 2))
        reqs.append((arrival_step, prompt, draw(st.integers(1, 12))))
    return cfg, reqs, draw(st.integers(0, 30))


def _assert_same_inputs(a: ModelInputs, b: ModelInputs) -> None:
    assert a.request_ids == b.request_ids
    assert a.sample_request_ids == b.sample_request_ids
    for name in (
        "input_ids",
        "positions",
        "slot_mapping",
        "query_start_loc",
        "seq_lens",
        "block_tables",
        "sample_rows",
    ):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), f"{name}: {x} != {y}"


Work = tuple[SchedulerConfig, list[tuple[int, list[int], int]], int]


@settings(max_examples=int(os.environ.get("FAST_PATH_EXAMPLES", "150")))
@given(workloads())
def test_fast_decode_path_matches_reference_loop(work: Work) -> None:
    run_side_by_side(work, on_bulk=event)


class _CountedRun:
    """A decode run whose every bulk call is told to ``on_bulk`` (taken or refused)."""

    def __init__(self, run: DecodeRun, on_bulk: Callable[[str], None]) -> None:
        self.run, self.on_bulk = run, on_bulk

    def append_decodes(self, *args: Any) -> object:
        out = self.run.append_decodes(*args)
        self.on_bulk("bulk decode path" if out is not None else "fell back to the reference loop")
        return out


def run_side_by_side(work: Work, on_bulk: Callable[[str], None] | None = None) -> None:
    """Drive a fast and a reference scheduler through ``work``; AssertionError at the
    first step where plans, inputs, snapshots or running orders differ."""
    cfg, reqs, abort_at = work
    forked: set[str] = set()
    fast, slow = Scheduler(cfg), reference_loop(Scheduler(cfg))
    if on_bulk is not None:
        decode_run = fast.batch.decode_run

        def counted(*args: Any) -> _CountedRun:
            return _CountedRun(decode_run(*args), on_bulk)

        fast.batch.decode_run = counted  # type: ignore[assignment, method-assign]
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
        if cfg.num_speculative_tokens and step % 3 == 1:
            _propose_to_both(fast, slow, step, on_bulk)
        pf, ps = fast.schedule(), slow.schedule()
        assert pf == ps, f"step {step}: plans differ"
        assert fast.pool.snapshot() == slow.pool.snapshot()
        _assert_same_inputs(
            build_inputs(pf, fast.requests, fast.pool, fast.batch),
            build_inputs(ps, slow.requests, slow.pool),
        )
        if step % 7 == 3:  # a failed step: both roll back, then plan it again
            fast.rollback()
            slow.rollback()
            assert fast.snapshot() == slow.snapshot()
            pf, ps = fast.schedule(), slow.schedule()
            assert pf == ps, f"step {step}: plans differ after a rollback"
        sampled = {
            rid: fake_token(fast.requests[rid].seq, fast.requests[rid].num_tokens) % 3 + 1
            for rid, smp in zip(pf.request_ids, pf.samples, strict=True)
            if smp
        }
        accepted = {rid: (step + len(d)) % (len(d) + 1) for rid, d in pf.drafts.items()}
        # The fast side gets the tokens as an array in plan order, the slow one by id.
        fast.commit(pf, torch.tensor(list(sampled.values()), dtype=torch.int64), 0.0, accepted)
        slow.commit(ps, sampled, 0.0, accepted)
        assert fast.snapshot() == slow.snapshot()
        assert [r.request_id for r in fast.running] == [r.request_id for r in slow.running]
        if step == abort_at and fast.running:
            victim = fast.running[len(fast.running) // 2].request_id
            fast.abort(victim)
            slow.abort(victim)
        for r in list(fast.running):  # n = 2: a sibling sharing every block (COW)
            child = r.request_id + ".1"
            decoding = r.status is RequestStatus.DECODING
            if decoding and r.num_output_tokens == 1 and "." not in r.request_id and step % 2:
                if child in forked:
                    continue
                forked.add(child)
                if on_bulk is not None:
                    on_bulk("forked")
                for s in (fast, slow):
                    s.fork(r.request_id, child, 2, StopParams(4, ignore_eos=True))
    assert not fast.has_unfinished


def _propose_to_both(
    fast: Scheduler, slow: Scheduler, step: int, on_bulk: Callable[[str], None] | None
) -> None:
    """The same drafts for both (speculative decoding): a verification step runs the
    reference loop on both sides, and the next bulk step must find the batch's rows
    reloaded after the rejected drafts were dropped."""
    for r in fast.running:
        if r.status is RequestStatus.DECODING:
            n = (r.seq + step) % (fast.config.num_speculative_tokens + 1)
            drafts = [fake_token(r.seq, r.num_tokens + j) % 3 + 1 for j in range(n)]
            fast.propose(r.request_id, drafts)
            slow.propose(r.request_id, drafts)
            if on_bulk is not None and n:
                on_bulk("drafts proposed")


# A workload that crosses blocks, forks, rolls back, aborts and finishes by length.
PLANTED: Work = (
    SchedulerConfig(
        max_num_batched_tokens=16,
        max_num_seqs=8,
        block_size=2,
        num_blocks=40,
        enable_prefix_caching=True,
        prefill_reserve_tokens=0,
    ),
    # The last one forks at step 9 and both copy-on-write in step 10, rolled back.
    [(0, [1, 2, 3], 9), (0, [1, 2, 3], 7), (1, [2, 2], 12), (2, [3], 5), (9, [4, 5, 6], 6)],
    6,
)


def test_the_planted_workload_passes_unplanted() -> None:
    run_side_by_side(PLANTED)


_NEEDS_BLOCK = BulkBatch.needs_block
_COMMIT_DECODES = BulkBatch.commit_decodes


def _drop_last_needy(self: BulkBatch, rows: DecodeRows, pool: BlockPool) -> list[int]:
    return _NEEDS_BLOCK(self, rows, pool)[:-1]


def _forget_growth(self: BulkBatch, rows: DecodeRows, needy: list[int], g: object) -> None:
    return None  # the rows keep their old tables


def _miss_length(self: BulkBatch, rows: DecodeRows, tokens: Ints, now_ms: float) -> list[int]:
    self.kv_limit[rows.slots] += 1  # finishes one token late
    return _COMMIT_DECODES(self, rows, tokens, now_ms)


def _ignore_rollback(self: BulkBatch, pool: BlockPool) -> None:
    pool.take_changed()  # drops the "every table" mark of a rollback


@pytest.mark.parametrize(
    ("method", "planted"),
    [
        ("needs_block", _drop_last_needy),
        ("grew", _forget_growth),
        ("commit_decodes", _miss_length),
        ("sync_tables", _ignore_rollback),
    ],
)
def test_the_differential_test_catches_a_planted_batch_bug(
    monkeypatch: pytest.MonkeyPatch, method: str, planted: Callable[..., object]
) -> None:
    monkeypatch.setattr(BulkBatch, method, planted)
    with pytest.raises(AssertionError):
        run_side_by_side(PLANTED)


@pytest.mark.mutation_kill
def test_steady_decodes_take_the_bulk_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for everyone, each step's decodes go through one bulk pool call that
    covers every decoding request: the fast path is taken, not silently skipped (the
    differential test above cannot tell a skipped fast path from a taken one)."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=4, num_blocks=64)
    s = Scheduler(cfg)
    bulk = DecodeRun.append_decodes
    calls: list[tuple[list[str], bool]] = []

    def spy(run: DecodeRun, *args: list[int]) -> object:
        out = bulk(run, *args)
        calls.append((list(run.request_ids), out is not None))
        return out

    monkeypatch.setattr(DecodeRun, "append_decodes", spy)
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
