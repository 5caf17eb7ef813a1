"""Conformance for other engines' migration (feature ``migration``, conformance/migration.py).

refserve's adapter moves requests through ref/core/transit.py and passes every migration
scenario; the independent indie engine passes both by transfer and by always recomputing
(a different design choice); each bug planted in indie's migration code is caught under
the migration rule a reader would expect (spec/cluster.py), including in disaggregated
prefill/decode, at the operation that broke it; an engine without the feature is skipped
with its reason in the report; malformed migration records are findings, not crashes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import indie_adapter
import pytest
from indie_engine import MIGRATION_BUGS

from refserve.conformance.adapter import (
    EngineAdapter,
    Feature,
    MigrationExport,
    MigrationStaged,
    RequestSpec,
)
from refserve.conformance.adapters.ref import RefAdapter
from refserve.conformance.adapters.ref import make as make_ref
from refserve.conformance.adapters.ref import make_swap as make_ref_swap
from refserve.conformance.cli import conformance_main
from refserve.conformance.report import Report
from refserve.conformance.runner import RunResult, run_fresh, run_workload
from refserve.conformance.scenarios import _cfg, by_name
from refserve.conformance.shrink import shrink, signature
from refserve.conformance.suite import run_suite, scenario_names
from refserve.conformance.workload import MigrationPlan, RequestPlan, Workload, prompt
from refserve.spec.violation import CLUSTER_INVARIANTS, Invariant

MIGRATION_SCENARIOS = [n for n in scenario_names() if n.startswith(("migration-", "disagg"))]
FIXED = [n for n in MIGRATION_SCENARIOS if n != "generated-migration"]


def _moves(run: RunResult) -> list[dict[str, Any]]:
    return [e for e in run.trace if "migrate" in e]


def _fails(report: Report) -> list[str]:
    return [
        f"{r.scenario}/{r.invariant}: {r.failure.message if r.failure else ''}"
        for r in report.results
        if r.status == "fail"
    ]


def test_the_migration_scenarios_are_in_the_library() -> None:
    assert "generated-migration" in scenario_names()
    assert len(FIXED) == 9 and "disaggregation-prefill-decode" in FIXED
    for name in FIXED:
        assert Feature.MIGRATION in by_name()[name].needs(), name


# ------------------------------------------------------------------ correct engines
@pytest.mark.parametrize(
    "factory", [make_ref, make_ref_swap, indie_adapter.make_migrating], ids=["ref", "swap", "indie"]
)
def test_a_correct_engine_passes_every_migration_scenario(factory: Any) -> None:
    report = run_suite(factory, "x:y", MIGRATION_SCENARIOS, max_examples=20)
    assert _fails(report) == []
    assert report.summary()["not_supported"] == 0
    checked = {r.invariant for r in report.results if r.status == "pass"}
    assert {str(i) for i in CLUSTER_INVARIANTS} <= checked


def test_refserve_declares_migration_and_moves_really_happen() -> None:
    """Each fixed scenario does what it says: K/V moved, from the host too under swap,
    destination hits, refusals, link faults, recomputes, three engines, disaggregation."""
    assert Feature.MIGRATION in make_ref().features
    assert isinstance(make_ref(), EngineAdapter)
    runs = {n: run_fresh(make_ref, by_name()[n].workload) for n in FIXED}
    assert all(r.ok for r in runs.values()), {n: r.findings[:1] for n, r in runs.items()}
    done = {n: [e for e in _moves(r) if "sent" in e and "fault" not in e] for n, r in runs.items()}
    assert all(done[n] for n in FIXED), done  # every scenario completes a move
    assert any(e["hit"] for e in done["migration-destination-hit"])
    assert all(e["sent"] == 0 for e in done["migration-recompute"])
    assert any(e["kv_length"] for e in done["migration-recompute"])  # it had KV to drop
    faults = [e["fault"] for e in _moves(runs["migration-link-faults"]) if "fault" in e]
    assert sorted(faults) == ["abort_in_transit", "before_ack", "before_ack"]
    assert any("refused" in e for e in _moves(runs["migration-refused"]))
    assert {e["to"] for e in done["migration-three-engines"]} == {"A", "B", "C"}
    disagg = runs["disaggregation-prefill-decode"]
    assert sorted(e["migrate"] for e in _moves(disagg)) == ["A", "B", "C", "D"]
    # Prefill on A, decode on B: after the moves every step on B is a decode.
    assert all(
        all(s["n"] == 1 for s in e["scheduled"]) for e in disagg.trace if e.get("engine") == "B"
    )
    swapped = run_fresh(make_ref_swap, by_name()["migration-under-preemption"].workload)
    assert swapped.ok and any(e["host"] and e["sent"] for e in _moves(swapped))


def test_an_engine_that_always_recomputes_passes_too() -> None:
    """A different design choice: indie's recompute variant never takes K/V."""
    report = run_suite(indie_adapter.make_recompute, "x:y", MIGRATION_SCENARIOS, max_examples=20)
    assert _fails(report) == []
    run = run_fresh(indie_adapter.make_recompute, by_name()["migration-decode-transfer"].workload)
    moved = [e for e in _moves(run) if "sent" in e]
    assert moved and all(e["sent"] == 0 and e["hit"] == 0 for e in moved)
    assert any(e["kv_length"] for e in moved)


