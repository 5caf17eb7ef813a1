"""What pytest-benchmark's ``--benchmark-json`` leaves out, added for docs/BENCHMARKS.md.

pytest-benchmark records the CPU and Python, but not the command, the load the run
started under or the torch version, and on the project's shared VMs the load moves the
figures more than most code changes do. ``make bench`` writes ``out/bench-pytest.json``
and ``refserve.conformance.bench.report`` prints this record under its tables.
"""

from __future__ import annotations

import shlex
from typing import Any

import pytest

from refserve.conformance.bench.machine import describe, load_average

# Taken when pytest loads this file, before any benchmark of the session runs.
_MACHINE_AT_START = describe()


def pytest_benchmark_update_json(
    config: pytest.Config, benchmarks: list[Any], output_json: dict[str, Any]
) -> None:
    # pytest-benchmark keeps every round's time (2.5 MB for the step and pool suites); the
    # statistics beside them are what the report prints and what --benchmark-compare
    # reads, and docs/bench/ commits this file.
    for b in output_json.get("benchmarks", []):
        b.get("stats", {}).pop("data", None)
    args = " ".join(shlex.quote(str(a)) for a in config.invocation_params.args)
    output_json["refserve"] = {
        "command": f"python -m pytest {args}",
        "machine": _MACHINE_AT_START,
        "load_after": load_average(),
    }
