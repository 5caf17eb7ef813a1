"""The real engine's part of ``refserve kv-layouts`` on a tiny configuration: a hybrid
Qwen2 (random weights, config embedded) on the plain pool of N blocks and on the
grouped pool of 2N. Capacity never passes the analytic bound, the hybrid layout holds
more at the longest prompt, the pool's used blocks equal the sum of ``layout_blocks``
on every step (with the engine's own step checks on), the two layouts give the same
greedy tokens (and a planted difference is caught), bad settings are typed errors, and
the command writes the engine's section, charts and JSON."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from refserve.cli.main import main
from refserve.errors import InvalidArgument
from refserve.model.config import SLIDING_ATTENTION, kv_groups, layer_groups
from refserve.model.tokenizer import ByteTokenizer
from refserve.report.kv_layouts_engine import (
    EngineExperiment,
    EngineRun,
    OutputsDiffer,
    build_model,
    check_outputs,
    run_engine_capacity,
)
from refserve.report.kv_layouts_markdown import render_markdown
from refserve.report.kv_layouts_report import KVLayoutsOptions, default_slo
from refserve.sim.kv_layouts import DENSE, LayoutExperiment, hybrid_layout, standard_layouts
from tests.sim.test_compare import assert_png

TINY = EngineExperiment(contexts=(64, 256), dense_blocks=96, check_invariants=True)
SIM = LayoutExperiment(standard_layouts(64), contexts=(64,), output_len=16, dense_blocks=64)
# The CLI's spelling: the simulator's part as small as it goes, the engine's as TINY.
ARGS = (
    "--contexts=64",
    "--output-len=16",
    "--window=64",
    "--layouts=dense,hybrid-1:1",
    "--dense-blocks=64",
    "--capacity-budget=256",
    "--goodput-budget=256",
    "--goodput-requests=4",
    "--engine-contexts=64,256",
    "--engine-dense-blocks=96",
    "--quiet",
)


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[tuple[str, int], EngineRun]]:
    # One torch thread, as measure_engine runs it: two cores are shared.
    threads = torch.get_num_threads()
    torch.set_num_threads(TINY.threads)
    try:
        model = build_model(TINY)
        yield {
            (x.name, c): run_engine_capacity(TINY, x, c, model)
            for c in TINY.contexts
            for x in TINY.layouts
        }
    finally:
        torch.set_num_threads(threads)


def test_the_model_and_the_layouts() -> None:
    cfg = TINY.model_config()
    assert cfg.model_type == "qwen2" and cfg.num_layers == 4 and cfg.sliding_window == 32
    assert cfg.attention_kinds.count(SLIDING_ATTENTION) == 2  # 1:1
    tok = ByteTokenizer()  # the engine reads the prompts' ids and writes text through it
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id) == (
        tok.vocab_size,
        tok.bos_token_id,
        tok.eos_token_id,
    )
    assert layer_groups(cfg) == (1, 0, 1, 0)
    dense, hybrid = TINY.layouts
    assert dense is DENSE
    # The hybrid layout is the model's own: the engine takes it as grouped_kv=True does.
    assert hybrid == hybrid_layout(1, 32) and hybrid.kv_groups == kv_groups(cfg)
    assert [x.num_blocks(96) for x in TINY.layouts] == [96, 192]
    assert TINY.config(hybrid).num_blocks == 192 and TINY.config(dense).kv_groups == ()
    # Twice what the layout of most seats holds: memory limits both.
    assert TINY.num_requests(256) == 2 * TINY.sizes.bound(hybrid, 256) > 2
    prompts = TINY.prompts(64)
    assert len(prompts) == TINY.num_requests(64) and len({tuple(p) for p in prompts}) == len(
        prompts
    )


def test_capacity_never_passes_the_bound(runs: dict[tuple[str, int], EngineRun]) -> None:
    for (name, c), run in runs.items():
        layout = next(x for x in TINY.layouts if x.name == name)
        f = run.figures
        assert 1 <= f.max_running <= TINY.sizes.bound(layout, c), (name, c, f.max_running)
        assert 0 < f.mean_running <= f.max_running
        assert f.preemptions == 0
        assert run.wall_s > 0 and run.output_tokens == TINY.num_requests(c) * TINY.output_len
    # The memory, not the request count, held them back: some request waited.
    assert all(any(s.waiting for s in run.samples) for run in runs.values())


def test_the_hybrid_layout_holds_more_at_the_longest_prompt(
    runs: dict[tuple[str, int], EngineRun],
) -> None:
    c = max(TINY.contexts)
    dense, hybrid = (runs[(x.name, c)].figures.max_running for x in TINY.layouts)
    assert hybrid > dense, (dense, hybrid)


def test_the_estimate_is_the_pools_count_on_every_step(
    runs: dict[tuple[str, int], EngineRun],
) -> None:
    for (name, c), run in runs.items():
        assert run.samples and len(run.samples) == run.figures.num_steps
        for s in run.samples:
            assert s.used_blocks == s.estimate_blocks, (name, c, s)
            assert s.used_blocks >= s.estimate_now_blocks, (name, c, s)
        assert run.figures.gap.max_gap == run.figures.gap.min_gap == 0
    # The window group gave blocks back while its requests ran: had it kept them, a
    # request would hold twice its full group's blocks and far fewer would fit.
    hybrid = TINY.layouts[1]
    kept_all = hybrid.num_blocks(TINY.dense_blocks) // (2 * DENSE.peak(256 + 16, 8))
    assert runs[(hybrid.name, 256)].figures.max_running > kept_all


def test_both_layouts_give_the_same_greedy_tokens(runs: dict[tuple[str, int], EngineRun]) -> None:
    for c in TINY.contexts:
        pair = [runs[(x.name, c)] for x in TINY.layouts]
        assert check_outputs(pair) == TINY.num_requests(c)
        assert pair[0].outputs == pair[1].outputs
        assert all(len(t) == TINY.output_len for t in pair[0].outputs)
        assert len(set(pair[0].outputs)) > 1  # distinct prompts, not one answer repeated


def test_a_changed_token_is_caught(runs: dict[tuple[str, int], EngineRun]) -> None:
    dense, hybrid = (runs[(x.name, 64)] for x in TINY.layouts)
    first = hybrid.outputs[3]
    changed = (*hybrid.outputs[:3], ((first[0] + 1) % 256, *first[1:]), *hybrid.outputs[4:])
    with pytest.raises(OutputsDiffer, match="request 3 of context 64: hybrid-1:1"):
        check_outputs([dense, dataclasses.replace(hybrid, outputs=changed)])


def test_the_hybrid_runs_on_the_grouped_pool(runs: dict[tuple[str, int], EngineRun]) -> None:
    for (name, _), run in runs.items():
        assert run.grouped is (name == "hybrid-1:1"), name
    # Each layer keeps a tensor of all the pool's blocks: twice the blocks, twice the bytes.
    assert runs[("hybrid-1:1", 64)].kv_bytes == 2 * runs[("dense", 64)].kv_bytes


def test_the_report_loads_the_engine_only_when_it_runs() -> None:
    """docs/ARCHITECTURE.md: the report imports the engine for this part alone; a fresh
    interpreter that loads the report and its command has no engine and no torch."""
    code = (
        "import sys, refserve.report.kv_layouts_report, refserve.cli.kv_layouts\n"
        "print(' '.join(m for m in sys.modules if m.split('.')[0] == 'torch' "
        "or m.startswith('refserve.engine')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == []


# ------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: EngineExperiment(num_layers=3), "even"),
        (lambda: EngineExperiment(num_layers=0), "num_layers"),
        (lambda: EngineExperiment(window=0), "window"),
        (lambda: EngineExperiment(threads=0), "threads"),
        (lambda: EngineExperiment(check_invariants="yes"), "check_invariants"),  # type: ignore[arg-type]
        (lambda: EngineExperiment(contexts=(9000,)), "at most 8192"),
        (lambda: EngineExperiment(contexts=()), "contexts"),
        (lambda: EngineExperiment(dense_blocks=8), "raise dense_blocks"),
        (lambda: EngineExperiment(dense_blocks=100_000, contexts=(8,)), "requests"),
        (lambda: run_engine_capacity(TINY, hybrid_layout(2, 32), 64, "tiny"), "layout"),
        (lambda: run_engine_capacity(TINY, DENSE, 128, "tiny"), "context"),
        (
            lambda: KVLayoutsOptions(SIM, default_slo(SIM), Path("x"), engine="yes"),  # type: ignore[arg-type]
            "engine",
        ),
    ],
)
def test_bad_settings_are_typed_errors(build: object, words: str) -> None:
    assert callable(build)
    with pytest.raises(InvalidArgument, match=words):
        build()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--engine-contexts", "99999"], "at most 8192"),
        (["--engine-contexts", "x"], "--engine-contexts"),
        (["--engine-window", "0"], "window"),
        (["--engine-threads", "0"], "threads"),
        (["--engine-dense-blocks", "4"], "raise dense_blocks"),
        (["--no-engine", "--engine-window", "16"], "--no-engine"),
    ],
)
def test_bad_engine_options_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    out = tmp_path / "r"
    assert main(["kv-layouts", *ARGS, *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("refserve: error: ") and words in err[0], err
    assert not (out / "report.json").exists()


# ------------------------------------------------------------------------ the command
def test_the_command_writes_the_engines_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    assert main(["kv-layouts", *ARGS, "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    md = (out / "report.md").read_text()
    assert md == render_markdown(report)
    assert report["command"] == (
        "refserve kv-layouts --contexts 64 --output-len 16 --window 64 --layouts "
        "dense,hybrid-1:1 --dense-blocks 64 --capacity-budget 256 --goodput-budget 256 "
        f"--goodput-requests 4 --engine-contexts 64,256 --engine-dense-blocks 96 --out {out}"
    )
    sim, engine = report["sources"]
    assert sim["name"] == "simulator" and engine["kind"] == "engine"
    s = engine["settings"]
    assert (s["device"], s["torch_threads"], s["dense_blocks"]) == ("cpu", 1, 96)
    assert s["model"]["sliding_layers"] * 2 == s["model"]["num_layers"]
    assert [x["num_blocks"] for x in engine["layouts"]] == [96, 192]
    points = engine["capacity"]
    assert len(points) == 4
    for p in points:
        assert p["reserve_peak"]["max_running"] <= p["bound"]
        assert p["output_tokens_per_s"] > 0
        assert f"| {p['context']:,} | {p['layout']} | {p['num_requests']} |" in md
    assert points[0]["throughput_ratio"] == 1.0
    assert all(r["gap"]["max_gap"] == r["gap"]["min_gap"] == 0 for r in engine["estimate"])
    compared = sum(TINY.num_requests(c) for c in TINY.contexts)
    assert engine["outputs"] == {"requests_compared": compared, "identical": True}
    assert "## Real engine" in md and "not a GPU figure" in md and "CPU" in md
    assert md.count("### Capacity") == 2 and md.count("### Goodput") == 1
    for name in report["plots"].values():
        assert_png(out / name)
        assert f"]({name})" in md
    assert set(report["plots"]) >= {"engine_capacity", "engine_throughput"}
