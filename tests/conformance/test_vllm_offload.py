"""vLLM with its offloading connector: the clean scheduler passes a workload that offloads
and loads K/V, and vllm#45388 re-applied on the same code is caught (PROGRESS).

Runs where vLLM imports (``.venv-vllm/bin/python -m pytest -p
no:cacheprovider tests/conformance/test_vllm_offload.py``); skipped in refserve's venv.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM lives in .venv-vllm: make conformance-vllm")

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
