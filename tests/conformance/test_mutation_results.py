"""Mutation runs as JSON (conformance/mutation/): reading mutmut's verdicts, drawing a
sample, the reasons file, the record's checks, and the run driver's collect step on a
hand-made ``mutants/`` tree (mutmut itself is never run here)."""

from __future__ import annotations

import json
import random
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from refserve.conformance.mutation import results, run
from refserve.conformance.mutation.results import (
    FileCounts,
    MutationRun,
    Selection,
    Survivor,
    UnnamedSurvivors,
)
from refserve.errors import InputFileError

POOL = "refserve.kv.pool.xǁBlockPoolǁallocate__mutmut_"
SCHED = "refserve.core.scheduler.xǁSchedulerǁcommit__mutmut_"
FILES = ("refserve/kv/pool.py", "refserve/core/scheduler.py")


def _codes() -> dict[str, dict[str, int | None]]:
    """Pool: 1 killed, 2 survived, 3 timed out, 4 no tests, 5 not run, 6 segfault;
    scheduler: 1-3 killed, 4 survived."""
    pool = {POOL + "1": 1, POOL + "2": 0, POOL + "3": 36, POOL + "4": 33, POOL + "5": None}
    pool[POOL + "6"] = -11
    sched: dict[str, int | None] = {SCHED + str(i): 1 for i in (1, 2, 3)}
    sched[SCHED + "4"] = 0
    return {FILES[0]: pool, FILES[1]: sched}


def _mutants_tree(root: Path) -> None:
    for f, codes in _codes().items():
        meta = root / "mutants" / (f + ".meta")
        meta.parent.mkdir(parents=True, exist_ok=True)
        fns = {n.removeprefix(results.module_of(f) + ".").rsplit("__mutmut_")[0] for n in codes}
        meta_doc = {"exit_code_by_key": codes, "hash_by_function_name": dict.fromkeys(fns, "h1")}
        meta.write_text(json.dumps(meta_doc), encoding="utf-8")
    (root / "pyproject.toml").write_text(
        "[tool.mutmut]\n"
        f"only_mutate = {json.dumps(list(FILES))}\n"
        'pytest_add_cli_args_test_selection = ["tests/kv/test_pool.py"]\n'
        "timeout_multiplier = 1.0\n",
        encoding="utf-8",
    )


def test_statuses_are_mutmuts_and_the_rare_ones_count_together() -> None:
    assert results.status_of(1) == results.status_of(3) == "killed"
    assert [results.bucket_of(c) for c in (0, 36, 24, 33, 5, 34, None)] == [
        "survived", "timeout", "timeout", "no_tests", "no_tests", "skipped", "not_checked",
    ]  # fmt: skip
    assert results.bucket_of(-11) == results.bucket_of(35) == results.bucket_of(77) == "other"


def test_mutmuts_own_table_is_the_copy_here() -> None:
    stats = pytest.importorskip("mutmut.stats", reason="mutmut is installed only to run it")
    assert dict(stats.status_by_exit_code) == results.STATUS_BY_EXIT_CODE


def test_collect_counts_every_mutant_per_file_and_lists_survivors_and_timeouts() -> None:
    counts, survivors, timeouts = results.collect(_codes())
    by_file = {c.files[0]: c for c in counts}
    pool = by_file["refserve/kv/pool.py"]
    assert (pool.frame, pool.killed, pool.survived, pool.timeout) == (6, 1, 1, 1)
    assert (pool.no_tests, pool.other, pool.not_checked, pool.run) == (1, 1, 1, 5)
    assert pool.label == "refserve.kv" and pool.detected == 2
    assert by_file["refserve/core/scheduler.py"].killed == 3
    assert [s.name for s in survivors] == [SCHED + "4", POOL + "2"]
    assert timeouts == (POOL + "3",)


