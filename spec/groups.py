"""KV layer groups: memory per token that is not a constant.

A hybrid model keeps full attention in some layers and a sliding window in others. The
layers of one kind form a **group**; each group keeps its own block table per request,
over one shared pool of blocks. A full group holds a block for every stored token, as
today. A window group of window ``W`` needs only what its next query reads: a query at
position ``p`` reads the keys ``p - W < k <= p`` (transformers' convention, and the
kernels'), so a request about to compute positions ``[L, L + n)`` needs, in a window
group, the stored positions ``[L - W + 1, L)`` and the new ones: the blocks covering
``[window_start(L, W), L + n)``. The blocks wholly before that may go back to the pool;
a table keeps their places as :data:`NULL_BLOCK` so logical block ``i`` is still entry
``i``.

Why it matters: a window block freed one token early is K/V a query still reads (a
wrong token later, silently); a prefix-cache hit taken without the window group's last
blocks resumes with keys that exist nowhere; per-group books that disagree (a request in
one group but not another, or stored at two lengths) leak or corrupt blocks.

The rules, each over one frozen :class:`GroupedSnapshot`:

- **group accounting** (:func:`check_groups`): BLOCK over every group's tables together
  (reference counts equal holders, the free queue exact), each table covering its KV
  length (POS), a request in every group or in none and at one length (rule
  ``group-tables``), no null entry in a full group (rule ``full-null``);
- **window held** (:func:`check_window_held`, after a request's allocation): its window
  group tables hold every block covering ``[window_start(L, W), L + n)`` (rule
  ``window-early``; rule ``prefix-complete`` when the missing block is inside a
  prefix-cache hit), and none wholly before it (rule ``window-late``: memory the request
  can never read again, declared optional: a manager may free it later).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from refserve.spec.arith import blocks_needed
from refserve.spec.block import check_block
from refserve.spec.snapshot import NULL_BLOCK, PoolSnapshot, TableSnapshot
from refserve.spec.violation import Invariant, Violation, violation

__all__ = [
    "FULL_NULL",
    "GROUP_TABLES",
    "NULL_BLOCK",
    "PREFIX_COMPLETE",
    "WINDOW_EARLY",
    "WINDOW_LATE",
    "GroupKind",
    "GroupTable",
    "GroupedSnapshot",
    "KVGroup",
    "check_groups",
    "check_window_held",
    "group_blocks",
    "group_table_id",
    "group_table_owner",
    "held_places",
    "layout_blocks",
    "layout_peak",
    "layout_text",
    "parse_layout",
    "peak_blocks",
    "window_start",
]


GROUP_TABLES = "group-tables"
FULL_NULL = "full-null"
WINDOW_EARLY = "window-early"
WINDOW_LATE = "window-late"
PREFIX_COMPLETE = "prefix-complete"


class GroupKind(StrEnum):
    FULL = "full"
    WINDOW = "window"
    COMPRESSED = "compressed"


@dataclass(frozen=True)
class KVGroup:
    """One kind of layer: ``full``; ``window`` of ``window`` tokens (a query at ``p``
    reads keys ``p - window < k <= p``); or ``compressed`` at ``ratio``: one K/V entry
    per ``ratio`` tokens, every entry kept (a block holds ``block_size`` entries, so
    ``block_size * ratio`` tokens). A compressed layer that also reads its last tokens
    raw keeps them in a window group of its own beside it in the layout."""

    kind: GroupKind
    window: int = 0
    ratio: int = 1

    def __post_init__(self) -> None:
        kind = GroupKind(self.kind)
        object.__setattr__(self, "kind", kind)
        if kind is GroupKind.WINDOW and not (type(self.window) is int and self.window >= 1):
            raise ValueError(f"a window group needs a window >= 1, got {self.window!r}")
        if kind is not GroupKind.WINDOW and self.window:
            raise ValueError(f"a {kind} group has no window, got {self.window!r}")
        if kind is GroupKind.COMPRESSED:
            if not (type(self.ratio) is int and self.ratio >= 2):
                raise ValueError(f"a compressed group needs a ratio >= 2, got {self.ratio!r}")
        elif self.ratio != 1:
            raise ValueError(f"only a compressed group has a ratio, got {self.ratio!r}")

    def tokens_per_block(self, block_size: int) -> int:
        """The tokens one of this group's blocks covers."""
        return block_size * self.ratio


