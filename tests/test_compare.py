"""``refserve compare --quick``: the report files exist, cover every policy, and add up."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ref.compare import POLICIES, TRACES, Slo, compare_main, knee_rate
from ref.metrics import RequestMetrics
from ref.report_plot import line_chart_svg, nice_ticks


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("compare")
    assert compare_main(["--quick", "--out", str(out)]) == 0
    return out


def test_quick_writes_report_files(quick_report: Path) -> None:
    assert (quick_report / "report.md").is_file()
    assert (quick_report / "report.json").is_file()
    for spec in TRACES:
        for kind in ("goodput", "ttft_p99"):
            svg = (quick_report / f"{kind}_{spec.name}.svg").read_text()
            assert svg.startswith("<svg") and "<polyline" in svg
            ET.fromstring(svg)  # well-formed XML
            assert f"({kind}_{spec.name}.svg)" in (quick_report / "report.md").read_text()


def test_every_available_policy_is_in_every_table(quick_report: Path) -> None:
    report = json.loads((quick_report / "report.json").read_text())
    md = (quick_report / "report.md").read_text()
    names = [p["name"] for p in report["policies"]]
    skipped = [p["name"] for p in report["skipped_policies"]]
    assert sorted(names + skipped) == sorted(p.name for p in POLICIES)
    assert {"static", "fcfs", "chunked", "prefix-aware"} <= set(names)
    for spec in TRACES:
        section = md.split(f"\n## {spec.name}\n", 1)[1].split("\n## ", 1)[0]
        for name in names:
            assert f"| {name} | " in section, (spec.name, name)
            assert name in report["knees"][spec.name]
        # The first (lowest) rate of the quick sweep is run for every policy.
        first = min(spec.quick_rates)
        got = {p["policy"] for p in report["points"] if p["trace"] == spec.name}
        assert got == set(names)
        assert all(
            any(p["rate"] == first for p in report["points"] if p["policy"] == n) for n in names
        )
    for name in skipped:
        assert f"~~{name}~~ skipped" in md


def test_numbers_are_sane(quick_report: Path) -> None:
    report = json.loads((quick_report / "report.json").read_text())
    points = report["points"]
    assert points
    for p in points:
        assert 0.0 <= p["slo_attainment"] <= 1.0
        assert 0.0 <= p["goodput_rps"] <= p["offered_rps"] + 1e-9
        assert p["num_finished"] + p["rejected"] == p["num_requests"]
        assert p["ttft_p50_ms"] <= p["ttft_p95_ms"] <= p["ttft_p99_ms"]
        assert p["tbt_p99_ms"] is None or p["tbt_p99_ms"] > 0
        assert p["output_tokens_per_s"] > 0
        assert p["goodput_tokens_per_s"] <= p["output_tokens_per_s"] + 1e-9
        assert p["preemptions"] >= 0 and 0.0 <= p["prefix_hit_rate"] <= 1.0
        if p["policy"] in ("static", "fcfs", "chunked"):
            assert p["cached_tokens"] == 0  # prefix caching off
    # Agent sessions reuse their prefix: with the cache on, most prompt tokens are hits.
    agent = [p for p in points if p["trace"] == "agent" and p["policy"] == "prefix-aware"]
    assert agent and all(p["prefix_hit_rate"] > 0.5 for p in agent)


def test_knee_rate_is_the_first_rate_below_the_threshold() -> None:
    from ref.compare import PointResult

    def point(rate: float, attainment: float) -> PointResult:
        return PointResult(
            "t", "p", rate, rate, 10, 10, 1.0, 1.0, 1.0, 1.0, 1.0, attainment,
            attainment * rate, 1.0, 0, 0, 0, 0.0, 1.0, 1, 0.0,
        )  # fmt: skip

    pts = [point(4, 0.5), point(1, 1.0), point(2, 0.95), point(3, 0.85)]
    assert knee_rate(pts, 0.9) == 3
    assert knee_rate(pts[1:2], 0.9) is None


def test_slo_needs_both_ttft_and_tbt() -> None:
    slo = Slo(ttft_base_ms=100, ttft_per_token_ms=1, tbt_ms=10)

    def m(times: tuple[float, ...], prompt: int = 50) -> RequestMetrics:
        return RequestMetrics("r", 0.0, 0.0, times, times[-1], "length", prompt, len(times), 0, 0)

    assert slo.met(m((150.0, 160.0)))
    assert not slo.met(m((151.0, 160.0)))  # TTFT over 100 + 50
    assert not slo.met(m((100.0, 111.0)))  # one gap over 10 ms


def test_unknown_policy_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert compare_main(["--quick", "--out", str(tmp_path), "--policies", "nope"]) == 2
    assert "unknown policy nope" in capsys.readouterr().err


def test_line_chart_is_well_formed_and_breaks_at_missing_points() -> None:
    svg = line_chart_svg(
        "t <&>",
        "x",
        "y",
        {"a": [(0.1, 1.0), (1.0, None), (10.0, 100.0)], "b": [(0.1, 5.0), (10.0, 50.0)]},
        log_x=True,
        log_y=True,
        reference=[(0.1, 0.1), (10.0, 10.0)],
    )
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f"{ns}circle")) == 4  # the missing point is not drawn
    assert len(root.findall(f"{ns}polyline")) == 2  # b and the reference: a has no run of 2
    assert nice_ticks(0, 7) == [0, 2, 4, 6, 8]