def test_collect_over_a_sample_counts_only_the_drawn_but_keeps_the_frame() -> None:
    counts, survivors, _ = results.collect(_codes(), [POOL + "2", SCHED + "1"])
    assert [(c.frame, c.run, c.survived) for c in counts] == [(4, 1, 0), (6, 1, 1)]
    assert [s.name for s in survivors] == [POOL + "2"]


def test_a_sample_is_uniform_seeded_and_limited_to_the_modules_named() -> None:
    codes = _codes()
    names = sorted(n for c in codes.values() for n in c)
    drawn = results.draw(codes, 3, seed=5)
    assert drawn == random.Random(5).sample(names, 3) and drawn == results.draw(codes, 3, 5)
    assert set(results.draw(codes, 4, 5, ["refserve.core"])) == set(codes[FILES[1]])
    assert results.draw(codes, 2, 5, ["refserve.kv.pool"])[0].startswith(POOL)
    with pytest.raises(ValueError, match="a sample of 5 from 4 mutants"):
        results.draw(codes, 5, 5, ["refserve.core"])
    assert not results.in_modules(SCHED + "1", ["refserve.co"])  # a prefix is a module


def test_wilson_interval() -> None:
    lo, hi = results.wilson(191, 200)
    assert (round(100 * lo, 1), round(100 * hi, 1)) == (91.7, 97.6)  # docs/MUTATION.md's KV
    assert results.wilson(0, 10)[0] == 0.0 and results.wilson(10, 10)[1] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        results.wilson(0, 0)


def test_reasons_file_lines_and_its_refusals(tmp_path: Path) -> None:
    path = tmp_path / "reasons.txt"
    path.write_text(
        f"# a comment\n\n{POOL}2@abc equivalent the same allocation, slower\n"
        f"{SCHED}4   killed-since   pinned by test_x\n",
        encoding="utf-8",
    )
    reasons = results.read_reasons(path)
    assert reasons[POOL + "2"] == results.Verdict(
        "equivalent", "the same allocation, slower", "abc"
    )
    assert reasons[SCHED + "4"].reason == "pinned by test_x"
    for bad, msg in (
        (f"{POOL}2 equivalent\n", "expected NAME VERDICT REASON"),
        (f"{POOL}2 maybe why\n", "unknown verdict 'maybe'"),
        (f"{POOL}2 untriaged why\n", "unknown verdict 'untriaged'"),
        (f"{POOL}2 left a\n{POOL}2 left b\n", "given a reason twice"),
    ):
        path.write_text(bad, encoding="utf-8")
        with pytest.raises(InputFileError, match=msg):
            results.read_reasons(path)


def _run(**over: Any) -> MutationRun:
    base: dict[str, Any] = dict(
        title="t", when="2026-01-02 03:04 UTC", commit="abc", command="python -m x",
        mutmut="3.8.1", files=FILES, tests=("tests/kv/test_pool.py",),
        selection=Selection("sample", 7, 10, ("refserve.kv",)),
        counts=(FileCounts(FILES[:1], "refserve.kv", 40, killed=8, timeout=1, survived=1),),
        survivors=(Survivor(POOL + "2", "equivalent", "why"),),
    )  # fmt: skip
    base.update(over)
    return MutationRun(**base)


def test_a_run_survives_its_json_and_a_malformed_one_is_refused() -> None:
    run_ = _run(unnamed=(), timeouts=(POOL + "3",), wall_s=12.5, note="n", recorded="r")
    again = results.run_from_json(json.loads(json.dumps(run_.to_json())), "x.json")
    assert again == run_
    doc = run_.to_json()
    twice = [vars(run_.survivors[0])] * 2
    for change, msg in (
        ({"format": "other"}, "not a refserve-mutation version 1 document"),
        ({"survivors": []}, "1 mutants survived but 0 survivors are listed"),
        ({"survivors": twice, "counts": [{**doc["counts"][0], "survived": 2}]}, "listed twice"),
        ({"survivors": [{"name": "n", "verdict": "fine", "reason": ""}]}, "unknown verdict"),
        ({"counts": [{**doc["counts"][0], "frame": 5}]}, "more mutants counted than generated"),
        ({"counts": [{**doc["counts"][0], "killed": -1}]}, "a negative count"),
        ({"counts": [{**doc["counts"][0], "killed": True}]}, "'killed' is missing or not a int"),
        ({"selection": {"kind": "sample", "seed": 1}}, "names its seed and its size"),
        ({"selection": {"kind": "some"}}, "'every' or 'sample'"),
        ({"title": None}, "'title' is missing"),
    ):  # fmt: skip
        with pytest.raises(InputFileError, match=msg):
            results.run_from_json({**doc, **change}, "x.json")


