"""Checks added to kill mutants that survived ``make mutation`` (see docs/MUTATION.md).

Each test names the code it pins down; all are small, deterministic and fast.
"""

from __future__ import annotations

import pytest

import ref.kv.pool as pool_module
from ref.core.config import SchedulerConfig
from ref.core.cost import StepCost
from ref.core.engine_core import EngineCore
from ref.core.request import FinishReason, Request, StopParams
from ref.core.scheduler import Scheduler, StepInProgress
from ref.errors import DuplicateRequest, InvalidArgument, UnknownRequest
from ref.kv import BlockPool, PrefixHit
from ref.kv.free_queue import FreeQueue
from ref.kv.journal import Journal
from ref.sim.simulator import SimExecutor
from spec import check_pool
from spec.snapshot import RequestStatus as S


# ------------------------------------------------------------------ free queue
def test_free_queue_peek_is_hand_out_order_and_bounded() -> None:
    fq = FreeQueue(5, Journal())
    assert fq.peek(0) == []
    assert fq.peek(3) == [0, 1, 2]
    assert fq.peek(9) == [0, 1, 2, 3, 4]
    fq.remove(1)
    fq.append(1)
    assert fq.peek(5) == [0, 2, 3, 4, 1]
    assert fq.peek(2) == [0, 2]
    assert list(fq) == [0, 2, 3, 4, 1]  # peek removed nothing
    assert len(fq) == 5


def test_journal_and_free_queue_misuse_fails_loudly() -> None:
    journal = Journal()
    with pytest.raises(AssertionError, match=r"^rollback without an open transaction"):
        journal.rollback()
    with pytest.raises(AssertionError, match=r"^commit without an open transaction"):
        journal.commit()
    journal.begin()
    with pytest.raises(AssertionError, match=r"^a transaction is already open"):
        journal.begin()
    fq = FreeQueue(1, journal)
    with pytest.raises(AssertionError, match=r"^block 0 is already in the free queue"):
        fq.append(0)
    assert fq.popleft() == 0
    with pytest.raises(AssertionError, match=r"^popleft on an empty free queue"):
        fq.popleft()
    with pytest.raises(AssertionError, match=r"^block 0 is not in the free queue"):
        fq.remove(0)
    journal.rollback()
    assert list(fq) == [0] and not journal.active


# ------------------------------------------------------------------ block pool
def test_block_table_view_is_the_live_table() -> None:
    pool = BlockPool(4, 2)
    pool.allocate("a", [1, 2, 3], 3)
    view = pool.block_table_view("a")
    assert list(view) == [0, 1]
    pool.allocate("a", [1, 2, 3, 4, 5], 2)
    assert list(view) == [0, 1, 2]  # live: sees the growth without a new call
    with pytest.raises(UnknownRequest, match=r"^block_table_view: unknown request id 'x'$"):
        pool.block_table_view("x")


def test_free_queue_contains_returns_a_bool_after_an_undone_append() -> None:
    journal = Journal()
    fq = FreeQueue(3, journal)
    fq.remove(2)
    journal.begin()
    fq.append(2)
    journal.rollback()  # _unlink_tail
    assert fq.__contains__(2) is False
    assert fq.__contains__(1) is True
    assert list(fq) == [0, 1] and len(fq) == 2


def test_pool_unknown_request_messages_name_the_operation() -> None:
    pool = BlockPool(4, 2)
    pool.allocate("a", [1, 2, 3], 3)
    cases = {
        "num_stored": lambda: pool.num_stored("x"),
        "block_table": lambda: pool.block_table("x"),
        "free": lambda: pool.free("x"),
        "append_decode_tokens": lambda: pool.append_decode_tokens(["a", "x"], [[1], [2]]),
        "block_table_views": lambda: pool.block_table_views(["a", "x"]),
        "fork": lambda: pool.fork("x", "c"),
    }
    for what, call in cases.items():
        with pytest.raises(UnknownRequest) as info:
            call()
        assert str(info.value) == f"{what}: unknown request id 'x'"
    with pytest.raises(DuplicateRequest) as dup:
        pool.fork("a", "a")
    assert str(dup.value) == "fork: request id 'a' is already in use"
    with pytest.raises(InvalidArgument) as bad:
        pool.append_decode_tokens(["a"], [[1, 2, 3]])
    assert str(bad.value) == (
        "append_decode_tokens: a request has 3 known tokens and 3 stored; "
        "there is no new token to append"
    )
    views = pool.block_table_views(["a", "a"])
    assert [list(v) for v in views] == [[0, 1], [0, 1]]


