"""spec/host.py on a grouped host pool: swapped KV of a hybrid model's layer groups.

A grouped pool swaps, in each layer group, the blocks the request's next query reads
(spec/groups.py ``held_places``), and its host pool lists each group's table as the
device pool's engine view does (``request@groupN``, null places before a window
group's first block). ``check_host`` accepts such tables; given the layout it holds each
to exactly those places, and fails on a host table missing a window block or holding
one more, on a group's table left out, and on two lengths.

Hand-built snapshots: blocks of 4, a full group and a window of 6, request ``a`` swapped
with 13 tokens of KV (its query at 13 reads from position 8: full places 0..3, window
places 2 and 3).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from refserve.spec import EngineSnapshot, PoolSnapshot, RequestSnapshot, TableSnapshot
from refserve.spec.groups import FULL_NULL, NULL_BLOCK, WINDOW_EARLY, GroupKind, KVGroup
from refserve.spec.host import HOST_EXTRA, HOST_GROUPS, check_host, check_host_groups
from refserve.spec.snapshot import RequestStatus
from refserve.spec.violation import Invariant

BS = 4
GROUPS = (KVGroup(GroupKind.FULL), KVGroup(GroupKind.WINDOW, 6))
N = NULL_BLOCK
KV = 13
TOKENS = tuple(range(100, 100 + KV))


def table(name: str, blocks: tuple[int, ...], kv: int = KV) -> TableSnapshot:
    return TableSnapshot(name, blocks, kv, TOKENS[:kv])


def host(*tables: TableSnapshot, n: int = 10) -> PoolSnapshot:
    ref = [0] * n
    for t in tables:
        for b in t.block_table:
            if b != N:
                ref[b] += 1
    free = tuple(b for b in range(n) if ref[b] == 0)
    return PoolSnapshot(n, BS, tuple(ref), free, tables, null_entries=True)


def engine(h: PoolSnapshot, *rids: str) -> EngineSnapshot:
    device = PoolSnapshot(4, BS, (0,) * 4, (0, 1, 2, 3), ())
    requests = tuple(
        RequestSnapshot(r, RequestStatus.SWAPPED, KV, 1, KV, 8) for r in rids or ("a",)
    )
    return EngineSnapshot(requests, device, h)


FULL_A = table("a", (0, 1, 2, 3))
WINDOW_A = table("a@group1", (N, N, 4, 5))


def test_check_host_accepts_grouped_host_tables() -> None:
    good = engine(host(FULL_A, WINDOW_A))
    assert check_host(good) == []  # each table belongs to its request
    assert check_host(good, groups=GROUPS) == []
    # A paused turn's KV on the host, too.
    paused = replace(good, requests=(replace(good.requests[0], status=RequestStatus.WAITING_TOOL),))
    assert check_host(paused, groups=GROUPS) == []
    # A window group that holds no block at all (a window of 1 at a block boundary).
    one = (GROUPS[0], KVGroup(GroupKind.WINDOW, 1))
    at12 = engine(host(table("a", (0, 1, 2), 12), table("a@group1", (N, N, N), 12)))
    at12 = replace(at12, requests=(replace(at12.requests[0], num_computed_tokens=12),))
    assert check_host(at12, groups=one) == []


@pytest.mark.parametrize(
    ("tables", "rule", "words"),
    [
        # The block holding position 8, which the next query reads, is not on the host.
        ((FULL_A, table("a@group1", (N, N, N, 5))), WINDOW_EARLY, "lacks places"),
        # The last window block left out: the table is short (POS says so too).
        ((FULL_A, table("a@group1", (N, N, 4))), WINDOW_EARLY, "lacks places"),
        # One more: block 1 of the window group, wholly before the window.
        ((FULL_A, table("a@group1", (N, 6, 4, 5))), HOST_EXTRA, "does not read"),
        # A full group's place missing.
        ((table("a", (0, N, 2, 3)), WINDOW_A), FULL_NULL, "lacks places"),
        # A group's table left out, or at another length.
        ((FULL_A,), HOST_GROUPS, "some groups only"),
        ((FULL_A, table("a@group1", (N, N, 4), 12)), HOST_GROUPS, "another length"),
    ],
)
def test_check_host_fails_on_corrupted_grouped_tables(
    tables: tuple[TableSnapshot, ...], rule: str, words: str
) -> None:
    found = check_host(engine(host(*tables)), groups=GROUPS)
    assert any(v.rule == rule and words in str(v) for v in found), found
    assert check_host_groups(GROUPS, host(*tables)) != []


def test_a_short_window_table_is_a_pos_violation_without_the_layout() -> None:
    found = check_host(engine(host(FULL_A, table("a@group1", (N, N, 4)))))
    assert any(v.invariant is Invariant.POS and "host request a@group1" in str(v) for v in found)


def test_a_group_table_without_its_request_is_named() -> None:
    """A later group's table whose request holds no host KV (its own table gone): the
    request is not swapped (it is unknown here), and its tables are in some groups only."""
    found = check_host(engine(host(table("b@group1", (N, N, 4, 5))), "a"), groups=GROUPS)
    assert any("request b" in str(v) and "not swapped" in str(v) for v in found), found
    assert any(v.rule == HOST_GROUPS and "request b" in str(v) for v in found), found
    # ...and ``a``, swapped, has its KV in neither pool.
    assert any("request a" in str(v) and "neither pool" in str(v) for v in found), found


def test_a_plain_host_pool_reads_no_group_in_a_request_id() -> None:
    """Without null entries (a plain pool) ``x@group1`` is a request of its own."""
    plain = replace(host(table("x@group1", (0, 1, 2, 3))), null_entries=False)
    assert check_host(engine(plain, "x@group1")) == []
