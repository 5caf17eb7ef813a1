"""Hostile input at the command line: one error surface, a standing table.

Every case in ``bad_input_cases.ALL_CASES`` runs ``refserve.cli.main.main(argv)`` in-process under
a deadline and must end with: the expected exit code, exactly one line on stderr that
starts ``refserve: error: `` and names the field, option or file, no ``Traceback``, and
no output file (nor a temporary one) left behind. Ctrl-C is injected in-process into
every long command, and sent for real (SIGINT) to one subprocess; one more subprocess is
a smoke test of ``python -m refserve.cli.main``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from bad_input_cases import (
    ALL_CASES,
    OK_LINE,
    Case,
    checkpoint_tensors,
    write_checkpoint,
)

from refserve.cli.main import main

REPO = Path(__file__).resolve().parents[2]
CASE_SECONDS = 20.0


class CaseTimeout(BaseException):
    """Raised by the deadline's alarm. A BaseException, so that the CLI's error surface
    (which turns every Exception into one line) cannot swallow it."""


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise CaseTimeout(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    with deadline(CASE_SECONDS):
        try:
            code = main(argv)
        except SystemExit as e:  # the surface returns codes; a raise is itself a finding
            pytest.fail(f"main() raised SystemExit({e.code!r}) instead of returning")
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(err: str, prefix: str, words: str) -> None:
    assert "Traceback" not in err, err[-3000:]
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err[-3000:]}"
    assert lines[0].startswith(prefix), lines[0]
    assert words in lines[0], f"{words!r} not in {lines[0]!r}"


def leftovers(ws: Path) -> list[Path]:
    """Temporary files of an atomic write that were not cleaned up."""
    return [p for p in ws.rglob(".*.tmp")]


# --------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def weights_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny checkpoint's weights, linked into every model case's folder."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny-ckpt")) / "model.safetensors"


def workspace(tmp_path: Path, case: Case | None = None, weights: Path | None = None) -> Path:
    ws = tmp_path / "ws"
    (ws / "adir").mkdir(parents=True)
    (ws / "afile").write_text("not a directory\n", encoding="utf-8")
    (ws / "ok.jsonl").write_text(OK_LINE + "\n", encoding="utf-8")
    if case is None:
        return ws
    if isinstance(case.trace, bytes):
        (ws / "t.jsonl").write_bytes(case.trace)
    elif case.trace is not None:
        (ws / "t.jsonl").write_text(case.trace, encoding="utf-8")
    if case.config is not None:
        if case.bad_tensor is not None:
            name, value = case.bad_tensor
            tensors = checkpoint_tensors()
            tensors[name].view(-1)[3] = value
            write_checkpoint(ws / "ckpt", case.config, tensors=tensors)
        elif case.weights_bytes is not None:
            write_checkpoint(ws / "ckpt", case.config, weights_file=weights)
            (ws / "ckpt" / "model.safetensors").unlink()
            (ws / "ckpt" / "model.safetensors").write_bytes(case.weights_bytes)
        else:
            write_checkpoint(ws / "ckpt", case.config, weights_file=weights)
    return ws


# --------------------------------------------------------------------- the table
def test_the_table_is_large_and_its_ids_unique() -> None:
    ids = [c.id for c in ALL_CASES]
    assert len(ids) >= 150, len(ids)
    assert len(set(ids)) == len(ids), sorted(i for i in ids if ids.count(i) > 1)


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.id)
def test_bad_input(
    case: Case,
    tmp_path: Path,
    weights_file: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if case.skip_if_cuda and torch.cuda.is_available():
        pytest.skip("CUDA is available here, so the device is not bad input")
    ws = workspace(tmp_path, case, weights_file)
    for target, value in case.patches:
        monkeypatch.setattr(target, value)
    for name in case.env_unset:
        monkeypatch.delenv(name, raising=False)
    argv = [a.replace("{ws}", str(ws)) for a in case.argv]
    code, out, err = run_main(argv, capsys)
    assert code == case.code, f"exit {code}, expected {case.code}; stderr: {err[-2000:]}"
    assert "Traceback" not in out
    assert_one_line(err, case.message, case.words)
    for rel in case.outputs:
        assert not (ws / rel).exists(), f"{rel} was written"
    assert not leftovers(ws)


# --------------------------------------------------------------------- accepted input
def test_the_tiny_checkpoint_itself_generates(
    tmp_path: Path, weights_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The config cases fail for the field they change, not for the base checkpoint."""
    ckpt = write_checkpoint(tmp_path / "ckpt", {}, weights_file=weights_file)
    argv = ["generate", "--model", str(ckpt), "--prompt-ids", "1,5", "--max-tokens", "2"]
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    assert "tokens:" in out


