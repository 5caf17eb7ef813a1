"""Run corpus entries: the buggy side must be caught, the clean side must pass.

For each entry reachable here (its engine imports), both adapter factories run the
entry's detector scenarios on fresh adapters. The buggy side's first finding of each
failing scenario is shrunk (the suite's own delta debugging), and the shortest such
counterexample's step count is recorded. The clean side must finish every scenario with
zero findings and none of them ``not_supported`` (a run that could not happen proves
nothing). Then the buggy side also runs every scenario the library had before the
corpus, counting only the findings of the rules that existed then, that the clean side
does not give, and that are of the same kind (rule, message) as the entry's own
findings: none means the suite of before would have missed the bug.

Nothing here raises for an engine's fault: an adapter that fails to import, a factory
that raises, a scenario that hangs become a reported line, never a traceback.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from refserve.conformance.adapter import AdapterFactory, NotSupported, load_factory
from refserve.conformance.corpus.entry import NEW_RULES, Entry
from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT
from refserve.conformance.kv.run import replay_kv
from refserve.conformance.kv.scenarios import KV_CORPUS_SCENARIOS, kv_scenarios
from refserve.conformance.kv.suite import load_kv_factory
from refserve.conformance.kv.workload import KVFinding
from refserve.conformance.run_result import Finding, RunResult
from refserve.conformance.runner import run_fresh
from refserve.conformance.scenarios import CORPUS_SCENARIOS, by_name
from refserve.conformance.shrink import shrink, signature
from refserve.spec.violation import Violation


@dataclass(frozen=True)
class Seen:
    """One finding as the corpus reports it."""

    scenario: str
    step: int
    rule: str
    """``Violation.rule``, or the invariant's id for its original checks."""
    message: str

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "step": self.step,
            "rule": self.rule,
            "message": self.message,
        }


@dataclass
class Side:
    """What one factory did under the detector."""

    factory: str
    findings: list[Seen] = field(default_factory=list)
    not_supported: list[str] = field(default_factory=list)
    error: str = ""
    """Why the side could not run at all (its adapter does not import, ...)."""
    steps: int | None = None
    """Engine steps of the shortest counterexample (KV level: operations), if caught."""

    def to_json(self) -> dict[str, Any]:
        return {
            "factory": self.factory,
            "findings": [f.to_json() for f in self.findings],
            "not_supported": self.not_supported,
            "error": self.error,
            "steps": self.steps,
        }


@dataclass
class EntryResult:
    entry: Entry
    skipped: str = ""
    """Why the entry did not run here (``""``: it ran)."""
    buggy: Side | None = None
    clean: Side | None = None
    before: list[Seen] = field(default_factory=list)
    """The suite of before reporting this bug: findings of the rules of before, on the
    scenarios of before, that the buggy side gives and the clean side does not, of the
    same kind (rule and message) as the entry's own detecting findings."""
    before_other: list[Seen] = field(default_factory=list)
    """Other such differences: the suite of before saw the buggy build misbehave, but
    as another defect (a bug the patch exposes, not the bug itself)."""

    @property
    def caught(self) -> bool:
        return self.buggy is not None and not self.buggy.error and bool(self.buggy.findings)

    @property
    def clean_passes(self) -> bool:
        c = self.clean
        return c is not None and not (c.error or c.findings or c.not_supported)

    @property
    def ok(self) -> bool:
        """Caught on the buggy code, silent on the clean code."""
        return self.caught and self.clean_passes

    @property
    def caught_by(self) -> list[str]:
        return sorted({f.rule for f in self.buggy.findings}) if self.buggy else []

    @property
    def missed_before(self) -> bool:
        return self.caught and not self.before

    def to_json(self) -> dict[str, Any]:
        e = self.entry
        out: dict[str, Any] = {
            "bug": e.bug,
            "url": e.url,
            "fix": e.fix,
            "engine": e.engine,
            "affected": e.affected,
            "fixed": e.fixed,
            "symptom": e.symptom,
            "rule": str(e.rule),
            "reproduction": str(e.reproduction),
            "environment": e.environment,
            "scenarios": [*e.detector.scenarios, *e.detector.kv_scenarios],
            "skipped": self.skipped,
        }
        if not self.skipped:
            out |= {
                "caught": self.caught,
                "clean_passes": self.clean_passes,
                "caught_by": self.caught_by,
                "missed_before": self.missed_before,
                "before": [f.to_json() for f in self.before],
                "before_other": [f.to_json() for f in self.before_other],
                "buggy": self.buggy.to_json() if self.buggy else None,
                "clean": self.clean.to_json() if self.clean else None,
            }
        return out


def reachable(entry: Entry) -> str:
    """``""`` when the entry's engine imports here, else why not (one line)."""
    # An adapter may have put the engine's package into sys.modules by hand (one whose
    # __init__ imports what the scheduler never needs): that counts as installed.
    found = entry.requires in sys.modules
    if not found:
        try:
            found = importlib.util.find_spec(entry.requires) is not None
        except (ImportError, ValueError):
            found = False
    if not found:
        where = f"make {entry.environment}" if entry.environment else "refserve's environment"
        return f"{entry.requires} is not installed here (it runs under {where})"
    return ""


