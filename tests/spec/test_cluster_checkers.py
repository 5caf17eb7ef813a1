"""Every migration rule (spec/cluster.py, docs/MIGRATION.md "The rules") is shown to fail.

The states are real: two schedulers of different block sizes (tests/harness.py, each
with a fake K/V memory), a request moved between them phase by phase with
``PhasedMigration`` (tests/phased_migration.py; by transfer onto a prefix hit of the
destination, by recompute, from the host pool, aborted halfway) and a real step. Each
clean sequence of snapshots passes every rule; then one thing is corrupted with
``dataclasses.replace`` and the test asserts the rule, the subject and the message of
the violation it gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest

from refserve.core.config import SchedulerConfig
from refserve.core.request import Request, StopParams
from refserve.core.swap import KVRetention, PreemptionMode
from refserve.core.transit import KVPlace
from refserve.spec.checks import CLUSTER_CHECKS, check_cluster
from refserve.spec.cluster import (
    ClusterSnapshot,
    ClusterStep,
    Delivered,
    Node,
    Sample,
    Transit,
    TransitPhase,
    check_conserve,
    check_kv_copy,
    check_leak,
    check_moved,
    check_owner,
)
from refserve.spec.snapshot import RequestStatus, TableSnapshot
from refserve.spec.violation import (
    CLUSTER_INVARIANTS,
    ENGINE_INVARIANTS,
    ROLE_INVARIANTS,
    Invariant,
    Violation,
)
from tests.harness import Boom, MemoryLink, Stepper, cluster_snapshot
from tests.phased_migration import PhasedMigration, PhasedMigrationAborted

S = RequestStatus
PROMPT = tuple(range(10, 20))  # 10 distinct tokens
OWNER, CONSERVE, MOVED, KVCOPY, LEAK = (
    Invariant.OWNER,
    Invariant.CONSERVE,
    Invariant.MOVED,
    Invariant.KVCOPY,
    Invariant.LEAK,
)


def find(vs: list[Violation], inv: Invariant, subject: str, fragment: str) -> Violation:
    """The violation of ``inv`` about ``subject`` whose message contains ``fragment``."""
    hits = [v for v in vs if v.invariant is inv and v.subject == subject and fragment in v.message]
    assert hits, f"no [{inv}] {subject!r} ~ {fragment!r} among {[str(v) for v in vs]}"
    return hits[0]


# ------------------------------------------------------------------------- scenarios
def engines(*, host_blocks: int = 8) -> dict[str, Stepper]:
    """``a``: blocks of 4, swap to a host pool; ``b``: blocks of 2, prefix caching."""
    a = SchedulerConfig(
        max_num_batched_tokens=16,
        max_num_seqs=4,
        block_size=4,
        num_blocks=12,
        max_model_len=40,
        preemption_mode=PreemptionMode.SWAP if host_blocks else PreemptionMode.RECOMPUTE,
        num_host_blocks=host_blocks,
    )
    b = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=2, num_blocks=24, max_model_len=40
    )
    return {"a": Stepper(a, memory=True), "b": Stepper(b, memory=True)}


@dataclass
class Scenario:
    """A move observed phase by phase: ``snaps[i]`` after ``labels[i]``."""

    engines: dict[str, Stepper]
    move: PhasedMigration
    labels: list[str]
    snaps: list[ClusterSnapshot]

    def at(self, label: str) -> ClusterSnapshot:
        return self.snaps[self.labels.index(label)]

    def step(self, label: str) -> ClusterStep:
        """The step that ended at ``label``."""
        i = self.labels.index(label)
        return ClusterStep(self.snaps[i - 1], self.snaps[i])

    def steps(self) -> list[ClusterStep]:
        return [ClusterStep(x, y) for x, y in zip(self.snaps, self.snaps[1:], strict=False)]


def cached_prefix(e: dict[str, Stepper]) -> dict[str, tuple[int, ...]]:
    """``b`` runs a request on the first 8 tokens of PROMPT to the end: they stay cached."""
    p = Request("p", [*PROMPT[:8], 99], StopParams(2, ignore_eos=True))
    e["b"].add(p)
    e["b"].drain()
    return {"p": tuple(p.output_token_ids)}


def decoding(e: dict[str, Stepper], rid: str = "r", steps: int = 3) -> None:
    """``rid`` (PROMPT) decodes on ``a`` beside a bystander ``x``."""
    e["a"].add(
        Request(rid, list(PROMPT), StopParams(12, ignore_eos=True)),
        Request("x", [1, 2, 3, 4, 5], StopParams(12, ignore_eos=True)),
    )
    e["a"].decoding(rid, "x")
    for _ in range(steps):
        e["a"].step()


def observe_move(
    e: dict[str, Stepper],
    rid: str,
    *,
    with_kv: bool,
    chunk_blocks: int | None = 1,
    fault: str | None = None,
    finished: dict[str, tuple[int, ...]] | None = None,
) -> Scenario:
    """PhasedMigration ``rid`` from ``a`` to ``b`` and snapshot the cluster after every phase."""
    move = PhasedMigration(
        e["a"].sched,
        e["b"].sched,
        rid,
        with_kv=with_kv,
        link=MemoryLink(e["a"], e["b"]),
        chunk_blocks=chunk_blocks,
    )
    scenario = Scenario(e, move, ["start"], [cluster_snapshot(e, finished=finished)])

    def observe(m: PhasedMigration) -> None:
        copied = m.phase is TransitPhase.STAGED and scenario.labels[-1] in ("staged", "chunk")
        scenario.labels.append("chunk" if copied else str(m.phase))
        scenario.snaps.append(cluster_snapshot(e, (m, "a", "b"), finished))

    def hook(point: str) -> None:
        if point == fault:
            raise Boom(point)

    try:
        move.run(fault=hook, observe=observe)
    except PhasedMigrationAborted:
        scenario.labels.append("aborted")
    else:
        scenario.labels.append("committed")
    scenario.snaps.append(cluster_snapshot(e, finished=finished))
    return scenario


@pytest.fixture
def transfer() -> Scenario:
    """``r`` decoding on ``a`` moves by transfer onto ``b``'s cached prefix, in chunks."""
    e = engines()
    done = cached_prefix(e)
    decoding(e)
    return observe_move(e, "r", with_kv=True, finished=done)


