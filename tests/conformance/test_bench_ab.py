"""The before/after driver (conformance/bench/ab.py): its ratio, its table, and a side
that cannot run reported as exit 2, not a traceback (docs/BENCHMARKS.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from refserve.conformance.bench.ab import Figure, main, own_code, to_markdown


def test_the_ratio_is_of_the_medians_over_rounds() -> None:
    f = Figure("t", base=(1.0, 3.0, 2.0), new=(2.2, 100.0, 2.4))  # one slow round of new
    assert f.ratio == pytest.approx(2.4 / 2.0)


def test_the_table_names_each_benchmark_with_both_medians() -> None:
    record = {"command": "c", "machine": {"cores": 2}, "load_after": [1.0]}
    table = to_markdown([Figure("tests/x.py::t", (1e-6, 1e-6), (2e-6, 2e-6))], record)
    assert "| `tests/x.py::t` | 1.0 us | 2.0 us | 2.000 |" in table


def test_a_side_that_cannot_run_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["--base", str(empty), "--new", str(empty), "--rounds", "1", "nope.py"]) == 2
    assert "pytest exited" in capsys.readouterr().err


def test_a_checkout_with_the_one_import_name_runs_through_its_link_tree(tmp_path: Path) -> None:
    (tmp_path / "Makefile").write_text("tree:\n\tmkdir -p build/tree/refserve\n")
    env = own_code(tmp_path)
    assert env["PYTHONPATH"] == str(tmp_path / "build" / "tree")
    assert (tmp_path / "build" / "tree" / "refserve").is_dir()  # its own make tree ran


def test_an_older_checkout_runs_from_its_working_directory(tmp_path: Path) -> None:
    (tmp_path / "Makefile").write_text("test:\n\ttrue\n")
    assert own_code(tmp_path).get("PYTHONPATH") == os.environ.get("PYTHONPATH")


def test_a_failing_make_tree_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "Makefile").write_text("tree:\n\tfalse\n")
    assert main(["--base", str(tmp_path), "--new", str(tmp_path), "--rounds", "1", "x.py"]) == 2
    assert "make tree exited" in capsys.readouterr().err
