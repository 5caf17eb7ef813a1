"""``refserve kv-layouts`` on a tiny configuration: capacity never above the analytic
bound under peak reservation, the hybrid layouts ahead of dense at long context, the
admission's block count equal to the pool's on every step (and a probe of the wrong
layout seen to differ), typed errors for bad settings and options, and the command's
files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from refserve.cli.main import main
from refserve.core.cost import StepCost
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.errors import InvalidArgument
from refserve.report.kv_layouts_markdown import render_markdown
from refserve.report.kv_layouts_report import (
    KVLayoutsOptions,
    default_slo,
    goodput_point,
    with_ratios,
)
from refserve.report.policies import Slo
from refserve.sim.kv_layouts import (
    DENSE,
    FULL,
    BlockProbe,
    CapacityAdmission,
    KVLayout,
    LayoutExperiment,
    LoopRun,
    ReservePeaks,
    compressed_layout,
    hybrid_layout,
    run_capacity,
    run_goodput,
    standard_layouts,
)
from refserve.sim.simulator import simulate
from refserve.spec.groups import GroupKind, KVGroup
from tests.sim.test_compare import assert_png

LAYOUTS = standard_layouts(64)
TINY = LayoutExperiment(
    LAYOUTS,
    contexts=(64, 512),
    output_len=32,
    dense_blocks=96,
    capacity_budget=512,
    goodput_budget=256,
    goodput_requests=12,
)
# Fewer blocks than its groups: a long prompt's chunk holds more than its peak, and
# more than the pool (a window group holds the whole chunk while it computes).
ODD = KVLayout("odd", "two groups in one group's memory", LAYOUTS[1].kv_groups, 1)
# The CLI's spelling of the same sizes.
TINY_ARGS = (
    "--contexts=64,512",
    "--output-len=32",
    "--window=64",
    "--dense-blocks=96",
    "--capacity-budget=512",
    "--goodput-budget=256",
    "--goodput-requests=12",
    "--no-engine",
    "--quiet",
)


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, int, CapacityAdmission], LoopRun]:
    return {
        (layout.name, c, a): run_capacity(TINY, layout, c, a)
        for layout in TINY.layouts
        for c in TINY.contexts
        for a in CapacityAdmission
    }


# ------------------------------------------------------------------------ the layouts
def test_the_layouts_and_their_memory() -> None:
    dense, h11, h51, comp = LAYOUTS
    assert dense is DENSE and dense.groups == (FULL,) and dense.kv_groups == ()
    assert [x.name for x in LAYOUTS] == ["dense", "hybrid-1:1", "hybrid-5:1", "compressed-r4"]
    window = KVGroup(GroupKind.WINDOW, 64)
    assert h11.kv_groups == (FULL, window)
    assert h51.kv_groups == (FULL, *(window,) * 5)
    assert comp.kv_groups == (FULL, KVGroup(GroupKind.COMPRESSED, ratio=4), window)
    # Equal layer counts: G groups, G times the dense blocks in the same memory; the
    # compressed layers' raw window is a second group over the same layers.
    assert [x.num_blocks(96) for x in LAYOUTS] == [96, 192, 576, 192]
    assert h51.groups_text() == "full, window 64 x5"
    assert comp.groups_text() == "full, compressed 4:1, window 64"
    # 544 tokens: 34 blocks full; a window of 64 holds at most 5 blocks of 16; a block
    # of the compressed group covers 64 tokens.
    assert [x.peak(544, 16) for x in LAYOUTS] == [34, 39, 59, 34 + 9 + 5]
    assert [TINY.bound(x, 512) for x in LAYOUTS] == [96 // 34, 192 // 39, 576 // 59, 192 // 48]
    # In chunks of 512 a window group holds the whole chunk and the window before it.
    assert TINY.chunk_peak(h11, 512) == h11.peak(544, 16, 512) > h11.peak(544, 16)
    assert TINY.chunk_peak(dense, 512) == dense.peak(544, 16)
    assert TINY.chunk_bound(h51, 512) <= TINY.bound(h51, 512)


def test_capacity_never_passes_the_bound_under_peak_reservation(
    runs: dict[tuple[str, int, CapacityAdmission], LoopRun],
) -> None:
    for layout in TINY.layouts:
        for c in TINY.contexts:
            f = runs[(layout.name, c, CapacityAdmission.RESERVE_PEAK)].figures
            bound = TINY.bound(layout, c)
            assert 1 <= f.max_running <= bound, (layout.name, c, f.max_running, bound)
            assert 0 < f.mean_running <= f.max_running
            assert f.steady_steps > 0 and f.throughput_rps > 0
            assert 0 < f.mean_used_fraction <= 1


def test_the_schedulers_own_admission_can_pass_the_bound_and_then_preempts(
    runs: dict[tuple[str, int, CapacityAdmission], LoopRun],
) -> None:
    """Short prompts, long outputs: the sequence admission counts the new request's
    peak against the free blocks, not the growth those running still have."""
    over = [
        (layout.name, c)
        for layout in TINY.layouts
        for c in TINY.contexts
        if runs[(layout.name, c, CapacityAdmission.SEQUENCE)].figures.max_running
        > TINY.bound(layout, c)
    ]
    assert ("dense", 64) in over
    for name, c in over:
        assert runs[(name, c, CapacityAdmission.SEQUENCE)].figures.preemptions > 0


def test_hybrid_layouts_hold_more_requests_than_dense_at_long_context(
    runs: dict[tuple[str, int, CapacityAdmission], LoopRun],
) -> None:
    longest = max(TINY.contexts)
    ran = [
        runs[(x.name, longest, CapacityAdmission.RESERVE_PEAK)].figures.max_running for x in LAYOUTS
    ]
    assert ran[0] < ran[1] < ran[2], ran
    assert ran[3] > ran[0], ran
    bounds = [TINY.bound(x, longest) for x in LAYOUTS]
    assert bounds[0] < bounds[1] < bounds[2], bounds


def test_the_estimate_is_the_pools_count_on_every_step(
    runs: dict[tuple[str, int, CapacityAdmission], LoopRun],
) -> None:
    for (name, c, a), run in runs.items():
        assert run.samples, (name, c, a)
        for s in run.samples:
            assert s.used_blocks == s.estimate_blocks, (name, c, a, s)
            # At the KV length now the pool holds the same or more: a window group
            # releases its out-of-window blocks at the request's next allocation.
            assert s.used_blocks >= s.estimate_now_blocks, (name, c, a, s)
        f = run.figures
        assert f.gap.max_gap == f.gap.min_gap == 0
        if name == "dense":
            assert f.gap_now.max_gap == 0
        else:
            assert f.gap_now.max_gap > 0 and f.gap_now.mean_gap > 0
    assert any(r.figures.preemptions for r in runs.values()), "no preemption was checked"


def test_a_probe_of_the_wrong_layout_sees_a_gap() -> None:
    """The comparison can fail: a hybrid pool counted as dense disagrees."""
    hybrid = LAYOUTS[2]
    scheduler = Scheduler(TINY.config(hybrid, TINY.capacity_budget))
    probe = BlockProbe(scheduler, DENSE)
    simulate(scheduler, TINY.requests(512, [0.0, 0.0]), TINY.cost, on_step=probe)
    assert any(s.used_blocks != s.estimate_blocks for s in probe.samples)


def test_on_step_is_told_every_step_after_its_commit() -> None:
    scheduler = Scheduler(TINY.config(DENSE, 256))
    seen: list[int] = []

    def observe(record: object) -> None:
        seen.append(scheduler.step_index)

    result = simulate(scheduler, TINY.requests(64, [0.0, 5.0, 9.0]), TINY.cost, on_step=observe)
    assert len(seen) == result.num_steps > 0
    assert seen == list(range(1, result.num_steps + 1))  # the step was committed


def test_reserve_peaks_admits_while_the_peaks_fit() -> None:
    layout = LAYOUTS[1]
    policy = ReservePeaks(layout, num_blocks=3 * 39, block_size=16)
    stop = StopParams(max_tokens=32, ignore_eos=True)
    reqs = [Request(f"r{i}", [1] * 512, stop) for i in range(4)]
    assert policy.peak_of(reqs[0]) == layout.peak(544, 16) == 39
    assert policy.may_admit(reqs[2], reqs[:2])
    assert not policy.may_admit(reqs[3], reqs[:3])


# ------------------------------------------------------------------------ goodput
def test_goodput_runs_share_arrivals_and_the_hybrids_are_not_worse_at_long_context() -> None:
    slo = default_slo(TINY)
    c = max(TINY.contexts)
    first = [r.arrival_ms for r in run_goodput(TINY, LAYOUTS[0], c).requests]
    assert first == [r.arrival_ms for r in run_goodput(TINY, LAYOUTS[2], c).requests]
    points = with_ratios([goodput_point(TINY, slo, x, c) for x in LAYOUTS], "dense")
    assert points[0].goodput_ratio == 1.0
    for p in points:
        assert p.num_finished == p.num_requests == TINY.goodput_requests
        assert 0 <= p.goodput_rps <= p.rate_rps
        assert p.goodput_rps == pytest.approx(p.slo_attainment * p.rate_rps)
    assert points[2].goodput_rps >= points[0].goodput_rps


def test_ratios_are_none_without_baseline_goodput() -> None:
    slo = Slo(0.0, 0.0, 1e-9)  # nothing meets it
    points = with_ratios([goodput_point(TINY, slo, x, 64) for x in LAYOUTS[:2]], "dense")
    assert [p.goodput_ratio for p in points] == [None, None]


# ------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: KVLayout("", "x", (), 1), "name"),
        (lambda: KVLayout("a,b", "x", (), 1), "name"),
        (lambda: KVLayout("w", "x", (KVGroup(GroupKind.WINDOW, 8),), 1), "first group"),
        (lambda: KVLayout("w", "x", [FULL], 1), "kv_groups"),  # type: ignore[arg-type]
        (lambda: KVLayout("w", "x", (), 0), "blocks_multiplier"),
        (lambda: KVLayout("w", "x", (), True), "blocks_multiplier"),
        (lambda: hybrid_layout(0, 64), "windows"),
        (lambda: hybrid_layout(1, 0), "window"),
        (lambda: compressed_layout(1, 64), "ratio"),
        (lambda: compressed_layout(4, 0), "window"),
        (lambda: dataclasses.replace(TINY, layouts=()), "layouts"),
        (lambda: dataclasses.replace(TINY, layouts=(DENSE, DENSE)), "twice"),
        (lambda: dataclasses.replace(TINY, contexts=()), "contexts"),
        (lambda: dataclasses.replace(TINY, contexts=(64, 64)), "twice"),
        (lambda: dataclasses.replace(TINY, contexts=(0,)), "contexts"),
        (lambda: dataclasses.replace(TINY, contexts=(4096,)), "dense_blocks"),
        (lambda: dataclasses.replace(TINY, layouts=(ODD,), contexts=(1400,)), "chunk"),
        (lambda: dataclasses.replace(TINY, output_len=0), "output_len"),
        (lambda: dataclasses.replace(TINY, goodput_requests=0), "goodput_requests"),
        (lambda: dataclasses.replace(TINY, load=0.0), "load"),
        (lambda: dataclasses.replace(TINY, load=float("nan")), "load"),
        (lambda: dataclasses.replace(TINY, cost=StepCost(1, 0, 1)), "cost"),
        (lambda: dataclasses.replace(TINY, dense_blocks=10**6, contexts=(16,)), "requests"),
        (lambda: run_capacity(TINY, hybrid_layout(2, 64), 64, "reserve-peak"), "layout"),
        (lambda: run_capacity(TINY, DENSE, 128, "reserve-peak"), "context"),
        (lambda: run_capacity(TINY, DENSE, 64, "nope"), "nope"),
        (lambda: KVLayoutsOptions(TINY, default_slo(TINY), Path("x"), ("dense", 99)), "trace"),
        (lambda: KVLayoutsOptions(TINY, Slo(0, 0, 0), Path("x")), "tbt_ms"),
        (lambda: render_markdown({}), "settings"),
        (lambda: render_markdown({"settings": []}), "settings"),
    ],
)
def test_bad_settings_are_typed_errors(build: object, words: str) -> None:
    assert callable(build)
    with pytest.raises(InvalidArgument, match=words):
        build()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--contexts", "a,b"], "--contexts"),
        (["--contexts", "0"], "--contexts"),
        (["--layouts", "dense,nope"], "unknown layout nope"),
        (["--layouts", ""], "--layouts"),
        (["--load", "0"], "--load"),
        (["--load", "inf"], "--load"),
        (["--window", "0"], "--window"),
        (["--ratio", "1"], "--ratio"),
        (["--output-len", "0"], "output_len"),
        (["--cost", "2+xP"], "cost model"),
        (["--trace", "dense"], "--trace"),
        (["--trace", "dense@999"], "trace"),
        (["--tbt-slo-ms", "0"], "--tbt-slo-ms"),
        (["--goodput-requests", "100000"], "--goodput-requests"),
    ],
)
def test_bad_options_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    out = tmp_path / "r"
    assert main(["kv-layouts", *TINY_ARGS, *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("refserve: error: ") and words in err[0], err
    assert not (out / "report.json").exists()


def test_bad_option_value_type_is_refused_before_anything_runs(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["kv-layouts", *TINY_ARGS, "--out", str(afile)]) == 2


# ------------------------------------------------------------------------ the command
def test_the_command_writes_the_report_into_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    assert main(["kv-layouts", *TINY_ARGS, "--trace", "hybrid-1:1@512", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    md = (out / "report.md").read_text()
    assert md == render_markdown(report)
    assert report["command"] == (
        "refserve kv-layouts --contexts 64,512 --output-len 32 --window 64 --dense-blocks 96 "
        "--capacity-budget 512 --goodput-budget 256 --goodput-requests 12 "
        f"--trace hybrid-1:1@512 --no-engine --out {out.as_posix()}"
    )
    (source,) = report["sources"]
    assert source["name"] == "simulator"
    assert len(source["capacity"]) == len(source["goodput"]) == 2 * len(LAYOUTS)
    assert [r["layout"] for r in source["estimate"]] == [x.name for x in LAYOUTS]
    assert all(r["gap"]["max_gap"] == r["gap"]["min_gap"] == 0 for r in source["estimate"])
    trace = source["estimate_trace"]
    assert (trace["layout"], trace["context"]) == ("hybrid-1:1", 512)
    assert trace["used_blocks"] == trace["estimate_blocks"]
    for name in report["plots"].values():
        assert_png(out / name)
        assert f"]({name})" in md
    for p in source["capacity"]:
        assert p["reserve_peak"]["max_running"] <= p["bound"]
        assert f"| {p['context']:,} | {p['layout']} | {p['num_blocks']:,} |" in md
    # A second source renders as a section of its own, from its own tables only.
    engine = {"name": "engine", "description": "the real engine", "capacity": source["capacity"]}
    twice = render_markdown({**report, "sources": [source, engine]})
    assert "## Engine" in twice and twice.count("### Capacity") == 2
    assert twice.count("### Goodput") == 1