MLFQ_TRACE = "\n".join(
    json.dumps({"id": rid, "arrival_ms": at, "prompt_len": n, "output_len": m})
    for rid, at, n, m in [("l1", 0, 40, 20), ("l2", 0, 30, 20), ("s1", 30, 3, 4), ("s2", 60, 2, 4)]
)
MLFQ_KNOBS = (
    "--policy",
    "mlfq",
    "--mlfq-queues",
    "3",
    "--mlfq-quantum-ms",
    "4",
    "--mlfq-growth",
    "2",
    "--mlfq-starvation-steps",
    "30",
)


@pytest.mark.parametrize("proactive_swap", [True, False], ids=["swap", "recompute"])
def test_simulate_runs_the_mlfq_policy_with_its_knobs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], proactive_swap: bool
) -> None:
    """Two long requests hold both seats when short ones arrive: each short one displaces
    a long one (to the host, or dropped with --mlfq-no-proactive-swap), every spec
    invariant checked."""
    ws = workspace(tmp_path)
    (ws / "t.jsonl").write_text(MLFQ_TRACE + "\n", encoding="utf-8")
    out_json = ws / "run.json"
    argv = ["simulate", str(ws / "t.jsonl"), "--quiet", "--check", "--json", str(out_json)]
    argv += ["--max-num-seqs", "2", "--block-size", "4", "--max-num-batched-tokens", "16"]
    argv += ["--num-host-blocks", "32", *MLFQ_KNOBS]
    if not proactive_swap:
        argv.append("--mlfq-no-proactive-swap")
    code, _, err = run_main(argv, capsys)
    assert code == 0, err
    doc = json.loads(out_json.read_text(encoding="utf-8"))
    assert doc["complete"] is True and doc["config"]["policy"] == "mlfq"
    assert "'num_queues': 3" in doc["config"]["mlfq"]
    assert f"'proactive_swap': {proactive_swap}" in doc["config"]["mlfq"]
    assert doc["summary"]["num_finished"] == 4
    assert doc["summary"]["num_preemptions"] == 2
    swapped = doc["swap"]["num_swapped_out"]
    assert swapped == (2 if proactive_swap else 0)


