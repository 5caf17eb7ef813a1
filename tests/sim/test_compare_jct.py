"""``refserve compare``'s job completion times and its MLFQ policies: the JCT figures are
in the report and add up, the mlfq rows and their ablations are there, each ablation
takes away what it names, and the JCT findings are computed from the figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refserve.cli.compare import compare_main
from refserve.core.config import PolicyName
from refserve.core.cost import StepCost
from refserve.core.request_metrics import RequestMetrics
from refserve.report.analysis import PointResult
from refserve.report.compare import BASE_CONFIG, POLICIES, Slo
from refserve.report.jct import jct_findings
from refserve.report.jct_markdown import jct_markdown
from refserve.report.policies import MLFQ_KV_BYTES_PER_TOKEN, PolicyContext
from refserve.report.sweep import PlannedTrace, SweepResult
from refserve.report.workload_specs import TRACES

MLFQS = ("mlfq", "mlfq-no-skip-join", "mlfq-recompute")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("compare-jct")
    args = ["--quick", "--out", str(out), "--no-progress", "--traces", "heavy,mixed"]
    pols = "fcfs,chunked,prefix-aware," + ",".join(MLFQS)
    assert compare_main([*args, "--policies", pols]) == 0
    return out


def test_jct_figures_and_mlfq_rows_are_in_the_report(report: Path) -> None:
    doc = json.loads((report / "report.json").read_text())
    md = (report / "report.md").read_text()
    assert {p["name"] for p in doc["policies"]} >= set(MLFQS)
    for p in doc["points"]:
        assert 0 < p["jct_p50_ms"] <= p["jct_p95_ms"]
        # A request completes after its first token: the JCT median is at least the
        # fastest first token.
        assert p["jct_p95_ms"] >= p["ttft_p50_ms"] * 0.5
    jct = md.split("\n## Job completion time\n", 1)[1].split("\n## ", 1)[0]
    for trace in ("heavy", "mixed"):
        table = jct.split(f"**{trace}**", 1)[1].split("\n\n**", 1)[0]
        for pol in ("fcfs", "prefix-aware", *MLFQS):
            assert f" {pol} |" in table.splitlines()[2], (trace, pol)
        rows = [ln for ln in table.splitlines() if ln.startswith("| ") and " / " in ln]
        assert len(rows) == 2  # the two quick rates
    for pol in MLFQS:
        assert f"| {pol} | " in md.split("\n## heavy\n", 1)[1]
    # The findings name every baseline and both ablations, per trace.
    pairs = doc["jct"]["versus"]
    assert {(x["trace"], x["other"]) for x in pairs} == {
        (t, o) for t in ("heavy", "mixed") for o in ("fcfs", "chunked", "prefix-aware")
    }
    assert len(doc["jct"]["skip_join"]) == len(doc["jct"]["proactive_swap"]) == 2
    assert "**mlfq vs fcfs**" in jct and "**the skip-join**" in jct
    assert "**the proactive swap**" in jct


def test_the_ablations_take_away_what_they_name() -> None:
    cost = StepCost.parse("2+0.5P+D")
    ctx = PolicyContext(1000, Slo.of(cost), cost, scale=16.0)
    by_name = {p.name: p.configure(BASE_CONFIG, ctx) for p in POLICIES if p.name in MLFQS}
    full, no_skip, recompute = (by_name[n] for n in MLFQS)
    for cfg in by_name.values():
        assert cfg.policy is PolicyName.MLFQ and cfg.mlfq.cost == cost
        assert cfg.enable_chunked_prefill and cfg.enable_prefix_caching
    assert full.mlfq.skip_join and full.mlfq.proactive_swap
    assert full.num_host_blocks == BASE_CONFIG.num_blocks
    # Swaps are priced per simulated token: scale x the real token's K/V.
    assert full.swap_cost is not None
    assert full.swap_cost.kv_bytes_per_token == 16 * MLFQ_KV_BYTES_PER_TOKEN
    assert not no_skip.mlfq.skip_join and no_skip.num_host_blocks == full.num_host_blocks
    assert not recompute.mlfq.proactive_swap and recompute.num_host_blocks == 0


def _point(policy: str, rate: float, p50: float, p95: float) -> PointResult:
    return PointResult(
        "heavy", policy, rate, rate, 10, 10, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, rate, 1.0, 0, 0,
        0, 0.0, 1.0, 1, 0.0, jct_p50_ms=p50, jct_p95_ms=p95,
    )  # fmt: skip


def test_findings_are_computed_from_the_figures() -> None:
    by_name = {p.name: p for p in POLICIES}
    names = ("fcfs", "prefix-aware", *MLFQS)
    points = [
        # fcfs stopped after rate 1: the comparison with it is at rate 1.
        _point("fcfs", 1, 300, 900),
        _point("prefix-aware", 1, 100, 400),
        _point("prefix-aware", 2, 200, 800),
        _point("mlfq", 1, 100, 400),
        _point("mlfq", 2, 100, 600),
        _point("mlfq-no-skip-join", 2, 150, 600),
        _point("mlfq-recompute", 2, 200, 700),
    ]
    sweep = SweepResult(
        (PlannedTrace(next(t for t in TRACES if t.name == "heavy"), (1.0, 2.0)),),
        tuple(by_name[n] for n in names),
        (),
        tuple(points),
        {"heavy": {"fcfs": 2.0}},
    )
    f = jct_findings(sweep)
    assert f is not None
    vs_fcfs = next(p for p in f.versus if p.other == "fcfs")
    assert vs_fcfs.rate == 1 and vs_fcfs.p50 == vs_fcfs.p95 == "better"
    vs_pa = next(p for p in f.versus if p.other == "prefix-aware")
    assert vs_pa.rate == 2 and vs_pa.p50 == "better" and vs_pa.p95 == "better"
    assert f.beats("prefix-aware", "p50") == ["heavy"]
    # mlfq gains 100 ms (P50) and 200 ms (P95) over prefix-aware at rate 2; without the
    # skip-join 50 of the 100 and none of the 200 are lost, without the swap all of both.
    (skip,) = f.skip_join
    assert skip.share_p50 == pytest.approx(0.5) and skip.share_p95 == pytest.approx(0.0)
    (swap,) = f.proactive_swap
    assert swap.share_p50 == pytest.approx(1.0) and swap.share_p95 == pytest.approx(0.5)
    text = "\n".join(jct_markdown(sweep, f))
    assert "lower JCT P50 on heavy" in text and "50% of the gain" in text
    assert "| 2 | - | 200 / 800 | 100 / 600 |" in text
    # Equal figures are a tie, and no gain leaves nothing to share.
    same = SweepResult(
        sweep.plan,
        sweep.policies,
        (),
        tuple(_point(n, 2, 100, 400) for n in names),
        {},
    )
    g = jct_findings(same)
    assert g is not None and all(p.p50 == p.p95 == "tie" for p in g.versus)
    assert g.skip_join[0].share_p50 is None
    assert "no gain over prefix-aware to share" in "\n".join(jct_markdown(same, g))


def test_jct_is_arrival_to_finish() -> None:
    m = RequestMetrics("r", 10.0, 12.0, (20.0, 30.0), 31.0, "stop", 5, 2, 0, 0)
    assert m.jct_ms == 21.0
    unfinished = RequestMetrics("r", 10.0, 12.0, (20.0,), None, None, 5, 1, 0, 0)
    assert unfinished.jct_ms is None
