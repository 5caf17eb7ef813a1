"""refserve.conformance.validate (malformed adapter records) and refserve.conformance.selfcheck (the
explaining walk-through for a new adapter; docs/ADAPTERS.md, "The self-check").

validate must name the field and never raise, whatever it is given; self_check must pass
refserve's own adapter and explain each typical adapter mistake in one line, with exit
status 1 (2 when the adapter cannot even be loaded).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import pytest

from refserve.conformance import validate
from refserve.conformance.adapter import (
    CommitReport,
    EngineConfig,
    EngineProperties,
    RequestSpec,
    StepReport,
)
from refserve.conformance.adapters import template
from refserve.conformance.adapters.ref import RefAdapter, make
from refserve.conformance.selfcheck import SelfCheckResult, self_check, self_check_main
from refserve.spec.snapshot import (
    EngineSnapshot,
    PoolSnapshot,
    RequestSnapshot,
    RequestStatus,
    ScheduledRequest,
    TableSnapshot,
)

# --------------------------------------------------------------------------- fixtures


def _records() -> tuple[EngineSnapshot, StepReport, CommitReport, EngineSnapshot]:
    """Real records from refserve: a snapshot with a waiting request, the first step's
    report (a 4-token chunk of a 6-token prompt), its commit and the snapshot after."""
    a = make()
    a.configure(
        EngineConfig(
            block_size=4, num_blocks=8, max_num_batched_tokens=4, max_num_seqs=2, eos_token_id=1
        )
    )
    a.add_request(RequestSpec("A", (5, 6, 7, 8, 9, 10), 3, eos_token_id=1))
    before = a.snapshot()
    rep = a.schedule()
    done = a.commit({})
    return before, rep, done, a.snapshot()


BEFORE, REPORT, COMMIT, AFTER = _records()


def _with(record: Any, **fields: Any) -> Any:
    """``dataclasses.replace`` with values of the wrong type on purpose."""
    return dataclasses.replace(record, **fields)


def _has(problems: list[str], *parts: str) -> bool:
    return any(all(p in line for p in parts) for line in problems)


# --------------------------------------------------------------------------- validate


def test_real_records_are_well_formed() -> None:
    assert validate.check_engine_snapshot(BEFORE) == []
    assert validate.check_engine_snapshot(AFTER) == []
    assert validate.check_pool_snapshot(AFTER.pool) == []
    assert validate.check_step_report(REPORT) == []
    assert validate.check_commit_report(COMMIT) == []
    assert AFTER.pool.tables and REPORT.scheduled  # the records are not trivially empty


class _Hostile:
    """Every attribute read raises; so do repr and str."""

    def __getattr__(self, name: str) -> object:
        raise RuntimeError(f"no {name}")

    def __repr__(self) -> str:
        raise RuntimeError("no repr")

    __str__ = __repr__


class _RaisingSnapshot(EngineSnapshot):
    @property  # shadows the dataclass field on purpose
    def requests(self) -> tuple[RequestSnapshot, ...]:
        raise KeyError("requests")


GARBAGE: list[object] = [
    None,
    5,
    "snapshot",
    b"x",
    {},
    [],
    {"requests": ()},
    object(),
    _Hostile(),
    EngineSnapshot(requests=None, pool=5),  # type: ignore[arg-type]
    StepReport(scheduled=[1, None]),  # type: ignore[arg-type]
    CommitReport(finished=[("a",), None, ("a", 1)]),  # type: ignore[arg-type]
    PoolSnapshot(
        num_blocks="8",  # type: ignore[arg-type]
        block_size=None,  # type: ignore[arg-type]
        ref_cnt=5,  # type: ignore[arg-type]
        free_queue=None,  # type: ignore[arg-type]
        tables={},  # type: ignore[arg-type]
    ),
    _RaisingSnapshot.__new__(_RaisingSnapshot),
]


@pytest.mark.parametrize("obj", GARBAGE, ids=lambda o: type(o).__name__)
def test_validate_never_raises_on_garbage(obj: object) -> None:
    for fn in (
        validate.check_engine_snapshot,
        validate.check_pool_snapshot,
        validate.check_step_report,
        validate.check_commit_report,
    ):
        problems = fn(obj)
        assert problems, (fn.__name__, obj.__class__)
        assert all(isinstance(p, str) and ": " in p for p in problems)


def test_wrong_record_type_is_named() -> None:
    assert validate.check_engine_snapshot({}) == [
        "snapshot: expected a refserve.spec.snapshot.EngineSnapshot, got dict"
    ]
    assert validate.check_step_report(None) == [
        "step_report: expected a refserve.conformance.adapter.StepReport, got None"
    ]
    assert validate.check_commit_report(5) == [
        "commit_report: expected a refserve.conformance.adapter.CommitReport, got int 5"
    ]
    assert validate.check_pool_snapshot(AFTER, where="kv") == [
        "kv: expected a refserve.spec.snapshot.PoolSnapshot, got EngineSnapshot"
    ]


def test_attribute_that_raises_is_a_problem_not_a_crash() -> None:
    problems = validate.check_engine_snapshot(_RaisingSnapshot.__new__(_RaisingSnapshot))
    assert _has(problems, "snapshot.requests", "raised KeyError")


def test_lists_instead_of_tuples() -> None:
    pool = _with(AFTER.pool, ref_cnt=list(AFTER.pool.ref_cnt))
    snap = _with(AFTER, requests=list(AFTER.requests), pool=pool)
    problems = validate.check_engine_snapshot(snap)
    assert "snapshot.pool.ref_cnt: expected a tuple of int, got list" in problems
    assert "snapshot.requests: expected a tuple of RequestSnapshot, got list" in problems
    s = _with(REPORT.scheduled[0], positions=list(REPORT.scheduled[0].positions))
    problems = validate.check_step_report(dataclasses.replace(REPORT, scheduled=(s,)))
    assert problems == ["step_report.scheduled[0].positions: expected a tuple of int, got list"]


def test_status_must_be_a_request_status() -> None:
    bad = _with(AFTER.requests[0], status="running")
    problems = validate.check_engine_snapshot(dataclasses.replace(AFTER, requests=(bad,)))
    assert len(problems) == 1
    assert problems[0].startswith(
        "snapshot.requests[0].status: 'running' is not a RequestStatus (waiting, prefilling,"
    )
    plain = _with(AFTER.requests[0], status="decoding")
    problems = validate.check_engine_snapshot(dataclasses.replace(AFTER, requests=(plain,)))
    assert problems == [
        "snapshot.requests[0].status: expected a RequestStatus, got str 'decoding' "
        "(use RequestStatus.DECODING)"
    ]


def test_counts_are_exact_non_negative_ints() -> None:
    r = _with(AFTER.requests[0], num_output_tokens=True, num_computed_tokens=-1, max_tokens=3.0)
    problems = validate.check_engine_snapshot(dataclasses.replace(AFTER, requests=(r,)))
    assert "snapshot.requests[0].num_output_tokens: expected int, got bool True" in problems
    assert "snapshot.requests[0].num_computed_tokens: -1 is negative" in problems
    assert "snapshot.requests[0].max_tokens: expected int, got float 3.0" in problems
    pool = dataclasses.replace(AFTER.pool, block_size=0, ref_cnt=(*AFTER.pool.ref_cnt[:-1], -1))
    problems = validate.check_pool_snapshot(pool)
    assert "pool.block_size: must be >= 1, got 0" in problems
    assert _has(problems, "pool.ref_cnt[7]: -1 is negative")


def test_lengths_and_block_ids_are_left_to_the_spec_checkers() -> None:
    """Values that are well-typed but wrong are the invariants' findings (BLOCK, POS,
    TOKEN under their own ids), so validation lets them through."""
    pool = AFTER.pool
    short = dataclasses.replace(pool, ref_cnt=pool.ref_cnt[:7])
    assert validate.check_pool_snapshot(short) == []
    t = pool.tables[0]
    bad_t = dataclasses.replace(t, token_ids=t.token_ids[:-1], block_table=(0, 8))
    wrong = dataclasses.replace(pool, tables=(bad_t,), free_queue=(*pool.free_queue, 99))
    assert validate.check_pool_snapshot(wrong) == []
    s = REPORT.scheduled[0]
    bad_s = _with(s, slot_mapping=s.slot_mapping[:3], samples=1)
    problems = validate.check_step_report(dataclasses.replace(REPORT, scheduled=(bad_s,)))
    assert problems == ["step_report.scheduled[0].samples: expected bool, got int 1"]
    bad_n = dataclasses.replace(s, num_new_tokens=5)
    assert validate.check_step_report(dataclasses.replace(REPORT, scheduled=(bad_n, bad_n))) == []


def test_duplicate_request_ids() -> None:
    r = AFTER.requests[0]
    problems = validate.check_engine_snapshot(dataclasses.replace(AFTER, requests=(r, r)))
    assert problems == ["snapshot.requests: request id 'A' listed twice (indices 0 and 1)"]
    t = AFTER.pool.tables[0]
    problems = validate.check_pool_snapshot(dataclasses.replace(AFTER.pool, tables=(t, t)))
    assert problems == ["pool.tables: request id 'A' has two tables (indices 0 and 1)"]
    s = REPORT.scheduled[0]
    problems = validate.check_step_report(dataclasses.replace(REPORT, scheduled=(s, s)))
    assert problems == []  # TOKEN reports a request scheduled twice
    problems = validate.check_commit_report(CommitReport((("A", "length"), ("A", "stop"))))
    assert problems == ["commit_report.finished: request id 'A' listed twice (indices 0 and 1)"]


def test_pairs_and_host_pool() -> None:
    rep = _with(REPORT, finished=(("A",),), block_copies=((1, -2),), swap_in=[(0, 1)])
    problems = validate.check_step_report(rep)
    assert (
        "step_report.finished[0]: expected a (request id, reason) tuple of two str, "
        "got tuple of length 1"
    ) in problems
    assert "step_report.block_copies[0][1]: -2 is negative" in problems
    assert _has(problems, "step_report.swap_in: expected a tuple of (src, dst) pairs, got list")
    host = dataclasses.replace(AFTER.pool, cache_entries=(), num_blocks=-1)
    problems = validate.check_engine_snapshot(dataclasses.replace(AFTER, host=host))
    assert "snapshot.host.num_blocks: -1 is negative" in problems


def test_structural_only_semantics_are_left_to_the_checkers() -> None:
    """A double free or a wrong ref count is BLOCK's finding, not a malformed record."""
    pool = AFTER.pool
    q = pool.free_queue
    wrong = dataclasses.replace(pool, free_queue=(*q, q[0]), ref_cnt=(5, *pool.ref_cnt[1:]))
    assert validate.check_pool_snapshot(wrong) == []