def _recompute() -> Scenario:
    e = engines()
    decoding(e)
    return observe_move(e, "r", with_kv=False)


def _swapped() -> Scenario:
    """``r`` arrives after a longer ``x``; when the pool runs out, it is the victim
    swapped out to ``a``'s host pool, and is moved from there."""
    e = engines()
    e["a"].add(Request("x", list(range(50, 80)), StopParams(16, ignore_eos=True)))
    e["a"].decoding("x")
    e["a"].add(Request("r", list(PROMPT), StopParams(12, ignore_eos=True)))
    e["a"].until(lambda: e["a"].sched.requests["r"].status is S.SWAPPED)
    return observe_move(e, "r", with_kv=True, chunk_blocks=None)


def _paused_on_host() -> Scenario:
    e = engines()
    decoding(e)
    e["a"].sched.pause("r", KVRetention.HOST)
    e["a"].step()  # the pause moves its KV to the host in the next step
    assert e["a"].sched.host.has_request("r")
    return observe_move(e, "r", with_kv=True)


def _aborted(point: str) -> Callable[[], Scenario]:
    def make() -> Scenario:
        e = engines()
        done = cached_prefix(e)
        decoding(e)
        return observe_move(e, "r", with_kv=True, fault=point, finished=done)

    return make


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "recompute": _recompute,
    "swapped": _swapped,
    "paused on the host": _paused_on_host,
    "aborted after the stage": _aborted("after_stage"),
    "aborted mid-stream": _aborted("mid_stream"),
    "aborted before the ack": _aborted("before_ack"),
}


