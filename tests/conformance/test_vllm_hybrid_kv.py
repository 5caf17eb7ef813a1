"""vLLM 0.33.0's hybrid KV cache manager through its grouped KV adapter
(conformance/adapters/vllm_hybrid_kv.py), checked with spec/groups.py's rules.

The import check runs everywhere; the rest only where vLLM is importable, i.e. in
``.venv-vllm`` (``make conformance-vllm`` builds it):
``.venv-vllm/bin/python -m pytest tests/conformance/test_vllm_hybrid_kv.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import random
from typing import Any

import pytest

from refserve.conformance.kv.groups import GroupedKVConfig
from refserve.conformance.kv.protocol import NoSpace
from refserve.spec.groups import (
    NULL_BLOCK,
    GroupedSnapshot,
    GroupKind,
    KVGroup,
    check_groups,
    check_window_held,
    window_start,
)

ADAPTER = "refserve.conformance.adapters.vllm_hybrid_kv"
HAS_VLLM = importlib.util.find_spec("vllm") is not None

FULL = KVGroup(GroupKind.FULL)


def win(w: int) -> KVGroup:
    return KVGroup(GroupKind.WINDOW, w)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_import_without_vllm_names_the_make_target() -> None:
    with pytest.raises(ModuleNotFoundError, match="make conformance-vllm"):
        importlib.import_module(ADAPTER)


def _adapter(config: GroupedKVConfig) -> Any:
    pytest.importorskip(
        "vllm", reason="vLLM is not installed; `make conformance-vllm` builds .venv-vllm"
    )
    a = importlib.import_module(ADAPTER).make()
    a.configure(config)
    return a


def _checked(a: Any, rid: str, num_before: int, num_cached: int = 0) -> GroupedSnapshot:
    s: GroupedSnapshot = a.snapshot()
    assert check_groups(s) == []
    assert check_window_held(s, rid, num_before, num_cached) == []
    return s


def test_long_prompt_through_one_full_and_one_window_group() -> None:
    bs, w = 4, 6
    a = _adapter(GroupedKVConfig(num_blocks=32, block_size=bs, groups=(FULL, win(w))))
    prompt = list(range(100, 140))  # 40 tokens: 10 blocks
    stored = 0
    for n in (8, 8, 8, 8, 7):  # chunked prefill, the last token left for decode
        al = a.allocate("r", prompt[: stored + n], n)
        s = _checked(a, "r", stored)
        full, window = al.block_tables
        blocks = -(-(stored + n) // bs)
        assert len(full) == len(window) == blocks
        assert NULL_BLOCK not in full
        # vLLM frees at each allocation exactly what the query at `stored` cannot
        # read: the blocks wholly before window_start(stored, w).
        first = window_start(stored, w) // bs
        assert window[:first] == (NULL_BLOCK,) * first
        assert NULL_BLOCK not in window[first:]
        # Freed window blocks are back in the pool (cached, so at the free queue's tail).
        held = {b for t in al.block_tables for b in t if b != NULL_BLOCK}
        assert set(s.pool.free_queue) == set(range(32)) - held
        assert s.pool.stated_free == len(s.pool.free_queue)
        stored += n
    tokens = prompt[:stored]
    for t in range(5):  # decode
        tokens.append(900 + t)
        al = a.allocate("r", tokens, 1)
        _checked(a, "r", stored)
        stored += 1
    window = al.block_tables[1]
    first = window_start(stored - 1, w) // bs
    assert window[:first] == (NULL_BLOCK,) * first and NULL_BLOCK not in window[first:]
    # A window group holds at most the blocks covering w - 1 tokens plus the new one.
    assert len([b for b in window if b != NULL_BLOCK]) <= -(-w // bs) + 1
    a.free("r")
    s = a.snapshot()
    assert s.tables == () and set(s.pool.ref_cnt) == {0} and len(s.pool.free_queue) == 32


def test_prefix_hit_takes_the_window_blocks_it_reads_and_nulls_the_rest() -> None:
    bs, w = 4, 6
    a = _adapter(GroupedKVConfig(num_blocks=32, block_size=bs, groups=(FULL, win(w))))
    prompt = list(range(24))
    a.allocate("r", prompt, 24)
    before = a.snapshot()
    al = a.allocate("s", [*prompt, 77], 1)
    assert al.num_cached_tokens == 24
    s = _checked(a, "s", 24, 24)
    full, window = al.block_tables
    r_full, r_window = before.table("r", 0), before.table("r", 1)
    assert r_full is not None and r_window is not None
    # Full group: every cached block shared; window group: only the blocks covering
    # [window_start(24, 6), 24) = [19, 24), i.e. logical blocks 4 and 5.
    assert full[:6] == r_full.block_table
    assert window[:4] == (NULL_BLOCK,) * 4 and window[4:6] == r_window.block_table[4:6]
    for b in window[4:6]:
        assert s.pool.ref_cnt[b] == 2


def test_window_hit_after_the_holder_freed_its_early_window_blocks() -> None:
    """The first request's early window blocks went back to the pool (still cached);
    a hit on a shorter prefix revives them from the free queue."""
    bs, w = 4, 5
    a = _adapter(GroupedKVConfig(num_blocks=40, block_size=bs, groups=(FULL, win(w))))
    prompt = list(range(32))
    a.allocate("r", prompt[:16], 16)
    a.allocate("r", prompt, 16)  # frees window blocks wholly before window_start(16, 5)
    r_window = a.snapshot().table("r", 1)
    assert r_window is not None and r_window.block_table[0] == NULL_BLOCK
    al = a.allocate("s", [*prompt[:12], 5000], 1)
    assert al.num_cached_tokens == 12
    _checked(a, "s", 12, 12)
    window = al.block_tables[1]
    assert window[:2] == (NULL_BLOCK, NULL_BLOCK) and NULL_BLOCK not in window[2:]


def test_refused_allocation_has_already_freed_window_blocks() -> None:
    """vLLM's remove_skipped_blocks runs before allocate_slots checks room: a refused
    allocation of a running request whose window moved has freed blocks (the adapter
    translates; a grouped suite that holds NoSpace to "nothing changed" sees it)."""
    bs, w = 4, 4
    a = _adapter(GroupedKVConfig(num_blocks=6, block_size=bs, groups=(FULL, win(w))))
    tokens = list(range(20))
    a.allocate("r", tokens[:8], 8)
    a.allocate("r", tokens[:12], 4)
    before = a.snapshot()
    b_window = before.table("r", 1)
    assert b_window is not None and b_window.block_table[1] != NULL_BLOCK
    with pytest.raises(NoSpace):
        a.allocate("r", tokens[:20], 8)  # needs 2 + 2 blocks, 1 + 1 freed available
    after = a.snapshot()
    a_window = after.table("r", 1)
    assert a_window is not None
    assert a_window.block_table[1] == NULL_BLOCK
    assert len(after.pool.free_queue) == len(before.pool.free_queue) + 1
    assert check_groups(after) == []
    # A smaller step that fits (the request knows its 20 tokens now).
    al = a.allocate("r", tokens, 1)
    assert al.block_tables[1][:2] == (NULL_BLOCK, NULL_BLOCK)
    _checked(a, "r", 12)


def test_refused_first_allocation_changes_nothing_and_a_miss_is_retried() -> None:
    bs = 4
    a = _adapter(GroupedKVConfig(num_blocks=4, block_size=bs, groups=(FULL, win(3))))
    before = a.snapshot()
    with pytest.raises(NoSpace):
        a.allocate("r", list(range(12)), 12)  # 3 + 3 blocks
    assert a.snapshot() == before
    al = a.allocate("r", list(range(8)), 8)
    assert [len(t) for t in al.block_tables] == [2, 2]


@pytest.mark.parametrize(
    "groups,caching,takes_hits",
    [
        ((FULL, win(6)), True, True),
        ((win(3), FULL, win(9)), True, True),
        ((FULL, FULL, win(4)), True, True),
        ((win(7),), True, True),
        ((FULL, win(5)), False, False),
        ((win(1), FULL), True, False),  # see test_window_of_one_never_hits
    ],
    ids=["full+w6", "w3+full+w9", "full+full+w4", "w7-only", "no-caching", "w1+full"],
)
def test_random_workload_keeps_the_group_rules(
    groups: tuple[KVGroup, ...], caching: bool, takes_hits: bool
) -> None:
    bs, nb = 4, 24
    a = _adapter(GroupedKVConfig(nb, bs, groups, caching))
    rng = random.Random(7)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    known: dict[str, list[int]] = {}
    stored: dict[str, int] = {}
    refusals = hits = 0
    for step in range(300):
        live = sorted(known)
        op = rng.random()
        if live and op < 0.15:
            rid = rng.choice(live)
            a.free(rid)
            known.pop(rid)
            stored.pop(rid)
        elif not live or op < 0.4:
            rid = f"q{step}"
            toks = [*rng.choice(prefixes), *(rng.randrange(50) for _ in range(rng.randrange(1, 9)))]
            n = rng.randrange(1, len(toks) + 1)
            try:
                al = a.allocate(rid, toks, n)
            except NoSpace:
                refusals += 1
                continue
            hits += al.num_cached_tokens > 0
            known[rid], stored[rid] = toks, al.num_cached_tokens + n
            _checked(a, rid, al.num_cached_tokens, al.num_cached_tokens)
        else:
            rid = rng.choice(live)
            toks = known[rid]
            if stored[rid] == len(toks):
                toks.append(rng.randrange(50))
            n = rng.randrange(1, len(toks) - stored[rid] + 1)
            try:
                a.allocate(rid, toks, n)
            except NoSpace:
                refusals += 1
                assert check_groups(a.snapshot()) == []
                continue
            _checked(a, rid, stored[rid])
            stored[rid] += n
        s = a.snapshot()
        assert {t.table.request_id for t in s.tables} == set(known)
    assert refusals > 0
    assert (hits > 0) == takes_hits


def test_window_of_one_never_hits() -> None:
    """With sliding_window=1 a hit needs cdiv(0, bs) = 0 window blocks, so
    SlidingWindowManager.reachable_block_mask caches none of them, while
    find_longest_cache_hit declares a window match only on a cached block: vLLM never
    takes a hit for such a layout (allowed: no hit is always a correct choice)."""
    a = _adapter(GroupedKVConfig(24, 4, (FULL, win(1))))
    prompt = list(range(16))
    a.allocate("r", prompt, 16)
    al = a.allocate("s", [*prompt, 99], 1)
    assert al.num_cached_tokens == 0
    _checked(a, "s", 0)
    b = _adapter(GroupedKVConfig(24, 4, (FULL, win(2))))
    b.allocate("r", prompt, 16)
    assert b.allocate("s", [*prompt, 99], 1).num_cached_tokens == 16


# ---------------------------------------------------------------------- the whole suite
def _suite_findings() -> list[tuple[str, str]]:
    """The grouped suite on vLLM's adapter: (invariant, rule) of every failed check."""
    from refserve.conformance.kv.grouped_suite import run_grouped_kv_suite

    factory = importlib.import_module(ADAPTER).make
    pairs = run_grouped_kv_suite(factory, f"{ADAPTER}:make", max_examples=60)
    return sorted(
        {(r.invariant, f.rule) for results, _ in pairs for r in results for f in r.failures}
    )


def test_the_grouped_suite_passes_vllm() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed; `make conformance-vllm`")
    assert _suite_findings() == []


@pytest.mark.parametrize(
    ("shift", "rule"),
    [(1, "window-early"), (-1, "window-late")],
    ids=["freed-one-token-early", "freed-one-token-late"],
)
def test_the_suite_catches_a_window_off_by_one_planted_in_vllm(
    monkeypatch: pytest.MonkeyPatch, shift: int, rule: str
) -> None:
    """vLLM's own sliding-window manager, its skipped-token count moved by one: one token
    early is K/V a query still reads (window-early); one late is memory it never reads
    again, judged because the adapter declares eager freeing (window-late)."""
    pytest.importorskip("vllm", reason="vLLM is not installed; `make conformance-vllm`")
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    real = SlidingWindowManager.get_num_skipped_tokens

    def planted(self: Any, num_computed_tokens: int) -> int:
        n = real(self, num_computed_tokens)
        return max(0, n + shift) if n or shift > 0 else n

    monkeypatch.setattr(SlidingWindowManager, "get_num_skipped_tokens", planted)
    assert rule in {r for _, r in _suite_findings()}