def test_problem_lines_are_capped() -> None:
    pool = dataclasses.replace(
        AFTER.pool,
        tables=tuple(
            TableSnapshot(f"r{i}", [0], -1, ())  # type: ignore[arg-type]
            for i in range(100)
        ),
    )
    problems = validate.check_pool_snapshot(pool)
    assert len(problems) == validate.MAX_PROBLEMS + 1
    assert problems[-1].endswith("more problems not shown")


# --------------------------------------------------------------------------- self-check


def _check(factory: object, timeout: float = 5.0) -> SelfCheckResult:
    assert callable(factory)
    return self_check(factory, call_timeout=timeout)


def _fails(res: SelfCheckResult, *parts: str) -> bool:
    return any("FAIL" in line and all(p in line for p in parts) for line in res.lines)


def test_self_check_passes_refserve(capsys: pytest.CaptureFixture[str]) -> None:
    res = _check(make)
    assert res.ok and res.exit_code == 0, res.render()
    text = res.render()
    assert "FAIL" not in text
    assert "ok: snapshot.pool (16 blocks, block size 4)" in text
    assert "decoding, num_computed_tokens 6 == num_tokens 7 - 1" in text
    assert "reason 'length'" in text
    assert "all 16 blocks free again" in text
    assert res.lines[-1].startswith("verdict: OK")
    assert self_check_main("refserve.conformance.adapters.ref:make", 5.0) == 0
    out = capsys.readouterr().out
    assert "verdict: OK" in out and "refserve.conformance.adapters.ref:make" in out


