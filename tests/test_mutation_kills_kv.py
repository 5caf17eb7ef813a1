"""Checks that kill mutants of ``ref/kv/`` which survived ``make mutation``.

See docs/MUTATION.md. Each test drives the block pool, free queue or journal through
their public methods and checks one behaviour exactly, with ``spec.check_pool`` where
a whole pool state results. All are small and deterministic: mutmut runs them once per
mutant.
"""

from __future__ import annotations

from ref.kv.free_queue import FreeQueue
from ref.kv.journal import Journal


# ------------------------------------------------------------------ free queue
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
