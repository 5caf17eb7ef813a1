"""POS: positions are contiguous, slots follow the block table, tables cover the KV length.

Why it matters: in example 1 of docs/ARCHITECTURE.md, B's 8th token is still its 8th
position in round 2 (a new round does not restart the positions at the first one), and
its slots come from the block table 7, 2, 12. A wrong position breaks rotary embeddings silently; a
wrong slot writes K/V where attention will not read it (or where someone else will).
"""

from __future__ import annotations

from refserve.spec.arith import blocks_needed, slot_of
from refserve.spec.snapshot import PoolSnapshot, RequestStatus, StepSnapshot, TransferKind
from refserve.spec.violation import Invariant, Violation, violation

P = Invariant.POS
# Statuses whose KV lives in the pool (a swapped request's KV is elsewhere).
_RUNNING = (RequestStatus.PREFILLING, RequestStatus.DECODING)


def check_pos_pool(pool: PoolSnapshot, lookahead: int = 0) -> list[Violation]:
    """Each table holds ceil(num_stored / block_size) blocks, plus at most the blocks of
    ``lookahead`` slots reserved ahead of the KV length.

    The rule is that a table covers its KV and holds nothing a request could not write
    next; how far ahead an engine reserves is its choice (``lookahead`` is the declared
    number of slots, 0 for refserve: docs/CONFORMANCE.md "Rules and conventions"). A
    block beyond that is memory no position will reach before the request grows again.
    """
    assert lookahead >= 0, lookahead
    out: list[Violation] = []
    kept = _kept_for_recompute(pool)
    for t in pool.tables:
        need = blocks_needed(t.num_stored, pool.block_size)
        most = blocks_needed(t.num_stored + lookahead, pool.block_size)
        most += sum(1 for b in t.block_table if b in kept.get(t.request_id, ()))
        if not need <= len(t.block_table) <= most:
            out.append(
                violation(
                    P,
                    f"request {t.request_id}",
                    "block table does not cover the KV length exactly"
                    if lookahead == 0
                    else f"block table does not cover the KV length plus {lookahead} slots",
                    need if need == most else f"{need}..{most}",
                    len(t.block_table),
                )
            )
        if len(t.token_ids) != t.num_stored:
            out.append(
                violation(
                    P,
                    f"request {t.request_id}",
                    "stored token ids differ from num_stored",
                    t.num_stored,
                    len(t.token_ids),
                )
            )
    return out


def _kept_for_recompute(pool: PoolSnapshot) -> dict[str, set[int]]:
    """The blocks of failed loads their holders keep (``PoolSnapshot.failed_transfers``):
    no K/V (spec/transfer.py), blocks the request recomputes into, so a table may hold
    them past its KV length as it holds slots reserved ahead."""
    out: dict[str, set[int]] = {}
    for x in pool.failed_transfers:
        if x.kind is TransferKind.LOAD:
            out.setdefault(x.holder or x.request_id, set()).update(x.blocks)
    return out


def check_pos(step: StepSnapshot) -> list[Violation]:
    out: list[Violation] = []
    bs = step.after.pool.block_size
    for s in step.scheduled:
        who = f"request {s.request_id}"
        before = step.before.request(s.request_id)
        if before is not None:
            start = before.num_computed_tokens + s.num_new_cached_tokens + s.num_new_loaded_tokens
            expected = tuple(range(start, start + s.num_new_tokens))
            if s.positions != expected:
                out.append(
                    violation(
                        P,
                        who,
                        "positions are not contiguous with the KV already computed",
                        _span(expected),
                        _span(s.positions),
                    )
                )
        if len(s.slot_mapping) != len(s.positions):
            out.append(
                violation(
                    P,
                    who,
                    "slot mapping length differs from positions",
                    len(s.positions),
                    len(s.slot_mapping),
                )
            )
            continue
        for pos, slot in zip(s.positions, s.slot_mapping, strict=True):
            idx = pos // bs
            if idx >= len(s.block_table):
                out.append(
                    violation(
                        P,
                        who,
                        f"position {pos} lies beyond the block table",
                        f"< {len(s.block_table) * bs}",
                        pos,
                    )
                )
                break
            want = slot_of(s.block_table[idx], pos, bs)
            if slot != want:
                out.append(
                    violation(
                        P, who, f"slot of position {pos} breaks the block-table formula", want, slot
                    )
                )
                break
    for r in step.after.requests:
        table = step.after.pool.table(r.request_id)
        if table is None and r.status in _RUNNING and r.num_computed_tokens > 0:
            out.append(
                violation(
                    P,
                    f"request {r.request_id}",
                    "running request has KV but no block table in the pool",
                    f"{blocks_needed(r.num_computed_tokens, bs)} blocks",
                    "no table",
                )
            )
        if table is not None and table.num_stored != r.num_computed_tokens:
            out.append(
                violation(
                    P,
                    f"request {r.request_id}",
                    "pool KV length differs from num_computed_tokens",
                    r.num_computed_tokens,
                    table.num_stored,
                )
            )
    return out


def _span(positions: tuple[int, ...]) -> str:
    if not positions:
        return "[]"
    return f"[{positions[0]}..{positions[-1]}] ({len(positions)})"
