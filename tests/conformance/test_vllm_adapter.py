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


# ---------------------------------------------------------------- speculative decoding
SPECULATION = "speculation-verify-and-roll-back"


def _spec_config(k: int) -> Any:
    from refserve.conformance.adapter import EngineConfig

    return EngineConfig(
        block_size=4,
        num_blocks=16,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        num_speculative_tokens=k,
    )


def test_vllm_verifies_the_suites_drafts_and_rolls_back_the_rejected() -> None:
    """The speculation scenario on vLLM's n-gram speculative config: every invariant
    passes, drafts were verified, some accepted and some rejected, and the tables held
    the rejected drafts' slots (declared as ``lookahead_slots``, the configured k)."""
    from refserve.conformance.adapter import Feature
    from refserve.conformance.runner import run_fresh
    from refserve.conformance.scenarios import by_name
    from refserve.conformance.suite import run_suite

    mod: Any = _vllm()
    adapter = mod.make()
    assert Feature.SPECULATIVE_DECODING in adapter.features
    for k in (0, 3):
        adapter.configure(_spec_config(k))
        assert adapter.properties.lookahead_slots == k
    report = run_suite(mod.make, "refserve.conformance.adapters.vllm:make", [SPECULATION])
    assert {r.invariant: r.status for r in report.results} == {
        i: "pass" for i in ("TOKEN", "BLOCK", "KVLEN", "POS", "CAP", "PREFIX", "PROGRESS", "ORDER")
    }
    res = run_fresh(mod.make, by_name()[SPECULATION].workload)
    verified = [
        (s["drafts"], t["accepted"][s["id"]])
        for t in res.trace
        if "accepted" in t
        for s in t["scheduled"]
        if s["drafts"]
    ]
    assert verified, res.trace
    assert any(a < d for d, a in verified) and any(a == d for d, a in verified), verified
    ahead: list[int] = []

    class Watched(mod.VllmAdapter):  # type: ignore[misc, name-defined]
        def snapshot(self) -> Any:
            snap = super().snapshot()
            bs = snap.pool.block_size
            ahead.extend(len(t.block_table) * bs - t.num_stored for t in snap.pool.tables)
            return snap

    assert not run_fresh(Watched, by_name()[SPECULATION].workload).findings
    assert max(ahead) >= 4, ahead  # a whole block kept past the KV length somewhere


def test_without_the_lookahead_declaration_the_kept_draft_blocks_are_a_pos_finding() -> None:
    """The declaration is needed: declared 0, the blocks vLLM keeps for rejected
    drafts are tables longer than their KV (POS)."""
    from refserve.conformance.suite import run_suite

    mod: Any = _vllm()

    class Undeclared(mod.VllmAdapter):  # type: ignore[misc, name-defined]
        def configure(self, config: Any) -> None:
            super().configure(config)
            self.properties = dataclasses.replace(self.properties, lookahead_slots=0)

    report = run_suite(Undeclared, "x:y", [SPECULATION])
    failed = {r.invariant for r in report.results if r.status == "fail"}
    assert "POS" in failed, [(r.invariant, r.status) for r in report.results]
    messages = [f.message for r in report.results for f in r.failures if r.invariant == "POS"]
    assert any("does not cover the KV length exactly" in m for m in messages), messages


def test_a_planted_missing_rollback_in_vllm_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug planted in vLLM's scheduler (it forgets which drafts a step verified, so it
    never lowers num_computed_tokens for the rejected ones) is found through the
    adapter: the clean speculation run is vLLM's."""
    from refserve.conformance.suite import run_suite

    mod: Any = _vllm()
    sched = importlib.import_module("vllm.v1.core.sched.scheduler").Scheduler
    real = sched.update_from_output

    def forgetful(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        scheduler_output.scheduled_spec_decode_tokens = {}
        return real(self, scheduler_output, model_runner_output)

    monkeypatch.setattr(sched, "update_from_output", forgetful)
    report = run_suite(mod.make, "x:y", [SPECULATION])
    failed = {r.invariant for r in report.results if r.status == "fail"}
    assert "TOKEN" in failed, [(r.invariant, r.status) for r in report.results]


def _padded_admission() -> Any:
    """The explorer's shortest path to vLLM's padded step (scope small-spec): r0 fills
    block 0 with [2, 3] and stops; r1 = [2, 3, 4] hits that block and is admitted with one
    token left, which vLLM pads to 1 + 2 tokens with two placeholder drafts."""
    from refserve.conformance.adapter import EngineConfig
    from refserve.conformance.workload import EOS, RequestPlan, Workload

    return Workload(
        config=EngineConfig(
            block_size=2,
            num_blocks=4,
            max_num_batched_tokens=4,
            max_num_seqs=2,
            eos_token_id=EOS,
            num_speculative_tokens=2,
        ),
        requests=(
            RequestPlan("r0", (2, 3, 5, 6), max_tokens=4, stop_at=1),
            RequestPlan("r1", (2, 3, 4), max_tokens=5),
        ),
    )


def test_vllms_placeholder_drafts_are_declared_and_rejected() -> None:
    """vLLM verifies two drafts nobody proposed (its padding); declared
    (``placeholder_drafts``, set by ``configure`` with drafts) the suite rejects them
    and the run is clean; undeclared, the same step is the TOKEN finding it would be
    for an engine inventing drafts."""
    from refserve.conformance.runner import run_fresh

    mod: Any = _vllm()
    res = run_fresh(mod.make, _padded_admission())
    assert not res.findings, [str(f) for f in res.findings]
    padded = [
        (s["drafts"], t["accepted"][s["id"]])
        for t in res.trace
        if "accepted" in t
        for s in t["scheduled"]
        if s["id"] == "r1" and s["cached"]
    ]
    assert padded == [(2, 0)], res.trace

    class Undeclared(mod.VllmAdapter):  # type: ignore[misc, name-defined]
        def configure(self, config: Any) -> None:
            super().configure(config)
            self.properties = dataclasses.replace(self.properties, placeholder_drafts=False)

    again = run_fresh(Undeclared, _padded_admission())
    assert [(f.violation.invariant.name, f.violation.message) for f in again.findings] == [
        ("TOKEN", "verifies more drafts than the suite proposed")
    ], [str(f) for f in again.findings]
