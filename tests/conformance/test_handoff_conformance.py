"""MOVED, rule ``handoff`` (spec/handoff.py), end to end: a planted bug in refserve's own
adapter, an export that sends the slot list a request had before its last preemption,
is caught at the export, before the link carries anything; refserve itself passes."""

from __future__ import annotations

import conformance_broken_adapters as broken
import pytest

from refserve.conformance.adapters.ref import make as make_ref
from refserve.conformance.runner import run_fresh
from refserve.conformance.scenarios import M, R, _cfg
from refserve.conformance.workload import Workload, prompt
from refserve.spec.handoff import HANDOFF
from refserve.spec.violation import Invariant


def preempted_then_moved(at: int, rid: str) -> Workload:
    """Three requests on a home pool of 6 blocks of 2: they preempt each other and
    recompute; ``rid`` then moves with its K/V to a roomy peer at boundary ``at``."""
    return Workload(
        _cfg(2, 6, 8, 4),
        tuple(R(f"S{i}", prompt(223 + i, 3), 8, i % 2) for i in range(3)),
        peers=(_cfg(2, 16, 8, 4),),
        migrations=(M(at, rid),),
    )


@pytest.mark.parametrize(("at", "rid"), [(5, "S1"), (13, "S1"), (10, "S2")])
def test_a_stale_send_list_after_a_preemption_is_caught_at_the_export(at: int, rid: str) -> None:
    w = preempted_then_moved(at, rid)
    clean = run_fresh(make_ref, w)
    assert clean.ok, [str(f) for f in clean.findings]
    moved = [e for e in clean.trace if e.get("migrate") == rid and e.get("sent")]
    assert moved, "the move carries K/V"

    run = run_fresh(broken.stale_export_after_preemption, w)
    first = run.findings[0]
    assert (first.invariant, first.violation.rule, first.phase) == (
        Invariant.MOVED,
        HANDOFF,
        "migrate: exported",
    ), str(first)
    assert f"request {rid}" == first.violation.subject
    assert "sends other slots than its device table holds" in first.violation.message
    # The other rules only see it after the stale K/V has landed somewhere.
    early = {"migrate: exported", "migrate: staged"}
    others = [f for f in run.findings if f.violation.rule != HANDOFF]
    assert all(f.phase not in early for f in others), [str(f) for f in others]


def test_the_planted_bug_changes_nothing_without_a_preemption() -> None:
    """The corruption needs a preemption: on a roomy pool the broken adapter is clean."""
    w = Workload(
        _cfg(2, 16, 8, 4),
        tuple(R(f"S{i}", prompt(223 + i, 3), 8, i % 2) for i in range(3)),
        peers=(_cfg(2, 16, 8, 4),),
        migrations=(M(5, "S1"),),
    )
    run = run_fresh(broken.stale_export_after_preemption, w)
    assert run.ok, [str(f) for f in run.findings]
    assert any(e.get("migrate") == "S1" and e.get("sent") for e in run.trace)
