"""Prefill/decode roles in the in-process cluster (ref/cluster/cluster.py, "Roles";
ref/cluster/handoff.py; docs/DISAGG.md, "In the cluster").

- A workload on ``2P2D`` (with no deflection, and with every prefill deflected that can
  be, by a TTFT SLO of 0 ms) gives a single engine's tokens, greedy and one seeded
  ``n = 2`` request; after every step the ownership rule and the snapshot rules of
  spec/pd.py hold (``check_roles``: a non-kept request sampled at most its first token on
  a prefill replica, one handoff at its first token, P to D), every decode replica step
  keeps rule ``deflect`` (``check_deflect``), and the handoffs are counted.
- A long prefill deflected to a decode replica runs beside its decodes in chunks the
  TBT bound allows, and the bound binds.
- A handoff that fails keeps the request on its prefill replica, where it finishes once
  with the same tokens: no decode replica with a seat; a decode replica dying
  mid-handoff (a fault hook on the in-process path, its slot restarted with its role; an
  import that raises ``ReplicaDead`` on the ticket path, where a request the dead replica
  held ends once with that error).
- A planted double handoff is refused by the book before it moves anything, and with
  the book's refusal planted away too, ``check_once`` names it.
- Bad role arguments are typed errors naming what is wrong.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import pytest
from cluster_helpers import config, replica
from pd_helpers import CFG, EVERY, ROLES, Finals, Run, Work

from refserve.cluster import Cluster, InProcessReplica, ReplicaDead
from refserve.cluster import handoff as handoff_module
from refserve.cluster.disagg import (
    Deflection,
    HandoffBook,
    HandoffDecision,
    Phase,
    Roles,
    TTFTBound,
)
from refserve.cluster.records import LoadFigures
from refserve.cluster.triggers import MigrationPolicy
from refserve.core.config import SchedulerConfig
from refserve.core.transit import MigrationFault
from refserve.engine import migration
from refserve.engine.llm_engine import LLMEngine
from refserve.engine.ticket import MigrationTicket
from refserve.errors import InvalidArgument
from refserve.model.sampler import SamplingParams
from refserve.spec.pd import (
    RoleName,
    check_once,
)


def _workload(seed: int, num_requests: int) -> Work:
    """Prompts of 5 to 20 tokens, 1 to 8 greedy tokens; and one seeded request, n = 2."""
    rng = random.Random(seed)
    out: Work = []
    for k in range(num_requests):
        prompt = [rng.randrange(1, 256) for _ in range(rng.randint(5, 20))]
        out.append((f"q{k}", prompt, SamplingParams(max_tokens=rng.randint(1, 8))))
    prompt = [rng.randrange(1, 256) for _ in range(12)]
    out.append(("fork", prompt, SamplingParams(max_tokens=6, n=2, temperature=0.9, seed=5)))
    return out


def _reference(work: Work) -> Finals:
    """Each request on one engine."""
    engine = LLMEngine("tiny", scheduler_config=SchedulerConfig(num_blocks=64, block_size=16))
    results = engine.generate([p for _, p, _ in work], [s for *_, s in work])
    return {
        (rid, o.index): o.token_ids
        for (rid, _, _), r in zip(work, results, strict=True)
        for o in r.outputs
    }


def _placements(cluster: Cluster) -> dict[str, Any]:
    assert cluster.pd is not None
    return {p.request_id: p for p in cluster.pd.placements}


@pytest.mark.parametrize("deflection", [None, EVERY], ids=["handoff", "deflected"])
def test_2p2d_gives_a_single_engines_tokens_and_keeps_the_rules(
    deflection: Deflection | None,
) -> None:
    work = _workload(seed=3, num_requests=12)
    cluster = Cluster.in_process(4, scheduler_config=CFG, roles=ROLES, deflection=deflection)
    run = Run(cluster)
    run.add(work)
    want = _reference(work)
    assert run.to_end() == want

    placements = _placements(cluster)
    deflected = {rid for rid, p in placements.items() if p.deflected}
    assert cluster.metrics.deflections == len(deflected)
    assert all(ROLES.of(placements[rid].replica).value == "D" for rid in deflected)
    # Every request placed on a prefill replica that outlived its first token was handed
    # off once, or kept where a decode replica had no seat (4 seats each, and deflected
    # requests take some); the others finished there at their first token, or were
    # deflected.
    first_only = {rid for (rid, _), tokens in want.items() if len(tokens) == 1}
    assert first_only and not run.handed_off & run.kept
    assert run.handed_off | run.kept == set(placements) - deflected - first_only
    assert cluster.metrics.handoffs == len(run.handed_off) > 0
    assert cluster.metrics.migrations_by_reason["handoff"] == len(run.handed_off)
    assert cluster.metrics.handoffs_kept == len(run.kept)
    if deflection is None:
        assert not run.kept
    assert bool(deflected) == (deflection is not None)
    assert run.decode_steps  # the decode replicas' steps were read and checked


def test_deflected_chunks_stay_within_the_tbt_bound_beside_decodes() -> None:
    """A decode replica decoding handed-off requests takes a long deflected prefill in
    chunks its SLO-aware chunk rule bounds: rule ``deflect`` holds on every step, and it
    binds (a chunk beside decodes stays below what the token budget alone allows). The
    bound beside 3 decodes is ``(25 - 2 - 3) / 0.5`` = 40 tokens, of a budget of 64."""
    cfg = config(4, 128, 64, max_num_seqs=8)
    slo = Deflection(TTFTBound(0.0), tbt_slo_ms=25.0)
    cluster = Cluster.in_process(
        2, scheduler_config=cfg, roles=Roles.parse("1P1D", 2), deflection=slo
    )
    run = Run(cluster)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    run.add([(f"d{k}", [5 + k] * 10, params) for k in range(3)])
    for _ in range(50):
        if cluster.metrics.handoffs + cluster.metrics.deflections == 3:
            break
        run.step()
    assert cluster.metrics.handoffs + cluster.metrics.deflections == 3
    short = SamplingParams(max_tokens=2)
    run.add([("L1", list(range(10, 210)), short), ("L2", list(range(20, 170)), short)])
    assert _placements(cluster)["L2"].deflected  # the prefill replica has L1's backlog
    run.to_end()
    beside = [
        sum(ch.tokens for ch in s.chunks) for s in run.decode_steps if s.chunks and s.num_decodes
    ]
    assert beside and max(beside) < cfg.max_num_batched_tokens - 3, beside


def test_no_decode_replica_with_a_seat_keeps_requests_on_their_prefill_replica() -> None:
    """A decode replica with one seat takes one request at a time: the others are kept
    where they prefilled, decode there past their first token, and finish with the same
    tokens."""
    work = [(f"k{i}", list(range(1 + i, 12 + i)), SamplingParams(max_tokens=8)) for i in range(4)]
    configs = [CFG, config(4, 48, 8, max_num_seqs=1)]
    cluster = Cluster.in_process(2, scheduler_config=configs, roles=Roles.parse("1P1D", 2))
    run = Run(cluster)
    run.add(work)
    assert run.to_end() == _reference(work)
    assert run.kept and cluster.metrics.handoffs_kept == len(run.kept)
    assert cluster.metrics.handoffs + cluster.metrics.handoffs_kept == len(work)
    # Kept requests decoded on the prefill replica (rule first lets them).
    assert any(
        r.kept and r.role is RoleName.PREFILL and r.sampled_here > 1
        for s in run.snapshots
        for r in s.requests
    )


def _dies_at_handoff(cluster: Cluster, monkeypatch: pytest.MonkeyPatch, nth: int = 1) -> list[str]:
    """The ``nth`` handoff's destination dies after it staged the import (the fault hook
    of ``Cluster.migrate``); returns the request whose handoff it hit."""
    hit: list[str] = []
    tried: list[str] = []
    migrate = cluster.migrate

    def with_fault(request_id: str, to: int, **kw: Any) -> migration.MigrationReport:
        tried.append(request_id)

        def fault(point: str) -> None:
            if point == MigrationFault.AFTER_STAGE and len(tried) == nth and not hit:
                hit.append(request_id)
                raise ReplicaDead(to, "killed mid-handoff by the test")

        return migrate(request_id, to, fault=fault, **kw)

    monkeypatch.setattr(cluster, "migrate", with_fault)
    return hit


def test_a_decode_replica_dying_mid_handoff_keeps_the_request_on_prefill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In process: the request stays on its prefill replica (kept) and finishes there
    once; the dead slot restarts as a decode replica and takes the later handoffs."""
    work = [(f"r{i}", list(range(3 + i, 14 + i)), SamplingParams(max_tokens=6)) for i in range(4)]
    restarted: list[int] = []

    def restart(slot: int) -> InProcessReplica:
        restarted.append(slot)
        return replica(CFG)

    reps = [replica(CFG), replica(CFG)]
    cluster = Cluster(reps, roles=Roles.parse("1P1D", 2), restart=restart, max_restarts=1)
    hit = _dies_at_handoff(cluster, monkeypatch)
    run = Run(cluster)
    run.add(work)
    want = _reference(work)
    assert run.to_end() == want
    assert run.failed == {}
    assert len(hit) == 1 and run.kept == set(hit)
    assert restarted == [1] and cluster.metrics.replicas_dead == 1
    # The fresh replica in slot 1 is a decode replica: the later handoffs went to it.
    later = {rid for (rid, _), tokens in want.items() if len(tokens) > 1} - set(hit)
    assert later and run.handed_off == later and cluster.metrics.handoffs == len(later)
    assert all(
        h.destination is RoleName.DECODE
        for s in run.snapshots
        for r in s.requests
        for h in r.handoffs
    )


