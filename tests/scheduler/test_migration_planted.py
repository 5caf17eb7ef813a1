"""Planted migration bugs at the scheduler level, each caught by a named
migration rule (spec/cluster.py, docs/MIGRATION.md "The rules").

Each bug is planted by monkeypatching the real code of ref/core/transit.py (or what the
scheduler calls from it): a block sent from the wrong position, the source freeing the
request before the ack, the destination counting a cached block twice (an extra
reference on a prefix-hit block; the hit added to the KV length twice). Every test runs
the same move with and without the bug: with it, the named rule fails at the named
phase; without it, every rule holds at every phase. The first two are also caught by the
cluster state machine (tests/scheduler/test_migration_state_machine.py), run here with
the bug planted until it fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import refserve.core.transit as transit
from refserve.core.config import SchedulerConfig
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.core.transit import Arrival, Departure, Import, MigrationError
from refserve.spec.checks import check_cluster
from refserve.spec.cluster import ClusterSnapshot, ClusterStep, TransitPhase
from refserve.spec.snapshot import RequestStatus
from refserve.spec.violation import Invariant, Violation
from tests.harness import Boom, MemoryLink, Stepper, cluster_snapshot
from tests.phased_migration import PhasedMigration, PhasedMigrationAborted
from tests.scheduler.test_migration_state_machine import ClusterMachine

PROMPT = list(range(10, 22))  # 12 distinct tokens: three blocks of 4
Plant = Callable[[pytest.MonkeyPatch], None]


# --------------------------------------------------------------------- the bugs
def wrong_position(mp: pytest.MonkeyPatch) -> None:
    """The source sends, for every position past its first block, the slot of the block
    before: its K/V goes out one block off (the export's slots are the bug's site)."""
    real = transit.export

    def shifted(sched: Scheduler, request_id: str) -> Departure:
        d = real(sched, request_id)
        bs = sched.config.block_size
        return replace(
            d, slots=tuple(d.slots[p - bs if p >= bs else p] for p in range(len(d.slots)))
        )

    # PhasedMigration exports and re-reads through the module's name.
    mp.setattr(transit, "export", shifted)


def release_before_ack(mp: pytest.MonkeyPatch) -> None:
    """The source frees the request as soon as the destination staged it."""
    real = PhasedMigration.stage

    def stage(self: PhasedMigration) -> Arrival:
        a = real(self)
        transit.release(self.src, self.request_id)
        return a

    mp.setattr(PhasedMigration, "stage", stage)


def hit_referenced_twice(mp: pytest.MonkeyPatch) -> None:
    """The destination takes one more reference on the first block of its prefix hit."""
    real = Import.stage

    def stage(self: Import, state: transit.RequestState, *, with_kv: bool) -> Arrival:
        a = real(self, state, with_kv=with_kv)
        if a.num_hit_tokens:
            pool = self._sched.pool
            pool._blocks.share([pool.block_table(state.request_id)[0]])
        return a

    mp.setattr(Import, "stage", stage)


def hit_counted_twice(mp: pytest.MonkeyPatch) -> None:
    """The destination adds its prefix hit to the KV length once more on commit."""
    real = transit._place

    def place(sched: Scheduler, a: Arrival, offset_ms: float) -> Request:
        return real(sched, replace(a, kv_length=a.kv_length + a.num_hit_tokens), offset_ms)

    mp.setattr(transit, "_place", place)


# ---------------------------------------------------------------------- the move
@dataclass
class Observed:
    labels: list[str]
    snaps: list[ClusterSnapshot]
    error: BaseException | None = None

    def violations(self) -> dict[str, list[Violation]]:
        """Every rule's findings, by the phase that ended the step they are about."""
        out: dict[str, list[Violation]] = {}
        for label, x, y in zip(self.labels[1:], self.snaps, self.snaps[1:], strict=False):
            out.setdefault(label, []).extend(check_cluster(ClusterStep(x, y)))
        return out


