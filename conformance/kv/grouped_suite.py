"""The grouped KV level as a suite: its fixed scenarios, then the generated search, each
finding shrunk apart and reported as :class:`~refserve.conformance.report.Result`
records (:func:`run_grouped_kv_suite`), as the plain KV level reports
(:mod:`refserve.conformance.kv.suite`). Scenarios are named ``kv-groups-*``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, cast

from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT, AdapterCallError, call
from refserve.conformance.kv.grouped_run import find_signature, replay_grouped_workload
from refserve.conformance.kv.grouped_search import GroupedFound, search_grouped, shrink_grouped
from refserve.conformance.kv.grouped_workload import GroupedScenario, GroupedWorkload, layout
from refserve.conformance.kv.groups import GroupedKVAdapterFactory, GroupedKVConfig
from refserve.conformance.kv.protocol import KVFeature
from refserve.conformance.kv.run import KV_INVARIANTS
from refserve.conformance.kv.shape import as_features
from refserve.conformance.report import Failure, Result, ScenarioInfo

GROUPED_GENERATED = "kv-groups-generated"
GROUPED_TARGETS = tuple(str(i) for i in KV_INVARIANTS)
GROUPED_ADAPTER_MEMBERS = (("name", "features"), ("configure", "allocate", "free", "snapshot"))
"""The data members and methods of a grouped KV adapter (the CLI's check of a factory)."""


def _new(rid: str, prompt: list[int], n: int) -> dict[str, Any]:
    return {"op": "new", "rid": rid, "prompt": prompt, "n": n}


def _grow(rid: str, append: list[int], n: int) -> dict[str, Any]:
    return {"op": "grow", "rid": rid, "append": append, "n": n}


def _free(rid: str) -> dict[str, Any]:
    return {"op": "free", "rid": rid}


def grouped_scenarios() -> list[GroupedScenario]:
    """The fixed grouped scenarios, each a workload the search could draw, named for
    what it makes happen."""
    p14 = [1, 2, 0, 1, 2, 2, 0, 1, 1, 0, 2, 1, 0, 2]
    slide = GroupedWorkload(
        GroupedKVConfig(12, 4, layout(5)),
        (
            _new("r1", p14[:11], 6),
            _grow("r1", [], 5),
            *(_grow("r1", [i % 3], 1) for i in range(9)),
            _free("r1"),
        ),
    )
    shared = GroupedWorkload(
        GroupedKVConfig(24, 4, layout(3, 6)),
        (
            _new("r1", p14, 14),
            _grow("r1", [0], 1),
            _grow("r1", [1], 1),
            _new("r2", [*p14, 0, 1, 2], 4),
            _grow("r2", [], 3),
            _free("r1"),
            *(_grow("r2", [i % 3], 1) for i in range(5)),
            _free("r2"),
        ),
    )
    evicted = GroupedWorkload(
        GroupedKVConfig(16, 2, layout(3)),
        (
            _new("r1", p14[:10], 10),
            _grow("r1", [2], 1),
            _new("r3", [2] * 8, 8),
            _new("r2", [*p14[:10], 0], 3),
            _free("r3"),
            _new("r2", [*p14[:10], 0], 3),
            _grow("r2", [1], 1),
            _free("r1"),
            _free("r2"),
        ),
    )
    return [
        GroupedScenario(
            "kv-groups-slide",
            "one full group and a window of 5 over blocks of 4: a chunked prompt, then "
            "decodes, so the window crosses a block boundary mid-block again and again",
            slide,
        ),
        GroupedScenario(
            "kv-groups-shared-hit",
            "windows of 3 and 6 beside a full group: a second request hits the first "
            "one's prefix while it lives (window blocks shared), then outlives it",
            shared,
        ),
        GroupedScenario(
            "kv-groups-evicted-hit",
            "a window of 3, blocks of 2, a full pool: the window blocks a request left go "
            "back to the pool and are reused, a refused allocation, then a request whose "
            "prefix is cached in the full group but no longer in the window group",
            evicted,
        ),
    ]


def grouped_scenario_names() -> list[str]:
    return [s.name for s in grouped_scenarios()] + [GROUPED_GENERATED]


def _results(
    name: str,
    factory: GroupedKVAdapterFactory,
    adapter_spec: str,
    checked: set[Any],
    found: Mapping[str, GroupedFound],
    call_timeout: float,
    suppressed: int,
) -> list[Result]:
    """One Result per invariant checked or failed; each signature shrunk apart."""
    failures: dict[str, list[Failure]] = {}
    for sig, first in found.items():
        best, f, trace = first.workload, first.finding, list(first.trace)
        if not f.timed_out:  # replaying a hang costs a whole time limit per try
            best, run = shrink_grouped(factory, best, sig, call_timeout=call_timeout)
            f, trace = find_signature(run, sig) or f, run.trace
        v = f.violation
        workload = {"grouped_kv_adapter": adapter_spec, **best.to_json()}
        failures.setdefault(str(f.invariant), []).append(
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
        fs = failures.get(str(inv), [])
        if fs:
            results.append(Result(name, str(inv), "fail", "", fs[0], tuple(fs[1:])))
        elif inv in checked:
            note = "known findings suppressed by the baseline" if suppressed else ""
            results.append(Result(name, str(inv), "pass", note))
    return results


def _not_supported(
    name: str, description: str, kind: str, why: str
) -> tuple[list[Result], ScenarioInfo]:
    results = [Result(name, str(i), "not_supported", why) for i in KV_INVARIANTS]
    return results, ScenarioInfo(name, description, kind, GROUPED_TARGETS, why)


def run_grouped_fixed(
    factory: GroupedKVAdapterFactory,
    sc: GroupedScenario,
    features: frozenset[KVFeature],
    *,
    adapter_spec: str = "",
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    known: frozenset[str] = frozenset(),
) -> tuple[list[Result], ScenarioInfo]:
    """One fixed grouped scenario: its results and its info."""
    missing = sorted(str(f) for f in sc.needs - features)
    if missing:
        return _not_supported(sc.name, sc.description, "fixed", f"needs {', '.join(missing)}")
    run = replay_grouped_workload(factory, sc.workload, call_timeout)
    if run.not_supported:
        return _not_supported(sc.name, sc.description, "fixed", run.not_supported)
    found: dict[str, GroupedFound] = {}
    for f in run.findings:
        found.setdefault(f.signature, GroupedFound(run.workload(f.step), f, tuple(run.trace)))
    fresh = {sig: x for sig, x in found.items() if sig not in known}
    suppressed = len(found) - len(fresh)
    results = _results(sc.name, factory, adapter_spec, run.checked, fresh, call_timeout, suppressed)
    observed: dict[str, Any] = {
        "ops": len(sc.workload.ops),
        "coverage": dict(sorted(run.coverage.items())),
    }
    if suppressed:
        observed["suppressed"] = suppressed
    info = ScenarioInfo(sc.name, sc.description, "fixed", GROUPED_TARGETS, "", observed)
    return results, info


def run_grouped_generated(
    factory: GroupedKVAdapterFactory,
    features: frozenset[KVFeature],
    *,
    adapter_spec: str = "",
    max_examples: int = 100,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    known: frozenset[str] = frozenset(),
) -> tuple[list[Result], ScenarioInfo]:
    """The generated grouped search: its results and its info."""
    description = (
        "Hypothesis-generated op lists on one full group plus one or two window groups "
        "(windows mostly not a multiple of the block size) over a shared pool of blocks "
        "of 1-4 tokens: long prompts with shared prefixes (cache hits), chunked and "
        "decode growth, frees, NoSpace; every op checked, each distinct finding shrunk."
    )
    out = search_grouped(factory, features, max_examples=max_examples, call_timeout=call_timeout)
    if out.not_supported:
        return _not_supported(GROUPED_GENERATED, description, "generated", out.not_supported)
    fresh = {sig: x for sig, x in out.found.items() if sig not in known}
    suppressed = len(out.found) - len(fresh)
    results = _results(
        GROUPED_GENERATED, factory, adapter_spec, out.checked, fresh, call_timeout, suppressed
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
    info = ScenarioInfo(GROUPED_GENERATED, description, "generated", GROUPED_TARGETS, "", observed)
    return results, info


def run_grouped_kv_suite(
    factory: GroupedKVAdapterFactory,
    adapter_spec: str,
    *,
    max_examples: int = 100,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    known: frozenset[str] = frozenset(),
) -> list[tuple[list[Result], ScenarioInfo]]:
    """The grouped KV level: every fixed scenario, then ``kv-groups-generated``; one
    ``(results, info)`` pair per scenario, as :func:`run_kv_suite` returns them.
    Findings whose signature is in ``known`` are counted, not failed."""
    probed = _probe_features(factory, call_timeout)
    out = [
        run_grouped_fixed(
            factory, sc, probed, adapter_spec=adapter_spec, call_timeout=call_timeout, known=known
        )
        for sc in grouped_scenarios()
    ]
    out.append(
        run_grouped_generated(
            factory,
            probed,
            adapter_spec=adapter_spec,
            max_examples=max_examples,
            call_timeout=call_timeout,
            known=known,
        )
    )
    return out


def _probe_features(factory: GroupedKVAdapterFactory, call_timeout: float) -> frozenset[KVFeature]:
    """The adapter's declared features; none when it cannot say (each run then reports
    the fault itself as a PROGRESS finding)."""
    try:
        adapter = call("factory()", factory, call_timeout)
        return as_features(call("features", lambda: adapter.features, call_timeout))
    except (AdapterCallError, TypeError, ValueError):
        return frozenset()


def load_grouped_kv_factory(spec: str) -> GroupedKVAdapterFactory:
    """Resolve ``MODULE:FACTORY`` to a grouped KV adapter factory."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"grouped KV adapter must be MODULE:FACTORY, got {spec!r}")
    module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"{module_name!r} has no callable {attr!r}")
    return cast(GroupedKVAdapterFactory, factory)
