"""BLOCK and POS for the host-side swap pool: swapped KV lives in exactly one place.

Why it matters: preemption by swap (docs/ARCHITECTURE.md, "Where refserve differs from
vLLM") copies a victim's KV to host memory
and back. A host block handed to two swapped requests, or freed while its request is
still swapped, is silent corruption after swap-in, just as on the device; a request
holding KV in both pools (a swap-out that forgot to free the device blocks, a swap-in
that forgot the host ones) leaks one of them; a SWAPPED request without a host table
resumes with positions whose K/V exist nowhere.

The host pool is checked with the device pool's own BLOCK and POS predicates (its
subjects are prefixed with ``host``), plus the cross-pool rules here.

A hybrid model's grouped pool (spec/groups.py) swaps, in every layer group, only the
blocks the request's next query reads. Its host pool lists each group's table as the
device pool's engine view does (``null_entries``; the table of group ``g > 0`` named
:func:`~refserve.spec.groups.group_table_id`, null places before a window group's first
block), so BLOCK and POS read it unchanged and each table belongs to its request.
Given the layout, :func:`check_host_groups` holds each swapped request's tables to
exactly the places its groups' next query reads
(:func:`~refserve.spec.groups.held_places`): one missing is K/V the resumed request
reads and nobody has (rule ``window-early``, or ``full-null`` in a full group); one
more is a copy and host memory for nothing (rule ``host-extra``); a request in some
groups only, or at two lengths, is rule ``host-groups``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from refserve.spec.block import check_block
from refserve.spec.groups import (
    FULL_NULL,
    NULL_BLOCK,
    WINDOW_EARLY,
    GroupKind,
    KVGroup,
    group_table_owner,
    held_places,
)
from refserve.spec.pos import check_pos_pool
from refserve.spec.snapshot import (
    EngineSnapshot,
    PoolSnapshot,
    RequestSnapshot,
    RequestStatus,
    TableSnapshot,
)
from refserve.spec.violation import Invariant, Violation, violation

B = Invariant.BLOCK
P = Invariant.POS
HOST_GROUPS = "host-groups"
HOST_EXTRA = "host-extra"
# States in which a request may keep its KV on the host.
_HOST_STATES = (RequestStatus.SWAPPED, RequestStatus.WAITING_TOOL)


def check_host(
    engine: EngineSnapshot, lookahead: int = 0, groups: Sequence[KVGroup] = ()
) -> list[Violation]:
    """The host pool's own BLOCK/POS rules and where each request's KV lives
    (``lookahead``: blocks reserved ahead travel with a swapped table); with a layout
    of several ``groups``, :func:`check_host_groups` too."""
    host = engine.host
    out: list[Violation] = []
    if host is None:
        for r in engine.requests:
            if _needs_host(r, engine, set()):
                out.append(_nowhere(r.request_id, r.status, r.num_computed_tokens))
        return out
    out.extend(
        replace(v, subject=f"host {v.subject}")
        for v in (*check_block(host), *check_pos_pool(host, lookahead))
    )
    for b, rc in enumerate(host.ref_cnt):
        if rc > 1:
            out.append(violation(B, f"host block {b}", "swapped KV is shared", "<= 1", rc))
    if host.cache_entries:
        out.append(
            violation(
                B,
                "host pool",
                "host blocks are in a prefix-cache index",
                0,
                len(host.cache_entries),
            )
        )
    requests = {r.request_id: r for r in engine.requests}
    host_ids: set[str] = set()
    for t in host.tables:
        # A grouped pool's table of a later group is its request's too: the request's
        # state is checked once, its KV length at its own table (a later group's, in
        # that group's own positions, is check_host_groups').
        rid, group = group_table_owner(t.request_id) if host.null_entries else (t.request_id, 0)
        seen = rid in host_ids
        host_ids.add(rid)
        owner = requests.get(rid)
        if not seen:
            out.extend(_owner_violations(engine, rid, owner))
        if group or owner is None or owner.status not in _HOST_STATES:
            continue
        if t.num_stored != owner.num_computed_tokens:
            out.append(
                violation(
                    P,
                    f"request {rid}",
                    "host KV length differs from num_computed_tokens",
                    owner.num_computed_tokens,
                    t.num_stored,
                )
            )
    for r in engine.requests:
        if _needs_host(r, engine, host_ids):
            out.append(_nowhere(r.request_id, r.status, r.num_computed_tokens))
    if len(groups) > 1:
        out.extend(check_host_groups(groups, host))
    return out


def _owner_violations(
    engine: EngineSnapshot, rid: str, owner: RequestSnapshot | None
) -> list[Violation]:
    """A request holding host blocks is swapped or waiting for a tool, its KV on the
    host only."""
    who = f"request {rid}"
    if owner is None or owner.status not in _HOST_STATES:
        state = "unknown" if owner is None else owner.status.value
        return [
            violation(
                B,
                who,
                "holds host blocks but is not swapped or waiting for a tool",
                "swapped | waiting_tool",
                state,
            )
        ]
    if engine.pool.table(rid) is not None:
        return [violation(B, who, "holds KV in both the device and the host pool", 1, 2)]
    return []


def check_host_groups(groups: Sequence[KVGroup], host: PoolSnapshot) -> list[Violation]:
    """A grouped host pool's tables (the module doc): every swapped request has one in
    each of the layout's ``groups``, at one KV length, each holding exactly the places
    its group's next query reads."""
    out: list[Violation] = []
    by_request: dict[str, dict[int, TableSnapshot]] = {}
    for t in host.tables:
        rid, group = group_table_owner(t.request_id)
        by_request.setdefault(rid, {})[group] = t
    for rid, tables in sorted(by_request.items()):
        who = f"request {rid}"
        if sorted(tables) != list(range(len(groups))):
            out.append(violation(B, who, "host tables in some groups only",
                                 f"groups 0..{len(groups) - 1}", sorted(tables),
                                 rule=HOST_GROUPS))  # fmt: skip
        own = tables.get(0)
        if own is None:
            continue
        for g, t in sorted(tables.items()):
            if 0 <= g < len(groups):
                out.extend(_group_places(who, g, groups[g], t, own.num_stored, host.block_size))
    return out


