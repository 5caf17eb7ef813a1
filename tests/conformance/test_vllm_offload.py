"""vLLM with its offloading connector: the clean scheduler passes a workload that offloads
and loads K/V, and vllm#45388 re-applied on the same code is caught (PROGRESS); copies
the suite fails: a failed load fails or recomputes its request (both policies), two
planted workers that let a failed copy's K/V be served are caught, and a failed store
starves a later lookup of its chunks (vLLM 0.33.0 has no store failure path).

Runs where vLLM imports (``.venv-vllm/bin/python -m pytest -p
no:cacheprovider tests/conformance/test_vllm_offload.py``); skipped in refserve's venv.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM lives in .venv-vllm: make conformance-vllm")

import dataclasses
from typing import Any

from refserve.conformance.adapters import vllm_offload
from refserve.conformance.corpus.patches import vllm_45388
from refserve.conformance.runner import run_with
from refserve.conformance.scenarios import by_name
from refserve.conformance.workload import Workload
from refserve.spec.violation import Invariant


def parked_load_behind_blockless_head() -> Workload:
    """L's prefix offloaded and evicted, L admitted as a load, H (11 of the 12 blocks,
    higher priority) ahead of it (the library scenario's docstring has the details)."""
    return by_name()["pressure-parked-load-behind-large-head"].workload


def test_clean_offload_passes_and_moves_kv() -> None:
    built: list[vllm_offload.VllmOffloadAdapter] = []

    def factory() -> vllm_offload.VllmOffloadAdapter:
        built.append(vllm_offload.make_priority())
        return built[-1]

    res = run_with(factory, parked_load_behind_blockless_head())
    assert not res.not_supported
    assert res.findings == []
    transfers = built[-1].transfers
    assert transfers["stores"] > 0 and transfers["chunks_stored"] > 0
    assert transfers["loads"] == 1 and transfers["chunks_loaded"] == 2
    assert res.observed.cached_tokens == 0  # L's two loaded blocks are a load, not a cache hit


def test_vllm_45388_caught_then_clean_unaffected() -> None:
    res = run_with(vllm_45388.make, parked_load_behind_blockless_head())
    assert res.findings
    first = res.findings[0]
    assert first.violation.invariant is Invariant.PROGRESS
    assert "runnable work but nothing scheduled" in first.violation.message
    assert "request L got nothing" in first.violation.message
    # The patch lives on its own scheduler: the clean adapter in this process keeps
    # vLLM's queue split.
    again = run_with(vllm_offload.make_priority, parked_load_behind_blockless_head())
    assert again.findings == []


def _failing(rid: str, kind: str) -> Workload:
    """The parked-load workload with every copy of ``rid``'s of ``kind`` failing (the
    suite decides every copy in flight; all others complete at the next step)."""
    w = parked_load_behind_blockless_head()
    return dataclasses.replace(
        w, transfer_outcomes=tuple((s, rid, kind, "fail") for s in range(12))
    )


def _built(
    cls: type[vllm_offload.VllmOffloadAdapter], **kw: Any
) -> tuple[list[vllm_offload.VllmOffloadAdapter], Any]:
    built: list[vllm_offload.VllmOffloadAdapter] = []

    def factory() -> vllm_offload.VllmOffloadAdapter:
        built.append(cls(policy="priority", **kw))
        return built[-1]

    return built, factory


def test_a_failed_load_fails_its_request_with_a_reason() -> None:
    built, factory = _built(vllm_offload.VllmOffloadAdapter)
    res = run_with(factory, _failing("L", "load"))
    assert not res.not_supported
    assert res.findings == []
    assert built[-1].transfers["loads_failed"] == 1
    assert built[-1].transfers["loads"] == 0
    assert res.observed.finish_reasons == {"length": 4, "error": 1}
    assert any(e.get("transfers") == {"L load": "fail"} for e in res.trace)


def test_a_failed_load_recomputes_under_the_recompute_policy() -> None:
    built, factory = _built(vllm_offload.VllmOffloadAdapter, load_failure_policy="recompute")
    res = run_with(factory, _failing("L", "load"))
    assert res.findings == []
    t = built[-1].transfers
    # L looks up again after each failure and loads once the suite lets a load land.
    assert t["loads_failed"] >= 1 and t["loads"] == 1
    assert res.observed.finish_reasons == {"length": 5}


class _FailedLoadServed(vllm_offload.VllmOffloadAdapter):
    """Planted: a worker that reports a failed load as landed (no invalid blocks)."""

    def _invalid_blocks(self, failed: list[Any]) -> set[int]:
        return set()


class _FailedStoreVisible(vllm_offload.VllmOffloadAdapter):
    """Planted: a worker that reports a failed store as completed, so vLLM's manager
    marks its chunks ready and a later lookup loads K/V that never arrived."""

    def _reported_ended(self, done: list[Any], failed: list[Any]) -> list[Any]:
        return [*done, *failed]


def test_a_failed_load_served_as_landed_is_caught() -> None:
    _, factory = _built(_FailedLoadServed, load_failure_policy="recompute")
    res = run_with(factory, _failing("L", "load"))
    assert res.findings
    v = res.findings[0].violation
    assert (v.invariant, v.rule) == (Invariant.BLOCK, "in-flight")
    assert "after its load failed" in v.message


def test_a_failed_store_made_visible_is_caught() -> None:
    _, factory = _built(_FailedStoreVisible)
    res = run_with(factory, _failing("P", "store"))
    assert res.findings
    v = res.findings[0].violation
    assert (v.subject, v.message) == (
        "request L",
        "KV read back at position 0: KV at this position was never written",
    )


def test_a_failed_store_starves_a_later_lookup_of_its_chunks() -> None:
    """vLLM 0.33.0: a store nobody can report failed keeps its chunks write-pending, and
    the lookup of a request sharing the prefix is deferred for good."""
    _, factory = _built(vllm_offload.VllmOffloadAdapter)
    res = run_with(factory, _failing("P", "store"))
    assert res.findings
    v = res.findings[0].violation
    assert v.invariant is Invariant.PROGRESS
    assert "waiting request L got nothing" in v.message