def test_unnamed_survivors_count_toward_the_survived() -> None:
    unnamed = (UnnamedSurvivors(2, "killed-since", "gaps"),)
    counts = (FileCounts(FILES, "migration", 40, killed=7, survived=3),)
    run_ = _run(counts=counts, unnamed=unnamed)
    assert results.run_from_json(run_.to_json(), "x") == run_
    with pytest.raises(InputFileError, match="3 mutants survived but 2"):
        results.run_from_json(run_.to_json() | {"survivors": []}, "x")


def test_a_reason_written_for_another_version_of_the_function_is_not_applied() -> None:
    """mutmut numbers a changed function's mutants anew: the same name, another change."""
    reasons = {POOL + "2": results.Verdict("equivalent", "why", "h1")}
    same, changed, unknown = (Survivor(POOL + "2", function_hash=h) for h in ("h1", "h2", ""))
    assert results.reason_for(same, reasons) == reasons[POOL + "2"]
    assert results.reason_for(changed, reasons).verdict == "untriaged"
    assert results.reason_for(unknown, reasons).verdict == "equivalent"  # a recorded run
    untied = {POOL + "2": results.Verdict("equivalent", "why")}
    assert results.reason_for(changed, untied).verdict == "equivalent"


def test_with_reasons_sets_each_named_survivor_and_leaves_the_rest_untriaged() -> None:
    run_ = _run(survivors=(Survivor(POOL + "2"),))
    told = results.with_reasons(run_, {POOL + "2": results.Verdict("left", "needs a GPU")})
    assert told.survivors == (Survivor(POOL + "2", "left", "needs a GPU"),)
    assert results.with_reasons(told, {}).survivors == (Survivor(POOL + "2"),)


def test_the_scope_is_read_from_pyproject(tmp_path: Path) -> None:
    _mutants_tree(tmp_path)
    config = results.mutmut_config(tmp_path / "pyproject.toml")
    assert config.only_mutate == FILES and config.tests == ("tests/kv/test_pool.py",)
    assert config.settings == {"timeout_multiplier": 1.0}
    (tmp_path / "pyproject.toml").write_text("[tool.other]\n", encoding="utf-8")
    with pytest.raises(InputFileError, match=re.escape("no [tool.mutmut] only_mutate")):
        results.mutmut_config(tmp_path / "pyproject.toml")
    with pytest.raises(InputFileError, match=re.escape("no mutants of refserve/x.py")):
        results.read_mutants(tmp_path / "mutants", ["refserve/x.py"])