def test_a_decode_replica_dying_while_it_holds_a_request_ends_that_one_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In process, no restart: the decode replica dies at the second handoff, holding
    the first request. That one ends once with ``ReplicaDead`` and the buried replica
    delivers nothing more of it (it is not stepped again, even in the step that buried
    it); the second, and every later one (no decode replica is left), is kept and
    finishes on the prefill replica with the same tokens."""
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    work = [(f"s{i}", list(range(3 + i, 14 + i)), params) for i in range(3)]
    cluster = Cluster([replica(CFG), replica(CFG)], roles=Roles.parse("1P1D", 2))
    hit = _dies_at_handoff(cluster, monkeypatch, nth=2)
    run = Run(cluster)
    run.add(work)
    run.to_end()
    failed = run.failed
    assert cluster.dead.keys() == {1} and len(hit) == 1
    assert len(failed) == 1 and not {rid for rid, _ in run.finals} & set(failed)
    # Nothing of it after the step that buried its replica, that step included (the
    # prefill replica, which found the death, steps first).
    assert all(run.delivered[rid] < at for rid, at in run.failed_at.items()), run.delivered
    assert hit[0] in run.kept and run.kept | set(failed) == {rid for rid, *_ in work}
    want = _reference(work)
    assert run.finals == {k: v for k, v in want.items() if k[0] not in failed}


class DyingImport:
    """A replica the cluster cannot see into (so a move to it goes by ticket): its
    ``import_request`` raises ``ReplicaDead`` from the ``die_at``-th import on, and so
    does every call after that (the replica is gone)."""

    def __init__(self, inner: InProcessReplica, slot: int, die_at: int) -> None:
        self._inner, self._slot, self._die_at = inner, slot, die_at
        self.imports: list[str] = []
        self.dead = False

    def import_request(self, ticket: MigrationTicket) -> list[str]:
        self.imports.append(ticket.request_id)
        if len(self.imports) >= self._die_at:
            self.dead = True
        self._check()
        return self._inner.import_request(ticket)

    def _check(self) -> None:
        if self.dead:
            raise ReplicaDead(self._slot, "its import killed it (the test)")

    def __getattr__(self, name: str) -> Any:
        if name not in ("block_size", "identity", "encode", "cache_snapshot"):
            self._check()
        return getattr(self._inner, name)


def test_a_decode_replica_dying_in_a_ticket_handoff_keeps_the_request_on_prefill() -> None:
    """By ticket: the decode replica dies at its second import. The request it was
    importing stays on its prefill replica and finishes there once; the request it held
    ends once with ``ReplicaDead``; nothing is delivered twice or lost."""
    work = [
        (f"t{i}", list(range(3 + 2 * i, 16 + 2 * i)), SamplingParams(max_tokens=12))
        for i in range(4)
    ]
    dying = DyingImport(replica(CFG), 1, die_at=2)
    cluster = Cluster([replica(CFG), dying, replica(CFG)], roles=Roles.parse("1P2D", 3))
    run = Run(cluster)
    run.add(work)
    run.to_end()
    failed = run.failed
    want = _reference(work)
    assert len(dying.imports) == 2 and 1 in cluster.dead
    held, importing = dying.imports
    assert set(failed) == {held} and isinstance(failed[held], ReplicaDead)
    assert importing in run.kept and (importing, 0) in run.finals
    # Every request ends once: finished with the single engine's tokens, or failed.
    assert {rid for rid, _ in run.finals} | set(failed) == {rid for rid, *_ in work}
    assert not {rid for rid, _ in run.finals} & set(failed)
    assert run.finals == {k: v for k, v in want.items() if k[0] not in failed}


def _plant_second_handoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug: a request is due whatever its phase, and a handoff's destination is the
    other prefill replica (so the request is on a prefill replica again, due again)."""

    def due(self: HandoffBook, request_id: str, num_output_tokens: int) -> bool:
        return request_id in self.phase and num_output_tokens >= 1

    def choose(
        request_id: str, source: int, kv_tokens: int, loads: Mapping[int, LoadFigures], roles: Roles
    ) -> HandoffDecision:
        return HandoffDecision(request_id, source, 1 - source, 0, ())

    monkeypatch.setattr(HandoffBook, "due", due)
    monkeypatch.setattr(handoff_module, "choose_decode", choose)


