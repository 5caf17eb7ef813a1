"""The conformance report: a stable JSON format (REPORT_FORMAT.md) and a markdown rendering.

One :class:`Result` per (scenario, invariant) the scenario checks, with ``status`` one
of ``pass``, ``fail``, ``not_supported``; a failure carries the step, the message, the
shrunk workload and the replayable trace of that workload. Policy observations (prefill-
first, mixed batches, chunking, golden schedules) are kept apart from results: they never
fail a run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refserve.conformance import REPORT_FORMAT_VERSION

FORMAT = "refserve-conformance"
STATUSES = ("pass", "fail", "not_supported")


def signature_of(invariant: object, subject: str, message: str) -> str:
    """What makes two findings the same bug: the invariant, the kind of subject
    (``request``, ``block``, ``step``...) and the message with its numbers blanked (a
    crash keeps its ``file:line``), e.g. ``BLOCK request: preempted but still holds...``."""
    kind = subject.split(" ", 1)[0] if subject else ""
    blanked = _NUMBER.sub("#", message)
    return f"{invariant} {kind}: {blanked}"


_NUMBER = re.compile(r"(?<![:\d])\d+")


@dataclass(frozen=True)
class Failure:
    step: int
    phase: str
    subject: str
    message: str
    expected: str
    seen: str
    workload: dict[str, Any]
    trace: list[dict[str, Any]]
    signature: str = ""
    """What makes two findings the same bug (refserve.conformance.suite.signature), as text."""
    rule: str = ""
    """The named rule broken (``Violation.rule``), for the invariants' named rules."""

    def to_json(self) -> dict[str, Any]:
        d = {
            "step": self.step,
            "phase": self.phase,
            "subject": self.subject,
            "message": self.message,
            "expected": self.expected,
            "seen": self.seen,
            "workload": self.workload,
            "trace": self.trace,
        }
        if self.signature:
            d["signature"] = self.signature
        if self.rule:
            d["rule"] = self.rule
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> Failure:
        return Failure(
            int(d["step"]),
            str(d["phase"]),
            str(d["subject"]),
            str(d["message"]),
            str(d.get("expected", "")),
            str(d.get("seen", "")),
            dict(d["workload"]),
            list(d.get("trace", [])),
            str(d.get("signature", "")),
            str(d.get("rule", "")),
        )


@dataclass(frozen=True)
class Result:
    scenario: str
    invariant: str
    status: str
    note: str = ""
    failure: Failure | None = None
    """The first distinct failure (its own shrunk workload)."""
    more_failures: tuple[Failure, ...] = ()
    """Further failures of the same invariant with other signatures, each shrunk apart."""

    @property
    def failures(self) -> tuple[Failure, ...]:
        return ((self.failure,) if self.failure is not None else ()) + self.more_failures

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "scenario": self.scenario,
            "invariant": self.invariant,
            "status": self.status,
        }
        if self.note:
            d["note"] = self.note
        if self.failure is not None:
            d["failure"] = self.failure.to_json()
        if self.more_failures:
            d["more_failures"] = [f.to_json() for f in self.more_failures]
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> Result:
        if d["status"] not in STATUSES:
            raise ValueError(f"unknown status {d['status']!r}")
        f = d.get("failure")
        return Result(
            str(d["scenario"]),
            str(d["invariant"]),
            str(d["status"]),
            str(d.get("note", "")),
            Failure.from_json(f) if f is not None else None,
            tuple(Failure.from_json(x) for x in d.get("more_failures", ())),
        )


@dataclass(frozen=True)
class ScenarioInfo:
    name: str
    description: str
    kind: str
    """``fixed`` (library) or ``generated`` (Hypothesis)."""
    targets: tuple[str, ...] = ()
    not_supported: str = ""
    observed: dict[str, Any] = field(default_factory=dict)
    golden: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "kind": self.kind,
            "targets": list(self.targets),
            "observed": self.observed,
        }
        if self.not_supported:
            d["not_supported"] = self.not_supported
        if self.golden is not None:
            d["golden"] = self.golden
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> ScenarioInfo:
        return ScenarioInfo(
            str(d["name"]),
            str(d["description"]),
            str(d["kind"]),
            tuple(d.get("targets", ())),
            str(d.get("not_supported", "")),
            dict(d.get("observed", {})),
            d.get("golden"),
        )


