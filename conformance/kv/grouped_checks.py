"""The grouped KV level's own checks, beside :mod:`refserve.spec.groups`: whether a
refused call really lacked room in the shared pool (CAP), whether a refused call changed
only what it may (ATOMIC), whether each group's tables match the suite's books, and
whether every live request reads back, in each group, what that group's next query
reads (BLOCK, PREFIX).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from refserve.conformance.kv.checks import Books, Room, table_violations
from refserve.conformance.kv.shape import canonical
from refserve.spec.arith import blocks_needed, slot_of
from refserve.spec.atomic import check_atomic_pool
from refserve.spec.groups import NULL_BLOCK, GroupedSnapshot, GroupKind, GroupTable, KVGroup
from refserve.spec.groups import window_start as spec_window_start
from refserve.spec.violation import Invariant, Violation, violation


def first_read(group: KVGroup, num_tokens: int) -> int:
    """The first position the query at ``num_tokens`` reads in ``group`` (0 in a full
    group: it reads everything)."""
    if group.kind is GroupKind.FULL:
        return 0
    return spec_window_start(num_tokens, group.window)


def grouped_room(before: GroupedSnapshot, rid: str, prev: int, n: int, *, first: bool) -> Room:
    """What allocating ``n`` tokens to ``rid`` (holding ``prev``) needs from the shared
    pool over all groups together, counted without a cache hit: the blocks covering what
    each group reads that its table lacks. Room: the free blocks, plus the request's own
    window blocks wholly before its window that nobody else holds (an eager manager frees
    them in this very call). Other requests' blocks past their windows are not counted:
    when a lazy manager takes them back is its choice."""
    bs, pool = before.pool.block_size, before.pool
    end = blocks_needed(prev + n, bs)
    in_queue = set(pool.free_queue)
    free = sum(1 for b, rc in enumerate(pool.ref_cnt) if rc == 0 and b in in_queue)
    need = 0
    stale: Counter[int] = Counter()
    for g, group in enumerate(before.groups):
        t = None if first else before.table(rid, g)
        table = t.block_table if t is not None else ()
        lo = first_read(group, prev) // bs
        need += sum(1 for i in range(lo, end) if i >= len(table) or table[i] == NULL_BLOCK)
        if group.kind is GroupKind.WINDOW:
            stale.update(b for b in table[:lo] if 0 <= b < len(pool.ref_cnt))
    reclaim = sum(1 for b, c in stale.items() if pool.ref_cnt[b] == c)
    return Room(need, free + reclaim)


def released(s: GroupedSnapshot, rid: str, num_tokens: int) -> GroupedSnapshot:
    """``s`` after ``rid`` released its window-group blocks wholly before the window of
    its query at ``num_tokens`` (ref counts down, a block at zero free)."""
    bs = s.pool.block_size
    ref = list(s.pool.ref_cnt)
    free = list(s.pool.free_queue)
    tables: list[GroupTable] = []
    for gt in s.tables:
        group = s.groups[gt.group] if 0 <= gt.group < len(s.groups) else None
        if gt.table.request_id != rid or group is None or group.kind is not GroupKind.WINDOW:
            tables.append(gt)
            continue
        lo = first_read(group, num_tokens) // bs
        row = list(gt.table.block_table)
        for i, b in enumerate(row[:lo]):
            if b != NULL_BLOCK and 0 <= b < len(ref):
                row[i] = NULL_BLOCK
                ref[b] -= 1
                if ref[b] == 0:
                    free.append(b)
        tables.append(replace(gt, table=replace(gt.table, block_table=tuple(row))))
    pool = replace(s.pool, ref_cnt=tuple(ref), free_queue=tuple(free))
    return replace(s, pool=pool, tables=tuple(tables))


def refused_atomic(
    before: GroupedSnapshot, after: GroupedSnapshot, rid: str, num_tokens: int
) -> list[Violation]:
    """ATOMIC for a refused allocation: the snapshot is unchanged, except that the
    request may have released its window blocks wholly before its window (they leave
    it whether or not the call is served: vLLM frees them before it checks for room)."""
    a = canonical(after.as_pool())
    found = check_atomic_pool(canonical(before.as_pool()), a)
    if found and not check_atomic_pool(canonical(released(before, rid, num_tokens).as_pool()), a):
        return []
    return found


def group_table_violations(s: GroupedSnapshot, books: Books) -> list[Violation]:
    """The plain level's table checks (:func:`table_violations`) in each group: a
    live request's table holds its KV length and its own token ids, a freed one holds
    none."""
    out: list[Violation] = []
    for g in range(len(s.groups)):
        pool = replace(s.pool, tables=tuple(t.table for t in s.tables if t.group == g))
        out += [
            replace(v, message=f"group {g}: {v.message}") for v in table_violations(pool, books)
        ]
    return out


@dataclass(frozen=True)
class Memories:
    """The suite's fake KV memory of each group (slot -> token id) and its books."""

    slots: Sequence[Mapping[int, int]]
    known: Mapping[str, Sequence[int]]
    stored: Mapping[str, int]
    cached: Mapping[str, int]


def grouped_read_back(s: GroupedSnapshot, m: Memories) -> list[Violation]:
    """Every live request reads, in each group, its own tokens at the positions that
    group's next query reads (all in a full group, from the window's start in a window
    group; never before it). Null entries and ids out of range are left to the rules
    that name them (spec/groups.py). One violation per request and group at most."""
    holders: Counter[int] = Counter(
        b for t in s.tables for b in set(t.table.block_table) if b != NULL_BLOCK
    )
    out: list[Violation] = []
    done: set[tuple[str, int]] = set()
    for gt in s.tables:
        rid, g = gt.table.request_id, gt.group
        if rid not in m.stored or (rid, g) in done or not 0 <= g < len(s.groups):
            continue
        done.add((rid, g))
        v = _read_one(s, gt, m, holders)
        if v is not None:
            out.append(v)
    return out


def _read_one(
    s: GroupedSnapshot, gt: GroupTable, m: Memories, holders: Counter[int]
) -> Violation | None:
    rid, g, table = gt.table.request_id, gt.group, gt.table.block_table
    bs, nb = s.pool.block_size, s.pool.num_blocks
    stored = m.stored[rid]
    for p in range(first_read(s.groups[g], stored), min(stored, len(table) * bs)):
        b = table[p // bs]
        if not 0 <= b < nb:
            continue
        got = m.slots[g].get(slot_of(b, p, bs))
        want = m.known[rid][p]
        if got == want:
            continue
        if holders[b] > 1 or p < m.cached.get(rid, 0):
            inv, why = Invariant.PREFIX, f"shared or cached block {b} holds another token"
        elif got is None:
            inv, why = Invariant.BLOCK, f"block {b} never received this KV"
        else:
            inv, why = Invariant.BLOCK, f"block {b} was overwritten by another request"
        return violation(
            inv, f"request {rid}", f"group {g}: KV read back at position {p}: {why}", want, got
        )
    return None
