"""The free-block queue (ref/kv/free_queue.py): LRU hand-out order, O(1) removal, undo.

Allocation pops the head, frees append at the tail, a cache hit removes a block from the
middle; every change is undone exactly by the journal (docs/ARCHITECTURE.md,
"Invariants": ATOMIC). Misuse is a programming error and fails an assertion with a message.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from types import MethodType

import pytest

from refserve.kv.free_queue import FreeQueue
from refserve.kv.journal import Journal


@pytest.mark.mutation_kill
def test_a_fresh_free_queue_holds_every_block_in_id_order() -> None:
    journal = Journal()
    fq = FreeQueue(4, journal)
    assert list(fq) == [0, 1, 2, 3] and len(fq) == 4
    assert all(b in fq for b in range(4))
    journal.begin()
    assert [fq.popleft() for _ in range(4)] == [0, 1, 2, 3]
    assert len(fq) == 0 and list(fq) == [] and not any(b in fq for b in range(4))
    journal.rollback()
    assert list(fq) == [0, 1, 2, 3] and len(fq) == 4


@pytest.mark.mutation_kill
def test_an_empty_free_queue_is_empty() -> None:
    journal = Journal()
    fq = FreeQueue(0, journal)
    assert len(fq) == 0 and list(fq) == []


@pytest.mark.mutation_kill
def test_free_queue_iteration_walks_each_block_once() -> None:
    journal = Journal()
    fq = FreeQueue(3, journal)
    journal.begin()
    fq.remove(1)
    journal.rollback()  # _relink puts 1 back between 0 and 2
    assert list(itertools.islice(iter(fq), 5)) == [0, 1, 2]
    fq.remove(2)
    fq.append(2)
    fq.append(fq.popleft())
    assert list(itertools.islice(iter(fq), 5)) == [1, 2, 0]


@pytest.mark.mutation_kill
def test_a_removed_block_is_not_in_the_free_queue() -> None:
    fq = FreeQueue(3, Journal())
    fq.remove(1)
    assert fq.__contains__(1) is False and fq.__contains__(0) is True
    assert list(fq) == [0, 2] and len(fq) == 2


@pytest.mark.mutation_kill
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


@pytest.mark.mutation_kill
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
    assert fq.acquire_n(0, [0]) == [] and list(fq) == [0]  # no blocks: a no-op
    with pytest.raises(AssertionError, match=r"^acquire_n\(2\) on a free queue of 1"):
        fq.acquire_n(2, [0, 0])


def _state(fq: FreeQueue, n: int) -> tuple[list[int], int, list[bool]]:
    return list(fq), len(fq), [b in fq for b in range(n)]


def test_runs_interleaved_with_single_changes_roll_back_to_the_exact_order() -> None:
    journal = Journal()
    fq = FreeQueue(10, journal)
    fq.remove(3)
    fq.append(3)  # order 0 1 2 4 5 6 7 8 9 3: not id order, so a wrong relink shows
    before = _state(fq, 10)
    counts = [0] * 10
    journal.begin()
    assert fq.acquire_n(3, counts) == [0, 1, 2]
    fq.remove(7)  # a cache hit revives a free block (the pool counts it)
    counts[7] = 1
    fq.release_n([1, 7], counts)
    assert fq.acquire_n(2, counts) == [4, 5]
    counts[0] = 0
    fq.append(0)
    fq.remove(9)
    counts[9] = 1
    fq.release_n([9, 5, 2], counts)
    assert fq.acquire_n(4, counts) == [6, 8, 3, 1]
    assert list(fq) == [7, 0, 9, 5, 2] and len(fq) == 5
    journal.rollback()
    assert _state(fq, 10) == before


def test_acquire_and_release_runs_set_counts_and_roll_back_exactly() -> None:
    journal = Journal()
    fq = FreeQueue(6, journal)
    counts = [0] * 6
    journal.begin()
    run = fq.acquire_n(4, counts)
    assert run == [0, 1, 2, 3] and counts == [1, 1, 1, 1, 0, 0] and list(fq) == [4, 5]
    counts[2] += 1  # a second holder (the pool journals its own changes)
    fq.release_n(run[::-1], counts)  # only the blocks reaching zero join, in that order
    assert counts == [0, 0, 1, 0, 0, 0] and list(fq) == [4, 5, 3, 1, 0] and len(fq) == 5
    assert 2 not in fq
    counts[2] -= 1
    journal.rollback()
    assert counts == [0] * 6 and list(fq) == [0, 1, 2, 3, 4, 5] and len(fq) == 6


def test_a_run_records_one_journal_entry_whatever_its_length() -> None:
    journal = Journal()
    fq = FreeQueue(64, journal)
    counts = [0] * 64
    journal.begin()
    run = fq.acquire_n(32, counts)
    assert journal.num_entries == 1
    fq.release_n(run, counts)
    assert journal.num_entries == 2
    fq.release_n(fq.acquire_n(16, counts), counts)
    assert journal.num_entries == 4
    journal.rollback()
    assert list(fq) == list(range(64)) and journal.num_entries == 0


def test_outside_a_transaction_runs_record_nothing() -> None:
    journal = Journal()
    fq = FreeQueue(8, journal)
    counts = [0] * 8
    fq.release_n(fq.acquire_n(3, counts), counts)
    fq.release_n(fq.acquire_n(2, counts), counts)
    assert list(fq) == [5, 6, 7, 0, 1, 2, 3, 4] and len(fq) == 8
    assert journal.num_entries == 0 and counts == [0] * 8


@pytest.mark.parametrize("journaled", [False, True])
def test_a_failed_run_leaves_the_queue_and_counts_unchanged(journaled: bool) -> None:
    journal = Journal()
    fq = FreeQueue(6, journal)
    counts = [0] * 6
    assert fq.acquire_n(3, counts) == [0, 1, 2]  # held once each; 3 4 5 queued
    if journaled:
        journal.begin()
    before = (_state(fq, 6), list(counts), journal.num_entries)
    counts[3] = 1  # inconsistent on purpose: a queued block that reaches zero again
    with pytest.raises(AssertionError, match=r"^block 3 is already in the free queue"):
        fq.release_n([1, 3], counts)
    assert counts[3] == 1
    counts[3] = 0
    with pytest.raises(AssertionError, match=r"^ref count of block 5 would go negative"):
        fq.release_n([2, 1, 5], counts)
    assert (_state(fq, 6), counts, journal.num_entries) == before
    with pytest.raises(AssertionError, match=r"^ref count of block 5 would go negative"):
        fq.release_n([2, 5, 1], counts)  # the block after the failing one keeps its count
    assert (_state(fq, 6), counts, journal.num_entries) == before
    counts[0] = 2  # shared: the release before the failure only drops its count
    shared = (_state(fq, 6), list(counts), journal.num_entries)
    with pytest.raises(AssertionError, match=r"^ref count of block 5 would go negative"):
        fq.release_n([0, 1, 5], counts)
    assert (_state(fq, 6), counts, journal.num_entries) == shared
    counts[0] = 1
    if journaled:
        journal.rollback()
        assert (_state(fq, 6), counts) == before[:2]


def test_the_journal_replays_compact_entries_newest_first() -> None:
    journal = Journal()
    log: list[object] = []
    journal.record(log.append, "outside")  # no transaction: nothing is kept
    assert not _is_open(journal) and journal.num_entries == 0
    journal.begin()
    assert _is_open(journal)
    journal.record(log.append, 1)
    journal.record(log.reverse)  # the zero-argument form
    journal.record(log.extend, (2, 3))
    assert journal.num_entries == 3
    journal.rollback()
    assert log == [3, 2, 1]
    assert not _is_open(journal) and journal.num_entries == 0
    journal.begin()
    journal.record(log.clear)
    journal.commit()  # a commit drops the entries: nothing is replayed
    assert log == [3, 2, 1] and not _is_open(journal)
    with pytest.raises(RuntimeError), journal.transaction():
        journal.record(log.pop)
        raise RuntimeError
    assert log == [3, 2]


class _Owner:
    def undo(self, log: list[object]) -> None:
        log.append("bound method")


def _undo(log: list[object]) -> None:
    log.append("function")


def test_the_journal_refuses_a_closure_or_a_lambda_as_an_undo_entry() -> None:
    """Undo entries are records, a function or method and its arguments
    (ref/kv/journal.py): a closure, a lambda or a function built per call is refused
    by an assertion in an open transaction, before it is kept. Records pass."""
    journal = Journal()
    log: list[object] = []

    def closure() -> None:
        log.append("closure")

    def nested(items: list[object]) -> None:  # no free variable, yet built per call
        items.append("nested")

    journal.record(closure)  # no transaction: nothing is kept, so nothing is checked
    journal.begin()
    refused = [closure, lambda: None, nested, MethodType(nested, log)]
    for bad in refused:
        with pytest.raises(AssertionError, match="is a closure or a lambda, not a record"):
            journal.record(bad)
    assert journal.num_entries == 0
    journal.record(_undo, log)
    journal.record(_Owner().undo, log)
    journal.record(log.append, "builtin")
    journal.rollback()
    assert log == ["builtin", "bound method", "function"]


def test_a_wrapped_record_is_judged_by_what_it_wraps() -> None:
    """A ``functools.wraps`` wrapper (what mutation testing puts around every method,
    docs/MUTATION.md) is a record when it wraps one, and refused when it wraps a closure."""
    journal = Journal()
    log: list[object] = []

    def closure() -> None:
        log.append("closure")

    def wrap(fn: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def wrapper(*args: object) -> None:
            fn(*args)

        return wrapper

    journal.begin()
    journal.record(wrap(_undo), log)
    with pytest.raises(AssertionError, match="is a closure or a lambda, not a record"):
        journal.record(wrap(closure))
    journal.rollback()
    assert log == ["function"]


def _is_open(journal: Journal) -> bool:
    # A call, so that mypy does not narrow ``active`` across begin() and rollback().
    return journal.active


@pytest.mark.parametrize("failure", ["would go negative", "is already in the free queue"])
def test_a_failed_release_inside_a_transaction_keeps_earlier_undos_exact(failure: str) -> None:
    """A block removed earlier in the transaction and linked by a release that then
    fails (either way) gets its own links back, so the rollback relinks it where it was."""
    journal = Journal()
    fq = FreeQueue(6, journal)
    counts = [0] * 6
    assert fq.acquire_n(2, counts) == [0, 1]
    before = _state(fq, 6)
    journal.begin()
    fq.remove(4)  # a cache hit revives block 4 (the pool counts it)
    counts[4] = 1
    if failure == "is already in the free queue":
        counts[5] = 1  # inconsistent on purpose: queued, yet counted once
    with pytest.raises(AssertionError, match=failure):
        fq.release_n([4, 5], counts)  # 4 reaches zero and is linked; 5 fails
    counts[4] = counts[5] = 0
    journal.rollback()
    assert _state(fq, 6) == before and list(fq) == [2, 3, 4, 5]
