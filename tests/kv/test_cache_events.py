"""Cache events from the block pool (ref/kv/events.py) and the replay rule EVENTS
(spec/events.py): replaying the published events gives exactly the pool's cache index,
and a rolled-back step publishes nothing. tests/kv/test_pool_state_machine.py checks the
rule after every operation; these tests pin the stream down and show the rule failing."""

from __future__ import annotations

import pytest

from refserve.kv import BlockPool
from refserve.kv.events import CacheEventLog
from refserve.kv.prefix_index import PrefixIndex
from refserve.spec.events import BlockRemoved, BlockStored, CacheCleared, CacheEvent, check_events
from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace, block_key
from refserve.spec.snapshot import CacheEntry
from refserve.spec.violation import Invariant

BS = 2


def pool(num_blocks: int = 4) -> BlockPool:
    return BlockPool(num_blocks, BS, cache_events=True)


def drain(p: BlockPool) -> list[CacheEvent]:
    log = p.cache_events
    assert log is not None
    return log.drain()


def test_off_by_default() -> None:
    assert BlockPool(4, BS).cache_events is None


def test_stored_blocks_are_published_in_order_with_their_keys() -> None:
    p = pool()
    p.allocate("a", [1, 2, 3, 4, 5], 5)
    events = drain(p)
    root = DEFAULT_NAMESPACE.root_key()
    k1 = block_key(root, (1, 2))
    k2 = block_key(k1, (3, 4))
    table = p.block_table("a")
    assert events == [
        CacheEvent(0, BlockStored(k1, root, (1, 2), table[0])),
        CacheEvent(1, BlockStored(k2, k1, (3, 4), table[1])),
    ]
    assert drain(p) == []  # drained once


def test_the_namespace_is_in_the_chain_root() -> None:
    p = pool()
    salted = Namespace(cache_salt="tenant-b")
    p.allocate("a", [1, 2, 3], 3, namespace=salted)
    (ev,) = drain(p)
    assert isinstance(ev.change, BlockStored)
    assert ev.change.parent_key == salted.root_key() != DEFAULT_NAMESPACE.root_key()


def test_eviction_forget_and_clear_are_published() -> None:
    p = pool(num_blocks=2)
    p.allocate("a", [1, 2, 3, 4], 4)
    p.free("a")  # both blocks stay cached, evictable
    stored = drain(p)
    assert [type(e.change) for e in stored] == [BlockStored, BlockStored]
    p.allocate("b", [7, 8, 9], 3)  # needs both blocks: evicts both entries, stores [7, 8]
    changes = [e.change for e in drain(p)]
    removed = [c for c in changes if isinstance(c, BlockRemoved)]
    assert {c.key for c in removed} == {
        s.change.key for s in stored if isinstance(s.change, BlockStored)
    }
    assert isinstance(changes[-1], BlockStored) and changes[-1].token_ids == (7, 8)
    assert p.forget_cached(p.block_table("b")) == 1
    (forgot,) = drain(p)
    assert isinstance(forgot.change, BlockRemoved) and forgot.seq == 5
    p.free("b")
    p.allocate("c", [5, 6, 1], 3)
    assert [e.seq for e in drain(p)] == [6]
    assert p.clear_cache() == 1
    (cleared,) = drain(p)
    assert cleared.change == CacheCleared()
    assert p.snapshot().cache_entries == ()


def test_a_rolled_back_transaction_publishes_nothing_and_a_committed_one_publishes_at_commit() -> (
    None
):
    p = pool()
    p.begin()
    p.allocate("a", [1, 2, 3], 3)
    assert drain(p) == []  # pending until the transaction closes
    p.rollback()
    assert drain(p) == []
    p.begin()
    p.allocate("a", [1, 2, 3], 3)
    p.clear_cache()
    p.rollback()  # the clear is undone too, and never published
    assert drain(p) == [] and len(p.snapshot().cache_entries) == 0
    p.begin()
    p.allocate("a", [1, 2, 3], 3)
    p.commit()
    (ev,) = drain(p)
    assert ev.seq == 0  # numbering continues from what was published, not from what was tried


def test_replay_reproduces_the_index_across_many_operations() -> None:
    p = pool(num_blocks=6)
    replica: tuple[CacheEntry, ...] = ()
    seq = 0
    for step, prompt in enumerate([[1, 2, 3, 4, 5], [1, 2, 3, 9], [6, 6, 6, 6, 6, 6, 6]]):
        rid = f"r{step}"
        p.begin()
        hit = p.lookup(prompt)
        p.allocate(rid, prompt, len(prompt) - hit.num_tokens, hit=hit)
        p.commit()
        if step == 1:
            p.free("r0")
        events = drain(p)
        after = p.snapshot()
        assert check_events(replica, events, seq, after) == []
        replica, seq = after.cache_entries, seq + len(events)


# ------------------------------------------------------------------ the rule fails
def _stream() -> tuple[BlockPool, list[CacheEvent]]:
    p = pool()
    p.allocate("a", [1, 2, 3, 4, 5], 5)
    p.free("a")
    p.forget_cached(p.snapshot().free_queue[-1:])
    return p, drain(p)


def test_the_rule_holds_on_the_real_stream() -> None:
    p, events = _stream()
    assert check_events((), events, 0, p.snapshot()) == []


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda ev: ev[:-1], "replayed cache entry differs"),  # an event lost
        (lambda ev: [ev[0], ev[0], *ev[1:]], "stores a key the cache already holds"),
        (lambda ev: [*ev, ev[-1]], "removes an entry the cache does not hold"),
        (lambda ev: [ev[0], CacheEvent(5, ev[1].change), *ev[2:]], "sequence gap"),
    ],
    ids=["lost", "duplicated", "removed-twice", "gap"],
)
def test_the_rule_fails_on_a_corrupted_stream(corrupt, message) -> None:  # type: ignore[no-untyped-def]
    p, events = _stream()
    found = check_events((), corrupt(events), 0, p.snapshot())
    assert found and all(v.invariant is Invariant.EVENTS for v in found)
    assert any(message in v.message for v in found), found


def test_planted_unreported_eviction_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool whose ``_drop`` forgets to report: the replayed index keeps a stale entry."""
    real = PrefixIndex._drop

    def silent(self: PrefixIndex, block_ids: list[int]):  # type: ignore[no-untyped-def]
        events, self.events = self.events, None
        try:
            return real(self, block_ids)
        finally:
            self.events = events

    monkeypatch.setattr(PrefixIndex, "_drop", silent)
    p, events = _stream()
    found = check_events((), events, 0, p.snapshot())
    assert [v.message for v in found] == ["replayed cache entry differs from the pool's"]


def _keep_everything(self: CacheEventLog, mark: int) -> None:
    """The planted bug: the undo of a pending change does nothing."""


def test_planted_rollback_that_publishes_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Events that survive a rollback describe a state the pool never committed."""
    monkeypatch.setattr(CacheEventLog, "_take_back", _keep_everything)
    p = pool()
    p.begin()
    p.allocate("a", [1, 2, 3], 3)
    p.rollback()
    found = check_events((), drain(p), 0, p.snapshot())
    assert found and found[0].invariant is Invariant.EVENTS
