"""A pytest plugin so an engine's own test suite can include the conformance suite.

Enable it with the ``refserve`` entry point (``pytest11``) or ``-p
refserve.conformance.pytest_plugin``, then::

    pytest --refserve-adapter mypkg.adapter:make [--refserve-examples 50]

Each fixed scenario and each generated scenario becomes one test item,
``refserve_conformance[SCENARIO]``; it fails with the failing invariants, steps,
messages and shrunk workloads, and is skipped (with the reason) when the engine lacks a
feature the scenario needs. Without ``--refserve-adapter`` nothing is collected.
"""

from __future__ import annotations

import json
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("refserve", "refserve conformance suite")
    group.addoption(
        "--refserve-adapter",
        default=None,
        metavar="MODULE:FACTORY",
        help="run refserve's conformance suite against this adapter factory",
    )
    group.addoption(
        "--refserve-examples",
        type=int,
        default=50,
        help="Hypothesis examples per generated conformance scenario (default 50)",
    )


def run_scenario(adapter: str, scenario: str, examples: int) -> None:
    """Run one scenario; ``pytest.fail`` / ``pytest.skip`` with the report's content."""
    from refserve.conformance.adapter import load_factory
    from refserve.conformance.suite import run_suite

    report = run_suite(load_factory(adapter), adapter, [scenario], max_examples=examples)
    info = report.scenarios[0]
    fails = [r for r in report.results if r.status == "fail"]
    if fails:
        lines: list[str] = []
        for r in fails:
            for f in r.failures:
                lines.append(f"{r.invariant}: step {f.step}: {f.subject}: {f.message}")
                lines.append("  shrunk workload: " + json.dumps(f.workload))
        pytest.fail("\n".join(lines), pytrace=False)
    if info.not_supported:
        pytest.skip(f"not supported: {info.not_supported}")


class ConformanceItem(pytest.Item):
    """One conformance scenario as a pytest test item."""

    def __init__(self, *, adapter: str, scenario: str, examples: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.adapter = adapter
        self.scenario = scenario
        self.examples = examples

    def runtest(self) -> None:
        run_scenario(self.adapter, self.scenario, self.examples)

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "refserve-conformance", None, f"refserve_conformance[{self.scenario}]"


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    adapter = config.getoption("--refserve-adapter")
    if not adapter:
        return
    from refserve.conformance.suite import scenario_names

    examples = int(config.getoption("--refserve-examples"))
    for name in scenario_names():
        items.append(
            ConformanceItem.from_parent(
                session,
                name=f"refserve_conformance[{name}]",
                adapter=str(adapter),
                scenario=name,
                examples=examples,
            )
        )
