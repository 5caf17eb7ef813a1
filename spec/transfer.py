"""BLOCK, rule ``in-flight``: a block being copied to or from another store belongs to the copy.

Why it matters: a KV connector moves K/V between the pool and another store (host
memory, a remote engine) asynchronously, while the scheduler goes on. Until a load has
landed, its blocks hold nothing yet: freeing them, handing them to someone else or
reading them serves garbage. Until a store has landed, its blocks are the source of the
copy: writing into them (after handing them to another request) stores the wrong K/V,
and a later load serves it. Known bugs elsewhere (docs/CORPUS.md): deadlocks where
parked loads hold the blocks a head of the queue needs. A copy that fails ends the
transfer as a completion does, but what it copied is nothing: a failed load's blocks
hold no K/V (serving them serves garbage), a failed store's copy is no entry of the
other store (a later load would bring garbage back; the suite's fake KV memory catches
that one when it happens, as the other store is no snapshot here).

The rule, on :attr:`PoolSnapshot.transfers` (the copies in flight at a boundary):

* a load's blocks are held (ref count >= 1, not free) and no other live request's table
  holds them;
* no step writes into a block of a copy that was in flight before the step and still is
  after it (a copy that completes in the step is executed first, as an executor does);
* a copy that failed in the step (:attr:`PoolSnapshot.failed_transfers` after it) is no
  longer in flight; a failed load's blocks are in no cache entry, no table of its
  request counts them as holding K/V (the request recomputes them, or finishes: it
  fails with a reason), and the request is not left loading with no load in flight.
"""

from __future__ import annotations

from refserve.spec.snapshot import (
    EngineSnapshot,
    PoolSnapshot,
    RequestStatus,
    StepSnapshot,
    TransferKind,
)
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
    out += check_failed(step.after)
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


def check_failed(after: EngineSnapshot) -> list[Violation]:
    """A copy that failed ends its transfer and leaves nothing that serves its K/V."""
    pool = after.pool
    bs = pool.block_size
    out: list[Violation] = []
    in_flight = {(x.request_id, x.kind, x.blocks) for x in pool.transfers}
    loading = {x.request_id for x in pool.transfers if x.kind is TransferKind.LOAD}
    cached = {e.block_id for e in pool.cache_entries}
    for x in pool.failed_transfers:
        who = f"{x.kind} of request {x.request_id}"
        if (x.request_id, x.kind, x.blocks) in in_flight:
            out.append(violation(B, who, "still in flight after it failed", rule=IN_FLIGHT))
            continue
        if x.kind is not TransferKind.LOAD:
            continue
        bad = set(x.blocks)
        for b in sorted(bad & cached):
            out.append(
                violation(
                    B,
                    f"block {b} ({who})",
                    "in the cache index after its load failed",
                    "no cache entry",
                    "cached",
                    rule=IN_FLIGHT,
                )
            )
        for name in dict.fromkeys((x.holder or x.request_id, x.request_id)):
            t = pool.table(name)
            if t is None:
                continue
            stored = t.block_table[: -(-t.num_stored // bs)]
            hit = next((b for b in stored if b in bad), None)
            if hit is not None:
                out.append(
                    violation(
                        B,
                        f"block {hit} ({who})",
                        f"counted as holding K/V by table {name} after its load failed",
                        "recomputed or the request fails",
                        f"{t.num_stored} tokens stored",
                        rule=IN_FLIGHT,
                    )
                )
        r = after.request(x.request_id)
        if r is not None and r.status is RequestStatus.LOADING and x.request_id not in loading:
            out.append(
                violation(
                    B,
                    f"request {x.request_id}",
                    "still loading after its load failed, with no load in flight",
                    "waiting (recompute) or finished (fails with a reason)",
                    str(r.status),
                    rule=IN_FLIGHT,
                )
            )
    return out
