"""``refserve compare --quick``: the report files exist, cover every policy, and add up;
the PNG plots are real images; fairness and the knee-cause classifier on hand-checked
cases."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from refserve.cli.compare import compare_main
from refserve.core.config import SchedulerConfig
from refserve.core.engine_core import StepRecord
from refserve.core.outcome import Outcome, StepOutcome
from refserve.core.plan import StepPlan
from refserve.core.request_metrics import RequestMetrics
from refserve.report.compare import (
    NO_LIMIT,
    POLICIES,
    TRACES,
    LimitFractions,
    Slo,
    knee_cause,
    knee_rate,
    limit_fractions,
    tenant_fairness,
)
from refserve.report.plots import PNG_MAGIC, BarGroup, grouped_bar_chart_png, line_chart_png
from refserve.sim.metrics import jain_index


def assert_png(path: Path, min_bytes: int = 5_000, max_bytes: int = 200_000) -> None:
    """A real, non-trivial, committable PNG that matplotlib reads back."""
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), path
    assert min_bytes < len(data) < max_bytes, (path, len(data))
    pixels = imread(path)
    height, width = pixels.shape[:2]
    assert width >= 300 and height >= 200
    # Not a blank canvas: a drawn chart has many distinct colours.
    assert len({tuple(px) for px in pixels[::7, ::7].reshape(-1, pixels.shape[2]).tolist()}) > 8


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("compare")
    assert compare_main(["--quick", "--out", str(out)]) == 0
    return out


def test_quick_writes_report_files(quick_report: Path) -> None:
    assert (quick_report / "report.md").is_file()
    assert (quick_report / "report.json").is_file()
    md = (quick_report / "report.md").read_text()
    for spec in TRACES:
        for kind in ("goodput", "ttft_p99"):
            assert_png(quick_report / f"{kind}_{spec.name}.png")
            assert f"({kind}_{spec.name}.png)" in md
    assert_png(quick_report / "swap_vs_recompute.png")
    assert "(swap_vs_recompute.png)" in md
    assert not list(quick_report.glob("*.svg"))


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
        assert p["rejection_rate"] == pytest.approx(p["rejected"] / p["num_requests"])
        assert 0.0 <= p["capacity_rate"] <= p["rejection_rate"]
        assert all(0.0 <= v <= 1.0 for v in p["limits"].values())
        # Only the traces with several tenants (chat: one per application) have a
        # fairness figure, and it is a Jain index: between 1/n and 1.
        if p["trace"] in ("long", "heavy", "heavy-tight"):
            assert p["num_tenants"] == 1 and p["fairness"] is None
        else:
            assert p["num_tenants"] >= 2
            assert 1 / p["num_tenants"] - 1e-9 <= p["fairness"] <= 1 + 1e-9
    # Agent sessions reuse their prefix: with the cache on, most prompt tokens are hits.
    agent = [p for p in points if p["trace"] == "agent" and p["policy"] == "prefix-aware"]
    assert agent and all(p["prefix_hit_rate"] > 0.5 for p in agent)
    # Chat shares a 2K system prompt per application (128 of ~192 simulated tokens).
    chat = [p for p in points if p["trace"] == "chat" and p["policy"] == "prefix-aware"]
    assert chat and all(p["prefix_hit_rate"] > 0.3 for p in chat)


def test_knee_rate_is_the_first_rate_below_the_threshold() -> None:
    from refserve.report.compare import PointResult

    def point(rate: float, attainment: float, kv: float = 0.0) -> PointResult:
        return PointResult(
            "t", "p", rate, rate, 10, 10, 1.0, 1.0, 1.0, 1.0, 1.0, attainment,
            attainment * rate, 1.0, 0, 0, 0, 0.0, 1.0, 1, 0.0,
            limits=LimitFractions(kv_blocks=kv),
        )  # fmt: skip

    pts = [point(4, 0.5), point(1, 1.0), point(2, 0.95), point(3, 0.85, kv=0.5)]
    assert knee_rate(pts, 0.9) == 3
    assert knee_rate(pts[1:2], 0.9) is None
    # The cause is read at the knee's own run, not at a later, more overloaded one.
    assert knee_cause(pts, 0.9) == "KV blocks"
    assert knee_cause(pts[1:2], 0.9) is None
    # No limit bound: the cause names the SLO that more requests missed.
    tbt = dataclasses.replace(
        pts[3], limits=LimitFractions(), ttft_miss_rate=0.1, tbt_miss_rate=0.3
    )
    assert tbt.cause() == f"{NO_LIMIT} (TBT)"
    ttft = dataclasses.replace(tbt, ttft_miss_rate=0.5)
    assert ttft.cause() == f"{NO_LIMIT} (TTFT)"


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


def test_jain_index_by_hand() -> None:
    assert jain_index([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(1 / 4)  # one gets all: 1/n
    assert jain_index([1.0, 0.5]) == pytest.approx(1.5**2 / (2 * 1.25))  # 0.9
    assert jain_index([0.0, 0.0]) == 1.0  # nobody served: equally
    assert jain_index([]) is None
    with pytest.raises(ValueError):
        jain_index([1.0, -1.0])


def _req(tenant: str, ok: bool) -> RequestMetrics:
    # 10 ms TTFT meets a 100 ms SLO; 500 ms does not.
    first = 10.0 if ok else 500.0
    return RequestMetrics(
        "r", 0.0, 0.0, (first, first + 1), first + 1, "length", 10, 2, 0, 0, tenant
    )


def test_tenant_fairness_is_jain_over_tenant_attainment() -> None:
    slo = Slo(ttft_base_ms=100, ttft_per_token_ms=0, tbt_ms=10)
    equal = [_req("a", True), _req("a", False), _req("b", True), _req("b", False)]
    assert tenant_fairness(equal, slo) == pytest.approx(1.0)
    starved = [_req("a", True), _req("a", True), _req("b", False), _req("c", False)]
    assert tenant_fairness(starved, slo) == pytest.approx(1 / 3)
    assert tenant_fairness([_req("a", True), _req("a", False)], slo) is None  # one tenant


def _step(
    i: int, tokens: dict[str, int], kv: int, *, preempted: tuple[str, ...] = ()
) -> StepRecord:
    ids = tuple(tokens)
    plan = StepPlan(
        step_index=i,
        request_ids=ids,
        starts=tuple(0 for _ in ids),
        num_new_tokens=tuple(tokens.values()),
        samples=tuple(False for _ in ids),
        is_prefill=tuple(True for _ in ids),
        num_new_cached_tokens=tuple(0 for _ in ids),
        preempted=preempted,
    )
    return StepRecord(
        i, float(i), float(i + 1), tuple(tokens.items()), sum(tokens.values()), 0, kv,
        _preempted(preempted), plan,
    )  # fmt: skip


def _preempted(ids: tuple[str, ...]) -> StepOutcome:
    return StepOutcome(
        (), np.zeros(0, dtype=np.int64), tuple(Outcome(p, preempted=True) for p in ids)
    )


def test_knee_cause_classifier_on_synthetic_steps() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2, block_size=4, num_blocks=20)
    budget = [_step(0, {"a": 8}, 2), _step(1, {"a": 5, "b": 3}, 4), _step(2, {"a": 1}, 4)]
    got = limit_fractions(budget, cfg)
    # Steps 0 and 1 computed 8 of 8 tokens; step 1 ran 2 of 2 sequences; KV never near 20.
    assert got == LimitFractions(token_budget=2 / 3, max_seqs=1 / 3, kv_blocks=0.0, swap=0.0)
    assert got.cause() == "token budget"
    # 19 of 20 blocks in use is full (>= 95 %), and a preemption marks a step KV-bound even
    # at the budget: memory, not the budget, stopped it.
    kv = [_step(0, {"a": 8}, 19), _step(1, {"a": 8}, 10, preempted=("b",)), _step(2, {"a": 1}, 5)]
    got = limit_fractions(kv, cfg)
    assert got.kv_blocks == pytest.approx(2 / 3) and got.token_budget == pytest.approx(2 / 3)
    assert got.cause() == "KV blocks"
    idle = [_step(i, {"a": 1}, 1) for i in range(10)]
    assert limit_fractions(idle, cfg).cause() == NO_LIMIT
    assert limit_fractions([], cfg) == LimitFractions()


def test_charts_are_valid_pngs(tmp_path: Path) -> None:
    line = line_chart_png(
        tmp_path / "line.png",
        "title",
        "rate (req/s)",
        "goodput (req/s)",
        {"a": [(0.1, 1.0), (1.0, None), (10.0, 100.0)], "b": [(0.1, 5.0), (10.0, 50.0)]},
        log_x=True,
        log_y=True,
        reference=[(0.1, 0.1), (10.0, 10.0)],
        reference_label="offered",
    )
    assert_png(line)
    bars = grouped_bar_chart_png(
        tmp_path / "bars.png",
        "title",
        "mode",
        "ms",
        [
            BarGroup("recompute", {"p50": 1.0, "p99": 9.0}),
            BarGroup("swap", {"p50": 2.0, "p99": None}),
        ],
    )
    assert_png(bars)
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary name


def test_timeline_png_from_a_simulated_run(tmp_path: Path) -> None:
    from refserve.core.cost import StepCost
    from refserve.core.scheduler import Scheduler
    from refserve.report.timeline import write_timeline_png
    from refserve.sim.simulator import simulate
    from refserve.sim.trace import load_trace

    cfg = SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=4, block_size=4, num_blocks=16)
    reqs = [t.to_request() for t in load_trace("seed002")]
    result = simulate(Scheduler(cfg), reqs, StepCost.parse("2+0.5P+D"))
    assert_png(write_timeline_png(tmp_path / "t.png", result.steps, cfg.num_blocks, "seed002"))


def test_core_does_not_import_matplotlib() -> None:
    """Plotting is lazy: running the simulator and the report's numbers never loads it."""
    import subprocess
    import sys

    code = (
        "import sys, refserve.report.compare, refserve.report.timeline, refserve.sim.simulator; "
        "import refserve.core.engine_core; "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
