"""spec/groups.py: every rule silent on a sound grouped snapshot and failing on one
corrupted to break it, with the rule it names; window_start on examples and against
its definition (a query at ``p`` reads the keys ``p - W < k <= p``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refserve.spec.groups import (
    FULL_NULL,
    GROUP_TABLES,
    NULL_BLOCK,
    PREFIX_COMPLETE,
    WINDOW_EARLY,
    WINDOW_LATE,
    GroupedSnapshot,
    GroupKind,
    GroupTable,
    KVGroup,
    check_groups,
    check_window_held,
    window_start,
)
from refserve.spec.snapshot import PoolSnapshot, TableSnapshot
from refserve.spec.violation import Invariant, Violation

FULL, WINDOW5 = KVGroup(GroupKind.FULL), KVGroup(GroupKind.WINDOW, 5)
TOKENS = tuple(range(11))
NB = 10


def snapshot(
    full: tuple[int, ...], window: tuple[int, ...], *, stored: int = 11
) -> GroupedSnapshot:
    """Request r1 with ``stored`` tokens over blocks of 4: a full table and a window-5
    table; ref counts and the free queue follow the tables (so BLOCK holds)."""
    held = [b for b in (*full, *window) if b != NULL_BLOCK]
    ref = tuple(held.count(b) for b in range(NB))
    pool = PoolSnapshot(NB, 4, ref, tuple(b for b in range(NB) if not ref[b]), ())
    tables = (
        GroupTable(0, TableSnapshot("r1", full, stored, TOKENS[:stored])),
        GroupTable(1, TableSnapshot("r1", window, stored, TOKENS[:stored])),
    )
    return GroupedSnapshot((FULL, WINDOW5), pool, tables)


# r1 allocated positions [9, 11): its window-5 query at 9 reads from 5, logical block 1 on.
SOUND = snapshot((0, 1, 2), (NULL_BLOCK, 4, 5))


def rules(vs: list[Violation]) -> set[tuple[str, str]]:
    return {(str(v.invariant), v.rule) for v in vs}


def test_sound_snapshot_is_silent() -> None:
    assert check_groups(SOUND) == []
    assert check_window_held(SOUND, "r1", 9) == []
    assert check_window_held(SOUND, "r1", 9, num_cached=8) == []
    assert check_window_held(SOUND, "nobody", 9) == []  # check_groups names a missing table


def test_block_over_all_groups() -> None:
    bad = replace(SOUND, pool=replace(SOUND.pool, ref_cnt=(1, 1, 1, 0, 2, 1, 0, 0, 0, 0)))
    found = check_groups(bad)
    assert ("BLOCK", "") in rules(found)
    assert any("ref_cnt differs" in v.message and "(all groups)" in v.message for v in found)


def test_two_groups_holding_one_block_count_twice() -> None:
    bad = snapshot((0, 1, 2), (NULL_BLOCK, 4, 2))  # block 2 in both groups: ref count 2
    assert check_groups(bad) == []
    under = replace(bad, pool=replace(bad.pool, ref_cnt=(1, 1, 1, 0, 1, 0, 0, 0, 0, 0)))
    assert any(v.message.startswith("ref_cnt differs") for v in check_groups(under))


def test_pos_a_table_short_of_its_kv_length() -> None:
    found = check_groups(snapshot((0, 1), (NULL_BLOCK, 4, 5)))
    assert [(v.invariant, v.rule) for v in found] == [(Invariant.POS, "")]
    assert "group 0" in found[0].message


def test_group_tables_a_request_in_some_groups_only() -> None:
    s = snapshot((0, 1, 2), ())
    lone = replace(s, tables=s.tables[:1])
    assert rules(check_groups(lone)) == {("BLOCK", GROUP_TABLES)}


def test_group_tables_groups_at_different_lengths() -> None:
    s = SOUND
    shorter = replace(s.tables[1], table=replace(s.tables[1].table, num_stored=10))
    found = check_groups(replace(s, tables=(s.tables[0], shorter)))
    assert rules(found) == {("KVLEN", GROUP_TABLES)}


def test_group_tables_a_group_that_does_not_exist() -> None:
    s = SOUND
    stray = replace(s.tables[1], group=2)
    assert ("BLOCK", GROUP_TABLES) in rules(check_groups(replace(s, tables=(s.tables[0], stray))))


def test_full_null_a_full_group_that_dropped_a_block() -> None:
    found = check_groups(snapshot((NULL_BLOCK, 1, 2), (NULL_BLOCK, 4, 5)))
    assert rules(found) == {("BLOCK", FULL_NULL)}


def test_window_early_a_block_the_next_query_reads_is_gone() -> None:
    s = snapshot((0, 1, 2), (NULL_BLOCK, NULL_BLOCK, 5))
    assert check_groups(s) == []  # the books are sound: only the window rule sees it
    found = check_window_held(s, "r1", 9)
    assert rules(found) == {("KVLEN", WINDOW_EARLY)}
    assert "logical block 1" in found[0].message
    # One token later the window starts at 8 (block 2): block 1 is no longer read.
    assert check_window_held(s, "r1", 12) == []


def test_window_early_on_a_block_boundary() -> None:
    # A window of 5 at 8 tokens starts at 4: exactly block 1, so block 0 may go.
    s = snapshot((0, 1), (NULL_BLOCK, 4), stored=8)
    assert check_window_held(s, "r1", 8) == []
    assert rules(check_window_held(s, "r1", 7)) == {("KVLEN", WINDOW_EARLY)}


def test_prefix_complete_a_hit_without_its_window_blocks() -> None:
    s = snapshot((0, 1, 2), (NULL_BLOCK, NULL_BLOCK, 5))
    found = check_window_held(s, "r1", 9, num_cached=8)
    assert rules(found) == {("PREFIX", PREFIX_COMPLETE)}
    assert "prefix hit" in found[0].message


def test_window_late_a_block_before_the_window_still_held() -> None:
    s = snapshot((0, 1, 2), (3, 4, 5))
    assert check_groups(s) == []
    found = check_window_held(s, "r1", 9)
    assert rules(found) == {("BLOCK", WINDOW_LATE)}
    assert check_window_held(s, "r1", 7) == []  # at 7 the window starts at 3: block 0


def test_kv_group_validation() -> None:
    with pytest.raises(ValueError, match="window >= 1"):
        KVGroup(GroupKind.WINDOW, 0)
    with pytest.raises(ValueError, match="no window"):
        KVGroup(GroupKind.FULL, 3)
    assert KVGroup("window", 2).kind is GroupKind.WINDOW  # type: ignore[arg-type]


def test_window_start_examples() -> None:
    assert [window_start(n, 5) for n in (0, 1, 4, 5, 6, 11)] == [0, 0, 0, 1, 2, 7]
    assert window_start(3, 1) == 3  # a window of one reads only the query's own key
    assert window_start(7, 100) == 0


@given(st.integers(0, 500), st.integers(1, 64))
def test_window_start_is_the_first_key_read(num_tokens: int, window: int) -> None:
    """The query at ``p = num_tokens`` reads keys ``p - W < k <= p``: the first is the
    least such k that exists (k >= 0)."""
    read = [k for k in range(num_tokens + 1) if num_tokens - window < k <= num_tokens]
    assert window_start(num_tokens, window) == read[0]
