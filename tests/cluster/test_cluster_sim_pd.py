"""Prefill/decode roles in the cluster simulator (ref/cluster/sim.py, sim_pd.py;
docs/CLUSTER.md, "The cluster simulator"; docs/DISAGG.md): every request finishes with
all its tokens under 2P2D with and without deflection, the ROLES rules of spec/pd.py
asserted after every operation; handoffs counted, landings that wait for room counted
and never recomputed; deflection under a load that makes the prefill side miss its TTFT
SLO and none under a light one; the TTFT breakdown adds up; planted bugs are caught."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from refserve.cluster.disagg import Deflection, HandoffBook, Phase, Roles, TTFTBound
from refserve.cluster.router import Router
from refserve.cluster.sim import (
    ClusterResult,
    ClusterSim,
    LinkModel,
    MigrationPolicy,
    simulate_cluster,
)
from refserve.cluster.sim_pd import Path, SimRoles, breakdowns
from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.errors import InvalidArgument
from refserve.report.cluster_experiment import TRACES, ClusterSlo
from refserve.sim.metrics import percentile
from refserve.sim.workloads import Workload, from_records, short_chat

COST = StepCost()
SLO = ClusterSlo.of(COST)
CONFIG = SchedulerConfig(
    max_num_batched_tokens=SLO.budget, max_num_seqs=64, block_size=16, num_blocks=1024
)
DEFLECT = Deflection(TTFTBound(SLO.tbt_ms, SLO.ttft_per_token_ms), SLO.tbt_ms)
TWO_TWO = Roles.parse("2P2D", 4)
CHAT = next(t for t in TRACES if t.name == "chat")


def _chat(load: float, replicas: int = 4) -> Workload:
    return CHAT.workload(replicas, load, 0)


def _run(
    w: Workload,
    deflection: Deflection | None = None,
    config: SchedulerConfig = CONFIG,
    roles: Roles = TWO_TWO,
) -> ClusterResult:
    return simulate_cluster(
        w,
        len(roles),
        config,
        COST,
        "slo_aware",
        roles=roles,
        deflection=deflection,
        check_ownership=True,
        check_pd=True,
    )


def _all_finished(w: Workload, res: ClusterResult) -> None:
    by_id = {t.id: t for t in w.requests}
    assert len(res.requests) == len(by_id)
    for m in res.requests:
        assert m.finish_reason == "length", m.request_id
        assert m.num_output_tokens == by_id[m.request_id].output_len


@pytest.mark.parametrize("deflection", [None, DEFLECT], ids=["2P2D", "2P2D+deflect"])
def test_every_request_finishes_and_is_handed_off_once(deflection: Deflection | None) -> None:
    w = _chat(2.0)
    res = _run(w, deflection)
    _all_finished(w, res)
    pd = res.pd
    assert pd is not None and pd.roles == "2P2D"
    handed = {h.request_id: h for h in pd.handoffs}
    assert len(handed) == len(pd.handoffs), "a request is handed off once"
    assert not pd.kept, "the decode pools are sized to take every handoff"
    deflected = set(pd.deflected)
    assert deflected.isdisjoint(handed)
    # Every request that outlived its first token and was not deflected left its
    # prefill replica for a decode replica; none got a second token before it landed.
    metrics = {m.request_id: m for m in res.requests}
    for rid, m in metrics.items():
        if rid in deflected or m.num_output_tokens < 2:
            continue
        h = handed[rid]
        assert h.source in (0, 1) and h.destination in (2, 3)
        assert m.token_times_ms[0] <= h.depart_ms < h.land_ms <= m.token_times_ms[1]
    assert (len(deflected) > 0) == (deflection is not None)


def test_deflection_under_load_that_misses_the_ttft_slo_and_not_when_light() -> None:
    # Light: 40 short chats at 4 per second, no shared prefix; heavy: the experiment's
    # chat trace at twice one replica's load on each of the 4.
    light = Workload("light", tuple(short_chat(40, 4.0, seed=0, scale=16.0)))
    heavy = _chat(2.0)
    # Without deflection, the heavy load makes the prefill side miss its TTFT SLO (the
    # light one does not), and deflecting lowers the tail.
    plain_light, plain_heavy = _run(light), _run(heavy)
    assert all(SLO.ttft_met(m) for m in plain_light.requests)
    missed = sum(not SLO.ttft_met(m) for m in plain_heavy.requests)
    assert missed > len(plain_heavy.requests) // 2
    light_d, heavy_d = _run(light, DEFLECT), _run(heavy, DEFLECT)
    assert light_d.pd is not None and heavy_d.pd is not None
    assert light_d.pd.deflected == ()
    assert len(heavy_d.pd.deflected) >= 10
    placed = {p.request_id: p for p in heavy_d.pd.placements}
    for rid in heavy_d.pd.deflected:
        p = placed[rid]
        assert p.ttft_slo_ms is not None and p.prefill_ttft_ms > p.ttft_slo_ms
        assert p.replica in (2, 3)

    def p95(res: ClusterResult) -> float:
        v = percentile([m.ttft_ms for m in res.requests if m.ttft_ms is not None], 95)
        assert v is not None
        return v

    assert p95(heavy_d) < p95(plain_heavy)
    assert sum(SLO.good(m) for m in heavy_d.requests) > sum(
        SLO.good(m) for m in plain_heavy.requests
    )


def test_the_ttft_breakdown_adds_up() -> None:
    res = _run(_chat(2.0), DEFLECT)
    rows = breakdowns(res.requests, res.pd)
    assert len(rows) == len(res.requests)
    assert {r.path for r in rows} >= {Path.HANDED_OFF, Path.DEFLECTED}
    for r in rows:
        assert r.queueing_ms >= 0 and r.prefill_ms > 0
        assert r.queueing_ms + r.prefill_ms == pytest.approx(r.ttft_ms)
        if r.second_token_ms is not None:
            assert r.decode_wait_ms is not None and r.decode_wait_ms >= 0
            total = r.ttft_ms + r.transfer_ms + r.decode_wait_ms
            assert total == pytest.approx(r.second_token_ms)
        # The first token streams from the prefill replica: a transfer is never in TTFT.
        assert (r.transfer_ms > 0) == (r.path is Path.HANDED_OFF)
    # Colocated: no handoff, the second token's wait is the first gap.
    plain = simulate_cluster(_chat(1.0), 4, CONFIG, COST, "slo_aware")
    assert {r.path for r in breakdowns(plain.requests)} == {Path.COLOCATED}


def test_a_full_decode_replica_keeps_handoffs_on_the_link_not_recomputed() -> None:
    # One small decode replica (40 blocks of 16) behind one prefill replica, outputs of
    # 120 tokens whose K/V grows there, a 20 ms link: some handoffs find it full when
    # they land and wait on the link (counted) until it has room, landing with their
    # K/V; when it has no room at a first token the request is kept and decodes on its
    # prefill replica.
    recs = [
        {"id": f"r{i}", "arrival_ms": i * 15.0, "prompt_len": 64, "output_len": 120}
        for i in range(30)
    ]
    w = Workload("tight", tuple(from_records(recs)))
    small = dataclasses.replace(CONFIG, num_blocks=40, max_num_seqs=16)
    res = simulate_cluster(
        w,
        2,
        small,
        COST,
        "slo_aware",
        roles=Roles.parse("1P1D", 2),
        link=LinkModel(latency_ms=20.0),
        check_ownership=True,
        check_pd=True,
    )
    _all_finished(w, res)
    pd = res.pd
    assert pd is not None
    assert pd.kept, "the decode replica was full at some first tokens"
    assert pd.landing_waits > 0, "some handoffs landed on a replica that had filled"
    assert sum(h.waits for h in pd.handoffs) == pd.landing_waits
    assert res.moves == (), "a handoff is not a trigger's move, and never a fallback"
    assert all(h.kv_tokens == 64 for h in pd.handoffs)
    rows = {r.request_id: r for r in breakdowns(res.requests, pd)}
    assert {rows[rid].path for rid in pd.kept} == {Path.KEPT}


# ------------------------------------------------------------------ planted bugs
def _expect_caught(monkeypatch: pytest.MonkeyPatch, plant: Callable[[], None], rule: str) -> None:
    plant()
    with pytest.raises(AssertionError, match=rule):
        _run(_chat(2.0), DEFLECT, config=dataclasses.replace(CONFIG, max_num_batched_tokens=512))


def test_a_second_handoff_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the book hands a request off again from its decode replica."""

    def due(self: HandoffBook, rid: str, n: int) -> bool:
        return self.phase.get(rid) in (Phase.PREFILL, Phase.HANDED_OFF) and n >= 1

    def handed_off(self: HandoffBook, rid: str) -> None:
        self.phase[rid] = Phase.HANDED_OFF

    def plant() -> None:
        monkeypatch.setattr(HandoffBook, "due", due)
        monkeypatch.setattr(HandoffBook, "handed_off", handed_off)

    _expect_caught(monkeypatch, plant, "more than once")


