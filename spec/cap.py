"""CAP: blocks in use never exceed the pool, and every promised slot is delivered.

Why it matters: free KV blocks are a limit of their own, separate from the token budget
and max_num_seqs (free blocks say nothing about this step's compute, and the budget nothing
about memory); example 2e of docs/ARCHITECTURE.md (1000 blocks, 900 used, a
1600-token prompt needs 100) shows admission must not promise memory
that the pool cannot deliver without preempting someone. A plan that names a slot in a
block its request does not hold writes K/V into somebody else's memory.
"""

from __future__ import annotations

from refserve.spec.snapshot import NULL_BLOCK, PoolSnapshot, StepSnapshot
from refserve.spec.violation import Invariant, Violation, violation

C = Invariant.CAP


def check_cap(pool: PoolSnapshot) -> list[Violation]:
    """Blocks in use <= num_blocks; no table longer than the pool."""
    out: list[Violation] = []
    used = sum(1 for rc in pool.ref_cnt if rc > 0)
    if used > pool.num_blocks:
        out.append(
            violation(C, "pool", "blocks in use exceed num_blocks", f"<= {pool.num_blocks}", used)
        )
    for t in pool.tables:
        held = len(t.block_table)
        if pool.null_entries:  # a window group's places of blocks it let go hold nothing
            held -= t.block_table.count(NULL_BLOCK)
        if held > pool.num_blocks:
            out.append(
                violation(
                    C,
                    f"request {t.request_id}",
                    "block table longer than the pool",
                    f"<= {pool.num_blocks}",
                    held,
                )
            )
    return out


def check_cap_step(step: StepSnapshot) -> list[Violation]:
    """Every slot the plan writes lies in a block the request holds after the step.

    The one exception is a rejected draft's slot (docs/SPECULATIVE.md): its K/V is
    dropped at commit, and a block that held nothing else goes back to the free queue,
    so that slot may lie in a block that is free after the step, never in a block of
    another request."""
    out: list[Violation] = []
    bs = step.after.pool.block_size
    ref_cnt = step.after.pool.ref_cnt
    for s in step.scheduled:
        table = step.after.pool.table(s.request_id)
        if table is None:
            continue  # finished or preempted in this very step; its blocks are gone
        held = set(table.block_table)
        for pos, slot in zip(s.positions, s.slot_mapping, strict=False):
            b = slot // bs
            if b in held:
                continue
            if s.num_draft_tokens and pos >= table.num_stored and not ref_cnt[b]:
                continue  # a rejected draft's slot in a block returned at commit
            out.append(
                violation(
                    C,
                    f"request {s.request_id}",
                    f"position {pos} writes slot {slot} in a block the request does not hold",
                    f"one of {sorted(held)}",
                    b,
                )
            )
    return out
