"""The driver that runs the explorer on mutmut's mutants (conformance/explore/mutants.py,
docs/MUTATION.md "The exhaustive explorer against the mutants"): names, the list of
survivors, the choice of adapters. The runs themselves need mutmut's ``mutants/`` tree."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from refserve.conformance.explore.mutants import adapters_for, all_mutants, function_of, read_names

ROOT = Path(__file__).resolve().parents[2]
SCHED = "refserve.core.scheduler.xǁSchedulerǁ"
HOST = "refserve.kv.host_pool.xǁHostPoolǁ"


def test_a_mutant_name_without_its_number_is_its_function() -> None:
    assert function_of(SCHED + "_plan__mutmut_91") == SCHED + "_plan"
    assert function_of("refserve.kv.pool.x__taken__mutmut_2") == "refserve.kv.pool.x__taken"


def test_the_listed_survivors_are_mutmut_names_of_the_mutated_files() -> None:
    names = read_names(ROOT / "docs" / "MUTATION_SURVIVORS.txt")
    assert len(names) == len(set(names)) > 100
    mutated = {p.removesuffix(".py").replace("/", ".") for p in _only_mutate()}
    for n in names:
        assert "__mutmut_" in n and n.split(".x", 1)[0] in mutated, n


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


def _only_mutate() -> list[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return list(data["tool"]["mutmut"]["only_mutate"])