def test_a_transfer_passes_every_rule_at_every_phase(transfer: Scenario) -> None:
    move = transfer.move
    assert transfer.labels == [
        "start",
        "exported",
        "staged",
        *["chunk"] * (len(transfer.labels) - 6),
        "acked",
        "released",
        "committed",
    ]
    assert move.arrival is not None and move.arrival.num_hit_tokens == 8  # b's cached prefix
    assert len(transfer.labels) > 6  # the rest came in chunks
    for step in transfer.steps():
        assert check_cluster(step) == []
    after = transfer.at("committed")
    b = after.node("b")
    assert b is not None and b.live("r") is not None and after.holders("r") == ["b"]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_other_moves_pass_every_rule(name: str) -> None:
    scenario = SCENARIOS[name]()
    move = scenario.move
    if name == "swapped" or name == "paused on the host":
        assert move.departure is not None and move.departure.kv_place is KVPlace.HOST
    if name.startswith("aborted"):
        assert scenario.labels[-1] == "aborted"
        assert scenario.at("aborted").holders("r") == ["a"]
    else:
        assert scenario.labels[-1] == "committed"
        assert scenario.at("committed").holders("r") == ["b"]
    for step in scenario.steps():
        assert check_cluster(step) == []


def test_the_rule_list_is_the_cluster_invariants() -> None:
    assert len(CLUSTER_CHECKS) == len(CLUSTER_INVARIANTS) == 5
    assert set(ENGINE_INVARIANTS) | CLUSTER_INVARIANTS | ROLE_INVARIANTS == set(Invariant)
    assert not set(ENGINE_INVARIANTS) & CLUSTER_INVARIANTS


# ------------------------------------------------------------------------ corruption
def node_of(snap: ClusterSnapshot, name: str) -> Node:
    n = snap.node(name)
    assert n is not None
    return n


def with_node(snap: ClusterSnapshot, name: str, **changes: object) -> ClusterSnapshot:
    nodes = tuple(
        replace(n, **changes) if n.name == name else n  # type: ignore[arg-type]
        for n in snap.nodes
    )
    return replace(snap, nodes=nodes)


def with_request(snap: ClusterSnapshot, name: str, rid: str, **changes: object) -> ClusterSnapshot:
    engine = node_of(snap, name).engine
    requests = tuple(
        replace(r, **changes) if r.request_id == rid else r  # type: ignore[arg-type]
        for r in engine.requests
    )
    return with_node(snap, name, engine=replace(engine, requests=requests))


def without_request(snap: ClusterSnapshot, name: str, rid: str) -> ClusterSnapshot:
    n = node_of(snap, name)
    engine = replace(n.engine, requests=tuple(r for r in n.engine.requests if r.request_id != rid))
    tokens = tuple(x for x in n.token_ids if x[0] != rid)
    return with_node(snap, name, engine=engine, token_ids=tokens)


def copy_request(snap: ClusterSnapshot, src: str, dst: str, rid: str) -> ClusterSnapshot:
    """``dst`` lists ``rid`` as ``src`` does (its tokens too)."""
    s, d = node_of(snap, src), node_of(snap, dst)
    r = s.engine.request(rid)
    toks = s.tokens(rid)
    assert r is not None and toks is not None
    engine = replace(d.engine, requests=(*d.engine.requests, r))
    return with_node(snap, dst, engine=engine, token_ids=(*d.token_ids, (rid, toks)))


def with_tokens(
    snap: ClusterSnapshot, name: str, rid: str, toks: tuple[int, ...]
) -> ClusterSnapshot:
    n = node_of(snap, name)
    return with_node(
        snap, name, token_ids=tuple((k, toks if k == rid else v) for k, v in n.token_ids)
    )


def with_delivered(snap: ClusterSnapshot, rid: str, **changes: object) -> ClusterSnapshot:
    delivered = tuple(
        replace(d, **changes) if d.request_id == rid else d  # type: ignore[arg-type]
        for d in snap.delivered
    )
    return replace(snap, delivered=delivered)


def with_transit(snap: ClusterSnapshot, **changes: object) -> ClusterSnapshot:
    (t,) = snap.transits
    return replace(snap, transits=(replace(t, **changes),))  # type: ignore[arg-type]


