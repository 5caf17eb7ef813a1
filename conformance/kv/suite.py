"""The KV level as a suite: the fixed scenarios, then the generated search, each
finding shrunk apart and reported as :class:`~refserve.conformance.report.Result` records
(:func:`run_kv_suite`); findings a baseline knows are counted, not failed."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any, cast

from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT, AdapterCallError, call
from refserve.conformance.kv.protocol import KVAdapterFactory, KVFeature
from refserve.conformance.kv.run import KV_INVARIANTS, find_signature, replay_workload
from refserve.conformance.kv.scenarios import GENERATED_NAME, kv_scenario_names, kv_scenarios
from refserve.conformance.kv.search import Found, search_kv
from refserve.conformance.kv.shape import as_features
from refserve.conformance.kv.shrink import shrink_kv
from refserve.conformance.kv.workload import KVScenario
from refserve.conformance.report import Failure, Result, ScenarioInfo
from refserve.spec.violation import Invariant


def _note(inv: Invariant, features: frozenset[KVFeature]) -> str:
    if inv is not Invariant.PREFIX:
        return ""
    if KVFeature.PREFIX_CACHING not in features:
        return "partial: no prefix caching; sharing after fork and the KV read-back are checked"
    if KVFeature.CACHE_INDEX not in features:
        return (
            "partial: the adapter exposes no cache index in the spec hash chain; sharing, "
            "hit sizes and the KV read-back (stale hits) are checked"
        )
    return ""


def _results(
    name: str,
    factory: KVAdapterFactory,
    adapter_spec: str,
    checked: set[Invariant],
    found: Mapping[str, Found],
    features: frozenset[KVFeature],
    call_timeout: float,
    suppressed: int,
) -> list[Result]:
    """One Result per invariant checked or failed; each signature shrunk apart."""
    failures: dict[Invariant, list[Failure]] = {}
    for sig, first in found.items():
        best, f, trace = first.workload, first.finding, list(first.trace)
        if not f.timed_out:  # replaying a hang costs a whole time limit per try
            best, run = shrink_kv(factory, best, sig, features=features, call_timeout=call_timeout)
            f, trace = find_signature(run, sig) or f, run.trace
        v = f.violation
        workload = {"kv_adapter": adapter_spec, **best.to_json()}
        failures.setdefault(f.invariant, []).append(
            Failure(
                f.step,
                "kv",
                v.subject,
                v.message,
                v.expected,
                v.seen,
                workload,
                trace,
                signature=sig,
                rule=v.rule,
            )
        )
    results: list[Result] = []
    for inv in KV_INVARIANTS:
        fs = failures.get(inv, [])
        note = _note(inv, features)
        if fs:
            results.append(Result(name, str(inv), "fail", note, fs[0], tuple(fs[1:])))
        elif inv in checked:
            if suppressed and not note:
                note = "known findings suppressed by the baseline"
            results.append(Result(name, str(inv), "pass", note))
    return results


def _not_supported(
    name: str, description: str, kind: str, targets: tuple[str, ...], why: str
) -> tuple[list[Result], ScenarioInfo]:
    results = [Result(name, str(i), "not_supported", why) for i in KV_INVARIANTS]
    return results, ScenarioInfo(name, description, kind, targets, why)


def run_kv_fixed(
    factory: KVAdapterFactory,
    sc: KVScenario,
    features: frozenset[KVFeature] | None,
    *,
    adapter_spec: str = "",
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    known: frozenset[str] = frozenset(),
) -> tuple[list[Result], ScenarioInfo]:
    """One fixed scenario: its results (one per invariant checked) and its info. With
    ``features`` None (unreadable) it runs anyway, so the run reports that fault.
    Findings whose signature is in ``known`` (a baseline) are counted, not failed."""
    missing = sorted(str(f) for f in sc.needs - features) if features is not None else []
    if missing:
        why = f"needs KV feature(s) {', '.join(missing)}"
        return _not_supported(sc.name, sc.description, "fixed", sc.targets, why)
    run = replay_workload(factory, sc.workload, call_timeout)
    if run.not_supported:
        return _not_supported(sc.name, sc.description, "fixed", sc.targets, run.not_supported)
    found: dict[str, Found] = {}
    for f in run.findings:
        found.setdefault(f.signature, Found(run.workload(f.step), f, tuple(run.trace)))
    suppressed = len(found.keys() & known)
    fresh = {sig: x for sig, x in found.items() if sig not in known}
    results = _results(
        sc.name, factory, adapter_spec, run.checked, fresh, run.features, call_timeout, suppressed
    )
    observed: dict[str, Any] = {
        "ops": len(sc.workload.ops),
        "coverage": dict(sorted(run.coverage.items())),
    }
    if suppressed:
        observed["suppressed"] = suppressed
    return results, ScenarioInfo(sc.name, sc.description, "fixed", sc.targets, "", observed)


def run_kv_generated(
    factory: KVAdapterFactory,
    features: frozenset[KVFeature],
    *,
    adapter_spec: str = "",
    max_examples: int = 100,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    known: frozenset[str] = frozenset(),
) -> tuple[list[Result], ScenarioInfo]:
    """The generated search: its results and its info (coverage counts in ``observed``).
    Findings whose signature is in ``known`` are counted, not failed or shrunk."""
    description = (
        "Hypothesis-generated op lists on pools of 1-12 blocks of 1-4 tokens: new requests "
        "with shared prefixes (cache hits; in several key namespaces with feature "
        "key_domains), chunked and decode growth, forks, frees; "
        "every op checked, each distinct finding shrunk."
    )
    targets = tuple(str(i) for i in KV_INVARIANTS)
    out = search_kv(factory, features, max_examples=max_examples, call_timeout=call_timeout)
    if out.not_supported:
        return _not_supported(GENERATED_NAME, description, "generated", targets, out.not_supported)
    fresh = {sig: x for sig, x in out.found.items() if sig not in known}
    suppressed = len(out.found) - len(fresh)
    results = _results(
        GENERATED_NAME,
        factory,
        adapter_spec,
        out.checked,
        fresh,
        features,
        call_timeout,
        suppressed,
    )
    observed: dict[str, Any] = {
        "examples": out.examples,
        "coverage": dict(sorted(out.coverage.items())),
        "distinct_findings": len(fresh),
    }
    if suppressed:
        observed["suppressed"] = suppressed
    if out.stopped:
        observed["stopped"] = out.stopped
    return results, ScenarioInfo(GENERATED_NAME, description, "generated", targets, "", observed)


def probe_features(factory: KVAdapterFactory, call_timeout: float) -> frozenset[KVFeature] | None:
    """The adapter's declared features; None when it cannot say (each run then reports
    the fault itself as a PROGRESS finding)."""
    try:
        adapter = call("factory()", factory, call_timeout)
        raw = call("features", lambda: adapter.features, call_timeout)
        return as_features(raw)
    except (AdapterCallError, TypeError, ValueError):
        return None


def run_kv_suite(
    factory: KVAdapterFactory,
    adapter_spec: str,
    *,
    max_examples: int = 100,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    names: Sequence[str] | None = None,
    known: frozenset[str] = frozenset(),
) -> list[tuple[list[Result], ScenarioInfo]]:
    """The KV level: every fixed scenario (:func:`kv_scenarios`), then ``kv-generated``.

    Returns one ``(results, info)`` pair per scenario, in run order (the fixed ones
    first): the results hold one :class:`Result` per invariant checked (or all
    ``not_supported``), to be appended with the info to a report's lists. ``names``
    selects scenarios (:func:`kv_scenario_names`; an unknown name is a ``ValueError``);
    findings whose signature is in ``known`` (a baseline report's) are counted in the
    info's ``observed["suppressed"]``, not failed.
    """
    wanted = set(names) if names else None
    if wanted is not None and wanted - set(kv_scenario_names()):
        raise ValueError(
            f"unknown KV scenarios: {', '.join(sorted(wanted - set(kv_scenario_names())))}"
        )
    probed = probe_features(factory, call_timeout)
    features = probed if probed is not None else frozenset()
    out: list[tuple[list[Result], ScenarioInfo]] = []
    for sc in kv_scenarios():
        if wanted is None or sc.name in wanted:
            out.append(
                run_kv_fixed(
                    factory,
                    sc,
                    probed,
                    adapter_spec=adapter_spec,
                    call_timeout=call_timeout,
                    known=known,
                )
            )
    if wanted is None or GENERATED_NAME in wanted:
        out.append(
            run_kv_generated(
                factory,
                features,
                adapter_spec=adapter_spec,
                max_examples=max_examples,
                call_timeout=call_timeout,
                known=known,
            )
        )
    return out


def load_kv_factory(spec: str) -> KVAdapterFactory:
    """Resolve ``MODULE:FACTORY`` (e.g. ``refserve.conformance.adapters.ref_kv:make_kv``)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"KV adapter must be MODULE:FACTORY, got {spec!r}")
    module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"{module_name!r} has no callable {attr!r}")
    return cast(KVAdapterFactory, factory)