def move_with_hit(fault: str | None = None) -> Observed:
    """``r`` (PROMPT, decoding on ``a``, blocks of 4) moves by transfer, one block a
    chunk, to ``b`` (blocks of 2), which holds PROMPT's first 8 tokens in its cache."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_blocks=12, max_model_len=40
    )
    e = {"a": Stepper(cfg, memory=True), "b": Stepper(replace(cfg, block_size=2), memory=True)}
    p = Request("p", [*PROMPT[:8], 99], StopParams(2, ignore_eos=True))
    e["b"].add(p)
    e["b"].drain()
    done = {"p": tuple(p.output_token_ids)}
    e["a"].add(Request("r", list(PROMPT), StopParams(8, ignore_eos=True)))
    e["a"].decoding("r")
    e["a"].step()
    seen = Observed(["start"], [cluster_snapshot(e, finished=done)])
    move = PhasedMigration(
        e["a"].sched, e["b"].sched, "r", with_kv=True, link=MemoryLink(e["a"], e["b"])
    )
    move.chunk_blocks = 1

    def observe(m: PhasedMigration) -> None:
        seen.labels.append(str(m.phase))
        seen.snaps.append(cluster_snapshot(e, (m, "a", "b"), done, seen.snaps[-1]))

    def hook(point: str) -> None:
        if point == fault:
            raise Boom(point)

    try:
        move.run(fault=hook, observe=observe)
        seen.labels.append("committed")
    except (PhasedMigrationAborted, MigrationError) as err:
        seen.error = err
        seen.labels.append("aborted")
    seen.snaps.append(cluster_snapshot(e, finished=done, since=seen.snaps[-1]))
    assert move.arrival is not None and move.arrival.num_hit_tokens == 8
    return seen


def rules(found: list[Violation]) -> set[Invariant]:
    return {v.invariant for v in found}


@pytest.fixture(params=[False, True], ids=["bug removed", "bug planted"])
def planted(request: pytest.FixtureRequest) -> bool:
    on: bool = request.param
    return on


def _plant(on: bool, bug: Plant, mp: pytest.MonkeyPatch) -> None:
    if on:
        bug(mp)


def _clean(seen: Observed) -> None:
    found = seen.violations()
    assert all(v == [] for v in found.values()), found
    assert seen.labels[-1] == "committed", seen.error


# ----------------------------------------------------------------------- the tests
def test_block_sent_from_the_wrong_position(planted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    _plant(planted, wrong_position, monkeypatch)
    seen = move_with_hit()
    if not planted:
        _clean(seen)
        return
    found = seen.violations()
    # The export already names slots the source's table does not hold for those
    # positions (MOVED, rule handoff), before the link carries anything; at the ack the
    # destination then reads the block before the one it should (KVCOPY).
    exported = found["exported"]
    assert rules(exported) == {Invariant.MOVED}
    assert {v.rule for v in exported} == {"handoff"}
    acked = found["acked"]
    assert rules(acked) == {Invariant.MOVED, Invariant.KVCOPY}
    assert any("does not hold the source's token" in v.message for v in acked)


def test_source_frees_before_the_ack(planted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    _plant(planted, release_before_ack, monkeypatch)
    seen = move_with_hit(fault="before_ack")
    if not planted:
        found = seen.violations()
        assert all(v == [] for v in found.values()), found
        assert isinstance(seen.error, PhasedMigrationAborted) and seen.error.point == "before_ack"
        assert seen.snaps[-1].holders("r") == ["a"]  # the fault left it on the source
        return
    found = seen.violations()
    # Staged, the source no longer holds it: it has no owner until the ack.
    staged = found["staged"]
    assert any(v.invariant is Invariant.OWNER and "its source only" in v.message for v in staged)
    assert any(v.invariant is Invariant.CONSERVE and "lost" in v.message for v in staged)
    # The move then aborts (the source changed under it): on neither engine, lost.
    assert isinstance(seen.error, MigrationError)
    end = found["aborted"]
    assert any(v.invariant is Invariant.OWNER and "no engine owns it" in v.message for v in end)
    assert seen.snaps[-1].holders("r") == []


def test_destination_references_a_hit_block_twice(
    planted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    _plant(planted, hit_referenced_twice, monkeypatch)
    seen = move_with_hit()
    if not planted:
        _clean(seen)
        return
    found = seen.violations()
    for phase in ("staged", "acked", "released", "committed"):
        leak = [v for v in found[phase] if v.invariant is Invariant.LEAK]
        assert leak and all("ref_cnt differs" in v.message for v in leak), (phase, found[phase])
        assert all(v.subject.startswith("engine b: block ") for v in leak)


def test_destination_counts_its_hit_twice(planted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    _plant(planted, hit_counted_twice, monkeypatch)
    seen = move_with_hit()
    if not planted:
        _clean(seen)
        return
    found = seen.violations()
    assert all(found[p] == [] for p in ("staged", "acked", "released"))
    moved = [v for v in found["committed"] if v.invariant is Invariant.MOVED]
    assert any("with other counters" in v.message for v in moved), found["committed"]


def test_ack_refuses_a_copy_that_is_not_complete() -> None:
    """The protocol's own guard: an ack before every needed slot is written is a typed
    error, and the move aborts with both engines as they were."""
    cfg = SchedulerConfig(max_num_batched_tokens=16, block_size=4, num_blocks=12)
    a, b = Stepper(cfg, memory=True), Stepper(cfg, memory=True)
    a.add(Request("r", list(PROMPT), StopParams(4, ignore_eos=True)))
    a.decoding("r")
    before = (a.sched.snapshot(), b.sched.snapshot())
    move = PhasedMigration(a.sched, b.sched, "r", with_kv=True, link=MemoryLink(a, b))
    move.export()
    move.stage()
    with pytest.raises(MigrationError, match="still missing"):
        move.ack()
    start, end = move.chunks()[0]
    with pytest.raises(MigrationError, match="out of order"):
        move.copy(start + 1, end)
    move.abort()
    assert (a.sched.snapshot(), b.sched.snapshot()) == before
    assert a.sched.requests["r"].status is RequestStatus.DECODING
    with pytest.raises(MigrationError, match="chunk_blocks"):
        PhasedMigration(a.sched, b.sched, "r", with_kv=True, link=MemoryLink(a, b), chunk_blocks=0)
    with pytest.raises(MigrationError, match="one engine"):
        PhasedMigration(a.sched, a.sched, "r", with_kv=True, link=MemoryLink(a, a))


# ------------------------------------------------------ caught by the state machine
_HUNT = settings(
    max_examples=300,
    stateful_step_count=30,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.generate],  # the first failure is the finding: no shrinking
    suppress_health_check=list(HealthCheck),
    report_multiple_bugs=False,
)


@pytest.mark.parametrize(
    ("bug", "rule"),
    [(wrong_position, "[MOVED]"), (release_before_ack, "[OWNER]")],
    ids=["wrong position", "release before the ack"],
)
def test_the_state_machine_catches(bug: Plant, rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    bug(monkeypatch)
    with pytest.raises(AssertionError, match=r"\[[A-Z]+\]") as err:
        run_state_machine_as_test(ClusterMachine, settings=_HUNT)
    assert rule in str(err.value), str(err.value)[:2000]


def test_a_failing_observer_aborts_the_move_and_is_raised_as_it_is() -> None:
    """A broken rule seen mid-move is the finding itself: ``PhasedMigration.run`` aborts (both
    engines as before) and raises it unwrapped, not as a ``PhasedMigrationAborted``."""
    cfg = SchedulerConfig(max_num_batched_tokens=16, block_size=4, num_blocks=12)
    a, b = Stepper(cfg, memory=True), Stepper(cfg, memory=True)
    a.add(Request("r", list(PROMPT), StopParams(4, ignore_eos=True)))
    a.decoding("r")
    before = (a.sched.snapshot(), b.sched.snapshot(), dict(b.memory))
    move = PhasedMigration(
        a.sched, b.sched, "r", with_kv=True, link=MemoryLink(a, b), chunk_blocks=1
    )

    def observe(m: PhasedMigration) -> None:
        if m.phase is TransitPhase.STAGED and b.memory != before[2]:
            raise AssertionError("a rule broke mid-copy")

    with pytest.raises(AssertionError, match="a rule broke mid-copy"):
        move.run(observe=observe)
    assert move.phase is None
    assert (a.sched.snapshot(), b.sched.snapshot(), dict(b.memory)) == before
