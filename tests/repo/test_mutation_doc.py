"""docs/MUTATION.md is generated from the mutation runs' JSON, never typed.

The committed document must equal what ``refserve.conformance.mutation.report`` renders
from the committed runs in docs/mutation/ (``make mutation`` and ``make mutation-sample``
refresh both; ``make mutation-report`` renders alone); a hand edit of either side fails
here. Each named survivor's verdict in the JSON is the one the reasons file gives it, so
a reason edited in docs/mutation/reasons.txt and not applied to the runs fails too.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from refserve.conformance.mutation import report, results
from refserve.conformance.mutation.results import FileCounts, MutationRun, Selection, Survivor

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "MUTATION.md"
RUNS = ROOT / "docs" / "mutation"
INPUTS = sorted(RUNS.glob("*.json"))


def _committed() -> list[tuple[str, MutationRun]]:
    return results.load(INPUTS)


def test_the_committed_document_is_what_the_committed_runs_render() -> None:
    assert INPUTS, "docs/mutation/ holds no mutation run"
    assert DOC.read_text(encoding="utf-8") == report.render(_committed()), (
        "docs/MUTATION.md is stale or was edited by hand: run `make mutation-report` "
        f"({report.COMMAND})"
    )


def test_a_changed_figure_makes_the_committed_document_stale() -> None:
    runs = _committed()
    name, run = runs[0]
    counts = (dataclasses.replace(run.counts[0], killed=run.counts[0].killed - 1, other=1),)
    runs[0] = (name, dataclasses.replace(run, counts=counts))
    assert report.render(runs) != DOC.read_text(encoding="utf-8")


def test_every_named_survivor_carries_the_reason_the_reasons_file_gives_it() -> None:
    reasons = results.read_reasons(RUNS / "reasons.txt")
    for name, run in _committed():
        for s in run.survivors:
            given = results.reason_for(s, reasons)
            assert (s.verdict, s.reason) == (given.verdict, given.reason), (
                f"{name}: {s.name}: run `python -m refserve.conformance.mutation.run --refresh "
                "docs/mutation/*.json --reasons docs/mutation/reasons.txt`"
            )


def test_the_runs_and_their_reasons_are_all_docs_holds_of_mutation_testing() -> None:
    """Survivor lists and raw dumps live in the runs' JSON, not beside the document."""
    assert {p.suffix for p in RUNS.iterdir()} == {".json", ".txt"}
    assert [p.name for p in RUNS.glob("*.txt")] == ["reasons.txt"]
    stray = [p.name for p in (ROOT / "docs").iterdir() if p.name.lower().startswith("mutation")]
    assert sorted(stray) == ["MUTATION.md", "mutation"]


def test_make_mutation_and_mutation_sample_end_by_regenerating_the_document() -> None:
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    line = re.search(r"^MUTATION_REPORT = (.*)$", make, re.M)
    assert line is not None and line.group(1) == "$(PY) -m " + report.COMMAND.removeprefix(
        "python -m "
    )
    for target in ("mutation", "mutation-sample", "mutation-report"):
        recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", make, re.M)
        assert recipe is not None, target
        assert recipe.group(1).splitlines()[-1].strip() == "$(MUTATION_REPORT)", target
    assert "--sample $(MUTATION_N)" in make and "--seed $(MUTATION_SEED)" in make


# --------------------------------------------------------------------- the renderer
POOL = "refserve.kv.pool.xǁBlockPoolǁallocate__mutmut_"
FILES = ("refserve/kv/pool.py", "refserve/kv/journal.py", "refserve/core/scheduler.py")


def _sample() -> MutationRun:
    return MutationRun(
        title="A sample",
        when="2026-01-02 03:04 UTC",
        commit="abc123",
        command="python -m refserve.conformance.mutation.run --sample 200",
        mutmut="3.8.1",
        files=FILES,
        tests=("tests/kv/test_pool.py",),
        selection=Selection("sample", 7, 200, ("refserve.kv",)),
        counts=(
            FileCounts(FILES[:1], "refserve.kv", 900, killed=120, timeout=1, survived=3),
            FileCounts(FILES[1:2], "refserve.kv", 40, killed=70, no_tests=6),
        ),
        survivors=(
            Survivor(POOL + "10", "equivalent", "the same blocks"),
            Survivor(POOL + "9", "killed-since", "pinned by `test_x`"),
            Survivor(POOL + "11"),
        ),
        timeouts=(POOL + "3",),
        wall_s=600.0,
    )


