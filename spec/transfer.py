"""BLOCK, rule ``in-flight``: a block being copied to or from another store belongs to the copy.

Why it matters: a KV connector moves K/V between the pool and another store (host
memory, a remote engine) asynchronously, while the scheduler goes on. Until a load has
landed, its blocks hold nothing yet: freeing them, handing them to someone else or
reading them serves garbage. Until a store has landed, its blocks are the source of the
copy: writing into them (after handing them to another request) stores the wrong K/V,
and a later load serves it. Known bugs elsewhere (docs/CORPUS.md): deadlocks where
parked loads hold the blocks a head of the queue needs. Not checked yet: a load or store
that fails (it must leave no cache entry visible).

The rule, on :attr:`PoolSnapshot.transfers` (the copies in flight at a boundary):

* a load's blocks are held (ref count >= 1, not free) and no other live request's table
  holds them;
* no step writes into a block of a copy that was in flight before the step and still is
  after it (a copy that completes in the step is executed first, as an executor does).
"""

from __future__ import annotations

from refserve.spec.snapshot import PoolSnapshot, StepSnapshot, TransferKind
from refserve.spec.violation import Invariant, Violation, violation

B = Invariant.BLOCK

#: The rule's name in a :class:`Violation`.
IN_FLIGHT = "in-flight"


def check_in_flight(pool: PoolSnapshot, live: frozenset[str]) -> list[Violation]:
    """A load's blocks are held by its holder and by no other live request."""
    out: list[Violation] = []
    free = set(pool.free_queue)
    holders: dict[int, set[str]] = {}
    for t in pool.tables:
        for b in t.block_table:
            holders.setdefault(b, set()).add(t.request_id)
    for x in pool.transfers:
        if x.kind is not TransferKind.LOAD:
            continue
        mine = {x.request_id, x.holder or x.request_id}
        for b in x.blocks:
            who = f"block {b} (load of request {x.request_id})"
            if b in free or not 0 <= b < len(pool.ref_cnt) or pool.ref_cnt[b] < 1:
                out.append(
                    violation(
                        B, who, "freed while its load is in flight", "held", "free", rule=IN_FLIGHT
                    )
                )
                continue
            others = sorted((holders.get(b, set()) - mine) & live)
            if others:
                out.append(
                    violation(
                        B,
                        who,
                        "held by another request while its load is in flight",
                        x.holder or x.request_id,
                        ", ".join(others),
                        rule=IN_FLIGHT,
                    )
                )
    return out


def check_in_flight_step(step: StepSnapshot) -> list[Violation]:
    """No write lands in a block whose copy is in flight across the whole step."""
    bs = step.before.pool.block_size
    after = {(x.request_id, x.kind, b) for x in step.after.pool.transfers for b in x.blocks}
    busy = {
        b: x
        for x in step.before.pool.transfers
        for b in x.blocks
        if (x.request_id, x.kind, b) in after
    }
    live = frozenset(r.request_id for r in step.after.requests if not r.status.is_done)
    out = check_in_flight(step.after.pool, live)
    for s in step.scheduled:
        for slot in s.slot_mapping:
            x = busy.get(slot // bs)
            if x is not None:
                out.append(
                    violation(
                        B,
                        f"request {s.request_id}",
                        f"writes into block {slot // bs} while its {x.kind} for request "
                        f"{x.request_id} is in flight",
                        "no write until the copy lands",
                        f"slot {slot}",
                        rule=IN_FLIGHT,
                    )
                )
                break
    return out
