"""``make bench-peers``'s driver (conformance/bench/peers.py), its figures (results.py) and
its table (render.py), without the third-party venvs.

The figures, the ratios and the table are computed from hand-made rounds; the worker
protocol runs for real with refserve's worker (tiny N, two rounds); a missing venv, an
engine that cannot be imported, a worker that hangs or prints nonsense are each one
clear line, never a traceback.
"""

from __future__ import annotations

import io
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from refserve.conformance.bench import memory, peers
from refserve.conformance.bench.render import render_markdown
from refserve.conformance.bench.results import (
    Cell,
    PoolCell,
    Run,
    growth,
    per_request_us,
    phase_us,
    ratio,
)
from refserve.conformance.bench.worker import Unsupported, handle
from refserve.conformance.bench.workload import Shape, prompt, prompt_len, shapes


def _cell(engine: str, n: int, caching: bool, step_ns: list[int]) -> Cell:
    """Rounds whose phases sum to each of ``step_ns`` (split 1:3 over two phases)."""
    return Cell(engine, n, caching, times_ns=[[t // 4, t - t // 4] for t in step_ns])


def _run(cells: list[Cell]) -> Run:
    info = {"includes": "X", "phases": ["a", "b"]}
    return Run(
        command="cmd",
        sizes=[64, 1024],
        rounds=3,
        warmup=1,
        engines={
            "ref": {"name": "refserve", **info},
            "vllm": {"name": "vLLM 0.33.0", **info},
            "nanovllm": {"name": "nano", **info},
        },
        cells=cells,
        started="today",
        load_before=[1.0, 2.0, 3.0],
        load_after=[1.5, 2.0, 3.0],
        cpus=2,
    )


CELLS = [
    # refserve: 4 us per request at 64, 5 at 1024 (medians of 3 rounds; the outlier is out).
    _cell("ref", 64, False, [256_000, 250_000, 900_000]),
    _cell("ref", 1024, False, [5_120_000, 5_000_000, 5_200_000]),
    # vLLM: 16 us at 64 (4x), 20 us at 1024 (4x).
    _cell("vllm", 64, False, [1_024_000, 1_000_000, 1_100_000]),
    _cell("vllm", 1024, False, [20_480_000, 20_000_000, 21_000_000]),
    Cell("nanovllm", 64, False, status="unsupported", reason="always caches"),
    Cell("nanovllm", 1024, False, status="unsupported", reason="always caches"),
]


def test_the_figures_are_medians_per_request_and_ratios_to_refserve() -> None:
    assert per_request_us([[100_000, 156_000], [50_000, 200_000], [1, 899_999]], 64) == 4.0
    assert phase_us([[1_000, 3_000], [2_000, 2_000], [3_000, 1_000]], 1) == [2.0, 2.0]
    with pytest.raises(ValueError):
        per_request_us([], 64)
    assert ratio(CELLS, "vllm", 64, False) == pytest.approx(4.0)
    assert ratio(CELLS, "vllm", 1024, False) == pytest.approx(4.0)
    assert ratio(CELLS, "ref", 64, False) == pytest.approx(1.0)
    assert ratio(CELLS, "nanovllm", 64, False) is None  # unsupported: no figure
    assert ratio(CELLS, "vllm", 64, True) is None  # not measured at all
    assert growth(CELLS, "ref", False, [64, 1024]) == pytest.approx(5.0 / 4.0)
    assert growth(CELLS, "vllm", False, [1024, 64]) == pytest.approx(20.0 / 16.0)
    assert growth(CELLS, "vllm", False, [64]) is None


def test_the_table_shows_figures_ratios_growth_and_what_was_not_measured() -> None:
    md = render_markdown(_run(CELLS))
    assert "| engine | prefix caching | N = 64 | N = 1024 | growth N = 64 to 1024 |" in md
    assert "| refserve | off | 4.0 us | 5.0 us | 1.25x |" in md
    assert "| vLLM 0.33.0 | off | 16.0 us (4.0x) | 20.0 us (4.0x) | 1.25x |" in md
    assert "| nano | off | n/a (unsupported) | n/a (unsupported) | n/a |" in md
    assert "| refserve | on | n/a | n/a | n/a |" in md  # never asked for
    assert "- nano (unsupported): always caches" in md
    assert "load average (1 / 5 / 15 min) 1.00 / 2.00 / 3.00 before" in md
    assert "| vLLM 0.33.0 | off | 1024 | a 5.0 us, b 15.0 us |" in md
    data = _run(CELLS).to_json()
    vllm_1024 = next(c for c in data["cells"] if (c["engine"], c["n"]) == ("vllm", 1024))
    assert vllm_1024["us_per_request"] == 20.0 and vllm_1024["ratio_to_refserve"] == 4.0
    assert vllm_1024["phase_us_per_request"] == {"a": 5.0, "b": 15.0}
    assert data["growth_largest_over_smallest_n"]["vllm-nocache"] == 1.25
    assert json.loads(json.dumps(data)) == data


def test_a_run_renders_the_same_from_its_json() -> None:
    """docs/BENCHMARKS.md renders committed JSON (conformance/bench/report.py): the run
    read back from its JSON must give the table the run itself printed."""
    run = _run(CELLS)
    run.pool_cells = [PoolCell("ref", 32, False, times_ns=[[3_200], [6_400]])]
    back = Run.from_json(json.loads(json.dumps(run.to_json())))
    assert render_markdown(back) == render_markdown(run)
    assert back.to_json() == run.to_json()
    with pytest.raises(ValueError, match="not a bench-peers JSON"):
        Run.from_json({"format": "something else"})


def test_the_shared_workload() -> None:
    assert {prompt_len(i) for i in range(1024)} == set(range(100, 129))
    assert len({tuple(prompt(i)[:16]) for i in range(1024)}) == 1024  # no shared block
    assert [s.key for s in shapes((64, 1024))] == [
        "n64-nocache",
        "n64-cache",
        "n1024-nocache",
        "n1024-cache",
    ]
    assert Shape(1024, True).num_blocks == 1024 * 64
    assert Shape(1024, True).max_num_batched_tokens == 2048


class _Engine:
    name = "fake 1"
    includes = "nothing"
    phases = ("x",)

    def setup(self, shape: Shape) -> object:
        if not shape.prefix_caching:
            raise Unsupported("no switch")
        return shape.n

    def step(self, state: object) -> tuple[int, ...]:
        raise ZeroDivisionError("the engine's own bug")


def test_the_worker_answers_an_engine_failure_with_one_line() -> None:
    states: dict[str, object] = {}
    ok = handle(_Engine(), states, {"cmd": "setup", "n": 4, "prefix_caching": True})
    assert ok["ok"] and states == {"n4-cache": 4}
    assert handle(_Engine(), states, {"cmd": "setup", "n": 4, "prefix_caching": False}) == {
        "ok": False,
        "unsupported": "no switch",
    }
    bad = handle(_Engine(), states, {"cmd": "steps", "key": "n4-cache", "steps": 1})
    assert bad["ok"] is False
    assert bad["error"].startswith("raised ZeroDivisionError: the engine's own bug at ")
    assert handle(_Engine(), states, {"cmd": "nope"})["ok"] is False


def _fake_python(tmp_path: Path, body: str) -> str:
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_refserve_runs_and_a_missing_venv_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    code = peers.main(
        [
            *("--engines", "ref", "vllm", "nanovllm"),
            *("--python", f"vllm={tmp_path / 'no-venv' / 'bin' / 'python'}"),
            # refserve's venv has no nano-vllm: the worker starts but cannot import it.
            *("--python", f"nanovllm={sys.executable}"),
            *("--sizes", "4", "--rounds", "2", "--warmup", "1"),
            *("--json", str(out_json), "--markdown", str(out_md)),
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if "not run" in ln or "cannot start" in ln]
    assert lines[0] == (
        f"bench-peers: vllm: not run: {tmp_path / 'no-venv' / 'bin' / 'python'} not found "
        "(build the venv: make conformance-vllm)"
    )
    assert lines[1].startswith("bench-peers: nanovllm: cannot start: raised ModuleNotFoundError")
    assert "make conformance-nanovllm" in lines[1]
    data = json.loads(out_json.read_text())
    # The machine, recorded when the run started (conformance/bench/machine.py).
    assert set(data["machine"]) >= {"cpu_model", "cores", "load_average", "python", "torch"}
    assert data["machine"]["cores"] == os.cpu_count()
    ref = [c for c in data["cells"] if c["engine"] == "ref"]
    assert [c["status"] for c in ref] == ["ok", "ok"]
    assert all(c["us_per_request"] > 0 and len(c["times_ns"]) == 2 for c in ref)
    assert all(len(t) == 3 for c in ref for t in c["times_ns"])  # schedule, inputs, commit
    assert data["engines"]["ref"]["phases"] == ["schedule", "build_inputs", "commit"]
    md = out_md.read_text()
    assert "**not measured**: not run:" in md and "n/a (error)" in md


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("sleep 30", "no answer within 1 s (killed)"),
        ("echo hello", "not a protocol line: 'hello'"),
        ("echo 'it broke' >&2; exit 3", "worker exited with status 3: it broke"),
    ],
)
def test_a_broken_worker_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, expected: str
) -> None:
    monkeypatch.setattr(peers, "SETUP_TIMEOUT", 1.0)
    log = io.StringIO()
    run = peers.run_peers(
        ["vllm"], {"vllm": _fake_python(tmp_path, body)}, [4], 1, 0, "cmd", log=log
    )
    assert run.engines["vllm"]["error"] == expected
    assert log.getvalue() == f"bench-peers: vllm: {expected}\n"
    assert {c.status for c in run.cells} == {"error"}


def test_make_bench_times_the_bulk_path_against_the_reference_loop(tmp_path: Path) -> None:
    """`make bench`'s step table: refserve and refserve on its reference loop, each in
    its own worker, with the reference loop's ratio to the bulk path."""
    out_json, out_md = tmp_path / "s.json", tmp_path / "s.md"
    code = peers.main(
        [
            *("--engines", "ref", "ref-loop", "--only", "steps"),
            *("--sizes", "8", "--rounds", "2", "--warmup", "0"),
            *("--json", str(out_json), "--markdown", str(out_md)),
        ]
    )
    assert code == 0
    data = json.loads(out_json.read_text())
    assert data["engines"]["ref-loop"]["name"].endswith(", reference loop")
    cells = {(c["engine"], c["prefix_caching"]): c for c in data["cells"]}
    assert set(cells) == {(e, p) for e in ("ref", "ref-loop") for p in (False, True)}
    assert all(c["status"] == "ok" and c["us_per_request"] > 0 for c in cells.values())
    assert "reference loop" in out_md.read_text() and data["parts"] == ["steps"]


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="pinning needs CPU affinity (Linux)"
)
def test_every_worker_runs_on_the_cpu_the_run_pins_and_the_caller_is_left_as_it_was(
    tmp_path: Path,
) -> None:
    """`--cpu` pins every worker (each reports its CPUs in its hello); the caller's own
    affinity comes back afterwards; `--no-pin` leaves the workers where the OS puts them."""
    before = os.sched_getaffinity(0)
    cpu = min(before)
    out_json, out_md = tmp_path / "s.json", tmp_path / "s.md"
    args = [
        *("--engines", "ref", "ref-loop", "--only", "pool", "--rounds", "1", "--warmup", "0"),
        *("--json", str(out_json), "--markdown", str(out_md)),
    ]
    assert peers.main([*args, "--cpu", str(cpu)]) == 0
    assert os.sched_getaffinity(0) == before
    data = json.loads(out_json.read_text())
    assert data["pinned_cpu"] == cpu
    assert all(info["cpus"] == [cpu] for info in data["engines"].values())
    assert f"pinned to CPU {cpu}" in out_md.read_text()
    assert peers.main([*args, "--no-pin"]) == 0
    data = json.loads(out_json.read_text())
    assert data["pinned_cpu"] is None and "not pinned" in out_md.read_text()
    assert all(info["cpus"] == sorted(before) for info in data["engines"].values())


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity"), reason="the check needs CPU affinity (Linux)"
)
def test_a_cpu_the_run_may_not_use_is_refused_by_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(SystemExit) as e:
        peers.main(["--only", "pool", "--cpu", str(bad), "--json", str(tmp_path / "x.json")])
    assert e.value.code == 2
    assert f"--cpu {bad}: this process may run on CPUs" in capsys.readouterr().err


def test_make_bench_reports_the_heap_per_running_request(tmp_path: Path) -> None:
    out_json, out_md = tmp_path / "m.json", tmp_path / "m.md"
    assert (
        memory.main(["--sizes", "8", "32", "--json", str(out_json), "--markdown", str(out_md)]) == 0
    )
    doc = json.loads(out_json.read_text())
    assert doc["format"] == memory.FORMAT and doc["command"].endswith(str(out_md))
    assert set(doc["machine"]) >= {"cpu_model", "cores", "load_average", "python", "torch"}
    assert memory.figures_of(doc) == [memory.MemoryFigure(**f) for f in doc["figures"]]
    figures = doc["figures"]
    assert [f["n"] for f in figures] == [8, 32]
    # A request holds its prompt (100-128 token ids, twice: the request and the pool's
    # table) and its bookkeeping: kilobytes, not bytes and not megabytes.
    assert all(2_000 < f["heap_bytes_per_request"] < 100_000 for f in figures)
    assert all(0 < f["step_bytes_per_request"] < 100_000 for f in figures)
    assert "| 32 |" in out_md.read_text()
