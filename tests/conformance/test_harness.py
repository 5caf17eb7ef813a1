"""The harness cannot be taken down by the engine it checks.

An adapter that hangs, raises in any call, or returns a malformed record gets a finding
naming the call and a complete report; the CLI never hangs, never prints a traceback,
and keeps its exit codes apart: 0 passed, 1 findings, 2 usage or harness error, 130
interrupted. Results are streamed, so a killed run leaves a valid partial report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from refserve.conformance.adapter import (
    CommitReport,
    Feature,
    NotSupported,
    RequestSpec,
    StepReport,
)
from refserve.conformance.adapters.ref import RefAdapter
from refserve.conformance.cli import conformance_main
from refserve.conformance.report import Report
from refserve.spec.snapshot import EngineSnapshot

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MOD = "test_harness"
ONE = ["--scenarios", "seed001-round-by-round"]


class HangsInSchedule(RefAdapter):
    def schedule(self) -> StepReport:
        if self.sched.step_index >= 2:
            while True:  # a scheduler that spins forever
                pass
        return super().schedule()


class HangsInNativeCode(RefAdapter):
    """Blocked in C with the GIL released: the alarm cannot interrupt it, the watchdog can."""

    def schedule(self) -> StepReport:
        import hashlib

        hashlib.pbkdf2_hmac("sha256", b"x", b"y", 2**31 - 1)  # ~30 min of C
        return super().schedule()


class Raises(RefAdapter):
    """Raises in the named call (after a few calls, so the run is under way)."""

    where = ""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def _maybe(self, name: str) -> None:
        if name == self.where:
            self.calls += 1
            if self.calls >= 3:
                raise KeyError(f"boom in {name}")

    def configure(self, config: object) -> None:
        if self.where == "configure":
            raise RuntimeError("cannot configure")
        super().configure(config)  # type: ignore[arg-type]

    def add_request(self, request: RequestSpec) -> None:
        self._maybe("add_request")
        super().add_request(request)

    def schedule(self) -> StepReport:
        self._maybe("schedule")
        return super().schedule()

    def commit(self, sampled: Mapping[str, int]) -> CommitReport:
        self._maybe("commit")
        return super().commit(sampled)

    def snapshot(self) -> EngineSnapshot:
        self._maybe("snapshot")
        return super().snapshot()

    def has_unfinished(self) -> bool:
        if self.where == "has_unfinished":
            raise SystemExit(3)  # even this must not end the run
        return super().has_unfinished()


def _raising(where: str) -> type[Raises]:
    return type(f"Raises_{where}", (Raises,), {"where": where})


class MalformedSnapshot(RefAdapter):
    def snapshot(self) -> EngineSnapshot:
        s = super().snapshot()
        return EngineSnapshot(list(s.requests), s.pool)  # type: ignore[arg-type]


class NotASnapshot(RefAdapter):
    def snapshot(self) -> EngineSnapshot:
        return {"requests": []}  # type: ignore[return-value]


class RefusesRequests(RefAdapter):
    def add_request(self, request: RequestSpec) -> None:
        raise NotSupported("this engine takes no requests through the adapter")


class BadProperties(RefAdapter):
    properties: object = ("not", "EngineProperties")


def _factory_raises() -> RefAdapter:
    raise ImportError("the engine's CUDA extension is missing")


hangs_in_schedule = HangsInSchedule
hangs_in_native_code = HangsInNativeCode
malformed_snapshot = MalformedSnapshot
not_a_snapshot = NotASnapshot
refuses_requests = RefusesRequests
bad_properties = BadProperties
factory_raises = _factory_raises
raises_configure = _raising("configure")
raises_add_request = _raising("add_request")
raises_schedule = _raising("schedule")
raises_commit = _raising("commit")
raises_snapshot = _raising("snapshot")
raises_has_unfinished = _raising("has_unfinished")


def _run(tmp_path: Path, adapter: str, *extra: str) -> tuple[int, Report]:
    rep = tmp_path / "r.json"
    code = conformance_main(
        ["--adapter", f"{MOD}:{adapter}", *ONE, "--report", str(rep), "--no-progress", *extra]
    )
    return code, Report.load(rep)


def _messages(report: Report) -> list[str]:
    return [f"{r.invariant} {f.subject}: {f.message}" for r in report.results for f in r.failures]


@pytest.mark.parametrize(
    ("adapter", "fragment"),
    [
        ("raises_configure", "configure() raised RuntimeError: cannot configure at"),
        ("raises_add_request", "add_request('C') raised KeyError: 'boom in add_request'"),
        ("raises_schedule", "schedule() raised KeyError: 'boom in schedule' at test_harness.py"),
        ("raises_commit", "commit() raised KeyError"),
        ("raises_snapshot", "snapshot() raised KeyError"),
        ("raises_has_unfinished", "has_unfinished() raised SystemExit: 3"),
        ("malformed_snapshot", "snapshot() returned a malformed record: snapshot.requests"),
        ("not_a_snapshot", "snapshot() returned a malformed record"),
        ("factory_raises", "the adapter factory raised ImportError"),
        (
            "bad_properties",
            "adapter.properties must be refserve.conformance.adapter.EngineProperties",
        ),
    ],
)
def test_a_faulty_adapter_is_a_finding_with_a_complete_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], adapter: str, fragment: str
) -> None:
    code, report = _run(tmp_path, adapter)
    assert code == 1
    assert report.complete
    msgs = _messages(report)
    assert any(fragment in m and m.startswith("PROGRESS") for m in msgs), msgs
    err = capsys.readouterr().err
    assert "Traceback" not in err


def test_a_hanging_adapter_call_is_a_progress_finding_naming_the_call(tmp_path: Path) -> None:
    t0 = time.monotonic()
    code, report = _run(tmp_path, "hangs_in_schedule", "--call-timeout", "0.3")
    assert time.monotonic() - t0 < 30  # one timeout per run, shrinking included
    assert code == 1 and report.complete
    msgs = _messages(report)
    assert any("schedule() did not return within 0.3 s" in m for m in msgs), msgs


def test_not_supported_anywhere_means_not_supported(tmp_path: Path) -> None:
    code, report = _run(tmp_path, "refuses_requests")
    assert code == 0
    assert {r.status for r in report.results} == {"not_supported"}
    info = report.scenarios[0]
    assert "add_request('A'): this engine takes no requests" in info.not_supported


def test_usage_errors_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = ["--adapter", "refserve.conformance.adapters.ref:make"]
    cases = [
        [],
        ["--adapter", "nope"],
        ["--adapter", "no_such_module_xyz:make"],
        ["--adapter", "builtins:nothing_here"],
        ["--adapter", "builtins:dict"],  # returns something that is no adapter at all
        ["--kv-adapter", "builtins:dict"],
        [
            "--kv-adapter",
            "refserve.conformance.adapters.ref:make",
        ],  # an engine adapter, not a KV one
        ["--adapter", "refserve.conformance.adapters.ref_kv:make_kv"],
        [*ref, "--scenarios", "no-such-scenario"],
        [*ref, "--examples", "-5"],
        [*ref, "--examples", "zero"],
        [*ref, "--call-timeout", "nan"],
        [*ref, "--call-timeout", "0"],
        [*ref, "--report", str(tmp_path)],  # a directory
        [*ref, "--report", str(tmp_path / "file" / "under" / "r.json")],
        [*ref, "--baseline", str(tmp_path / "missing.json")],
        [*ref, "--replay", str(tmp_path / "missing.json")],
        ["--self-check"],
        ["--bogus-flag"],
    ]
    (tmp_path / "file").write_text("a file, not a directory")
    for argv in cases:
        assert conformance_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err, argv
        assert "error" in err, (argv, err)


def test_a_factory_that_returns_no_adapter_is_a_usage_error_naming_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rep = tmp_path / "r.json"
    assert conformance_main(["--adapter", "builtins:dict", "--report", str(rep)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "refserve conformance: error: --adapter builtins:dict does not return an engine "
        "adapter: missing name, features, configure, add_request, abort, has_unfinished, "
        "schedule, commit, rollback, snapshot (docs/ADAPTERS.md)"
    ]
    assert not rep.exists()  # refused before the run: no report, not even a partial one
    argv = ["--kv-adapter", "refserve.conformance.adapters.ref:make"]
    assert conformance_main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        "refserve conformance: error: --kv-adapter refserve.conformance.adapters.ref:make does not "
        "return a KV adapter: missing allocate, fork, free (docs/ADAPTERS.md)"
    )
    # Replays are checked the same way.
    from refserve.conformance.scenarios import by_name

    wl = tmp_path / "w.json"
    wl.write_text(json.dumps(by_name()["seed001-round-by-round"].workload.to_json()))
    assert conformance_main(["--adapter", "builtins:dict", "--replay", str(wl)]) == 2
    assert "does not return an engine adapter" in capsys.readouterr().err


def test_the_member_lists_are_the_protocols_and_nothing_of_the_adapter_runs() -> None:
    from refserve.conformance.adapter import (
        ENGINE_ADAPTER_ATTRIBUTES,
        ENGINE_ADAPTER_METHODS,
        EngineAdapter,
        missing_members,
    )
    from refserve.conformance.kv.protocol import (
        KV_ADAPTER_ATTRIBUTES,
        KV_ADAPTER_METHODS,
        KVAdapter,
    )

    def shaped(names: tuple[str, ...], drop: str = "") -> object:
        return type("Shaped", (), {n: (lambda self: None) for n in names if n != drop})()

    for proto, attrs, methods in (
        (EngineAdapter, ENGINE_ADAPTER_ATTRIBUTES, ENGINE_ADAPTER_METHODS),
        (KVAdapter, KV_ADAPTER_ATTRIBUTES, KV_ADAPTER_METHODS),
    ):
        names = (*attrs, *methods)
        # Exactly the protocol: every listed member is needed, and the list is enough.
        assert isinstance(shaped(names), proto)
        for n in names:
            assert not isinstance(shaped(names, drop=n), proto), n
            assert missing_members(shaped(names, drop=n), attrs, methods) == [n]
        assert missing_members(shaped(names), attrs, methods) == []

    class Odd(RefAdapter):
        schedule = 3  # type: ignore[assignment]

        @property
        def features(self) -> frozenset[Feature]:
            raise AssertionError("a property must not run while the members are checked")

        @classmethod
        def rollback(cls) -> None: ...  # type: ignore[override]

    attrs, methods = ENGINE_ADAPTER_ATTRIBUTES, ENGINE_ADAPTER_METHODS
    assert missing_members(Odd(), attrs, methods) == ["schedule (not callable)"]

    class Proxy:
        """Delegates everything, as a wrapper around an engine's own adapter may."""

        def __init__(self) -> None:
            self.inner = RefAdapter()

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

    assert missing_members(Proxy(), attrs, methods) == []
    assert missing_members({}, attrs, methods) == [*attrs, *methods]


