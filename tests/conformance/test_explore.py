"""The exhaustive explorer (conformance/explore/, docs/CONFORMANCE.md "Exhaustive exploration").

refserve exhausts the small scope with every invariant and liveness holding; every
engine-level planted bug of the independent indie engine and the planted livelock are
found with a shortest counterexample that the ordinary runner replays to the same
finding; the canonical key factors out exactly the symmetries it claims.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import indie_adapter
import livelock_engine
import pytest
from explore_vs_suite import ENGINE_BUGS

from refserve.conformance.adapter import Feature, TransferOutcome
from refserve.conformance.adapters.ref import RefAdapter, make, make_swap
from refserve.conformance.explore import SCOPES, explore
from refserve.conformance.explore.key import pool_key
from refserve.conformance.explore.liveness import check_liveness, find_cycle, longest_drain
from refserve.conformance.explore.session import Step, step_variants
from refserve.conformance.runner import run_fresh
from refserve.conformance.shrink import signature
from refserve.conformance.suite import run_suite
from refserve.conformance.workload import RequestPlan, Workload, drawn_outcome
from refserve.core import speculation
from refserve.core.request import Request
from refserve.core.scheduler import Scheduler
from refserve.spec.snapshot import CacheEntry, PoolSnapshot, TableSnapshot

HERE = Path(__file__).parent


def test_refserve_exhausts_the_small_scope() -> None:
    res = explore(make, SCOPES["small"], strategy="copy")
    assert res.exhausted, res.summary()
    assert res.ok, [str(c.finding) for c in res.counterexamples]
    assert res.liveness is not None and res.liveness.checked and not res.liveness.cycle
    # The scope reaches what it is meant to: each of these paths is exercised.
    for what in ("preemption", "prefix hit", "chunked prompt", "finish capacity", "finish stop"):
        assert res.coverage.get(what, 0) > 0, (what, res.coverage)
    assert res.states > 1000 and res.faults > 1000, res.summary()


def test_replay_and_copy_explore_the_same_graph() -> None:
    a = explore(make, SCOPES["tiny"], strategy="replay")
    b = explore(make, SCOPES["tiny"], strategy="copy")
    assert a.ok and b.ok
    assert (a.states, a.transitions, a.depth) == (b.states, b.transitions, b.depth)


@pytest.mark.skipif(
    os.environ.get("HYPOTHESIS_PROFILE") != "deep", reason="the medium scope runs in make deep"
)
@pytest.mark.parametrize("factory", [make, make_swap], ids=["recompute", "swap"])
def test_refserve_exhausts_the_medium_scope(factory: object) -> None:
    res = explore(factory, SCOPES["medium"], strategy="copy")  # type: ignore[arg-type]
    assert res.exhausted and res.ok, res.summary()
    assert res.liveness is not None and not res.liveness.cycle


def test_the_independent_engine_passes() -> None:
    res = explore(indie_adapter.make, SCOPES["small"], strategy="copy")
    assert res.exhausted and res.ok, [str(c.finding) for c in res.counterexamples]


@pytest.mark.parametrize("bug", ENGINE_BUGS)
def test_each_planted_bug_is_found_and_replays(bug: str) -> None:
    factory = getattr(indie_adapter, f"make_{bug}")
    res = explore(factory, SCOPES["small"], strategy="copy", first_only=True)
    assert res.counterexamples, f"{bug}: {res.summary()}"
    c = res.counterexamples[0]
    assert 1 <= len(c.path) <= 10, (bug, c.path)
    replayed = run_fresh(factory, c.workload)
    assert signature(c.finding) in {signature(f) for f in replayed.findings}, (
        bug,
        str(c.finding),
        [str(f) for f in replayed.findings],
    )
    # The same workload on the correct engine finds nothing: the bug, not the path.
    assert run_fresh(indie_adapter.make, c.workload).ok


def test_replay_finds_what_copy_finds() -> None:
    """Stateless exploration (what an adapter that cannot copy itself gets) finds the same
    shortest counterexample as the copying one."""
    factory = indie_adapter.make_preempt_no_reset
    a = explore(factory, SCOPES["small"], strategy="replay", first_only=True)
    b = explore(factory, SCOPES["small"], strategy="copy", first_only=True)
    assert a.counterexamples and b.counterexamples
    assert a.counterexamples[0].path == b.counterexamples[0].path


def test_the_planted_livelock_is_found_as_a_cycle() -> None:
    res = explore(livelock_engine.make, SCOPES["small"], strategy="copy")
    assert [c.kind for c in res.counterexamples] == ["liveness"], res.summary()
    c = res.counterexamples[0]
    assert c.cycle and all(str(e) == "step" for e in c.cycle)
    assert "preempted" in c.table
    replayed = run_fresh(livelock_engine.make, c.workload)
    assert any(f.invariant == "PROGRESS" for f in replayed.findings), replayed.findings
    # Every step is fine on its own: the sampled suite sees only the symptom, a run that
    # does not quiesce within its step limit, hundreds of steps in; the explorer gives the
    # shortest path into the loop and the loop itself.
    report = run_suite(livelock_engine.make, "livelock_engine:make", max_examples=10)
    failures = [f for r in report.results for f in r.failures]
    assert {f.signature for f in failures} <= {"PROGRESS run: did not quiesce within # steps"}
    assert all(f.step > 10 * (len(c.path) + len(c.cycle)) for f in failures)


def _pool(ids: tuple[int, ...], free: tuple[int, ...]) -> PoolSnapshot:
    a, b = ids
    return PoolSnapshot(
        num_blocks=4,
        block_size=2,
        ref_cnt=tuple(1 if i == a else 0 for i in range(4)),
        free_queue=free,
        tables=(TableSnapshot("x", (a,), 2, (5, 6)),),
        cache_entries=(CacheEntry(b"k", b, b"", (7, 8)),),
    )


def test_the_key_factors_out_block_ids_and_unobservable_free_order() -> None:
    rank = {"x": 0}
    mem1 = {0: 5, 1: 6, 2: 7, 3: 8}
    mem2 = {6: 5, 7: 6, 2: 7, 3: 8}  # the same contents in blocks 3 and 1
    one = pool_key(_pool((0, 1), (2, 1, 3)), rank, mem1, True)
    renamed = pool_key(_pool((3, 1), (0, 1, 2)), rank, mem2 | {0: 7, 1: 8}, True)
    assert one == renamed  # ids renamed; uncached free blocks are interchangeable
    moved = pool_key(_pool((0, 1), (1, 2, 3)), rank, mem1, True)
    assert moved != one  # the cached block is now first to be evicted: observable
    assert pool_key(_pool((0, 1), (1, 2, 3)), rank, mem1, False) == pool_key(
        _pool((0, 1), (2, 1, 3)), rank, mem1, False
    )
    stale = pool_key(_pool((0, 1), (2, 1, 3)), rank, {**mem1, 1: 9}, True)
    assert stale != one  # a held block's K/V content is part of the state


def test_liveness_finds_cycles_and_the_longest_drain() -> None:
    edges = {0: {1, 2}, 1: {3}, 2: {3}, 3: set()}
    assert find_cycle(edges, {0, 1, 2}) == ()
    assert longest_drain(edges, {0, 1, 2}) == 2
    loop = {0: {1}, 1: {2}, 2: {1, 3}}
    assert find_cycle(loop, {0, 1, 2}) in ((1, 2, 1), (2, 1, 2))
    assert check_liveness({0: {0}}, {0}, True).cycle == (0, 0)  # a step that changes nothing


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.getcwd()])}
    return subprocess.run(
        [sys.executable, "-m", "refserve.cli.main", "conformance", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_cli_exhaustive_reports_and_writes_replayable_counterexamples(tmp_path: Path) -> None:
    ok = _cli(
        "--exhaustive", "--scope", "tiny", "--adapter", "refserve.conformance.adapters.ref:make"
    )
    assert ok.returncode == 0, ok.stderr
    assert "all invariants hold" in ok.stdout and "exhausted" in ok.stdout
    out = tmp_path / "cx"
    report = tmp_path / "explore.json"
    bad = _cli(
        "--exhaustive",
        "--adapter",
        "indie_adapter:make_abort_leak",
        "--counterexamples",
        str(out),
        "--report",
        str(report),
    )
    assert bad.returncode == 1, bad.stderr
    assert "FAIL safety" in bad.stdout and "| # | event | engine |" in bad.stdout
    assert json.loads(report.read_text())["counterexamples"]
    replay = _cli(
        "--adapter", "indie_adapter:make_abort_leak", "--replay", str(out / "counterexample-1.json")
    )
    assert replay.returncode == 1 and "still holds blocks after abort" in replay.stdout
    wrong = _cli(
        "--exhaustive", "--scope", "huge", "--adapter", "refserve.conformance.adapters.ref:make"
    )
    assert wrong.returncode == 2 and "--scope must be one of" in wrong.stderr
    assert "Traceback" not in wrong.stderr


class _FewerDrafts(RefAdapter):
    """Verifies one draft fewer than proposed: a valid choice (a budget of its own)."""

    def propose(self, request_id: str, draft_token_ids: tuple[int, ...]) -> None:
        super().propose(request_id, draft_token_ids[:-1])


@pytest.mark.parametrize(
    ("factory", "requests"), [(RefAdapter, 3), (_FewerDrafts, 2)], ids=["refserve", "fewer"]
)
def test_every_accepted_count_is_explored(factory: type[RefAdapter], requests: int) -> None:
    # The other design choice needs fewer paths to show it passes: two requests at once.
    scope = dataclasses.replace(SCOPES["small-spec"], max_requests=requests)
    res = explore(factory, scope, strategy="copy")
    assert res.exhausted and res.ok, [str(c.finding) for c in res.counterexamples]
    assert res.coverage.get("drafts rejected", 0) > 0, res.coverage
    assert res.coverage.get("drafts all accepted", 0) > 0, res.coverage


@pytest.mark.parametrize(
    ("bug", "invariant"),
    [("keeps rejected KV", {"POS"}), ("counts the target's token", {"KVLEN", "TOKEN"})],
)
def test_a_planted_verification_bug_is_found_and_replays(
    monkeypatch: pytest.MonkeyPatch, bug: str, invariant: set[str]
) -> None:
    original = Scheduler._commit_verified

    def planted(self: Scheduler, r: Request, *args: object) -> object:
        if bug == "keeps rejected KV":
            monkeypatch.setattr(speculation, "truncate", lambda *_: [])
        out = original(self, r, *args)  # type: ignore[arg-type]
        if bug == "counts the target's token" and not r.is_done:
            r.num_computed_tokens += 1
        return out

    monkeypatch.setattr(Scheduler, "_commit_verified", planted)
    res = explore(RefAdapter, SCOPES["small-spec"], strategy="copy", first_only=True)
    assert len(res.counterexamples) == 1, res.summary()
    assert str(res.counterexamples[0].finding.invariant) in invariant
    c = res.counterexamples[0]
    assert c.workload.drafts_right  # the accepted counts travel with the workload
    replayed = run_fresh(RefAdapter, c.workload)
    assert signature(c.finding) in {signature(f) for f in replayed.findings}


class _Uncopyable(RefAdapter):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()  # deepcopy refuses locks


def test_an_adapter_that_cannot_be_copied_is_told_to_replay() -> None:
    res = explore(_Uncopyable, SCOPES["tiny"], strategy="copy")
    assert "cannot be deep-copied" in res.not_supported and "replay" in res.not_supported
    assert not res.ok
    assert explore(_Uncopyable, SCOPES["tiny"], strategy="replay").ok


def test_a_scope_an_engine_cannot_take_is_not_supported() -> None:
    res = explore(indie_adapter.make, SCOPES["small-spec"], strategy="copy")
    assert res.not_supported == "engine lacks speculative_decoding", res.summary()


def test_cli_exhaustive_kv_writes_replayable_counterexamples(tmp_path: Path) -> None:
    ok = _cli(
        "--exhaustive",
        "--scope",
        "tiny",
        "--kv-adapter",
        "refserve.conformance.adapters.ref_kv:make_kv",
    )
    assert ok.returncode == 0, ok.stderr
    assert "all invariants hold" in ok.stdout
    bad = _cli(
        "--exhaustive",
        "--scope",
        "tiny",
        "--kv-adapter",
        "indie_adapter:make_kv_fork_no_incref",
        "--counterexamples",
        str(tmp_path),
    )
    assert bad.returncode == 1 and "FAIL" in bad.stdout, bad.stderr
    replay = _cli(
        "--kv-adapter",
        "indie_adapter:make_kv_fork_no_incref",
        "--replay",
        str(tmp_path / "counterexample-1.json"),
    )
    assert replay.returncode == 1 and "FAIL" in replay.stdout
    both = _cli("--exhaustive", "--adapter", "x:y", "--kv-adapter", "x:y")
    assert both.returncode == 2 and "one adapter" in both.stderr


def test_each_outcome_of_each_copy_in_flight_is_a_step_of_its_own() -> None:
    offered = {("A", "load"): ("delay", "fail"), ("B", "store"): ("fail",)}
    steps = list(step_variants((), {}, offered))
    assert len(steps) == 3 * 2 - 1  # every combination but the ordinary step
    moves = {t for st in steps for t in st.transfers}
    assert ("A", "load", "delay") in moves and ("B", "store", "fail") in moves
    assert all(o != "complete" for _, _, o in moves)
    assert str(Step(transfers=(("A", "load", "fail"),))) == "step (A load fail)"


def test_transfer_choices_round_trip_and_are_checked() -> None:
    w = dataclasses.replace(
        _tiny(),
        transfer_outcomes=((3, "r0", "load", "fail"),),
        transfer_seed=7,
    )
    back = Workload.from_json(json.loads(json.dumps(w.to_json())))
    assert back == w
    assert Feature.TRANSFER_FAULTS in w.needs()
    assert Feature.TRANSFER_FAULTS not in _tiny().needs()
    with pytest.raises(ValueError, match="transfer_outcomes"):
        dataclasses.replace(w, transfer_outcomes=((3, "r0", "load", "lost"),))
    assert {drawn_outcome(s, 1, "r0", "load") for s in range(64)} == set(TransferOutcome)
    assert drawn_outcome(5, 2, "r1", "store") == drawn_outcome(5, 2, "r1", "store")


def _tiny() -> Workload:
    return Workload(SCOPES["small"].config(), (RequestPlan("r0", (2, 3, 4), 2),))
