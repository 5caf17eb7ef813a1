"""Declared conventions are promises, checked both ways: an engine may do what it
declares, and where the declaration says it does, it does (docs/CONFORMANCE.md,
"Declarations are promises").

Same-step prefix hits (PREFIX, rule ``declared-same-step-hits``): an engine that says it
hits blocks another request fills in the same step and then computes the shared prefix
twice is caught; the engines that keep their declaration (vLLM and nano-vllm in their
own venvs) or make the other choice (refserve, the indie engine) pass. Lookahead slots
declare a range, both of whose bounds POS already checks (a block beyond the declared
slots: the indie engine's ``blocks_needed_off_by_one``). No eos handling (KVLEN, rule
``declared-eos``): the suite samples eos at a forced stop either way, and an engine that
declares none and stops there is caught. Prefill-first (ORDER, rule
``declared-step-order``): a decode-first engine that says it serves new prompts first is
caught passing over a waiting prompt that fitted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from refserve.conformance.adapter import (
    AdapterFactory,
    EngineConfig,
    EngineProperties,
    StepOrder,
)
from refserve.conformance.adapters.ref import RefAdapter
from refserve.conformance.adapters.ref import make as make_ref
from refserve.conformance.run_result import RunResult
from refserve.conformance.runner import run_with
from refserve.conformance.scenarios import by_name
from refserve.conformance.stops import DECLARED_EOS
from refserve.conformance.workload import RequestPlan, Workload
from refserve.spec.prefix import DECLARED_SAME_STEP_HITS
from tests.conformance import indie_adapter

SHARED = "promise-same-step-shared-prefix"
WITHIN_BUDGET = "promise-same-step-hit-within-budget"


def _run(factory: AdapterFactory, scenario: str) -> RunResult:
    return run_with(factory, by_name()[scenario].workload)


def _rules(res: RunResult) -> set[str]:
    return {f.violation.rule for f in res.findings}


def _indie_claiming_same_step_hits() -> indie_adapter.IndieAdapter:
    """The indie scheduler never looks the cache up: each request computes its own
    blocks. This one says it hits what another request fills in the same step."""
    a = indie_adapter.make()
    a.properties = dataclasses.replace(a.properties, same_step_prefix_hits=True)
    return a


def _ref_claiming_same_step_hits() -> RefAdapter:
    """refserve indexes a block only when its step commits; this one says otherwise."""
    a = make_ref()
    a.properties = dataclasses.replace(a.properties, same_step_prefix_hits=True)
    return a


def _ref_declaring_nothing() -> RefAdapter:
    """refserve held to the documented defaults: nothing declared, nothing promised."""
    a = make_ref()
    a.properties = EngineProperties()
    return a


def test_an_engine_declaring_same_step_hits_that_recomputes_the_prefix_is_caught() -> None:
    res = _run(_indie_claiming_same_step_hits, SHARED)
    assert _rules(res) == {DECLARED_SAME_STEP_HITS}, [str(f) for f in res.findings]
    v = res.findings[0].violation
    assert v.subject == "requests A, B" and "logical block 0 of one prefix in two blocks" in (
        v.message
    )
    assert _run(indie_adapter.make, SHARED).findings == []


def test_refserve_declaring_same_step_hits_it_does_not_take_is_caught() -> None:
    """The declaration is a promise: refserve's correct engine, which never hits a block
    in the step that fills it, breaks it when it says it does."""
    res = _run(_ref_claiming_same_step_hits, SHARED)
    assert _rules(res) == {DECLARED_SAME_STEP_HITS}, [str(f) for f in res.findings]
    # Within the budget refserve admits B only after A's step (a chunk of one token
    # first, or nothing), so no two tables hold the prefix twice: nothing to judge.
    assert _run(_ref_claiming_same_step_hits, WITHIN_BUDGET).findings == []


def test_refserve_passes_with_its_declarations_and_without_them() -> None:
    for factory in (make_ref, _ref_declaring_nothing):
        for name in (SHARED, WITHIN_BUDGET, "seed001-round-by-round", "keys-cache-salt"):
            res = _run(factory, name)
            assert res.findings == [], (name, [str(f) for f in res.findings])


def test_a_block_reserved_beyond_the_declared_slots_is_caught_as_before() -> None:
    """The declared lookahead is a range, ``ceil(num_stored / bs)`` to
    ``ceil((num_stored + k) / bs)`` blocks, and POS checks both of its bounds: here the
    upper one, a table holding more than the declared slots."""
    res = _run(indie_adapter.make_blocks_needed_off_by_one, "seed001-round-by-round")
    assert "block table does not cover the KV length plus 1 slots" in {
        f.violation.message for f in res.findings
    }, [str(f) for f in res.findings]


def _ref_claiming_no_eos() -> RefAdapter:
    """refserve stops on eos; this one says it has no eos handling."""
    a = make_ref()
    a.properties = dataclasses.replace(a.properties, eos=False)
    return a


FORCED_STOPS = "stop-token-forced"


def test_an_engine_declaring_no_eos_handling_that_stops_on_eos_is_caught() -> None:
    workload = by_name()[FORCED_STOPS].workload
    assert any(r.stop_at is not None for r in workload.requests)
    res = _run(_ref_claiming_no_eos, FORCED_STOPS)
    assert _rules(res) == {DECLARED_EOS}, [str(f) for f in res.findings]
    assert "stopped on its eos token, which the adapter declares" in (
        res.findings[0].violation.message
    )
    # The indie engine has no eos handling: it runs on past the eos the suite samples.
    indie = _run(indie_adapter.make, FORCED_STOPS)
    assert indie.findings == [] and not indie.observed.finish_reasons.get("stop")
    assert _run(make_ref, FORCED_STOPS).findings == []


def _ref_claiming_prefill_first() -> RefAdapter:
    """refserve serves its decodes first; this one says it serves new prompts first."""
    a = make_ref()
    a.properties = dataclasses.replace(a.properties, step_order=StepOrder.PREFILL_FIRST)
    return a


STARVES = "seed002-decode-starves-prefill"


def test_a_decode_first_engine_declaring_prefill_first_is_caught() -> None:
    """Eight decodes take the whole budget of 8 while X (6 tokens) waits: a decode-first
    engine's choice, a broken promise for one declared prefill-first."""
    res = _run(_ref_claiming_prefill_first, STARVES)
    assert _rules(res) == {"declared-step-order"}, [str(f) for f in res.findings]
    assert "request X" in {f.violation.subject for f in res.findings}
    assert "(declared prefill_first)" in res.findings[0].violation.message
    assert _run(make_ref, STARVES).findings == []
    assert _run(indie_adapter.make, STARVES).findings == []