def test_the_summary_line_counts_scenarios_and_findings_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from refserve.conformance.report import Failure, Result, to_markdown

    def fail(msg: str) -> Failure:
        return Failure(0, "step", "step", msg, "", "", {}, [], f"TOKEN step: {msg}")

    results = (
        Result("a", "TOKEN", "fail", "", fail("one"), (fail("two"),)),  # two findings
        Result("a", "BLOCK", "fail", "", fail("three")),
        Result("a", "POS", "pass"),
        Result("b", "TOKEN", "pass"),
        Result("c", "TOKEN", "not_supported", "engine lacks abort"),
    )
    report = Report("m:f", "eng", (), results, ())
    line = (
        "1 of 3 scenarios failed (3 findings); checks (scenario x invariant): 2 failed, "
        "2 passed, 1 not supported"
    )
    assert report.headline() == line
    assert f"**{line}.**" in to_markdown(report)
    one = Report("m:f", "eng", (), (results[1], results[3]), ())  # one scenario fails
    assert one.headline().startswith("1 of 2 scenarios failed (1 finding); ")
    # The CLI prints it above exactly as many FAIL lines as it counts findings.
    code, _ = _run(tmp_path, "raises_schedule")
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert out[0].startswith("refserve: 1 of 1 scenarios failed (1 finding); checks "), out[0]
    assert sum(1 for x in out if x.startswith("  FAIL ")) == 1, out