class ListSnapshot(RefAdapter):
    """Builds its snapshot with lists, as engines hold their state."""

    def snapshot(self) -> EngineSnapshot:
        s = super().snapshot()
        pool = dataclasses.replace(s.pool, ref_cnt=list(s.pool.ref_cnt))  # type: ignore[arg-type]
        return dataclasses.replace(s, requests=list(s.requests), pool=pool)  # type: ignore[arg-type]


class OffByOnePosition(RefAdapter):
    """Every decode reports position num_tokens instead of num_tokens - 1."""

    def schedule(self) -> StepReport:
        rep = super().schedule()
        out = []
        for s in rep.scheduled:
            if s.num_new_tokens == 1 and s.positions[0] > 0:
                s = dataclasses.replace(s, positions=(s.positions[0] + 1,))
            out.append(s)
        return dataclasses.replace(rep, scheduled=tuple(out))


class PhantomAfterA(RefAdapter):
    """Schedules a request 'Z' it was never given after A, its positions off by one."""

    def schedule(self) -> StepReport:
        rep = super().schedule()
        if not rep.scheduled:
            return rep
        a = rep.scheduled[0]
        z = dataclasses.replace(a, request_id="Z", positions=tuple(p + 1 for p in a.positions))
        return dataclasses.replace(rep, scheduled=(*rep.scheduled, z))