def test_evict_rejects_a_negative_count_by_name() -> None:
    pool = BlockPool(4, 2)
    with pytest.raises(InvalidArgument) as info:
        pool.evict(-1)
    assert str(info.value) == "num_blocks must be >= 0, got -1"
    assert pool.evict(0) == 0


def test_forget_cached_counts_only_cached_in_range_blocks() -> None:
    pool = BlockPool(4, 2)
    pool.allocate("a", [1, 2, 3, 4, 5], 5)  # blocks 0, 1 full and cached; 2 partial
    assert len(pool.snapshot().cache_entries) == 2
    assert pool.forget_cached([]) == 0
    assert pool.forget_cached([2, 4, -1, 99]) == 0  # uncached or out of range
    assert pool.forget_cached([0, 1, 4]) == 2  # 4 == num_blocks is out of range
    assert pool.forget_cached([0]) == 0  # already gone
    assert pool.snapshot().cache_entries == ()
    assert check_pool(pool.snapshot()) == []


def test_can_allocate_counts_the_revived_blocks_of_a_hit() -> None:
    pool = BlockPool(4, 2)
    pool.allocate("a", [1, 2, 3, 4, 5], 5)  # blocks 0, 1 cached, 2 partial
    pool.free("a")  # all free again, 0 and 1 still cached
    pool.allocate("c", [7], 1)  # takes block 3: three free blocks left
    prompt = [1, 2, 3, 4, 9, 9, 9]
    hit = pool.lookup(prompt)
    assert hit.block_ids == (0, 1)
    # Two fresh blocks plus the two free cached blocks the hit revives: 4 > 3.
    assert pool.blocks_to_allocate("b", 3, hit) == 4
    assert pool.can_allocate("b", 3, hit) is False
    assert pool.can_allocate("b", 3) is True  # without the hit only 2 blocks


def test_free_inside_a_rolled_back_transaction_restores_the_table() -> None:
    pool = BlockPool(4, 2)
    pool.allocate("a", [1, 2, 3], 3)
    before = pool.snapshot()
    pool.begin()
    pool.free("a")
    assert not pool.has_request("a")
    pool.rollback()
    assert pool.has_request("a")
    assert pool.snapshot() == before


def _three_cached_blocks() -> tuple[BlockPool, PrefixHit]:
    """Block size 1, 3 blocks all held by "a" and cached ([5], [5, 6], [5, 6, 7])."""
    pool = BlockPool(3, 1)
    pool.allocate("a", [5, 6, 7], 3)
    hit = pool.lookup([5, 6, 7, 8])
    assert hit.block_ids == (0, 1, 2)
    return pool, hit


def test_a_hit_must_leave_the_last_token_to_recompute() -> None:
    pool, hit = _three_cached_blocks()
    one = PrefixHit(hit.root_key, hit.block_ids[:1], hit.keys[:1], 1)
    with pytest.raises(InvalidArgument, match="covers 1 tokens of 1; the last token must be"):
        pool.allocate("b", [5], 1, hit=one)


def test_a_hit_with_more_blocks_than_keys_is_refused() -> None:
    pool, hit = _three_cached_blocks()
    bad = PrefixHit(hit.root_key, hit.block_ids[:2], hit.keys[:1], 1)
    before = pool.snapshot()
    with pytest.raises(ValueError, match="zip"):
        pool.allocate("b", [5, 6, 7, 8], 1, hit=bad)
    assert pool.snapshot() == before


