"""The before/after driver (conformance/bench/ab.py): its ratio, its table, and a side
that cannot run reported as exit 2, not a traceback (docs/BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.bench.ab import Figure, main, to_markdown


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