def test_generate_under_mlfq_gives_the_default_policys_greedy_tokens(
    tmp_path: Path, weights_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", {}, weights_file=weights_file)
    argv = ["generate", "--model", str(ckpt), "--prompt-ids", "1,5,9", "--max-tokens", "6"]
    code, plain, err = run_main(argv, capsys)
    assert code == 0, err
    code, mlfq, err = run_main([*argv, *MLFQ_KNOBS, "--mlfq-no-skip-join"], capsys)
    assert code == 0, err
    assert "tokens:" in mlfq and mlfq == plain


def test_max_steps_ends_typed_and_writes_the_partial_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = workspace(tmp_path)
    out_json, out_html = ws / "out" / "run.json", ws / "out" / "run.html"
    argv = ["simulate", "seed002", "--quiet", "--max-steps", "3"]
    argv += ["--json", str(out_json), "--timeline", str(out_html)]
    code, out, err = run_main(argv, capsys)
    assert code == 2
    assert_one_line(err, "refserve: error: ", "within max_steps=3 steps")
    doc = json.loads(out_json.read_text(encoding="utf-8"), parse_constant=_no_constant)
    assert doc["complete"] is False and len(doc["iterations"]) == 3
    assert "<svg" in out_html.read_text(encoding="utf-8")
    assert "partial result" in out
    assert not leftovers(ws)


def _no_constant(name: str) -> float:
    raise AssertionError(f"non-standard JSON constant {name}")


def test_accepted_edge_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A BOM-prefixed trace reads; missing output folders are created; the JSON written
    is standard (no NaN or Infinity) and marked complete."""
    ws = workspace(tmp_path)
    (ws / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + OK_LINE.encode() + b"\n")
    out_json = ws / "new" / "deeper" / "run.json"
    code, _, err = run_main(["simulate", str(ws / "bom.jsonl"), "--json", str(out_json)], capsys)
    assert code == 0, err
    doc = json.loads(out_json.read_text(encoding="utf-8"), parse_constant=_no_constant)
    assert doc["complete"] is True and doc["requests"][0]["request_id"] == "a"
    # File names that are not UTF-8 (surrogate-escaped by Python) are printed escaped.
    odd = ws / "\udcff.jsonl"
    odd.write_text(OK_LINE + "\n", encoding="utf-8")
    picture = ws / "\udcfe.html"
    code, out, err = run_main(["simulate", str(odd), "--timeline", str(picture)], capsys)
    assert code == 0, err
    assert "\\udcfe.html" in out and "<svg" in picture.read_text(encoding="utf-8")
    assert not leftovers(ws)


def test_debug_shows_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["--debug", "simulate", str(tmp_path / "absent.jsonl")], capsys)
    assert code == 2
    assert "Traceback" in err
    assert err.strip().splitlines()[-1].startswith("refserve: error: trace ")


def test_an_internal_error_is_one_line_too(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr("refserve.sim.simulator.simulate", broken)
    code, _, err = run_main(["simulate", "seed002", "--quiet"], capsys)
    assert code == 2
    assert_one_line(err, "refserve: error: internal error: ZeroDivisionError", "--debug")


def test_conformance_still_routes_to_its_own_cli(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[str]] = []

    def fake(argv: list[str]) -> int:
        seen.append(argv)
        return 7

    monkeypatch.setattr("refserve.conformance.cli.conformance_main", fake)
    assert main(["conformance", "--list", "--examples", "-5"]) == 7
    assert main(["--debug", "conformance", "--list"]) == 7
    assert seen == [["--list", "--examples", "-5"], ["--list", "--debug"]]


# --------------------------------------------------------------------- Ctrl-C
def _interrupt_after(calls: int) -> Callable[..., Any]:
    """A replacement that raises KeyboardInterrupt on its ``calls``-th call and otherwise
    runs the original (bound by the caller)."""
    count = {"n": 0}

    def install(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            count["n"] += 1
            if count["n"] >= calls:
                raise KeyboardInterrupt
            return original(*args, **kwargs)

        return wrapper

    return install


INTERRUPTS: list[tuple[str, list[str], str, int, list[str]]] = [
    # (id, argv, what to interrupt, on which call, outputs that must not exist). A few
    # steps in, so the run is under way; the first rename of a write, so a temporary file
    # exists and must be removed.
    (
        "simulate",
        ["simulate", "seed002", "--json", "{ws}/o/run.json", "--timeline", "{ws}/o/t.html"],
        "refserve.core.engine_core.EngineCore.step",
        3,
        ["o/run.json", "o/t.html"],
    ),
    (
        "simulate-during-write",
        ["simulate", "seed002", "--quiet", "--json", "{ws}/o/run.json"],
        "refserve.files.os.replace",
        1,
        ["o/run.json"],
    ),
    (
        "generate",
        ["generate", "--prompt", "Hello", "--max-tokens", "8"],
        "refserve.core.engine_core.EngineCore.step",
        3,
        [],
    ),
    (
        "demo",
        ["demo", "--timeline", "{ws}/o/demo.html"],
        "refserve.core.engine_core.EngineCore.step",
        3,
        ["o/demo.html", "o/demo.png"],
    ),
    (
        "compare",
        ["compare", "--quick", "--traces", "chat", "--no-progress", "--out", "{ws}/cmp"],
        "refserve.core.engine_core.EngineCore.step",
        3,
        ["cmp/report.json", "cmp/report.md", "cmp/goodput_chat.png"],
    ),
    (
        "compare-during-write",
        [
            *("compare", "--quick", "--traces", "chat", "--policies", "fcfs"),
            *("--no-progress", "--out", "{ws}/cmp"),
        ],
        "refserve.files.os.replace",
        1,
        ["cmp/report.json", "cmp/report.md", "cmp/goodput_chat.png"],
    ),
]


@pytest.mark.parametrize(
    ("argv", "target", "calls", "outputs"),
    [i[1:] for i in INTERRUPTS],
    ids=[i[0] for i in INTERRUPTS],
)
def test_ctrl_c_exits_130_and_leaves_no_file(
    argv: list[str],
    target: str,
    calls: int,
    outputs: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ws = workspace(tmp_path)
    module_path, _, attr = target.rpartition(".")
    owner: Any = _resolve(module_path)
    monkeypatch.setattr(owner, attr, _interrupt_after(calls)(getattr(owner, attr)))
    code, _, err = run_main([a.replace("{ws}", str(ws)) for a in argv], capsys)
    assert code == 130, err[-2000:]
    assert_one_line(err, "refserve: interrupted", "interrupted")
    for rel in outputs:
        assert not (ws / rel).exists(), f"{rel} was left behind"
    assert not leftovers(ws)


def test_ctrl_c_in_check_kernel_leaves_no_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grid is interrupted half-way through writing its report: the report it was
    given is a temporary name, removed; the real one never appears."""
    ws = workspace(tmp_path)
    seen: list[list[str]] = []

    def grid(argv: list[str]) -> int:
        seen.append(argv)
        Path(argv[argv.index("--json") + 1]).write_text('{"half": ', encoding="utf-8")
        raise KeyboardInterrupt

    monkeypatch.setattr("refserve.conformance.kernel_grid.check_kernel_main", grid)
    report = ws / "o" / "k.json"
    argv = [
        "check-kernel",
        "refserve.kernels.oracle:paged_attention",
        "--quick",
        "--json",
        str(report),
    ]
    code, _, err = run_main(argv, capsys)
    assert code == 130
    assert_one_line(err, "refserve: interrupted", "interrupted")
    assert seen and seen[0][-1] != str(report)  # the grid wrote to a temporary name
    assert not report.exists() and not leftovers(ws)


def _resolve(dotted: str) -> Any:
    """``pkg.mod.Class`` or ``pkg.mod`` (``refserve.sim.trace.os``: the os module as
    refserve.sim.trace sees it) to the object."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p)
        return obj
    raise LookupError(dotted)


# --------------------------------------------------------------------- subprocesses
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def test_sigint_mid_simulation_exits_130_without_files(tmp_path: Path) -> None:
    """A real Ctrl-C: SIGINT to a simulation that would run for minutes."""
    ws = workspace(tmp_path)
    rows = [
        json.dumps({"id": f"r{i}", "arrival_ms": i, "prompt_len": 256, "output_len": 2000})
        for i in range(400)
    ]
    (ws / "long.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    argv = [str(ws / "long.jsonl"), "--check", "--json", str(ws / "o" / "run.json")]
    argv += ["--timeline", str(ws / "o" / "t.html")]
    # Heavy imports first, then a line on stdout: SIGINT lands inside the run. Python's
    # own SIGINT handler is installed explicitly: a shell starts background jobs (CI)
    # with SIGINT ignored, and Python keeps an inherited "ignore".
    code = (
        "import signal, sys, refserve.cli.main, refserve.sim.simulator, refserve.core.scheduler\n"
        "import refserve.core.cost, refserve.sim.metrics\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "print('ready', flush=True)\n"
        f"sys.exit(refserve.cli.main.main(['simulate', *{argv!r}]))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ws,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    assert_one_line(err, "refserve: interrupted", "interrupted")
    assert not (ws / "o" / "run.json").exists() and not (ws / "o" / "t.html").exists()
    assert not leftovers(ws)


def test_smoke_python_m_ref_cli(tmp_path: Path) -> None:
    """The real entry point, a real process: a directory as the trace, a NaN arrival."""
    ws = workspace(tmp_path)
    (ws / "nan.jsonl").write_text(
        '{"id": "a", "arrival_ms": NaN, "prompt_len": 4, "output_len": 2}\n', encoding="utf-8"
    )
    for trace, words in ((ws / "adir", "is a directory"), (ws / "nan.jsonl", "'arrival_ms'")):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "refserve.cli.main",
                "simulate",
                str(trace),
                "--json",
                "o/x.json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=_env(),
            cwd=ws,
        )
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert_one_line(proc.stderr, "refserve: error: ", words)
    assert not (ws / "o" / "x.json").exists()


def test_limits_are_what_the_docs_say() -> None:
    """The bounds the modules document are the ones enforced."""
    from refserve.cli import args as cli
    from refserve.cli import compare
    from refserve.core import cost as cost_model
    from refserve.sim import trace

    assert cli.MAX_BLOCKS == 1 << 22 and cli.MAX_STEPS == 100_000_000
    assert trace.MAX_TRACE_TOKENS == 1 << 24 and trace.MAX_TRACE_BYTES == 64 << 20
    assert trace.MAX_ARRIVAL_MS == 1e12 and math.isfinite(cost_model.MAX_COEFFICIENT_MS)
    assert (compare.MIN_SCALE, compare.MAX_SCALE, compare.MAX_REQUESTS) == (1, 65536, 100_000)