def test_a_prefill_replica_that_decodes_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: no request is ever due, so each decodes on its prefill replica."""
    _expect_caught(
        monkeypatch,
        lambda: monkeypatch.setattr(SimRoles, "due", lambda self, requests: []),
        "rule first",
    )


def test_a_decode_replica_without_the_tbt_cap_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the decode replicas' schedulers run without the SLO-aware chunk rule, so
    a deflected chunk beside decodes is a whole 512-token budget."""
    _expect_caught(
        monkeypatch,
        lambda: monkeypatch.setattr(SimRoles, "config_for", lambda self, i, config, cost: config),
        "exceed their TBT bound",
    )


def test_a_decode_replica_prefilling_a_request_not_deflected_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planted: the placement's deflection is forgotten by the book, so the decode
    replica's prefill is of a request it does not know as deflected."""
    real = HandoffBook.placed

    def placed(self: HandoffBook, rid: str, p: object) -> None:
        real(self, rid, dataclasses.replace(p, deflected=False))  # type: ignore[type-var]

    _expect_caught(
        monkeypatch,
        lambda: monkeypatch.setattr(HandoffBook, "placed", placed),
        "not deflected to it",
    )


# ------------------------------------------------------------------ arguments
def test_bad_arguments_are_typed_errors() -> None:
    router = Router("slo_aware")
    with pytest.raises(InvalidArgument, match="name 4 replicas but the simulator has 3"):
        ClusterSim(3, CONFIG, COST, router, roles=TWO_TWO)
    with pytest.raises(InvalidArgument, match="deflection needs roles"):
        ClusterSim(4, CONFIG, COST, router, deflection=DEFLECT)
    with pytest.raises(InvalidArgument, match="deflection needs a decode replica"):
        ClusterSim(4, CONFIG, COST, router, roles=Roles.parse("4C"), deflection=DEFLECT)
    with pytest.raises(InvalidArgument, match="do not mix"):
        ClusterSim(4, CONFIG, COST, router, roles=TWO_TWO, migration=MigrationPolicy(pressure=True))
    with pytest.raises(InvalidArgument, match="must be a Roles"):
        ClusterSim(4, CONFIG, COST, router, roles="2P2D")  # type: ignore[arg-type]
