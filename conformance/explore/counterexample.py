"""A violation as a person reads it: the shortest path, a replayable workload, a table.

Breadth-first search reaches every state first by a shortest event path, so the path of
a violation is a shortest counterexample. It is turned into a workload in the format of
``refserve conformance --replay`` (arrival, abort and eos-stop of each request, and the
steps at which the executor fails), which the ordinary runner replays to the same
finding, and into a step table: one row per event, with what the engine did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from refserve.conformance.adapter import AdapterFactory
from refserve.conformance.explore.scope import Scope
from refserve.conformance.explore.session import Abort, Add, Event, Fault, Session, Step
from refserve.conformance.runner import Finding, adapter_traits, build
from refserve.conformance.workload import Workload


@dataclass(frozen=True)
class Counterexample:
    finding: Finding
    path: tuple[Event, ...]
    workload: Workload
    kind: str = "safety"
    """``safety`` (a check failed on the last event) or ``liveness`` (a step cycle)."""
    cycle: tuple[Event, ...] = ()
    """For a livelock: the steps that lead from the path's last state back to it."""
    table: str = ""
    """The path (and cycle) as a step table (:func:`step_table`)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "finding": self.finding.to_json(),
            "path": [str(e) for e in self.path],
            "cycle": [str(e) for e in self.cycle],
            "workload": self.workload.to_json(),
            "table": self.table,
        }


def record(factory: AdapterFactory, scope: Scope, path: Sequence[Event], timeout: float) -> Session:
    """Replay ``path`` on a fresh adapter keeping the trace and the workload's books."""
    adapter = build(factory, timeout)
    features, props = adapter_traits(adapter, timeout)
    s = Session(adapter, scope, props, timeout)
    s.record = True
    s.start(features)
    for ev in path:
        if s.dead:
            break
        s.apply(ev)
    return s


def to_workload(s: Session, note: str) -> Workload:
    """The recorded session's path as a workload the runner replays."""
    plans = [
        replace(s.run.plans[rid], stop_at=s.stops.get(rid), abort_at=s.aborts.get(rid))
        for rid in s.entries
    ]
    return Workload(
        s.scope.config(),
        tuple(plans),
        rollback_at=tuple(s.rollbacks),
        drafts_right=tuple(s.choices.right_used),
        transfer_outcomes=tuple(s.run.copies.used),
        note=note,
    )


def step_table(s: Session, path: Sequence[Event]) -> str:
    """The recorded trace as a markdown table, one row per event."""
    rows = ["| # | event | engine |", "|---|---|---|"]
    trace = iter(s.run.res.trace)
    for i, ev in enumerate(path, 1):
        what = ""
        if isinstance(ev, (Add, Abort, Fault)):
            entry = next(trace, {})
            what = ", ".join(f"{k} {v}" for k, v in entry.items() if k != "boundary")
            if isinstance(ev, Add):
                t = s.scope.catalogue[ev.entry]
                what += f" (prompt {list(t.prompt)}, max_tokens {t.max_tokens})"
        elif isinstance(ev, Step):
            entry = next(trace, {})
            sched = ", ".join(
                f"{c['id']}: {c['n']} at {c['positions']} -> blocks {c['block_table']}"
                + (" samples" if c["samples"] else "")
                for c in entry.get("scheduled", [])
            )
            extra = []
            if entry.get("preempted"):
                extra.append(f"preempted {entry['preempted']}")
            if entry.get("finished"):
                extra.append(f"finished {entry['finished']}")
            what = "; ".join([sched or "nothing scheduled", *extra])
        rows.append(f"| {i} | {ev} | {what} |")
    return "\n".join(rows)
