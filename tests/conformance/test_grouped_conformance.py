"""The grouped KV level of the conformance suite (conformance/kv/grouped_*.py).

Two correct grouped managers (eager and lazy window freeing) pass with zero findings;
each planted bug is caught under the rule that names it, with a shrunk workload that
replays; an adapter that faults is a finding, never a crash; the CLI runs it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grouped_reference as G
import pytest

from refserve.conformance.cli import conformance_main
from refserve.conformance.kv.grouped_run import replay_grouped
from refserve.conformance.kv.grouped_suite import (
    grouped_scenario_names,
    grouped_scenarios,
    run_grouped_generated,
    run_grouped_kv_suite,
)
from refserve.conformance.kv.grouped_workload import GroupedWorkload
from refserve.conformance.kv.groups import GroupedKVAdapter, GroupedKVAdapterFactory
from refserve.conformance.kv.protocol import KVFeature
from refserve.conformance.report import Result

EXAMPLES = 60


def _failures(results: list[Result]) -> list[tuple[str, str, str]]:
    return [(r.invariant, f.rule, f.message) for r in results for f in r.failures]


@pytest.mark.parametrize(
    "factory",
    [G.make, G.make_lazy, G.make_release_on_refusal],
    ids=["eager", "lazy", "release-on-refusal"],
)
def test_correct_grouped_managers_pass(factory: GroupedKVAdapterFactory) -> None:
    assert isinstance(factory(), GroupedKVAdapter)
    pairs = run_grouped_kv_suite(factory, "grouped_reference:x", max_examples=EXAMPLES)
    results = [r for rs, _ in pairs for r in rs]
    assert _failures(results) == []
    assert [info.name for _, info in pairs] == grouped_scenario_names()
    assert {r.invariant for r in results if r.status == "pass"} >= {"BLOCK", "ATOMIC", "CAP"}
    coverage = pairs[-1][1].observed["coverage"]
    # The search reaches what the rules are about: hits, refusals, evictions, and (eager)
    # window blocks released.
    assert coverage["cache_hits"] >= 5 and coverage["no_space"] >= 5
    assert coverage["evictions"] >= 5 and coverage["window_released"] >= 5


def test_fixed_scenarios_exercise_what_they_name() -> None:
    from refserve.conformance.kv.grouped_run import replay_grouped_workload

    cov = {
        sc.name: replay_grouped_workload(G.make, sc.workload, 10).coverage
        for sc in grouped_scenarios()
    }
    assert cov["kv-groups-slide"]["window_released"] >= 2
    assert cov["kv-groups-shared-hit"]["cache_hits"] == 1
    assert cov["kv-groups-evicted-hit"]["no_space"] == 1
    assert cov["kv-groups-evicted-hit"]["evictions"] >= 4


BUGS = [
    (G.make_window_early, "KVLEN", "window-early"),
    (G.make_hit_missing_window, "PREFIX", "prefix-complete"),
    (G.make_free_shared, "BLOCK", ""),
    (G.make_full_drops, "BLOCK", "full-null"),
]


@pytest.mark.parametrize(
    ("factory", "invariant", "rule"), BUGS, ids=[b[2] or "block" for b in BUGS]
)
def test_planted_bug_is_caught_with_its_rule(
    factory: GroupedKVAdapterFactory, invariant: str, rule: str
) -> None:
    pairs = run_grouped_kv_suite(factory, "grouped_reference:x", max_examples=EXAMPLES)
    found = [(r, f) for rs, _ in pairs for r in rs for f in r.failures]
    hits = [(r, f) for r, f in found if r.invariant == invariant and f.rule == rule]
    assert hits, _failures([r for rs, _ in pairs for r in rs])
    if rule == "":
        assert any("free queue" in f.message for _, f in hits)
    # Each finding's shrunk workload replays to the same finding on a fresh adapter.
    for _, f in hits:
        again = replay_grouped(factory, f.workload)
        assert any(x.signature == f.signature for x in again), (f.workload, again)
    # The generated search alone finds it too (not only a fixed scenario).
    gen, _ = run_grouped_generated(factory, factory().features, max_examples=EXAMPLES)
    assert any(r.invariant == invariant and f.rule == rule for r in gen for f in r.failures)


def test_a_refusal_may_release_only_the_blocks_past_the_window() -> None:
    """ATOMIC after NoSpace: the refused request's out-of-window blocks may go back
    (vLLM's order), anything else changed is a finding."""
    from refserve.conformance.kv.grouped_checks import refused_atomic

    run_before = G.GroupedRef()
    run_before.configure(grouped_scenarios()[0].workload.config)
    run_before.allocate("r1", list(range(11)), 11)
    before = run_before.snapshot()
    run_before.release_past_window("r1", 11, grow=False)
    released = run_before.snapshot()
    assert before != released and refused_atomic(before, released, "r1", 11) == []
    assert refused_atomic(before, released, "r1", 6) != []  # at 6 nothing had left
    run_before.free("r1")
    assert refused_atomic(before, run_before.snapshot(), "r1", 11) != []


class _LazyClaimsEager(G.GroupedRef):
    """The lazy design declaring window_eager_free: then its kept blocks are findings."""

    def __init__(self) -> None:
        super().__init__(eager=False)

    @property
    def features(self) -> frozenset[KVFeature]:
        return super().features | {KVFeature.WINDOW_EAGER_FREE}


def test_window_late_only_for_a_manager_that_declares_eager_freeing() -> None:
    sc = next(s for s in grouped_scenarios() if s.name == "kv-groups-slide")
    assert replay_grouped(G.make_lazy, sc.workload.to_json()) == []
    found = replay_grouped(_LazyClaimsEager, sc.workload.to_json())
    assert [(str(f.invariant), f.violation.rule) for f in found] == [("BLOCK", "window-late")]


class _Faulty(G.GroupedRef):
    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def allocate(self, request_id: str, token_ids: Any, num_new_tokens: int) -> Any:
        if self.fault == "raise":
            raise RuntimeError("boom")
        if self.fault == "one_table":
            return super().allocate(request_id, token_ids, num_new_tokens).block_tables[0]
        return super().allocate(request_id, token_ids, num_new_tokens)

    def snapshot(self) -> Any:
        return None if self.fault == "no_snapshot" else super().snapshot()


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        ("raise", "allocate('r1', n=6) raised RuntimeError: boom"),
        ("one_table", "returned a malformed value"),
        ("no_snapshot", "snapshot() returned a malformed value: None"),
    ],
)
def test_an_adapter_fault_is_a_progress_finding(fault: str, words: str) -> None:
    sc = grouped_scenarios()[0]
    found = replay_grouped(lambda: _Faulty(fault), sc.workload.to_json())
    assert len(found) == 1 and str(found[0].invariant) == "PROGRESS", found
    assert words in found[0].violation.message