def test_the_driver_collects_a_sample_from_mutmuts_verdicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _mutants_tree(tmp_path)
    reasons = tmp_path / "reasons.txt"
    reasons.write_text(f"{POOL}2 equivalent why\n{SCHED}4 left because\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "docs" / "sample.json"
    argv = ["--collect-only", "--sample", "6", "--seed", "3", "--modules", "refserve.kv"]
    argv += ["--out", str(out), "--reasons", str(reasons), "--title", "A sample"]
    assert run.main(argv) == 0
    doc = results.run_from_json(json.loads(out.read_text(encoding="utf-8")), str(out))
    assert doc.selection == Selection("sample", 3, 6, ("refserve.kv",))
    assert doc.files == FILES and doc.title == "A sample" and doc.wall_s is None
    assert [c.run for c in doc.counts] == [0, 5]  # the one not run is counted apart
    assert doc.survivors == (Survivor(POOL + "2", "equivalent", "why", "h1"),)
    assert doc.command.startswith("python -m refserve.conformance.mutation.run --collect-only")
    # The reasons file changed: --refresh applies it to the committed run.
    reasons.write_text(f"{POOL}2 killed-since by test_y\n", encoding="utf-8")
    assert run.main(["--refresh", str(out), "--reasons", str(reasons)]) == 0
    refreshed = results.load([out])[0][1]
    assert refreshed.survivors == (Survivor(POOL + "2", "killed-since", "by test_y", "h1"),)


def test_the_driver_prints_a_reasons_line_for_every_survivor_not_read_yet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _mutants_tree(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert run.main(["--collect-only", "--out", str(tmp_path / "every.json")]) == 0
    out = capsys.readouterr().out
    assert "run: 2 survivor(s) to read" in out
    assert f"{POOL}2@h1 VERDICT REASON" in out and f"{SCHED}4@h1 VERDICT REASON" in out
    doc = results.load([tmp_path / "every.json"])[0][1]
    assert doc.selection == Selection("every") and sum(c.frame for c in doc.counts) == 10


def test_the_driver_runs_mutmut_by_name_in_batches_and_resumes_where_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _mutants_tree(tmp_path)
    monkeypatch.chdir(tmp_path)
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **_: Any) -> None:
        if cmd[0] == "git":
            raise OSError("no git here")
        calls.append(cmd)

    monkeypatch.setattr(subprocess, "run", fake_run)
    out = str(tmp_path / "s.json")
    assert run.main(["--sample", "6", "--seed", "3", "--batch", "4", "--out", out]) == 0
    assert [c[3:6] for c in calls] == [["run", "--max-children", "1"]] * 2
    ran = [n for c in calls for n in c[6:]]
    assert ran == results.draw(_codes(), 6, 3) and [len(c) - 6 for c in calls] == [4, 2]
    calls.clear()
    assert run.main(["--sample", "6", "--seed", "3", "--resume", "--out", out]) == 0
    assert calls == [calls[0][:6] + [n for n in ran if n == POOL + "5"]]  # the one not run
    calls.clear()
    assert run.main(["--out", out]) == 0
    assert [c[3:] for c in calls] == [["run", "--max-children", "1"]]  # every mutant


def test_the_driver_refuses_a_sample_larger_than_the_frame(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _mutants_tree(tmp_path)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "s.json"
    assert run.main(["--collect-only", "--sample", "99", "--out", str(out)]) == 2
    assert "a sample of 99 from 10 mutants" in capsys.readouterr().err and not out.exists()


def test_a_path_inside_the_checkout_is_recorded_relative_to_it() -> None:
    inside = run.ROOT / "docs" / "mutation" / "reasons.txt"
    assert run.shown(str(inside)) == "docs/mutation/reasons.txt"
    assert run.shown("--seed") == "--seed" and run.shown("/elsewhere/x") == "/elsewhere/x"


def test_a_sample_limited_to_modules_reports_their_frame_only() -> None:
    """The scope's other files could not be drawn: neither their mutants (the frame a
    sample is "N of") nor their packages (a row of n/a) belong to the run's report."""
    from refserve.conformance.mutation import report

    counts = (
        FileCounts(FILES[:1], "refserve.kv", 40, killed=8, timeout=1, survived=1),
        FileCounts(FILES[1:], "refserve.core", 300),
    )
    text = report.render([("x.json", _run(counts=counts))])
    assert "a uniform sample of 10 of the 40 mutants of `refserve.kv`" in text
    assert "| refserve.kv | 2026-01-02 03:04 UTC | 10 of 40 |" in text
    assert "| refserve.core | 2026-01-02" not in text
    every = _run(counts=counts, selection=Selection("every", None, None, ()))
    assert "| refserve.core | 2026-01-02 03:04 UTC | 0 |" in report.render([("x.json", every)])
