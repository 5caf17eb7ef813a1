"""The driver that runs the explorer on mutmut's mutants (conformance/explore/mutants.py,
docs/CONFORMANCE.md "Against mutants"): names, the survivors of the recorded mutation
runs, the choice of adapters. The runs themselves need mutmut's ``mutants/`` tree."""

from __future__ import annotations

import json
from pathlib import Path

from refserve.conformance.explore.mutants import (
    adapters_for,
    all_mutants,
    function_of,
    read_names,
    survivors_of,
)
from refserve.conformance.mutation.results import load, module_of

ROOT = Path(__file__).resolve().parents[2]
SCHED = "refserve.core.scheduler.xǁSchedulerǁ"
HOST = "refserve.kv.host_pool.xǁHostPoolǁ"


def test_a_mutant_name_without_its_number_is_its_function() -> None:
    assert function_of(SCHED + "_plan__mutmut_91") == SCHED + "_plan"
    assert function_of("refserve.kv.pool.x__taken__mutmut_2") == "refserve.kv.pool.x__taken"


def test_the_recorded_survivors_are_mutmut_names_of_the_files_their_run_mutated() -> None:
    """Checked against each run's own scope: a recorded run names the modules of its day."""
    paths = sorted((ROOT / "docs" / "mutation").glob("*.json"))
    names = survivors_of(paths)
    assert len(names) == len(set(names))
    for _, run in load(paths):
        mutated = {module_of(f) for f in run.files}
        for s in run.survivors:
            assert "__mutmut_" in s.name and s.name.split(".x", 1)[0] in mutated, s.name
            assert (s.name in names) == (s.verdict not in ("killed-since", "removed")), s.name


def test_the_swap_adapter_runs_only_for_swapping_code_or_code_only_it_reaches() -> None:
    hits = {"ref": {SCHED + "_plan", HOST + "commit"}, "swap": {SCHED + "_plan", HOST + "commit"}}
    hits["swap"] |= {SCHED + "only_swap_reaches", HOST + "swap_out"}
    assert adapters_for(SCHED + "_plan__mutmut_1", hits) == ["ref"]
    assert adapters_for(HOST + "commit__mutmut_1", hits) == ["ref", "swap"]
    assert adapters_for(HOST + "swap_out__mutmut_1", hits) == ["swap"]
    assert adapters_for(SCHED + "only_swap_reaches__mutmut_1", hits) == ["swap"]
    assert adapters_for(SCHED + "never_called__mutmut_1", hits) == []


def test_every_mutant_is_read_from_mutmuts_meta_files(tmp_path: Path) -> None:
    meta = tmp_path / "refserve" / "kv" / "journal.py.meta"
    meta.parent.mkdir(parents=True)
    keys = {"refserve.kv.journal.xǁJournalǁcommit__mutmut_2": None}
    keys["refserve.kv.journal.xǁJournalǁcommit__mutmut_1"] = 0
    meta.write_text(json.dumps({"exit_code_by_key": keys}), encoding="utf-8")
    assert all_mutants(tmp_path) == sorted(keys)


def test_a_names_file_holds_one_name_a_line_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "names.txt"
    path.write_text(f"# survivors\n{SCHED}_plan__mutmut_1  # why\n\n{HOST}commit__mutmut_2\n")
    assert read_names(path) == [SCHED + "_plan__mutmut_1", HOST + "commit__mutmut_2"]
