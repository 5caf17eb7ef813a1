"""Run the scenario library and the generated searches on one adapter; build the report.

Every finding is reduced to its signature (:mod:`refserve.conformance.shrink`); each distinct
signature of a scenario is shrunk apart, keeping that exact signature, and reported with
its own minimal workload and trace. A generated scenario spends its whole example budget
whatever it finds. Signatures listed in a baseline report are suppressed (counted, not
failed), so a search can be pointed past known bugs. Results are handed to ``on_result``
as each scenario completes, which is how the CLI streams a partial report.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from refserve.conformance.adapter import AdapterFactory, EngineProperties, Feature, StepOrder
from refserve.conformance.generate import GENERATED, search
from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT, AdapterCallError
from refserve.conformance.report import Failure, Report, Result, ScenarioInfo, signature_of
from refserve.conformance.runner import STEP_INVARIANTS, RunResult, adapter_traits, build, run_fresh
from refserve.conformance.scenarios import library
from refserve.conformance.shrink import distinct, shrink, signature
from refserve.conformance.workload import Scenario
from refserve.spec.violation import CLUSTER_INVARIANTS, Invariant

ALL_INVARIANTS = tuple(Invariant)

#: What a run on one engine checks (the step invariants, ATOMIC, ORDER when declared).
ENGINE_CHECKS = tuple(
    i for i in ALL_INVARIANTS if i in STEP_INVARIANTS or i in (Invariant.ATOMIC, Invariant.ORDER)
)


def invariants_for(needs: frozenset[Feature]) -> tuple[Invariant, ...]:
    """The invariants a scenario needing ``needs`` would check, what it lists as
    ``not_supported`` when the engine cannot run it: one engine's, plus the migration
    rules (spec/cluster.py) when it runs on several instances."""
    if Feature.MIGRATION in needs:
        return tuple(i for i in ALL_INVARIANTS if i in ENGINE_CHECKS or i in CLUSTER_INVARIANTS)
    return ENGINE_CHECKS


OnResult = Callable[[list[Result], ScenarioInfo], None]
"""Called once per scenario, in order, with its results (for streaming reports)."""


def scenario_names() -> list[str]:
    return [s.name for s in library()] + [g.name for g in GENERATED]


def _failure(run: RunResult, sig: str) -> Failure:
    f = next(x for x in run.findings if signature(x) == sig)
    v = f.violation
    return Failure(
        f.step,
        f.phase,
        v.subject,
        v.message,
        v.expected,
        v.seen,
        run.workload.to_json(),
        run.trace,
        sig,
        v.rule,
    )


def _results(
    name: str,
    checked: set[Invariant],
    failures: dict[str, RunResult],
    features: frozenset[Feature],
    suppressed: int,
) -> list[Result]:
    """One Result per checked invariant; each distinct signature its own Failure."""
    by_inv: dict[Invariant, list[Failure]] = {}
    for sig, run in failures.items():
        inv = Invariant(sig.split(" ", 1)[0])
        by_inv.setdefault(inv, []).append(_failure(run, sig))
    results: list[Result] = []
    for inv in ALL_INVARIANTS:
        if inv not in checked and inv not in by_inv:
            continue
        note = _notes_for(inv, features)
        fs = by_inv.get(inv, [])
        if fs:
            results.append(Result(name, str(inv), "fail", note, fs[0], tuple(fs[1:])))
        else:
            if suppressed and not note:
                note = "known findings suppressed by the baseline"
            results.append(Result(name, str(inv), "pass", note))
    return results


def _notes_for(inv: Invariant, features: frozenset[Feature]) -> str:
    if inv is Invariant.PREFIX and Feature.CACHE_INDEX not in features:
        return (
            "partial: the adapter exposes no cache index in the spec hash chain; sharing, "
            "writes into shared blocks, hit sizes and the KV read-back are checked"
        )
    return ""


def run_fixed(
    factory: AdapterFactory,
    sc: Scenario,
    features: frozenset[Feature],
    *,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    known: frozenset[str] = frozenset(),
) -> tuple[list[Result], ScenarioInfo]:
    def run(w: Any) -> RunResult:
        return run_fresh(factory, w, call_timeout=call_timeout)

    first = run(sc.workload)
    golden: dict[str, Any] | None = None
    if sc.golden is not None and not first.not_supported:
        observed = first.observed.rounds[sc.golden_from_step : sc.golden_from_step + len(sc.golden)]
        golden = {
            "from_step": sc.golden_from_step,
            "expected": [[list(x) for x in rnd] for rnd in sc.golden],
            "observed": [[list(x) for x in rnd] for rnd in observed],
            # Within a step the order of the plan is the engine's business.
            "matches": [sorted(r) for r in observed] == [sorted(r) for r in sc.golden],
        }
    fresh = distinct(first.findings, known)
    suppressed = len({signature(f) for f in first.findings}) - len(fresh)
    observed_json = first.observed.to_json() if not first.not_supported else {}
    if suppressed:
        observed_json["suppressed"] = suppressed
    info = ScenarioInfo(
        sc.name,
        sc.description,
        "fixed",
        sc.targets,
        first.not_supported,
        observed_json,
        golden,
    )
    if first.not_supported:
        return [
            Result(sc.name, str(i), "not_supported", first.not_supported)
            for i in invariants_for(sc.needs())
        ], info
    shrunk = {sig: shrink(run, first, sig) for sig in fresh}
    return _results(sc.name, first.checked, shrunk, features, suppressed), info


def run_generated(
    factory: AdapterFactory,
    name: str,
    max_examples: int,
    features: frozenset[Feature],
    *,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    known: frozenset[str] = frozenset(),
) -> tuple[list[Result], ScenarioInfo]:
    g = next(x for x in GENERATED if x.name == name)
    missing = g.requires - features
    if missing:
        why = "engine lacks " + ", ".join(sorted(missing))
        info = ScenarioInfo(name, g.description, "generated", (), why, {})
        rows = [Result(name, str(i), "not_supported", why) for i in invariants_for(g.requires)]
        return rows, info
    out = search(
        factory,
        g.kind,
        max_examples=max_examples,
        call_timeout=call_timeout,
        known=known,
        features=features,
    )
    results = _results(name, out.checked, out.failures, features, out.suppressed)
    observed: dict[str, Any] = {
        "examples": out.examples,
        "distinct_findings": len(out.failures),
        "coverage": out.coverage,
    }
    if out.suppressed:
        observed["suppressed"] = out.suppressed
    return results, ScenarioInfo(name, g.description, "generated", (), "", observed)


def _policy(infos: Sequence[ScenarioInfo], props: EngineProperties) -> dict[str, Any]:
    fixed = [i for i in infos if i.kind == "fixed" and i.observed]

    def total(key: str) -> int:
        return sum(int(i.observed.get(key, 0)) for i in fixed)

    paused = [i.name for i in fixed if i.observed.get("decodes_paused_for_prefill")]
    # An empty golden record is neither a match nor a mismatch.
    golden = [(i.name, bool(i.golden.get("matches"))) for i in infos if i.golden]
    out: dict[str, Any] = {
        "mixed_prefill_decode_steps": total("mixed_steps"),
        "prefill_first_steps": total("decodes_paused_for_prefill"),
        "prefill_first_scenarios": paused,
        "chunked_prompts": total("chunked_prompts"),
        "preemptions": total("preemptions"),
        "prefix_cached_tokens": total("cached_tokens"),
        "golden_matches": sum(1 for _, matches in golden if matches),
        "golden_mismatches": [name for name, matches in golden if not matches],
    }
    declared = props.step_order
    if declared is not StepOrder.UNSPECIFIED:
        seen = "prefill_first" if paused else "decode_first"
        out["step_order"] = {"declared": str(declared), "observed": seen}
    return out


def _notes(features: frozenset[Feature], props: EngineProperties) -> list[str]:
    notes: list[str] = []
    missing = sorted(str(f) for f in frozenset(Feature) - features)
    if missing:
        notes.append(f"features the engine lacks (their scenarios are not_supported): {missing}")
    ml = props.multi_level
    if ml is not None:
        within = "priority, then arrival" if ml.by_priority else "arrival"
        notes.append(
            f"multi_level: a preemptive multi-level queue of {ml.num_levels} levels, "
            f"declared instead of an admission and a step order; ORDER checks admission "
            f"by level, then {within} within a level (rule level-admission), and "
            "preemption only for a higher level (rule level-preemption)"
        )
    elif props.admission_order.value == "unspecified":
        notes.append("admission order: unspecified by the adapter, not checked (ORDER)")
    if props.lookahead_slots:
        notes.append(
            f"lookahead_slots {props.lookahead_slots}: tables may hold the blocks of "
            f"{props.lookahead_slots} slots ahead of their KV (POS)"
        )
    if props.same_step_prefix_hits:
        notes.append(
            "same_step_prefix_hits: a request may hit a block another fills in the same "
            "step, and with prefix caching on it does (PREFIX, rule declared-same-step-hits)"
        )
    if not props.eos:
        notes.append(
            "eos: the engine has no eos handling; the eos tokens the suite sampled were "
            "held to keep requests running (KVLEN, rule declared-eos)"
        )
    if not props.free_queue_order:
        notes.append("free_queue_order: the free queue is unordered; hand-out order not checked")
    if props.max_model_len_stop:
        notes.append(
            "max_model_len_stop: a request stops with reason length at the max_model_len "
            "its snapshot reports (KVLEN checks the stop there)"
        )
    if Feature.MIGRATION not in features:
        notes.append(
            "migration: not declared, so no request was moved between instances: the "
            "migration scenarios are not_supported and the migration rules (one owner, "
            "tokens conserved, the K/V identical after a move, no block leaked on either "
            "side) are not checked"
        )
    if props.step_order is StepOrder.PREFILL_FIRST:
        notes.append("golden schedules are decode-first: a prefill-first engine differs by design")
    return notes


def run_suite(
    factory: AdapterFactory,
    adapter_spec: str,
    names: Sequence[str] | None = None,
    *,
    max_examples: int = 100,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    baseline: frozenset[str] = frozenset(),
    on_result: OnResult | None = None,
    on_start: Callable[[str], None] | None = None,
) -> Report:
    """Every selected scenario (default: all) on a fresh adapter each run.

    Raises ``ValueError`` for unknown scenario names. An adapter whose factory, features
    or properties cannot be read gets one finding (scenario ``adapter``) instead.
    """
    wanted = set(names) if names else None
    if wanted is not None:
        unknown = wanted - set(scenario_names())
        if unknown:
            raise ValueError(f"unknown scenarios: {', '.join(sorted(unknown))}")
    results: list[Result] = []
    infos: list[ScenarioInfo] = []

    def done(rs: list[Result], info: ScenarioInfo) -> None:
        results.extend(rs)
        infos.append(info)
        if on_result is not None:
            on_result(rs, info)

    try:
        probe = build(factory, call_timeout)
        features, props = adapter_traits(probe, call_timeout)
        name = _engine_name(probe, call_timeout)
    except AdapterCallError as e:
        done(*_setup_failure(e))
        return Report(adapter_spec, "unknown", (), tuple(results), tuple(infos), {}, ())
    for sc in library():
        if wanted is None or sc.name in wanted:
            if on_start is not None:
                on_start(sc.name)
            done(*run_fixed(factory, sc, features, call_timeout=call_timeout, known=baseline))
    for g in GENERATED:
        if wanted is None or g.name in wanted:
            if on_start is not None:
                on_start(g.name)
            done(
                *run_generated(
                    factory,
                    g.name,
                    max_examples,
                    features,
                    call_timeout=call_timeout,
                    known=baseline,
                )
            )
    return Report(
        adapter_spec,
        name,
        tuple(sorted(str(f) for f in features)),
        tuple(results),
        tuple(infos),
        _policy(infos, props),
        tuple(_notes(features, props)),
        properties=props.to_json(),
    )


def _engine_name(adapter: object, call_timeout: float) -> str:
    from refserve.conformance.guard import call

    name = call("name", lambda: getattr(adapter, "name", "unnamed"), call_timeout)
    return name if isinstance(name, str) else repr(name)


def _setup_failure(e: AdapterCallError) -> tuple[list[Result], ScenarioInfo]:
    """The adapter could not even be built or described: one PROGRESS finding."""
    msg = str(e)
    sig = signature_of(Invariant.PROGRESS, "adapter", msg)
    f = Failure(-1, "setup", "adapter", msg, "", "", {}, [], sig)
    info = ScenarioInfo("adapter", "Building the adapter and reading its traits.", "setup")
    return [Result("adapter", str(Invariant.PROGRESS), "fail", "", f)], info