def test_workload_json_round_trips_and_is_validated() -> None:
    for sc in grouped_scenarios():
        assert GroupedWorkload.from_json(json.dumps(sc.workload.to_json())) == sc.workload
    good = grouped_scenarios()[0].workload.to_json()
    bad_cases = [
        ({**good, "ops": [{"op": "fork", "parent": "a", "child": "b"}]}, "not a grouped op"),
        ({**good, "grouped_kv_config": {**good["grouped_kv_config"], "groups": []}}, "groups"),
        (
            {
                **good,
                "grouped_kv_config": {
                    **good["grouped_kv_config"],
                    "groups": [{"kind": "window", "window": 0}],
                },
            },
            "window >= 1",
        ),
        ({"ops": []}, "grouped_kv_config"),
    ]
    for bad, words in bad_cases:
        with pytest.raises(ValueError, match=words):
            GroupedWorkload.from_json(bad)


# ------------------------------------------------------------------------------ the CLI
def test_cli_runs_the_grouped_suite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "r.json"
    argv = ["--grouped-kv-adapter", "grouped_reference:make", "--examples", "10"]
    assert conformance_main([*argv, "--no-progress", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "grouped KV adapter grouped_reference:make: 0 of 4 scenarios failed" in out
    data = json.loads(report.read_text())
    assert data["grouped_kv_adapter"] == "grouped_reference:make"
    assert {r["scenario"] for r in data["results"]} == set(grouped_scenario_names())


def test_cli_reports_findings_and_replays_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "r.json"
    argv = ["--grouped-kv-adapter", "grouped_reference:make_full_drops", "--examples", "5"]
    assert conformance_main([*argv, "--no-progress", "--report", str(report)]) == 1
    assert "FAIL kv-groups-slide BLOCK" in capsys.readouterr().out
    failure = next(
        r["failure"] for r in json.loads(report.read_text())["results"] if r.get("failure")
    )
    replay = tmp_path / "w.json"
    replay.write_text(json.dumps(failure["workload"]))
    spec = ["--grouped-kv-adapter", "grouped_reference:make_full_drops"]
    assert conformance_main([*spec, "--replay", str(replay)]) == 1
    assert "full group 0 lost blocks" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("grouped_reference", "must be MODULE:FACTORY"),
        ("grouped_reference:nothing", "has no callable 'nothing'"),
        ("no_such_module_here:make", "ModuleNotFoundError"),
        ("grouped_reference:BUGS", "has no callable"),
        ("builtins:object", "does not return a grouped KV adapter: missing name"),
    ],
)
def test_cli_bad_factory_is_one_line(
    spec: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = conformance_main(["--grouped-kv-adapter", spec, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err, err


def test_cli_factory_that_raises_is_a_finding(capsys: pytest.CaptureFixture[str]) -> None:
    code = conformance_main(
        ["--grouped-kv-adapter", "grouped_reference:make_broken_factory", "--examples", "2",
         "--no-progress"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1 and "factory() raised" in out and "Traceback" not in out, out