def run_entry(entry: Entry, call_timeout: float = DEFAULT_CALL_TIMEOUT) -> EntryResult:
    """Run one entry's two sides (and the buggy side on the scenarios of before)."""
    why = reachable(entry)
    if why:
        return EntryResult(entry, skipped=why)
    res = EntryResult(entry)
    res.buggy = _side(entry, entry.buggy, call_timeout, shrink_first=True)
    res.clean = _side(entry, entry.clean, call_timeout, shrink_first=False)
    if res.caught:
        own = {_sig(f) for f in res.buggy.findings}
        for f in _before(entry, call_timeout):
            (res.before if _sig(f) in own else res.before_other).append(f)
    return res


def run_entries(
    entries: Iterable[Entry],
    *,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    on_result: Callable[[EntryResult], None] | None = None,
) -> list[EntryResult]:
    out: list[EntryResult] = []
    for e in entries:
        r = run_entry(e, call_timeout)
        out.append(r)
        if on_result is not None:
            on_result(r)
    return out


def _rule_of(v: Violation) -> str:
    return v.rule or str(v.invariant)


def _load(spec: str, kv: bool) -> tuple[Any, str]:
    """The factory, or why it cannot be had (an import error of someone else's code)."""
    try:
        return (load_kv_factory(spec) if kv else load_factory(spec)), ""
    except Exception as e:  # the engine's or the patch's import: reported, not raised
        return None, f"{spec} did not load: {type(e).__name__}: {e}"


def _side(entry: Entry, spec: str, call_timeout: float, *, shrink_first: bool) -> Side:
    side = Side(spec)
    d = entry.detector
    if d.scenarios:
        factory, side.error = _load(spec, kv=False)
        if side.error:
            return side
        for name in d.scenarios:
            if not _engine_scenario(side, factory, name, call_timeout, shrink_first):
                return side
    if d.kv_scenarios:
        kv_factory, side.error = _load(spec, kv=True)
        if side.error:
            return side
        for name in d.kv_scenarios:
            _kv_scenario(side, kv_factory, name, call_timeout)
    return side


def _engine_scenario(
    side: Side, factory: AdapterFactory, name: str, call_timeout: float, shrink_first: bool
) -> bool:
    """Run one scenario on ``side``; False when no engine could be built for it."""

    def run(w: Any) -> RunResult:
        return run_fresh(factory, w, call_timeout=call_timeout)

    first = run(by_name()[name].workload)
    if first.not_supported:
        side.not_supported.append(f"{name}: {first.not_supported}")
        return True
    setup = [f for f in first.findings if f.phase == "setup"]
    if setup:  # no engine ran: the adapter could not be built, which catches nothing
        side.error = f"{name}: {setup[0].violation}"
        return False
    side.findings.extend(_seen(name, first.findings))
    if shrink_first and first.findings:
        shortest = shrink(run, first, signature(first.findings[0]))
        steps = _steps(shortest)
        side.steps = steps if side.steps is None else min(side.steps, steps)
    return True


def _steps(r: RunResult) -> int:
    """The steps a counterexample takes to show its first finding (at least 1)."""
    at = [f.step for f in r.findings if f.step >= 0]
    return (min(at) + 1) if at else max(1, r.observed.steps)


def _kv_scenario(side: Side, factory: Any, name: str, call_timeout: float) -> None:
    sc = {s.name: s for s in kv_scenarios()}[name]
    try:
        found = replay_kv(factory, sc.workload.to_json(), call_timeout=call_timeout)
    except NotSupported as e:
        side.not_supported.append(f"{name}: {e}")
        return
    side.findings.extend(_kv_seen(name, found))
    at = [f.step + 1 for f in found if f.step >= 0]
    if at:
        side.steps = min(at) if side.steps is None else min(side.steps, min(at))


def _seen(name: str, findings: Sequence[Finding]) -> list[Seen]:
    return [Seen(name, f.step, _rule_of(f.violation), str(f.violation)) for f in findings]


def _kv_seen(name: str, findings: Sequence[KVFinding]) -> list[Seen]:
    return [Seen(name, f.step, _rule_of(f.violation), str(f.violation)) for f in findings]


def _before(entry: Entry, call_timeout: float) -> list[Seen]:
    """Findings of the rules of before, on the scenarios of before, that the buggy side
    has and the clean side has not (an engine's other bugs show on both sides)."""
    clean = {(f.scenario, _sig(f)) for f in _old_findings(entry.clean, entry, call_timeout)}
    return [
        f
        for f in _old_findings(entry.buggy, entry, call_timeout)
        if (f.scenario, _sig(f)) not in clean
    ]


def _sig(f: Seen) -> str:
    return f.rule + ":" + "".join("#" if c.isdigit() else c for c in f.message)


def _old_findings(spec: str, entry: Entry, call_timeout: float) -> list[Seen]:
    new = {str(r) for r in NEW_RULES}
    out: list[Seen] = []
    if entry.detector.scenarios:
        factory, err = _load(spec, kv=False)
        if err:
            return out
        for name, sc in by_name().items():
            if name in CORPUS_SCENARIOS:
                continue
            r = run_fresh(factory, sc.workload, call_timeout=call_timeout)
            out.extend(s for s in _seen(name, r.findings) if s.rule not in new)
    if entry.detector.kv_scenarios:
        kv_factory, err = _load(spec, kv=True)
        if err:
            return out
        for ksc in kv_scenarios():
            if ksc.name in KV_CORPUS_SCENARIOS:
                continue
            try:
                found = replay_kv(kv_factory, ksc.workload.to_json(), call_timeout=call_timeout)
            except NotSupported:
                continue
            out.extend(s for s in _kv_seen(ksc.name, found) if s.rule not in new)
    return out
