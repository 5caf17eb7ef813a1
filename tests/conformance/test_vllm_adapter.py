"""The vLLM adapter (conformance/adapters/vllm.py): its refusals without vLLM, and its
triage (conformance/FINDINGS_vllm.md) where vLLM 0.33.0 is installed.

vLLM lives in its own virtualenv (``make conformance-vllm``), never in refserve's: in
``make test`` only the refusals run; the triage test runs with
``.venv-vllm/bin/python -m pytest tests/conformance/test_vllm_adapter.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
CLI = [sys.executable, "-m", "refserve.cli.main", "conformance"]


def _cli(argv: list[str], pythonpath: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    paths = [p for p in (pythonpath, str(ROOT), env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run(
        [*CLI, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here: the refusal cannot show")
def test_without_vllm_the_module_refuses_with_a_typed_error() -> None:
    sys.modules.pop("refserve.conformance.adapters.vllm", None)
    with pytest.raises(ModuleNotFoundError) as e:
        importlib.import_module("refserve.conformance.adapters.vllm")
    assert e.value.name == "vllm"
    assert "make conformance-vllm" in str(e.value)


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here: the refusal cannot show")
@pytest.mark.parametrize("mode", ["--self-check", None])
def test_without_vllm_the_cli_exits_2_with_one_line(mode: str | None) -> None:
    argv = ["--adapter", "refserve.conformance.adapters.vllm:make"] + ([mode] if mode else [])
    out = _cli(argv)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("refserve conformance: error: ")
    assert "vLLM is not installed here" in lines[0]


def test_another_vllm_release_is_refused_by_name(tmp_path: Path) -> None:
    """A vLLM other than 0.33.0 (a stand-in package here) is refused before any import."""
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('the adapter imported vllm')\n")
    dist = tmp_path / "vllm-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.1.0\n")
    out = _cli(["--adapter", "refserve.conformance.adapters.vllm:make"], pythonpath=str(tmp_path))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "VllmVersionError: vLLM 0.1.0 is installed" in lines[0]
    assert "translates vLLM 0.33.0 only" in lines[0]


# ---------------------------------------------------------------- with vLLM 0.33.0
def _vllm() -> object:
    return pytest.importorskip(
        "refserve.conformance.adapters.vllm",
        reason="vLLM 0.33.0 is not installed here: it lives in its own virtualenv "
        "(make conformance-vllm, then .venv-vllm/bin/python -m pytest "
        "tests/conformance/test_vllm_adapter.py)",
        exc_type=ImportError,
    )


# The scenarios the triage test runs: every fixed scenario the fcfs adapter can take
# (one generated example each keeps it to seconds).
TRIAGED = [
    "seed001-round-by-round",
    "seed003-prefix-reuse",
    "bug-double-free-shared-blocks",
    "bug-fully-cached-prompt-concurrent",
    "bug-same-step-new-shared-prefix",
    "bug-abort-preempted",
    "bug-preemption-storm",
    "bug-head-of-line-kv-heavy",
    "bug-lone-request-cannot-grow",
    "bug-free-list-order",
    "atomic-rejected-empty-prompt",
    "atomic-oversized-prompt",
    "atomic-executor-fault",
    "stop-token-forced",
    "no-prefix-caching",
]


def test_vllm_adapter_declares_its_conventions_and_keeps_them() -> None:
    """The triage of conformance/FINDINGS_vllm.md, as a test."""
    from refserve.conformance.adapter import (
        AdmissionOrder,
        EngineAdapter,
        EngineProperties,
        Feature,
        StepOrder,
    )
    from refserve.conformance.suite import run_suite

    mod: Any = _vllm()
    assert isinstance(mod.make(), EngineAdapter)
    assert mod.make().properties == EngineProperties(
        lookahead_slots=0,
        eos=True,
        admission_order=AdmissionOrder.FCFS_STRICT,
        step_order=StepOrder.DECODE_FIRST,
        same_step_prefix_hits=True,
        free_queue_order=True,
        max_model_len_stop=True,
    )
    assert mod.make_priority().properties.admission_order == AdmissionOrder.PRIORITY_STRICT
    assert Feature.PRIORITIES in mod.make_priority().features
    assert Feature.CHUNKED_PREFILL not in mod.make_unchunked().features
    report = run_suite(mod.make, "refserve.conformance.adapters.vllm:make", TRIAGED, max_examples=1)
    status = {(r.scenario, r.invariant): r.status for r in report.results}
    failed = {
        (r.scenario, r.invariant): [f.message for f in r.failures]
        for r in report.results
        if r.failures
    }
    # Finding 1, withdrawn: vLLM stops a request at the max_model_len it fitted to the
    # pool, with reason length, before max_tokens: the declared max_model_len_stop.
    assert failed == {}
    assert status[("bug-lone-request-cannot-grow", "KVLEN")] == "pass"
    lone = next(s for s in report.scenarios if s.name == "bug-lone-request-cannot-grow")
    assert lone.observed["finish_reasons"] == {"length": 1}, lone.observed
    # Without the declaration the same stop is the finding it used to be.
    undeclared = dataclasses.replace(mod.VLLM_PROPERTIES, max_model_len_stop=False)

    def make_undeclared() -> Any:
        adapter = mod.make()
        adapter.properties = undeclared
        return adapter

    again = run_suite(make_undeclared, "x:y", ["bug-lone-request-cannot-grow"], max_examples=1)
    assert [
        (r.invariant, [f.message.split(" (it reached")[0] for f in r.failures])
        for r in again.results
        if r.failures
    ] == [("KVLEN", ["finished with reason length after 2 outputs without a stop"])]
    assert status[("atomic-executor-fault", "ATOMIC")] == "not_supported"  # no rollback
    assert report.policy["step_order"] == {"declared": "decode_first", "observed": "decode_first"}
    assert report.policy["preemptions"] > 0 and report.policy["prefix_cached_tokens"] > 0


@pytest.mark.parametrize("plant", ["leak_on_free", "hit_without_ref"])
def test_a_bug_planted_in_vllm_is_found_through_the_adapter(
    plant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapter reads vLLM's own objects: a bug planted in vLLM (not in the adapter)
    shows as a finding, so the clean run above is vLLM's, not the adapter's."""
    from refserve.conformance.suite import run_suite

    mod: Any = _vllm()
    manager = importlib.import_module("vllm.v1.core.kv_cache_manager").KVCacheManager
    pool = importlib.import_module("vllm.v1.core.block_pool").BlockPool
    if plant == "leak_on_free":
        monkeypatch.setattr(manager, "free", lambda self, request: None)
        scenario, invariant = "seed001-round-by-round", "PROGRESS"
    else:

        def touch(self: Any, blocks: Any) -> None:  # takes a cached block, no reference
            for block in blocks:
                if not block.is_null and block.ref_cnt == 0:
                    self.free_block_queue.remove(block)

        monkeypatch.setattr(pool, "touch", touch)
        scenario, invariant = "bug-fully-cached-prompt-concurrent", "BLOCK"
    report = run_suite(
        mod.make, "refserve.conformance.adapters.vllm:make", [scenario], max_examples=1
    )
    status = {r.invariant: r.status for r in report.results}
    assert status[invariant] == "fail", status
