"""The declared property ``max_model_len_stop`` (refserve.conformance.adapter.EngineProperties).

A request that reaches the ``max_model_len`` its snapshot reports may (and then must)
finish there with reason ``length`` when the adapter declares it; vLLM does
(conformance/FINDINGS_vllm.md, finding 1), and so does refserve. The check still fails a
``length`` stop anywhere else before ``max_tokens``, every such stop when the property is
not declared, a wrong reason at the limit and a request that runs past it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pytest

from refserve.conformance.adapter import CommitReport, EngineConfig, EngineProperties
from refserve.conformance.adapters.ref import REF_PROPERTIES, RefAdapter
from refserve.conformance.adapters.ref import make as make_ref
from refserve.conformance.runner import RunResult, run_workload
from refserve.conformance.suite import run_suite
from refserve.conformance.workload import EOS, RequestPlan, Workload
from refserve.spec.snapshot import EngineSnapshot

LIMIT = 10
"""The workload's max_model_len: A's 6-token prompt plus 4 outputs, before its 8."""

WORKLOAD = Workload(
    config=EngineConfig(
        block_size=4,
        num_blocks=8,
        max_num_batched_tokens=16,
        max_num_seqs=2,
        max_model_len=LIMIT,
        eos_token_id=EOS,
    ),
    requests=(
        RequestPlan("A", (6, 29, 45, 61, 15, 31), max_tokens=8),
        RequestPlan("B", (7, 8, 9), max_tokens=2),
    ),
)
UNDECLARED = dataclasses.replace(REF_PROPERTIES, max_model_len_stop=False)


def _kvlen(res: RunResult) -> list[str]:
    return [f.violation.message for f in res.findings if str(f.invariant) == "KVLEN"]


class Undeclared(RefAdapter):
    """refserve, correct, but without the declaration: its stop at the limit is a finding."""

    properties = UNDECLARED


class ReportsALongerLimit(RefAdapter):
    """Corrupted: every snapshot reports max_model_len + 1, so the engine's length stop
    is not at the limit it reports (an early stop)."""

    def snapshot(self) -> EngineSnapshot:
        s = super().snapshot()
        reqs = tuple(dataclasses.replace(r, max_model_len=r.max_model_len + 1) for r in s.requests)
        return dataclasses.replace(s, requests=reqs)


class WrongReasonAtTheLimit(RefAdapter):
    """Corrupted: the stop at the limit is reported as ``stop`` (eos) instead of length."""

    def commit(self, sampled: Mapping[str, int]) -> CommitReport:
        done = super().commit(sampled)
        return CommitReport(tuple((rid, "stop") for rid, _ in done.finished if rid == "A"))


class RunsPastTheLimit(RefAdapter):
    """Corrupted: the engine's own limit is far away, yet its snapshots report the
    workload's: the request reaches the reported limit and keeps running."""

    def configure(self, config: EngineConfig) -> None:
        super().configure(dataclasses.replace(config, max_model_len=1 << 20))

    def snapshot(self) -> EngineSnapshot:
        s = super().snapshot()
        reqs = tuple(dataclasses.replace(r, max_model_len=LIMIT) for r in s.requests)
        return dataclasses.replace(s, requests=reqs)


def test_refserve_declares_it_and_stops_at_the_limit_cleanly() -> None:
    assert RefAdapter.properties.max_model_len_stop is True
    res = run_workload(make_ref(), WORKLOAD)
    assert res.findings == [], [f.violation for f in res.findings]
    assert res.observed.finish_reasons == {"length": 2}
    # A stopped at the limit (4 outputs), not at its max_tokens 8.
    steps = [t for t in res.trace if any(f[0] == "A" for f in t.get("finished", ()))]
    assert len(steps) == 1
    sampled_a = sum(1 for t in res.trace if "A" in t.get("sampled", {}))
    assert sampled_a == LIMIT - 6


def test_without_the_declaration_a_length_stop_at_the_limit_fails() -> None:
    res = run_workload(Undeclared(), WORKLOAD)
    assert _kvlen(res) == [
        "finished with reason length after 4 outputs without a stop (it reached the "
        "max_model_len 10 its snapshot reports: an engine that stops there declares "
        "EngineProperties(max_model_len_stop=True))"
    ]


def test_a_length_stop_before_the_reported_limit_still_fails() -> None:
    res = run_workload(ReportsALongerLimit(), WORKLOAD)
    assert _kvlen(res) == ["finished with reason length after 4 outputs without a stop"]


def test_a_stop_at_the_limit_must_say_length() -> None:
    res = run_workload(WrongReasonAtTheLimit(), WORKLOAD)
    assert "reached its max_model_len 10 and finished with reason stop, not length" in _kvlen(res)


def test_reaching_the_reported_limit_without_stopping_fails() -> None:
    res = run_workload(RunsPastTheLimit(), WORKLOAD)
    msgs = _kvlen(res)
    assert msgs[0] == "reached its max_model_len 10 (10 tokens) but kept running", msgs
    assert "num_tokens exceeds max_model_len" in msgs  # the snapshot check, next step


def test_the_property_is_validated_and_reported() -> None:
    with pytest.raises(ValueError, match="max_model_len_stop must be a bool, got 1"):
        EngineProperties(max_model_len_stop=1)  # type: ignore[arg-type]
    assert EngineProperties().max_model_len_stop is False
    report = run_suite(
        make_ref, "refserve.conformance.adapters.ref:make", ["seed001-round-by-round"]
    )
    assert report.properties["max_model_len_stop"] is True
    assert any(n.startswith("max_model_len_stop:") for n in report.notes)
    undeclared = run_suite(Undeclared, "x:y", ["seed001-round-by-round"])
    assert undeclared.properties["max_model_len_stop"] is False
    assert not any(n.startswith("max_model_len_stop:") for n in undeclared.notes)
