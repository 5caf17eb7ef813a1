"""A declared preemptive multi-level queue is a promise (ORDER, rules ``level-admission``
and ``level-preemption``): refserve under policy mlfq keeps it in the suite and in every
state of the explorer's tiny scope; a policy that admits a lower level over a higher one
that fitted, or displaces a request for one of its own level, is caught by the rule it
breaks; the declaration itself and the levels an adapter reports are checked."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

from refserve.conformance.adapter import (
    AdmissionOrder,
    EngineProperties,
    MultiLevelQueue,
    StepOrder,
)
from refserve.conformance.adapters.ref import CONFORMANCE_MLFQ, RefAdapter, make_mlfq
from refserve.conformance.explore import SCOPES, explore
from refserve.conformance.report import Report
from refserve.conformance.runner import run_with
from refserve.conformance.scenarios import by_name
from refserve.conformance.suite import run_suite
from refserve.core.config import PolicyName
from refserve.core.mlfq import SkipJoinMlfq
from refserve.core.policy import Displacement, Room
from refserve.core.request import Request
from refserve.core.waiting import WaitingQueue
from refserve.spec.order import LEVEL_ADMISSION, LEVEL_PREEMPTION


@pytest.fixture(scope="module")
def mlfq_report() -> Report:
    return run_suite(make_mlfq, "refserve.conformance.adapters.ref:make_mlfq", max_examples=60)


def test_refserve_under_mlfq_passes_the_suite_with_its_discipline_checked(
    mlfq_report: Report,
) -> None:
    fails = [
        f"{r.scenario}/{r.invariant}: {r.failure.message if r.failure else ''}"
        for r in mlfq_report.results
        if r.status == "fail"
    ]
    assert fails == []
    assert mlfq_report.summary()["not_supported"] == 0
    # ORDER is checked in every scenario (those moving requests between instances too),
    # under the discipline, not FCFS or decode-first.
    order = [r for r in mlfq_report.results if r.invariant == "ORDER"]
    assert len(order) == len(mlfq_report.scenarios), len(order)
    assert all(r.status == "pass" for r in order)
    assert mlfq_report.properties["multi_level"] == {"num_levels": 3, "by_priority": True}
    assert mlfq_report.properties["admission_order"] == "unspecified"
    assert mlfq_report.properties["step_order"] == "unspecified"
    assert any("rule level-preemption" in n for n in mlfq_report.notes)
    # The policy did reorder: preemptions (displacements, headroom swaps) happened.
    assert mlfq_report.policy["preemptions"] >= 5, mlfq_report.policy


def test_refserve_under_mlfq_exhausts_the_tiny_scope() -> None:
    res = explore(make_mlfq, SCOPES["tiny"], strategy="copy")
    assert res.exhausted and res.ok, res.summary()
    assert res.liveness is not None and not res.liveness.cycle


def test_the_levels_reported_are_the_policys() -> None:
    a = make_mlfq()
    res = run_with(lambda: a, by_name()["seed001-round-by-round"].workload)
    assert res.findings == []
    assert a.properties.multi_level == MultiLevelQueue(CONFORMANCE_MLFQ.num_queues, True)
    # Plain refserve keeps its FCFS-style declaration and has no levels to report.
    assert RefAdapter().properties.multi_level is None
    assert RefAdapter(policy="mlfq").properties.multi_level == MultiLevelQueue(4, True)


class _Planted(SkipJoinMlfq):
    """The mlfq policy, keeping a reference to its own waiting queue (the planted bugs
    read it)."""

    def waiting_queue(self, *, track_arrivals: bool) -> WaitingQueue:
        self.queue = super().waiting_queue(track_arrivals=track_arrivals)
        return self.queue


class LowerLevelsFirst(_Planted):
    """Planted: admission reads the levels from the lowest up."""

    def waiting_order(self, waiting: Iterable[Request], step_index: int) -> Iterable[Request]:
        return sorted(waiting, key=lambda r: (-self.level_of(r), r.seq))


class DisplacesItsEquals(_Planted):
    """Planted: with no seat free, the latest running request of the first waiting
    request's own level (or below) is displaced for it."""

    def displace(
        self, running: Sequence[Request], room: Room, step_index: int
    ) -> Sequence[Displacement]:
        out = list(super().displace(running, room, step_index))
        if out or room.free_seats >= 1:
            return out
        head = next(iter(self.waiting_order(self.queue, step_index)), None)
        if head is None:
            return out
        equals = [r for r in running if self.level_of(r) >= self.level_of(head)]
        if equals:
            victim = max(equals, key=lambda r: r.seq)
            out.append(Displacement(victim, "seat", head.request_id))
        return out