def with_slot(snap: ClusterSnapshot, name: str, slot: int, token: int) -> ClusterSnapshot:
    mem = dict(node_of(snap, name).memory or ())
    assert slot in mem and mem[slot] != token
    mem[slot] = token
    return with_node(snap, name, memory=tuple(sorted(mem.items())))


def with_table(snap: ClusterSnapshot, name: str, rid: str, **changes: object) -> ClusterSnapshot:
    engine = node_of(snap, name).engine
    tables = tuple(
        replace(t, **changes) if t.request_id == rid else t  # type: ignore[arg-type]
        for t in engine.pool.tables
    )
    return with_node(snap, name, engine=replace(engine, pool=replace(engine.pool, tables=tables)))


def transit_of(snap: ClusterSnapshot) -> Transit:
    (t,) = snap.transits
    return t


# ------------------------------------------------------------------------------ OWNER
def test_owner_destination_listing_the_request_mid_transit(transfer: Scenario) -> None:
    bad = copy_request(transfer.at("staged"), "a", "b", "r")
    v = find(check_owner(bad), OWNER, "request r", "in transit (staged) it must be listed by")
    assert (v.expected, v.seen) == ("['a']", "['a', 'b']")


def test_owner_source_released_before_the_ack(transfer: Scenario) -> None:
    bad = without_request(transfer.at("staged"), "a", "r")
    v = find(check_owner(bad), OWNER, "request r", "its source only")
    assert (v.expected, v.seen) == ("['a']", "[]")


def test_owner_source_still_listing_it_after_release(transfer: Scenario) -> None:
    bad = replace(transfer.at("released"), nodes=transfer.at("acked").nodes)
    v = find(check_owner(bad), OWNER, "request r", "no engine until the destination commits")
    assert (v.expected, v.seen) == ("[]", "['a']")


def test_owner_live_on_two_engines(transfer: Scenario) -> None:
    bad = copy_request(transfer.at("start"), "a", "b", "r")
    v = find(check_owner(bad), OWNER, "request r", "live on more than one engine")
    assert v.seen == "['a', 'b']"


def test_owner_lost_request(transfer: Scenario) -> None:
    bad = without_request(transfer.at("committed"), "b", "r")
    find(check_owner(bad), OWNER, "request r", "not finished, yet no engine owns it")


def test_owner_finished_yet_owned(transfer: Scenario) -> None:
    bad = with_delivered(transfer.at("committed"), "r", done=True)
    find(check_owner(bad), OWNER, "request r", "finished, yet still owned")
    bad = with_delivered(transfer.at("staged"), "r", done=True)
    find(check_owner(bad), OWNER, "request r", "finished, yet still owned")


def test_owner_live_request_unknown_to_the_cluster(transfer: Scenario) -> None:
    snap = transfer.at("committed")
    bad = replace(snap, delivered=tuple(d for d in snap.delivered if d.request_id != "x"))
    find(check_owner(bad), OWNER, "request x", "its client was never told of it")


def test_owner_bad_transit_records(transfer: Scenario) -> None:
    snap = transfer.at("staged")
    t = transit_of(snap)
    find(check_owner(with_transit(snap, destination="zz")), OWNER, "request r", "unknown engine")
    find(check_owner(with_transit(snap, destination="a")), OWNER, "request r", "to itself")
    twice = replace(snap, transits=(t, t))
    find(check_owner(twice), OWNER, "request r", "in transit twice at once")
    dup = replace(snap, nodes=(*snap.nodes, node_of(snap, "a")))
    find(check_owner(dup), OWNER, "cluster", "two engines share a name")


# --------------------------------------------------------------------------- CONSERVE
@dataclass
class Stepped:
    step: ClusterStep
    finished: str  # a request the step finished


