"""The transfer-or-recompute rule of migration (ref/core/migration_cost.py;
docs/MIGRATION.md, "The cost rule")."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refserve.core.cost import StepCost
from refserve.core.migration_cost import MIN_IDLE, KVMode, MigrationCost
from refserve.errors import InvalidArgument

# 1,000 bytes per token over 1 GB/s = 1e6 bytes/ms: 0.001 ms per token on the link,
# 0.5 ms per token to recompute (b of 2 + 0.5P + D).
RULE = MigrationCost(kv_bytes_per_token=1000, link_gb_per_s=1.0, latency_ms=10.0)


def test_transfer_is_latency_plus_bytes_over_bandwidth() -> None:
    assert RULE.transfer_ms(0) == 0.0  # nothing to send: no round trip either
    assert RULE.transfer_ms(1) == pytest.approx(10.001)
    assert RULE.transfer_ms(1000) == pytest.approx(11.0)


def test_recompute_is_prefill_cost_over_idle_compute() -> None:
    assert RULE.recompute_ms(100) == pytest.approx(50.0)
    assert RULE.recompute_ms(100, idle=0.5) == pytest.approx(100.0)
    # A saturated destination is priced at MIN_IDLE, not infinitely.
    assert RULE.recompute_ms(100, idle=0.0) == pytest.approx(50.0 / MIN_IDLE)


def test_auto_picks_the_cheaper_and_records_its_inputs() -> None:
    short = RULE.decide(KVMode.AUTO, kv_tokens=10)
    assert short.mode is KVMode.RECOMPUTE  # 10.01 ms of link against 5 ms of prefill
    long = RULE.decide(KVMode.AUTO, kv_tokens=100)
    assert long.mode is KVMode.TRANSFER  # 10.1 ms against 50 ms
    assert (long.kv_tokens, long.hit_tokens, long.idle) == (100, 0, 1.0)
    assert long.transfer_ms == pytest.approx(10.1) and long.recompute_ms == pytest.approx(50.0)
    assert (long.link_gb_per_s, long.latency_ms) == (1.0, 10.0)
    assert long.moved_tokens == 100 and short.moved_tokens == 0


def test_the_destination_hit_is_subtracted_before_pricing() -> None:
    # 100 tokens of KV, 96 already cached on the destination: 4 to price, recompute wins.
    d = RULE.decide(KVMode.AUTO, kv_tokens=100, hit_tokens=96)
    assert d.mode is KVMode.RECOMPUTE
    assert d.recompute_ms == pytest.approx(2.0)
    forced = RULE.decide(KVMode.TRANSFER, kv_tokens=100, hit_tokens=96)
    assert forced.mode is KVMode.TRANSFER and forced.moved_tokens == 4


def test_a_busy_destination_tips_the_rule_to_transfer() -> None:
    assert RULE.decide(KVMode.AUTO, kv_tokens=15).mode is KVMode.RECOMPUTE
    assert RULE.decide(KVMode.AUTO, kv_tokens=15, idle=0.25).mode is KVMode.TRANSFER


def test_explicit_modes_are_kept() -> None:
    for mode in (KVMode.TRANSFER, KVMode.RECOMPUTE):
        assert RULE.decide(mode, kv_tokens=10).mode is mode
        assert RULE.decide(mode.value, kv_tokens=1000).mode is mode  # type: ignore[arg-type]


def test_breakeven_is_where_transfer_starts_to_win() -> None:
    # 10 + 0.001 L <= 0.5 L  <=>  L >= 10 / 0.499 = 20.04
    assert RULE.breakeven_tokens() == 21
    assert RULE.decide(KVMode.AUTO, kv_tokens=20).mode is KVMode.RECOMPUTE
    assert RULE.decide(KVMode.AUTO, kv_tokens=21).mode is KVMode.TRANSFER
    # A link slower per token than compute never wins.
    slow = MigrationCost(kv_bytes_per_token=10**6, link_gb_per_s=1.0, iteration=StepCost(b=0.5))
    assert slow.breakeven_tokens() is None


@given(
    st.integers(1, 10**6),
    st.floats(0.01, 100.0),
    st.floats(0.0, 50.0),
    st.floats(0.0, 1.0),
    st.integers(0, 4096),
)
def test_auto_agrees_with_the_breakeven(
    per_token: int, gb: float, latency: float, idle: float, n: int
) -> None:
    rule = MigrationCost(kv_bytes_per_token=per_token, link_gb_per_s=gb, latency_ms=latency)
    d = rule.decide(KVMode.AUTO, kv_tokens=n, idle=idle)
    assert (d.mode is KVMode.TRANSFER) == (d.transfer_ms <= d.recompute_ms)
    even = rule.breakeven_tokens(idle=idle, limit=4096)
    if n >= 1:
        assert (d.mode is KVMode.TRANSFER) == (even is not None and n >= even)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token"),
        ({"kv_bytes_per_token": True}, "kv_bytes_per_token"),
        ({"kv_bytes_per_token": 8, "link_gb_per_s": 0.0}, "link_gb_per_s"),
        ({"kv_bytes_per_token": 8, "link_gb_per_s": math.inf}, "link_gb_per_s"),
        ({"kv_bytes_per_token": 8, "latency_ms": -1.0}, "latency_ms"),
        ({"kv_bytes_per_token": 8, "latency_ms": math.nan}, "latency_ms"),
    ],
)
def test_bad_figures_are_refused_by_name(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        MigrationCost(**kwargs)  # type: ignore[arg-type]


def test_bad_decision_inputs_are_refused_by_name() -> None:
    with pytest.raises(InvalidArgument, match="hit_tokens"):
        RULE.decide(KVMode.AUTO, kv_tokens=4, hit_tokens=5)
    with pytest.raises(InvalidArgument, match="hit_tokens"):
        RULE.decide(KVMode.AUTO, kv_tokens=4, hit_tokens=-1)
    with pytest.raises(InvalidArgument, match="idle"):
        RULE.decide(KVMode.AUTO, kv_tokens=4, idle=1.5)
    with pytest.raises(InvalidArgument, match="kv mode must be one of transfer, recompute, auto"):
        RULE.decide("sideways", kv_tokens=4)  # type: ignore[arg-type]
