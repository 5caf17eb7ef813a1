"""vLLM with its NIXL connector's scheduler side as a prefill/decode pair: the suite's
moves run through vLLM's hand-off (conformance/adapters/vllm_nixl.py), pass every rule,
and a move the adapter cannot make faithfully is reported as not supported, with why.

Runs where vLLM imports (``.venv-vllm/bin/python -m pytest -p
no:cacheprovider tests/conformance/test_vllm_nixl.py``); skipped in refserve's venv.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM lives in .venv-vllm: make conformance-vllm")

from refserve.conformance.adapter import (
    CommitReport,
    EngineConfig,
    Feature,
    MigrationExport,
    MigrationStaged,
    StepReport,
)
from refserve.conformance.adapters import vllm_nixl
from refserve.conformance.runner import RunResult, run_fresh
from refserve.conformance.scenarios import M, R, _cfg, by_name
from refserve.conformance.workload import RequestPlan, Workload, prompt
from refserve.spec.handoff import HANDOFF
from refserve.spec.violation import Invariant


def _run(name: str, factory: Any = vllm_nixl.make) -> tuple[RunResult, list[Any]]:
    built: list[Any] = []

    def make() -> Any:
        built.append(factory())
        return built[-1]

    # A generous call timeout: building a vLLM scheduler takes seconds on a busy machine.
    return run_fresh(make, by_name()[name].workload, call_timeout=120), built


def _moves(run: RunResult) -> list[dict[str, Any]]:
    return [e for e in run.trace if "migrate" in e and "sent" in e]


def test_the_adapter_declares_migration() -> None:
    assert Feature.MIGRATION in vllm_nixl.make().features


def test_disaggregation_hands_every_request_over_through_the_connector() -> None:
    run, built = _run("disaggregation-prefill-decode")
    assert run.ok and not run.not_supported, [str(f) for f in run.findings]
    moves = _moves(run)
    assert sorted(e["migrate"] for e in moves) == ["A", "B", "C", "D"]
    assert all(e["sent"] > 0 and e["sent"] + e["hit"] == e["kv_length"] for e in moves)
    src, dst = built[0], built[1]
    assert src.transfers["sends"] == 4 and src.transfers["blocks_sent"] > 0
    assert dst.transfers["loads_admitted"] == dst.transfers["receives"] == 4


def test_the_destination_takes_its_own_prefix_hit() -> None:
    run, _ = _run("migration-destination-hit")
    assert run.ok and not run.not_supported, [str(f) for f in run.findings]
    assert any(e["hit"] > 0 and e["sent"] > 0 for e in _moves(run))


@pytest.mark.parametrize(
    "name",
    [
        "migration-decode-transfer",
        "migration-recompute",
        "migration-refused",
        "migration-under-preemption",
        "migration-three-engines",
    ],
)
def test_moves_pass_every_rule(name: str) -> None:
    run, _ = _run(name)
    assert run.ok and not run.not_supported, [str(f) for f in run.findings]
    assert _moves(run)


def test_a_transfer_mid_prefill_is_not_supported_with_the_reason() -> None:
    run, _ = _run("migration-mid-prefill")
    assert run.findings == []
    assert "a transfer mid-prefill" in run.not_supported


def test_an_aborted_import_is_not_supported_with_the_reason() -> None:
    """A decode transfer whose link fails before the ack: vLLM cannot put the
    destination back as it was."""
    w = by_name()["migration-decode-transfer"].workload
    first, *rest = w.migrations
    faulty = replace(w, migrations=(replace(first, fault="before_ack"), *rest))
    run = run_fresh(vllm_nixl.make, faulty, call_timeout=120)
    assert run.findings == []
    assert "abort_import: vLLM holds the blocks of an aborted in-flight load" in run.not_supported
    assert any(e.get("fault") == "before_ack" for e in run.trace)


def test_a_request_at_the_destinations_length_limit_is_refused() -> None:
    """The shortest counterexample the suite once found against this adapter: r0 (2
    tokens after its first output) moving to a peer whose max_model_len is 2 (2 blocks
    of 1) is refused, as vLLM refuses such a prompt, and finishes on its source."""

    def cfg(bs: int) -> EngineConfig:
        return EngineConfig(bs, 2, 1, 1, enable_prefix_caching=False, eos_token_id=1)

    w = Workload(cfg(2), (RequestPlan("r0", (3,), 2),), peers=(cfg(1),), disaggregated=True)
    run = run_fresh(vllm_nixl.make, w, call_timeout=120)
    assert run.ok, [str(f) for f in run.findings]
    assert any("refused" in e for e in run.trace if e.get("migrate") == "r0")


class _ReceivesOverTheHit(vllm_nixl.VllmNixlAdapter):
    """Adapter error planted: the stage reports the slots from the first block of the
    request's table on, as if the destination's prefix hit were received too."""

    def stage_import(self, export: MigrationExport, transfer: bool) -> MigrationStaged:
        s = super().stage_import(export, transfer)
        if not s.num_hit_tokens or not s.kv_slots:
            return s
        bs = self.cfg.block_size
        (blocks,) = self._sched.kv_cache_manager.get_block_ids(s.request_id)
        table = [(b - vllm_nixl.NULL_BLOCKS) * bs + o for b in blocks for o in range(bs)]
        return replace(s, kv_slots=tuple(table[: len(s.kv_slots)]))


def test_a_receive_list_off_the_table_is_caught() -> None:
    run, _ = _run("migration-destination-hit", _ReceivesOverTheHit)
    first = run.findings[0]
    assert (first.invariant, first.violation.rule, first.phase) == (
        Invariant.MOVED,
        HANDOFF,
        "migrate: staged",
    ), str(first)
    assert "receives into other slots than its staged table holds" in first.violation.message


def _preempted_then_moved(at: int, rid: str) -> Workload:
    """Three requests on a home pool of 6 blocks of 2: vLLM preempts and recomputes
    them; ``rid`` then moves with its K/V to a roomy peer at boundary ``at``."""
    return Workload(
        _cfg(2, 6, 8, 4),
        tuple(R(f"S{i}", prompt(223 + i, 3), 8, i % 2) for i in range(3)),
        peers=(_cfg(2, 16, 8, 4),),
        migrations=(M(at, rid),),
    )


class _SendsTheListFromBeforeAPreemption(vllm_nixl.VllmNixlAdapter):
    """Adapter error planted: the export sends, for the positions it covers, the slot
    list the request had before vLLM last preempted it."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, tuple[int, ...]] = {}
        self._stale: dict[str, tuple[int, ...]] = {}

    def schedule(self) -> StepReport:
        rep = super().schedule()
        for rid in rep.preempted:
            if self._last.get(rid):
                self._stale[rid] = self._last[rid]
        return rep

    def commit(
        self, sampled: Mapping[str, int], accepted: Mapping[str, int] | None = None
    ) -> CommitReport:
        out = super().commit(sampled, accepted)
        running = [r for r, q in self._live.items() if q.status == vllm_nixl.V.VStatus.RUNNING]
        self._last = {r: super(type(self), self).export_request(r).kv_slots for r in running}
        return out

    def export_request(self, request_id: str) -> MigrationExport:
        e = super().export_request(request_id)
        old = self._stale.get(request_id, ())
        if not old or not e.kv_slots:
            return e
        return replace(e, kv_slots=old[: len(e.kv_slots)] + e.kv_slots[len(old) :])


@pytest.mark.parametrize("at", [9, 10])
def test_vllms_send_list_after_a_preemption_is_its_table_and_a_stale_one_is_caught(
    at: int,
) -> None:
    w = _preempted_then_moved(at, "S1")
    clean = run_fresh(vllm_nixl.make, w, call_timeout=120)
    assert clean.ok and not clean.not_supported, [str(f) for f in clean.findings]
    assert any(e.get("migrate") == "S1" and e.get("sent") for e in clean.trace)
    assert any(e.get("preempted") for e in clean.trace if e.get("engine") == "A")

    run = run_fresh(_SendsTheListFromBeforeAPreemption, w, call_timeout=120)
    first = run.findings[0]
    assert (first.invariant, first.violation.rule, first.phase) == (
        Invariant.MOVED,
        HANDOFF,
        "migrate: exported",
    ), str(first)
