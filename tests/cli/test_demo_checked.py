"""``refserve demo`` says how much was checked, and the numbers it prints are the ones that
ran: the steps the engine checked, against the checkers refserve.spec.check_step runs.

A checker planted in ``refserve.spec.checks.STEP_CHECKS`` counts its calls: the demo must then
print one checker more, and as many steps as the planted checker saw.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import refserve.cli.demo  # noqa: F401  imported first, as in a full run: it must not copy the list
import refserve.spec.checks as spec_checks
from refserve.cli.main import main
from refserve.spec import StepSnapshot, Violation

LINE = re.compile(r"checked: all (\d+) steps (?:above )?against the (\d+) invariant checks")


def _plant_counter(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []

    def count(step: StepSnapshot, lookahead: int, same_step_hits: bool) -> list[Violation]:
        seen.append(step.step_index)
        return []

    monkeypatch.setattr(spec_checks, "STEP_CHECKS", (*spec_checks.STEP_CHECKS, count))
    return seen


def _checked(out: str) -> tuple[int, int]:
    found = LINE.findall(out)
    assert len(found) == 1, out[-2000:]
    steps, checks = found[0]
    return int(steps), int(checks)


def test_the_simulator_demo_counts_what_ran(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = len(spec_checks.STEP_CHECKS)
    seen = _plant_counter(monkeypatch)
    assert main(["demo", "--simulator"]) == 0
    out = capsys.readouterr().out
    steps, checks = _checked(out)
    assert checks == real + 1
    assert steps == len(seen) > 0
    # ... and the rounds the demo shows add up to it (example 2, then example 0 twice).
    shown = re.findall(r"over (\d+) rounds|: (\d+) rounds", out)
    assert steps == sum(int(a or b) for a, b in shown)


def test_make_run_says_every_step_was_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    real = len(spec_checks.STEP_CHECKS)
    seen = _plant_counter(monkeypatch)
    assert main(["demo", "--timeline", str(tmp_path / "t.html")]) == 0
    out = capsys.readouterr().out
    assert _checked(out) == (len(seen), real + 1)
    assert f"{len(seen)} steps in " in out  # the summary's step count is the checked one
