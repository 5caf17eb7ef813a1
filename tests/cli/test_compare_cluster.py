"""``refserve compare --cluster`` (ref/cli/compare.py, ref/report/cluster_*.py): the SLOs
and the budget derived from the cost model, and a small run writing its report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refserve.cli.compare import compare_main
from refserve.core.cost import StepCost
from refserve.report.cluster_experiment import (
    D_REF,
    TBT_MULTIPLE,
    ClusterSlo,
    capacity_load,
    knee_load,
)


@pytest.mark.parametrize("cost", ["2+0.5P+D", "5+0.25P+0.5D", "1+1P+2D"])
def test_budget_is_the_largest_block_multiple_within_the_tbt_slo(cost: str) -> None:
    c = StepCost.parse(cost)
    slo = ClusterSlo.of(c, 16)
    decode = c.a + c.c * D_REF
    assert slo.tbt_ms == pytest.approx(TBT_MULTIPLE * decode)
    assert slo.budget % 16 == 0
    assert c.a + c.b * slo.budget + c.c * D_REF <= slo.tbt_ms
    assert c.a + c.b * (slo.budget + 16) + c.c * D_REF > slo.tbt_ms


def test_compare_cluster_writes_a_report_that_tells_policies_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rep"
    argv = [
        "--cluster", "--quick", "--quiet", "--out", str(out), "--traces", "agent",
        "--policies", "round_robin,prefix_aware", "--replicas", "1,2",
    ]  # fmt: skip
    assert compare_main(argv) == 0
    report = json.loads((out / "cluster.json").read_text())
    md = (out / "cluster.md").read_text()
    assert "knee" in md and "published 1.91x" in md
    assert set(report["knees"]["agent"]) == {"round_robin", "prefix_aware"}
    for name in report["plots"]:
        assert (out / name).read_bytes().startswith(b"\x89PNG")
    grid = {(p["policy"], p["replicas"]): p for p in report["grid"]}
    # Two replicas: prefix-aware keeps a session's turns where its context is cached.
    assert (
        grid["prefix_aware", 2]["prefix_hit_tokens"] > grid["round_robin", 2]["prefix_hit_tokens"]
    )
    # One replica: routing has no choice, so the policies run the same steps.
    a, b = grid["prefix_aware", 1], grid["round_robin", 1]
    assert (a["ttft_p99_ms"], a["prefix_hit_tokens"]) == (b["ttft_p99_ms"], b["prefix_hit_tokens"])
    assert "wrote" in capsys.readouterr().out


def test_compare_cluster_refuses_a_bad_replica_count(tmp_path: Path) -> None:
    assert compare_main(["--cluster", "--replicas", "0", "--out", str(tmp_path)]) != 0


def test_knee_and_capacity_read_the_first_failing_load() -> None:
    from refserve.report.cluster_experiment import Point

    def at(load: float, att: float) -> Point:
        fields = dict.fromkeys(Point.__dataclass_fields__, 0)
        fields.update(trace="t", policy="p", link="d", load=load, attainment=att)
        return Point(**fields)  # type: ignore[arg-type]

    pts = [at(2.0, 0.5), at(0.5, 1.0), at(1.0, 0.95), at(3.0, 0.99)]
    assert knee_load(pts) == 2.0
    assert capacity_load(pts) == 1.0
    assert knee_load(pts[1:3]) is None and capacity_load([at(1.0, 0.1)]) is None


def test_compare_cluster_reports_disaggregation_from_its_runs(tmp_path: Path) -> None:
    out = tmp_path / "rep"
    argv = [
        "--cluster", "--quick", "--quiet", "--out", str(out), "--traces", "chat",
        "--policies", "round_robin", "--replicas", "4",
    ]  # fmt: skip
    assert compare_main(argv) == 0
    report = json.loads((out / "cluster.json").read_text())
    md = (out / "cluster.md").read_text()
    rows = {p["config"]: p for p in report["pd"]}
    assert set(rows) == {"4 colocated", "2P2D", "2P2D+deflect"}
    assert report["pd_router"] == "slo_aware"
    assert rows["4 colocated"]["handoffs"] == 0 and rows["2P2D"]["handoffs"] > 0
    assert rows["2P2D"]["deflected"] == 0 < rows["2P2D+deflect"]["deflected"]
    for p in rows.values():
        # TTFT's tail splits into queueing and prefill execution; no transfer in it.
        assert p["tail_queueing_ms"] + p["tail_prefill_ms"] == pytest.approx(p["tail_ttft_ms"])
        assert p["tail_transfer_ms"] == 0
    assert rows["2P2D"]["second_tail_transfer_ms"] > 0
    # The findings are written from the measured figures.
    share = report["pd_findings"]["prefill_share_of_tail_ttft"]["chat 2x 2P2D"]
    assert f"{100 * share:.0f} %" in md and "published 2-23 %" in md
    cut = report["pd_findings"]["deflection_vs_2p2d"]["chat 2x"]["p95_ttft_cut"]
    assert f"{abs(100 * cut):.0f} %" in md
    assert {"cluster_pd_ttft.png", "cluster_pd_attainment.png"} <= set(report["plots"])