# ------------------------------------------------------------------ planted bugs
# bug -> (the migration rule that must fail, the first operation where it shows)
EXPECTED = {
    "wrong_block_sent": (Invariant.KVCOPY, "migrate: acknowledged"),
    "free_before_ack": (Invariant.MOVED, "migrate: exported"),
    "hit_counted_twice": (Invariant.MOVED, "migrate: committed"),
}


def test_every_migration_bug_has_an_expectation() -> None:
    assert set(EXPECTED) == MIGRATION_BUGS
    for bug in MIGRATION_BUGS:
        a = getattr(indie_adapter, f"make_migrating_{bug}")()
        assert a.bug == bug and Feature.MIGRATION in a.features


@pytest.mark.parametrize("bug", sorted(EXPECTED))
@pytest.mark.parametrize("scenario", ["migration-destination-hit", "disaggregation-prefill-decode"])
def test_each_planted_bug_is_caught_at_the_operation_that_broke_it(bug: str, scenario: str) -> None:
    invariant, phase = EXPECTED[bug]
    factory = getattr(indie_adapter, f"make_migrating_{bug}")
    run = run_fresh(factory, by_name()[scenario].workload)
    found = [f for f in run.findings if f.invariant is invariant]
    assert found, [str(f) for f in run.findings]
    assert found[0].phase == phase, str(found[0])
    # The same workload on the correct engine is clean: the bug, not the scenario.
    assert run_fresh(indie_adapter.make_migrating, by_name()[scenario].workload).ok


def test_the_source_freeing_early_also_breaks_the_pure_read_of_the_export() -> None:
    run = run_fresh(
        indie_adapter.make_migrating_free_before_ack, by_name()["migration-link-faults"].workload
    )
    atomic = [f for f in run.findings if f.invariant is Invariant.ATOMIC]
    assert atomic and "by an export (a pure read)" in atomic[0].violation.message


@pytest.mark.parametrize("bug", sorted(EXPECTED))
def test_a_planted_bug_shrinks_to_a_small_workload_that_replays(bug: str) -> None:
    invariant, _ = EXPECTED[bug]
    factory = getattr(indie_adapter, f"make_migrating_{bug}")

    def run(w: Workload) -> RunResult:
        return run_fresh(factory, w)

    first = run(by_name()["migration-destination-hit"].workload)
    sig = signature(next(f for f in first.findings if f.invariant is invariant))
    small = shrink(run, first, sig).workload
    assert len(small.requests) <= 2 and len(small.migrations) <= 2, small
    assert small != first.workload
    replay = run(Workload.from_json(small.to_json()))
    assert sig in {signature(f) for f in replay.findings}


# ------------------------------------------------------------------ no feature
def test_an_adapter_without_migration_is_skipped_with_the_reason_stated() -> None:
    report = run_suite(indie_adapter.make, "indie_adapter:make", MIGRATION_SCENARIOS)
    rows = [r for r in report.results if r.scenario in MIGRATION_SCENARIOS]
    assert rows and all(r.status == "not_supported" for r in rows)
    assert all(r.note == "engine lacks migration" for r in rows), {r.note for r in rows}
    # The migration rules are listed as skipped, not passed.
    assert {r.invariant for r in rows} >= {str(i) for i in CLUSTER_INVARIANTS}
    notes = " ".join(report.notes)
    assert "migration: not declared" in notes and "not checked" in notes
    # An engine-only scenario still lists one engine's invariants only.
    other = run_suite(indie_adapter.make, "indie_adapter:make", ["bug-abort-waiting"])
    assert not {r.invariant for r in other.results} & {str(i) for i in CLUSTER_INVARIANTS}


