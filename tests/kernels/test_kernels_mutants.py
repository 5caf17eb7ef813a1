"""Every kernel mutant is caught by the default grid (docs/KERNELS.md, "Mutants").

Running the whole grid per mutant in the interpreter takes minutes, so each test runs
only the cases recorded in ``Mutant.caught_by`` and asserts those are in the default
grid (``select_cases``, not the quick subset): if the grid stops generating them, or
they stop catching the bug, the test fails. The full scan (every mutant over the whole
default grid) and its results are in docs/KERNELS.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import broken_kernel
import mutant_kernels
import pytest
import torch
from kernel_testing import DEVICE

from refserve.conformance.kernel_grid import (
    BOUNDARY_RULES,
    CASES,
    FAIL,
    check_kernel_main,
    run_case,
    select_cases,
)

DEFAULT_GRID = {c.name for c in select_cases(DEVICE)}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN on purpose
@pytest.mark.parametrize("name", sorted(mutant_kernels.MUTANTS))
def test_mutant_is_caught_by_the_default_grid(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    mutant = mutant_kernels.MUTANTS[name]
    assert mutant.caught_by and set(mutant.caught_by) <= DEFAULT_GRID
    if mutant.may_crash:  # through the isolating CLI: a segfault must not kill pytest
        monkeypatch.setenv(
            "PYTHONPATH",
            os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
        )
        out = tmp_path / "r.json"
        argv = [
            f"mutant_kernels:{name}",
            "--device",
            str(DEVICE),
            "--dtype",
            "float32",
            "--json",
            str(out),
            *(x for c in mutant.caught_by for x in ("--case", c)),
        ]
        assert check_kernel_main(argv) == 1, capsys.readouterr().out
        statuses = {r["case"]: r["status"] for r in json.loads(out.read_text())["results"]}
        assert statuses == dict.fromkeys(mutant.caught_by, FAIL)
        return
    fn = mutant_kernels.load(name).paged_attention
    for case_name in mutant.caught_by:
        result = run_case(fn, CASES[case_name], torch.float32, DEVICE)
        assert result.status == FAIL, f"{name} survived {case_name}: {result}"


def test_the_unmutated_kernel_passes_the_catching_cases() -> None:
    from refserve.kernels.attention import paged_attention

    catching = sorted({c for m in mutant_kernels.MUTANTS.values() for c in m.caught_by})
    for case_name in catching:
        result = run_case(paged_attention, CASES[case_name], torch.float32, DEVICE)
        assert result.passed, result


def test_mutants_that_only_generated_cases_catch_exist() -> None:
    # The rescale and pruning bugs of the issue slip through every hand-named case; the
    # generated boundary cases are what catch them.
    for name in ("unguarded_rescale", "window_prune_off_by_one"):
        boundaries = {CASES[c].boundary for c in mutant_kernels.MUTANTS[name].caught_by}
        assert boundaries <= set(BOUNDARY_RULES) - {"named"}


@pytest.mark.parametrize(
    "fn",
    [
        broken_kernel.ignores_last_partial_block,
        broken_kernel.reads_whole_blocks,
        broken_kernel.causal_from_start,
        broken_kernel.writes_past_output,
    ],
    ids=lambda f: f.__name__,
)
def test_dense_mutants_are_caught_by_the_quick_grid(fn: object) -> None:
    quick = select_cases("cpu", quick=True)
    results = [run_case(fn, c, torch.float32, "cpu") for c in quick]  # type: ignore[arg-type]
    assert any(r.status == FAIL for r in results)