def parse_layout(text: str) -> tuple[KVGroup, ...]:
    """``"full,window:4096,compressed:4"`` as groups (:func:`layout_text`'s inverse), or
    :class:`ValueError` naming the part that is not ``full``, ``window:W`` or
    ``compressed:R``."""
    groups: list[KVGroup] = []
    for i, part in enumerate(text.split(",")):
        kind, _, size = part.strip().partition(":")
        try:
            if kind == GroupKind.FULL and not size:
                groups.append(KVGroup(GroupKind.FULL))
            elif kind == GroupKind.WINDOW and size.isdecimal():
                groups.append(KVGroup(GroupKind.WINDOW, window=int(size)))
            elif kind == GroupKind.COMPRESSED and size.isdecimal():
                groups.append(KVGroup(GroupKind.COMPRESSED, ratio=int(size)))
            else:
                raise ValueError("not full, window:W or compressed:R")
        except ValueError as e:
            raise ValueError(f"layout part {i + 1} ({part.strip()!r}): {e}") from None
    return tuple(groups)


def layout_text(groups: Sequence[KVGroup]) -> str:
    """A layout as :func:`parse_layout` reads it (``"full"`` for the plain pool's)."""
    if not groups:
        return "full"
    return ",".join(
        f"{g.kind}:{g.window}"
        if g.kind is GroupKind.WINDOW
        else f"{g.kind}:{g.ratio}"
        if g.kind is GroupKind.COMPRESSED
        else str(g.kind)
        for g in groups
    )


def window_start(num_tokens: int, window: int) -> int:
    """The first position the query at ``num_tokens`` reads in a window of ``window``.

    pre: num_tokens >= 0
    pre: window >= 1
    post: 0 <= __return__ <= num_tokens
    post: num_tokens - __return__ <= window - 1
    post: __return__ == 0 or num_tokens - __return__ == window - 1
    """
    return max(0, num_tokens - window + 1)


def group_blocks(group: KVGroup, num_stored: int, num_new: int, block_size: int) -> int:
    """The blocks a request holds in ``group`` while it computes positions
    ``[num_stored, num_stored + num_new)``: every block up to the last position in a full
    group (a compressed group's blocks cover ``ratio`` times the tokens); in a window
    group, those from the block holding ``window_start(num_stored, W)``.
    """
    end = blocks_needed(num_stored + num_new, group.tokens_per_block(block_size))
    if group.kind is not GroupKind.WINDOW:
        return end
    return end - window_start(num_stored, group.window) // block_size


