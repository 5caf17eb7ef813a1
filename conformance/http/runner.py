"""Run the HTTP checks and write the report (JSON + markdown).

Report format (``"format": "refserve-conformance-http"``, version 1), in the family of
``refserve conformance``'s (conformance/REPORT_FORMAT.md)::

    {"format": "refserve-conformance-http", "version": 1,
     "base_url": "...", "model": "...", "reference": "...",
     "summary": {"pass": 10, "fail": 1, "not_supported": 0},
     "results": [{"check": "usage", "status": "fail", "note": null, "seconds": 0.4,
                  "failure": {"message": "...", "expected": "...", "seen": "...",
                              "request": {...}}}],
     "complete": true}
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from refserve.conformance.http.checks import CHECKS, Context, NotSupported
from refserve.conformance.http.client import Finding

FORMAT = "refserve-conformance-http"
VERSION = 1


@dataclass(frozen=True)
class CheckResult:
    check: str
    status: str  # pass | fail | not_supported
    seconds: float
    note: str | None = None
    failure: Finding | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "check": self.check,
            "status": self.status,
            "note": self.note,
            "seconds": round(self.seconds, 3),
        }
        if self.failure is not None:
            f = self.failure
            doc["failure"] = {
                "message": f.message,
                "expected": f.expected,
                "seen": f.seen,
                "request": f.request,
            }
        return doc


def run_check(name: str, ctx: Context) -> CheckResult:
    t0 = time.perf_counter()
    try:
        note = CHECKS[name](ctx)
    except Finding as found:
        return CheckResult(name, "fail", time.perf_counter() - t0, failure=found)
    except NotSupported as e:
        return CheckResult(name, "not_supported", time.perf_counter() - t0, note=str(e))
    except Exception as e:  # a server answer no check foresaw: still a finding, not a crash
        odd = Finding(f"the check could not read the server's answer: {type(e).__name__}: {e}")
        return CheckResult(name, "fail", time.perf_counter() - t0, failure=odd)
    return CheckResult(name, "pass", time.perf_counter() - t0, note=note)


def report_json(
    results: Sequence[CheckResult], *, base_url: str, model: str, reference: str, complete: bool
) -> dict[str, Any]:
    summary = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "not_supported")}
    return {
        "format": FORMAT,
        "version": VERSION,
        "base_url": base_url,
        "model": model,
        "reference": reference,
        "summary": summary,
        "results": [r.to_json() for r in results],
        "complete": complete,
    }


def report_markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    lines = [
        f"# conformance-http: `{doc['base_url']}` serving `{doc['model']}`",
        "",
        f"Reference: refserve's engine on `{doc['reference']}`. "
        f"**{s['pass']} pass, {s['fail']} fail, {s['not_supported']} not supported.**",
        "",
        "| check | status | seconds | note |",
        "|---|---|---:|---|",
    ]
    for r in doc["results"]:
        note = r.get("note") or (r["failure"]["message"] if "failure" in r else "")
        lines.append(f"| {r['check']} | {r['status']} | {r['seconds']:.2f} | {_cell(note)} |")
    fails = [r for r in doc["results"] if "failure" in r]
    for r in fails:
        f = r["failure"]
        lines += [
            "",
            f"## {r['check']}: {f['message']}",
            "",
            f"- expected: `{_cell(str(f['expected']))}`",
            f"- seen: `{_cell(str(f['seen']))}`",
            f"- request: `{_cell(json.dumps(f['request']))}`",
        ]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").replace("`", "'")
