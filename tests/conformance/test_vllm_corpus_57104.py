"""vllm PR#57104 re-applied on vLLM 0.33.0 (conformance/corpus/patches/vllm_57104.py):
with speculative decoding, two asynchronous loads admitted without reserving the blocks
of the step each takes once landed fill the pool, and the first to land can never take
that step. Caught (PROGRESS) by ``pressure-loads-land-with-drafts``, which the clean
scheduler passes with no finding, its loads one after the other.

Runs where vLLM imports (``.venv-vllm/bin/python -m pytest -p no:cacheprovider
tests/conformance/test_vllm_corpus_57104.py``); skipped in refserve's venv.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM lives in .venv-vllm: make conformance-vllm")

from refserve.conformance.adapters import vllm_offload
from refserve.conformance.corpus.catalogue import ENTRIES
from refserve.conformance.corpus.patches import vllm_57104
from refserve.conformance.corpus.run import run_entry
from refserve.conformance.runner import run_with
from refserve.conformance.scenarios import by_name
from refserve.conformance.workload import Workload
from refserve.spec.violation import Invariant


def loads_land_with_drafts() -> Workload:
    return by_name()["pressure-loads-land-with-drafts"].workload


def _rounds(res: object) -> list[tuple[str, int]]:
    return [entry for step in res.observed.rounds for entry in step]  # type: ignore[attr-defined]


def test_clean_loads_one_then_the_other_and_pads_the_first_step() -> None:
    built: list[vllm_offload.VllmOffloadAdapter] = []

    def factory() -> vllm_offload.VllmOffloadAdapter:
        built.append(vllm_offload.make())
        return built[-1]

    res = run_with(factory, loads_land_with_drafts())
    assert not res.not_supported
    assert res.findings == []
    assert built[-1].transfers["loads"] == 2 and built[-1].transfers["chunks_loaded"] == 7
    # A's first step after its load: its last prompt token and 3 placeholder drafts;
    # B runs only after A, from its own load.
    scheduled = _rounds(res)
    assert scheduled.index(("A", 4)) < scheduled.index(("B", 4))
    firsts = [
        (s["id"], s["drafts"], t["accepted"][s["id"]])
        for t in res.trace
        if "accepted" in t
        for s in t["scheduled"]
        if s["n"] == 4
    ]
    assert firsts == [("A", 3, 0), ("B", 3, 0)], firsts


def test_vllm_57104_caught_then_clean_unaffected() -> None:
    built: list[vllm_57104.Vllm57104Adapter] = []

    def factory() -> vllm_57104.Vllm57104Adapter:
        built.append(vllm_57104.make())
        return built[-1]

    res = run_with(factory, loads_land_with_drafts())
    assert not res.not_supported
    assert res.findings
    first = res.findings[0]
    assert first.violation.invariant is Invariant.PROGRESS
    assert "runnable work but nothing scheduled" in first.violation.message
    assert "waiting request A got nothing" in first.violation.message
    # Both loads were admitted and landed, and hold the whole pool: the PR's end state.
    # A, at the head, was stepped back to recompute its last prompt token (a 1-token
    # step vLLM pads to 1 + 3); B's whole prompt is still its loaded prefix.
    sched = built[-1]._sched
    assert built[-1].transfers["loads"] == 2
    holding = {r.request_id: r.num_computed_tokens for r in sched.kv_holding_waiting}
    assert holding == {"A": 15, "B": 12}
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    # The patch lives on its own scheduler: the clean adapter in this process keeps
    # vLLM's reservation.
    assert run_with(vllm_offload.make, loads_land_with_drafts()).findings == []


def test_the_corpus_entry_runs_buggy_caught_clean_passing() -> None:
    entry = next(e for e in ENTRIES if e.bug == "vllm-project/vllm#57104")
    r = run_entry(entry)
    assert not r.skipped, r.skipped
    assert r.caught and r.clean_passes, r