class RaisingSchedule(RefAdapter):
    def schedule(self) -> StepReport:
        table: dict[str, StepReport] = {}
        return table["x"]


class HangingSchedule(RefAdapter):
    def schedule(self) -> StepReport:
        time.sleep(30)
        return super().schedule()


class SilentFinish(RefAdapter):
    """Finishes the request but never says so in the commit report."""

    def commit(self, sampled: Mapping[str, int]) -> CommitReport:
        super().commit(sampled)
        return CommitReport()


class ComputedCountsSampled(RefAdapter):
    """Reports num_computed_tokens == num_tokens for a decoding request (and the table to
    match), the classic off-by-one of engines that derive one count from the other."""

    def snapshot(self) -> EngineSnapshot:
        s = super().snapshot()
        reqs = tuple(
            dataclasses.replace(r, num_computed_tokens=r.num_tokens)
            if r.status is RequestStatus.DECODING
            else r
            for r in s.requests
        )
        return dataclasses.replace(s, requests=reqs)


class WrongProperties(RefAdapter):
    @property
    def properties(self) -> dict[str, int]:  # type: ignore[override]
        return {"lookahead_slots": 1}


class SlotIsOffset(RefAdapter):
    """Reports each position's offset in its block as the slot (forgot the block)."""

    def schedule(self) -> StepReport:
        rep = super().schedule()
        bs = self.sched.config.block_size
        out = [
            dataclasses.replace(s, slot_mapping=tuple(p % bs for p in s.positions))
            for s in rep.scheduled
        ]
        return dataclasses.replace(rep, scheduled=tuple(out))