def test_a_planted_double_handoff_is_refused_before_it_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _plant_second_handoff(monkeypatch)
    cluster = Cluster.in_process(3, scheduler_config=CFG, roles=Roles.parse("2P1D", 3))
    cluster.add_request(list(range(1, 9)), SamplingParams(max_tokens=5), request_id="x")
    with pytest.raises(InvalidArgument, match="handed off once a turn"):
        for _ in range(20):
            cluster.step()
    # The refusal came before the second move: the request is where the first put it.
    assert cluster.ownership_violations() == []
    assert cluster.owner("x") == 1 and cluster.metrics.handoffs == 1


def test_a_planted_double_handoff_past_the_book_is_named_by_check_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _plant_second_handoff(monkeypatch)

    def handed_off(self: HandoffBook, request_id: str) -> None:
        self.phase[request_id] = Phase.PREFILL  # and due again: the bug

    monkeypatch.setattr(HandoffBook, "check_handoff", lambda self, request_id: None)
    monkeypatch.setattr(HandoffBook, "handed_off", handed_off)
    cluster = Cluster.in_process(3, scheduler_config=CFG, roles=Roles.parse("2P1D", 3))
    cluster.add_request(list(range(1, 9)), SamplingParams(max_tokens=5), request_id="x")
    found = []
    for _ in range(20):
        cluster.step()
        found += check_once(cluster.pd_snapshot())
    assert any("more than once" in v.message for v in found), found
    assert any("wrong roles" in v.message for v in found), found