@pytest.fixture
def stepped() -> Stepped:
    """A real step of ``a``: ``r`` and ``x`` sample, ``f`` samples its last token."""
    e = engines()
    decoding(e, steps=0)
    f = Request("f", [7, 8, 9], StopParams(2, ignore_eos=True))
    e["a"].add(f)
    e["a"].decoding("f")
    before = cluster_snapshot(e)
    rec = e["a"].step()
    assert f.is_done
    samples = tuple(Sample("a", rid, (tok,)) for rid, tok in rec.outcome.last_tokens())
    assert {s.request_id for s in samples} == {"r", "x", "f"}
    after = cluster_snapshot(e, finished={"f": tuple(f.output_token_ids)})
    step = ClusterStep(before, after, samples)
    assert check_cluster(step) == []
    return Stepped(step, "f")


def test_conserve_a_token_delivered_twice(stepped: Stepped) -> None:
    after = stepped.step.after
    d = after.delivery("r")
    assert d is not None
    bad = replace(stepped.step, after=with_delivered(after, "r", token_ids=d.token_ids * 2))
    v = find(check_conserve(bad), CONSERVE, "request r", "delivered outputs differ")
    assert v.seen == str(d.token_ids * 2)


def test_conserve_a_token_not_delivered(stepped: Stepped) -> None:
    after = stepped.step.after
    d = after.delivery("x")
    assert d is not None
    bad = replace(stepped.step, after=with_delivered(after, "x", token_ids=d.token_ids[:-1]))
    find(check_conserve(bad), CONSERVE, "request x", "delivered outputs differ")


def test_conserve_tokens_grow_by_other_than_sampled(stepped: Stepped) -> None:
    after = stepped.step.after
    toks = node_of(after, "a").tokens("r")
    assert toks is not None
    bad = replace(stepped.step, after=with_tokens(after, "a", "r", (*toks, 3)))
    v = find(check_conserve(bad), CONSERVE, "request r", "token ids changed by other than")
    assert v.expected == str(toks)


def test_conserve_sampled_on_an_engine_that_does_not_own_it(stepped: Stepped) -> None:
    samples = tuple(
        replace(s, engine="b") if s.request_id == "r" else s for s in stepped.step.sampled
    )
    bad = replace(stepped.step, sampled=samples)
    v = find(check_conserve(bad), CONSERVE, "request r", "on an engine that does not own it")
    assert (v.expected, v.seen) == ("['a']", "b")


def test_conserve_sampled_twice(stepped: Stepped) -> None:
    s = next(s for s in stepped.step.sampled if s.request_id == "r")
    bad = replace(stepped.step, sampled=(*stepped.step.sampled, replace(s, engine="b")))
    find(check_conserve(bad), CONSERVE, "request r", "sampled on more than one engine at once")


def test_conserve_sampled_after_it_finished(stepped: Stepped) -> None:
    again = ClusterStep(stepped.step.after, stepped.step.after, (Sample("a", "f", (1,)),))
    find(check_conserve(again), CONSERVE, "request f", "sampled after it finished")


def test_conserve_a_request_vanishing_without_finishing(stepped: Stepped) -> None:
    after = stepped.step.after
    bad = replace(stepped.step, after=without_request(after, "a", "x"))
    find(check_conserve(bad), CONSERVE, "request x", "its tokens are lost")


def test_conserve_delivered_stream_vanished_or_reopened(stepped: Stepped) -> None:
    after = stepped.step.after
    gone = replace(after, delivered=tuple(d for d in after.delivered if d.request_id != "r"))
    find(check_conserve(replace(stepped.step, after=gone)), CONSERVE, "request r", "vanished")
    reopened = ClusterStep(after, with_delivered(after, "f", done=False))
    find(check_conserve(reopened), CONSERVE, "request f", "its finished stream was reopened")


def test_conserve_tokens_lost_across_a_move(transfer: Scenario) -> None:
    step = transfer.step("committed")
    toks = node_of(step.after, "b").tokens("r")
    assert toks is not None
    bad = replace(step, after=with_tokens(step.after, "b", "r", toks[:-1]))
    v = find(check_conserve(bad), CONSERVE, "request r", "token ids changed by other than")
    assert (v.expected, v.seen) == (str(toks), str(toks[:-1]))


