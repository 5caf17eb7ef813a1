"""The explorer's counterexample for each planted bug against the sampled suite's.

Run: ``PYTHONPATH=tests/conformance .venv/bin/python tests/conformance/explore_vs_suite.py``
(about two minutes on 2 cores). Prints a markdown table: per planted bug of the indie
engine (and the planted livelock), the events of the explorer's shortest path in the
small scope, and the shortest failure the whole sampled suite reports (requests and
steps, from whichever scenario, with that scenario's own limits). docs/CONFORMANCE.md,
"Exhaustive exploration", quotes it.
"""

from __future__ import annotations

import indie_adapter
import livelock_engine

from refserve.conformance.adapter import AdapterFactory
from refserve.conformance.explore import SCOPES, explore
from refserve.conformance.explore.session import Abort, Add, Step
from refserve.conformance.suite import run_suite

ENGINE_BUGS = (
    "abort_leak",
    "blocks_needed_off_by_one",
    "budget_overrun",
    "capacity_spin",
    "fcfs_broken",
    "hol_skip",
    "preempt_keeps_blocks",
    "preempt_no_reset",
)
"""The indie engine's bugs that live in its scheduler (test_explore.py finds each); the
other three are in its block manager, reached only through the KV protocol
(test_explore_kv.py)."""


def _n(k: int, what: str) -> str:
    return f"{k} {what}" + ("" if k == 1 else "s")


def explorer_path(factory: AdapterFactory) -> str:
    res = explore(factory, SCOPES["small"], strategy="copy", first_only=True)
    if not res.counterexamples:
        return "not found"
    c = res.counterexamples[0]
    adds = sum(isinstance(e, Add) for e in c.path)
    steps = sum(isinstance(e, Step) for e in c.path)
    aborts = sum(isinstance(e, Abort) for e in c.path)
    out = f"{_n(adds, 'add')}, {_n(steps, 'step')}" + (f", {_n(aborts, 'abort')}" if aborts else "")
    return out + (f", then a {len(c.cycle)}-step cycle" if c.cycle else "")


def suite_shortest(factory: AdapterFactory) -> str:
    report = run_suite(factory, "explore_vs_suite", max_examples=100)
    best: tuple[int, int, str] | None = None
    for r in report.results:
        for f in r.failures:
            cand = (f.step + 1, len(f.workload["requests"]), r.scenario)
            if f.step < 0:
                cand = (1 << 30, cand[1], r.scenario)  # found only at quiescence
            if best is None or cand < best:
                best = cand
    if best is None:
        return "not found"
    steps, requests, scenario = best
    shown = "at quiescence" if steps == 1 << 30 else _n(steps, "step")
    return f"{_n(requests, 'request')}, {shown} (`{scenario}`)"


def main() -> None:
    print("| planted bug | explorer (small scope) | sampled suite (shortest failure) |")
    print("|---|---|---|")
    for bug in ENGINE_BUGS:
        f = getattr(indie_adapter, f"make_{bug}")
        print(f"| {bug} | {explorer_path(f)} | {suite_shortest(f)} |", flush=True)
    print(
        f"| livelock | {explorer_path(livelock_engine.make)} | "
        f"{suite_shortest(livelock_engine.make)} |"
    )


if __name__ == "__main__":
    main()
