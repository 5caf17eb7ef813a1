"""The suite held against an engine nobody here wrote it for (indie_engine.py).

The correct indie engine and block manager must pass the default CLI run with zero
findings; each planted bug must fail it under the invariant a reader would expect, at
the level (engine or KV manager) where the bug can show. The engine never forks and
never looks the prefix cache up, so its fork and cache bugs show only at the KV level.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import indie_adapter
import pytest
from indie_engine import BUGS, Batch, EngineError, IndieEngine, State

from refserve.conformance.adapter import AdmissionOrder, EngineAdapter
from refserve.conformance.cli import conformance_main
from refserve.conformance.kv.protocol import KVAdapter, KVConfig

# bug -> (invariant that must fail, level where it shows: "engine" or "kv")
EXPECTED: dict[str, tuple[str, str]] = {
    "cow_skipped": ("PREFIX", "kv"),  # a write into a block the fork still shares
    "fork_no_incref": ("BLOCK", "kv"),  # ref count below the tables holding the block
    "budget_overrun": ("TOKEN", "engine"),  # one decode past max_num_batched_tokens
    "fcfs_broken": ("ORDER", "engine"),  # a later arrival admitted past one that fitted
    "preempt_keeps_blocks": ("BLOCK", "engine"),  # preempted but still holds device blocks
    "blocks_needed_off_by_one": ("POS", "engine"),  # table longer than KV plus lookahead
    "abort_leak": ("PROGRESS", "engine"),  # still holds blocks after abort
    "stale_prefix_entry": ("PREFIX", "kv"),  # a cache hit reads another request's tokens
    "preempt_no_reset": ("TOKEN", "engine"),  # recompute preemption keeps its KV length
    "capacity_spin": ("PROGRESS", "engine"),  # a lone request that cannot grow spins
    "hol_skip": ("ORDER", "engine"),  # a head that does not fit is passed (strict order)
}


def _cli(tmp_path: Path, engine: str, kv: str, *extra: str) -> tuple[int, dict[str, Any]]:
    report = tmp_path / "report.json"
    rc = conformance_main(
        [
            "--adapter",
            f"indie_adapter:{engine}",
            "--kv-adapter",
            f"indie_adapter:{kv}",
            "--report",
            str(report),
            "--no-progress",
            *extra,
        ]
    )
    data: dict[str, Any] = json.loads(report.read_text())
    return rc, data


def _failures(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(scenario, invariant, message) of every failure in the report."""
    out = []
    for r in report["results"]:
        if r["status"] != "fail":
            continue
        for f in [r["failure"], *r.get("more_failures", [])]:
            out.append((r["scenario"], r["invariant"], f["message"]))
    return out


def test_the_correct_engine_passes_the_default_run(tmp_path: Path) -> None:
    rc, report = _cli(tmp_path, "make", "make_kv")
    assert _failures(report) == []
    assert rc == 0
    assert report["properties"]["lookahead_slots"] == 1
    # Both levels really ran: engine scenarios and kv-* scenarios, some of each passing.
    passed = {r["scenario"] for r in report["results"] if r["status"] == "pass"}
    assert any(s.startswith("kv-") for s in passed)
    assert any(not s.startswith("kv-") for s in passed)


def test_every_bug_has_an_expectation_and_both_factories() -> None:
    assert set(EXPECTED) == BUGS
    for bug in BUGS:
        eng = getattr(indie_adapter, f"make_{bug}")()
        kv = getattr(indie_adapter, f"make_kv_{bug}")()
        assert isinstance(eng, EngineAdapter) and isinstance(kv, KVAdapter)
        assert isinstance(eng, indie_adapter.IndieAdapter) and eng.bug == bug
        assert isinstance(kv, indie_adapter.IndieKVAdapter) and kv.bug == bug
        lax = getattr(indie_adapter, f"make_lax_{bug}")()
        assert lax.bug == bug and lax.properties.admission_order is AdmissionOrder.FCFS


@pytest.mark.parametrize("bug", sorted(EXPECTED))
def test_each_planted_bug_is_caught_with_the_expected_invariant(bug: str, tmp_path: Path) -> None:
    invariant, level = EXPECTED[bug]
    rc, report = _cli(tmp_path, f"make_{bug}", f"make_kv_{bug}")  # the default options
    assert rc == 1
    found = _failures(report)
    at_level = [(s, inv, msg) for s, inv, msg in found if s.startswith("kv-") == (level == "kv")]
    assert invariant in {inv for _, inv, _ in at_level}, found