def test_conserve_tool_tokens_are_appended() -> None:
    """A resumed turn's tool tokens are what ``appended`` says, nothing else."""
    e = engines()
    decoding(e, steps=0)
    e["a"].sched.pause("r", KVRetention.DEVICE)
    before = cluster_snapshot(e)
    e["a"].sched.resume("r", [5, 6], StopParams(2, ignore_eos=True))
    # The client has every turn's outputs (cluster_snapshot counts this turn's only).
    after = replace(cluster_snapshot(e), delivered=before.delivered)
    step = ClusterStep(before, after, appended=(Sample("a", "r", (5, 6)),))
    assert check_cluster(step) == []
    v = find(check_conserve(replace(step, appended=())), CONSERVE, "request r", "token ids")
    assert v.seen.endswith("5, 6)")


# ------------------------------------------------------------------------------ MOVED
def test_moved_kv_length_off_on_landing(transfer: Scenario) -> None:
    step = transfer.step("committed")
    r = node_of(step.after, "b").live("r")
    assert r is not None
    bad = replace(
        step,
        after=with_request(step.after, "b", "r", num_computed_tokens=r.num_computed_tokens + 1),
    )
    v = find(check_moved(bad), MOVED, "request r", "landed on b with other counters")
    assert v.seen.endswith(f"{r.num_computed_tokens + 1})")


def test_moved_positions_off_on_landing(transfer: Scenario) -> None:
    step = transfer.step("committed")
    table = node_of(step.after, "b").engine.pool.table("r")
    assert table is not None
    shifted = (table.token_ids[0] + 1, *table.token_ids[1:])
    bad = replace(step, after=with_table(step.after, "b", "r", token_ids=shifted))
    find(check_moved(bad), MOVED, "request r", "does not hold the source's positions")


def test_moved_token_ids_differ_on_landing(transfer: Scenario) -> None:
    step = transfer.step("committed")
    toks = node_of(step.after, "b").tokens("r")
    assert toks is not None
    bad = replace(step, after=with_tokens(step.after, "b", "r", (*toks[:-1], toks[-1] + 1)))
    find(check_moved(bad), MOVED, "request r", "other token ids than the source's")


def test_moved_recompute_landing_with_kv() -> None:
    scenario = _recompute()
    step = scenario.step("committed")
    t = transit_of(step.before)
    assert not t.with_kv
    bad = replace(step, before=with_transit(step.before, with_kv=True))  # it claimed a transfer
    find(check_moved(bad), MOVED, "request r", "landed on b with other counters")
    find(check_moved(bad), MOVED, "request r", "does not hold the source's positions")


def test_moved_landing_state(transfer: Scenario) -> None:
    step = transfer.step("committed")
    bad = replace(step, after=with_request(step.after, "b", "r", status=S.WAITING))
    v = find(check_moved(bad), MOVED, "request r", "in a state its KV does not allow")
    assert v.expected == "prefilling or decoding"


def test_moved_source_changed_in_transit(transfer: Scenario) -> None:
    snap = transfer.at("staged")
    r = node_of(snap, "a").live("r")
    assert r is not None
    bad = with_request(snap, "a", "r", num_output_tokens=r.num_output_tokens + 1)
    find(check_moved(ClusterStep(snap, bad)), MOVED, "request r", "changed on its source a")


def test_moved_source_kv_changed_in_transit(transfer: Scenario) -> None:
    snap = transfer.at("acked")
    table = node_of(snap, "a").engine.pool.table("r")
    assert table is not None
    bad = with_table(snap, "a", "r", token_ids=(0, *table.token_ids[1:]))
    find(check_moved(ClusterStep(snap, bad)), MOVED, "request r", "its KV on the source a")


def test_moved_staged_table_of_another_length(transfer: Scenario) -> None:
    snap = transfer.at("staged")
    bad = with_table(snap, "b", "r", num_stored=transit_of(snap).kv_length - 1)
    find(check_moved(ClusterStep(snap, bad)), MOVED, "request r", "the table staged on b")


def test_moved_committed_before_release(transfer: Scenario) -> None:
    step = ClusterStep(transfer.at("acked"), transfer.at("committed"))
    find(check_moved(step), MOVED, "request r", "committed before its source released it")


