"""docs/kv_layouts/report.md is rendered from the committed report.json, never typed.

``refserve kv-layouts --out docs/kv_layouts`` writes both (and the charts); here the
committed document must equal what the committed JSON renders, the JSON must name the
command that measured it, and every chart it names must be there.
"""

from __future__ import annotations

import json
from pathlib import Path

from refserve.report.kv_layouts_markdown import render_markdown
from refserve.report.kv_layouts_report import COMMAND

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "kv_layouts"


def test_the_committed_report_is_what_its_json_renders() -> None:
    report = json.loads((DOCS / "report.json").read_text(encoding="utf-8"))
    assert (DOCS / "report.md").read_text(encoding="utf-8") == render_markdown(report), (
        f"docs/kv_layouts/report.md is stale or was edited by hand: run `{COMMAND}`"
    )


def test_the_committed_estimate_is_the_pools_count() -> None:
    """docs/GUIDE.md says so: on every step of every capacity run."""
    report = json.loads((DOCS / "report.json").read_text(encoding="utf-8"))
    for source in report["sources"]:
        for row in source["estimate"]:
            assert row["gap"]["max_gap"] == row["gap"]["min_gap"] == 0, row
            assert row["steps"] > 0


def test_the_committed_report_names_its_command_and_charts() -> None:
    report = json.loads((DOCS / "report.json").read_text(encoding="utf-8"))
    assert report["command"] == COMMAND
    for name in report["plots"].values():
        assert (DOCS / name).is_file(), name


def test_the_committed_report_has_the_real_engine() -> None:
    """docs/HYBRID_KV.md cites its table: the engine's runs are in the committed report,
    at most the bound, the grouped pool's greedy tokens the plain pool's, and the wall
    times said to be CPU."""
    report = json.loads((DOCS / "report.json").read_text(encoding="utf-8"))
    engines = [s for s in report["sources"] if s.get("kind") == "engine"]
    assert len(engines) == 1
    (engine,) = engines
    assert engine["settings"]["device"] == "cpu"
    assert engine["outputs"]["identical"] is True and engine["outputs"]["requests_compared"] > 0
    points = engine["capacity"]
    assert points and all(p["reserve_peak"]["max_running"] <= p["bound"] for p in points)
    longest = max(p["context"] for p in points)
    ran = {p["layout"]: p["reserve_peak"]["max_running"] for p in points if p["context"] == longest}
    assert ran["hybrid-1:1"] > ran["dense"]
    md = (DOCS / "report.md").read_text(encoding="utf-8")
    assert "## Real engine" in md and "not a GPU figure" in md