class StaysPrefilling(RefAdapter):
    """Maps the engine's running state to prefilling whatever the counters say."""

    def snapshot(self) -> EngineSnapshot:
        s = super().snapshot()
        reqs = tuple(
            dataclasses.replace(r, status=RequestStatus.PREFILLING)
            if r.status is RequestStatus.DECODING
            else r
            for r in s.requests
        )
        return dataclasses.replace(s, requests=reqs)


class ForgetsFinished(RefAdapter):
    """Lists live requests only: a finished request vanishes at once."""

    def snapshot(self) -> EngineSnapshot:
        s = super().snapshot()
        return dataclasses.replace(s, requests=tuple(r for r in s.requests if not r.status.is_done))


class NoneSnapshot(RefAdapter):
    def snapshot(self) -> EngineSnapshot:
        return None  # type: ignore[return-value]


class StrTokenCount(RefAdapter):
    """num_new_tokens as a string: the step cannot be read, so the check stops there."""

    def schedule(self) -> StepReport:
        rep = super().schedule()
        out = [_with(s, num_new_tokens=str(s.num_new_tokens)) for s in rep.scheduled]
        return dataclasses.replace(rep, scheduled=tuple(out))


class AlwaysBusy(RefAdapter):
    def has_unfinished(self) -> bool:
        return True


class LeakyFinish(RefAdapter):
    """The finished request's blocks never go back to the free queue."""

    def snapshot(self) -> EngineSnapshot:
        s = super().snapshot()
        if s.requests and all(r.status is RequestStatus.FINISHED for r in s.requests):
            pool = dataclasses.replace(s.pool, free_queue=s.pool.free_queue[:-2])
            return dataclasses.replace(s, pool=pool)
        return s


class LookaheadEngine(RefAdapter):
    """Declares lookahead_slots but is otherwise refserve: a declared convention is fine."""

    properties = EngineProperties(lookahead_slots=1)


def test_self_check_explains_lists_instead_of_tuples() -> None:
    res = _check(ListSnapshot)
    assert res.exit_code == 1
    assert _fails(res, "snapshot.pool.ref_cnt: expected a tuple of int, got list")
    assert _fails(res, "snapshot.requests: expected a tuple of RequestSnapshot, got list")
    # Reported once, not once per snapshot.
    assert sum(line.startswith("FAIL") and "pool.ref_cnt" in line for line in res.lines) == 1


def test_self_check_explains_off_by_one_position() -> None:
    res = _check(OffByOnePosition)
    assert res.exit_code == 1
    assert _fails(res, "positions are 7, expected 6", "off by one")
    assert "step 1:" in res.lines and "step 2:" not in res.lines  # stops after the bad step


def test_self_check_judges_a_by_its_own_entry() -> None:
    """A request the adapter invented is named; A's own entry is still what is checked
    (the entry after it, Z's, is not read as A's)."""
    res = _check(PhantomAfterA)
    assert res.exit_code == 1
    assert _fails(res, "schedule() scheduled 'Z', a request that was never added")
    assert not _fails(res, "positions are")


def test_self_check_explains_a_raise() -> None:
    res = _check(RaisingSchedule)
    assert res.exit_code == 1
    assert _fails(res, "schedule() raised KeyError: 'x' at test_selfcheck_and_validate.py:")
    assert res.lines[-1].startswith(
        "verdict: NOT OK: 1 problem, the first: step 0: schedule() raised"
    )


