"""The entry points of a conformance run: one workload on a fresh adapter (and, for a
workload of several instances, on fresh peers of the same engine), never raising for an
engine's bug. One instance's run is :mod:`refserve.conformance.instance`; several instances
moving requests between them (feature ``migration``) is :mod:`refserve.conformance.migration`.
"""

from __future__ import annotations

from collections.abc import Sequence

from refserve.conformance.adapter import AdapterFactory, EngineAdapter, Feature
from refserve.conformance.fake_kv import POISONED
from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT, AdapterCallError, call
from refserve.conformance.instance import STALL_STEPS, STEP_INVARIANTS, InstanceRun, adapter_traits
from refserve.conformance.migration import run_instances
from refserve.conformance.run_result import Finding, Observed, RunResult
from refserve.conformance.workload import EOS, Workload
from refserve.spec.violation import Invariant, violation


def run_workload(
    adapter: EngineAdapter,
    workload: Workload,
    *,
    peers: Sequence[EngineAdapter] = (),
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
) -> RunResult:
    """Run ``workload`` on a freshly configured ``adapter``; never raises for engine bugs
    (a hang, a raise or a malformed record is a finding of the run).

    A workload of several instances (feature ``migration``) runs on ``adapter`` and
    ``peers``, fresh adapters of the same engine (:func:`run_fresh` builds them); too
    few peers for an engine that has the feature is the caller's ValueError."""
    res = RunResult(workload)
    try:
        features, props = adapter_traits(adapter, call_timeout)
    except AdapterCallError as e:
        res.findings.append(Finding(violation(Invariant.PROGRESS, "adapter", str(e)), -1, "setup"))
        return res
    missing = workload.needs() - features
    if missing:
        res.not_supported = "engine lacks " + ", ".join(sorted(missing))
        return res
    if workload.instances > 1:
        if len(peers) < workload.instances - 1:
            raise ValueError(
                f"the workload runs on {workload.instances} instances; "
                f"{len(peers)} peer adapters given"
            )
        return run_instances([adapter, *peers], workload, call_timeout)
    return InstanceRun(adapter, workload, props, call_timeout).run()


def build(factory: AdapterFactory, call_timeout: float = DEFAULT_CALL_TIMEOUT) -> EngineAdapter:
    """A fresh adapter from ``factory``, through the guard (raises AdapterCallError)."""
    return call("the adapter factory", factory, call_timeout)


def run_fresh(
    factory: AdapterFactory, workload: Workload, *, call_timeout: float = DEFAULT_CALL_TIMEOUT
) -> RunResult:
    """Run ``workload`` on a new adapter (and, for a workload of several instances, on
    new peers from the same factory); a factory that raises or hangs is a finding."""
    res = RunResult(workload)
    try:
        adapter = build(factory, call_timeout)
        peers: list[EngineAdapter] = []
        if workload.instances > 1 and _has_migration(adapter, call_timeout):
            peers = [build(factory, call_timeout) for _ in range(workload.instances - 1)]
    except AdapterCallError as e:
        res.findings.append(Finding(violation(Invariant.PROGRESS, "adapter", str(e)), -1, "setup"))
        return res
    return run_workload(adapter, workload, peers=peers, call_timeout=call_timeout)


def _has_migration(adapter: EngineAdapter, call_timeout: float) -> bool:
    """Whether peers are worth building (unreadable traits: run_workload reports them)."""
    try:
        features, _ = adapter_traits(adapter, call_timeout)
    except AdapterCallError:
        return False
    return Feature.MIGRATION in features


def run_with(factory: AdapterFactory, workload: Workload) -> RunResult:
    return run_fresh(factory, workload)


__all__ = [
    "EOS",
    "POISONED",
    "STALL_STEPS",
    "STEP_INVARIANTS",
    "Finding",
    "Observed",
    "RunResult",
    "adapter_traits",
    "build",
    "run_fresh",
    "run_with",
    "run_workload",
]
