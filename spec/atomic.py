"""ATOMIC: a failed step leaves the engine exactly as it was (plan, reserve, execute, commit).

Why it matters: a request rejected for bad input, an allocation that cannot be met or an
executor fault must not leave half a plan behind: blocks reserved for nobody, a counter
advanced for tokens never computed, a request lost from its queue. TigerBeetle-style, the
check is plain equality of snapshots taken before and after the failed step.
"""

from __future__ import annotations

from refserve.spec.snapshot import EngineSnapshot, PoolSnapshot
from refserve.spec.violation import Invariant, Violation, violation

A = Invariant.ATOMIC


def check_atomic_pool(before: PoolSnapshot, after: PoolSnapshot) -> list[Violation]:
    out: list[Violation] = []
    for name in ("num_blocks", "block_size", "ref_cnt", "free_queue", "cache_entries"):
        if getattr(before, name) != getattr(after, name):
            out.append(
                violation(
                    A,
                    "pool",
                    f"{name} changed by a failed operation",
                    _short(getattr(before, name)),
                    _short(getattr(after, name)),
                )
            )
    tb = {t.request_id: t for t in before.tables}
    ta = {t.request_id: t for t in after.tables}
    for rid in sorted(tb.keys() | ta.keys()):
        if tb.get(rid) != ta.get(rid):
            out.append(
                violation(
                    A,
                    f"request {rid}",
                    "block table changed by a failed operation",
                    _short(tb.get(rid)),
                    _short(ta.get(rid)),
                )
            )
    return out


def check_atomic(before: EngineSnapshot, after: EngineSnapshot) -> list[Violation]:
    out = check_atomic_pool(before.pool, after.pool)
    if before.host != after.host:
        out.append(
            violation(
                A,
                "host pool",
                "swap pool changed by a failed operation",
                _short(before.host),
                _short(after.host),
            )
        )
    rb = {r.request_id: r for r in before.requests}
    ra = {r.request_id: r for r in after.requests}
    for rid in sorted(rb.keys() | ra.keys()):
        if rb.get(rid) != ra.get(rid):
            out.append(
                violation(
                    A,
                    f"request {rid}",
                    "request changed by a failed operation",
                    _short(rb.get(rid)),
                    _short(ra.get(rid)),
                )
            )
    return out


def _short(value: object, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
