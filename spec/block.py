"""BLOCK: every block is free or referenced, and ref counts match the block tables.

Why it matters: a block whose ref count is one too low goes back to the free queue while
a request still reads it, and the next request's K/V silently overwrites it; one too high
is a leak that shrinks the pool until admission stalls. With sharing, a block is
reclaimable only when reference counts, retention and eviction all agree, so the counts
must be exact. Known bug elsewhere (docs/ARCHITECTURE.md, "Known bugs elsewhere"): freeing
a list holding the same block twice, which puts it in the free queue twice and hands it
to two requests. A manager that keeps its own count of free and evictable blocks
(``PoolSnapshot.stated_free``) admits by that count, so it must equal the blocks: SGLang's
radix cache once counted a page shared by two tree nodes twice in its evictable size, and
its scheduler's idle check then stopped the server.
"""

from __future__ import annotations

from collections import Counter

from refserve.spec.snapshot import NULL_BLOCK, PoolSnapshot
from refserve.spec.violation import Invariant, Violation, violation

B = Invariant.BLOCK


def check_block(pool: PoolSnapshot) -> list[Violation]:
    """Ref counts == holders, no duplicate in the free queue, used + free == total."""
    out: list[Violation] = []
    n = pool.num_blocks
    if len(pool.ref_cnt) != n:
        out.append(
            violation(B, "pool", "ref_cnt length differs from num_blocks", n, len(pool.ref_cnt))
        )
        return out
    holders: Counter[int] = Counter()
    for t in pool.tables:
        seen_here: set[int] = set()
        for b in t.block_table:
            if b == NULL_BLOCK and pool.null_entries:
                continue  # a window group's place of a block that left: holds nothing
            if not 0 <= b < n:
                out.append(
                    violation(
                        B, f"request {t.request_id}", "block id out of range", f"0..{n - 1}", b
                    )
                )
                continue
            if b in seen_here:
                out.append(
                    violation(B, f"block {b}", f"held twice by request {t.request_id}", 1, 2)
                )
            seen_here.add(b)
            holders[b] += 1
    queue_count: Counter[int] = Counter(pool.free_queue)
    for b, c in queue_count.items():
        if not 0 <= b < n:
            out.append(
                violation(B, f"block {b}", "free queue holds an id out of range", f"0..{n - 1}", b)
            )
        elif c > 1:
            out.append(violation(B, f"block {b}", "appears more than once in the free queue", 1, c))
    for b in range(n):
        rc = pool.ref_cnt[b]
        if rc < 0:
            out.append(violation(B, f"block {b}", "negative ref count", ">= 0", rc))
        if rc != holders[b]:
            out.append(
                violation(
                    B, f"block {b}", "ref_cnt differs from block tables holding it", holders[b], rc
                )
            )
        in_queue = queue_count[b] > 0
        if rc > 0 and in_queue:
            out.append(
                violation(
                    B,
                    f"block {b}",
                    "referenced block is in the free queue",
                    "not free",
                    f"ref_cnt {rc}",
                )
            )
        if rc == 0 and not in_queue:
            out.append(
                violation(
                    B,
                    f"block {b}",
                    "neither free nor referenced (leaked)",
                    "in free queue",
                    "absent",
                )
            )
    used = sum(1 for rc in pool.ref_cnt if rc > 0)
    free = len(set(pool.free_queue))
    if used + free != n:
        out.append(violation(B, "pool", "used + free != num_blocks", n, f"{used} + {free}"))
    if pool.stated_free is not None and pool.stated_free != free:
        out.append(
            violation(
                B,
                "pool",
                "the manager's own count of free and evictable blocks differs from the blocks",
                free,
                pool.stated_free,
                rule="stated-free",
            )
        )
    return out