def _group_places(
    who: str, g: int, group: KVGroup, t: TableSnapshot, num_stored: int, block_size: int
) -> list[Violation]:
    """Group ``g``'s host table of a request with ``num_stored`` tokens of KV holds
    exactly the places its next query reads."""
    out: list[Violation] = []
    # A compressed group's table counts in its own positions (one per ``ratio`` tokens).
    stored = -(-num_stored // group.ratio)
    if t.num_stored != stored:
        out.append(violation(Invariant.KVLEN, who, f"group {g}'s host table stores another "
                             "length than the request's", stored, t.num_stored,
                             rule=HOST_GROUPS))  # fmt: skip
    places = held_places(group, num_stored, block_size)
    blocks = t.block_table
    missing = [i for i in places if i >= len(blocks) or blocks[i] == NULL_BLOCK]
    extra = [i for i, b in enumerate(blocks) if b != NULL_BLOCK and i not in places]
    if missing:
        window = group.kind is GroupKind.WINDOW
        out.append(violation(P, who, f"group {g}'s host table lacks places its next query "
                             f"reads (from {places.start}, {num_stored} tokens)",
                             "a block", f"none at {missing}",
                             rule=WINDOW_EARLY if window else FULL_NULL))  # fmt: skip
    if extra:
        out.append(violation(B, who, f"group {g}'s host table holds places its next query "
                             f"does not read (it reads {places.start}..{places.stop - 1})",
                             "none", f"blocks at {extra}", rule=HOST_EXTRA))  # fmt: skip
    return out


def _needs_host(r: RequestSnapshot, engine: EngineSnapshot, host_ids: set[str]) -> bool:
    """A swapped request, or a paused one with KV, whose KV is in neither pool."""
    if r.request_id in host_ids:
        return False
    if r.status is RequestStatus.SWAPPED:
        return True
    return (
        r.status is RequestStatus.WAITING_TOOL
        and r.num_computed_tokens > 0
        and engine.pool.table(r.request_id) is None
    )


def _nowhere(request_id: str, status: RequestStatus, num_computed: int) -> Violation:
    return violation(
        P,
        f"request {request_id}",
        f"{status.value} request's KV is in neither pool",
        f"{num_computed} tokens",
        "no table",
    )
