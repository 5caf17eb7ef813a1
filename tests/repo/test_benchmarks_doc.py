"""docs/BENCHMARKS.md is generated from the benchmarks' JSON, never typed.

The committed document must equal what ``refserve.conformance.bench.report`` renders from the
committed inputs in docs/bench/ (``make bench`` and ``make bench-peers`` refresh both);
a hand edit of either side, or a JSON refreshed without regenerating, fails here. The
renderer itself is checked on small hand-made JSON documents of every kind it reads.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from refserve.conformance.bench import migration, report
from refserve.conformance.bench.results import Cell, PoolCell, Run

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "BENCHMARKS.md"
INPUTS = sorted((ROOT / "docs" / "bench").glob("*.json"))

MACHINE = {
    "cpu_model": "Test CPU 9000",
    "cores": 2,
    "load_average": [0.5, 0.25, 0.12],
    "platform": "Linux-test",
    "python": "3.11.7",
    "torch": "2.13.0+cpu",
}


def _committed() -> list[tuple[str, dict[str, Any]]]:
    return report.load(INPUTS, lambda line: pytest.fail(f"docs/bench/ holds a stray file: {line}"))


def test_the_committed_document_is_what_the_committed_json_renders() -> None:
    assert INPUTS, "docs/bench/ holds no benchmark JSON"
    kinds = {report.kind_of(doc) for _, doc in _committed()}
    assert {"step", "memory"} <= kinds  # what `make bench` always writes
    rendered = report.render(_committed(), "docs/BENCHMARKS.md")
    assert DOC.read_text(encoding="utf-8") == rendered, (
        "docs/BENCHMARKS.md is stale or was edited by hand: run `make bench-report` "
        "(python -m refserve.conformance.bench.report --out docs/BENCHMARKS.md docs/bench/*.json)"
    )


def test_a_refreshed_json_makes_the_committed_document_stale() -> None:
    """The check above can fail: one changed figure in one input changes the text."""
    inputs = copy.deepcopy(_committed())
    name, mem = next((n, d) for n, d in inputs if report.kind_of(d) == "memory")
    mem["figures"][0]["heap_bytes_per_request"] = 123_456_789
    rendered = report.render(inputs, "docs/BENCHMARKS.md")
    assert rendered != DOC.read_text(encoding="utf-8")
    assert "123,456,789 B" in rendered and name.startswith("docs/bench/")


# --------------------------------------------------------------------- fixtures
def _step_run(engines: dict[str, str]) -> dict[str, Any]:
    """A bench-peers JSON: refserve 2 us per request at N = 4 (the median of three rounds
    of 4, 8 and 12 us, phases 1:3), every other engine 5x that, caching off only."""
    cells = []
    for e in engines:
        scale = 1 if e == "ref" else 5
        rounds = [
            [2_000 * scale, 6_000 * scale],
            [1_000 * scale, 3_000 * scale],
            [3_000 * scale, 9_000 * scale],
        ]
        cells.append(Cell(e, 4, False, times_ns=rounds))
    run = Run(
        command="python -m refserve.conformance.bench.peers --fixture",
        sizes=[4],
        rounds=3,
        warmup=1,
        engines={
            e: {"name": n, "includes": f"{n}'s step", "phases": ["a", "b"]}
            for e, n in engines.items()
        },
        cells=cells,
        started="2026-01-02 03:04 UTC",
        load_before=[0.5, 0.25, 0.12],
        load_after=[1.5, 0.5, 0.25],
        cpus=2,
        pinned_cpu=1,
        parts=("steps",),
        machine=MACHINE,
    )
    return run.to_json()


MEMORY = {
    "format": "refserve-bench-memory",
    "version": 1,
    "command": "python -m refserve.conformance.bench.memory --fixture",
    "when": "2026-01-02 03:05 UTC",
    "machine": MACHINE,
    "load_after": [0.75, 0.3, 0.1],
    "workload": {"block_size": 16, "prompt_tokens": [100, 128], "blocks_per_request": 16},
    "figures": [
        {"n": 1024, "heap_bytes_per_request": 10168, "step_bytes_per_request": 213},
        {"n": 16384, "heap_bytes_per_request": 10204, "step_bytes_per_request": 209},
    ],
}

PYTEST = {
    "machine_info": {"processor": "x86_64", "python_version": "3.11.7", "cpu": {"count": 2}},
    "commit_info": {},
    "datetime": "2026-01-02T03:06:07.000+00:00",
    "version": "5.3.1",
    "benchmarks": [
        {
            "group": "allocate+free K=32 blocks (no cache)",
            "name": "test_allocate_free[nocache-1000]",
            "fullname": "tests/bench/test_pool_bench.py::test_allocate_free[nocache-1000]",
            "extra_info": {"pool_blocks": 1000, "blocks_per_round": 32},
            "stats": {"median": 9.94e-6, "min": 9.4e-6, "mean": 1.76e-5, "rounds": 2000},
        },
        {
            "group": None,
            "name": "test_engine[continuous]",
            "fullname": "tests/bench/test_engine_bench.py::test_engine[continuous]",
            "extra_info": {},
            "stats": {"median": 1.5, "min": 1.25, "mean": 2.0, "rounds": 3},
        },
    ],
    "refserve": {
        "command": "python -m pytest tests/bench --benchmark-only",
        "machine": MACHINE,
        "load_after": [2.0, 1.0, 0.5],
    },
}


def _rendered(*docs: tuple[str, dict[str, Any]]) -> str:
    return report.render(list(docs), "docs/BENCHMARKS.md")


def test_the_step_table_carries_figures_ratios_command_and_machine() -> None:
    md = _rendered(("s.json", _step_run({"ref": "refserve", "ref-loop": "refserve, loop"})))
    assert "## refserve's step: the bulk path against the reference loop" in md
    assert "| refserve | off | 2.0 us | n/a |" in md  # one size: no growth
    assert "| refserve | on | n/a | n/a |" in md  # never measured
    assert "| refserve, loop | off | 10.0 us (5.0x) | n/a |" in md
    assert "| refserve | off | 4 | a 0.50 us, b 1.5 us |" in md
    assert "| refserve, loop | off | 4 | a 2.5 us, b 7.5 us |" in md
    assert (
        "Command: `python -m refserve.conformance.bench.peers --fixture`, run 2026-01-02 03:04 UTC."
        in md
    )
    assert (
        "Machine: Test CPU 9000, 2 cores, load average (1 / 5 / 15 min) 0.50 / 0.25 / 0.12 "
        "at the start; Linux-test, Python 3.11.7, torch 2.13.0+cpu." in md
    )
    assert "Load average 1.50 / 0.50 / 0.25 at the end. Every worker pinned to CPU 1" in md
    assert "### Scheduler step" in md and "### Block pool" not in md  # --only steps


def test_a_run_with_other_engines_is_the_side_by_side_section() -> None:
    doc = _step_run({"ref": "refserve", "vllm": "vLLM 0.33.0"})
    pool = PoolCell("ref", 32, False, times_ns=[[3_200], [6_400], [3_200]])
    run = Run.from_json(doc)
    run.parts, run.pool_cells = ("steps", "pool"), [pool]
    md = _rendered(("p.json", run.to_json()))
    assert "## refserve, nano-vllm-fork and vLLM side by side" in md
    assert "| vLLM 0.33.0 | off | 10.0 us (5.0x) | n/a |" in md
    assert "- vLLM 0.33.0: vLLM 0.33.0's step" in md
    assert "### Block pool (allocate + free)" in md and "| refserve | 0.100 us |" in md
    assert "Not measured for this file" in md and "side by side (`make bench-peers`)" not in md


def test_the_memory_table() -> None:
    md = _rendered(("m.json", MEMORY))
    assert "| 1024 | 10,168 B | 213 B |" in md and "| 16384 | 10,204 B | 209 B |" in md
    assert (
        "Command: `python -m refserve.conformance.bench.memory --fixture`, run 2026-01-02 03:05"
        in md
    )
    assert "Load average 0.75 / 0.30 / 0.10 at the end." in md
    assert "prompts of 100-128 tokens, 16 blocks of pool per request" in md


GPU_ROW = {
    "kind": "decode", "context": 4096, "batch": 64, "dtype": "float16", "time_us": 489.28,
    "bytes_moved": 1074790400, "bandwidth_gbs": 2196.7, "fraction_of_copy": 0.531,
    "sdpa_time_us": 278.88, "ratio_to_sdpa": 1.754, "flashinfer_time_us": None,
    "ratio_to_flashinfer": None, "max_abs_err_first_seq": 6.1e-05,
    "note": "flashinfer not installed",
}  # fmt: skip
GPU = {
    "format": "refserve-gpu-bench", "command": "python -m refserve.kernels.bench --json g.json",
    "when": "2026-01-02 03:04 UTC", "device": "Test GPU 9000", "torch": "2.11.0",
    "triton": "3.6.0", "python": "3.12.3", "copy_bandwidth_gbs": 4134.4, "wall_s": 20.0,
    "shape": {"num_q_heads": 32, "num_kv_heads": 8, "head_size": 128, "block_size": 16,
              "chunk": 512},
    "rows": [GPU_ROW, {**GPU_ROW, "kind": "mixed", "sdpa_time_us": None,
                       "ratio_to_sdpa": None, "note": None}],
}  # fmt: skip


def test_the_gpu_table_carries_device_command_and_ratio_to_sdpa() -> None:
    assert report.kind_of(GPU) == "gpu"
    md = _rendered(("g.json", GPU))
    assert "## Paged attention on a GPU" in md
    assert (
        "Command: `python -m refserve.kernels.bench --json g.json`, run 2026-01-02 03:04 UTC." in md
    )
    assert "Device: Test GPU 9000, torch 2.11.0, Triton 3.6.0" in md and "4134.4 GB/s" in md
    assert "| decode | 4,096 | 64 | float16 | 489 us | 2,197 | 53% | 279 us | [1.75x] |" in md
    assert "| mixed | 4,096 | 64 | float16 | 489 us | 2,197 | 53% | n/a | n/a |" in md
    assert "Note: flashinfer not installed." in md and "Provenance" not in md
    hand = _rendered(("g.json", {**GPU, "provenance_note": "added later"}))
    assert "Provenance: added later." in hand


def test_the_pytest_benchmark_tables_group_by_group_or_module() -> None:
    md = _rendered(("b.json", PYTEST))
    assert "**allocate+free K=32 blocks (no cache)**" in md
    assert (
        "| `test_allocate_free[nocache-1000]` | 9.94 us | 9.4 us | 17.6 us | 2000 | "
        "pool_blocks = 1000; blocks_per_round = 32 |" in md
    )
    assert "**tests/bench/test_engine_bench.py**" in md  # no group: the module
    assert "| `test_engine[continuous]` | 1.5 s | 1.25 s | 2 s | 3 |  |" in md
    assert (
        "Command: `python -m pytest tests/bench --benchmark-only`, run 2026-01-02 03:06 UTC" in md
    )
    assert "Test CPU 9000" in md  # tests/bench/conftest.py's record, not pytest-benchmark's


def test_a_pytest_benchmark_json_without_our_record_still_names_its_machine() -> None:
    bare = {k: v for k, v in PYTEST.items() if k != "refserve"}
    md = _rendered(("b.json", bare))
    assert "Machine: x86_64, 2 cores, load average (1 / 5 / 15 min) not recorded" in md
    assert "(command not recorded)" in md


def _migration_doc() -> dict[str, Any]:
    """A migration bench JSON: transfer 1 ms + 1 us per token, recompute 0.1 ms + 10 us
    per token (each the median of three rounds), so the lines cross at 100 tokens."""
    lengths = (16, 64, 256, 1024)
    transfer = {n: [1e-3 + n * 1e-6 + d for d in (-1e-5, 0.0, 2e-5)] for n in lengths}
    recompute = {n: [1e-4 + n * 1e-5 + d for d in (0.0, 3e-5, -1e-5)] for n in lengths}
    info = migration.summarise(transfer, recompute, block_size=16, kv_bytes_per_token=512)
    bench = {
        "group": None,
        "name": "test_transfer_against_recompute",
        "fullname": "tests/bench/test_migration_bench.py::test_transfer_against_recompute",
        "extra_info": info,
        "stats": {"median": 2.0, "min": 2.0, "mean": 2.0, "rounds": 1},
    }
    return {**PYTEST, "benchmarks": [bench]}


def test_the_migration_table_and_its_break_even() -> None:
    doc = _migration_doc()
    assert report.kind_of(doc) == "migration"
    md = _rendered(("m.json", doc))
    assert "## Migration: sending the K/V against recomputing it" in md
    assert "Blocks of 16 tokens, 512 bytes of K/V per token." in md
    # 256 tokens: 1.256 ms against 2.66 ms, 16 blocks.
    assert "| 256 | 16 | 1.26 ms | 78.5 us | 2.66 ms | 0.47 | 3 |" in md
    assert "| 16 | 1 | 1.02 ms | 1.02 ms | 0.26 ms | 3.91 | 3 |" in md
    assert "sending is faster from 256 tokens of context on" in md
    assert "the two medians cross at about 100 tokens" in md
    # Less the step's fixed cost (0.26 ms at 16 tokens), recompute crosses later.
    assert "sending is faster from about 128.9 tokens on." in md
    assert "One block more sent costs 16 us" in md
    # One migration benchmark among others is the suites' section, not this one.
    mixed = {**PYTEST, "benchmarks": [*PYTEST["benchmarks"], *doc["benchmarks"]]}
    assert report.kind_of(mixed) == "pytest"


def test_the_break_even_when_sending_never_or_always_wins() -> None:
    lengths = (16, 64)
    recompute = {n: [1e-5 * n] for n in lengths}
    for factor, below, words in (
        (2.0, False, "sending is slower at every measured length, up to 64 tokens"),
        (0.5, True, "sending is faster at every measured length, down to 16 tokens"),
    ):
        transfer = {n: [factor * 1e-5 * n] for n in lengths}
        info = migration.summarise(transfer, recompute, block_size=16, kv_bytes_per_token=512)
        be = info["breakeven"]
        assert be["measured_tokens"] == (16 if below else None)
        assert be["interpolated_tokens"] is None and be["below"] is below
        assert words in "\n".join(migration.table(info))


def test_the_header_says_generated_by_what_and_sections_come_in_a_fixed_order() -> None:
    step = _step_run({"ref": "refserve", "ref-loop": "loop"})
    md = report.render([("z/m.json", MEMORY), ("a/b.json", PYTEST), ("y/s.json", step)], "X.md")
    assert md.startswith("# Benchmarks\n")
    assert (
        "**Generated** by `python -m refserve.conformance.bench.report --out X.md a/b.json "
        "y/s.json z/m.json` from the benchmarks' own JSON; do not edit it by hand." in md
    )
    titles = re.findall(r"^## (.*)$", md, re.M)
    assert titles == [
        "refserve's step: the bulk path against the reference loop",
        "Python heap per running request",
        "pytest-benchmark suites (`tests/bench/`)",
    ]
    assert "- refserve, nano-vllm-fork and vLLM side by side (`make bench-peers`)" in md
    # The contents links resolve to the headings (GitHub's slugs).
    for anchor in re.findall(r"\]\(#([\w-]+)\)", md):
        assert anchor in {report._slug(t) for t in titles}


def test_the_command_skips_other_json_and_refuses_nothing_to_render(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "conformance.json"
    other.write_text(json.dumps({"format": "refserve-conformance", "results": []}))
    mem = tmp_path / "bench-memory.json"
    mem.write_text(json.dumps(MEMORY))
    out = tmp_path / "doc" / "B.md"
    assert report.main(["--out", str(out), str(other), str(mem)]) == 0
    assert f"report: skipped {other}: not a benchmark JSON" in capsys.readouterr().err
    assert "| 1024 | 10,168 B | 213 B |" in out.read_text()
    before = out.read_text()
    assert report.main(["--out", str(out), str(other)]) == 2
    assert "no benchmark JSON among the inputs" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**MEMORY, "figures": [{"n": 1}]}))
    assert report.main(["--out", str(out), str(broken)]) == 2
    assert capsys.readouterr().err.startswith("report: error: ")
    assert out.read_text() == before  # a failed run leaves the old document
    # A device or a directory is refused before the rename could replace it.
    assert report.main(["--out", os.devnull, str(mem)]) == 2
    assert "exists and is not a regular file" in capsys.readouterr().err
    assert not Path(os.devnull).is_file()
    assert report.main(["--out", str(tmp_path), str(mem)]) == 2


def test_make_bench_and_bench_peers_end_by_regenerating_the_document() -> None:
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    report_line = re.search(r"^BENCH_REPORT = (.*)$", make, re.M)
    assert report_line is not None
    assert report_line.group(1).endswith(
        "-m refserve.conformance.bench.report --out docs/BENCHMARKS.md docs/bench/*.json"
    )
    for target, copied in (
        (
            "bench",
            "out/bench-pytest.json out/bench-migration.json out/bench-step.json "
            "out/bench-memory.json",
        ),
        ("bench-peers", "out/bench-peers.json"),
    ):
        recipe = re.search(rf"^{target}:.*\n((?:\t.*\n|.*\\\n)+)", make, re.M)
        assert recipe is not None, target
        lines = [ln.strip() for ln in recipe.group(1).splitlines()]
        assert lines[-1] == "$(BENCH_REPORT)", target
        assert lines[-2] == f"cp {copied} docs/bench/", target
    assert "--benchmark-json out/bench-pytest.json" in make
    # The migration bench has a JSON and a table of its own, so the suite run skips it.
    assert "--ignore=tests/bench/test_migration_bench.py" in make
    assert "tests/bench/test_migration_bench.py --benchmark-only" in make
    assert "--benchmark-json out/bench-migration.json" in make


SIMFIT_FIT = {
    "cost_ms": {"a": 0.5, "b": 0.07, "c": 2.8, "e": 0.0, "f": 9.5, "g": 2.5},
    "num_steps": 1800, "r_squared": 0.21, "replicas": 1, "router": None,
    "terms": [
        {"name": "a", "meaning": "every step", "value_ms": 0.5, "stderr_ms": 0.1,
         "r2_drop": 0.01},
        {"name": "gap", "meaning": "the loop after a step", "value_ms": 2.5,
         "stderr_ms": 0.05, "r2_drop": None},
    ],
    "noise_factors": [1.0],
    "overheads": [{"name": "transport", "meaning": "HTTP", "p50_ms": 5.5, "p90_ms": 20.25,
                   "num_requests": 240}],
    "comparisons": [
        {"metric": "TTFT P50", "measured": 30.0, "simulated": 27.0, "unit": "ms",
         "measured_lo": 28.0, "measured_hi": 33.0, "error": -0.1},
        {"metric": "goodput", "measured": 3.9, "simulated": 3.95, "unit": "req/s",
         "measured_lo": 3.8, "measured_hi": 4.0, "error": 0.0128},
    ],
}  # fmt: skip
SIMFIT = {
    "format": "refserve-bench-simfit", "version": 1,
    "command": "python -m refserve.conformance.bench.simfit --json s.json",
    "when": "2026-01-02 03:04 UTC", "machine": MACHINE, "load_after": [6.5, 6.0, 5.5],
    "workload": {"model": "tiny-trained", "trace": "chat", "rate": 4.0, "duration_s": 60.0,
                 "seed": 0, "slo_ttft_ms": 100.0, "slo_tpot_ms": 20.0},
    "runs": [
        {"replicas": 1, "summary": {"num_ok": 240, "num_requests": 240, "duration_s": 60.2},
         "fit": SIMFIT_FIT},
        {"replicas": 2, "summary": {"num_ok": 239, "num_requests": 240, "duration_s": 60.1},
         "fit": {**SIMFIT_FIT, "replicas": 2, "router": "prefix_aware"}},
    ],
}  # fmt: skip


def test_the_simulator_fit_table_per_replica_count() -> None:
    assert report.kind_of(SIMFIT) == "simfit"
    md = _rendered(("s.json", SIMFIT))
    assert "## The simulator against the server it was fitted to" in md
    assert "Command: `python -m refserve.conformance.bench.simfit --json s.json`" in md
    assert "Load average 6.50 / 6.00 / 5.50 at the end." in md
    assert "Trace `chat` at 4 requests/s for 60 s (seed 0)" in md
    assert "TTFT <= 100 ms and TPOT <= 20 ms" in md
    row = "| TTFT P50 (ms) | 30.0 (28.0-33.0) / 27.0 / -10% | 30.0 (28.0-33.0) / 27.0 / -10% |"
    assert row in md
    assert "| goodput (req/s) | 3.90 (3.80-4.00) / 3.95 / +1% |" in md
    assert "- 1 replica(s): 240 of 240 requests ok over 60.2 s; 1800 steps fitted" in md
    assert "a 0.500 ± 0.100 (R1 -0.010 without), gap 2.500 ± 0.050;" in md
    assert "2 replica(s), router prefix_aware: 239 of 240" in md
    assert "transport 5.50/20.25." in md


SOAK_POOL = {"num_blocks": 64, "free_blocks": 64, "live_requests": [], "tables": 0,
             "violations": [], "rss_bytes": 300 << 20, "pid": 7}  # fmt: skip
SOAK = {
    "format": "refserve-soak", "command": "python -m refserve.conformance.bench.soak --duration 60",
    "when": "2026-01-02 03:04 UTC", "machine": MACHINE, "load_after": [1.5, 1.0, 0.5],
    "backend": "inprocess", "note": "a fixture",
    "settings": {"duration_s": 60.0, "rate_rps": 3.0, "seed": 4, "kill_every_s": 20.0,
                 "replicas": 2, "max_tokens": [16, 160], "error_budget": 0.05,
                 "slo_e2e_s": 10.0, "rss_bound_mib": 64.0, "warmup_fraction": 0.25},
    "summary": {
        "requests": 180, "kinds": {"stream": 80, "plain": 40, "disconnect": 20, "abort": 20,
                                   "bad": 20},
        "ends": {"ok": 130, "error": 4, "left": 26, "refused": 20, "broken": 0},
        "errors": {"503 service_unavailable": 4}, "wall_s": 60.0, "throughput_rps": 3.0,
        "tokens_per_s": 150.5, "goodput_rps": 2.1, "ok_e2e_p50_s": 0.7, "ok_e2e_p99_s": 2.5,
        "error_rate": 0.0299, "error_budget_used": 0.597, "kills_sent": 3,
        "server": {"replica_deaths_total": 3.0, "replica_restarts_total": 3.0,
                   "replica_failed_requests_total": 4.0,
                   "replica_restarted_requests_total": 1.0, "aborted_requests": 25.0},
        "rss_growth_mib": {"7": 12.5}, "rss_peak_mib": 310.0,
        "final_pools": [{"replica": 0, "alive": True, "restarts": 2, "report": SOAK_POOL},
                        {"replica": 1, "alive": False, "restarts": 1, "report": None}],
    },
    "failures": [], "passed": True, "rss_samples": [],
}  # fmt: skip


def test_the_soak_section_carries_its_promises_and_figures() -> None:
    md = _rendered(("docs/bench/soak.json", SOAK))
    assert "## Soak: the served cluster under faults" in md
    assert (
        "Command: `python -m refserve.conformance.bench.soak --duration 60`, run 2026-01-02 03:04"
        in md
    )
    assert "60 s of open-loop load at 3 requests/s (seed 4)" in md and "Note: a fixture." in md
    assert "**Passed**." in md
    assert "| goodput | 2.1 requests/s (a result within 10 s) |" in md
    assert "| error budget used | 59.7% (errors 3.0% of the requests kept; budget 5.0%) |" in md
    assert "3 kills; 3 deaths, 3 restarts, 4 requests failed with their replica" in md
    assert "growth after the warm-up (25.0% of the run) 12.5 MiB, bound 64 MiB" in md
    pools = "replica 0: 64 of 64 blocks free, 0 tables, 0 requests, 0 violations; replica 1: dead"
    assert pools in md
    failed = {**SOAK, "passed": False, "failures": ["pools: replica 0: [LEAK] x"]}
    assert "**FAILED**: pools: replica 0: [LEAK] x" in _rendered(("s.json", failed))


def test_make_soak_ends_by_regenerating_the_document() -> None:
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(r"^soak:.*\n((?:\t.*\n)+)", make, re.M)
    assert recipe is not None
    lines = [ln.strip() for ln in recipe.group(1).splitlines()]
    assert lines[-2:] == ["cp out/soak.json docs/bench/", "$(BENCH_REPORT)"]
    assert "-m refserve.conformance.bench.soak --duration $(SOAK_S)" in lines[-3]