def test_malformed_replay_and_baseline_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = ["--adapter", "refserve.conformance.adapters.ref:make"]
    bad = tmp_path / "bad.json"
    for text in ("{not json", '{"config": 5}', "[1, 2]", '"x"'):
        bad.write_text(text)
        assert conformance_main([*ref, "--replay", str(bad)]) == 2, text
        assert conformance_main([*ref, "--baseline", str(bad)]) == 2, text
    bad.write_bytes(b"\xff\xfe latin-1 \xe9")
    assert conformance_main([*ref, "--replay", str(bad)]) == 2
    assert "not UTF-8" in capsys.readouterr().err


def test_output_directories_are_created(tmp_path: Path) -> None:
    rep = tmp_path / "new" / "dir" / "r.json"
    md = tmp_path / "md" / "r.md"
    argv = ["--adapter", "refserve.conformance.adapters.ref:make", *ONE]
    assert conformance_main([*argv, "--report", str(rep), "--markdown", str(md)]) == 0
    assert Report.load(rep).complete and md.read_text().startswith("# Conformance report")


def test_baseline_suppresses_known_findings_and_the_search_goes_on(tmp_path: Path) -> None:
    base = tmp_path / "base.json"
    argv = ["--adapter", f"{MOD}:raises_schedule", *ONE, "--no-progress"]
    assert conformance_main([*argv, "--report", str(base)]) == 1
    again = tmp_path / "again.json"
    assert conformance_main([*argv, "--baseline", str(base), "--report", str(again)]) == 0
    report = Report.load(again)
    assert not report.failed
    assert report.scenarios[0].observed.get("suppressed") == 1
    assert any("suppressed by the baseline" in r.note for r in report.results)