def test_moved_without_transit(transfer: Scenario) -> None:
    step = ClusterStep(transfer.at("start"), transfer.at("committed"))
    v = find(check_moved(step), MOVED, "request r", "moved from a without being in transit")
    assert (v.expected, v.seen) == ("None", "['b']")


def test_moved_transit_going_back_a_phase(transfer: Scenario) -> None:
    step = ClusterStep(transfer.at("acked"), transfer.snaps[transfer.labels.index("acked") - 1])
    find(check_moved(step), MOVED, "request r", "its transit went back a phase")


# ----------------------------------------------------------------------------- KVCOPY
def test_kv_copy_destination_slot_off_after_the_ack(transfer: Scenario) -> None:
    snap = transfer.at("acked")
    t = transit_of(snap)
    arrival = transfer.move.arrival
    assert arrival is not None
    slot = arrival.slots[0]  # the first position after the hit
    bad = with_slot(snap, "b", slot, 77)
    v = find(check_kv_copy(bad), KVCOPY, "request r", "does not hold the source's token")
    assert (v.expected, v.seen) == (str(t.token_ids[t.num_hit_tokens]), "77")
    assert f"device slot {slot} (position {t.num_hit_tokens})" in v.message


def test_kv_copy_partial_before_the_ack_is_allowed(transfer: Scenario) -> None:
    """Mid-copy the staged table is partly written: not a finding until the ack."""
    snap = transfer.at("staged")
    arrival = transfer.move.arrival
    assert arrival is not None
    mem = dict(node_of(snap, "b").memory or ())
    assert all(mem.get(s) is None for s in arrival.slots)  # b's blocks were fresh
    assert check_kv_copy(snap) == []
    written = replace(transit_of(snap), phase=TransitPhase.ACKED)
    bad = replace(snap, transits=(written,))
    find(check_kv_copy(bad), KVCOPY, "request r", "does not hold the source's token")


def test_kv_copy_live_table_and_cache_entry(transfer: Scenario) -> None:
    snap = transfer.at("committed")
    table = node_of(snap, "a").engine.pool.table("x")
    assert table is not None
    bad = with_slot(snap, "a", table.block_table[0] * 4, 77)
    v = find(check_kv_copy(bad), KVCOPY, "request x", "does not hold its token")
    assert v.seen == "77"
    entries = node_of(snap, "b").engine.pool.cache_entries
    held = {b for t in node_of(snap, "b").engine.pool.tables for b in t.block_table}
    e = next(e for e in entries if e.block_id not in held)  # p's blocks, free and cached
    bad = with_slot(snap, "b", e.block_id * 2, 77)
    find(check_kv_copy(bad), KVCOPY, f"engine b: block {e.block_id}", "cache entry")


def test_kv_copy_host_table() -> None:
    scenario = _swapped()
    snap = scenario.at("exported")
    host = node_of(snap, "a").engine.host
    assert host is not None
    table = host.table("r")
    assert table is not None
    mem = dict(node_of(snap, "a").host_memory or ())
    slot = table.block_table[0] * 4
    mem[slot] = 77
    bad = with_node(snap, "a", host_memory=tuple(sorted(mem.items())))
    v = find(check_kv_copy(bad), KVCOPY, "request r", "host slot")
    assert v.seen == "77"


# ------------------------------------------------------------------------------- LEAK
def test_leak_extra_reference_on_the_destination(transfer: Scenario) -> None:
    snap = transfer.at("committed")
    pool = node_of(snap, "b").engine.pool
    table = pool.table("r")
    assert table is not None
    b0 = table.block_table[0]  # a hit block: b's cached prefix
    ref = list(pool.ref_cnt)
    ref[b0] += 1
    engine = replace(node_of(snap, "b").engine, pool=replace(pool, ref_cnt=tuple(ref)))
    bad = with_node(snap, "b", engine=engine)
    v = find(check_leak(ClusterStep(snap, bad)), LEAK, f"engine b: block {b0}", "ref_cnt differs")
    assert v.message.startswith("device pool (BLOCK): ")