def _every() -> MutationRun:
    counts = (FileCounts(FILES[2:], "refserve.core", 50, killed=48, survived=2),)
    return dataclasses.replace(
        _sample(),
        title="Every mutant",
        when="2025-12-31",
        commit=None,
        selection=Selection("every"),
        counts=counts,
        survivors=(),
        unnamed=(results.UnnamedSurvivors(2, "removed", "dead code"),),
        timeouts=(),
        wall_s=None,
        recorded="carried over from an older document.",
    )


def test_scores_per_package_with_an_interval_for_a_sample_only() -> None:
    md = report.render([("b.json", _every()), ("a.json", _sample())])
    # 121 of 200 detected; with the one killed since, 122.
    assert (
        "| refserve.kv | 2026-01-02 03:04 UTC | 200 of 940 | 190 | 1 | 3 | 6 | **95.5 %** "
        "| 91.7-97.6 % | 96.0 % |" in md
    )
    assert (
        "| refserve.core | 2025-12-31 | 50 | 48 | 0 | 2 | 0 | **96.0 %** | (every mutant) |" in md
    )
    assert md.index("### A sample (2026-01-02 03:04 UTC)") < md.index("### Every mutant (2025")


def test_a_run_section_has_provenance_files_and_every_survivor() -> None:
    md = report.render([("a.json", _sample())])
    assert "- Command: `python -m refserve.conformance.mutation.run --sample 200`" in md
    assert "- mutmut 3.8.1; measured 2026-01-02 03:04 UTC on commit `abc123`; 10 min" in md
    assert (
        "- Selection: a uniform sample of 200 of the 940 mutants of `refserve.kv`, drawn with "
        "`random.Random(7).sample` from their sorted names." in md
    )
    assert "| `refserve/kv/pool.py` | 900 | 124 | 120 | 1 | 3 | 0 | 0 | 0 | 0 |" in md
    rows = [ln for ln in md.splitlines() if ln.startswith(f"| `{POOL}")]
    assert rows == [
        f"| `{POOL}9` | a test gap, killed since | pinned by `test_x` |",
        f"| `{POOL}10` | equivalent | the same blocks |",
        f"| `{POOL}11` | not read yet | - |",
    ]
    assert f"Timed out (1, counted as detected): `{POOL}3`." in md


def test_a_recorded_run_says_so_and_lists_its_unnamed_survivors() -> None:
    md = report.render([("b.json", _every())])
    assert "on commit (not recorded)" in md and "- Selection: every mutant of the scope." in md
    assert "- Recorded: carried over from an older document." in md
    assert "| 2 not named in the record | redundant code, removed | dead code |" in md


def test_the_header_says_generated_and_how_to_rerun() -> None:
    md = report.render([("a.json", _sample())])
    assert md.startswith("# Mutation testing\n")
    assert f"<!-- Generated by `{report.COMMAND}` (`make mutation-report`)" in md
    for words in ("make mutation-sample", "forkserver", "test_scheduler_state_machine.py"):
        assert words in md


def test_the_command_writes_the_document_and_refuses_nothing_to_render(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "M.md"
    assert report.main(["--out", str(out), *map(str, INPUTS)]) == 0
    assert out.read_text(encoding="utf-8") == DOC.read_text(encoding="utf-8")
    assert report.main(["--out", str(out)]) == 2
    assert "no mutation run among the inputs" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{", encoding="utf-8")
    assert report.main(["--out", str(out), str(broken)]) == 2
    assert "cannot be read as JSON" in capsys.readouterr().err
    assert report.main(["--out", str(tmp_path), *map(str, INPUTS)]) == 2