def _planted(policy: type[_Planted]) -> RefAdapter:
    return RefAdapter(
        policy_factory=policy,
        policy=PolicyName.MLFQ,
        mlfq=CONFORMANCE_MLFQ,
        num_host_blocks="pool",
    )


QUICK = ["seed001-round-by-round", "bug-preemption-storm", "generated-mixed"]


@pytest.mark.parametrize(
    ("policy", "rule"),
    [(LowerLevelsFirst, LEVEL_ADMISSION), (DisplacesItsEquals, LEVEL_PREEMPTION)],
    ids=["lower-levels-first", "displaces-its-equals"],
)
def test_a_planted_policy_bug_is_caught_by_its_rule(policy: type[_Planted], rule: str) -> None:
    report = run_suite(lambda: _planted(policy), policy.__name__, QUICK, max_examples=15)
    failures = [f for r in report.results if r.status == "fail" for f in r.failures]
    assert {f.rule for f in failures} == {rule}, [f.message for f in failures]
    # Nothing else is broken: the planted policy keeps every other rule.
    assert {r.invariant for r in report.results if r.status == "fail"} == {"ORDER"}


def test_the_declaration_replaces_the_orders_and_is_typed() -> None:
    ml = MultiLevelQueue(3)
    with pytest.raises(ValueError, match="multi_level replaces the admission order"):
        EngineProperties(admission_order=AdmissionOrder.FCFS, multi_level=ml)
    with pytest.raises(ValueError, match="multi_level replaces the step order"):
        EngineProperties(step_order=StepOrder.DECODE_FIRST, multi_level=ml)
    with pytest.raises(ValueError, match="num_levels must be an int in"):
        MultiLevelQueue(0)
    with pytest.raises(ValueError, match="multi_level must be a MultiLevelQueue"):
        EngineProperties(multi_level=3)  # type: ignore[arg-type]


class _Misreports(RefAdapter):
    """Declares the discipline but reports a level that does not exist."""

    def levels(self) -> dict[str, int]:
        return {rid: 7 for rid in super().levels()}


class _NoLevels(RefAdapter):
    """Declares the discipline on plain refserve, which has no levels to report."""

    properties = EngineProperties(max_model_len_stop=True, multi_level=MultiLevelQueue(2))


def test_levels_that_cannot_be_read_end_the_run_as_progress() -> None:
    w = by_name()["seed001-round-by-round"].workload
    bad = run_with(lambda: _Misreports(policy="mlfq", mlfq=CONFORMANCE_MLFQ), w).findings
    assert [f.violation.invariant.value for f in bad] == ["PROGRESS"]
    assert "level 7 does not exist (declared num_levels 3)" in bad[0].violation.message
    res = run_with(_NoLevels, w)
    assert res.not_supported.startswith("levels(): levels exist only under policy mlfq")


def test_mlfq_settings_of_the_wrong_type_are_not_supported() -> None:
    # refserve's configuration refuses them at configure: the scenario cannot run.
    res = run_with(
        lambda: RefAdapter(policy="mlfq", mlfq=3), by_name()["seed001-round-by-round"].workload
    )
    assert "mlfq must be MlfqSettings" in res.not_supported
