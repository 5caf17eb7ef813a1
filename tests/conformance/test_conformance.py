"""The conformance suite itself: ref passes, broken adapters are caught, reports round-trip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conformance_broken_adapters import BROKEN

from refserve.conformance.adapter import EngineAdapter, Feature, StepReport, load_factory
from refserve.conformance.adapters.ref import RefAdapter
from refserve.conformance.adapters.ref import make as make_ref
from refserve.conformance.adapters.ref import make_swap as make_ref_swap
from refserve.conformance.cli import conformance_main
from refserve.conformance.report import Report, to_markdown
from refserve.conformance.runner import run_workload
from refserve.conformance.scenarios import by_name, library
from refserve.conformance.suite import run_suite, scenario_names
from refserve.conformance.workload import Workload

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def ref_report() -> Report:
    return run_suite(make_ref, "refserve.conformance.adapters.ref:make", max_examples=60)


def test_ref_adapter_is_an_engine_adapter() -> None:
    assert isinstance(make_ref(), EngineAdapter)
    # Every feature but the one for copies to another store, which refserve never makes.
    assert make_ref().features == frozenset(Feature) - {Feature.TRANSFER_FAULTS}


def test_ref_passes_everything(ref_report: Report) -> None:
    fails = [
        f"{r.scenario}/{r.invariant}: {r.failure.message if r.failure else ''}"
        for r in ref_report.results
        if r.status == "fail"
    ]
    assert fails == []
    assert not ref_report.failed
    assert ref_report.summary()["not_supported"] == 0
    assert {s.name for s in ref_report.scenarios} == set(scenario_names())


def test_ref_matches_every_golden_schedule(ref_report: Report) -> None:
    golden = [s for s in ref_report.scenarios if s.golden is not None]
    assert len(golden) == 4
    assert all(s.golden and s.golden["matches"] for s in golden), [s.golden for s in golden]


def test_generated_searches_reach_the_rare_paths(ref_report: Report) -> None:
    cov: dict[str, int] = {}
    for s in ref_report.scenarios:
        for k, v in s.observed.get("coverage", {}).items():
            cov[k] = cov.get(k, 0) + v
    for path in ("preemption", "prefix_hit", "abort", "forced_stop", "chunked_prompt"):
        assert cov.get(path, 0) >= 5, cov


# Scenarios that exercise each corruption quickly; the generated one adds random cover.
QUICK = [
    "seed001-round-by-round",
    "bug-abort-decoding",
    "bug-preemption-storm",
    "atomic-executor-fault",
    "bug-same-step-new-shared-prefix",
    "generated-mixed",
]


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_adapter_is_caught_with_the_right_invariant(name: str) -> None:
    cls, invariant = BROKEN[name]
    report = run_suite(cls, name, QUICK, max_examples=15)
    failed = {r.invariant for r in report.results if r.status == "fail"}
    assert invariant in failed, failed
    fail = next(r for r in report.results if r.invariant == invariant and r.failure)
    assert fail.failure is not None
    # The shrunk workload replays to the same invariant.
    rerun = run_workload(cls(), Workload.from_json(fail.failure.workload))
    assert invariant in {str(f.invariant) for f in rerun.findings}


def test_ref_preempting_by_swap_passes_everything() -> None:
    """The whole library with every victim swapped; the runner's fake memory follows the
    copies, so a lost or misplaced swap fails (see SwapOutLost)."""
    swapped: list[int] = []

    class Counting(RefAdapter):
        def __init__(self) -> None:
            super().__init__(preemption_mode="swap", num_host_blocks="pool")

        def schedule(self) -> StepReport:
            rep = super().schedule()
            swapped.append(len(rep.swap_out))
            return rep

    report = run_suite(Counting, "refserve.conformance.adapters.ref:make_swap", max_examples=30)
    assert not report.failed, [r.failure for r in report.results if r.failure]
    assert sum(swapped) >= 5, sum(swapped)  # blocks swapped out across the suite (22 here)
    assert isinstance(make_ref_swap(), EngineAdapter)


def test_shrinking_gives_a_small_workload() -> None:
    cls, _ = BROKEN["DoubleFree"]
    report = run_suite(cls, "DoubleFree", ["bug-preemption-storm"], max_examples=1)
    fail = next(r for r in report.results if r.failure is not None)
    assert fail.failure is not None
    assert len(fail.failure.workload["requests"]) <= 2


def test_report_round_trips(ref_report: Report, tmp_path: Path) -> None:
    cls, _ = BROKEN["SkippedPosition"]
    broken = run_suite(cls, "x:y", ["seed001-round-by-round"], max_examples=1)
    for report in (ref_report, broken):
        path = tmp_path / "r.json"
        report.dump(path)
        again = Report.load(path)
        assert again == report
        assert again.to_json() == json.loads(path.read_text())
    data = broken.to_json()
    assert data["format"] == "refserve-conformance" and data["version"] == 2
    statuses = {r["status"] for r in data["results"]}
    assert statuses <= {"pass", "fail", "not_supported"} and "fail" in statuses
    failure = next(r["failure"] for r in data["results"] if r["status"] == "fail")
    assert {"step", "message", "workload", "trace"} <= failure.keys()
    md = to_markdown(broken)
    assert "seed001-round-by-round" in md and "**FAIL**" in md and "```json" in md


def test_report_rejects_other_formats() -> None:
    with pytest.raises(ValueError):
        Report.from_json({"format": "other", "version": 1})


def test_cli_exit_codes_and_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rep, md = tmp_path / "r.json", tmp_path / "r.md"
    ok = conformance_main(
        [
            "--adapter",
            "refserve.conformance.adapters.ref:make",
            "--scenarios",
            "seed001-round-by-round",
            "bug-lone-request-cannot-grow",
            "--report",
            str(rep),
            "--markdown",
            str(md),
        ]
    )
    assert ok == 0
    assert Report.load(rep).summary()["fail"] == 0
    assert "seed001-round-by-round" in md.read_text()
    bad = conformance_main(
        [
            "--adapter",
            "conformance_broken_adapters:double_free",
            "--scenarios",
            "bug-abort-decoding",
            "--report",
            str(rep),
        ]
    )
    assert bad == 1
    failure = next(r.failure for r in Report.load(rep).results if r.failure)
    assert failure is not None
    wl = tmp_path / "w.json"
    wl.write_text(json.dumps(failure.to_json()))
    replay = conformance_main(
        ["--adapter", "conformance_broken_adapters:double_free", "--replay", str(wl)]
    )
    assert replay == 1
    assert conformance_main(["--scenarios", "x"]) == 2
    assert conformance_main(["--adapter", "nope"]) == 2
    assert (
        conformance_main(
            ["--adapter", "refserve.conformance.adapters.ref:make", "--scenarios", "x"]
        )
        == 2
    )
    assert conformance_main(["--list"]) == 0
    assert "generated-mixed" in capsys.readouterr().out


def test_scenario_library_covers_the_design_lists() -> None:
    names = {s.name for s in library()}
    for needed in (
        "seed001-round-by-round",
        "seed003-prefix-reuse",
        "bug-double-free-shared-blocks",
        "bug-stale-hash-entry",
        "bug-fully-cached-prompt-concurrent",
        "bug-block-aligned-prompt-recompute",
        "bug-same-step-new-shared-prefix",
        "bug-abort-waiting",
        "bug-abort-mid-prefill",
        "bug-abort-decoding",
        "bug-abort-preempted",
        "bug-preemption-storm",
        "bug-preempted-loses-place-priority",
        "bug-head-of-line-kv-heavy",
        "bug-first-chunk-admission-thrash",
        "bug-lone-request-cannot-grow",
        "bug-free-list-order",
    ):
        assert needed in names
    for s in library():
        assert Workload.from_json(json.loads(json.dumps(s.workload.to_json()))) == s.workload
    assert by_name()["seed001-round-by-round"].golden is not None


def test_load_factory_errors() -> None:
    with pytest.raises(ValueError):
        load_factory("no-colon")
    with pytest.raises(ValueError):
        load_factory("refserve.conformance.adapters.ref:missing")


def test_pytest_plugin_runs_scenarios_as_items() -> None:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        # The plugin is registered through the pytest11 entry point of the installed
        # distribution; naming it again with -p would register it twice.
        "--refserve-adapter",
        "conformance_broken_adapters:double_free",
        "--refserve-examples",
        "3",
        "-k",
        "bug-abort-decoding or seed001",
        str(HERE / "conformance_broken_adapters.py"),
    ]
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{ROOT}"}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.count("FAILED ::refserve_conformance[") == 2, out.stdout
    assert "BLOCK" in out.stdout


# ---------------------------------------------------------------- nano-vllm-fork
def _nano() -> object:
    return pytest.importorskip(
        "refserve.conformance.adapters.nanovllm",
        reason="nano-vllm-fork is not installed here: it lives in its own virtualenv "
        "(make conformance-nanovllm, then .venv-nanovllm/bin/python -m pytest "
        "tests/conformance/test_conformance.py -k nanovllm)",
        exc_type=ImportError,
    )


def test_nanovllm_adapter_runs_and_finds_its_known_defects() -> None:
    """The triage of conformance/FINDINGS_nanovllm.md: conventions declared (and kept),
    rule violations found."""
    from refserve.conformance.adapter import (
        AdmissionOrder,
        EngineConfig,
        EngineProperties,
        StepOrder,
    )
    from refserve.conformance.workload import RequestPlan

    mod = _nano()
    factory = mod.make  # type: ignore[attr-defined]
    assert isinstance(factory(), EngineAdapter)
    assert factory().properties == EngineProperties(
        lookahead_slots=0,
        eos=True,
        admission_order=AdmissionOrder.FCFS_STRICT,
        step_order=StepOrder.PREFILL_FIRST,
        same_step_prefix_hits=True,
        free_queue_order=True,
    )
    report = run_suite(
        factory,
        "refserve.conformance.adapters.nanovllm:make",
        [
            "bug-fully-cached-prompt-concurrent",
            "bug-same-step-new-shared-prefix",
            "bug-lone-request-cannot-grow",
            "bug-preemption-storm",
            "bug-head-of-line-kv-heavy",
            "bug-free-list-order",
            "bug-abort-waiting",
            "stop-token-forced",
        ],
        max_examples=1,
    )
    status = {(r.scenario, r.invariant): r.status for r in report.results}
    messages = {(r.scenario, r.invariant): [f.message for f in r.failures] for r in report.results}
    # Rules broken (findings 1, 2 and 4).
    assert status[("bug-fully-cached-prompt-concurrent", "TOKEN")] == "fail"
    assert messages[("bug-fully-cached-prompt-concurrent", "PREFIX")] == [
        "cache hit covers the last known token (no logit)"
    ]
    # Finding 3 withdrawn: a same-step hit is the declared convention.
    assert status[("bug-same-step-new-shared-prefix", "PREFIX")] == "pass"
    assert status[("bug-lone-request-cannot-grow", "PROGRESS")] == "fail"
    assert any(
        "AssertionError at scheduler.py:170" in m
        for m in messages[("bug-lone-request-cannot-grow", "PROGRESS")]
    )
    assert status[("bug-preemption-storm", "PROGRESS")] == "fail"
    assert any(
        "IndexError" in m and "block_manager.py:105" in m
        for m in messages[("bug-preemption-storm", "PROGRESS")]
    )
    # Conventions declared and kept: FCFS with head-of-line blocking, the free-list
    # hand-out order, eos stops, exact tables (no lookahead), prefill-first batching.
    for sc in (
        "bug-fully-cached-prompt-concurrent",
        "bug-same-step-new-shared-prefix",
        "bug-preemption-storm",
        "bug-head-of-line-kv-heavy",
        "bug-free-list-order",
        "stop-token-forced",
    ):
        assert status[(sc, "ORDER")] == "pass", sc
        assert status[(sc, "POS")] == "pass", sc
        assert status[(sc, "CAP")] == "pass", sc
    for sc in ("bug-head-of-line-kv-heavy", "bug-free-list-order", "stop-token-forced"):
        assert {status[(sc, inv)] for inv in ("TOKEN", "BLOCK", "KVLEN", "PROGRESS")} == {"pass"}
    assert status[("bug-abort-waiting", "TOKEN")] == "not_supported"
    assert report.policy["step_order"] == {"declared": "prefill_first", "observed": "prefill_first"}
    prefix = next(r for r in report.results if r.invariant == "PREFIX")
    assert "partial" in prefix.note

    def workload(bs: int, nb: int, budget: int, seqs: int, *reqs: RequestPlan) -> Workload:
        return Workload(EngineConfig(bs, nb, budget, seqs, eos_token_id=1), reqs)

    def seen(w: Workload) -> set[tuple[str, str]]:
        return {
            (str(f.invariant), f.violation.message) for f in run_workload(factory(), w).findings
        }

    # Finding 1: a preempted sequence stays in `running`; readmitted, it is scheduled and
    # preempted in one step with an empty table (no slot for its position), and is left
    # in `waiting` after every request finished.
    dup = seen(workload(2, 2, 4, 2, RequestPlan("r0", (2, 2), 2), RequestPlan("r1", (2,), 3)))
    assert ("TOKEN", "both scheduled and preempted in one step") in dup
    assert ("POS", "slot mapping length differs from positions") in dup
    assert any(inv == "PROGRESS" and "unfinished work" in m for inv, m in dup)
    # ... and a finished sequence whose stale `running` entry is preempted runs again,
    # past max_tokens (reported live with its blocks, as the engine holds it).
    revived = seen(
        workload(
            2,
            4,
            6,
            1,
            RequestPlan("r0", (5,), 3),
            RequestPlan("r2", (2,), 2),
            RequestPlan("r3", (2, 2, 5, 7), 2),
            RequestPlan("r4", (5, 9, 7), 3),
        )
    )
    assert ("KVLEN", "outputs exceed max_tokens") in revived
    assert ("KVLEN", "reached max_tokens 2 but kept running") in revived
    assert not any(inv == "BLOCK" for inv, _ in revived)
