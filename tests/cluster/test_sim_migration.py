"""The cluster simulator's ends of the one migration driver (ref/cluster/sim_migration.py),
each on its own: a replica's scheduler as the source (a pure read that prices the move
and sizes its K/V), the link towards a peer as the destination (that peer's prefix hit
under the request's namespace, an import that owns the request once acked), and the
landing (with its K/V, or without it when the peer has no room)."""

from __future__ import annotations

import pytest

from refserve.cluster.index import GlobalPrefixIndex
from refserve.cluster.sim_migration import LinkDestination, ReplicaSource, land
from refserve.core import transit
from refserve.core.config import SchedulerConfig
from refserve.core.migration_cost import KVMode, MigrationCost
from refserve.core.request import Request, StopParams
from refserve.core.transit import MigrationError
from refserve.engine.ticket import KVChunk
from refserve.spec.hashing import Namespace
from tests.harness import Stepper

CFG = SchedulerConfig(max_num_batched_tokens=16, block_size=2, num_blocks=16, cache_events=True)
COST = MigrationCost(kv_bytes_per_token=100)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
NS = Namespace(model="m", cache_salt="tenant-a")


def _decoding(namespace: Namespace | None = None) -> tuple[Stepper, Request]:
    """A source whose request ``r`` computed its prompt and decodes."""
    src = Stepper(CFG)
    ns = namespace or Namespace()
    r = Request("r", list(PROMPT), StopParams(8, ignore_eos=True), namespace=ns)
    src.add(r)
    src.until(lambda: r.num_computed_tokens >= len(PROMPT))
    return src, r


def test_the_export_prices_the_move_and_sizes_its_kv_and_changes_nothing() -> None:
    src, r = _decoding()
    before = src.sched.snapshot()
    source = ReplicaSource(src.sched, 5.0, COST)
    kv = r.num_computed_tokens
    default = source.export_request("r")  # the defaults: K/V inline, the rule's pick
    assert default.kv_tokens == kv and default.clock_ms == 5.0
    sent = source.export_request("r", kv=KVMode.TRANSFER, hit_tokens=4)
    assert (sent.kv_mode, sent.kv_tokens, sent.moved_tokens) == (KVMode.TRANSFER, kv, kv - 4)
    assert sent.kv_bytes == (kv - 4) * 100 and sent.num_chunks == 1 and sent.with_kv
    assert sent.state == source.export_state("r") and sent.record == r.snapshot(CFG.max_len)
    redone = source.export_request("r", kv=KVMode.RECOMPUTE, hit_tokens=4)
    assert (redone.moved_tokens, redone.kv_bytes, redone.num_chunks) == (0, 0, 0)
    assert not redone.with_kv
    assert src.sched.snapshot() == before and not source.source_changed(sent)
    src.step()
    assert source.source_changed(sent)  # it decoded a token since


def test_a_simulated_replica_streams_no_kv() -> None:
    src, _ = _decoding()
    source = ReplicaSource(src.sched, 0.0, COST)
    with pytest.raises(MigrationError, match="travels whole, not streamed"):
        source.export_request("r", inline=False)
    with pytest.raises(MigrationError, match="holds no K/V bytes"):
        source.read_kv("r", 0, 2)


def test_the_link_reads_the_peers_hit_under_the_requests_namespace() -> None:
    index = GlobalPrefixIndex()
    for i in (0, 1):
        index.add_replica(i, CFG.block_size)
    peer = Stepper(CFG)
    peer.add(Request("p", list(PROMPT), StopParams(1, ignore_eos=True), namespace=NS))
    peer.until(lambda: not peer.sched.has_unfinished)
    log = peer.sched.pool.cache_events
    assert log is not None
    index.apply(1, log.drain())
    dest = LinkDestination(index, 1, 0.25)
    _, r = _decoding(NS)
    state = transit.RequestState.of(r)
    hit = dest.prefix_hit_tokens(PROMPT, state)
    assert hit == index.longest_prefix(PROMPT, NS)[1] > 0
    assert dest.prefix_hit_tokens(PROMPT, transit.RequestState.of(_decoding()[1])) == 0
    assert dest.prefix_hit_tokens([], state) == 0 and dest.idle_fraction == 0.25
    assert LinkDestination(index, 0, 1.0).prefix_hit_tokens(PROMPT, state) == 0


def test_the_link_owns_the_request_once_acked_and_puts_it_in_flight_at_the_commit() -> None:
    src, _ = _decoding()
    ticket = ReplicaSource(src.sched, 0.0, COST).export_request("r", kv=KVMode.TRANSFER)
    dest = LinkDestination(GlobalPrefixIndex(), 1, 1.0)
    staged = dest.stage_import(ticket)
    assert dest.staged is staged and staged.needed == {} and staged.decision == ticket.decision
    assert not staged.acked and not staged.done
    with pytest.raises(AssertionError, match="no move was committed"):
        dest.committed()
    with pytest.raises(AssertionError, match="needs the ack"):
        staged.commit()
    with pytest.raises(MigrationError, match="travels whole"):
        staged.write(KVChunk("r", 0, 2, b""))
    staged.ack()
    assert staged.commit() == ["r"] and staged.done and dest.committed() is ticket
    with pytest.raises(AssertionError, match="abort after commit"):
        staged.abort()


@pytest.mark.parametrize("room", [True, False], ids=["with-its-kv", "fallback"])
def test_the_landing_takes_the_kv_when_the_peer_has_room(room: bool) -> None:
    src, r = _decoding()
    source = ReplicaSource(src.sched, 0.0, COST)
    ticket = source.export_request("r", kv=KVMode.TRANSFER)
    source.release_request("r")
    assert "r" not in src.sched.requests
    dst = Stepper(CFG)
    if not room:  # a request running there holds all but a few blocks
        busy = Request("busy", list(range(100, 126)), StopParams(8, ignore_eos=True))
        dst.add(busy)
        dst.until(lambda: busy.num_computed_tokens >= 26)
        assert dst.sched.pool.num_free_blocks * CFG.block_size < ticket.kv_tokens
    landing = land(dst.sched, ticket)
    assert landing.fallback is not room
    moved = landing.request
    assert moved.request_id == "r" and dst.sched.requests["r"] is moved
    assert moved.num_computed_tokens == (ticket.kv_tokens if room else 0)
    assert moved.token_ids == r.token_ids


def test_a_stage_without_kv_arrives_with_none() -> None:
    _, r = _decoding()
    assert r.num_computed_tokens > 0
    dst = Stepper(CFG)
    imp = transit.begin_import(dst.sched)
    arrival = imp.stage(transit.RequestState.of(r), with_kv=False)
    assert arrival.state.num_computed_tokens == 0 and arrival.kv_length == 0
    imp.abort()
    assert not dst.sched.requests