def test_bad_role_arguments_are_typed_errors() -> None:
    reps = [replica(CFG), replica(CFG)]
    with pytest.raises(InvalidArgument, match="name 4 replicas, the cluster has 2"):
        Cluster(reps, roles=ROLES)
    with pytest.raises(InvalidArgument, match="roles must be Roles"):
        Cluster(reps, roles="1P1D")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="a deflection needs roles"):
        Cluster(reps, deflection=EVERY)
    with pytest.raises(InvalidArgument, match="deflection must be a Deflection"):
        Cluster(reps, roles=Roles.parse("1P1D"), deflection=12.0)  # type: ignore[arg-type]
    # A decode replica that would not bound deflected chunks beside its decodes.
    with pytest.raises(InvalidArgument, match=r"decode replica 1 has tbt_slo_ms=None"):
        Cluster(reps, roles=Roles.parse("1P1D"), deflection=EVERY)
    with pytest.raises(InvalidArgument, match="move only by their handoff"):
        Cluster(reps, roles=Roles.parse("1P1D"), migration=MigrationPolicy(pressure=True))
    # A decode slot of Cluster.in_process gets the SLO; a prefill slot keeps the caller's.
    c = Cluster.in_process(2, scheduler_config=CFG, roles=Roles.parse("1P1D"), deflection=EVERY)
    slos = [
        r.engine.scheduler.config.tbt_slo_ms for r in c.replicas if isinstance(r, InProcessReplica)
    ]
    assert slos == [None, EVERY.tbt_slo_ms]