# ------------------------------------------------ the engines that declare same-step hits
def _engine(module: str, venv: str) -> Any:
    return pytest.importorskip(
        f"refserve.conformance.adapters.{module}",
        reason=f"{module} is not installed here: it lives in its own virtualenv ({venv}/bin/"
        "python -m pytest tests/conformance/test_declared_promises.py)",
        exc_type=ImportError,
    )


@pytest.mark.parametrize(
    ("module", "venv"), [("vllm", ".venv-vllm"), ("nanovllm", ".venv-nanovllm")]
)
def test_the_engines_declaring_same_step_hits_take_them(module: str, venv: str) -> None:
    make = _engine(module, venv).make
    assert make().properties.same_step_prefix_hits
    shared, within = _run(make, SHARED), _run(make, WITHIN_BUDGET)
    assert shared.findings == [] and within.findings == []
    # B hits A's two blocks in step 0 (and D hits them a step later): 16 tokens; within
    # the budget B is admitted on its hit of 8.
    assert (shared.observed.cached_tokens, within.observed.cached_tokens) == (16, 8)
    assert shared.observed.rounds[0] == (("A", 11), ("B", 2))


def test_nanovllm_breaks_prefill_first_only_through_its_duplicated_sequence() -> None:
    """conformance/FINDINGS_nanovllm.md, N3: finding 1 (a preempted sequence left in
    ``running``) puts a stale copy of r4 at the head of ``waiting``; it never fits, so
    nano-vllm decodes while r1 (one token, one free block) waits behind it."""
    make = _engine("nanovllm", ".venv-nanovllm").make
    cfg = EngineConfig(2, 3, 6, 2, eos_token_id=1)
    w = Workload(
        cfg,
        (
            RequestPlan("r0", (3, 2, 4, 3), 2),
            RequestPlan("r1", (4,), 1, 1),
            RequestPlan("r4", (2,), 4),
            RequestPlan("r5", (2, 3, 2), 3),
        ),
    )
    res = run_with(make, w)
    order = [f for f in res.findings if f.violation.rule == "declared-step-order"]
    assert order and order[0].violation.subject == "request r1", [str(f) for f in res.findings]
    assert "while decoding request r4 got a token" in order[0].violation.message
    # The same engine keeps the promise wherever finding 1 does not strike.
    for name in ("seed002-decode-starves-prefill", "bug-head-of-line-kv-heavy", SHARED):
        assert not [f for f in _run(make, name).findings if f.violation.rule], name
