"""The free-block queue (ref/kv/free_queue.py): LRU hand-out order, O(1) removal, undo.

Allocation pops the head, frees append at the tail, a cache hit removes a block from the
middle; every change is undone exactly by the journal (docs/ARCHITECTURE.md,
"Invariants": ATOMIC). Misuse is a programming error and fails an assertion with a message.
"""

from __future__ import annotations

import itertools

import pytest

from ref.kv.free_queue import FreeQueue
from ref.kv.journal import Journal


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