def _subprocess(argv: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{ROOT}"}
    cmd = [sys.executable, "-m", "refserve.conformance.cli", *argv]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_default,
    )


def _sigint_default() -> None:
    # A shell starts background jobs with SIGINT ignored, and Python keeps an inherited
    # "ignore" (no KeyboardInterrupt at all): a test suite run in the background would
    # see Ctrl-C ignored. The child starts as a terminal's foreground job would.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_call_stuck_in_native_code_ends_the_run_with_a_partial_report(tmp_path: Path) -> None:
    rep = tmp_path / "r.json"
    argv = ["--adapter", f"{MOD}:hangs_in_native_code", *ONE, "--call-timeout", "0.5"]
    proc = _subprocess([*argv, "--report", str(rep)])
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert "Traceback" not in err
    assert "schedule() did not return within 0.5 s and could not be interrupted" in err
    report = Report.load(rep)
    assert not report.complete and report.failed


def test_ctrl_c_exits_130_with_one_line_and_a_valid_partial_report(tmp_path: Path) -> None:
    rep = tmp_path / "r.json"
    proc = _subprocess(
        ["--adapter", "refserve.conformance.adapters.ref:make", "--report", str(rep)]
    )
    deadline = time.monotonic() + 60
    while not rep.exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the first scenario's results are streamed
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, f"stdout: {out[-2000:]}\nstderr: {err[-2000:]}"
    assert err.strip().splitlines()[-1] == "refserve conformance: interrupted"
    assert "Traceback" not in err
    partial = json.loads(rep.read_text())
    assert partial["complete"] is False and partial["results"]