def test_a_hit_must_chain_from_the_root() -> None:
    # Block 1 holds token 6 computed after token 5: a hit that starts at it (from the
    # root) has the right key and tokens for that block but the wrong parent.
    pool, hit = _three_cached_blocks()
    bad = PrefixHit(hit.root_key, hit.block_ids[1:2], hit.keys[1:2], 1)
    with pytest.raises(InvalidArgument, match="does not match its token ids at block 0"):
        pool.allocate("b", [6, 9], 1, hit=bad)
    assert not pool.has_request("b")


def test_lookup_of_nothing_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgument) as info:
        BlockPool(2, 1).lookup([])
    assert str(info.value) == "lookup: token_ids is empty; a request needs at least one token"


def test_a_key_collision_in_lookup_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    # A block key that ignores the parent makes "token 6 after 5" and "token 6 first"
    # collide; lookup's identity check (stored parent key) must refuse the reuse.
    monkeypatch.setattr(pool_module, "block_key", lambda parent, tokens: bytes(tokens))
    pool = BlockPool(4, 1)
    pool.allocate("a", [5, 6], 2)
    assert pool.lookup([5, 6, 7]).block_ids == (0, 1)
    assert pool.lookup([6, 7]).block_ids == ()


def test_decode_append_with_mismatched_token_lists_is_refused_first() -> None:
    # A full pool, and "a" needs a fresh block: the length mismatch must be reported
    # (ValueError) before the "not enough blocks" answer (None).
    pool = BlockPool(1, 2)
    pool.allocate("a", [1, 2], 2)
    before = pool.snapshot()
    with pytest.raises(ValueError, match="zip"):
        pool.append_decode_tokens(["a"], [[1, 2, 3], [4, 5, 6]])
    assert pool.append_decode_tokens(["a"], [[1, 2, 3]]) is None
    assert pool.snapshot() == before


# ------------------------------------------------------------------ scheduler
CFG = SchedulerConfig(
    max_num_batched_tokens=16, max_num_seqs=2, block_size=2, num_blocks=8, max_model_len=16
)


def _decoding_parent(cfg: SchedulerConfig = CFG) -> tuple[Scheduler, EngineCore, Request]:
    """A scheduler whose request ``p`` (5-token prompt) has just sampled its first token."""
    sched = Scheduler(cfg)
    core = EngineCore(sched, SimExecutor(StepCost(), sched.requests), check_invariants=True)
    parent = Request("p", [5, 6, 7, 8, 9], StopParams(max_tokens=4), arrival_ms=3.0, priority=2)
    sched.add_request(parent)
    core.step(10.0)
    assert parent.status is S.DECODING and parent.num_output_tokens == 1
    return sched, core, parent


def test_finish_retires_a_running_request_with_the_given_reason() -> None:
    sched, _, parent = _decoding_parent()
    sched.finish("p", FinishReason.STOP, 42.5)
    assert parent.status is S.FINISHED
    assert parent.finish_reason is FinishReason.STOP
    assert parent.finished_ms == 42.5
    assert "p" not in sched.requests and parent not in sched.running
    assert sched.retired[-1] is parent
    assert not sched.pool.has_request("p")
    assert sched.pool.num_free_blocks == CFG.num_blocks
    with pytest.raises(UnknownRequest, match=r"^finish: unknown request id 'p'$"):
        sched.finish("p", FinishReason.STOP)


def test_finish_and_fork_refuse_mid_step() -> None:
    sched, _, _ = _decoding_parent()
    sched.schedule(0.0)
    with pytest.raises(StepInProgress, match=r"^finish: a step is in progress"):
        sched.finish("p", FinishReason.STOP)
    with pytest.raises(StepInProgress, match=r"^fork: a step is in progress"):
        sched.fork("p", "c", 1, StopParams(max_tokens=4))
    sched.rollback()
    assert sched.requests["p"].status is S.DECODING


