"""The machine a benchmark ran on, recorded in its JSON at measurement time.

A figure means little without the machine behind it: the project's benchmarks run on
shared VMs whose speed moves with the load, so every writer (``refserve.conformance.bench.peers``,
``refserve.conformance.bench.memory``, the pytest-benchmark hook in ``tests/bench/conftest.py``)
stores :func:`describe` next to its figures, and ``refserve.conformance.bench.report`` prints it
under each table. Nothing here imports torch: the driver of ``make bench-peers`` runs no
model, and the version is read from the installed distribution instead.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's marketing name (``model name`` in /proc/cpuinfo), else what the platform
    module knows, else ``unknown``."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, or [] where the platform has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def version_of(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def describe() -> dict[str, Any]:
    """CPU model, core count, load average now, OS, Python and torch versions."""
    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count() or 0,
        "load_average": load_average(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version_of("torch"),
    }


def machine_line(m: dict[str, Any]) -> str:
    """One sentence for a :func:`describe` record (no full stop: callers end it)."""
    load = " / ".join(f"{x:.2f}" for x in m.get("load_average", [])) or "not recorded"
    return (
        f"Machine: {m.get('cpu_model', 'unknown CPU')}, {m.get('cores', '?')} cores, load "
        f"average (1 / 5 / 15 min) {load} at the start; {m.get('platform', 'unknown OS')}, "
        f"Python {m.get('python', '?')}, torch {m.get('torch') or 'not installed'}"
    )


@dataclass(frozen=True)
class Provenance:
    """How a benchmark ran, as the head of its JSON records it: the command that reruns
    it, when it started and the machine then (:func:`describe`: its load average is
    what the run started on); the load average after is read when the head is written,
    at the end. One head for every writer, so the renderer reads them alike."""

    command: str
    when: str
    machine: dict[str, Any]

    @staticmethod
    def start(command: str) -> Provenance:
        """Recorded before the run."""
        return Provenance(command, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), describe())

    def header(self, fmt: str, version: int = 1) -> dict[str, Any]:
        """The JSON's first keys: ``format``, ``version``, ``command``, ``when``,
        ``machine``, ``load_after``."""
        return {
            "format": fmt,
            "version": version,
            "command": self.command,
            "when": self.when,
            "machine": self.machine,
            "load_after": load_average(),
        }
