"""Run the scenario library and the generated searches on one adapter; build the report.

A fixed scenario's failure is shrunk greedily (drop requests, shorten prompts and outputs,
move arrivals earlier, shrink the limits) while the same invariant still fails; a
generated one is shrunk by Hypothesis. Either way the report carries the minimal workload
and the trace of running it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import Any

from conformance.adapter import AdapterFactory, Feature
from conformance.generate import GENERATED, search
from conformance.report import Failure, Report, Result, ScenarioInfo
from conformance.runner import Finding, RunResult, run_workload
from conformance.scenarios import library
from conformance.workload import Scenario, Workload
from spec.violation import Invariant

ALL_INVARIANTS = tuple(Invariant)
MAX_SHRINK_RUNS = 400


def scenario_names() -> list[str]:
    return [s.name for s in library()] + [g.name for g in GENERATED]


def _candidates(w: Workload) -> Iterator[Workload]:
    reqs = w.requests
    for i in range(len(reqs)):
        if len(reqs) > 1:
            yield dataclasses.replace(w, requests=reqs[:i] + reqs[i + 1 :])
    for i, r in enumerate(reqs):

        def put(**kw: Any) -> Workload:
            new = dataclasses.replace(r, **kw)  # noqa: B023 - used at once
            return dataclasses.replace(w, requests=(*reqs[:i], new, *reqs[i + 1 :]))  # noqa: B023

        if r.abort_at is not None:
            yield put(abort_at=None)
        if r.stop_at is not None:
            yield put(stop_at=None)
        if r.max_tokens > 1:
            yield put(max_tokens=r.max_tokens - 1, stop_at=None)
        if len(r.prompt) > 1:
            yield put(prompt=r.prompt[:-1])
            yield put(prompt=r.prompt[1:])
        if r.arrival > 0:
            yield put(arrival=0)
            yield put(arrival=r.arrival - 1)
        if r.priority:
            yield put(priority=0)
    for j in range(len(w.rollback_at)):
        yield dataclasses.replace(w, rollback_at=w.rollback_at[:j] + w.rollback_at[j + 1 :])
    c = w.config
    for name in ("num_blocks", "max_num_seqs", "max_num_batched_tokens", "block_size"):
        if getattr(c, name) > 1:
            yield dataclasses.replace(
                w, config=dataclasses.replace(c, **{name: getattr(c, name) - 1})
            )


def signature(f: Finding) -> tuple[Invariant, str]:
    """What makes two findings the same bug: invariant and message, numbers blanked
    (a crash keeps its ``file:line``), so shrinking cannot swap one bug for another."""
    return f.invariant, re.sub(r"(?<![:\d])\d+", "#", f.violation.message)


def shrink(factory: AdapterFactory, w: Workload, inv: Invariant) -> RunResult:
    """Greedy delta-debugging: the smallest workload found that still fails ``inv`` with
    the same :func:`signature` as the first such finding."""
    best = run_workload(factory(), w)
    target = next((signature(f) for f in best.findings if f.invariant is inv), None)
    runs = 0
    improved = True
    while improved and runs < MAX_SHRINK_RUNS:
        improved = False
        for cand in _candidates(best.workload):
            runs += 1
            r = run_workload(factory(), cand)
            if not r.not_supported and any(signature(f) == target for f in r.findings):
                best = r
                improved = True
                break
            if runs >= MAX_SHRINK_RUNS:
                break
    return best


def _failure(run: RunResult, inv: Invariant, sig: tuple[Invariant, str] | None = None) -> Failure:
    f = next(x for x in run.findings if x.invariant is inv and (sig is None or signature(x) == sig))
    v = f.violation
    return Failure(
        f.step, f.phase, v.subject, v.message, v.expected, v.seen, run.workload.to_json(), run.trace
    )


def _notes_for(inv: Invariant, features: frozenset[Feature]) -> str:
    if inv is Invariant.PREFIX and Feature.CACHE_INDEX not in features:
        return (
            "partial: the adapter exposes no cache index in the spec hash chain; sharing, "
            "writes into shared blocks, hit sizes and the KV read-back are checked"
        )
    return ""


def run_fixed(factory: AdapterFactory, sc: Scenario) -> tuple[list[Result], ScenarioInfo]:
    adapter = factory()
    features = adapter.features
    run = run_workload(adapter, sc.workload)
    golden: dict[str, Any] | None = None
    if sc.golden is not None and not run.not_supported:
        observed = run.observed.rounds[sc.golden_from_step : sc.golden_from_step + len(sc.golden)]
        golden = {
            "from_step": sc.golden_from_step,
            "expected": [[list(x) for x in rnd] for rnd in sc.golden],
            "observed": [[list(x) for x in rnd] for rnd in observed],
            "matches": tuple(observed) == sc.golden,
        }
    info = ScenarioInfo(
        sc.name,
        sc.description,
        "fixed",
        sc.targets,
        run.not_supported,
        run.observed.to_json() if not run.not_supported else {},
        golden,
    )
    if run.not_supported:
        return [
            Result(sc.name, str(i), "not_supported", run.not_supported) for i in ALL_INVARIANTS
        ], info
    results: list[Result] = []
    failed = {f.invariant for f in run.findings}
    for inv in ALL_INVARIANTS:
        if inv not in run.checked:
            continue
        note = _notes_for(inv, features)
        if inv in failed:
            sig = next(signature(f) for f in run.findings if f.invariant is inv)
            shrunk = shrink(factory, sc.workload, inv)
            results.append(Result(sc.name, str(inv), "fail", note, _failure(shrunk, inv, sig)))
        else:
            results.append(Result(sc.name, str(inv), "pass", note))
    return results, info


def run_generated(
    factory: AdapterFactory, name: str, max_examples: int
) -> tuple[list[Result], ScenarioInfo]:
    g = next(x for x in GENERATED if x.name == name)
    features = factory().features
    out = search(factory, g.kind, max_examples=max_examples)
    by_inv: dict[Invariant, RunResult] = {}
    for r in out.failures:
        first = r.first()
        if first is not None and first.invariant not in by_inv:
            by_inv[first.invariant] = r
    results: list[Result] = []
    for inv in ALL_INVARIANTS:
        if inv not in out.checked and inv not in by_inv:
            continue
        note = _notes_for(inv, features)
        if inv in by_inv:
            results.append(Result(name, str(inv), "fail", note, _failure(by_inv[inv], inv)))
        else:
            results.append(Result(name, str(inv), "pass", note))
    observed: dict[str, Any] = {"examples": out.examples, "coverage": out.coverage}
    return results, ScenarioInfo(name, g.description, "generated", (), "", observed)


def _policy(infos: Sequence[ScenarioInfo]) -> dict[str, Any]:
    fixed = [i for i in infos if i.kind == "fixed" and i.observed]

    def total(key: str) -> int:
        return sum(int(i.observed.get(key, 0)) for i in fixed)

    paused = [i.name for i in fixed if i.observed.get("decodes_paused_for_prefill")]
    golden = [i for i in infos if i.golden is not None]
    return {
        "mixed_prefill_decode_steps": total("mixed_steps"),
        "prefill_first_steps": total("decodes_paused_for_prefill"),
        "prefill_first_scenarios": paused,
        "chunked_prompts": total("chunked_prompts"),
        "preemptions": total("preemptions"),
        "prefix_cached_tokens": total("cached_tokens"),
        "golden_matches": sum(1 for i in golden if i.golden and i.golden.get("matches")),
        "golden_mismatches": [i.name for i in golden if i.golden and not i.golden.get("matches")],
    }


def run_suite(
    factory: AdapterFactory,
    adapter_spec: str,
    names: Sequence[str] | None = None,
    *,
    max_examples: int = 100,
) -> Report:
    """Every selected scenario (default: all) on a fresh adapter each run."""
    probe = factory()
    wanted = set(names) if names else None
    if wanted is not None:
        unknown = wanted - set(scenario_names())
        if unknown:
            raise ValueError(f"unknown scenarios: {', '.join(sorted(unknown))}")
    results: list[Result] = []
    infos: list[ScenarioInfo] = []
    for sc in library():
        if wanted is None or sc.name in wanted:
            rs, info = run_fixed(factory, sc)
            results += rs
            infos.append(info)
    for g in GENERATED:
        if wanted is None or g.name in wanted:
            rs, info = run_generated(factory, g.name, max_examples)
            results += rs
            infos.append(info)
    notes: list[str] = []
    missing = sorted(str(f) for f in frozenset(Feature) - probe.features)
    if missing:
        notes.append(f"features the engine lacks (their scenarios are not_supported): {missing}")
    return Report(
        adapter_spec,
        probe.name,
        tuple(sorted(str(f) for f in probe.features)),
        tuple(results),
        tuple(infos),
        _policy(infos),
        tuple(notes),
    )