def test_fork_with_room_shares_the_parents_blocks_and_state() -> None:
    sched, core, parent = _decoding_parent()
    stop = StopParams(max_tokens=3)
    child = sched.fork("p", "c", 77, stop)
    assert child.request_id == "c"
    assert child.status is S.DECODING
    assert child.prompt_token_ids == parent.prompt_token_ids
    assert child.token_ids == [*parent.prompt_token_ids, 77]
    assert child.stop is stop
    assert child.arrival_ms == parent.arrival_ms == 3.0
    assert child.priority == parent.priority == 2
    assert child.tenant == parent.tenant and child.namespace == parent.namespace
    assert child.seq == parent.seq
    assert child.admitted_ms == parent.admitted_ms
    assert child.token_times_ms == parent.token_times_ms
    assert child.token_times_ms is not parent.token_times_ms
    assert child.num_computed_tokens == parent.num_computed_tokens
    assert child.num_cached_tokens == parent.num_cached_tokens
    assert sched.requests["c"] is child
    assert sched.running == [parent, child]
    assert sched.pool.block_table("c") == sched.pool.block_table("p")
    assert check_pool(sched.pool.snapshot()) == []
    while sched.has_unfinished:
        core.step(20.0)
    assert parent.num_output_tokens == 4 and child.num_output_tokens == 3
    assert sched.pool.num_free_blocks == CFG.num_blocks


def test_fork_without_room_waits_as_preempted_in_arrival_order() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=1, block_size=2, num_blocks=8, max_model_len=16
    )
    sched, core, parent = _decoding_parent(cfg)
    later = Request("z", [1, 2, 3], StopParams(max_tokens=2))
    sched.add_request(later)
    child = sched.fork("p", "c", 77, StopParams(max_tokens=2))
    assert child.status is S.PREEMPTED
    assert sched.running == [parent]
    assert sched.waiting == [child, later]  # the sibling keeps the parent's place
    assert not sched.pool.has_request("c")
    assert child.num_computed_tokens == 0
    while sched.has_unfinished:
        core.step(20.0)
    assert child.status is S.FINISHED and child.num_output_tokens == 2
    assert child.token_ids[:6] == [5, 6, 7, 8, 9, 77]


def test_fork_that_can_never_fit_is_finished_with_capacity() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=1, block_size=1, num_blocks=5, max_model_len=16
    )
    sched, _, parent = _decoding_parent(cfg)
    child = sched.fork("p", "c", 77, StopParams(max_tokens=2))
    assert child.status is S.FINISHED
    assert child.finish_reason is FinishReason.CAPACITY
    assert "c" not in sched.requests and sched.retired[-1] is child
    assert child not in sched.waiting and sched.running == [parent]


def test_fork_fits_exactly_when_blocks_equal_the_pool() -> None:
    # 6 tokens in blocks of 2 need 3 of 3 blocks: not "never fits", so it waits.
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=1, block_size=2, num_blocks=3, max_model_len=16
    )
    sched, _, _ = _decoding_parent(cfg)
    child = sched.fork("p", "c", 77, StopParams(max_tokens=1))
    assert child.status is S.PREEMPTED and sched.waiting == [child]


def test_fork_refusals() -> None:
    sched, _, parent = _decoding_parent()
    stop = StopParams(max_tokens=2)
    with pytest.raises(UnknownRequest, match=r"^fork: unknown request id 'ghost'$"):
        sched.fork("ghost", "c", 1, stop)
    with pytest.raises(DuplicateRequest, match=r"^fork: request id 'p' is already in use$"):
        sched.fork("p", "p", 1, stop)
    for bad in (-1, True, 1.0):
        with pytest.raises(InvalidArgument, match=r"^fork: bad first token .* for 'c'$"):
            sched.fork("p", "c", bad, stop)  # type: ignore[arg-type]
    sched.fork("p", "c", 0, stop)  # token 0 is fine
    assert sched.requests["c"].token_ids[-1] == 0
    # A parent that is not decoding, or has sampled more than one token.
    waiting = Request("w", [1, 2, 3], stop)
    sched.add_request(waiting)
    with pytest.raises(InvalidArgument, match=r"^fork: parent 'w' must be decoding"):
        sched.fork("w", "d", 1, stop)
    core = EngineCore(sched, SimExecutor(StepCost(), sched.requests), check_invariants=True)
    core.step(11.0)
    assert parent.num_output_tokens == 2
    with pytest.raises(InvalidArgument, match=r"\(status decoding, 2 sampled\)$"):
        sched.fork("p", "d", 1, stop)
    assert "d" not in sched.requests
