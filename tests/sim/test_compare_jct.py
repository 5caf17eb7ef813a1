"""``refserve compare``'s job completion times and its MLFQ policies: the JCT figures are
in the report and add up, the mlfq rows and their ablations are there, each ablation
takes away what it names, the JCT findings are computed from the figures, and on
heavy-tight's constrained server mlfq displaces and swaps (counted per run)."""

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
from refserve.report.sweep import PlannedTrace, SweepPoint, SweepResult, run_point
from refserve.report.workload_specs import TRACES

MLFQS = ("mlfq", "mlfq-no-skip-join", "mlfq-recompute")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("compare-jct")
    args = ["--quick", "--out", str(out), "--no-progress", "--traces", "heavy,mixed,heavy-tight"]
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
        (t, o)
        for t in ("heavy", "mixed", "heavy-tight")
        for o in ("fcfs", "chunked", "prefix-aware")
    }
    assert len(doc["jct"]["skip_join"]) == len(doc["jct"]["proactive_swap"]) == 3
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


def _point(
    policy: str, rate: float, p50: float, p95: float, trace: str = "heavy", displaced: int = 0
) -> PointResult:
    mlfq = policy.startswith("mlfq")
    return PointResult(
        trace, policy, rate, rate, 10, 10, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, rate, 1.0, 0,
        displaced, 0, 0.0, 1.0, 1, 0.0, jct_p50_ms=p50, jct_p95_ms=p95,
        displaced=displaced if mlfq else None, headroom_swaps=1 if displaced else 0,
        swapped_out=displaced // 2, swap_blocks_out=displaced, swap_blocks_in=displaced,
        swap_bytes=2 * displaced * 1_000_000_000,
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


def test_the_tight_run_displaces_and_swaps_in_the_report(report: Path) -> None:
    doc = json.loads((report / "report.json").read_text())
    md = (report / "report.md").read_text()
    tight = next(t for t in doc["traces"] if t["name"] == "heavy-tight")
    assert tight["server"]["max_num_seqs"] < BASE_CONFIG.max_num_seqs
    points = {(p["policy"], p["rate"]): p for p in doc["points"] if p["trace"] == "heavy-tight"}
    top = max(tight["rates"])
    mlfq, recompute = points["mlfq", top], points["mlfq-recompute", top]
    assert mlfq["displaced"] > 0 and mlfq["swapped_out"] > 0 and mlfq["swap_blocks_out"] > 0
    assert mlfq["preemptions"] >= mlfq["displaced"]
    # The ablation has no host pool: it displaces too, and nothing crosses the link.
    assert recompute["displaced"] > 0 and recompute["swap_bytes"] == 0
    assert points["prefix-aware", top]["displaced"] is None  # not an mlfq policy
    per_rate = [x for x in doc["jct"]["per_rate"] if x["trace"] == "heavy-tight"]
    assert [x["rate"] for x in per_rate] == tight["rates"]
    # The findings text is built from these counts, not typed in.
    assert "**On heavy-tight's constrained server**" in md
    bullet = md.split(f"- **@ {top:g}**: ", 1)[1].split("\n", 1)[0]
    assert f"mlfq displaced {mlfq['displaced']} ({mlfq['headroom_swaps']} for headroom)" in bullet
    assert f"{mlfq['swapped_out']} swapped out ({mlfq['swap_blocks_out']} blocks out" in bullet
    assert f"mlfq {mlfq['jct_p50_ms']:,.0f} / {mlfq['jct_p95_ms']:,.0f} ms" in bullet
    assert "mlfq-recompute displaced" in bullet and "nothing swapped" in bullet
    # Only the constrained trace is read rate by rate.
    assert all(x["trace"] == "heavy-tight" for x in doc["jct"]["per_rate"])


def test_mlfq_displaces_on_the_tight_server_only(tmp_path: Path) -> None:
    """The full heavy workload at 32 req/s: the default server never makes mlfq displace,
    the tight one does, for seats and for headroom, and the K/V goes over the link."""
    from refserve.cli.compare import compare_options

    opts, _ = compare_options(["--out", str(tmp_path)])
    by_trace = {t.name: t for t in TRACES}
    by_policy = {p.name: p for p in POLICIES}
    runs = {}
    for trace in ("heavy", "heavy-tight"):
        spec = by_trace[trace]
        workload = spec.build(32.0, spec.num_units(32.0, None, False), opts.scale, opts.seed)
        for pol in ("mlfq", "mlfq-recompute"):
            runs[trace, pol] = run_point(opts, SweepPoint(spec, workload, by_policy[pol], 32.0))
    assert runs["heavy", "mlfq"].displaced == runs["heavy", "mlfq"].swapped_out == 0
    tight = runs["heavy-tight", "mlfq"]
    assert tight.displaced is not None and tight.displaced > 0
    assert tight.headroom_swaps is not None and tight.headroom_swaps > 0
    assert 0 < tight.swapped_out <= tight.displaced
    assert tight.swap_blocks_out == tight.swap_blocks_in > 0
    assert tight.swap_bytes == 2 * tight.swap_blocks_out * 16 * 16 * MLFQ_KV_BYTES_PER_TOKEN
    recompute = runs["heavy-tight", "mlfq-recompute"]
    assert recompute.displaced and recompute.headroom_swaps == 0 and recompute.swap_bytes == 0


def test_tight_findings_are_computed_rate_by_rate() -> None:
    by_name = {p.name: p for p in POLICIES}
    names = ("fcfs", "prefix-aware", *MLFQS)
    spec = next(t for t in TRACES if t.name == "heavy-tight")
    figures = {
        # rate: (fcfs, prefix-aware, mlfq, no-skip-join, recompute) as (P50, P95)
        1: ((100, 400), (100, 400), (100, 400), (100, 400), (100, 400)),
        2: ((300, 900), (200, 800), (100, 1000), (300, 1200), (50, 700)),
    }
    points = [
        _point(n, rate, p50, p95, trace="heavy-tight", displaced=0 if rate == 1 else 7)
        for rate, row in figures.items()
        for n, (p50, p95) in zip(names, row, strict=True)
    ]
    sweep = SweepResult(
        (PlannedTrace(spec, (1.0, 2.0)),), tuple(by_name[n] for n in names), (), tuple(points), {}
    )
    f = jct_findings(sweep)
    assert f is not None and [x.rate for x in f.per_rate] == [1.0, 2.0]
    low, high = f.per_rate
    assert all(p.p50 == p.p95 == "tie" for p in low.versus)
    vs_fcfs = high.against("fcfs")
    assert vs_fcfs is not None and (vs_fcfs.p50, vs_fcfs.p95) == ("better", "worse")
    # mlfq gains 100 ms P50 over prefix-aware; without the skip-join it loses 200 (200 %),
    # without the swap it gains 50 more (-50 %); no P95 gain to share.
    assert high.skip_join is not None and high.skip_join.share_p50 == pytest.approx(2.0)
    assert high.proactive_swap is not None
    assert high.proactive_swap.share_p50 == pytest.approx(-0.5)
    assert high.proactive_swap.share_p95 is None
    assert [a.displaced for a in high.activity] == [7, 7, 7]
    text = "\n".join(jct_markdown(sweep, f))
    assert "- **mlfq vs fcfs**: lower JCT P50 at 2; lower P95 at none." in text
    assert "- **mlfq vs prefix-aware**: lower JCT P50 at 2; lower P95 at none." in text
    assert "the skip-join lowers P50 and lowers P95 (without it 300 / 1,200 ms" in text
    assert "the proactive swap raises P50 and raises P95" in text
    assert "-50%: mlfq gains more without it" in text
    assert "mlfq displaced 0 (0 for headroom), 0 preemptions, nothing swapped" in text
    assert "mlfq displaced 7 (1 for headroom), 7 preemptions, 3 swapped out" in text
    assert "| 2 | mlfq | 7 (1) | 7 | 3 | 7 / 7 | 14.0 | 0.56 |" in text
    assert "displaced nobody here" in text.split("- **@ 2**", 1)[0]
