"""Two deadlocks of vLLM's scheduler with an offloading connector, each re-applied on vLLM
0.33.0 and caught (PROGRESS) by a workload the clean scheduler passes with no finding:
vllm PR#44560 (async loads admitted without reserving what the loads already in flight
still need) and vllm PR#57841 (a request whose lookup the connector deferred, holding no
block, ahead of a load that holds blocks, under FCFS).

Runs where vLLM imports (``.venv-vllm/bin/python -m pytest -p no:cacheprovider
tests/conformance/test_vllm_corpus_deadlocks.py``); skipped in refserve's venv.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip("vllm", reason="vLLM lives in .venv-vllm: make conformance-vllm")

from refserve.conformance.adapters import vllm_offload
from refserve.conformance.corpus.patches import vllm_44560, vllm_45388, vllm_57841
from refserve.conformance.runner import run_with
from refserve.conformance.scenarios import by_name
from refserve.conformance.workload import Workload
from refserve.spec.violation import Invariant


def loads_back_at_once() -> Workload:
    return by_name()["pressure-loads-back-at-once"].workload


def deferred_lookup_ahead_of_load() -> Workload:
    return by_name()["pressure-deferred-lookup-ahead-of-load"].workload


def test_clean_runs_two_loads_one_after_the_other() -> None:
    built: list[vllm_offload.VllmOffloadAdapter] = []

    def factory() -> vllm_offload.VllmOffloadAdapter:
        built.append(vllm_offload.make())
        return built[-1]

    res = run_with(factory, loads_back_at_once())
    assert not res.not_supported
    assert res.findings == []
    transfers = built[-1].transfers
    assert transfers["loads"] == 2 and transfers["chunks_loaded"] == 10
    # A and B compute only what follows their loaded prefixes, A first.
    scheduled = [entry for step in res.observed.rounds for entry in step]
    assert scheduled.index(("A", 28)) < scheduled.index(("B", 6))
    assert res.observed.finish_reasons.get("length") == 6


def test_vllm_44560_caught_then_clean_unaffected() -> None:
    built: list[vllm_44560.Vllm44560Adapter] = []

    def factory() -> vllm_44560.Vllm44560Adapter:
        built.append(vllm_44560.make())
        return built[-1]

    res = run_with(factory, loads_back_at_once())
    assert not res.not_supported
    assert res.findings
    first = res.findings[0]
    assert first.violation.invariant is Invariant.PROGRESS
    assert "runnable work but nothing scheduled" in first.violation.message
    assert "waiting request A got nothing" in first.violation.message
    # Both loads were admitted and both landed: each holds its prefix, neither runs.
    assert built[-1].transfers["loads"] == 2
    sched = built[-1]._sched
    holding = {r.request_id: r.num_computed_tokens for r in sched.kv_holding_waiting}
    assert holding == {"A": 16, "B": 24}
    # The patch lives on its own scheduler: the clean adapter in this process keeps
    # vLLM's reservation.
    again = run_with(vllm_offload.make, loads_back_at_once())
    assert again.findings == []


# ---------------------------------------------------------------- vllm PR#57841


def test_clean_serves_the_loads_before_the_deferred_request() -> None:
    built: list[vllm_offload.VllmOffloadAdapter] = []

    def factory() -> vllm_offload.VllmOffloadAdapter:
        built.append(vllm_offload.make())
        return built[-1]

    res = run_with(factory, deferred_lookup_ahead_of_load())
    assert not res.not_supported
    assert res.findings == []
    transfers = built[-1].transfers
    assert transfers["loads"] == 2 and transfers["chunks_loaded"] == 10
    # P and L load their prefixes and compute the rest; H runs after them, on p as P's
    # load left it on the device (32 of its 48 tokens computed).
    scheduled = [entry for step in res.observed.rounds for entry in step]
    assert scheduled.index(("L", 2)) < scheduled.index(("H", 32))
    assert ("P", 2) in scheduled


@pytest.mark.parametrize(
    "make", [vllm_57841.make, vllm_45388.make], ids=["fcfs", "priority-all-equal"]
)
def test_vllm_57841_caught_then_clean_unaffected(
    make: Callable[[], vllm_offload.VllmOffloadAdapter],
) -> None:
    built: list[vllm_offload.VllmOffloadAdapter] = []

    def factory() -> vllm_offload.VllmOffloadAdapter:
        built.append(make())
        return built[-1]

    res = run_with(factory, deferred_lookup_ahead_of_load())
    assert not res.not_supported
    assert res.findings
    first = res.findings[0]
    assert first.violation.invariant is Invariant.PROGRESS
    assert "runnable work but nothing scheduled" in first.violation.message
    assert "waiting request H got nothing" in first.violation.message
    # The PR's end state in small: H holds nothing and heads the one queue; L, behind it,
    # holds its loaded prefix.
    sched = built[-1]._sched
    assert [(r.request_id, r.num_computed_tokens) for r in sched.waiting] == [
        ("H", 0),
        ("L", 24),
    ]
    assert not sched.kv_holding_waiting
    again = run_with(vllm_offload.make, deferred_lookup_ahead_of_load())
    assert again.findings == []
