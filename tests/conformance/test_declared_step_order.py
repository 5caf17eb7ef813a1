"""A declared step order is a promise: an engine that says decode-first and admits new
work past a decode is caught (ORDER, rule ``declared-step-order``); the engines that keep
their declaration pass (refserve here; vLLM in its own venv)."""

from __future__ import annotations

import dataclasses

from refserve.conformance.adapter import StepOrder
from refserve.conformance.adapters.ref import make as make_ref
from refserve.conformance.runner import run_with
from refserve.conformance.scenarios import by_name
from tests.conformance import indie_adapter


def _claims_decode_first() -> indie_adapter.IndieAdapter:
    """The indie engine is prefill-first; this one says otherwise."""
    a = indie_adapter.make()
    a.properties = dataclasses.replace(a.properties, step_order=StepOrder.DECODE_FIRST)
    return a


def test_a_prefill_first_engine_declaring_decode_first_is_caught() -> None:
    res = run_with(_claims_decode_first, by_name()["seed001-round-by-round"].workload)
    rules = {f.violation.rule for f in res.findings}
    assert rules == {"declared-step-order"}, [str(f) for f in res.findings]
    assert "decoding request got no token while request" in res.findings[0].violation.message
    honest = run_with(indie_adapter.make, by_name()["seed001-round-by-round"].workload)
    assert honest.findings == []


def test_refserve_keeps_its_declared_decode_first_order() -> None:
    for name in ("seed001-round-by-round", "seed002-budget-14", "keys-cache-salt"):
        assert run_with(make_ref, by_name()[name].workload).findings == []