def test_leak_double_free(transfer: Scenario) -> None:
    snap = transfer.at("released")
    pool = node_of(snap, "a").engine.pool
    dup = pool.free_queue[0]
    engine = replace(
        node_of(snap, "a").engine, pool=replace(pool, free_queue=(*pool.free_queue, dup))
    )
    bad = with_node(snap, "a", engine=engine)
    find(check_leak(ClusterStep(snap, bad)), LEAK, f"engine a: block {dup}", "more than once")


def test_leak_source_keeping_its_blocks_after_release(transfer: Scenario) -> None:
    acked, released = transfer.at("acked"), transfer.at("released")
    table = node_of(acked, "a").engine.pool.table("r")
    assert table is not None
    engine = node_of(released, "a").engine
    kept = replace(engine, pool=replace(engine.pool, tables=(*engine.pool.tables, table)))
    bad = with_node(released, "a", engine=kept)
    v = find(
        check_leak(ClusterStep(acked, bad)),
        LEAK,
        "engine a: request r",
        "neither live here nor staged for a move here",
    )
    assert v.seen == str(table.block_table)


def test_leak_half_imported_request_left_behind() -> None:
    scenario = _aborted("mid_stream")()
    staged = scenario.at("staged")
    table = node_of(staged, "b").engine.pool.table("r")
    assert table is not None
    after = scenario.at("aborted")
    engine = node_of(after, "b").engine
    left = replace(engine, pool=replace(engine.pool, tables=(*engine.pool.tables, table)))
    bad = with_node(after, "b", engine=left)
    step = ClusterStep(scenario.snaps[-2], bad)
    find(check_leak(step), LEAK, "engine b: request r", "neither live here nor staged")
    find(check_leak(step), LEAK, "request r", "an aborted move left the pool of b changed")


def test_leak_aborted_move_must_restore_the_pool() -> None:
    scenario = _aborted("after_stage")()
    staged = scenario.at("staged")
    step = ClusterStep(staged, replace(scenario.at("aborted"), nodes=staged.nodes))
    vs = check_leak(step)
    v = find(vs, LEAK, "request r", "an aborted move left the pool of b changed")
    assert "tables ['r']" in v.seen


def test_leak_staged_blocks_not_the_transits(transfer: Scenario) -> None:
    snap = transfer.at("staged")
    t = transit_of(snap)
    bad = with_transit(snap, staged_blocks=t.staged_blocks[:-1])
    v = find(check_leak(ClusterStep(snap, bad)), LEAK, "engine b: request r", "not the transit's")
    assert v.seen == str(t.staged_blocks)
    recompute = _recompute().at("staged")
    claim = with_transit(recompute, staged_blocks=(0,))
    find(
        check_leak(ClusterStep(recompute, claim)), LEAK, "engine b: request r", "not the transit's"
    )


def test_leak_staged_table_missing(transfer: Scenario) -> None:
    snap = transfer.at("staged")
    engine = node_of(snap, "b").engine
    tables = tuple(t for t in engine.pool.tables if t.request_id != "r")
    bad = with_node(snap, "b", engine=replace(engine, pool=replace(engine.pool, tables=tables)))
    v = find(check_leak(ClusterStep(snap, bad)), LEAK, "engine b: request r", "not the transit's")
    assert v.seen == "()"


def test_every_check_of_the_list_runs(transfer: Scenario) -> None:
    """``check_cluster`` is the list: each corruption above shows up there too."""
    snap = transfer.at("committed")
    bad = with_delivered(without_request(snap, "b", "r"), "r", done=False)
    found = {v.invariant for v in check_cluster(ClusterStep(transfer.at("released"), bad))}
    assert OWNER in found and CONSERVE in found
    table = TableSnapshot("ghost", (0,), 1, (1,))
    engine = node_of(snap, "b").engine
    ghost = replace(engine, pool=replace(engine.pool, tables=(*engine.pool.tables, table)))
    found = {
        v.invariant for v in check_cluster(ClusterStep(snap, with_node(snap, "b", engine=ghost)))
    }
    assert LEAK in found
    assert Delivered("r") != Delivered("r", done=True)
