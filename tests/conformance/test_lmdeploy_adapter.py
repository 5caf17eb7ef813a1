"""lmdeploy 0.18.0's paging scheduler under the suite (conformance/adapters/lmdeploy.py):
the clean adapter passes scenarios of the library, the two lmdeploy behaviours of
conformance/FINDINGS_lmdeploy.md are found on their shrunk workloads, and the two corpus
entries re-applied on it are caught while the clean side gives nothing.

Runs where lmdeploy imports (``.venv-lmdeploy/bin/python -m pytest -p no:cacheprovider
tests/conformance/test_lmdeploy_adapter.py``); skipped in refserve's venv.
"""

from __future__ import annotations

import importlib.util

import pytest

# Not importorskip("lmdeploy"): the package's own __init__ needs the serving stack,
# which the adapter never imports (it loads the paging modules alone).
if importlib.util.find_spec("lmdeploy") is None:
    pytest.skip(
        "lmdeploy lives in .venv-lmdeploy: make conformance-lmdeploy", allow_module_level=True
    )

from refserve.conformance.adapter import EngineConfig, RequestSpec
from refserve.conformance.adapters import lmdeploy
from refserve.conformance.corpus.catalogue import ENTRIES
from refserve.conformance.corpus.patches import lmdeploy_3589, lmdeploy_4100
from refserve.conformance.corpus.run import run_entry
from refserve.conformance.runner import EOS, run_with
from refserve.conformance.scenarios import R, by_name
from refserve.conformance.workload import Workload
from refserve.spec.violation import Invariant

CLEAN_SCENARIOS = (
    "bug-abort-preempted",
    "bug-preemption-storm",
    "order-head-of-line-blocking",
    "atomic-oversized-prompt",
    "bug-lone-request-cannot-grow",
    "stop-token-forced",
    "no-prefix-caching",
    "keys-lora",
    "pressure-victim-recomputes-without-cache",
)


@pytest.mark.parametrize("name", CLEAN_SCENARIOS)
def test_clean_adapter_passes(name: str) -> None:
    res = run_with(lmdeploy.make, by_name()[name].workload)
    assert not res.not_supported
    assert res.findings == []


def test_trie_blocks_are_free_and_evictable() -> None:
    adapter = lmdeploy.make()
    adapter.configure(EngineConfig(4, 8, 16, 2, eos_token_id=EOS))
    adapter.add_request(RequestSpec("A", tuple(range(10, 19)), 1))
    plan = adapter.schedule()
    assert [s.positions for s in plan.scheduled] == [tuple(range(9))]
    assert adapter.commit({"A": 5}).finished == (("A", "length"),)
    pool = adapter.snapshot().pool
    # The trie keeps A's two full blocks (allocator count 1): no request holds them, and
    # they come after the allocator's free stack in the free queue.
    alloc = adapter.scheduler.block_manager.allocator
    assert [int(alloc.get_ref_count(b)) for b in (0, 1, 2)] == [1, 1, 0]
    assert pool.ref_cnt == (0,) * 8 and pool.tables == ()
    assert sorted(pool.free_queue) == list(range(8)) and pool.free_queue[-2:] == (0, 1)


def test_prompt_of_max_session_len_gets_no_token() -> None:
    """FINDINGS_lmdeploy.md, L1: max_session_len is the pool less one block; a prompt of
    exactly that length is accepted and finished without an output."""
    cfg = EngineConfig(1, 2, 1, 1, enable_prefix_caching=False, eos_token_id=EOS)
    res = run_with(lmdeploy.make, Workload(cfg, (R("r0", (2,), 1),)))
    messages = {f.violation.message for f in res.findings}
    assert "samples flag disagrees with whether the chunk reaches num_tokens" in messages
    assert res.observed.finish_reasons == {"length": 1}


def test_recomputed_block_written_into_shared_block() -> None:
    """FINDINGS_lmdeploy.md, L2 (prefill form): B repeats A's block-aligned prompt; the
    trie deduplicates B's recomputed last block into A's, and B writes it."""
    res = run_with(lmdeploy.make, by_name()["bug-fully-cached-prompt-concurrent"].workload)
    first = res.findings[0]
    assert first.violation.invariant is Invariant.PREFIX
    assert first.violation.subject == "request B"
    assert "writes into block 1 shared by several requests" in first.violation.message


def test_lmdeploy_3589_caught_then_clean_unaffected() -> None:
    workload = by_name()["pressure-victim-recomputes-without-cache"].workload
    res = run_with(lmdeploy_3589.make, workload)
    assert not res.not_supported
    messages = {(f.violation.invariant, f.violation.message) for f in res.findings}
    # The reclaim leaves the victim a KV length and no blocks; admitted again, it reads
    # position 0 from a block the other request wrote.
    assert (Invariant.POS, "running request has KV but no block table in the pool") in messages
    assert any(
        inv is Invariant.BLOCK and "KV read back at position 0" in msg for inv, msg in messages
    )
    # The patch lives on its own scheduler's helper: a clean one built after it keeps
    # lmdeploy's release.
    clean = lmdeploy.make()
    clean.configure(workload.config)
    assert "_reclaim_candidate" not in vars(clean.scheduler.eviction_helper)
    assert run_with(lmdeploy.make, workload).findings == []


def test_lmdeploy_4100_caught_then_clean_unaffected() -> None:
    workload = by_name()["bug-free-list-order"].workload
    res = run_with(lmdeploy_4100.make, workload)
    # The engine also decodes past a request that fits (ORDER, its declared
    # prefill-first order) before the stall is long enough to call.
    stalls = [f for f in res.findings if f.violation.invariant is Invariant.PROGRESS]
    assert stalls, [str(f) for f in res.findings]
    assert "runnable work but nothing scheduled" in stalls[0].violation.message
    assert run_with(lmdeploy.make, workload).findings == []


@pytest.mark.parametrize("bug", ["InternLM/lmdeploy#3589", "InternLM/lmdeploy#4100"])
def test_corpus_entry(bug: str) -> None:
    (entry,) = [e for e in ENTRIES if e.bug == bug]
    result = run_entry(entry)
    assert result.skipped == ""
    assert result.caught and result.clean_passes