def test_the_engine_declares_strict_fcfs_and_keeps_the_lax_order_too(tmp_path: Path) -> None:
    """Head-of-line blocking implies the lax order: the correct engine passes under both."""
    assert indie_adapter.make().properties.admission_order is AdmissionOrder.FCFS_STRICT
    assert indie_adapter.make_lax().properties.admission_order is AdmissionOrder.FCFS
    rc, report = _cli(tmp_path, "make_lax", "make_kv")
    assert (rc, _failures(report)) == (0, [])
    assert report["properties"]["admission_order"] == "fcfs"


def test_skipping_a_head_that_does_not_fit_breaks_only_the_strict_order(tmp_path: Path) -> None:
    """``hol_skip`` admits a small request past a head that does not fit: the lax ``fcfs``
    rule allows that (the head never fitted in what the small one took), so the engine
    passes the whole suite when it declares ``fcfs``; declaring the head-of-line blocking
    it promises (``fcfs_strict``), it fails ORDER, and nothing else."""
    rc, report = _cli(tmp_path, "make_lax_hol_skip", "make_kv_hol_skip")
    assert (rc, _failures(report)) == (0, [])
    rc, report = _cli(tmp_path, "make_hol_skip", "make_kv_hol_skip")
    found = _failures(report)
    assert rc == 1 and found
    assert {inv for _, inv, _ in found} == {"ORDER"}, found
    assert ("order-head-of-line-blocking", "ORDER") in {(s, inv) for s, inv, _ in found}
    assert all("later in fcfs_strict order" in msg for _, _, msg in found), found


def test_lifo_admission_breaks_the_lax_order_too(tmp_path: Path) -> None:
    rc, report = _cli(tmp_path, "make_lax_fcfs_broken", "make_kv")
    found = [(s, msg) for s, inv, msg in _failures(report) if inv == "ORDER"]
    assert rc == 1 and found
    assert all("later in fcfs order, although it fitted" in msg for _, msg in found), found


# ------------------------------------------------------------------ the engine itself
def _greedy(batch: Batch) -> dict[str, int]:
    return {c.rid: 7 for c in batch.chunks if c.samples}


def test_the_slot_of_the_sampled_token_is_reserved_in_the_same_step() -> None:
    eng = IndieEngine(num_blocks=8, block_size=4, max_batched_tokens=16, max_seqs=4)
    eng.add_request("a", [5, 6, 7, 8], max_tokens=3)
    eng.run_step(_greedy)
    # KV for 4 tokens, plus the slot of the 5th (sampled) one: ceil(5 / 4) == 2 blocks.
    assert eng.bm.num_stored("a") == 4
    assert len(eng.bm.table("a")) == 2


def test_preemption_takes_the_latest_arrival_and_requeues_it_first() -> None:
    eng = IndieEngine(num_blocks=3, block_size=2, max_batched_tokens=8, max_seqs=4)
    eng.add_request("old", [2, 3], max_tokens=6)
    eng.add_request("new", [4], max_tokens=6)
    eng.add_request("later", [5], max_tokens=6)
    preempted: list[str] = []

    def model(batch: Batch) -> dict[str, int]:
        preempted.extend(batch.preempted)
        return _greedy(batch)

    for _ in range(4):
        eng.run_step(model)
    assert preempted[0] == "new"
    assert eng.requests["new"].state is State.PREEMPTED
    assert eng.waiting[0].rid == "new"  # ahead of "later", which never ran
    assert "new" not in eng.bm.tables


def test_bad_requests_are_refused_before_anything_changes() -> None:
    eng = IndieEngine(num_blocks=2, block_size=4, max_batched_tokens=8, max_seqs=2)
    with pytest.raises(EngineError):
        eng.add_request("empty", [], max_tokens=1)
    with pytest.raises(EngineError):  # 8 prompt tokens + the sampled slot > 2 blocks of 4
        eng.add_request("huge", list(range(2, 10)), max_tokens=1)
    assert not eng.has_unfinished() and eng.bm.num_free == 2


def test_kv_fork_copies_the_shared_partial_block_before_a_write() -> None:
    kv = indie_adapter.make_kv()
    kv.configure(KVConfig(num_blocks=4, block_size=4))
    first = kv.allocate("p", [2, 3, 4], 3)
    kv.fork("p", "c")
    grown = kv.allocate("c", [2, 3, 4, 5], 1)
    assert grown.copies == ((first.block_table[0], grown.block_table[0]),)
    assert grown.block_table != first.block_table