@dataclass(frozen=True)
class Report:
    adapter: str
    engine: str
    features: tuple[str, ...]
    results: tuple[Result, ...]
    scenarios: tuple[ScenarioInfo, ...]
    policy: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    properties: dict[str, Any] = field(default_factory=dict)
    """The adapter's declared EngineProperties (conventions the run honoured)."""
    complete: bool = True
    """False in a report streamed while the run was still going (or was killed)."""
    kv_adapter: str = ""
    """``MODULE:FACTORY`` of the KV-manager adapter when one was run (scenarios ``kv-*``)."""
    grouped_kv_adapter: str = ""
    """``MODULE:FACTORY`` of the grouped KV adapter when one was run (``kv-groups-*``)."""

    @property
    def failed(self) -> bool:
        return any(r.status == "fail" for r in self.results)

    def summary(self) -> dict[str, int]:
        """Results by status: one result per (scenario, invariant), not per scenario."""
        out = dict.fromkeys(STATUSES, 0)
        for r in self.results:
            out[r.status] += 1
        return out

    def headline(self) -> str:
        """The one-line verdict: how many scenarios failed, how many findings they hold
        (one FAIL line each: a failed check may hold several distinct findings), then the
        checks (:meth:`summary`). Three counts used to stand alone, so a line saying
        ``3 failed`` sat above five FAIL lines and a reader counted scenarios."""
        scenarios = {r.scenario for r in self.results}
        failed = {r.scenario for r in self.results if r.status == "fail"}
        findings = sum(len(r.failures) for r in self.results)
        s = self.summary()
        return (
            f"{len(failed)} of {len(scenarios)} scenarios failed "
            f"({findings} finding{'' if findings == 1 else 's'}); checks (scenario x "
            f"invariant): {s['fail']} failed, {s['pass']} passed, "
            f"{s['not_supported']} not supported"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": REPORT_FORMAT_VERSION,
            "adapter": self.adapter,
            "engine": self.engine,
            "features": list(self.features),
            "summary": self.summary(),
            "results": [r.to_json() for r in self.results],
            "scenarios": [s.to_json() for s in self.scenarios],
            "policy": self.policy,
            "notes": list(self.notes),
            "properties": self.properties,
            "complete": self.complete,
            "kv_adapter": self.kv_adapter,
            "grouped_kv_adapter": self.grouped_kv_adapter,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> Report:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a conformance report (format {d.get('format')!r})")
        if int(d.get("version", 0)) not in (1, REPORT_FORMAT_VERSION):
            raise ValueError(f"unsupported report version {d.get('version')!r}")
        return Report(
            str(d["adapter"]),
            str(d["engine"]),
            tuple(d["features"]),
            tuple(Result.from_json(r) for r in d["results"]),
            tuple(ScenarioInfo.from_json(s) for s in d["scenarios"]),
            dict(d.get("policy", {})),
            tuple(d.get("notes", ())),
            dict(d.get("properties", {})),
            bool(d.get("complete", True)),
            str(d.get("kv_adapter", "")),
            str(d.get("grouped_kv_adapter", "")),
        )

    def signatures(self) -> frozenset[str]:
        """Every failure's signature (what ``--baseline`` suppresses)."""
        out: set[str] = set()
        for r in self.results:
            for f in r.failures:
                out.add(f.signature or signature_of(r.invariant, f.subject, f.message))
        return frozenset(out)

    def dump(self, path: Path) -> None:
        """Write atomically (a temporary file renamed over ``path``): a reader, or a run
        killed mid-write, never sees half a report."""
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n")
        tmp.replace(path)

    @staticmethod
    def load(path: Path) -> Report:
        return Report.from_json(json.loads(path.read_text()))


_ICON = {"pass": "pass", "fail": "**FAIL**", "not_supported": "not supported"}


def to_markdown(report: Report) -> str:
    """A report a human reads: the matrix, then each failure with its shrunk workload."""
    sections = (_md_header, _md_matrix, _md_failures, _md_not_supported, _md_policy)
    lines = [line for section in sections for line in section(report)]
    return "\n".join(lines) + "\n"


def _md_header(report: Report) -> list[str]:
    """Title, adapter, headline; a partial report and declared properties say so."""
    lines = [
        f"# Conformance report: {report.engine}",
        "",
        f"Adapter `{report.adapter}`; features: {', '.join(report.features) or 'none'}.",
        "",
        f"**{report.headline()}.**",
        "",
    ]
    if not report.complete:
        lines += ["**Partial report: the run had not finished when this was written.**", ""]
    if report.properties:
        props = ", ".join(f"{k} = {v}" for k, v in report.properties.items())
        lines += [f"Declared properties: {props}.", ""]
    return lines


def _md_matrix(report: Report) -> list[str]:
    """One row per scenario, one column per invariant (``-``: not checked there)."""
    invariants = sorted({r.invariant for r in report.results})
    by = {(r.scenario, r.invariant): r for r in report.results}
    lines = ["| scenario | " + " | ".join(invariants) + " |", "|---|" + "---|" * len(invariants)]
    for sc in report.scenarios:
        cells = [_ICON[by[(sc.name, i)].status] if (sc.name, i) in by else "-" for i in invariants]
        lines.append(f"| {sc.name} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _md_failures(report: Report) -> list[str]:
    failures = [(r, f) for r in report.results for f in r.failures]
    if not failures:
        return []
    lines = ["## Failures", ""]
    for r, f in failures:
        seen = f" (expected {f.expected}, seen {f.seen})" if f.expected or f.seen else ""
        lines += [
            f"### {r.scenario}: {r.invariant}",
            "",
            f"Step {f.step} ({f.phase}), {f.subject}: {f.message}{seen}",
            "",
            "Shrunk workload:",
            "",
            "```json",
            json.dumps(f.workload, sort_keys=False),
            "```",
            "",
        ]
    return lines


def _md_not_supported(report: Report) -> list[str]:
    unsupported = [sc for sc in report.scenarios if sc.not_supported]
    if not unsupported:
        return []
    return ["## Not supported", "", *(f"- {sc.name}: {sc.not_supported}" for sc in unsupported), ""]


def _md_policy(report: Report) -> list[str]:
    """Observed policy and golden matches (never violations), notes, the scenario list."""
    lines = ["## Observed policy (not violations)", ""]
    lines += [f"- {k}: {v}" for k, v in report.policy.items()]
    golden = [(sc.name, sc.golden) for sc in report.scenarios if sc.golden is not None]
    if golden:
        lines += ["", "| golden scenario | matches the golden schedule |", "|---|---|"]
        lines += [f"| {name} | {'yes' if g.get('matches') else 'no'} |" for name, g in golden]
    if report.notes:
        lines += ["", "## Notes", "", *(f"- {n}" for n in report.notes)]
    lines += ["", "## Scenarios", ""]
    lines += [f"- **{sc.name}** ({sc.kind}): {sc.description}" for sc in report.scenarios]
    return lines
