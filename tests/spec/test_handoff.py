"""MOVED, rule ``handoff`` (spec/handoff.py): the slot lists of a move are its tables'.

Real states (tests/harness.py, ``PhasedMigration`` of tests/phased_migration.py between
two schedulers of different block sizes, observed phase by phase): every clean move
passes at every phase, from the device and from the host pool; then one list is corrupted with
``dataclasses.replace`` and the rule names what is wrong. ``check_cluster`` runs it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from refserve.spec.checks import check_cluster
from refserve.spec.cluster import ClusterSnapshot, ClusterStep, Transit
from refserve.spec.handoff import HANDOFF, check_handoff, table_slots
from refserve.spec.snapshot import TableSnapshot
from refserve.spec.violation import Invariant, Violation
from tests.spec.test_cluster_checkers import SCENARIOS, Scenario, transfer  # noqa: F401

MOVED = Invariant.MOVED


def _with_transit(snap: ClusterSnapshot, **changes: object) -> ClusterSnapshot:
    (t,) = snap.transits
    return replace(snap, transits=(replace(t, **changes),))


def _transit(snap: ClusterSnapshot) -> Transit:
    (t,) = snap.transits
    return t


def _only_handoff(vs: list[Violation]) -> Violation:
    hits = [v for v in vs if v.rule == HANDOFF]
    assert len(hits) == 1, [str(v) for v in vs]
    assert hits[0].invariant is MOVED and hits[0].subject == "request r"
    return hits[0]


def test_a_transfer_records_both_lists_and_passes_at_every_phase(
    transfer: Scenario,  # noqa: F811
) -> None:
    acked = _transit(transfer.at("acked"))
    assert acked.sent_slots and acked.received_slots  # K/V travels, onto a hit
    assert len(acked.sent_slots) == acked.kv_length
    assert len(acked.received_slots) == acked.kv_length - acked.num_hit_tokens > 0
    assert _transit(transfer.at("exported")).received_slots is None
    for snap in transfer.snaps:
        assert check_handoff(snap) == []


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_other_moves_pass(name: str) -> None:
    scenario = SCENARIOS[name]()
    for snap in scenario.snaps:
        assert check_handoff(snap) == []
    if name in ("swapped", "paused on the host"):
        assert _transit(scenario.at("exported")).sent_on_host


def test_a_stale_send_list_is_a_violation(transfer: Scenario) -> None:  # noqa: F811
    """The list names a block the source's table does not hold (a block it held before
    a preemption): one free block of the source's pool stands in for it."""
    snap = transfer.at("exported")
    t = _transit(snap)
    a = snap.node("a")
    assert a is not None and t.sent_slots
    bs = a.engine.pool.block_size
    free = a.engine.pool.free_queue[0]
    stale = (free * bs, *t.sent_slots[1:])
    v = _only_handoff(check_handoff(_with_transit(snap, sent_slots=stale)))
    assert "sends other slots than its device table holds" in v.message
    assert f"slots [{free * bs}] of blocks it no longer holds" in v.message
    # check_cluster runs the rule
    vs = check_cluster(ClusterStep(transfer.at("start"), _with_transit(snap, sent_slots=stale)))
    assert [x for x in vs if x.rule == HANDOFF] == [v]


def test_an_empty_or_short_send_list_for_a_request_with_kv_is_a_violation(
    transfer: Scenario,  # noqa: F811
) -> None:
    snap = transfer.at("exported")
    t = _transit(snap)
    assert t.sent_slots
    v = _only_handoff(check_handoff(_with_transit(snap, sent_slots=())))
    assert "sends an empty slot list for a request with K/V" in v.message
    v = _only_handoff(check_handoff(_with_transit(snap, sent_slots=t.sent_slots[:-1])))
    assert "sends other slots" in v.message


def test_a_send_list_from_no_table_is_a_violation(transfer: Scenario) -> None:  # noqa: F811
    """The source lost the request's blocks (a recompute preemption) but sends the list
    it had: checked on the source's pool without the table."""
    snap = transfer.at("exported")
    a = snap.node("a")
    assert a is not None
    pool = a.engine.pool
    tables = tuple(x for x in pool.tables if x.request_id != "r")
    gone = replace(a, engine=replace(a.engine, pool=replace(pool, tables=tables)))
    nodes = tuple(gone if n.name == "a" else n for n in snap.nodes)
    v = _only_handoff(check_handoff(replace(snap, nodes=nodes)))
    assert "from no table" in v.message


def test_a_receive_list_off_the_staged_table_is_a_violation(
    transfer: Scenario,  # noqa: F811
) -> None:
    snap = transfer.at("acked")
    t = _transit(snap)
    assert t.received_slots
    shifted = tuple(s + 1 for s in t.received_slots)
    v = _only_handoff(check_handoff(_with_transit(snap, received_slots=shifted)))
    assert "receives into other slots than its staged table holds" in v.message
    short = t.received_slots[:-1]
    _only_handoff(check_handoff(_with_transit(snap, received_slots=short)))


def test_the_source_is_not_read_once_released(transfer: Scenario) -> None:  # noqa: F811
    """After the release the source's table is gone by design: the send list is not
    checked against it any more."""
    snap = transfer.at("released")
    assert check_handoff(_with_transit(snap, sent_slots=(0,))) == []


def test_table_slots_maps_positions_through_the_table() -> None:
    table = TableSnapshot("r", (5, 2), 3, (1, 2, 3), b"")
    assert table_slots(table, 0, 3, 2) == (10, 11, 4)
    assert table_slots(table, 1, 5, 2) == (11, 4, 5, -1)