def test_self_check_explains_a_hang() -> None:
    t0 = time.monotonic()
    res = _check(HangingSchedule, timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert res.exit_code == 1
    assert _fails(res, "schedule() did not return within 0.5 s")


def test_self_check_explains_the_template() -> None:
    res = _check(template.make)
    assert res.exit_code == 1 and res.built
    assert _fails(res, "configure() raised NotImplementedError", "template.py:")
    assert any("note: features is empty" in line for line in res.lines)


def test_self_check_explains_a_missing_finish() -> None:
    res = _check(SilentFinish)
    assert res.exit_code == 1
    assert _fails(res, "did not report A finished", "max_tokens 3", "'length'")


def test_self_check_explains_a_computed_count_off_by_one() -> None:
    res = _check(ComputedCountsSampled)
    assert res.exit_code == 1
    assert _fails(res, "A.num_computed_tokens is 7, expected 6", "last sampled token")
    assert _fails(res, "the table's num_stored is 6 but A.num_computed_tokens is 7")


def test_self_check_explains_wrong_properties() -> None:
    res = _check(WrongProperties)
    assert res.exit_code == 1
    assert _fails(
        res, "properties:", "must be refserve.conformance.adapter.EngineProperties, got dict"
    )
    assert res.lines[-1].startswith("verdict: NOT OK: 1 problem")  # the walk itself is fine


def test_self_check_explains_a_slot_without_its_block() -> None:
    res = _check(SlotIsOffset)
    assert res.exit_code == 1
    assert _fails(
        res, "slot_mapping[4] is 0 for position 4", "block_table[pos // 4] * 4 + pos % 4", "= 4"
    )


def test_self_check_explains_a_wrong_status() -> None:
    res = _check(StaysPrefilling)
    assert res.exit_code == 1
    assert _fails(
        res,
        "after a chunk that reached the end of the prompt and sampled, the request should be "
        "decoding with num_computed_tokens == num_tokens - 1 (6 == 7 - 1)",
        "the snapshot says prefilling",
    )


def test_self_check_explains_a_vanished_finished_request() -> None:
    res = _check(ForgetsFinished)
    assert res.exit_code == 1
    assert _fails(res, "A finished in this step but is missing from the snapshot")


def test_self_check_explains_malformed_records_and_stops() -> None:
    res = _check(NoneSnapshot)
    assert res.exit_code == 1
    assert _fails(res, "snapshot: expected a refserve.spec.snapshot.EngineSnapshot, got None")
    res = _check(StrTokenCount)
    assert res.exit_code == 1
    assert _fails(res, "step_report.scheduled[0].num_new_tokens: expected int, got str '6'")
    assert not any(line.strip().startswith("ok: commit") for line in res.lines)


def test_self_check_explains_has_unfinished() -> None:
    res = _check(AlwaysBusy)
    assert res.exit_code == 1
    assert _fails(res, "has_unfinished() is True, expected False")


def test_self_check_explains_blocks_not_freed() -> None:
    res = _check(LeakyFinish)
    assert res.exit_code == 1
    assert _fails(res, "the free queue lacks blocks", "after the only request finished")


def test_self_check_accepts_a_declared_lookahead() -> None:
    res = _check(LookaheadEngine)
    assert res.ok, res.render()
    assert any("lookahead_slots 1" in line for line in res.lines)


def test_self_check_main_cannot_load(capsys: pytest.CaptureFixture[str]) -> None:
    assert self_check_main("nope:nothing", 1.0) == 2
    err = capsys.readouterr().err
    assert err.startswith("refserve conformance: error: ")
    assert self_check_main("refserve.conformance.adapters.ref:nothing", 1.0) == 2
    assert self_check_main("no-colon", 1.0) == 2


def _broken_factory() -> RefAdapter:
    raise RuntimeError("no GPU")


def test_self_check_cannot_build(capsys: pytest.CaptureFixture[str]) -> None:
    res = _check(_broken_factory)
    assert not res.built and res.exit_code == 2
    assert _fails(res, "factory() raised RuntimeError: no GPU")
    assert self_check_main(f"{__name__}:_broken_factory", 1.0) == 2
    assert "cannot build the adapter" in capsys.readouterr().err


def test_scheduled_request_record_used_by_tests_is_the_real_one() -> None:
    # Guards the fixtures above: they corrupt real records, not look-alikes.
    assert isinstance(REPORT.scheduled[0], ScheduledRequest)