# ------------------------------------------------------------------ the protocol
class _BadExport(RefAdapter):
    """Returns the export's slots as a list and under another request's id."""

    def export_request(self, request_id: str) -> MigrationExport:
        e = super().export_request(request_id)
        return dataclasses.replace(e, request_id="other", kv_slots=list(e.kv_slots))  # type: ignore[arg-type]


class _StagesTooLittle(RefAdapter):
    """The destination drops the last staged slot: a position never sent."""

    def stage_import(self, export: MigrationExport, transfer: bool) -> MigrationStaged:
        s = super().stage_import(export, transfer)
        return dataclasses.replace(s, kv_slots=s.kv_slots[:-1]) if s.kv_slots else s


def test_a_malformed_migration_record_is_a_finding_naming_the_field() -> None:
    run = run_fresh(_BadExport, by_name()["migration-decode-transfer"].workload)
    msgs = [f.violation.message for f in run.findings]
    assert len(msgs) == 1 and "export_request() returned a malformed record" in msgs[0], msgs
    assert "export.request_id: 'other' is not the request asked for" in msgs[0]


def test_a_position_the_link_never_carried_is_read_back_as_missing() -> None:
    run = run_fresh(_StagesTooLittle, by_name()["migration-decode-transfer"].workload)
    # The short receive list is seen at the stage (MOVED, rule handoff) ...
    first = run.findings[0]
    assert (first.invariant, first.phase, first.violation.rule) == (
        Invariant.MOVED,
        "migrate: staged",
        "handoff",
    ), first
    # ... and the position it leaves out reads back as missing once acknowledged.
    read = next(f for f in run.findings if f.invariant is Invariant.KVCOPY)
    assert read.phase == "migrate: acknowledged", read
    assert read.violation.seen == "None"  # the slot the destination never asked for


def test_a_migration_workload_round_trips_through_json() -> None:
    w = by_name()["migration-link-faults"].workload
    assert Workload.from_json(w.to_json()) == w
    d = by_name()["disaggregation-prefill-decode"].workload
    assert Workload.from_json(d.to_json()) == d and d.instances == 2


def test_bad_moves_and_too_few_peers_are_typed_errors() -> None:
    with pytest.raises(ValueError, match="fault must be one of"):
        MigrationPlan(0, "A", fault="mid_air")
    with pytest.raises(ValueError, match="at >= 0"):
        MigrationPlan(-1, "A")
    w = Workload(
        _cfg(4, 8, 8, 2),
        (RequestPlan("A", prompt(1, 3), 2),),
        migrations=(MigrationPlan(1, "A", 2),),
    )
    assert w.instances == 3 and w.needs() >= {Feature.MIGRATION}
    with pytest.raises(ValueError, match="runs on 3 instances; 1 peer"):
        run_workload(make_ref(), w, peers=[make_ref()])


def test_a_ticket_from_another_engine_is_refused_with_nothing_changed() -> None:
    ref, indie = make_ref(), indie_adapter.make_migrating()
    for a in (ref, indie):
        a.configure(_cfg(4, 8, 8, 2))
    ref.add_request(RequestSpec("A", prompt(2, 5), 3))
    exp = ref.export_request("A")
    before = indie.snapshot()
    with pytest.raises(Exception, match="not an indie ticket"):
        indie.stage_import(exp, True)
    assert indie.snapshot() == before


def test_a_shrunk_migration_workload_replays_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = by_name()["migration-destination-hit"].workload
    path = tmp_path / "w.json"
    path.write_text(json.dumps(w.to_json()))
    bug = "indie_adapter:make_migrating_wrong_block_sent"
    assert conformance_main(["--adapter", bug, "--replay", str(path)]) == 1
    out = capsys.readouterr().out
    assert "KVCOPY" in out and '"migrate": "Q"' in out
    assert (
        conformance_main(["--adapter", "indie_adapter:make_migrating", "--replay", str(path)]) == 0
    )


def test_a_peer_that_cannot_describe_itself_is_a_finding_not_a_crash() -> None:
    built: list[RefAdapter] = []

    class FlakyPeer(RefAdapter):
        def __init__(self) -> None:
            super().__init__()
            built.append(self)
            self.n = len(built)

        @property
        def features(self) -> frozenset[Feature]:
            if self.n > 1:
                raise RuntimeError("peer broken")
            return super().features

    run = run_fresh(FlakyPeer, by_name()["migration-refused"].workload)
    assert len(built) == 2
    assert [(f.invariant, f.phase) for f in run.findings] == [(Invariant.PROGRESS, "setup")]
    assert "peer broken" in run.findings[0].violation.message