def held_places(group: KVGroup, num_stored: int, block_size: int) -> range:
    """The places (logical blocks) of ``group``'s table whose blocks a request that has
    computed ``num_stored`` tokens needs for its next query: every one in a full or
    compressed group, a window group's from the block holding
    ``window_start(num_stored, W)`` on. There are ``group_blocks(group, num_stored, 0,
    block_size)`` of them: what a swap to the host moves and brings back.
    """
    end = blocks_needed(num_stored, group.tokens_per_block(block_size))
    if group.kind is not GroupKind.WINDOW:
        return range(end)
    return range(window_start(num_stored, group.window) // block_size, end)


def layout_blocks(groups: Sequence[KVGroup], num_stored: int, num_new: int, block_size: int) -> int:
    """:func:`group_blocks` summed over the layout: what the request takes from the one
    shared pool. Admission, the capacity refusal, preemption and the simulator all
    count a request's memory with this one function."""
    return sum(group_blocks(g, num_stored, num_new, block_size) for g in groups)


def peak_blocks(
    groups: Sequence[KVGroup], num_tokens: int, block_size: int, max_chunk: int = 1
) -> int:
    """The most blocks a request of ``num_tokens`` tokens ever holds when it computes
    them in steps of at most ``max_chunk`` tokens (the fewest a pool must have to run
    it at all): the largest :func:`layout_blocks` over every step ``[L, L + n)`` with
    ``n <= max_chunk``. A window group holds a step's every block, so a long chunk
    needs more than decoding the same tokens does.

    Each step is longest where it can be, ``n = min(max_chunk, num_tokens - L)``. Up to
    ``L = num_tokens - max_chunk`` no group holds fewer blocks for a step a block later
    (a full or compressed group's count never falls; a window group's gains a block
    at its end and loses at most one at its start); past it every step ends at
    ``num_tokens`` and a window group's count only falls. So the largest count is at
    one of the ``block_size + 1`` steps that start up to a block before that point.
    """
    assert num_tokens >= 1 and block_size >= 1 and max_chunk >= 1, (num_tokens, max_chunk)
    last = max(0, num_tokens - max_chunk)
    return max(
        layout_blocks(groups, start, min(max_chunk, num_tokens - start), block_size)
        for start in range(max(0, last - block_size), last + 1)
    )


def layout_peak(groups: Sequence[KVGroup], num_tokens: int, block_size: int, max_chunk: int) -> int:
    """:func:`peak_blocks` of a scheduler's layout, ``()`` being the plain pool's one
    full group (a block per ``block_size`` tokens, whatever the chunks)."""
    if not groups or num_tokens < 1:
        return blocks_needed(num_tokens, block_size)
    return peak_blocks(groups, num_tokens, block_size, max_chunk)


@dataclass(frozen=True)
class GroupTable:
    """One request's table in one group (``group`` indexes the snapshot's groups)."""

    group: int
    table: TableSnapshot


@dataclass(frozen=True)
class GroupedSnapshot:
    """A grouped KV manager: its groups, the shared pool (reference counts, free queue
    and every group's cache entries; its own ``tables`` unused) and each request's table
    in each group."""

    groups: tuple[KVGroup, ...]
    pool: PoolSnapshot
    tables: tuple[GroupTable, ...]

    def as_pool(self) -> PoolSnapshot:
        """The shared pool with every group's tables, null entries left out and each
        table named ``request@group``: what BLOCK counts holders over."""
        tables = tuple(
            replace(
                t.table,
                request_id=f"{t.table.request_id}@{t.group}",
                block_table=tuple(b for b in t.table.block_table if b != NULL_BLOCK),
            )
            for t in self.tables
        )
        return replace(self.pool, tables=tables)

    def engine_pool(self) -> PoolSnapshot:
        """The pool as an engine's step checks see it: the first group's tables under
        their requests' ids (the table the scheduler and the executor's positions
        follow), every other group's as :func:`group_table_id`, null entries kept
        (``null_entries``), so BLOCK counts every holder and POS every table's length."""
        tables = tuple(t.table if t.group == 0 else self._engine_table(t) for t in self.tables)
        return replace(self.pool, tables=tables, null_entries=True)

    def _engine_table(self, t: GroupTable) -> TableSnapshot:
        """A table of group > 0 under :func:`group_table_id`; a compressed group's in its
        own positions (one per ``ratio`` tokens, each standing for its first token), so a
        block covers ``block_size`` of them as in every other table of the pool."""
        table = replace(t.table, request_id=group_table_id(t.table.request_id, t.group))
        ratio = self.groups[t.group].ratio if 0 <= t.group < len(self.groups) else 1
        if ratio == 1:
            return table
        return replace(
            table, num_stored=-(-table.num_stored // ratio), token_ids=table.token_ids[::ratio]
        )

    def table(self, request_id: str, group: int) -> TableSnapshot | None:
        for t in self.tables:
            if t.group == group and t.table.request_id == request_id:
                return t.table
        return None


def group_table_id(request_id: str, group: int) -> str:
    """The name of a request's table in ``group`` > 0 where one pool lists every group's
    tables (:meth:`GroupedSnapshot.engine_pool`)."""
    return f"{request_id}@group{group}"


def group_table_owner(table_id: str) -> tuple[str, int]:
    """The request and group of a table named as :func:`group_table_id` names them
    (the first group's table is the request's own id: group 0)."""
    rid, sep, group = table_id.rpartition("@group")
    if sep and group.isdecimal() and group == str(int(group)) and int(group) >= 1:
        return rid, int(group)
    return table_id, 0


def check_groups(s: GroupedSnapshot) -> list[Violation]:
    """Group accounting (the module doc)."""
    out = [replace(v, message=f"{v.message} (all groups)") for v in check_block(s.as_pool())]
    bs = s.pool.block_size
    where: dict[str, dict[int, TableSnapshot]] = {}
    for gt in s.tables:
        t = gt.table
        if not 0 <= gt.group < len(s.groups):
            out.append(_v(Invariant.BLOCK, t.request_id, f"a table in group {gt.group}, "
                          "which does not exist", f"0..{len(s.groups) - 1}", gt.group,
                          GROUP_TABLES))  # fmt: skip
            continue
        where.setdefault(t.request_id, {})[gt.group] = t
        need = blocks_needed(t.num_stored, s.groups[gt.group].tokens_per_block(bs))
        if len(t.block_table) != need:
            out.append(_v(Invariant.POS, t.request_id, f"group {gt.group}'s table does not "
                          "cover the KV length exactly", need, len(t.block_table), ""))  # fmt: skip
        kind = s.groups[gt.group].kind
        if kind is not GroupKind.WINDOW and NULL_BLOCK in t.block_table:
            out.append(_v(Invariant.BLOCK, t.request_id, f"{kind} group {gt.group} lost "
                          "blocks (null entries)", "none", t.block_table.count(NULL_BLOCK),
                          FULL_NULL))  # fmt: skip
    for rid, by_group in sorted(where.items()):
        if len(by_group) != len(s.groups):
            out.append(_v(Invariant.BLOCK, rid, "a table in some groups only",
                          f"{len(s.groups)} groups", sorted(by_group), GROUP_TABLES))  # fmt: skip
        lengths = {t.num_stored for t in by_group.values()}
        if len(lengths) > 1:
            out.append(_v(Invariant.KVLEN, rid, "groups store different lengths", "one",
                          sorted(lengths), GROUP_TABLES))  # fmt: skip
    return out


def check_window_held(
    s: GroupedSnapshot, request_id: str, num_before: int, num_cached: int = 0
) -> list[Violation]:
    """After an allocation that took ``request_id`` from ``num_before`` stored tokens to
    its table's length (``num_cached``: the tokens of a prefix-cache hit it took, part of
    ``num_before``): every window group holds the blocks its next queries read, and none
    wholly before them."""
    out: list[Violation] = []
    bs = s.pool.block_size
    for g, group in enumerate(s.groups):
        if group.kind is not GroupKind.WINDOW:
            continue
        t = s.table(request_id, g)
        if t is None:
            continue  # check_groups names a missing table
        first = window_start(num_before, group.window) // bs
        for i, b in enumerate(t.block_table):
            if i >= first and b == NULL_BLOCK:
                hit = i * bs < num_cached
                out.append(_v(
                    Invariant.PREFIX if hit else Invariant.KVLEN,
                    request_id,
                    f"window group {g} dropped logical block {i}, which its next query "
                    f"reads (window {group.window}, {num_before} tokens before)"
                    + (": a prefix hit taken without its window blocks" if hit else ""),
                    "a block",
                    "null",
                    PREFIX_COMPLETE if hit else WINDOW_EARLY,
                ))  # fmt: skip
            elif i < first and b != NULL_BLOCK:
                out.append(_v(
                    Invariant.BLOCK,
                    request_id,
                    f"window group {g} still holds logical block {i}, wholly before the "
                    f"window its queries read (window {group.window}, {num_before} tokens "
                    "before)",
                    "null",
                    f"block {b}",
                    WINDOW_LATE,
                ))  # fmt: skip
    return out


def _v(
    invariant: Invariant,
    request_id: str,
    message: str,
    expected: object,
    seen: object,
    rule: str,
) -> Violation:
    return violation(invariant, f"request {request_id}", message, expected, seen, rule=rule)
